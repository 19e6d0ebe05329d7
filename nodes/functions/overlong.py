"""DAPO's handling of over-long responses: the ``overlong_penalty`` node (soft over-long punishment, a reward
shaping node between a reward node and the train node) and the pre-launch check of the train nodes'
``overlong_filter`` where ``truncated`` is an optional input (``ppo_actor``).

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv:2503.14476),
section 3.4 ("Overlong Reward Shaping": over-long filtering, soft over-long punishment, eq. 13).

Shapes (DESIGN.md): B rows, R response tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.registry import node_function
from rlflow.nodes import rl
from rlflow.nodes.context import NodeContext, NodeResult

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["overlong_filter_mistakes", "overlong_penalty_mistakes", "overlong_penalty_node"]

_DAPO = "Yu et al. 2025 (DAPO), eq. 13"


def _where(graph: Graph, node: str, key: str) -> str:
    return f"{graph.spec.source or '<graph>'}: nodes.{node}.{key}"


def overlong_penalty_mistakes(graph: Graph, node: str) -> list[str]:
    """The ``overlong_penalty`` node's pre-launch check, one message per mistake naming file, node and key:
    a window (``buffer``) longer than ``max_length``, and a ``max_length`` beyond the ``max_new_tokens`` of
    the node producing its ``response_mask`` (no response gets that long: part of the window, or all of it,
    could never be reached, and the penalty would silently do less than the graph says)."""
    args = graph.args(node)
    out = []
    if args["buffer"] > args["max_length"]:
        out.append(
            f"{_where(graph, node, 'args.buffer')}: the penalty window L_cache ({args['buffer']} tokens) is "
            f"longer than max_length L_max ({args['max_length']}); it must lie in [1, max_length]"
        )
    bound = graph.node(node).inputs
    key = bound.get("response_mask") if isinstance(bound, Mapping) else None
    producer = graph.keys().get(key) if key is not None else None
    budget = graph.args(producer).get("max_new_tokens") if producer in graph.nodes else None
    if isinstance(budget, int) and args["max_length"] > budget:
        out.append(
            f"{_where(graph, node, 'args.max_length')}: {args['max_length']} exceeds the max_new_tokens "
            f"({budget}) of node '{producer}', so no response reaches it and the penalty never reaches "
            f"-penalty_factor; DAPO's L_max is the generation limit: set max_length to {budget}"
        )
    return out


@node_function(
    "overlong_penalty",
    "inference",
    inputs=("response_mask", "task_scores"),
    outputs=("scores",),
    needs_model=False,
    args=(
        Arg(
            "max_length",
            int,
            20480,
            "L_max: responses this long get -penalty_factor, longer ones too (the generate node's "
            "max_new_tokens, which validate requires it not to exceed; 20480: the paper's 16384 + 4096)",
            _DAPO,
            low=1,
        ),
        Arg(
            "buffer",
            int,
            4096,
            "L_cache: the window before max_length over which the penalty falls linearly from 0 to "
            "-penalty_factor (tokens; in [1, max_length])",
            _DAPO,
            low=1,
        ),
        Arg(
            "penalty_factor",
            float,
            1.0,
            "the penalty at and beyond max_length, negated (0: off)",
            "DAPO's released recipe (overlong_penalty_factor); verl overlong_buffer.penalty_factor",
            low=0,
        ),
    ),
    check=overlong_penalty_mistakes,
)
def overlong_penalty_node(
    ctx: NodeContext, batch: Batch, *, max_length: int, buffer: int, penalty_factor: float
) -> NodeResult:
    """DAPO's soft over-long punishment: ``scores = task_scores + R_length(|y|)`` ``[B]``
    (:func:`rlflow.nodes.rl.overlong_penalty`; ``|y|`` from :func:`rlflow.nodes.rl.response_lengths`).

    Metrics: ``overlong/penalty_mean`` (the mean penalty, <= 0) and ``overlong/penalised_frac`` (the share
    of responses with a penalty).
    """
    mask = batch.tensor("response_mask")
    penalty = rl.overlong_penalty(rl.response_lengths(mask), max_length, buffer, penalty_factor)
    scores = batch.tensor("task_scores").float() + penalty.to(batch.tensor("task_scores").device)
    metrics = {
        "overlong/penalty_mean": float(penalty.mean()) if len(penalty) else 0.0,
        "overlong/penalised_frac": float((penalty < 0).float().mean()) if len(penalty) else 0.0,
    }
    return NodeResult({"scores": scores}, metrics, int(mask.sum()))


def overlong_filter_mistakes(graph: Graph, node: str) -> list[str]:
    """The check of a train node whose ``overlong_filter`` reads ``truncated`` from its optional inputs
    (``ppo_actor``, which reads it for bootstrapping too): with the filter on, the node must bind it; one
    message naming file, node and key."""
    bound = graph.node(node).inputs
    if not graph.args(node)["overlong_filter"] or (isinstance(bound, Mapping) and "truncated" in bound):
        return []
    return [
        f"{_where(graph, node, 'inputs.truncated')}: args.overlong_filter is True, which reads input "
        "'truncated' (the generate node's), but the node does not bind it; add it to the node's inputs "
        "(with the optional inputs bound together with it)"
    ]
