"""Asynchronous RL: the controller's scheduling policy when a generate node has ``staleness`` η >= 1.

The DAG stays the loop; asynchrony is a schedule over (iteration, node) pairs. With η = 0 everywhere the
controller never builds this loop and runs one iteration after the other
(:meth:`rlflow.schedulers.runtime.controller.Controller.run_iteration`), bit for bit as before.

**The version schedule** (deterministic, so a seeded run is exactly reproducible whatever the timing):
weights have *policy version* ``v`` after ``v`` iterations of training (version 0: the initial weights).
A generate node ``g`` with staleness η samples iteration ``k`` with version ``max(s, k - 1 - η)``, ``s``
being the iteration the run (or its resume) started from; every other call of a model reads version
``k - 1``, as in the synchronous loop. So a sample trained at iteration ``k`` (version ``k - 1``) lags by at
most η versions: AReaL's bound (Fu et al., 2025, "AReaL: A Large-Scale Asynchronous Reinforcement
Learning System for Language Reasoning", arXiv:2505.24298, section 5.1), enforced by **admission control,
not dropping**: a rollout starts only once the weights it must read exist, and nothing generated is
thrown away. When generation is faster than training the lag sits at η (training paces the run:
``async/staleness_mean`` = η); when it is slower it stays below η (generation paces the run).

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

Iterations are opened (their prompts drawn from the data stream, in order) up to η beyond the last
finished one, and complete in order; metrics and the trace of iteration ``k`` are logged when it
completes. Before an evaluation or a checkpoint the loop **drains** (waits for what runs, submits nothing
new): then every instance of a model holds the version after ``k`` and the batches generated ahead
(iterations ``k + 1 .. k + η``) are complete values, which the checkpoint stores (``inflight``) and a
resume puts back, so a resumed run continues the same schedule exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.records.rundir import TraceRow

if TYPE_CHECKING:
    from rlflow.schedulers.runtime.controller import Controller

__all__ = [
    "AsyncLoop",
    "VersionSchedule",
    "busy_spans",
    "idle_ratios",
    "segment_items",
    "split_item",
    "staleness_of",
]


def staleness_of(graph: Graph) -> dict[str, int]:
    """Generate node -> its staleness η, for the nodes with η >= 1 (empty: a synchronous graph)."""
    return {name: node.staleness for name, node in graph.nodes.items() if node.staleness > 0}


def busy_spans(rows: Sequence[TraceRow]) -> dict[int, list[tuple[float, float]]]:
    """Worker -> the spans (run-clock seconds) it computed or moved data in ``rows``.

    A weight sync is a collective: a worker that enters it waits for the others (e.g. a generation worker
    for the train step it syncs from), so each ``reallocation`` row counts from the latest start among the
    rows of the same sync (iteration and model) to its own end.
    """
    arrived: dict[tuple[int, str], float] = {}
    for r in rows:
        if r.kind == "reallocation":
            key = (r.iteration, r.node)
            arrived[key] = max(arrived.get(key, r.start_s), r.start_s)
    out: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        start = arrived[(r.iteration, r.node)] if r.kind == "reallocation" else r.start_s
        out.setdefault(r.worker, []).append((min(start, r.end_s), r.end_s))
    return out


def idle_ratios(spans: Mapping[int, list[tuple[float, float]]], t0: float, t1: float) -> dict[int, float]:
    """Per worker, the fraction of ``[t0, t1]`` (seconds) covered by none of its busy ``spans``.

    Spans may overlap each other and the window's ends; a window of zero length is idle 0.
    Golden: spans ``[(0, 2), (1, 3)]`` in window ``[1, 5]`` cover ``[1, 3]``: idle ``2 / 4 = 0.5``.
    """
    out: dict[int, float] = {}
    length = t1 - t0
    for worker, items in spans.items():
        clipped = sorted((max(a, t0), min(b, t1)) for a, b in items if min(b, t1) > max(a, t0))
        busy = 0.0
        end = t0
        for a, b in clipped:
            if b > end:
                busy += b - max(a, end)
                end = b
        out[worker] = 1.0 - busy / length if length > 0 else 0.0
    return out


SYNC = "/sync"  # suffix of a weight-sync item: ``actor_train/sync`` (node names cannot hold "/")
SEGMENT = "/segment"  # ``actor_gen/segment0``: an interruptible generate node's earlier segments


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

    Items are the graph's nodes and, where the executor sends weight syncs on their own, one sync item per
    train node (``<train node>/sync``). A sync overwrites the weights of the nodes on the model's other
    instances (``sync_readers``), so rule 4 then holds the sync back, not the train step: the train step
    of iteration k overlaps generation of k + 1 .. k + η on any instance, and the generation worker runs
    the rest of its queue (reference, reward) before it joins the sync.

    Args:
        graph: the validated graph.
        start: the iteration the run starts after (0, or the resumed checkpoint's).
        sync_readers: train node -> the nodes its separate weight sync writes (on other instances);
            ``None``: syncs go with their train nodes (or there are none: one process).
    """

    def __init__(self, graph: Graph, start: int, sync_readers: Mapping[str, set[str]] | None = None) -> None:
        self.graph = graph
        self.start = start
        self.order = graph.execution_order()
        self.deps = {n: graph.dependencies(n) for n in self.order}
        self.eta = {n: graph.node(n).staleness for n in self.order}
        self.trainers = {n: graph.trainers(n) for n in self.order}
        self.sync_readers = {t: set(r) for t, r in (sync_readers or {}).items() if r}
        self.segments = {n: graph.segments(n) for n in self.order}
        self.node_items = {n: segment_items(n, self.segments[n]) for n in self.order}
        self.items = [
            *(i for n in self.order for i in self.node_items[n]),
            *(t + SYNC for t in self.order if t in self.sync_readers),
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

    def reads(self, item: str, k: int) -> int:
        """The iteration whose trained weights ``item`` (a node, or a segment of one) reads at iteration
        ``k`` (its policy version): ``max(s, k - 1 - η)``; segment ``j`` of an interruptible generate node
        one version newer per segment, up to the on-policy ``k - 1``."""
        node, j = split_item(item)
        first = max(self.start, k - 1 - self.eta[node])
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
        if item.endswith(SYNC):  # after its train step, once the rollouts reading the old weights went out
            return state.finished(k, item.removesuffix(SYNC)) and self._writes_ok(k, item, state, total)
        node, _ = split_item(item)
        seg = self.segment(item)
        if seg is None or seg[0] == 0:
            if not all(state.finished(k, d) for d in self.deps[node]):
                return False
        elif not state.submitted(k, self.node_items[node][seg[0] - 1]):  # segments go out in order
            return False
        if not state.submitted(k - 1, item):
            return False
        j = self.reads(item, k)
        for t in self.trainers[node]:
            if not state.finished(j, t):
                return False
            if node in self.sync_readers.get(t, ()) and not state.finished(j, t + SYNC):
                return False
        if self.graph.node(node).kind == "train":
            return state.complete(k - 1) and self._writes_ok(k, node, state, total)
        return True

    def _writes_ok(self, k: int, writer: str, state: ScheduleState, total: int) -> bool:
        """Rule 4: every generate call (or segment) that reads the weights ``writer`` overwrites (those
        after iteration ``k - 1``, read by iterations ``k .. k + η``) was submitted."""
        for g, eta in self.stale_readers.get(writer, ()):
            for later in range(k, min(k + eta, total) + 1):
                for item in self.node_items[g]:
                    if self.reads(item, later) == k - 1 and not state.submitted(later, item):
                        return False
        return True


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


@dataclass
class _Open:
    """An iteration in flight: its store (key -> rows or references), counts and partial records."""

    k: int
    store: dict[str, Any]
    pending: dict[str, int]
    metrics: dict[str, float] = field(default_factory=dict)
    trace: list[TraceRow] = field(default_factory=list)
    gen_tokens: int = 0
    train_tokens: int = 0
    samples: int = 0
    # (generate node, lag of each response's oldest token, samples, mean lag over response tokens)
    lags: list[tuple[str, float, int, float]] = field(default_factory=list)
    rollouts_done: bool = False
    prompt_rows: dict[str, int] = field(default_factory=dict)  # interruptible node -> its input rows


class AsyncLoop:
    """Runs iterations of ``host``'s graph under the version schedule (see the module docstring).

    Args:
        host: the controller (its graph, executor, data stream, recorder and node helpers).
        start: the iteration the run starts after.
        inflight: the checkpoint's batches generated ahead (:meth:`state`), or ``None``.

    Raises:
        GraphError: ``inflight`` was written under other staleness values (its batches could exceed this
            graph's bound).
    """

    def __init__(self, host: Controller, start: int, inflight: Mapping[str, Any] | None = None) -> None:
        self.host = host
        self.graph = host.graph
        self.etas = staleness_of(self.graph)
        executor = host.executor
        # the distributed executor sends a weight sync on its own, so it waits for the rollouts that read
        # the old weights, not the train step (VersionSchedule)
        readers = getattr(executor, "sync_readers", None)
        self.split_syncs = readers is not None and hasattr(executor, "submit_sync")
        sync_readers = (
            {t: readers(t) for t in self.graph.execution_order() if self.graph.node(t).kind == "train"}
            if self.split_syncs and readers is not None
            else None
        )
        self.schedule = VersionSchedule(self.graph, start, sync_readers)
        self.order = self.schedule.order
        self.state_ = ScheduleState(start, self.schedule.items)
        self.open: dict[int, _Open] = {}
        self.completed: dict[int, dict[str, float]] = {}
        self.running: dict[int, tuple[Any, int, str, int, float]] = {}  # id -> (ticket, k, node, bytes, t)
        self.rows: list[TraceRow] = []  # finished trace rows still inside the current idle window
        self.mark = host.recorder.now()  # when the iteration being timed began (run clock)
        self.steps = self._steps_per_version()
        self.producers = self.graph.keys()  # batch key -> producer (Graph.keys copies on every call)
        if inflight:
            self._restore(inflight)

    # -- versions -------------------------------------------------------------------------------------
    def _steps_per_version(self) -> dict[str, int]:
        """Generate node -> optimizer steps per policy version of its model (the ``epochs ×
        mini_batches`` of the train nodes of that very model; 0: not trained directly, e.g. an EMA)."""
        out: dict[str, int] = {}
        for name in self.order:
            node = self.graph.node(name)
            if node.kind != "generate":
                continue
            trainers = [self.graph.node(t) for t in self.graph.trainers(name)]
            out[name] = sum(t.epochs * t.mini_batches for t in trainers if t.model == node.model)
        return out

    # -- the loop -------------------------------------------------------------------------------------
    def next(self, k: int, total: int) -> dict[str, float]:
        """Run until iteration ``k`` has completed (later iterations proceed as the schedule allows);
        its metrics.

        Raises:
            NodeError: a node failed (the executor stops its workers).
        """
        self.mark = max(self.mark, self.host.recorder.now())
        while k not in self.completed:
            self._open_iterations(total)
            self._submit_ready(total)
            assert self.running, f"iteration {k}: nothing to run (a schedule without progress)"
            self._wait_one()
        return self.completed.pop(k)

    def drain(self) -> None:
        """Wait for every submitted node; submit nothing new (before evaluation and checkpoints)."""
        while self.running:
            self._wait_one()

    def _open_iterations(self, total: int) -> None:
        """Draw the prompts of every iteration up to η beyond the last completed one, in order."""
        host = self.host
        k = max([self.state_.through, *self.open]) + 1
        while k <= total and k <= self.state_.through + 1 + self.schedule.depth:
            batch = host.stream.next_batch(host.prompts_per_iteration)
            store = host.executor.source(batch, k)
            pending = {key: len(self.graph.consumers(key)) for key in self.producers}
            self.open[k] = _Open(k, store, pending)
            self.state_.submitted_at[k] = set()
            self.state_.finished_at[k] = set()
            k += 1

    def _submit_ready(self, total: int) -> None:
        """Submit every ready ``(k, node)``, oldest iteration first, until none is (rule 4 may free a
        train node once a later iteration's generation went out in the same pass)."""
        progress = True
        while progress:
            progress = False
            for k in sorted(self.open):
                it = self.open[k]
                for name in self.schedule.items:
                    if name in self.state_.submitted_at[k] or not self.schedule.ready(
                        k, name, self.state_, total
                    ):
                        continue
                    if name.endswith(SYNC):
                        ticket = self.host.executor.submit_sync(name.removesuffix(SYNC), k)  # type: ignore[attr-defined]
                        self.running[id(ticket)] = (ticket, k, name, 0, self.host.recorder.now())
                        self.state_.submitted_at[k].add(name)
                        progress = True
                        continue
                    node, _ = split_item(name)
                    segment = self.schedule.segment(name)
                    if segment is None or segment[0] == 0:
                        batch = self.host._inputs(node, it.store)
                        for key in _binding(self.graph.node(node).inputs).values():
                            it.pending[key] -= 1
                            if it.pending[key] == 0:
                                it.store.pop(key, None)
                    else:  # the node's ranks hold the rollouts: the rows' count is all it needs
                        batch = Batch({"segment": [segment[0]] * it.prompt_rows[node]})
                    if segment is not None:
                        if segment[0] == 0:
                            it.prompt_rows[node] = len(batch)
                        ticket = self.host.executor.submit(node, batch, k, segment=segment)
                    elif self.split_syncs and name + SYNC in self.schedule.items:
                        ticket = self.host.executor.submit(name, batch, k, sync=False)  # type: ignore[call-arg]
                    else:
                        ticket = self.host.executor.submit(name, batch, k)
                    self.running[id(ticket)] = (ticket, k, name, _bytes(batch), self.host.recorder.now())
                    self.state_.submitted_at[k].add(name)
                    progress = True

    def _wait_one(self) -> None:
        """Wait for one submitted node and record it; complete its iteration if it was the last."""
        from rlflow.schedulers.runtime.controller import _merge_metrics

        tickets = [t for t, *_ in self.running.values()]
        ticket, done = self.host.executor.wait_any(tickets)
        _, k, name, nbytes, _ = self.running.pop(id(ticket))
        it = self.open[k]
        if name.endswith(SYNC):  # a weight sync sent on its own: its metrics and reallocation rows
            _merge_metrics(it.metrics, done.result.metrics)
            rows = [r for r in self.host._trace_rows(k, done, 0) if r.kind == "reallocation"]
            it.trace.extend(rows)
            self.rows.extend(rows)
            self._finished(k, name)
            return
        base, j = split_item(name)
        node = self.graph.node(base)
        result = done.result
        if j is not None:  # an earlier segment: no outputs yet (its ranks keep the rollouts)
            it.gen_tokens += result.tokens
            _merge_metrics(it.metrics, result.metrics)
            key = f"timing_s/{base}"
            it.metrics[key] = it.metrics.get(key, 0.0) + done.end - done.start
            rows = self.host._trace_rows(k, done, nbytes)
            it.trace.extend(rows)
            self.rows.extend(rows)
            self._finished(k, name)
            return
        for param, key in _binding(node.outputs).items():
            if key is not None:
                it.store[key] = result.outputs[param]
        if node.kind == "generate":
            it.gen_tokens += result.tokens
            samples = self.graph.prompts(name) * self.graph.group_size(name)
            it.samples = max(it.samples, samples)
            steps = self.steps.get(name, 0)
            version = result.metrics.get("rollout/weight_version")
            if steps and version is not None:
                # trained at k with version k-1; sampled with the measured version (optimizer steps): the
                # oldest among a response's tokens under interruptible generation
                token_version = result.metrics.get("rollout/token_weight_version_mean", version)
                it.lags.append((name, (k - 1) - version / steps, samples, (k - 1) - token_version / steps))
        elif node.kind == "train":
            it.train_tokens += result.tokens // max(1, node.epochs)
            it.samples = max(it.samples, self.graph.rows(name))
        _merge_metrics(it.metrics, result.metrics)
        it.metrics[f"timing_s/{name}"] = it.metrics.get(f"timing_s/{name}", 0.0) + done.end - done.start
        rows = self.host._trace_rows(k, done, nbytes)
        it.trace.extend(rows)
        self.rows.extend(rows)
        self._finished(k, name)

    def _finished(self, k: int, item: str) -> None:
        self.state_.finished_at[k].add(item)
        it = self.open[k]
        gens = [n for n in self.order if self.graph.node(n).kind == "generate"]
        it.rollouts_done = all(g in self.state_.finished_at[k] for g in gens)
        if self.state_.complete(k) and k == self.state_.through + 1:
            self._complete(k)

    def _complete(self, k: int) -> None:
        """Iteration ``k`` has finished: its metrics, trace and idle ratios; it leaves the open set."""
        host = self.host
        rec = host.recorder
        it = self.open.pop(k)
        self.state_.through = k
        del self.state_.submitted_at[k], self.state_.finished_at[k]
        now = rec.now()
        elapsed = now - self.mark
        metrics = it.metrics
        tokens = it.gen_tokens or it.train_tokens
        metrics["timing_s/iteration"] = elapsed
        metrics["perf/throughput"] = tokens / elapsed if elapsed > 0 else 0.0
        metrics["perf/samples_per_s"] = it.samples / elapsed if elapsed > 0 else 0.0
        metrics["perf/tokens"] = float(tokens)
        metrics.update({f"memory_bytes/{w}": float(b) for w, b in self.host.executor.worker_memory().items()})
        if it.lags:
            weight = sum(n for _, _, n, _ in it.lags)
            metrics["async/staleness_mean"] = sum(lag * n for _, lag, n, _ in it.lags) / weight
            metrics["async/staleness_max"] = max(lag for _, lag, _, _ in it.lags)
            # per token: below the per-response lag when interrupted rollouts continued under newer weights
            metrics["async/token_staleness_mean"] = sum(t * n for _, _, n, t in it.lags) / weight
            # at the bound: generation ran as far ahead as allowed, so training paces the run
            metrics["async/at_bound"] = (
                sum(n for g, lag, n, _ in it.lags if lag >= self.etas.get(g, 0)) / weight
            )
        metrics["async/queue_depth"] = float(sum(1 for o in self.open.values() if o.rollouts_done))
        metrics.update(self._idle(self.mark, now))
        self.rows = [r for r in self.rows if r.end_s > now]
        rec.log_trace(it.trace)
        if host.live is not None:
            host.live.observe_iteration(k, metrics, it.trace)
        self.completed[k] = metrics
        self.mark = now

    def _idle(self, t0: float, t1: float) -> dict[str, float]:
        """``perf/idle_ratio/<worker>`` over ``[t0, t1]``: finished rows, and nodes still running on the
        distributed workers counted busy from the later of their submission and the worker's last finished
        row (a command may wait in the worker's queue: the ratio is then a lower bound). The single process
        runs a node only when waited for, so a submitted node there is not busy."""
        from rlflow.schedulers.runtime.executor import LocalExecutor

        spans: dict[int, list[tuple[float, float]]] = {w: [] for w in range(self.graph.spec.run.devices)}
        for w, items in busy_spans(self.rows).items():
            spans.setdefault(w, []).extend(items)
        if not isinstance(self.host.executor, LocalExecutor):
            for ticket, _, name, _, submitted in self.running.values():
                # a distributed ticket knows its ranks (a separate sync spans two meshes)
                ranks = getattr(ticket, "ranks", None) or self.graph.placement(split_item(name)[0]).devices
                for w in ranks:
                    last = max([b for a, b in spans.get(w, [])], default=submitted)
                    spans.setdefault(w, []).append((max(submitted, min(last, t1)), t1))
        return {f"perf/idle_ratio/{w}": v for w, v in idle_ratios(spans, t0, t1).items()}

    def abort(self) -> None:
        """Log the trace rows of the iterations in flight (after a failure: what finished is kept)."""
        rows = [r for it in self.open.values() for r in it.trace]
        if rows:
            self.host.recorder.log_trace(rows)

    # -- checkpoints ----------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """The batches generated ahead, for a checkpoint: per open iteration its finished nodes, the
        store's values copied to the controller (CPU tensors, lists), partial metrics and trace rows.
        Call after :meth:`drain`."""
        assert not self.running, "drain before saving the iterations in flight"
        pull = getattr(self.host.executor, "pull", None)
        iterations: dict[int, dict[str, Any]] = {}
        for k, it in sorted(self.open.items()):
            store: dict[str, Any] = {}
            for key, value in it.store.items():
                store[key] = pull({key: value})[key] if pull is not None else value
            iterations[k] = {
                "finished": sorted(self.state_.finished_at[k]),
                "store": store,
                "metrics": dict(it.metrics),
                "trace": list(it.trace),
                "gen_tokens": it.gen_tokens,
                "train_tokens": it.train_tokens,
                "samples": it.samples,
                "lags": list(it.lags),
                "prompt_rows": dict(it.prompt_rows),
            }
        segments = {name: self.graph.node(name).interrupt_every for name in self.etas}
        return {"staleness": dict(self.etas), "interrupt_every": segments, "iterations": iterations}

    def _restore(self, inflight: Mapping[str, Any]) -> None:
        """Put the checkpoint's batches generated ahead back (on the workers of their next readers)."""
        saved = dict(inflight.get("staleness", {}))
        iterations = inflight.get("iterations", {})
        if iterations and saved != self.etas:
            src = self.graph.spec.source or "<graph>"
            raise GraphError(
                f"{src}: --resume: the checkpoint holds {len(iterations)} batch(es) generated ahead under "
                f"staleness {_show(saved)}; this graph has {_show(self.etas)}: resume with the same "
                "nodes.<generate node>.staleness"
            )
        saved_every = dict(inflight.get("interrupt_every", {}))
        every = {name: self.graph.node(name).interrupt_every for name in self.etas}
        if iterations and saved_every and saved_every != every:
            src = self.graph.spec.source or "<graph>"
            raise GraphError(  # a rollout held between segments continues in segments of the saved size
                f"{src}: --resume: the checkpoint holds {len(iterations)} batch(es) in flight sampled in "
                f"segments of interrupt_every {_show(saved_every)}; this graph has {_show(every)}: resume "
                "with the same nodes.<generate node>.interrupt_every"
            )
        for k, entry in sorted(iterations.items()):
            finished = set(entry["finished"])
            values: dict[str, Any] = entry["store"]
            store: dict[str, Any] = {}
            by_rows: dict[int, dict[str, Any]] = {}
            for key, value in values.items():
                by_rows.setdefault(len(value), {})[key] = value
            for group in by_rows.values():
                store.update(self.host.executor.source(Batch(group), k, done=finished))
            pending = {
                key: sum(1 for n in self.graph.consumers(key) if n not in finished) for key in self.producers
            }
            it = _Open(k, store, pending, dict(entry["metrics"]), list(entry["trace"]))
            it.gen_tokens, it.train_tokens, it.samples = (
                entry["gen_tokens"],
                entry["train_tokens"],
                entry["samples"],
            )
            # a checkpoint from before per-token lags holds (node, lag, samples): its token lag is the lag
            it.lags = [(x[0], x[1], x[2], x[3] if len(x) > 3 else x[1]) for x in entry["lags"]]
            it.prompt_rows = dict(entry.get("prompt_rows", {}))
            gens = [n for n in self.order if self.graph.node(n).kind == "generate"]
            it.rollouts_done = all(g in finished for g in gens)
            self.open[k] = it
            self.state_.submitted_at[k] = set(finished)
            self.state_.finished_at[k] = set(finished)


def _show(etas: Mapping[str, int]) -> str:
    return ", ".join(f"{n}: {e}" for n, e in sorted(etas.items())) or "0 everywhere (synchronous)"


def _binding(keys: object) -> dict[str, Any]:
    assert isinstance(keys, dict), "graph validation resolves bindings to dicts"
    return keys


def _bytes(batch: Batch) -> int:
    from rlflow.schedulers.runtime.controller import _bytes as controller_bytes

    return controller_bytes(batch)
