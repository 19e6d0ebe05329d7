"""Run directory records (schedulers/records/rundir.py) and `rlflow runs` (schedulers/commands/runs.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.commands import runs as runs_cmd
from rlflow.schedulers.records.rundir import (
    TRACE_SCHEMA,
    RunClock,
    RunRecorder,
    TraceRow,
    latest_checkpoint,
    list_checkpoints,
    read_metrics,
    read_predicted_trace,
    read_status,
    read_trace,
)


def _row(it: int, node: str, start: float, end: float, worker: int = 0, **kw: object) -> TraceRow:
    return TraceRow(it, node, worker, worker, start, end, **kw)  # type: ignore[arg-type]


def _temp_files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.rglob("*") if p.name.startswith(".tmp-")]


def test_layout_and_status(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "ppo"
    rec = RunRecorder(run_dir)
    for sub in ("metrics", "trace", "checkpoints"):
        assert (run_dir / sub).is_dir()
    assert read_status(run_dir) is None
    rec.write_status("running", 3)
    status = read_status(run_dir)
    assert status is not None
    assert (status["state"], status["iteration"], status["pid"]) == ("running", 3, os.getpid())
    assert "T" in status["updated"]  # ISO 8601
    rec.write_status("finished", 4)
    assert read_status(run_dir)["state"] == "finished"  # type: ignore[index]
    with pytest.raises(ValueError, match="run state"):
        rec.write_status("done", 4)
    (run_dir / "status.json").write_text("{not json")
    assert read_status(run_dir) is None
    assert _temp_files(run_dir) == []


def test_metrics_union_of_columns_and_merge(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    rec.log_metrics(2, {"perf/throughput": 100.0, "actor/pg_loss": 0.5})
    rec.log_metrics(1, {"perf/throughput": 50.0})
    rec.log_metrics(2, {"val/accuracy": 0.25, "actor/pg_loss": 0.75})  # merged; new value wins
    assert sorted(p.name for p in (tmp_path / "metrics").iterdir()) == [
        "iter-000001.parquet",
        "iter-000002.parquet",
    ]
    table = read_metrics(tmp_path)
    assert table.schema.field("iteration").type == pa.int64()
    assert table.schema.field("perf/throughput").type == pa.float64()
    assert table.column("iteration").to_pylist() == [1, 2]
    assert table.column("perf/throughput").to_pylist() == [50.0, 100.0]
    assert table.column("actor/pg_loss").to_pylist() == [None, 0.75]
    assert table.column("val/accuracy").to_pylist() == [None, 0.25]
    with pytest.raises(ValueError, match="not a number"):
        rec.log_metrics(3, {"x": "abc"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="iteration"):
        rec.log_metrics(3, {"iteration": 1.0})


def test_empty_run_reads_empty(tmp_path: Path) -> None:
    assert read_metrics(tmp_path).column_names == ["iteration"]
    assert read_trace(tmp_path).num_rows == 0
    assert read_trace(tmp_path).schema == TRACE_SCHEMA
    assert read_predicted_trace(tmp_path) is None


def test_trace_flushes_are_separate_files_and_read_back_in_order(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    rec.log_trace([_row(1, "gen", 0.0, 1.0, tokens=10), _row(1, "gen", 0.0, 0.9, worker=1, tokens=10)])
    # A second flush of iteration 1 and a first of iteration 2, as a controller flushing per node would do.
    rec.log_trace(
        [
            _row(1, "train", 1.5, 2.0, predicted_s=0.4),
            _row(1, "actor", 1.0, 1.5, bytes_moved=4096, kind="reallocation"),
            _row(2, "gen", 2.0, 3.0),
        ]
    )
    names = sorted(p.name for p in (tmp_path / "trace").iterdir())
    assert names == ["iter-000001-001.parquet", "iter-000001.parquet", "iter-000002.parquet"]
    table = read_trace(tmp_path)
    assert table.schema == TRACE_SCHEMA
    assert table.num_rows == 5
    assert table.column("iteration").to_pylist() == [1, 1, 1, 1, 2]
    assert table.column("start_s").to_pylist() == [0.0, 0.0, 1.0, 1.5, 2.0]
    assert table.column("kind").to_pylist()[2] == "reallocation"
    assert table.column("bytes_moved").to_pylist()[2] == 4096
    # predicted_s stays null where there was no prediction.
    assert table.column("predicted_s").to_pylist() == [None, None, None, 0.4, None]
    assert _temp_files(tmp_path) == []


def test_reader_skips_partial_and_temp_files(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    rec.log_trace([_row(1, "gen", 0.0, 1.0)])
    rec.log_metrics(1, {"a": 1.0})
    # A truncated last file (e.g. the run dir copied while a non-atomic writer was busy) and a temp file.
    whole = (tmp_path / "trace" / "iter-000001.parquet").read_bytes()
    (tmp_path / "trace" / "iter-000002.parquet").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "trace" / ".tmp-abc.parquet").write_bytes(b"garbage")
    (tmp_path / "metrics" / "iter-000002.parquet").write_bytes(b"PAR1 half")
    with pytest.warns(RuntimeWarning, match="unreadable"):
        trace = read_trace(tmp_path)
    assert trace.column("iteration").to_pylist() == [1]
    with pytest.warns(RuntimeWarning, match="unreadable"):
        metrics = read_metrics(tmp_path)
    assert metrics.column("iteration").to_pylist() == [1]


def test_failed_write_leaves_previous_file_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = RunRecorder(tmp_path)
    rec.log_metrics(1, {"a": 1.0})

    def crash(table: pa.Table, where: object, **kw: object) -> None:
        Path(str(where)).write_bytes(b"PAR1")  # half written, then the writer dies
        raise OSError("disk full")

    monkeypatch.setattr(pq, "write_table", crash)
    with pytest.raises(OSError, match="disk full"):
        rec.log_metrics(1, {"a": 2.0})
    with pytest.raises(OSError, match="disk full"):
        rec.log_trace([_row(1, "gen", 0.0, 1.0)])
    monkeypatch.undo()
    assert read_metrics(tmp_path).column("a").to_pylist() == [1.0]
    assert read_trace(tmp_path).num_rows == 0
    assert _temp_files(tmp_path) == []


def test_trace_row_validation() -> None:
    with pytest.raises(ValueError, match="kind"):
        _row(0, "gen", 0.0, 1.0, kind="compute")
    with pytest.raises(ValueError, match="end_s"):
        _row(0, "gen", 2.0, 1.0)
    with pytest.raises(ValueError, match=">= 0"):
        _row(0, "gen", 0.0, 1.0, tokens=-1)
    assert _row(0, "gen", 0.5, 2.0).duration_s == 1.5


def test_run_clock_shared_origin_and_resume_offset(tmp_path: Path) -> None:
    clock = RunClock()
    a = clock.now()
    b = clock()
    assert 0.0 <= a <= b
    # A worker clock built from the controller's origin reads the same axis (never earlier than it).
    worker = RunClock(origin=clock.origin)
    assert worker.now() >= b
    assert RunClock(origin=time.monotonic(), offset_s=100.0).now() >= 100.0
    rec = RunRecorder(tmp_path)
    rec.log_trace([_row(3, "gen", 10.0, 42.5)])
    resumed = RunRecorder(tmp_path)  # a resumed run continues after the previous trace's end
    assert resumed.now() >= 42.5


def test_checkpoint_is_atomic(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    with rec.checkpoint(5) as tmp:
        (tmp / "weights.bin").write_bytes(b"v1")
        assert not (tmp_path / "checkpoints" / "iter-000005").exists()
    assert (tmp_path / "checkpoints" / "iter-000005" / "weights.bin").read_bytes() == b"v1"
    with pytest.raises(RuntimeError), rec.checkpoint(10) as tmp:
        (tmp / "weights.bin").write_bytes(b"partial")
        raise RuntimeError("killed")
    with rec.checkpoint(5) as tmp:  # rewriting an iteration replaces it
        (tmp / "weights.bin").write_bytes(b"v2")
    assert (tmp_path / "checkpoints" / "iter-000005" / "weights.bin").read_bytes() == b"v2"
    assert [it for it, _ in list_checkpoints(tmp_path)] == [5]
    assert latest_checkpoint(tmp_path) == (5, tmp_path / "checkpoints" / "iter-000005")
    assert _temp_files(tmp_path) == []


def test_predicted_trace_roundtrip(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path)
    rec.write_predicted_trace([_row(0, "gen", 0.0, 1.0, predicted_s=1.0)])
    pred = read_predicted_trace(tmp_path)
    assert pred is not None
    assert pred.column("predicted_s").to_pylist() == [1.0]


# --- rlflow runs ------------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _make(root: Path, name: str, state: str, pid: int, checkpoint: bool, reward: float | None = None) -> Path:
    rec = RunRecorder(root / name)
    rec.write_status(state, 2)
    status = json.loads((root / name / "status.json").read_text())
    status["pid"] = pid
    (root / name / "status.json").write_text(json.dumps(status))
    if checkpoint:
        with rec.checkpoint(2) as tmp:
            (tmp / "w").write_bytes(b"")
    if reward is not None:
        rec.log_metrics(1, {"critic/score/mean": reward - 1})
        rec.log_metrics(2, {"critic/score/mean": reward, "perf/throughput": 1234.5})
    return root / name


def test_run_status_rules() -> None:
    dead = _dead_pid()
    me = os.getpid()
    assert runs_cmd.run_status({"state": "running", "pid": me}, False) == "running"
    assert runs_cmd.run_status({"state": "running", "pid": dead}, True) == "resumable"
    assert runs_cmd.run_status({"state": "running", "pid": dead}, False) == "failed"
    assert runs_cmd.run_status({"state": "interrupted", "pid": dead}, True) == "resumable"
    assert runs_cmd.run_status({"state": "finished", "pid": dead}, True) == "finished"
    assert runs_cmd.run_status({"state": "failed", "pid": dead}, False) == "failed"
    assert runs_cmd.run_status(None, True) == "unknown"


def test_runs_command_lists_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _dead_pid()
    _make(tmp_path, "a_live", "running", os.getpid(), False, reward=0.5)
    _make(tmp_path, "b_done", "finished", dead, True)
    _make(tmp_path / "group", "c_crashed", "running", dead, True)
    _make(tmp_path, "d_crashed_early", "running", dead, False)
    (tmp_path / "not_a_run").mkdir()
    parser = argparse.ArgumentParser()
    runs_cmd.configure(parser)

    assert runs_cmd.run(parser.parse_args([str(tmp_path), "--json"])) == 0
    infos = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    by_name = {Path(i["path"]).name: i for i in infos}
    assert {k: v["status"] for k, v in by_name.items()} == {
        "a_live": "running",
        "b_done": "finished",
        "c_crashed": "resumable",
        "d_crashed_early": "failed",
    }
    assert by_name["a_live"]["last_metrics"] == {"critic/score/mean": 0.5, "perf/throughput": 1234.5}
    assert by_name["c_crashed"]["checkpoint"] == 2

    assert runs_cmd.run(parser.parse_args([str(tmp_path)])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["RUN", "STATUS", "ITER"]
    assert "reward" in lines[0] and "tok/s" in lines[0]
    live = next(line for line in lines if "a_live" in line)
    assert "running" in live and "0.5" in live and "1234" in live

    with pytest.raises(DataError, match="does not exist"):
        runs_cmd.run(parser.parse_args([str(tmp_path / "missing")]))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_atomic_writes_get_the_umask_modes(umask: int, tmp_path: Path) -> None:
    """Files and checkpoint directories written atomically (temp file, then rename) have the modes of
    every other file, 0666/0777 less the umask, not tempfile's private 0600/0700: group members of a
    shared cluster read a run's status, graph and checkpoints."""
    before = os.umask(umask)
    try:
        rec = RunRecorder(tmp_path / "run")
        rec.write_status("running", 1)
        rec.write_text("graph.yaml", "models: {}\n")
        rec.write_predicted_trace([_row(0, "gen", 0.0, 1.0, predicted_s=1.0)])
        rec.log_metrics(1, {"loss": 1.0})
        rec.log_trace([_row(1, "gen", 0.0, 1.0)])
        with rec.checkpoint(1) as tmp:
            (tmp / "state.pt").write_bytes(b"x")
            (tmp / "models").mkdir()
    finally:
        os.umask(before)
    run_dir = tmp_path / "run"
    modes = {str(p.relative_to(run_dir)): p.stat().st_mode & 0o777 for p in run_dir.rglob("*")}
    expected = {name: (0o777 if (run_dir / name).is_dir() else 0o666) & ~umask for name in modes}
    assert modes == expected
    assert {"status.json", "graph.yaml", "predicted_trace.parquet", "checkpoints/iter-000001"} <= set(modes)
