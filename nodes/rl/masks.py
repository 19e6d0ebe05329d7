"""Mask validation and masked reductions shared by every RL function in ``rlflow.nodes.rl``.

Shapes (DESIGN.md): B rows, R response tokens, V vocabulary.

Batch format (the one format of ``rlflow.nodes.rl``): padded, right-aligned response tensors ``[B, R]`` with a
0/1 ``mask`` ``[B, R]`` (the contract's ``response_mask``). A mask-0 position may sit anywhere, also inside
a response (tool or observation tokens). Values at mask-0 positions, NaN and ±inf included, never reach an
output or a gradient: every public function replaces them with ``masked_fill`` *before* any arithmetic,
because ``torch.where(mask, f(x), 0)`` still back-propagates ``0 * f'(NaN) = NaN``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlflow.dataflow.errors import DataError

__all__ = [
    "AllSum",
    "MaskError",
    "RLInputError",
    "check_mask",
    "check_shapes",
    "first_eos_lengths",
    "lengths_to_mask",
    "mask_spans",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "sanitize",
]


class RLInputError(DataError, ValueError):
    """A tensor or argument given to an RL maths function is invalid (shape, range, option name)."""


class MaskError(RLInputError):
    """A mask holds a value other than 0 or 1 (or True/False), or does not match its tensor's shape."""


def check_mask(mask: torch.Tensor, name: str = "mask") -> torch.Tensor:
    """Validate a 0/1 mask and return it as ``torch.bool`` (same shape).

    Accepts bool, integer or floating tensors. Raises :class:`MaskError` naming ``name`` if any entry
    is not exactly 0 or 1 (NaN included).
    """
    if not isinstance(mask, torch.Tensor):
        raise MaskError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mask
    ok = (mask == 0) | (mask == 1)
    if not bool(ok.all()):
        bad = mask[~ok].flatten()[:3].tolist()
        raise MaskError(f"{name}: mask must hold only 0 and 1, found {bad}")
    return mask != 0


