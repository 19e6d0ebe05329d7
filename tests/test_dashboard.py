"""Dashboards from run directories (schedulers/records/charts.py, `rlflow dashboard`).

Runs are recorded synthetically through RunRecorder, the same writer the controller uses.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from rlflow.dataflow.errors import DataError
from rlflow.schedulers.commands import dashboard as dashboard_cmd
from rlflow.schedulers.records.charts import build_panels
from rlflow.schedulers.records.curves import curve_columns
from rlflow.schedulers.records.dashboard_data import category_seconds as _spans
from rlflow.schedulers.records.dashboard_data import load_runs, parse_iterations
from rlflow.schedulers.records.metric_groups import curve_plots
from rlflow.schedulers.records.render import render_dashboard
from rlflow.schedulers.records.rundir import RunRecorder, TraceRow

# (node, seconds on worker 0, tokens); worker 1 finishes 0.05 s earlier.
NODES = (("actor_gen", 1.0, 512), ("ref_inf", 0.4, 512), ("actor_train", 0.8, 512))


def make_run(
    run_dir: Path,
    iterations: int = 3,
    predicted: bool = True,
    slower: float = 0.0,
    stall: dict[int, float] | None = None,
    val_score: bool = False,
) -> Path:
    """A 2-device PPO-like run: per iteration gen -> ref -> (reallocation) -> train, each followed by a
    data transfer of 0.05 s. Iteration time = 1.0 + 0.4 + 0.2 + 0.8 + 3 * 0.05 = 2.55 s (+ slower, + the
    ``stall`` seconds of that iteration, spent in actor_gen; a 0.2 s ``tool`` phase inside actor_gen on
    worker 0 does not add to it). ``val_score``: also log ``val/score/mean``
    equal to ``val/accuracy`` (an exact-match reward)."""
    rec = RunRecorder(run_dir)
    rec.write_status("running", 0)
    t = 0.0
    for it in range(1, iterations + 1):
        rows, t_start = [], t
        for node, seconds, tokens in NODES:
            seconds += slower + (stall or {}).get(it, 0.0) if node == "actor_gen" else 0.0
            if node == "actor_train":
                rows += [
                    TraceRow(it, "actor", w, w, t, t + 0.2, 0, 4096, None, "reallocation") for w in (0, 1)
                ]
                t += 0.2
            rows += [TraceRow(it, node, w, w, t, t + seconds - 0.05 * w, tokens, 0, seconds) for w in (0, 1)]
            if node == "actor_gen":  # an agent's tool phase inside the node: drawn, not added to its time
                rows.append(TraceRow(it, node, 0, 0, t + 0.3, t + 0.5, 0, 0, None, "tool"))
            t += seconds
            rows.append(TraceRow(it, node, 0, 0, t, t + 0.05, 0, 1024, None, "data_transfer"))
            t += 0.05
        rec.log_trace(rows)
        metrics = {
            "timing_s/iteration": t - t_start,
            "perf/throughput": 1536 / (t - t_start),
            "perf/samples_per_s": 16 / (t - t_start),
            "critic/score/mean": 0.1 * it,
            "actor/ppo_kl": 0.01 * it,
            "actor/pg_loss": 1.0 / it,
            "critic/vf_loss": 2.0 / it,
            "actor/pg_clipfrac": 0.05,
            "response_length/mean": 10.0 + it,
        }
        if it % 2 == 0:
            metrics["val/accuracy"] = 0.2 * it
            if val_score:
                metrics["val/score/mean"] = 0.2 * it
        rec.log_metrics(it, metrics)
        rec.write_status("running", it)
    if predicted:
        rec.write_predicted_trace(
            [TraceRow(0, "actor_gen", w, w, 0.0, 0.9, 512, 0, 0.9) for w in (0, 1)]
            + [TraceRow(0, "actor_train", w, w, 1.0, 1.7, 512, 0, 0.7) for w in (0, 1)]
        )
    rec.write_status("finished", iterations)
    return run_dir


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    return [make_run(root / "ppo_a"), make_run(root / "ppo_b", predicted=False, slower=0.5)]


@pytest.fixture(scope="module")
def html_file(two_runs: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html") / "dash.html"
    render_dashboard(two_runs, out, iterations=(2, 3))
    return out


def test_node_spans_golden(two_runs: list[Path]) -> None:
    (run,) = load_runs(two_runs[:1])
    spans = _spans(run.trace)
    assert sorted(spans) == [1, 2, 3]
    # Span over workers: worker 0 runs 1.0 s, worker 1 0.95 s from the same start -> 1.0 s.
    assert spans[1]["actor_gen"] == pytest.approx(1.0)
    assert spans[1]["ref_inf"] == pytest.approx(0.4)
    assert spans[1]["reallocation"] == pytest.approx(0.2)
    # Three transfers of 0.05 s each.
    assert spans[1]["data_transfer"] == pytest.approx(0.15)
    assert "tool" not in spans[1]  # inside actor_gen's span, not counted twice
    assert sum(spans[1].values()) == pytest.approx(2.55)


def test_panels_and_training_groups(two_runs: list[Path], tmp_path: Path) -> None:
    runs = load_runs(two_runs)
    assert [r.name for r in runs] == ["ppo_a", "ppo_b"]
    keys = ["throughput", "node_time", "gantt", "training", "validation"]
    assert [p.key for p in build_panels(runs)] == keys
    groups = {p.title: p.names for p in curve_plots(curve_columns(runs), len(runs))}
    assert groups["Reward"] == ("critic/score/mean",)
    assert groups["KL to the reference"] == ("actor/ppo_kl",)
    assert groups["Value loss"] == ("critic/vf_loss",)
    assert groups["Validation accuracy"] == ("val/accuracy",)
    assert "Entropy" not in groups
    # Metrics only (no trace yet): the node bars fall back to timing_s/<node>, no timeline.
    rec = RunRecorder(tmp_path / "metrics_only")
    rec.log_metrics(1, {"timing_s/actor_gen": 1.5, "timing_s/iteration": 2.0})
    assert [p.key for p in build_panels(load_runs([tmp_path / "metrics_only"]))] == [
        "throughput",
        "node_time",
    ]


def test_same_basename_runs_are_named_by_path(tmp_path: Path) -> None:
    make_run(tmp_path / "x" / "ppo", iterations=1)
    make_run(tmp_path / "y" / "ppo", iterations=1)
    runs = load_runs([tmp_path / "x" / "ppo", tmp_path / "y" / "ppo"])
    assert [r.name for r in runs] == [str(tmp_path / "x" / "ppo"), str(tmp_path / "y" / "ppo")]


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_runs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="not a run directory"):
        load_runs([tmp_path / "empty"])
    RunRecorder(tmp_path / "fresh").write_status("running", 0)
    with pytest.raises(DataError, match="nothing to draw"):
        render_dashboard([tmp_path / "fresh"], tmp_path / "out.html")
    with pytest.raises(ValueError, match=r"\.html or \.png"):
        render_dashboard([tmp_path / "fresh"], tmp_path / "out.pdf")
    assert parse_iterations("3-7") == (3, 7)
    assert parse_iterations("5") == (5, 5)
    for bad in ("7-3", "a-b", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_iterations(bad)


def test_iterations_beyond_the_trace_are_an_error(
    two_runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlflow.schedulers.cli import main

    out = tmp_path / "d.html"
    for asked in ((3, 5), (0, 2), (7, 7)):
        with pytest.raises(DataError, match=r"run 'ppo_a' has traced iterations 1-3"):
            render_dashboard(two_runs, out, iterations=asked)
    assert main(["dashboard", str(two_runs[0]), "--out", str(out), "--iterations", "4-9"]) == 2
    assert "--iterations 4-9: run 'ppo_a' has traced iterations 1-3" in capsys.readouterr().err
    assert not out.exists()
    RunRecorder(tmp_path / "fresh").log_metrics(1, {"timing_s/iteration": 1.0})
    with pytest.raises(DataError, match="'fresh' has traced no iterations yet"):
        render_dashboard([tmp_path / "fresh"], out, iterations=(1, 1))


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_png_via_command(two_runs: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    dashboard_cmd.configure(parser)
    out = tmp_path / "dash.png"
    args = parser.parse_args([*map(str, two_runs), "--out", str(out), "--iterations", "1-2"])
    assert dashboard_cmd.run(args) == 0
    assert str(out) in capsys.readouterr().out
    width, height = _png_size(out)
    # 13 in wide at 100 dpi; four panels stacked make it taller than wide but not absurdly so.
    assert width == 1300
    assert 1000 < height < 4000
    assert out.stat().st_size > 50_000  # plots, not a blank canvas
    with pytest.raises(SystemExit):
        parser.parse_args([str(two_runs[0]), "--out", str(tmp_path / "dash.pdf")])
    with pytest.raises(SystemExit):
        parser.parse_args([str(two_runs[0]), "--iterations", "5-2"])


class _Figures(HTMLParser):
    """Collects <figure class="plot"> attributes, counts <svg>, and collects external references."""

    def __init__(self) -> None:
        super().__init__()
        self.figures: list[dict[str, str | None]] = []
        self.body: dict[str, str | None] = {}
        self.svgs = 0
        self.external: list[str] = []
        self.scripts_with_src = 0
        self._in_errors = False
        self.errors_text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if tag == "figure" and "plot" in (attr.get("class") or ""):
            self.figures.append(attr)
        elif tag == "body":
            self.body = attr
        elif tag == "svg":
            self.svgs += 1
        if tag == "script" and "src" in attr:
            self.scripts_with_src += 1
        for key in ("src", "href", "xlink:href"):
            value = attr.get(key) or ""
            if re.match(r"\s*(https?:|//|file:)", value):
                self.external.append(value)
        self._in_errors = attr.get("id") == "js-errors"

    def handle_endtag(self, tag: str) -> None:
        self._in_errors = False

    def handle_data(self, data: str) -> None:
        if self._in_errors:
            self.errors_text += data


def _parse(text: str) -> _Figures:
    parser = _Figures()
    parser.feed(text)
    return parser


def test_html_is_self_contained(html_file: Path) -> None:
    page = _parse(html_file.read_text())
    keys = ["throughput", "node_time", "gantt", "training", "validation"]
    assert [f["data-plot"] for f in page.figures] == keys
    assert page.svgs >= 5
    assert page.external == []
    assert page.scripts_with_src == 0
    assert "<link" not in html_file.read_text()
    assert "<?xml" not in html_file.read_text()
    assert "ppo_a" in html_file.read_text() and "ppo_b" in html_file.read_text()


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _dump_dom(browser: str, page: Path, profile: Path) -> tuple[str, str]:
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--window-size=1280,2000",
        "--dump-dom", page.resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def _browser_or_skip() -> str:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI", "").lower() in ("1", "true"):
            pytest.fail("chromium is required in CI (scripts/setup.sh installs it)")
        pytest.skip("chromium not installed (scripts/setup.sh installs it on Debian)")
    return browser


def test_html_renders_in_headless_chromium(html_file: Path, tmp_path: Path) -> None:
    browser = _browser_or_skip()
    dom, stderr = _dump_dom(browser, html_file, tmp_path / "profile")
    page = _parse(dom)
    assert page.body.get("data-scripts-ran") == "1", "the inline script did not run"
    assert len(page.figures) == 5
    assert page.body.get("data-plots") == page.body.get("data-plots-rendered") == "5"
    for fig in page.figures:
        assert fig.get("data-rendered") == "1", fig
        assert int(fig.get("data-width") or 0) > 100 and int(fig.get("data-height") or 0) > 50, fig
    assert page.errors_text.strip() == ""
    assert "Uncaught" not in stderr
    # Hover values exist, and what the pointer meets over a marker or bar is the element with its value.
    for fig in page.figures:
        if fig["data-plot"] == "gantt":
            continue
        assert int(fig.get("data-hovers") or 0) > 0, fig
        assert fig.get("data-hover-hit") == "1", fig
        assert re.search(r"iteration \d+: [\d.e+-]+", fig.get("data-hover-title") or ""), fig

    # Control: a page with a failing script must be caught by the same checks.
    broken = tmp_path / "broken.html"
    broken.write_text(html_file.read_text().replace("</body>", "<script>notDefined();</script></body>"))
    dom, stderr = _dump_dom(browser, broken, tmp_path / "profile2")
    assert "notDefined" in _parse(dom).errors_text
    assert "Uncaught" in stderr


def _axes_of(panel_key: str, runs: list[Path]) -> list[Axes]:
    (panel,) = [p for p in build_panels(load_runs(runs)) if p.key == panel_key]
    fig = Figure(figsize=(13, panel.height_in), layout="constrained")
    panel.draw(fig)
    fig.canvas.draw()
    return fig.axes


def _curves(ax: Axes) -> list[Line2D]:
    return [line for line in ax.get_lines() if not str(line.get_label()).startswith("_")]


def test_series_of_a_run_have_their_own_colours_and_runs_differ(two_runs: list[Path]) -> None:
    """Issue 14: the series of one run shared one colour (solid vs dashed only)."""
    training = _axes_of("training", two_runs)
    titles = [
        "Reward",
        "KL to the reference",
        "Policy loss",
        "Value loss",
        "Clip fraction",
        "Response length",
    ]
    assert [ax.get_title() for ax in training] == titles
    (validation,) = _axes_of("validation", two_runs)
    for ax in (*training, validation):
        lines = _curves(ax)
        assert len(lines) == 2, ax.get_title()  # one per run
        assert lines[0].get_color() != lines[1].get_color(), ax.get_title()
        assert lines[0].get_marker() != lines[1].get_marker(), ax.get_title()  # runs differ in shape too


def _legend_texts(ax: Axes) -> list[str]:
    """The texts of the legend of ``ax``'s subfigure (each curve plot has one, below the plot)."""
    sub = ax.get_figure(root=False)
    assert sub is not None and ax.get_legend() is None  # never inside the axes
    (legend,) = sub.legends
    return [t.get_text().replace("\n", " ") for t in legend.get_texts()]  # long labels wrap


