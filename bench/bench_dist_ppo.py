"""The same PPO graph on 1 process (LocalExecutor) and on 4 CPU processes (DistExecutor, manual plan).

Prints per-node times and the iteration time (seconds, mean over the measured iterations after one warm-up
iteration) and the ratio 1-process / 4-process (> 1: the 4-process plan is faster). Ratios, not
assertions: on a 2-core machine 4 processes share 2 cores, so expect ratios below 1 there.

    python bench/bench_dist_ppo.py [--iterations 4] [--batch 32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
PLAN_4 = """
plan:
  actor_gen: {devices: 0-3, layout: d4t1p1m1}
  reward: {devices: 3, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1m1}
  critic_values: {devices: 2-3, layout: d2t1p1m1}
  actor_train: {devices: 0-3, layout: d2t2p1m1}
  critic_train: {devices: 0-3, layout: d4t1p1m1}
"""


def _run(devices: int, iterations: int, batch: int) -> dict[str, float]:
    from rlflow.dataflow.loader import loads_graph
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    text = (ROOT / "examples/ppo.yaml").read_text() + (PLAN_4 if devices > 1 else "")
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"run.devices={devices}",
            f"run.iterations={iterations + 1}",
            f"run.output_dir={tmp}/run",
            "run.eval_interval=0",
            "run.checkpoint_interval=0",
            f"algorithm.batch={batch}",
            "models.actor.config.vocab_size=20",
        ]
        graph = loads_graph(text, "examples/ppo.yaml", overrides)
        c = Controller(graph)  # LocalExecutor for 1 device, DistExecutor for the 4-device plan
        try:
            c.run()
        finally:
            c.close()
        table = read_metrics(Path(tmp) / "run").to_pylist()
    rows = [r for r in table if r["iteration"] >= 2]  # iteration 1 is warm-up
    keys = [k for k in rows[0] if k.startswith("timing_s/")]
    return {k.removeprefix("timing_s/"): statistics.mean(float(r[k]) for r in rows) for k in keys}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    one = _run(1, args.iterations, args.batch)
    four = _run(4, args.iterations, args.batch)
    print(
        f"PPO (examples/ppo.yaml, batch {args.batch}), mean of {args.iterations} iterations after 1 warm-up"
    )
    print(f"{'node':<16}{'1 proc (s)':>12}{'4 procs (s)':>13}{'ratio 1/4':>11}")
    names: list[Any] = [n for n in one if n != "iteration"] + ["iteration"]
    for name in names:
        a, b = one[name], four.get(name, float("nan"))
        print(f"{name:<16}{a:>12.4f}{b:>13.4f}{a / b if b else float('nan'):>11.2f}")
    print("plan (4 procs):", " ".join(line.strip() for line in PLAN_4.strip().splitlines()[1:]))


if __name__ == "__main__":
    main()
