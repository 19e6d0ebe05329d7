"""Why a node fits nowhere, in one paragraph for a user: the node, the placement that came closest (its
devices and layout), the biggest consumers of a device there, and the smallest changes that fit.

The candidate placements of a node (``candidates.SearchSpace``) are priced alone on their devices; when none
fits :func:`no_fit_message` explains the least short of them: its bytes per device against the cluster's
capacity, by consumer (``memory_cost.MemoryBreakdown``), and each change the cost model shows would fit it,
priced the same way: activation recomputation, DeepSpeed ZeRO-3 with CPU offload (train nodes), a memory
share that starts the vLLM engine, a shorter context (``data.max_prompt_tokens`` + ``args.max_new_tokens``:
vLLM needs one full-context request in its pool), for a train node more hosts (the node re-priced at the
least-memory layout of a mesh of 2, 4 or 8 times the hosts, :func:`_least_peak`), for a train or inference
node the largest ``max_new_tokens`` that fits its mesh beside the other models' weights and state (or, if
neither alone fits, the fewest more hosts with the largest that fits there; bisected: a row's activations
grow with its length, more devices do not shard them). A change is named only where its price fits; else
devices with more memory. Where the layout rule (``rlflow.dataflow.layout_rules``) caps the node's
data-parallel degree below what its devices allow (a GRPO train node keeps whole groups of samples per
prompt on each dp rank of each mini-batch; rows must divide), the paragraph says so with the rule's reason
for the next degree (:func:`dp_cap`): the state a dp rank holds, and a mixture of experts' expert degree
(carved out of dp), stop shrinking there, whatever the hosts.
"""

from __future__ import annotations

import math
from dataclasses import replace

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.plan_spec import Layout
from rlflow.nodes.engines.sizing import ENGINE_BLOCK_TOKENS
from rlflow.schedulers.planner.call_cost import NodeCost
from rlflow.schedulers.planner.cluster import MAX_PLAN_DEVICES, human_bytes
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.memory_cost import MemoryBreakdown
from rlflow.schedulers.planner.plans import NodePlacement, format_devices
from rlflow.schedulers.planner.problem import PlanNode
from rlflow.schedulers.planner.vllm_cost import engine_context_tokens, engine_kv_per_token, engine_shares
from rlflow.schedulers.planner.zero_cost import ZeroConfig

__all__ = ["consumers", "dp_cap", "dp_limit", "no_fit_message"]


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


