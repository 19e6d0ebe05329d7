"""Data: JSONL/Parquet reading, field mapping, tokenization layout, seeded resumable prompt streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlflow.dataflow.data import (
    PromptStream,
    Rows,
    epoch_permutation,
    eval_batches,
    load_rows,
    load_splits,
    make_batch,
)
from rlflow.dataflow.data_spec import DataSpec, GeneratorSpec
from rlflow.dataflow.errors import DataError, RegistryError
from rlflow.nodes.tokenizers import load_tokenizer

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "arith" / "tokenizer"
ROWS = [{"question": f"{i}+{i}=", "answer": str(2 * i), "id": i} for i in range(6)]


def _write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _six_rows() -> Rows:
    return Rows({"prompt": [r["question"] for r in ROWS], "answer": [r["answer"] for r in ROWS]}, "six")


def test_jsonl_and_parquet_with_field_mapping(tmp_path: Path) -> None:
    fields = {"prompt": "question", "answer": "answer"}
    a = load_rows(_write_jsonl(tmp_path / "d.jsonl", ROWS), fields=fields)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    b = load_rows("d.parquet", fields=fields, base_dir=tmp_path)  # relative to base_dir
    assert (
        a.columns
        == b.columns
        == {
            "prompt": ["0+0=", "1+1=", "2+2=", "3+3=", "4+4=", "5+5="],
            "answer": ["0", "2", "4", "6", "8", "10"],
        }
    )
    assert list(load_rows(tmp_path / "d.jsonl").columns) == ["question", "answer", "id"]  # no mapping


def test_data_errors(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    with pytest.raises(
        DataError, match=r"d\.jsonl.*field 'prompt'.*column 'prompt_text'.*question, answer, id"
    ):
        load_rows(path, fields={"prompt": "prompt_text"})
    with pytest.raises(DataError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl' cannot be read"):
        load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "d.csv").write_text("a\n1\n")
    with pytest.raises(DataError, match="unsupported format"):
        load_rows(tmp_path / "d.csv")
    with pytest.raises(RegistryError, match="did you mean 'arith'"):
        load_rows(generator="arth")


def test_tokenization_layout() -> None:
    tok = load_tokenizer(TOKENIZER)  # <pad>=0 <bos>=1 <eos>=2, "0".."9" = 4..13, "+"=14, "="=17
    batch: Any = make_batch(
        {"prompt": ["1+1=", "12+34="], "response": ["2", "46"], "answer": ["2", "46"]},
        tok,
        tokenize=["prompt", "response"],
    )
    assert batch.keys() == ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "answer"]
    # prompts: BOS added, left-padded with <pad>
    assert batch["prompt_ids"].tolist() == [[0, 0, 1, 5, 14, 5, 17], [1, 5, 6, 14, 7, 8, 17]]
    assert batch["prompt_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]
    # responses: no BOS, EOS appended, right-padded
    assert batch["response_ids"].tolist() == [[6, 2, 0], [8, 10, 2]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch["prompt_ids"].dtype == torch.int64
    assert batch["answer"] == ["2", "46"]
    with pytest.raises(DataError, match="row 1 holds 7"):
        make_batch({"prompt": ["1", 7]}, tok, tokenize=["prompt"])
    with pytest.raises(DataError, match="no such data field"):
        make_batch({"prompt": ["1"]}, tok, tokenize=["response"])


def test_resume_golden_six_prompts_batch_two() -> None:
    """The issue's golden case: 6 prompts, batch 2, seeded shuffle."""
    full = PromptStream(_six_rows(), seed=7)
    batches: list[Any] = [full.next_batch(2)["prompt"] for _ in range(3)]
    # every prompt used once in the epoch
    assert sorted(p for b in batches for p in b) == sorted(str(r["question"]) for r in ROWS)
    first = PromptStream(_six_rows(), seed=7)
    assert first.next_batch(2)["prompt"] == batches[0]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
    assert state == {"epoch": 0, "position": 2, "seed": 7, "rows": 6}
    resumed = PromptStream(_six_rows(), seed=7)
    resumed.load_state_dict(state)
    # after resuming past the first batch: the 2nd and 3rd batches of the same epoch order
    assert [resumed.next_batch(2)["prompt"] for _ in range(2)] == batches[1:]
    # the epoch order is seeded: not file order for this seed, and another seed differs
    assert [p for b in batches for p in b] != [r["question"] for r in ROWS]
    assert epoch_permutation(6, 7, 0) != epoch_permutation(6, 8, 0)


def test_epochs_and_partial_tail() -> None:
    stream = PromptStream(_six_rows(), seed=1)
    seen = [stream.next_indices(4), stream.next_indices(4)]
    # 6 rows, batch 4: the 2 left over in epoch 0 are dropped; the 2nd batch opens epoch 1
    assert seen[0] == epoch_permutation(6, 1, 0)[:4]
    assert seen[1] == epoch_permutation(6, 1, 1)[:4]
    assert stream.state_dict()["epoch"] == 1
    ordered = PromptStream(_six_rows(), seed=1, shuffle=False)
    assert [ordered.next_indices(3) for _ in range(3)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]
    with pytest.raises(DataError, match="batch of 7 rows"):
        stream.next_indices(7)
    other = PromptStream(_six_rows(), seed=2)
    with pytest.raises(DataError, match="seed 1"):
        other.load_state_dict(stream.state_dict())


def test_eval_batches_keep_every_row() -> None:
    tok = load_tokenizer(TOKENIZER)
    batches: list[Any] = list(eval_batches(_six_rows(), 4, tokenizer=tok, tokenize=["prompt"]))
    assert [len(b) for b in batches] == [4, 2]
    assert batches[0]["answer"] + batches[1]["answer"] == ["0", "2", "4", "6", "8", "10"]


def test_load_splits_from_spec(tmp_path: Path) -> None:
    gen = DataSpec(
        generator=GeneratorSpec("arith", {"digits": 1, "train_size": 20, "eval_size": 5}),
        fields={"prompt": "prompt", "answer": "answer"},
        tokenize=("prompt",),
        tokenizer="actor",
    )
    train, held_out = load_splits(gen)
    assert len(train) == 20 and held_out is not None and len(held_out) == 5
    assert not set(train.columns["prompt"]) & set(held_out.columns["prompt"])
    _write_jsonl(tmp_path / "t.jsonl", ROWS)
    files = DataSpec(train="t.jsonl", fields={"prompt": "question"})
    train, held_out = load_splits(files, base_dir=tmp_path)
    assert len(train) == 6 and held_out is None


def test_a_row_missing_a_mapped_field_is_reported_at_load(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2="}, {"prompt": "3+3=", "response": "6"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"d\.jsonl.*'response'.*1 row\(s\), first at row 1"):
        load_rows(path, fields={"prompt": "prompt", "response": "response"})
