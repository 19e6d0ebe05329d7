"""Small programming problems with tests: the data generator ``code``.

A problem is a chain of ``steps`` integer steps applied in order to ``x``, read from stdin: the prompt
``"x +2 *3:"`` asks for a program that prints ``(x+2)*3``. Each step is an operator of ``ops`` (``+``,
``-``, ``*``) and a constant in ``[2, max_const]`` (2 and up: ``*1`` would make a step that does nothing).
Rows are::

    {"prompt": "x +2 *3:",
     "tests": [{"stdin": "5\\n", "stdout": "21\\n"}, ...],      # code_reward's stdin/stdout pairs
     "solution": "print((int(input())+2)*3)",                     # a correct short program
     "demonstration": "print(int(input())+2*3)"}                  # the imperfect demonstrator's program

Problems are distinct, deterministic in the arguments, and the ``train`` and ``eval`` splits are disjoint:
both come from one seeded stream of distinct problems, the first ``eval_size`` forming the held-out split.
Each problem has ``tests`` stdin/stdout pairs with distinct inputs ``x`` in ``[1, 99]``.

``demonstration`` is what an imperfect demonstrator writes, for supervised fine-tuning: on a share
``paren_slip`` of the training problems whose program needs parentheses (a ``*`` step after a ``+`` or
``-`` step) it transcribes the steps left to right and forgets that ``*`` binds tighter than ``+`` and
``-`` in Python (The Python Language Reference, 6.17 "Operator precedence"), writing ``x+2*3`` for
``(x+2)*3``. Each program is linear in ``x``; the slipped one's slope is the product of the multipliers
before the first ``+``/``-`` step, the true one's the product of all of them, so the two differ on all but
at most one input and two distinct tests always tell them apart. Elsewhere, and on every held-out row,
``demonstration == solution``. A model imitating it learns both programs side by side; an execution reward
on ``tests`` (``code_reward``) can then teach it to prefer the right one (``examples/code``).
"""

from __future__ import annotations

import random
from typing import Any

from rlflow.dataflow.data import DATA_GENERATORS
from rlflow.dataflow.errors import DataError

__all__ = ["OPS", "Step", "code", "count_problems", "make_problems", "needs_parens", "program", "run_steps"]

OPS = ("+", "-", "*")
Step = tuple[str, int]
"""One step of a problem: ``(operator, constant)``, e.g. ``("*", 3)``."""

# the program's input read as Python reads it
READ_X = "int(input())"
# inputs x of the tests, inclusive (positive: the slip argument above needs x != 0)
X_RANGE = (1, 99)


def run_steps(x: int, steps: tuple[Step, ...]) -> int:
    """The value the problem asks for: ``steps`` applied to ``x`` in order (``x +2 *3`` -> ``(x+2)*3``)."""
    for op, c in steps:
        if op == "+":
            x += c
        elif op == "-":
            x -= c
        elif op == "*":
            x *= c
        else:
            raise DataError(f"code: unknown operator '{op}'; use {', '.join(OPS)}")
    return x


def needs_parens(steps: tuple[Step, ...]) -> bool:
    """Whether the program needs parentheses: some ``*`` step follows a ``+`` or ``-`` step."""
    ops = [op for op, _ in steps]
    return any(op == "*" and any(o in "+-" for o in ops[:i]) for i, op in enumerate(ops))


def program(steps: tuple[Step, ...], *, slip: bool = False) -> str:
    """The one-line program printing ``steps`` applied to the integer on stdin, with the fewest
    parentheses: ``(`` ``)`` around the expression so far when a ``*`` step follows a ``+``/``-`` one.

    ``slip``: the demonstrator's program, the steps written left to right with no parentheses
    (``+2 *3`` -> ``print(int(input())+2*3)``, which Python reads as ``x+6``).
    """
    expr, low = READ_X, False  # low: the expression's outermost operator is + or -
    for op, c in steps:
        if op == "*" and low and not slip:
            expr, low = f"({expr})", False
        expr += f"{op}{c}"
        low = low or op in "+-"
    return f"print({expr})"


def count_problems(steps: int, ops: str, max_const: int) -> int:
    """Number of distinct problems: ``(len(set(ops)) * (max_const - 1)) ** steps``."""
    return (len(set(ops)) * (max_const - 1)) ** steps