def check_shapes(mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise :class:`RLInputError` unless every given tensor has ``mask.shape`` (``None`` is skipped)."""
    for key, t in tensors.items():
        if t is not None and tuple(t.shape) != tuple(mask.shape):
            raise RLInputError(f"{key}: shape {tuple(t.shape)} does not match mask shape {tuple(mask.shape)}")


def sanitize(x: torch.Tensor, mask: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """Return ``x`` with mask-0 positions replaced by ``value`` (gradient 0 there; NaN/inf never leak).

    ``mask`` is a bool tensor broadcastable to ``x``.
    """
    return x.masked_fill(~mask, value)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over mask-1 positions (``dim=None``: all of them). ``mask`` 0/1, same shape as ``x``."""
    m = check_mask(mask)
    check_shapes(m, x=x)
    xs = sanitize(x, m)
    return xs.sum() if dim is None else xs.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over mask-1 positions; an empty selection gives an explicit 0 (never NaN).

    ``dim=None`` reduces everything to a scalar; otherwise reduces ``dim`` (rows with no mask-1 entry
    give 0). ``mask`` 0/1, same shape as ``x``.
    """
    m = check_mask(mask)
    check_shapes(m, x=x)
    xs = sanitize(x, m)
    if dim is None:
        return xs.sum() / m.sum().clamp(min=1)
    return xs.sum(dim=dim) / m.sum(dim=dim).clamp(min=1)


AllSum = Callable[[torch.Tensor], torch.Tensor]


def masked_moments(
    x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, all_sum: AllSum | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of ``x`` over all mask-1 positions (two scalars), two-pass.

    ``unbiased=True`` uses Bessel's correction ``/(n-1)`` (as ``torch.var`` and TRL/verl's ``masked_var``);
    with fewer than 2 selected values (1 for ``unbiased=False``) the variance is defined as 0; with none
    the mean is 0.

    ``all_sum``: when ``x`` is one share of a batch split over processes (data-parallel ranks), a function
    summing a tensor over the shares (:meth:`rlflow.nodes.context.TrainHooks.all_sum`); the moments are then
    those of the whole batch: ``mean = Σx / n`` and ``var = Σ(x - mean)² / (n - 1)`` with every sum over all
    shares (two reductions, the same two passes as one process). ``None``: ``x`` is the whole batch.
    """
    m = check_mask(mask)
    check_shapes(m, x=x)
    xs = sanitize(x, m)
    total = torch.stack([xs.sum(), m.sum().to(xs.dtype)])
    if all_sum is not None:
        total = all_sum(total)
    n = total[1]
    mean = total[0] / n.clamp(min=1)
    d = sanitize(xs - mean, m)
    squares = (d * d).sum()
    if all_sum is not None:
        squares = all_sum(squares.reshape(1))[0]
    denom = n - 1 if unbiased else n
    return mean, squares / denom.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over all mask-1 positions (scalar); see :func:`masked_moments`."""
    return masked_moments(x, mask, unbiased)[1]


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    all_sum: AllSum | None = None,
) -> torch.Tensor:
    """Whiten ``x`` with statistics over mask-1 positions only: ``(x - mean) / sqrt(var + eps)``.

    ``var`` is the unbiased masked variance (:func:`masked_moments`). ``shift_mean=False`` adds the mean
    back (PPO reward whitening). ``all_sum``: ``x`` is one data-parallel share and the statistics are the
    whole batch's (:func:`masked_moments`). Mask-0 positions of the result are 0. Shapes: ``x``, ``mask``
    any equal shape; returns the same shape.
    """
    m = check_mask(mask)
    check_shapes(m, x=x)
    xs = sanitize(x, m)
    mean, var = masked_moments(xs, m, all_sum=all_sum)
    out = (xs - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return sanitize(out, m)


def lengths_to_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Right-padded 0/1 mask ``[B, width]`` (bool) with ``lengths[b]`` leading ones per row.

    This is how a response mask is built: from lengths, never from token ids (EOS may equal PAD).
    Raises :class:`RLInputError` for a negative length or one above ``width``.
    """
    if lengths.dim() != 1:
        raise RLInputError(f"lengths: expected shape [B], got {tuple(lengths.shape)}")
    if bool((lengths < 0).any()) or bool((lengths > width).any()):
        raise RLInputError(f"lengths: every length must lie in [0, {width}], got {lengths.tolist()}")
    pos = torch.arange(width, device=lengths.device)
    return pos.unsqueeze(0) < lengths.unsqueeze(1)


def first_eos_lengths(response_ids: torch.Tensor, eos_ids: int | list[int] | tuple[int, ...]) -> torch.Tensor:
    """Response lengths ``[B]`` (int64) from generated ids ``[B, R]``: up to and including the first EOS.

    A row with no EOS has length ``R`` (truncated at the length limit). Trailing tokens after the first
    EOS are padding even when PAD == EOS, which is why masks come from these lengths and not from
    ``ids != pad_id``.
    """
    ids = response_ids
    eos = torch.as_tensor([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), device=ids.device)
    is_eos = torch.isin(ids, eos)
    width = ids.shape[1]
    pos = torch.arange(width, device=ids.device).expand_as(ids)
    first = torch.where(is_eos, pos, torch.full_like(pos, width)).min(dim=1).values
    return torch.where(first < width, first + 1, first).to(torch.int64)


def mask_spans(ids: torch.Tensor, mask: torch.Tensor, open_id: int, close_id: int) -> torch.Tensor:
    """``mask`` ``[B, R]`` with every span ``open_id … close_id`` (both ends included) set to 0, as int64.

    For training on demonstration trajectories whose tool observations (``<result> … </result>``) were
    written by the environment, not the policy: they are context, never targets, as in a rollout
    (Jin et al. 2025, Search-R1: retrieved tokens are masked out of the loss). Token t is inside a span when
    more ``open_id`` than ``close_id`` tokens precede it, counting an ``open_id`` at t and not a
    ``close_id`` at t; an unclosed span runs to the end of the row.
    """
    m = check_mask(mask).long()
    opens = (ids == open_id).long().cumsum(1)
    closes = (ids == close_id).long()
    inside = opens > (closes.cumsum(1) - closes)
    return m * (~inside).long()
