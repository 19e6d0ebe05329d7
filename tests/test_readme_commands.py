"""The README stands alone (issue 14, item 6): its "Using it" commands work in order from a fresh copy of
the examples, their outputs land where git ignores them, and every document it points to is in the
project.

The commands are read from the README's ```bash block under "## Using it" and run as written, with only
these changes to keep the test short (about a minute on 2 cores):

- ``rlflow run``: ``run.iterations`` is 1 (one more than the run before for ``--resume``), and
  ``run.eval_interval=0`` (evaluation decodes 200 held-out problems);
- ``rlflow plan``: ``--steps 30 --restarts 1`` (a shorter search, the same code);
- ``rlflow profile``: ``--quick`` (its documented rough mode; the full one takes minutes).

Reproduce the old failure: the README's last command stopped because ``--metrics-port 0``'s run had made
``runs/ppo`` already; ``rlflow dashboard runs/arith-ppo`` needed ``make run`` first; ``show`` and
``profile`` wrote into the repository root.
"""

from __future__ import annotations

import glob
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "DESIGN.md", "bench/README.md", "nodes/README.md")


def readme_commands() -> list[list[str]]:
    """The argv of each command in the README's "Using it" block (comments dropped)."""
    section = (ROOT / "README.md").read_text().split("\n## Using it\n", 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, flags=re.S)
    assert match, "README: no ```bash block under '## Using it'"
    return [argv for line in match.group(1).splitlines() if (argv := shlex.split(line, comments=True))]


def shortened(argv: list[str], iterations: dict[str, int]) -> list[str]:
    """``argv`` with the test's tiny settings (the module docstring lists them)."""
    command = argv[1]
    if command == "run":
        graph = argv[2]
        n = iterations.get(graph, 0) + 1 if "--resume" in argv else 1
        iterations[graph] = n
        kept = [a for a in argv if not a.startswith(("run.iterations=", "run.eval_interval="))]
        return [*kept, f"run.iterations={n}", "run.eval_interval=0"]
    if command == "plan":
        return [*argv, "--steps", "30", "--restarts", "1"]
    if command == "profile":
        return [*argv, "--quick"]
    return argv


def test_readme_commands_run_in_order_from_a_fresh_copy(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    before = {p for p in tmp_path.rglob("*")}
    commands = readme_commands()
    assert [a[1] for a in commands][:2] == ["validate", "show"] and all(a[0] == "rlflow" for a in commands)
    iterations: dict[str, int] = {}
    outputs: dict[str, str] = {}
    for argv in commands:
        args = [
            p for a in shortened(argv, iterations) for p in (sorted(glob.glob(a, root_dir=tmp_path)) or [a])
        ]
        done = subprocess.run(
            [sys.executable, "-m", "rlflow.schedulers.cli", *args[1:]],
            cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"README command failed: {shlex.join(args)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
        outputs[shlex.join(argv)] = done.stdout
    assert "ok: examples/reinforce_pp.yaml" in outputs["rlflow validate 'examples/*.yaml'"]
    assert (tmp_path / "runs" / "grpo" / "dashboard.html").is_file()
    # Everything the commands wrote lies where git ignores it (out/, runs/), never loose in the tree.
    written = sorted(str(p.relative_to(tmp_path)) for p in set(tmp_path.rglob("*")) - before if p.is_file())
    assert any(w.startswith("out/") for w in written) and any(w.startswith("runs/") for w in written)
    if (ROOT / ".git").exists():
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(written),
            capture_output=True, text=True, check=False,
        ).stdout.split()  # fmt: skip
    else:  # no checkout to ask: .gitignore must list the folders the commands wrote into
        listed = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
        ignored = [w for w in written if w.split("/", 1)[0] in listed]
    assert sorted(set(written) - set(ignored)) == [], "README commands wrote files git does not ignore"


def test_docs_point_only_inside_the_project() -> None:
    """Every relative link of the docs resolves in the repository; nothing points outside it (the README
    once linked ``../shared/DESIGN.md``); every example graph file the README names exists."""
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        assert "../shared" not in text, doc
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+:", target):
                resolved = (path.parent / target).resolve()
                assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{doc}: link {target}"
    readme = (ROOT / "README.md").read_text()
    named = set(
        re.findall(r"`((?:examples/)?[\w/]+\.yaml)`", readme.split("## Graph files", 1)[1].split("```", 1)[0])
    )
    assert "reinforce_pp.yaml" in named
    for name in named:
        assert (ROOT / "examples" / name.removeprefix("examples/")).is_file(), name
