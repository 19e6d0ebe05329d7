"""Worker-to-worker batches without a process group (tiers 1-2): the token-balanced dp split, row references
in a :class:`Batch`, and transfer plans executed by hand (pack on the sender, unpack and assemble on the
receiver), which must give each receiver exactly the rows a single process would hold.
"""

from __future__ import annotations

import random

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import DataError, PlanError
from rlflow.schedulers.runtime.distributed.rows import balance_rows, shard_rows
from rlflow.schedulers.runtime.distributed.transfer import (
    Holding,
    RowRef,
    RowStore,
    _pack,
    _unpack,
    assemble,
    plan_transfers,
)

# -- the token-balanced split ----------------------------------------------------------------------


def _loads(tokens: list[int], shares: list[list[int]]) -> list[int]:
    return [sum(tokens[i] for i in s) for s in shares]


def test_balance_rows_skewed_example_beats_the_even_split() -> None:
    # One mini-batch of 8 rows, dp 2. Tokens: one long row (40) and seven short ones.
    tokens = [40, 5, 6, 4, 5, 6, 5, 7]
    # Even split (rows 0-3 | 4-7): 40+5+6+4 = 55 against 5+6+5+7 = 23, spread 32.
    even = shard_rows(8, 2)
    assert _loads(tokens, even) == [55, 23]
    # LPT by hand: order 40(0), 7(7), 6(2), 6(5), 5(1), 5(4), 5(6), 4(3);
    # 40 -> r0; 7 -> r1 (7); 6 -> r1 (13); 6 -> r1 (19); 5 -> r1 (24); 5 -> r1 (29); 5 -> r1 (34);
    # 4 -> r1 (38). Rank 0 holds only the long row: 40 against 38, spread 2 (at most the largest row).
    out = balance_rows(tokens, 2)
    assert out == [[[0]], [[1, 2, 3, 4, 5, 6, 7]]]
    assert _loads(tokens, [m[0] for m in out]) == [40, 38]
    # A minimum of 2 rows per rank (2 micro-batches): the last row left goes to rank 0.
    # 40 -> r0; 7, 6, 6, 5, 5, 5 -> r1 (34); one row left, rank 0 still short: 4 -> r0 (44).
    out = balance_rows(tokens, 2, min_rows=2)
    assert out == [[[0, 3]], [[1, 2, 4, 5, 6, 7]]]
    assert _loads(tokens, [m[0] for m in out]) == [44, 34]


def test_balance_rows_keeps_groups_and_mini_batches_and_is_deterministic() -> None:
    # 2 mini-batches of 3 groups of 2 rows; group tokens [10+10, 1+1, 1+1] then [1+1, 1+1, 30+30]
    tokens = [10, 10, 1, 1, 1, 1, 1, 1, 1, 1, 30, 30]
    out = balance_rows(tokens, 2, mini_batches=2, group_size=2)
    assert out == [[[0, 1], [10, 11]], [[2, 3, 4, 5], [6, 7, 8, 9]]]
    assert out == balance_rows(list(tokens), 2, mini_batches=2, group_size=2)
    with pytest.raises(PlanError, match="whole groups"):
        balance_rows(tokens, 2, mini_batches=2, group_size=4)
    with pytest.raises(PlanError, match="cannot give each"):
        balance_rows(tokens, 2, mini_batches=2, group_size=2, min_rows=4)


def test_balance_rows_random_cases_cover_every_row_once_within_bounds() -> None:
    rng = random.Random(0)
    for _ in range(300):
        dp, group, minis = rng.randint(1, 4), rng.choice([1, 2, 4]), rng.randint(1, 3)
        min_groups = rng.randint(1, 2)
        groups = dp * min_groups + rng.randint(0, 5)
        tokens = [rng.choice([rng.randint(0, 9), rng.randint(0, 900)]) for _ in range(groups * group * minis)]
        min_rows = rng.randint(1, min_groups * group)
        out = balance_rows(tokens, dp, minis, group, min_rows)
        per_mb = len(tokens) // minis
        assert sorted(i for rank in out for mb in rank for i in mb) == list(range(len(tokens)))
        for mb in range(minis):
            shares = [rank[mb] for rank in out]
            for s in shares:
                assert len(s) >= min_rows and all(mb * per_mb <= i < (mb + 1) * per_mb for i in s)
                for first in s[::group]:  # whole groups of consecutive rows, aligned to the group size
                    k = s.index(first)
                    assert first % group == 0 and s[k : k + group] == list(range(first, first + group))
            largest = max(sum(tokens[g : g + group]) for g in range(mb * per_mb, (mb + 1) * per_mb, group))
            loads = _loads(tokens, shares)
            assert max(loads) - min(loads) <= largest


# -- row references and transfer plans -------------------------------------------------------------


