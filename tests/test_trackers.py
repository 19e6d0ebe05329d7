"""Experiment trackers (issue 40): ``run.trackers`` sends a run's metrics, graph and plan to TensorBoard,
W&B and MLflow, each through its real library, offline, and read back with that library's own reader
(TensorBoard's ``EventAccumulator``, ``MlflowClient``; W&B's offline transaction log parsed into its own
``Record`` protobufs, wandb 0.31 having no reader of it). Tiny in-process SFT runs through the controller:
the names and values the run directory records, the graph as config, a resume continuing the same tracker
runs without a step twice, a SIGTERM and a failure closing them, and bad input refused before anything
starts. Nothing is written outside ``tmp_path``: home, W&B's and MLflow's directories point there."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import read_metrics, read_status
from rlflow.schedulers.records.trackers import TRACKERS, Tracker, TrackerRun, TrackerWarning
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
SFT = ["run.eval_interval=0", "run.seed=3"]


@TRACKERS.register("test_stop")
class StopTracker(Tracker):
    """A plug-in tracker that stops the run at step ``at``: SIGTERM to this process, or an exception."""

    at = 0
    how = "signal"

    def start(self, run: TrackerRun) -> dict[str, Any]:
        return {}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step == self.at and self.how == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        elif step == self.at:
            raise RuntimeError("the tracker's server went away")

    def close(self, state: str) -> None:
        pass


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # example graphs name paths relative to the repository root
    torch.set_num_threads(1)
    home = tmp_path / "home"
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / "netrc"))  # no W&B credentials
    for var, sub in (
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        monkeypatch.setenv(var, str(home / "wandb" / sub))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _controller(run_dir: Path, *overrides: str, resume: bool = False) -> Controller:
    graph = load_graph("examples/sft.yaml", [f"run.output_dir={run_dir}", *SFT, *overrides])
    return Controller(resolve_plan(graph, None), resume=resume)


def _run(run_dir: Path, *overrides: str, resume: bool = False) -> Any:
    controller = _controller(run_dir, *overrides, resume=resume)
    try:
        return controller.run()
    finally:
        controller.close()


def _records(run_dir: Path) -> dict[int, dict[str, float]]:
    """The run directory's metrics: iteration -> name -> value."""
    rows = read_metrics(run_dir).to_pylist()
    return {row.pop("iteration"): {k: v for k, v in row.items() if v is not None} for row in rows}


# -- each library's reader ------------------------------------------------------------------------------
def _tensorboard(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """Scalars (name -> [(step, value)] as TensorBoard shows them, purged steps gone) and the graph text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(
        str(run_dir / "trackers/tensorboard"), size_guidance={"scalars": 0, "tensors": 0}
    )
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    text = events.Tensors("graph/text_summary")[-1].tensor_proto.string_val[0].decode()
    return scalars, text


def _mlflow(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Any, Any, dict[str, list[tuple[int, float]]]]:
    """The client, the run and its metric histories (name -> [(step, value)] in the order logged)."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader's own opt-in to MLflow 3's file store
    client = MlflowClient((run_dir / "trackers/mlruns").resolve().as_uri())
    run_id = json.loads((run_dir / "trackers/state.json").read_text())["mlflow"]["state"]["run_id"]
    run = client.get_run(run_id)
    history = {
        name: [(m.step, m.value) for m in client.get_metric_history(run_id, name)]
        for name in run.data.metrics
    }
    return client, run, history


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B transaction log (``run-<id>.wandb``): a 7-byte W&B header, then LevelDB's log
    format (32 KiB blocks of chunks: CRC-32C, length, type full/first/middle/last), each record one
    ``wandb_internal_pb2.Record``."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, records, chunks = path.read_bytes(), 32768, [], b""
    assert data[:4] == b":W&B", path
    pos = 7
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def _wandb(run_dir: Path) -> list[dict[str, Any]]:
    """Each fragment of the offline W&B run (one per start, in start order): its run id, config, history
    (step -> name -> value), exit code and whether it was marked preempting."""
    fragments = []
    for log in sorted((run_dir / "trackers/wandb").glob("offline-run-*/run-*.wandb")):
        out: dict[str, Any] = {"config": {}, "history": {}, "exit_code": None, "preempting": False}
        for record in _wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                out["id"] = record.run.run_id
                out["files"] = sorted(p.name for p in (log.parent / "files").iterdir())
            updates = {"run": record.run.config.update, "config": record.config.update}.get(kind, [])
            for item in updates:
                out["config"][item.key] = json.loads(item.value_json)
            if kind == "history":
                items = record.history.item
                row = {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}
                out["history"][record.history.step.num] = {
                    k: v for k, v in row.items() if not k.startswith("_")
                }
            if kind == "exit":
                out["exit_code"] = record.exit.exit_code
            out["preempting"] |= kind == "preempting"
        fragments.append(out)
    return fragments


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-12)


