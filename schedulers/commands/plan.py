"""``rlflow plan GRAPH --cluster CLUSTER``: search a plan, compare it with the baselines, write it out.

Prints a table (node, devices, layout, micro-batches, predicted seconds, peak memory per device, the
decisions searched and those the graph pinned: ``planner/decisions.py``), the
predicted iteration time of the searched plan against each baseline (colocate / split / disaggregate /
heuristic), writes the plan YAML (``--out``, default ``out/plan.yaml``; each placement with its
``searched`` / ``pinned`` record; loadable by
``rlflow.schedulers.planner.plans.load_plan`` and ``rlflow run --plan``) headed by comments that record
how it was made (graph file, overrides, cluster, hosts, profile, search options, rlflow version, date) and
how the search went (plans simulated, whether the time budget cut it short), the predicted trace
(``--trace``, Parquet) and a Gantt chart per device (``--gantt``, PNG).

The search (``--restarts`` annealing chains of ``--steps`` moves, ``--seed``) runs within ``--time-budget``
seconds of wall-clock time, counted from the start of the command (reading the graph and building the
candidate placements count; ``Searcher.search``'s ``time_budget_s``, and the searcher's ``deadline`` for
the candidates): when they are spent the best plan found so far is written. Model-free nodes (rule
rewards) have a row in the table (``format_plan_table``). Before searching it refuses the local files the
graph names that do not exist (a model's checkpoint not written yet: the stage that writes it is named) and
engine arguments the cluster's devices cannot honour, as ``rlflow validate`` does (``missing_files``,
``check_engine_args``: sleep mode off CUDA).

Example: ``rlflow plan examples/ppo.yaml --cluster h100-8x --hosts 2 --out runs/ppo/plan.yaml``;
``--cluster ray [--address HOST:PORT]`` plans for the live Ray cluster's hosts and devices
(:mod:`rlflow.schedulers.planner.ray_cluster`).
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import GraphMistakes, PlanError
from rlflow.schedulers.commands import OUT_DIR
from rlflow.schedulers.planner.decisions import decision_lists
from rlflow.schedulers.planner.lengths import expected_longest
from rlflow.schedulers.planner.plans import dump_plan

if TYPE_CHECKING:
    from rlflow.dataflow.plan_spec import NodePlacement
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.search import Searcher


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("graph", help="graph file (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted graph overrides")
    parser.add_argument(
        "--cluster",
        default="cpu-local",
        help="cluster preset name or file (default cpu-local), or 'ray': the live Ray cluster's hosts and "
        "devices (see --address)",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="with --cluster ray: the Ray head's address (default RAY_ADDRESS, else 'auto': the cluster this "
        "host joined)",
    )
    parser.add_argument("--hosts", type=int, default=None, help="override the cluster's host count")
    parser.add_argument(
        "--profile", default=None, help="Parquet from `rlflow profile` for measured efficiencies"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help="prompt tokens per row (default: measured on the graph's data, else 128)",
    )
    parser.add_argument(
        "--mean-new-tokens",
        type=float,
        default=None,
        help="mean response tokens of the generate nodes, for the length model: a call decodes until its "
        "longest row ends (default: measured on the data set's responses, else every response runs to "
        "max_new_tokens)",
    )
    parser.add_argument(
        "--out", default=str(OUT_DIR / "plan.yaml"), help=f"plan YAML to write (default {OUT_DIR}/plan.yaml)"
    )
    parser.add_argument("--gantt", default=None, help="Gantt PNG (default: --out with .png)")
    parser.add_argument("--trace", default=None, help="predicted trace Parquet (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the annealing search (default 0)")
    parser.add_argument(
        "--restarts", type=_count(0), default=4, help="annealing chains (default 4; 0: the baselines only)"
    )
    parser.add_argument(
        "--steps", type=_count(1), default=1500, help="annealing steps per restart (default 1500)"
    )
    parser.add_argument(
        "--time-budget",
        type=_budget,
        default=TIME_BUDGET_S,
        metavar="SECONDS",
        help=f"wall-clock seconds for planning: reading the graph, candidate placements, baselines and "
        f"annealing (default {TIME_BUDGET_S:g}: the command plans 1,024 GPUs in under a minute on 2 cores). "
        "Annealing stops when they are spent and the best plan found so far is written; the plan's header "
        "says whether the budget cut the search short. 'inf': no budget, the plan then depends on --seed "
        "alone",
    )
    parser.add_argument("--exhaustive", action="store_true", help="exhaustive search (small clusters)")


# Default of --time-budget: with the output after it (the Gantt chart of 1,024 devices takes some 10 s)
# `rlflow plan` of four 70B models on 1,024 GPUs stays under 60 s on 2 cores (bench/README.md, "Planner at
# scale").
TIME_BUDGET_S = 35.0


def _budget(text: str) -> float:
    """``--time-budget``: seconds >= 0, or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0, or inf), got {text!r}") from None
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected seconds (a number >= 0, or inf), got {text!r}")
    return value


