"""The dashboard's panels: throughput and training charts drawn from run directories alone (matplotlib).

Panels (each drawn only when the runs hold its data):

- ``throughput``: tokens/s (``perf/throughput``), samples/s (``perf/samples_per_s``) and seconds per
  iteration (``timing_s/iteration``, else the trace's span of each iteration) over iterations;
- ``node_time``: seconds per node per iteration as stacked bars, reallocation and data transfer included
  (from the trace: the span first start -> last end over workers; else ``timing_s/<node>`` metrics); an
  iteration over ``CLIP_FACTOR`` times the median (a stall) is cut at the top and labelled with its total,
  so it does not flatten the others;
- ``gantt``: node executions per device for the chosen iterations coloured by node, beside the planner's
  predicted timeline (``predicted_trace.parquet``) when the run has one;
- the curve panels of :mod:`rlflow.schedulers.records.curves`: training (reward, KL, losses, clip fraction,
  entropy, response length), preference training (DPO, reward model), optimisation (gradient norm, learning
  rate), asynchronous RL (staleness), agent rollouts and validation, one unit per plot.

Several runs overlay (lines) or sit side by side (bars, timelines). Legends sit outside the plots (a
figure legend, ``loc="outside ..."``). Nodes have the same colour in every chart (:mod:`.colours`).

The data comes from :mod:`rlflow.schedulers.records.dashboard_data`; :mod:`rlflow.schedulers.records.render`
writes the panels to one HTML page or one PNG grid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.axes import Axes
from matplotlib.figure import FigureBase
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.records.colours import SPECIAL_COLOURS, node_colours
from rlflow.schedulers.records.curves import curve_panels
from rlflow.schedulers.records.dashboard_data import (
    DATA_TRANSFER,
    REALLOCATION,
    TOOL,
    RunData,
    category,
    category_seconds,
    iteration_seconds_from_trace,
    node_categories,
)
from rlflow.schedulers.records.panel import Panel, no_data, outside_legend, run_colour

__all__ = ["CLIP_FACTOR", "build_panels", "category_colours"]

CLIP_FACTOR: Final = 3.0  # per-node bars: an iteration over 3x the median one is cut at the top
_SPECIAL_HATCH: Final = {REALLOCATION: "//", DATA_TRANSFER: "..", TOOL: "xx"}


def category_colours(categories: Sequence[str]) -> dict[str, Any]:
    """A colour per category (:func:`~rlflow.schedulers.records.dashboard_data.category`): a node's from its
    name alone (the same in every run), grey for the others."""
    return node_colours(categories) | SPECIAL_COLOURS


# --- panels ---------------------------------------------------------------------------------------


def _throughput_panel(runs: Sequence[RunData]) -> Panel | None:
    series: list[tuple[str, str, str]] = [
        ("perf/throughput", "Throughput", "tokens / s"),
        ("perf/samples_per_s", "Sample throughput", "samples / s"),
        ("timing_s/iteration", "Time per iteration", "seconds"),
    ]

    def data(run: RunData, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        found = run.column(metric)
        if found is None and metric == "timing_s/iteration":
            found = iteration_seconds_from_trace(run.trace)
        return found

    if not any(data(r, m) is not None for r in runs for m, _, _ in series):
        return None

    def draw(fig: FigureBase) -> None:
        axes = fig.subplots(1, 3)
        handles: dict[str, Any] = {}  # run name -> a line of it, for the one legend of the runs
        for ax, (metric, title, unit) in zip(axes, series, strict=True):
            drawn = False
            for i, run in enumerate(runs):
                found = data(run, metric)
                if found is not None:
                    (line,) = ax.plot(*found, marker="o", ms=3, color=run_colour(i), label=run.name)
                    handles.setdefault(run.name, line)
                    drawn = True
            ax.set(title=title, xlabel="iteration", ylabel=unit)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if not drawn:
                no_data(ax)
        if len(runs) > 1:
            outside_legend(fig, list(handles.values()), list(handles), "right")

    return Panel("throughput", "Throughput and time per iteration", 3.2, draw)


def _node_time_panel(runs: Sequence[RunData]) -> Panel | None:
    categories = node_categories(runs)
    colours = category_colours(categories)
    per_run: list[dict[int, dict[str, float]]] = []
    for run in runs:
        spans = category_seconds(run.trace)
        if not spans:  # no trace: fall back to the controller's per-node timings
            for name in run.metrics.column_names:
                if name.startswith("timing_s/") and name != "timing_s/iteration":
                    found = run.column(name)
                    for it, sec in zip(*(found or ((), ())), strict=True):
                        spans.setdefault(int(it), {})[name.removeprefix("timing_s/")] = float(sec)
        per_run.append(spans)
    if not any(per_run):
        return None

    totals = np.array([sum(per_it.values()) for spans in per_run for per_it in spans.values()])
    # A stalled iteration would flatten every other bar: cut the axis above the ordinary ones.
    ordinary = totals[totals <= CLIP_FACTOR * np.median(totals)]
    top = 1.15 * float(ordinary.max()) if len(ordinary) < len(totals) else None

    def draw(fig: FigureBase) -> None:
        axes = np.atleast_1d(fig.subplots(1, len(runs), sharey=True, squeeze=False)[0])
        used: set[str] = set()
        for ax, run, spans in zip(axes, runs, per_run, strict=True):
            ax.set(title=run.name, xlabel="iteration")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(axis="y", alpha=0.3)
            if not spans:
                no_data(ax)
                continue
            iterations = np.array(sorted(spans))
            bottom = np.zeros(len(iterations))
            for cat in categories:
                heights = np.array([spans[it].get(cat, 0.0) for it in iterations])
                if not heights.any():
                    continue
                used.add(cat)
                ax.bar(
                    iterations,
                    heights,
                    bottom=bottom,
                    width=0.8,
                    color=colours[cat],
                    hatch=_SPECIAL_HATCH.get(cat),
                    edgecolor="white",
                    linewidth=0.3,
                    label=cat,
                )
                bottom += heights
            if top is not None:
                for it, total in zip(iterations, bottom, strict=True):
                    if total > top:
                        ax.annotate(
                            f"{total:.3g} s ↑", (it, top), xytext=(0, -2), textcoords="offset points",
                            ha="center", va="top", fontsize="x-small", rotation=90,
                            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "0.5", "lw": 0.5},
                        )  # fmt: skip
        if top is not None:
            axes[0].set_ylim(0, top)
            axes[0].set_ylabel(f"seconds (cut at {top:.3g}: bars labelled)")
        else:
            axes[0].set_ylabel("seconds")
        handles = [
            Patch(facecolor=colours[c], hatch=_SPECIAL_HATCH.get(c), label=c) for c in categories if c in used
        ]
        outside_legend(fig, handles, [str(h.get_label()) for h in handles], "right")

    return Panel("node_time", "Time per node per iteration", 3.4, draw)


def _select_iterations(run: RunData, iterations: tuple[int, int] | None) -> list[int]:
    """The traced iterations of ``run`` in ``iterations`` (inclusive; default: the last one).

    Raises:
        DataError: ``iterations`` reaches beyond the iterations the run's trace holds (named).
    """
    present = sorted(set(run.trace.column("iteration").to_pylist()))
    if iterations is None:
        return present[-1:]
    lo, hi = iterations
    if not present or lo < present[0] or hi > present[-1]:
        asked = f"{lo}-{hi}" if lo != hi else str(lo)
        has = f"iterations {present[0]}-{present[-1]}" if present else "no iterations yet"
        raise DataError(f"--iterations {asked}: run '{run.name}' has traced {has}")
    return [it for it in present if lo <= it <= hi]


def _gantt(ax: Axes, rows: pa.Table, colours: dict[str, Any], title: str) -> float:
    """Draw a timeline per device; returns the time span drawn (seconds)."""
    ax.set(title=title, xlabel="seconds from iteration start")
    if rows.num_rows == 0:
        no_data(ax)
        return 0.0
    start = rows.column("start_s").to_numpy()
    t0 = float(start.min())
    devices = sorted(set(rows.column("device").to_pylist()))
    lane = {d: i for i, d in enumerate(devices)}
    for node, kind, device, s, e in zip(
        rows.column("node").to_pylist(),
        rows.column("kind").to_pylist(),
        rows.column("device").to_pylist(),
        rows.column("start_s").to_pylist(),
        rows.column("end_s").to_pylist(),
        strict=True,
    ):
        cat = category(kind, node)
        half = 0.2 if kind == TOOL else 0.4  # a tool phase sits inside its node's bar, which stays visible
        # Zero-length executions still get a sliver so they stay visible.
        ax.broken_barh(
            [(s - t0, max(e - s, 1e-9))],
            (lane[device] - half, 2 * half),
            facecolors=colours[cat],
            hatch=_SPECIAL_HATCH.get(cat),
            edgecolor="white",
            linewidth=0.3,
        )
    iteration_starts = rows.group_by("iteration").aggregate([("start_s", "min")]).column("start_s_min")
    for it_start in sorted(iteration_starts.to_pylist())[1:]:
        ax.axvline(it_start - t0, color="0.3", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(devices)), [f"device {d}" for d in devices])
    ax.set_ylim(len(devices) - 0.5, -0.5)
    ax.grid(axis="x", alpha=0.3)
    return float(rows.column("end_s").to_numpy().max()) - t0


def _gantt_panel(runs: Sequence[RunData], iterations: tuple[int, int] | None) -> Panel | None:
    chosen = [_select_iterations(run, iterations) for run in runs]
    if not any(chosen):
        return None
    categories = node_categories(runs)
    colours = category_colours(categories)
    with_prediction = any(r.predicted is not None and r.predicted.num_rows for r in runs)
    n_devices = max(
        (len(set(r.trace.column("device").to_pylist())) for r in runs if r.trace.num_rows), default=1
    )

    def predicted_rows(run: RunData, its: list[int]) -> pa.Table | None:
        if run.predicted is None or run.predicted.num_rows == 0:
            return None
        pred = run.predicted
        mask = pc.is_in(pred.column("iteration"), pa.array(its, pa.int64()))
        matching = pred.filter(mask)
        if matching.num_rows:
            return matching
        # A plan predicts one steady-state iteration: show it as is.
        first = min(pred.column("iteration").to_pylist())
        return pred.filter(pc.equal(pred.column("iteration"), first))

    def draw(fig: FigureBase) -> None:
        ncols = 2 if with_prediction else 1
        grid = fig.subplots(len(runs), ncols, squeeze=False)
        spans: list[float] = []
        for row, (run, its) in enumerate(zip(runs, chosen, strict=True)):
            label = ", ".join(map(str, its)) if len(its) <= 4 else f"{its[0]}-{its[-1]}"
            actual = run.trace.filter(pc.is_in(run.trace.column("iteration"), pa.array(its, pa.int64())))
            spans.append(_gantt(grid[row][0], actual, colours, f"{run.name}: measured, iteration {label}"))
            if with_prediction:
                pred = predicted_rows(run, its)
                ax = grid[row][1]
                if pred is None:
                    ax.set_title(f"{run.name}: no predicted timeline")
                    ax.axis("off")
                else:
                    spans.append(_gantt(ax, pred, colours, f"{run.name}: predicted by the planner"))
        # One time scale for every timeline, so runs and predictions compare by eye.
        hi = max(spans, default=0.0) * 1.02 or 1.0
        for ax in grid.ravel():
            if ax.axison:
                ax.set_xlim(0, hi)
        used = {
            category(k, n)
            for r in runs
            for k, n in zip(
                r.trace.column("kind").to_pylist(), r.trace.column("node").to_pylist(), strict=True
            )
        }
        handles = [
            Patch(facecolor=colours[c], hatch=_SPECIAL_HATCH.get(c), label=c) for c in categories if c in used
        ]
        outside_legend(fig, handles, [str(h.get_label()) for h in handles], "right")

    height = len(runs) * (0.9 + 0.35 * n_devices) + 0.6
    return Panel("gantt", "Timeline per device", height, draw)


def build_panels(
    runs: Sequence[RunData], iterations: tuple[int, int] | None = None, smoothing: float = 0.0
) -> list[Panel]:
    """The panels that the runs have data for, in dashboard order.

    Args:
        runs: loaded runs (:func:`load_runs`).
        iterations: inclusive iteration range shown in the timeline; ``None`` = each run's last one.
        smoothing: EMA weight in [0, 1) of the curve panels (:func:`~rlflow.schedulers.records.curves.ema`;
            0: raw values only).

    Raises:
        DataError: ``iterations`` reaches beyond what a run's trace holds.
        ValueError: ``smoothing`` outside [0, 1).
    """
    candidates = (_throughput_panel(runs), _node_time_panel(runs), _gantt_panel(runs, iterations))
    return [p for p in candidates if p is not None] + curve_panels(runs, smoothing)
