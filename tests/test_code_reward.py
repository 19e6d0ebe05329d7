"""``code_reward`` through the registry: scores and reasons by hand, extraction, the two test formats, every
argument reaching the outcome, the pool, bounded start retries, and the pre-launch refusal of a host without
the isolation (``rlflow validate``).

Responses are token ids of Unicode code points (:class:`CharTokenizer`); each sample's tests are the batch's
``tests`` list. Goldens: a sample's ``pass_fraction`` score is ``(passed + failure_score · failed) / n``
(``all_pass``: 1 or ``failure_score``); each (sample, test) is one execution, the reasons' ratios are shares
of all executions.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeContext
from rlflow.nodes.functions.code_reward import limits_of, sandbox_for
from rlflow.nodes.services import sandbox as sandbox_module
from rlflow.nodes.services.code_exec import REASONS
from rlflow.schedulers.cli import main

pytestmark = pytest.mark.slow  # executions start bwrap and a Python interpreter

load_builtin_functions()
ROOT = Path(__file__).resolve().parents[1]
FAST = {"cpu_seconds": 2, "wall_seconds": 30.0, "memory_mb": 256, "max_processes": 8, "tmp_mb": 4}
SQUARE = [
    {"stdin": "3\n", "stdout": "9\n"},
    {"stdin": "4\n", "stdout": "16\n"},
    {"stdin": "-2\n", "stdout": "4\n"},
]
SQUARE_F = {"asserts": ["assert f(2) == 4", "assert f(-3) == 9", "assert f(0) == 0"]}


class CharTokenizer:
    """Token ids are Unicode code points (``code_reward`` only decodes)."""

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return ["".join(chr(i) for i in row) for row in ids]


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution:\n```{lang}\n{code}\n```\nDone."


def run(texts: list[str], tests: list[Any], **args: Any) -> tuple[list[float], dict[str, float]]:
    """``code_reward`` on ``texts`` (one sample each) with their ``tests``: ``(scores, metrics)``."""
    width = max(len(t) for t in texts)
    ids = torch.tensor([[ord(c) for c in t] + [0] * (width - len(t)) for t in texts])
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts])
    given = {**FAST, **args}
    ctx = NodeContext(
        node=NodeSpec("reward", "inference", "code_reward", args=given),
        model=None,
        group_size=1,
        generator=None,
        tokenizer=CharTokenizer(),
    )
    batch = Batch({"response_ids": ids, "response_mask": mask, "tests": tests})
    result = NODE_FUNCTIONS.get("code_reward").fn(ctx, batch, **given)
    return [round(float(s), 6) for s in result.outputs["scores"]], result.metrics


def ratios(metrics: dict[str, float]) -> dict[str, float]:
    return {
        r: round(metrics[f"reward/code_{r}_ratio"], 6) for r in REASONS if metrics[f"reward/code_{r}_ratio"]
    }


# stdin/stdout: r0 squares (3 pass); r1 doubles |x| (-2 -> 4 only: 1 pass, 2 fail); r2's last block triples
# (3 -> 9 only: 1 pass, 2 fail; its first, right block is not the last); r3 has no fence, r4 only a bash
# block: no code (3 errors each, nothing run). 15 executions: 5 pass, 4 fail, 6 error.
STDIO_TEXTS = [
    fenced("print(int(input()) ** 2)"),
    fenced("print(abs(int(input())) * 2)"),
    fenced("print(int(input()) ** 2)") + "\nOr shorter:\n```\nprint(int(input()) * 3)\n```",
    "print(int(input()) ** 2)",
    fenced("echo 9", lang="bash"),
]


def test_stdio_scores_and_reasons_by_hand() -> None:
    scores, metrics = run(STDIO_TEXTS, [json.dumps(SQUARE)] * 5)
    third = round(1 / 3, 6)
    assert scores == [1.0, third, third, 0.0, 0.0]
    assert ratios(metrics) == {"pass": round(5 / 15, 6), "fail": round(4 / 15, 6), "error": round(6 / 15, 6)}
    assert sum(metrics[f"reward/code_{r}_ratio"] for r in REASONS) == pytest.approx(1.0)
    assert metrics["critic/score/mean"] == pytest.approx((1 + 2 / 3) / 5)
    assert metrics["critic/score/max"] == 1.0 and metrics["critic/score/min"] == 0.0


def test_score_modes_and_failure_score() -> None:
    tests = [json.dumps(SQUARE)] * 3
    texts = STDIO_TEXTS[:2] + STDIO_TEXTS[3:4]
    assert run(texts, tests, score="all_pass")[0] == [1.0, 0.0, 0.0]
    assert run(texts, tests, score="all_pass", failure_score=-1.0)[0] == [1.0, -1.0, -1.0]
    # pass_fraction: (1 + (-1)·2) / 3 = -1/3 for r1; no code: -1
    assert run(texts, tests, failure_score=-1.0)[0] == [1.0, round(-1 / 3, 6), -1.0]


def test_extraction_modes() -> None:
    raw, wrapped = "print(int(input()) ** 2)", fenced("print(int(input()) ** 2)")
    tests = [SQUARE, SQUARE]
    scores, metrics = run([raw, wrapped], tests, extract="whole")
    assert scores == [1.0, 0.0]  # the fence is a syntax error
    assert ratios(metrics) == {"pass": 0.5, "error": 0.5}
    assert run([raw, wrapped], tests)[0] == [0.0, 1.0]  # fenced: raw text has no block


def test_assert_tests_by_hand() -> None:
    """r0 squares (3 pass); r1 doubles (f(2) = 4 and f(0) = 0 pass, f(-3) fails); r2 raises (3 errors); r3
    exits 0 before the assertion runs, r4 through sys.exit (3 errors each): 15 executions, 5/1/9."""
    texts = [
        fenced("def f(x):\n    return x * x"),
        fenced("def f(x):\n    return 2 * x"),
        fenced("def f(x):\n    raise ValueError(x)"),
        fenced("import os\nos._exit(0)"),
        fenced("import sys\nsys.exit(0)"),
    ]
    scores, metrics = run(texts, [SQUARE_F] * 5)
    assert scores == [1.0, round(2 / 3, 6), 0.0, 0.0, 0.0]
    assert ratios(metrics) == {"pass": round(5 / 15, 6), "fail": round(1 / 15, 6), "error": round(9 / 15, 6)}


def test_stdout_compared_up_to_trailing_whitespace() -> None:
    tests = [[{"stdout": "1 2\n3"}]] * 3
    texts = [
        fenced("print('1 2  ')\nprint(3)\nprint()"),
        fenced("print('1  2')\nprint(3)"),
        fenced("print(' 1 2\\n3')"),
    ]
    assert run(texts, tests)[0] == [1.0, 0.0, 0.0]  # inner and leading whitespace count


def test_unreadable_tests_stop_the_node_naming_the_input() -> None:
    good = json.dumps([{"stdout": "1"}])
    for bad in ("not json", json.dumps({"cases": []}), json.dumps([]), json.dumps([{"stdin": "1"}])):
        with pytest.raises(NodeError, match=r"node 'reward': code_reward: input 'tests' of sample 1: "):
            run([fenced("print(1)")] * 2, [good, bad])


def test_limits_reach_the_outcome() -> None:
    """Each limit decides an outcome: the same program passes under the default, not under the tighter one."""
    wall = fenced("import time\ntime.sleep(1.5)\nprint('ok')")
    assert run([wall], [[{"stdout": "ok"}]])[0] == [1.0]
    assert ratios(run([wall], [[{"stdout": "ok"}]], wall_seconds=0.8)[1]) == {"timeout": 1.0}
    spin = fenced(
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.5:\n    pass\nprint('ok')"
    )
    assert run([spin], [[{"stdout": "ok"}]])[0] == [1.0]
    assert ratios(run([spin], [[{"stdout": "ok"}]], cpu_seconds=1)[1]) == {"timeout": 1.0}
    big = fenced("b = bytearray(100 << 20)\nprint('ok')")
    assert run([big], [[{"stdout": "ok"}]])[0] == [1.0]
    assert ratios(run([big], [[{"stdout": "ok"}]], memory_mb=64)[1]) == {"oom": 1.0}
    loud = fenced("print('x' * 5000)\nprint('ok')")
    assert ratios(run([loud], [[{"stdout": "x" * 5000 + "\nok"}]], max_output_bytes=4096)[1]) == {
        "killed": 1.0
    }
    assert run([loud], [[{"stdout": "x" * 5000 + "\nok"}]])[0] == [1.0]
    disk = fenced("open('/tmp/f', 'wb').write(b'x' * (3 << 20))\nprint('ok')")
    assert run([disk], [[{"stdout": "ok"}]])[0] == [1.0]
    # Python ignores SIGXFSZ: the write past 1 MiB fails (EFBIG), an OSError
    assert ratios(run([disk], [[{"stdout": "ok"}]], tmp_mb=1)[1]) == {"error": 1.0}
    # processes: the program and its children; a child that cannot fork raises
    forks = fenced(
        "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n    os.wait()\n"
        "print('ok')"
    )
    assert run([forks], [[{"stdout": "ok"}]])[0] == [1.0]
    assert run([forks], [[{"stdout": "ok"}]], max_processes=1)[1]["reward/code_error_ratio"] == 1.0


def test_isolation_none_unsafe_sees_the_host() -> None:
    """Without isolation the project is visible to the program; in the sandbox it is not."""
    probe = fenced(f"import os\nprint(os.path.exists({str(ROOT / 'pyproject.toml')!r}))")
    assert run([probe], [[{"stdout": "False"}]])[0] == [1.0]
    with pytest.warns(sandbox_module.UnsafeSandboxWarning):
        assert run([probe], [[{"stdout": "True"}]], isolation="none_unsafe")[0] == [1.0]


def test_concurrency_runs_executions_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``concurrency: 4``: four executions are in flight together (a barrier of 4 opens); ``1``: never two."""
    sandbox = sandbox_for("bubblewrap", limits_of({**FAST, "max_output_bytes": 1 << 20}))
    original = sandbox.run
    barrier, lock, live, peak = threading.Barrier(4, timeout=30), threading.Lock(), [0], [0]

    def gated(*args: Any, **kwargs: Any) -> Any:
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        try:
            if barrier.parties:
                barrier.wait()
            return original(*args, **kwargs)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(sandbox, "run", gated)
    texts = [fenced("print(1)")] * 4
    assert run(texts, [[{"stdout": "1"}]] * 4, concurrency=4)[0] == [1.0] * 4
    assert peak[0] == 4
    barrier, peak[0] = threading.Barrier(1), 0
    assert run(texts, [[{"stdout": "1"}]] * 4, concurrency=1)[0] == [1.0] * 4
    assert peak[0] == 1


