"""``plan: auto`` and the planner's view of a graph it runs: the plan for this host, its predictions.

``rlflow run`` resolves a graph's plan here before anything starts (:func:`resolve_plan`): a plan file's
placements, or ``plan: auto`` searched on ``cluster_files.local_cluster`` (this host, optionally fitted to a
profile) over the layouts the shared rule (``rlflow.dataflow.layout_rules``) allows. Pure planning: no process
starts and nothing of the runtime is imported (torch only to ask which device this host has).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.graph import Graph, GraphWarning, warn_unplanned_devices
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.dataflow.spec import GraphSpec
from rlflow.schedulers.planner.cluster import ClusterSpec, human_bytes
from rlflow.schedulers.planner.cluster_files import local_cluster
from rlflow.schedulers.planner.decisions import PINNED, SEARCHED, node_decision_lists
from rlflow.schedulers.planner.graph_problem import engine_choices, problem_from_graph
from rlflow.schedulers.planner.plans import format_devices, load_plan
from rlflow.schedulers.planner.problem import float32_warnings
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.segment_cost import segment_warnings
from rlflow.schedulers.planner.simulator import node_spans, simulate

if TYPE_CHECKING:
    from rlflow.schedulers.records.rundir import TraceRow

__all__ = [
    "auto_plan",
    "format_plan_table",
    "graph_searcher",
    "predict_plan",
    "resolve_plan",
    "with_placements",
]


def resolve_plan(
    graph: Graph, plan_file: Path | None, *, time_budget_s: float = 5.0, profile: Path | None = None
) -> Graph:
    """The graph with ``--plan``'s placements (validated like a graph file's plan), or with ``plan: auto``
    resolved for the local host: several devices, or one where a generate node's engine is searched (left
    out or ``auto``) and vLLM can serve it, or where a vLLM node's memory share is (no
    ``args.gpu_memory_utilization``: ``engine_share``), give the planner's plan (:func:`auto_plan`, printed
    to stderr);
    one device otherwise the trivial plan, not searched (d1t1p1m1, each decision the graph leaves out at
    ``rlflow.dataflow.node_spec.UNPLANNED``'s value). A graph without a plan runs every node on device 0
    (with a :class:`~rlflow.dataflow.graph.GraphWarning` on several devices). A hand-written plan (or plan
    file) runs each decision the graph leaves to the plan with the value it names, ``UNPLANNED``'s where it
    names none (``rlflow.dataflow.plan_spec.resolve_engine`` and its siblings).

    Args:
        time_budget_s: wall-clock seconds the planner may search for (``plan: auto`` on > 1 device).
        profile: a profile of this host (``rlflow profile``) the planner fits its rates to.

    Raises:
        PlanError: a plan file that does not fit the graph or its devices.
    """
    spec: GraphSpec = graph.spec
    if plan_file is not None:
        placements = load_plan(plan_file)
        try:
            return with_placements(graph, placements)
        except (PlanError, GraphError) as e:  # the plan file is at fault, not the graph file
            prefix, msg = f"{spec.source}: ", str(e)
            if spec.source and msg.startswith(prefix):
                raise type(e)(f"{plan_file}: {msg[len(prefix) :]}") from None
            raise
    if spec.plan == "auto":
        if spec.run.devices == 1 and not _engine_choice(graph) and not _share_to_choose(graph):
            return Graph.from_spec(dataclasses.replace(spec, plan={}), graph.registry)
        return auto_plan(graph, time_budget_s=time_budget_s, profile=profile)
    warn_unplanned_devices(spec, stacklevel=2)
    return graph


def _engine_choice(graph: Graph) -> bool:
    """Whether a generate node of ``graph`` whose engine is searched has more than one engine on this
    host's devices (``graph_problem.engine_choices``: vLLM installed and able to serve it)."""
    if not any(n.kind == "generate" and n.engine == "auto" for n in graph.spec.nodes.values()):
        return False  # no device probe for a graph without the choice
    import torch  # lazily: the rest of the planner is torch-free

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return any(
        len(engine_choices(graph, name, device_type)) > 1
        for name, n in graph.spec.nodes.items()
        if n.kind == "generate"
    )


def _share_to_choose(graph: Graph) -> bool:
    """Whether a generate node of ``graph`` runs vLLM with no memory share pinned (its
    ``args.gpu_memory_utilization``): the planner chooses it (``engine_share``)."""
    return any(
        n.kind == "generate" and n.engine == "vllm" and graph.args(name).get("gpu_memory_utilization") is None
        for name, n in graph.spec.nodes.items()
    )


def graph_searcher(graph: Graph, cluster: ClusterSpec, prompt_len: int | None = None) -> Searcher:
    """A :class:`~rlflow.schedulers.planner.search.Searcher` for ``graph`` on ``cluster``: its layouts are
    those the shared rule allows (``rlflow.dataflow.layout_rules``), which the graph's plan checks and the
    runtime apply too; baselines and annealing candidates all come from ``Searcher.layouts``.

    Generate nodes with ``engine: auto`` may run the engines that can serve them on the cluster's device
    type (``graph_problem.engine_choices``: vLLM when installed and able to serve the model); the search picks
    one per node by predicted cost and names it in the placement.

    Args:
        prompt_len: prompt tokens per row for the cost model (default: measured on the graph's data,
            ``problem_from_graph``).
    """
    problem = problem_from_graph(graph, prompt_len=prompt_len, device_type=cluster.device_type)
    return Searcher(problem, cluster)


def with_placements(graph: Graph, placements: Mapping[str, NodePlacement]) -> Graph:
    """``graph`` with ``placements`` (``Graph`` puts the model-free nodes they leave out on device 0,
    ``d1t1p1m1``: ``rlflow plan`` places model nodes only), validated by ``Graph``, whose plan checks use
    the layout rule the runtime's plan view uses (no process starts). Of its :class:`GraphWarning` messages
    only those ``graph`` did not give are shown (those about the placements, e.g. staleness on shared
    devices); the others were shown when ``graph`` was built.

    Raises:
        PlanError, GraphError: the plan does not validate.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        placed = Graph.from_spec(dataclasses.replace(graph.spec, plan=dict(placements)), graph.registry)
    for msg in placed.warnings:
        if msg not in graph.warnings:
            warnings.warn(GraphWarning(msg), stacklevel=3)
    return placed


def format_plan_table(searcher: Searcher, plan: Mapping[str, NodePlacement]) -> str:
    """Rows of node, device ids, layout, micro-batches, engine (a generate node's; ``deepspeed`` for a
    DeepSpeed train node; ``-`` for others; ``recompute`` added where a train node recomputes activations,
    ``no reshard`` where its FSDP2 units stay gathered through each optimizer step (``reshard: false``)),
    predicted seconds and peak memory (bytes, human units) per device, the decisions the search made and
    those the graph pinned (``decisions.node_decisions``; ``-``: none), as
    ``rlflow plan`` prints them, then, when a node runs vLLM, a line on the engine's rates (measured by the
    profile, or the default) and start time. Device ids read as a list (``[4]``, ``[0-3]``, ``[0,2]``),
    never as a count. A model-free node (a rule reward; ``PlanProblem.order``) has a row too, ``no model``:
    the plan leaves it out, so it runs where a plan puts a node it leaves out (device 0, ``d1t1p1m1``), and
    ``-`` for time and memory, which the planner does not price; a line under the table says so."""
    memory = searcher.memory(plan)
    rows = [("node", "device ids", "layout", "micro-batches", "engine", "predicted s", "peak memory",
             "searched", "pinned")]  # fmt: skip
    vllm = []
    model_free = []
    placed = {node.name: node for node in searcher.problem.nodes}
    for name in searcher.problem.order or placed:
        if name not in placed:  # Graph's placement of a node a plan leaves out
            model_free.append(name)
            left_out = NodePlacement((0,), Layout())
            rows.append(
                (name, f"[{format_devices(left_out.devices)}]", str(left_out.layout),
                 str(left_out.layout.micro_batches), "no model", "-", "-", "-", "-")
            )  # fmt: skip
            continue
        node = placed[name]
        p = plan[node.name]
        cost = searcher.cost.node_cost(node, p)
        engine = node.engine_of(p.engine) if node.kind == "generate" else "-"
        if engine == "vllm":
            vllm.append(node.name)
        shown = engine
        if engine == "vllm":  # its memory share: pinned by the graph or chosen by the planner (engine_share)
            share = node.share_of(p.gpu_memory_utilization)
            shown = f"vllm, share {share:g}" if share is not None else "vllm, default KV cache"
        if node.zero is not None:
            shown = "deepspeed"
        if node.recompute_of(p.recompute):
            shown = ("" if shown == "-" else f"{shown}, ") + "recompute"
        if node.kind == "train" and p.layout.dp > 1 and node.zero is None and not node.reshard_of(p.reshard):
            shown = ("" if shown == "-" else f"{shown}, ") + "no reshard"
        searched, pinned = (node_decision_lists(node, p)[how] for how in (SEARCHED, PINNED))
        rows.append(
            (node.name, f"[{format_devices(p.devices)}]", str(p.layout), str(p.layout.micro_batches), shown,
             f"{cost.time_s:.4g}", human_bytes(max(memory[d] for d in p.devices)),
             ", ".join(searched) or "-", ", ".join(pinned) or "-")
        )  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    if model_free:
        lines.append(
            f"no model ({', '.join(model_free)}): not in the plan file and not priced (no time or memory "
            "predicted); runs on device 0 (d1t1p1m1), where a plan puts a node it leaves out"
        )
    if vllm:
        rates = searcher.cluster.engine_rates()
        lines.append(
            f"vLLM engine ({', '.join(vllm)}): "
            + (
                f"rates measured by the profile; each engine starts once per run in {rates.start_s:.3g} s "
                "(not in the iteration time)"
                if rates.measured
                else "published rates of the cluster file (its `engine` section; measure them with "
                "`rlflow profile` where vLLM is installed)"
                if rates.published
                else "no engine rates in the profile: priced as the built-in loop plus its weight load "
                "(measure them with `rlflow profile` where vLLM is installed)"
            )
        )
    return "\n".join(lines)


def predict_plan(graph: Graph, profile: Path | None = None) -> tuple[dict[str, float], list[TraceRow]]:
    """The planner's prediction for the graph's plan on the local host: seconds per model node (its span
    on its workers, weight sync included, as ``timing_s/<node>`` measures it) and the simulated timeline
    of two iterations as trace rows (``predicted_trace.parquet``).

    Returns ``({}, [])`` when the cost model cannot price the plan (e.g. an unusual model config).
    """
    from rlflow.schedulers.records.rundir import TraceRow  # pyarrow: only when predicting

    try:
        cost = graph_searcher(graph, local_cluster(graph.spec.run.devices, profile)).cost
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
    """Resolve ``plan: auto`` for ``run.devices`` local devices with the planner (on one device it only
    chooses the engines of ``engine: auto`` nodes, and micro-batches).

    Searches (seed ``run.seed``, at most ``restarts`` annealing chains of ``steps`` moves, stopping after
    ``time_budget_s`` seconds of search with the best plan found by then; reading the graph, which in a fresh
    process imports what it needs, does not count) over the layouts the shared rule allows
    (:func:`graph_searcher`) on ``cluster_files.local_cluster``, validates the result like a hand-written
    plan, and prints the plan table with the predicted iteration time (seconds) to ``stream`` (default
    stderr). Should the searched plan fail to validate or the search fail, it falls back to the first valid
    baseline (colocate, split, disaggregate, heuristic), then to every node on device 0, and says so.

    Returns:
        the graph with the chosen plan (validated; no process started).
    """
    out = sys.stderr if stream is None else stream
    spec = graph.spec
    cluster = local_cluster(spec.run.devices, profile)
    tried: list[str] = []
    try:
        searcher = graph_searcher(graph, cluster)
        for line in float32_warnings(searcher.problem, cluster.device_type):
            print(f"rlflow: plan auto: {line}", file=out)
        for line in segment_warnings(searcher.problem.nodes):  # what the segments' pricing leaves out
            print(f"rlflow: plan auto: {line}", file=out)
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
                f"predicted iteration {seconds:.4g} s ({result.describe()})",
                file=out,
            )
            print(format_plan_table(searcher, plan), file=out)
            for name, (_p, base_s) in result.baselines.items():
                why, cut = searcher.infeasible.get(name, ""), searcher.budget_cut.get(name)
                shown = f"{base_s:.4g} s" if math.isfinite(base_s) else cut or f"infeasible: {why}"
                shown += f"; {cut}" if cut and math.isfinite(base_s) else ""
                print(f"  baseline {name}: {shown}", file=out)
            return planned
    print("rlflow: plan auto: falling back to every node on device 0 (d1t1p1m1)", file=out)
    return with_placements(graph, {name: NodePlacement((0,), Layout()) for name in graph.spec.nodes})
