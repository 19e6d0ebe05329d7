"""Throughput and training dashboards drawn from run directories alone (matplotlib).

Panels (each drawn only when the runs hold its data):

- ``throughput``: tokens/s (``perf/throughput``), samples/s (``perf/samples_per_s``) and seconds per
  iteration (``timing_s/iteration``, else the trace's span of each iteration) over iterations;
- ``node_time``: seconds per node per iteration as stacked bars, reallocation and data transfer included
  (from the trace: the span first start -> last end over workers; else ``timing_s/<node>`` metrics); an
  iteration over ``CLIP_FACTOR`` times the median (a stall) is cut at the top and labelled with its total,
  so it does not flatten the others;
- ``gantt``: node executions per device for the chosen iterations coloured by node, beside the planner's
  predicted timeline (``predicted_trace.parquet``) when the run has one;
- ``training``: reward, KL, losses, clip fraction, entropy, response length, validation metrics.

Several runs overlay (lines) or sit side by side (bars, timelines). Every line of a panel has its own
colour; a run's lines share a marker and line style; a line equal to one drawn before it in the panel
(``val/score/mean`` and ``val/accuracy`` of an exact-match reward) is drawn as hollow markers over it and
named ``(= other)`` in the legend. Nodes have the same colour in every chart (:mod:`.colours`).
Output is either one self-contained HTML file (plots inlined as SVG, where every point and bar shows its
exact value on hover through an SVG ``<title>``; a small inline script; nothing fetched from the network)
or one PNG grid.
"""

from __future__ import annotations

import contextlib
import html
import io
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import matplotlib as mpl
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from matplotlib.axes import Axes
from matplotlib.container import BarContainer
from matplotlib.figure import Figure, FigureBase
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator
from matplotlib.transforms import Bbox

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.records.colours import SPECIAL_COLOURS, node_colours
from rlflow.schedulers.records.rundir import (
    METRICS_DIR,
    STATUS_FILE,
    TRACE_DIR,
    read_metrics,
    read_predicted_trace,
    read_status,
    read_trace,
)
from rlflow.schedulers.records.telemetry import KL_METRICS

__all__ = [
    "TRAINING_GROUPS",
    "Panel",
    "RunData",
    "build_panels",
    "load_runs",
    "parse_iterations",
    "render_dashboard",
    "render_html",
    "render_png",
]

WIDTH_IN: Final = 13.0
_LOSS_RE: Final = re.compile(r"loss")
# (panel title, metric names); "Other losses" and "Validation" are filled by pattern below.
TRAINING_GROUPS: Final[tuple[tuple[str, tuple[str, ...]], ...]] = (
    ("Reward", ("critic/score/mean", "critic/rewards/mean")),
    ("KL", KL_METRICS),
    ("Policy loss", ("actor/pg_loss",)),
    ("Value loss", ("critic/vf_loss",)),
    ("SFT loss (NLL)", ("actor/nll",)),
    ("Clip fraction", ("actor/pg_clipfrac", "critic/vf_clipfrac")),
    ("Entropy", ("actor/entropy",)),
    ("Response length", ("response_length/mean",)),
    ("Agent turns and tool calls", ("num_turns/mean", "tool_call_counts/mean")),
    ("Environment errors", ("env/error_ratio",)),
)
REALLOCATION: Final = "reallocation"
DATA_TRANSFER: Final = "data_transfer"
TOOL: Final = "tool"  # an agent node's environment steps, inside the node's own rows
CLIP_FACTOR: Final = 3.0  # per-node bars: an iteration over 3x the median one is cut at the top
_RUN_MARKERS: Final = ("o", "s", "^", "D", "v", "P")
_RUN_STYLES: Final = ("-", "--", "-.", ":")
_SPECIAL_HATCH: Final = {REALLOCATION: "//", DATA_TRANSFER: "..", TOOL: "xx"}


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


def _category(kind: str, node: str) -> str:
    return node if kind == "node" else kind


