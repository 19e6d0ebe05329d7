"""Batch: row-aligned mapping of tensors and lists (dataflow/batch.py)."""

from __future__ import annotations

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import DataError


def make() -> Batch:
    return Batch(
        prompt_ids=torch.tensor([[0, 5], [6, 7], [0, 8]]),
        scores=torch.tensor([1.0, 2.0, 3.0]),
        answer=["a", "b", "c"],
    )


def test_len_keys_and_rows() -> None:
    b = make()
    assert len(b) == 3
    assert b.keys() == ["prompt_ids", "scores", "answer"]
    assert len(Batch()) == 0


def test_rows_must_agree() -> None:
    b = make()
    with pytest.raises(DataError, match="'x' has 2 rows but 'prompt_ids' has 3"):
        b["x"] = torch.zeros(2)
    with pytest.raises(DataError, match="0-dim"):
        b["y"] = torch.tensor(1.0)
    with pytest.raises(DataError, match=r"expected a torch\.Tensor or a list"):
        b["z"] = (1, 2, 3)  # type: ignore[assignment]
    b["scores"] = torch.zeros(3)  # replacing with the same rows is fine
    single = Batch(a=[1, 2])
    single["a"] = [1, 2, 3]  # the only key may change the row count
    assert len(single) == 3


def test_missing_key_suggests() -> None:
    with pytest.raises(DataError, match="did you mean 'scores'"):
        make()["score"]


def test_select_and_index() -> None:
    b = make()
    s = b.select(["answer", "scores"])
    assert s.keys() == ["answer", "scores"]
    assert s["scores"] is b["scores"]  # shared, not copied
    picked = b.index([2, 0])
    assert picked["answer"] == ["c", "a"]
    assert torch.equal(picked["prompt_ids"], torch.tensor([[0, 8], [0, 5]]))
    masked = b.index(torch.tensor([False, True, True]))
    assert masked["answer"] == ["b", "c"]
    assert torch.equal(b.index(torch.tensor([1]))["scores"], torch.tensor([2.0]))
    with pytest.raises(DataError, match="out of range"):
        b.index([3])


def test_split() -> None:
    b = Batch(x=torch.arange(6), s=list("abcdef"))
    parts = b.split(3)
    assert [p["s"] for p in parts] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert torch.equal(parts[1]["x"], torch.tensor([2, 3]))
    with pytest.raises(DataError, match="cannot split a batch of 6 rows into 4"):
        b.split(4)
    with pytest.raises(DataError):
        b.split(0)


def test_concat_pads_prompts_left_and_responses_right() -> None:
    a = Batch(prompt_ids=torch.tensor([[5, 6]]), response_ids=torch.tensor([[7]]), tag=["a"])
    b = Batch(prompt_ids=torch.tensor([[1, 2, 3]]), response_ids=torch.tensor([[8, 9, 4]]), tag=["b"])
    c = Batch.concat([a, b])
    # prompt [5, 6] is left-padded to width 3 -> [0, 5, 6]; response [7] right-padded -> [7, 0, 0].
    assert torch.equal(c["prompt_ids"], torch.tensor([[0, 5, 6], [1, 2, 3]]))
    assert torch.equal(c["response_ids"], torch.tensor([[7, 0, 0], [8, 9, 4]]))
    assert c["tag"] == ["a", "b"]
    with pytest.raises(DataError, match="same keys"):
        Batch.concat([a, Batch(prompt_ids=torch.zeros(1, 2))])
    with pytest.raises(DataError, match="empty list"):
        Batch.concat([])
    with pytest.raises(DataError, match="mixes tensors and lists"):
        Batch.concat([Batch(x=[1]), Batch(x=torch.zeros(1))])


def test_concat_then_split_round_trips() -> None:
    b = make()
    again = Batch.concat(b.split(3))
    for key in b:
        v, w = b[key], again[key]
        assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w


def test_repeat_interleave_expands_prompts_to_samples() -> None:
    b = Batch(prompt_ids=torch.tensor([[1], [2]]), answer=["x", "y"])
    r = b.repeat_interleave(3)
    assert torch.equal(r["prompt_ids"].flatten(), torch.tensor([1, 1, 1, 2, 2, 2]))
    assert r["answer"] == ["x", "x", "x", "y", "y", "y"]
    with pytest.raises(DataError):
        b.repeat_interleave(0)


def test_update_and_pop() -> None:
    b = make()
    b.update({"values": torch.zeros(3, 2)})
    b.update(Batch(extra=[1, 2, 3]))
    assert "values" in b and b["extra"] == [1, 2, 3]
    with pytest.raises(DataError, match="rows"):
        b.update({"bad": torch.zeros(4)})
    assert b.pop("extra") == [1, 2, 3] and "extra" not in b
    del b["values"]
    assert "values" not in b
    assert "rows=3" in repr(b)
