"""Planner quality and speed at scale (ReaL paper settings), predicted with rlflow's cost model.

1. PPO with 7B/13B/34B/70B actor + critic (reference = actor shape, reward = critic shape) on
   8–128 H100s (ReaL, Mei et al. 2024, §7: batch 512 prompts, 128 prompt + 384 generated tokens), the
   train nodes on FSDP2, on DeepSpeed ZeRO-3 and on ZeRO-3 with CPU offload (optimizer; optimizer and
   parameters): predicted iteration seconds of the searched plan, of the colocated baseline, and the
   searched plan's speedup over each baseline (colocate = DeepSpeed-Chat/verl, split = OpenRLHF,
   heuristic = per-node best on all devices).
2. Speed: four 70B models (PPO) on ``--gpus`` H100s (default 128; 8 per host) planned end to end as
   ``rlflow plan`` plans them (candidates + baselines + annealing, 4 restarts × 1500 steps within its
   default ``--time-budget``, counted from before the candidates): the seconds of each part, the plans
   simulated, whether the budget cut the search short, and the load average (target: the whole of
   ``rlflow plan`` under 60 s on 2 cores at 1,024 GPUs).

Run: ``python bench/bench_planner_scale.py`` (a few minutes on 2 shared cores; ``--quick`` for fewer
annealing steps in part 1, ``--speed-only --gpus 1024`` for part 2 alone).
Fidelity (predicted vs measured) is ``bench_planner_fidelity.py``: it needs the distributed runtime
and is not written yet.
"""

from __future__ import annotations

import argparse
import math
import os
import time

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.commands.plan import TIME_BUDGET_S
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.problem import ppo_problem
from rlflow.schedulers.planner.search import BASELINES, Searcher
from rlflow.schedulers.planner.zero_cost import ZeroConfig

SETTINGS = [("7b", 1), ("13b", 2), ("34b", 4), ("70b", 8), ("7b", 4)]  # (size, hosts of 8)
# How both train nodes run: FSDP2 (None), DeepSpeed ZeRO-3, and ZeRO-3 with CPU offload.
TRAIN = [
    None,
    ZeroConfig(3),
    ZeroConfig(3, offload_optimizer=True),
    ZeroConfig(3, offload_optimizer=True, offload_param=True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer annealing steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--recompute", action="store_true", help="train nodes recompute activations (PlanNode.recompute)"
    )
    parser.add_argument(
        "--gpus", type=int, default=128, help="GPUs of the speed part, 8 per host (default 128)"
    )
    parser.add_argument("--speed-only", action="store_true", help="only the speed part")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=TIME_BUDGET_S,
        help=f"the speed part's budget, seconds (default {TIME_BUDGET_S:g}: rlflow plan's)",
    )
    args = parser.parse_args()
    if args.gpus < 8 or args.gpus % 8:
        parser.error(f"--gpus {args.gpus}: a multiple of 8 (hosts of 8 GPUs)")
    if not args.speed_only:
        quality(args)
    speed(args)


def quality(args: argparse.Namespace) -> None:
    """Part 1: searched plans against the baselines (module docstring)."""
    steps = 300 if args.quick else 800
    print(
        f"{'actor+critic':>12} {'GPUs':>5} {'train nodes':>30} {'searched s':>11} {'colocate s':>11} "
        + " ".join(f"{'vs ' + b:>14}" for b in BASELINES)
    )
    for size, hosts in SETTINGS:
        for zero in TRAIN:
            try:
                problem = ppo_problem(size, size, zero=zero, recompute=args.recompute)
                searcher = Searcher(problem, load_cluster("h100-8x", hosts=hosts))
                result = searcher.search(seed=args.seed, restarts=3, steps=steps)
            except PlanError as err:  # no plan fits memory with these settings
                print(f"{size + '+' + size:>12} {8 * hosts:>5} {zero or 'fsdp2'!s:>30} infeasible: {err}")
                continue
            cells = []
            for name in BASELINES:
                seconds = result.baselines[name][1]
                cells.append(
                    f"{seconds / result.iteration_s:13.2f}x"
                    if math.isfinite(seconds)
                    else f"{'infeasible':>14}"
                )
            colocate = result.baselines["colocate"][1]
            shown = f"{colocate:11.2f}" if math.isfinite(colocate) else f"{'infeasible':>11}"
            print(
                f"{size + '+' + size:>12} {8 * hosts:>5} {zero or 'fsdp2'!s:>30} {result.iteration_s:11.2f} "
                f"{shown} " + " ".join(cells)
            )


def speed(args: argparse.Namespace) -> None:
    """Part 2: planning time of four 70B models on ``args.gpus`` GPUs (module docstring)."""
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.perf_counter()
    problem = ppo_problem("70b", "70b", recompute=args.recompute)
    searcher = Searcher(problem, load_cluster("h100-8x", hosts=args.gpus // 8))
    built = time.perf_counter() - t0
    result = searcher.search(seed=args.seed, time_budget_s=args.time_budget, since=t0)
    seconds = time.perf_counter() - t0
    cells = []
    for name in BASELINES:
        b = result.baselines[name][1]
        missing = "not priced" if name in searcher.budget_cut else "infeasible"
        cells.append(f"{b / result.iteration_s:13.2f}x" if math.isfinite(b) else f"{missing:>14}")
    print(
        f"\n{'70b+70b':>12} {args.gpus:>5} {'searched s':>11} "
        + " ".join(f"{'vs ' + b:>14}" for b in BASELINES)
    )
    print(f"{'':>12} {'':>5} {result.iteration_s:11.2f} " + " ".join(cells))
    print(
        f"planning 4 × 70B models on {args.gpus} GPUs: {seconds:.1f} s (candidates {built:.1f} s, "
        f"{len(searcher.meshes)} meshes; baselines + annealing {seconds - built:.1f} s)\n"
        f"{result.describe()}\nload average {load} (1/5/15 min) on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