def _holders() -> tuple[dict[int, RowStore], dict[str, RowRef], dict[str, torch.Tensor]]:
    """Three keys held by workers 0-2, and the full tensors one process would hold (``Batch.concat``).

    ``response_ids`` [6, 5]: rows 0-2 on rank 0 (width 3), rows 3-5 on rank 1 (width 5, right padding);
    ``prompt_ids`` [6, 4]: rows 0-2 on rank 1 (width 2, left padding), rows 3-5 on rank 0 (width 4);
    ``scores`` [6]: every row on rank 2 and on rank 0 (replicas).
    """
    resp = [torch.arange(9).view(3, 3) + 1, torch.arange(15).view(3, 5) + 100]
    prompt = [torch.arange(6).view(3, 2) + 50, torch.arange(12).view(3, 4) + 70]
    scores = torch.linspace(-1, 1, 6)
    stores = {r: RowStore() for r in range(4)}
    hr, hp, hs = (0, "response_ids", 7), (0, "prompt_ids", 3), (0, "scores", 9)
    stores[0].put(hr, resp[0])
    stores[1].put(hr, resp[1])
    stores[1].put(hp, prompt[0])
    stores[0].put(hp, prompt[1])
    stores[2].put(hs, scores)
    stores[0].put(hs, scores)
    refs = {
        "response_ids": RowRef(
            "response_ids", hr, torch.int64, [Holding(0, (0, 1, 2), (3, 3)), Holding(1, (3, 4, 5), (3, 5))]
        ),
        "prompt_ids": RowRef(
            "prompt_ids",
            hp,
            torch.int64,
            [Holding(1, (0, 1, 2), (3, 2)), Holding(0, (3, 4, 5), (3, 4))],
            left_pad=True,
        ),
        "scores": RowRef("scores", hs, torch.float32, [Holding(r, tuple(range(6)), (6,)) for r in (2, 0)]),
    }
    full = Batch.concat(
        [Batch({"response_ids": r, "prompt_ids": p}) for r, p in zip(resp, prompt, strict=True)]
    )
    return stores, refs, {**{k: full.tensor(k) for k in full}, "scores": scores}


def _run(parts: dict, need: dict, stores: dict[int, RowStore]) -> dict[int, dict[str, torch.Tensor]]:
    """Execute a plan by hand: each sender packs its message, each receiver unpacks and assembles."""
    out = {}
    for dst in need:
        part = parts[dst]
        received = {
            src: _unpack(_pack(stores[src], dict(parts[src].sends)[dst]), pieces)
            for src, pieces in part.recvs
        }
        out[dst] = assemble(part, received, stores[dst], "cpu")
    return out


def test_transfer_plan_gives_each_receiver_the_single_process_rows() -> None:
    stores, refs, full = _holders()
    # rank 0 (a holder) takes rows [5, 0]; rank 3 (holds nothing) rows [1, 1, 4]
    need = {0: [5, 0], 3: [1, 1, 4]}
    parts = plan_transfers(refs, need)
    got = _run(parts, need, stores)
    for dst, rows in need.items():
        for key, tensor in full.items():
            assert torch.equal(got[dst][key], tensor[rows]), (dst, key)
    # rank 0 copies what it holds (its response row 0, prompt row 5, every score): one message, from rank 1
    assert [src for src, _ in parts[0].recvs] == [1]
    copies = {(c[0], c[3]) for c in parts[0].copies}
    assert copies == {("response_ids", (1,)), ("prompt_ids", (0,)), ("scores", (0, 1))}
    # rank 3 reads its score replica from rank 0 or 2 (3 % 2 -> the second replica, rank 0)
    assert [src for src, _ in parts[3].recvs] == [0, 1]
    # int64 responses 2 x 3 (rank 0) + 1 x 5 (rank 1), prompts 2 x 2 (rank 1) + 1 x 4 (rank 0), 3 float scores
    assert parts[3].received_bytes == 8 * (6 + 5 + 4 + 4) + 3 * 4
    assert 2 not in parts  # the other score replica is not read


def test_row_refs_in_a_batch_select_and_repeat_without_moving_rows() -> None:
    stores, refs, full = _holders()
    batch = Batch({"scores": refs["scores"], "answer": [str(i) for i in range(6)]})
    assert len(batch) == 6 and "remote[6]" in repr(batch)
    sub = batch.index([4, 1]).repeat_interleave(2)  # rows 4, 4, 1, 1
    ref = sub["scores"]
    assert isinstance(ref, RowRef) and ref.rows_map == (4, 4, 1, 1) and ref.nbytes == 4 * 4
    assert sub.list_of("answer") == ["4", "4", "1", "1"]
    got = _run(plan_transfers({"s": ref}, {1: range(4)}), {1: range(4)}, stores)
    assert torch.equal(got[1]["s"], full["scores"][[4, 4, 1, 1]])
    with pytest.raises(DataError, match="other processes"):
        Batch.concat([batch, batch])
    with pytest.raises(DataError, match="not a tensor"):
        batch.tensor("scores")


def test_last_reader_frees_the_rows_on_every_holder() -> None:
    stores, refs, _ = _holders()
    parts = plan_transfers({"r": refs["scores"]}, {3: [0]}, free=[refs["scores"]])
    assert parts[0].frees == parts[2].frees == [refs["scores"].handle]
    stores[2].free(parts[2].frees)
    with pytest.raises(KeyError, match="not held on this worker"):
        stores[2].get(refs["scores"].handle)