def _spans(trace: pa.Table) -> dict[int, dict[str, float]]:
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
        cat = _category(kind, node)
        per_iter[cat] = per_iter.get(cat, 0.0) + float(end - start)
    return out


def _iteration_seconds_from_trace(trace: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    if trace.num_rows == 0:
        return None
    grouped = trace.group_by("iteration").aggregate([("start_s", "min"), ("end_s", "max")])
    order = np.argsort(grouped.column("iteration").to_numpy())
    x = grouped.column("iteration").to_numpy()[order]
    y = (grouped.column("end_s_max").to_numpy() - grouped.column("start_s_min").to_numpy())[order]
    return x, y


def _node_categories(runs: Sequence[RunData]) -> list[str]:
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


def _colours(categories: Sequence[str]) -> dict[str, Any]:
    """A colour per node from its name alone (the same in every run), grey for the others."""
    return node_colours(categories) | SPECIAL_COLOURS


def _run_colour(index: int) -> Any:
    return mpl.colormaps["tab10"](index % 10)


# --- panels ---------------------------------------------------------------------------------------


@dataclass
class Panel:
    """One plot of the dashboard: ``draw`` fills a figure (or subfigure) of ``height_in`` inches."""

    key: str
    title: str
    height_in: float
    draw: Callable[[FigureBase], None] = field(repr=False)


def _no_data(ax: Axes, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.5")


def _throughput_panel(runs: Sequence[RunData]) -> Panel | None:
    series: list[tuple[str, str, str]] = [
        ("perf/throughput", "Throughput", "tokens / s"),
        ("perf/samples_per_s", "Sample throughput", "samples / s"),
        ("timing_s/iteration", "Time per iteration", "seconds"),
    ]

    def data(run: RunData, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
        found = run.column(metric)
        if found is None and metric == "timing_s/iteration":
            found = _iteration_seconds_from_trace(run.trace)
        return found

    if not any(data(r, m) is not None for r in runs for m, _, _ in series):
        return None

    def draw(fig: FigureBase) -> None:
        axes = fig.subplots(1, 3)
        for ax, (metric, title, unit) in zip(axes, series, strict=True):
            drawn = False
            for i, run in enumerate(runs):
                found = data(run, metric)
                if found is not None:
                    ax.plot(*found, marker="o", ms=3, color=_run_colour(i), label=run.name)
                    drawn = True
            ax.set(title=title, xlabel="iteration", ylabel=unit)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            if not drawn:
                _no_data(ax)
            elif len(runs) > 1:
                ax.legend(fontsize="small")

    return Panel("throughput", "Throughput and time per iteration", 3.2, draw)


def _node_time_panel(runs: Sequence[RunData]) -> Panel | None:
    categories = _node_categories(runs)
    colours = _colours(categories)
    per_run: list[dict[int, dict[str, float]]] = []
    for run in runs:
        spans = _spans(run.trace)
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
                _no_data(ax)
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
        fig.legend(handles=handles, loc="outside right upper", fontsize="small")

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
        _no_data(ax)
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
        cat = _category(kind, node)
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
    categories = _node_categories(runs)
    colours = _colours(categories)
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
            _category(k, n)
            for r in runs
            for k, n in zip(
                r.trace.column("kind").to_pylist(), r.trace.column("node").to_pylist(), strict=True
            )
        }
        handles = [
            Patch(facecolor=colours[c], hatch=_SPECIAL_HATCH.get(c), label=c) for c in categories if c in used
        ]
        fig.legend(handles=handles, loc="outside right upper", fontsize="small")

    height = len(runs) * (0.9 + 0.35 * n_devices) + 0.6
    return Panel("gantt", "Timeline per device", height, draw)


def _training_groups(runs: Sequence[RunData]) -> list[tuple[str, list[str]]]:
    columns: dict[str, None] = {}
    for run in runs:
        for name in run.metrics.column_names:
            if name != "iteration" and any(r.column(name) is not None for r in runs):
                columns.setdefault(name, None)
    groups: list[tuple[str, list[str]]] = []
    used: set[str] = set()
    for title, names in TRAINING_GROUPS:
        present = [n for n in names if n in columns]
        if present:
            groups.append((title, present))
            used.update(present)
    other_losses = [n for n in columns if _LOSS_RE.search(n) and n not in used]
    if other_losses:
        groups.append(("Other losses", other_losses))
        used.update(other_losses)
    validation = [n for n in columns if n.startswith("val/") and n not in used]
    # Lengths (tokens) and scores/accuracies (~0-1) get separate axes so neither flattens the other.
    lengths = [n for n in validation if "length" in n]
    scores = [n for n in validation if n not in lengths]
    if scores:
        groups.append(("Validation", scores))
    if lengths:
        groups.append(("Validation response length", lengths))
    return groups


def _training_panel(runs: Sequence[RunData]) -> Panel | None:
    groups = _training_groups(runs)
    if not groups:
        return None
    ncols = min(3, len(groups))
    nrows = math.ceil(len(groups) / ncols)

    def draw(fig: FigureBase) -> None:
        axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
        for ax, (title, names) in zip(axes, groups, strict=False):
            series = [
                (i, name if len(runs) == 1 else f"{run.name}: {name}", found)
                for i, run in enumerate(runs)
                for name in names
                if (found := run.column(name)) is not None
            ]
            cmap = mpl.colormaps["tab10" if len(series) <= 10 else "tab20"]
            drawn: list[tuple[str, tuple[np.ndarray, np.ndarray]]] = []
            for k, (i, label, found) in enumerate(series):
                marker = _RUN_MARKERS[i % len(_RUN_MARKERS)]
                same = next((other for other, xy in drawn if _same_series(xy, found)), None)
                if same is None:
                    ax.plot(
                        *found, color=cmap(k % cmap.N), linestyle=_RUN_STYLES[i % len(_RUN_STYLES)],
                        marker=marker, ms=3, label=label,
                    )  # fmt: skip
                else:  # on top of an equal line: hollow, larger markers keep both visible
                    ax.plot(
                        *found, color=cmap(k % cmap.N), linestyle="none", marker=marker, ms=7, mfc="none",
                        mew=1.3, zorder=3, label=f"{label} (= {same})",
                    )  # fmt: skip
                drawn.append((label, found))
            ax.set(title=title, xlabel="iteration")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize="x-small")
        for ax in axes[len(groups) :]:
            ax.axis("off")

    return Panel("training", "Training curves", 2.8 * nrows + 0.3, draw)


def _same_series(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> bool:
    return bool(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))


def build_panels(runs: Sequence[RunData], iterations: tuple[int, int] | None = None) -> list[Panel]:
    """The panels that the runs have data for, in dashboard order.

    Args:
        runs: loaded runs (:func:`load_runs`).
        iterations: inclusive iteration range shown in the timeline; ``None`` = each run's last one.

    Raises:
        DataError: ``iterations`` reaches beyond what a run's trace holds.
    """
    candidates = (
        _throughput_panel(runs),
        _node_time_panel(runs),
        _gantt_panel(runs, iterations),
        _training_panel(runs),
    )
    return [p for p in candidates if p is not None]


# --- rendering ------------------------------------------------------------------------------------


def _rc() -> contextlib.AbstractContextManager[None]:
    # Text as paths (no font needed offline); a fixed hash salt makes the SVG ids reproducible.
    return mpl.rc_context({"svg.fonttype": "path", "svg.hashsalt": "rlflow", "font.size": 9})


def _figure(height_in: float) -> Figure:
    return Figure(figsize=(WIDTH_IN, height_in), layout="constrained")


def render_png(panels: Sequence[Panel], out: str | os.PathLike[str], dpi: int = 100) -> None:
    """All panels in one figure grid, saved as PNG (Agg)."""
    with _rc():
        heights = [p.height_in + 0.4 for p in panels]
        fig = _figure(sum(heights))
        subfigs = fig.subfigures(len(panels), 1, height_ratios=heights, squeeze=False)[:, 0]
        for sub, panel in zip(subfigs, panels, strict=True):
            sub.suptitle(panel.title, fontweight="bold")
            panel.draw(sub)
        fig.savefig(out, format="png", dpi=dpi)


def _hover_targets(fig: Figure) -> list[str]:
    """Invisible SVG shapes over every marker of a line and every bar, each with a ``<title>`` holding the
    exact value (a browser shows it on hover); markers at one spot (equal series) share one shape that
    lists them all. Call after the figure is drawn (its layout is final)."""
    scale = 72.0 / fig.dpi  # display pixels -> SVG points (the SVG's user units)
    height_pt = fig.get_figheight() * 72.0
    targets: list[str] = []
    points: dict[tuple[float, float], list[str]] = {}

    def title(text: str) -> str:
        return f"<title>{html.escape(text)}</title>"

    for ax in fig.axes:
        head = ax.get_title()
        for line in ax.get_lines():
            label = str(line.get_label())
            if label.startswith("_") or line.get_marker() in (None, "", "None", " "):
                continue
            data = np.asarray(line.get_xydata(), dtype=np.float64)
            for (x, y), (px, py) in zip(data, ax.transData.transform(data), strict=True):
                if ax.bbox.contains(px, py):
                    spot = (round(px * scale, 2), round(height_pt - py * scale, 2))
                    points.setdefault(spot, []).append(f"{head}: {label}, iteration {x:g}: {y:.6g}")
        for container in ax.containers:
            if not isinstance(container, BarContainer):
                continue
            for rect in container.patches:
                box = Bbox.intersection(rect.get_window_extent(), ax.bbox)
                if box is None or rect.get_height() <= 0:
                    continue
                it = rect.get_x() + rect.get_width() / 2
                text = f"{head}: {container.get_label()}, iteration {it:g}: {rect.get_height():.6g} s"
                targets.append(
                    f'<rect x="{box.x0 * scale:.2f}" y="{height_pt - box.y1 * scale:.2f}" '
                    f'width="{box.width * scale:.2f}" height="{box.height * scale:.2f}" '
                    f'data-hover="bar">{title(text)}</rect>'
                )
    for (cx, cy), texts in points.items():
        targets.append(
            f'<circle cx="{cx:.2f}" cy="{cy:.2f}" r="4" data-hover="point">'
            f"{title(chr(10).join(texts))}</circle>"
        )
    return targets


def _svg(panel: Panel) -> str:
    with _rc():
        fig = _figure(panel.height_in)
        panel.draw(fig)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
        targets = _hover_targets(fig)
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # drop the XML declaration and DOCTYPE: invalid inside HTML
    end = text.rindex("</svg>")
    overlay = '<g class="hover-values">\n' + "\n".join(targets) + "\n</g>\n"
    return text[:end] + overlay + text[end:]


_HEAD_SCRIPT: Final = """
window.rlflowErrors = [];
window.addEventListener("error", function (event) {
  var text = (event.message || "error") + " at " + (event.filename || "?") + ":" + (event.lineno || 0);
  window.rlflowErrors.push(text);
  var box = document.getElementById("js-errors");
  if (box) { box.textContent += text + "\\n"; box.hidden = false; }
});
"""

_BODY_SCRIPT: Final = """
(function () {
  var errors = document.getElementById("js-errors");
  window.rlflowErrors.forEach(function (t) { errors.textContent += t + "\\n"; errors.hidden = false; });
  document.querySelectorAll("button.toggle").forEach(function (button) {
    button.addEventListener("click", function () {
      var fig = document.getElementById(button.dataset.target);
      fig.hidden = !fig.hidden;
      button.textContent = fig.hidden ? "show" : "hide";
    });
  });
  var figures = document.querySelectorAll("figure.plot"), rendered = 0;
  figures.forEach(function (fig) {
    var svg = fig.querySelector("svg");
    var box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    fig.dataset.width = String(Math.round(box.width));
    fig.dataset.height = String(Math.round(box.height));
    if (box.width > 0 && box.height > 0) { fig.dataset.rendered = "1"; rendered += 1; }
  });
  // Hover values: count them, and check that the first of each plot is what the pointer meets there.
  figures.forEach(function (fig) {
    var targets = fig.querySelectorAll("[data-hover]");
    fig.dataset.hovers = String(targets.length);
    if (!targets.length) { return; }
    targets[0].scrollIntoView({block: "center"});
    var r = targets[0].getBoundingClientRect();
    var hit = document.elementFromPoint(r.left + r.width / 2, r.top + r.height / 2);
    fig.dataset.hoverHit = hit === targets[0] ? "1" : "0";
    fig.dataset.hoverTitle = targets[0].querySelector("title").textContent;
  });
  window.scrollTo(0, 0);
  document.body.dataset.plots = String(figures.length);
  document.body.dataset.plotsRendered = String(rendered);
  document.body.dataset.scriptsRan = "1";
})();
"""

_STYLE: Final = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1em; }
td, th { border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: left; }
figure.plot { margin: 0; }
figure.plot svg { max-width: 100%; height: auto; }
#js-errors { color: #b00; }
button.toggle { margin-left: 1em; font-size: 0.7em; }
g.hover-values [data-hover] { fill: #000; fill-opacity: 0; }
g.hover-values [data-hover]:hover { fill-opacity: 0.2; }
"""

_SUMMARY_METRICS: Final = ("critic/score/mean", "perf/throughput", "timing_s/iteration", "val/accuracy")


def _summary_rows(runs: Sequence[RunData]) -> str:
    head = "".join(
        f"<th>{html.escape(h)}</th>" for h in ("run", "path", "state", "iteration", *_SUMMARY_METRICS)
    )
    lines = [f"<tr>{head}</tr>"]
    for run in runs:
        status = run.status or {}
        cells = [run.name, str(run.path), str(status.get("state", "?")), str(status.get("iteration", "?"))]
        for name in _SUMMARY_METRICS:
            found = run.column(name)
            cells.append(f"{found[1][-1]:.4g}" if found is not None else "")
        lines.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines)


def render_html(runs: Sequence[RunData], panels: Sequence[Panel], out: str | os.PathLike[str]) -> None:
    """One self-contained HTML file: inline SVG plots, inline CSS and script, no external resource."""
    sections = []
    for panel in panels:
        fid = f"plot-{panel.key}"
        sections.append(
            f"<section><h2>{html.escape(panel.title)}"
            f'<button class="toggle" data-target="{fid}">hide</button></h2>\n'
            f'<figure class="plot" id="{fid}" data-plot="{panel.key}">\n{_svg(panel)}\n</figure></section>'
        )
    title = "rlflow dashboard: " + ", ".join(r.name for r in runs)
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>{_STYLE}</style>
<script>{_HEAD_SCRIPT}</script>
</head>
<body>
<h1>{html.escape(title)}</h1>
<pre id="js-errors" hidden></pre>
<table>
{_summary_rows(runs)}
</table>
{chr(10).join(sections)}
<script>{_BODY_SCRIPT}</script>
</body>
</html>
"""
    Path(out).write_text(page, encoding="utf-8")


def render_dashboard(
    run_dirs: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    iterations: tuple[int, int] | None = None,
) -> Path:
    """Draw the dashboard of one or more runs into ``out`` (``.html`` or ``.png``).

    Args:
        run_dirs: run directories; several overlay.
        out: output file; its suffix picks the format.
        iterations: inclusive range of iterations for the timeline (default: each run's last).

    Raises:
        ValueError: ``out`` is neither ``.html`` nor ``.png``.
        DataError: a run directory is missing, ``iterations`` reaches beyond what a run's trace holds, or
            the runs hold nothing to draw.
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise ValueError(f"dashboard output {str(out)!r}: use a .html or .png file name")
    runs = load_runs(run_dirs)
    panels = build_panels(runs, iterations)
    if not panels:
        raise DataError(
            "nothing to draw: the run directories "
            + ", ".join(repr(str(r.path)) for r in runs)
            + " have no metrics and no trace yet"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".png":
        render_png(panels, out)
    else:
        render_html(runs, panels, out)
    return out
