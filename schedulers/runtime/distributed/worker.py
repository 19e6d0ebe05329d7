"""A worker process: one device, the model instances of the nodes placed on it, a command loop.

Started by the embedded launcher of :class:`rlflow.schedulers.runtime.distributed.pool.WorkerPool`, or
by torchrun::

    RLFLOW_CONTROLLER=HOST:PORT RLFLOW_AUTHKEY=HEX \\
        torchrun --nnodes N --nproc-per-node P ... -m rlflow.schedulers.runtime.distributed.worker

(``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK`` from torchrun; the controller prints
the two ``RLFLOW_*`` values when started with ``launch="external"``).

Protocol: the dataclasses of :mod:`rlflow.schedulers.runtime.distributed.protocol`, pickled over a
``multiprocessing.connection``; :func:`serve` dispatches them with a ``match``. A node's reply is metadata
only (:class:`~rlflow.schedulers.runtime.distributed.protocol.NodeReport`: shapes, dtypes, per-row mask
sums, metrics, times), never its output tensors; a sync's reply is its
:class:`~rlflow.schedulers.runtime.distributed.protocol.SyncReport`.

Batches move worker to worker (:mod:`rlflow.schedulers.runtime.distributed.transfer`): a node's outputs
stay in the :class:`~rlflow.schedulers.runtime.distributed.transfer.RowStore` of its dp leaders; a node
that reads them first gets an ``Xfer`` command on every rank that sends or receives its rows, then its
``RunNode``. When the controller submits several ready nodes together, all their ``Xfer`` commands go out
before their ``RunNode`` commands, so a worker that holds rows for one node and runs another sends first
and does not serialise the two.

No deadlock: each worker executes its commands one at a time in the order received, and the controller
sends every command to all its participants before the next one (one connection per worker keeps the
order), so all workers execute the commands they share in the same global order, the controller's send
order (command ids are reserved at submission, so they need not increase in that order). The
communication of a command — point-to-point transfers (one message per pair, tagged with the command id,
all posted before any is waited for), collectives inside the node on its mesh, a weight sync's broadcasts
on the union of source and target ranks — involves only that command's participants and is matched only
inside that command. So the first-sent unfinished command has every participant either at it or done with
it (everything sent earlier is finished), and it completes; by induction every command does. Nodes on
disjoint meshes with disjoint holders run concurrently; nodes that share a worker, as executor, holder or
receiver, run one after another in send order. A dead peer does not hang anyone: every process group has
the collective timeout, and the controller sees the death first.

Generation and training backends are plain node functions here (transformers + torch). A generate node
with ``engine: vllm`` gets this rank's vLLM engine in its context; a train node with ``engine: deepspeed``
trains its instance inside a DeepSpeed ZeRO engine on the node's own dp group
(:mod:`rlflow.schedulers.runtime.distributed.zero`), through the same node function and
:class:`~rlflow.nodes.context.TrainHooks` seam as FSDP2.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.graph import Graph
from rlflow.nodes.context import ModelState, NodeContext, NodeResult
from rlflow.nodes.models import build_model, build_model_from_spec
from rlflow.nodes.tokenizers import data_tokenizer, load_tokenizer
from rlflow.nodes.train import build_optimizer
from rlflow.schedulers.realloc.ema import ema_update
from rlflow.schedulers.realloc.execute import execute_reallocation
from rlflow.schedulers.realloc.planning import ReallocPlan, Transfer, plan_reallocation
from rlflow.schedulers.realloc.shards import param_shards
from rlflow.schedulers.realloc.verify import verify_reallocation, weights_checksum
from rlflow.schedulers.runtime.distributed.launch import no_delay
from rlflow.schedulers.runtime.distributed.layouts import apply_layout
from rlflow.schedulers.runtime.distributed.mesh import GroupCache
from rlflow.schedulers.runtime.distributed.pipeline import (
    gather_stage_params,
    generation_scope,
    make_stage,
    stage_scope,
    train_hooks,
)
from rlflow.schedulers.runtime.distributed.placement import Instance, PlanView
from rlflow.schedulers.runtime.distributed.protocol import (
    Command,
    DistConfig,
    Done,
    Failed,
    Fetch,
    Free,
    GetState,
    Hello,
    ListMeta,
    LoadState,
    NodeReport,
    OutputMeta,
    Pull,
    Put,
    Ready,
    RunNode,
    Setup,
    Stop,
    Stored,
    Sync,
    SyncReport,
    TargetReport,
    TensorMeta,
    Xfer,
    recv,
    send,
)
from rlflow.schedulers.runtime.distributed.stream_sync import (
    UnitStream,
    local_bytes,
    move_params,
    weight_units,
)
from rlflow.schedulers.runtime.distributed.transfer import Handle, Part, RowStore, exchange, mask_lengths
from rlflow.schedulers.runtime.distributed.weight_sync import (
    ModelInfo,
    Route,
    SharedGroups,
    boxes_match,
    expected_boxes,
    full_params,
    load_full_params,
    local_boxes,
    model_info,
    plan_bytes_of,
    source_shards,
    target_shards,
)
from rlflow.schedulers.runtime.distributed.zero import (
    Holdings,
    ZeroHooks,
    box_holdings,
    build_engine,
    destroy_engine,
    load_zero_params,
    load_zero_train_state,
    move_pieces,
    node_group,
    plan_pieces,
    refresh_master,
    zero_full_params,
    zero_holdings,
    zero_local,
    zero_train_state,
)
from rlflow.schedulers.runtime.executor import _model_order, _stable_seed, peak_memory_bytes

__all__ = ["Worker", "connect_controller", "join_and_serve", "main", "serve", "spawned_main"]

_log = logging.getLogger("rlflow.realloc")


def node_seed(seed: int, name: str, dp_rank: int) -> int:
    """A node's sampling seed on dp rank ``dp_rank`` (rank 0 has the single-process seed)."""
    return _stable_seed(seed, name if dp_rank == 0 else f"{name}#dp{dp_rank}")


