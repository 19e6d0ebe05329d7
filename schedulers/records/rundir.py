"""Run records: the run directory a controller writes and the readers dashboards use.

Layout of a run directory (see the shared contract, "Run directory")::

    <run_dir>/
      graph.yaml                 resolved graph file
      status.json                {"state": running|finished|interrupted|failed, "iteration", "pid", "updated",
                                  "restarts": [...] once the run restarted (runtime/restarts.py)}
      metrics/iter-000007.parquet   one row: iteration int64 + metric name -> float64
      trace/iter-000007.parquet     trace rows of iteration 7 (later flushes: iter-000007-001.parquet, ...)
      prompts.jsonl              the prompt ids each iteration trained on (:mod:`.prompt_record`)
      checkpoints/iter-000005/      written to a temp dir, then renamed
      plan.yaml, predicted_trace.parquet   optional, from the planner
      run.lock                   held by the live run (:mod:`rlflow.schedulers.records.runlock`)
      trackers/                  the experiment trackers' files (:mod:`rlflow.schedulers.records.trackers`)

Every file is written to a temp file in the same directory (name starting with ``.tmp-``) and moved into
place with ``os.replace``, so a reader never sees half a file from a live writer and a crashed run keeps
everything up to the crash. Readers still skip unreadable files (e.g. a run directory copied while being
written) with a warning, and ignore temp files.

Times in traces are seconds since the run's start on one clock (:class:`RunClock`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from rlflow.schedulers.records.prompt_record import PROMPTS_FILE, append_prompts, drop_prompts_after

__all__ = [
    "LOCK_FILE",
    "RUN_STATES",
    "TRACE_KINDS",
    "TRACE_SCHEMA",
    "RecordSink",
    "RunClock",
    "RunRecorder",
    "TraceRow",
    "latest_checkpoint",
    "list_checkpoints",
    "normal_mode",
    "read_metrics",
    "read_predicted_trace",
    "read_status",
    "read_trace",
    "remove_run_dir",
    "trace_rows_to_table",
]

RunState = Literal["running", "finished", "interrupted", "failed"]
RUN_STATES: Final[tuple[str, ...]] = ("running", "finished", "interrupted", "failed")
TraceKind = Literal["node", "reallocation", "data_transfer", "tool"]
TRACE_KINDS: Final[tuple[str, ...]] = ("node", "reallocation", "data_transfer", "tool")

METRICS_DIR: Final = "metrics"
TRACE_DIR: Final = "trace"
CHECKPOINTS_DIR: Final = "checkpoints"
STATUS_FILE: Final = "status.json"
GRAPH_FILE: Final = "graph.yaml"
PLAN_FILE: Final = "plan.yaml"
PREDICTED_TRACE_FILE: Final = "predicted_trace.parquet"
LOCK_FILE: Final = "run.lock"
TRACKERS_DIR: Final = "trackers"
TMP_PREFIX: Final = ".tmp-"

_ITER_FILE_RE: Final = re.compile(r"^iter-(\d{6,})(?:-(\d+))?\.parquet$")
_CKPT_RE: Final = re.compile(r"^iter-(\d{6,})$")

TRACE_SCHEMA: Final = pa.schema(
    [
        pa.field("iteration", pa.int64(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("worker", pa.int64(), nullable=False),
        pa.field("device", pa.int64(), nullable=False),
        pa.field("start_s", pa.float64(), nullable=False),
        pa.field("end_s", pa.float64(), nullable=False),
        pa.field("tokens", pa.int64(), nullable=False),
        pa.field("bytes_moved", pa.int64(), nullable=False),
        pa.field("predicted_s", pa.float64(), nullable=True),
        pa.field("kind", pa.string(), nullable=False),
    ]
)


class RunClock:
    """Seconds since the run's start, from ``time.monotonic`` (never goes backwards).

    ``origin`` is the ``time.monotonic()`` value that reads as ``offset_s``. On Linux CLOCK_MONOTONIC is
    system-wide, so worker processes on the same host share the controller's clock by building
    ``RunClock(origin=controller_clock.origin, offset_s=controller_clock.offset_s)``. ``offset_s`` lets a
    resumed run continue where the previous trace ended.
    """

    def __init__(self, origin: float | None = None, offset_s: float = 0.0) -> None:
        self.origin: float = time.monotonic() if origin is None else float(origin)
        self.offset_s: float = float(offset_s)

    def now(self) -> float:
        """Seconds since the run's start."""
        return time.monotonic() - self.origin + self.offset_s

    def __call__(self) -> float:
        return self.now()


