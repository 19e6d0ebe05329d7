"""The controller ↔ worker protocol: one frozen dataclass per command and per reply, and their framing.

Every message is pickled by value (:func:`send`/:func:`recv`) over a ``multiprocessing.connection``
(the controller's address and an auth key). The worker (:mod:`rlflow.schedulers.runtime.distributed.worker`)
dispatches commands with a ``match`` statement; the controller's side is
:class:`~rlflow.schedulers.runtime.distributed.pool.WorkerPool`.

* worker → controller: :class:`Hello`, then :class:`Ready` after :class:`Setup`, then per command
  :class:`Done` (its payload: :class:`NodeReport` for :class:`RunNode`, :class:`SyncReport` for
  :class:`Sync`, or what the command's docstring names) or :class:`Failed` (the error and traceback).
* controller → worker: :class:`Setup` first, then commands with an id (``cmd``) that the reply repeats;
  :class:`Stop` ends the loop.

Node outputs stay on the workers; a reply describes them with :class:`TensorMeta` (shape, dtype, per-row
token counts) or carries a per-row list as :class:`ListMeta`.
"""

from __future__ import annotations

import copyreg
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.runtime.distributed.transfer import Handle, Part

__all__ = [
    "Command",
    "DistConfig",
    "Done",
    "Failed",
    "Fetch",
    "Free",
    "GetState",
    "Hello",
    "ListMeta",
    "LoadState",
    "NodeReport",
    "OutputMeta",
    "Pull",
    "Put",
    "Ready",
    "Reply",
    "RunNode",
    "Setup",
    "Stop",
    "Stored",
    "Sync",
    "SyncReport",
    "TargetReport",
    "TensorMeta",
    "Xfer",
    "recv",
    "send",
]


