"""The planner's price of a filter's rounds (dynamic sampling): how many times per iteration the round
side of a graph with a filter node runs (:mod:`rlflow.dataflow.filtering`).

Each round judges ``P`` new prompt groups, each passing with probability ``p`` independently of the others;
rounds stop once ``N`` groups passed or ``R`` rounds ran. After ``r`` rounds ``r·P`` groups were judged, so
the rounds go past ``r`` exactly when fewer than ``N`` of them passed, and (the tail-sum formula of an
integer count)

    E[rounds] = Σ_{r=0}^{R−1} P(rounds > r) = Σ_{r=0}^{R−1} P(Binomial(r·P, p) < N),

whose first term is 1 (the first round always runs). ``p`` is the filter's stated ``pass_rate`` (its
argument), or the rate a run of the graph measured (the mean ``filter/pass_rate`` its run directory
recorded: :func:`measured_pass_rate`). The round side's nodes are priced ``E[rounds]`` times per iteration
(:func:`repeated`: compute, communication and fixed costs; their memory is one round's).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.schedulers.planner.call_cost import NodeCost

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "binomial_below",
    "expected_rounds",
    "measured_pass_rate",
    "pass_rate_of",
    "repeated",
    "round_calls",
    "rounds_line",
]


def binomial_below(n: int, p: float, k: int) -> float:
    """``P(Binomial(n, p) < k)``: the sum of the first ``k`` terms, in log space (no underflow for a large
    ``n``). Golden: ``n = 8, p = 0.5, k = 4``: ``(1 + 8 + 28 + 56) / 256 = 93/256``."""
    if k <= 0:
        return 0.0
    if k > n:
        return 1.0
    if p >= 1.0:
        return 0.0
    if p <= 0.0:
        return 1.0
    lp, lq = math.log(p), math.log1p(-p)
    total = 0.0
    for i in range(k):
        log_term = math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
        total += math.exp(log_term)
    return min(1.0, total)


def expected_rounds(pass_rate: float, per_round: int, target: int, max_rounds: int) -> float:
    """Expected rounds of one iteration (module docstring): ``pass_rate`` ``p`` in (0, 1], ``per_round``
    groups ``P`` judged per round, ``target`` groups ``N`` to pass, at most ``max_rounds`` ``R``.

    Golden: ``p = 0.5, P = 8, N = 4, R = 4``: ``1 + 93/256 + 697/65536 + 2325/16777216 ≈ 1.374``; with
    ``p = 1``: ``min(R, ⌈N / P⌉)``.

    Raises:
        ValueError: ``pass_rate`` outside (0, 1], or a count below 1.
    """
    if not 0 < pass_rate <= 1:
        raise ValueError(f"pass_rate must be in (0, 1], got {pass_rate}")
    if per_round < 1 or target < 1 or max_rounds < 1:
        raise ValueError(
            f"per_round, target and max_rounds must be >= 1, got {per_round}, {target}, {max_rounds}"
        )
    return sum(binomial_below(r * per_round, pass_rate, target) for r in range(max_rounds))


def repeated(cost: NodeCost, calls: float) -> NodeCost:
    """``cost`` of a node called ``calls`` times per iteration (a round-side node): every time component and
    the dispatch times ``calls``; memory and a vLLM engine's weight load (once per new version) as one
    call's."""
    if calls == 1.0:
        return cost
    scaled = ("compute_s", "tp_comm_s", "dp_comm_s", "pp_comm_s", "bubble_s", "optimizer_s", "decode_s",
              "overhead_s", "dispatch_s", "offload_s", "ep_comm_s")  # fmt: skip
    return replace(cost, **{name: getattr(cost, name) * calls for name in scaled})


def measured_pass_rate(run_dir: str | Path) -> float | None:
    """The mean ``filter/pass_rate`` a run recorded in ``run_dir`` (``None``: no such run or metric)."""
    from rlflow.schedulers.records.rundir import read_metrics

    path = Path(run_dir)
    if not (path / "metrics").is_dir():
        return None
    table = read_metrics(path)
    if "filter/pass_rate" not in table.column_names:
        return None
    values = [v for v in table.column("filter/pass_rate").to_pylist() if v is not None and v > 0]
    return sum(values) / len(values) if values else None


def pass_rate_of(graph: Graph, pass_rate: float | None = None) -> tuple[float, str]:
    """The pass rate the planner prices ``graph``'s filter with, and where it comes from: ``pass_rate``
    (given), else the rate a run in the graph's ``run.output_dir`` measured (:func:`measured_pass_rate`),
    else the filter's stated ``pass_rate`` argument. Needs a graph with a filter."""
    split = graph.filter
    assert split is not None, "a graph with a filter node"
    if pass_rate is not None:
        return pass_rate, "given"
    measured = measured_pass_rate(graph.spec.run.output_dir)
    if measured is not None:
        return measured, f"measured by the run in {graph.spec.run.output_dir}"
    return split.rule.pass_rate, f"stated: nodes.{split.node}.args.pass_rate"


def round_calls(graph: Graph, pass_rate: float | None = None) -> dict[str, float]:
    """Node -> expected calls per iteration of the round side of ``graph``'s filter (empty without a
    filter), at the rate :func:`pass_rate_of` gives."""
    split = graph.filter
    if split is None:
        return {}
    rate, _ = pass_rate_of(graph, pass_rate)
    first = next(n for n in graph.execution_order() if n in split.rounds)
    calls = expected_rounds(rate, graph.prompts(first), graph.prompts(split.node), split.rule.max_rounds)
    return {name: calls for name in split.rounds}


def rounds_line(graph: Graph, pass_rate: float | None = None) -> str | None:
    """What ``rlflow plan`` says of the rounds it priced (``None`` without a filter)."""
    split = graph.filter
    if split is None:
        return None
    calls = round_calls(graph, pass_rate)
    rate, source = pass_rate_of(graph, pass_rate)
    first = next(n for n in graph.execution_order() if n in split.rounds)
    return (
        f"rounds ({split.node}): {', '.join(split.rounds)} priced {next(iter(calls.values())):.3g} times per "
        f"iteration: {graph.prompts(split.node)} groups to pass of {graph.prompts(first)} per round, at most "
        f"{split.rule.max_rounds} rounds, pass rate {rate:.3g} ({source})"
    )
