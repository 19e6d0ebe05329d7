"""One synchronous pass of the controller over a set of nodes, and the records it tallies.

:func:`walk` submits each node as soon as the nodes it depends on within the iteration have finished (so
nodes on disjoint meshes run at the same time), hands it its inputs from the iteration's store, stores its
outputs, and drops a key once its last reader was submitted. The controller walks every node once per
iteration; with a filter node (:mod:`rlflow.schedulers.runtime.refill`) it walks the round side once per
round and the rest once after. :func:`close_iteration` turns a :class:`Tally` into the iteration's
throughput and idle metrics.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlflow.dataflow.graph import Graph
from rlflow.nodes.context import NodeResult
from rlflow.schedulers.records.rundir import RunRecorder, TraceRow
from rlflow.schedulers.runtime.executor import Executor
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

__all__ = ["Tally", "WalkHost", "close_iteration", "walk"]


class WalkHost(Protocol):
    """What a walk reads of the run it serves (the controller)."""

    graph: Graph
    executor: Executor[Any]
    recorder: RunRecorder  # the run clock (seconds)
    predicted_s: dict[str, float]  # the planner's seconds per node, for the trace
    dependencies: dict[str, list[str]]  # node -> the nodes it waits for within an iteration
    live: Any  # LiveMetrics to update per iteration, or None


@dataclass
class Tally:
    """What the nodes of one walk (or of several, e.g. rounds) recorded: merged metrics (with
    ``timing_s/<node>``), trace rows, generated and trained tokens and the samples of the iteration."""

    metrics: dict[str, float] = field(default_factory=dict)
    trace: list[TraceRow] = field(default_factory=list)
    gen_tokens: int = 0
    train_tokens: int = 0
    samples: int = 0


def walk(
    host: WalkHost,
    names: Sequence[str],
    store: dict[str, Any],
    pending: dict[str, int],
    iteration: int,
    tally: Tally,
    done: Collection[str] = (),
) -> dict[str, NodeResult]:
    """Run nodes ``names`` (in execution order) once on ``store``; their results by node.

    Args:
        store: key -> rows (or references to rows the workers hold); outputs are added, and a key whose
            ``pending`` reads fall to 0 is dropped.
        pending: key -> reads still to come; each submitted reader takes one.
        tally: where metrics, trace rows, tokens and samples are added.
        done: nodes finished before this walk (dependencies of ``names`` outside it).

    Raises:
        NodeError: a node failed.
    """
    graph, executor = host.graph, host.executor
    waiting = list(names)
    finished: set[str] = set(done)
    running: dict[int, tuple[Any, int]] = {}  # id(ticket) -> (ticket, input bytes)
    results: dict[str, NodeResult] = {}
    while waiting or running:
        for name in [n for n in waiting if finished.issuperset(host.dependencies[n])]:
            batch = node_inputs(graph, name, store)
            for key in binding(graph.node(name).inputs).values():
                pending[key] -= 1
                if pending[key] == 0:
                    store.pop(key, None)
            ticket = executor.submit(name, batch, iteration)
            running[id(ticket)] = (ticket, input_bytes(batch))
            waiting.remove(name)
        ticket, finished_node = executor.wait_any([t for t, _ in running.values()])
        nbytes = running.pop(id(ticket))[1]
        name, result = finished_node.name, finished_node.result
        finished.add(name)
        results[name] = result
        node = graph.node(name)
        for param, key in binding(node.outputs).items():
            if key is not None:
                store[key] = result.outputs[param]
        merge_metrics(tally.metrics, result.metrics)
        timing = f"timing_s/{name}"
        tally.metrics[timing] = tally.metrics.get(timing, 0.0) + finished_node.end - finished_node.start
        if node.kind == "generate":
            tally.gen_tokens += result.tokens
            tally.samples = max(tally.samples, graph.prompts(name) * graph.group_size(name))
        elif node.kind == "train":
            tally.train_tokens += result.tokens // max(1, node.epochs)
            tally.samples = max(tally.samples, graph.rows(name))
        now = host.recorder.now()
        tally.trace.extend(trace_rows(graph, iteration, finished_node, nbytes, now, host.predicted_s))
    return results


def close_iteration(host: WalkHost, iteration: int, t0: float, tally: Tally) -> dict[str, float]:
    """The metrics of an iteration that began at ``t0`` (run clock): the tally's, with throughput
    (:func:`~rlflow.schedulers.runtime.iteration.throughput_metrics`) and ``perf/idle_ratio/<worker>``;
    handed to the live metrics when there are."""
    t1 = host.recorder.now()
    metrics = tally.metrics
    tokens = tally.gen_tokens or tally.train_tokens
    metrics.update(throughput_metrics(t1 - t0, tokens, tally.samples, host.executor.worker_memory()))
    spans: dict[int, list[tuple[float, float]]] = {w: [] for w in range(host.graph.spec.run.devices)}
    for w, items in busy_spans(tally.trace).items():
        spans.setdefault(w, []).extend(items)
    metrics.update({f"perf/idle_ratio/{w}": v for w, v in idle_ratios(spans, t0, t1).items()})
    if host.live is not None:
        host.live.observe_iteration(iteration, metrics, tally.trace)
    return metrics