@dataclass(frozen=True)
class TraceRow:
    """One execution on one worker: a node call, a reallocation, a data transfer, or a tool phase.

    Attributes:
        iteration: iteration index.
        node: node name (for reallocations: the model or node being reallocated).
        worker: worker rank that executed it.
        device: device index it ran on.
        start_s, end_s: seconds since the run's start (:class:`RunClock`), ``end_s >= start_s``.
        tokens: tokens processed (prompt + response tokens for node calls; 0 if not applicable).
        bytes_moved: bytes sent or received (reallocations, data transfers; 0 otherwise).
        predicted_s: the planner's predicted duration in seconds, ``None`` without a prediction.
        kind: ``"node"``, ``"reallocation"``, ``"data_transfer"`` or ``"tool"`` (the environment steps of
            an agent node's turn, ``node`` naming that node; inside the node's own row, not added to it).

    Raises:
        ValueError: on an unknown kind, ``end_s < start_s`` or negative counts (a programming error of
        the caller, not a user mistake).
    """

    iteration: int
    node: str
    worker: int
    device: int
    start_s: float
    end_s: float
    tokens: int = 0
    bytes_moved: int = 0
    predicted_s: float | None = None
    kind: str = "node"

    def __post_init__(self) -> None:
        if self.kind not in TRACE_KINDS:
            raise ValueError(f"TraceRow.kind must be one of {TRACE_KINDS}, got {self.kind!r}")
        if self.end_s < self.start_s:
            raise ValueError(f"TraceRow for node {self.node!r}: end_s {self.end_s} < start_s {self.start_s}")
        if self.tokens < 0 or self.bytes_moved < 0:
            raise ValueError(f"TraceRow for node {self.node!r}: tokens and bytes_moved must be >= 0")

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def trace_rows_to_table(rows: Sequence[TraceRow]) -> pa.Table:
    """Rows -> a table with :data:`TRACE_SCHEMA`."""
    columns: dict[str, list[Any]] = {f.name: [] for f in TRACE_SCHEMA}
    for row in rows:
        for name, value in asdict(row).items():
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=TRACE_SCHEMA)


def _now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``/proc/self/status``): setting
    it to read it back would, for that moment, apply to files other threads create."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def normal_mode(path: str | os.PathLike[str], directory: bool = False) -> None:
    """Give a ``tempfile.mkstemp``/``mkdtemp`` path (created 0600/0700, private) the mode ``open``/``mkdir``
    would have (0666/0777 less the umask): records and checkpoints are shared like every other file."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def _atomic_write(path: Path, write: Any) -> None:
    """Call ``write(tmp_path)`` on a temp file next to ``path``, then ``os.replace`` it into place (with the
    mode a plain write would give it)."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        normal_mode(tmp)
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _atomic_write_table(path: Path, table: pa.Table) -> None:
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


class RecordSink(Protocol):
    """Where else a run's metrics go (its experiment trackers: :class:`~.trackers.Trackers`): opened when the
    run's status says running (the iteration it starts after), each iteration's metrics as they are logged,
    closed with its final status (finished, interrupted or failed)."""

    def open(self, iteration: int) -> None: ...
    def log(self, iteration: int, metrics: Mapping[str, float]) -> None: ...
    def close(self, state: str) -> None: ...


