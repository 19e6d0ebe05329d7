"""Arithmetic problems with checkable answers: the data generator ``arith``.

Rows are ``{"prompt": "12+34=", "answer": "46"}``. Operands are uniform in ``[0, 10**digits)``;
operators are drawn from ``ops`` (``+``, ``-``, ``*``). Problems are distinct, deterministic in the
arguments, and the ``train`` and ``eval`` splits are disjoint: both come from one seeded stream of
distinct problems, the first ``eval_size`` forming the held-out split.
"""

from __future__ import annotations

import random
from typing import Any

from rlflow.dataflow.data import DATA_GENERATORS
from rlflow.dataflow.errors import DataError

__all__ = ["OPS", "arith", "count_problems", "make_problems", "solve"]

OPS = ("+", "-", "*")


def solve(a: int, op: str, b: int) -> int:
    """The integer value of ``a op b``."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise DataError(f"arith: unknown operator '{op}'; use {', '.join(OPS)}")


def count_problems(digits: int, ops: str, allow_negative: bool) -> int:
    """Number of distinct problems: ``m²`` per ``+``/``*`` and ``m(m+1)/2`` for ``-`` without negatives."""
    m = 10**digits
    return sum(m * (m + 1) // 2 if op == "-" and not allow_negative else m * m for op in set(ops))


def make_problems(
    count: int, *, digits: int = 2, ops: str = "+-", seed: int = 0, allow_negative: bool = False
) -> list[tuple[int, str, int]]:
    """``count`` distinct problems ``(a, op, b)`` drawn with ``random.Random(seed)``.

    Without ``allow_negative`` a ``-`` problem has ``a >= b`` (the operands are swapped when drawn the
    other way round).

    Raises:
        DataError: bad ``digits``/``ops``, or ``count`` exceeds the number of distinct problems.
    """
    if not isinstance(digits, int) or digits < 1:
        raise DataError(f"arith: digits must be an integer >= 1, got {digits!r}")
    if not ops or any(op not in OPS for op in ops):
        raise DataError(f"arith: ops must be a non-empty string of {''.join(OPS)}, got {ops!r}")
    available = count_problems(digits, ops, allow_negative)
    if count > available:
        raise DataError(
            f"arith: {count} distinct problems requested, only {available} exist "
            f"({digits} digits, ops {ops!r})"
        )
    rng = random.Random(seed)
    op_list = sorted(set(ops), key=OPS.index)
    m = 10**digits
    seen: set[tuple[int, str, int]] = set()
    out: list[tuple[int, str, int]] = []
    while len(out) < count:
        op, a, b = op_list[rng.randrange(len(op_list))], rng.randrange(m), rng.randrange(m)
        if op == "-" and not allow_negative and a < b:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        out.append((a, op, b))
    return out


@DATA_GENERATORS.register("arith")
def arith(
    split: str,
    digits: int = 2,
    train_size: int = 2000,
    eval_size: int = 200,
    seed: int = 0,
    ops: str = "+-",
    allow_negative: bool = False,
) -> list[dict[str, Any]]:
    """Rows ``{"prompt": "a+b=", "answer": "c"}`` of split ``train`` (``train_size`` rows) or ``eval``.

    Raises:
        DataError: unknown split or invalid arguments (see :func:`make_problems`).
    """
    if split not in ("train", "eval"):
        raise DataError(f"arith: unknown split '{split}'; use train or eval")
    problems = make_problems(
        eval_size + train_size, digits=digits, ops=ops, seed=seed, allow_negative=allow_negative
    )
    chosen = problems[:eval_size] if split == "eval" else problems[eval_size:]
    return [{"prompt": f"{a}{op}{b}=", "answer": str(solve(a, op, b))} for a, op, b in chosen]