# -- the tests ------------------------------------------------------------------------------------------
def test_trackers_record_the_run_and_a_resume_continues_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    trackers = "run.trackers=[tensorboard,wandb,mlflow]"
    # no WANDB_MODE and no credentials: W&B goes offline, and says why
    with pytest.warns(TrackerWarning, match=r"wandb logs offline to .*no W&B credentials"):
        _run(run_dir, trackers, "run.iterations=3", "run.checkpoint_interval=2", "run.experiment=sft-a")
    records = _records(run_dir)
    assert list(records) == [1, 2, 3]
    graph = yaml.safe_load((run_dir / "graph.yaml").read_text())
    assert graph["run"]["trackers"] == ["tensorboard", "wandb", "mlflow"] and "plan" in graph

    # the same names, steps and values as the run directory's records, in every tracker
    scalars, text = _tensorboard(run_dir)
    client, run, history = _mlflow(run_dir, monkeypatch)
    (fragment,) = _wandb(run_dir)
    names = set(records[1])
    assert set(scalars) == set(history) == set(fragment["history"][1]) == names
    for name in names:
        expected = [(it, records[it][name]) for it in records]
        for got in (scalars[name], history[name], [(s, row[name]) for s, row in fragment["history"].items()]):
            assert [s for s, _ in got] == [1, 2, 3], name
            assert all(_same(v, w) for (_, v), (_, w) in zip(got, expected, strict=True)), (
                name,
                got,
                expected,
            )

    # the graph (its plan in it) as each one's config, and as a file where the tracker keeps files
    assert "actor_train:" in text and "trackers:" in text
    assert {k: fragment["config"][k] for k in graph} == graph
    assert fragment["id"] and "graph.yaml" in fragment["files"] and fragment["exit_code"] == 0
    assert run.data.params["models.actor.optimizer.lr"] == "0.001"
    assert run.data.params["run.trackers"] == '["tensorboard", "wandb", "mlflow"]'
    assert (run.info.run_name, run.info.status) == ("sft-a", "FINISHED")
    assert client.get_experiment(run.info.experiment_id).name == "rlflow"
    saved = Path(client.download_artifacts(run.info.run_id, "graph.yaml", str(tmp_path)))
    assert saved.read_text() == (run_dir / "graph.yaml").read_text()

    # killed after iteration 3 was logged but before its checkpoint: resumed from 2, the run continues the
    # same tracker runs; TensorBoard purges step 3 of the first attempt, W&B and MLflow keep it (their steps
    # only go forward) and say so; no step appears twice
    shutil.rmtree(run_dir / "checkpoints/iter-000003")
    again = [trackers, "run.iterations=4", "run.checkpoint_interval=2", "run.experiment=sft-a"]
    with pytest.warns(
        TrackerWarning, match=r"steps 3\.\.3 were logged before this run resumed from iteration 2"
    ):
        _run(run_dir, *again, resume=True)
    records = _records(run_dir)
    scalars, _ = _tensorboard(run_dir)
    _, resumed, history = _mlflow(run_dir, monkeypatch)
    first, second = _wandb(run_dir)
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert first["id"] == second["id"] == fragment["id"] and list(second["history"]) == [4]
    for name in names:
        for got in (scalars[name], history[name]):
            assert [s for s, _ in got] == [1, 2, 3, 4], (name, got)
        assert _same(scalars[name][2][1], records[3][name])  # TensorBoard shows the resumed attempt's step 3
        for got in (scalars[name][-1][1], history[name][-1][1], second["history"][4][name]):
            assert _same(got, records[4][name])