def _least_peak(
    cost: CostModel, node: PlanNode, size: int, like: NodePlacement, state_only: bool = False
) -> float:
    """The fewest bytes per device of ``node`` over its layouts on ``size`` devices (``like``'s engine,
    recompute, on where searched, and reshard; each degree at its most micro-batches, the fewest
    activations);
    ``state_only``: its weights, gradients and optimizer state alone. ``math.inf`` when no layout is
    allowed. ``cost`` is fresh per ``node`` variant: its cache is keyed by the node's name."""
    layers = cost.problem.models[node.model].num_hidden_layers
    dph, mesh = cost.cluster.devices_per_host, tuple(range(size))
    least = math.inf
    for tp in (t for t in range(1, dph + 1) if dph % t == 0 and size % t == 0):
        for pp in (q for q in range(1, min(size // tp, layers) + 1) if (size // tp) % q == 0):
            dp = size // (tp * pp)
            for m in {1, max(1, node.split_rows // (dp * node.mini_batches))}:
                layout = Layout(dp, tp, pp, m)
                if cost.layout_problem(node, layout, like.engine) is not None:
                    continue
                # a searched recompute priced on: the least memory
                redo = (
                    (True if node.recompute == "auto" else like.recompute) if node.kind == "train" else None
                )
                p = NodePlacement.on_mesh(mesh, layout, like.engine, redo, like.reshard if dp > 1 else None)
                try:
                    mem = cost.node_cost(node, p).memory
                except PlanError:
                    continue
                least = min(least, mem.weights + mem.grads + mem.optimizer if state_only else mem.peak)
    return least


def dp_cap(cost: CostModel, node: PlanNode, size: int, engine: str | None = None) -> str:
    """Why ``node``'s data-parallel degree stops below what ``size`` devices allow (module docstring):
    ``"its data-parallel degree stops at D on N devices ...: <the layout rule's reason for the next>"``, or
    ``""`` when the largest degree a layout of ``size`` devices has (tp dividing the devices per host, pp
    at most the layers) is allowed, or no degree is (:func:`dp_limit`)."""
    limit = dp_limit(cost, node, size, engine)
    if limit is None:
        return ""
    top, above, why = limit
    moe = cost.problem.models[node.model].is_moe and node.kind != "generate"
    experts = " (and with it the expert degree ep, which divides dp)" if moe else ""
    return f"its data-parallel degree stops at {top} on {size} devices{experts}; the next, {above}: {why}"


def dp_limit(
    cost: CostModel, node: PlanNode, size: int, engine: str | None = None
) -> tuple[int, int, str | None] | None:
    """``(D, next, reason)``: the largest data-parallel degree the layout rule allows ``node`` on ``size``
    devices, the next degree a layout of them has, and the rule's reason against it; ``None`` when the
    largest degree is allowed, or none is (:func:`dp_cap` says it in words)."""
    layers = cost.problem.models[node.model].num_hidden_layers
    dph = cost.cluster.devices_per_host
    shapes: dict[int, list[tuple[int, int]]] = {}  # dp -> its (tp, pp) on ``size`` devices
    for tp in (t for t in range(1, dph + 1) if dph % t == 0 and size % t == 0):
        for pp in (q for q in range(1, min(size // tp, layers) + 1) if (size // tp) % q == 0):
            shapes.setdefault(size // (tp * pp), []).append((tp, pp))
    allowed = [
        dp for dp, tps in shapes.items()
        if any(cost.layout_problem(node, Layout(dp, tp, pp, 1), engine) is None for tp, pp in tps)
    ]  # fmt: skip
    if not allowed or max(allowed) == max(shapes):
        return None
    top = max(allowed)
    above = min(dp for dp in shapes if dp > top)
    tp, pp = shapes[above][0]
    return top, above, cost.layout_problem(node, Layout(above, tp, pp, 1), engine)


def _room(cost: CostModel, node: PlanNode, placement: NodePlacement, size: int) -> float:
    """Bytes per device ``node`` may take on ``size`` devices beside every other model's state there at its
    least (the instances a plan keeps on the same devices; a model's node with the most state prices it)."""
    state: dict[str, float] = {}
    for n in cost.problem.nodes:
        if n.model != node.model:
            least = _least_peak(cost, n, size, placement, state_only=True)
            state[n.model] = max(state.get(n.model, 0.0), least if math.isfinite(least) else 0.0)
    taken = sum(state.values())
    return cost.cluster.memory_capacity - taken


def _wider(cost: CostModel) -> list[tuple[int, CostModel]]:
    """(hosts, its cost model) at 2, 4 and 8 times the cluster's hosts, within ``MAX_PLAN_DEVICES``."""
    cluster = cost.cluster
    hosts = [
        cluster.hosts * t
        for t in (2, 4, 8)
        if cluster.hosts * t * cluster.devices_per_host <= MAX_PLAN_DEVICES
    ]
    return [(h, CostModel(cost.problem, cluster.with_hosts(h))) for h in hosts]


def _longest_response(cost: CostModel, node: PlanNode, placement: NodePlacement, size: int) -> int | None:
    """The largest response length (``PlanNode.gen_len``, below the node's) at which ``node`` fits on
    ``size`` devices of ``cost.cluster`` beside the other models' state (:func:`_least_peak`, :func:`_room`,
    bisected); None when not even one token fits."""

    def fits(tokens: int) -> bool:
        shorter = replace(node, gen_len=tokens, gen_mean=min(node.gen_mean, tokens))
        fresh = CostModel(cost.problem, cost.cluster)
        return _least_peak(fresh, shorter, size, placement) <= room

    room = _room(cost, node, placement, size)
    if not fits(1):
        return None
    lo, hi = 1, node.gen_len  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _length_changes(cost: CostModel, node: PlanNode, placement: NodePlacement, src: str) -> list[str]:
    """More hosts (train nodes), shorter responses, or both, where each fits ``node`` (a train or inference
    node) (module docstring)."""
    gens = [n.name for n in cost.problem.nodes if n.kind == "generate"]
    key = f"{src}nodes.{gens[-1]}.args.max_new_tokens" if gens else "max_new_tokens"
    dph = cost.cluster.devices_per_host
    wider = _wider(cost) if node.kind == "train" and node.zero is None else []
    out: list[str] = []
    hosts = next(
        (
            h
            for h, c in wider
            if _least_peak(c, node, h * dph, placement) <= _room(c, node, placement, h * dph)
        ),
        None,
    )
    if hosts is not None:
        out.append(f"{hosts} hosts (`rlflow plan --hosts {hosts}`)")
    tokens = _longest_response(cost, node, placement, len(placement.devices))
    if tokens is not None:
        out.append(f"responses of at most {tokens} tokens instead of {node.gen_len} ({key}: {tokens})")
    if out:
        return out
    for h, c in wider:  # neither alone: the fewest hosts where some response length fits
        tokens = _longest_response(c, node, placement, h * dph)
        if tokens is not None:
            return [
                f"{h} hosts with responses of at most {tokens} tokens instead of {node.gen_len} "
                f"(`rlflow plan --hosts {h}` and {key}: {tokens})"
            ]
    return []


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
    if node.kind in ("train", "inference"):
        out += _length_changes(cost, node, placement, src)
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
    fix = (
        f"Changes that fit: {'; or '.join(changes)}"
        if changes
        else "It needs devices with more memory, or a smaller model"
    )
    redo = ""
    if node.kind == "train":
        redo = " with" if node.recompute_of(placement.recompute) else " without"
        redo += " activation recomputation"
    cap = dp_cap(cost, node, len(placement.devices), placement.engine)
    cap = f" The layout rule caps it: {cap}." if cap else ""
    return (
        f"{head}: its least short placement, layout {placement.layout}{redo} on devices "
        f"[{format_devices(placement.devices)}], lacks {human_bytes(peak - capacity)} per device (needs "
        f"{human_bytes(peak)}); its biggest consumers there: {parts}.{cap} "
        f"{fix}{f'; {why}' if why else ''}"
    )
