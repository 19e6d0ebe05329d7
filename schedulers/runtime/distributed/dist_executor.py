"""``DistExecutor``: the :class:`~rlflow.schedulers.runtime.executor.Executor` interface over workers.

The controller process starts ``run.devices`` workers through a
:class:`~rlflow.schedulers.runtime.distributed.pool.WorkerPool` (launch, connections, commands; failure
handling). Each worker builds the model instances of the nodes placed on it in their layouts
(:mod:`rlflow.schedulers.runtime.distributed.placement`).

Batches move worker to worker; the controller handles metadata
(:mod:`rlflow.schedulers.runtime.distributed.transfer`; its row references:
:mod:`rlflow.schedulers.runtime.distributed.held_rows`; the replies:
:mod:`rlflow.schedulers.runtime.distributed.node_reports`):

* :meth:`DistExecutor.source` puts an iteration's source tensors (the data set's prompts) on the mesh of
  the first node that reads each (equal dp shares) and returns row references for the controller's store;
  per-row lists (answers) stay in the store and travel with the commands.
* :meth:`DistExecutor.submit` splits a node's rows over its dp ranks, balanced by tokens (per-row mask
  sums from the metadata; :func:`~rlflow.schedulers.runtime.distributed.rows.balance_rows`; generation:
  equal shares), plans which rank receives which rows from which holder, and sends one command id to the
  node's mesh (:class:`~rlflow.schedulers.runtime.distributed.protocol.RunNode`) and to the other holders
  it reads from (:class:`~rlflow.schedulers.runtime.distributed.protocol.Xfer`). The last reader of a
  reference (the graph's consumer count) also tells its holders to drop the rows.
* :meth:`DistExecutor.wait_any` / :meth:`DistExecutor.collect` get the dp leaders' metadata and return row
  references as the node's outputs (the tensors stay on the leaders; a leader is the tp-rank-0 rank of the
  last pipeline stage of its dp group: with ``pp > 1`` only the last stage computes the head, see
  :mod:`rlflow.schedulers.runtime.distributed.pipeline`). :meth:`DistExecutor.pull` copies rows to the
  controller, for checks only. ``traffic`` counts the bytes through the controller's connections.

Metrics: the dp leaders' values are combined (``*/max`` max, ``*/min`` min, otherwise the mean over dp
ranks weighted by their rows; train-step metrics such as ``grad_norm`` and ``lr`` are identical on every
rank); tokens are summed. After a train node, a weight sync to the model's other instances is submitted at
once (version edges); the asynchronous loop sends it on its own instead (:meth:`DistExecutor.submit_sync`),
once the rollouts that read the old weights are on their way. Batch-wide statistics inside train nodes
(advantage whitening, batch std) are all-reduced over the dp ranks
(:class:`~rlflow.schedulers.runtime.distributed.layouts.DataParallelHooks`).

Limitations (documented, not hidden): pipelined generation (the built-in loop) runs the stages one after
another, without overlapping micro-batches; ``state_dict`` holds each rank's
optimizer shards, so resuming needs the same plan; the controller keeps a full CPU copy of every model (the
*mirror*) for evaluation and checkpoint writing, refreshed from the workers when read; a consumer waits for
its producer's metadata (one controller round trip per edge).

Failures raise :class:`~rlflow.dataflow.errors.NodeError` naming the worker rank, the node and the error,
after every worker is stopped. Every wait has a timeout (``DistConfig``); process groups have a collective
timeout, so a worker blocked on a dead peer fails too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rlflow.dataflow.batch import Batch, RemoteRows
from rlflow.dataflow.errors import NodeError, PlanError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.nodes.context import ModelState, NodeResult
from rlflow.schedulers.runtime.distributed.held_rows import HeldRows
from rlflow.schedulers.runtime.distributed.layouts import check_tensor_parallel
from rlflow.schedulers.runtime.distributed.node_reports import Pending, SyncLog, combine_metrics, node_outputs
from rlflow.schedulers.runtime.distributed.pipeline import check_pipeline
from rlflow.schedulers.runtime.distributed.placement import BaseCopyWarning, PlanView, lora_placement
from rlflow.schedulers.runtime.distributed.pool import WorkerPool, to_ranks
from rlflow.schedulers.runtime.distributed.protocol import (
    Command,
    DistConfig,
    Fetch,
    GetState,
    LoadState,
    NodeReport,
    RunNode,
    Sync,
    Xfer,
)
from rlflow.schedulers.runtime.distributed.transfer import Handle, RowRef, plan_transfers
from rlflow.schedulers.runtime.executor import Finished, LocalExecutor, saved_plan_text
from rlflow.schedulers.runtime.instances import save_model

__all__ = ["DistExecutor"]

_log = logging.getLogger("rlflow.realloc")
# The controller has no process groups by design: it unpickles the workers' DTensor optimizer state only to
# store it in checkpoints and send it back, so torch's warning that an unpickled DeviceMesh cannot find
# its groups (printed for every checkpoint) does not apply here.
logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)


class _FreshModels(Mapping[str, ModelState]):
    """``executor.models``: the mirror's models, refreshed from the workers when read (evaluation)."""

    def __init__(self, owner: DistExecutor) -> None:
        self.owner = owner

    def __getitem__(self, name: str) -> ModelState:
        self.owner.refresh(name)
        return self.owner.mirror.models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.owner.mirror.models)

    def __len__(self) -> int:
        return len(self.owner.mirror.models)


