"""SIGTERM and SIGHUP stop a run like Ctrl-C (issue 14, failure 2): the iteration in flight finishes
within ``--stop-timeout`` (else it is abandoned), a checkpoint is written, the status says so, the exit
status is 128 + the signal's number, and ``--resume`` continues. Real signals to real processes, one
process and a controller with 2 workers signalled as a process group (as Slurm and Kubernetes do)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from rlflow.schedulers.cli import main
from rlflow.schedulers.records.rundir import latest_checkpoint, read_metrics, read_status
from tests import harness

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # CLI runs in their own processes
CLI = [*harness.CLI, "run"]
SFT = ["examples/sft.yaml", "run.eval_interval=0", "--no-progress"]
# seconds without a logged iteration before a run counts as hung: an iteration takes seconds alone, but a
# shared 2-core host under other runs starved one for over 180 s (a CI simulation of 2026-12-02)
HANG_S = 600

# SFT's train node data parallel (FSDP2) over 2 workers
PLAN_2 = "actor_train: {devices: 0-1, layout: d2t1p1m1}\n"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # example graphs name paths relative to the repository root
    torch.set_num_threads(1)


def _iterations_done(run_dir: Path) -> int:
    return len(list((run_dir / "metrics").glob("iter-*")))


def _signal_after(
    cmd: list[str], run_dir: Path, iterations: int, signum: int, *, checkpointed: bool = False
) -> tuple[int, str]:
    """Start ``cmd`` in a new process group, send ``signum`` to the whole group once ``iterations`` are
    logged (and, with ``checkpointed``, saved as a checkpoint); the exit status and stderr."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )

    def ready() -> bool:
        if _iterations_done(run_dir) < iterations:
            return False
        return not checkpointed or (latest_checkpoint(run_dir) or (0,))[0] >= iterations

    try:
        deadline = time.monotonic() + HANG_S
        while not ready():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, f"no progress within {HANG_S} s"
            time.sleep(0.1)
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err


