"""``rlflow run GRAPH [GRAPH ...] [key=value ...]``: train with the algorithm a graph file describes.

Each graph file is a stage, run in order (:mod:`.stage`: checks, plan, controller, evaluations, dashboard);
the overrides apply to every stage. Every graph is validated before the first stage starts, each reporting
all the mistakes ``rlflow validate`` finds before reading data, one line each (:func:`check_stage`), except
where a later stage reads what an earlier one writes (e.g. ``models.actor.path`` under the SFT stage's run
directory): such a stage is validated when its turn comes. Progress bar on stderr, run directory and metrics
endpoint printed at start, ``--resume`` to continue from each run directory's latest checkpoint (a stage
that already did ``run.iterations`` says so and the next one starts; in a chain, a stage without a
checkpoint starts anew). SIGINT, SIGTERM and SIGHUP save a checkpoint and exit with 128 + the signal's
number (130, 143, 129); later stages do not start. ``--max-restarts N`` (``run.max_restarts``): a stage
whose worker, engine or Ray node is lost resumes from its last checkpoint by itself
(:mod:`rlflow.schedulers.runtime.restarts`). At the end: one table of the stages (iterations,
samples, held-out accuracy first -> last evaluation, wall time) and where each dashboard is.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import GraphError, GraphMistakes, ModelError
from rlflow.dataflow.run_spec import LAUNCHERS
from rlflow.schedulers.commands.stage import StageResult, load_run_graph, run_stage
from rlflow.schedulers.records.rundir import latest_checkpoint

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

GRAPH_SUFFIXES = (".yaml", ".yml")


def _port(text: str) -> int:
    """A TCP port, 0 (any free port) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 0-65535 (0: any free port)")
    return port


def _stop_timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return seconds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a graph file (every iteration walks the graph's nodes once), or several in order as the stages "
        "of one job (e.g. SFT, then PPO from its checkpoint); a summary table at the end."
    )
    parser.add_argument("graph", help="graph file (YAML)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="[GRAPH ...] [KEY=VALUE ...]",
        help="more graph files (stages run in order), then dotted overrides applied to every stage, e.g. "
        "run.iterations=5",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an existing run directory first (not with --resume)"
    )
    parser.add_argument("--plan", type=Path, help="plan YAML (as written by `rlflow plan`) to use")
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="Parquet from `rlflow profile`: measured rates for `plan: auto` and the predicted times",
    )
    parser.add_argument(
        "--devices", type=int, help="devices on this host (CPU: worker processes); sets run.devices"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=None,
        metavar="N",
        help="restart from the last checkpoint by itself when a worker, engine or Ray node is lost, up to N "
        "times within run.restart_window_s (docs/operations.md); sets run.max_restarts",
    )
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=None,
        help="how the workers of a multi-device plan start: embedded (processes on this host; the default), "
        "ray (one actor per device on a Ray cluster, see --address), torchrun (the controller waits for "
        "workers started by torchrun); sets run.launcher",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="--launcher ray: the Ray head's address ('auto': the cluster this host joined; default "
        "RAY_ADDRESS, else a local Ray instance for this run); --launcher torchrun: where the controller "
        "listens for its workers",
    )
    parser.add_argument(
        "--metrics-port", type=_port, default=None, help="serve Prometheus metrics (0: any port)"
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for the metrics endpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--dashboard",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("RLFLOW_DASHBOARD", "1") != "0",
        help="write RUN_DIR/dashboard.html at the end of each stage (default: yes; environment variable "
        "RLFLOW_DASHBOARD=0: no)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=_stop_timeout,
        default=None,
        metavar="SECONDS",
        help="after SIGTERM/SIGHUP, seconds the iteration in flight has to finish before it is abandoned "
        "(default 20: schedulers send SIGKILL 30 s after SIGTERM); then a checkpoint is saved",
    )


def split_graphs(first: str, rest: list[str]) -> tuple[list[str], list[str]]:
    """``(graph files, overrides)`` of the positional arguments: the leading ones that name a YAML file
    (no ``=``) are graph files, the others overrides."""
    graphs = [first]
    i = 0
    while i < len(rest) and "=" not in rest[i] and rest[i].lower().endswith(GRAPH_SUFFIXES):
        graphs.append(rest[i])
        i += 1
    return graphs, list(rest[i:])