def test_equal_series_both_stay_visible(two_runs: list[Path]) -> None:
    """Issue 14: a series equal to another (here both runs' reward) hid it exactly."""
    reward = _axes_of("training", two_runs)[0]
    first, second = _curves(reward)
    assert _legend_texts(reward) == [
        "ppo_a: critic/score/mean",
        "ppo_b: critic/score/mean (= ppo_a: critic/score/mean)",
    ]
    assert list(first.get_ydata()) == list(second.get_ydata())
    assert first.get_color() != second.get_color()
    # The later one: hollow, larger markers drawn above the first line, so both show.
    assert second.get_markerfacecolor() == "none" and second.get_markersize() > first.get_markersize()
    assert second.get_zorder() > first.get_zorder()


def test_one_unit_per_plot_and_legends_below_the_plots(tmp_path: Path) -> None:
    """Issue 32: one validation plot mixed accuracies, counts and ratios under a legend over the plot."""
    run = make_run(tmp_path / "exact", val_score=True, predicted=False)
    rec = RunRecorder(run)
    rec.log_metrics(4, {"val/num_turns/mean": 2.5, "val/env/error_ratio": 0.1, "val/no_tool/accuracy": 0.3})
    axes = _axes_of("validation", [run])
    names = {ax.get_title(): (ax.get_ylabel(), _legend_texts(ax)) for ax in axes}
    assert names == {
        "Validation accuracy": ("fraction (0-1)", ["val/accuracy", "val/no_tool/accuracy"]),
        "Validation reward": ("reward (mean per response)", ["val/score/mean"]),
        "Validation turns and tool calls": ("count per episode", ["val/num_turns/mean"]),
        "Validation environment errors": ("fraction (0-1)", ["val/env/error_ratio"]),
    }
    for ax in axes:  # each legend lies below its own plot, inside its subfigure
        sub = ax.get_figure(root=False)
        assert sub is not None
        legend_box = sub.legends[0].get_window_extent()
        assert legend_box.y1 <= ax.get_window_extent().y0 and sub.bbox.contains(*legend_box.p0)