class Worker:
    """The state of one worker: its meshes, model instances, node contexts."""

    def __init__(self, rank: int, graph: Graph, checkpoint_dir: Path | None, config: DistConfig):
        self.rank = rank
        self.graph = graph
        self.view = PlanView.of(graph)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        self.groups = GroupCache(config.collective_timeout_s, self.device.type)
        self.store = RowStore()  # node outputs and source rows held here until their last reader
        self.received: dict[int, dict[str, torch.Tensor]] = {}  # xfer command -> inputs for its run
        # Collective set-up, identical order on every rank: node meshes, models, then the sync routes
        # (their process groups are created here because a sync involves only some ranks).
        self.meshes = {name: self.groups.mesh(spec) for name, spec in self.view.meshes.items()}
        self.instances: dict[int, ModelState] = {}
        self.engines: dict[int, Any] = {}  # instance -> its DeepSpeed engine (engine: deepspeed train nodes)
        self._build(checkpoint_dir)
        self.contexts = self._contexts()
        self._start_engines()
        self.realloc_mode = config.realloc  # "auto" or "gather", checked by DistConfig
        self.realloc_groups = SharedGroups(self.groups)
        self.realloc_count = 0  # planned reallocations this rank took part in
        self.model_infos: dict[int, ModelInfo] = {}
        self.routes: dict[tuple[int, int], Route] = {}
        for train, targets in self.view.sync_targets.items():
            src = self.view.node_instance[train]
            for dst in targets:
                self.routes[(src, dst)] = self._route(src, dst)
        self.realloc_groups.frozen = True
        # instances whose weights only their vLLM engines read: freed while the engines hold them
        self.release_replicas = config.release_replicas
        self.engine_only = {i: self._engine_only(i) for i in range(len(self.view.instances))}  # from the plan
        self.replicas = self._replicas() if config.release_replicas else {}
        self.replica_peaks: dict[int, int] = {}  # instance -> most bytes of it held here during the last sync
        self.released: set[int] = set()
        if checkpoint_dir is None:  # resumed: load_state restores the version, which the engines load first
            self._release()

    # -- building -------------------------------------------------------------------------------------
    def _build(self, checkpoint_dir: Path | None) -> None:
        spec = self.graph.spec
        mine = {
            i
            for i, inst in enumerate(self.view.instances)
            if self.rank in inst.mesh.devices  # instances hosted here
        }
        needed = {self.view.instances[i].model for i in mine}
        for name in list(needed):  # init_from sources are built too (copied from)
            src = spec.models[name].init_from
            while src is not None:
                needed.add(src)
                src = spec.models[src].init_from
        full: dict[str, torch.nn.Module] = {}
        self.tokenizers: dict[str, Any] = {}
        # shapes of the whole model per hosted instance, taken before a pipeline stage drops the others'
        self.full_infos: dict[int, ModelInfo] = {}
        for idx, name in enumerate(_model_order(spec.models)):
            if name not in needed:
                continue
            mspec = spec.models[name]
            saved = checkpoint_dir / "models" / name if checkpoint_dir is not None else None
            if saved is not None and saved.is_dir():
                module = build_model(
                    path=saved, head=mspec.head, dtype=mspec.dtype, name=name, runs_on=self.device
                )
            else:
                source = full[mspec.init_from] if mspec.init_from else None
                module = build_model_from_spec(
                    mspec, init_from=source, seed=spec.run.seed + idx, name=name, runs_on=self.device
                )
            full[name] = module
            tok = None
            if mspec.tokenizer_dir is not None:
                tok = load_tokenizer(mspec.tokenizer_dir)
            elif mspec.init_from:
                tok = self.tokenizers.get(mspec.init_from)
            self.tokenizers[name] = tok
        self.data_tokenizer = self._data_tokenizer()
        steps = self._train_steps()
        for i in sorted(mine):
            inst = self.view.instances[i]
            mspec = spec.models[inst.model]
            self.full_infos[i] = model_info(full[inst.model])
            module = copy.deepcopy(full[inst.model]).to(self.device)
            train_nodes = [
                n for n, k in self.view.node_instance.items() if k == i and self.graph.node(n).kind == "train"
            ]
            where = f"model '{inst.model}' ({len(inst.mesh.devices)} devices, {inst.mesh.layout})"
            if inst.mesh.pp > 1:  # keep this rank's stage only; apply_layout then shards it on the stage mesh
                module = make_stage(module, inst.mesh, self.rank, self.groups)
            mesh = self.meshes[self._node_of(i)]
            module = apply_layout(module, mesh, train=inst.fsdp, where=where)
            state = ModelState(
                name=inst.model, module=module, head=mspec.head, tokenizer=self.tokenizers[inst.model]
            )
            if mspec.trainable and train_nodes and steps.get(inst.model, 0) > 0 and inst.zero is not None:
                engine = build_engine(
                    module, inst.zero, mspec.optimizer, steps[inst.model], mesh["dp"].get_group(),
                    mesh["tp"].get_group(),
                )  # fmt: skip
                self.engines[i] = engine
                state.module, state.optimizer, state.scheduler = (
                    engine.module,
                    engine.optimizer,
                    engine.lr_scheduler,
                )
                state.optimizer_spec = mspec.optimizer
            elif mspec.trainable and train_nodes and steps.get(inst.model, 0) > 0:
                state.optimizer, state.scheduler = build_optimizer(module, mspec.optimizer, steps[inst.model])
                state.optimizer_spec = mspec.optimizer
            else:
                module.requires_grad_(False)
            self.instances[i] = state

    def _node_of(self, instance: int) -> str:
        return next(n for n, k in self.view.node_instance.items() if k == instance)

    def _train_steps(self) -> dict[str, int]:
        run = self.graph.spec.run
        steps: dict[str, int] = {}
        for node in self.graph.nodes.values():
            if node.model and node.kind == "train":
                steps[node.model] = (
                    steps.get(node.model, 0) + run.iterations * node.epochs * node.mini_batches
                )
        return steps

    def _data_tokenizer(self) -> Any:
        return data_tokenizer(self.graph, self.tokenizers)

    def _contexts(self) -> dict[str, NodeContext]:
        out: dict[str, NodeContext] = {}
        seed = self.graph.spec.run.seed
        for name, spec in self.view.meshes.items():
            if self.rank not in spec.devices:
                continue
            node = self.graph.run_node(name)  # engine: auto resolved by the plan
            dp_rank, _ = spec.coords(self.rank)
            gen = torch.Generator(device=self.device).manual_seed(node_seed(seed, name, dp_rank))
            inst = self.view.node_instance.get(name)
            state = self.instances[inst] if inst is not None else None
            out[name] = NodeContext(
                node=node,
                model=state,
                group_size=self.graph.group_size(name),
                micro_batches=self.graph.placement(name).layout.micro_batches,
                device=self.device,
                generator=gen,
                tokenizer=state.tokenizer if state and state.tokenizer is not None else self.data_tokenizer,
            )
        return out

    def _start_engines(self) -> None:
        """A vLLM engine for every data-parallel replica of every node placed here whose engine is vLLM
        (``engine: vllm``, or ``auto`` that the plan resolved to it), fed by the model instance, which the
        weight sync writes after each train step (the node then loads it into the engine and verifies it).
        At tp = 1 each rank starts its own (an instance only engines read is freed in between:
        :meth:`_replicas`, :meth:`_release`; allocated again by :meth:`sync`); at tp > 1 one engine per tp
        group, started by the group's tp rank 0 with ``tensor_parallel_size = tp`` on the group's devices,
        and every rank of the group gets a :class:`~rlflow.nodes.engines.tp_group.GroupEngine` (collective
        generate and sync; the engine starts in step on every rank of the group)."""
        from rlflow.nodes.engines.validation import engine_nodes

        names = [n for n in engine_nodes(self.graph) if n in self.contexts]
        if not names:
            return
        from rlflow.nodes.engines.sizing import engine_max_rows
        from rlflow.nodes.engines.tp_group import start_group_engine
        from rlflow.nodes.engines.vllm_engine import start_engine
        from rlflow.schedulers.planner.resources import engine_memory

        try:
            for name in names:
                spec = self.view.meshes[name]
                dp_rank, _ = spec.coords(self.rank)
                rows = engine_max_rows(self.graph.rows(name), spec.dp, self.graph.group_size(name))
                seed = node_seed(self.graph.spec.run.seed, name, dp_rank)
                fraction, device_memory = engine_memory(self.graph, name)
                if spec.tp > 1:
                    ranks = next(g for g in spec.tp_groups() if self.rank in g)
                    self.contexts[name].engine = start_group_engine(
                        self.contexts[name],
                        self.groups.group(ranks),
                        ranks,
                        max_rows=rows,
                        seed=seed,
                        gpu_memory_utilization=fraction,
                        device_memory=device_memory,
                    )
                    continue
                self.contexts[name].engine = start_engine(
                    self.contexts[name],
                    max_rows=rows,
                    seed=seed,
                    gpu_memory_utilization=fraction,
                    device_memory=device_memory,
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop this worker's generation engines and release its DeepSpeed engines (idempotent)."""
        for ctx in self.contexts.values():
            engine, ctx.engine = ctx.engine, None
            if engine is not None:
                engine.close()
        engines, self.engines = self.engines, {}
        for ds in engines.values():
            destroy_engine(ds)

    # -- released replicas ----------------------------------------------------------------------------
    def _replicas(self) -> dict[int, tuple[str, ...]]:
        """Instance -> its vLLM engine nodes, for every instance hosted here whose parameters may be freed
        while its engines hold the weights (:meth:`_engine_only`) and every sync into it rewrites every
        element on this rank (:meth:`_rewrites_all`). At tp > 1 its parameters are DTensors whose local
        shards are freed; the tp group's engine sync gathers the full tensors from those shards and its
        probe forward runs on them before the release."""
        out: dict[int, tuple[str, ...]] = {}
        for i, state in self.instances.items():
            names = self.engine_only[i]
            if not names or state.optimizer is not None:
                continue
            params = target_shards(state.module)
            routes = [r for (src, dst), r in self.routes.items() if dst == i]
            if all(self._rewrites_all(r, params) for r in routes):
                out[i] = names
        return out

    def _engine_only(self, i: int) -> tuple[str, ...]:
        """The nodes of instance ``i`` if only vLLM engines read it (no built-in generate, inference or train
        node), it is not an EMA follower, a DeepSpeed instance or the model's primary instance (:meth:`fetch`
        reads that one), a weight sync writes it and it is not sharded over dp (FSDP2, ZeRO-3); else ``()``.
        From the plan alone, so every rank answers the same for any instance."""
        from rlflow.nodes.engines.validation import engine_nodes

        engines = set(engine_nodes(self.graph))
        synced = {k for targets in self.view.sync_targets.values() for k in targets}
        names = tuple(n for n, k in self.view.node_instance.items() if k == i)
        inst = self.view.instances[i]
        if (
            not names
            or any(n not in engines for n in names)
            or i in self.view.ema
            or inst.zero is not None
            or i not in synced
            or i == self.view.primary(inst.model)
            or inst.sharded
        ):
            return ()
        return names

    def _streams(self, route: Route, dst: int) -> bool:
        """Whether a sync into ``dst`` on ``route`` is streamed unit by unit into its engines
        (:mod:`~rlflow.schedulers.runtime.distributed.stream_sync`): the planned reallocation into an
        instance that only engines read, with replicas released (``DistConfig.release_replicas``). The same
        answer on every rank of the route."""
        return self.release_replicas and route.plan is not None and bool(self.engine_only[dst])

    def _rewrites_all(self, route: Route, params: dict[str, torch.Tensor]) -> bool:
        """Whether a sync on ``route`` writes every element of this rank's target tensors ``params``: the
        gather path copies whole tensors; the ZeRO path's pieces and the planned reallocation's regions
        (disjoint by construction) must add up to each tensor's elements."""
        written: dict[str, int] = dict.fromkeys(params, 0)
        if route.pieces is not None:
            for piece in route.pieces:
                if piece.dst == self.rank and piece.param in written:
                    written[piece.param] += piece.stop - piece.start
        elif route.plan is not None:
            for t in route.plan.transfers:
                if self.rank in t.dsts and t.param in written:
                    written[t.param] += int(torch.Size([s.stop - s.start for s in t.slices]).numel())
        else:
            return True
        return all(written[k] == v.numel() for k, v in params.items())

    def _release(self) -> None:
        """Free the parameters of every releasable instance whose engines all hold its current version
        (each node's engine loaded and verified it); the parameters keep their shapes and dtypes on the
        ``meta`` device, so the module can be allocated again (:meth:`_materialise`). Buffers stay."""
        for i, names in self.replicas.items():
            state = self.instances[i]
            if i in self.released or any(
                (e := self.contexts[n].engine) is None or e.weight_version != state.version for n in names
            ):
                continue
            move_params(state.module.parameters(), torch.device("meta"))
            self.released.add(i)

    def _materialise(self, instance: int) -> None:
        """Allocate a released instance's parameters on the device again (uninitialised: the weight sync
        that follows rewrites every element, :meth:`_rewrites_all`)."""
        if instance not in self.released:
            return
        move_params(self.instances[instance].module.parameters(), self.device)
        self.released.discard(instance)

    def _resident_bytes(self, instance: int) -> int:
        """Bytes of the parameters' storage of ``instance`` on this rank (0 once released; a DTensor's
        local shard)."""
        return sum(local_bytes(p) for p in self.instances[instance].module.parameters())

    # -- weight-sync routes ---------------------------------------------------------------------------
    def _info(self, src: int) -> ModelInfo:
        """The source model's shapes and dtypes, broadcast from the source mesh's first rank (collective)."""
        if src not in self.model_infos:
            root = self.view.instances[src].mesh.devices[0]
            box: list[Any] = [self.full_infos[src] if self.rank == root else None]
            dist.broadcast_object_list(box, src=root)
            self.model_infos[src] = box[0]
        return self.model_infos[src]

    def _route(self, src: int, dst: int) -> Route:
        """Decide (identically on every rank: collective over the world) how ``src -> dst`` syncs."""
        source, target = self.view.instances[src], self.view.instances[dst]
        both = tuple(sorted(set(source.mesh.devices) | set(target.mesh.devices)))
        info = self._info(src)
        reason = ""
        plan: ReallocPlan | None = None
        zero_path = (source.zero3 or target.zero3) and not target.fsdp and dst not in self.view.ema
        if self.realloc_mode != "gather" and zero_path:
            src_hold = self._holdings(info, source)
            dst_hold = self._holdings(info, target)
            pieces = tuple(plan_pieces(src_hold, dst_hold, list(info.shapes)))
            self.groups.group(both)  # the verification group
            return Route(None, "", both, pieces)
        if self.realloc_mode == "gather":
            reason = "realloc='gather' was asked for"
        elif target.fsdp:
            reason = "the target is FSDP2-sharded over dp (param_shards does not describe it)"
        else:
            try:
                plan = plan_reallocation(
                    info.shapes,
                    info.meta,
                    source.mesh.devices,
                    source.mesh.layout,
                    target.mesh.devices,
                    target.mesh.layout,
                    dtype_bytes=info.dtype_bytes,
                )
            except PlanError as e:
                reason = f"no reallocation plan: {e}"
        if plan is not None:  # every rank checks its DTensor shard boxes against param_shards
            mismatch = ""
            for idx, inst, gather in ((src, source, source.fsdp), (dst, target, False)):
                if idx in self.instances and not mismatch:
                    got = local_boxes(self.instances[idx].module, gather_dp=gather)
                    want = expected_boxes(info, inst.mesh, self.rank)
                    mismatch = boxes_match(got, want)
            flag = torch.tensor([0 if mismatch else 1], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if mismatch or int(flag.item()) == 0:
                reason = f"shard layout differs from param_shards ({mismatch or 'on another rank'})"
                plan = None
        model = source.model
        if plan is None:
            self.groups.group(self.view.sync_ranks(src, dst))
            if self.rank == 0:
                _log.info("weight sync of '%s' %d -> %d uses the gather path: %s", model, src, dst, reason)
            return Route(None, reason, both)
        self.realloc_groups.prepare(plan)
        self.groups.group(both)  # the verification group
        return Route(plan, "", both)

    @staticmethod
    def _holdings(info: ModelInfo, inst: Instance) -> Holdings:
        """What each rank of ``inst`` holds of every parameter, as flat runs (ZeRO-3 partitions, or the
        ``param_shards`` boxes of the layout; an FSDP2 source is re-gathered over dp to those boxes)."""
        if inst.zero3:
            return zero_holdings(info.shapes, inst.mesh.devices)
        boxes = param_shards(info.shapes, info.meta, inst.mesh.devices, inst.mesh.layout)
        return box_holdings(info.shapes, boxes)

    def _local(self, instance: int, *, source: bool) -> dict[str, torch.Tensor]:
        """This rank's local storages of ``instance`` for the ZeRO path (flat runs' storages)."""
        inst = self.view.instances[instance]
        module = self.instances[instance].module
        if inst.zero3:
            return zero_local(module)
        if source:
            return source_shards(module, gather_dp=inst.fsdp)
        return target_shards(module)

    # -- commands -------------------------------------------------------------------------------------
    def _node_scope(self, name: str, ctx: NodeContext) -> contextlib.ExitStack:
        """Around one call of node ``name``: a train node's hooks (data parallel, and pipeline stages), a
        generate node's generation on pipeline stages, and the end of a pipeline stage's sends."""
        scope = contextlib.ExitStack()
        module = ctx.model.module if ctx.model is not None else None
        inst = self.view.node_instance.get(name)
        if ctx.node.kind == "train" and inst in self.engines:
            spec = self.view.meshes[name]
            hooks = ZeroHooks(self.engines[inst], self.meshes[name]["dp"].get_group(), spec.dp)
            ctx.train_hooks = scope.enter_context(hooks)
        elif inst in self.engines:  # another node calling a ZeRO instance (same mesh, same dp group)
            scope.enter_context(node_group(self.meshes[name]["dp"].get_group()))
        elif ctx.node.kind == "train" and module is not None:
            spec = self.view.meshes[name]
            ctx.train_hooks = scope.enter_context(
                train_hooks(
                    module,
                    self.meshes[name]["dp"].get_group(),
                    spec.dp,
                    reshard=ctx.node.reshard is not False,
                )
            )
        if ctx.node.kind == "generate":  # the built-in loop on pipeline stages: logits shared, local caches
            scope.enter_context(generation_scope(module))
        scope.enter_context(stage_scope(module))
        return scope

    def run_node(self, cmd: RunNode) -> NodeReport:
        """Receive this rank's input rows, run ``cmd.node`` on them, keep the outputs here.

        The rows come from the controller (``cmd.local``: per-row lists, test batches) and from the
        transfer ``cmd.xfer`` (:meth:`transfer`), in the controller's order ``cmd.order``; ``cmd.cmd``
        names the stored outputs.

        Returns:
            on every rank ``start``/``end`` (wall-clock seconds, ``time.time``, transfer included); on a
            dp leader (tp rank 0 of the last pipeline stage) also the outputs' metadata
            (:class:`TensorMeta`, or :class:`ListMeta` for a per-row list, which travels as it is),
            ``metrics``, ``tokens``, ``rows``, ``version``. Output tensors stay in :attr:`store` under
            ``(iteration, key, cmd)`` on the dp leaders (unbound outputs are dropped).
        """
        name, iteration, xfer = cmd.node, cmd.iteration, cmd.xfer
        ctx = self.contexts[name]
        ctx.iteration = iteration
        ctx.segment = cmd.segment
        ctx.mini_batch_rows = cmd.mini_rows
        node = ctx.node
        fn = self.graph.function(name).fn
        start = time.time()
        received = self.received.pop(xfer, {}) if xfer is not None else {}
        values = {**dict(cmd.local.to(self.device).items()), **received}
        batch = Batch({k: values[k] for k in cmd.order})
        with self._node_scope(name, ctx):
            result: NodeResult = fn(ctx, batch, **node.args)
        inst = self.view.node_instance.get(name)
        if ctx.engine is not None and inst is not None:  # its engine holds the weights: free the replica
            if inst in self.replicas and inst not in self.released:  # held whole until now (start, resume)
                self.replica_peaks[inst] = self._resident_bytes(inst)
            self._release()
            result.metrics[f"perf/weight_replica_bytes/{name}"] = float(self._resident_bytes(inst))
            if inst in self.replica_peaks:  # the most of it held at once during the last weight sync
                result.metrics[f"perf/weight_replica_peak_bytes/{name}"] = float(self.replica_peaks[inst])
        end = time.time()
        if self.rank not in self.view.meshes[name].leaders():  # every rank reports its times for the trace
            return NodeReport(
                start, end, spans=tuple(result.spans), peak_memory=peak_memory_bytes(self.device)
            )
        binding = node.outputs
        assert isinstance(binding, dict), "graph validation resolves bindings to dicts"
        outputs: dict[str, OutputMeta] = {}
        for param, value in result.outputs.items():
            if not isinstance(value, torch.Tensor):
                outputs[param] = ListMeta(list(value))
                continue
            key = binding.get(param)
            if key is not None:
                self.store.put((iteration, key, cmd.cmd), value.detach())
            outputs[param] = TensorMeta(tuple(value.shape), value.dtype, mask_lengths(param, value))
        return NodeReport(
            start,
            end,
            outputs=outputs,
            metrics=dict(result.metrics),
            tokens=int(result.tokens),
            rows=len(batch),
            version=ctx.model.version if ctx.model is not None else 0,
            spans=tuple(result.spans),
            peak_memory=peak_memory_bytes(self.device),
        )

    def transfer(self, cmd: int, part: Part, keep: bool) -> None:
        """This rank's part of the input transfer of a node (sends rows, receives rows, frees handles).

        ``keep``: this rank is in the node's mesh; the received inputs wait under ``cmd`` for the node's
        ``RunNode`` command, which the controller sends after the transfers of every node it submitted
        together (so a rank that both feeds one node and runs another does not hold the first back).
        """
        received = exchange(part, self.store, cmd, self.device)
        if keep:
            self.received[cmd] = received

    def put(self, cmd: int, iteration: int, rows: dict[str, torch.Tensor]) -> None:
        """Hold source rows from the controller under ``(iteration, key, cmd)``."""
        for key, value in rows.items():
            self.store.put((iteration, key, cmd), value.to(self.device))

    def pull(self, items: list[tuple[Handle, tuple[int, ...]]]) -> list[torch.Tensor]:
        """Held rows copied to the controller (CPU), one tensor per ``(handle, local rows)``."""
        return [self.store.select(h, rows).to("cpu") for h, rows in items]

    def sync(self, src: int, dsts: tuple[int, ...], version: int) -> SyncReport:
        """Copy instance ``src``'s weights to every instance in ``dsts`` (collective on their ranks).

        Per target, the planned reallocation where :meth:`_route` allowed it (shard-to-shard transfers
        of :mod:`rlflow.schedulers.realloc.execute`, verified region by region), else the gather path:
        all-gather the full parameters inside the source mesh, broadcast them from its first rank to the
        target mesh, each target rank slices its shard. A target whose model follows the source as an
        EMA then blends the received weights into its previous ones
        (:func:`rlflow.schedulers.realloc.ema.ema_update`).

        Returns:
            this rank's report: start and end (wall-clock seconds, ``time.time``), its bytes sent +
            received, and per target instance its path, the bytes of the whole sync (summed over
            receivers) and this rank's target checksum (:class:`TargetReport`).

        Raises:
            ChecksumError: a target region differs from its source region after the reallocation.
        """
        start = time.time()
        source = self.view.instances[src]
        in_source = self.rank in source.mesh.devices
        routes = [self.routes[(src, d)] for d in dsts]
        for dst, route in zip(dsts, routes, strict=True):
            # a released target is allocated again to be written (a streamed one a unit at a time)
            if not self._streams(route, dst):
                self._materialise(dst)
                if dst in self.replicas:
                    self.replica_peaks[dst] = self._resident_bytes(dst)
        shards: dict[str, torch.Tensor] | None = None
        flat: torch.Tensor | None = None
        info = self.model_infos[src]
        # the gather path's flat buffer: every parameter of the whole model, in named_parameters order
        names_shapes = [(k, torch.Size(shape)) for k, shape in info.shapes.items()]
        if in_source and any(r.plan is None and r.pieces is None for r in routes):
            params = self._full_params(src)  # on the source's first rank at least (the broadcast root)
            if params:
                flat = torch.cat([params[k].reshape(-1).to(self.device) for k, _ in names_shapes])
            del params
        targets: dict[int, TargetReport] = {}
        nbytes_here = 0  # this rank's bytes sent + received
        for dst, route in zip(dsts, routes, strict=True):
            target = self.view.instances[dst]
            in_target = self.rank in target.mesh.devices
            if route.pieces is not None:
                remote = sum((p.stop - p.start) * info.dtype_bytes for p in route.pieces if p.src != p.dst)
                targets[dst] = TargetReport("zero", remote)
                if self.rank not in route.verify_ranks:
                    continue
                checksum, moved_here = move_pieces(
                    route.pieces,
                    self.rank,
                    self._local(src, source=True) if in_source else {},
                    self._local(dst, source=False) if in_target else {},
                    self.groups.group(route.verify_ranks),
                )
                nbytes_here += moved_here
                self.realloc_count += 1
                if in_target:
                    if dst in self.engines:
                        refresh_master(self.engines[dst])
                    targets[dst] = TargetReport("zero", remote, checksum)
                    self.instances[dst].version = version
                    _log.info(
                        "ZeRO reallocation of '%s' v%d: instance %d -> %d, rank %d checksum %s",
                        target.model, version, src, dst, self.rank, checksum,
                    )  # fmt: skip
                continue
            if route.plan is not None:
                plan = route.plan
                targets[dst] = TargetReport("plan", plan.remote_bytes)
                if self.rank not in route.verify_ranks:
                    continue
                if self._streams(route, dst):
                    checksum, moved_here = self._stream_sync(src, dst, plan, route.verify_ranks, version)
                    nbytes_here += moved_here
                    self.realloc_count += 1
                    if in_target:
                        targets[dst] = TargetReport("plan", plan.remote_bytes, checksum)
                    continue
                if in_source and shards is None:
                    shards = source_shards(self.instances[src].module, gather_dp=source.fsdp)
                src_shards = shards if in_source and shards is not None else {}
                dst_shards = target_shards(self.instances[dst].module) if in_target else {}
                before = self._before_ema(dst) if in_target else None
                src_off = expected_boxes(info, source.mesh, self.rank) if in_source else None
                dst_off = expected_boxes(info, target.mesh, self.rank) if in_target else None
                execute_reallocation(
                    plan,
                    self.rank,
                    src_shards,
                    dst_shards,
                    dtype=info.dtypes,
                    groups=self.realloc_groups,
                    src_offsets=src_off,
                    dst_offsets=dst_off,
                )
                checksum = verify_reallocation(
                    plan,
                    self.rank,
                    src_shards,
                    dst_shards,
                    src_offsets=src_off,
                    dst_offsets=dst_off,
                    group=self.groups.group(route.verify_ranks),
                )
                nbytes_here += plan_bytes_of(plan, self.rank)
                self.realloc_count += 1
                if in_target:
                    if dst in self.engines:
                        refresh_master(self.engines[dst])
                    ema_checksum = self._blend_ema(dst, before) or checksum
                    targets[dst] = TargetReport("plan", plan.remote_bytes, ema_checksum)
                    self.instances[dst].version = version
                    _log.info(
                        "reallocation of '%s' v%d: instance %d -> %d, rank %d checksum %s",
                        target.model, version, src, dst, self.rank, checksum,
                    )  # fmt: skip
                continue
            ranks = self.view.sync_ranks(src, dst)
            if self.rank not in ranks:
                targets[dst] = TargetReport("gather")
                continue
            numel = sum(int(torch.Size(s).numel()) for _, s in names_shapes)
            dtype = next(iter(info.dtypes.values()))  # rlflow models have one dtype
            buf = flat if flat is not None else torch.empty(numel, dtype=dtype, device=self.device)
            nbytes = numel * buf.element_size()
            moved = nbytes * (len(ranks) - 1)
            targets[dst] = TargetReport("gather", moved)
            if len(ranks) > 1:
                dist.broadcast(buf, src=ranks[0], group=self.groups.group(ranks))
                nbytes_here += nbytes * (len(ranks) - 1 if self.rank == ranks[0] else 1)
            if in_target:
                full: dict[str, torch.Tensor] = {}
                offset = 0
                for k, shape in names_shapes:
                    n = int(torch.Size(shape).numel())
                    full[k] = buf[offset : offset + n].view(shape)
                    offset += n
                before = self._before_ema(dst)
                if target.zero3:
                    load_zero_params(self.instances[dst].module, full)
                else:
                    load_full_params(self.instances[dst].module, full)
                if dst in self.engines:
                    refresh_master(self.engines[dst])
                self.instances[dst].version = version
                checksum = self._blend_ema(dst, before) or weights_checksum(
                    target_shards(self.instances[dst].module)
                )
                targets[dst] = TargetReport("gather", moved, checksum)
        return SyncReport(start, time.time(), nbytes_here, targets)

    def _stream_sync(
        self, src: int, dst: int, plan: ReallocPlan, ranks: tuple[int, ...], version: int
    ) -> tuple[str, int]:
        """Run the planned reallocation ``src -> dst`` unit by unit and stream each unit into ``dst``'s
        engines (:mod:`~rlflow.schedulers.runtime.distributed.stream_sync`; every rank of the route,
        ``ranks``, calls it). A target rank drives the units from the engines' probe forward and ends with
        the engines verified at ``version`` and the instance's parameters freed (:attr:`released`); a source
        rank outside the target walks the units in order.

        Returns:
            this rank's checksum of the target (BLAKE2b over the units' checksums; "" off the target) and
            its bytes sent + received.

        Raises:
            ChecksumError: a unit's target region differs from its source region; NodeError,
                WeightSyncError: an engine failed to load or does not serve the weights (after every unit
                has moved, so no rank is left waiting).
        """
        import hashlib

        from rlflow.nodes.engines.probe import trainer_probe

        source, target = self.view.instances[src], self.view.instances[dst]
        in_source, in_target = self.rank in source.mesh.devices, self.rank in target.mesh.devices
        info = self.model_infos[src]
        units = weight_units(info.shapes)
        unit_of_param = {name: k for k, (_, names) in enumerate(units) for name in names}
        per_unit: list[list[Transfer]] = [[] for _ in units]
        for t in plan.transfers:  # one pass: each unit's sub-plan, in the plan's order
            per_unit[unit_of_param[t.param]].append(t)
        subplans = [ReallocPlan(tuple(ts)) for ts in per_unit]
        src_module = self.instances[src].module if in_source else None
        src_off = expected_boxes(info, source.mesh, self.rank) if in_source else None
        dst_off = expected_boxes(info, target.mesh, self.rank) if in_target else None
        group = self.groups.group(ranks)
        engines = (
            [e for n in self.engine_only[dst] if (e := self.contexts[n].engine) is not None]
            if in_target
            else []
        )
        module = self.instances[dst].module if in_target else None
        aliases = list(module.named_parameters(remove_duplicate=False)) if module is not None else []
        names_of: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}  # parameter -> every name it goes by
        for alias, p in aliases:
            names_of.setdefault(id(p), []).append((alias, p))
        sums: list[str] = []

        def fill(k: int, params: dict[str, torch.nn.Parameter]) -> None:
            names = units[k][1]
            src_shards = (
                source_shards(src_module, gather_dp=source.fsdp, names=names)
                if src_module is not None
                else {}
            )
            dst_shards = target_shards(params)
            execute_reallocation(
                subplans[k], self.rank, src_shards, dst_shards, dtype=info.dtypes, groups=self.realloc_groups,
                src_offsets=src_off, dst_offsets=dst_off,
            )  # fmt: skip
            checksum = verify_reallocation(
                subplans[k], self.rank, src_shards, dst_shards, src_offsets=src_off, dst_offsets=dst_off,
                group=group,
            )  # fmt: skip
            sums.append(checksum)
            del src_shards  # an FSDP2 source's re-gathered unit
            # a tied head's name too: the engine re-packs the head only when it receives it (weight_buckets)
            named = [pair for p in params.values() for pair in names_of[id(p)]]
            for engine in engines:
                engine.load_unit(named)

        if not in_target:
            for k in range(len(units)):
                fill(k, {})
            return "", plan_bytes_of(plan, self.rank)
        assert module is not None
        state = self.instances[dst]
        if dst not in self.released:  # held since start-up: freed first, so one unit at a time is held
            move_params(module.parameters(), torch.device("meta"))
        for engine in engines:
            engine.begin_sync()
        param_names = {k for k, _ in aliases}
        buffers = [(k, v) for k, v in module.state_dict().items() if k not in param_names]
        for engine in engines:  # persistent buffers (resident): one unit before the parameters
            if buffers:
                engine.load_unit(buffers)
        stream = UnitStream(module, units, fill, self.device)
        with stream:
            want = trainer_probe(module, self.device)
        stream.finish()
        self.released.add(dst)
        self.replica_peaks[dst] = stream.peak_bytes
        for engine in engines:
            engine.end_sync(want, model=target.model, version=version)
        state.version = version
        checksum = hashlib.blake2b("".join(sums).encode(), digest_size=16).hexdigest()
        _log.info(
            "streamed reallocation of '%s' v%d: instance %d -> %d, rank %d, %d units, peak %d bytes, "
            "checksum %s",
            target.model, version, src, dst, self.rank, len(units), stream.peak_bytes, checksum,
        )  # fmt: skip
        return checksum, plan_bytes_of(plan, self.rank)

    def _before_ema(self, dst: int) -> dict[str, torch.Tensor] | None:
        """A copy of an EMA target's local shards before the source's weights overwrite them."""
        if dst not in self.view.ema:
            return None
        return {k: v.clone() for k, v in target_shards(self.instances[dst].module).items()}

    def _blend_ema(self, dst: int, before: dict[str, torch.Tensor] | None) -> str | None:
        """Blend an EMA target: its shards hold the source's weights, ``before`` its own; the checksum."""
        if before is None:
            return None
        now = target_shards(self.instances[dst].module)
        ema_update(before, now, self.view.ema[dst])
        for k, v in before.items():
            now[k].copy_(v)
        return weights_checksum(now)

    def _full_params(self, instance: int) -> dict[str, torch.Tensor]:
        """Full parameters of ``instance``, gathered on its mesh (collective there): the whole model on
        the mesh's first rank, and on every rank of a ``pp = 1`` mesh; ``{}`` elsewhere with ``pp > 1``."""
        inst = self.view.instances[instance]
        module = self.instances[instance].module
        params = zero_full_params(module) if inst.zero3 else full_params(module)
        if inst.mesh.pp > 1:
            params = gather_stage_params(params, inst.mesh, self.rank, self.groups)
        return params

    def fetch(self, instance: int) -> dict[str, torch.Tensor] | None:
        """Full parameters of ``instance`` (collective on its mesh); returned by its first rank only."""
        inst = self.view.instances[instance]
        if instance in self.released:  # never the primary instance (_replicas)
            raise RuntimeError(f"instance {instance} of model '{inst.model}' is released to its engines")
        params = self._full_params(instance)
        if self.rank != inst.mesh.devices[0]:
            return None
        return {k: v.detach().to("cpu").clone() for k, v in params.items()}

    def state(self) -> dict[str, Any]:
        """This rank's optimizer/scheduler shards, weight versions, node generators and partial rollouts
        between segments (interruptible generation)."""
        instances: dict[int, Any] = {}
        for i, s in self.instances.items():
            if i in self.engines:
                zero = self.view.instances[i].zero
                assert zero is not None
                instances[i] = zero_train_state(
                    s, self.engines[i], zero.zero_stage, self.view.instances[i].mesh.dp
                )
            else:
                instances[i] = s.train_state()
        return {
            "instances": instances,
            "generators": {n: c.generator.get_state() for n, c in self.contexts.items() if c.generator},
            "partial": {n: dict(c.partial) for n, c in self.contexts.items() if c.partial},
        }

    def load_state(self, state: dict[str, Any]) -> None:
        for i, saved in state["instances"].items():
            i = int(i)
            inst = self.view.instances[i]
            if i in self.engines:
                assert inst.zero is not None
                stage, dp = inst.zero.zero_stage, inst.mesh.dp
                kept = load_zero_train_state(self.instances[i], self.engines[i], stage, dp, saved)
                now = f"ZeRO-{stage} on dp={dp}"
            else:
                kept = "zero" not in saved
                self.instances[i].load_train_state(_builtin_train_state(saved))
                now = "rlflow's AdamW (FSDP2 path)"
            if not kept and self.rank == inst.mesh.devices[0]:  # once per model instance
                zero = saved.get("zero")
                was = (
                    "rlflow's AdamW (FSDP2 path)"
                    if zero is None
                    else f"ZeRO-{zero['stage']} on dp={zero['dp']}"
                )
                _log.warning(
                    "rlflow: warning: --resume: model '%s': the checkpoint's optimizer state was written "
                    "by %s; this run trains it with %s: weights, LR schedule and version are restored, "
                    "the Adam moments start from zero",
                    inst.model,
                    was,
                    now,
                )
        for name, gen_state in state["generators"].items():
            gen = self.contexts[name].generator
            if gen is not None:
                gen.set_state(gen_state)
        for name, partial in state.get("partial", {}).items():
            self.contexts[name].partial = dict(partial)
        self._release()  # engines already at the restored version; the others load it first


def _builtin_train_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved train state as an FSDP2/plain instance loads it: a DeepSpeed node's optimizer state (its ZeRO
    partitions) does not load into torch's AdamW, so only its version and LR schedule are kept."""
    if "zero" in saved:
        return {**saved, "optimizer": None}
    return saved