class DistExecutor:
    """All nodes of ``graph`` on ``run.devices`` worker processes, each in its planned mesh and layout.

    Args:
        graph: the validated graph with a manual plan.
        checkpoint_dir: when resuming, a checkpoint whose ``models/<name>`` replace the initial weights.
        config: timeouts and launch settings.

    Raises:
        PlanError: before any process starts: devices outside ``run.devices``, a tensor degree that does
            not divide the model, a pipeline degree the model cannot be cut into, dp shares that split
            sample groups (a vLLM generate node with pp > 1 is rejected by the graph's plan validation), a
            LoRA model or base view with tp > 1 or pp > 1 (:func:`~.placement.lora_placement`).
        NodeError: a worker failed to start or build its models.

    Warns:
        BaseCopyWarning: a base view (``base_of``) placed apart from its LoRA model holds its own copy.
    """

    def __init__(
        self, graph: Graph, checkpoint_dir: Path | None = None, config: DistConfig | None = None
    ) -> None:
        self.graph = graph
        self.config = config or DistConfig()
        self.view = PlanView.of(graph)
        self.world = self.view.world
        for msg in lora_placement(graph, self.view):
            warnings.warn(BaseCopyWarning(msg), stacklevel=2)
        with warnings.catch_warnings():  # the user's graph was validated (and warned about) already
            warnings.simplefilter("ignore", GraphWarning)
            trivial = Graph.from_spec(dataclasses.replace(graph.spec, plan={}), graph.registry)
        self.mirror = LocalExecutor(
            trivial, device=torch.device("cpu"), checkpoint_dir=checkpoint_dir, start_engines=False
        )
        for inst in self.view.instances:
            where = f"model '{inst.model}' (layout {inst.mesh.layout})"
            check_tensor_parallel(self.mirror.models[inst.model].module, inst.mesh.tp, where)
            check_pipeline(self.mirror.models[inst.model].module, inst.mesh.pp, where)
        self.device = torch.device("cpu")
        self._versions: dict[str, int] = {m: 0 for m in graph.spec.models}
        self._mirror_versions: dict[str, int] = dict(self._versions)
        self.timings: dict[str, tuple[float, float]] = {}
        # node -> rank -> (start, end) wall-clock seconds (time.time) of its last execution on each worker
        self.worker_timings: dict[str, dict[int, tuple[float, float]]] = {}
        self.worker_spans: dict[str, dict[int, tuple[tuple[str, float, float], ...]]] = {}
        self._peak_memory: dict[int, int] = {}  # rank -> its device's peak bytes, from its node reports
        # node -> bytes of input rows moved between workers, and each dp rank's global input rows, in its
        # last execution
        self.moved_bytes: dict[str, int] = {}
        self.shares: dict[str, list[list[int]]] = {}
        self.pool = WorkerPool(graph, self.world, checkpoint_dir, self.config)
        self.rows = HeldRows(graph, self.view, self.pool)
        self.syncs = SyncLog(graph, self.view, self.pool)

    @property
    def traffic(self) -> dict[str, int]:
        """Bytes through the controller's connections after start-up (``sent``/``received``)."""
        return self.pool.traffic

    @property
    def sync_timings(self) -> dict[str, dict[int, tuple[float, float, int]]]:
        """Train node -> rank -> (start, end, bytes) of the weight sync after its last run
        (:attr:`SyncLog.timings <rlflow.schedulers.runtime.distributed.node_reports.SyncLog>`)."""
        return self.syncs.timings

    @property
    def realloc_counts(self) -> dict[str, int]:
        """Weight syncs per path (``plan``, ``zero``, ``gather``), counted per target instance."""
        return self.syncs.counts

    @property
    def realloc_log(self) -> list[dict[str, Any]]:
        """One record per target instance and weight sync (model, version, path, bytes, checksums)."""
        return self.syncs.log

    # -- row references -------------------------------------------------------------------------------
    def source(self, batch: Batch, iteration: int, done: Collection[str] = ()) -> dict[str, Any]:
        """The controller's store entries for an iteration's source data (the data set's batch; on a
        resume, the values of an iteration in flight whose nodes ``done`` have run): its tensors put on
        the workers as row references (:meth:`HeldRows.source
        <rlflow.schedulers.runtime.distributed.held_rows.HeldRows.source>`), the rest as it is."""
        return self.rows.source(batch, iteration, done)

    def pull(self, values: Mapping[str, Any]) -> Batch:
        """``values`` with every :class:`RowRef` replaced by its rows, copied to the controller in row order
        (for checks and debugging only; not a read)."""
        return self.rows.pull(values)

    def release(self, values: Sequence[RemoteRows]) -> None:
        """Free the workers' rows of ``values``, references no node will read (a filter's rounds)."""
        self.rows.release([v for v in values if isinstance(v, RowRef)])

    def stored(self) -> dict[int, list[Handle]]:
        """The handles every worker holds now (rank -> sorted handles)."""
        return self.rows.stored()

    # -- running --------------------------------------------------------------------------------------
    def submit(
        self,
        name: str,
        batch: Batch,
        iteration: int,
        segment: tuple[int, int] | None = None,
        sync: bool = True,
    ) -> Pending:
        """Send node ``name`` to its mesh (and, after a train node, the weight sync); does not wait.

        ``batch`` holds row references (:class:`RowRef`: moved worker to worker) and values the controller
        holds (per-row lists, or any batch a caller gives), which travel with the command. ``segment``:
        ``(j, segments)`` of an interruptible generate node (its ranks keep the rollouts between segments;
        a later segment's ``batch`` only needs the rows' count, e.g. a per-row list). ``sync=False``
        leaves a train node's weight sync to :meth:`submit_sync` (the asynchronous loop sends it later).

        Raises:
            PlanError: the rows cannot be split over the node's dp ranks.
            NodeError: a worker is gone.
        """
        node = self.graph.node(name)
        spec = self.view.meshes[name]
        shares = self.rows.shares(name, batch)
        flat = [[i for mini in share for i in mini] for share in shares]
        train_dp = node.kind == "train" and spec.dp > 1
        mini_rows = [tuple(len(m) for m in share) if train_dp else None for share in shares]
        refs = {k: v for k, v in batch.items() if isinstance(v, RowRef)}
        foreign = [k for k, v in batch.items() if isinstance(v, RemoteRows) and k not in refs]
        if foreign:
            raise NodeError(f"node '{name}': input '{foreign[0]}' holds rows this runtime does not know")
        local = Batch({k: v for k, v in batch.items() if k not in refs})
        parts = [local.index(f) if local.keys() and spec.dp > 1 else local for f in flat]
        need = {r: flat[spec.coords(r)[0]] for r in spec.devices}
        plan = plan_transfers(refs, need, self.rows.read(list(refs.values())))
        order = batch.keys()

        # the transfer goes out now; the run (and a train node's weight sync) once every node submitted
        # with it has sent its transfer (WorkerPool.flush): feeding one node never waits for running another
        movers = tuple(sorted(plan))
        xfer: int | None = None
        if movers:
            xfer = self.pool.reserve()
            self.pool.send({r: Xfer(xfer, plan[r], r in spec.devices) for r in movers})
        cmd = self.pool.reserve()
        runs: dict[int, Command] = {}
        for r in spec.devices:
            d, _ = spec.coords(r)
            runs[r] = RunNode(cmd, name, iteration, parts[d], order, mini_rows[d], xfer, segment)
        self.pool.defer(runs)
        moved = sum(p.received_bytes for p in plan.values())
        holders = tuple(r for r in movers if r not in spec.devices)
        pending = Pending(name, iteration, cmd, spec.devices, tuple(spec.leaders()), flat, holders, moved)
        if xfer is not None:
            pending.xfer_cmd, pending.xfer_ranks = xfer, movers
        targets = self.view.sync_targets.get(name, ())
        pending.sync_deferred = bool(targets) and not sync
        if targets and sync:
            src = self.view.node_instance[name]
            ranks = sorted(set(spec.devices).union(*(self.view.instances[t].mesh.devices for t in targets)))
            version = self._versions[node.model or ""] + node.epochs * node.mini_batches
            pending.sync_cmd = self.pool.reserve()
            self.pool.defer(to_ranks(ranks, Sync(pending.sync_cmd, src, tuple(targets), version)))
            pending.sync_ranks = tuple(ranks)
        return pending

    def sync_readers(self, train: str) -> set[str]:
        """The nodes whose model instance the weight sync after train node ``train`` writes (the other
        instances of its model, and of the models that follow it as an EMA); empty: nothing to sync."""
        targets = set(self.view.sync_targets.get(train, ()))
        return {n for n, i in self.view.node_instance.items() if i in targets}

    def submit_sync(self, name: str, iteration: int) -> Pending:
        """Send the weight sync after train node ``name``'s last run on its own (collective on the union of
        its mesh and the target meshes); does not wait. Its :meth:`collect` gives the sync's metrics.

        Raises:
            NodeError: a worker is gone.
        """
        node = self.graph.node(name)
        spec = self.view.meshes[name]
        targets = self.view.sync_targets[name]
        src = self.view.node_instance[name]
        ranks = sorted(set(spec.devices).union(*(self.view.instances[t].mesh.devices for t in targets)))
        version = self._versions[node.model or ""]
        cmd = self.pool.reserve()
        self.pool.defer(to_ranks(ranks, Sync(cmd, src, tuple(targets), version)))
        return Pending(name, iteration, cmd, tuple(ranks), (), [], sync_only=True, sync_version=version)

    def _followers_moved(self, model: str) -> None:
        """The models following ``model`` as an EMA changed with its weight sync: one version more."""
        for name, spec in self.graph.spec.models.items():
            if spec.ema is not None and spec.ema.source == model:
                self._versions[name] += 1

    def _collect_sync(self, pending: Pending) -> NodeResult:
        """Wait for a weight sync sent by :meth:`submit_sync`; its metrics."""
        deadline = time.monotonic() + self.config.node_timeout_s
        what = f"weight sync after node '{pending.name}' (iteration {pending.iteration})"
        synced = self.pool.wait({(r, pending.cmd) for r in pending.ranks}, deadline, what)
        reports = {r: synced[(r, pending.cmd)] for r in pending.ranks}
        metrics = self.syncs.record(pending.name, pending.sync_version, reports)
        self._followers_moved(self.graph.node(pending.name).model or "")
        return NodeResult(outputs={}, metrics=metrics, tokens=0)

    def collect(self, pending: Pending) -> NodeResult:
        """Wait for a submitted node (and its weight sync); its outputs as row references, metrics, tokens.

        Output tensors stay on the dp leaders: each output is a :class:`RowRef` (global row order: rows
        ``i·k .. i·k+k-1`` come from input row ``i``, ``k`` outputs per input row, e.g. a generate node's
        ``n``); per-row lists come back as lists.
        """
        if pending.sync_only:
            return self._collect_sync(pending)
        deadline = time.monotonic() + self.config.node_timeout_s
        what = f"node '{pending.name}' (iteration {pending.iteration})"
        if pending.xfer_cmd is not None:
            xfers = {(r, pending.xfer_cmd) for r in pending.xfer_ranks}
            self.pool.wait(xfers, deadline, f"input rows of {what}")
        got: dict[tuple[int, int], NodeReport] = self.pool.wait(
            {(r, pending.cmd) for r in pending.ranks}, deadline, what
        )
        payloads = [got[(r, pending.cmd)] for r in pending.leaders]
        sync_metrics: dict[str, float] = {}
        if pending.sync_cmd is not None:
            synced = self.pool.wait(
                {(r, pending.sync_cmd) for r in pending.sync_ranks}, deadline, f"weight sync after {what}"
            )
            reports = {r: synced[(r, pending.sync_cmd)] for r in pending.sync_ranks}
            sync_metrics = self.syncs.record(pending.name, payloads[0].version, reports)
        self.worker_timings[pending.name] = {
            r: (got[(r, pending.cmd)].start, got[(r, pending.cmd)].end) for r in pending.ranks
        }
        self.worker_spans[pending.name] = {r: got[(r, pending.cmd)].spans for r in pending.ranks}
        for r in pending.ranks:
            self._peak_memory[r] = max(self._peak_memory.get(r, 0), got[(r, pending.cmd)].peak_memory)
        self.timings[pending.name] = (min(p.start for p in payloads), max(p.end for p in payloads))
        self.moved_bytes[pending.name] = pending.moved
        self.shares[pending.name] = pending.shares
        node = self.graph.node(pending.name)
        if node.model is not None and node.kind == "train":
            self._versions[node.model] = payloads[0].version
            if not pending.sync_deferred:  # EMA followers changed with the sync
                self._followers_moved(node.model)
        return NodeResult(
            outputs=node_outputs(self.graph, pending, payloads, self.rows.track),
            metrics={
                **combine_metrics([p.metrics for p in payloads], [p.rows for p in payloads]),
                **sync_metrics,
            },
            tokens=sum(p.tokens for p in payloads),
        )

    def run_node(self, name: str, batch: Batch, iteration: int) -> NodeResult:
        """Run node ``name`` on its mesh (the :class:`Executor` protocol).

        Raises:
            NodeError: a worker raised or died (names the worker rank, node and error); every worker is
                stopped first.
        """
        return self.collect(self.submit(name, batch, iteration))

    def wait_any(self, pendings: Sequence[Pending]) -> tuple[Pending, Finished]:
        """Block until one of ``pendings`` (and its weight sync) has finished; the earliest submitted wins
        a tie. Its result, and its span on the workers (first start to last end, sync included).

        Raises:
            NodeError: a worker raised or died, or a node passed ``node_timeout_s`` (all workers stopped).
        """
        self.pool.flush()
        while True:
            for p in pendings:
                if self.pool.arrived(p.replies()):
                    result = self.collect(p)
                    if p.sync_only:
                        sync = self.sync_timings[p.name]
                        start, end = min(t[0] for t in sync.values()), max(t[1] for t in sync.values())
                        return p, Finished(p.name, result, start, end, syncs=sync)
                    start, end = self.timings[p.name]
                    sync = self.sync_timings.get(p.name, {}) if p.sync_cmd is not None else {}
                    end = max([end, *(t[1] for t in sync.values())])
                    workers = self.worker_timings[p.name]
                    spans = self.worker_spans[p.name]
                    return p, Finished(p.name, result, start, end, workers=workers, syncs=sync, spans=spans)
            oldest = min(pendings, key=lambda p: p.submitted)
            left = oldest.submitted + self.config.node_timeout_s - time.monotonic()
            what = f"node '{oldest.name}' (iteration {oldest.iteration})"
            if left <= 0:
                missing = self.pool.missing(oldest.replies())
                raise self.pool.fail(
                    missing[0], what, f"no reply within the timeout (ranks {missing} pending)"
                )
            self.pool.pump(min(left, 1.0), what)

    # -- models and state -----------------------------------------------------------------------------
    @property
    def models(self) -> Mapping[str, ModelState]:
        """Full CPU copies of the models (the mirror), refreshed from the workers when read."""
        return _FreshModels(self)

    @property
    def data_tokenizer(self) -> Any:
        """The tokenizer the data set is tokenized with."""
        return self.mirror.data_tokenizer

    @property
    def runs_when_submitted(self) -> bool:
        """``True``: a submitted node runs on its workers while the controller goes on."""
        return True

    def fetch(
        self, model: str, instance: int | None = None, adapters: bool = False
    ) -> dict[str, torch.Tensor]:
        """The current full parameters of ``model`` (from ``instance``, default its primary instance,
        gathered on that instance's mesh); with ``adapters``, a LoRA model's adapters alone."""
        inst = self.view.primary(model) if instance is None else instance
        ranks = self.view.instances[inst].mesh.devices
        cmd = self.pool.reserve()
        out = self.pool.ask(cmd, to_ranks(ranks, Fetch(cmd, inst, adapters)), f"fetch of '{model}'")[ranks[0]]
        assert isinstance(out, dict)
        return out

    def refresh(self, model: str) -> None:
        """Copy ``model``'s current weights into the mirror if they changed since the last refresh (a LoRA
        model's adapters only: its frozen base is the mirror's since start-up)."""
        if self._mirror_versions.get(model) == self._versions.get(model):
            return
        lora = self.graph.spec.models[model].lora is not None
        full = self.fetch(model, adapters=lora)
        module = self.mirror.models[model].module
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in full or not lora:
                    p.copy_(full[name])
        self.mirror.models[model].version = self._versions[model]
        self._mirror_versions[model] = self._versions[model]

    def save_models(self, directory: Path) -> None:
        """Every model in Hugging Face format under ``directory/<name>`` (gathered from the workers)."""
        for name in self.mirror.models:
            self.refresh(name)
            s = self.mirror.models[name]
            save_model(s.module, self.graph.spec.models[name], s.tokenizer, directory / name)

    def state_dict(self) -> dict[str, Any]:
        """Weight versions and every worker's optimizer/scheduler shards and node generators."""
        cmd = self.pool.reserve()
        return {
            "versions": dict(self._versions),
            "workers": self.pool.ask(cmd, to_ranks(range(self.world), GetState(cmd)), "state"),
            "plan": self._plan_record(),
        }

    def _plan_record(self) -> dict[str, tuple[Any, ...]]:
        """Node -> (devices, dp, tp, pp, ep) of this run's plan, as checkpoints record it."""
        return {n: (m.devices, m.dp, m.tp, m.pp, m.ep) for n, m in self.view.meshes.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (same plan; the workers already hold the checkpoint's weights).

        Raises:
            PlanError: the checkpoint was written under another plan.
        """
        plan = self._plan_record()
        saved = state.get("plan")
        if isinstance(saved, Mapping):  # checkpoints before expert parallel recorded no ep: ep 1
            saved = {n: (*tuple(v), 1) if len(v) == 4 else tuple(v) for n, v in saved.items()}
        if saved != plan:
            raise PlanError(
                f"the checkpoint was written under {saved_plan_text(state)}; this run's plan is "
                f"{saved_plan_text({'plan': plan, 'workers': dict.fromkeys(range(self.world))})}: resume "
                "with the same --devices and plan"
            )
        self._versions.update(state["versions"])
        self._mirror_versions = {m: -1 for m in self._versions}
        cmd = self.pool.reserve()
        loads = {r: LoadState(cmd, saved) for r, saved in state["workers"].items()}
        self.pool.ask(cmd, loads, "load state")

    def worker_memory(self) -> dict[int, int]:
        """Worker rank -> the peak bytes its device has held, as its node reports gave it (ranks that ran no
        node yet are absent). The controller (this process, holding the mirror) is not a worker."""
        return dict(sorted(self._peak_memory.items()))

    # -- shutdown -------------------------------------------------------------------------------------
    def close(self, force: bool = False) -> None:
        """Stop the workers (:meth:`WorkerPool.close`; ``force``: at once, without a clean stop)."""
        self.pool.close(force)

    def __enter__(self) -> DistExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)

    def __del__(self) -> None:
        try:
            pool = self.__dict__.get("pool")  # absent when __init__ failed before the launch
            if pool is not None and not pool.closed:
                pool.close(force=True)
        except Exception:
            pass
