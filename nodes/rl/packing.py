"""Packed (varlen) layout of a padded batch, and exact conversion both ways.

Shapes (DESIGN.md): B rows, L padded sequence width (S + R), N packed tokens (real tokens plus trailing
padding), Q segments.

The RL maths of ``rlflow.nodes.rl`` takes the padded format (``[B, R]`` + mask). Packing exists for the
forward pass: the real tokens of every row (its attention-mask-1 positions, which must be contiguous — a
left-padded prompt followed by a right-padded response is) are laid end to end in ``[N]``, described by the
cumulative sequence lengths ``cu_seqlens`` ``[Q+1]`` (int32, as FlashAttention's varlen kernels take).
Guarantees:
- one segment per non-empty row, in row order; empty rows get no segment (no zero-length segment ever);
- padding up to ``pad_to`` forms one extra trailing segment, so no real sequence reads padding and no
  padding reads a real sequence; if ``pad_to`` equals the real total, no padding segment is added;
- ``position_ids`` restart at 0 in each segment, equal to the padded ``cumsum(attention_mask) - 1`` at
  real tokens; ``unpack(pack(x)) == x`` bit for bit at real positions.
Source of the format: Dao 2023, FlashAttention-2 (``flash_attn_varlen_func``); Krell et al. 2021,
"Efficient Sequence Packing without Cross-contamination".

:func:`budget_partition` cuts rows of given token lengths into micro-batches of at most a token budget (the
``max_tokens_per_micro_batch`` of a node), balanced, rows kept whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.nodes.rl.masks import MaskError, RLInputError, check_mask

__all__ = [
    "PackedLayout",
    "budget_partition",
    "cu_seqlens_from_lengths",
    "pack",
    "packed_attention_mask",
    "packed_layout",
    "unpack",
]


def cu_seqlens_from_lengths(lengths: torch.Tensor | list[int], pad_to: int | None = None) -> torch.Tensor:
    """Cumulative sequence lengths ``[Q+1]`` int32 from segment lengths, dropping zero lengths.

    ``pad_to`` (total packed width N): a final padding segment ``[total, pad_to)`` is appended when
    ``pad_to > total``; ``pad_to == total`` adds nothing. Raises :class:`RLInputError` for a negative
    length or ``pad_to < total``. Example: lengths [3, 2] → [0, 3, 5]; with ``pad_to=8`` → [0, 3, 5, 8].
    """
    lens = torch.as_tensor(lengths, dtype=torch.int64)
    if lens.dim() != 1 or bool((lens < 0).any()):
        raise RLInputError(f"lengths must be a 1-D tensor of non-negative ints, got {lens.tolist()}")
    lens = lens[lens > 0]
    total = int(lens.sum())
    if pad_to is not None:
        if pad_to < total:
            raise RLInputError(f"pad_to={pad_to} is below the {total} real tokens")
        if pad_to > total:
            lens = torch.cat([lens, torch.tensor([pad_to - total], dtype=torch.int64)])
    cu = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, dim=0)
    return cu.to(torch.int32)


@dataclass(frozen=True)
class PackedLayout:
    """Where each packed token comes from.

    ``cu_seqlens`` ``[Q+1]`` int32 (padding segment included when ``num_padding > 0``); ``rows`` ``[Q_real]``
    int64 batch row of each real segment; ``flat_index`` ``[N_real]`` int64 index into the flattened
    ``[B*L]`` padded batch; ``position_ids`` ``[N]`` int64; ``batch_shape`` ``(B, L)``; ``max_seqlen``.
    """

    cu_seqlens: torch.Tensor
    rows: torch.Tensor
    flat_index: torch.Tensor
    position_ids: torch.Tensor
    batch_shape: tuple[int, int]
    num_padding: int
    max_seqlen: int

    @property
    def num_real(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.flat_index.numel())

    @property
    def total(self) -> int:
        """Packed width N, padding included."""
        return self.num_real + self.num_padding


def packed_layout(attention_mask: torch.Tensor, pad_to: int | None = None) -> PackedLayout:
    """Layout packing the real tokens of ``attention_mask`` ``[B, L]`` (0/1, contiguous per row).

    Raises :class:`MaskError` if a row's real tokens are not contiguous (packing them would join tokens
    across the gap and shift positions), :class:`RLInputError` if ``pad_to`` is below the real total.
    """
    m = check_mask(attention_mask, "attention_mask")
    if m.dim() != 2:
        raise RLInputError(f"attention_mask: expected [B, L], got {tuple(m.shape)}")
    batch, width = m.shape
    lengths = m.sum(dim=1)
    starts = m.to(torch.int8).argmax(dim=1)
    pos = torch.arange(width, device=m.device).unsqueeze(0)
    contiguous = (pos >= starts.unsqueeze(1)) & (pos < (starts + lengths).unsqueeze(1))
    if not torch.equal(contiguous, m):
        bad = torch.nonzero((contiguous != m).any(dim=1)).flatten().tolist()
        raise MaskError(f"attention_mask: rows {bad} have non-contiguous real tokens; cannot pack them")
    cu = cu_seqlens_from_lengths(lengths.cpu(), pad_to)
    flat_index = torch.nonzero(m.flatten()).flatten()
    rows = torch.nonzero(lengths > 0).flatten()
    real = int(lengths.sum())
    num_padding = 0 if pad_to is None else pad_to - real
    seg_lens = (cu[1:] - cu[:-1]).to(torch.int64)
    seg_starts = torch.repeat_interleave(cu[:-1].to(torch.int64), seg_lens)
    position_ids = torch.arange(real + num_padding, dtype=torch.int64) - seg_starts
    max_seqlen = int(seg_lens.max()) if seg_lens.numel() else 0
    return PackedLayout(
        cu, rows, flat_index, position_ids.to(m.device), (batch, width), num_padding, max_seqlen
    )


def pack(x: torch.Tensor, layout: PackedLayout, pad_value: float = 0.0) -> torch.Tensor:
    """Pack a padded tensor ``[B, L, ...]`` into ``[N, ...]`` following ``layout``; padding = ``pad_value``.

    Values at mask-0 positions of the padded tensor are never read.
    """
    if tuple(x.shape[:2]) != layout.batch_shape:
        raise RLInputError(f"pack: tensor shape {tuple(x.shape)} does not start with {layout.batch_shape}")
    real = x.flatten(0, 1).index_select(0, layout.flat_index)
    if layout.num_padding == 0:
        return real
    pad = torch.full((layout.num_padding, *x.shape[2:]), pad_value, dtype=x.dtype, device=x.device)
    return torch.cat([real, pad], dim=0)


def unpack(x: torch.Tensor, layout: PackedLayout, fill: float = 0.0) -> torch.Tensor:
    """Inverse of :func:`pack`: ``[N, ...]`` → padded ``[B, L, ...]`` with ``fill`` at mask-0 positions."""
    if x.shape[0] != layout.total:
        raise RLInputError(f"unpack: expected {layout.total} packed tokens, got {x.shape[0]}")
    batch, width = layout.batch_shape
    out = torch.full((batch * width, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
    out = out.index_copy(0, layout.flat_index, x[: layout.num_real])
    return out.view(batch, width, *x.shape[1:])


def packed_attention_mask(cu_seqlens: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Block-diagonal boolean attention mask ``[N, N]`` (True = may attend) for a packed batch.

    Token i may attend to token j only inside its own segment (and, if ``causal``, only j ≤ i): the dense
    equivalent of a varlen kernel, for CPU or SDPA.
    """
    cu = cu_seqlens.to(torch.int64)
    seg_lens = cu[1:] - cu[:-1]
    seg = torch.repeat_interleave(torch.arange(seg_lens.numel()), seg_lens)
    allowed = seg.unsqueeze(0) == seg.unsqueeze(1)
    if causal:
        allowed = allowed & torch.ones_like(allowed).tril()
    return allowed


