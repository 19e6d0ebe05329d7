"""The main job (`make run`) over seeds and torch thread counts: held-out accuracy before -> after RL.

Runs the Makefile's own ``run`` command (``rlflow run examples/arith/sft.yaml examples/arith/ppo.yaml``,
read from the Makefile) once per (seed, threads), each in a fresh directory holding a copy of
``examples/``, with ``run.seed=SEED`` (model initialisation and sampling; the data set is the same) and
``OMP_NUM_THREADS=THREADS``. Prints one row per run (the SFT stage's final held-out accuracy, the RL
stage's, the gain, wall seconds and the load average at start and end) and the mean and spread (max - min)
of each column. Accuracy is greedy on the 512 held-out problems (never trained on), the same evaluation
before and after RL.

Run: ``python bench/bench_main_job.py`` (seeds 0 1 2 x threads 1 2, one run at a time: ~6 x 5 min on a
quiet 2-core machine); ``--seeds 0 --threads 2`` for one; ``--jobs 2`` runs two at a time (threads-1 runs
only: two 2-thread runs on 2 cores measure the contention, not rlflow); ``--graphs`` another chain.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^(\S+\.ya?ml) +(\d+) +([\d,]+) +([\d.]+) -> ([\d.]+) \(it (\d+) -> (\d+)\)")


def make_run_graphs() -> list[str]:
    """The graph files of the Makefile's ``run`` recipe (its one ``rlflow run`` command)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    recipe = next(line for line in lines[lines.index("run: install") + 1 :] if line.startswith("\t"))
    argv = shlex.split(recipe)
    return [a for a in argv[argv.index("run") + 1 :] if a.endswith((".yaml", ".yml"))]


def one_run(seed: int, threads: int, graphs: list[str], keep: Path | None) -> dict[str, object]:
    """Run the chain once; its stages' accuracies, the wall seconds and the load before/after."""
    work = Path(tempfile.mkdtemp(prefix=f"main-job-s{seed}-t{threads}-", dir=keep))
    shutil.copytree(ROOT / "examples", work / "examples")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "rlflow.schedulers.cli", "run", *graphs, "--overwrite", f"run.seed={seed}",
           "--no-progress"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - t0
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} threads {threads}: exit {proc.returncode}; see {work / 'log.txt'}")
    stages = [m.groups() for m in map(ROW.match, proc.stdout.splitlines()) if m]
    if keep is None:
        shutil.rmtree(work)
    return {
        "seed": seed,
        "threads": threads,
        "stages": stages,
        "wall_s": wall,
        "load": (load0, os.getloadavg()[0]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (threads-1 runs only)")
    parser.add_argument("--graphs", nargs="+", default=None, help="the chain (default: the Makefile's)")
    parser.add_argument("--keep", type=Path, default=None, help="keep each run's directory under this one")
    args = parser.parse_args(argv)
    if args.jobs > 1 and any(t > 1 for t in args.threads):
        parser.error("--jobs > 1 only with --threads 1 (parallel multi-thread runs measure contention)")
    graphs = args.graphs or make_run_graphs()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    configs = list(itertools.product(args.seeds, args.threads))
    print(f"chain: {' '.join(graphs)}; {len(configs)} runs, {args.jobs} at a time; load {os.getloadavg()}")
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(lambda c: one_run(c[0], c[1], graphs, args.keep), configs))
    print(
        f"\n{'seed':>4} {'thr':>3}  {'SFT end':>7}  {'RL start':>8}  {'RL end':>6}  {'gain':>6}  "
        f"{'wall s':>6}  load"
    )
    ends, gains, sft_ends = [], [], []
    for r in results:
        stages = r["stages"]
        assert isinstance(stages, list) and len(stages) == 2, stages
        sft, rl = stages
        a0, a1 = float(rl[3]), float(rl[4])
        ends.append(a1)
        gains.append(a1 - a0)
        sft_ends.append(float(sft[4]))
        load = r["load"]
        print(f"{r['seed']:>4} {r['threads']:>3}  {float(sft[4]):>7.3f}  {a0:>8.3f}  {a1:>6.3f}  "
              f"{a1 - a0:>+6.3f}  {r['wall_s']:>6.0f}  {load[0]:.1f} -> {load[1]:.1f}")  # fmt: skip
    for name, xs in (("SFT end", sft_ends), ("RL end", ends), ("gain", gains)):
        print(f"{name}: mean {statistics.mean(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}, "
              f"spread {max(xs) - min(xs):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
