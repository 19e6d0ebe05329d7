"""Asynchronous RL's version schedule: when an (iteration, node) may be submitted, and which weights it reads.

When a generate node has ``staleness`` η >= 1 the DAG stays the loop; asynchrony is a schedule over
(iteration, node) pairs, which the asynchronous loop (:mod:`rlflow.schedulers.runtime.asynchronous`) follows.
This module holds the schedule as pure values and functions of what was submitted and finished.

**The version schedule** (deterministic, so a seeded run is exactly reproducible whatever the timing):
weights have *policy version* ``v`` after ``v`` iterations of training (version 0: the initial weights).
A generate node ``g`` with staleness η samples iteration ``k`` with version ``max(s, k - 1 - η)``, ``s``
being the schedule's **origin** for iteration ``k``: the iteration the run started from, kept across
resumes for the iterations in flight at the checkpoint (their earlier segments read versions before it),
and for the later ones the iteration a resume started from (only a synchronous checkpoint, or a run whose
last iteration was reached, leaves one there: no weights older than the checkpoint exist); every other call
of a model reads version ``k - 1``, as in the synchronous loop. So a sample trained at iteration ``k``
(version ``k - 1``) lags by at most η versions: AReaL's bound (Fu et al., 2025, "AReaL: A Large-Scale
Asynchronous Reinforcement Learning System for Language Reasoning", arXiv:2505.24298, section 5.1),
enforced by **admission control, not dropping**: a rollout starts only once the weights it must read
exist, and nothing generated is thrown away. When generation is faster than training the lag sits at η
(training paces the run: ``async/staleness_mean`` = η); when it is slower it stays below η (generation
paces the run).

**Submission rules.** ``(k, n)`` is submitted when

1. every node it depends on within iteration ``k`` (data and order edges) has finished;
2. ``(k-1, n)`` was submitted (each node's calls, and its random generator, stay in iteration order);
3. the train nodes it reads from (version edges) have finished iteration ``k - 1`` — for a generate node
   with η, iteration ``k - 1 - η`` — weight sync included;
4. for a train node: iteration ``k - 1`` has finished, and every generate node ``g`` reading its model was
   submitted for iteration ``k + η_g`` (which must read the weights this call overwrites).

The distributed executor sends a train node's weight sync on its own (``<train node>/sync`` items): after
the train step has finished, and, for the generate nodes on the instances it writes, rule 4 applies to the
sync instead of the train step. So the train step of iteration ``k`` runs while generation of iterations
``k + 1 .. k + η`` does, and the generation worker finishes what it was sent (e.g. the reference log-probs
of the next batch) before it joins the sync. Rule 3 then also waits for the sync of the weights read.

Executors run the nodes that share a device in submission order (the distributed workers execute their
commands in the controller's send order), so rules 3 and 4 pin the version every call reads on any
placement: a generate node and a train node on the same weights (one device, or a shared model instance)
still follow the schedule, one after the other; on disjoint meshes generation of iteration ``k + 1 .. k +
η`` runs while iteration ``k`` trains. The single-process runtime therefore computes exactly what the
distributed one does (the parity test), only without the overlap; validation warns about that. In
asynchronous runs ``timing_s/<train node>`` is the train step alone; its sync is ``realloc/seconds``.

**Interruptible generation** (``interrupt_every`` on a generate node with η >= 1; partial rollouts): one
iteration of the node is ``segments = ceil(max_new_tokens / interrupt_every)`` calls, items
``<node>/segment0 ..`` and the node itself (the last, which outputs the batch). Segment ``j`` of iteration
``k`` reads version ``min(k - 1, max(s, k - 1 - η) + j)``: between two segments the weight sync of the
next version is applied (the rules above, per item: rule 3 holds a segment back until its weights exist,
rule 4 holds a sync back until every segment reading the old weights was sent), and the unfinished
responses continue under it (:mod:`rlflow.nodes.partial`). The interruption points are fixed by the
schedule, not by when training finishes, so a seeded run stays exactly reproducible; each token's version
lag is still at most η, and the last segments of an iteration may be on-policy.

**Dynamic sampling** (a filter node, :mod:`rlflow.dataflow.filtering`): the filter's round side is one item
of an iteration, its **stage** ``<filter>/rounds`` (:mod:`rlflow.schedulers.runtime.async_rounds`): all its
rounds, each on the next prompts, and every round of iteration ``k`` reads the version the rules give its
nodes for ``k`` (a generate node's ``max(s, k - 1 - η)``), so the rounds of one iteration share its version.
Rule 1 holds for the stage as a whole; rule 2 becomes: the stage of ``k - 1`` has *ended* (the rounds draw
their prompts from the data stream in iteration order, and how many each stage draws depends on the
rewards); rule 3 holds for every node of the stage; in rule 4 a round-side node counts as sent once its
stage has ended (until the filter judged its last round another round may read the same weights). So the
stages of ``k + 1 .. k + η`` run while iteration ``k`` trains, and the weight sync of ``k`` waits for the
stage of ``k + η`` to end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlflow.dataflow.graph import Graph

__all__ = [
    "ROUNDS",
    "SEGMENT",
    "SYNC",
    "ScheduleState",
    "VersionSchedule",
    "segment_items",
    "split_item",
    "staleness_of",
]


def staleness_of(graph: Graph) -> dict[str, int]:
    """Generate node -> its staleness η, for the nodes with η >= 1 (empty: a synchronous graph)."""
    return {name: node.staleness for name, node in graph.nodes.items() if node.staleness > 0}


SYNC = "/sync"  # suffix of a weight-sync item: ``actor_train/sync`` (node names cannot hold "/")
SEGMENT = "/segment"  # ``actor_gen/segment0``: an interruptible generate node's earlier segments
ROUNDS = "/rounds"  # ``dynamic_sampling/rounds``: a filter's round side, one item (its stage)


def segment_items(node: str, segments: int) -> list[str]:
    """The schedule items of one iteration of ``node``: its earlier segments ``<node>/segment<j>`` (j <
    ``segments - 1``), then ``node`` itself, the last segment (the call that outputs the batch)."""
    return [f"{node}{SEGMENT}{j}" for j in range(segments - 1)] + [node]


def split_item(item: str) -> tuple[str, int | None]:
    """``(node, j)`` of an earlier-segment item; ``(node, None)`` of a node (last segment, or whole call)."""
    node, sep, j = item.partition(SEGMENT)
    return (node, int(j)) if sep else (item, None)


class VersionSchedule:
    """The submission rules of the module docstring as a pure function of what was submitted/finished.

    Items are the graph's nodes (a filter's round side as one item, its stage :attr:`stage`) and, where
    the executor sends weight syncs on their own, one sync item per train node (``<train node>/sync``). A
    sync overwrites the weights of the nodes on the model's other instances (``sync_readers``), so rule 4
    then holds the sync back, not the train step: the train step of iteration k overlaps generation of
    k + 1 .. k + η on any instance, and the generation worker runs the rest of its queue (reference,
    reward) before it joins the sync.

    Args:
        graph: the validated graph.
        start: the iteration the run starts after (0, or the resumed checkpoint's).
        sync_readers: train node -> the nodes its separate weight sync writes (on other instances);
            ``None``: syncs go with their train nodes (or there are none: one process).
        origins: iteration -> its origin, for the iterations in flight at the resumed checkpoint (saved
            with them); every other iteration's origin is ``start``.
    """

    def __init__(
        self,
        graph: Graph,
        start: int,
        sync_readers: Mapping[str, set[str]] | None = None,
        origins: Mapping[int, int] | None = None,
    ) -> None:
        self.graph = graph
        self.start = start
        self.origins = dict(origins or {})
        self.order = graph.execution_order()
        split = graph.filter
        # a filter's round side runs as one item (module docstring): stage item, its nodes, node -> item
        self.stage = split.node + ROUNDS if split is not None else None
        self.members: tuple[str, ...] = (*split.rounds, split.node) if split is not None else ()
        self.owner = dict.fromkeys(self.members, self.stage or "")
        self.deps = {n: self._items_of(graph.dependencies(n)) for n in self.order}
        self.eta = {n: graph.node(n).staleness for n in self.order}
        self.trainers = {n: graph.trainers(n) for n in self.order}
        self.sync_readers = {t: set(r) for t, r in (sync_readers or {}).items() if r}
        self.segments = {n: graph.segments(n) for n in self.order}
        self.node_items = {n: segment_items(n, self.segments[n]) for n in self.order}
        items = (self.owner.get(n, n) for n in self.order)
        self.items = [
            *(i for n in dict.fromkeys(items) for i in self.node_items.get(n, [n])),
            *(t + SYNC for t in self.order if t in self.sync_readers),
        ]
        if self.stage is not None:
            self.deps[self.stage] = [
                d for d in self._items_of([d for m in self.members for d in self.deps[m]]) if d != self.stage
            ]
        # train node (or sync item) -> (generate node, η) of the calls that must be submitted before it
        # overwrites the weights they read
        self.stale_readers: dict[str, list[tuple[str, int]]] = {}
        for n in self.order:
            for t in self.trainers[n]:
                if self.eta[n]:
                    writer = t + SYNC if n in self.sync_readers.get(t, ()) else t
                    self.stale_readers.setdefault(writer, []).append((n, self.eta[n]))
        self.depth = max(self.eta.values(), default=0)

    def _items_of(self, nodes: list[str]) -> list[str]:
        """The items of ``nodes`` (a round-side node's is its stage), in order, once each."""
        return list(dict.fromkeys(self.owner.get(n, n) for n in nodes))

    def origin(self, k: int) -> int:
        """The origin ``s`` of iteration ``k``'s reads (module docstring): a checkpoint stores it with the
        iterations in flight, so that a resume reads the versions the uninterrupted run read."""
        return self.origins.get(k, self.start)

    def reads(self, item: str, k: int) -> int:
        """The iteration whose trained weights ``item`` (a node, or a segment of one) reads at iteration
        ``k`` (its policy version): ``max(s, k - 1 - η)`` (``s``: :meth:`origin`); segment ``j`` of an
        interruptible generate node one version newer per segment, up to the on-policy ``k - 1``."""
        node, j = split_item(item)
        first = max(self.origin(k), k - 1 - self.eta[node])
        if self.segments[node] == 1:
            return first
        j = self.segments[node] - 1 if j is None else j
        return min(k - 1, first + j)

    def segment(self, item: str) -> tuple[int, int] | None:
        """``(j, segments)`` of an interruptible generate node's item; ``None`` for a whole call."""
        node, j = split_item(item)
        segments = self.segments[node]
        if segments == 1:
            return None
        return (segments - 1 if j is None else j), segments

    def ready(self, k: int, item: str, state: ScheduleState, total: int) -> bool:
        """Whether ``(k, item)`` may be submitted now (rules 1-4); ``total``: the run's last iteration."""
        if item == self.stage:  # the rounds of k - 1 ended (they drew the prompts before these)
            return (
                all(state.finished(k, d) for d in self.deps[item])
                and state.finished(k - 1, item)
                and all(self._weights_ready(m, k, state) for m in self.members)
            )
        if item.endswith(SYNC):  # after its train step, once the rollouts reading the old weights went out
            return state.finished(k, item.removesuffix(SYNC)) and self._writes_ok(k, item, state, total)
        node, _ = split_item(item)
        seg = self.segment(item)
        if seg is None or seg[0] == 0:
            if not all(state.finished(k, d) for d in self.deps[node]):
                return False
        elif not state.submitted(k, self.node_items[node][seg[0] - 1]):  # segments go out in order
            return False
        if not state.submitted(k - 1, item) or not self._weights_ready(item, k, state):
            return False
        if self.graph.node(node).kind == "train":
            return state.complete(k - 1) and self._writes_ok(k, node, state, total)
        return True

    def _weights_ready(self, item: str, k: int, state: ScheduleState) -> bool:
        """Rule 3: the train steps (and weight syncs) whose weights ``(k, item)`` reads have finished."""
        node, _ = split_item(item)
        j = self.reads(item, k)
        for t in self.trainers[node]:
            if not state.finished(j, t):
                return False
            if node in self.sync_readers.get(t, ()) and not state.finished(j, t + SYNC):
                return False
        return True

    def _writes_ok(self, k: int, writer: str, state: ScheduleState, total: int) -> bool:
        """Rule 4: every generate call (or segment) that reads the weights ``writer`` overwrites (those
        after iteration ``k - 1``, read by iterations ``k .. k + η``) was submitted."""
        for g, eta in self.stale_readers.get(writer, ()):
            for later in range(k, min(k + eta, total) + 1):
                for item in self.node_items[g]:
                    if self.reads(item, later) == k - 1 and not self._sent(later, item, state):
                        return False
        return True

    def _sent(self, k: int, item: str, state: ScheduleState) -> bool:
        """Every call of ``(k, item)`` went out: a round-side node's once its stage ended (until the filter
        judged the last round, another round may read the same weights)."""
        stage = self.owner.get(item)
        return state.finished(k, stage) if stage else state.submitted(k, item)


@dataclass
class ScheduleState:
    """What was submitted and finished: everything up to ``through``, then per open iteration (``order``:
    every item of an iteration, :attr:`VersionSchedule.items`)."""

    through: int
    order: list[str]
    submitted_at: dict[int, set[str]] = field(default_factory=dict)
    finished_at: dict[int, set[str]] = field(default_factory=dict)

    def submitted(self, k: int, node: str) -> bool:
        return k <= self.through or node in self.submitted_at.get(k, ())

    def finished(self, k: int, node: str) -> bool:
        return k <= self.through or node in self.finished_at.get(k, ())

    def complete(self, k: int) -> bool:
        return k <= self.through or len(self.finished_at.get(k, ())) == len(self.order)
