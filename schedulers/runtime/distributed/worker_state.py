"""The state of one worker process and its handling of each command: running a node on the rows it
received, moving rows between workers, a weight sync, a fetch of full weights, and the state a checkpoint
keeps.

A :class:`Worker` is built by the ``Setup`` command (:func:`rlflow.schedulers.runtime.distributed.worker.
serve`), collectively and in the same order on every rank: what it hosts
(:class:`~rlflow.schedulers.runtime.distributed.hosted.Hosted`), the route of every weight sync
(:class:`~rlflow.schedulers.runtime.distributed.sync_routes.SyncRoutes`), then the replicas it may release
(:class:`~rlflow.schedulers.runtime.distributed.replicas.Replicas`).

Generation and training backends are plain node functions here (transformers + torch). A generate node
with ``engine: vllm`` gets this rank's vLLM engine in its context; a train node with ``engine: deepspeed``
trains its instance inside a DeepSpeed ZeRO engine on the node's own dp group
(:mod:`rlflow.schedulers.runtime.distributed.zero`), through the same node function and
:class:`~rlflow.nodes.context.TrainHooks` seam as FSDP2.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.graph import Graph
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.schedulers.runtime.devices import peak_memory_bytes
from rlflow.schedulers.runtime.distributed.hosted import Hosted
from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks
from rlflow.schedulers.runtime.distributed.mesh import GroupCache
from rlflow.schedulers.runtime.distributed.pipeline import generation_scope, stage_scope
from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks
from rlflow.schedulers.runtime.distributed.placement import PlanView
from rlflow.schedulers.runtime.distributed.protocol import (
    DistConfig,
    ListMeta,
    NodeReport,
    OutputMeta,
    RunNode,
    SyncReport,
    TensorMeta,
)
from rlflow.schedulers.runtime.distributed.replicas import Replicas
from rlflow.schedulers.runtime.distributed.sync_routes import SyncRoutes
from rlflow.schedulers.runtime.distributed.sync_runner import SyncRunner
from rlflow.schedulers.runtime.distributed.transfer import Handle, Part, RowStore, exchange, mask_lengths
from rlflow.schedulers.runtime.distributed.zero import (
    ZeroHooks,
    load_zero_train_state,
    node_group,
    zero_train_state,
)
from rlflow.schedulers.runtime.instances import contexts_state, load_contexts_state

__all__ = ["Worker"]

_log = logging.getLogger("rlflow.realloc")


class Worker:
    """The state of one worker: what it hosts, the rows it holds, its sync routes and released replicas.

    Args:
        rank: this worker's rank in the default process group (initialised already).
        graph: the validated graph.
        checkpoint_dir: when resuming, the checkpoint whose ``models/<name>`` the instances load.
        config: the distributed runtime's settings (collective timeout, ``realloc``, ``release_replicas``).

    Attributes:
        hosted: the meshes, instances, contexts and engines of this rank.
        routing: the route of every weight sync; replicas: the instances released to their engines;
            syncs: runs this rank's part of each weight sync.
        store: node outputs and source rows held here until their last reader.
        received: input-transfer command -> the inputs it received, waiting for the node's run.

    Raises:
        ModelError: a model or tokenizer cannot be loaded or built.
        NodeError: a generation engine failed to start.
    """

    def __init__(self, rank: int, graph: Graph, checkpoint_dir: Path | None, config: DistConfig):
        self.rank = rank
        self.graph = graph
        self.view = PlanView.of(graph)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        groups = GroupCache(config.collective_timeout_s, self.device.type)
        self.store = RowStore()
        self.received: dict[int, dict[str, torch.Tensor]] = {}
        # Collective set-up, identical order on every rank: node meshes, models, then the sync routes
        # (their process groups are created here because a sync involves only some ranks).
        self.hosted = Hosted(rank, graph, self.view, self.device, groups, checkpoint_dir)
        self.routing = SyncRoutes(self.hosted, config.realloc)
        # instances whose weights only their vLLM engines read: freed while the engines hold them
        self.replicas = Replicas(self.hosted, self.routing.routes, config.release_replicas)
        self.syncs = SyncRunner(self.hosted, self.routing, self.replicas)
        if checkpoint_dir is None:  # resumed: load_state restores the version, which the engines load first
            self.replicas.release()

    def close(self) -> None:
        """Stop this worker's generation engines and release its DeepSpeed engines (idempotent)."""
        self.hosted.close()

    def _node_scope(self, name: str, ctx: NodeContext) -> contextlib.ExitStack:
        """Around one call of node ``name``: a train node's hooks (data parallel, and pipeline stages), a
        generate node's generation on pipeline stages, and the end of a pipeline stage's sends."""
        scope = contextlib.ExitStack()
        module = ctx.model.module if ctx.model is not None else None
        inst = self.view.node_instance.get(name)
        if ctx.node.kind == "train" and inst in self.hosted.engines:
            spec = self.view.meshes[name]
            hooks = ZeroHooks(self.hosted.engines[inst], self.hosted.meshes[name]["dp"].get_group(), spec.dp)
            ctx.train_hooks = scope.enter_context(hooks)
        elif inst in self.hosted.engines:  # another node calling a ZeRO instance (same mesh, same dp group)
            scope.enter_context(node_group(self.hosted.meshes[name]["dp"].get_group()))
        elif ctx.node.kind == "train" and module is not None:
            spec = self.view.meshes[name]
            ctx.train_hooks = scope.enter_context(
                train_hooks(
                    module,
                    self.hosted.meshes[name]["dp"].get_group(),
                    spec.dp,
                    reshard=ctx.node.reshard is not False,
                )
            )
        budget = ctx.node.max_tokens_per_micro_batch
        if ctx.node.kind == "inference" and budget is not None and module is not None:
            # token-budget micro-batches: the dp ranks agree on their count (FSDP2/ZeRO-3 gather per forward)
            spec = self.view.meshes[name]
            ctx.train_hooks = DataParallelHooks(module, self.hosted.meshes[name]["dp"].get_group(), spec.dp)
        if ctx.node.kind == "generate":  # the built-in loop on pipeline stages: logits shared, local caches
            scope.enter_context(generation_scope(module))
        scope.enter_context(stage_scope(module))
        if ctx.model is not None:  # a base view runs its LoRA model with the adapters off
            scope.enter_context(ctx.model.calling())
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
        ctx = self.hosted.contexts[name]
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
            replicas = self.replicas
            if (
                inst in replicas.releasable and inst not in replicas.released
            ):  # held whole until now (start, resume)
                replicas.peaks[inst] = replicas.resident_bytes(inst)
            self.replicas.release()
            result.metrics[f"perf/weight_replica_bytes/{name}"] = float(self.replicas.resident_bytes(inst))
            if inst in self.replicas.peaks:  # the most of it held at once during the last weight sync
                result.metrics[f"perf/weight_replica_peak_bytes/{name}"] = float(self.replicas.peaks[inst])
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
        """Copy instance ``src``'s weights to every instance in ``dsts`` (collective on their ranks):
        :meth:`~rlflow.schedulers.runtime.distributed.sync_runner.SyncRunner.sync`.

        Raises:
            ChecksumError: a target region differs from its source region after the reallocation.
        """
        return self.syncs.sync(src, dsts, version)

    def fetch(self, instance: int, *, adapters: bool = False) -> dict[str, torch.Tensor] | None:
        """Full parameters of ``instance`` (collective on its mesh); returned by its first rank only. With
        ``adapters``, a LoRA model's trained parameters alone (the base is frozen: the controller's mirror
        holds it since start-up)."""
        inst = self.view.instances[instance]
        if instance in self.replicas.released:  # never the primary instance (replicas.engine_only)
            raise RuntimeError(f"instance {instance} of model '{inst.model}' is released to its engines")
        params = self.hosted.full_params(instance)
        if self.rank != inst.mesh.devices[0]:
            return None
        if adapters:
            trained = self.hosted.full_infos[instance].adapters
            params = {k: v for k, v in params.items() if k in trained}
        return {k: v.detach().to("cpu").clone() for k, v in params.items()}

    def state(self) -> dict[str, Any]:
        """This rank's optimizer/scheduler shards, weight versions, node generators and partial rollouts
        between segments (interruptible generation)."""
        instances: dict[int, Any] = {}
        for i, s in self.hosted.instances.items():
            if i in self.hosted.engines:
                zero = self.view.instances[i].zero
                assert zero is not None
                instances[i] = zero_train_state(
                    s, self.hosted.engines[i], zero.zero_stage, self.view.instances[i].mesh.dp
                )
            else:
                instances[i] = s.train_state()
        return {"instances": instances, **contexts_state(self.hosted.contexts)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (the instances already hold the checkpoint's weights); an optimizer state
        written by the other trainer (DeepSpeed vs rlflow's AdamW) keeps only the version and LR schedule,
        with a warning. Then releases the replicas whose engines hold the restored version."""
        for i, saved in state["instances"].items():
            i = int(i)
            inst = self.view.instances[i]
            if i in self.hosted.engines:
                assert inst.zero is not None
                stage, dp = inst.zero.zero_stage, inst.mesh.dp
                kept = load_zero_train_state(
                    self.hosted.instances[i], self.hosted.engines[i], stage, dp, saved
                )
                now = f"ZeRO-{stage} on dp={dp}"
            else:
                kept = "zero" not in saved
                self.hosted.instances[i].load_train_state(_builtin_train_state(saved))
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
        load_contexts_state(self.hosted.contexts, state)
        self.replicas.release()  # engines already at the restored version; the others load it first


def _builtin_train_state(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved train state as an FSDP2/plain instance loads it: a DeepSpeed node's optimizer state (its ZeRO
    partitions) does not load into torch's AdamW, so only its version and LR schedule are kept."""
    if "zero" in saved:
        return {**saved, "optimizer": None}
    return saved
