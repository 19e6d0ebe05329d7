"""Math answers checked by the ``math-verify`` package (Hugging Face): the rule reward ``math_verify``.

``math-verify`` extracts the final answer of a response (a ``\\boxed{}``, a LaTeX expression, a plain number)
and the reference answer, parses both into SymPy and compares them symbolically (``\\frac{1}{2}`` = ``0.5``
= ``1/2``; ``x+1`` = ``1+x``). Its time limit is a ``SIGALRM`` alarm, which works on the main thread only and
shares the process's one real-time timer with the run's own stop timeout
(:meth:`rlflow.schedulers.runtime.controller.Controller.run`): :func:`verify_math_answer` re-arms what the
timer held before the call once the call is over.
"""

from __future__ import annotations

import signal
import threading
import time

from rlflow.dataflow.errors import NodeError

__all__ = ["check_math_verify_options", "verify_math_answer"]


def _gold_text(answer: str) -> str:
    """A bare reference answer (``12``, ``\\frac{1}{2}``) as LaTeX math for math-verify's extraction."""
    text = answer.strip()
    return text if "$" in text or "\\boxed" in text else f"${text}$"


def check_math_verify_options(timeout_s: object = 5) -> None:
    """The ``math_verify`` reward's options, checked when they are bound (``rlflow validate``, before a call).

    Raises:
        NodeError: ``timeout_s`` is not a whole number of seconds >= 0 (the message names the key).
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 0:
        raise NodeError(f"math_verify: timeout_s must be a whole number of seconds >= 0, got {timeout_s!r}")


def verify_math_answer(response_text: str, answer: str, timeout_s: int) -> float:
    """1.0 if the final answer of ``response_text`` equals ``answer`` by ``math_verify.verify``, else 0.0.

    ``"The answer is $\\boxed{0.5}$"`` vs ``"\\frac{1}{2}"`` -> 1; ``"so 1/2"`` vs ``"0.5"`` -> 1;
    ``"\\boxed{4}"`` vs ``"3"`` -> 0; a response with no answer -> 0. Parsing and comparing each get
    ``timeout_s`` whole seconds (math-verify's ``SIGALRM`` alarm); past it the response scores 0 (math-verify
    logs a warning); ``timeout_s`` 0: no limit (a pathological expression such as ``9^{9^{9^9}}`` can then
    take hours).

    Raises:
        NodeError: math-verify is not installed (the ``rewards`` extra); ``timeout_s`` is not an integer >= 0;
            or the call is off the main thread with a time limit (Python delivers signals to the main thread
            only).
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise NodeError(f"math_verify needs the math-verify package (the rewards extra): {e}") from e
    check_math_verify_options(timeout_s)
    limit = timeout_s if timeout_s > 0 else None
    if limit is not None and threading.current_thread() is not threading.main_thread():
        raise NodeError(
            "math_verify: its time limit is a SIGALRM alarm, which only the main thread receives; this call "
            f"runs on thread '{threading.current_thread().name}' (timeout_s: 0 runs it without a limit)"
        )
    # math-verify's alarm replaces the real-time timer and cancels it when done: keep what it held (the run's
    # stop timeout), re-armed afterwards with the time left (at once if it ran out during the call)
    held_s, interval_s = signal.getitimer(signal.ITIMER_REAL) if limit is not None else (0.0, 0.0)
    started = time.monotonic()
    try:
        gold = parse(_gold_text(answer), parsing_timeout=limit)
        got = parse(response_text, parsing_timeout=limit)
        return 1.0 if gold and got and verify(gold, got, timeout_seconds=limit) else 0.0
    finally:
        if held_s > 0:
            left = held_s - (time.monotonic() - started)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), interval_s)
