"""The arithmetic task: generator determinism, disjoint splits, answers, tokenizer round trip."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from rlflow.dataflow.data import DATA_GENERATORS, load_builtin_generators
from rlflow.dataflow.errors import DataError
from rlflow.nodes.rewards import arith_exact
from rlflow.nodes.tasks.arith import arith, count_problems, make_problems

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "arith" / "tokenizer"


def test_registered() -> None:
    load_builtin_generators()
    assert DATA_GENERATORS.get("arith") is arith


def test_deterministic_and_disjoint() -> None:
    args = {"digits": 2, "train_size": 300, "eval_size": 50, "seed": 3, "ops": "+-*"}
    train, held_out = arith("train", **args), arith("eval", **args)
    assert arith("train", **args) == train and len(train) == 300 and len(held_out) == 50
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
    assert len({r["prompt"] for r in train}) == 300  # distinct problems
    assert arith("train", **{**args, "seed": 4}) != train
    assert {r["prompt"][-1] for r in train} == {"="}
    assert {op for r in train for op in "+-*" if op in r["prompt"]} == {"+", "-", "*"}


def test_answers_are_correct() -> None:
    for row in arith("train", digits=3, train_size=200, eval_size=0, ops="+-*"):
        expr = row["prompt"].removesuffix("=")
        assert str(eval(expr)) == row["answer"]  # the expression is digits and one operator
        assert arith_exact(row["answer"], row["answer"]) == 1.0
        assert int(row["answer"]) >= 0  # no negatives by default
        a, b = (int(x) for x in expr.replace("*", "+").replace("-", "+").split("+"))
        assert 0 <= a < 1000 and 0 <= b < 1000


def test_problem_space_limits() -> None:
    # 1 digit: 100 sums and 10*11/2 = 55 non-negative differences
    assert count_problems(1, "+-", allow_negative=False) == 155
    assert count_problems(1, "-", allow_negative=True) == 100
    assert len(set(make_problems(155, digits=1, ops="+-"))) == 155
    with pytest.raises(DataError, match="156 distinct problems requested, only 155"):
        make_problems(156, digits=1, ops="+-")
    with pytest.raises(DataError, match="ops"):
        arith("train", ops="/")
    with pytest.raises(DataError, match="unknown split"):
        arith("test")


def test_tokenizer_loads_offline_and_round_trips() -> None:
    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len(tok) == 19
    for row in arith("eval", digits=3, eval_size=20, train_size=0, ops="+-*"):
        ids = tok(row["prompt"])["input_ids"]
        assert ids[0] == tok.bos_token_id and len(ids) == len(row["prompt"]) + 1  # one token per char
        assert tok.decode(ids, skip_special_tokens=True) == row["prompt"]
    assert tok.unk_token_id not in tok("12 * 3 - 4 = 32")["input_ids"]


def test_make_tokenizer_script_reproduces_committed_files(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tokenizer", TOKENIZER.parent / "make_tokenizer.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["make_tokenizer.py", str(tmp_path / "tok")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "tok" / name).read_text() == (TOKENIZER / name).read_text(), name


def test_the_demonstrator_slips_on_carries_and_borrows_only() -> None:
    from rlflow.nodes.tasks.arith import needs_carry, slip

    # hand-worked: 57+68 forgets both carries (7+8 -> 5, 5+6 -> 1); 52-38 takes 2 from 8 and 3 from 5;
    # 90-9 takes 0 from 9 in both columns
    assert (slip(57, "+", 68), slip(52, "-", 38), slip(90, "-", 9)) == (15, 26, 99)
    assert (slip(12, "+", 34), slip(58, "-", 23)) == (46, 35)  # no carry, no borrow: the right answer
    assert needs_carry(57, "+", 68) and needs_carry(52, "-", 38) and not needs_carry(12, "+", 34)
    assert not needs_carry(7, "*", 8)
    args = {"digits": 2, "train_size": 4000, "eval_size": 500, "seed": 0, "carry_slip": 0.6}
    train, held_out = arith("train", **args), arith("eval", **args)
    assert all(r["demonstration"] == r["answer"] for r in held_out)  # the truth where it is measured
    slipped = [r for r in train if r["demonstration"] != r["answer"]]
    carries = [r for r in train if needs_carry(*_parse(r["prompt"]))]
    assert all(r in carries for r in slipped)
    assert 0.55 < len(slipped) / len(carries) < 0.65  # 0.6 of the carry problems, drawn per problem
    a, op, b = _parse(slipped[0]["prompt"])
    assert slipped[0]["demonstration"] == str(slip(a, op, b))
    # the same problems and answers as without a demonstrator, and the demonstrations don't move with it
    plain = arith("train", **{**args, "carry_slip": 0.0})
    assert [(r["prompt"], r["answer"]) for r in plain] == [(r["prompt"], r["answer"]) for r in train]
    assert all(r["demonstration"] == r["answer"] for r in plain)
    with pytest.raises(DataError, match="carry_slip must be a number in"):
        arith("train", carry_slip=1.5)
    adds_only = arith("train", **args, slip_ops="+")  # slips on carries only: subtraction shown right
    assert {_parse(r["prompt"])[1] for r in adds_only if r["demonstration"] != r["answer"]} == {"+"}
    with pytest.raises(DataError, match="slip_ops must be made of"):
        arith("train", slip_ops="*")


def test_zero_padding_keeps_every_column_in_place() -> None:
    rows = arith("train", digits=2, train_size=300, eval_size=0, ops="+-*", zero_pad=True, carry_slip=1.0)
    for row in rows:
        a, op, b = _parse(row["prompt"])
        assert len(row["prompt"]) == 6 and len(row["answer"]) == (4 if op == "*" else 3)
        assert int(row["answer"]) == eval(f"{a}{op}{b}") and arith_exact(row["answer"], row["answer"]) == 1.0
        assert len(row["demonstration"]) == len(row["answer"])
    assert arith_exact("075", "075") == 1.0 and arith_exact("75", "075") == 1.0


def _parse(prompt: str) -> tuple[int, str, int]:
    expr = prompt.removesuffix("=")
    op = next(c for c in "+-*" if c in expr)
    a, b = expr.split(op)
    return int(a), op, int(b)
