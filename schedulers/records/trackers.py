"""Experiment trackers: a run's metrics, graph and plan also sent to TensorBoard, Weights & Biases or MLflow.

``run.trackers: [tensorboard, wandb, mlflow]`` in a graph file (verl's ``trainer.logger``, TRL's
``report_to``), under ``run.project`` and ``run.experiment`` (verl's ``project_name`` and
``experiment_name``). Each tracker goes through its own library, imported only when it is configured:

- ``tensorboard``: torch's ``SummaryWriter`` into ``<run_dir>/trackers/tensorboard``; the graph as the text
  ``graph``.
- ``wandb``: a W&B run under ``<run_dir>/trackers/wandb`` (``WANDB_DIR`` where set), the graph as its config
  and the file ``graph.yaml``; ``WANDB_MODE`` where set, else online only when W&B has credentials and its
  server answers, offline otherwise (a :class:`TrackerWarning` says why; ``wandb sync`` uploads it later).
- ``mlflow``: an MLflow run in the experiment ``run.project`` at ``MLFLOW_TRACKING_URI`` where set, else a
  local file store ``<run_dir>/trackers/mlruns``; the graph flattened into params
  (``models.actor.optimizer.lr``) and the artifact ``graph.yaml``.

Every tracker gets the very metrics the run directory records (:meth:`RunRecorder.log_metrics`: the same
names and values), with step = iteration. :class:`Trackers`, the recorder's sink, starts them when the
run's status turns running and closes them with its final status, so a failed run, one stopped by a
signal and a finished one each close their tracker runs (W&B: exit code 1 for failed, marked preempting
when interrupted; MLflow: FAILED, KILLED, FINISHED). A resumed run continues the same tracker run: the W&B
run id and the MLflow run id are kept in ``<run_dir>/trackers/state.json``; TensorBoard purges the steps
after the checkpoint the run resumes from (``purge_step``), while W&B and MLflow, whose steps only go
forward, keep the values of steps logged after that checkpoint by the attempt before and are not sent
them again (a :class:`TrackerWarning` names them; a resume is exact, so they agree but for timings).

:data:`TRACKERS` maps names to :class:`Tracker` classes; a plug-in registers one with
``@TRACKERS.register(name)`` in a module declared in the entry-point group :data:`TRACKER_PLUGINS`.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import json
import os
import socket
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlparse

from rlflow.dataflow.errors import GraphError, HostError, RegistryError
from rlflow.dataflow.registry import Registry
from rlflow.dataflow.spec import GraphSpec
from rlflow.schedulers.records.rundir import GRAPH_FILE, TRACKERS_DIR, RunRecorder

__all__ = [
    "STATE_FILE",
    "TRACKERS",
    "TRACKER_PLUGINS",
    "Tracker",
    "TrackerRun",
    "TrackerWarning",
    "Trackers",
    "check_trackers",
    "tracker_mistakes",
]

TRACKER_PLUGINS = "rlflow.trackers"
STATE_FILE = "state.json"  # in <run_dir>/trackers/: each tracker's run id and the last step it logged
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}  # MLflow's run statuses


class TrackerWarning(UserWarning):
    """A tracker does something other than the plain thing: W&B logs offline (and why), a resumed run
    keeps steps an earlier attempt logged, MLflow keeps a param it cannot change, a tracker did not close."""


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker starts from.

    Attributes:
        run_dir: the run directory.
        dir: ``<run_dir>/trackers``, where trackers write by default (a plug-in: ``dir / <its name>``).
        project: ``run.project`` (the W&B project, the MLflow experiment).
        experiment: ``run.experiment``, default the run directory's name (the tracker run's name).
        config: the resolved graph file as plain containers, its ``plan`` included.
        graph_file: the run directory's ``graph.yaml`` (the same graph as a file).
        start: the iteration the run starts after (0 for a new run, ``k`` resumed from checkpoint ``k``);
            the first step it logs is ``start + 1`` (``0``: the evaluation before training).
        state: what this tracker's :meth:`Tracker.start` returned last time in this run directory (``{}``
            the first time): its run id.
        logged: the last step this tracker logged in this run directory, ``None`` if none.
    """

    run_dir: Path
    dir: Path
    project: str
    experiment: str
    config: dict[str, Any]
    graph_file: Path
    start: int
    state: dict[str, Any]
    logged: int | None