def send(conn: Connection, msg: Any) -> int:
    """Send ``msg`` pickled by value (tensors copied, never shared through file descriptors); its bytes."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)
    return len(data)


def recv(conn: Connection) -> Any:
    """Receive a message of :func:`send`."""
    return pickle.loads(conn.recv_bytes())


LAUNCHES = ("spawn", "external", "ray")


@dataclass(frozen=True)
class DistConfig:
    """Timeouts (seconds) and process settings of a
    :class:`~rlflow.schedulers.runtime.distributed.dist_executor.DistExecutor`; it travels to the workers
    in :class:`Setup`.

    Attributes:
        start_timeout_s: workers must connect and finish building their models within this.
        node_timeout_s: the longest one command (node, sync, fetch) may take.
        collective_timeout_s: timeout of every process group's collectives on the workers.
        grace_s: after :class:`Stop`, seconds the workers have to exit before SIGKILL.
        threads: torch/OpenMP threads per worker; ``None``: the rule of
            :func:`~rlflow.schedulers.runtime.threads.choose_threads` (the host's cores divided among the
            workers placed on it, or the user's ``RLFLOW_NUM_THREADS``/``OMP_NUM_THREADS``), resolved by
            the launcher; the worker's copy always holds the number it uses.
        launch: ``"spawn"`` (embedded launcher), ``"external"`` (wait for torchrun-started workers) or
            ``"ray"`` (one Ray actor per device, :mod:`rlflow.schedulers.runtime.distributed.ray_launch`).
        address: controller listen address for ``external`` (host, port); port 0 picks a free one (the Ray
            launcher listens on this host's address in the Ray cluster instead).
        ray_address: the Ray cluster for ``"ray"`` (``HOST:PORT``, ``auto``; ``None``: ``RAY_ADDRESS`` or
            a local instance).
        env: environment variables set for spawned workers.
        realloc: weight syncs use the planned reallocation where the layouts allow it (``"auto"``) or
            always the gather path (``"gather"``: all-gather in the source mesh, then broadcast).
        release_replicas: a model instance that only vLLM engines read frees its parameters once its
            engines hold the weights and allocates them again for the next weight sync
            (:class:`~rlflow.schedulers.runtime.distributed.replicas.Replicas`); ``False`` keeps it resident
            (the control of the tests: same results, one more copy of the model per engine device).

    Raises:
        PlanError: ``realloc`` is neither ``"auto"`` nor ``"gather"``, ``launch`` is unknown, or ``threads``
            is below 1.
    """

    start_timeout_s: float = 300.0
    node_timeout_s: float = 3600.0
    collective_timeout_s: float = 300.0
    grace_s: float = 5.0
    threads: int | None = None
    launch: str = "spawn"
    address: tuple[str, int] = ("127.0.0.1", 0)
    env: dict[str, str] = field(default_factory=dict)
    realloc: str = "auto"
    ray_address: str | None = None
    release_replicas: bool = True

    def __post_init__(self) -> None:
        if self.realloc not in ("auto", "gather"):
            raise PlanError(f"DistConfig.realloc must be 'auto' or 'gather', got {self.realloc!r}")
        if self.launch not in LAUNCHES:
            raise PlanError(f"DistConfig.launch must be one of {', '.join(LAUNCHES)}, got {self.launch!r}")
        if self.threads is not None and self.threads < 1:
            raise PlanError(f"DistConfig.threads must be >= 1 (or None: chosen per host), got {self.threads}")


# -- output metadata -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """An output tensor kept on a dp leader: its local ``shape`` (``[B_local, ...]``), ``dtype``, and
    ``lengths``, the per-row sums of a ``*_mask`` tensor (tokens per row; ``None`` for other keys)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    lengths: list[int] | None = None

    @property
    def rows(self) -> int:
        """Local rows."""
        return int(self.shape[0])


@dataclass(frozen=True, slots=True)
class ListMeta:
    """A per-row list output (e.g. texts); it travels as it is."""

    values: list[Any]

    @property
    def rows(self) -> int:
        """Local rows."""
        return len(self.values)


OutputMeta = TensorMeta | ListMeta


# -- commands (controller -> worker) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """Build the worker: its meshes and model instances (``checkpoint_dir``: weights to resume from)."""

    graph: Graph
    checkpoint_dir: Path | None
    config: DistConfig


@dataclass(frozen=True, slots=True)
class Xfer:
    """The rank's :class:`~rlflow.schedulers.runtime.distributed.transfer.Part` of a node's input transfer
    (rows to send, to receive, to free); ``keep``: the rank is in the node's mesh and keeps what it
    received for the node's :class:`RunNode`. Reply payload: ``None``."""

    cmd: int
    part: Part
    keep: bool


@dataclass(frozen=True, slots=True)
class RunNode:
    """Run ``node`` on the rank's rows. ``local``: the rank's share of the inputs the controller holds
    (per-row lists); ``order``: the input names in the controller's order; ``mini_rows``: the rank's rows
    per mini-batch of a dp train node (``None``: equal split); ``xfer``: the id of the :class:`Xfer` that
    brought its input rows (``None``: none); ``segment``: ``(j, segments)`` of an interruptible generate
    node (``NodeContext.segment``; ``None``: the whole call). Reply payload: :class:`NodeReport`."""

    cmd: int
    node: str
    iteration: int
    local: Batch
    order: list[str]
    mini_rows: tuple[int, ...] | None
    xfer: int | None
    segment: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Put:
    """Hold source rows from the controller (``key -> [B_local, ...]``). Reply payload: ``None``."""

    cmd: int
    iteration: int
    rows: dict[str, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Pull:
    """Copy held rows to the controller: one CPU tensor per ``(handle, local rows)``."""

    cmd: int
    items: list[tuple[Handle, tuple[int, ...]]]


@dataclass(frozen=True, slots=True)
class Free:
    """Drop held rows. Reply payload: ``None``."""

    cmd: int
    handles: list[Handle]


@dataclass(frozen=True, slots=True)
class Stored:
    """List the handles held (sorted)."""

    cmd: int


@dataclass(frozen=True, slots=True)
class Sync:
    """Copy instance ``src``'s weights to ``dsts`` (collective on their ranks), now at ``version``.
    Reply payload: :class:`SyncReport`."""

    cmd: int
    src: int
    dsts: tuple[int, ...]
    version: int


@dataclass(frozen=True, slots=True)
class Fetch:
    """Full parameters of ``instance`` (collective on its mesh): ``name -> tensor`` from its first rank,
    ``None`` from the others; with ``adapters`` a LoRA model's trained parameters only (its adapters)."""

    cmd: int
    instance: int
    adapters: bool = False


@dataclass(frozen=True, slots=True)
class GetState:
    """The rank's optimizer/scheduler shards, weight versions and node generators."""

    cmd: int


@dataclass(frozen=True, slots=True)
class LoadState:
    """Restore a :class:`GetState` payload. Reply payload: ``None``."""

    cmd: int
    state: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Stop:
    """End the command loop (no reply)."""


Command = Setup | Xfer | RunNode | Put | Pull | Free | Stored | Sync | Fetch | GetState | LoadState | Stop


# -- replies (worker -> controller) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    """The worker connected."""

    rank: int


@dataclass(frozen=True, slots=True)
class Ready:
    """The worker finished :class:`Setup`."""

    rank: int


@dataclass(frozen=True, slots=True)
class Done:
    """Command ``cmd`` finished on ``rank``; ``payload`` as the command's docstring says."""

    cmd: int
    rank: int
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Failed:
    """Command ``cmd`` raised on ``rank`` while doing ``what``: ``message`` and the worker's traceback;
    ``lost``: the cause when the error was a :class:`~rlflow.dataflow.errors.ProcessLost` (e.g. ``engine``:
    the worker lives but its vLLM engine died), else ``None``."""

    cmd: int
    rank: int
    what: str
    message: str
    traceback: str
    lost: str | None = None


Reply = Hello | Ready | Done | Failed


@dataclass(frozen=True, slots=True)
class NodeReport:
    """What a rank reports of one node run: ``start``/``end`` (wall-clock seconds, ``time.time``,
    transfer included) on every rank; on a dp leader also the metadata of its outputs (by output name),
    the node's ``metrics``, ``tokens``, local input ``rows`` and the model's weight ``version``; ``spans``:
    on every rank, the phases the node function reported (``NodeResult.spans``: kind, start, end);
    ``peak_memory``: on every rank, the peak bytes its device has held so far
    (:func:`~rlflow.schedulers.runtime.devices.peak_memory_bytes`)."""

    start: float
    end: float
    outputs: dict[str, OutputMeta] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    rows: int = 0
    version: int = 0
    spans: tuple[tuple[str, float, float], ...] = ()
    peak_memory: int = 0


@dataclass(frozen=True, slots=True)
class TargetReport:
    """One target instance of a weight sync on one rank: its ``path`` (``"plan"``/``"gather"``), the
    ``moved`` bytes of the whole sync (summed over receivers; ``None`` where this rank did not take
    part), and this rank's target ``checksum`` (BLAKE2b hex of its shards, ``None`` off the target)."""

    path: str
    moved: int | None = None
    checksum: str | None = None


@dataclass(frozen=True, slots=True)
class SyncReport:
    """A rank's weight-sync report: ``sync_start``/``sync_end`` (wall-clock seconds), ``bytes`` (this
    rank's bytes sent + received) and a :class:`TargetReport` per target instance."""

    sync_start: float
    sync_end: float
    bytes: int
    targets: dict[int, TargetReport]


# Compact messages on the wire, for a cost near the tuples they replaced (a reply is ~10 µs to pickle and
# unpickle; the per-node traffic through the controller stays a few KB): each class is pickled as its
# field values (no field names) and named by a one-byte pickle extension code (copyreg's private-use range
# 240-255) instead of its module path. Start-up and error messages (Setup, Hello, Ready, Failed, Stop) are
# rare and keep the default.
_WIRE = (
    RunNode, Xfer, Put, Pull, Free, Stored, Sync, Fetch, GetState, LoadState,
    Done, NodeReport, TensorMeta, ListMeta, SyncReport, TargetReport,
)  # fmt: skip


def _reducer(cls: type) -> Callable[[Any], tuple[type, tuple[Any, ...]]]:
    """``__reduce__`` for dataclass ``cls``: rebuild it from its field values, in field order."""
    names = [f.name for f in fields(cls)]
    many = operator.attrgetter(*names) if len(names) > 1 else None

    def reduce(self: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, many(self) if many is not None else (getattr(self, names[0]),)

    return reduce


for _code, _cls in enumerate(_WIRE, start=240):
    _cls.__reduce__ = _reducer(_cls)  # type: ignore[method-assign,assignment]
    copyreg.add_extension(__name__, _cls.__qualname__, _code)
