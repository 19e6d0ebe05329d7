"""The sandbox's security battery (issue 38): hostile programs run through ``code_reward``, each contained.

Every program runs through the registered node function (``code_reward``, ``extract: whole``, one sample,
one test) in the real bubblewrap sandbox. Each test checks that the execution is contained: the call returns
(the run continues), the score is the failure score (-1 here, so that 0 cannot pass by accident) with the
reason expected (``reward/code_<reason>_ratio`` is 1), the host is unchanged (files, the test server, the
test's own processes), and no process is left (the autouse fixture: no child of this process, no cgroup of
this process's sandboxes, no process whose command line carries the test's token; then a benign program
still passes).
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import threading
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from rlflow.dataflow.args import ArgError
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.functions.code_reward import limits_of, sandbox_for
from rlflow.nodes.services.sandbox import Sandbox, UnsafeSandboxWarning
from tests.test_code_reward import run as run_code_reward

pytestmark = pytest.mark.slow  # each execution starts bwrap and a Python interpreter

load_builtin_functions()
ROOT = Path(__file__).resolve().parents[1]
FAILURE = -1.0
# small limits keep the battery fast: 2 CPU s, 256 MiB, 8 processes, 64 KiB of output; a wall limit that
# a loaded machine does not reach by accident (the tests of timeouts set a short one)
LIMITS: dict[str, Any] = {
    "extract": "whole",
    "failure_score": FAILURE,
    "cpu_seconds": 2,
    "wall_seconds": 20.0,
    "memory_mb": 256,
    "max_processes": 8,
    "max_output_bytes": 1 << 16,
    "tmp_mb": 4,
    "start_retries": 0,
}
TOKEN = f"{uuid.uuid4().int % 10**6}.{os.getpid()}"  # a sleep's length no other process on the host has


def reward(program: str, tests: Any, **args: Any) -> tuple[float, dict[str, float]]:
    """``code_reward`` on one response (``program``) with its ``tests``: ``(score, metrics)``."""
    scores, metrics = run_code_reward([program], [json.dumps(tests)], **{**LIMITS, **args})
    return scores[0], metrics


def expect(program: str, reason: str, tests: Any = None, **args: Any) -> None:
    """The program scores the failure score and its one execution ends with ``reason``."""
    score, metrics = reward(program, tests or [{"stdout": "never printed"}], **args)
    assert metrics[f"reward/code_{reason}_ratio"] == 1.0, metrics
    assert score == FAILURE


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _leftovers(before: set[int]) -> list[str]:
    """What this test left: new children of this process (not those an earlier test module on the same
    worker started, e.g. multiprocessing's resource tracker), tagged processes, sandbox cgroups."""
    children = psutil.Process().children(recursive=True)
    mine = [f"child {p.pid} {p.cmdline()}" for p in children if p.pid not in before]
    tagged = []
    for p in psutil.process_iter(["cmdline"]):
        if any(TOKEN in part for part in p.info["cmdline"] or ()):
            tagged.append(f"tagged {p.pid} {p.info['cmdline']}")
    base = sandbox_for("bubblewrap", limits_of(LIMITS)).cgroups
    cgroups = [str(d) for d in base.base.glob(f"rlflow-sandbox-{os.getpid()}-*")] if base else []
    if base is not None and base.cpu_base is not None and base.cpu_base != base.base:
        cgroups += [str(d) for d in base.cpu_base.glob(f"rlflow-sandbox-{os.getpid()}-*")]
    return mine + tagged + cgroups


@pytest.fixture(autouse=True)
def _contained() -> Iterator[None]:
    """After each test: no process or cgroup left, and the next execution still runs and passes."""
    before = _children()
    yield
    assert _leftovers(before) == []
    score, metrics = reward("print(int(input()) * 3)", [{"stdin": "3\n", "stdout": "9\n"}])
    assert score == 1.0 and metrics["reward/code_pass_ratio"] == 1.0


def test_fork_bomb() -> None:
    bomb = "import os\nwhile True:\n    os.fork()\n"
    expect(bomb, "error")  # fork fails (EAGAIN) at the process limit: BlockingIOError
    quiet_bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    expect(quiet_bomb, "timeout", wall_seconds=1.5)
    # the limit itself: 8 processes in all = the program and 7 children (a pass proves the count)
    count = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\nexcept OSError:\n    print(n)\n"
    )
    score, metrics = reward(count, [{"stdout": "7\n"}])
    assert score == 1.0, metrics


