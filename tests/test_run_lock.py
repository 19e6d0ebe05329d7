"""The run directory's lock (issue 14, failure 1): a live run holds its directory against a second run
(new, ``--overwrite``, ``--resume``), the lock dies with a SIGKILLed run, and ``rlflow runs`` tells a live
run from a dead "running" one by it. Two real processes: a run in a subprocess and ``rlflow`` here."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rlflow.schedulers.cli import main
from rlflow.schedulers.commands.runs import describe
from rlflow.schedulers.records.rundir import (
    LOCK_FILE,
    RunRecorder,
    latest_checkpoint,
    read_metrics,
    read_status,
)
from rlflow.schedulers.records.runlock import RunDirLock, lock_holder
from tests.harness import CLI

ROOT = Path(__file__).resolve().parents[1]
SFT = ["examples/sft.yaml", "run.eval_interval=0", "run.checkpoint_interval=1"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


def _start_run(run_dir: Path) -> subprocess.Popen[str]:
    """A long SFT run in another process; returns once it has written a checkpoint."""
    cmd = [*CLI, "run", *SFT, f"run.output_dir={run_dir}"]
    proc = subprocess.Popen(
        [*cmd, "run.iterations=100000", "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while latest_checkpoint(run_dir) is None:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the first run wrote no checkpoint within 120 s"
        time.sleep(0.1)
    return proc


@pytest.mark.slow
def test_a_live_run_keeps_its_directory_and_a_killed_one_leaves_no_lock(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    first = _start_run(run_dir)
    try:
        graph_yaml = (run_dir / "graph.yaml").read_text()
        holder = lock_holder(run_dir)
        assert holder is not None and (holder.pid, holder.host) == (first.pid, socket.gethostname())
        second = ["run", *SFT, f"run.output_dir={run_dir}", "run.iterations=2", "--no-progress"]
        holder_named = f"'{run_dir}' is in use by a live run (pid {first.pid} on host {socket.gethostname()}"
        for flags in (["--overwrite"], ["--resume"], []):
            code = main([*second, *flags])
            err = capsys.readouterr().err
            assert code == 2, (flags, err)
            assert err.count("\n") == 1 and err.startswith("rlflow run: error: "), err
            assert holder_named in err, err
            # nothing deleted or rewritten: the first run's files and status stand
            assert (run_dir / "graph.yaml").read_text() == graph_yaml
            assert latest_checkpoint(run_dir) is not None
            assert read_status(run_dir)["pid"] == first.pid
        assert describe(run_dir).status == "running"
        assert first.poll() is None, "the first run must still be running"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    assert lock_holder(run_dir) is None  # the kernel dropped it with the process
    assert read_status(run_dir)["state"] == "running"  # the dead run could not say otherwise
    assert describe(run_dir).status == "resumable"
    done = latest_checkpoint(run_dir)
    assert done is not None
    code = main(["run", *SFT, f"run.output_dir={run_dir}", f"run.iterations={done[0] + 1}", "--resume",
                 "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert read_status(run_dir)["state"] == "finished"
    assert read_metrics(run_dir).column("iteration").to_pylist()[-1] == done[0] + 1


def test_a_dead_running_status_whose_pid_lives_again_is_not_running(tmp_path: Path) -> None:
    """status.json says running with a pid that exists now (here: this test's own, as a recycled pid would)
    but nobody holds the lock: the run is dead."""
    rec = RunRecorder(tmp_path)
    rec.write_status("running", 3)
    assert read_status(tmp_path)["pid"] == os.getpid()
    (tmp_path / LOCK_FILE).write_text('{"pid": 1, "host": "elsewhere"}\n')  # left by a dead run
    assert describe(tmp_path).status == "failed"  # no checkpoint: not resumable
    with RunDirLock(tmp_path):
        assert describe(tmp_path).status == "running"


def test_overwrite_keeps_the_lock_file_and_a_failed_start_leaves_no_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert main(["run", *SFT, f"run.output_dir={run_dir}", "run.iterations=1", "--no-progress"]) == 0
    lock_inode = (run_dir / LOCK_FILE).stat().st_ino
    assert main(["run", *SFT, f"run.output_dir={run_dir}", "run.iterations=1", "--no-progress",
                 "--overwrite"]) == 0  # fmt: skip
    # one lock file for the directory's whole life: a new one could be locked beside the held one
    assert (run_dir / LOCK_FILE).stat().st_ino == lock_inode
    fresh = tmp_path / "fresh"
    assert main(["run", *SFT, f"run.output_dir={fresh}", "--resume", "--no-progress"]) == 2
    assert not fresh.exists()