# what a failed command was doing, in its error message (commands that say more set it in serve)
_WHAT: dict[type, str] = {
    Setup: "setup",
    Pull: "pull",
    Free: "free",
    Stored: "stored",
    Fetch: "fetch",
    GetState: "state",
    LoadState: "load_state",
}


def serve(rank: int, conn: Connection) -> None:
    """The command loop of a worker whose default process group is initialised; returns on :class:`Stop`
    (or when the controller is gone), after stopping the worker's generation engines."""
    send(conn, Hello(rank))
    worker: Worker | None = None
    try:
        while True:
            try:
                msg: Command = recv(conn)
            except (EOFError, OSError):  # the controller is gone
                return
            if isinstance(msg, Stop):
                return
            cmd = -1 if isinstance(msg, Setup) else msg.cmd
            what = _WHAT.get(type(msg), type(msg).__name__)
            try:
                if isinstance(msg, Setup):
                    worker = Worker(rank, msg.graph, msg.checkpoint_dir, msg.config)
                    send(conn, Ready(rank))
                    continue
                assert worker is not None, "setup must come first"
                payload: Any = None
                match msg:
                    case RunNode(node=name, iteration=iteration):
                        what = f"node '{name}' (iteration {iteration})"
                        payload = worker.run_node(msg)
                    case Xfer(part=part, keep=keep):
                        what = "moving input rows between workers"
                        worker.transfer(cmd, part, keep)
                    case Put(iteration=iteration, rows=rows):
                        what = f"receiving source rows (iteration {iteration})"
                        worker.put(cmd, iteration, rows)
                    case Pull(items=items):
                        payload = worker.pull(items)
                    case Free(handles=handles):
                        worker.store.free(handles)
                    case Stored():
                        payload = worker.store.handles()
                    case Sync(src=src, dsts=dsts, version=version):
                        what = f"weight sync of model '{worker.view.instances[src].model}'"
                        payload = worker.sync(src, dsts, version)
                    case Fetch(instance=instance):
                        payload = worker.fetch(instance)
                    case GetState():
                        payload = worker.state()
                    case LoadState(state=state):
                        worker.load_state(state)
                    case _:
                        raise RuntimeError(f"unknown command {msg!r}")
                send(conn, Done(cmd, rank, payload))
            except BaseException as e:
                try:
                    send(conn, Failed(cmd, rank, what, f"{type(e).__name__}: {e}", traceback.format_exc()))
                except (EOFError, OSError):
                    return
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    return

    finally:
        if worker is not None:  # the engines stop with their worker, whatever ended the loop
            worker.close()


