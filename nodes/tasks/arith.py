"""Arithmetic problems with checkable answers: the data generator ``arith``.

Rows are ``{"prompt": "12+34=", "answer": "46", "demonstration": "46"}``. Operands are uniform in
``[0, 10**digits)``; operators are drawn from ``ops`` (``+``, ``-``, ``*``). Problems are distinct,
deterministic in the arguments, and the ``train`` and ``eval`` splits are disjoint: both come from one
seeded stream of distinct problems, the first ``eval_size`` forming the held-out split.

``demonstration`` is what an imperfect demonstrator writes, for supervised fine-tuning: on a share
``carry_slip`` of the training problems that need a carry (``+``) or a borrow (``-``) it makes the two
classic column-arithmetic slips (Brown & Burton, 1978, "Diagnostic models for procedural bugs in basic
mathematical skills", Cognitive Science 2(2)): it forgets every carry (``57+68`` -> ``15``: each column's
digit sum mod 10) and subtracts the smaller digit from the larger in each column (``52-38`` -> ``26``).
Elsewhere, and on every held-out row, ``demonstration == answer``. A model imitating it learns the
right procedure and the slip side by side; a reward on ``answer`` (the truth) can then teach it to
prefer the right one — the arithmetic chain's main job (``examples/arith``).
"""

from __future__ import annotations

import random
from typing import Any

from rlflow.dataflow.data import DATA_GENERATORS
from rlflow.dataflow.errors import DataError

__all__ = ["OPS", "arith", "count_problems", "make_problems", "needs_carry", "slip", "solve"]

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


def _digits(n: int, width: int) -> list[int]:
    return [(n // 10**i) % 10 for i in range(width)]


def needs_carry(a: int, op: str, b: int) -> bool:
    """Whether column arithmetic on ``a op b`` carries (``+``) or borrows (``-``) in some column.

    ``*`` never counts (the demonstrator makes no multiplication slip); ``-`` assumes ``a >= b``.
    """
    if op not in "+-" or a < 0 or b < 0 or (op == "-" and a < b):
        return False
    return slip(a, op, b) != solve(a, op, b)  # a carry or borrow always changes some column


def slip(a: int, op: str, b: int) -> int:
    """The demonstrator's slipped answer: ``+`` without carries, ``-`` smaller digit from larger per column.

    ``57+68`` -> 15 (7+8=15 -> 5, 5+6=11 -> 1); ``52-38`` -> 26 (|2-8|=6, |5-3|=2). Equals
    :func:`solve` when no column carries or borrows. Operands must be non-negative.

    Raises:
        DataError: ``op`` is not ``+`` or ``-``.
    """
    if op not in "+-":
        raise DataError(f"arith: the demonstrator slips on + and - only, got '{op}'")
    width = max(len(str(a)), len(str(b)))
    cols = zip(_digits(a, width), _digits(b, width), strict=True)
    digits = [(x + y) % 10 if op == "+" else abs(x - y) for x, y in cols]
    return sum(d * 10**i for i, d in enumerate(digits))


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
    carry_slip: float = 0.0,
    slip_ops: str = "+-",
    zero_pad: bool = False,
) -> list[dict[str, Any]]:
    """Rows ``{"prompt": "a+b=", "answer": "c", "demonstration": "d"}`` of split ``train``
    (``train_size`` rows) or ``eval``.

    ``zero_pad``: operands written with ``digits`` digits and answers with ``digits + 1`` (``*``:
    ``2 * digits``), leading zeros kept (``07+68=075``): every column at a fixed position, which a small
    model learns far faster (Lee et al., 2023, "Teaching Arithmetic to Small Transformers",
    arXiv:2307.03381). Rewards compare numbers, so ``075`` scores as 75.

    ``carry_slip`` in [0, 1]: the share of the training problems needing a carry or borrow whose
    ``demonstration`` is :func:`slip`'s (drawn per problem, seeded by ``seed``); 0 = a perfect demonstrator.
    ``slip_ops``: the operators it slips on (``+``: forgets carries, ``-``: smaller from larger).

    Raises:
        DataError: unknown split or invalid arguments (see :func:`make_problems`); ``carry_slip``
            outside [0, 1], or above 0 with negative answers allowed.
    """
    if split not in ("train", "eval"):
        raise DataError(f"arith: unknown split '{split}'; use train or eval")
    if not isinstance(carry_slip, (int, float)) or not 0.0 <= carry_slip <= 1.0:
        raise DataError(f"arith: carry_slip must be a number in [0, 1], got {carry_slip!r}")
    if not isinstance(zero_pad, bool):
        raise DataError(f"arith: zero_pad must be true or false, got {zero_pad!r}")
    if not isinstance(slip_ops, str) or any(op not in "+-" for op in slip_ops):
        raise DataError(f"arith: slip_ops must be made of + and -, got {slip_ops!r}")
    if carry_slip and allow_negative:
        raise DataError("arith: carry_slip needs allow_negative: false (the slips are defined for a >= b)")
    problems = make_problems(
        eval_size + train_size, digits=digits, ops=ops, seed=seed, allow_negative=allow_negative
    )
    slips = random.Random(f"arith-carry-slip-{seed}")
    rows = []
    for i, (a, op, b) in enumerate(problems):
        answer = solve(a, op, b)
        # one draw per problem whatever the split, so a problem's demonstration never depends on eval_size
        slipped = slips.random() < carry_slip and i >= eval_size and op in slip_ops and needs_carry(a, op, b)
        demo = slip(a, op, b) if slipped else answer
        if zero_pad:
            width = 2 * digits if op == "*" else digits + 1
            prompt, shown, demo_shown = (
                f"{a:0{digits}d}{op}{b:0{digits}d}=",
                f"{answer:0{width}d}",
                f"{demo:0{width}d}",
            )
        else:
            prompt, shown, demo_shown = f"{a}{op}{b}=", str(answer), str(demo)
        rows.append({"prompt": prompt, "answer": shown, "demonstration": demo_shown})
    return rows[:eval_size] if split == "eval" else rows[eval_size:]