def _first_fit_decreasing(lengths: list[int], order: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        b = next((k for k, load in enumerate(loads) if load + lengths[i] <= budget), len(bins))
        if b == len(bins):
            bins.append([])
            loads.append(0)
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def _worst_fit_decreasing(
    lengths: list[int], order: list[int], budget: int, parts: int
) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in order:
        fits = [k for k in range(parts) if loads[k] + lengths[i] <= budget]
        if not fits:
            return None
        b = min(fits, key=lambda k: (loads[k], len(bins[k]), k))
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins


def budget_partition(lengths: list[int], budget: int, parts: int | None = None) -> list[list[int]]:
    """Rows of token lengths ``lengths`` cut into micro-batches of at most ``budget`` tokens each, rows whole.

    The count: ``parts`` when given (a data-parallel runtime's agreed count: every rank must run as many
    micro-batches), else the fewest bins first-fit decreasing packs the rows into (FFD, Johnson 1973: at
    most 11/9 of the optimum + 6/9 bins). The rows are then spread over that many micro-batches by worst-fit
    decreasing (longest row first, each to the least-loaded micro-batch it fits in): balanced loads under
    the budget as a hard bound. verl's ``rearrange_micro_batches`` (``verl/utils/seqlen_balancing.py``)
    balances ``ceil(total / budget)`` partitions with Karmarkar–Karp instead, which can put a partition over
    the budget; here the budget always holds. Should worst-fit not place every row, FFD's bins are used and
    the bin with the most rows gives its shortest row to a new micro-batch until there are ``parts``.

    Args:
        lengths: tokens of each row (>= 0).
        budget: most tokens per micro-batch (>= 1).
        parts: micro-batches wanted, ``1 <= parts <= len(lengths)`` and at least FFD's count.

    Returns:
        ``parts`` (or FFD's count) non-empty lists of row indices, each ascending, ordered by first row;
        every row in exactly one. ``[]`` for no rows. Example: lengths [5, 3, 4, 2], budget 7 → FFD needs 2
        bins; worst-fit gives [[0, 3], [1, 2]] (7 and 7 tokens).

    Raises:
        RLInputError: a row longer than ``budget`` (names the row and its length), a negative length, or a
            ``parts`` outside the bounds above.
    """
    lens = [int(n) for n in lengths]
    if budget < 1:
        raise RLInputError(f"budget must be >= 1 token, got {budget}")
    if any(n < 0 for n in lens):
        raise RLInputError(f"lengths must be >= 0, got {lens}")
    over = [i for i, n in enumerate(lens) if n > budget]
    if over:
        i = max(over, key=lambda i: lens[i])
        raise RLInputError(
            f"row {i} has {lens[i]} tokens, more than the budget of {budget} tokens per micro-batch"
        )
    if not lens:
        if parts:
            raise RLInputError(f"no rows to cut into {parts} micro-batches")
        return []
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    ffd = _first_fit_decreasing(lens, order, budget)
    count = len(ffd) if parts is None else int(parts)
    if not len(ffd) <= count <= len(lens):
        raise RLInputError(
            f"{count} micro-batches of at most {budget} tokens cannot hold {len(lens)} rows: between "
            f"{len(ffd)} (first-fit decreasing) and {len(lens)} (one row each)"
        )
    bins = _worst_fit_decreasing(lens, order, budget, count)
    if bins is None:
        bins = ffd
        while len(bins) < count:
            donor = max(bins, key=len)
            shortest = min(donor, key=lambda i: (lens[i], -i))
            donor.remove(shortest)
            bins.append([shortest])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