class RunRecorder:
    """Writes a run directory (the controller's only writer of records).

    Creating a recorder creates ``run_dir`` with ``metrics/``, ``trace/`` and ``checkpoints/``. On an
    existing run directory (a resumed run) the run clock continues from the latest ``end_s`` in the trace,
    so traces of both attempts stay on one time axis, and ``restarts`` (the run's supervised restarts, one
    JSON object each, written into every ``status.json``) continues the existing status's list. ``sink``
    (default none), set by its owner, receives the metrics and status too (:class:`RecordSink`).

    Args:
        run_dir: the run directory (``run.output_dir`` of the graph file).
        clock: the run clock; default a new :class:`RunClock` (continuing an existing trace).
    """

    def __init__(self, run_dir: str | os.PathLike[str], clock: RunClock | None = None) -> None:
        self.run_dir = Path(run_dir)
        for sub in (METRICS_DIR, TRACE_DIR, CHECKPOINTS_DIR):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        if clock is None:
            previous = read_trace(self.run_dir)
            offset = max(previous.column("end_s").to_pylist(), default=0.0) if previous.num_rows else 0.0
            clock = RunClock(offset_s=offset)
        self.clock = clock
        self.sink: RecordSink | None = None
        earlier = (read_status(self.run_dir) or {}).get("restarts")
        self.restarts: list[dict[str, Any]] = list(earlier) if isinstance(earlier, list) else []

    # --- paths -----------------------------------------------------------------------------------
    @property
    def metrics_dir(self) -> Path:
        return self.run_dir / METRICS_DIR

    @property
    def trace_dir(self) -> Path:
        return self.run_dir / TRACE_DIR

    @property
    def checkpoints_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR

    def now(self) -> float:
        """Seconds since the run's start (the clock trace rows must use)."""
        return self.clock.now()

    # --- writers ---------------------------------------------------------------------------------
    def write_status(self, state: RunState | str, iteration: int) -> None:
        """Atomically write ``status.json``: state, iteration, this process's pid, ISO-8601 UTC time, and
        the run's ``restarts`` if it had any.

        Raises:
            ValueError: ``state`` is not running, finished, interrupted (stopped by a signal after saving a
                checkpoint) or failed.
        """
        if state not in RUN_STATES:
            raise ValueError(f"run state must be one of {RUN_STATES}, got {state!r}")
        if self.sink is not None and state == "running":
            self.sink.open(int(iteration))  # (a no-op once open) before the status says the run is running
        status: dict[str, Any] = {
            "state": state,
            "iteration": int(iteration),
            "pid": os.getpid(),
            "updated": _now_iso(),
        }
        if self.restarts:
            status["restarts"] = self.restarts
        _atomic_write_text(self.run_dir / STATUS_FILE, json.dumps(status, indent=1) + "\n")
        if self.sink is not None and state != "running":
            self.sink.close(state)

    def write_text(self, name: str, text: str) -> Path:
        """Atomically write a text file in the run dir (``graph.yaml``, ``plan.yaml``)."""
        path = self.run_dir / name
        _atomic_write_text(path, text)
        return path

    def log_metrics(self, iteration: int, metrics: Mapping[str, float]) -> Path:
        """Write ``metrics/iter-XXXXXX.parquet``: ``iteration`` int64 plus one float64 column per metric.

        Logging the same iteration again merges into its file (new values win), so evaluation metrics may
        be logged after the training ones.

        Raises:
            ValueError: a metric is named ``iteration`` or its value is not a real number.
        """
        values: dict[str, float] = {}
        for name, value in metrics.items():
            if name == "iteration":
                raise ValueError("a metric cannot be named 'iteration' (it is the index column)")
            try:
                values[name] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"metric {name!r} = {value!r} is not a number") from None
        logged = dict(values)
        path = self.metrics_dir / f"iter-{int(iteration):06d}.parquet"
        if path.exists():
            old = _read_parquet(path)
            if old is not None and old.num_rows:
                merged = {k: old.column(k)[0].as_py() for k in old.column_names if k != "iteration"}
                merged.update(values)
                values = {k: float("nan") if v is None else float(v) for k, v in merged.items()}
        columns: dict[str, pa.Array] = {"iteration": pa.array([int(iteration)], pa.int64())}
        for name, value in values.items():
            columns[name] = pa.array([value], pa.float64())
        _atomic_write_table(path, pa.table(columns))
        if self.sink is not None:
            self.sink.log(int(iteration), logged)
        return path

    def log_trace(self, rows: Iterable[TraceRow]) -> list[Path]:
        """Append trace rows: one new Parquet file per iteration present in ``rows``.

        The first flush of iteration 7 is ``trace/iter-000007.parquet``, later ones
        ``iter-000007-001.parquet``, ... so a controller may flush after every node and a crash loses at
        most the unflushed rows. Returns the files written.
        """
        by_iteration: dict[int, list[TraceRow]] = {}
        for row in rows:
            by_iteration.setdefault(int(row.iteration), []).append(row)
        written = []
        for iteration, group in sorted(by_iteration.items()):
            path = self._next_trace_path(iteration)
            _atomic_write_table(path, trace_rows_to_table(group))
            written.append(path)
        return written

    def log_prompts(self, iteration: int, epoch: int, ids: Sequence[Any]) -> Path:
        """Append iteration ``iteration``'s prompt ids (train order) and epoch to ``prompts.jsonl``."""
        return append_prompts(self.run_dir, iteration, epoch, ids)

    def drop_after(self, iteration: int) -> None:
        """Remove metrics and trace files and prompt-record lines of iterations after ``iteration`` (a
        killed run's leftovers, before a resume from the checkpoint of ``iteration``)."""
        drop_prompts_after(self.run_dir, iteration)
        for directory in (self.metrics_dir, self.trace_dir):
            for path in directory.iterdir():
                match = _ITER_FILE_RE.match(path.name)
                if match and int(match.group(1)) > iteration:
                    path.unlink()

    def write_predicted_trace(self, rows: Sequence[TraceRow]) -> Path:
        """Write the planner's predicted timeline (``predicted_trace.parquet``, trace columns)."""
        path = self.run_dir / PREDICTED_TRACE_FILE
        _atomic_write_table(path, trace_rows_to_table(rows))
        return path

    @contextlib.contextmanager
    def checkpoint(self, iteration: int) -> Iterator[Path]:
        """Context manager yielding a temp directory; on success it is renamed to
        ``checkpoints/iter-XXXXXX`` (replacing an older one of that iteration), on error removed."""
        final = self.checkpoints_dir / f"iter-{int(iteration):06d}"
        tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + final.name + "-", dir=self.checkpoints_dir))
        try:
            normal_mode(tmp, directory=True)
            yield tmp
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():
            # A directory cannot be os.replace'd over a non-empty one: move the old aside first.
            old = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + "old-", dir=self.checkpoints_dir))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)

    def _next_trace_path(self, iteration: int) -> Path:
        base = self.trace_dir / f"iter-{iteration:06d}.parquet"
        if not base.exists():
            return base
        k = 1
        while (path := self.trace_dir / f"iter-{iteration:06d}-{k:03d}.parquet").exists():
            k += 1
        return path


