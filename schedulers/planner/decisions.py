"""Which decisions of each node a plan searched and which the graph pinned: the record ``rlflow plan`` writes
beside each placement (``searched:`` / ``pinned:``, ``plans.dump_plan``) and prints in its table.

A decision the graph leaves out is searched, as ``auto`` is (``rlflow.dataflow.node_spec.NodeSpec``); a
value the graph writes pins it. The decisions, where they apply (``rlflow.dataflow.plan_spec.DECISIONS``):

* ``micro_batches`` — every node's layout ``m``; pinned by a token budget
  (``max_tokens_per_micro_batch``); no decision for a node run by vLLM, which batches its own requests.
* ``engine`` — a generate node's (``builtin`` / ``vllm``).
* ``gpu_memory_utilization`` — a vLLM node's memory share: pinned by ``args.gpu_memory_utilization``, else
  the planner's for the placement.
* ``recompute`` — a train node's activation recomputation.
* ``reshard`` — an FSDP2 train node's resharding per micro-batch, where its layout has dp > 1.
* ``staleness`` — a generate node's η ≥ 1 is the graph's (the algorithm's off-policy bound: never raised by
  a plan), listed as pinned; the search places the node so that its stale generation overlaps training
  where that is faster (the simulator's asynchronous replay). η = 0 allows no overlap: not listed.

The mesh and the (dp, tp, pp, ep) degrees are searched for every node and not listed.
"""

from __future__ import annotations

from collections.abc import Mapping

from rlflow.dataflow.plan_spec import DECISIONS, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem

__all__ = ["PINNED", "SEARCHED", "decision_lists", "node_decision_lists", "node_decisions"]

SEARCHED, PINNED = "searched", "pinned"


def node_decisions(node: PlanNode, placement: NodePlacement) -> dict[str, str]:
    """Decision name -> ``searched`` or ``pinned`` for each decision that applies to ``node`` under
    ``placement`` (module docstring), in :data:`~rlflow.dataflow.plan_spec.DECISIONS` order."""
    out: dict[str, str] = {}
    vllm = node.kind == "generate" and node.engine_of(placement.engine) == "vllm"
    if not vllm:
        out["micro_batches"] = PINNED if node.max_tokens_per_micro_batch is not None else SEARCHED
    if node.kind == "generate":
        out["engine"] = SEARCHED if node.engine == "auto" else PINNED
        if vllm:
            out["gpu_memory_utilization"] = PINNED if node.gpu_memory_utilization is not None else SEARCHED
        if node.staleness:
            out["staleness"] = PINNED
    if node.kind == "train":
        out["recompute"] = SEARCHED if node.recompute == "auto" else PINNED
        if node.zero is None and placement.layout.dp > 1:
            out["reshard"] = SEARCHED if node.reshard == "auto" else PINNED
    return {k: out[k] for k in DECISIONS if k in out}


def node_decision_lists(node: PlanNode, placement: NodePlacement) -> dict[str, list[str]]:
    """``{"searched": [...], "pinned": [...]}`` of ``node`` under ``placement`` (:func:`node_decisions`), as
    ``plans.dump_plan`` writes them and ``rlflow plan``'s table shows them."""
    marks = node_decisions(node, placement)
    return {how: [k for k, v in marks.items() if v == how] for how in (SEARCHED, PINNED)}


def decision_lists(
    problem: PlanProblem, plan: Mapping[str, NodePlacement]
) -> dict[str, dict[str, list[str]]]:
    """Node -> ``{"searched": [...], "pinned": [...]}`` for every node of ``problem`` that ``plan`` places
    (:func:`node_decisions`), as ``plans.dump_plan`` writes them."""
    return {n.name: node_decision_lists(n, plan[n.name]) for n in problem.nodes if n.name in plan}
