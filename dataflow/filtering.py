"""Filter nodes and the rounds of generation that refill their batch (dynamic sampling).

A **filter** is a node whose function keeps whole prompt groups by a predicate on upstream outputs (its
trait :attr:`~rlflow.dataflow.registry.NodeFunction.filters` gives the node's :class:`FilterRule`): DAPO's
dynamic sampling drops the groups whose rewards all equal, which give GRPO no gradient, and samples more
prompts until the batch is full of groups with spread (Yu et al. 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv 2503.14476, §3.2).

A filter splits the graph in two (:class:`FilterSplit`):

- its **round** side: the nodes it reads from, directly or through others (with the data set). At least
  one is a generate node and none trains. They run once per **round**, each round on the next ``P``
  prompts of the data (their ``batch_size``), then the filter judges the round's groups;
- every other node runs once per iteration after the filter (an order edge from it), on the rows of the
  first ``N`` groups that passed, in data order (``N``: the filter's ``batch_size``, in groups).

Rounds go on until ``N`` groups passed or the rule's ``max_rounds`` ran; then the rule's ``on_short`` says
what a short iteration does (``error``: stop, as verl's DAPO recipe does past ``max_num_gen_batches``;
``train``: go on with the groups that passed). Groups that pass beyond the ``N``-th are dropped.

With ``staleness`` (asynchronous RL) the round side of an iteration is its generation stage: all its
rounds sample with the version the schedule gives the iteration and run ahead while earlier iterations
train (:mod:`rlflow.schedulers.runtime.async_rounds`).

Graph validation (:func:`split_at_filter`, :func:`check_filter`) refuses, naming the file, node and key:
two filters, a filter without a generate node upstream, a train node upstream of a filter, interruptible
generation (``interrupt_every``) on the round side, with ``staleness`` a round-side node reading the trained
weights its generation samples at another lag (the rounds of an iteration read one version), groups smaller
than the predicates need, and an ``N`` that ``max_rounds`` rounds of ``P`` prompts cannot reach.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import networkx as nx

from rlflow.dataflow.args import ArgError
from rlflow.dataflow.dag import DATA, flow
from rlflow.dataflow.errors import GraphError

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph
    from rlflow.dataflow.registry import NodeFunction
    from rlflow.dataflow.spec import GraphSpec

__all__ = ["ON_SHORT", "FilterRule", "FilterSplit", "check_filter", "split_at_filter", "through_filter"]

ON_SHORT: tuple[str, ...] = ("error", "train")
"""What an iteration does when ``max_rounds`` rounds passed fewer groups than the filter's batch."""


@dataclass(frozen=True)
class FilterRule:
    """How the runtime runs a filter node, from its bound arguments (the function's ``filters`` trait).

    Attributes:
        max_rounds: rounds of generation per iteration at most (>= 1; verl's ``max_num_gen_batches``).
        on_short: ``error`` or ``train`` (:data:`ON_SHORT`): after ``max_rounds`` rounds with fewer groups
            passed than the filter's ``batch_size``, stop the run with an error naming the pass rate, or
            go on with the groups that passed (rounded down to what the nodes after the filter can split).
        pass_rate: the expected share of groups that pass, in (0, 1]: what the planner prices the rounds
            with when no measured rate is given.
        min_group: the smallest group (samples per prompt) the predicates are defined on (2 for a spread).
        mask: the name under which the function's result holds the per-row keep flags (a list of ``B``
            bools, equal within each group); not a graph key.
    """

    max_rounds: int
    on_short: str
    pass_rate: float
    min_group: int = 1
    mask: str = "keep"

    def __post_init__(self) -> None:
        assert self.max_rounds >= 1 and self.on_short in ON_SHORT and 0 < self.pass_rate <= 1


@dataclass(frozen=True)
class FilterSplit:
    """A graph's filter node and the two sides it splits the graph into (module docstring).

    Attributes:
        node: the filter node's name.
        rule: its :class:`FilterRule`.
        rounds: the nodes that run once per round (the filter's ancestors), in execution order.
        after: the nodes that run once per iteration after the filter, in declaration order.
    """

    node: str
    rule: FilterRule
    rounds: tuple[str, ...]
    after: tuple[str, ...]


