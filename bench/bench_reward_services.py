"""The sandbox pool of ``code_reward``: executions per second at concurrency 1..N, and the cost of one
sandboxed execution against a bare subprocess running the same program.

    nice -n 19 python bench/bench_reward_services.py [--executions 64] [--max-concurrency 4] [--rounds 3]

Each execution runs the code task's kind of program (``print((int(input())+2)*3)``, one stdin/stdout test)
three ways, each side in the same process and run, one after the other:

- ``bare``: ``subprocess.run([python, "-I", "-S", "-c", program])`` with the test's stdin (this interpreter,
  no harness, no limits, no isolation): the floor any per-execution process pays;
- ``rlimits``: ``code_reward``'s pool with ``isolation: none_unsafe`` (the trusted prelude and harness,
  ``setrlimit``, a temporary directory, the output cap and deadline; no namespaces);
- ``bubblewrap``: ``code_reward``'s pool as configured by default (the namespaces, the read-only root, the
  pids cgroup where there is one; ``rlflow.nodes.services.sandbox``).

Per side and concurrency ``c`` (threads, each waiting on one process, as the pool runs them): executions per
second over ``--executions`` executions (the median of ``--rounds`` rounds), and the ratio to ``bare`` at the
same concurrency; then the overhead per execution at concurrency 1 (seconds per execution minus ``bare``'s,
in milliseconds) and its ratio. Wall time only: the sandboxed interpreter's CPU time does not reach this
process's ``RUSAGE_CHILDREN`` (a trial counted less CPU per bubblewrap execution than per bare one). Every
execution's output is checked (a wrong one stops the bench). The 1-minute load average is printed before
and after: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.functions.code_reward import limits_of, sandbox_for
from rlflow.nodes.services.code_exec import CodeTest, run_tests
from rlflow.nodes.services.sandbox import UnsafeSandboxWarning

PROGRAM = "print((int(input())+2)*3)"
TEST = CodeTest(stdin="5\n", stdout="21\n")


def _bare(executions: int, concurrency: int) -> None:
    def once(_: int) -> None:
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", PROGRAM], input=TEST.stdin.encode(), capture_output=True,
            timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0 or done.stdout != TEST.stdout.encode():
            raise SystemExit(f"bare subprocess: exit {done.returncode}, stdout {done.stdout!r}")

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(once, range(executions)))


def _pool(isolation: str) -> Callable[[int, int], None]:
    args = NODE_FUNCTIONS.get("code_reward").bind({"isolation": isolation})  # the schema's defaults
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSandboxWarning)  # none_unsafe is this side's point
        sandbox = sandbox_for(isolation, limits_of(args))

    def run(executions: int, concurrency: int) -> None:
        outcomes = run_tests(
            sandbox, [PROGRAM] * executions, [[TEST]] * executions, concurrency=concurrency,
            start_retries=int(args["start_retries"]),
        )  # fmt: skip
        wrong = [o[0] for o in outcomes if o[0].reason != "pass"]
        if wrong:
            raise SystemExit(f"{isolation}: {len(wrong)} executions did not pass, first: {wrong[0]}")

    return run


def _rate(run: Callable[[int, int], None], executions: int, concurrency: int, rounds: int) -> float:
    """Executions per second: the median of ``rounds`` timed rounds (after one untimed execution)."""
    run(1, 1)
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        run(executions, concurrency)
        rates.append(executions / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executions", type=int, default=64, help="executions per timed round")
    parser.add_argument("--max-concurrency", type=int, default=4, help="concurrency 1, 2, 4, ... up to this")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per point (median)")
    args = parser.parse_args()
    load_builtin_functions()
    load_before = os.getloadavg()[0]
    sides = {"bare": _bare, "rlimits": _pool("none_unsafe"), "bubblewrap": _pool("bubblewrap")}
    levels = [c for c in (1, 2, 4, 8, 16, 32, 64) if c <= args.max_concurrency]
    print(f"{args.executions} executions of {PROGRAM!r} per round, median of {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs; load average (1 min) before: {load_before:.2f}")  # fmt: skip
    header = "  ".join(f"{name + ' exec/s':>18}" for name in sides)
    print(f"{'concurrency':>11}  {header}  ratios to bare")
    per_exec: dict[str, float] = {}
    for c in levels:
        rates = {name: _rate(run, args.executions, c, args.rounds) for name, run in sides.items()}
        if c == 1:
            per_exec = {name: 1.0 / r for name, r in rates.items()}
        ratios = ", ".join(f"{n} {rates[n] / rates['bare']:.2f}" for n in sides if n != "bare")
        print(f"{c:>11}  " + "  ".join(f"{rates[n]:>18.1f}" for n in sides) + f"  {ratios}")
    bare = per_exec["bare"]
    print(f"per execution at concurrency 1: bare {bare * 1e3:.1f} ms")
    for name in ("rlimits", "bubblewrap"):
        extra = per_exec[name] - bare
        print(f"  {name}: {per_exec[name] * 1e3:.1f} ms, overhead {extra * 1e3:+.1f} ms "
              f"({per_exec[name] / bare:.2f}x bare)")  # fmt: skip
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