def test_memory_bomb() -> None:
    expect("b = bytearray(1 << 31)\n", "oom")
    expect("x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n", "oom")


def test_infinite_loop() -> None:
    expect("while True:\n    pass\n", "timeout", cpu_seconds=1, wall_seconds=30.0)  # the CPU limit: SIGXCPU


def test_writes_outside_the_sandbox_tmp_leave_the_host_unchanged(tmp_path: Path) -> None:
    """Home, /tmp, the run directory, the project: each host file keeps its content; the program either
    cannot reach the directory (error) or writes a private /tmp copy (its read-back differs: fail)."""
    name = f"rlflow-sandbox-{TOKEN}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    targets = {
        Path.home() / f".{name}": "error",
        Path("/tmp") / name: "fail",
        run_dir / "metrics.jsonl": "error",
        ROOT / f".{name}": "error",
    }
    try:
        for path, reason in targets.items():
            path.write_text("original")
            program = f"p = {str(path)!r}\nwith open(p, 'a') as f:\n    f.write('pwned')\n"
            program += "print(open(p).read())\n"
            expect(program, reason, [{"stdout": "originalpwned"}])
            assert path.read_text() == "original", path
        expect("open('/x', 'w')\n", "error")  # the root: read-only
        expect(f"open({os.path.realpath(os.__file__)!r}, 'a')\n", "error")  # the interpreter: read-only
    finally:
        for path in targets:
            path.unlink(missing_ok=True)