def test_a_signal_and_a_failure_close_the_tracker_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM during iteration 1's records stops the run after it (interrupted): MLflow KILLED, W&B marked
    preempting; the resumed run, failing in iteration 2, closes the same tracker runs as failed."""
    monkeypatch.setenv("WANDB_MODE", "offline")  # honoured: no reason to warn
    run_dir = tmp_path / "run"
    trackers = "run.trackers=[wandb,mlflow,test_stop]"
    monkeypatch.setattr(StopTracker, "at", 1)
    result = _run(run_dir, trackers, "run.iterations=3", "run.checkpoint_interval=0")
    assert (result.interrupted, result.signal, result.iteration) == (True, signal.SIGTERM, 1)
    assert read_status(run_dir)["state"] == "interrupted"
    _, run, _ = _mlflow(run_dir, monkeypatch)
    (fragment,) = _wandb(run_dir)
    assert run.info.status == "KILLED" and fragment["preempting"] and fragment["exit_code"] == 1

    monkeypatch.setattr(StopTracker, "at", 2)
    monkeypatch.setattr(StopTracker, "how", "raise")
    with pytest.raises(RuntimeError, match="the tracker's server went away"):
        _run(run_dir, trackers, "run.iterations=3", "run.checkpoint_interval=0", resume=True)
    assert read_status(run_dir)["state"] == "failed"
    _, failed, history = _mlflow(run_dir, monkeypatch)
    first, second = _wandb(run_dir)
    assert failed.info.run_id == run.info.run_id and failed.info.status == "FAILED"
    assert second["id"] == first["id"] and second["exit_code"] == 1 and not second["preempting"]
    assert all([s for s, _ in got] == [1, 2] for got in history.values())


def test_bad_trackers_are_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    cases = {
        "run.trackers=[tensorbord]": r"sft\.yaml: run\.trackers: unknown tracker 'tensorbord' \(did you mean "
        r"'tensorboard'\?\); known: .*mlflow, tensorboard.*wandb",
        "run.trackers=[console,wandb]": r"sft\.yaml: run\.trackers: 'console' is not a tracker .*leave it",
        "run.trackers=[mlflow]": r"sft\.yaml: run\.trackers: tracker 'mlflow' needs the Python package "
        r"'mlflow', which is not installed: pip install 'rlflow\[trackers\]'$",
    }
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if it were not installed
    for override, message in cases.items():
        with pytest.raises(GraphError, match=message):
            _controller(run_dir, override)
        assert not run_dir.exists()
        assert main(["validate", "examples/sft.yaml", override]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    # a project name W&B refuses at wandb.init: refused before the run, naming run.project
    project = ("run.trackers=[wandb]", "run.project=a/b c")
    with pytest.raises(GraphError, match=r"sft\.yaml: run\.project: 'a/b c' holds /; W&B project names"):
        _controller(run_dir, *project)
    assert not run_dir.exists()
    assert main(["validate", "examples/sft.yaml", *project]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    for override, message in (
        (
            "run.trackers=wandb",
            r"run\.trackers: expected a list of tracker names \(\[tensorboard\]\), got 'wan",
        ),
        ("run.trackers=[wandb,wandb]", r"run\.trackers: 'wandb' is listed twice"),
        ("run.experiment=[a]", r"run\.experiment: expected a non-empty string"),
    ):
        with pytest.raises(GraphError, match=message):
            _controller(run_dir, override)
