"""Threads per process (``rlflow.schedulers.runtime.threads``): the rule as a pure function with golden
values, and the environment a worker started by the launchers' spawn path really gets."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from rlflow.dataflow.errors import HostError
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.threads import (
    ThreadChoice,
    allowed_cores,
    choose_threads,
    environment,
    per_host_threads,
    wait_settings,
    worker_env,
)


# cores // processes, at least 1: 2 // 1 = 2; 2 // 2 = 1; 16 // 3 = 5 (one core left over); 2 // 4 = 0 -> 1
@pytest.mark.parametrize(
    ("cores", "processes", "threads"), [(2, 1, 2), (2, 2, 1), (16, 3, 5), (2, 4, 1), (1, 1, 1), (64, 8, 8)]
)
def test_cores_are_divided_among_the_processes_of_a_host(cores: int, processes: int, threads: int) -> None:
    assert choose_threads(cores, processes, {}) == ThreadChoice(threads, cores, processes, "cores")


def test_overrides_rlflow_before_omp_before_the_rule_and_a_fixed_number_before_both() -> None:
    both = {"RLFLOW_NUM_THREADS": "3", "OMP_NUM_THREADS": "1"}
    assert choose_threads(16, 2, both) == ThreadChoice(3, 16, 2, "RLFLOW_NUM_THREADS")
    # an empty RLFLOW_NUM_THREADS is unset; OMP_NUM_THREADS's first (outer-level) value counts
    omp = {"RLFLOW_NUM_THREADS": "", "OMP_NUM_THREADS": " 4,2"}
    assert choose_threads(16, 2, omp) == ThreadChoice(4, 16, 2, "OMP_NUM_THREADS")
    assert choose_threads(16, 2, both, fixed=6) == ThreadChoice(6, 16, 2, "DistConfig.threads")


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_an_invalid_override_is_a_host_error_naming_the_variable(value: str) -> None:
    with pytest.raises(HostError, match=rf"RLFLOW_NUM_THREADS='{value}': expected a whole number"):
        choose_threads(2, 1, {"RLFLOW_NUM_THREADS": value})


def test_ranks_sharing_a_host_share_its_cores() -> None:
    # host a: 8 cores, ranks 0 1 -> 4 each; host b: 4 cores, rank 2 alone -> 4
    got = per_host_threads(["a", "a", "b"], {"a": 8, "b": 4}, {})
    assert [(c.threads, c.processes) for c in got] == [(4, 2), (4, 2), (4, 1)]
    # 16 cores: three ranks -> 5 each, the fourth alone on its host -> 16; an override applies to every rank
    got = per_host_threads(["a", "a", "a", "b"], {"a": 16, "b": 16}, {})
    assert [c.threads for c in got] == [5, 5, 5, 16]
    got = per_host_threads(["a", "b"], {"a": 16, "b": 16}, {"OMP_NUM_THREADS": "2"})
    assert [c.threads for c in got] == [2, 2]


def test_wait_policy_is_passive_unless_the_user_set_one() -> None:
    assert wait_settings({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert wait_settings({"GOMP_SPINCOUNT": "1000"}) == {"GOMP_SPINCOUNT": "1000"}
    assert wait_settings({"OMP_WAIT_POLICY": "active"}) == {"OMP_WAIT_POLICY": "active"}
    assert worker_env(ThreadChoice(3, 8, 2, "cores"), {}) == {
        "OMP_NUM_THREADS": "3",
        "OMP_WAIT_POLICY": "PASSIVE",
    }


def test_the_line_says_threads_source_share_oversubscription_and_wait() -> None:
    line = ThreadChoice(2, 2, 1, "cores").line(wait={"OMP_WAIT_POLICY": "PASSIVE"})
    assert line == (
        "rlflow: threads: 2 per process (2 cores allowed / 1 process on this host), OMP_WAIT_POLICY=PASSIVE"
    )
    line = ThreadChoice(2, 2, 4, "RLFLOW_NUM_THREADS").line("per worker", wait={})
    assert "RLFLOW_NUM_THREADS=2; 2 cores allowed / 4 processes on this host: 8 threads on 2 cores" in line
    assert "OMP_WAIT_POLICY unset: waiting threads spin" in line


def test_environment_restores_what_it_set() -> None:
    os.environ.pop("RLFLOW_TEST_UNSET", None)
    os.environ["RLFLOW_TEST_SET"] = "before"
    try:
        with environment({"RLFLOW_TEST_UNSET": "1", "RLFLOW_TEST_SET": "during"}):
            assert (os.environ["RLFLOW_TEST_UNSET"], os.environ["RLFLOW_TEST_SET"]) == ("1", "during")
        assert "RLFLOW_TEST_UNSET" not in os.environ
        assert os.environ["RLFLOW_TEST_SET"] == "before"
    finally:
        os.environ.pop("RLFLOW_TEST_SET", None)


def _report_threads(rank: int, world: int) -> tuple[str | None, str | None, int]:
    import torch

    return os.environ.get("OMP_NUM_THREADS"), os.environ.get("OMP_WAIT_POLICY"), torch.get_num_threads()


@pytest.mark.slow
def test_a_spawned_worker_starts_with_the_chosen_threads_and_passive_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through run_group's spawn path (``spawn_group``, which the embedded launcher's pool uses too): no
    override set, so each of the 2 workers gets this host's allowed cores // 2, at least 1."""
    for name in ("RLFLOW_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    expected = max(1, allowed_cores() // 2)
    got = run_group(_report_threads, 2, timeout_s=120)
    assert got == [(str(expected), "PASSIVE", expected)] * 2
    assert "OMP_WAIT_POLICY" not in os.environ  # this process's environment is restored


def _report_env(rank: int, world: int, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    import multiprocessing
    import signal

    seen: dict[str, Any] = {n: os.environ.get(n) for n in names}
    seen["SIGTERM"] = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the fork server ignores it
    return multiprocessing.get_start_method(), seen


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_worker_sees_the_environment_of_its_start_whichever_the_start_method(
    method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two groups one after the other, the environment changed between them (a variable set, one removed):
    each group's workers see this process's environment as it was when they started, forked from the fork
    server (started, with its preloads, for the first group) or spawned, and SIGTERM's default action
    (the fork server itself ignores it: tests/test_signals.py sends it to a run's whole process group)."""
    monkeypatch.setenv("RLFLOW_WORKER_START", method)
    monkeypatch.setenv("RLFLOW_TEST_GONE", "1")
    monkeypatch.delenv("RLFLOW_TEST_SET", raising=False)
    names = ("RLFLOW_TEST_SET", "RLFLOW_TEST_GONE")
    first = run_group(_report_env, 2, (names,), timeout_s=300)
    monkeypatch.setenv("RLFLOW_TEST_SET", "2")
    monkeypatch.delenv("RLFLOW_TEST_GONE")
    second = run_group(_report_env, 2, (names,), timeout_s=300)
    assert [m for m, _ in first + second] == [method] * 4
    assert [e for _, e in first] == [{"RLFLOW_TEST_SET": None, "RLFLOW_TEST_GONE": "1", "SIGTERM": True}] * 2
    assert [e for _, e in second] == [{"RLFLOW_TEST_SET": "2", "RLFLOW_TEST_GONE": None, "SIGTERM": True}] * 2


# the fork server's exit, as the server runs it: the preload first, then what the preloaded modules register
SERVER_EXIT = """
import atexit
import rlflow.schedulers.runtime.distributed.preload
atexit.register(print, "atexit ran", flush=True)
class Held:
    def __del__(self):
        print("teardown ran", flush=True)
held = Held()
raise SystemExit  # how the server leaves its loop once its parent has gone
"""


@pytest.mark.slow
def test_the_fork_server_exits_after_its_atexit_handlers_without_the_interpreter_teardown() -> None:
    """In the fork server (``RLFLOW_FORK_SERVER=1`` while it starts) the atexit handlers of the modules it
    preloads still run, and then the process ends without the interpreter's teardown (module clearing and
    garbage collection of the preloaded torch/transformers heap, ~1.3 CPU s a run): a finaliser only the
    teardown would call is not called. Elsewhere the preload module changes nothing: it is."""
    import subprocess
    import sys

    for mark, lines in (("1", ["atexit ran"]), ("0", ["atexit ran", "teardown ran"])):
        env = {**os.environ, "RLFLOW_FORK_SERVER": mark}
        done = subprocess.run(
            [sys.executable, "-c", SERVER_EXIT], env=env, capture_output=True, text=True, timeout=120
        )
        assert (done.returncode, done.stdout.splitlines(), done.stderr) == (0, lines, ""), mark


def test_the_start_method_override_is_checked_and_cuda_decides_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from rlflow.schedulers.runtime.distributed.launch import worker_start_method

    assert worker_start_method({"RLFLOW_WORKER_START": "spawn"}) == "spawn"
    assert worker_start_method({"RLFLOW_WORKER_START": "forkserver"}) == "forkserver"
    with pytest.raises(HostError, match=r"RLFLOW_WORKER_START='fork': expected one of forkserver, spawn"):
        worker_start_method({"RLFLOW_WORKER_START": "fork"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert worker_start_method({}) == "spawn"  # a forked process cannot use an initialised CUDA driver
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker_start_method({}) == "forkserver"


def test_a_bad_start_method_stops_rlflow_run_before_anything_is_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """The override is read when the run starts, before its graph is loaded or a plan searched."""
    from rlflow.schedulers.cli import main

    monkeypatch.setenv("RLFLOW_WORKER_START", "fork")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the example's paths are the repository's
    run_dir = tmp_path / "run"
    assert main(["run", "examples/sft.yaml", f"run.output_dir={run_dir}", "plan=auto"]) != 0
    assert "RLFLOW_WORKER_START='fork': expected one of forkserver, spawn" in capsys.readouterr().err
    assert not run_dir.exists()
