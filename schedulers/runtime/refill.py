"""Iterations of a graph with a filter node: rounds of generation refill the batch (dynamic sampling).

The graph's filter splits it (:mod:`rlflow.dataflow.filtering`): the round side (the filter's ancestors)
runs once per round on the next ``P`` prompts of the data stream, the filter judges the round's groups, and
the rows of the groups that passed are kept, in data order, for the keys the nodes after the filter read.
Rounds go on until ``N`` groups passed (the filter's ``batch_size`` in groups) or ``max_rounds`` ran. Then
the first ``N`` groups go on (those that passed beyond them are dropped, not carried to the next
iteration: an iteration's rows depend only on the data position and random states at its start, which a
checkpoint holds, so a resumed run reproduces them exactly); with fewer, the rule's ``on_short`` says
``error`` (stop) or ``train`` (the groups that passed, rounded down to the :func:`whole_share` the nodes
after the filter can split over their mini-batches, ranks and micro-batches). The nodes after the filter
then run once.

Metrics: ``filter/pass_rate`` (groups passed / groups judged, over the iteration's rounds),
``filter/rounds`` and ``filter/groups`` (the groups the nodes after the filter received). A round-side
node's metrics are those of all its rounds: ``timing_s/<node>`` summed, ``*/max`` the largest, ``*/min`` the
smallest, the rest averaged; tokens and samples generated are summed.

With ``staleness`` the asynchronous loop runs the same rounds as its generation stage
(:mod:`rlflow.schedulers.runtime.async_rounds`), through :meth:`Rounds.judge`, :meth:`Rounds.groups_kept`,
:meth:`Rounds.after_store` and :meth:`Rounds.filter_metrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rlflow.dataflow.batch import Batch, RemoteRows
from rlflow.dataflow.dag import DATA
from rlflow.dataflow.data import PromptStream
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.filtering import FilterSplit
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.layout_rules import layout_problem
from rlflow.schedulers.runtime.walk import Tally, WalkHost, close_iteration, walk

__all__ = ["PassedGroups", "Rounds", "RoundsHost", "merge_rounds", "whole_share"]


class RoundsHost(WalkHost, Protocol):
    """What the rounds read of the run they serve (the controller)."""

    stream: PromptStream  # the training prompts, drawn per round
    prompts_per_iteration: int  # prompts per round: the round side's batch_size


def whole_share(graph: Graph, nodes: Sequence[str]) -> int:
    """The fewest groups whose rows every one of ``nodes`` can split as its layout and mini-batches need
    (:func:`~rlflow.dataflow.layout_rules.layout_problem` on ``q`` groups, and whole groups per mini-batch
    for a group-wise function): a short iteration under ``on_short: train`` keeps a multiple of it."""
    limit = max(graph.prompts(n) for n in nodes)
    for q in range(1, limit + 1):
        if all(_splits(graph, n, q) for n in nodes):
            return q
    return limit


def _splits(graph: Graph, name: str, groups: int) -> bool:
    node, g = graph.node(name), graph.group_size(name)
    rows = groups if node.kind == "generate" else groups * g
    mini = node.mini_batches if node.kind == "train" else 1
    if graph.function(name).group_wise is not None and (rows % mini or (rows // mini) % g):
        return False
    layout = graph.placement(name).layout
    return layout_problem(node.kind, rows, mini, g, None, layout, engine=graph.engine(name)) is None


def merge_rounds(tallies: Sequence[Tally]) -> Tally:
    """One tally of the rounds' (module docstring: sums, largest, smallest, means)."""
    out = Tally()
    seen: dict[str, list[float]] = {}
    for t in tallies:
        for key, value in t.metrics.items():
            seen.setdefault(key, []).append(value)
        out.trace.extend(t.trace)
        out.gen_tokens += t.gen_tokens
        out.train_tokens += t.train_tokens
        out.samples += t.samples
    for key, values in seen.items():
        if key.startswith(("timing_s/", "realloc/bytes", "realloc/seconds")):
            out.metrics[key] = sum(values)
        elif key.endswith("/max"):
            out.metrics[key] = max(values)
        elif key.endswith("/min"):
            out.metrics[key] = min(values)
        else:
            out.metrics[key] = sum(values) / len(values)
    return out


