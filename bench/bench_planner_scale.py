"""Planner quality and speed at scale (ReaL paper settings), predicted with rlflow's cost model.

1. PPO with 7B/13B/34B/70B actor + critic (reference = actor shape, reward = critic shape) on
   8–128 H100s (ReaL, Mei et al. 2024, §7: batch 512 prompts, 128 prompt + 384 generated tokens), the
   train nodes on FSDP2, on DeepSpeed ZeRO-3 and on ZeRO-3 with CPU offload (optimizer; optimizer and
   parameters): predicted iteration seconds of the searched plan, of the colocated baseline, and the
   searched plan's speedup over each baseline (colocate = DeepSpeed-Chat/verl, split = OpenRLHF,
   heuristic = per-node best on all devices).
2. Speed: 128 GPUs with four 70B models planned end to end (candidates + baselines + annealing);
   the seconds are printed (target < 60 s on 2 cores).

Run: ``python bench/bench_planner_scale.py`` (about a minute on 2 shared cores; ``--quick`` for less).
Fidelity (predicted vs measured) is ``bench_planner_fidelity.py``: it needs the distributed runtime
and is not written yet.
"""

from __future__ import annotations

import argparse
import math
import time

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.cluster import load_cluster
from rlflow.schedulers.planner.problem import ppo_problem
from rlflow.schedulers.planner.search import BASELINES, Searcher
from rlflow.schedulers.planner.zero_cost import ZeroConfig

SETTINGS = [("7b", 1), ("13b", 2), ("34b", 4), ("70b", 8), ("7b", 4), ("70b", 16)]  # (size, hosts of 8)
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
    args = parser.parse_args()
    steps = 300 if args.quick else 800
    print(
        f"{'actor+critic':>12} {'GPUs':>5} {'train nodes':>30} {'searched s':>11} {'colocate s':>11} "
        + " ".join(f"{'vs ' + b:>14}" for b in BASELINES)
    )
    for size, hosts in SETTINGS[:-1]:
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
    size, hosts = SETTINGS[-1]
    t0 = time.perf_counter()
    searcher = Searcher(
        ppo_problem(size, size, recompute=args.recompute), load_cluster("h100-8x", hosts=hosts)
    )
    result = searcher.search(seed=args.seed, restarts=3, steps=steps, time_budget_s=50.0)
    seconds = time.perf_counter() - t0
    cells = []
    for name in BASELINES:
        b = result.baselines[name][1]
        cells.append(f"{b / result.iteration_s:13.2f}x" if math.isfinite(b) else f"{'infeasible':>14}")
    print(f"{'70b+70b':>12} {8 * hosts:>5} {result.iteration_s:11.2f} " + " ".join(cells))
    print(
        f"\nplanning 4 × 70B models on {8 * hosts} GPUs: {seconds:.1f} s "
        f"({result.evaluated} plans simulated; target < 60 s on 2 cores)"
    )


if __name__ == "__main__":
    main()
