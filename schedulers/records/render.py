"""Dashboards written out: the panels of :mod:`rlflow.schedulers.records.charts` as one self-contained
HTML file or one PNG grid (``rlflow dashboard``).

The HTML inlines every plot as SVG, where every point and bar shows its exact value on hover through an SVG
``<title>``, with a small inline script and nothing fetched from the network; a table above the plots sums
up each run (state, last iteration, a few metrics).
"""

from __future__ import annotations

import contextlib
import html
import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import matplotlib as mpl
import numpy as np
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.records.charts import build_panels
from rlflow.schedulers.records.dashboard_data import RunData, load_runs
from rlflow.schedulers.records.panel import Panel
from rlflow.schedulers.records.run_status import restart_count, with_restarts

__all__ = ["WIDTH_IN", "panel_svg", "render_dashboard", "render_html", "render_png"]

WIDTH_IN: Final = 13.0


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


def panel_svg(panel: Panel) -> str:
    """One panel as an inline ``<svg>`` element (no XML declaration), :data:`WIDTH_IN` wide, with the hover
    values of :func:`render_html` over its markers and bars."""
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
        state = with_restarts(str(status.get("state", "?")), restart_count(status))
        cells = [run.name, str(run.path), state, str(status.get("iteration", "?"))]
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
            f'<figure class="plot" id="{fid}" data-plot="{panel.key}">\n'
            f"{panel_svg(panel)}\n</figure></section>"
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
    smoothing: float = 0.0,
) -> Path:
    """Draw the dashboard of one or more runs into ``out`` (``.html`` or ``.png``).

    Args:
        run_dirs: run directories; several overlay.
        out: output file; its suffix picks the format.
        iterations: inclusive range of iterations for the timeline (default: each run's last).
        smoothing: EMA weight in [0, 1) of the curves (TensorBoard's smoothing; 0: raw values only).

    Raises:
        ValueError: ``out`` is neither ``.html`` nor ``.png``, or ``smoothing`` is outside [0, 1).
        DataError: a run directory is missing, ``iterations`` reaches beyond what a run's trace holds, or
            the runs hold nothing to draw.
    """
    out = Path(out)
    suffix = out.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise ValueError(f"dashboard output {str(out)!r}: use a .html or .png file name")
    runs = load_runs(run_dirs)
    panels = build_panels(runs, iterations, smoothing)
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