def test_reads_outside_see_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint the run wrote, /etc/shadow, the home directory, the trainer's environment (tokens):
    nothing of them is visible."""
    monkeypatch.setenv("RLFLOW_TEST_TOKEN", "s3cret")
    expect("import os\nprint(os.environ['RLFLOW_TEST_TOKEN'])\n", "error", [{"stdout": "s3cret"}])
    ckpt = tmp_path / "run" / "checkpoints" / "step_1" / "actor.safetensors"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_text("secret weights")
    expect(f"print(open({str(ckpt)!r}).read())\n", "error", [{"stdout": "secret weights"}])
    expect("print(open('/etc/shadow').read())\n", "error")
    home = Path.home()
    listing = repr(sorted(os.listdir(home)))
    program = f"import os\nprint(sorted(os.listdir({str(home)!r})))\n"
    score, metrics = reward(program, [{"stdout": listing}])
    assert score == FAILURE and metrics["reward/code_pass_ratio"] == 0.0, metrics


def test_network_connection_reaches_nothing() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.settimeout(0.2)
    accepted: list[Any] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except TimeoutError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        program = (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "s.sendall(b'hello')\nprint('sent')\n"
        )
        expect(program, "error", [{"stdout": "sent"}])
    finally:
        stop.set()
        thread.join()
        server.close()
    assert accepted == []


def test_detached_daemon_does_not_outlive_the_execution() -> None:
    daemon = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', '{TOKEN}'])\n    os._exit(0)\n"
        "import time\ntime.sleep(0.3)\nprint('detached')\n"
    )
    expect(daemon, "fail")  # it ran to the end; its output is not the test's; the fixture finds no sleep


def test_signals_reach_no_host_process() -> None:
    """SIGKILL to the parent, to every process it may signal (kill -9 -1), to this test's process and to a
    host process of the same user: none of them dies; the program itself survives to say so."""
    host = subprocess.Popen(["sleep", "30"])
    try:
        program = (
            "import os\nfor pid in (os.getppid(), -1, " + f"{os.getpid()}, {host.pid}):\n"
            "    try:\n        os.kill(pid, 9)\n    except OSError:\n        pass\nprint('still here')\n"
        )
        expect(program, "fail")
        assert host.poll() is None
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait()


def test_printing_gigabytes_is_cut() -> None:
    expect("import sys\nb = b'x' * (1 << 20)\nwhile True:\n    sys.stdout.buffer.write(b)\n", "killed")
    expect("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)\n", "killed")


def test_sleeping_past_the_wall_limit_while_holding_children() -> None:
    program = (
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', '{TOKEN}'])\ntime.sleep(60)\n"
    )
    expect(program, "timeout", wall_seconds=1.0)


def test_isolation_off_is_refused_unless_named_unsafe() -> None:
    fn = NODE_FUNCTIONS.get("code_reward").fn
    refused = r"args\.isolation: unknown value .*choices: bubblewrap, none_unsafe"
    for off in ("none", "off", "disabled"):
        with pytest.raises(ArgError, match=refused):
            fn(None, None, isolation=off)
    with pytest.raises(ArgError, match=r"args\.isolation: "):
        fn(None, None, isolation=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        score, _ = reward("print(2 + 2)", [{"stdout": "4"}], isolation="none_unsafe", tmp_mb=5)
    assert score == 1.0
    assert any(issubclass(w.category, UnsafeSandboxWarning) for w in caught)


def test_seccomp_refuses_tracing_and_new_namespaces() -> None:
    """ptrace(PTRACE_TRACEME) (which succeeds unfiltered) and unshare(CLONE_NEWUSER) both get EPERM (1)."""
    import ctypes.util

    if platform.machine() != "x86_64" or ctypes.util.find_library("seccomp") is None:
        pytest.skip("no libseccomp on this host, or system call numbers not x86-64's")
    sandbox = sandbox_for("bubblewrap", limits_of(LIMITS))
    assert sandbox.seccomp is not None, sandbox.seccomp_why  # libseccomp is here: the filter must be in force
    program = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.syscall(101, 0, 0, 0, 0), ctypes.get_errno())\n"  # x86-64 ptrace, PTRACE_TRACEME
        "print(libc.syscall(272, 0x10000000), ctypes.get_errno())\n"  # x86-64 unshare, CLONE_NEWUSER
    )
    score, metrics = reward(program, [{"stdout": "-1 1\n-1 1\n"}])
    assert score == 1.0, metrics


def test_stale_cgroups_of_dead_processes_are_removed_at_creation() -> None:
    """A trainer SIGKILLed leaves empty ``rlflow-sandbox-<pid>-N`` cgroups: a new sandbox removes those whose
    pid is dead, and leaves a live process's."""
    cgroups = sandbox_for("bubblewrap", limits_of(LIMITS)).cgroups
    if cgroups is None or not cgroups.available:
        pytest.skip("no writable pids cgroup here")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = (
        cgroups.base / f"rlflow-sandbox-{dead.pid}-7",
        cgroups.base / f"rlflow-sandbox-{os.getppid()}-7",
    )
    stale.mkdir()
    live.mkdir()
    try:
        fresh = Sandbox("bubblewrap", limits_of({**LIMITS, "tmp_mb": 7}))
        assert not stale.exists() and live.exists()
        assert fresh.cgroups is not None and fresh.cgroups.removed_stale >= 1
    finally:
        for path in (stale, live):
            if path.exists():
                path.rmdir()


def test_an_abandoned_call_kills_its_running_executions() -> None:
    """A stop signal abandons the iteration while ``code_reward`` waits on sandboxes sleeping under a 60 s
    wall limit (SIGALRM's handler raises, as the controller's does): the call ends with that exception at once
    instead of waiting out the limit, and the fixture finds no process left."""
    import time

    class Abandoned(Exception):
        pass

    def on_alarm(signum: int, frame: object) -> None:
        raise Abandoned

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 1.0)
    start = time.monotonic()
    try:
        with pytest.raises(Abandoned):
            reward("import time\ntime.sleep(300)", [{"stdout": "x"}] * 4, wall_seconds=60.0, concurrency=2)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - start < 30  # not the 60 s wall limit of the executions it waited on
