"""The code task (issue 38): the ``code`` data generator's programs, tests and slips by hand, its determinism
and disjoint splits; a demonstration run through the real sandbox (``code_reward``) passes its own tests and
a slipped one fails them; the character tokenizer shipped in ``examples/code/tokenizer``; the held-out
evaluation scored by ``code_reward`` (``run.eval.reward``) and its checks; the chain
``examples/code/sft.yaml`` → ``examples/code/grpo.yaml`` CI-sized (its learning: the figure in
docs/rewards.md, not asserted here)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.data import DATA_GENERATORS, load_builtin_generators
from rlflow.dataflow.errors import DataError
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeContext
from rlflow.nodes.tasks.code_task import code, count_problems, make_problems, needs_parens, program, run_steps
from rlflow.nodes.tasks.code_tokenizer import build_tokenizer, save_tokenizer
from rlflow.schedulers.cli import main

ROOT = Path(__file__).resolve().parents[1]
SFT, GRPO = "examples/code/sft.yaml", "examples/code/grpo.yaml"
CHAIN = [SFT, GRPO]  # docs/rewards.md's command
ARGS = {"steps": 3, "max_const": 9, "train_size": 300, "eval_size": 40, "tests": 2, "seed": 0}


@pytest.mark.parametrize(
    ("steps", "solution", "slipped", "x", "value"),
    [
        # (5+2)*3 = 21; the slip reads 5+2*3 = 11
        ((("+", 2), ("*", 3)), "print((int(input())+2)*3)", "print(int(input())+2*3)", 5, 21),
        # no * after + or -: no parentheses, nothing to slip on; 4*2-3 = 5
        ((("*", 2), ("-", 3)), "print(int(input())*2-3)", "print(int(input())*2-3)", 4, 5),
        # (10*2+3)*4 = 92
        ((("*", 2), ("+", 3), ("*", 4)), "print((int(input())*2+3)*4)", "print(int(input())*2+3*4)", 10, 92),
        # ((1-2)*3)*4 = -12: one pair, the second * needs none
        ((("-", 2), ("*", 3), ("*", 4)), "print((int(input())-2)*3*4)", "print(int(input())-2*3*4)", 1, -12),
        # (7+2)*3-4 = 23
        ((("+", 2), ("*", 3), ("-", 4)), "print((int(input())+2)*3-4)", "print(int(input())+2*3-4)", 7, 23),
    ],
)
def test_programs_by_hand(steps: Any, solution: str, slipped: str, x: int, value: int) -> None:
    assert program(steps) == solution
    assert program(steps, slip=True) == slipped
    assert needs_parens(steps) == (solution != slipped)
    assert run_steps(x, steps) == value


def test_registered_as_a_data_generator() -> None:
    load_builtin_generators()
    assert DATA_GENERATORS.get("code") is code


def test_count_and_distinct_problems() -> None:
    # 3 operators x 8 constants (2..9) per step: 24 per step, 24**2 = 576 two-step problems
    assert count_problems(2, "+-*", 9) == 576
    problems = make_problems(576, steps=2, seed=3)
    assert len(set(problems)) == 576
    with pytest.raises(DataError, match="577 distinct problems requested, only 576 exist"):
        make_problems(577, steps=2)


def test_rows_deterministic_and_splits_disjoint() -> None:
    train, held_out = code("train", **ARGS, paren_slip=0.6), code("eval", **ARGS, paren_slip=0.6)
    assert (len(train), len(held_out)) == (300, 40)
    assert train == code("train", **ARGS, paren_slip=0.6)
    assert train != code("train", **{**ARGS, "seed": 1}, paren_slip=0.6)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["prompt"] for r in train}) == 300
    row = held_out[0]
    assert set(row) == {"prompt", "tests", "solution", "demonstration"}
    assert re.fullmatch(r"x( [+*-][2-9]){3}:", row["prompt"])
    # the tests: 2 distinct inputs in [1, 99], the expected output computed from the prompt's steps
    steps = tuple((s[0], int(s[1:])) for s in row["prompt"][2:-1].split())
    xs = [int(t["stdin"]) for t in row["tests"]]
    assert len(set(xs)) == 2 and all(1 <= x <= 99 for x in xs)
    assert [t["stdout"] for t in row["tests"]] == [f"{run_steps(x, steps)}\n" for x in xs]
    assert row["solution"] == program(steps)


def test_slips_only_where_parentheses_are_needed_and_only_in_training() -> None:
    train = code("train", **ARGS, paren_slip=0.6)
    slipped = [r for r in train if r["demonstration"] != r["solution"]]
    needing = [r for r in train if "((" in r["solution"]]
    # a slipped program keeps only print's and int(input())'s parentheses
    assert all("((" in r["solution"] and r["demonstration"].count("(") == 3 for r in slipped)
    assert 0.4 * len(needing) < len(slipped) < 0.8 * len(needing)  # a share 0.6 of them, drawn
    assert all(r["demonstration"] == r["solution"] for r in code("eval", **ARGS, paren_slip=1.0))
    always = code("train", **ARGS, paren_slip=1.0)
    assert sum(r["demonstration"] != r["solution"] for r in always) == len(needing)
    assert all(r["demonstration"] == r["solution"] for r in code("train", **ARGS, paren_slip=0.0))
    # a problem's tests do not depend on the slip share, nor its demonstration on the held-out size
    assert [r["tests"] for r in always] == [r["tests"] for r in train]
    # eval_size 20: training rows are problems 20..319, so its rows from the 21st on are problems 40..319
    later = code("train", **{**ARGS, "eval_size": 20}, paren_slip=0.6)[20:]
    assert [r["demonstration"] for r in later] == [r["demonstration"] for r in train[:280]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"tests": 1}, r"tests must be an integer in \[2, 99\]"),
        ({"paren_slip": 1.5}, r"paren_slip must be a number in \[0, 1\]"),
        ({"ops": "+/"}, r"ops must be a non-empty string of \+-\*"),
        ({"max_const": 1}, r"max_const must be an integer >= 2"),
        ({"steps": 0}, r"steps must be an integer >= 1"),
    ],
)
def test_bad_arguments(args: dict[str, Any], message: str) -> None:
    with pytest.raises(DataError, match=message):
        code("train", **args)
    with pytest.raises(DataError, match="unknown split 'test'"):
        code("test")


def test_tokenizer_shipped_and_round_trips(tmp_path: Path) -> None:
    tok = build_tokenizer()
    assert len(tok) == 63  # 4 specials + 10 digits + 26 letters + 22 punctuation + space
    text = "print((int(input())+2)*3-4)"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1 and tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == text
    save_tokenizer(tmp_path)  # examples/code/make_tokenizer.py's output is the shipped directory
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shipped = json.loads((ROOT / "examples/code/tokenizer" / name).read_text())
        assert json.loads((tmp_path / name).read_text()) == shipped


@pytest.mark.slow  # executions start bwrap and a Python interpreter
def test_demonstrations_through_the_sandbox() -> None:
    """A correct demonstration passes its own tests through ``code_reward`` (the real sandbox); a slipped one
    fails every test but at most one (its line meets the true one at most once): ``all_pass`` 1 and 0."""
    load_builtin_functions()
    rows = code("train", **ARGS, paren_slip=1.0)[:24]
    texts = [r["demonstration"] for r in rows]
    tok = build_tokenizer()
    encoded = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([e + [tok.pad_token_id] * (width - len(e)) for e in encoded])
    mask = torch.tensor([[1] * len(e) + [0] * (width - len(e)) for e in encoded])
    fn = NODE_FUNCTIONS.get("code_reward")
    args = fn.bind({"extract": "whole", "score": "all_pass", "concurrency": 2})
    node = NodeSpec(name="reward", kind="inference", function="code_reward")
    ctx = NodeContext(node=node, model=None, tokenizer=tok)
    batch = Batch(response_ids=ids, response_mask=mask, tests=[r["tests"] for r in rows])
    result = fn.fn(ctx, batch, **args)
    expected = [1.0 if r["demonstration"] == r["solution"] else 0.0 for r in rows]
    assert 0.0 in expected and 1.0 in expected
    assert result.outputs["scores"].tolist() == expected
    executions = 2 * len(rows)
    assert result.metrics["reward/code_pass_ratio"] + result.metrics["reward/code_fail_ratio"] == 1.0
    assert result.metrics["reward/code_pass_ratio"] * executions >= 2 * expected.count(1.0)


def _refusal(path: Path, overrides: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["validate", str(path), *overrides]) == 2
    return capsys.readouterr().err


@pytest.mark.slow  # validate probes the sandbox
def test_eval_reward_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``run.eval.reward: code_reward``: its arguments bind with code_reward's schema, and the held-out rows
    must carry its ``tests`` input; both refused by ``rlflow validate`` naming file and key."""
    monkeypatch.chdir(ROOT)
    err = _refusal(ROOT / SFT, ["run.eval.reward_args.extract=first"], capsys)
    assert "sft.yaml: run.eval.reward_args.extract: unknown value 'first'; choices: fenced, whole" in err, err
    untested = tmp_path / "sft.yaml"  # the held-out rows without their tests
    untested.write_text((ROOT / SFT).read_text().replace(", tests: tests}", "}"))
    err = _refusal(untested, [], capsys)
    assert "sft.yaml: run.eval.reward: code_reward reads 'tests' from the held-out rows" in err, err
    assert main(["validate", str(ROOT / SFT)]) == 0


@pytest.mark.slow  # runs the chain in-process; the sandbox starts bwrap and Python per execution
def test_example_chain_ci_sized(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlflow run examples/code/sft.yaml examples/code/grpo.yaml` for 2 iterations a stage: both evaluate
    the held-out pass rate through the sandbox; GRPO starts from the SFT stage's checkpoint."""
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    small = ["run.iterations=2", "run.eval_interval=2", "run.checkpoint_interval=2", "run.eval.size=16",
             "data.generator.args.train_size=256", "--no-progress"]  # fmt: skip
    assert main(["validate", GRPO]) == 2  # it reads the SFT stage's checkpoint, not there yet
    assert "runs/code-sft/checkpoints/latest/models/actor" in capsys.readouterr().err
    assert main(["run", *CHAIN, *small]) == 0
    out = capsys.readouterr().out
    table = out[out.index("stage ") :].splitlines()
    for line, (graph, samples) in zip(table[1:3], zip(CHAIN, (128, 128), strict=True), strict=True):
        assert re.match(rf"{graph} +2 +{samples} +[\d.]+ -> [\d.]+ \(it 0 -> 2\)", line), table
    assert "val/reward/code_pass_ratio=" in out
