"""The ``math_verify`` rule reward (the math-verify package): goldens by hand, through the registry and
through a ``rule_reward`` node; its time limit, the run's stop timer kept across it, the main-thread rule."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeContext
from rlflow.nodes.rewards import REWARD_FUNCTIONS, resolve_reward, score_texts
from rlflow.nodes.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# (response, reference answer, score): the final answer compared as mathematics, not as text
GOLDEN = [
    ("The answer is $\\boxed{0.5}$", "\\frac{1}{2}", 1.0),  # 0.5 = 1/2
    ("so 1/2", "0.5", 1.0),  # a plain fraction, the last expression of the text
    ("\\boxed{\\frac12}", "1/2", 1.0),  # \frac12 is \frac{1}{2}
    ("$\\boxed{1+x}$", "x+1", 1.0),  # symbolic: 1 + x = x + 1
    ("1000", "1,000", 1.0),  # thousands separator in the reference
    ("\\boxed{12}", "\\boxed{12}", 1.0),  # a boxed reference
    ("6+6", "12", 1.0),  # an expression is evaluated: 6 + 6 = 12
    ("\\boxed{4}", "3", 0.0),  # wrong
    ("12 then 13", "12", 0.0),  # the final answer is 13
    ("0.333", "1/3", 0.0),  # 0.333 is not 1/3 (math-verify rounds floats to 6 digits)
    ("no number", "2", 0.0),  # no answer at all
    ("", "3", 0.0),
]


def test_math_verify_goldens() -> None:
    assert "math_verify" in REWARD_FUNCTIONS
    fn = resolve_reward("math_verify")
    responses, answers, want = zip(*GOLDEN, strict=True)
    assert score_texts(fn, list(responses), list(answers), name="math_verify") == list(want)


def test_rule_reward_node_runs_math_verify_with_its_options() -> None:
    load_builtin_functions()
    tok = load_tokenizer(ROOT / "examples/arith/tokenizer")
    texts = ["12", "13", "6+6"]  # vs answer 12: equal, wrong, equal as an expression
    ids = torch.tensor([tok(t, add_special_tokens=False)["input_ids"] + [0] * (3 - len(t)) for t in texts])
    batch = Batch({"response_ids": ids, "response_mask": (ids != 0).long(), "answer": ["12"] * 3})
    args: dict[str, Any] = {"fn": "math_verify", "timeout_s": 2}
    node = NodeSpec("reward", "inference", "rule_reward", args=args)
    ctx = NodeContext(node=node, model=None, tokenizer=tok)
    out = NODE_FUNCTIONS.get("rule_reward").fn(ctx, batch, **args)
    assert out.outputs["scores"].tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(NodeError, match=r"node 'reward'.*timeout_s must be a whole number of seconds >= 0"):
        NODE_FUNCTIONS.get("rule_reward").fn(ctx, batch, fn="math_verify", timeout_s=-1)


def test_a_comparison_past_timeout_s_scores_zero() -> None:
    # 9^(9^(9^9)) cannot be compared with 3 in any time SymPy has: the 1 s alarm ends it
    assert resolve_reward("math_verify", timeout_s=1)("\\boxed{9^{9^{9^{9}}}}", "3") == 0.0


def test_the_runs_stop_timer_survives_a_call() -> None:
    """The controller's stop timeout is the process's real-time timer, which math-verify's alarm replaces:
    armed at 100 s before a call, it is armed again after it, with at most 100 s left."""
    fired: list[int] = []

    def handler(signum: int, frame: object) -> None:
        fired.append(signum)

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 100.0)
        assert resolve_reward("math_verify")("\\boxed{\\frac12}", "0.5") == 1.0
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0 < left <= 100.0 and not fired
        assert signal.getsignal(signal.SIGALRM) is handler  # restored by math-verify
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_a_time_limit_is_refused_and_none_runs() -> None:
    got: dict[str, Any] = {}

    def call(timeout_s: int) -> None:
        try:
            got[str(timeout_s)] = resolve_reward("math_verify", timeout_s=timeout_s)("so 1/2", "0.5")
        except NodeError as e:
            got[str(timeout_s)] = str(e)

    for t in (5, 0):
        thread = threading.Thread(target=call, args=(t,), name="scorer")
        thread.start()
        thread.join()
    assert "only the main thread receives; this call runs on thread 'scorer'" in got["5"]
    assert got["0"] == 1.0


def test_validate_checks_the_options_naming_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    """``timeout_s`` 2.5 / -1 or a misspelt option: refused by ``rlflow validate`` (a rule_reward node's args,
    the held-out evaluation's reward_args), not at the first call of the run."""
    from rlflow.schedulers.cli import main

    graph = str(ROOT / "examples" / "grpo.yaml")
    node = [graph, "nodes.reward.args.fn=math_verify"]
    for option, why in (
        ("timeout_s=2.5", "math_verify: timeout_s must be a whole number of seconds >= 0, got 2.5"),
        ("timeout_s=-1", "math_verify: timeout_s must be a whole number of seconds >= 0, got -1"),
        ("timeot_s=3", "reward 'math_verify': options timeot_s do not fit it"),
    ):
        assert main(["validate", *node, f"nodes.reward.args.{option}"]) == 2
        assert f"{graph}: nodes.reward.args: {why}" in capsys.readouterr().err
    assert main(["validate", *node, "nodes.reward.args.timeout_s=3"]) == 0
    capsys.readouterr()
    held_out = [graph, "run.eval.reward=math_verify", "run.eval.reward_args.timeout_s=2.5"]
    assert main(["validate", *held_out]) == 2
    assert f"{graph}: run.eval.reward_args: math_verify: timeout_s must be" in capsys.readouterr().err
