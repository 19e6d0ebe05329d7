"""The dashboard's curve panels: training, preference, optimisation, asynchronous, agent and validation
metrics over iterations, one unit per plot (:mod:`rlflow.schedulers.records.metric_groups`).

Each plot sits in its own subfigure with its legend below it, outside the axes, so no legend covers a
curve. Every line of a plot has its own colour; a run's lines share a marker and line style; a line equal
to one drawn before it in the plot (two runs with the same reward) is drawn as hollow markers over it and
named ``(= other)`` in the legend.

Smoothing (``smoothing`` > 0) is TensorBoard's: a debiased exponential moving average (:func:`ema`) drawn
as the solid line, the raw values faint beneath it with their markers (their exact values show on hover
in the HTML page).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib as mpl
import numpy as np
from matplotlib.artist import Artist
from matplotlib.figure import FigureBase
from matplotlib.ticker import MaxNLocator

from rlflow.schedulers.records.dashboard_data import RunData
from rlflow.schedulers.records.metric_groups import SECTIONS, Plot, curve_plots
from rlflow.schedulers.records.panel import RUN_MARKERS, RUN_STYLES, Panel, legend_rows, outside_legend

__all__ = ["curve_columns", "curve_panels", "ema"]

_PLOT_IN = 2.3  # inches of one plot (title, axes, tick labels), its legend below it added
_LEGEND_LINE_IN = 0.15
_COLUMNS = 3


def ema(values: np.ndarray, weight: float) -> np.ndarray:
    """Debiased exponential moving average of ``values`` ``[n]`` in order (TensorBoard's smoothing):
    ``s_i = w·s_{i-1} + (1-w)·x_i`` from ``s_{-1} = 0``, divided by ``1 - w^(i+1)`` so the first values are
    not pulled towards 0. ``weight`` 0 returns the values; NaN stays out of the average.

    Raises:
        ValueError: ``weight`` outside [0, 1).
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must lie in [0, 1), got {weight}")
    values = np.asarray(values, dtype=np.float64)
    out = np.empty_like(values)
    last, steps = 0.0, 0
    for i, v in enumerate(values):
        if math.isfinite(v):
            last = last * weight + (1.0 - weight) * v
            steps += 1
        out[i] = last / (1.0 - weight**steps) if steps else v
    return out


def curve_columns(runs: Sequence[RunData]) -> list[str]:
    """Metric names any run logged a finite value of, in order of first appearance."""
    columns: dict[str, None] = {}
    for run in runs:
        for name in run.metrics.column_names:
            if name != "iteration" and run.column(name) is not None:
                columns.setdefault(name, None)
    return list(columns)


def _label(run: RunData, name: str, runs: Sequence[RunData]) -> str:
    return name if len(runs) == 1 else f"{run.name}: {name}"


def _labels(plot: Plot, runs: Sequence[RunData]) -> list[str]:
    return [_label(r, n, runs) for r in runs for n in plot.names if r.column(n) is not None]


def _same(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))


def _draw_plot(sub: FigureBase, plot: Plot, runs: Sequence[RunData], smoothing: float) -> None:
    ax = sub.subplots()
    series = [
        (i, _label(run, name, runs), found)
        for i, run in enumerate(runs)
        for name in plot.names
        if (found := run.column(name)) is not None
    ]
    cmap = mpl.colormaps["tab10"]
    handles: list[Artist] = []
    labels: list[str] = []
    drawn: list[tuple[str, tuple[np.ndarray, np.ndarray]]] = []
    for k, (i, label, (x, y)) in enumerate(series):
        colour = cmap(k % cmap.N)
        marker, style = RUN_MARKERS[i % len(RUN_MARKERS)], RUN_STYLES[i % len(RUN_STYLES)]
        same = next((other for other, xy in drawn if _same(xy, (x, y))), None)
        if same is not None:  # on top of an equal line: hollow, larger markers keep both visible
            label = f"{label} (= {same})"
            (line,) = ax.plot(
                x, y, color=colour, linestyle="none", marker=marker, ms=7, mfc="none", mew=1.3, zorder=3,
                label=label,
            )  # fmt: skip
        elif smoothing > 0:  # raw values faint (with markers: hover values), the average solid
            ax.plot(
                x, y, color=colour, linestyle=style, marker=marker, ms=2.5, lw=0.8, alpha=0.3, label=label
            )
            (line,) = ax.plot(x, ema(y, smoothing), color=colour, linestyle=style, lw=1.8, label=label)
        else:
            (line,) = ax.plot(x, y, color=colour, linestyle=style, marker=marker, ms=3, label=label)
        drawn.append((label, (x, y)))
        handles.append(line)
        labels.append(label)
    ax.set(title=plot.title, xlabel="iteration", ylabel=plot.unit)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    outside_legend(sub, handles, labels, "below")


def _section_panel(
    key: str, title: str, plots: list[Plot], runs: Sequence[RunData], smoothing: float
) -> Panel:
    ncols = min(_COLUMNS, len(plots))
    rows = [plots[r : r + ncols] for r in range(0, len(plots), ncols)]
    heights = [_PLOT_IN + _LEGEND_LINE_IN * max(legend_rows(_labels(p, runs)) for p in row) for row in rows]

    def draw(fig: FigureBase) -> None:
        grid = fig.subfigures(len(rows), ncols, height_ratios=heights, squeeze=False)
        for r, row in enumerate(rows):
            for c, plot in enumerate(row):
                _draw_plot(grid[r][c], plot, runs, smoothing)

    if smoothing > 0:
        title = f"{title} (EMA smoothing {smoothing:g}; raw values faint)"
    return Panel(key, title, sum(heights) + 0.2, draw)


def curve_panels(runs: Sequence[RunData], smoothing: float) -> list[Panel]:
    """One panel per section of :data:`~rlflow.schedulers.records.metric_groups.SECTIONS` the runs logged
    metrics of, in that order; ``smoothing`` in [0, 1) is the EMA weight (0: raw values only).

    Raises:
        ValueError: ``smoothing`` outside [0, 1).
    """
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must lie in [0, 1), got {smoothing}")
    plots = curve_plots(curve_columns(runs), len(runs))
    return [
        _section_panel(key, title, chosen, runs, smoothing)
        for key, title in SECTIONS
        if (chosen := [p for p in plots if p.section == key])
    ]