def make_problems(
    count: int, *, steps: int = 2, ops: str = "+-*", max_const: int = 9, seed: int = 0
) -> list[tuple[Step, ...]]:
    """``count`` distinct problems (tuples of ``steps`` steps) drawn with ``random.Random(seed)``.

    Raises:
        DataError: bad ``steps``/``ops``/``max_const``, or ``count`` exceeds the number of distinct problems.
    """
    if not isinstance(steps, int) or steps < 1:
        raise DataError(f"code: steps must be an integer >= 1, got {steps!r}")
    if not isinstance(ops, str) or not ops or any(op not in OPS for op in ops):
        raise DataError(f"code: ops must be a non-empty string of {''.join(OPS)}, got {ops!r}")
    if not isinstance(max_const, int) or max_const < 2:
        raise DataError(f"code: max_const must be an integer >= 2, got {max_const!r}")
    available = count_problems(steps, ops, max_const)
    if count > available:
        raise DataError(
            f"code: {count} distinct problems requested, only {available} exist "
            f"({steps} steps, ops {ops!r}, constants 2..{max_const})"
        )
    rng = random.Random(seed)
    op_list = sorted(set(ops), key=OPS.index)
    seen: set[tuple[Step, ...]] = set()
    out: list[tuple[Step, ...]] = []
    while len(out) < count:
        problem = tuple(
            (op_list[rng.randrange(len(op_list))], rng.randint(2, max_const)) for _ in range(steps)
        )
        if problem in seen:
            continue
        seen.add(problem)
        out.append(problem)
    return out


@DATA_GENERATORS.register("code")
def code(
    split: str,
    steps: int = 2,
    ops: str = "+-*",
    max_const: int = 9,
    train_size: int = 400,
    eval_size: int = 128,
    tests: int = 3,
    seed: int = 0,
    paren_slip: float = 0.0,
) -> list[dict[str, Any]]:
    """Rows ``{"prompt", "tests", "solution", "demonstration"}`` (module docstring) of split ``train``
    (``train_size`` rows) or ``eval`` (``eval_size`` rows).

    ``tests``: stdin/stdout pairs per problem (at least 2), distinct inputs drawn per problem from
    ``[1, 99]`` with a stream seeded by ``seed``. ``paren_slip`` in [0, 1]: the share of the training
    problems needing parentheses whose ``demonstration`` is the slipped program (drawn per problem);
    0 = a perfect demonstrator.

    Raises:
        DataError: unknown split or invalid arguments (see :func:`make_problems`); ``tests`` not an integer
            in [2, 99]; ``paren_slip`` outside [0, 1].
    """
    if split not in ("train", "eval"):
        raise DataError(f"code: unknown split '{split}'; use train or eval")
    for name, size in (("train_size", train_size), ("eval_size", eval_size)):
        if not isinstance(size, int) or size < 0:
            raise DataError(f"code: {name} must be an integer >= 0, got {size!r}")
    n_inputs = X_RANGE[1] - X_RANGE[0] + 1
    if not isinstance(tests, int) or not 2 <= tests <= n_inputs:
        raise DataError(
            f"code: tests must be an integer in [2, {n_inputs}] (two tell a slip apart), got {tests!r}"
        )
    if not isinstance(paren_slip, (int, float)) or not 0.0 <= paren_slip <= 1.0:
        raise DataError(f"code: paren_slip must be a number in [0, 1], got {paren_slip!r}")
    problems = make_problems(eval_size + train_size, steps=steps, ops=ops, max_const=max_const, seed=seed)
    # separate streams, one draw each per problem whatever the split: a problem's tests and demonstration
    # never depend on eval_size or paren_slip
    inputs = random.Random(f"code-tests-{seed}")
    slips = random.Random(f"code-paren-slip-{seed}")
    rows = []
    for i, problem in enumerate(problems):
        xs = inputs.sample(range(X_RANGE[0], X_RANGE[1] + 1), tests)
        slipped = slips.random() < paren_slip and i >= eval_size and needs_parens(problem)
        rows.append(
            {
                "prompt": "x " + " ".join(f"{op}{c}" for op, c in problem) + ":",
                "tests": [{"stdin": f"{x}\n", "stdout": f"{run_steps(x, problem)}\n"} for x in xs],
                "solution": program(problem),
                "demonstration": program(problem, slip=slipped),
            }
        )
    return rows[:eval_size] if split == "eval" else rows[eval_size:]
