"""How the profile takes and keeps a measurement: the timing loops (sustained, cold, collective), the
profile row and its Parquet file, medians over rounds, and the profiled model shape and thread count."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_CONFIG",
    "IDLE_S",
    "WINDOW_S",
    "append_rows",
    "median_rounds",
    "one_layer",
    "profile_row",
    "time_call",
    "time_cold",
    "time_collective",
    "worker_threads",
]

# A small default block (a few hundred K params) so a CPU profile takes about a minute.
DEFAULT_CONFIG: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 1024,
}
WINDOW_S = 0.1  # seconds each measurement runs for at least
IDLE_S = 0.02  # idle seconds before each cold call (model_cold)


def worker_threads() -> int:
    """Torch threads of a runtime worker on a host with one worker per ``WORKER_THREADS`` cores (the
    planner's CPU device; :func:`~rlflow.schedulers.runtime.threads.choose_threads`), or the user's
    ``RLFLOW_NUM_THREADS``/``OMP_NUM_THREADS`` override."""
    import os

    from rlflow.schedulers.planner.cluster import WORKER_THREADS
    from rlflow.schedulers.runtime.threads import choose_threads

    return choose_threads(WORKER_THREADS, 1, os.environ).threads


def one_layer(config: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face model config ``config`` cut to one decoder layer (a new dict)."""
    return {**config, "num_hidden_layers": 1}


def time_call(fn: Callable[[], object], repeats: int, window_s: float = WINDOW_S) -> float:
    """Mean seconds per call of ``fn`` over at least ``repeats`` calls and ``window_s`` seconds, after a
    warm-up call: the sustained rate, which counts the time slices a busy host takes away as a node that
    runs for seconds sees them (the median of a few short calls does not)."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while calls < repeats or time.perf_counter() - t0 < window_s:
        fn()
        calls += 1
    return (time.perf_counter() - t0) / calls


def time_cold(fn: Callable[[], object], repeats: int, idle_s: float = IDLE_S) -> float:
    """Mean seconds of ``fn`` called after ``idle_s`` idle seconds each time, as a worker calls a node's
    model after waiting for the command (caches and clocks have cooled; measured ~1.8× a warm call)."""
    fn()
    samples = []
    for _ in range(max(repeats, 10)):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.mean(samples)


def time_collective(fn: Callable[[], object], repeats: int, window_s: float = WINDOW_S) -> float:
    """:func:`time_call` for a collective: every rank makes the same number of calls (rank 0 decides).
    Call it on every rank of an initialised ``torch.distributed`` group."""
    import torch.distributed as dist

    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    first = time.perf_counter() - t0
    more = torch.tensor([math.ceil(max(0.0, window_s - first) / max(first / repeats, 1e-9))])
    dist.broadcast(more, 0)
    for _ in range(int(more.item())):
        fn()
    return (time.perf_counter() - t0) / (repeats + int(more.item()))


def profile_row(op: str, seconds: float, **fields: Any) -> dict[str, Any]:
    """One profile row: ``op`` took ``seconds``; ``fields`` override the defaults (``batch`` and ``seq``
    0, ``group_size`` and ``count`` 1, ``flops`` 0.0, ``bytes`` 0) or add columns."""
    row = {"op": op, "batch": 0, "seq": 0, "group_size": 1, "count": 1, "flops": 0.0, "bytes": 0}
    row.update(fields)
    row["seconds"] = float(seconds)
    return row


def median_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The rows of repeated rounds of the same measurements (same rows, same order), each with its
    median seconds over the rounds.

    Raises:
        ValueError: the rounds differ in length.
    """
    return [
        {**same[0], "seconds": statistics.median(r["seconds"] for r in same)}
        for same in zip(*rounds, strict=True)
    ]


def append_rows(rows: Sequence[dict[str, Any]], out: str | Path) -> Path:
    """Append profile ``rows`` to the Parquet file ``out`` (created if missing); a column only some rows
    have (the probe's ``steps``) is null in the others. Returns its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = list(dict.fromkeys(k for row in rows for k in row))  # from_pylist reads the first row's keys
    table = pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows])
    path = Path(out)
    if path.exists():
        table = pa.concat_tables([pq.read_table(path), table], promote_options="default")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path