def connect_controller(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """A connection to the controller at ``address``, retried for ``timeout_s`` seconds (Nagle off)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return no_delay(Client(address, authkey=authkey))
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def spawned_main(
    rank: int, world: int, init_method: str, address: tuple[str, int], authkey: bytes, config: DistConfig
) -> None:
    """Entry of a worker started by the embedded launcher (multiprocessing spawn).

    The worker ignores SIGINT, SIGTERM and SIGHUP and leads a process group of its own: a Ctrl-C, or a
    scheduler's SIGTERM to the controller's process group, must reach the controller only, which finishes
    the iteration on its workers, saves and stops them (:class:`Stop`, else SIGKILL). A worker whose
    controller dies sees its connection close and exits.
    """
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    # A process group of its own: processes the worker starts (a vLLM engine core, which installs its own
    # SIGINT/SIGTERM handlers) then miss a terminal's Ctrl-C too, and keep serving the iteration in flight
    os.setpgid(0, 0)
    join_and_serve(rank, world, init_method, address, authkey, config)


def join_and_serve(
    rank: int, world: int, init_method: str, address: tuple[str, int], authkey: bytes, config: DistConfig
) -> None:
    """Join the process group, then serve the controller at ``address`` until :class:`Stop` (or the
    controller is gone); leaves the process group on the way out. Used by the embedded and Ray launchers."""
    from rlflow.schedulers.runtime.distributed.launch import init_worker_process

    init_worker_process(rank, world, init_method, config.collective_timeout_s, None, config.threads)
    conn = connect_controller(address, authkey, 60.0)
    try:
        serve(rank, conn)
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """torchrun entry: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and ``RLFLOW_CONTROLLER``
    (``host:port``), ``RLFLOW_AUTHKEY`` (hex) from the environment."""
    from datetime import timedelta

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    host, port = os.environ["RLFLOW_CONTROLLER"].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ["RLFLOW_AUTHKEY"])
    timeout = float(os.environ.get("RLFLOW_COLLECTIVE_TIMEOUT_S", "300"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    del world
    conn = connect_controller((host, int(port)), authkey, 120.0)
    try:
        serve(rank, conn)
    finally:
        conn.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
