"""Why a node fits nowhere, in one paragraph for a user: the node, the placement that came closest (its
devices and layout), the biggest consumers of a device there, and the smallest changes that fit.

The candidate placements of a node (``candidates.SearchSpace``) are priced alone on their devices; when none
fits :func:`no_fit_message` explains the least short of them: its bytes per device against the cluster's
capacity, by consumer (``memory_cost.MemoryBreakdown``), and each change the cost model shows would fit it,
priced the same way: activation recomputation, DeepSpeed ZeRO-3 with CPU offload (train nodes), a memory
share that starts the vLLM engine, a shorter context (``data.max_prompt_tokens`` + ``args.max_new_tokens``:
vLLM needs one full-context request in its pool), else devices with more memory.
"""

from __future__ import annotations

from dataclasses import replace

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.plan_spec import Layout
from rlflow.nodes.engines.sizing import ENGINE_BLOCK_TOKENS
from rlflow.schedulers.planner.call_cost import NodeCost
from rlflow.schedulers.planner.cluster import human_bytes
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.memory_cost import MemoryBreakdown
from rlflow.schedulers.planner.plans import NodePlacement, format_devices
from rlflow.schedulers.planner.problem import PlanNode
from rlflow.schedulers.planner.vllm_cost import engine_context_tokens, engine_kv_per_token, engine_shares
from rlflow.schedulers.planner.zero_cost import ZeroConfig

__all__ = ["consumers", "no_fit_message"]


def consumers(memory: MemoryBreakdown) -> list[tuple[str, float]]:
    """``(what, bytes)`` of one device under a node's placement alone, largest first, zeros left out."""
    parts = [
        ("weights", memory.weights), ("gradients", memory.grads), ("optimizer state", memory.optimizer),
        ("activations", memory.activations), ("KV cache", memory.kv_cache),
        ("vLLM engine weights", memory.engine_weights),
        ("vLLM engine KV cache and workspace", memory.engine_kv_cache),
        ("weights until the engine loads them", memory.replica),
        ("gathered weights and gradients", memory.gathered),
    ]  # fmt: skip
    return sorted(((w, b) for w, b in parts if b > 0), key=lambda p: -p[1])


def _fits(cost: CostModel, node: PlanNode, placement: NodePlacement) -> bool:
    try:
        return cost.node_cost(node, placement).memory.peak <= cost.cluster.memory_capacity
    except PlanError:
        return False


def _changes(cost: CostModel, node: PlanNode, placement: NodePlacement, nc: NodeCost, src: str) -> list[str]:
    """The changes that fit ``node`` at ``placement``'s mesh, each priced (module docstring)."""
    out: list[str] = []
    key = f"{src}nodes.{node.name}"
    redo = node.kind == "train" and node.recompute != "auto" and not node.recompute_of(placement.recompute)
    if redo and _fits(cost, replace(node, recompute=True), placement):
        out.append(f"activation recomputation ({key}.recompute: auto)")
    if node.kind == "train" and node.zero is None:
        zero = replace(node, zero=ZeroConfig(3, True, False), reshard=True)
        flat = NodePlacement.on_mesh(placement.devices, Layout(len(placement.devices), 1, 1, 1))
        if _fits(cost, zero, flat):
            out.append(
                "DeepSpeed ZeRO-3 with the optimizer state offloaded to host memory "
                f"({key}.engine: deepspeed, deepspeed: {{zero_stage: 3, offload_optimizer: cpu}})"
            )
    if node.kind == "generate" and node.engine_of(placement.engine) == "vllm":
        shape = cost.problem.models[node.model]
        lay = placement.layout
        least, _needed = engine_shares(cost.cluster, node, shape, lay.dp, lay.tp)
        usable = cost.cluster.memory_capacity / cost.cluster.device.memory_bytes
        pinned = node.gpu_memory_utilization
        if pinned is not None and pinned < least <= usable:
            out.append(
                f"a memory share that starts the engine ({key}.args.gpu_memory_utilization: {least:.3g})"
            )
        # the room one full-context request has: the capacity less everything but the engine's pool
        per_token = engine_kv_per_token(shape, lay.tp)
        context = engine_context_tokens(node, shape)
        block = ENGINE_BLOCK_TOKENS[cost.cluster.device_type]
        one = per_token * (-(-context // block) + 1) * block
        room = cost.cluster.memory_capacity - (nc.memory.peak - one) if pinned is None else 0.0
        tokens = int(room // per_token) - 2 * block
        if pinned is None and 0 < tokens < context:
            out.append(
                f"a context of at most {tokens} tokens instead of {context} (vLLM needs one whole request in "
                f"its KV cache: {src}data.max_prompt_tokens plus {key}.args.max_new_tokens)"
            )
    return out


def no_fit_message(
    cost: CostModel, node: PlanNode, best: tuple[NodePlacement, NodeCost] | None, why: str, source: str = ""
) -> str:
    """One paragraph on why ``node`` fits nowhere on ``cost.cluster``: ``best`` (the least short candidate
    placement and its price; None when no layout exists, then ``why`` says why), its bytes per device by
    consumer, and the changes that fit (module docstring). ``source``: the graph file, named before keys."""
    cluster, capacity = cost.cluster, cost.cluster.memory_capacity
    head = (
        f"node {node.name!r} (model {node.model!r}) fits nowhere on cluster {cluster.name!r} "
        f"(capacity {human_bytes(capacity)} per device)"
    )
    if best is None:
        return f"{head}: {why or 'it has no layout'}"
    placement, nc = best
    peak = nc.memory.peak
    parts = ", ".join(f"{what} {human_bytes(b)}" for what, b in consumers(nc.memory)[:4])
    src = f"{source}: " if source else ""
    changes = _changes(cost, node, placement, nc, src)
    more = (
        "more devices (its weights, gradients and optimizer state shard over its data-parallel ranks: "
        "more hosts, `rlflow plan --hosts`) or devices with more memory"
        if node.kind == "train" and node.zero is None
        else "devices with more memory"
    )
    fix = f"changes that fit: {'; or '.join(changes)}" if changes else f"it needs {more}, or a smaller model"
    return (
        f"{head}: its least short placement, layout {placement.layout} on devices "
        f"[{format_devices(placement.devices)}], lacks {human_bytes(peak - capacity)} per device (needs "
        f"{human_bytes(peak)}); its biggest consumers there: {parts}. "
        f"{fix}{f'; {why}' if why else ''}"
    )
