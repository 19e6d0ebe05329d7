"""One stage of ``rlflow run``: run one graph file, from its checks to its dashboard.

Takes the run directory's lock and checks the directory (a live run's, a file, not writable, checkpoints
without ``--resume``/``--overwrite``) and the metrics address, all before planning — ``plan: auto`` on
several devices is planned for this host by the planner
(:func:`rlflow.schedulers.planner.auto.resolve_plan`) — and before building anything; then runs the
controller (its workers started by ``--launcher``/``run.launcher``), prints the evaluations and writes the
run's dashboard (``RUN_DIR/dashboard.html``). What it did comes back as a :class:`StageResult`, read from
the run directory's metrics (so a resumed or already finished stage reports its whole run).
"""

from __future__ import annotations

import argparse
import functools
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import DataError, GraphError, HostError, PlanError, ProcessLost
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.commands.validate import data_mistakes
from rlflow.schedulers.planner.auto import predict_plan, resolve_plan
from rlflow.schedulers.planner.host_limits import fit_to_host
from rlflow.schedulers.planner.resources import check_plan_memory
from rlflow.schedulers.records.runlock import RunDirLock

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph
    from rlflow.schedulers.records.telemetry import LiveMetrics
    from rlflow.schedulers.runtime.controller import RunResult
    from rlflow.schedulers.runtime.restarts import Restart

ACCURACY = "val/accuracy"


@dataclass(frozen=True)
class StageResult:
    """What one stage did, as its run directory records it.

    ``iterations``: the last iteration recorded (0: none); ``samples``: samples generated (else rows
    trained) over the whole run, from ``perf/num_samples``; ``accuracy``: ``(iteration, val/accuracy)``
    of the first and the last evaluation (None without two); ``wall_s``: seconds this call ran the stage
    (None: it had nothing to do); ``exit_code``: 0, or 128 + the signal that stopped it.
    """

    source: str
    run_dir: Path
    iterations: int
    samples: int
    accuracy: tuple[tuple[int, float], tuple[int, float]] | None
    wall_s: float | None
    dashboard: Path | None = None
    exit_code: int = 0

    @classmethod
    def read(cls, graph: Graph, wall_s: float | None, exit_code: int = 0) -> StageResult:
        """The stage of ``graph`` as its run directory holds it (metrics read with
        :func:`~rlflow.schedulers.records.rundir.read_metrics`)."""
        from rlflow.schedulers.records.rundir import read_metrics

        run_dir = Path(graph.spec.run.output_dir)
        try:
            rows = read_metrics(run_dir).to_pylist()
        except DataError:  # no metrics yet: stopped before its first iteration
            rows = []
        last = max((int(r["iteration"]) for r in rows), default=0)
        samples = sum(int(r.get("perf/num_samples") or 0) for r in rows)
        evals = sorted(
            (int(r["iteration"]), float(r[ACCURACY]))
            for r in rows
            if r.get(ACCURACY) is not None and not math.isnan(r[ACCURACY])
        )
        accuracy = (evals[0], evals[-1]) if len(evals) >= 2 else None
        return cls(str(graph.spec.source), run_dir, last, samples, accuracy, wall_s, exit_code=exit_code)


def load_run_graph(args: argparse.Namespace, path: str | Path, overrides: list[str]) -> Graph:
    """The graph file ``path`` as ``rlflow run`` runs it, before planning: with ``overrides``,
    ``--devices``, ``--launcher`` and ``--max-restarts``. With ``--plan`` the file's own plan is set aside
    (``plan: auto``), so that checks and warnings about placements (e.g. staleness on shared devices) are
    made on ``--plan``'s placements when :func:`~rlflow.schedulers.planner.auto.resolve_plan` applies
    them, not on the file's.

    Raises:
        GraphError: the graph file or an override is invalid, or a ``plan`` override comes with ``--plan``
            (the file replaces the whole plan, so the override would be dropped).
    """
    if args.plan is not None:
        for item in overrides:
            key = str(item).split("=", 1)[0].strip()
            if key == "plan" or key.startswith("plan."):
                raise GraphError(
                    f"{item}: --plan {args.plan} replaces the graph's whole plan, so this override would be "
                    f"ignored; put the placement in {args.plan}, or drop --plan"
                )
    overrides = list(overrides) + ([f"run.devices={args.devices}"] if args.devices is not None else [])
    overrides += [f"run.launcher={args.launcher}"] if args.launcher else []
    max_restarts = getattr(args, "max_restarts", None)
    overrides += [f"run.max_restarts={max_restarts}"] if max_restarts is not None else []
    overrides += ["plan=auto"] if args.plan is not None else []
    return load_graph(path, overrides)


def run_stage(args: argparse.Namespace, graph: Graph) -> StageResult:
    """Run ``graph`` (loaded by :func:`load_run_graph`) under its run directory's lock, print its
    evaluations, write its dashboard; what it did.

    Raises:
        RlflowError: a check failed before the run, or the run failed (the controller's errors).
    """
    # Taken before planning and held by the controller for the run's life: a second run of the directory
    # (new, --overwrite or --resume) stops here, before it deletes or plans anything.
    with RunDirLock(graph.spec.run.output_dir) as lock:
        done = _run_locked(args, graph, lock)
    if args.dashboard and done.iterations > 0:
        from rlflow.schedulers.records.render import render_dashboard

        out = render_dashboard([done.run_dir], done.run_dir / "dashboard.html")
        done = StageResult(**{**done.__dict__, "dashboard": out})
    return done


