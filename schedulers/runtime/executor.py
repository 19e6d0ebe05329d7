"""Executors: where node functions run. The controller only talks to the :class:`Executor` interface.

:func:`~rlflow.schedulers.runtime.choose_executor.make_executor` picks one for a graph:
:class:`LocalExecutor` for the trivial plan (one device, every node ``d1t1p1``), else
:class:`~rlflow.schedulers.runtime.distributed.dist_executor.DistExecutor` (worker processes).

:class:`LocalExecutor` runs every node in this process on one device (``cuda:0`` when present, else the
CPU): it is the trivial plan, every node on device 0 with ``d1t1p1m<m>``. It owns the models of the graph
(built once, shared by every node that calls them, so a train step is seen by the next call of the same
model without any reallocation), their optimizers, and one random generator per node; what it builds is
built by :mod:`rlflow.schedulers.runtime.instances`, as the workers build theirs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from rlflow.dataflow.batch import Batch, RemoteRows
from rlflow.dataflow.errors import ModelError, NodeError, PlanError, ProcessLost, RlflowError
from rlflow.dataflow.graph import Graph
from rlflow.nodes.context import ModelState, NodeContext, NodeResult
from rlflow.nodes.tokenizers import data_tokenizer
from rlflow.schedulers.realloc.ema import check_ema_shards, ema_update
from rlflow.schedulers.realloc.regions import ReallocError
from rlflow.schedulers.runtime.devices import default_device, peak_memory_bytes
from rlflow.schedulers.runtime.instances import (
    build_models,
    close_engines,
    contexts_state,
    engine_settings,
    load_contexts_state,
    node_context,
    save_model,
    train_or_freeze,
    train_steps,
)

__all__ = ["Executor", "Finished", "LocalExecutor", "LocalTicket", "saved_plan_text"]


@dataclass(frozen=True)
class Finished:
    """A node that ran: its result, and when it started and ended (wall-clock seconds, ``time.time()``).

    For the distributed runtime ``start`` is the first worker's start and ``end`` the last worker's end,
    including the weight sync after a train node; the controller's dispatch is not part of it.

    Attributes:
        workers: worker rank -> (start, end) of the node on it (wall-clock seconds); the single-process
            executor is worker 0.
        syncs: after a train node, worker rank -> (start, end, bytes sent + received) of the weight sync
            to the model's other instances (empty when there was none).
        spans: worker rank -> the phases inside the node that it reported (:attr:`NodeResult.spans`:
            ``(kind, start, end)``, wall-clock seconds), e.g. an agent's ``tool`` steps.
    """

    name: str
    result: NodeResult
    start: float
    end: float
    workers: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    syncs: Mapping[int, tuple[float, float, int]] = field(default_factory=dict)
    spans: Mapping[int, Sequence[tuple[str, float, float]]] = field(default_factory=dict)


TicketT = TypeVar("TicketT")


class Executor(Protocol[TicketT]):
    """What the controller needs from a set of workers (``TicketT``: the executor's ticket type).

    ``submit`` hands a node and its inputs to its workers and returns a ticket without waiting;
    ``wait_any`` blocks until one of the given tickets has finished. Nodes submitted while others run
    may run at the same time (disjoint meshes) or after them in submission order (shared devices).
    """

    @property
    def device(self) -> torch.device:
        """Where the controller's own tensors go (the evaluation's batches)."""
        ...

    @property
    def models(self) -> Mapping[str, ModelState]:
        """Every model, current (the evaluation generates with them)."""
        ...

    @property
    def data_tokenizer(self) -> Any:
        """The tokenizer the data set is tokenized with."""
        ...

    def submit(
        self, name: str, batch: Batch, iteration: int, segment: tuple[int, int] | None = None
    ) -> TicketT: ...

    def wait_any(self, tickets: Sequence[TicketT]) -> tuple[TicketT, Finished]: ...

    def source(self, batch: Batch, iteration: int, done: Collection[str] = ()) -> dict[str, Any]: ...

    def pull(self, values: Mapping[str, Any]) -> Batch: ...

    def release(self, values: Sequence[RemoteRows]) -> None:
        """Free the rows of references no node will read (a filter's rounds: rows of the groups that did
        not go on), whatever reads were still counted."""
        ...

    def run_node(self, name: str, batch: Batch, iteration: int) -> NodeResult: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def save_models(self, directory: Path) -> None: ...

    def worker_memory(self) -> dict[int, int]:
        """Worker rank -> the peak memory (bytes) its device has held so far
        (:func:`~rlflow.schedulers.runtime.devices.peak_memory_bytes`)."""
        ...

    @property
    def runs_when_submitted(self) -> bool:
        """Whether a submitted node runs while the controller goes on (worker processes: busy from its
        submission); ``False``: it runs only inside :meth:`wait_any` (one process)."""
        ...

    def close(self, force: bool = False) -> None: ...


def saved_plan_text(state: Mapping[str, Any]) -> str:
    """The plan an executor state was written under, for error messages: ``N worker(s), node devices
    layout, ...`` (the distributed runtime's ``plan`` entry), or ``one process``."""
    plan = state.get("plan")
    if not isinstance(plan, Mapping):
        return "one process (every node on device 0)"

    def layout(dp: int, tp: int, pp: int, ep: int = 1) -> str:  # ep: absent from older checkpoints
        return f"d{dp}t{tp}p{pp}" + (f"e{ep}" if ep > 1 else "")

    nodes = ", ".join(f"{name} devices {list(spec[0])} {layout(*spec[1:])}" for name, spec in plan.items())
    workers = len(state.get("workers", {}))
    return f"{workers} workers ({nodes})"


def _data(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.data for k, p in module.named_parameters()}


@dataclass(frozen=True, eq=False)
class LocalTicket:
    """A node submitted to :class:`LocalExecutor`: it runs when waited for."""

    name: str
    batch: Batch
    iteration: int
    segment: tuple[int, int] | None = None


class LocalExecutor:
    """All models and nodes of ``graph`` in this process, on ``device``.

    Args:
        graph: the validated graph.
        device: torch device (default
            :func:`~rlflow.schedulers.runtime.devices.default_device`).
        checkpoint_dir: when resuming, a checkpoint directory whose ``models/<name>`` replace the
            graph's initial weights.
        start_engines: start the vLLM engines of ``engine: vllm`` nodes (off for a copy that runs no
            node, such as the distributed executor's mirror).

    Raises:
        PlanError: the plan places a node on more than one device or with dp/tp/pp > 1 (that needs the
            distributed runtime).
        ModelError: a model or tokenizer cannot be loaded.
    """

    def __init__(
        self,
        graph: Graph,
        device: torch.device | None = None,
        checkpoint_dir: Path | None = None,
        start_engines: bool = True,
    ):
        self.graph = graph
        self.device = device or default_device()
        for name in graph.nodes:
            placement = graph.placement(name)
            layout = placement.layout
            if len(placement.devices) != 1 or (layout.dp, layout.tp, layout.pp) != (1, 1, 1):
                raise PlanError(
                    f"node '{name}' is placed on devices {list(placement.devices)} with layout {layout}; "
                    "the single-process runtime runs layouts d1t1p1m<m> on one device only"
                )
        self.models: dict[str, ModelState] = {}
        self._build_models(checkpoint_dir)
        self._data_tokenizer = data_tokenizer(graph, {name: m.tokenizer for name, m in self.models.items()})
        self.contexts: dict[str, NodeContext] = {
            name: node_context(
                graph,
                name,
                self.models.get(node.model) if node.model else None,
                self.device,
                0,
                self._data_tokenizer,
            )
            for name, node in graph.nodes.items()
        }
        if start_engines:  # the distributed executor's mirror runs no node: its engines would sit idle
            self._start_engines()

    def _start_engines(self) -> None:
        """One vLLM engine per node whose engine is vLLM (``engine: vllm``, or ``auto`` that the plan resolved
        to it; this process is its only data-parallel rank): in this process when there is one, else each
        in vLLM's own processes."""
        from rlflow.nodes.engines.validation import engine_nodes

        names = engine_nodes(self.graph)
        if not names:
            return
        from rlflow.nodes.engines.engine_restart import start_engine

        try:
            for name in names:
                settings = engine_settings(self.graph, name, 1, 0)
                self.contexts[name].engine = start_engine(
                    self.contexts[name],
                    max_rows=settings.max_rows,
                    seed=settings.seed,
                    in_process=len(names) == 1,
                    gpu_memory_utilization=settings.gpu_memory_utilization,
                    device_memory=settings.device_memory,
                    max_model_len=settings.max_model_len,
                    max_restarts=settings.max_restarts,
                )
        except BaseException:
            self.close()
            raise

    # -- models -------------------------------------------------------------------------------------
    def _build_models(self, checkpoint_dir: Path | None) -> None:
        """Every model of the graph on :attr:`device` (:func:`build_models`), with its optimizer or frozen
        (:func:`train_or_freeze`); checks that each EMA follower can follow its source."""
        spec = self.graph.spec
        steps = train_steps(self.graph)
        modules, tokenizers = build_models(self.graph, self.device, checkpoint_dir, move=True)
        for name, module in modules.items():
            mspec = spec.models[name]
            state = ModelState(
                name=name, module=module, head=mspec.head, tokenizer=tokenizers[name], base_of=mspec.base_of
            )
            train_or_freeze(state, mspec, steps.get(name, 0))
            self.models[name] = state
        for name, mspec in spec.models.items():
            if mspec.ema is not None:
                try:
                    check_ema_shards(
                        dict(self.models[name].module.named_parameters()),
                        dict(self.models[mspec.ema.source].module.named_parameters()),
                    )
                except ReallocError as e:
                    raise ModelError(f"models.{name}.ema: {e}") from None

    def _follow(self, trained: str) -> None:
        """EMA update of every model whose ``ema.source`` is ``trained`` (after its train node ran)."""
        for name, mspec in self.graph.spec.models.items():
            if mspec.ema is not None and mspec.ema.source == trained:
                ema_update(_data(self.models[name].module), _data(self.models[trained].module), mspec.ema.eta)

    @property
    def data_tokenizer(self) -> Any:
        """The tokenizer the data set is tokenized with."""
        return self._data_tokenizer

    @property
    def runs_when_submitted(self) -> bool:
        """``False``: one process runs a submitted node only when it is waited for (:meth:`wait_any`)."""
        return False

    # -- running --------------------------------------------------------------------------------------
    def submit(
        self, name: str, batch: Batch, iteration: int, segment: tuple[int, int] | None = None
    ) -> LocalTicket:
        """A ticket for node ``name`` (``segment``: ``(j, segments)`` of an interruptible generate node,
        ``NodeContext.segment``); one process runs one node at a time, so it runs in :meth:`wait_any`."""
        return LocalTicket(name, batch, iteration, segment)

    def wait_any(self, tickets: Sequence[LocalTicket]) -> tuple[LocalTicket, Finished]:
        """Run the earliest submitted ticket now (the order a single device would run them).

        Raises:
            NodeError: the node failed (see :meth:`run_node`).
        """
        t = tickets[0]
        start = time.time()
        result = self.run_node(t.name, t.batch, t.iteration, t.segment)
        end = time.time()
        return t, Finished(t.name, result, start, end, workers={0: (start, end)}, spans={0: result.spans})

    def source(self, batch: Batch, iteration: int, done: Collection[str] = ()) -> dict[str, Any]:
        """The controller's store entries for an iteration's source data (or, on a resume, the values of
        an iteration in flight whose nodes ``done`` have run): the batch's values as they are."""
        return dict(batch.items())

    def pull(self, values: Mapping[str, Any]) -> Batch:
        """``values`` as a batch on the CPU (this process holds every value already)."""
        return Batch(values).to(torch.device("cpu"))

    def release(self, values: Sequence[RemoteRows]) -> None:
        """Nothing to free: this process holds every value itself (never :class:`RemoteRows`)."""

    def run_node(
        self, name: str, batch: Batch, iteration: int, segment: tuple[int, int] | None = None
    ) -> NodeResult:
        """Run node ``name`` on ``batch`` (canonical input names); ``segment``: one segment of an
        interruptible generate node (``NodeContext.segment``), ``None``: the whole call.

        Raises:
            NodeError: the function failed; names the node, its function and the cause.
        """
        ctx = self.contexts[name]
        ctx.iteration = iteration
        ctx.segment = segment
        node = ctx.node
        fn = self.graph.function(name).fn
        try:
            with ctx.model.calling() if ctx.model is not None else contextlib.nullcontext():
                result = fn(ctx, batch.to(self.device), **node.args)
            if node.kind == "train" and node.model is not None:
                self._follow(node.model)
            return result
        except ProcessLost as e:  # keeps its type: a supervised restart may fix it
            msg = str(e)
            raise ProcessLost(msg if f"'{name}'" in msg else f"node '{name}': {msg}", e.cause) from e
        except NodeError as e:
            msg = str(e)
            raise NodeError(msg if f"'{name}'" in msg else f"node '{name}': {msg}") from e
        except RlflowError:
            raise
        except Exception as e:
            raise NodeError(
                f"node '{name}' (function '{node.function}', iteration {iteration}) failed: "
                f"{type(e).__name__}: {e}"
            ) from e

    # -- state ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Optimizer, scheduler, weight versions, per-node generator states and the partial rollouts
        between segments (interruptible generation)."""
        return {
            "models": {name: s.train_state() for name, s in self.models.items()},
            **contexts_state(self.contexts),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (models must already hold the checkpoint's weights).

        Raises:
            PlanError: the checkpoint was written by the distributed runtime (a multi-device plan).
        """
        if "models" not in state:
            raise PlanError(
                "the checkpoint was written by the distributed runtime under "
                f"{saved_plan_text(state)}; resume with the same --devices and plan"
            )
        for name, saved in state["models"].items():
            self.models[name].load_train_state(saved)
        load_contexts_state(self.contexts, state)

    def save_models(self, directory: Path) -> None:
        """Every model in Hugging Face format under ``directory/<name>``."""
        for name, s in self.models.items():
            save_model(s.module, self.graph.spec.models[name], s.tokenizer, directory / name)

    def worker_memory(self) -> dict[int, int]:
        """``{0: peak bytes on this process's device}``: this process is the only worker."""
        return {0: peak_memory_bytes(self.device)}

    def close(self, force: bool = False) -> None:
        """Stop the generation engines (every node runs in this process; the engines do too)."""
        close_engines(self.contexts)