class Tracker(abc.ABC):
    """One experiment tracker: started with the run, sent each iteration's metrics, closed with it.

    A subclass names the module it needs (``library``, checked before a run starts, with the pip command
    that installs it, ``install``) and imports it in :meth:`start` only. ``rewinds``: whether :meth:`start`
    itself drops the steps after ``run.start`` that the tracker already holds; without it the steps up to
    ``run.logged`` are not sent again.
    """

    library: ClassVar[str] = ""
    install: ClassVar[str] = "pip install 'rlflow[trackers]'"
    rewinds: ClassVar[bool] = False

    @classmethod
    def mistake(cls, project: str, experiment: str | None) -> str | None:
        """Why this tracker would refuse ``run.project``/``run.experiment`` at start, as ``<key>: <why>``;
        ``None``: it takes them. Checked before a run starts (:func:`tracker_mistakes`)."""
        return None

    @abc.abstractmethod
    def start(self, run: TrackerRun) -> dict[str, Any]:
        """Open (or, with ``run.state``, continue) the tracker run; what to keep for a resume (JSON)."""

    @abc.abstractmethod
    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record ``metrics`` (name -> value) at ``step`` (the iteration)."""

    @abc.abstractmethod
    def close(self, state: str) -> None:
        """End the tracker run; ``state``: ``finished``, ``interrupted`` (stopped by a signal, resumable) or
        ``failed``."""


TRACKERS: Registry[type[Tracker]] = Registry("tracker", group=TRACKER_PLUGINS)
"""Tracker classes by the name ``run.trackers`` lists."""


def tracker_mistakes(spec: GraphSpec) -> list[str]:
    """One line per ``run.trackers`` entry that cannot start, naming the file and key: an unknown name
    (with the closest known one), a tracker whose library is not installed (with the pip command)."""
    source = spec.source or "<graph>"
    out = []
    for name in spec.run.trackers:
        if name == "console":
            out.append(
                f"{source}: run.trackers: 'console' is not a tracker (rlflow always prints progress lines); "
                f"leave it out. Trackers: {', '.join(sorted(TRACKERS))}"
            )
            continue
        try:
            cls = TRACKERS.get(name)
        except RegistryError as e:
            out.append(f"{source}: run.trackers: {e}")
            continue
        if cls.library and not _installed(cls.library):
            out.append(
                f"{source}: run.trackers: tracker '{name}' needs the Python package '{cls.library}', which "
                f"is not installed: {cls.install}"
            )
        why = cls.mistake(spec.run.project, spec.run.experiment)
        if why is not None:
            out.append(f"{source}: {why}")
    return out


def check_trackers(spec: GraphSpec) -> None:
    """Raise the first of :func:`tracker_mistakes` (:class:`GraphError`), before a run starts."""
    mistakes = tracker_mistakes(spec)
    if mistakes:
        raise GraphError(mistakes[0])


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that does not import; a module without a spec
        return False


class Trackers:
    """The run's trackers as its recorder's sink (:class:`~rlflow.schedulers.records.rundir.RecordSink`).

    Opened when the run's status turns running (again after a close: a second :meth:`Controller.run
    <rlflow.schedulers.runtime.controller.Controller.run>` continues the same tracker runs), each
    iteration's metrics sent to every tracker in ``run.trackers`` order, closed with the final status.
    Keeps each tracker's run id and last step in ``<run_dir>/trackers/state.json``.

    Raises:
        GraphError: from the constructor, as :func:`check_trackers`.
        HostError: a tracker did not start (the ones started are closed as failed); a tracker's own
            exception while logging goes through unchanged (the run fails and closes the others).
    """

    def __init__(self, spec: GraphSpec, recorder: RunRecorder) -> None:
        check_trackers(spec)
        self.spec = spec
        self.recorder = recorder
        self._open: list[tuple[str, Tracker]] = []
        self._skip: dict[str, int] = {}  # name -> the last step not to send again
        self._state: dict[str, dict[str, Any]] = {}

    @property
    def dir(self) -> Path:
        return self.recorder.run_dir / TRACKERS_DIR

    def open(self, iteration: int) -> None:
        """Start every tracker for a run that starts after ``iteration`` (a no-op while they are open)."""
        if self._open:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / STATE_FILE
        self._state = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        run = self.spec.run
        for name in run.trackers:
            cls = TRACKERS.get(name)
            saved = self._state.get(name, {})
            logged = saved.get("logged")
            start = TrackerRun(
                run_dir=self.recorder.run_dir,
                dir=self.dir,
                project=run.project,
                experiment=run.experiment or self.recorder.run_dir.resolve().name,
                config=self.spec.to_dict(),
                graph_file=self.recorder.run_dir / GRAPH_FILE,
                start=iteration,
                state=dict(saved.get("state", {})),
                logged=logged,
            )
            tracker = cls()
            try:
                state = tracker.start(start)
            except BaseException as e:  # the trackers started so far close; Ctrl-C stays what it is
                self.close("failed")
                if not isinstance(e, Exception):
                    raise
                raise HostError(
                    f"run.trackers: tracker '{name}' did not start: {type(e).__name__}: {e}"
                ) from e
            self._open.append((name, tracker))
            if logged is not None and logged > iteration and cls.rewinds:
                logged = iteration  # start() dropped the steps after it
            elif logged is not None and logged > iteration:
                self._skip[name] = logged
                warnings.warn(
                    f"run.trackers: {name}: steps {iteration + 1}..{logged} were logged before this run "
                    f"resumed from iteration {iteration}; {name} keeps those values (its steps only go "
                    "forward; a resume repeats them exactly, timings aside) and gets the steps after them",
                    TrackerWarning,
                    stacklevel=2,
                )
            self._state[name] = {"state": state, "logged": logged}
        self._save()

    def log(self, iteration: int, metrics: Mapping[str, float]) -> None:
        """Send one iteration's metrics to every open tracker (nothing when none is open)."""
        for name, tracker in self._open:
            if iteration <= self._skip.get(name, -1):
                continue
            tracker.log(iteration, metrics)
            self._state[name]["logged"] = iteration
        if self._open:
            self._save()

    def close(self, state: str) -> None:
        """Close every open tracker with the run's final ``state``; a tracker that fails to close is a
        :class:`TrackerWarning` (the run's own error, if any, is what the caller reports)."""
        opened, self._open, self._skip = self._open, [], {}
        for name, tracker in opened:
            try:
                tracker.close(state)
            except Exception as e:
                warnings.warn(
                    f"run.trackers: {name} did not close: {type(e).__name__}: {e}",
                    TrackerWarning,
                    stacklevel=2,
                )

    def _save(self) -> None:
        self.recorder.write_text(f"{TRACKERS_DIR}/{STATE_FILE}", json.dumps(self._state, indent=1) + "\n")


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"models": {"actor": {"dtype": "auto"}}}`` -> ``{"models.actor.dtype": "auto"}``; a list or an
    empty mapping as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value, default=str)
    return out


@TRACKERS.register("tensorboard")
class TensorBoardTracker(Tracker):
    """TensorBoard event files in ``<run_dir>/trackers/tensorboard`` (torch's ``SummaryWriter``): one scalar
    per metric, the graph as the text ``graph`` at the start step; flushed every iteration. A resumed run
    writes into the same directory with ``purge_step`` = the first step it logs, so TensorBoard hides the
    steps an earlier attempt logged after the checkpoint."""

    library = "tensorboard"
    rewinds = True

    def start(self, run: TrackerRun) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        purge = run.start + 1 if run.logged is not None and run.logged > run.start else None
        self.writer = SummaryWriter(str(run.dir / "tensorboard"), purge_step=purge)
        text = run.graph_file.read_text(encoding="utf-8")
        self.writer.add_text("graph", "".join(f"    {line}\n" for line in text.splitlines()), run.start)
        return {}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self, state: str) -> None:
        self.writer.close()


@TRACKERS.register("wandb")
class WandbTracker(Tracker):
    """A Weights & Biases run: project ``run.project``, name ``run.experiment``, the graph as its config and
    the file ``graph.yaml``; its id kept for a resume (``resume="allow"``). Written under
    ``<run_dir>/trackers/wandb`` unless ``WANDB_DIR`` says where. ``WANDB_MODE`` decides online or offline
    where set; else the run is online when W&B has credentials and its server answers, else offline with a
    :class:`TrackerWarning` saying why. Closed with exit code 0 (finished) or 1 (failed; interrupted: 1
    after ``mark_preempting``, W&B's word for a run that will resume)."""

    library = "wandb"
    # what W&B refuses in a project name (wandb's own check, at wandb.init)
    PROJECT_FORBIDDEN: ClassVar[str] = "/\\#?%:"
    PROJECT_MAX: ClassVar[int] = 128

    @classmethod
    def mistake(cls, project: str, experiment: str | None) -> str | None:
        bad = sorted({c for c in project if c in cls.PROJECT_FORBIDDEN})
        if bad or len(project) > cls.PROJECT_MAX:
            why = f"holds {' '.join(bad)}" if bad else f"is longer than {cls.PROJECT_MAX} characters"
            return (
                f"run.project: {project!r} {why}; W&B project names cannot hold "
                f"{' '.join(cls.PROJECT_FORBIDDEN)} or exceed {cls.PROJECT_MAX} characters"
            )
        return None

    def start(self, run: TrackerRun) -> dict[str, Any]:
        import wandb

        kwargs: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            run.dir.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(run.dir)
        # WANDB_MODE passed on as read now (wandb reads the environment once per process)
        mode = os.environ.get("WANDB_MODE")
        offline_because = None if mode else _wandb_offline(wandb)
        if mode or offline_because is not None:
            kwargs["mode"] = mode or "offline"
        self.run = wandb.init(
            project=run.project, name=run.experiment, id=run.state.get("id"), resume="allow", **kwargs
        )
        if offline_because is not None:
            warnings.warn(
                f"run.trackers: wandb logs offline to {Path(self.run.dir).parent} ({offline_because}); "
                "`wandb sync` uploads it later",
                TrackerWarning,
                stacklevel=3,
            )
        self.run.config.update(run.config, allow_val_change=True)
        self.run.save(str(run.graph_file), base_path=str(run.run_dir), policy="now")
        return {"id": self.run.id}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, state: str) -> None:
        if state == "interrupted":
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if state == "finished" else 1)


def _wandb_offline(wandb: Any) -> str | None:
    """Why a W&B run cannot be online (no credentials, the server does not answer), or ``None``."""
    if not wandb.login(prompt=False, verify=False):
        return "no W&B credentials: WANDB_API_KEY or `wandb login`"
    url = urlparse(wandb.setup().settings.base_url)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=5).close()
    except OSError as e:
        return f"{url.hostname}:{port} does not answer: {e.strerror or e}"
    return None


@TRACKERS.register("mlflow")
class MlflowTracker(Tracker):
    """An MLflow run (``MlflowClient``) in the experiment ``run.project``, named ``run.experiment``, at
    ``MLFLOW_TRACKING_URI`` where set, else in the file store ``<run_dir>/trackers/mlruns`` (MLflow 3
    keeps its file store in maintenance mode: rlflow allows it for this store only). The graph flattened
    into params and logged as the artifact ``graph.yaml``; a resumed run continues the stored run id
    (a param whose value changed stays as first logged, with a :class:`TrackerWarning`: MLflow params do
    not change). Closed FINISHED, FAILED or KILLED (interrupted)."""

    library = "mlflow"

    def start(self, run: TrackerRun) -> dict[str, Any]:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if uri:
            self.client = MlflowClient(uri)
        else:
            uri = (run.dir / "mlruns").resolve().as_uri()
            with _file_store_allowed():
                self.client = MlflowClient(uri)
        found = None
        if run.state.get("run_id"):
            try:
                found = self.client.get_run(run.state["run_id"])
            except MlflowException:
                warnings.warn(
                    f"run.trackers: mlflow: run {run.state['run_id']} is not in {uri}; starting a new one",
                    TrackerWarning,
                    stacklevel=3,
                )
        if found is None:
            experiment = self.client.get_experiment_by_name(run.project)
            eid = experiment.experiment_id if experiment else self.client.create_experiment(run.project)
            found = self.client.create_run(eid, run_name=run.experiment)
        else:
            self.client.update_run(found.info.run_id, status="RUNNING")
        self.run_id = found.info.run_id
        self._log_params(run, found.data.params)
        self.client.log_artifact(self.run_id, str(run.graph_file))
        return {"run_id": self.run_id}

    def _log_params(self, run: TrackerRun, logged: Mapping[str, str]) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        params = _flat(run.config)
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != v)
        long = sorted(k for k, v in params.items() if len(v) > MAX_PARAM_VAL_LENGTH)
        for keys, why in ((changed, "changed since the run's first start (MLflow params do not change)"),
                          (long, f"longer than MLflow's {MAX_PARAM_VAL_LENGTH} characters")):  # fmt: skip
            if keys:
                warnings.warn(
                    f"run.trackers: mlflow: params {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''} "
                    f"{why}: not logged; the artifact graph.yaml holds this start's graph",
                    TrackerWarning,
                    stacklevel=4,
                )
        new = [Param(k, v) for k, v in params.items() if k not in logged and k not in long]
        self.client.log_batch(self.run_id, params=new)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(name, float(value), now_ms, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self, state: str) -> None:
        self.client.set_terminated(self.run_id, _STATUS[state])


@contextlib.contextmanager
def _file_store_allowed() -> Iterator[None]:
    """MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` (where unset): allow it while the
    client for rlflow's default store builds the store, which MLflow then caches for that URI."""
    if "MLFLOW_ALLOW_FILE_STORE" in os.environ:
        yield
        return
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
