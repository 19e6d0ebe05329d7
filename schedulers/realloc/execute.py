"""Executing a parameter reallocation plan on a torch.distributed process group.

``rlflow.schedulers.realloc.planning.plan_reallocation`` lists every
``Transfer(src, dsts, param, slices, bytes)`` of moving a model from one (mesh, layout) to another (ReaL's
parameter reallocation, Mei et al. 2024, §4). This module runs such a plan with plain functions over *local*
tensors, so the distributed executor can call it from any worker: no module, DTensor or FSDP knowledge here.

Conventions
  * A device id in the plan is a **global rank** of the default process group.
  * ``slices`` of a transfer are in full-tensor coordinates; where they sit in a rank's local shard:
    :mod:`rlflow.schedulers.realloc.regions`.
  * Shapes: a source shard ``src_shards[p]`` has the shape of its box; a target shard the shape in
    ``dst_template[p]``; sizes in bytes, times in seconds.

Execution (``execute_reallocation``)
  1. Validation before any communication: every transfer this rank sends has its source shard with the
     declared dtype; every target shard is covered exactly (region elements sum to its numel).
  2. Local copies (``dsts == (src,)``) are done first: ``dst[local] = src[local]``.
  3. Remote transfers are grouped by ``(src, dsts)`` and coalesced into *messages*: transfers smaller than
     ``direct_bytes`` are packed (16-byte aligned) into flat uint8 buffers of at most ``bucket_bytes``;
     larger transfers go alone, zero-copy when the region is contiguous in the local tensor. Every rank
     derives the same message list from the plan (a pure function), sorted by ``(src, dsts)``.
  4. Each message is one ``broadcast`` from ``src`` inside the cached group ``{src} ∪ dsts``
     (:class:`~rlflow.schedulers.realloc.groups.GroupCache`), issued asynchronously. Every rank walks the
     messages in the same global order and takes part only in those naming it; it blocks only on a message
     it issued earlier (to reuse one of ``_SLOTS`` staging buffers, or at the end), so the globally first
     unfinished message has been issued by all its members and the schedule cannot deadlock (overlapping or
     disjoint meshes alike). Packing a message overlaps with sending earlier ones, and messages between
     disjoint rank sets run concurrently.

  Broadcast rather than send/recv for a single destination: measured on gloo, 4 processes on 2 cores
  (2026-12), a broadcast inside a cached 2-rank group takes 0.46 ms for 4 KiB (send/recv 3.2 ms),
  0.94 ms for 1 MiB (2.7 ms) and 46 ms for 128 MiB (57 ms), so broadcast wins at every size.

No rank materialises more than its own target shard plus ``_SLOTS`` message buffers (each at most
``bucket_bytes``, or one transfer region, which is part of its own target or source shard).

Verification of the result: :mod:`rlflow.schedulers.realloc.verify`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlflow.schedulers.realloc.groups import GroupCache
from rlflow.schedulers.realloc.planning import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_DIRECT_BYTES,
    ReallocPlan,
    Transfer,
)
from rlflow.schedulers.realloc.regions import (
    DtypeSpec,
    ReallocError,
    RegionViews,
    bytes_view,
    dtype_of,
    region_numel,
)
from rlflow.schedulers.realloc.shards import Slice

__all__ = ["Message", "execute_reallocation", "schedule_messages"]

_ALIGN = 16  # byte alignment of every region inside a packed buffer (any dtype can view it)
_DEFAULT_GROUPS = GroupCache()  # used when execute_reallocation gets no cache


# --------------------------------------------------------------------------------------------------------
# message schedule (pure)


@dataclass(frozen=True)
class Message:
    """One broadcast: ``transfers`` (all from ``src`` to ``dsts``) packed at byte ``offsets`` of a flat
    uint8 buffer of ``nbytes`` bytes; a single transfer may be sent without packing (``direct``)."""

    src: int
    dsts: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def direct(self) -> bool:
        return len(self.transfers) == 1

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted({self.src, *self.dsts}))


def _region_bytes(t: Transfer, dtype: DtypeSpec) -> int:
    return region_numel(t.slices) * dtype_of(dtype, t.param).itemsize


def schedule_messages(
    plan: ReallocPlan,
    dtype: DtypeSpec = torch.float32,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
) -> list[Message]:
    """The broadcasts that execute ``plan``'s remote transfers, in the global order every rank follows.

    Pure and deterministic: the same on every rank. Transfers are grouped by ``(src, dsts)`` (sorted);
    within a group, in plan order, a transfer of at least ``direct_bytes`` bytes (or more than
    ``bucket_bytes``) is a message of its own, and smaller ones are packed into buffers of at most
    ``bucket_bytes`` bytes, each region starting at a 16-byte aligned offset.
    """
    by_pair: dict[tuple[int, tuple[int, ...]], list[Transfer]] = defaultdict(list)
    for t in plan.transfers:
        if not t.is_local:
            by_pair[(t.src, t.dsts)].append(t)
    messages: list[Message] = []
    for (src, dsts), transfers in sorted(by_pair.items()):
        # bins: (transfers, offsets, size); a direct transfer is a bin of its own
        bins: list[tuple[list[Transfer], list[int], int]] = []
        open_bin: tuple[list[Transfer], list[int], int] | None = None
        for t in transfers:
            n = _region_bytes(t, dtype)
            if n >= direct_bytes or n > bucket_bytes:
                if open_bin is not None:
                    bins.append(open_bin)
                    open_bin = None
                bins.append(([t], [0], n))
                continue
            if open_bin is not None:
                start = -(-open_bin[2] // _ALIGN) * _ALIGN
                if start + n <= bucket_bytes:
                    open_bin[0].append(t)
                    open_bin[1].append(start)
                    open_bin = (open_bin[0], open_bin[1], start + n)
                    continue
                bins.append(open_bin)
            open_bin = ([t], [0], n)
        if open_bin is not None:
            bins.append(open_bin)
        messages.extend(Message(src, dsts, tuple(ts), tuple(offs), size) for ts, offs, size in bins)
    return messages


# --------------------------------------------------------------------------------------------------------
# execution


def _check_inputs(
    plan: ReallocPlan,
    rank: int,
    views: RegionViews,
    dst: Mapping[str, torch.Tensor],
    dtype: DtypeSpec,
) -> None:
    """Fail before any communication: sources present with the right dtype, targets covered exactly."""
    covered: dict[str, int] = defaultdict(int)
    for t in plan.transfers:
        want = dtype_of(dtype, t.param)
        if t.src == rank:
            region = views.source(t)
            if region.dtype != want:
                raise ReallocError(
                    f"reallocation: source shard of {t.param!r} on rank {rank} is {region.dtype}, "
                    f"the reallocation moves {want}"
                )
        if rank in t.dsts:
            if t.param not in dst:
                raise ReallocError(
                    f"reallocation: the plan sends {t.param!r} to rank {rank} but its target template "
                    "lacks it"
                )
            if dst[t.param].dtype != want:
                raise ReallocError(
                    f"reallocation: target shard of {t.param!r} on rank {rank} is {dst[t.param].dtype}, "
                    f"the reallocation moves {want}"
                )
            views.target(t)  # region inside the target shard
            covered[t.param] += region_numel(t.slices)
    for name, tensor in dst.items():
        if covered.get(name, 0) != tensor.numel():
            raise ReallocError(
                f"reallocation: the plan writes {covered.get(name, 0)} of the {tensor.numel()} elements of "
                f"{name!r} on rank {rank} (shape {tuple(tensor.shape)}); plan and target layout disagree"
            )


def execute_reallocation(
    plan: ReallocPlan,
    rank: int,
    src_shards: Mapping[str, torch.Tensor],
    dst_template: Mapping[str, Sequence[int] | torch.Size | torch.Tensor],
    *,
    dtype: DtypeSpec = torch.float32,
    groups: GroupCache | None = None,
    src_offsets: Mapping[str, Slice] | None = None,
    dst_offsets: Mapping[str, Slice] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    direct_bytes: int = DEFAULT_DIRECT_BYTES,
) -> dict[str, torch.Tensor]:
    """Run ``plan`` on this rank: send what it holds, receive its target shards.

    Every rank that takes part in the plan calls this with the same ``plan``, ``dtype``, ``bucket_bytes``
    and ``direct_bytes``, and, because process groups are created collectively (see ``GroupCache``), so
    does every rank of the default group, including ranks in neither mesh (they pass empty mappings and
    get ``{}``). A plan with only local copies needs no process group.

    Args:
        plan: from ``plan_reallocation`` (device ids are global ranks).
        rank: this process's global rank.
        src_shards: parameter -> this rank's source shard (shape of its box in ``param_shards`` for the
            source (mesh, layout)); empty if the rank is not in the source mesh. Read only.
        dst_template: parameter -> this rank's target shard shape, or a preallocated tensor of that shape
            to write into (e.g. a module's parameter data; it must not alias a source shard region that
            is still to be sent). Empty if the rank is not in the target mesh.
        dtype: element type of every parameter (or parameter -> dtype); must match on all ranks.
        groups: process-group cache (None: one process-wide cache; all ranks must then use it).
        src_offsets, dst_offsets: parameter -> this rank's shard box (as from ``param_shards``); inferred
            from shard shapes when None (aligned equal blocks, see the module docstring).
        bucket_bytes: most bytes packed into one broadcast buffer.
        direct_bytes: transfers of at least this many bytes are broadcast alone (zero-copy if contiguous).

    Returns:
        parameter -> this rank's target shard (the given tensors where ``dst_template`` held tensors).

    Raises:
        ReallocError: a missing source shard, a dtype or shape mismatch, or a target shard the plan does
            not cover exactly — all raised before any communication.
    """
    dst: dict[str, torch.Tensor] = {}
    for name, spec in dst_template.items():
        if isinstance(spec, torch.Tensor):
            dst[name] = spec
        else:
            dst[name] = torch.empty(tuple(int(n) for n in spec), dtype=dtype_of(dtype, name))
    views = RegionViews(src_shards, dst, src_offsets, dst_offsets)
    _check_inputs(plan, rank, views, dst, dtype)

    with torch.no_grad():
        for t in plan.transfers:
            if t.is_local and t.src == rank:
                views.target(t).copy_(views.source(t))

        messages = schedule_messages(plan, dtype, bucket_bytes, direct_bytes)
        if messages:
            if not dist.is_initialized():
                raise ReallocError(
                    "reallocation: the plan has remote transfers but no process group is set up"
                )
            cache = groups if groups is not None else _DEFAULT_GROUPS
            cache.prepare(plan)  # collective over the world
            flight = _InFlight()
            for m in messages:
                if rank in m.ranks:
                    flight.start(m, rank, views, cache.get(m.ranks))
            flight.finish()
    return dst


_SLOTS = 4  # staging buffers in flight at once (each at most max(bucket_bytes, largest staged region))
_SCRATCH: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(_SLOTS)]


def _scratch(slot: int, nbytes: int) -> torch.Tensor:
    """Staging buffer ``slot``: a flat uint8 buffer of ``nbytes`` bytes reused across messages (grown on
    demand, never shrunk).

    Reuse matters: a fresh 64 MiB buffer per message costs its page faults every time (measured ≈2× slower
    packed broadcasts on 2 cores).
    """
    if _SCRATCH[slot].numel() < nbytes:
        _SCRATCH[slot] = torch.empty(nbytes, dtype=torch.uint8)
    return _SCRATCH[slot][:nbytes]


def _typed(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return buf.view(like.dtype).view(like.shape)


class _InFlight:
    """Broadcasts issued with ``async_op=True``, in the global message order.

    Zero-copy messages just wait at the end; a staged message holds one of ``_SLOTS`` staging buffers
    until it is waited and unpacked, which happens before the slot is reused. Packing the next message
    therefore overlaps with sending the previous ones. No deadlock: a rank only ever blocks on a message
    it issued earlier, and the globally first unfinished message has been issued by all its members
    (every rank issues in the same order and blocks only on earlier messages).
    """

    def __init__(self) -> None:
        self.direct: list[Any] = []
        self.slots: list[tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]] | None] = [None] * _SLOTS
        self.next_slot = 0

    def _drain(self, slot: int) -> None:
        held = self.slots[slot]
        if held is not None:
            work, unpack = held
            work.wait()
            for region, staged in unpack:
                region.copy_(_typed(staged, region))
            self.slots[slot] = None

    def start(self, m: Message, rank: int, views: RegionViews, group: Any) -> None:
        if m.direct:
            (t,) = m.transfers
            region = views.source(t) if rank == m.src else views.target(t)
            if region.is_contiguous():  # zero-copy: broadcast straight from / into the shard
                self.direct.append(dist.broadcast(bytes_view(region), src=m.src, group=group, async_op=True))
                return
        slot = self.next_slot
        self.next_slot = (slot + 1) % _SLOTS
        self._drain(slot)
        buf = _scratch(slot, m.nbytes)
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t, off in zip(m.transfers, m.offsets, strict=True):
            region = views.source(t) if rank == m.src else views.target(t)
            staged = buf[off : off + region.numel() * region.element_size()]
            if rank == m.src:
                _typed(staged, region).copy_(region)
            else:
                parts.append((region, staged))
        self.slots[slot] = (dist.broadcast(buf, src=m.src, group=group, async_op=True), parts)

    def finish(self) -> None:
        for work in self.direct:
            work.wait()
        for slot in range(_SLOTS):
            self._drain(slot)
