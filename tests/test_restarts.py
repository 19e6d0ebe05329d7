"""Supervised restarts (issue 39; docs/operations.md): a run that loses a worker resumes by itself.

The main test runs ``rlflow run examples/ppo.yaml`` on two workers (every node data parallel over both)
with ``--max-restarts 2``, SIGKILLs one worker while iteration 4 of 4 runs (a checkpoint every 2), and
checks that the run finishes by itself (exit 0) with the final weights of an uninterrupted run started beside
it, bit for bit, that it said so (one stderr line), recorded it (``status.json``, ``faults/*`` metrics,
``rlflow runs``) and left no process behind. The policy (no restart at ``max_restarts: 0``, the count within
the window, errors that are not a lost process, a stop signal while waiting) is tested on
:func:`rlflow.schedulers.runtime.restarts.supervise` itself with attempts that raise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from rlflow.dataflow.errors import NodeError, ProcessLost
from rlflow.dataflow.run_spec import RunSpec
from rlflow.schedulers.records.rundir import RunRecorder, read_status
from rlflow.schedulers.runtime.restarts import Restart, restart_line, supervise
from tests import harness

ROOT = Path(__file__).resolve().parent.parent
# every node data parallel over both workers (the reward function on worker 0)
PLAN_2 = """\
actor_gen: {devices: 0-1, layout: d2t1p1m1}
reward: {devices: 0, layout: d1t1p1m1}
ref: {devices: 0-1, layout: d2t1p1m1}
critic_values: {devices: 0-1, layout: d2t1p1m1}
actor_train: {devices: 0-1, layout: d2t1p1m1}
critic_train: {devices: 0-1, layout: d2t1p1m1}
"""
ITERATIONS = 4
CHECKPOINT_INTERVAL = 2


def _run(out: Path, plan: Path, err: Any, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [*harness.CLI, "run", "examples/ppo.yaml", "--devices", "2", "--plan", str(plan),
           f"run.iterations={ITERATIONS}", f"run.checkpoint_interval={CHECKPOINT_INTERVAL}",
           "run.eval_interval=0", f"run.output_dir={out}", "--no-progress", "--no-dashboard",
           *extra]  # fmt: skip
    # stderr to a file, not a pipe nobody reads while the run goes on
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)


def _workers(run: subprocess.Popen[bytes]) -> list[Any]:
    """The run's worker processes: the children of its multiprocessing fork server."""
    import psutil  # a dependency of vLLM

    def cmdline(proc: Any) -> str:
        try:
            return " ".join(proc.cmdline())
        except psutil.Error:  # exited (or a zombie) since it was listed
            return ""

    try:
        children = psutil.Process(run.pid).children()
        return [w for c in children if "forkserver" in cmdline(c) for w in c.children()]
    except psutil.Error:  # the run or its fork server exited meanwhile
        return []


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = run_dir / "checkpoints" / f"iter-{ITERATIONS:06d}" / "models"
    assert latest.is_dir(), f"no final checkpoint in {run_dir}"
    return {
        f"{path.relative_to(latest)}:{name}": tensor
        for path in sorted(latest.rglob("*.safetensors"))
        for name, tensor in load_file(path).items()
    }


