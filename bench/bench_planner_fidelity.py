"""Planner fidelity: predicted vs measured seconds per node and per iteration, several plans, 2 and 4 CPU
worker processes.

For each graph and device count N the bench builds the planner's problem (``problem_from_graph`` with
the data's prompt length in tokens, ``measure_data_lengths``) on ``cpu-local`` with N devices, fitted with a
profile of this machine measured here (``rlflow.schedulers.profiling.collect.run_profile`` →
``rlflow.schedulers.planner.calibration.apply_profile``, three rounds, medians kept, one thread like a
worker: matmul / memory efficiencies of one decoder block of the graph's actor, the fixed costs of its
model calls and optimizer steps, gloo collectives per group size,
the runtime's own latencies and whole nodes in a probe run of a GRPO-shaped graph of that block on two
workers, weight hashing, the host's cores and busy-worker slowdown). Nothing is fitted to the runs below.
Plans: the searched plan (``graph_searcher``, as ``plan: auto`` uses it), the colocate / split / disaggregate
/ heuristic baselines (duplicates dropped) and a hand plan (tensor parallel on the actor's train node). Each
plan is then run for real: ``Controller`` + ``DistExecutor`` (N spawned worker processes, gloo, one thread
each), ``--warmup`` + ``--iterations`` iterations; measured seconds are the mean over the timed iterations of
the run's ``timing_s/<node>`` (the node's span on its workers, its weight sync included) and
``timing_s/iteration``.

Predictions (seconds): per node its span in the simulated iteration (``simulator.node_spans``: the
node's time, stretched where overlapping nodes share the cores, plus a train node's weight sync); per
iteration the simulator's period with nodes on disjoint meshes overlapping (``simulate``) and
one node at a time (``simulate(..., overlap=False)``). The controller submits every ready node at once
(nodes on disjoint meshes run concurrently), so the overlapped period is the prediction the measured
iteration is compared with (``--compare serial`` for a runtime that runs one node at a time); both are
printed. Printed: a table per plan with relative errors ``|pred − meas| / meas``, the medians, and the
Spearman rank correlation between predicted and measured iteration times across plans (per device count
and over all plans).

Ratios only, no assertions; wall times on a shared, oversubscribed machine are noisy (4 workers on 2 cores).

    python bench/bench_planner_fidelity.py                      # ppo, N = 2 and 4 (6-8 min on 2 cores)
    python bench/bench_planner_fidelity.py --graphs ppo grpo --iterations 2
    python bench/bench_planner_fidelity.py --staleness 1        # asynchronous (nodes.actor_gen.staleness)

With ``--staleness η`` every graph's generate node ``actor_gen`` may lag η versions: the planner's problem
carries it, so the search, the predictions (the simulator's asynchronous steady state) and the runs (the
controller's version schedule) are all asynchronous. Without it, each (graph, N) also runs one
asynchronous plan, ``async η=1`` (``--async-staleness``, 0: none): the plan searched for the graph with
``nodes.actor_gen.staleness=1`` if it puts generation apart from training (where the runtime overlaps
them; the planner credits overlap only there), else the first baseline that does (``split``), predicted
by the simulator's asynchronous steady state and measured under the version schedule.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlflow.dataflow.graph import Graph  # noqa: E402
from rlflow.dataflow.loader import load_graph  # noqa: E402
from rlflow.nodes.data_lengths import measure_data_lengths  # noqa: E402
from rlflow.schedulers.planner.auto import graph_searcher, with_placements  # noqa: E402
from rlflow.schedulers.planner.cluster import ClusterSpec  # noqa: E402
from rlflow.schedulers.planner.cluster_files import load_cluster  # noqa: E402
from rlflow.schedulers.planner.plans import Layout, NodePlacement, format_devices  # noqa: E402
from rlflow.schedulers.planner.search import Searcher  # noqa: E402
from rlflow.schedulers.planner.simulator import node_spans, overlapping_stale, simulate  # noqa: E402

Plan = dict[str, NodePlacement]


@dataclass
class Outcome:
    """One (graph, devices, plan): predicted and measured seconds per node and per iteration."""

    graph: str
    devices: int
    name: str
    plan: Plan
    pred_nodes: dict[str, float]
    pred_sim_s: float
    pred_serial_s: float
    compare: str
    meas_nodes: dict[str, float]
    meas_iter_s: float
    wall_s: float

    @property
    def pred_iter_s(self) -> float:
        """The prediction the measured iteration is compared with (``--compare``)."""
        return self.pred_sim_s if self.compare == "sim" else self.pred_serial_s


def rel_err(pred: float, meas: float) -> float:
    """``|pred − meas| / meas`` (dimensionless); nan when nothing was measured."""
    return abs(pred - meas) / meas if meas > 0 else math.nan


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman rank correlation (average ranks for ties; Pearson correlation of the ranks)."""

    def ranks(v: Sequence[float]) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        order = a.argsort(kind="stable")
        r = np.empty(len(a))
        r[order] = np.arange(len(a), dtype=float)
        for value in np.unique(a):  # ties share their mean rank
            tie = a == value
            r[tie] = r[tie].mean()
        return r

    if len(xs) < 2:
        return math.nan
    rx, ry = ranks(xs), ranks(ys)
    if rx.std() == 0 or ry.std() == 0:
        return math.nan
    return float(np.corrcoef(rx, ry)[0, 1])