# --- readers ---------------------------------------------------------------------------------------


def _read_parquet(path: Path) -> pa.Table | None:
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        warnings.warn(f"skipping unreadable record file {path}: {exc}", RuntimeWarning, stacklevel=3)
        return None


def _iter_files(directory: Path) -> list[Path]:
    """Record files of a directory in (iteration, flush) order; temp and foreign files ignored."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _ITER_FILE_RE.match(path.name)
        if match:
            found.append((int(match.group(1)), int(match.group(2) or 0), path))
    return [path for _, _, path in sorted(found)]


def read_metrics(run_dir: str | os.PathLike[str]) -> pa.Table:
    """All metrics of a run, one row per iteration sorted by iteration.

    Columns: ``iteration`` int64, then every metric name seen in any iteration (float64, null where an
    iteration did not log it). An empty table with only ``iteration`` when there are no metrics.
    """
    tables = [t for p in _iter_files(Path(run_dir) / METRICS_DIR) if (t := _read_parquet(p)) is not None]
    if not tables:
        return pa.table({"iteration": pa.array([], pa.int64())})
    table = pa.concat_tables(tables, promote_options="permissive")
    return table.sort_by("iteration")


def read_trace(run_dir: str | os.PathLike[str]) -> pa.Table:
    """All trace rows of a run (:data:`TRACE_SCHEMA`), sorted by iteration then ``start_s``."""
    tables = [t for p in _iter_files(Path(run_dir) / TRACE_DIR) if (t := _read_parquet(p)) is not None]
    return _concat_trace(tables)


def read_predicted_trace(run_dir: str | os.PathLike[str]) -> pa.Table | None:
    """The planner's predicted timeline, or ``None`` when the run has none (or it is unreadable)."""
    path = Path(run_dir) / PREDICTED_TRACE_FILE
    if not path.is_file():
        return None
    table = _read_parquet(path)
    return None if table is None else _concat_trace([table])


def _concat_trace(tables: list[pa.Table]) -> pa.Table:
    conformed = []
    for table in tables:
        try:
            conformed.append(table.select(TRACE_SCHEMA.names).cast(TRACE_SCHEMA))
        except (KeyError, pa.ArrowException) as exc:
            warnings.warn(
                f"skipping trace table without the trace columns: {exc}", RuntimeWarning, stacklevel=3
            )
    if not conformed:
        return TRACE_SCHEMA.empty_table()
    table = pa.concat_tables(conformed)
    return table.sort_by([("iteration", "ascending"), ("start_s", "ascending")])