def _status(proc: Any) -> str:
    import psutil

    try:
        return str(proc.status())
    except psutil.NoSuchProcess:
        return psutil.STATUS_DEAD


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    import psutil

    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_2)
    ref_dir, cut_dir = tmp_path / "uninterrupted", tmp_path / "supervised"
    with (tmp_path / "ref.err").open("wb") as ref_err, (tmp_path / "cut.err").open("wb") as cut_err:
        reference = _run(ref_dir, plan, ref_err)
        cut = _run(cut_dir, plan, cut_err, "--max-restarts", "2")
        try:
            # iteration 3's metrics are written: iteration 4 runs, after the checkpoint of iteration 2
            deadline = time.monotonic() + 240
            while not (cut_dir / "metrics" / "iter-000003.parquet").exists():
                assert cut.poll() is None, (tmp_path / "cut.err").read_text()
                assert time.monotonic() < deadline, "iteration 3 did not finish within 240 s"
                time.sleep(0.05)
            first = _workers(cut)
            assert len(first) == 2, first
            seen = [*psutil.Process(cut.pid).children(recursive=True)]
            killed = first[1].pid
            first[1].send_signal(signal.SIGKILL)
            assert cut.wait(timeout=240) == 0, (tmp_path / "cut.err").read_text()
            assert reference.wait(timeout=240) == 0, (tmp_path / "ref.err").read_text()
        finally:
            for proc in (reference, cut):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    err = (tmp_path / "cut.err").read_text()
    # the first attempt's processes (fork server, workers, their children) are all gone (a zombie, dead but
    # not yet reaped by the process it was re-parented to, is gone too)
    _, alive = psutil.wait_procs(seen, timeout=10)
    assert [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE] == []
    lines = [line for line in err.splitlines() if line.startswith("rlflow: restart ")]
    assert len(lines) == 1, err
    assert re.fullmatch(
        rf"rlflow: restart 1 of 2 \(worker lost\): worker rank [01] \(pid {killed}\) failed in the run "
        r"\(.*\): the worker .*died.*; resuming from checkpoint 2, 1 iteration lost",
        lines[0],
    ), lines
    # the same final weights as the uninterrupted run, bit for bit
    want, got = _weights(ref_dir), _weights(cut_dir)
    assert sorted(want) == sorted(got) and len(want) > 0
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    # recorded: the status's restart, and the first iteration after it (3: resumed from checkpoint 2)
    status = read_status(cut_dir)
    assert status is not None and status["state"] == "finished" and status["iteration"] == ITERATIONS
    (restart,) = status["restarts"]
    assert restart["cause"] == "worker" and restart["message"] in lines[0]
    assert (restart["from_iteration"], restart["resumed_iteration"]) == (3, 2)
    metrics = {
        it: pq.read_table(cut_dir / "metrics" / f"iter-{it:06d}.parquet").to_pylist()[0]
        for it in range(1, ITERATIONS + 1)
    }
    assert (metrics[3]["faults/restarts"], metrics[3]["faults/iterations_lost"]) == (1.0, 1.0)
    assert all("faults/restarts" not in metrics[it] for it in (1, 2, 4))
    shown = subprocess.run([*harness.CLI, "runs", str(tmp_path)], capture_output=True, text=True, check=True)
    assert "finished, restarted 1×" in shown.stdout and shown.stdout.count("restarted") == 1, shown.stdout


# -- the policy, on supervise itself --------------------------------------------------------------------


class Abandoned(BaseException):
    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


def _graph(tmp_path: Path, **run: Any) -> Any:
    """What supervise reads of a graph: its ``spec.run`` (a real RunSpec, so the keys are checked)."""
    return SimpleNamespace(spec=SimpleNamespace(run=RunSpec(output_dir=str(tmp_path), **run)))


