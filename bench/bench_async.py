"""Asynchronous RL on 2 CPU workers: synchronous vs staleness η = 1 and η = 2, GRPO and PPO on arithmetic.

The arithmetic chain (``examples/arith``): a short SFT run first (cached in ``--workdir``), then each RL
graph on 2 worker processes with a manual plan — generation, the reference and the rule reward on worker 0,
the train nodes (and PPO's critic) on worker 1 — once synchronously and once per η (``nodes.actor_gen
.staleness``), for every seed. Every run sees the same number of samples (``--iterations`` × the graph's
samples per iteration) and ends with a greedy evaluation on the held-out split.

Printed per algorithm and mode: iterations/s and samples/s (over the iterations after the first, from the
controller's ``timing_s/iteration``: completion to completion, so an asynchronous iteration counts its
steady-state period), their ratio to the synchronous run of the same seed, the mean staleness and idle
ratio per worker, and the held-out accuracy after the run (mean over seeds ± the spread between seeds: the
run-to-run noise). Ratios measured in one invocation; nothing is asserted.

    python bench/bench_async.py                      # GRPO and PPO, seeds 0 1, 30 iterations each
    python bench/bench_async.py --algorithms grpo --seeds 0 --iterations 10     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# worker 0: the generation pipeline (generate, reference log-probs, rule reward); worker 1: training (and
# the critic, whose values of iteration k + 1 need its training of iteration k anyway)
PLANS = {
    "grpo": """
plan:
  actor_gen: {devices: 0, layout: d1t1p1m1}
  reward: {devices: 0, layout: d1t1p1m1}
  ref: {devices: 0, layout: d1t1p1m1}
  actor_train: {devices: 1, layout: d1t1p1m1}
""",
    "ppo": """
plan:
  actor_gen: {devices: 0, layout: d1t1p1m1}
  reward: {devices: 0, layout: d1t1p1m1}
  ref: {devices: 0, layout: d1t1p1m1}
  critic_values: {devices: 1, layout: d1t1p1m1}
  actor_train: {devices: 1, layout: d1t1p1m1}
  critic_train: {devices: 1, layout: d1t1p1m1}
""",
}


def _sft(workdir: Path, iterations: int) -> Path:
    """The SFT actor the RL graphs start from (``examples/arith/sft.yaml``), trained once per workdir."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.runtime.controller import Controller

    out = workdir / f"sft-{iterations}"
    model = out / "checkpoints" / "latest" / "models" / "actor"
    if model.is_dir():
        return model
    graph = load_graph(
        str(ROOT / "examples/arith/sft.yaml"),
        [f"run.output_dir={out}", f"run.iterations={iterations}", "run.eval_interval=0",
         f"run.checkpoint_interval={iterations}"],
    )  # fmt: skip
    c = Controller(graph, overwrite=True)
    try:
        c.run()
    finally:
        c.close()
    return model


def _run(algorithm: str, eta: int, seed: int, args: argparse.Namespace, sft: Path) -> dict[str, Any]:
    """One RL run on 2 workers; its throughput, staleness, idle ratios and held-out accuracy."""
    from rlflow.dataflow.loader import loads_graph
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    out = args.workdir / f"{algorithm}-eta{eta}-seed{seed}"
    source = ROOT / f"examples/arith/{algorithm}.yaml"
    overrides = [
        f"models.actor.path={sft}",
        "run.devices=2",
        f"run.seed={seed}",
        f"run.iterations={args.iterations}",
        f"run.output_dir={out}",
        f"run.eval_interval={args.iterations}",
        "run.checkpoint_interval=0",
        f"nodes.actor_gen.staleness={eta}",
    ]
    graph = loads_graph(source.read_text() + PLANS[algorithm], str(source), overrides)
    t0 = time.monotonic()
    c = Controller(graph, overwrite=True)
    try:
        c.run()
    finally:
        c.close()
    wall = time.monotonic() - t0
    rows = read_metrics(out).to_pylist()
    timed = [r for r in rows if r["iteration"] >= 2]  # iteration 1 is warm-up
    seconds = sum(r["timing_s/iteration"] for r in timed)
    samples = sum(r["perf/samples_per_s"] * r["timing_s/iteration"] for r in timed)
    last = rows[-1]

    def mean(key: str) -> float:
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.mean(values) if values else float("nan")

    return {
        "algorithm": algorithm,
        "eta": eta,
        "seed": seed,
        "iterations_per_s": len(timed) / seconds,
        "samples_per_s": samples / seconds,
        "accuracy": last["val/accuracy"],
        "staleness_mean": mean("async/staleness_mean") if eta else 0.0,
        "idle_0": mean("perf/idle_ratio/0"),
        "idle_1": mean("perf/idle_ratio/1"),
        "wall_s": wall,
    }


def _report(results: list[dict[str, Any]]) -> None:
    by = {(r["algorithm"], r["eta"], r["seed"]): r for r in results}
    print(f"{'alg':<5}{'mode':<8}{'it/s':>8}{'samples/s':>11}{'x sync':>8}{'stale':>7}{'idle w0':>9}"
          f"{'idle w1':>9}{'accuracy (mean ± spread)':>27}")  # fmt: skip
    for alg in sorted({r["algorithm"] for r in results}):
        etas = sorted({r["eta"] for r in results if r["algorithm"] == alg})
        seeds = sorted({r["seed"] for r in results if r["algorithm"] == alg})
        for eta in etas:
            rs = [by[(alg, eta, s)] for s in seeds]
            ratios = [by[(alg, eta, s)]["samples_per_s"] / by[(alg, 0, s)]["samples_per_s"] for s in seeds]
            acc = [r["accuracy"] for r in rs]
            spread = (max(acc) - min(acc)) / 2 if len(acc) > 1 else float("nan")
            print(
                f"{alg:<5}{'sync' if eta == 0 else f'eta={eta}':<8}"
                f"{statistics.mean(r['iterations_per_s'] for r in rs):>8.3f}"
                f"{statistics.mean(r['samples_per_s'] for r in rs):>11.1f}"
                f"{statistics.mean(ratios):>7.2f}x"
                f"{statistics.mean(r['staleness_mean'] for r in rs):>7.2f}"
                f"{statistics.mean(r['idle_0'] for r in rs):>9.2f}"
                f"{statistics.mean(r['idle_1'] for r in rs):>9.2f}"
                f"{statistics.mean(acc):>19.3f} ± {spread:.3f}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["grpo", "ppo"], choices=sorted(PLANS))
    parser.add_argument("--etas", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--sft-iterations", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench-async")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    args = parser.parse_args(argv)
    if 0 not in args.etas:
        parser.error("--etas must include 0 (the synchronous baseline)")
    os.chdir(ROOT)  # the graph files name the tokenizer relative to the repository root
    import torch

    torch.set_num_threads(1)
    print(f"load average before: {os.getloadavg()}")
    sft = _sft(args.workdir, args.sft_iterations)
    results = []
    for alg in args.algorithms:
        for seed in args.seeds:
            for eta in args.etas:
                results.append(_run(alg, eta, seed, args, sft))
                print(json.dumps(results[-1]), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"{args.iterations} iterations per run (iteration 1 warm-up), seeds {args.seeds}, 2 CPU workers")
    _report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
