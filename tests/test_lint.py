"""The linter reads every tracked Python file, and the documents name paths that exist.

ruff skips folders named ``build``, ``dist``, ``venv``, ``node_modules``, ... by default, and anything
``.gitignore`` matches; a source folder so named would silently go unlinted (``make lint``). This test
asks ruff which files it checks (``ruff check --show-files``; ``ruff format`` discovers files the same way)
and compares them with ``git ls-files '*.py'``.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Outside a git checkout (an unpacked sdist): the project's own source folders.
SOURCE_FOLDERS = ("dataflow", "nodes", "schedulers", "tests", "bench", "examples", "scripts")


def _tracked_py_files() -> set[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return {p.resolve() for folder in SOURCE_FOLDERS for p in (ROOT / folder).rglob("*.py")}
    proc = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return {(ROOT / name).resolve() for name in proc.stdout.split("\0") if name}


@pytest.mark.slow
def test_ruff_checks_every_tracked_python_file() -> None:
    tracked = _tracked_py_files()
    assert len(tracked) > 50, f"git lists only {len(tracked)} Python files"
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--show-files", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"ruff check --show-files exited {proc.returncode}:\n{proc.stderr}"
    shown = {Path(line).resolve() for line in proc.stdout.splitlines() if line.strip()}
    skipped = sorted(str(p.relative_to(ROOT)) for p in tracked - shown)
    assert not skipped, f"ruff does not check these tracked files (excluded folder?): {skipped}"


DOCS = ("README.md", "DESIGN.md", "nodes/README.md", "bench/README.md")
_PATH = re.compile(r"`((?:dataflow|nodes|schedulers|examples|bench|tests|scripts)/[A-Za-z0-9_./*-]*)`")


def test_docs_name_existing_paths_inside_the_repository() -> None:
    """Paths the documents name in backticks exist (globs match), and no document points outside the repo."""
    stale = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        assert "../" not in text, f"{doc} points outside the repository ('../')"
        for path in _PATH.findall(text):
            if not any(ROOT.glob(path.rstrip("/"))):
                stale.append(f"{doc}: {path}")
    assert not stale, f"documents name paths that do not exist: {stale}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_mypy_is_clean_over_the_installed_names() -> None:
    """``scripts/typecheck.py`` (mypy over ``rlflow.*``, ``make lint``'s type check) reports nothing. It runs
    here, beside the other tests on the parallel workers, rather than before them in ``make test``: mypy is
    one process, so run first it left the second core idle for its minute or more."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "typecheck.py")], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