def test_a_sandbox_that_cannot_start_stops_the_run_after_its_retries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bwrap failing before the sandbox starts (no info) is retried ``start_retries`` times, then one line."""
    sandbox = sandbox_for("bubblewrap", limits_of({**FAST, "max_output_bytes": 1 << 20}))
    tries = tmp_path / "tries"
    fake = tmp_path / "bwrap"
    fake.write_text(
        f"#!/bin/sh\necho try >> {tries}\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap", str(fake))
    with pytest.raises(NodeError) as info:
        run([fenced("print(1)")], [[{"stdout": "1"}]], start_retries=2)
    message = str(info.value)
    assert "\n" not in message
    assert message == (
        "node 'reward': code_reward: the bubblewrap sandbox failed to start 3 time(s): "
        "bwrap: setting up uid map: Permission denied"
    )
    assert tries.read_text().count("try") == 3
    tries.unlink()
    with pytest.raises(NodeError, match="failed to start 1 time"):
        run([fenced("print(1)")], [[{"stdout": "1"}]], start_retries=0)
    assert tries.read_text().count("try") == 1


def _graph(tmp_path: Path, bad_row: dict[str, Any] | None = None, **args: Any) -> Path:
    """examples/grpo.yaml scored by ``code_reward`` on a 40-row JSONL file of stdin/stdout tests; row 30's
    ``tests`` is ``bad_row`` when given."""
    rows = [
        {"prompt": f"square {i}", "tests": json.dumps([{"stdin": f"{i}", "stdout": f"{i * i}"}])}
        for i in range(40)
    ]
    if bad_row is not None:
        rows[30]["tests"] = json.dumps([bad_row])
    data = tmp_path / "code.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    graph = yaml.safe_load((ROOT / "examples" / "grpo.yaml").read_text())
    graph["nodes"]["reward"].update(
        function="code_reward", inputs=["response_ids", "response_mask", "tests"], args=args
    )
    graph["data"] = {
        "train": str(data),
        "fields": {"prompt": "prompt", "tests": "tests"},
        "tokenize": ["prompt"],
        "tokenizer": "actor",
    }
    path = tmp_path / "code.yaml"
    path.write_text(yaml.safe_dump(graph))
    return path


def test_validate_bounds_the_limits_naming_the_argument(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A limit past its bound is refused by name before any probe (it was blamed on the host)."""
    monkeypatch.chdir(ROOT)
    path = _graph(tmp_path)
    for key, value in (
        ("cpu_seconds", "100000000000000000000"),
        ("memory_mb", "100000000000000"),
        ("wall_seconds", "0.001"),
        ("max_processes", "5000"),
        ("tmp_mb", "70000"),
    ):
        assert main(["validate", str(path), f"nodes.reward.args.{key}={value}"]) == 2
        err = capsys.readouterr().err
        assert f"nodes.reward.args.{key}" in err
        assert "not available on this host" not in err


