"""Asynchronous RL: the loop the controller runs when a generate node has ``staleness`` η >= 1.

The DAG stays the loop; asynchrony is a schedule over (iteration, node) pairs, the version schedule
(:mod:`rlflow.schedulers.runtime.version_schedule`: its submission rules, the weights each call reads,
weight syncs sent on their own, interruptible generation). With η = 0 everywhere the controller never builds
this loop and runs one iteration after the other
(:meth:`rlflow.schedulers.runtime.controller.Controller.run_iteration`), bit for bit as before.

:class:`AsyncLoop` submits every ready call to the executor and records what finishes.
Iterations are opened (their prompts drawn from the data stream, in order) up to η beyond the last
finished one, and complete in order; metrics and the trace of iteration ``k`` are logged when it
completes. Before an evaluation or a checkpoint the loop **drains** (waits for what runs, submits nothing
new): then every instance of a model holds the version after ``k`` and the batches generated ahead
(iterations ``k + 1 .. k + η``) are complete values, which the checkpoint stores (``inflight``) and a
resume puts back, so a resumed run continues the same schedule exactly.

A graph with a filter node (dynamic sampling) runs its round side as each iteration's generation stage
(:mod:`rlflow.schedulers.runtime.async_rounds`): an iteration draws no prompts when it opens, its stage
draws each round's; the nodes after the filter read the rows of the groups that passed. A drain lets a
stage in progress finish its rounds, so the checkpoint holds whole stages and the data position after them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.data import PromptStream
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.nodes.context import NodeResult
from rlflow.schedulers.records.rundir import RunRecorder, TraceRow
from rlflow.schedulers.runtime.async_rounds import RoundStages
from rlflow.schedulers.runtime.executor import Executor, Finished
from rlflow.schedulers.runtime.iteration import (
    binding,
    busy_spans,
    idle_ratios,
    input_bytes,
    merge_metrics,
    node_inputs,
    throughput_metrics,
    trace_rows,
)
from rlflow.schedulers.runtime.refill import Rounds
from rlflow.schedulers.runtime.version_schedule import (
    SYNC,
    ScheduleState,
    VersionSchedule,
    split_item,
    staleness_of,
)

__all__ = ["AsyncLoop", "LoopHost"]


class LoopHost(Protocol):
    """What the asynchronous loop reads of the run it serves (the controller)."""

    graph: Graph
    executor: Executor[Any]
    stream: PromptStream  # the training prompts, drawn per iteration
    prompts_per_iteration: int
    recorder: RunRecorder  # the run clock (seconds) and the trace file
    live: Any  # LiveMetrics to update per iteration, or None
    predicted_s: dict[str, float]  # the planner's seconds per node, for the trace
    dependencies: dict[str, list[str]]  # node -> the nodes it waits for within an iteration


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
    drawn: list[tuple[int, list[Any]]] | None = None  # (epoch, prompt ids)s for the prompt record


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

    def __init__(self, host: LoopHost, start: int, inflight: Mapping[str, Any] | None = None) -> None:
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
        # the iterations in flight keep their schedule's origin: a resume reads what the run would have
        held = (inflight or {}).get("iterations", {})
        origins = {int(k): e["origin"] for k, e in held.items() if "origin" in e}
        self.schedule = VersionSchedule(self.graph, start, sync_readers, origins)
        self.order = self.schedule.order
        self.state_ = ScheduleState(start, self.schedule.items)
        self.open: dict[int, _Open] = {}
        self.completed: dict[int, dict[str, float]] = {}
        self.running: dict[int, tuple[Any, int, str, int, float]] = {}  # id -> (ticket, k, node, bytes, t)
        self.rows: list[TraceRow] = []  # finished trace rows still inside the current idle window
        self.mark = host.recorder.now()  # when the iteration being timed began (run clock)
        self.steps = self._steps_per_version()
        self.producers = self.graph.keys()  # batch key -> producer (Graph.keys copies on every call)
        # a filter's round side runs as each iteration's stage; the iteration's store serves the rest
        self.stages = RoundStages(Rounds(host)) if self.graph.filter is not None else None
        inside: frozenset[str] = self.stages.members if self.stages is not None else frozenset()
        self.readers = {
            key: [n for n in self.graph.consumers(key) if n not in inside] for key in self.producers
        }
        gens = [n for n in self.order if self.graph.node(n).kind == "generate"]
        self.gen_items = list(dict.fromkeys(self.schedule.owner.get(n, n) for n in gens))
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
            store: dict[str, Any] = {}  # with a filter, its stage draws the prompts of each round
            drawn = None
            if self.stages is None:
                store = host.executor.source(host.stream.next_batch(host.prompts_per_iteration), k)
                drawn = [host.stream.drawn]
            pending = {key: len(self.readers[key]) for key in self.producers}
            self.open[k] = _Open(k, store, pending, drawn=drawn)
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
                    if name == self.schedule.stage and self.stages is not None:
                        for node, batch in self.stages.start(k):
                            self._send(k, node, batch)
                        self.state_.submitted_at[k].add(name)
                        progress = True
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
                        batch = node_inputs(self.graph, node, it.store)
                        for key in binding(self.graph.node(node).inputs).values():
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
                    self.running[id(ticket)] = (ticket, k, name, input_bytes(batch), self.host.recorder.now())
                    self.state_.submitted_at[k].add(name)
                    progress = True

    def _send(self, k: int, name: str, batch: Batch) -> None:
        """Submit one call of a stage's round (``name``: a round-side node) for iteration ``k``."""
        ticket = self.host.executor.submit(name, batch, k)
        self.running[id(ticket)] = (ticket, k, name, input_bytes(batch), self.host.recorder.now())

    def _wait_one(self) -> None:
        """Wait for one submitted node and record it; complete its iteration if it was the last."""
        tickets = [t for t, *_ in self.running.values()]
        ticket, done = self.host.executor.wait_any(tickets)
        _, k, name, nbytes, _ = self.running.pop(id(ticket))
        it = self.open[k]
        if name.endswith(SYNC):  # a weight sync sent on its own: its metrics and reallocation rows
            merge_metrics(it.metrics, done.result.metrics)
            rows = [r for r in self._trace_rows(k, done, 0) if r.kind == "reallocation"]
            it.trace.extend(rows)
            self.rows.extend(rows)
            self._finished(k, name)
            return
        base, j = split_item(name)
        node = self.graph.node(base)
        result = done.result
        if j is not None:  # an earlier segment: no outputs yet (its ranks keep the rollouts)
            it.gen_tokens += result.tokens
            merge_metrics(it.metrics, result.metrics)
            key = f"timing_s/{base}"
            it.metrics[key] = it.metrics.get(key, 0.0) + done.end - done.start
            rows = self._trace_rows(k, done, nbytes)
            it.trace.extend(rows)
            self.rows.extend(rows)
            self._finished(k, name)
            return
        # a round-side node: outputs and metrics to its round's (merged at the stage's end)
        member = self.stages is not None and base in self.stages.members
        metrics = self.stages.metrics(k) if self.stages is not None and member else it.metrics
        for param, key in binding(node.outputs).items():
            if key is not None and not member:
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
        merge_metrics(metrics, result.metrics)
        metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + done.end - done.start
        rows = self._trace_rows(k, done, nbytes)
        it.trace.extend(rows)
        self.rows.extend(rows)
        if member:
            self._advance_stage(k, name, result)
        else:
            self._finished(k, name)

    def _advance_stage(self, k: int, name: str, result: NodeResult) -> None:
        """Round-side node ``name`` of iteration ``k`` finished: submit what its stage runs next; at the
        stage's end, the rows of the groups that passed join the iteration's store."""
        assert self.stages is not None and self.schedule.stage is not None
        calls, end = self.stages.finished(k, name, result)
        for node, batch in calls:
            self._send(k, node, batch)
        if end is not None:
            it = self.open[k]
            it.store.update(end.store)
            it.drawn = end.drawn
            merge_metrics(it.metrics, end.metrics)
            self._finished(k, self.schedule.stage)

    def _trace_rows(self, k: int, done: Finished, nbytes: int) -> list[TraceRow]:
        """:func:`~rlflow.schedulers.runtime.iteration.trace_rows` of a call of iteration ``k``, now."""
        return trace_rows(self.graph, k, done, nbytes, self.host.recorder.now(), self.host.predicted_s)

    def _finished(self, k: int, item: str) -> None:
        self.state_.finished_at[k].add(item)
        it = self.open[k]
        it.rollouts_done = all(g in self.state_.finished_at[k] for g in self.gen_items)
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
        metrics.update(throughput_metrics(elapsed, tokens, it.samples, host.executor.worker_memory()))
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
        for epoch, ids in it.drawn or ():
            rec.log_prompts(k, epoch, ids)
        if host.live is not None:
            host.live.observe_iteration(k, metrics, it.trace)
        self.completed[k] = metrics
        self.mark = now

    def _idle(self, t0: float, t1: float) -> dict[str, float]:
        """``perf/idle_ratio/<worker>`` over ``[t0, t1]``: finished rows, and nodes still running on the
        distributed workers counted busy from the later of their submission and the worker's last finished
        row (a command may wait in the worker's queue: the ratio is then a lower bound). The single process
        runs a node only when waited for, so a submitted node there is not busy."""
        spans: dict[int, list[tuple[float, float]]] = {w: [] for w in range(self.graph.spec.run.devices)}
        for w, items in busy_spans(self.rows).items():
            spans.setdefault(w, []).extend(items)
        if self.host.executor.runs_when_submitted:
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
        assert self.stages is None or not self.stages.open, "a drain ends the stages in progress"
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
                "drawn": it.drawn,
                "origin": self.schedule.origin(k),
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
        if any(every.values()) and any("origin" not in e for e in iterations.values()):
            warnings.warn(  # its later segments read versions from the checkpoint on, not the run's
                GraphWarning(
                    f"{self.graph.spec.source or '<graph>'}: --resume: the checkpoint (written before the "
                    "schedule's origin was saved) holds rollouts between segments; they continue under "
                    "the weights the schedule gives a run started at the checkpoint, so this resume is "
                    "not bit-exact with the uninterrupted run"
                ),
                stacklevel=2,
            )
        for k, entry in sorted(iterations.items()):
            finished = set(entry["finished"])
            # an ended stage's rows go to the nodes after the filter (its round side ran)
            done = set(finished)
            if self.stages is not None and self.schedule.stage in finished:
                done |= self.stages.members
            values: dict[str, Any] = entry["store"]
            store: dict[str, Any] = {}
            by_rows: dict[int, dict[str, Any]] = {}
            for key, value in values.items():
                by_rows.setdefault(len(value), {})[key] = value
            for group in by_rows.values():
                store.update(self.host.executor.source(Batch(group), k, done=done))
            pending = {key: sum(1 for n in self.readers[key] if n not in finished) for key in self.producers}
            it = _Open(k, store, pending, dict(entry["metrics"]), list(entry["trace"]))
            it.gen_tokens, it.train_tokens, it.samples = (
                entry["gen_tokens"],
                entry["train_tokens"],
                entry["samples"],
            )
            # a checkpoint from before per-token lags holds (node, lag, samples): its token lag is the lag
            it.lags = [(x[0], x[1], x[2], x[3] if len(x) > 3 else x[1]) for x in entry["lags"]]
            it.prompt_rows = dict(entry.get("prompt_rows", {}))
            it.drawn = entry.get("drawn")  # None in a checkpoint from before the prompt record
            it.rollouts_done = all(g in finished for g in self.gen_items)
            self.open[k] = it
            self.state_.submitted_at[k] = set(finished)
            self.state_.finished_at[k] = set(finished)


def _show(etas: Mapping[str, int]) -> str:
    return ", ".join(f"{n}: {e}" for n, e in sorted(etas.items())) or "0 everywhere (synchronous)"
