"""Which batch rows each data-parallel rank of a node gets, and where its outputs go in row order.

A node's rows are cut into ``mini_batches`` consecutive mini-batches (one optimizer step each, as
``rlflow.nodes.train.optimize`` does) and each mini-batch is split over the ``dp`` ranks; dp rank ``r`` gets
its share of every mini-batch, in mini-batch order. So the ``k``-th local mini-batch of every rank is a share
of the same global mini-batch, and a train step on ``dp`` ranks sees exactly the rows the single-process
step sees.

* :func:`shard_rows`: equal consecutive shares (generation, whose cost is not known before it runs, and
  the controller's source data). Example: 8 rows, 2 mini-batches, dp 2 -> rank 0 rows [0, 1, 4, 5],
  rank 1 rows [2, 3, 6, 7].
* :func:`balance_rows`: shares balanced by tokens (prompt + response tokens per row), whole sample groups,
  possibly of different sizes (every other node).
"""

from __future__ import annotations

from collections.abc import Sequence

from rlflow.dataflow.errors import PlanError

__all__ = ["balance_rows", "output_rows", "shard_rows"]


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


def balance_rows(
    tokens: Sequence[int], dp: int, mini_batches: int = 1, group_size: int = 1, min_rows: int = 1
) -> list[list[list[int]]]:
    """Rows of each dp rank per mini-batch, balanced by tokens: ``out[rank][mini]`` (ascending indices).

    Each mini-batch (``len(tokens) / mini_batches`` consecutive rows) is cut into groups of ``group_size``
    consecutive rows (the samples of one prompt in GRPO/RLOO, kept on one rank), and its groups are split
    over the ``dp`` ranks so that the ranks' token sums are close, every rank getting at least ``min_rows``
    rows (a train node's micro-batch count: FSDP2 needs as many forward/backward passes on every rank).

    Algorithm: greedy LPT, "longest processing time first" (Graham 1969, "Bounds on multiprocessing timing
    anomalies"): groups in decreasing token order (ties: lower index first), each to the rank with the
    fewest tokens so far (ties: fewer rows, then lower rank); once the groups left are just enough to bring
    every rank to its minimum, they go only to ranks below it. Without that constraint the spread between
    the most and least loaded rank is at most the largest group's tokens. verl balances its dp ranks the
    same way ("seqlen balancing", ``verl/utils/seqlen_balancing.py``, with Karmarkar–Karp); LPT takes the
    per-rank minimum more simply. Deterministic: the same tokens give the same split on every process.

    Args:
        tokens: tokens of each row (any non-negative weights).
        dp: number of ranks.
        mini_batches: consecutive mini-batches; a rank's rows of each stay in that mini-batch.
        group_size: rows per sample group.
        min_rows: fewest rows a rank gets in each mini-batch.

    Raises:
        PlanError: the rows do not divide into mini-batches of whole groups, or a mini-batch has too few
            groups to give every rank ``min_rows`` rows.
    """
    rows = len(tokens)
    per_mb = rows // mini_batches if mini_batches > 0 else 0
    if mini_batches < 1 or rows % mini_batches or per_mb % group_size:
        raise PlanError(
            f"{rows} rows do not divide into {mini_batches} mini-batches of whole groups of {group_size}"
        )
    groups = per_mb // group_size
    min_groups = -(-max(1, min_rows) // group_size)
    if groups < dp * min_groups:
        raise PlanError(
            f"a mini-batch of {groups} groups of {group_size} rows cannot give each of dp={dp} ranks "
            f"{min_groups} groups ({min_rows} rows)"
        )
    out: list[list[list[int]]] = [[] for _ in range(dp)]
    for mb in range(mini_batches):
        first = mb * per_mb
        weight = [
            sum(int(t) for t in tokens[first + g * group_size : first + (g + 1) * group_size])
            for g in range(groups)
        ]
        load = [0] * dp
        count = [0] * dp
        owned: list[list[int]] = [[] for _ in range(dp)]
        for pos, g in enumerate(sorted(range(groups), key=lambda g: (-weight[g], g))):
            deficit = sum(max(0, min_groups - c) for c in count)
            short = [r for r in range(dp) if count[r] < min_groups]
            ranks = short if groups - pos <= deficit else range(dp)
            r = min(ranks, key=lambda r: (load[r], count[r], r))
            load[r] += weight[g]
            count[r] += 1
            owned[r].append(g)
        for r in range(dp):
            out[r].append([first + g * group_size + i for g in sorted(owned[r]) for i in range(group_size)])
    return out


def output_rows(share: Sequence[int], outputs: int) -> list[int]:
    """Global output rows of a rank's ``outputs`` local output rows, given its input rows ``share``.

    A node gives ``k = outputs / len(share)`` output rows per input row (``k = n`` for a generate node:
    its output rows ``i·n .. i·n+n-1`` belong to input row ``i``), so local output row ``j·k + c`` is
    global row ``share[j]·k + c``. Example: share [2, 5], 4 outputs (k = 2) -> [4, 5, 10, 11].
    """
    k = outputs // max(1, len(share))
    return [j * k + c for j in share for c in range(k)]