def _count(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``least``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {text!r}")
        return value

    return parse


def provenance(args: argparse.Namespace, cluster_text: str) -> list[str]:
    """Header lines of the plan YAML saying how it was made: the command, then one field a line (graph
    file, overrides, cluster, hosts, profile, rlflow version, UTC date)."""
    command = ["rlflow", "plan", args.graph, *args.overrides, "--cluster", args.cluster]
    for flag, value in (
        ("--address", getattr(args, "address", None)),
        ("--hosts", args.hosts),
        ("--profile", args.profile),
        ("--prompt-len", args.prompt_len),
        ("--mean-new-tokens", getattr(args, "mean_new_tokens", None)),
    ):
        if value is not None:
            command += [flag, str(value)]
    if args.exhaustive:
        command.append("--exhaustive")
    else:
        command += ["--seed", str(args.seed), "--restarts", str(args.restarts), "--steps", str(args.steps)]
        command += ["--time-budget", f"{args.time_budget:g}"]
    try:
        rlflow_version = version("rlflow")
    except PackageNotFoundError:  # run from a source tree that was never installed
        rlflow_version = "unknown (not installed)"
    return [
        shlex.join(command),
        f"graph: {args.graph}",
        f"overrides: {' '.join(args.overrides) or 'none'}",
        f"cluster: {cluster_text}",
        f"hosts: {args.hosts}" if args.hosts is not None else "hosts: the cluster file's",
        f"profile: {args.profile}" if args.profile else "profile: none (the cluster file's rates)",
        f"rlflow: {rlflow_version}",
        f"date: {datetime.now(UTC).isoformat(timespec='seconds')}",
    ]


def length_model_lines(searcher: Searcher, plan: Mapping[str, NodePlacement], given: bool) -> list[str]:
    """One line per generate node on the length model (``rlflow.schedulers.planner.lengths``): its mean
    response tokens and where the mean came from (``given``: ``--mean-new-tokens``; else the data set's
    responses), and the decode steps one call of the plan takes (the expected longest of its rows);
    without a mean, every response runs to ``max_new_tokens``."""
    lines = []
    for node in searcher.problem.nodes:
        if node.kind != "generate":
            continue
        lay = plan[node.name].layout
        cut = ""
        if node.interrupt_every and node.segments > 1:  # interruptible generation (segment_cost.py)
            cut = (
                f"; interrupted every {node.interrupt_every} tokens: {node.segments} calls per iteration, "
                "each prefilling its rows' prompts and tokens so far again"
                + (", the segments after the first on one micro-batch" if lay.micro_batches > 1 else "")
            )
        if not node.gen_mean:
            lines.append(
                f"length model ({node.name}): no mean response length (--mean-new-tokens, or responses in "
                f"the data set): every response priced at max_new_tokens = {node.gen_len}{cut}"
            )
            continue
        rows = node.rows / (lay.dp * lay.micro_batches)
        where = "--mean-new-tokens" if given else "measured on the data set's responses"
        if node.gen_mean > node.gen_len:  # a mean past the cap: every response runs to it
            where += f" {node.gen_mean:.4g}, capped at max_new_tokens"
        loop = ""
        if node.engine_of(plan[node.name].engine) != "vllm":  # ``auto``: the plan's engine
            how = "each prompt prefilled once for its samples, finished rows dropped from the decode steps"
            loop = f" (built-in loop: {how if node.compact else 'every row kept till the longest ends'})"
        lines.append(
            f"length model ({node.name}): mean response {node.response_mean:.4g} tokens ({where}) of "
            f"max_new_tokens = {node.gen_len}; a call of {rows:.4g} rows decodes its longest, "
            f"{expected_longest(node.response_mean, node.gen_len, max(rows, 1.0)):.4g} tokens{loop}{cut}"
        )
    return lines


def _no_profile_note(cluster: ClusterSpec) -> str:
    """The note a plan without ``--profile`` prints: the fixed costs the cluster file prices
    (``ClusterSpec.fixed_costs``: the collectives' latencies, each sourced in the GPU presets) and that every
    other one, the runtime's per node, call and step, is 0."""
    fixed = cluster.fixed_costs()
    given = ", ".join(
        f"{key} {s * 1e6:.3g} µs" if s < 1e-3 else f"{key} {s * 1e3:.3g} ms" for key, s in fixed.items()
    )
    return (
        f"note: no --profile: the cluster file's rates and fixed costs ({given or 'none'}); no other fixed "
        "software cost (the runtime's per node, call and step, the vLLM engine's per step where the file "
        "gives none): small models are predicted far faster than any runtime runs them. Measure a host "
        "with `rlflow profile` and pass --profile FILE."
    )


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()  # the time budget counts reading the graph and the candidates in
    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.engines.validation import check_engine_args
    from rlflow.schedulers.commands.validate import missing_files
    from rlflow.schedulers.planner.auto import format_plan_table
    from rlflow.schedulers.planner.calibration import apply_profile
    from rlflow.schedulers.planner.cluster_files import load_cluster
    from rlflow.schedulers.planner.graph_problem import problem_from_graph
    from rlflow.schedulers.planner.no_fit import dp_cap, dp_limit
    from rlflow.schedulers.planner.problem import float32_warnings
    from rlflow.schedulers.planner.rounds import rounds_line
    from rlflow.schedulers.planner.search import Searcher
    from rlflow.schedulers.planner.segment_cost import segment_warnings
    from rlflow.schedulers.planner.simulator import (
        async_depth,
        draw_gantt,
        overlapping_stale,
        simulate,
        staleness_depth,
    )

    # the file's own plan is replaced by the search: validate the graph without it, so no warning about
    # that plan's placements (e.g. generation sharing devices with training) is shown
    graph = load_graph(args.graph, [*args.overrides, "plan=auto"])
    missing = missing_files(graph)  # as validate names them: a model the planner cannot read is one
    if missing:
        raise GraphMistakes(missing)
    if args.cluster == "ray":
        from rlflow.schedulers.planner.ray_cluster import read_ray_cluster

        cluster = read_ray_cluster(args.address)
        if args.hosts is not None:
            cluster = cluster.with_hosts(args.hosts)
    else:
        if args.address is not None:
            raise PlanError(f"--address {args.address}: only --cluster ray reads a cluster at an address")
        cluster = load_cluster(args.cluster, hosts=args.hosts)
    if args.profile:
        cluster = apply_profile(cluster, args.profile)
    # what validate and run refuse on these devices (sleep mode off CUDA), before any search
    check_engine_args(graph, cluster.device_type)
    # the cluster's device type prices `dtype: auto` (bfloat16 on GPUs) and the engines a node may use
    problem = problem_from_graph(
        graph,
        prompt_len=args.prompt_len,
        device_type=cluster.device_type,
        mean_new_tokens=args.mean_new_tokens,
    )
    for line in float32_warnings(problem, cluster.device_type):
        print(f"rlflow: warning: {line}", file=sys.stderr)
    for line in segment_warnings(problem.nodes):  # what the segments' pricing leaves out
        print(f"rlflow: warning: {args.graph}: {line}", file=sys.stderr)
    # the candidates count against the budget too: past it, each node keeps the mesh sizes priced so far
    try:
        searcher = Searcher(
            problem, cluster, deadline=math.inf if args.exhaustive else started + args.time_budget
        )
    except PlanError as err:  # a node that fits nowhere: its message names the node and keys, this the file
        raise PlanError(f"{args.graph}: {err}") from None
    if args.exhaustive:
        result = searcher.exhaustive()
        result.baselines = searcher.baselines()
    else:
        result = searcher.search(
            seed=args.seed,
            restarts=args.restarts,
            steps=args.steps,
            time_budget_s=args.time_budget,
            since=started,
        )
    print(format_plan_table(searcher, result.plan))
    lengths = length_model_lines(searcher, result.plan, given=args.mean_new_tokens is not None)
    for line in lengths:
        print(line)
    for node in searcher.problem.nodes:  # where the layout rule, not the devices, set the plan's dp
        at = result.plan[node.name]
        limit = dp_limit(searcher.cost, node, len(at.devices), at.engine)
        if limit is not None and limit[0] == at.layout.dp:
            print(f"layout rule ({node.name}): {dp_cap(searcher.cost, node, len(at.devices), at.engine)}")
    rounds = rounds_line(graph)  # a filter's round side, priced once per expected round
    if rounds is not None:
        print(rounds)
    for name, shape in searcher.problem.models.items():  # what a mixture of experts or LoRA is priced from
        if shape.is_moe or shape.lora is not None or shape.base_of:
            print(f"model shape ({name}): {shape.describe()}")
    print(
        f"\npredicted iteration: {result.iteration_s:.4g} s on {cluster.name} ({cluster.num_devices} devices)"
    )
    print(result.describe())
    depth = staleness_depth(searcher.cost)
    asynchrony = ""
    if depth:  # the searched plan under the synchronous loop, for comparison
        sync_s = simulate(searcher.cost, result.plan, synchronous=True).iteration_s
        shared = overlapping_stale(searcher.cost, result.plan)
        credited = async_depth(searcher.cost, result.plan)
        asynchrony = (
            f"asynchronous (staleness up to {credited}): {result.iteration_s:.4g} s per iteration in the "
            f"steady state; synchronous: {sync_s:.4g} s ({sync_s / result.iteration_s:.2f}x)"
            if credited
            else f"asynchronous (staleness up to {depth}): no overlap in this plan (generation shares "
            f"devices with training), {result.iteration_s:.4g} s per iteration as synchronous"
        )
        print(asynchrony)
        for g, t in sorted(shared.items()):  # what validation of the searched plan warns
            both = sorted(set(result.plan[g].devices) & set(result.plan[t].devices))
            print(
                f"rlflow: warning: the searched plan puts generate node '{g}' (staleness) and train node "
                f"'{t}' on shared device{'s' if len(both) > 1 else ''} {both}: they cannot overlap, so no "
                "asynchronous speed-up is predicted for them",
                file=sys.stderr,
            )
    if not args.profile:
        print(_no_profile_note(cluster))
    cluster_text = (
        f"{args.cluster} ({cluster.name}: {cluster.hosts} hosts × {cluster.devices_per_host} devices)"
    )
    header = [
        *provenance(args, cluster_text),
        *lengths,
        f"predicted iteration {result.iteration_s:.4g} s",
        result.describe(),
    ]
    if asynchrony:
        header.append(asynchrony)
    for name, (_plan, seconds) in result.baselines.items():
        cut = searcher.budget_cut.get(name)
        if math.isfinite(seconds):
            speedup = seconds / result.iteration_s
            line = f"baseline {name}: {seconds:.4g} s (searched plan is {speedup:.2f}x faster)"
            line += f"; {cut}" if cut else ""
        elif cut:
            line = f"baseline {name}: {cut}"
        else:
            line = f"baseline {name}: infeasible: {searcher.infeasible.get(name, 'no plan')}"
        print(line)
        header.append(line)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_plan(result.plan, "\n".join(header), decision_lists(searcher.problem, result.plan)))
    gantt = Path(args.gantt) if args.gantt else out.with_suffix(".png")
    draw_gantt(result.timeline, gantt, cluster.num_devices)
    print(f"wrote {out} and {gantt}")
    if args.trace:
        result.timeline.write_parquet(args.trace)
        print(f"wrote {args.trace}")
    return 0
