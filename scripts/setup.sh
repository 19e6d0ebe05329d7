#!/usr/bin/env bash
# Installs rlflow and its test tools. torch is installed first, pinned to the CPU build
# (a bare `torch` requirement would pull a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[dev]"

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