def test_many_series_are_split_over_several_plots() -> None:
    names = [f"val/tool_{k}/accuracy" for k in range(8)] + ["actor/grad_norm", "critic/grad_norm"]
    plots = curve_plots(names, n_runs=1)
    assert [(p.title, len(p.names)) for p in plots] == [
        ("Gradient norm", 2), ("Validation accuracy (1/2)", 4), ("Validation accuracy (2/2)", 4),
    ]  # fmt: skip
    assert [len(p.names) for p in curve_plots(names, n_runs=3)] == [2, 2, 2, 2, 2]  # 6 lines at most


def test_ema_is_tensorboards_smoothing() -> None:
    from rlflow.schedulers.records.curves import ema

    values = np.array([1.0, 2.0, float("nan"), 4.0])
    # s = 0.6 s + 0.4 x from 0, debiased by 1 - 0.6^k (k: finite values seen)
    s1, s2 = 0.4, 0.6 * 0.4 + 0.4 * 2
    s4 = 0.6 * s2 + 0.4 * 4
    expected = [s1 / 0.4, s2 / (1 - 0.6**2), s2 / (1 - 0.6**2), s4 / (1 - 0.6**3)]
    assert ema(values, 0.6) == pytest.approx(expected)
    assert list(ema(values[:2], 0.0)) == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        ema(values, 1.0)


