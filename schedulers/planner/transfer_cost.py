"""Seconds of moving a problem's weights and batches between meshes: the weight sync after a train node,
one reallocation of a model between two (mesh, layout)s, and an edge's batch.

Notation, units and the collectives' model: ``cost.py``, ``comm_cost.py``.

Weight sync after a train node (what ``SyncRunner.sync`` runs, priced by :meth:`TransferCost.sync_time`):
every *instance* of the model other than the train node's (nodes with the same devices, dp, tp, pp, ep and
sharding share one, as in ``runtime.distributed.placement``) receives the new weights. An FSDP2 source first
all-gathers every parameter tensor over dp (not its routed experts at ep > 1: they are ep shards, outside
FSDP2); a plan-path target then gets ``realloc.plan_reallocation``'s transfers (an expert-parallel side's
fused expert tensors cut by ep along dim 0, ``realloc.shards``: each expert block from a holder to the
devices that need it), packed into broadcasts as ``realloc.execute.schedule_messages`` packs them, local
copies at memory bandwidth; an FSDP2 target takes the gather path (every tensor gathered on the source
mesh, one broadcast of the model). Every target is verified: two
all-gathers on the union of both meshes and hashing its shards twice at ``Overheads.digest_bandwidth``. An
edge costs ``bytes / link bandwidth + latency`` when producer and consumer meshes differ.

A LoRA model (``ModelShape.lora``) syncs its adapters only (and a trained value/score head; the base is
placed once, frozen, and never moves): bytes and tensors of the gathers, broadcasts and reallocation are the
adapters' (``adapters.adapter_shapes``, ``ModelShape.synced_params``), and the verification hashes the
target's share of them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rlflow.schedulers.planner.adapters import adapter_shapes
from rlflow.schedulers.planner.call_cost import trained_tensors
from rlflow.schedulers.planner.comm_cost import collectives_time
from rlflow.schedulers.planner.expert_cost import routed_expert_params
from rlflow.schedulers.planner.memory_cost import stage_params
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.realloc.planning import DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_BYTES, region_moves
from rlflow.schedulers.realloc.shards import ModelMeta, stage_layers

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.problem import PlanProblem

__all__ = ["TransferCost"]


class TransferCost:
    """Prices the weight syncs, reallocations and edges of ``problem`` on ``cluster`` (caches results)."""

    def __init__(self, problem: PlanProblem, cluster: ClusterSpec) -> None:
        self.problem = problem
        self.cluster = cluster
        self._realloc_cache: dict[tuple[str, NodePlacement, NodePlacement], float] = {}
        self._sync_cache: dict[tuple[str, tuple[tuple[NodePlacement, bool], ...]], float] = {}
        # (model, source pp, target pp) -> the representative parameters a reallocation plans, their scale
        self._realloc_params: dict[
            tuple[str, int, int], tuple[dict[str, tuple[int, ...]], dict[str, int]]
        ] = {}

    # ---- weight sync -------------------------------------------------------------------------------
    def sync_targets(self, train: str, plan: Mapping[str, NodePlacement]) -> list[tuple[NodePlacement, bool]]:
        """The instances that receive ``train``'s new weights: (placement, FSDP2-sharded) of every other
        node of its model whose (devices, dp, tp, pp, ep, sharding) differ from the train node's, once each
        (``runtime.distributed.placement.PlanView``'s instances)."""
        spec = self.problem.node(train)

        def instance(name: str) -> tuple[tuple[int, ...], int, int, int, int, bool]:
            lay = plan[name].layout
            return plan[name].devices, lay.dp, lay.tp, lay.pp, lay.ep, self._sharded(name, lay)

        own = instance(train)
        out: dict[tuple[tuple[int, ...], int, int, int, int, bool], tuple[NodePlacement, bool]] = {}
        for other in self.problem.model_nodes.get(spec.model, ()):
            key = instance(other)
            if other != train and key != own and key not in out:
                out[key] = (plan[other], key[5])
        return list(out.values())

    def _sharded(self, name: str, layout: Layout) -> bool:
        """Whether node ``name`` holds its weights sharded over dp under ``layout``: a train node with
        dp > 1 on FSDP2 or ZeRO-3 (ZeRO-1/2 keep whole weights on every rank)."""
        node = self.problem.node(name)
        return node.kind == "train" and layout.dp > 1 and (node.zero is None or node.zero.stage == 3)

    def sync_bytes(self, model: str) -> float:
        """Bytes of ``model`` one weight sync moves to each target: every parameter at the model's dtype,
        or a LoRA model's adapters (and trained head) only (module docstring); the runtime measures the
        same tensors (``rlflow.nodes.lora.adapter_bytes``)."""
        shape = self.problem.models[model]
        return float(shape.synced_params * shape.dtype_bytes)

    def sync_time(self, train: str, plan: Mapping[str, NodePlacement]) -> float:
        """Seconds of the weight sync after train node ``train`` under ``plan`` (0 without targets); the
        runtime's ``timing_s/<node>`` of a train node includes it (``simulator.node_spans``)."""
        targets = self.sync_targets(train, plan)
        if not targets:
            return 0.0
        src = plan[train]
        key = (train, ((src, False), *targets))
        if key in self._sync_cache:
            return self._sync_cache[key]
        spec = self.problem.node(train)
        shape = self.problem.models[spec.model]
        c, lay = self.cluster, src.layout
        tensors = trained_tensors(shape, shape.num_hidden_layers)
        model_bytes = self.sync_bytes(spec.model)  # a LoRA model's adapters only
        seconds = 0.0
        gathers = [fsdp for _dst, fsdp in targets]
        if self._sharded(train, lay) and not all(gathers):
            # the plan path from an FSDP2 source re-gathers each tensor over dp first, keeping its tp shard;
            # at ep > 1 the routed experts are ep shards outside FSDP2 (moved as they are)
            dp_group = src.devices[: lay.tp * lay.dp : lay.tp]
            experts = (
                routed_expert_params(shape) * shape.dtype_bytes if lay.ep > 1 and shape.lora is None else 0
            )
            fsdp_bytes = (model_bytes - experts) / lay.tp
            seconds += collectives_time(c, "all_gather", tensors, fsdp_bytes, dp_group)
        for (dst, _fsdp), gather in zip(targets, gathers, strict=True):
            union = tuple(sorted(set(src.devices) | set(dst.devices)))
            if gather:  # gather path: full tensors on the source mesh, one broadcast to the target mesh
                seconds += collectives_time(c, "all_gather", tensors, model_bytes, src.devices)
                group = (src.devices[0], *(x for x in dst.devices if x != src.devices[0]))
                seconds += collectives_time(c, "broadcast", 1, model_bytes, group)
            else:
                seconds += self.realloc_time(spec.model, src, dst)
            synced = shape.synced_params / shape.stored_params  # 1, or a LoRA model's adapter state
            shard = stage_params(shape, dst.layout) * synced * shape.dtype_bytes
            seconds += collectives_time(c, "all_gather", 2, 2 * 64 * len(union), union)  # verification
            seconds += c.mesh_slowdown(union) * 2 * shard / c.overheads.digest_bandwidth
        self._sync_cache[key] = seconds
        return seconds

    # ---- reallocation ------------------------------------------------------------------------------
    def realloc_time(self, model: str, src: NodePlacement, dst: NodePlacement) -> float:
        """Seconds to move ``model``'s weights from ``src`` to ``dst`` (0 for identical shards).

        Prices ``plan_reallocation`` per device: its transfers packed into broadcast messages as the runtime
        packs them (one collective per message in the group ``{src} ∪ dsts``), local copies at memory
        bandwidth; the busiest device sets the time; a LoRA model moves its adapters only (module docstring).
        Layers with the same (source stage, target stage, sparse or dense) move
        identically, so one representative layer per such class is planned and its bytes multiplied by the
        class size.
        """
        degrees = (src.layout.dp, src.layout.tp, src.layout.pp, src.layout.ep)
        if src.devices == dst.devices and degrees == (
            dst.layout.dp,
            dst.layout.tp,
            dst.layout.pp,
            dst.layout.ep,
        ):
            return 0.0
        # Shifting both meshes by whole hosts changes no link class: cache on host-normalised meshes.
        shift = min(min(src.devices), min(dst.devices)) // self.cluster.devices_per_host
        shift *= self.cluster.devices_per_host
        if shift:
            src = NodePlacement.on_mesh(tuple(d - shift for d in src.devices), src.layout)
            dst = NodePlacement.on_mesh(tuple(d - shift for d in dst.devices), dst.layout)
        key = (model, src, dst)
        if key in self._realloc_cache:
            return self._realloc_cache[key]
        shape = self.problem.models[model]
        c = self.cluster
        L = shape.num_hidden_layers
        src_stage = {layer: s for s, r in enumerate(stage_layers(L, src.layout.pp)) for layer in r}
        dst_stage = {layer: s for s, r in enumerate(stage_layers(L, dst.layout.pp)) for layer in r}
        sparse = set(shape.moe_layers)  # a sparse layer moves its experts too (cut by ep, realloc.shards)
        classes: dict[tuple[int, int, bool], list[int]] = defaultdict(list)
        for layer in range(L):
            classes[(src_stage[layer], dst_stage[layer], layer in sparse)].append(layer)
        weight_of = {cls[0]: len(cls) for cls in classes.values()}
        params = (model, src.layout.pp, dst.layout.pp)  # the classes follow from the two stage splits
        if params not in self._realloc_params:
            shapes: dict[str, tuple[int, ...]] = {}
            scale: dict[str, int] = {}
            moved = shape.param_shapes() if shape.lora is None else adapter_shapes(shape, shape.lora)
            for name, shp in moved.items():
                if ".layers." in name:
                    layer = int(name.split(".layers.")[1].split(".")[0])
                    if layer not in weight_of:
                        continue
                    scale[name] = weight_of[layer]
                else:
                    scale[name] = 1
                shapes[name] = shp
            self._realloc_params[params] = (shapes, scale)
        shapes, scale = self._realloc_params[params]
        moves = region_moves(
            shapes,
            ModelMeta(L, shape.tied),
            src.devices,
            src.layout,
            dst.devices,
            dst.layout,
            shape.dtype_bytes,
        )
        busy: dict[int, float] = defaultdict(float)
        # (src, dsts) -> [messages, bytes]: transfers >= DEFAULT_DIRECT_BYTES go alone, smaller ones are
        # packed into buckets of DEFAULT_BUCKET_BYTES (realloc.execute.schedule_messages); one broadcast each.
        direct: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
        packed: dict[tuple[int, ...], float] = defaultdict(float)
        # plan_reallocation's transfers region by region: a local copy per device in ``local``, one
        # broadcast from ``sender`` to ``remote``
        for param, _region, size, local, sender, remote in moves:
            nbytes = size * scale[param]
            copy = 2 * nbytes / (c.device.memory_bandwidth * c.efficiency.memory)
            for d in local:
                busy[d] += copy
            if not remote:
                continue
            if size >= DEFAULT_DIRECT_BYTES:
                direct[(sender, *remote)][0] += scale[param]
                direct[(sender, *remote)][1] += nbytes
            else:
                packed[(sender, *remote)] += nbytes
        for group in sorted(set(direct) | set(packed)):
            messages = direct[group][0] + math.ceil(packed[group] / DEFAULT_BUCKET_BYTES)
            seconds = collectives_time(c, "broadcast", messages, direct[group][1] + packed[group], group)
            for dev in group:
                busy[dev] += seconds
        result = max(busy.values(), default=0.0)
        self._realloc_cache[key] = result
        return result

    # ---- edges -------------------------------------------------------------------------------------
    def edge_time(self, nbytes: float, src: NodePlacement | None, dst: NodePlacement) -> float:
        """Seconds to move an edge's ``nbytes`` from the producer's mesh to the consumer's (0 if same mesh;
        the dataset (``src=None``) feeds every mesh for free). Rows are spread over the consumer's
        devices, so the slower of the two meshes' aggregate link bandwidth bounds the time."""
        if src is None or set(src.devices) == set(dst.devices) or nbytes <= 0:
            return 0.0
        link = self.cluster.link(tuple(src.devices) + tuple(dst.devices))
        lanes = min(len(src.devices), len(dst.devices))
        return nbytes / (lanes * link.bandwidth * self.cluster.efficiency.link) + link.latency