def split_at_filter(
    spec: GraphSpec,
    dag: nx.MultiDiGraph,
    functions: Mapping[str, NodeFunction],
    args: Mapping[str, Mapping[str, Any]],
) -> FilterSplit | None:
    """The graph's filter and its sides (``None`` without a filter); adds an order edge from the filter to
    every node after it that no edge orders yet.

    Raises:
        GraphError: two filter nodes; the rule's arguments refused (``nodes.<f>.args.<key>``); no generate
            node upstream of the filter; a train node upstream of it; ``interrupt_every`` on a generate node
            upstream of it; with staleness, a node upstream of it reading the trained weights its generation
            samples at another lag.
    """
    src = f"{spec.source}: " if spec.source else ""
    filters = [n for n in spec.nodes if functions[n].filters is not None]
    if not filters:
        return None
    if len(filters) > 1:
        raise GraphError(
            f"{src}nodes.{filters[1]}: a graph has one filter node, but '{filters[0]}' (function "
            f"'{spec.nodes[filters[0]].function}') and '{filters[1]}' (function "
            f"'{spec.nodes[filters[1]].function}') both filter; write the predicates of both in one"
        )
    name = filters[0]
    trait = functions[name].filters
    assert trait is not None
    try:
        rule = trait(dict(args[name]))
    except ArgError as e:
        raise GraphError(f"{src}nodes.{name}.args.{e.key}: {e}") from None
    within = flow(dag)
    ancestors = nx.ancestors(within, name) - {DATA}
    index = {n: i for i, n in enumerate(spec.nodes)}
    rounds = tuple(sorted(ancestors, key=index.__getitem__))
    gens = [n for n in rounds if spec.nodes[n].kind == "generate"]
    if not gens:
        reads = ", ".join(f"'{k}'" for k in spec.nodes[name].input_keys) or "nothing"
        raise GraphError(
            f"{src}nodes.{name}.inputs: filter '{name}' reads {reads}, which no generate node is upstream "
            "of; a filter keeps or drops the groups of a round of generation (bind an input to a key "
            "computed from a generate node's responses, e.g. a reward's scores)"
        )
    trains = [n for n in rounds if spec.nodes[n].kind == "train"]
    if trains:
        raise GraphError(
            f"{src}nodes.{trains[0]}: train node '{trains[0]}' is upstream of filter '{name}', so it would "
            "train once per round on unfiltered rows; read the filter's rows in a node after it"
        )
    parted = [n for n in gens if spec.nodes[n].interrupt_every]
    if parted:
        raise GraphError(
            f"{src}nodes.{parted[0]}.interrupt_every: {spec.nodes[parted[0]].interrupt_every}, but filter "
            f"'{name}' reads its rounds: every round of an iteration samples with the iteration's version, "
            "while interruptible generation moves a round's later segments to newer weights, which the "
            f"next round would have to go back from; drop nodes.{parted[0]}.interrupt_every (staleness "
            "alone composes with the filter) or the filter"
        )
    _check_one_version(spec, dag, name, rounds, src)
    after = tuple(n for n in spec.nodes if n != name and n not in ancestors)
    for n in after:
        if not nx.has_path(within, name, n):
            dag.add_edge(
                name, n, key="filter", kind="order", model=None, what="runs on the groups that passed"
            )
            within.add_edge(name, n)
    return FilterSplit(name, rule, rounds, after)


def _check_one_version(
    spec: GraphSpec, dag: nx.MultiDiGraph, name: str, rounds: tuple[str, ...], src: str
) -> None:
    """With ``staleness``, the rounds of an iteration read one version of a model its round side samples:
    another round-side node reading the weights of the same train node at another lag would hold the stage
    back for the training that waits for the stage (a deadlock).

    Raises:
        GraphError: such a node, naming it and the key to change."""

    def trainers(n: str) -> set[str]:
        return {u for u, _, d in dag.in_edges(n, data=True) if d["kind"] == "version"}

    def lag(n: str) -> int:
        return spec.nodes[n].staleness if spec.nodes[n].kind == "generate" else 0

    ahead = [
        g for g in rounds if spec.nodes[g].kind == "generate" and spec.nodes[g].staleness and trainers(g)
    ]
    for g in ahead:
        for n in rounds:
            shared = sorted(trainers(n) & trainers(g))
            if shared and lag(n) != lag(g):
                gen = spec.nodes[n].kind == "generate"
                fix = (
                    f"set it to {lag(g)}" if gen else f"run '{n}' after '{name}' (feed the filter none of it)"
                )
                raise GraphError(
                    f"{src}nodes.{n}{'.staleness' * gen}: '{n}' reads the weights train node '{shared[0]}' "
                    f"writes at staleness {lag(n)}, upstream of filter '{name}', whose generate node '{g}' "
                    f"samples them at staleness {lag(g)}: an iteration's rounds read one version, and they "
                    f"would wait for the training that waits for them; {fix}"
                )


def through_filter(split: FilterSplit | None, u: str, v: str) -> str | None:
    """For the batch-size check of data edge ``u -> v``: the node whose prompts per iteration ``v``'s must
    equal. ``u`` itself, the filter for rows that pass it (``u`` on the round side or the data set, ``v``
    after the filter), ``None`` for an edge into the filter (it reads rounds, checked by
    :func:`check_filter`)."""
    if split is None:
        return u
    if v == split.node:
        return None
    if v in split.after and (u == DATA or u in split.rounds):
        return split.node
    return u


def check_filter(graph: Graph) -> None:
    """A filter's group size and target against its rounds (after batch sizes are known).

    Raises:
        GraphError: groups smaller than the rule's ``min_group``; a target ``N`` (the filter's
            ``batch_size`` in groups) above ``max_rounds × P`` (``P``: prompts per round).
    """
    split = graph.filter
    if split is None:
        return
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    name, rule = split.node, split.rule
    g = graph.group_size(name)
    if g < rule.min_group:
        gens = [n for n in split.rounds if graph.node(n).kind == "generate"]
        raise GraphError(
            f"{src}nodes.{name}.args.predicates: {graph.args(name).get('predicates')} need groups of at "
            f"least {rule.min_group} samples per prompt, but generate node '{gens[0]}' samples "
            f"n={g} (nodes.{gens[0]}.args.n)"
        )
    first = next(n for n in graph.execution_order() if n in split.rounds)
    per_round, target = graph.prompts(first), graph.prompts(name)
    if target > rule.max_rounds * per_round:
        raise GraphError(
            f"{src}nodes.{name}.batch_size: {target} groups to pass, but args.max_rounds "
            f"{rule.max_rounds} rounds of {per_round} prompts (nodes.{first}.batch_size) examine "
            f"{rule.max_rounds * per_round} groups at most; raise max_rounds or the round's batch_size, or "
            "lower the filter's batch_size"
        )
