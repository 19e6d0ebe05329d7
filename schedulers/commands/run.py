"""``rlflow run GRAPH [key=value ...]``: train with the algorithm a graph file describes.

Validates the graph (and the plan against the local devices) before building anything, then runs the
controller: progress bar on stderr, run directory and metrics endpoint printed at start, ``--resume`` to
continue from the run directory's latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

from dataflow.errors import GraphError, PlanError
from dataflow.graph import Graph
from dataflow.loader import load_graph
from dataflow.spec import GraphSpec


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
        "--devices", type=int, help="devices on this host (CPU: worker processes); sets run.devices"
    )
    parser.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics (0: any port)"
    )
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for the metrics endpoint")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def resolve_plan(graph: Graph, plan_file: Path | None) -> Graph:
    """The graph with ``--plan``'s placements (validated like a graph file's plan), or with ``plan: auto``
    resolved for the local host (one device: the trivial plan).

    Raises:
        PlanError: a plan file that does not fit the graph or its devices; ``auto`` on several devices.
    """
    spec: GraphSpec = graph.spec
    if plan_file is not None:
        from schedulers.plan import load_plan

        return Graph.from_spec(dataclasses.replace(spec, plan=load_plan(plan_file)), graph.registry)
    if spec.plan == "auto":
        if spec.run.devices != 1:
            raise PlanError(
                f"{spec.source}: plan 'auto' on {spec.run.devices} devices needs the planner and the "
                "distributed runtime; use `rlflow plan` and a manual plan, or run.devices=1"
            )
        return Graph.from_spec(dataclasses.replace(spec, plan={}), graph.registry)
    return graph


def _remove_run_dir(run_dir: Path) -> None:
    """Delete ``run_dir`` if it is an rlflow run directory (has ``status.json``); refuse anything else."""
    if not run_dir.exists():
        return
    if not (run_dir / "status.json").is_file():
        raise GraphError(f"--overwrite: '{run_dir}' is not an rlflow run directory (no status.json); kept it")
    shutil.rmtree(run_dir)


def run(args: argparse.Namespace) -> int:
    from schedulers.runtime.controller import Controller

    overrides = list(args.overrides) + ([f"run.devices={args.devices}"] if args.devices else [])
    graph = resolve_plan(load_graph(args.graph, overrides), args.plan)
    if args.overwrite:
        if args.resume:
            raise GraphError("--overwrite and --resume contradict each other")
        _remove_run_dir(Path(graph.spec.run.output_dir))
    live = None
    if args.metrics_port is not None:
        from schedulers.telemetry import LiveMetrics

        live = LiveMetrics(port=args.metrics_port, host=args.metrics_host)
    controller = None
    try:
        controller = Controller(graph, resume=args.resume, progress=not args.no_progress, live_metrics=live)
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
