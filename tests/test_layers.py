"""The import contracts of ``pyproject.toml`` (``[tool.importlinter]``) hold: ``lint-imports`` succeeds.

The contracts: the floors import downwards only (``rlflow.schedulers`` > ``rlflow.nodes`` >
``rlflow.dataflow``; the ground floor reaches node functions, rewards and data generators through entry
points), and ``rlflow.schedulers.planner`` does not import ``rlflow.schedulers.runtime``. The test also
checks that import-linter analysed exactly this checkout's source files, so a contract cannot pass by
reading another installation (or none).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ("dataflow", "nodes", "schedulers")


def _lint_imports() -> str:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports not found: install the dev extra (pip install -e '.[dev]')")
    proc = subprocess.run(
        [exe, "--no-cache", "--no-logo", str(ROOT / "pyproject.toml")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"lint-imports failed (exit {proc.returncode}):\n{out}"
    return out


@pytest.mark.slow
def test_import_contracts_hold() -> None:
    out = _lint_imports()
    assert "BROKEN" not in out, out
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", out)
    assert kept is not None and int(kept.group(1)) >= 2, out
    analysed = re.search(r"Analyzed (\d+) files", out)
    n_sources = sum(1 for floor in FLOORS for _ in (ROOT / floor).rglob("*.py"))
    assert analysed is not None and int(analysed.group(1)) == n_sources, (
        f"lint-imports analysed {analysed and analysed.group(1)} files, the checkout has {n_sources} "
        f"under {', '.join(FLOORS)} (is rlflow installed from this checkout?):\n{out}"
    )
