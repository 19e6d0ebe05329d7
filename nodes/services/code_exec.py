"""Code rewards: code extracted from a response, run against a sample's tests in the sandbox, scored.

**Tests** (a sample's data field, a JSON string or the parsed value), one of two formats:

- stdin/stdout pairs: ``[{"stdin": "3\\n", "stdout": "9\\n"}, ...]`` (``stdin`` may be left out: empty).
  The program runs as ``__main__`` with the pair's stdin; it passes when it exits with status 0 (or
  ``sys.exit(0)``) and its stdout equals the expected one up to trailing whitespace on each line and
  trailing blank lines;
- assert-style: ``{"asserts": ["assert f(2) == 4", ...]}``: the program runs as ``__main__``, then the
  assertion, in the same globals; it passes when the assertion holds; an ``AssertionError`` fails it.

**Executions.** Each (sample, test) pair is one execution: one sandboxed process (a failure of one test
cannot leak into another). Its outcome is one of :data:`REASONS`:
``pass``; ``fail`` (it ran, the output or assertion was wrong); ``timeout`` (the wall-time limit, or the CPU
limit: its SIGXCPU, or the SIGKILL a second later of a program that ignored SIGXCPU, told by the CPU time of
the sandbox's processes); ``oom`` (the harness caught a ``MemoryError``, which is how the address-space limit
shows in Python: there is no signal for it, so a program that raises ``MemoryError`` itself, or exits with the
harness's oom status 102, counts as ``oom`` too; it scores as any failure, only the metric differs);
``killed`` (ended by another signal, or by the host for output over the cap); ``error`` (any other exception,
a syntax error, a non-zero exit, the program exiting before an assertion ran, or no code extracted: the
sample's tests then count as errors without running). The reasons' ratios over a call's executions sum to 1.

**Scores** (per sample, over its ``n`` tests): ``pass_fraction`` is ``(passed + failure_score · (n -
passed)) / n``, the pass fraction when ``failure_score`` is 0; ``all_pass`` is 1 when every test passes, else
``failure_score``. A sample without code scores ``failure_score``.

The harness is the one trusted program in the sandbox: it runs the code and the test and ends with an exit
status per outcome; an assertion's pass also wants a per-execution random token printed after the assertion
held, which stops a plain early ``os._exit(0)``. Assertion tests run in the program's own process and can be
gamed from there (the token read from the harness's frames and printed before an exit, an object whose
``__eq__`` is always true): no harness in the same process can stop that. stdin/stdout tests are compared by
the host, out of the program's reach: use them for RL rewards. The sandbox protects the host, not the
reward.
"""

from __future__ import annotations

import json
import re
import secrets
import signal
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from rlflow.dataflow.errors import DataError
from rlflow.nodes.services.sandbox import Execution, Sandbox

__all__ = [
    "EXTRACT_MODES",
    "HARNESS",
    "REASONS",
    "SCORE_MODES",
    "CodeTest",
    "Outcome",
    "classify",
    "extract_code",
    "parse_tests",
    "reason_ratios",
    "run_tests",
    "sample_score",
]

EXTRACT_MODES = ("fenced", "whole")
"""``fenced``: the last fenced block (```` ```python ````, ```` ```py ````, ```` ```python3 ```` or no
language); a response without one has no code. ``whole``: the whole response."""

SCORE_MODES = ("pass_fraction", "all_pass")
REASONS = ("pass", "fail", "timeout", "oom", "killed", "error")
"""How an execution ended (the module docstring defines each)."""