def read_status(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``status.json`` as a dict, or ``None`` when missing or unreadable."""
    path = Path(run_dir) / STATUS_FILE
    try:
        status = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return status if isinstance(status, dict) else None


# What a run directory may hold; `remove_run_dir` refuses a directory with anything else in it.
_RUN_ENTRIES: Final = frozenset(
    {GRAPH_FILE, STATUS_FILE, METRICS_DIR, TRACE_DIR, CHECKPOINTS_DIR, PLAN_FILE, PREDICTED_TRACE_FILE,
     LOCK_FILE, TRACKERS_DIR, PROMPTS_FILE, "dashboard.html", "dashboard.png"}
)  # fmt: skip


def remove_run_dir(run_dir: str | os.PathLike[str]) -> None:
    """Empty a run directory (``rlflow run --overwrite``), refusing anything that may hold other data.

    The lock file (``run.lock``) and the directory stay: the caller holds the lock, and a new lock file
    would let another run lock the directory alongside it.

    Before deleting anything it checks that every entry can be removed (each directory to be emptied
    writable, and for root, who ignores permission bits, no immutable entry): a failed ``--overwrite``
    must not leave half a run. Then it deletes in an order that never leaves a directory ``--resume``
    would continue: ``checkpoints/`` is first renamed away (one atomic step, after which no checkpoint is
    visible) and deleted, then the records, and ``status.json`` last, so an interrupted delete still reads
    as a run directory that a retried ``--overwrite`` empties.

    Raises:
        ValueError: ``run_dir`` is the working directory or one of its parents, has no ``status.json``,
            holds entries a run does not write (named in the message), or holds an entry this process
            cannot remove (named); nothing is deleted then. Also when the OS refuses a deletion the check
            could not foresee (the path named; the checkpoints are gone by then).
    """
    path = Path(run_dir)
    if not path.exists():
        return
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(f"'{run_dir}' is the working directory or one of its parents; not deleting it")
    entries = [p for p in path.iterdir() if p.name != LOCK_FILE]
    if not entries:
        return
    if not (path / STATUS_FILE).is_file():
        raise ValueError(f"'{run_dir}' is not an rlflow run directory (no {STATUS_FILE}); not deleting it")
    foreign = sorted(
        p.name for p in entries if p.name not in _RUN_ENTRIES and not p.name.startswith(TMP_PREFIX)
    )
    if foreign:
        raise ValueError(
            f"'{run_dir}' holds files a run does not write ({', '.join(foreign[:5])}); not deleting it"
        )
    blocked = _undeletable(path, entries)
    if blocked is not None:
        where, why = blocked
        raise ValueError(f"cannot delete '{where}' in '{run_dir}' ({why}); nothing was deleted")
    first = [p for p in entries if p.name == CHECKPOINTS_DIR]
    last = [p for p in entries if p.name == STATUS_FILE]
    try:
        for entry in first:  # no checkpoint visible from here on: --resume refuses the directory
            hidden = path / f"{TMP_PREFIX}{CHECKPOINTS_DIR}-{os.getpid()}-{time.monotonic_ns()}"
            os.replace(entry, hidden)
            shutil.rmtree(hidden)
        for entry in [p for p in entries if p not in first and p not in last] + last:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    except OSError as e:
        failed = e.filename or path
        raise ValueError(
            f"deleting '{run_dir}' stopped at '{failed}' ({e.strerror or e}); its checkpoints are gone, so "
            "--resume refuses it: make it writable and --overwrite again"
        ) from None


def _undeletable(run_dir: Path, entries: Sequence[Path]) -> tuple[Path, str] | None:
    """The first of ``entries`` (or a path under one) that this process cannot delete, with why; None when
    all can go. A directory must be writable and searchable to be emptied; access() honours an immutable
    flag or a read-only file system even for root, who alone may skip the permission bits, so for root
    files are checked too (an unprivileged user deletes a read-only file from a writable directory)."""
    privileged = hasattr(os, "geteuid") and os.geteuid() == 0
    dirs, files = [run_dir], []
    unreadable: list[OSError] = []
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            for root, subdirs, names in os.walk(entry, onerror=unreadable.append):
                dirs.append(Path(root))
                # os.walk lists symlinks to directories in subdirs without descending into them
                files += [
                    Path(root) / n for n in names + [d for d in subdirs if (Path(root) / d).is_symlink()]
                ]
        else:
            files.append(entry)
    if unreadable:  # a directory that cannot be listed cannot be emptied
        err = unreadable[0]
        return Path(err.filename or run_dir), err.strerror or "not readable"
    for directory in dirs:
        if not os.access(directory, os.W_OK | os.X_OK):
            return directory, "not writable"
    if privileged:
        for file in files:
            if not file.is_symlink() and not os.access(file, os.W_OK):
                return file, "immutable or on a read-only file system"
    return None


def list_checkpoints(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Completed checkpoints ``(iteration, path)`` in iteration order (temp dirs ignored)."""
    directory = Path(run_dir) / CHECKPOINTS_DIR
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _CKPT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The newest completed checkpoint ``(iteration, path)``, or ``None``."""
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None