def _run_locked(args: argparse.Namespace, graph: Graph, lock: RunDirLock) -> StageResult:
    from rlflow.schedulers.records.checkpoint_check import set_aside_broken
    from rlflow.schedulers.records.rundir import latest_checkpoint
    from rlflow.schedulers.runtime.controller import (
        DEFAULT_STOP_TIMEOUT_S,
        Controller,
        RunAbandoned,
        resume_hint,
        start_checkpoint,
    )
    from rlflow.schedulers.runtime.evaluation import eval_line
    from rlflow.schedulers.runtime.restarts import (
        amended,
        before_restart,
        ctrl_c_raises,
        stop_signals_raise,
        supervise,
    )

    run_spec = graph.spec.run
    if args.resume and not args.overwrite:  # a broken newest checkpoint: set aside, named (a warning)
        set_aside_broken(run_spec.output_dir)
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
        return StageResult.read(graph, None)
    start_checkpoint(Path(run_spec.output_dir), resume=args.resume, overwrite=args.overwrite)
    if args.profile is not None and not args.profile.is_file():
        raise PlanError(f"--profile {args.profile}: no such file (write one with `rlflow profile`)")
    live = _live_metrics(args)
    planned: dict[int, tuple[Graph, Graph]] = {}  # id of a graph as loaded -> (it, its plan resolved)
    owns_ray = False

    def attempt(loaded: Graph, restart: Restart | None) -> tuple[Graph, RunResult, float]:
        """Plan (once per graph as loaded: a restart keeps the run's plan), start and run the controller
        (a restart resumes: ``restart``); stops every process it started before it returns or raises."""
        nonlocal owns_ray
        controller = None
        why = (
            "while the run was starting (nothing trained, no checkpoint written, no worker left running)"
            if restart is None
            # a restart resumes from the directory's latest sound checkpoint (broken ones set aside)
            else f"while the run was restarting (no worker left running; {resume_hint(run_spec.output_dir)})"
        )
        try:
            # SIGTERM/SIGHUP before the run loop (planning, workers starting): one line, no worker left
            with stop_signals_raise(RunAbandoned, why):
                graph = planned[id(loaded)][1] if id(loaded) in planned else _plan(args, loaded)
                planned[id(loaded)] = (loaded, graph)
                predicted_s, predicted_rows = predict_plan(graph, args.profile)
                executor_config, owns = _launcher(graph, args.address)
                owns_ray = owns_ray or owns
                controller = Controller(
                    graph,
                    resume=args.resume and restart is None,
                    overwrite=args.overwrite and restart is None,
                    progress=not args.no_progress,
                    live_metrics=live,
                    predicted_s=predicted_s,
                    lock=lock,
                    stop_timeout_s=args.stop_timeout or DEFAULT_STOP_TIMEOUT_S,
                    executor_config=executor_config,
                    on_eval=lambda it, values: print(eval_line(it, values), flush=True),  # as each happens
                    restart=restart,
                )
            if predicted_rows:
                controller.recorder.write_predicted_trace(predicted_rows)
            if restart is None:
                print(f"rlflow: run directory {controller.run_dir}", file=sys.stderr)
                if live is not None:
                    print(f"rlflow: metrics at {live.url}", file=sys.stderr)
            started = time.monotonic()
            result = controller.run()
            return graph, result, time.monotonic() - started
        finally:
            if controller is not None:
                controller.close()

    try:
        # a Ctrl-C stops the run at any phase (SIGINT may have come ignored); the lock is held from the
        # first attempt to the last, restarts included
        with ctrl_c_raises(), lock.kept():
            wait = functools.partial(before_restart, address=args.address)  # a Ray cluster's, to wait on
            graph, result, wall_s = supervise(attempt, graph, abandon=RunAbandoned, wait=wait)
    except RunAbandoned as e:
        print(f"rlflow run: stopped by {signal.Signals(e.signum).name}: {e}", file=sys.stderr)
        return StageResult.read(graph, None, exit_code=128 + e.signum)
    except ProcessLost as e:  # no restart allowed or left: say where --resume goes on from
        raise amended(e, resume_hint(run_spec.output_dir)) from e
    finally:
        if owns_ray:  # the local Ray instance started for this run stops with it
            import ray

            ray.shutdown()
        if live is not None:
            live.close()
    if result.signal is not None:
        name = signal.Signals(result.signal).name
        print(
            f"rlflow: stopped by {name} after iteration {result.iteration} (checkpoint saved); resume with "
            "--resume",
            file=sys.stderr,
        )
        return StageResult.read(graph, wall_s, exit_code=128 + result.signal)
    return StageResult.read(graph, wall_s)


def _plan(args: argparse.Namespace, graph: Graph) -> Graph:
    """``graph`` with its plan resolved and checked against this host: ``--plan`` or ``plan: auto``, the
    devices its workers use, memory, and the data (unreadable, malformed or over-long prompts stop the run
    before any worker starts).

    Raises:
        PlanError, DataError, GraphError: the plan or the data cannot run here.
    """
    graph = resolve_plan(graph, args.plan, profile=args.profile)
    graph, compacted = fit_to_host(graph)  # CPU: workers for the devices the plan uses, and cores
    if compacted:
        print(compacted, file=sys.stderr)
    check_plan_memory(graph)  # every model, its copies and caches against this machine's memory
    from rlflow.schedulers.runtime.restarts import warn_if_nothing_to_restart

    warn_if_nothing_to_restart(graph)  # run.max_restarts on a plan with no process to lose
    too_long = data_mistakes(graph)
    if too_long:
        raise DataError(too_long[0])
    return graph


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
