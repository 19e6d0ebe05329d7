"""Proving a reallocation: region digests compared across ranks, and the checksum the runtime logs.

``verify_reallocation`` compares, for every transfer, a digest of the region on the target with a digest
of the same region on the source (exchanged with one ``all_gather_object``) and raises ``ChecksumError`` on
any mismatch; it returns ``weights_checksum`` of this rank's target shards, which the runtime logs after
each reallocation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from rlflow.schedulers.realloc.planning import ReallocPlan
from rlflow.schedulers.realloc.regions import ReallocError, RegionViews, bytes_view, format_slices
from rlflow.schedulers.realloc.shards import Slice

__all__ = ["ChecksumError", "verify_reallocation", "weights_checksum"]


class ChecksumError(ReallocError):
    """After a reallocation a target region differs from the source region it was copied from."""


def _digest(t: torch.Tensor) -> str:
    data = bytes_view(t.detach().contiguous()).numpy()
    return hashlib.blake2b(data.data, digest_size=16).hexdigest()


def weights_checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    """A 128-bit BLAKE2b hex digest over every tensor's name, dtype, shape and bytes, in sorted name order.

    Bit-exact: equal iff every shard holds the same bytes (with overwhelming probability). Not layout
    independent: it digests the shards this rank holds, as the runtime logs them per rank.
    """
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(bytes_view(t).numpy().data)
    return h.hexdigest()


def verify_reallocation(
    plan: ReallocPlan,
    rank: int,
    src_shards: Mapping[str, torch.Tensor],
    dst_shards: Mapping[str, torch.Tensor],
    *,
    src_offsets: Mapping[str, Slice] | None = None,
    dst_offsets: Mapping[str, Slice] | None = None,
    group: Any = None,
) -> str:
    """Check that every target region equals the source region it came from; return this rank's checksum.

    Each rank digests (BLAKE2b-128) the regions it sent (from its source shards, which must be unchanged
    since the reallocation) and the regions it received; one ``all_gather_object`` over ``group`` (default:
    the world; it must contain every rank of the plan and all its ranks must call this) shares them, and
    every rank compares all of them, so all ranks raise or return together.

    Returns:
        ``weights_checksum(dst_shards)`` (hex string) — what the runtime logs after a reallocation.

    Raises:
        ChecksumError: naming the parameter, region and ranks of every mismatching transfer (first 5).
    """
    views = RegionViews(src_shards, dst_shards, src_offsets, dst_offsets)
    mine: dict[str, str] = {}
    for i, t in enumerate(plan.transfers):
        if t.src == rank:
            mine[f"{i}:src"] = _digest(views.source(t))
        if rank in t.dsts:
            if t.param not in dst_shards:
                raise ReallocError(f"reallocation: rank {rank} has no target shard of {t.param!r}")
            mine[f"{i}:{rank}"] = _digest(views.target(t))
    if dist.is_initialized():
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, mine, group=group)
        digests: dict[str, str] = {k: v for part in gathered for k, v in part.items()}
    else:  # no process group: only this rank's local copies can be checked, and nothing else may touch it
        if any(not t.is_local and rank in (t.src, *t.dsts) for t in plan.transfers):
            raise ReallocError("reallocation: the plan has remote transfers but no process group is set up")
        digests = mine
    bad = []
    for i, t in enumerate(plan.transfers):
        if not dist.is_initialized() and t.src != rank:
            continue
        want = digests.get(f"{i}:src")
        if want is None:
            raise ReallocError(f"reallocation: no source digest from rank {t.src} for {t.param!r}")
        for d in t.dsts:
            got = digests.get(f"{i}:{d}")
            if got is None:
                raise ReallocError(f"reallocation: no target digest from rank {d} for {t.param!r}")
            if got != want:
                bad.append(f"{t.param}{format_slices(t.slices)} rank {t.src} -> rank {d}")
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ChecksumError(
            f"reallocation checksum mismatch in {len(bad)} region(s): " + "; ".join(bad[:5]) + more
        )
    return weights_checksum(dst_shards)
