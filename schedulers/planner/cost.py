"""The cost model: seconds and bytes of a node under a (mesh, layout), of a weight sync, and of an edge.

:class:`CostModel` is what the simulator, the search and the memory check ask; each price is formed in the
module whose job it is:

  * ``call_cost.py`` — the built-in engines: inference, FSDP2/DTensor train (pipeline stages: 1F1B) and the
    built-in generation loop; the terms every model call shares (FLOPs, real tokens, fixed costs,
    pipeline bubble, a decode step's roofline) and :class:`~rlflow.schedulers.planner.call_cost.NodeCost`;
  * ``vllm_cost.py`` — generation on vLLM engines: KV-cache budget, continuous batching, weight load, the
    engine's start in its memory share;
  * ``zero_cost.py`` — DeepSpeed ZeRO train nodes: memory per rank, collectives, CPU offload;
  * ``comm_cost.py`` — collectives (ring model, profiled links) and a forward's tensor-parallel ones;
  * ``memory_cost.py`` — memory per device (:class:`~rlflow.schedulers.planner.memory_cost.MemoryBreakdown`);
  * ``transfer_cost.py`` — weight syncs, reallocations and edges between meshes.

Units: time in seconds, memory and traffic in bytes, rates in FLOP/s and bytes/s — everywhere.

Notation: ``B`` rows (sequences) per iteration, ``P``/``G`` prompt/generated tokens, ``S = P + G`` (for an
inference or train micro-batch ``G = E[max]`` of its ``b`` rows' responses, ``call_cost.py``),
``L`` layers (``Lₛ`` on the largest pipeline stage), ``H`` hidden, ``V`` vocabulary, ``a`` attention
heads, ``Q = a · head_dim`` the attention width (``H`` unless the config's ``head_dim`` differs from
``H / a``), ``t/d/p`` tensor/data/pipeline degrees, ``m`` micro-batches, ``b`` rows per micro-batch per
data-parallel rank, ``k = epochs · mini_batches`` optimizer steps of a train node, ``w`` bytes per weight.

Rules every node's price follows:
  * CPU oversubscription (``cores_per_host``): a node whose mesh runs ``n`` busy workers on a host of
    ``c`` cores computes ``slowdown(n) = max(1, n/c)`` times slower (or the profile's measured slowdown of
    ``n`` busy processes, ``ClusterSpec.slowdown``), fixed costs included; a collective of a group of
    ``g`` ranks, profiled with ``g`` busy, by ``slowdown(n) / slowdown(g)`` (processor sharing; the
    simulator applies the same rule to nodes that overlap on one host).
  * Rank skew: a node's span runs from its first rank's start to its last rank's end, and the ranks of
    its mesh get their commands one after another: ``(ranks − 1) · rank_skew_s`` (measured by the
    profile's runtime probe).
  * Dispatch: per node ``dispatch_s + (t · input bytes + output bytes) / dispatch_bandwidth`` (the
    controller sends every mesh rank its dp share and reads the dp leaders' outputs; ``cluster.Overheads``),
    which is not part of the node's span on its workers (``NodeCost.time_s``) but occupies its devices in
    the simulator.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import fields, replace

from rlflow.dataflow import layout_rules as rules
from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.call_cost import NodeCost, generate_cost, inference_cost, train_cost
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.rounds import repeated
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.planner.transfer_cost import TransferCost
from rlflow.schedulers.planner.vllm_cost import engine_start_problem, vllm_generate_cost
from rlflow.schedulers.planner.zero_cost import zero_train_cost

__all__ = ["CostModel", "layout_problem"]


def layout_problem(
    shape: ModelShape, node: PlanNode, layout: Layout, engine: str | None = None
) -> str | None:
    """Why ``layout`` cannot run ``node`` on ``shape`` with the placement's ``engine`` (``None``: the node's
    own, ``PlanNode.engine_of``) (None when it can): the shared rule
    :func:`rlflow.dataflow.layout_rules.layout_problem` on the shape's config fields and the node's rows
    (``PlanNode.split_rows``); a LoRA model or a base view (``ModelShape.lora``, ``base_of``) runs
    ``tp = pp = 1`` (the runtime refuses other layouts); a node with a token budget
    (``PlanNode.max_tokens_per_micro_batch``) runs ``m = 1`` (the budget cuts its micro-batches) and
    ``pp = 1`` (the runtime packs on one stage)."""
    budget = node.max_tokens_per_micro_batch
    if budget is not None and (layout.micro_batches > 1 or layout.pp > 1):
        return (
            f"the token budget max_tokens_per_micro_batch={budget} cuts the node's micro-batches itself: "
            f"its layout has m=1 and pp=1, got {layout}"
        )
    if (shape.lora is not None or shape.base_of) and (layout.tp > 1 or layout.pp > 1):
        base = f"model '{node.model}' (the base of LoRA model '{shape.base_of}')"
        what = f"LoRA model '{node.model}'" if shape.lora is not None else base
        return (
            f"{what} runs at tp = pp = 1 only (peft's adapters are neither tensor- nor pipeline-parallel), "
            f"got {layout}"
        )
    if node.zero is not None and (layout.tp > 1 or layout.pp > 1):
        return (
            f"DeepSpeed ZeRO ({node.zero}) runs with tensor and pipeline degree 1, "
            f"got tp {layout.tp}, pp {layout.pp}"
        )
    config = {f.name: getattr(shape, f.name) for f in fields(shape)}
    why = rules.layout_problem(
        node.kind,
        node.split_rows,
        node.mini_batches,
        node.group_size,
        config,
        layout,
        node.model,
        node.engine_of(engine),
        node.function,
    )
    return None if why is None else str(why)


class CostModel:
    """Prices the nodes of one problem on one cluster (caches results); ``transfers`` prices its weight
    syncs, reallocations and edges (:class:`~rlflow.schedulers.planner.transfer_cost.TransferCost`)."""

    def __init__(self, problem: PlanProblem, cluster: ClusterSpec) -> None:
        self.problem = problem
        self.cluster = cluster
        self.transfers = TransferCost(problem, cluster)
        self._node_cache: dict[
            tuple[str, Layout, str, bool, bool, bool, tuple[int, ...], float | None], NodeCost
        ] = {}
        self._fits: dict[tuple[PlanNode, Layout, str | None, float | None], str | None] = {}
        self._io = self._io_bytes()

    def _io_bytes(self) -> dict[str, tuple[float, float]]:
        """Node -> (input bytes, output bytes) per iteration that pass through the controller.

        Batches move worker to worker (``schedulers/runtime/distributed/transfer.py``; priced by
        ``TransferCost.edge_time``) and outputs stay on the workers, so only the data set's rows go from the
        controller to a node's workers; the metadata of the replies is covered by ``dispatch_s``.
        """
        inputs: dict[str, float] = defaultdict(float)
        for src, dst, _key, size in self.problem.data_edges:
            if src == "data":
                inputs[dst] += size
        return {n.name: (inputs[n.name], 0.0) for n in self.problem.nodes}

    def dispatch_time(self, node: str | PlanNode, placement: NodePlacement) -> float:
        """Seconds of the controller's round trip for one node: ``dispatch_s + (t · in + out) / bw``."""
        spec = self.problem.node(node) if isinstance(node, str) else node
        ov = self.cluster.overheads
        in_bytes, out_bytes = self._io.get(spec.name, (0.0, 0.0))
        return ov.dispatch_s + (placement.layout.tp * in_bytes + out_bytes) / ov.dispatch_bandwidth

    def layout_problem(
        self, node: PlanNode, layout: Layout, engine: str | None = None, share: float | None = None
    ) -> str | None:
        """:func:`layout_problem` for ``node`` of this problem, and for a vLLM generate node whether its
        engines can start in the memory share ``share`` (the plan's; None: the node's pinned one, if any;
        ``vllm_cost.engine_start_problem``); memoised: the search asks it of every layout on every mesh
        size."""
        key = (node, layout, engine, share)
        if key not in self._fits:
            shape = self.problem.models[node.model]
            why = layout_problem(shape, node, layout, engine)
            if why is None and node.kind == "generate" and node.engine_of(engine) == "vllm":
                why = engine_start_problem(self.cluster, node, shape, layout.dp, layout.tp, share)
            self._fits[key] = why
        return self._fits[key]

    def node_cost(self, node: str | PlanNode, placement: NodePlacement) -> NodeCost:
        """Seconds and bytes of ``node`` under ``placement``: a vLLM generate node by ``vllm_cost``, a
        DeepSpeed train node by ``zero_cost``, any other by ``call_cost``; times ``PlanNode.rounds`` calls
        per iteration (``rounds.repeated``).

        Raises:
            PlanError: the layout does not fit the model or the rows (message names the node).
        """
        spec = self.problem.node(node) if isinstance(node, str) else node
        recompute = spec.recompute_of(placement.recompute)
        if spec.recompute is not recompute:  # ``auto``: priced as the placement chooses
            spec = replace(spec, recompute=recompute)
        reshard = spec.reshard_of(placement.reshard)
        if spec.reshard is not reshard:
            spec = replace(spec, reshard=reshard)
        busy = self.cluster.host_loads(placement.devices)
        engine = spec.engine_of(placement.engine)
        share = placement.gpu_memory_utilization if engine == "vllm" else None
        key = (spec.name, placement.layout, engine, recompute, reshard, len(busy) > 1, busy, share)
        cached = self._node_cache.get(key)
        if cached is None:
            shape = self.problem.models[spec.model]
            # a plan's share below what starts the engine is priced at that least (``vllm_cost.engine_kv``),
            # so a planned placement too small for one request shows as memory short, not as no layout;
            # a plan file's such share is refused before launch (``resources.check_plan_memory``)
            why = self.layout_problem(spec, placement.layout, placement.engine)
            if why is not None:
                raise PlanError(f"node {spec.name!r}: layout {placement.layout} does not fit: {why}")
            dispatch = self.dispatch_time(spec, placement)
            if spec.kind == "generate" and engine == "vllm":
                trainer = self.problem.train_node(spec.model)
                trained_by = self.problem.node(trainer) if trainer is not None else None
                cached = vllm_generate_cost(self.cluster, spec, shape, placement, trained_by, dispatch)
            elif spec.kind == "generate":
                cached = generate_cost(self.cluster, spec, shape, placement, dispatch)
            elif spec.kind == "train" and spec.zero is not None:
                cached = zero_train_cost(self.cluster, spec, shape, placement, dispatch)
            elif spec.kind == "train":
                cached = train_cost(self.cluster, spec, shape, placement, dispatch)
            else:
                cached = inference_cost(self.cluster, spec, shape, placement, dispatch)
            cached = repeated(cached, spec.rounds)  # a filter's round side: once per round of generation
            self._node_cache[key] = cached
        return cached
