"""What the OS refuses is a one-line ``rlflow <cmd>: error:`` naming the file or option, with no
traceback unless ``--debug`` or ``RLFLOW_DEBUG=1`` (issue 14, failure 5); and ``rlflow run`` checks the
run directory before it plans (failure 6's "the planner runs before the directory check")."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.schedulers.cli import main
from rlflow.schedulers.commands import run as run_cmd
from rlflow.schedulers.commands import stage as stage_cmd
from rlflow.schedulers.records.rundir import latest_checkpoint, list_checkpoints, read_status
from rlflow.schedulers.runtime import checkpoints

ROOT = Path(__file__).resolve().parents[1]
SFT = ["run", "examples/sft.yaml", "run.eval_interval=0", "run.iterations=1", "--no-progress"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("RLFLOW_DEBUG", raising=False)
    torch.set_num_threads(1)


def _one_line_error(err: str, *parts: str) -> None:
    """``err`` ends with one ``rlflow run: error:`` line holding ``parts`` (progress lines may precede)."""
    lines = err.splitlines()
    assert lines and lines[-1].startswith("rlflow run: error: "), err
    assert sum("error" in line for line in lines) == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in lines[-1], (part, err)


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_a_metrics_port_in_use_is_one_line_before_anything_runs(
    busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main([*SFT, f"run.output_dir={tmp_path / 'run'}", "--metrics-port", str(busy_port)])
    assert code == 2
    _one_line_error(capsys.readouterr().err, f"--metrics-port {busy_port}", "Address already in use")
    assert not (tmp_path / "run").exists()


def test_debug_adds_the_traceback(
    busy_port: int, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [*SFT, f"run.output_dir={tmp_path / 'run'}", "--metrics-port", str(busy_port)]
    for argv in (["--debug", *args], [*args, "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" in err and err.endswith("Address already in use\n"), err
    monkeypatch.setenv("RLFLOW_DEBUG", "1")
    assert main(args) == 2
    assert "Traceback" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_port_out_of_range_is_an_argument_error(port: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([*SFT, "--metrics-port", port])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "rlflow run: error: argument --metrics-port: " in err and "Traceback" not in err, err


def test_a_metrics_host_not_on_this_machine_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 192.0.2.1: TEST-NET-1 (RFC 5737), never a local address
    code = main([*SFT, f"run.output_dir={tmp_path}", "--metrics-port", "0", "--metrics-host", "192.0.2.1"])
    assert code == 2
    _one_line_error(capsys.readouterr().err, "--metrics-host 192.0.2.1", "Cannot assign requested address")


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert main([*SFT, f"run.output_dir={target}", *extra]) == 2
        _one_line_error(capsys.readouterr().err, f"run.output_dir '{target}' is a file, not a directory")
    assert target.read_text() == "mine"


@contextlib.contextmanager
def _read_only(path: Path) -> Iterator[Path]:
    """Make directory ``path`` unwritable for this process: mode 0555, or for root (who ignores modes)
    immutable; skip the test where root cannot (no chattr, or a file system without the flag)."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)]).returncode != 0:
        pytest.skip("running as root on a file system without chattr +i: no directory is read-only")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot write."""
    path = tmp_path / "ro"
    path.mkdir()
    with _read_only(path):
        yield path


def _listing(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


@pytest.mark.parametrize("blocked", [".", "metrics"])
def test_a_failed_overwrite_deletes_nothing(
    blocked: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite of a run directory with an entry it cannot delete (the directory itself, or its
    metrics/ after trace/ in the listing) refuses before deleting anything, naming the option and the path;
    the run stays whole and resumable."""
    run_dir = tmp_path / "run"
    args = [*SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=1"]
    assert main([*args, "run.iterations=2"]) == 0
    before = _listing(run_dir)
    capsys.readouterr()
    with _read_only(run_dir / blocked):
        assert main([*args, "run.iterations=2", "--overwrite"]) == 2
        where = run_dir if blocked == "." else run_dir / blocked
        _one_line_error(
            capsys.readouterr().err, "--overwrite: cannot delete", str(where), "nothing was deleted"
        )
        assert _listing(run_dir) == before
    assert main([*args, "run.iterations=3", "--resume"]) == 0  # still a whole run


def test_an_interrupted_overwrite_leaves_nothing_to_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deletion the check could not foresee fails half-way: the checkpoints went first, so --resume
    refuses the directory, and a second --overwrite (status.json, deleted last, still marks it a run)
    empties it."""
    from rlflow.schedulers.records import rundir

    run_dir = tmp_path / "run"
    args = [*SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=1", "run.iterations=1"]
    assert main(args) == 0
    real_rmtree = shutil.rmtree

    def rmtree(path: Any, *a: Any, **kw: Any) -> None:
        if Path(path).name in ("metrics", "trace"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(rundir.shutil, "rmtree", rmtree)
    assert main([*args, "--overwrite"]) == 2
    _one_line_error(
        capsys.readouterr().err, "--overwrite: deleting", "Input/output error", "--resume refuses"
    )
    assert latest_checkpoint(run_dir) is None and (run_dir / "status.json").is_file()
    assert main([*args, "--resume"]) == 2
    assert "no checkpoint in run directory" in capsys.readouterr().err
    monkeypatch.setattr(rundir.shutil, "rmtree", real_rmtree)
    assert main([*args, "--overwrite"]) == 0
    assert latest_checkpoint(run_dir) is not None


def test_a_read_only_output_dir_is_one_line(read_only_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = read_only_dir / "run"
    assert main([*SFT, f"run.output_dir={run_dir}"]) == 2
    _one_line_error(capsys.readouterr().err, f"run.output_dir '{run_dir}' is not writable")
    assert main([*SFT, f"run.output_dir={read_only_dir}"]) == 2
    _one_line_error(capsys.readouterr().err, f"run.output_dir '{read_only_dir}' is not writable")


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "state.pt"), "No space left on device: state.pt"),
        # how torch's zip writer reports a full disk
        (
            RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 128 vs 64"),
            "[enforce fail at inline_container.cc:626] . unexpected pos 128 vs 64",
        ),
    ],
    ids=["oserror", "torch"],
)
def test_a_full_disk_while_checkpointing_is_one_line_and_resumable(
    failure: BaseException,
    reason: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second checkpoint's write fails: the error says it was not written and where a resume starts;
    the temporary checkpoint is gone, the first one stays, and --resume continues from it."""
    run_dir = tmp_path / "run"
    real_save = torch.save
    calls = []

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(f)
        if len(calls) == 2:
            raise failure
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(checkpoints.torch, "save", save)
    args = [*SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=1"]
    assert main([*args, "run.iterations=3"]) == 2
    _one_line_error(
        capsys.readouterr().err,
        f"checkpoint after iteration 2 was not written ({reason}",
        "--resume continues from checkpoint 1",
    )
    assert [i for i, _ in list_checkpoints(run_dir)] == [1]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert read_status(run_dir)["state"] == "failed"
    monkeypatch.setattr(checkpoints.torch, "save", real_save)
    assert main([*args, "run.iterations=2", "--resume"]) == 0
    assert latest_checkpoint(run_dir) is not None and latest_checkpoint(run_dir)[0] == 2  # type: ignore[index]


def test_an_os_error_no_check_foresaw_names_the_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(args: Any) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "runs/x/metrics/iter-000001.parquet")

    monkeypatch.setattr(run_cmd, "run", fail)
    assert main(SFT) == 2  # the status of every other error the user or the host causes
    assert capsys.readouterr().err == (
        "rlflow run: error: Read-only file system: runs/x/metrics/iter-000001.parquet\n"
    )


def test_an_os_error_without_a_file_says_what_it_can(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write on an open file reports a full disk without a file name: the errno and where to look."""

    def fail(args: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(run_cmd, "run", fail)
    assert main(SFT) == 2
    assert capsys.readouterr().err == (
        "rlflow run: error: No space left on device (ENOSPC, the OS named no file); --debug shows where\n"
    )


def test_a_full_disk_in_the_weights_writer_is_one_line_and_resumable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """safetensors reports a full disk as its own SafetensorError (not an OSError): the second checkpoint's
    weights fail through the real writer (Hugging Face's save_pretrained -> safetensors); one line, the
    previous checkpoint named, and --resume continues from it."""
    import safetensors.torch
    import transformers.modeling_utils
    from safetensors import SafetensorError

    run_dir = tmp_path / "run"
    real = safetensors.torch.save_file
    calls: list[str] = []

    def save_file(tensors: Any, filename: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(str(filename))
        if "iter-000002" in str(filename):  # the temporary directory of checkpoint 2
            message = 'IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
            raise SafetensorError(f"Error while serializing: {message}")
        real(tensors, filename, *args, **kwargs)

    # transformers binds the function by name at import: patch both
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)
    args = [*SFT, f"run.output_dir={run_dir}", "run.checkpoint_interval=1"]
    assert main([*args, "run.iterations=3"]) == 2
    _one_line_error(
        capsys.readouterr().err,
        "checkpoint after iteration 2 was not written (No space left on device)",
        "--resume continues from checkpoint 1",
    )
    assert any("iter-000002" in c for c in calls)  # the failure came through the real writer
    assert [i for i, _ in list_checkpoints(run_dir)] == [1]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert read_status(run_dir)["state"] == "failed"
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real)
    assert main([*args, "run.iterations=2", "--resume"]) == 0
    assert latest_checkpoint(run_dir) is not None and latest_checkpoint(run_dir)[0] == 2  # type: ignore[index]


@pytest.mark.parametrize("state", ["checkpoints", "locked", "file"])
def test_the_run_directory_is_checked_before_planning(
    state: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlflow.schedulers.records.runlock import RunDirLock

    run_dir = tmp_path / "run"
    if state == "file":
        run_dir.write_text("")
    else:
        assert main([*SFT, f"run.output_dir={run_dir}"]) == 0
    capsys.readouterr()

    def planned(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("planned before checking the run directory")

    monkeypatch.setattr(stage_cmd, "resolve_plan", planned)
    argv = [*SFT, f"run.output_dir={run_dir}", "plan=auto", "run.devices=2"]
    if state == "locked":
        with RunDirLock(run_dir):
            assert main([*argv, "--overwrite"]) == 2
    else:
        assert main(argv) == 2
    message = {
        "checkpoints": "already holds checkpoints",
        "locked": "in use by a live run",
        "file": "is a file",
    }
    _one_line_error(capsys.readouterr().err, message[state])


@pytest.mark.slow
def test_a_failed_worker_is_one_line_and_debug_adds_its_traceback(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's failure reaches the user as one line (the worker's own traceback would repeat its last
    line: fresh-user finding) with a pointer to ``--debug``, which prints that traceback too."""
    from rlflow.schedulers.runtime.distributed.pool import worker_error

    tb = 'Traceback (most recent call last):\n  File "w.py", line 1\nRuntimeError: engine core died\n'

    def failing(args: object) -> int:
        raise worker_error(1, "node 'actor_gen' (iteration 3)", "RuntimeError: engine core died", tb)

    monkeypatch.setattr(run_cmd, "run", failing)
    assert main(SFT) == 2
    err = capsys.readouterr().err
    _one_line_error(err, "worker rank 1 failed in node 'actor_gen' (iteration 3): RuntimeError: engine core")
    assert "(--debug shows the worker's traceback)" in err and err.count("engine core died") == 1, err
    assert main(["--debug", *SFT]) == 2
    err = capsys.readouterr().err
    assert "--- worker 1 traceback ---" in err and 'File "w.py", line 1' in err, err
    assert err.rstrip().endswith("RuntimeError: engine core died"), err
