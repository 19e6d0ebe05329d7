"""Which batch rows each data-parallel rank of a node gets, and putting their outputs back in row order.

A node's rows are cut into ``mini_batches`` consecutive mini-batches (one optimizer step each, as
``nodes.train.optimize`` does) and each mini-batch into ``dp`` consecutive equal shares; dp rank ``r`` gets
its share of every mini-batch, in mini-batch order. So the ``k``-th local mini-batch of every rank is a
share of the same global mini-batch, and a train step on ``dp`` ranks sees exactly the rows the single-
process step sees. Equal shares (by rows); token balancing is not done yet.

Example: 8 rows, 2 mini-batches, dp 2 -> rank 0 rows [0, 1, 4, 5], rank 1 rows [2, 3, 6, 7].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dataflow.batch import Batch
from dataflow.errors import PlanError

__all__ = ["gather_rows", "shard_rows", "split_batch"]


def shard_rows(rows: int, dp: int, mini_batches: int = 1) -> list[list[int]]:
    """Row indices of each dp rank (see the module docstring).

    Raises:
        PlanError: ``rows`` does not divide into ``mini_batches × dp`` equal shares.
    """
    if rows % (mini_batches * dp):
        raise PlanError(f"{rows} rows do not divide into {mini_batches} mini-batches × dp={dp} equal shares")
    per_mb = rows // mini_batches
    per_rank = per_mb // dp
    return [
        [mb * per_mb + r * per_rank + i for mb in range(mini_batches) for i in range(per_rank)]
        for r in range(dp)
    ]


def split_batch(batch: Batch, dp: int, mini_batches: int = 1) -> list[Batch]:
    """``batch`` cut into the ``dp`` shares of :func:`shard_rows` (rank order)."""
    if dp == 1:
        return [batch]
    return [batch.index(idx) for idx in shard_rows(len(batch), dp, mini_batches)]


def gather_rows(parts: Sequence[Batch], shares: Sequence[Sequence[int]]) -> Batch:
    """Outputs of the dp ranks back in global row order.

    Args:
        parts: each rank's outputs; rank ``r`` has ``k · len(shares[r])`` rows, ``k`` output rows per input
            row (``k = n`` for a generate node: rows ``i·n .. i·n+n-1`` belong to input row ``i``).
        shares: the input row indices of each rank (:func:`shard_rows`).

    Returns:
        one batch of ``k · sum(len(s))`` rows; widths padded to the widest part (``Batch.concat``).
    """
    if len(parts) == 1:
        return parts[0]
    if not parts[0].keys():
        return Batch()
    inputs = sum(len(s) for s in shares)
    outputs = sum(len(p) for p in parts)
    k = outputs // max(1, inputs)
    position = [j * k + c for share in shares for j in share for c in range(k)]
    inverse = torch.empty(len(position), dtype=torch.long)
    inverse[torch.tensor(position, dtype=torch.long)] = torch.arange(len(position))
    return Batch.concat(list(parts)).index(inverse)
