"""``rlflow run GRAPH [key=value ...]``: train with the algorithm a graph file describes.

Validates the graph, then takes the run directory's lock and checks the directory (a live run's, a file,
not writable, checkpoints without ``--resume``/``--overwrite``) and the metrics address, all before
planning — ``plan: auto`` on several devices is planned for this host by the planner
(:func:`rlflow.schedulers.planner.auto.resolve_plan`) — and before building anything; then runs the
controller (its workers started by ``--launcher``/``run.launcher``: embedded processes, Ray actors — Ray's
connection and free devices checked before anything starts — or torchrun workers): progress bar on stderr,
run directory and metrics endpoint printed at start, ``--resume`` to continue from the run directory's
latest checkpoint (a run that already did ``run.iterations`` says so and exits 0). SIGINT, SIGTERM and
SIGHUP save a checkpoint and exit with 128 + the signal's number (130, 143, 129).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import DataError, GraphError, HostError, PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.run_spec import LAUNCHERS
from rlflow.schedulers.commands.validate import prompt_mistakes
from rlflow.schedulers.planner.auto import predict_plan, resolve_plan
from rlflow.schedulers.planner.resources import check_plan_memory
from rlflow.schedulers.records.runlock import RunDirLock

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph
    from rlflow.schedulers.records.telemetry import LiveMetrics


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
        "--stop-timeout",
        type=_stop_timeout,
        default=None,
        metavar="SECONDS",
        help="after SIGTERM/SIGHUP, seconds the iteration in flight has to finish before it is abandoned "
        "(default 20: schedulers send SIGKILL 30 s after SIGTERM); then a checkpoint is saved",
    )


def load_run_graph(args: argparse.Namespace) -> Graph:
    """The graph ``rlflow run`` runs, before planning: the file with its overrides, ``--devices`` and
    ``--launcher``. With ``--plan`` the file's own plan is set aside (``plan: auto``), so that checks and
    warnings about placements (e.g. staleness on shared devices) are made on ``--plan``'s placements
    when :func:`~rlflow.schedulers.planner.auto.resolve_plan` applies them, not on the file's.

    Raises:
        GraphError: the graph file or an override is invalid, or a ``plan`` override comes with ``--plan``
            (the file replaces the whole plan, so the override would be dropped).
    """
    if args.plan is not None:
        for item in args.overrides:
            key = str(item).split("=", 1)[0].strip()
            if key == "plan" or key.startswith("plan."):
                raise GraphError(
                    f"{item}: --plan {args.plan} replaces the graph's whole plan, so this override would be "
                    f"ignored; put the placement in {args.plan}, or drop --plan"
                )
    overrides = list(args.overrides) + ([f"run.devices={args.devices}"] if args.devices is not None else [])
    overrides += [f"run.launcher={args.launcher}"] if args.launcher else []
    overrides += ["plan=auto"] if args.plan is not None else []
    return load_graph(args.graph, overrides)


def run(args: argparse.Namespace) -> int:
    graph = load_run_graph(args)
    # Taken before planning and held by the controller for the run's life: a second run of the directory
    # (new, --overwrite or --resume) stops here, before it deletes or plans anything.
    with RunDirLock(graph.spec.run.output_dir) as lock:
        return _run_locked(args, graph, lock)


def _run_locked(args: argparse.Namespace, graph: Graph, lock: RunDirLock) -> int:
    from rlflow.schedulers.records.rundir import latest_checkpoint
    from rlflow.schedulers.runtime.controller import (
        DEFAULT_STOP_TIMEOUT_S,
        Controller,
        RunAbandoned,
        start_checkpoint,
    )

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
    start_checkpoint(Path(run_spec.output_dir), resume=args.resume, overwrite=args.overwrite)
    if args.profile is not None and not args.profile.is_file():
        raise PlanError(f"--profile {args.profile}: no such file (write one with `rlflow profile`)")
    live = _live_metrics(args)
    controller = None
    owns_ray = False
    try:
        graph = resolve_plan(graph, args.plan, profile=args.profile)
        check_plan_memory(graph)  # every model, its copies and caches against this machine's memory
        too_long = prompt_mistakes(graph)  # over-long prompts stop the run before any worker starts
        if too_long:
            raise DataError(too_long[0])
        predicted_s, predicted_rows = predict_plan(graph, args.profile)
        executor_config, owns_ray = _launcher(graph, args.address)
        controller = Controller(
            graph,
            resume=args.resume,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            live_metrics=live,
            predicted_s=predicted_s,
            lock=lock,
            stop_timeout_s=args.stop_timeout or DEFAULT_STOP_TIMEOUT_S,
            executor_config=executor_config,
        )
        if predicted_rows:
            controller.recorder.write_predicted_trace(predicted_rows)
        print(f"rlflow: run directory {controller.run_dir}", file=sys.stderr)
        if live is not None:
            print(f"rlflow: metrics at {live.url}", file=sys.stderr)
        result = controller.run()
    except RunAbandoned as e:
        print(f"rlflow run: stopped by {signal.Signals(e.signum).name}: {e}", file=sys.stderr)
        return 128 + e.signum
    finally:
        if controller is not None:
            controller.close()
        if owns_ray:  # the local Ray instance started for this run stops with it
            import ray

            ray.shutdown()
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
    if result.signal is not None:
        name = signal.Signals(result.signal).name
        print(
            f"rlflow: stopped by {name} after iteration {result.iteration} (checkpoint saved); resume with "
            "--resume",
            file=sys.stderr,
        )
        return 128 + result.signal
    return 0


def _launcher(graph: Graph, address: str | None) -> tuple[dict[str, Any], bool]:
    """The executor settings of ``run.launcher`` and ``--address``; whether this call connected to Ray.

    For ``ray`` (and a plan with workers) it connects to the cluster and checks its free devices now,
    before any worker starts.

    Raises:
        PlanError: ``--address`` without a launcher that takes one, or a torchrun address that is not
            ``HOST:PORT``.
        HostError: Ray is not installed, unreachable at ``address``, or has too few free devices.
    """
    from rlflow.schedulers.runtime.choose_executor import is_trivial_plan

    launcher = graph.spec.run.launcher
    if address is not None and launcher == "embedded":
        raise PlanError(f"--address {address}: only --launcher ray or torchrun take an address")
    if launcher == "torchrun" and address is not None:
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit() or int(port) > 65535:
            raise PlanError(f"--address {address!r}: expected HOST:PORT for the controller to listen on")
        return {"address": (host or "0.0.0.0", int(port))}, False
    if launcher != "ray" or is_trivial_plan(graph):
        return {}, False
    from rlflow.schedulers.runtime.distributed.protocol import DistConfig
    from rlflow.schedulers.runtime.distributed.ray_launch import prepare

    owns, _ = prepare(graph.spec.run.devices, DistConfig(launch="ray", ray_address=address))
    return {"ray_address": address}, owns


def _live_metrics(args: argparse.Namespace) -> LiveMetrics | None:
    """The metrics endpoint of ``--metrics-port``/``--metrics-host``, or ``None`` without a port.

    Raises:
        HostError: the address cannot be bound (port in use, an address not on this host, a name that
            does not resolve).
    """
    if args.metrics_port is None:
        return None
    from rlflow.schedulers.records.telemetry import LiveMetrics

    try:
        return LiveMetrics(port=args.metrics_port, host=args.metrics_host)
    except OSError as e:
        raise HostError(
            f"--metrics-port {args.metrics_port} --metrics-host {args.metrics_host}: cannot serve metrics "
            f"there: {e.strerror or e}"
        ) from e