def profiled_cluster(graph: Graph, out: Path, quick: bool) -> tuple[ClusterSpec, str]:
    """``cpu-local`` fitted with a profile measured now (one thread, like a worker), and a description."""
    from rlflow.schedulers.planner.calibration import apply_profile
    from rlflow.schedulers.profiling.collect import run_profile

    base = load_cluster("cpu-local")
    config = dict(graph.spec.models["actor"].config or {})
    if quick:
        return base, "no profile (--no-profile): cpu-local preset rates"
    run_profile(base, config, out, batch_sizes=(1, 4, 16), seq_lens=(8, 16), group_sizes=(2, 4), repeats=7)
    fitted = apply_profile(base, out)
    e, ov = fitted.efficiency, fitted.overheads
    links = ", ".join(
        f"{op} n={n} {link.latency * 1e6:.0f} us/step {link.bandwidth / 1e9:.2g} GB/s"
        for (op, n), link in sorted(fitted.collectives.items())
    )
    fixed = ", ".join(f"{k} {v:.3g}" for k, v in ov.__dict__.items())
    slow = ", ".join(f"{n} busy x{v:.2f}" for n, v in sorted(fitted.slowdowns.items()))
    note = (
        f"profile: matmul eff {e.matmul:.3g} (half at {e.half_tokens:.3g} tokens), memory eff "
        f"{e.memory:.3g}, optimizer eff {e.optimizer or e.memory:.3g}; {fitted.cores_per_host} cores, "
        f"{slow}\n  overheads (s, B/s): {fixed}\n  collectives: {links}"
    )
    return fitted, note


