"""Draw a run's throughput, time per node, device timelines and training curves (HTML or PNG).

`rlflow dashboard RUN_DIR [RUN_DIR ...] [--out FILE.html|FILE.png] [--iterations A-B] [--smoothing W]`:
several run directories overlay; ``--smoothing`` draws each curve's exponential moving average over its
faint raw values (TensorBoard's smoothing). The HTML is one self-contained file that works offline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlflow.schedulers.records.dashboard_data import parse_iterations
from rlflow.schedulers.records.render import render_dashboard


def _out_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in (".html", ".htm", ".png"):
        raise argparse.ArgumentTypeError(f"{text!r}: the output must end in .html or .png")
    return path


def _iterations(text: str) -> tuple[int, int]:
    try:
        return parse_iterations(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _smoothing(text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= weight < 1.0:
        raise argparse.ArgumentTypeError(f"{text}: the smoothing weight must lie in [0, 1)")
    return weight


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (run.output_dir)")
    parser.add_argument(
        "--out",
        type=_out_path,
        default=None,
        help="output file, .html (self-contained, works offline) or .png; default RUN_DIR/dashboard.html",
    )
    parser.add_argument(
        "--iterations",
        type=_iterations,
        default=None,
        metavar="A-B",
        help="iterations drawn in the per-device timeline (inclusive range or one number, within the "
        "iterations the run traced); default the last",
    )
    parser.add_argument(
        "--smoothing",
        type=_smoothing,
        default=0.0,
        metavar="W",
        help="EMA weight in [0, 1) for the curves, as TensorBoard's smoothing slider: each curve is drawn "
        "as its debiased exponential moving average (weight W on the past) over its raw values, drawn "
        "faint; 0 (default) draws the raw values only",
    )


def run(args: argparse.Namespace) -> int:
    out = args.out if args.out is not None else Path(args.run_dirs[0]) / "dashboard.html"
    written = render_dashboard(args.run_dirs, out, args.iterations, args.smoothing)
    print(f"dashboard written to {written}")
    return 0
