"""Every command of the README and of the docs site runs, page by page, in order, from a fresh copy of the
examples (issue 14, item 6; issue 31), and writes only where git ignores it.

A page is the README or a page of ``docs/`` listed in ``mkdocs.yml``'s nav (the generated reference pages
hold no commands). Each page's ```` ```bash ```` blocks are run as written, one after the other, by
``bash -e`` in a temporary directory holding a copy of ``examples/``: a page stands alone, as a reader who
lands on it from a search finds it. The ``rlflow`` those blocks call is a wrapper on ``PATH`` that runs
``python -m rlflow.schedulers.cli``'s code in a child of a fork server that imported it once
(tests/cli_server.py: the child takes the wrapper's directory, environment and streams; its exit status is
the wrapper's), with the documented arguments plus, to keep the test short:

- ``rlflow run``: ``run.iterations`` 1 (one more than the run of the same graph and directory before it
  for ``--resume``) and ``run.eval_interval=0`` (evaluation decodes hundreds of held-out problems);
- ``rlflow plan``: ``--steps 30 --restarts 1`` (a shorter search, the same code);
- ``rlflow profile``: ``--quick`` (its documented rough mode; the full one takes minutes).

A command whose comment says ``exits 2`` must exit with status 2 (a documented refusal). Shell blocks that
need what a test machine lacks (a cluster's addresses, the test suite itself) are fenced ```` ```sh ````
and listed in :data:`NOT_RUN` with the reason; any other ```` ```sh ```` block fails the test.

Reproduce the old failures: the README's ``rlflow run examples/ppo.yaml --metrics-port 0`` made
``runs/ppo``, and the asynchronous example run after it stopped on that directory; ``show`` and ``profile``
wrote into the repository root.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

# (page, first line of a ```sh block) -> why the tests do not run it
NOT_RUN: dict[tuple[str, str], str] = {
    ("README.md", "make run     # installs rlflow, then the main job: SFT then PPO on arithmetic"): (
        "make run installs, then runs the command of the README's next block, which this test runs; "
        "make test is the test suite itself"
    ),
    ("docs/launchers.md", "# on the head node (its address is printed: HEAD_IP:6379)"): (
        "needs a Ray cluster's addresses; the local Ray command on the same page runs"
    ),
    (
        "docs/launchers.md",
        "rlflow run examples/ppo.yaml run.devices=16 --plan plan.yaml --launcher torchrun "
        "--address 0.0.0.0:29400",
    ): "needs two hosts with 8 devices each",
    (
        "docs/records.md",
        "tensorboard --logdir runs/grpo/trackers/tensorboard   # or --logdir runs: every run's curves",
    ): "starts TensorBoard's web server, which runs until stopped; the run before it writes the curves",
    (
        "docs/recipes.md",
        "rlflow run examples/distill/teacher.yaml examples/arith/sft.yaml examples/distill/distill.yaml "
        "--overwrite",
    ): "three stages of 1,560 iterations (minutes); tests/test_distill.py runs this chain CI-sized",
    ("docs/ecosystem.md", "tensorboard --logdir runs/hub-grpo/trackers/tensorboard"): (
        "starts TensorBoard's server, which runs until stopped; the page's ls shows its event file, and "
        "tests/test_example_hub.py reads the file's metric names"
    ),
}

WRAPPER = '''#!{python}
"""rlflow with the test's short settings (tests/test_readme_commands.py)."""
import json, os, sys
from pathlib import Path

sys.path.insert(0, {tests!r})
import cli_server

argv = sys.argv[1:]
command = next((a for a in argv if not a.startswith("-")), "")
state_file = Path(os.environ["RLFLOW_DOCS_STATE"])
state = json.loads(state_file.read_text()) if state_file.exists() else {{}}
if command == "run":
    graph = argv[argv.index("run") + 1]
    out = next((a for a in argv if a.startswith("run.output_dir=")), "")
    key = graph + " " + out
    n = state.get(key, 0) + 1 if "--resume" in argv else 1
    state[key] = n
    state_file.write_text(json.dumps(state))
    argv = [a for a in argv if not a.startswith(("run.iterations=", "run.eval_interval="))]
    argv += [f"run.iterations={{n}}", "run.eval_interval=0"]
elif command == "plan":
    argv += ["--steps", "30", "--restarts", "1"]
elif command == "profile" and "--quick" not in argv:
    argv += ["--quick"]