def hand_plan(graph: Graph, devices: int) -> Plan:
    """A plausible hand plan: generation dp over all devices, the actor trained with tp = 2 on all devices,
    the frozen / critic inferences on the two halves, the critic trained dp over all devices."""
    allm = tuple(range(devices))
    half = devices // 2
    lo, hi = tuple(range(half)), tuple(range(half, devices))
    plan: Plan = {}
    for name, node in graph.spec.nodes.items():
        if node.model is None:
            continue
        if node.kind == "generate":
            plan[name] = NodePlacement(allm, Layout(devices, 1, 1, 1))
        elif node.kind == "train" and node.model == "actor":
            plan[name] = NodePlacement(allm, Layout(devices // 2, 2, 1, 1))
        elif node.kind == "train":
            plan[name] = NodePlacement(allm, Layout(devices, 1, 1, 1))
        elif node.model == "ref":
            plan[name] = NodePlacement(lo, Layout(len(lo), 1, 1, 1))
        else:
            plan[name] = NodePlacement(hi, Layout(len(hi), 1, 1, 1))
    return plan


def candidate_plans(graph: Graph, searcher: Searcher, seed: int) -> list[tuple[str, Plan]]:
    """Searched plan, baselines and the hand plan; identical plans kept once (first name wins)."""
    result = searcher.search(seed=seed, restarts=4, steps=400, time_budget_s=10.0)
    named: list[tuple[str, Plan]] = [("searched", result.plan)]
    named += [(k, p) for k, (p, _s) in result.baselines.items() if p is not None]
    named.append(("hand", hand_plan(graph, searcher.cluster.num_devices)))
    out: list[tuple[str, Plan]] = []
    seen: set[tuple[NodePlacement, ...]] = set()
    for name, plan in named:
        key = tuple(plan[n.name] for n in searcher.problem.nodes)
        if key in seen:
            continue
        try:
            with_placements(graph, plan)
        except Exception as err:  # report and skip a plan the runtime refuses
            print(f"  skip {name}: {err}", file=sys.stderr)
            continue
        seen.add(key)
        out.append((name, plan))
    return out


def predict(searcher: Searcher, plan: Mapping[str, NodePlacement]) -> tuple[dict[str, float], float, float]:
    """(seconds per node as spans of the overlapped replay, its iteration seconds, and the iteration
    seconds of one node at a time)."""
    cost = searcher.cost
    overlapped = simulate(cost, plan, 2)
    serial = simulate(cost, plan, 2, overlap=False).iteration_s
    return node_spans(cost, overlapped), overlapped.iteration_s, serial


def measure(graph: Graph, warmup: int, iterations: int, tmp: Path) -> tuple[dict[str, float], float]:
    """Mean measured seconds per node and per iteration over the timed iterations of a real run."""
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    controller = Controller(graph, run_dir=tmp, progress=False)
    try:
        controller.run()
    finally:
        controller.close()
    rows = [r for r in read_metrics(tmp).to_pylist() if r["iteration"] > warmup]
    keys = [k for k in rows[0] if k.startswith("timing_s/") and k != "timing_s/iteration"]
    per_node = {
        k.removeprefix("timing_s/"): statistics.mean(float(r[k]) for r in rows if r.get(k) is not None)
        for k in keys
    }
    return per_node, statistics.mean(float(r["timing_s/iteration"]) for r in rows)


def async_plan(searcher: Searcher, seed: int) -> Plan | None:
    """The plan searched for an asynchronous graph when it has generation apart from training (where the
    runtime overlaps them), else the first such baseline (``split``); ``None``: none has."""
    result = searcher.search(seed=seed, restarts=4, steps=400, time_budget_s=10.0)
    for plan in (result.plan, *(p for p, _s in result.baselines.values() if p is not None)):
        if not overlapping_stale(searcher.cost, plan):
            return plan
    return None


def sample_sizes(gname: str, batch: int) -> list[str]:
    """Overrides giving every node whose ``batch_size`` counts samples (``batch_unit: samples``) ``batch``
    prompts' worth of them (× the group size ``args.n`` of the generate node upstream), so resizing
    ``algorithm.prompts`` keeps the graph's batches consistent (GRPO's reward node counts samples)."""
    graph = load_graph(str(ROOT / "examples" / f"{gname}.yaml"))
    return [
        f"nodes.{name}.batch_size={batch * graph.group_size(name)}"
        for name, node in graph.spec.nodes.items()
        if node.batch_unit == "samples"
    ]


def plan_text(plan: Mapping[str, NodePlacement]) -> str:
    return " ".join(f"{n}={format_devices(p.devices)}:{p.layout}" for n, p in plan.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--graphs", nargs="+", default=["ppo"], help="example graphs (ppo, grpo)")
    parser.add_argument("--devices", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations per run")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per run")
    parser.add_argument("--batch", type=int, default=16, help="algorithm.batch (ppo) / prompts (grpo)")
    parser.add_argument("--max-plans", type=int, default=5, help="plans per (graph, devices)")
    parser.add_argument("--no-profile", action="store_true", help="use the preset's rates as they are")
    parser.add_argument(
        "--compare",
        choices=("sim", "serial"),
        default="sim",
        help="iteration prediction to score: overlapped (disjoint meshes run at once, as now) or serial",
    )
    parser.add_argument(
        "--staleness", type=int, default=0, help="nodes.actor_gen.staleness (asynchronous RL)"
    )
    parser.add_argument(
        "--async-staleness",
        type=int,
        default=1,
        help="also run the searched plan of each graph with nodes.actor_gen.staleness=η (0: not)",
    )
    args = parser.parse_args(argv)
    # FSDP2 warns once per worker about view outputs of the value head; keep the table readable.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::UserWarning")
    t_start = time.perf_counter()
    load = os.getloadavg()[0]
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        for gname in args.graphs:
            size_key = "algorithm.batch" if gname == "ppo" else "algorithm.prompts"
            overrides = [
                f"{size_key}={args.batch}",
                "models.actor.config.vocab_size=20",  # tp = 2 must divide the vocabulary (tokenizer has 19)
                "run.eval_interval=0",
                "run.checkpoint_interval=0",
                f"run.iterations={args.warmup + args.iterations}",
            ]
            overrides += sample_sizes(gname, args.batch)
            if args.staleness:
                overrides.append(f"nodes.actor_gen.staleness={args.staleness}")
            base_graph = load_graph(str(ROOT / "examples" / f"{gname}.yaml"), overrides)
            prompt_len = measure_data_lengths(base_graph).prompt_len or 128
            cluster0, note = profiled_cluster(base_graph, tmp / f"{gname}-profile.parquet", args.no_profile)
            print(f"{gname}: prompt {prompt_len} tokens; {note}", flush=True)
            for n in args.devices:
                graph = load_graph(str(ROOT / "examples" / f"{gname}.yaml"), [*overrides, f"run.devices={n}"])
                cluster = replace(cluster0, hosts=1, devices_per_host=n)
                searcher = graph_searcher(graph, cluster, prompt_len=prompt_len)
                plans = candidate_plans(graph, searcher, graph.spec.run.seed)[: args.max_plans]
                runs = [(pname, plan, graph, searcher) for pname, plan in plans]
                if args.async_staleness and not args.staleness:
                    # the same graph with η, on a plan with generation apart from training (they overlap);
                    # plan=auto: the file's own plan (generation on training's device) is not validated
                    eta = f"nodes.actor_gen.staleness={args.async_staleness}"
                    stale = load_graph(
                        str(ROOT / "examples" / f"{gname}.yaml"),
                        [*overrides, f"run.devices={n}", eta, "plan=auto"],
                    )
                    s_searcher = graph_searcher(stale, cluster, prompt_len=prompt_len)
                    apart = async_plan(s_searcher, stale.spec.run.seed)
                    if apart is None:
                        print(
                            f"  {gname} N={n}: no plan puts generation apart from training", file=sys.stderr
                        )
                    else:
                        runs.append((f"async η={args.async_staleness}", apart, stale, s_searcher))
                for pname, plan, run_graph, run_searcher in runs:
                    planned = with_placements(run_graph, plan)
                    pred_nodes, sim_s, serial_s = predict(run_searcher, plan)
                    run_dir = tmp / f"{gname}-{n}-{pname.replace(' ', '-')}"
                    t0 = time.perf_counter()
                    meas_nodes, meas_iter = measure(planned, args.warmup, args.iterations, run_dir)
                    wall = time.perf_counter() - t0
                    outcomes.append(
                        Outcome(
                            gname,
                            n,
                            pname,
                            plan,
                            pred_nodes,
                            sim_s,
                            serial_s,
                            args.compare,
                            meas_nodes,
                            meas_iter,
                            wall,
                        )
                    )
                    print(
                        f"  {gname} N={n} {pname:<10} measured {meas_iter:.3f} s/iter, predicted overlapped "
                        f"{sim_s:.3f} s, serial {serial_s:.3f} s  (run {wall:.0f} s, load "
                        f"{os.getloadavg()[0]:.1f})\n    plan {plan_text(plan)}",  # kept if the bench is cut
                        flush=True,
                    )
    report(outcomes, args, load, time.perf_counter() - t_start)
    return 0


def node_class(o: Outcome, node: str) -> str:
    """``1 device``, ``FSDP2 train`` (dp > 1), ``tp > 1`` or ``dp replicas`` (inference / generation)."""
    lay = o.plan[node].layout
    if lay.tp > 1:
        return "tp > 1"
    if lay.dp == 1:
        return "1 device"
    return "FSDP2 train" if node.endswith("train") else "dp replicas"


def med(values: Sequence[float]) -> float:
    finite = [x for x in values if math.isfinite(x)]
    return statistics.median(finite) if finite else math.nan


def report(outcomes: list[Outcome], args: argparse.Namespace, load_before: float, total_s: float) -> None:
    """Print the per-plan tables, the median relative errors and the rank correlations."""
    print()
    print(
        f"Planner fidelity: {args.warmup} warm-up + {args.iterations} timed iterations per run, batch "
        f"{args.batch}; seconds are means over the timed iterations. Load 1m {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; whole bench {total_s:.0f} s. Iterations are "
        f"scored against the {'overlapped' if args.compare == 'sim' else 'serial'} prediction (*)."
    )
    for o in outcomes:
        print(f"\n{o.graph} N={o.devices} plan {o.name}: {plan_text(o.plan)}")
        print(f"  {'node':<16}{'pred s':>10}{'meas s':>10}{'rel err':>9}")
        for node, pred in o.pred_nodes.items():
            meas = o.meas_nodes.get(node, math.nan)
            err = rel_err(pred, meas)
            print(f"  {node:<16}{pred:>10.4f}{meas:>10.4f}{err:>9.0%}")
        for label, pred, kind in (
            ("iter overlapped", o.pred_sim_s, "sim"),
            ("iter serial", o.pred_serial_s, "serial"),
        ):
            mark = "*" if kind == o.compare else " "
            print(
                f"  {label:<15}{mark}{pred:>10.4f}{o.meas_iter_s:>10.4f}{rel_err(pred, o.meas_iter_s):>9.0%}"
            )
    print("\nSummary")
    print(f"{'graph':<6}{'N':>3} {'plan':<10}{'overlapped':>11}{'serial':>9}{'measured':>10}{'err (*)':>9}")
    for o in outcomes:
        print(
            f"{o.graph:<6}{o.devices:>3} {o.name:<10}{o.pred_sim_s:>11.4f}{o.pred_serial_s:>9.4f}"
            f"{o.meas_iter_s:>10.4f}{rel_err(o.pred_iter_s, o.meas_iter_s):>9.0%}"
        )
    node_errs: dict[str, list[float]] = {}
    for o in outcomes:
        for node, pred in o.pred_nodes.items():
            node_errs.setdefault(node_class(o, node), []).append(
                rel_err(pred, o.meas_nodes.get(node, math.nan))
            )
    every = [e for errs in node_errs.values() for e in errs]
    by_class = ", ".join(f"{k} {med(v):.0%} ({len(v)})" for k, v in sorted(node_errs.items()))
    sim = [rel_err(o.pred_sim_s, o.meas_iter_s) for o in outcomes]
    serial = [rel_err(o.pred_serial_s, o.meas_iter_s) for o in outcomes]
    print(
        f"median relative error: per node {med(every):.0%} ({len(every)} node runs; {by_class}); per "
        f"iteration overlapped {med(sim):.0%}, serial {med(serial):.0%}  (aim: <= 15%)"
    )
    groups: dict[tuple[str, int], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.graph, o.devices), []).append(o)
    for (g, n), os_ in groups.items():
        print(f"Spearman {g} N={n} ({len(os_)} plans): {rank_line(os_)}")
    print(f"Spearman all ({len(outcomes)} plans): {rank_line(outcomes)}")


def rank_line(outcomes: Sequence[Outcome]) -> str:
    """Spearman of the overlapped and serial predicted iteration seconds against the measured ones."""
    meas = [o.meas_iter_s for o in outcomes]
    sim = spearman([o.pred_sim_s for o in outcomes], meas)
    return f"overlapped {sim:+.2f}, serial {spearman([o.pred_serial_s for o in outcomes], meas):+.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
