"""Batch-wide statistics over data-parallel shares (tier 1): whitening and batch std with ``all_sum``.

Two "ranks" are two threads whose ``all_sum`` meets at a barrier (a data-parallel all-reduce without a
process group); each holds one share of the batch. Their results must equal one process's on the whole
batch, and a hand-computed golden case.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlflow.nodes import rl
from rlflow.nodes.context import TrainHooks


class _ThreadSum:
    """``all_sum`` for ``n`` threads: each contributes its tensor, all get the sum (rank order)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.parts: dict[int, torch.Tensor] = {}

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_sum(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum((self.parts[r] for r in sorted(self.parts)), torch.zeros_like(t))
            self.barrier.wait()  # everyone has read before the next call overwrites
            return total

        return all_sum


def _on_shares(fn: Callable[..., torch.Tensor], shares: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    """``fn(*share, all_sum=...)`` on every share at once, one thread per share."""
    reducer = _ThreadSum(len(shares))
    with ThreadPoolExecutor(len(shares)) as pool:
        futures = [pool.submit(fn, *share, all_sum=reducer.for_rank(r)) for r, share in enumerate(shares)]
        return [f.result(timeout=30) for f in futures]


def test_whitening_over_two_shares_is_the_whole_batchs_golden() -> None:
    # Share 0: [1, 2, (9)], share 1: [3, 4, (7)]; the third column is masked out.
    # Whole batch: mean (1+2+3+4)/4 = 2.5; unbiased var (2.25+0.25+0.25+2.25)/3 = 5/3.
    x = [torch.tensor([[1.0, 2.0, 9.0]]), torch.tensor([[3.0, 4.0, 7.0]])]
    mask = torch.tensor([[1, 1, 0]])
    got = _on_shares(rl.masked_whiten, [(x[0], mask), (x[1], mask)])
    scale = 1.0 / math.sqrt(5.0 / 3.0 + 1e-8)
    assert torch.allclose(got[0], torch.tensor([[-1.5 * scale, -0.5 * scale, 0.0]]), atol=1e-6)
    assert torch.allclose(got[1], torch.tensor([[0.5 * scale, 1.5 * scale, 0.0]]), atol=1e-6)
    # per share (no all_sum) each share would be whitened around its own mean: wrong for the batch
    assert not torch.allclose(rl.masked_whiten(x[0], mask), got[0], atol=1e-3)
    # the single-process hook is the identity: the whole batch in one process gives the same numbers
    whole = rl.masked_whiten(torch.cat(x), torch.cat([mask, mask]), all_sum=TrainHooks().all_sum)
    assert torch.allclose(torch.cat(got), whole, atol=1e-6)


def test_shared_statistics_match_one_process_on_random_batches() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 7, generator=g) * 3 + 1
    mask = (torch.rand(10, 7, generator=g) < 0.7).long()
    mask[4] = 0  # a row with no trainable token
    scores = torch.randn(10, generator=g)
    cut = [(slice(0, 3)), slice(3, 10)]  # unequal shares, as the token-balanced split gives

    def shares(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        return [tuple(t[c] for t in tensors) for c in cut]

    got = torch.cat(_on_shares(rl.masked_whiten, shares(x, mask)))
    assert torch.allclose(got, rl.masked_whiten(x, mask), atol=1e-6)

    def rpp(r: torch.Tensor, m: torch.Tensor, all_sum: Any) -> torch.Tensor:
        return rl.reinforce_pp_advantages(r, m, 0.9, all_sum=all_sum)

    rewards = rl.token_rewards(scores, mask)
    got = torch.cat(_on_shares(rpp, shares(rewards, mask)))
    assert torch.allclose(got, rl.reinforce_pp_advantages(rewards, mask, 0.9), atol=1e-6)

    def grpo(s: torch.Tensor, m: torch.Tensor, all_sum: Any) -> torch.Tensor:
        return rl.grpo_advantages(s, m, 2, std="batch", all_sum=all_sum)

    cut = [slice(0, 2), slice(2, 10)]  # whole groups of 2
    got = torch.cat(_on_shares(grpo, shares(scores, mask)))
    assert torch.allclose(got, rl.grpo_advantages(scores, mask, 2, std="batch"), atol=1e-6)
