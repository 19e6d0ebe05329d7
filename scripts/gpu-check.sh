#!/usr/bin/env bash
# On a CUDA machine: every `gpu`-marked test, a short PPO run with vLLM generation on one GPU, then
# `rlflow profile` of this GPU at the Llama-2 7B shape against its preset (h100-8x / h200-8x / a100-8x by
# device name), kept as $OUT/gpu-profile.parquet with the fitted efficiencies printed next to the preset's
# (the numbers the GPU presets cite once measured). One summary line per check, exit status non-zero if
# any failed. Budget: under 10 minutes.
# Usage: scripts/gpu-check.sh   (after scripts/setup.sh, which installs the vllm-cuda extra on CUDA hosts)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-$(mktemp -d)}
status=0

check() {  # check NAME COMMAND...: runs COMMAND (10-minute cap), prints "NAME: ok|FAILED (s)", keeps the log
    local name=$1
    shift
    local t0=$SECONDS
    if timeout 600 "$@" >"$OUT/$name.log" 2>&1; then
        echo "$name: ok ($((SECONDS - t0)) s)"
    else
        echo "$name: FAILED ($((SECONDS - t0)) s; log $OUT/$name.log)"
        tail -5 "$OUT/$name.log" | sed 's/^/    /'
        status=1
    fi
}

"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    echo "gpu-check: no CUDA device visible to torch"
    exit 2
}
"$PY" -c "import torch; print('device:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
check gpu-tests "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/
check ppo-vllm-gpu "$PY" -m rlflow.schedulers.cli run examples/vllm/ppo.yaml run.iterations=3 \
    run.eval_interval=0 run.checkpoint_interval=0 "run.output_dir=$OUT/ppo-vllm" --overwrite --no-progress
if [ -d "$OUT/ppo-vllm/metrics" ]; then
    "$PY" - "$OUT/ppo-vllm" <<'PYSUM'
import sys
from rlflow.schedulers.records.rundir import read_metrics
rows = read_metrics(sys.argv[1]).to_pylist()
last = rows[-1]
print(
    f"ppo-vllm-gpu: {len(rows)} iterations, logprob_gap_mean {last.get('rollout/logprob_gap_mean', float('nan')):.2e}, "
    f"weight sync {last.get('timing_s/weight_sync/actor_gen', float('nan')):.3f} s, "
    f"{last.get('perf/throughput', float('nan')):.0f} tokens/s"
)
PYSUM
fi
preset=$("$PY" -c "
import torch
name = torch.cuda.get_device_name(0)
print(next((p for k, p in (('H200', 'h200-8x'), ('H100', 'h100-8x'), ('A100', 'a100-8x')) if k in name), ''))")
if [ -n "$preset" ]; then
    check gpu-profile "$PY" -m rlflow.schedulers.cli profile --cluster "$preset" --model 7b \
        --out "$OUT/gpu-profile.parquet"
    if [ -f "$OUT/gpu-profile.parquet" ]; then
        "$PY" - "$preset" "$OUT/gpu-profile.parquet" <<'PYFIT'
import sys
from rlflow.schedulers.planner.calibration import apply_profile
from rlflow.schedulers.planner.cluster import load_cluster
preset = load_cluster(sys.argv[1])
fitted = apply_profile(preset, sys.argv[2])
print(f"gpu-profile: {sys.argv[2]} ({sys.argv[1]}): efficiency {fitted.efficiency} (preset {preset.efficiency}); "
      f"overheads {fitted.overheads}")
PYFIT
    fi
else
    echo "gpu-profile: skipped (no preset for this device)"
fi
exit $status
