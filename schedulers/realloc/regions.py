"""Where a transfer's region sits in this rank's local shards (shared by execution and verification).

A ``Transfer``'s ``slices`` are in full-tensor coordinates. A rank's shard of a parameter is the box
``param_shards(...)[rank][param]``; region ``slices`` of it sits at ``slices - shard_start`` in the local
tensor. The shard start is given (``src_offsets`` / ``dst_offsets``, the slices that ``param_shards``
returns) or inferred from the shard shape: ``realloc.shards`` cuts every dim into equal aligned blocks, so
``start_d = (region_start_d // shard_len_d) * shard_len_d``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod

import torch

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.realloc.planning import Transfer
from rlflow.schedulers.realloc.shards import Slice

__all__ = [
    "DtypeSpec",
    "ReallocError",
    "RegionViews",
    "bytes_view",
    "dtype_of",
    "format_slices",
    "region_numel",
]

DtypeSpec = torch.dtype | Mapping[str, torch.dtype]
"""The element type of every parameter, or parameter name -> its element type."""


class ReallocError(PlanError):
    """A reallocation cannot run as given: missing or mis-shaped shards, wrong dtype, uncovered target."""


def dtype_of(dtype: DtypeSpec, param: str) -> torch.dtype:
    """``param``'s element type in ``dtype``.

    Raises:
        ReallocError: ``dtype`` is a mapping without ``param``.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return dtype[param]
    except KeyError:
        raise ReallocError(f"reallocation: no dtype given for parameter {param!r}") from None


def region_numel(slices: Slice) -> int:
    """Elements of the box ``slices``."""
    return prod(int(s.stop) - int(s.start) for s in slices)


def format_slices(slices: Slice) -> str:
    """``[a:b, c:d]``: a box for error messages."""
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in slices) + "]"


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)


def _shard_start(
    region: Slice, shape: Sequence[int], given: Slice | None, param: str, what: str
) -> tuple[int, ...]:
    """Start (per dim) of the shard that holds ``region``; checks that the region lies inside it."""
    if given is not None:
        start = tuple(int(s.start) for s in given)
        lengths = tuple(int(s.stop) - int(s.start) for s in given)
        if lengths != tuple(shape):
            raise ReallocError(
                f"reallocation: {what} shard of {param!r} has shape {tuple(shape)} but its offsets "
                f"{format_slices(given)} span {lengths}"
            )
    else:
        if len(shape) != len(region):
            raise ReallocError(
                f"reallocation: {what} shard of {param!r} has {len(shape)} dims, the plan's region "
                f"{format_slices(region)} has {len(region)}"
            )
        start = tuple((int(r.start) // n) * n if n else 0 for r, n in zip(region, shape, strict=True))
    for r, s0, n in zip(region, start, shape, strict=True):
        if int(r.start) < s0 or int(r.stop) > s0 + n:
            raise ReallocError(
                f"reallocation: region {format_slices(region)} of {param!r} is not inside this rank's "
                f"{what} shard (shape {tuple(shape)}, start {start})"
            )
    return start


def _local(region: Slice, start: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(int(r.start) - s0, int(r.stop) - s0) for r, s0 in zip(region, start, strict=True))


class RegionViews:
    """This rank's local views of transfer regions in its source and target shards.

    Args:
        src_shards, dst: parameter -> this rank's source / target shard (either may be empty).
        src_offsets, dst_offsets: parameter -> the shard's box (``param_shards``); ``None``: inferred from
            the shard's shape (module docstring).
    """

    def __init__(
        self,
        src_shards: Mapping[str, torch.Tensor],
        dst: Mapping[str, torch.Tensor],
        src_offsets: Mapping[str, Slice] | None,
        dst_offsets: Mapping[str, Slice] | None,
    ) -> None:
        self.src_shards, self.dst = src_shards, dst
        self.src_offsets, self.dst_offsets = src_offsets, dst_offsets
        # views already cut, per transfer (a plan's transfers live as long as the plan, which outlives
        # this object): execution asks for each region more than once
        self._sources: dict[int, tuple[Transfer, torch.Tensor]] = {}
        self._targets: dict[int, tuple[Transfer, torch.Tensor]] = {}

    def source(self, t: Transfer) -> torch.Tensor:
        """The region ``t`` sends, a view of this rank's source shard.

        Raises:
            ReallocError: no source shard of ``t.param``, or the region lies outside it.
        """
        held = self._sources.get(id(t))
        if held is not None and held[0] is t:
            return held[1]
        shard = self.src_shards.get(t.param)
        if shard is None:
            raise ReallocError(f"reallocation: rank {t.src} sends {t.param!r} but has no source shard of it")
        given = self.src_offsets.get(t.param) if self.src_offsets is not None else None
        view = shard[_local(t.slices, _shard_start(t.slices, shard.shape, given, t.param, "source"))]
        self._sources[id(t)] = (t, view)
        return view

    def target(self, t: Transfer) -> torch.Tensor:
        """The region ``t`` writes, a view of this rank's target shard.

        Raises:
            KeyError: no target shard of ``t.param``; ReallocError: the region lies outside it.
        """
        held = self._targets.get(id(t))
        if held is not None and held[0] is t:
            return held[1]
        shard = self.dst[t.param]
        given = self.dst_offsets.get(t.param) if self.dst_offsets is not None else None
        view = shard[_local(t.slices, _shard_start(t.slices, shard.shape, given, t.param, "target"))]
        self._targets[id(t)] = (t, view)
        return view