sys.exit(cli_server.call(os.environ["RLFLOW_DOCS_SERVER"], argv))
'''


@pytest.fixture(scope="module")
def cli_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The socket of a fork server holding an imported ``rlflow`` CLI (tests/cli_server.py), for this
    module's tests on this worker."""
    path = str(tmp_path_factory.mktemp("cli-server") / "socket")
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "cli_server.py"), path], stdout=subprocess.PIPE, text=True
    )
    try:
        ready = server.stdout.readline() if server.stdout else ""  # "" once the server exited
        assert ready == f"listening on {path}\n", f"the rlflow fork server did not start: {ready!r}"
        yield path
    finally:
        server.kill()
        server.wait()


def pages() -> list[str]:
    """The README, then every hand-written page of the docs site in nav order."""
    found: list[str] = []

    def walk(items: object) -> None:
        for item in items if isinstance(items, list) else []:
            for value in item.values() if isinstance(item, dict) else [item]:
                if isinstance(value, str) and (ROOT / "docs" / value).is_file():
                    found.append(f"docs/{value}")
                else:
                    walk(value)

    walk(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    return ["README.md", *found]


def blocks(page: str) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of a shell language on ``page``."""
    text = (ROOT / page).read_text()
    found = re.findall(r"^```(\w*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    return [(lang, body) for lang, body in found if lang in ("bash", "sh", "shell", "console")]


def script(body: str) -> str:
    """A bash block with each ``# exits 2`` command turned into a check of that status."""
    lines = []
    for line in body.splitlines():
        if re.search(r"#.*\bexits 2\b", line):
            command = line.split(" #", 1)[0].rstrip()
            line = f"{command} && exit 99; [ $? -eq 2 ]"
        lines.append(line)
    return "\n".join(lines) + "\n"


def test_every_shell_block_runs_or_says_why_not() -> None:
    seen = set()
    for page in pages():
        for lang, body in blocks(page):
            if lang == "bash":
                continue
            first = body.splitlines()[0]
            assert lang == "sh" and (page, first) in NOT_RUN, (
                f"{page}: a ```{lang} block the tests do not run"
            )
            seen.add((page, first))
    assert seen == set(NOT_RUN), f"NOT_RUN lists blocks no page has: {set(NOT_RUN) - seen}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", pages())
def test_page_commands_run_in_order_from_a_fresh_copy(page: str, tmp_path: Path, cli_server: str) -> None:
    work = tmp_path / "work"
    shutil.copytree(ROOT / "examples", work / "examples")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "rlflow"
    wrapper.write_text(WRAPPER.format(python=sys.executable, tests=str(ROOT / "tests")))
    wrapper.chmod(0o755)
    env = {
        **__import__("os").environ,
        "PATH": f"{bin_dir}:{__import__('os').environ.get('PATH', '')}",
        "RLFLOW_DOCS_STATE": str(tmp_path / "state.json"),
        "RLFLOW_DOCS_SERVER": cli_server,
    }
    before = set(work.rglob("*"))
    runnable = [body for lang, body in blocks(page) if lang == "bash"]
    printed = ""
    for i, body in enumerate(runnable):
        path = tmp_path / f"block{i}.sh"
        path.write_text(script(body))
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", str(path)], cwd=work, env=env, capture_output=True, text=True,
            timeout=1200, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (
            f"{page}, block {i + 1}:\n{body}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
        printed += done.stdout
    if page == "README.md":
        assert "ok: examples/reinforce_pp.yaml" in printed
        assert (work / "runs" / "grpo" / "dashboard.html").is_file()
    # Everything the commands wrote lies where git ignores it (out/, runs/), never loose in the tree.
    written = sorted(str(p.relative_to(work)) for p in set(work.rglob("*")) - before if p.is_file())
    if (ROOT / ".git").exists():
        ignored = subprocess.run(
            ["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(written),
            capture_output=True, text=True, check=False,
        ).stdout.split()  # fmt: skip
    else:  # no checkout to ask: .gitignore must list the folders the commands wrote into
        listed = {line.strip().strip("/") for line in (ROOT / ".gitignore").read_text().splitlines()}
        ignored = [w for w in written if w.split("/", 1)[0] in listed]
    assert sorted(set(written) - set(ignored)) == [], f"{page}: commands wrote files git does not ignore"


def test_docs_point_only_inside_the_project() -> None:
    """Every relative link of the repository's documents resolves in the repository; nothing points outside
    it (the README once linked ``../shared/DESIGN.md``); every example graph file a document names exists."""
    documents = ["README.md", "DESIGN.md", "bench/README.md", "nodes/README.md"]
    documents += [str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").rglob("*.md"))]
    for doc in documents:
        path = ROOT / doc
        text = path.read_text()
        assert "../shared" not in text, doc
        if doc.startswith("docs/"):
            continue  # the site's own links: mkdocs build --strict checks them (tests/test_docs.py)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if not re.match(r"[a-z]+:", target):
                resolved = (path.parent / target).resolve()
                assert resolved.is_relative_to(ROOT) and resolved.exists(), f"{doc}: link {target}"
        for name in re.findall(r"`(examples/[\w/]+\.yaml)`", text):
            assert (ROOT / name).is_file(), f"{doc}: {name}"
    graph_files = (ROOT / "docs" / "graph-files.md").read_text()
    for name in re.findall(r"`(\w+\.yaml)`", graph_files.split("```", 1)[0]):
        assert (ROOT / "examples" / name).is_file(), name