class Rounds:
    """Runs the iterations of ``host``'s graph, which has a filter node (module docstring)."""

    def __init__(self, host: RoundsHost) -> None:
        graph = host.graph
        assert graph.filter is not None, "a graph with a filter node"
        self.host = host
        self.split: FilterSplit = graph.filter
        order = graph.execution_order()
        name = self.split.node
        self.round_nodes = [n for n in order if n in self.split.rounds or n == name]
        self.after_nodes = [n for n in order if n in self.split.after]
        self.per_round = host.prompts_per_iteration
        self.target = graph.prompts(name)
        self.group = graph.group_size(name)
        producers = graph.keys()
        side = {DATA, *self.split.rounds}
        # the keys the nodes after the filter read from the round side: kept per round for the groups passed
        self.carried = sorted(
            {k for n in self.after_nodes for k in graph.node(n).input_keys if producers[k] in side}
        )
        self.round_pending = {
            key: sum(1 for n in graph.consumers(key) if n in self.round_nodes) + (key in self.carried)
            for key in producers
        }
        self.after_pending = {
            key: sum(1 for n in graph.consumers(key) if n in self.after_nodes) for key in producers
        }
        self.share = whole_share(graph, self.after_nodes) if self.after_nodes else 1

    def run(self, iteration: int) -> dict[str, float]:
        """Run iteration ``iteration``: rounds until the filter's batch is full (or the bound), then the
        nodes after the filter; the iteration's metrics.

        Raises:
            NodeError: a node failed, or ``on_short: error`` and the rounds passed too few groups (names the
                filter node, the groups passed and judged, and the arguments to change).
        """
        host, rule = self.host, self.split.rule
        rec = host.recorder
        t0 = rec.now()
        tallies: list[Tally] = []
        after = Tally()
        passed: list[PassedGroups] = []
        try:
            while len(tallies) < rule.max_rounds and not self.enough(passed):
                tally = Tally()
                tallies.append(tally)
                store = host.executor.source(host.stream.next_batch(self.per_round), iteration)
                drawn = host.stream.drawn
                results = walk(host, self.round_nodes, store, dict(self.round_pending), iteration, tally)
                passed.append(self.judge(store, results[self.split.node].outputs[rule.mask], drawn))
            kept = self.groups_kept(passed)
            store = self.after_store(passed, kept, iteration)
            walk(host, self.after_nodes, store, dict(self.after_pending), iteration, after, self.round_nodes)
            for epoch, ids in self.kept_ids(passed, kept):
                rec.log_prompts(iteration, epoch, ids)
        finally:
            rec.log_trace([row for t in [*tallies, after] for row in t.trace])
        total = merge_rounds(tallies)
        total.metrics.update(after.metrics)
        total.trace.extend(after.trace)
        total.train_tokens += after.train_tokens
        total.samples = max(total.samples, after.samples)
        total.metrics.update(self.filter_metrics(passed, kept))
        return close_iteration(host, iteration, t0, total)

    # -- rows ---------------------------------------------------------------------------------------
    def judge(
        self, store: dict[str, Any], keep: Sequence[bool], drawn: tuple[int, list[Any]]
    ) -> PassedGroups:
        """A round's verdict: ``keep``, the filter's per-row flags (``B`` bools, equal within each group),
        applied to the round's ``store``: the passed groups' rows of the carried keys (per prompt, per
        sample), how many groups were judged, and the passed prompts' (epoch, id) from ``drawn`` (the
        round's :attr:`~rlflow.dataflow.data.PromptStream.drawn`)."""
        graph = self.host.graph
        groups = [i for i in range(len(keep) // self.group) if keep[i * self.group]]
        rows = [i * self.group + j for i in groups for j in range(self.group)]
        prompt = {k: store[k] for k in self.carried if graph.is_per_prompt(k)}
        sample = {k: store[k] for k in self.carried if not graph.is_per_prompt(k)}
        held = [v for v in (*prompt.values(), *sample.values()) if isinstance(v, RemoteRows)]
        judged = len(keep) // self.group
        ids = [(drawn[0], drawn[1][g]) for g in groups]
        return PassedGroups(len(groups), _rows_of(prompt, groups), _rows_of(sample, rows), held, judged, ids)

    def kept_ids(self, passed: Sequence[PassedGroups], groups: int) -> list[tuple[int, list[Any]]]:
        """The prompt record of an iteration (:mod:`rlflow.schedulers.records.prompt_record`): the ids of
        the first ``groups`` passed groups (those :meth:`after_store` keeps, in its order), one
        ``(epoch, ids)`` per epoch the rounds drew from."""
        out: list[tuple[int, list[Any]]] = []
        for epoch, row in [i for p in passed for i in p.ids][:groups]:
            if not out or out[-1][0] != epoch:
                out.append((epoch, []))
            out[-1][1].append(row)
        return out

    def enough(self, passed: Sequence[PassedGroups]) -> bool:
        """Whether the rounds ``passed`` filled the filter's batch (``N`` groups passed)."""
        return sum(p.groups for p in passed) >= self.target

    def filter_metrics(self, passed: Sequence[PassedGroups], kept: int) -> dict[str, float]:
        """``filter/pass_rate`` (groups passed / judged), ``filter/rounds`` and ``filter/groups`` (``kept``:
        the groups the nodes after the filter receive) of an iteration's rounds ``passed``."""
        judged = sum(p.judged for p in passed)
        return {
            "filter/pass_rate": sum(p.groups for p in passed) / judged if judged else 0.0,
            "filter/rounds": float(len(passed)),
            "filter/groups": float(kept),
        }

    def groups_kept(self, rounds: Sequence[PassedGroups]) -> int:
        """How many of the groups that passed in ``rounds`` (one verdict per round) go on: the target, else
        as ``on_short`` says.

        Raises:
            NodeError: too few passed and ``on_short: error``, or fewer than the nodes after the filter can
                split."""
        passed, judged = sum(p.groups for p in rounds), sum(p.judged for p in rounds)
        if passed >= self.target:
            return self.target
        rule, name = self.split.rule, self.split.node
        n = len(rounds)
        why = (
            f"node '{name}': {passed} of {judged} groups passed in {n} round{'s' * (n > 1)} "
            f"(pass rate {passed / max(1, judged):.3f}), fewer than its batch of {self.target}"
        )
        if rule.on_short == "error":
            raise NodeError(
                f"{why}; args.on_short is 'error': raise nodes.{name}.args.max_rounds, lower "
                f"nodes.{name}.batch_size, or set nodes.{name}.args.on_short: train"
            )
        kept = passed // self.share * self.share
        if kept == 0:
            raise NodeError(
                f"{why}, and the nodes after it split {self.share} groups at least (their mini-batches, "
                f"layouts and micro-batches): nothing to train on; raise nodes.{name}.args.max_rounds"
            )
        return kept

    def after_store(self, passed: list[PassedGroups], groups: int, iteration: int) -> dict[str, Any]:
        """The store of the nodes after the filter: the first ``groups`` passed groups' rows, in round
        order. One round's references are used as they are; rows of several rounds are concatenated (rows
        the workers hold are copied back and put anew). Held rows no later node reads are freed."""
        executor = self.host.executor
        used = [p for p in passed if p.groups]
        while sum(p.groups for p in used[:-1]) >= groups:
            used.pop()
        unread = [v for p in passed if p not in used or len(used) > 1 for v in p.held]
        parts = [(p.prompt, p.sample) for p in used]
        prompts = _first(self._concat([b for b, _ in parts]), groups)
        samples = _first(self._concat([b for _, b in parts]), groups * self.group)
        remote = len(used) > 1 and any(p.held for p in used)  # rows copied back: put them anew
        out: dict[str, Any] = {}
        for batch in (prompts, samples):
            if remote and len(batch.keys()):
                out |= executor.source(batch, iteration, done=set(self.round_nodes))
            else:
                out |= dict(batch.items())
        if unread:
            executor.release(unread)
        return out

    def _concat(self, parts: list[Batch]) -> Batch:
        """``parts`` one after another; rows the workers hold are copied back first."""
        if len(parts) == 1 or not parts:
            return parts[0] if parts else Batch()
        if any(isinstance(v, RemoteRows) for p in parts for v in p.values()):
            parts = [self.host.executor.pull(dict(p.items())) for p in parts]
        return Batch.concat(parts) if len(parts[0].keys()) else Batch()


@dataclass(frozen=True, eq=False)
class PassedGroups:
    """One round's passed groups (:meth:`Rounds.judge`): how many, their rows of the carried per-prompt
    and per-sample keys, the round's held references of those keys, how many groups it judged, and the
    passed prompts' (epoch, id)."""

    groups: int
    prompt: Batch
    sample: Batch
    held: list[RemoteRows]
    judged: int
    ids: list[tuple[int, Any]]


def _rows_of(values: dict[str, Any], rows: list[int]) -> Batch:
    """Rows ``rows`` of ``values`` (an empty batch for no keys)."""
    return Batch(values).index(rows) if values else Batch()


def _first(batch: Batch, rows: int) -> Batch:
    """The first ``rows`` rows of ``batch`` (an empty batch stays empty)."""
    return batch.index(list(range(rows))) if len(batch.keys()) else batch
