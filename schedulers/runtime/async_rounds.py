"""A filter's rounds as the asynchronous loop's generation stage (dynamic sampling with ``staleness``).

In a graph with a filter node (:mod:`rlflow.dataflow.filtering`) run by the asynchronous loop
(:mod:`rlflow.schedulers.runtime.asynchronous`), the filter's whole round side is one item of an iteration
in the version schedule, its **stage** ``<filter>/rounds``
(:mod:`rlflow.schedulers.runtime.version_schedule`): iteration ``k``'s rounds, each on the next ``P``
prompts of the data stream, all sample with the version the schedule gives iteration ``k``, so the stages of
iterations ``k + 1 .. k + η`` run while iteration ``k`` trains (as AReaL's and slime's rollout side filters
groups ahead of their trainers). The stages run one after the other, in iteration order: each draws its
prompts once the previous one's last round was judged.

:class:`RoundStages` runs each stage's rounds as :class:`~rlflow.schedulers.runtime.refill.Rounds` does in
the synchronous loop (the same verdicts, the same rows kept, the same ``filter/pass_rate``,
``filter/rounds`` and ``filter/groups``; a round-side node's metrics merged over the rounds by
:func:`~rlflow.schedulers.runtime.refill.merge_rounds`), one node call at a time through the loop's
tickets: :meth:`RoundStages.start` and :meth:`RoundStages.finished` hand back the calls to submit, and the
stage's end gives the iteration's store for the nodes after the filter. The loop's drain waits for a stage
in progress to end (its rounds read weights that exist), so a checkpoint holds whole stages and the data
position after them: a resumed run draws exactly what the uninterrupted one did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlflow.dataflow.batch import Batch
from rlflow.nodes.context import NodeResult
from rlflow.schedulers.runtime.iteration import binding, node_inputs
from rlflow.schedulers.runtime.refill import PassedGroups, Rounds, merge_rounds
from rlflow.schedulers.runtime.walk import Tally

__all__ = ["RoundStages", "StageEnd"]


@dataclass(frozen=True)
class StageEnd:
    """What an ended stage gives its iteration: the store of the nodes after the filter (key -> rows or
    references), the stage's metrics (its nodes' merged over the rounds, and ``filter/*``) and the ids of
    the prompts kept (:meth:`~rlflow.schedulers.runtime.refill.Rounds.kept_ids`)."""

    store: dict[str, Any]
    metrics: dict[str, float]
    drawn: list[tuple[int, list[Any]]]  # the prompt record: (epoch, ids) of the groups kept


@dataclass
class _Stage:
    """One iteration's stage in progress: per round its metrics and verdict; the current round's store,
    reads still to come, nodes not yet submitted and nodes finished."""

    tallies: list[Tally] = field(default_factory=list)
    passed: list[PassedGroups] = field(default_factory=list)
    store: dict[str, Any] = field(default_factory=dict)
    drawn: tuple[int, list[Any]] = (0, [])  # the current round's prompts (PromptStream.drawn)
    pending: dict[str, int] = field(default_factory=dict)
    waiting: list[str] = field(default_factory=list)
    done: set[str] = field(default_factory=set)


class RoundStages:
    """The stages in progress of a graph with a filter node (module docstring).

    Args:
        rounds: the graph's :class:`~rlflow.schedulers.runtime.refill.Rounds` (its host: the controller,
            whose data stream the rounds draw from).
    """

    def __init__(self, rounds: Rounds) -> None:
        self.rounds = rounds
        self.host = rounds.host
        self.members = frozenset(rounds.round_nodes)  # the round side and the filter
        self.open: dict[int, _Stage] = {}

    def start(self, k: int) -> list[tuple[str, Batch]]:
        """Begin iteration ``k``'s stage with its first round; the calls to submit ``(node, inputs)``."""
        assert k not in self.open, f"iteration {k}: its rounds began already"
        self.open[k] = _Stage()
        return self._next_round(k)

    def metrics(self, k: int) -> dict[str, float]:
        """Where a round-side node's metrics of iteration ``k``'s current round go."""
        return self.open[k].tallies[-1].metrics

    def finished(
        self, k: int, name: str, result: NodeResult
    ) -> tuple[list[tuple[str, Batch]], StageEnd | None]:
        """Round-side node ``name`` of iteration ``k`` finished with ``result``: the calls to submit now
        (the round's next nodes, or the next round's first), and, when the filter judged the last round,
        the stage's end.

        Raises:
            NodeError: ``on_short: error`` and the rounds passed too few groups (as the synchronous rounds).
        """
        graph, stage, rounds = self.host.graph, self.open[k], self.rounds
        stage.done.add(name)
        for param, key in binding(graph.node(name).outputs).items():
            if key is not None:
                stage.store[key] = result.outputs[param]
        if name != rounds.split.node:
            return self._ready(k), None
        stage.passed.append(rounds.judge(stage.store, result.outputs[rounds.split.rule.mask], stage.drawn))
        if len(stage.passed) < rounds.split.rule.max_rounds and not rounds.enough(stage.passed):
            return self._next_round(k), None
        del self.open[k]
        kept = rounds.groups_kept(stage.passed)
        store = rounds.after_store(stage.passed, kept, k)
        metrics = merge_rounds(stage.tallies).metrics | rounds.filter_metrics(stage.passed, kept)
        return [], StageEnd(store, metrics, rounds.kept_ids(stage.passed, kept))

    def _next_round(self, k: int) -> list[tuple[str, Batch]]:
        """Draw the next ``P`` prompts for a new round of iteration ``k``; its first calls."""
        host, stage = self.host, self.open[k]
        stage.tallies.append(Tally())
        stage.store = host.executor.source(host.stream.next_batch(self.rounds.per_round), k)
        stage.drawn = host.stream.drawn
        stage.pending = dict(self.rounds.round_pending)
        stage.waiting = list(self.rounds.round_nodes)
        stage.done = set()
        return self._ready(k)

    def _ready(self, k: int) -> list[tuple[str, Batch]]:
        """The current round's nodes whose dependencies finished, with their inputs (a key whose last
        reader this is leaves the round's store), in execution order."""
        graph, stage = self.host.graph, self.open[k]
        calls: list[tuple[str, Batch]] = []
        for name in [n for n in stage.waiting if stage.done.issuperset(self.host.dependencies[n])]:
            calls.append((name, node_inputs(graph, name, stage.store)))
            for key in binding(graph.node(name).inputs).values():
                stage.pending[key] -= 1
                if stage.pending[key] == 0:
                    stage.store.pop(key, None)
            stage.waiting.remove(name)
        return calls