class Attempts:
    """An attempt that raises ``errors`` in turn (then returns "done"), recording the restarts it got."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.restarts: list[Restart | None] = []

    def __call__(self, graph: Any, restart: Restart | None) -> str:
        self.restarts.append(restart)
        if self.errors:
            raise self.errors.pop(0)
        return "done"


def test_max_restarts_0_stops_at_the_first_lost_process_unchanged(tmp_path: Path) -> None:
    lost = ProcessLost("worker rank 1 (pid 7) failed in the run: the worker process died (killed by SIGKILL)")
    attempts = Attempts(lost)
    with pytest.raises(ProcessLost) as caught:
        supervise(attempts, _graph(tmp_path), abandon=Abandoned)
    assert caught.value is lost and attempts.restarts == [None]


def test_errors_a_restart_cannot_fix_stop_at_once(tmp_path: Path) -> None:
    """A node's raised error (a NaN loss, out of memory on the same plan: a worker's Failed reply is a
    NodeError), a checkpoint that could not be written, bad input: never restarted."""
    for error in (
        NodeError(
            "worker rank 0 failed in node 'actor_train' (iteration 3): RuntimeError: non-finite loss nan"
        ),
        NodeError("node 'actor_train' failed: OutOfMemoryError: CUDA out of memory"),
        OSError(28, "No space left on device"),
        ValueError("bad input"),
    ):
        attempts = Attempts(error)
        with pytest.raises(type(error)) as caught:
            supervise(attempts, _graph(tmp_path, max_restarts=5), abandon=Abandoned)
        assert caught.value is error and attempts.restarts == [None]


def test_restarts_within_the_window_are_counted_and_the_one_too_many_stops(
    tmp_path: Path, capsys: Any
) -> None:
    """max_restarts 2 in a 100 s window: failures at t = 0, 10, 20 give two restarts, the third stops
    naming the count; at t = 0, 10, 105, 109 the first restart has left the window by t = 105 (105 - 0 >=
    100), so the restart at 105 is allowed (one in the window: 10), and at 109 two are (10, 105): stop."""
    (tmp_path / "status.json").write_text(json.dumps({"state": "failed", "iteration": 4, "pid": os.getpid()}))
    run = {"max_restarts": 2, "restart_window_s": 100.0}

    def lost(n: int) -> ProcessLost:
        return ProcessLost(f"worker rank 1 (pid {n}) failed in the run: killed\nsecond line", "worker")

    attempts = Attempts(lost(1), lost(2), lost(3))
    clock = iter([0.0, 10.0, 20.0])
    with pytest.raises(
        ProcessLost, match=r"\(pid 3\) .*: killed; not restarted: 2 restarts within the last 100 s"
    ) as e:
        supervise(attempts, _graph(tmp_path, **run), abandon=Abandoned, clock=lambda: next(clock))
    assert e.value.cause == "worker"
    assert len(attempts.restarts) == 3 and attempts.restarts[0] is None
    restart = attempts.restarts[1]
    assert restart is not None
    # no checkpoint: started again from 0; this process's status said iteration 4 was done
    assert (restart.cause, restart.from_iteration, restart.resumed_iteration) == ("worker", 4, 0)
    assert restart.message == "worker rank 1 (pid 1) failed in the run: killed"
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "rlflow: restart 1 of 2 (worker lost): worker rank 1 (pid 1) failed in the run: killed; starting "
        "again (no checkpoint yet), 4 iterations lost",
        "rlflow: restart 2 of 2 (worker lost): worker rank 1 (pid 2) failed in the run: killed; starting "
        "again (no checkpoint yet), 4 iterations lost",
    ]
    attempts = Attempts(lost(1), lost(2), lost(3), lost(4))
    clock = iter([0.0, 10.0, 105.0, 109.0])
    with pytest.raises(ProcessLost, match=r"\(pid 4\).*not restarted: 2 restarts within"):
        supervise(attempts, _graph(tmp_path, **run), abandon=Abandoned, clock=lambda: next(clock))
    assert len(attempts.restarts) == 4
    attempts = Attempts(lost(1), lost(2))
    clock = iter([0.0, 10.0])
    assert (
        supervise(attempts, _graph(tmp_path, **run), abandon=Abandoned, clock=lambda: next(clock)) == "done"
    )


def test_a_restart_resumes_from_the_newest_checkpoint_and_names_what_was_lost(tmp_path: Path) -> None:
    for it in (2, 4):  # sound as far as checkpoint_check reads them: a whole state.pt
        (tmp_path / "checkpoints" / f"iter-{it:06d}").mkdir(parents=True)
        torch.save({"iteration": it}, tmp_path / "checkpoints" / f"iter-{it:06d}" / "state.pt")
    rec = RunRecorder(tmp_path)
    rec.write_status("failed", 5)  # this process's run had finished iteration 5
    attempts = Attempts(ProcessLost("vLLM engine process 9 was killed by SIGKILL", "engine"))
    assert supervise(attempts, _graph(tmp_path, max_restarts=1), abandon=Abandoned, wait=_no_wait) == "done"
    restart = attempts.restarts[1]
    assert restart is not None and (restart.from_iteration, restart.resumed_iteration) == (5, 4)
    assert restart.iterations_lost == 1 and restart.cause == "engine"
    assert restart_line(restart, 1, 1) == (
        "rlflow: restart 1 of 1 (engine lost): vLLM engine process 9 was killed by SIGKILL; resuming from "
        "checkpoint 4, 1 iteration lost"
    )
    # the status of another process (an earlier invocation) says nothing of this one's iterations
    (tmp_path / "status.json").write_text(json.dumps({"state": "failed", "iteration": 9, "pid": 1}))
    attempts = Attempts(ProcessLost("lost", "worker"))
    supervise(attempts, _graph(tmp_path, max_restarts=1), abandon=Abandoned, wait=_no_wait)
    assert attempts.restarts[1] is not None and attempts.restarts[1].iterations_lost == 0


def _no_wait(graph: Any, error: ProcessLost, deadline: float) -> Any:
    return graph


def test_a_restart_that_dies_in_its_start_up_is_still_recorded_and_loses_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first attempt finished 3 iterations (no checkpoint) and lost a worker; restart 1 loses a worker
    as its workers start (make_executor raises, nothing run); restart 2 runs. Both restarts are in
    ``status.json`` and the first iteration's ``faults/restarts`` is 2, not 1 (restart 1 used to be dropped:
    it was recorded only once its workers had started); restart 2 lost 0 iterations (restart 1 had
    started again from 0 and run none), not 3 again."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime import controller as controller_module

    out = tmp_path / "run"
    graph = load_graph(ROOT / "examples/sft.yaml", [f"run.output_dir={out}", "run.iterations=1",
                                                    "run.eval_interval=0", "run.max_restarts=2"])  # fmt: skip
    graph = resolve_plan(graph, None)
    RunRecorder(out).write_status("failed", 3)  # this process's first attempt had finished iteration 3
    in_start_up = ProcessLost("worker rank 0 (pid 5) failed in start-up: killed by SIGKILL", "worker")
    real_make_executor = controller_module.make_executor
    restarts: list[Restart | None] = []

    def attempt(graph: Any, restart: Restart | None) -> str:
        restarts.append(restart)
        if restart is None:
            raise ProcessLost("worker rank 1 (pid 4) failed in the run: killed by SIGKILL", "worker")

        def make_executor(*args: Any, **kwargs: Any) -> Any:
            if len(restarts) == 2:
                raise in_start_up
            return real_make_executor(*args, **kwargs)

        monkeypatch.setattr(controller_module, "make_executor", make_executor)
        c = controller_module.Controller(graph, restart=restart)
        try:
            c.run()
        finally:
            c.close()
        return "done"

    assert supervise(attempt, graph, abandon=Abandoned, wait=_no_wait) == "done"
    first, second = restarts[1], restarts[2]
    assert first is not None and second is not None
    assert (first.iterations_lost, second.iterations_lost) == (3, 0)
    status = read_status(out) or {}
    assert status["state"] == "finished"
    assert [r["message"] for r in status["restarts"]] == [first.message, second.message]
    assert second.message == str(in_start_up)
    (row,) = pq.read_table(out / "metrics" / "iter-000001.parquet").to_pylist()
    assert (row["faults/restarts"], row["faults/iterations_lost"]) == (2.0, 0.0)


def test_a_run_out_of_restarts_says_how_to_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every start loses a worker (make_executor raises); --max-restarts 1: the restart is recorded, the
    second loss stops the run (exit 2) with one line that names the count and, as a stop without restarts
    does, how to go on (here no checkpoint: --overwrite; with one: ``--resume continues from checkpoint
    N``)."""
    from rlflow.schedulers.cli import main
    from rlflow.schedulers.runtime import controller as controller_module

    def make_executor(*args: Any, **kwargs: Any) -> Any:
        raise ProcessLost("worker rank 1 (pid 4) failed in start-up: killed by SIGKILL", "worker")

    monkeypatch.setattr(controller_module, "make_executor", make_executor)
    out = tmp_path / "run"
    argv = ["run", str(ROOT / "examples/sft.yaml"), f"run.output_dir={out}", "--max-restarts", "1",
            "--no-progress", "--no-dashboard"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (
        "rlflow run: error: worker rank 1 (pid 4) failed in start-up: killed by SIGKILL; not restarted: 1 "
        "restart within the last 3600 s already (run.max_restarts=1, run.restart_window_s=3600); no "
        "checkpoint yet: start it again with --overwrite"
    ), err
    status = read_status(out) or {}
    assert (status["state"], status["iteration"], len(status["restarts"])) == ("failed", 0, 1)


def test_a_stop_signal_while_a_restart_waits_stops_the_run(tmp_path: Path) -> None:
    """SIGTERM during the wait for resources raises the stop exception: no restart (``rlflow run`` then
    prints one line and exits 143)."""
    waited: list[float] = []

    def wait(graph: Any, error: ProcessLost, deadline: float) -> Any:
        waited.append(deadline)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler raises here
        raise AssertionError("SIGTERM did not stop the wait")

    attempts = Attempts(ProcessLost("lost", "ray_node"))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Abandoned, match="while waiting to restart after: lost") as caught:
        supervise(attempts, _graph(tmp_path, max_restarts=3, restart_wait_s=30.0), abandon=Abandoned,
                  clock=lambda: 100.0, wait=wait)  # fmt: skip
    assert caught.value.signum == signal.SIGTERM and waited == [130.0] and len(attempts.restarts) == 1
    assert signal.getsignal(signal.SIGTERM) == before


