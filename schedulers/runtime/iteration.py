"""One iteration's bookkeeping, shared by the synchronous controller and the asynchronous loop.

A node's input batch taken from the iteration's store (:func:`node_inputs`), the bytes it carries
(:func:`input_bytes`), its metrics merged into the iteration's (:func:`merge_metrics`), its trace rows
(:func:`trace_rows`), and the iteration's own metrics: throughput (:func:`throughput_metrics`) and each
worker's idle ratio (:func:`busy_spans`, :func:`idle_ratios`). Times are run-clock seconds
(:meth:`rlflow.schedulers.records.rundir.RunRecorder.now`) unless said otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlflow.dataflow.batch import Batch, RemoteRows
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.records.rundir import TraceRow
from rlflow.schedulers.runtime.executor import Finished

__all__ = [
    "binding",
    "busy_spans",
    "idle_ratios",
    "input_bytes",
    "merge_metrics",
    "node_inputs",
    "throughput_metrics",
    "trace_rows",
]


def binding(keys: object) -> dict[str, Any]:
    """A validated node's ``inputs``/``outputs``: canonical parameter -> batch key (``None``: discarded)."""
    assert isinstance(keys, dict), "graph validation resolves bindings to dicts"
    return keys


def input_bytes(batch: Batch) -> int:
    """Bytes of a node's input tensors, held here or by workers (from their metadata)."""
    return sum(
        v.numel() * v.element_size() if isinstance(v, torch.Tensor) else v.nbytes
        for v in batch.values()
        if isinstance(v, torch.Tensor | RemoteRows)
    )


def merge_metrics(into: dict[str, float], new: Mapping[str, float]) -> None:
    """Add a node's metrics to the iteration's, in place; reallocation totals of several train nodes add
    up (``realloc/bytes``, ``realloc/seconds``) and the checksum flag keeps the worst."""
    for key, value in new.items():
        if key in into and key in ("realloc/bytes", "realloc/seconds"):
            into[key] += value
        elif key in into and key == "realloc/checksum_ok":
            into[key] = min(into[key], value)
        else:
            into[key] = value


def node_inputs(graph: Graph, name: str, store: Mapping[str, Any]) -> Batch:
    """Node ``name``'s input batch (canonical parameter names) from the iteration's ``store`` (key -> rows,
    or references to rows the workers hold); a node whose rows are samples (not a generate node, group
    size ``G > 1``) gets each per-prompt key repeated ``G`` times (``[P, ...]`` -> ``[P·G, ...]``)."""
    node = graph.node(name)
    group = graph.group_size(name)
    samples = node.kind != "generate" and group > 1
    values: dict[str, Any] = {}
    for param, key in binding(node.inputs).items():
        value = store[key]
        if samples and graph.is_per_prompt(key):
            value = Batch({key: value}).repeat_interleave(group)[key]
        values[param] = value
    return Batch(values)


def trace_rows(
    graph: Graph,
    iteration: int,
    done: Finished,
    nbytes: int,
    now: float,
    predicted_s: Mapping[str, float],
) -> list[TraceRow]:
    """The trace rows of a finished node: one per worker that ran it (the single-process executor is
    worker 0 on device 0), one per phase a worker reported inside it (:attr:`Finished.spans`, e.g. kind
    ``tool``: an agent's environment steps, named after the node), then, after a train node, one per
    worker of its weight sync (kind ``reallocation``).

    Args:
        nbytes: the node's input bytes (:func:`input_bytes`), shared evenly among its workers' rows.
        now: the run clock now (seconds). Workers report wall-clock times (``time.time()``), moved onto the
            run clock with the offset between the two clocks now (same host).
        predicted_s: the planner's predicted seconds per node, recorded on the node's own rows.
    """
    name, tokens = done.name, int(done.result.tokens)
    offset = now - time.time()
    predicted = predicted_s.get(name)

    def row(rank: int, node: str, t0: float, t1: float, tok: int, nb: int, kind: str) -> TraceRow:
        start = max(0.0, t0 + offset)
        return TraceRow(iteration, node, rank, rank, start, max(start, t1 + offset), tok, nb,
                        predicted if kind == "node" else None, kind)  # fmt: skip

    per_worker = done.workers or {0: (done.start, done.end)}
    share = len(per_worker)
    rows = [
        row(rank, name, t0, t1, tokens // share, nbytes // share, "node")
        for rank, (t0, t1) in sorted(per_worker.items())
    ]
    rows += [
        row(rank, name, t0, t1, 0, 0, kind)
        for rank, phases in sorted(done.spans.items())
        for kind, t0, t1 in phases
    ]
    node = graph.node(name)
    if node.kind == "train":
        model = node.model or name
        rows += [
            row(rank, model, t0, t1, 0, int(nb), "reallocation")
            for rank, (t0, t1, nb) in sorted(done.syncs.items())
        ]
    return rows


def throughput_metrics(
    elapsed: float, tokens: int, samples: int, memory: Mapping[int, int]
) -> dict[str, float]:
    """An iteration's ``timing_s/iteration`` (``elapsed`` seconds), ``perf/throughput`` (tokens/s: the
    generated tokens, else the trained ones), ``perf/num_samples`` (``samples``: the samples generated,
    else the rows trained), ``perf/samples_per_s``, ``perf/tokens`` and ``memory_bytes/<worker>`` (each
    worker's peak bytes, ``memory``); rates are 0 for ``elapsed`` 0."""
    metrics = {
        "timing_s/iteration": elapsed,
        "perf/throughput": tokens / elapsed if elapsed > 0 else 0.0,
        "perf/num_samples": float(samples),
        "perf/samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
        "perf/tokens": float(tokens),
    }
    metrics.update({f"memory_bytes/{w}": float(b) for w, b in memory.items()})
    return metrics


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
