"""Rule rewards: ``fn(response_text: str, answer: str) -> float`` functions keyed by name.

Graph files name a reward in a ``rule_reward`` node's ``args.fn``: either a name registered in
:data:`REWARD_FUNCTIONS` (``arith_exact``, ``math_final_answer``, ``math_verify``, ``format_check``,
``tagged_answer_exact``) or a dotted path to any importable function (``pkg.mod:fn`` or ``pkg.mod.fn``).
:func:`score_texts` applies one to a batch and turns a raising function or a NaN into a
:class:`~rlflow.dataflow.errors.NodeError` naming the function and the sample.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import NodeError, RlflowError
from rlflow.dataflow.registry import Registry
from rlflow.nodes.checks import RUN_CHECKS
from rlflow.nodes.math_answers import check_math_verify_options, verify_math_answer
from rlflow.nodes.scoring import scoring_function, scoring_mistakes

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "OPTION_CHECKS",
    "REWARD_FUNCTIONS",
    "RewardFn",
    "arith_exact",
    "eval_reward_mistakes",
    "extract_final_answer",
    "format_check",
    "make_format_check",
    "math_final_answer",
    "math_verify",
    "parse_number",
    "resolve_reward",
    "reward_name_mistakes",
    "score_texts",
    "tagged_answer_exact",
]

RewardFn = Callable[[str, str], float]

REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", group="rlflow.rewards")

_INT_RE = re.compile(r"^\s*([+-]?\d+)")
_NUMBER_RE = re.compile(r"[+-]?(?:\d(?:[\d,]*\d)?(?:\.\d+)?|\.\d+)(?:/\d+)?")


@REWARD_FUNCTIONS.register("arith_exact")
def arith_exact(response_text: str, answer: str) -> float:
    """1.0 if the response starts with exactly the integer ``answer`` (leading spaces allowed), else 0.0.

    ``"46"`` vs answer ``"46"`` -> 1; ``"460"`` -> 0 (the whole leading integer must match); ``"46 "`` -> 1;
    ``" -3"`` vs ``"-3"`` -> 1; ``""`` -> 0. Text after the number (a second attempt) is ignored.
    """
    m = _INT_RE.match(response_text)
    if m is None:
        return 0.0
    try:
        return 1.0 if int(m.group(1)) == int(str(answer).strip()) else 0.0
    except ValueError:
        return 0.0


def parse_number(text: str) -> Fraction | None:
    """A number written as an integer, a decimal, a fraction ``a/b`` or with thousands commas, or None.

    ``"1,234"`` -> 1234, ``"0.5"`` -> 1/2, ``"3/4"`` -> 3/4, ``"$12"`` -> 12, ``"abc"`` -> None.
    """
    s = text.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    s = s.removeprefix("\\(").removesuffix("\\)")
    frac = re.fullmatch(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if frac:
        num, den = parse_number(frac.group(1)), parse_number(frac.group(2))
        return None if num is None or den is None or den == 0 else num / den
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _last_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked solution, or None.

    In order: the last ``\\boxed{X}``; the text after the last "answer is" / "answer:" (its first number
    when it holds one); a GSM8K-style ``#### X``; the last number in the text.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    hits = list(_ANSWER_IS_RE.finditer(text))
    if hits:
        tail = hits[-1].group(1)
        num = _NUMBER_RE.search(tail)
        return num.group(0) if num else tail.strip().rstrip(".") or None
    gsm = re.findall(r"####\s*([^\n]+)", text)
    if gsm:
        return str(gsm[-1]).strip()
    numbers = _NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


@REWARD_FUNCTIONS.register("math_final_answer")
def math_final_answer(response_text: str, answer: str) -> float:
    """1.0 if the response's final answer (:func:`extract_final_answer`) equals ``answer``, else 0.0.

    Numbers compare by value (``"0.50"`` = ``"1/2"`` = ``"\\frac{1}{2}"``; ``"1,000"`` = ``"1000"``);
    non-numeric answers compare as whitespace-stripped strings.
    """
    got = extract_final_answer(response_text)
    if got is None:
        return 0.0
    want = extract_final_answer(answer) if _last_boxed(answer) is not None else answer
    want = (want or "").strip()
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        return 1.0 if a == b else 0.0
    return 1.0 if got.strip() == want else 0.0


@REWARD_FUNCTIONS.register("math_verify")
def math_verify(response_text: str, answer: str, timeout_s: int = 5) -> float:
    """1.0 if the response's final answer equals ``answer`` by the ``math-verify`` package (parsed into SymPy
    and compared symbolically: ``\\frac{1}{2}`` = ``0.5`` = ``1/2``, ``x+1`` = ``1+x``), else 0.0.

    ``timeout_s`` (a ``rule_reward`` option): whole seconds each of parsing and comparing may take (past it:
    0.0; 0: no limit). See :func:`rlflow.nodes.math_answers.verify_math_answer`.
    """
    return verify_math_answer(response_text, answer, timeout_s)


def make_format_check(pattern: str, *, full_match: bool = True, flags: int = re.DOTALL) -> RewardFn:
    """A reward giving 1.0 when the response matches the regex ``pattern`` (whole text by default)."""
    regex = re.compile(pattern, flags)

    def check(response_text: str, answer: str) -> float:
        m = regex.fullmatch(response_text.strip()) if full_match else regex.search(response_text)
        return 1.0 if m else 0.0

    check.__name__ = f"format_check[{pattern}]"
    return check


FORMAT_PATTERN = r"[+-]?\d+"


@REWARD_FUNCTIONS.register("format_check")
def format_check(response_text: str, answer: str, pattern: str = FORMAT_PATTERN) -> float:
    """1.0 if the whole (stripped) response matches ``pattern`` (default: one integer), else 0.0.

    ``answer`` is unused; configure another rule with ``rule_reward`` ``args: {pattern: ...}`` (passed
    by :func:`resolve_reward` as ``options``) or build one with :func:`make_format_check`.
    """
    return 1.0 if re.fullmatch(pattern, response_text.strip(), re.DOTALL) else 0.0


_TAGGED_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@REWARD_FUNCTIONS.register("tagged_answer_exact")
def tagged_answer_exact(response_text: str, answer: str) -> float:
    """1.0 if the text inside the response's last ``<answer> ... </answer>`` equals ``answer`` (whitespace-
    normalised, case-folded), else 0.0; a response without the tags scores 0 (exact match, the reward of
    Search-R1, Jin et al. 2025).

    ``"<search> x </search> <answer> Paris </answer>"`` vs ``"paris"`` -> 1; ``"<answer> paris france
    </answer>"`` -> 0; ``"paris"`` (no tags) -> 0.
    """
    hits = _TAGGED_RE.findall(response_text)
    if not hits:
        return 0.0
    got, want = " ".join(hits[-1].split()).casefold(), " ".join(str(answer).split()).casefold()
    return 1.0 if got == want else 0.0


OPTION_CHECKS: dict[str, Callable[..., None]] = {"math_verify": check_math_verify_options}
"""A registered reward's check of its options' values, run when :func:`resolve_reward` binds them."""


def reward_name_mistakes(
    name: str, where: str, options: dict[str, object] | None = None, options_where: str = ""
) -> list[str]:
    """``["<where>: <why>"]`` when the reward ``name`` (a registered name or a dotted path) does not resolve
    (:func:`resolve_reward`), ``["<options_where>: <why>"]`` when it does but ``options`` do not bind, else
    ``[]``; ``where`` and ``options_where`` name the file and key."""
    try:
        resolve_reward(name)
    except RlflowError as e:
        return [f"{where}: {e}"]
    if options:
        try:
            resolve_reward(name, **options)
        except RlflowError as e:
            return [f"{options_where}: {e}"]
    return []


@RUN_CHECKS.register("run.eval.reward")
def eval_reward_mistakes(graph: Graph) -> list[str]:
    """The run-level check of ``run.eval.reward``, the held-out evaluation's reward: it must resolve (a
    ``rule_reward`` node's ``args.fn``, the evaluation's reward otherwise, is that node's own check), or name
    a scoring node function (``code_reward``) whose arguments bind
    (:func:`rlflow.nodes.scoring.scoring_mistakes`)."""
    reward = graph.spec.run.eval.get("reward")
    if not reward:
        return []
    scorer = scoring_function(str(reward))
    if scorer is not None:
        return scoring_mistakes(graph, scorer)
    where = f"{graph.spec.source or '<graph>'}: run.eval.reward"
    return reward_name_mistakes(str(reward), where, graph.spec.run.eval.get("reward_args"), f"{where}_args")


def resolve_reward(name_or_path: str, **options: object) -> RewardFn:
    """The reward function for a registered name or a dotted path (``pkg.mod:fn`` / ``pkg.mod.fn``).

    ``options`` are bound as keyword arguments (``format_check`` takes ``pattern``).

    Raises:
        RegistryError: an unknown name that is not a dotted path (with a "did you mean").
        NodeError: a dotted path whose module or attribute cannot be imported, or that is not callable.
    """
    if name_or_path in REWARD_FUNCTIONS:
        fn: Callable[..., float] = REWARD_FUNCTIONS.get(name_or_path)
    elif ":" in name_or_path or "." in name_or_path:
        fn = _import_callable(name_or_path)
    else:
        REWARD_FUNCTIONS.get(name_or_path)  # raises RegistryError with a suggestion
        raise AssertionError("unreachable")
    if options:
        _check_options(fn, name_or_path, options)
        base = fn

        def bound(response_text: str, answer: str) -> float:
            return base(response_text, answer, **options)

        bound.__name__ = getattr(base, "__name__", name_or_path)
        bound.__qualname__ = getattr(base, "__qualname__", name_or_path)
        return bound
    return fn


def _check_options(fn: Callable[..., float], name: str, options: dict[str, object]) -> None:
    """``options`` must be keyword parameters of ``fn`` and, for a registered reward, pass its
    :data:`OPTION_CHECKS` entry; a ``NodeError`` naming the reward and the key otherwise."""
    try:
        inspect.signature(fn).bind("", "", **options)
    except TypeError as e:
        raise NodeError(f"reward '{name}': options {', '.join(options)} do not fit it: {e}") from None
    except ValueError:  # no signature to read (a builtin): its first call will tell
        pass
    check = OPTION_CHECKS.get(name) if name in REWARD_FUNCTIONS else None
    if check is not None:
        check(**options)


def _import_callable(path: str) -> Callable[..., float]:
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise NodeError(f"reward function '{path}': write a dotted path as 'pkg.mod:fn' or 'pkg.mod.fn'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise NodeError(f"reward function '{path}': cannot import module '{module_name}': {e}") from e
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise NodeError(f"reward function '{path}': module '{module_name}' has no '{attr}'") from None
    if not callable(obj):
        raise NodeError(f"reward function '{path}' is not callable (got {type(obj).__name__})")
    return obj


def score_texts(
    fn: RewardFn, responses: Sequence[str], answers: Sequence[str], *, name: str | None = None
) -> list[float]:
    """``[fn(r, a) for r, a in zip(responses, answers)]`` as floats, checked.

    Raises:
        NodeError: ``fn`` raised, returned a non-number, NaN or an infinity; names the function, the row
            index, the response and the answer.
        ValueError: ``responses`` and ``answers`` differ in length (an internal mismatch).
    """
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    fname = name or getattr(fn, "__qualname__", None) or repr(fn)
    out: list[float] = []
    for i, (resp, ans) in enumerate(zip(responses, answers, strict=True)):
        where = f"reward function '{fname}' on sample {i} (response {resp!r}, answer {ans!r})"
        try:
            raw = fn(resp, ans)
        except Exception as e:  # any user-code failure becomes a NodeError naming the sample
            raise NodeError(f"{where} raised {type(e).__name__}: {e}") from e
        if isinstance(raw, str | bytes):
            raise NodeError(f"{where} returned {type(raw).__name__} {raw!r}, not a number")
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise NodeError(f"{where} returned {type(raw).__name__} {raw!r}, not a number") from None
        if math.isnan(value):
            raise NodeError(f"{where} returned NaN")
        if math.isinf(value):
            raise NodeError(f"{where} returned {value} (rewards must be finite)")
        out.append(value)
    return out