_EXIT_FAIL, _EXIT_OOM, _EXIT_ERROR = 101, 102, 103
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\r?\n(.*?)```", re.DOTALL)

HARNESS = rf"""
import os, sys, traceback
def _end(status, marker=None):
    try:
        if marker is not None:
            sys.stdout.write("\n" + marker + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)
def _main(code, test, marker):
    env = {{"__name__": "__main__", "__builtins__": __builtins__}}
    try:
        exec(compile(code, "solution.py", "exec"), env)
        if test is not None:
            exec(compile(test, "test.py", "exec"), env)
    except SystemExit as e:
        if test is not None:
            print("the program exited before its test ran", file=sys.stderr)
            _end({_EXIT_ERROR})
        _end(0 if e.code is None or e.code == 0 else e.code if isinstance(e.code, int) else 1)
    except MemoryError:
        _end({_EXIT_OOM})
    except AssertionError:
        traceback.print_exc()
        _end({_EXIT_FAIL} if test is not None else {_EXIT_ERROR})
    except BaseException:
        traceback.print_exc()
        _end({_EXIT_ERROR})
    _end(0, marker if test is not None else None)
_main(job["code"], job["test"], job["marker"])
"""
"""The trusted harness run in the sandbox (the sandbox's prelude gives it ``job``)."""


@dataclass(frozen=True)
class CodeTest:
    """One test: ``stdin``/``stdout`` (a stdin/stdout pair) or ``assertion`` (an assert statement)."""

    stdin: str = ""
    stdout: str | None = None
    assertion: str | None = None


@dataclass(frozen=True)
class Outcome:
    """One execution's reason (one of :data:`REASONS`) and the last line of its stderr."""

    reason: str
    detail: str = ""


def extract_code(text: str, mode: str) -> str | None:
    """The code of a response: the last fenced block (``fenced``) or the whole text (``whole``); ``None``
    when there is none (no fenced block, or only whitespace)."""
    if mode == "whole":
        code = text
    elif mode == "fenced":
        blocks = _FENCE.findall(text)
        code = blocks[-1] if blocks else ""
    else:
        raise ValueError(f"extract mode '{mode}' is not one of {', '.join(EXTRACT_MODES)}")
    return code if code.strip() else None


def parse_tests(value: Any) -> list[CodeTest]:
    """A sample's tests from its data field (a JSON string, a list of stdin/stdout pairs or a dict with
    ``asserts``; see the module docstring).

    Raises:
        DataError: not one of the two formats, or no test at all.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"tests are not JSON: {e}") from None
    tests: list[CodeTest] = []
    if isinstance(value, dict) and set(value) == {"asserts"} and isinstance(value["asserts"], list):
        for a in value["asserts"]:
            if not isinstance(a, str):
                raise DataError(f"an assert test must be a string, got {a!r}")
            tests.append(CodeTest(assertion=a))
    elif isinstance(value, list):
        for pair in value:
            if not (isinstance(pair, dict) and "stdout" in pair and set(pair) <= {"stdin", "stdout"}):
                raise DataError(f"a stdin/stdout test must be {{'stdin': str, 'stdout': str}}, got {pair!r}")
            if not all(isinstance(v, str) for v in pair.values()):
                raise DataError(f"a stdin/stdout test's values must be strings, got {pair!r}")
            tests.append(CodeTest(stdin=pair.get("stdin", ""), stdout=pair["stdout"]))
    else:
        raise DataError(
            'tests must be a list of {"stdin": ..., "stdout": ...} pairs or {"asserts": [...]}, '
            f"got {str(value)[:80]!r}"
        )
    if not tests:
        raise DataError("a sample has no test")
    return tests


def _normal(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def classify(execution: Execution, test: CodeTest, marker: str) -> Outcome:
    """The reason an execution of ``test`` ended with (:data:`REASONS`; the module docstring defines them)."""
    err = execution.stderr.decode(errors="replace").strip().splitlines()
    detail = err[-1][:200] if err else ""
    code = execution.exit_code
    if execution.timed_out:
        return Outcome("timeout", "wall-time limit")
    if execution.output_exceeded:
        return Outcome("killed", "output over the cap")
    assert code is not None
    if code == _EXIT_OOM:
        return Outcome("oom", detail or "MemoryError")
    if code == 128 + signal.SIGXCPU:
        return Outcome("timeout", "CPU-time limit")
    if execution.cpu_killed:
        return Outcome("timeout", "CPU-time limit (SIGKILL: SIGXCPU was ignored)")
    if code > 128:
        return Outcome("killed", f"signal {code - 128}")
    if code == _EXIT_FAIL:
        return Outcome("fail", detail)
    if code != 0:
        return Outcome("error", detail or f"exit status {code}")
    out = execution.stdout.decode(errors="replace")
    if test.assertion is not None:
        ok = out.rstrip().endswith(marker)
        return Outcome("pass") if ok else Outcome("error", "the program exited before its test ran")
    assert test.stdout is not None
    return Outcome("pass") if _normal(out) == _normal(test.stdout) else Outcome("fail", "wrong output")


def _execute(
    sandbox: Sandbox, code: str, test: CodeTest, start_retries: int, cancel: threading.Event
) -> Outcome:
    marker = secrets.token_hex(16)
    job = {"code": code, "test": test.assertion, "marker": marker}
    execution = sandbox.run(HARNESS, job, test.stdin.encode(), start_retries=start_retries, cancel=cancel)
    return classify(execution, test, marker)


def run_tests(
    sandbox: Sandbox,
    codes: Sequence[str | None],
    tests: Sequence[Sequence[CodeTest]],
    *,
    concurrency: int,
    start_retries: int,
) -> list[list[Outcome]]:
    """Each sample's outcomes, one per test, its executions run by a pool of ``concurrency`` threads (each
    waits on one sandboxed process). A sample without code gets ``error`` per test, nothing run.

    An exception that ends the call early (a failed start, or a stop signal's abandoning the iteration while
    the caller waits) kills the executions still running within 0.25 s and starts no more.

    Raises:
        SandboxStartError: a sandbox failed to start ``start_retries + 1`` times (the other executions are
            abandoned).
    """
    jobs = [(i, j) for i, code in enumerate(codes) if code is not None for j in range(len(tests[i]))]
    outcomes = [[Outcome("error", "no code")] * len(t) for t in tests]
    cancel = threading.Event()  # set when this call ends early: its running executions are killed
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sandbox") as pool:
        futures = {
            (i, j): pool.submit(_execute, sandbox, str(codes[i]), tests[i][j], start_retries, cancel)
            for i, j in jobs
        }
        try:
            for (i, j), future in futures.items():
                outcomes[i][j] = future.result()
        finally:  # a failed start, or a stop signal abandoning the call: leaving the pool waits on none
            cancel.set()
            for future in futures.values():
                future.cancel()
    return outcomes


def sample_score(outcomes: Sequence[Outcome], mode: str, failure_score: float) -> float:
    """One sample's score from its tests' outcomes (the module docstring gives both formulas)."""
    passed = sum(o.reason == "pass" for o in outcomes)
    if mode == "all_pass":
        return 1.0 if passed == len(outcomes) else failure_score
    return (passed + failure_score * (len(outcomes) - passed)) / len(outcomes)


def reason_ratios(outcomes: Sequence[Sequence[Outcome]]) -> dict[str, float]:
    """``reward/code_<reason>_ratio`` for each of :data:`REASONS`: its share of all executions (sum 1)."""
    counts = Counter(o.reason for row in outcomes for o in row)
    total = max(sum(counts.values()), 1)
    return {f"reward/code_{r}_ratio": counts[r] / total for r in REASONS}
