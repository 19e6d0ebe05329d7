"""``rlflow run GRAPH [key=value ...]``: train with the algorithm a graph file describes.

Validates the graph (and the plan against the local devices) before building anything — ``plan: auto`` on
several devices is planned for this host by the planner first (:func:`auto_plan`) — then runs the
controller: progress bar on stderr, run directory and metrics endpoint printed at start, ``--resume`` to
continue from the run directory's latest checkpoint (a run that already did ``run.iterations`` says so and
exits 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.graph import Graph, warn_unplanned_devices
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.spec import GraphSpec, Layout, NodePlacement

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.problem import PlanNode
    from rlflow.schedulers.planner.search import Searcher
    from rlflow.schedulers.records.rundir import TraceRow


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


def resolve_plan(
    graph: Graph, plan_file: Path | None, *, time_budget_s: float = 5.0, profile: Path | None = None
) -> Graph:
    """The graph with ``--plan``'s placements (validated like a graph file's plan), or with ``plan: auto``
    resolved for the local host: one device gives the trivial plan, several devices the planner's plan
    (:func:`auto_plan`, printed to stderr). A graph without a plan on several devices runs every node on
    device 0, with a :class:`~rlflow.dataflow.graph.GraphWarning` saying so.

    Args:
        time_budget_s: wall-clock seconds the planner may search for (``plan: auto`` on > 1 device).
        profile: a profile of this host (``rlflow profile``) the planner fits its rates to.

    Raises:
        PlanError: a plan file that does not fit the graph or its devices.
    """
    spec: GraphSpec = graph.spec
    if plan_file is not None:
        from rlflow.schedulers.planner.plans import load_plan

        placements = load_plan(plan_file)
        try:
            return with_placements(graph, placements)
        except (PlanError, GraphError) as e:  # the plan file is at fault, not the graph file
            prefix, msg = f"{spec.source}: ", str(e)
            if spec.source and msg.startswith(prefix):
                raise type(e)(f"{plan_file}: {msg[len(prefix) :]}") from None
            raise
    if spec.plan == "auto":
        if spec.run.devices == 1:
            return Graph.from_spec(dataclasses.replace(spec, plan={}), graph.registry)
        return auto_plan(graph, time_budget_s=time_budget_s, profile=profile)
    warn_unplanned_devices(spec, stacklevel=2)
    return graph


def local_cluster(devices: int, profile: Path | None = None) -> ClusterSpec:
    """The cluster ``plan: auto`` plans for: this host with ``devices`` devices, fitted to ``profile``
    (``rlflow.schedulers.planner.profile.apply_profile``) when one is given.

    CPU: the ``cpu-local`` preset (one worker process per device) with this host's cores, which the workers
    share. CUDA: the preset whose name matches the GPU (``h200-8x``, ``h100-8x``, ``a100-8x``), else
    ``h100-8x``'s rates with the GPU's own memory (bytes).
    Either way one host with ``devices`` devices (``run.devices``: the worker processes the runtime starts).
    """
    import torch

    from rlflow.schedulers.planner.cluster import load_cluster

    if not torch.cuda.is_available():
        from rlflow.schedulers.planner.profile import host_cores

        base = dataclasses.replace(load_cluster("cpu-local"), cores_per_host=host_cores())
    else:
        name = torch.cuda.get_device_name(0)
        preset = next((p for p in ("h200", "h100", "a100") if p in name.lower()), None)
        base = load_cluster(f"{preset}-8x" if preset else "h100-8x")
        if preset is None:
            memory = float(torch.cuda.get_device_properties(0).total_memory)
            device = dataclasses.replace(base.device, name=name, memory_bytes=memory)
            base = dataclasses.replace(base, name=f"local-{name}", device=device)
    if profile is not None:
        from rlflow.schedulers.planner.profile import apply_profile

        base = apply_profile(base, profile)
    return dataclasses.replace(base, hosts=1, devices_per_host=devices)


def runtime_layout_problem(graph: Graph, node: str, layout: Layout) -> str | None:
    """Why the distributed runtime cannot run ``node`` of ``graph`` with ``layout`` (None when it can).

    The runtime's own rules beyond the planner's shape checks: generation is not pipelined (``pp = 1``
    for a generate node; train and inference nodes may use pipeline stages, at most one per decoder layer);
    the node's rows (prompts for a generate node, samples otherwise: ``Graph.rows``) divide into
    ``mini_batches × dp × micro_batches`` equal shares (``Graph`` validation); a dp rank keeps whole groups
    of samples per prompt (``PlanView.of``).
    """
    spec = graph.node(node)
    if layout.pp > 1:
        if spec.kind == "generate":
            return f"pp={layout.pp}: generation cannot use pipeline stages"
        model = graph.spec.models[spec.model] if spec.model is not None else None
        while model is not None and model.config is None and model.init_from:  # a copy: its source's
            model = graph.spec.models[model.init_from]
        layers = model.config.get("num_hidden_layers") if model is not None and model.config else None
        if isinstance(layers, int) and layers < layout.pp:
            return f"pp={layout.pp}: the model has {layers} layers"
    rows, mini = graph.rows(node), max(1, spec.mini_batches)
    if rows % (mini * layout.dp) or (rows // mini // layout.dp) % layout.micro_batches:
        return (
            f"{rows} rows do not divide into {mini} mini-batches × dp={layout.dp} × m={layout.micro_batches}"
        )
    group = graph.group_size(node)
    if spec.kind != "generate" and group > 1 and layout.dp > 1 and (rows // mini // layout.dp) % group:
        return f"dp={layout.dp} splits groups of {group} samples per prompt"
    return None


def runtime_searcher(graph: Graph, cluster: ClusterSpec, prompt_len: int | None = None) -> Searcher:
    """A :class:`~rlflow.schedulers.planner.search.Searcher` whose layouts are only those the runtime can execute
    (:func:`runtime_layout_problem`); baselines and annealing candidates all come from ``layouts``.

    Args:
        prompt_len: prompt tokens per row for the cost model (default: measured on the graph's data,
            ``problem_from_graph``).
    """
    from rlflow.schedulers.planner.problem import problem_from_graph
    from rlflow.schedulers.planner.search import Searcher

    class RuntimeSearcher(Searcher):
        def layout_problem(self, node: PlanNode, layout: Layout) -> str | None:
            return super().layout_problem(node, layout) or runtime_layout_problem(graph, node.name, layout)

    return RuntimeSearcher(problem_from_graph(graph, prompt_len=prompt_len), cluster)


def with_placements(graph: Graph, placements: Mapping[str, NodePlacement]) -> Graph:
    """``graph`` with ``placements`` (``Graph`` puts the model-free nodes they leave out on device 0,
    ``d1t1p1m1``: ``rlflow plan`` places model nodes only), validated by ``Graph`` and by the runtime's plan
    view (no process starts).

    Raises:
        PlanError, GraphError: the plan does not validate.
    """
    from rlflow.schedulers.runtime.distributed.placement import PlanView

    planned = Graph.from_spec(dataclasses.replace(graph.spec, plan=dict(placements)), graph.registry)
    PlanView.of(planned)
    return planned


def format_plan_table(searcher: Searcher, plan: Mapping[str, NodePlacement]) -> str:
    """Rows of node, devices, layout, micro-batches, predicted seconds and peak memory (bytes, human units)
    per device, as ``rlflow plan`` prints them."""
    from rlflow.schedulers.planner.plans import format_devices
    from rlflow.schedulers.planner.search import human_bytes

    memory = searcher.memory(plan)
    rows = [("node", "devices", "layout", "micro-batches", "predicted s", "peak memory")]
    for node in searcher.problem.nodes:
        p = plan[node.name]
        cost = searcher.cost.node_cost(node, p)
        rows.append(
            (node.name, format_devices(p.devices), str(p.layout), str(p.layout.micro_batches),
             f"{cost.time_s:.4g}", human_bytes(max(memory[d] for d in p.devices)))
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


def predict_plan(graph: Graph, profile: Path | None = None) -> tuple[dict[str, float], list[TraceRow]]:
    """The planner's prediction for the graph's plan on the local host: seconds per model node (its span
    on its workers, weight sync included, as ``timing_s/<node>`` measures it) and the simulated timeline
    of two iterations as trace rows (``predicted_trace.parquet``).

    Returns ``({}, [])`` when the cost model cannot price the plan (e.g. an unusual model config).
    """
    from rlflow.schedulers.planner.simulator import node_spans, simulate
    from rlflow.schedulers.records.rundir import TraceRow

    try:
        cost = runtime_searcher(graph, local_cluster(graph.spec.run.devices, profile)).cost
        plan = {n.name: graph.placement(n.name) for n in cost.problem.nodes}
        timeline = simulate(cost, plan)
        seconds = node_spans(cost, timeline)
        rows = [TraceRow(**row) for row in timeline.to_rows()]  # type: ignore[arg-type]
    except (PlanError, GraphError, KeyError, ValueError, ZeroDivisionError):
        return {}, []
    return seconds, rows


def auto_plan(
    graph: Graph,
    *,
    time_budget_s: float = 5.0,
    restarts: int = 4,
    steps: int = 400,
    stream: TextIO | None = None,
    profile: Path | None = None,
) -> Graph:
    """Resolve ``plan: auto`` for ``run.devices`` > 1 local devices with the planner.

    Searches (seed ``run.seed``, at most ``restarts`` annealing chains of ``steps`` moves, stopping after
    ``time_budget_s`` seconds) over the layouts the runtime supports (:func:`runtime_layout_problem`) on
    :func:`local_cluster`, validates the result like a hand-written plan, and prints the plan table with the
    predicted iteration time (seconds) to ``stream`` (default stderr). Should the searched plan fail to
    validate or the search fail, it falls back to the first valid baseline (colocate, split, heuristic),
    then to every node on device 0, and says so.

    Returns:
        the graph with the chosen plan (validated; no process started).
    """
    out = sys.stderr if stream is None else stream
    spec = graph.spec
    cluster = local_cluster(spec.run.devices, profile)
    tried: list[str] = []
    try:
        searcher = runtime_searcher(graph, cluster)
        result = searcher.search(
            seed=spec.run.seed, restarts=restarts, steps=steps, time_budget_s=time_budget_s
        )
    except (PlanError, GraphError) as err:
        print(f"rlflow: plan auto: the planner found no plan ({err})", file=out)
        tried.append("search")
    else:
        candidates = [("searched", result.plan, result.iteration_s)]
        candidates += [(f"baseline {k}", p, s) for k, (p, s) in result.baselines.items() if p is not None]
        for what, plan, seconds in candidates:
            try:
                planned = with_placements(graph, plan)
            except (PlanError, GraphError) as err:
                print(f"rlflow: plan auto: the {what} plan does not validate ({err})", file=out)
                tried.append(what)
                continue
            note = f" (fallback: {', '.join(tried)} did not validate)" if tried else ""
            print(
                f"rlflow: plan auto on {cluster.name} ({cluster.num_devices} devices): {what} plan{note}, "
                f"predicted iteration {seconds:.4g} s ({result.evaluated} plans simulated in "
                f"{result.seconds:.1f} s)",
                file=out,
            )
            print(format_plan_table(searcher, plan), file=out)
            for name, (_p, base_s) in result.baselines.items():
                why = searcher.infeasible.get(name, "")
                shown = f"{base_s:.4g} s" if math.isfinite(base_s) else f"infeasible: {why}"
                print(f"  baseline {name}: {shown}", file=out)
            return planned
    print("rlflow: plan auto: falling back to every node on device 0 (d1t1p1m1)", file=out)
    return with_placements(graph, {name: NodePlacement((0,), Layout()) for name in graph.spec.nodes})


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
