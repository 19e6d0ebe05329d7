"""What a dashboard reads from run directories, and the series it draws, as plain values.

:func:`load_runs` reads each run's metrics, trace, predicted trace and status (:class:`RunData`); the
functions below shape them: seconds per iteration and category (:func:`category_seconds`: a node, or the
``reallocation``, ``data_transfer`` and ``tool`` rows), seconds per iteration from the trace, the node
categories of the runs in order. The charts drawn from them are :mod:`rlflow.schedulers.records.charts`
(which curves share a plot: :mod:`rlflow.schedulers.records.metric_groups`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.records.rundir import (
    METRICS_DIR,
    STATUS_FILE,
    TRACE_DIR,
    read_metrics,
    read_predicted_trace,
    read_status,
    read_trace,
)

__all__ = [
    "DATA_TRANSFER",
    "REALLOCATION",
    "TOOL",
    "RunData",
    "category",
    "category_seconds",
    "iteration_seconds_from_trace",
    "load_runs",
    "node_categories",
    "parse_iterations",
]

REALLOCATION: Final = "reallocation"
DATA_TRANSFER: Final = "data_transfer"
TOOL: Final = "tool"  # an agent node's environment steps, inside the node's own rows


@dataclass
class RunData:
    """Everything the dashboard reads from one run directory."""

    path: Path
    name: str
    metrics: pa.Table
    trace: pa.Table
    predicted: pa.Table | None
    status: dict[str, Any] | None

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(iterations, values) of a metric with nulls/NaN dropped, or ``None`` if never logged."""
        if name not in self.metrics.column_names:
            return None
        x = self.metrics.column("iteration").to_numpy().astype(np.int64)
        y = self.metrics.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        keep = np.isfinite(y)
        return (x[keep], y[keep]) if keep.any() else None


def load_runs(paths: Sequence[str | os.PathLike[str]]) -> list[RunData]:
    """Read run directories.

    Raises:
        DataError: a path is not a directory or holds no run records (status, metrics or trace).
    """
    runs = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise DataError(f"run directory {str(path)!r} does not exist or is not a directory")
        if not any((path / p).exists() for p in (STATUS_FILE, METRICS_DIR, TRACE_DIR)):
            raise DataError(
                f"{str(path)!r} is not a run directory (no {STATUS_FILE}, {METRICS_DIR}/ or {TRACE_DIR}/)"
            )
        runs.append(
            RunData(
                path,
                path.resolve().name,
                read_metrics(path),
                read_trace(path),
                read_predicted_trace(path),
                read_status(path),
            )
        )
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # same base name: fall back to the paths as given
        for run, raw in zip(runs, paths, strict=True):
            run.name = str(raw)
    return runs


def parse_iterations(text: str) -> tuple[int, int]:
    """``"a-b"`` -> (a, b) inclusive, ``"a"`` -> (a, a).

    Raises:
        ValueError: not of that form, negative, or a > b.
    """
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        raise ValueError(f"iterations must look like 'A-B' or 'A' (non-negative integers), got {text!r}")
    lo = int(match.group(1))
    hi = int(match.group(2)) if match.group(2) is not None else lo
    if lo > hi:
        raise ValueError(f"iterations {text!r}: start {lo} is after end {hi}")
    return lo, hi


# --- data shaping ---------------------------------------------------------------------------------


def category(kind: str, node: str) -> str:
    """The category of a trace row: its node for kind ``node``, else its kind (``reallocation``, ...)."""
    return node if kind == "node" else kind


def category_seconds(trace: pa.Table) -> dict[int, dict[str, float]]:
    """iteration -> category -> seconds. A node's time in an iteration is its span over workers
    (first start to last end); reallocations and transfers add up their per-node spans. Tool phases lie
    inside their node's span and are left out (they would count that time twice)."""
    trace = trace.filter(pc.field("kind") != TOOL)
    if trace.num_rows == 0:
        return {}
    grouped = trace.group_by(["iteration", "kind", "node"]).aggregate([("start_s", "min"), ("end_s", "max")])
    out: dict[int, dict[str, float]] = {}
    for it, kind, node, start, end in zip(
        grouped.column("iteration").to_pylist(),
        grouped.column("kind").to_pylist(),
        grouped.column("node").to_pylist(),
        grouped.column("start_s_min").to_pylist(),
        grouped.column("end_s_max").to_pylist(),
        strict=True,
    ):
        per_iter = out.setdefault(int(it), {})
        cat = category(kind, node)
        per_iter[cat] = per_iter.get(cat, 0.0) + float(end - start)
    return out


def iteration_seconds_from_trace(trace: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    """(iterations, seconds) of each traced iteration: its first start to its last end; ``None`` for an
    empty trace."""
    if trace.num_rows == 0:
        return None
    grouped = trace.group_by("iteration").aggregate([("start_s", "min"), ("end_s", "max")])
    order = np.argsort(grouped.column("iteration").to_numpy())
    x = grouped.column("iteration").to_numpy()[order]
    y = (grouped.column("end_s_max").to_numpy() - grouped.column("start_s_min").to_numpy())[order]
    return x, y


def node_categories(runs: Sequence[RunData]) -> list[str]:
    """Node names in order of first execution, then reallocation, data transfer and tool phases."""
    seen: dict[str, None] = {}
    for run in runs:
        for kind, node in zip(
            run.trace.column("kind").to_pylist(), run.trace.column("node").to_pylist(), strict=True
        ):
            if kind == "node":
                seen.setdefault(node, None)
        for name in run.metrics.column_names:
            if name.startswith("timing_s/") and name != "timing_s/iteration":
                seen.setdefault(name.removeprefix("timing_s/"), None)
    return [*seen, REALLOCATION, DATA_TRANSFER, TOOL]
