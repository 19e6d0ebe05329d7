"""``rlflow run GRAPH [key=value ...]``: train with the algorithm a graph file describes.

Validates the graph (and the plan against the local devices) before building anything — ``plan: auto`` on
several devices is planned for this host by the planner first
(:func:`rlflow.schedulers.planner.auto.resolve_plan`) — then runs the
controller: progress bar on stderr, run directory and metrics endpoint printed at start, ``--resume`` to
continue from the run directory's latest checkpoint (a run that already did ``run.iterations`` says so and
exits 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlflow.dataflow.errors import DataError, PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.commands.validate import prompt_mistakes
from rlflow.schedulers.planner.auto import predict_plan, resolve_plan
from rlflow.schedulers.planner.resources import check_plan_memory


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run a graph file: every iteration walks the graph's nodes once."
    parser.add_argument("graph", help="graph file (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.iterations=5")
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
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics (0: any port)"
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for the metrics endpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from rlflow.schedulers.records.rundir import latest_checkpoint
    from rlflow.schedulers.runtime.controller import Controller

    overrides = list(args.overrides) + ([f"run.devices={args.devices}"] if args.devices else [])
    graph = load_graph(args.graph, overrides)
    run_spec = graph.spec.run
    found = latest_checkpoint(run_spec.output_dir) if args.resume and not args.overwrite else None
    if found is not None and found[0] >= run_spec.iterations:
        print(
            f"rlflow: run {run_spec.output_dir} already finished {found[0]} of {run_spec.iterations} "
            "iterations; nothing to do (raise run.iterations to continue)"
            if found[0] == run_spec.iterations
            else f"rlflow: run {run_spec.output_dir} already did {found[0]} iterations, more than "
            f"run.iterations={run_spec.iterations}; nothing to do",
            file=sys.stderr,
        )
        return 0
    if args.profile is not None and not args.profile.is_file():
        raise PlanError(f"--profile {args.profile}: no such file (write one with `rlflow profile`)")
    graph = resolve_plan(graph, args.plan, profile=args.profile)
    check_plan_memory(graph)  # every model, its copies and caches against this machine's memory
    for message in prompt_mistakes(graph):  # over-long prompts stop the run before any worker starts
        raise DataError(message)
    live = None
    if args.metrics_port is not None:
        from rlflow.schedulers.records.telemetry import LiveMetrics

        live = LiveMetrics(port=args.metrics_port, host=args.metrics_host)
    controller = None
    try:
        predicted_s, predicted_rows = predict_plan(graph, args.profile)
        controller = Controller(
            graph,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            live_metrics=live,
            predicted_s=predicted_s,
        )
        if predicted_rows:
            controller.recorder.write_predicted_trace(predicted_rows)
        print(f"rlflow: run directory {controller.run_dir}", file=sys.stderr)
        if live is not None:
            print(f"rlflow: metrics at {live.url}", file=sys.stderr)
        result = controller.run()
    finally:
        if controller is not None:
            controller.close()
        if live is not None:
            live.close()
    for it in sorted(result.evals):
        shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.evals[it].items()))
        print(f"eval after {it} iterations: {shown}")
    accuracy = {it: e["val/accuracy"] for it, e in sorted(result.evals.items()) if "val/accuracy" in e}
    if len(accuracy) >= 2:
        (first, a0), (last, a1) = next(iter(accuracy.items())), list(accuracy.items())[-1]
        print(
            f"held-out accuracy (greedy): {a0:.3f} after {first} iterations -> {a1:.3f} after {last} "
            f"({graph.spec.source})"
        )
    if result.interrupted:
        print(
            f"rlflow: interrupted after iteration {result.iteration}; resume with --resume", file=sys.stderr
        )
        return 130
    return 0