def run(args: argparse.Namespace) -> int:
    from rlflow.schedulers.runtime.distributed.launch import WORKER_START_ENV, worker_start_method

    if os.environ.get(WORKER_START_ENV):  # a bad value stops the run now, not after planning
        worker_start_method()
    paths, overrides = split_graphs(args.graph, list(args.overrides))
    if len(paths) > 1:
        _check_chain(args, paths, overrides)
    results: list[StageResult] = []
    for path in paths:
        graph = load_run_graph(args, path, overrides)
        check_stage(graph)
        stage_args = args
        if len(paths) > 1 and args.resume and latest_checkpoint(graph.spec.run.output_dir) is None:
            # a stage the stopped chain never reached (or stopped before its first checkpoint) starts now
            stage_args = argparse.Namespace(**{**vars(args), "resume": False})
        stage = run_stage(stage_args, graph)
        results.append(stage)
        if stage.exit_code:
            break
    print_summary(results)
    return results[-1].exit_code


def _check_chain(args: argparse.Namespace, paths: list[str], overrides: list[str]) -> None:
    """Validate every stage before the first starts, but for a mistake about a path that an earlier
    stage's run directory will hold (its turn comes later; a one-slash one, ``runs/sft``, is read as a Hub
    id while it does not exist).

    Raises:
        GraphError: ``--plan`` or a ``run.output_dir`` override with several stages (one file cannot place,
            one directory cannot hold, several graphs), two stages with one run directory, or a stage's
            mistake.
    """
    if args.plan is not None:
        raise GraphError(
            f"--plan {args.plan}: one plan file cannot place {len(paths)} graphs; run them apart"
        )
    for item in overrides:
        if item.split("=", 1)[0].strip() in ("run", "run.output_dir"):
            raise GraphError(
                f"{item}: every stage needs its own run directory; set run.output_dir in each file"
            )
    earlier: dict[Path, str] = {}
    for path in paths:
        try:
            graph = load_run_graph(args, path, overrides)
        except (GraphError, ModelError) as e:  # ModelError: such a path read as a Hub id
            if not any(str(d) in str(e) for d in earlier):
                raise
            continue
        check_stage(graph, tuple(earlier))
        out = Path(graph.spec.run.output_dir)
        if out in earlier:
            raise GraphError(
                f"{path}: run.output_dir '{out}' is also {earlier[out]}'s; give each stage its own"
            )
        earlier[out] = path


def check_stage(graph: Graph, earlier: tuple[Path, ...] = ()) -> None:
    """Every mistake ``rlflow validate`` reports of ``graph`` before reading its data
    (:func:`~rlflow.schedulers.commands.validate.runtime_mistakes`: missing files, node functions' and run
    checks, model configs, engines, trackers, the data generator), all at once, before the stage plans or
    starts anything; a mistake about a path under an ``earlier`` stage's run directory (what that stage
    will write) waits for this stage's turn. The data's and the plan's own checks follow, once planned
    (:mod:`.stage`).

    Raises:
        GraphMistakes: one message per mistake, each naming the file and key.
    """
    from rlflow.schedulers.commands.validate import runtime_mistakes

    mistakes = [m for m in runtime_mistakes(graph) if not any(str(d) in m for d in earlier)]
    if mistakes:
        raise GraphMistakes(mistakes)


def _wall(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, s = divmod(round(seconds), 60)
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def print_summary(results: list[StageResult]) -> None:
    """One row per stage: graph file, iterations, samples, held-out accuracy (first -> last evaluation,
    greedy) and wall time (``-``: nothing to do); then each dashboard's path."""
    header = ("stage", "iterations", "samples", "held-out accuracy (greedy)", "wall")
    rows = []
    for r in results:
        acc = "-"
        if r.accuracy is not None:
            (i0, a0), (i1, a1) = r.accuracy
            acc = f"{a0:.3f} -> {a1:.3f} (it {i0} -> {i1})"
        rows.append((r.source, str(r.iterations), f"{r.samples:,}", acc, _wall(r.wall_s)))
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, *rows):
        print(
            "  ".join(
                c.ljust(w) if i in (0, 3) else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    for r in results:
        if r.dashboard is not None:
            print(f"dashboard: {r.dashboard}")
