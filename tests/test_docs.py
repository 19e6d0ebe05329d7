"""The docs site builds in strict mode and says what the code does (issue 31).

``mkdocs build --strict`` (what ``make docs`` runs) fails on a broken link, a missing anchor or a page left
out of the nav; its hook (``scripts/docs_reference.py``) generates the reference pages from the code, so
the build also checks that every registered node function, graph-file key, command and metric name the
code has reaches the site. The other tests here hold the docs to what the issue asked: a short README with
no lab log, examples that run (the plug-in module is the one ``tests/test_plugins.py`` installs; the
``validate --help`` examples validate), and module paths that import.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.dataflow.registry import NODE_FUNCTIONS
from rlflow.dataflow.run_spec import EVAL_KEYS
from rlflow.schedulers.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
USER_DOCS = ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md")))]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_site_builds_strictly_with_the_generated_reference(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    functions = (site / "reference" / "node-functions" / "index.html").read_text()
    for name in NODE_FUNCTIONS.names():
        assert f'id="{name}"' in functions, name
    keys = (site / "reference" / "graph-file" / "index.html").read_text()
    for key in ("zero_stage", "staleness", "interrupt_every", "max_prompt_tokens", "launcher", *EVAL_KEYS):
        assert key in keys, key
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for command in COMMANDS:
        assert f"rlflow {command}" in cli, command
    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    for name in (
        "actor/pg_loss",
        "critic/vf_loss",
        "async/staleness_mean",
        "timing_s/&lt;node&gt;",
        "val/accuracy",
    ):
        assert name in metrics, name
    home = (site / "index.html").read_text()
    assert "A five-minute tour" in home and "rlflow_reward" in metrics


def test_readme_is_short_and_the_user_docs_hold_no_lab_log() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for doc in USER_DOCS:
        text = (ROOT / doc).read_text()
        for pattern in (r"\b20\d\d-\d\d-\d\d\b", r"load average", r"\bsession \d", r"\bcommit [0-9a-f]{7}"):
            assert not re.search(pattern, text), (
                f"{doc}: a lab-log entry ({pattern}) belongs in bench/README.md"
            )


def test_plugin_example_is_the_tested_plugin() -> None:
    from tests.test_plugins import MODULE

    page = (ROOT / "docs" / "plugins.md").read_text()
    example = re.search(r"```python\n(.*?)```", page, flags=re.S)
    assert example, "docs/plugins.md: no python block"
    tested = MODULE.split('"""', 2)[2].lstrip("\n")  # the module less its docstring
    assert example.group(1) == tested


def test_validate_help_examples_validate(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each ``rlflow validate`` example of ``validate --help`` passes (run in this process: the CLI's
    ``main``, from the repository root as the help assumes)."""
    from rlflow.schedulers.cli import main

    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as done:
        main(["validate", "--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    examples = [line.strip() for line in help_text.splitlines() if line.startswith("    rlflow validate ")]
    assert len(examples) >= 2
    for example in examples:
        argv = example.split()[2:]
        files = [str(p.relative_to(ROOT)) for a in argv if "*" in a for p in sorted(ROOT.glob(a))]
        argv = [a for a in argv if "*" not in a] + files
        assert main(["validate", *argv]) == 0, f"{example}\n{capsys.readouterr().err}"


def test_module_paths_in_the_docs_import() -> None:
    """Every ``python -m MODULE`` and every ``rlflow.<floor>.*`` name in code font exists (a module, or an
    attribute of one)."""
    for doc in USER_DOCS:
        text = (ROOT / doc).read_text()
        names = set(re.findall(r"-m (rlflow[\w.]+)", text))
        # rlflow.<floor>.<...>: two-part names are the floors or entry-point groups (rlflow.tools)
        names |= set(re.findall(r"`(rlflow\.\w+(?:\.\w+)+)", text))
        for name in names:
            assert _resolves(name), f"{doc}: {name}"


def _resolves(name: str) -> bool:
    """``name`` is a module, or an attribute (chain) of the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 1, -1):
        if _module_exists(".".join(parts[:i])):
            obj: object = importlib.import_module(".".join(parts[:i]))
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent is a module, not a package
        return False