def test_restart_keys_are_checked_naming_the_key() -> None:
    for key, value, why in (
        ("max_restarts", -1, "must be >= 0"),
        ("max_restarts", 1.5, "expected an integer"),
        ("restart_window_s", 0, "must be > 0"),
        ("restart_wait_s", -1.0, "must be >= 0"),
    ):
        with pytest.raises(Exception, match=rf"run\.{key}: {why}"):
            RunSpec(**{key: value})


def test_the_status_keeps_its_restarts_through_later_writes_and_a_resume(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    rec.write_status("running", 0)
    assert "restarts" not in (read_status(tmp_path) or {})
    record = Restart("2026-12-06T16:00:00Z", "worker", "worker rank 1 lost", 3, 2).record()
    rec.restarts.append(record)
    rec.write_status("running", 3)
    rec.write_status("finished", 5)
    assert (read_status(tmp_path) or {})["restarts"] == [record]
    again = RunRecorder(tmp_path)  # a resumed run continues the list
    again.write_status("running", 5)
    assert (read_status(tmp_path) or {})["restarts"] == [record]


def test_rotation_keeps_sound_checkpoints_and_never_counts_one_set_aside(tmp_path: Path) -> None:
    """keep_checkpoints 2: checkpoints 2 and 3 after three saves; 3 damaged (state.pt truncated), set aside as
    iter-000003.broken by a resume (or a restart) that resumes from 2; the resumed run saves 3 and 4: the
    two kept are the sound 3 and 4 (2 removed as the oldest of three sound ones), the broken one is kept aside
    (evidence, never resumed from) and was never one of the two."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.records.checkpoint_check import set_aside_broken
    from rlflow.schedulers.records.rundir import latest_checkpoint, list_checkpoints
    from rlflow.schedulers.runtime.checkpoints import save_checkpoint

    graph = load_graph(ROOT / "examples/sft.yaml", [f"run.output_dir={tmp_path}", "run.keep_checkpoints=2"])
    executor = SimpleNamespace(save_models=lambda path: path.mkdir(), state_dict=lambda: {})
    stream = SimpleNamespace(state_dict=lambda: {})
    rec = RunRecorder(tmp_path)
    for it in (1, 2, 3):
        save_checkpoint(rec, it, graph, executor, stream)  # type: ignore[arg-type]
    assert [i for i, _ in list_checkpoints(tmp_path)] == [2, 3]
    state = tmp_path / "checkpoints" / "iter-000003" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.warns(
        UserWarning, match=r"iteration 3 is broken: .*state.pt.*set aside as iter-000003.broken"
    ):
        set_aside_broken(tmp_path)
    assert latest_checkpoint(tmp_path) == (2, tmp_path / "checkpoints" / "iter-000002")
    for it in (3, 4):
        save_checkpoint(rec, it, graph, executor, stream)  # type: ignore[arg-type]
    assert [i for i, _ in list_checkpoints(tmp_path)] == [3, 4]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["iter-000003", "iter-000003.broken", "iter-000004", "latest"]
    assert os.readlink(tmp_path / "checkpoints" / "latest") == "iter-000004"


@pytest.mark.slow
def test_ctrl_c_while_workers_start_stops_the_run_even_with_sigint_inherited_ignored(tmp_path: Path) -> None:
    """A 2-worker run started as a shell's background job starts with SIGINT ignored; a Ctrl-C after its
    run directory exists but before its run loop (here: as its workers start) used to be lost, so the run
    went on (a test waiting for exit 130 then hung). It stops: exit 130, one line, no process left."""
    import psutil

    cmd = [*harness.CLI, "run", "examples/sft.yaml", "--devices", "2", "plan.actor_train.devices=0-1",
           "plan.actor_train.layout=d2t1p1m1", "run.iterations=2", "run.eval_interval=0",
           f"run.output_dir={tmp_path / 'run'}", "--no-progress", "--no-dashboard"]  # fmt: skip

    def ignore_sigint() -> None:  # what a non-interactive shell does for a command started with &
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with (tmp_path / "err").open("wb") as err:
        run = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=ignore_sigint)
        try:
            deadline = time.monotonic() + 120
            while not _workers(run):  # the fork server has started a worker: the pool is starting
                assert run.poll() is None, (tmp_path / "err").read_text()
                assert time.monotonic() < deadline, "no worker started within 120 s"
                time.sleep(0.02)
            tree = psutil.Process(run.pid).children(recursive=True)
            assert not (tmp_path / "run" / "metrics").is_dir() or not list(
                (tmp_path / "run" / "metrics").iterdir()
            )
            run.send_signal(signal.SIGINT)
            assert run.wait(timeout=120) == 130, (tmp_path / "err").read_text()
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    assert "rlflow run: interrupted" in (tmp_path / "err").read_text()
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert [p for p in alive if _status(p) != psutil.STATUS_ZOMBIE] == []


def test_restarts_on_a_plan_with_no_process_to_lose_are_a_named_warning() -> None:
    """``run.max_restarts`` on a one-device plan (every node in the ``rlflow run`` process, its one vLLM
    engine too) restarts nothing: a GraphWarning naming file and key says so; a 2-worker plan (a worker to
    lose) and ``max_restarts: 0`` warn nothing."""
    import warnings

    from rlflow.dataflow.graph import GraphWarning
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.runtime.restarts import warn_if_nothing_to_restart

    source = str(ROOT / "examples" / "ppo.yaml")
    one = load_graph(source, ["run.max_restarts=2"])
    with pytest.warns(GraphWarning, match=r"ppo\.yaml: run\.max_restarts: 2, but the plan runs in this"):
        warn_if_nothing_to_restart(one)
    plan = [f"plan.{n}.{k}={v}" for n in ("actor_gen", "ref", "critic_values", "actor_train", "critic_train")
            for k, v in (("devices", "0-1"), ("layout", "d2t1p1m1"))]  # fmt: skip
    two = load_graph(source, ["run.max_restarts=2", "run.devices=2", *plan])
    off = load_graph(source, ["run.max_restarts=0"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        warn_if_nothing_to_restart(two)
        warn_if_nothing_to_restart(off)
