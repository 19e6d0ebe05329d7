"""The filter node function: ``filter_groups`` keeps the prompt groups whose metric passes predicates
(:mod:`rlflow.nodes.group_filters`), and its rule (:class:`~rlflow.dataflow.filtering.FilterRule`) tells the
runtime to refill the batch with rounds of generation: DAPO's dynamic sampling (Yu et al. 2025, arXiv
2503.14476, §3.2; verl's ``algorithm.filter_groups``: ``metric``, ``max_num_gen_batches``).

The node reads one metric per row (``inputs: {metric: scores}``, or any per-row key upstream of it) and
returns the keep flag of each row (the group's) under ``keep``: the runtime reads it, no graph key holds it
(:mod:`rlflow.dataflow.filtering` says how the graph splits at a filter).
"""

from __future__ import annotations

from typing import Any

import torch

from rlflow.dataflow.args import Arg, ArgError
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError, did_you_mean
from rlflow.dataflow.filtering import ON_SHORT, FilterRule
from rlflow.dataflow.registry import node_function
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.group_filters import GROUP_PREDICATES, keep_groups

__all__ = ["FILTER_ARGS", "filter_groups_node", "filter_rule"]

DAPO = "Yu et al. 2025 (DAPO), §3.2 dynamic sampling"

FILTER_ARGS = (
    Arg(
        "predicates",
        list,
        ["reward_spread"],
        "the group predicates a group must all pass (registry rlflow.nodes.group_filters.GROUP_PREDICATES: "
        "reward_spread, mean_between)",
        DAPO,
    ),
    Arg(
        "min_mean",
        float,
        None,
        "mean_between: keep groups whose mean metric is above this (strict; null: no lower bound)",
        optional=True,
    ),
    Arg(
        "max_mean",
        float,
        None,
        "mean_between: keep groups whose mean metric is below this (strict; null: no upper bound)",
        optional=True,
    ),
    Arg(
        "max_rounds",
        int,
        4,
        "rounds of generation per iteration at most, each on the next batch of prompts of the data",
        "verl algorithm.filter_groups.max_num_gen_batches",
        low=1,
        what="rounds",
    ),
    Arg(
        "on_short",
        str,
        "error",
        "after max_rounds rounds with fewer groups passed than the node's batch_size: stop the run with an "
        "error (error, as verl's DAPO recipe), or train on the groups that passed (train)",
        "verl recipe/dapo",
        choices=ON_SHORT,
    ),
    Arg(
        "pass_rate",
        float,
        0.5,
        "the expected share of groups that pass: the planner prices the expected rounds with it (a rate "
        "measured by a run of the graph replaces it)",
        low=0,
        high=1,
        low_open=True,
    ),
)
"""The ``filter_groups`` node's arguments."""


def filter_rule(args: dict[str, Any]) -> FilterRule:
    """The ``filters`` trait of ``filter_groups``: the node's :class:`FilterRule` from its bound ``args``.

    Raises:
        ArgError: an empty or unknown predicate (with "did you mean"), ``min_mean``/``max_mean`` without
            ``mean_between`` (they would be ignored), ``mean_between`` with neither (everything passes), or
            ``min_mean >= max_mean`` (nothing passes).
    """
    names = args["predicates"]
    known = GROUP_PREDICATES.names()
    if not names:
        raise ArgError("predicates", f"lists no predicate; known: {', '.join(known)}")
    for name in names:
        if name not in GROUP_PREDICATES:
            raise ArgError(
                "predicates",
                f"unknown predicate {name!r}{did_you_mean(str(name), known)}; known: {', '.join(known)}",
            )
    read = {a for name in names for a in GROUP_PREDICATES.get(name).args}
    for key in ("min_mean", "max_mean"):
        if args[key] is not None and key not in read:
            raise ArgError(key, f"is read by mean_between only, which predicates {names} do not list")
    low, high = args["min_mean"], args["max_mean"]
    if "mean_between" in names and low is None and high is None:
        raise ArgError(
            "predicates", "lists mean_between without min_mean or max_mean: every group would pass (set one)"
        )
    if low is not None and high is not None and low >= high:
        raise ArgError("max_mean", f"{high} is not above min_mean {low}: no group's mean lies between them")
    return FilterRule(
        max_rounds=int(args["max_rounds"]),
        on_short=str(args["on_short"]),
        pass_rate=float(args["pass_rate"]),
        min_group=max(GROUP_PREDICATES.get(name).min_group for name in names),
    )


@node_function(
    "filter_groups",
    "inference",
    inputs=("metric",),
    needs_model=False,
    args=FILTER_ARGS,
    filters=filter_rule,
)
def filter_groups_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    predicates: list[str],
    min_mean: float | None,
    max_mean: float | None,
    max_rounds: int,
    on_short: str,
    pass_rate: float,
) -> NodeResult:
    """Keep the prompt groups whose ``metric`` ``[B]`` passes every predicate (DAPO's dynamic sampling)."""
    metric = batch["metric"]
    values_B = metric if isinstance(metric, torch.Tensor) else torch.tensor(metric, dtype=torch.float32)
    if values_B.dim() != 1:
        raise NodeError(
            f"node '{ctx.node.name}': input metric must hold one value per row [B], got shape "
            f"{tuple(values_B.shape)}"
        )
    bounds = {"min_mean": min_mean, "max_mean": max_mean}
    keep_P = keep_groups(values_B, ctx.group_size, predicates, bounds)
    keep = [bool(k) for k in keep_P.repeat_interleave(ctx.group_size).tolist()]
    return NodeResult({"keep": keep}, {}, 0)
