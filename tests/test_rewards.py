"""Rule rewards: the registry, each builtin rule, dotted-path resolution, failure reporting."""

from __future__ import annotations

import math

import pytest

from rlflow.dataflow.errors import NodeError, RegistryError
from rlflow.nodes.rewards import (
    REWARD_FUNCTIONS,
    arith_exact,
    extract_final_answer,
    make_format_check,
    math_final_answer,
    parse_number,
    resolve_reward,
    score_texts,
)


def test_registry_holds_builtins() -> None:
    for name in ("arith_exact", "math_final_answer", "format_check"):
        assert name in REWARD_FUNCTIONS
    with pytest.raises(RegistryError, match="did you mean 'arith_exact'"):
        resolve_reward("arith_exakt")


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("46", "46", 1.0),
        (" 46", "46", 1.0),
        ("46 ", "46", 1.0),
        ("46+1", "46", 1.0),  # a trailing second attempt after the number is ignored
        ("460", "46", 0.0),  # the whole leading integer must match
        ("4", "46", 0.0),
        ("-3", "-3", 1.0),
        ("3", "-3", 0.0),
        ("046", "46", 1.0),  # same integer
        ("", "46", 0.0),
        ("=46", "46", 0.0),
    ],
)
def test_arith_exact(response: str, answer: str, reward: float) -> None:
    assert arith_exact(response, answer) == reward


def test_parse_number() -> None:
    assert parse_number("1,234") == 1234
    assert parse_number("0.5") == parse_number("1/2") == parse_number("\\frac{1}{2}")
    assert parse_number("$12.") == 12
    assert parse_number("abc") is None and parse_number("1/0") is None


@pytest.mark.parametrize(
    ("text", "final"),
    [
        ("so x = 3 and \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{{2}+1}", "{2}+1"),  # last box, balanced braces
        ("We get 12 apples. The answer is 42.", "42"),
        ("Answer: 7", "7"),
        ("steps 1 2 3\n#### 1,000", "1,000"),
        ("3 plus 4 gives 7", "7"),
        ("sum: 1,000, done", "1,000"),
        ("-2.5 then", "-2.5"),
        ("no numbers here", None),
    ],
)
def test_extract_final_answer(text: str, final: str | None) -> None:
    assert extract_final_answer(text) == final


def test_math_final_answer() -> None:
    assert math_final_answer("... so the answer is 0.50", "1/2") == 1.0
    assert math_final_answer("thus \\boxed{1000}", "1,000") == 1.0
    assert math_final_answer("thus \\boxed{999}", "1000") == 0.0
    assert math_final_answer("it is 5 then 6", "6") == 1.0  # last number
    assert math_final_answer("\\boxed{x+1}", "x+1") == 1.0  # non-numeric: string compare
    assert math_final_answer("nothing", "3") == 0.0


def test_format_check_default_and_configured() -> None:
    fmt = resolve_reward("format_check")
    assert fmt(" 12 ", "") == 1.0 and fmt("12 apples", "") == 0.0
    tagged = resolve_reward("format_check", pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    assert tagged("<think>a\nb</think> <answer>3</answer>", "") == 1.0
    assert tagged("<answer>3</answer>", "") == 0.0
    search = make_format_check(r"\d+", full_match=False)
    assert search("x 12 y", "") == 1.0 and search("none", "") == 0.0


def test_dotted_paths() -> None:
    assert resolve_reward("rlflow.nodes.rewards:arith_exact") is arith_exact
    assert resolve_reward("rlflow.nodes.rewards.arith_exact") is arith_exact
    assert resolve_reward("math.isclose") is math.isclose  # any importable callable
    with pytest.raises(NodeError, match=r"cannot import module 'no_such_pkg\.mod'"):
        resolve_reward("no_such_pkg.mod:fn")
    with pytest.raises(NodeError, match="has no 'nope'"):
        resolve_reward("rlflow.nodes.rewards:nope")
    with pytest.raises(NodeError, match="not callable"):
        resolve_reward("math:pi")


def _raises_on_seven(response: str, answer: str) -> float:
    if response == "7":
        raise ZeroDivisionError("bad luck")
    return 1.0


def test_score_texts_reports_failing_sample() -> None:
    assert score_texts(arith_exact, ["46", "45"], ["46", "46"]) == [1.0, 0.0]
    with pytest.raises(
        NodeError, match=r"'_raises_on_seven' on sample 1 \(response '7'.*ZeroDivisionError: bad luck"
    ):
        score_texts(_raises_on_seven, ["1", "7"], ["1", "2"])
    with pytest.raises(NodeError, match=r"sample 0.*returned NaN"):
        score_texts(lambda r, a: math.nan, ["x"], ["y"])
    with pytest.raises(NodeError, match="not a number"):
        score_texts(lambda r, a: "1.0", ["x"], ["y"])  # type: ignore[arg-type,return-value]
    with pytest.raises(NodeError, match="finite"):
        score_texts(lambda r, a: math.inf, ["x"], ["y"])