def test_smoothing_draws_the_average_over_faint_raw_values(two_runs: list[Path], tmp_path: Path) -> None:
    runs = load_runs(two_runs[:1])
    (training,) = [p for p in build_panels(runs, smoothing=0.5) if p.key == "training"]
    assert training.title == "Training curves (EMA smoothing 0.5; raw values faint)"
    fig = Figure(figsize=(13, training.height_in), layout="constrained")
    training.draw(fig)
    reward = fig.axes[0]
    raw, smooth = reward.get_lines()
    assert list(raw.get_ydata()) == pytest.approx([0.1, 0.2, 0.3])  # the values, with markers (hover)
    assert raw.get_alpha() is not None and raw.get_alpha() < 0.5 and raw.get_marker() == "o"
    assert list(smooth.get_ydata()) == pytest.approx(
        [0.1, (0.25 * 0.1 + 0.5 * 0.2) / 0.75, smooth.get_ydata()[2]]
    )
    assert smooth.get_marker() in ("None", None, "") and _legend_texts(reward) == ["critic/score/mean"]
    # through the command: a weight outside [0, 1) is refused, one inside draws
    parser = argparse.ArgumentParser()
    dashboard_cmd.configure(parser)
    for bad in ("1", "-0.1", "x"):
        with pytest.raises(SystemExit):
            parser.parse_args([str(two_runs[0]), "--smoothing", bad])
    out = tmp_path / "smooth.html"
    assert (
        dashboard_cmd.run(parser.parse_args([str(two_runs[0]), "--out", str(out), "--smoothing", "0.6"])) == 0
    )
    assert "EMA smoothing 0.6" in out.read_text()


