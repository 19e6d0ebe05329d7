"""Type-check every source file under the names it is installed as (``rlflow.dataflow``, ...).

The design's top-level folders install as ``rlflow.*`` through setuptools' ``package-dir`` mapping, which
mypy cannot follow. This script builds a link tree ``build/typecheck/rlflow/{dataflow,nodes,schedulers}``
pointing at the folders, runs ``mypy -p rlflow`` on it (settings from ``pyproject.toml``) and prints
errors with the repository's own paths. Exit status: mypy's.

Run: ``python scripts/typecheck.py`` (``make lint`` does).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("dataflow", "nodes", "schedulers")


def main() -> int:
    tree = ROOT / "build" / "typecheck"
    pkg = tree / "rlflow"
    pkg.mkdir(parents=True, exist_ok=True)
    for layer in LAYERS:
        link = pkg / layer
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(ROOT / layer, pkg), target_is_directory=True)
    env = {**os.environ, "MYPYPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "rlflow"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    prefix = f"{tree.relative_to(ROOT)}/rlflow/"
    sys.stdout.write(proc.stdout.replace(prefix, ""))
    sys.stderr.write(proc.stderr.replace(prefix, ""))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