def test_validate_names_the_row_of_a_bad_tests_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every row's ``tests`` is parsed before the run: the file, split, count and first row are named."""
    monkeypatch.chdir(ROOT)
    path = _graph(tmp_path, bad_row={"stdin": "1", "out": "2"}, tmp_mb=6)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{path}: data '{tmp_path / 'code.jsonl'}' (train split): field 'tests' is unreadable for "
        "code_reward in 1 row(s), first at row 30: a stdin/stdout test must be"
    ) in err


def test_a_slow_start_past_the_wall_limit_is_a_timeout_not_a_failed_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bwrap still setting up when the wall limit runs out (a loaded host): the execution times out, the
    run goes on (before: 'failed to start', which stops the run)."""
    limits = {**FAST, "wall_seconds": 1.0}
    sandbox = sandbox_for("bubblewrap", limits_of({**limits, "max_output_bytes": 1 << 20}))
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap", str(fake))
    scores, metrics = run([fenced("print(1)")], [[{"stdout": "1"}]], start_retries=0, **limits)
    assert scores == [0.0]
    assert ratios(metrics) == {"timeout": 1.0}


def test_a_program_ignoring_sigxcpu_killed_by_the_cpu_limit_is_a_timeout() -> None:
    """SIGXCPU ignored: the hard CPU limit (cpu_seconds + 1) SIGKILLs it -- the CPU limit, a timeout; a
    program that SIGKILLs itself at once is ``killed``."""
    spin = fenced("import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass")
    assert ratios(run([spin], [[{"stdout": "ok"}]], cpu_seconds=1)[1]) == {"timeout": 1.0}
    suicide = fenced("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert ratios(run([suicide], [[{"stdout": "ok"}]])[1]) == {"killed": 1.0}
    # stderr text alone is not an oom: only the harness's caught MemoryError is
    fake_oom = fenced("import sys\nsys.stderr.write('MemoryError\\n')\nsys.exit(3)")
    assert ratios(run([fake_oom], [[{"stdout": "ok"}]])[1]) == {"error": 1.0}


def test_validate_refuses_a_host_without_the_isolation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    path = _graph(tmp_path, tmp_mb=3)
    assert main(["validate", str(path)]) == 0
    assert "code_reward sandbox: isolation bubblewrap" in capsys.readouterr().err  # the start-up line
    monkeypatch.setattr(sandbox_module, "bwrap_binary", lambda: None)
    path = _graph(tmp_path, tmp_mb=2)  # other limits: a sandbox not probed yet
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        f"{path}: nodes.reward.args.isolation: bubblewrap isolation is not available on this host: no " in err
    )
    assert "bubblewrap binary" in err
    assert main(["validate", str(path), "nodes.reward.args.isolation=none"]) == 2
    assert "nodes.reward.args.isolation: unknown value 'none'" in capsys.readouterr().err
    # a bwrap that cannot set up its namespaces (as where user namespaces are off): the probe fails to start
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module, "bwrap_binary", lambda: str(fake))
    path = _graph(tmp_path, tmp_mb=1)
    assert main(["validate", str(path)]) == 2
    assert (
        f"{path}: nodes.reward.args.isolation: bubblewrap isolation is not available on this host: the probe "
        "could not start it: the bubblewrap sandbox failed to start 1 time(s): bwrap: No permissions to "
        "create a new namespace"
    ) in capsys.readouterr().err
    # a sandbox only the held-out evaluation uses (examples/code/sft.yaml: run.eval.reward: code_reward, no
    # node runs it) is probed too, naming the evaluation's key
    sft = ["validate", "examples/code/sft.yaml", "run.eval.reward_args.tmp_mb=1"]
    assert main(sft) == 2
    assert (
        "examples/code/sft.yaml: run.eval.reward_args.isolation: bubblewrap isolation is not available on "
        "this host: the probe could not start it"
    ) in capsys.readouterr().err


def test_stdin_of_any_size_and_the_job_read_once() -> None:
    """A 300 KB stdin (past a pipe's buffer) arrives whole, or is dropped unread; the harness's job (with the
    assertion's token) comes through a pipe, so a program cannot rewind its stdin to read the token."""
    big = "7\n" * 150_000
    reads = fenced("import sys\nprint(len(sys.stdin.read()))")
    ignores = fenced("print('ok')")
    assert run([reads, ignores], [[{"stdin": big, "stdout": "300000"}], [{"stdin": big, "stdout": "ok"}]])[
        0
    ] == [
        1.0,
        1.0,
    ]
    rewind = fenced(
        "import os, re\ntry:\n    os.lseek(0, 0, 0)\nexcept OSError:\n    pass\n"
        "found = re.search(r'\"marker\": \"(\\w+)\"', open('/proc/self/fd/0').read())\n"
        "print('\\n' + (found.group(1) if found else ''), flush=True)\nos._exit(0)"
    )
    scores, metrics = run([rewind], [SQUARE_F])
    assert scores == [0.0] and ratios(metrics) == {"error": 1.0}