def test_a_stalled_iteration_does_not_flatten_the_node_bars(tmp_path: Path) -> None:
    """Issue 14: one stalled iteration made every other per-node bar a sliver."""
    run = make_run(tmp_path / "stalled", iterations=6, predicted=False, stall={4: 250.0})
    (ax,) = _axes_of("node_time", [run])
    low, high = ax.get_ylim()
    assert low == 0 and 2.55 < high < 4.0  # the ordinary iterations (2.55 s) fill the axis
    notes = [t.get_text() for t in ax.texts]
    assert notes == ["253 s ↑"], notes  # the cut bar says its total
    (plain,) = _axes_of("node_time", [make_run(tmp_path / "plain", iterations=6, predicted=False)])
    assert plain.get_ylim()[1] > 2.55 and len(plain.texts) == 0  # nothing cut without a stall


def test_node_colours_do_not_depend_on_the_other_nodes_or_their_order() -> None:
    """Issue 14: node colours followed the order of appearance, so they changed between runs."""
    from rlflow.schedulers.planner.simulator import Event, Timeline, gantt_figure
    from rlflow.schedulers.records.charts import category_colours as _colours

    a = _colours(["actor_gen", "ref_inf", "actor_train", "reallocation", "data_transfer"])
    b = _colours(["critic_values", "actor_train", "actor_gen"])
    assert a["actor_gen"] == b["actor_gen"] and a["actor_train"] == b["actor_train"]
    assert len(set(a.values())) == len(a)
    ev = (Event(0, "actor_gen", (0,), 0.0, 1.0, "node"), Event(0, "zeta", (0,), 1.0, 2.0, "node"))
    (ax,) = gantt_figure(Timeline(ev, (2.0,)), 1).axes
    legend = ax.get_legend()
    assert legend is not None
    colour = {
        t.get_text(): h.get_facecolor()
        for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }
    assert to_hex(colour["actor_gen"]) == a["actor_gen"]  # the planner's Gantt chart agrees


