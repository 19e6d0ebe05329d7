"""Every example's dashboard reads at a glance: one unit per plot, at most ``MAX_SERIES`` lines, and no
legend over a plot, checked where the user sees it: in headless Chromium; DPO and reward-model runs log
their losses and get their curves.

The runs are synthetic (RunRecorder, the controller's own writer) with the metric columns each example
logs (``tests/example_metrics.json``, written by ``scripts/example_metrics.py`` from one-iteration runs of
the examples), so no example runs here. All dashboards go on one page: one browser start.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import shutil
import subprocess
import zlib
from collections.abc import Sequence
from html.parser import HTMLParser
from pathlib import Path

import pytest
from matplotlib.figure import Figure

from rlflow.schedulers.records.charts import build_panels
from rlflow.schedulers.records.curves import curve_columns
from rlflow.schedulers.records.dashboard_data import RunData, load_runs, node_categories
from rlflow.schedulers.records.metric_groups import FRACTION, MAX_SERIES, PLOT_RULES, curve_plots
from rlflow.schedulers.records.render import panel_svg
from rlflow.schedulers.records.rundir import RunRecorder, TraceRow

CATALOGUE = Path(__file__).parent / "example_metrics.json"
EXAMPLE_METRICS: dict[str, list[str]] = json.loads(CATALOGUE.read_text())
ITERATIONS = 12
EVAL_EVERY = 4
# Dashboards of several runs overlaid, as `rlflow dashboard A B` draws them.
OVERLAYS = (("search-sft", "search-grpo"), ("ppo", "ppo-async", "grpo"))


def _value(run: str, name: str, it: int) -> float:
    """A plausible value of ``name`` at iteration ``it`` of ``run``, in its unit's range (a fraction in
    [0, 1], tokens in [10, 30], else in [0.2, 3.2]); another run, another curve."""
    phase = zlib.crc32(f"{run}:{name}".encode()) % 100 / 100
    wave = 0.5 + 0.4 * math.sin(it / 2 + 6.3 * phase)
    rule = next((r for r in PLOT_RULES if re.fullmatch(r.pattern, name)), None)
    if rule is None or rule.unit == FRACTION or name.endswith("accuracy"):
        return wave
    if rule.unit == "tokens":
        return 10 + 20 * wave
    return 0.2 + 3 * wave


def synthetic_run(run_dir: Path, names: Sequence[str]) -> Path:
    """A finished run logging ``names`` for ``ITERATIONS`` iterations (``val/*`` before the first and every
    ``EVAL_EVERY``), with a trace of the ``timing_s/<node>`` nodes one after the other on device 0."""
    rec = RunRecorder(run_dir)
    nodes = [n.removeprefix("timing_s/") for n in names if re.fullmatch(r"timing_s/[^/]+", n)]
    nodes = [n for n in nodes if n != "iteration"]
    val = [n for n in names if n.startswith("val/")]
    if val:
        rec.log_metrics(0, {n: _value(run_dir.name, n, 0) for n in val})
    t = 0.0
    for it in range(1, ITERATIONS + 1):
        rows = []
        for k, node in enumerate(nodes):
            seconds = 0.2 + 0.1 * k
            rows.append(TraceRow(it, node, 0, 0, t, t + seconds, 64, 0, seconds))
            t += seconds
        rec.log_trace(rows)
        metrics = {
            n: _value(run_dir.name, n, it) for n in names if not n.startswith("val/") or it % EVAL_EVERY == 0
        }
        rec.log_metrics(it, metrics)
    rec.write_status("finished", ITERATIONS)
    return run_dir


@pytest.fixture(scope="module")
def dashboards(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Example label (or labels joined by ``+``) -> the synthetic run directories of its dashboard; one
    dashboard for examples that log the same names (``examples/arith/ppo.yaml`` and ``examples/ppo.yaml``)."""
    root = tmp_path_factory.mktemp("example-runs")
    runs = {label: synthetic_run(root / label, names) for label, names in EXAMPLE_METRICS.items()}
    distinct = {tuple(names): label for label, names in reversed(EXAMPLE_METRICS.items())}
    out = {label: [runs[label]] for label in EXAMPLE_METRICS if label in distinct.values()}
    out.update({"+".join(labels): [runs[label] for label in labels] for labels in OVERLAYS})
    return out


def test_the_examples_metrics_are_known() -> None:
    """The catalogue covers the examples the issue names, and DPO and reward-model runs log their loss."""
    assert {"dpo", "reward_model", "search-sft", "search-grpo", "ppo-async"} <= set(EXAMPLE_METRICS)
    dpo = {"actor/dpo_loss", "actor/rewards/margins", "actor/rewards/accuracies"}
    assert dpo <= set(EXAMPLE_METRICS["dpo"])
    assert {"reward/loss", "reward/accuracy"} <= set(EXAMPLE_METRICS["reward_model"])


def test_plots_hold_one_unit_and_few_series(dashboards: dict[str, list[Path]]) -> None:
    for label, dirs in dashboards.items():
        runs = load_runs(dirs)
        plots = curve_plots(curve_columns(runs), len(runs))
        for plot in plots:
            units = {next(r.unit for r in PLOT_RULES if re.fullmatch(r.pattern, n)) for n in plot.names}
            assert len(units) <= 1, (label, plot)  # none: a validation metric of its own
            lines = sum(run.column(n) is not None for run in runs for n in plot.names)
            assert 1 <= lines <= MAX_SERIES or len(plot.names) == 1, (label, plot)
        titles = {n: p.title for p in plots for n in p.names}
        # what an RL engineer looks for in each kind of run is drawn
        logged = set(curve_columns(runs))
        wanted = {"actor/dpo_loss", "reward/loss", "actor/grad_norm", "actor/lr", "async/staleness_mean"}
        assert wanted & logged <= set(titles), label
        if "val/accuracy" in logged and "val/num_turns/mean" in logged:
            assert titles["val/accuracy"] != titles["val/num_turns/mean"]  # accuracies apart from counts
            assert titles["val/accuracy"] != titles["val/env/error_ratio"]


_CHECK_SCRIPT = """
(function () {
  var problems = [], legends = 0, areas = 0;
  function overlap(a, b) {
    return [Math.min(a.right, b.right) - Math.max(a.left, b.left),
            Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top)];
  }
  document.querySelectorAll("figure.plot").forEach(function (fig) {
    var svg = fig.querySelector("svg"), box = svg.getBoundingClientRect();
    // matplotlib's SVG: each axes is <g id="axes_N">, its background patch (the plot area) its first child
    var plots = Array.prototype.map.call(
      svg.querySelectorAll('g[id^="axes_"] > g[id^="patch_"]:first-child'),
      function (g) { return g.getBoundingClientRect(); });
    areas += plots.length;
    svg.querySelectorAll('g[id^="legend_"]').forEach(function (legend) {
      legends += 1;
      var r = legend.getBoundingClientRect();
      plots.forEach(function (p, k) {
        var o = overlap(r, p);
        if (o[0] > 0.5 && o[1] > 0.5) {
          problems.push(fig.id + ": " + legend.id + " covers plot " + k + " by " + o[0].toFixed(1) + " x " +
                        o[1].toFixed(1) + " px");
        }
      });
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 ||
          r.bottom > box.bottom + 0.5) {
        problems.push(fig.id + ": " + legend.id + " reaches outside the figure");
      }
    });
  });
  document.body.dataset.problems = JSON.stringify(problems);
  document.body.dataset.legends = String(legends);
  document.body.dataset.areas = String(areas);
  document.body.dataset.checked = "1";
})();
"""


def _signature(key: str, runs: list[RunData]) -> tuple[object, ...]:
    """What a panel's layout depends on: its runs' names when they overlay (legend labels), the nodes of
    the bar and timeline panels, the plots and metric names of a curve panel. Equal signatures, equal
    panels: such a panel is checked once."""
    names = tuple(r.name for r in runs) if len(runs) > 1 else ()
    if key in ("node_time", "gantt"):
        return key, names, tuple(node_categories(runs))
    if key == "throughput":
        return key, names
    plots = curve_plots(curve_columns(runs), len(runs))
    return key, names, tuple((p.title, p.names) for p in plots if p.section == key)


def dashboards_page(dashboards: dict[str, list[Path]], out: Path) -> tuple[int, int]:
    """One HTML page holding every panel of every dashboard (inline SVG, as ``rlflow dashboard`` writes
    them; a panel equal to one already there (:func:`_signature`) once) and the legend check; returns
    (panels of the dashboards, panels on the page)."""
    sections: dict[tuple[object, ...], str] = {}
    panels = 0
    for label, dirs in dashboards.items():
        runs = load_runs(dirs)
        for panel in build_panels(runs):
            panels += 1
            key = _signature(panel.key, runs)
            if key not in sections:
                fid = html.escape(f"{label}/{panel.key}")
                sections[key] = (
                    f'<h2>{fid}</h2>\n<figure class="plot" id="{fid}">\n{panel_svg(panel)}\n</figure>'
                )
    out.write_text(
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><style>figure.plot { margin: 0; } '
        "figure.plot svg { max-width: 100%; height: auto; }</style></head><body>\n"
        + "\n".join(sections.values())
        + f"\n<script>{_CHECK_SCRIPT}</script></body></html>\n",
        encoding="utf-8",
    )
    return panels, len(sections)


class _Body(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, str | None] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self.attrs = dict(attrs)


def legend_problems(page: Path, profile: Path) -> tuple[list[str], int, int]:
    """Chromium's layout of ``page``: (legends over a plot area or outside their figure, legends, plot
    areas)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser is not None
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--window-size=1280,2000", "--dump-dom", page.resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    body = _Body()
    body.feed(done.stdout)
    assert body.attrs.get("data-checked") == "1", "the check script did not run"
    problems = json.loads(body.attrs.get("data-problems") or "[]")
    return problems, int(body.attrs.get("data-legends") or 0), int(body.attrs.get("data-areas") or 0)


def test_no_legend_covers_a_plot_in_chromium(dashboards: dict[str, list[Path]], tmp_path: Path) -> None:
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("chromium is required in CI (scripts/setup.sh installs it)")
        pytest.skip("chromium not installed (scripts/setup.sh installs it on Debian)")
    panels, drawn = dashboards_page(dashboards, tmp_path / "examples.html")
    problems, legends, areas = legend_problems(tmp_path / "examples.html", tmp_path / "profile")
    assert problems == []
    # the check saw what was drawn: a plot area at least per panel, a legend in all but throughput's
    assert panels > 5 * len(dashboards) and drawn > 2 * len(dashboards)
    assert legends >= drawn - 2 and areas >= drawn


def _run_example(graph: str, out: Path, *overrides: str) -> Path:
    """One process, as `rlflow run` with the embedded launcher: the controller on ``graph``."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.runtime.controller import Controller

    c = Controller(load_graph(graph, [f"run.output_dir={out}", "run.checkpoint_interval=0", *overrides]))
    try:
        c.run()
    finally:
        c.close()
    return out


def test_dpo_and_reward_model_runs_log_and_draw_their_losses(tmp_path: Path) -> None:
    """Issue 32: DPO and reward-model runs got no training curves; the DPO loss was not even logged."""
    one = ("run.iterations=1", "run.eval_interval=0")
    dpo = _run_example("examples/dpo.yaml", tmp_path / "dpo", *one, "nodes.actor_train.mini_batches=1")
    rm = _run_example("examples/reward_model.yaml", tmp_path / "rm", *one)
    (run,) = load_runs([dpo])
    # the first step's policy is its reference (init_from): every margin is 0, the loss -log σ(0) = log 2
    loss, margins = run.column("actor/dpo_loss"), run.column("actor/rewards/margins")
    assert loss is not None and margins is not None
    assert loss[1][0] == pytest.approx(math.log(2), abs=1e-4)
    assert margins[1][0] == pytest.approx(0.0, abs=1e-4)
    (reward,) = load_runs([rm])
    found = reward.column("reward/loss")
    assert found is not None and found[1][0] > 0
    for runs, titles in (
        ([run], ["DPO loss", "DPO implicit rewards", "DPO preference accuracy"]),
        ([reward], ["Reward-model loss", "Reward-model accuracy", "Reward-model margin"]),
    ):
        panels = {p.key: p for p in build_panels(runs)}
        assert "preference" in panels and "optimizer" in panels  # gradient norm, learning rate
        fig = Figure(figsize=(13, panels["preference"].height_in), layout="constrained")
        panels["preference"].draw(fig)
        assert [ax.get_title() for ax in fig.axes] == titles
