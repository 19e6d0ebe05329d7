#!/usr/bin/env bash
# Installs rlflow and its test tools. torch is installed first, pinned to the CPU build
# (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[dev]"
