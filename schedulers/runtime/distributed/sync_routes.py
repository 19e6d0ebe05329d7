"""How each weight sync runs, decided once at start-up and identically on every rank.

A sync ``src -> dst`` (after a train node, from its instance to another instance of its model or of a model
that follows it as an EMA) takes one of three routes
(:class:`~rlflow.schedulers.runtime.distributed.weight_sync.Route`): the ZeRO path when a side holds ZeRO-3
partitions (pieces of flat runs, :func:`~rlflow.schedulers.runtime.distributed.zero_transfer.plan_pieces`),
the planned reallocation where the layouts allow it
(:func:`~rlflow.schedulers.realloc.planning.plan_reallocation`, checked against every rank's DTensor shard
boxes), else the gather path, whose reason is logged. The process groups a route
needs are created here, in the same order on every rank, because a sync involves only some ranks.

A sync between two instances of one LoRA model moves its adapters only (:meth:`SyncRoutes.info`): both
sides built the same frozen base at start-up (the model's spec, its seed) and no train step changes it. A
target that vLLM engines read (tp = 1: ``lora_placement`` refuses a LoRA model at tp > 1) is no exception:
its engines serve that base, loaded once, and the generate node then loads the instance's new adapters
into them as a new adapter version (:mod:`rlflow.nodes.engines.lora_sync`). A model that follows a LoRA
model as an EMA gets every weight (it has weights of its own).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.realloc.planning import ReallocPlan, plan_reallocation
from rlflow.schedulers.realloc.shards import param_shards
from rlflow.schedulers.runtime.distributed.hosted import Hosted
from rlflow.schedulers.runtime.distributed.placement import Instance
from rlflow.schedulers.runtime.distributed.weight_sync import (
    ModelInfo,
    Route,
    SharedGroups,
    boxes_match,
    expected_boxes,
    local_boxes,
)
from rlflow.schedulers.runtime.distributed.zero_transfer import (
    Holdings,
    box_holdings,
    plan_pieces,
    zero_holdings,
)

__all__ = ["SyncRoutes", "holdings"]

_log = logging.getLogger("rlflow.realloc")


class SyncRoutes:
    """The route of every weight sync of the plan, seen from rank ``hosted.rank`` (collective over the world:
    every rank builds it at start-up, after its instances).

    Args:
        hosted: this rank's instances (their shard boxes are checked against the plan's).
        mode: ``DistConfig.realloc``: ``"auto"`` or ``"gather"`` (the gather path for every sync).

    Attributes:
        routes: ``(src, dst)`` instance pair -> its route.
        infos: source instance -> the whole model's shapes and dtypes (from the source mesh's first rank).
        route_infos: ``(src, dst)`` -> the parameters that sync moves (:meth:`info`).
        realloc_groups: the process groups of the planned reallocations (frozen once every route is set).
    """

    def __init__(self, hosted: Hosted, mode: str) -> None:
        self.hosted = hosted
        self.rank = hosted.rank
        self.view = hosted.view
        self.groups = hosted.groups
        self.mode = mode
        self.realloc_groups = SharedGroups(self.groups)
        self.infos: dict[int, ModelInfo] = {}
        self.route_infos: dict[tuple[int, int], ModelInfo] = {}
        self.routes: dict[tuple[int, int], Route] = {}
        for train, targets in self.view.sync_targets.items():
            src = self.view.node_instance[train]
            for dst in targets:
                self.routes[(src, dst)] = self._route(src, dst)
        self.realloc_groups.frozen = True

    def _info(self, src: int) -> ModelInfo:
        """The source model's shapes and dtypes, broadcast from the source mesh's first rank (collective)."""
        if src not in self.infos:
            root = self.view.instances[src].mesh.devices[0]
            box: list[Any] = [self.hosted.full_infos[src] if self.rank == root else None]
            dist.broadcast_object_list(box, src=root)
            self.infos[src] = box[0]
        return self.infos[src]

    def info(self, src: int, dst: int) -> ModelInfo:
        """The parameters the sync ``src -> dst`` moves: the adapters alone between two instances of a LoRA
        model (:meth:`ModelInfo.adapters_only`; vLLM engines that read the target load them from it as a
        new adapter version), else every parameter."""
        key = (src, dst)
        if key not in self.route_infos:
            info = self._info(src)
            source, target = self.view.instances[src], self.view.instances[dst]
            adapters = bool(info.adapters) and target.model == source.model and dst not in self.view.ema
            self.route_infos[key] = info.adapters_only() if adapters else info
            if info.adapters and not adapters and self.rank == 0:
                _log.info(
                    "weight sync of LoRA model '%s' %d -> %d moves every weight (the target follows it as "
                    "an EMA)", source.model, src, dst,
                )  # fmt: skip
        return self.route_infos[key]

    def _route(self, src: int, dst: int) -> Route:
        """Decide (identically on every rank: collective over the world) how ``src -> dst`` syncs."""
        source, target = self.view.instances[src], self.view.instances[dst]
        both = tuple(sorted(set(source.mesh.devices) | set(target.mesh.devices)))
        info = self.info(src, dst)
        reason = ""
        plan: ReallocPlan | None = None
        zero_path = (source.zero3 or target.zero3) and not target.fsdp and dst not in self.view.ema
        if self.mode != "gather" and zero_path:
            pieces = tuple(plan_pieces(holdings(info, source), holdings(info, target), list(info.shapes)))
            self.groups.group(both)  # the verification group
            return Route(None, "", both, pieces)
        if self.mode == "gather":
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
            instances = self.hosted.instances
            for idx, inst, gather in ((src, source, source.fsdp), (dst, target, False)):
                if idx in instances and not mismatch:
                    boxes = local_boxes(instances[idx].module, gather_dp=gather)
                    got = {k: v for k, v in boxes.items() if k in info.shapes}  # an adapter sync's
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


def holdings(info: ModelInfo, inst: Instance) -> Holdings:
    """What each rank of ``inst`` holds of every parameter, as flat runs (ZeRO-3 partitions, or the
    ``param_shards`` boxes of the layout; an FSDP2 source is re-gathered over dp to those boxes)."""
    if inst.zero3:
        return zero_holdings(info.shapes, inst.mesh.devices)
    boxes = param_shards(info.shapes, info.meta, inst.mesh.devices, inst.mesh.layout)
    return box_holdings(info.shapes, boxes)
