"""The memory share (vLLM's ``gpu_memory_utilization``) the planner chooses for each vLLM engine whose graph
pins none, per placement: the largest that fits beside what else lives on its devices, computed, not
searched.

A share ``f`` of a device of ``M`` bytes is the engine's weights, activation workspace and KV pool
(``sizing.kv_pool_bytes``); the engine's bytes on a device grow as ``f · M`` once ``f`` is at least the
share that starts it, ``least`` (``vllm_cost.engine_shares``). Beyond ``needed`` (a pool for every row of a
call at the full context) a larger share buys no speed, so the chosen share is

    f = min(needed, least + room / M),   room = min over the engine's devices of (capacity − bytes there
                                               with the engine at ``needed``) + (needed − least) · M

— with every other unpinned engine of the plan at its ``least`` and the engines before it (graph order) at
their chosen shares; a device's bytes are ``resources.device_totals`` (the same model as the search's
memory and the pre-launch check, with its headroom: ``ClusterSpec.memory_capacity``). A sleeping engine's
bytes are working memory, counted in the device's largest transient: the same formula holds once the
engine is that largest (which it is wherever the share matters). A plan whose devices overflow even at
``least`` keeps ``least`` (the search prices the overflow). The share is floored to three significant
digits, never below ``least``. :func:`alone_share` is the same with the node alone on its mesh (the
search's candidate placements).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.plans import NodePlacement
from rlflow.schedulers.planner.problem import PlanNode
from rlflow.schedulers.planner.resources import device_totals
from rlflow.schedulers.planner.vllm_cost import engine_shares

__all__ = ["alone_share", "choose_shares", "unpinned_engine", "with_share"]


def with_share(placement: NodePlacement, share: float | None) -> NodePlacement:
    """``placement`` with the memory share ``share`` (``NodePlacement.on_mesh``: the mesh not parsed
    again)."""
    p = placement
    return NodePlacement.on_mesh(p.devices, p.layout, p.engine, p.recompute, p.reshard, share)


def unpinned_engine(node: PlanNode, placement: NodePlacement) -> bool:
    """Whether the planner chooses ``node``'s memory share under ``placement``: a generate node run by vLLM
    whose ``args.gpu_memory_utilization`` pins none."""
    return (
        node.kind == "generate"
        and node.engine_of(placement.engine) == "vllm"
        and node.gpu_memory_utilization is None
    )


def _floor3(share: float, least: float) -> float:
    """``share`` floored to three significant digits, at least ``least`` and at most 1."""
    if share <= least:
        return min(1.0, least)
    digits = 2 - math.floor(math.log10(share))
    floored = math.floor(share * 10**digits + 1e-9) / 10**digits
    return min(1.0, max(least, floored))


def _bounds(cost: CostModel, node: PlanNode, placement: NodePlacement) -> tuple[float, float]:
    lay = placement.layout
    return engine_shares(cost.cluster, node, cost.problem.models[node.model], lay.dp, lay.tp)


def alone_share(cost: CostModel, node: PlanNode, placement: NodePlacement) -> float:
    """The share of ``node``'s engine under ``placement`` with the node alone on its devices (module
    docstring): ``min(needed, needed − (the node's peak at needed − capacity) / M)``, at least ``least``."""
    least, needed = _bounds(cost, node, placement)
    memory = cost.cluster.device.memory_bytes
    top = _floor3(needed, least)
    peak = cost.node_cost(node, with_share(placement, top)).memory.peak
    over = max(0.0, peak - cost.cluster.memory_capacity)
    return _floor3(top - over / memory, least)


def choose_shares(cost: CostModel, plan: Mapping[str, NodePlacement]) -> dict[str, NodePlacement]:
    """``plan`` with every unpinned vLLM engine's share (:func:`unpinned_engine`) chosen as the module
    docstring says; other placements as they are.

    Raises:
        PlanError: a layout does not fit its node (``CostModel.node_cost``).
    """
    out = dict(plan)
    nodes = [n for n in cost.problem.nodes if n.name in out and unpinned_engine(n, out[n.name])]
    if not nodes:
        return out
    bounds = {n.name: _bounds(cost, n, out[n.name]) for n in nodes}
    for n in nodes:  # the others at their least until their turn
        out[n.name] = with_share(out[n.name], _floor3(bounds[n.name][0], bounds[n.name][0]))
    memory, capacity = cost.cluster.device.memory_bytes, cost.cluster.memory_capacity
    for n in nodes:
        least, needed = bounds[n.name]
        top = _floor3(needed, least)
        trial = {**out, n.name: with_share(out[n.name], top)}
        totals = device_totals(cost, trial)
        over = max(0.0, *(totals[d] - capacity for d in out[n.name].devices))
        out[n.name] = with_share(out[n.name], _floor3(top - over / memory, least))
    return out
