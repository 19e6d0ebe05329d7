"""One single-process run alone and beside one busy process: seconds per iteration and the slowdown.

Runs ``rlflow run GRAPH`` (default ``examples/arith/sft.yaml``, ``run.iterations=ITERATIONS``, no
evaluation or checkpoints until the end, no dashboard) as a subprocess, once alone and once while a busy
process (``python3 -c "while True: pass"``, optionally pinned to one core) holds a core, for each variant of
the thread settings:

- ``spin``: libgomp's default wait (``GOMP_SPINCOUNT=300000``, its built-in value: a waiting OpenMP thread
  spins ~300k times before it sleeps) with one thread per allowed core: what the runtime did before it
  chose threads and wait policy (``rlflow.schedulers.runtime.threads``);
- ``rlflow``: the runtime's own choice (threads = the cores it is allowed, ``OMP_WAIT_POLICY=PASSIVE``);
- ``1-thread``: ``RLFLOW_NUM_THREADS=1``.

Variants and the alone/beside pair run interleaved, ``--repeats`` times, so that the other jobs on a shared
machine weigh on every cell alike. Seconds per iteration are the run's own ``timing_s/iteration`` metrics
(read back from the run directory), the first ``--skip`` iterations of each run dropped (warm-up). Printed:
one row per run (1-minute load average at its start, p50/p90), then per variant the pooled p50/p90 alone and
beside and the ratio beside/alone of the p50s, with the spread of the per-repeat ratios (min–max).

Run: ``python bench/bench_contention.py`` (~6 min on a quiet 2-core machine); ``--variants spin,rlflow``,
``--pin`` to pin the busy process to core 0, ``--graph examples/sft.yaml``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# what the thread settings of a run are read from; cleared before each variant sets its own
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RLFLOW_NUM_THREADS", "MKL_NUM_THREADS")
VARIANTS: dict[str, dict[str, str]] = {
    "spin": {"GOMP_SPINCOUNT": "300000"},
    "rlflow": {},
    "1-thread": {"RLFLOW_NUM_THREADS": "1"},
}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between order statistics."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def one_run(args: argparse.Namespace, variant: str, busy: bool, work: Path) -> tuple[list[float], float]:
    """Run the graph once; its per-iteration seconds (after ``--skip``) and the load average at start."""
    from rlflow.schedulers.records.rundir import read_metrics

    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env.update(VARIANTS[variant])
    out = work / f"{variant}-{'busy' if busy else 'alone'}"
    cmd = [sys.executable, "-m", "rlflow.schedulers.cli", "run", str(args.graph), "--overwrite",
           "--no-progress", "--no-dashboard", f"run.iterations={args.iterations}", "run.eval_interval=0",
           "run.checkpoint_interval=0", f"run.output_dir={out}"]  # fmt: skip
    hog = None
    if busy:
        pin = (lambda: os.sched_setaffinity(0, {0})) if args.pin else None
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
        time.sleep(0.5)
    load = os.getloadavg()[0]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    if proc.returncode != 0:
        raise SystemExit(f"{variant} busy={busy}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    threads_line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("rlflow: threads")), "")
    if threads_line and args.verbose:
        print(f"    {threads_line}")
    times = [float(t) for t in read_metrics(out).column("timing_s/iteration").to_pylist()]
    return times[args.skip :], load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", type=Path, default=ROOT / "examples/arith/sft.yaml")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--skip", type=int, default=10, help="warm-up iterations dropped from each run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}"
    )
    p.add_argument("--pin", action="store_true", help="pin the busy process to core 0")
    p.add_argument("--verbose", action="store_true", help="print each run's threads line")
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    if args.iterations <= args.skip:
        raise SystemExit("--iterations must exceed --skip")
    pinned = "pinned to core 0" if args.pin else "unpinned"
    print(f"graph {args.graph}, {args.iterations} iterations (first {args.skip} dropped), cores allowed "
          f"{len(os.sched_getaffinity(0))}, busy process {pinned}")  # fmt: skip
    cells: dict[tuple[str, bool], list[float]] = {}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    loads: dict[tuple[str, bool], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as tmp:
        for rep in range(args.repeats):
            for variant in variants:
                p50 = {}
                for busy in (False, True):
                    times, load = one_run(args, variant, busy, Path(tmp))
                    cells.setdefault((variant, busy), []).extend(times)
                    loads.setdefault((variant, busy), []).append(load)
                    p50[busy] = statistics.median(times)
                    print(f"repeat {rep} {variant:9s} {'beside' if busy else 'alone ':6s} load {load:5.2f}  "
                          f"p50 {p50[busy]:.3f} s  p90 {quantile(times, 0.9):.3f} s", flush=True)  # fmt: skip
                ratios[variant].append(p50[True] / p50[False])
    print()
    print(f"{'variant':9s} {'alone p50/p90 s':>16s} {'beside p50/p90 s':>17s} {'beside/alone':>13s} "
          f"{'(per repeat)':>14s} {'load alone/beside':>18s}")  # fmt: skip
    for v in variants:
        a, b = cells[(v, False)], cells[(v, True)]
        ratio = statistics.median(b) / statistics.median(a)
        la, lb = statistics.mean(loads[(v, False)]), statistics.mean(loads[(v, True)])
        print(f"{v:9s} {statistics.median(a):7.3f} /{quantile(a, 0.9):6.3f} {statistics.median(b):8.3f} /"
              f"{quantile(b, 0.9):6.3f} {ratio:12.2f}x {min(ratios[v]):6.2f}-{max(ratios[v]):.2f}x "
              f"{la:8.2f} / {lb:.2f}")  # fmt: skip
    base = "spin" if "spin" in variants else None
    if base is not None:
        for v in variants:
            if v != base:
                r = statistics.median(cells[(base, True)]) / statistics.median(cells[(v, True)])
                print(f"beside the busy process, {v} is {r:.2f}x as fast as {base} (p50)")


if __name__ == "__main__":
    main()