def _resume(cmd: list[str], iterations: int) -> None:
    """Continue the run of ``cmd`` to ``iterations`` with ``--resume``, in this process."""
    assert cmd[: len(CLI)] == CLI
    assert main([*cmd[len(CLI) - 1 :], f"run.iterations={iterations}", "--resume"]) == 0


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_save_and_stop(signum: int, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [*CLI, *SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=0"]
    code, err = _signal_after([*cmd, "run.iterations=100000"], run_dir, 2, signum)
    name = signal.Signals(signum).name
    assert code == 128 + signum, err
    assert f"stopped by {name} after iteration" in err and "--resume" in err, err
    assert "Traceback" not in err, err
    found = latest_checkpoint(run_dir)
    last = read_metrics(run_dir).column("iteration").to_pylist()[-1]
    assert found is not None and found[0] == last  # checkpoint_interval=0: only the stop saved it
    status = read_status(run_dir)
    assert status is not None and (status["state"], status["iteration"]) == ("interrupted", last)
    _resume(cmd, last + 1)
    assert read_status(run_dir)["state"] == "finished"
    assert read_metrics(run_dir).column("iteration").to_pylist()[-1] == last + 1


def test_an_iteration_past_the_stop_timeout_is_abandoned(tmp_path: Path) -> None:
    """--stop-timeout bounds the wait: past it the iteration in flight is abandoned, the previous
    checkpoint stays and the run resumes from it."""
    run_dir = tmp_path / "run"
    cmd = [*CLI, *SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=1"]
    # 200 epochs: iteration 2 takes seconds, so a signal once checkpoint 1 exists lands inside it (a signal
    # while a checkpoint is written waits for it: test_a_stop_signal_during_a_checkpoint_lets_it_finish)
    slow = [*cmd, "run.iterations=100000", "nodes.actor_train.epochs=200", "--stop-timeout", "0.001"]
    code, err = _signal_after(slow, run_dir, 1, signal.SIGTERM, checkpointed=True)
    assert code == 128 + signal.SIGTERM, err
    assert "rlflow run: stopped by SIGTERM: the iteration in flight ran past 0.001 s" in err, err
    assert "abandoned" in err and "Traceback" not in err, err
    found = latest_checkpoint(run_dir)
    assert found is not None and found[0] == 1
    assert "iteration 2 abandoned" in err, err
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert read_status(run_dir)["state"] == "failed"
    _resume(cmd, found[0] + 1)
    assert read_status(run_dir)["state"] == "finished"


def test_a_stop_signal_during_a_checkpoint_lets_it_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A SIGTERM that lands while a scheduled checkpoint is written (the iteration is done) is no reason
    to abandon anything: the stop timeout's alarm must not tear the save (a CI run of 2026-12-05 saw
    OmegaConf turn the alarm's exception into a ConfigKeyError there). The save finishes and the run stops
    on it, in process, with a real signal."""
    from rlflow.schedulers.runtime import controller

    real_save = controller.save_checkpoint

    def save_while_signalled(recorder, iteration, *args, **kwargs):  # type: ignore[no-untyped-def]
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.3)  # far past the 0.001 s stop timeout: an armed alarm would go off here
        return real_save(recorder, iteration, *args, **kwargs)

    monkeypatch.setattr(controller, "save_checkpoint", save_while_signalled)
    run_dir = tmp_path / "run"
    args = [*SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=1", "run.iterations=5"]
    assert main(["run", *args, "--stop-timeout", "0.001"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    assert "stopped by SIGTERM after iteration 2 (checkpoint saved)" in err and "abandoned" not in err, err
    assert latest_checkpoint(run_dir)[0] == 2  # type: ignore[index]
    assert read_status(run_dir)["state"] == "interrupted"
    assert main(["run", *args, "--resume"]) == 0
    assert read_metrics(run_dir).column("iteration").to_pylist() == [1, 2, 3, 4, 5]


def test_sigterm_to_the_process_group_of_a_2_worker_run_saves(tmp_path: Path) -> None:
    """The workers share the controller's process group; they ignore the group's SIGTERM and the
    controller finishes the iteration on them, saves and stops them."""
    run_dir = tmp_path / "run"
    plan = tmp_path / "plan.yaml"
    plan.write_text(PLAN_2)
    cmd = [*CLI, *SFT, f"run.output_dir={run_dir}", "run.devices=2", "--plan", str(plan),
           "run.checkpoint_interval=0"]  # fmt: skip
    code, err = _signal_after([*cmd, "run.iterations=100000"], run_dir, 1, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM after iteration" in err and "Traceback" not in err, err
    found = latest_checkpoint(run_dir)
    last = read_metrics(run_dir).column("iteration").to_pylist()[-1]
    assert found is not None and found[0] == last
    assert read_status(run_dir)["state"] == "interrupted"
    _resume(cmd, last + 1)
    assert read_metrics(run_dir).column("iteration").to_pylist()[-1] == last + 1


def test_two_sigterms_before_the_first_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second SIGTERM abandons the iteration in flight before any checkpoint exists: the hint says to
    start again with --overwrite (--resume has nothing to continue from and says the same), and the
    abandoned iteration leaves no trace or metrics file behind."""
    run_dir = tmp_path / "run"
    # 200 epochs per iteration: an iteration takes seconds, so both signals land inside iteration 2
    cmd = [
        *CLI,
        *SFT,
        f"run.output_dir={run_dir}",
        "run.checkpoint_interval=0",
        "nodes.actor_train.epochs=200",
    ]
    proc = subprocess.Popen(
        [*cmd, "run.iterations=100000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    lines: list[str] = []
    first_handled = threading.Event()

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "stopping after this iteration" in line:
                first_handled.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + HANG_S
        while _iterations_done(run_dir) < 1:
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, f"no progress within {HANG_S} s"
            time.sleep(0.05)
        # iteration 1 is logged; a signal right now could still reach the run's stop check of iteration 1
        # (which would save iteration 1 and have the second signal abandon that): let iteration 2 begin
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGTERM)
        # the second signal only once the first is handled ("stopping after this iteration")
        assert first_handled.wait(60), "".join(lines)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
        reader.join(timeout=10)
        err = "".join(lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert latest_checkpoint(run_dir) is None, err  # the second signal came before iteration 2 was saved
    assert "a second stop signal (SIGTERM): iteration 2 abandoned; no checkpoint yet: start it again with " \
        "--overwrite" in err, err  # fmt: skip
    assert "Traceback" not in err, err
    assert sorted(p.name for p in (run_dir / "trace").iterdir()) == ["iter-000001.parquet"]
    assert sorted(p.name for p in (run_dir / "metrics").iterdir()) == ["iter-000001.parquet"]
    assert read_status(run_dir)["state"] == "failed"
    args = [*cmd[len(CLI) - 1 :], "run.iterations=1", "nodes.actor_train.epochs=1"]
    assert main([*args, "--resume"]) == 2
    assert "no checkpoint in run directory" in (err := capsys.readouterr().err) and "--overwrite" in err
    assert main([*args, "--overwrite"]) == 0  # what the hint says works
    assert read_status(run_dir)["state"] == "finished"