def _hovers(svg: str) -> list[tuple[float, float, str]]:
    found = re.findall(
        r'<circle cx="([\d.]+)" cy="([\d.]+)" r="4" data-hover="point"><title>([^<]*)</title>', svg
    )
    return [(float(x), float(y), html.unescape(t)) for x, y, t in found]


def test_html_has_exact_values_on_hover(html_file: Path) -> None:
    """Issue 14: the HTML had no hover values. Every marker and bar carries an SVG <title> with its value,
    placed on the marker matplotlib drew."""
    text = html_file.read_text()
    figures = dict(re.findall(r'data-plot="(\w+)">\n(<svg.*?</svg>)', text, flags=re.S))
    training = _hovers(figures["training"])
    titles = {line for _, _, t in training for line in t.split("\n")}
    validation = {line for _, _, t in _hovers(figures["validation"]) for line in t.split("\n")}
    assert "Validation accuracy: ppo_a: val/accuracy, iteration 2: 0.4" in validation
    # ppo_b's reward equals ppo_a's: its own colour and hollow markers, named as equal in the legend.
    assert "Reward: ppo_b: critic/score/mean (= ppo_a: critic/score/mean), iteration 3: 0.3" in titles
    throughput = {line for _, _, t in _hovers(figures["throughput"]) for line in t.split("\n")}
    assert f"Throughput: ppo_b, iteration 1: {1536 / 3.05:.6g}" in throughput
    # Equal points of two runs share one shape that names both.
    both = "Reward: ppo_a: critic/score/mean, iteration 1: 0.1\nReward: ppo_b: critic/score/mean (= ppo_a: "
    assert any(t.startswith(both) for _, _, t in training)
    # Each hover circle sits on a marker of the SVG (matplotlib draws markers as <use x= y=>).
    markers = [
        (float(x), float(y))
        for x, y in re.findall(r'<use xlink:href="#\w+" x="([\d.]+)" y="([\d.]+)"', figures["training"])
    ]
    for x, y, title in training:
        assert min(abs(x - mx) + abs(y - my) for mx, my in markers) < 0.5, title
    bars = re.findall(r'data-hover="bar"><title>([^<]*)</title>', figures["node_time"])
    assert "ppo_a: actor_gen, iteration 2: 1 s" in bars and "ppo_b: actor_gen, iteration 2: 1.5 s" in bars


def test_rlflow_cli_wiring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlflow.schedulers.cli import main

    assert main(["dashboard", str(tmp_path / "missing"), "--out", str(tmp_path / "d.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
    make_run(tmp_path / "runs" / "grpo", iterations=1, predicted=False)
    assert main(["runs", str(tmp_path / "runs")]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "finished" in out
    monkeypatch.chdir(tmp_path / "runs" / "grpo")  # no ./runs here: no runs yet is not an error
    assert main(["runs"]) == 0
    assert "no runs yet" in capsys.readouterr().out


def test_each_evaluation_prints_as_it_happens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32: evaluations printed only when a run ended, so a crashed run showed none."""
    from rlflow.schedulers.cli import main
    from rlflow.schedulers.runtime.controller import Controller

    ran = Controller.run_iteration

    def crash_at_2(self: Controller, iteration: int) -> dict[str, float]:
        if iteration == 2:
            raise RuntimeError("boom in iteration 2")
        return ran(self, iteration)

    monkeypatch.setattr(Controller, "run_iteration", crash_at_2)
    argv = ["run", "examples/grpo.yaml", f"run.output_dir={tmp_path / 'grpo'}", "run.iterations=3",
            "run.eval_interval=1", "run.eval.size=4", "run.checkpoint_interval=0",
            "--no-progress"]  # fmt: skip
    with pytest.raises(RuntimeError, match="boom"):
        main(argv)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("eval after")]
    assert [line.split(":")[0] for line in lines] == ["eval after 0 iterations", "eval after 1 iterations"]
    assert re.fullmatch(r"eval after 1 iterations: .*val/accuracy=[\d.e+-]+.*", lines[1]), lines[1]
