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
  2. Local copies (``dsts == (src,)``): ``dst[local] = src[local]``, done while the messages of 4. are in
     flight.
  3. Remote transfers are grouped by ``(src, dsts)`` and coalesced into *messages*: transfers smaller than
     ``direct_bytes`` are packed (16-byte aligned) into flat uint8 buffers of at most ``bucket_bytes``;
     larger transfers go alone, zero-copy when the region is contiguous in the local tensor. Every rank
     derives the same message list from the plan (a pure function), sorted by ``(src, dsts)``.
  4. On CPU tensors (gloo) each message travels as a chain of point-to-point sends inside the cached group
     ``{src} ∪ dsts`` (:class:`~rlflow.schedulers.realloc.groups.GroupCache`): ``src -> dsts[0] ->
     dsts[1] -> ...``, each rank forwarding the message as soon as it has it, so the sender sends each
     byte once (as in a broadcast) and a chain is pipelined message by message; one destination is a
     single send / receive. On other devices (NCCL) each message is one ``broadcast`` from ``src``. All
     are issued asynchronously, tagged with the message's index, before any wait: every rank issues the
     messages naming it in one global order (``issue_order``: round-robin over the ``(src, dsts)`` pairs,
     so both directions of an exchange and different senders proceed at once), does its local copies
     (2.) while they are in flight (forwarding what has arrived between copies), then waits. A message
     staged through a buffer (packed, or a region not contiguous in its shard) takes its bytes from a
     ring over one staging arena of ``staging_bytes`` (grown to the largest staged message); a rank
     blocks before the end only when the ring needs bytes an earlier message of its own still holds, and
     then on that message. The globally first unfinished message has therefore been issued (every receive
     posted) by all its members, and the schedule cannot deadlock (overlapping or disjoint meshes alike).

  Why not one gloo broadcast per message: a group's broadcasts run through its work queue two at a time
  in issue order (so the two directions of pp -> tp ran one after the other), and gloo's binomial-tree
  broadcast cost more CPU per message. Measured with ``bench/bench_realloc.py`` (4 gloo processes on 2
  shared cores, 2026-12-05, CPU seconds summed over the ranks per reallocation, raw broadcast of the same
  bytes alongside): one -> all 0.38 with broadcasts, 0.26 with chains (raw 0.19-0.21); train -> generate
  0.45 -> 0.34 (raw 0.19-0.21); one -> one 0.11 -> 0.085 (raw 0.066).

No rank materialises more than its own target shard plus the staging arena (``staging_bytes``, or the
largest staged message: at most ``bucket_bytes`` or one transfer region).

Verification of the result: :mod:`rlflow.schedulers.realloc.verify`.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
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

__all__ = ["DEFAULT_STAGING_BYTES", "Message", "execute_reallocation", "issue_order", "schedule_messages"]

DEFAULT_STAGING_BYTES = 256 << 20  # staging arena per process (grown to the largest staged message)
_ALIGN = 16  # byte alignment of every region inside a packed buffer (any dtype can view it)
_DEFAULT_GROUPS = GroupCache()  # used when execute_reallocation gets no cache


# --------------------------------------------------------------------------------------------------------
# message schedule (pure)


@dataclass(frozen=True)
class Message:
    """One message: ``transfers`` (all from ``src`` to ``dsts``) packed at byte ``offsets`` of a flat
    uint8 buffer of ``nbytes`` bytes; a single transfer may be sent without packing (``direct``)."""

    src: int
    dsts: tuple[int, ...]
    transfers: tuple[Transfer, ...]
    offsets: tuple[int, ...]
    nbytes: int

    @property
    def direct(self) -> bool:
        return len(self.transfers) == 1

    @cached_property
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
    staging_bytes: int = DEFAULT_STAGING_BYTES,
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
        bucket_bytes: most bytes packed into one message buffer.
        direct_bytes: transfers of at least this many bytes are sent alone (zero-copy if contiguous).
        staging_bytes: size of the staging ring (bytes); staged messages beyond it wait for older ones.

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
        messages, order, group_keys = _schedule(plan, dtype, bucket_bytes, direct_bytes)
        flight = None
        if messages:
            if not dist.is_initialized():
                raise ReallocError(
                    "reallocation: the plan has remote transfers but no process group is set up"
                )
            cache = groups if groups is not None else _DEFAULT_GROUPS
            for key in group_keys:  # GroupCache.prepare's groups and order: collective over the world
                cache.get(key)
            mine = [(tag, messages[tag]) for tag in order if rank in messages[tag].ranks]
            staged = [-(-m.nbytes // _ALIGN) * _ALIGN for _, m in mine if _staged_here(m, rank, views)]
            flight = _InFlight(max(min(sum(staged), staging_bytes), max(staged, default=0)))
            for tag, m in mine:
                flight.start(m, rank, views, cache.get(m.ranks), tag)
        for t in plan.transfers:  # local copies overlap the messages in flight
            if t.is_local and t.src == rank:
                views.target(t).copy_(views.source(t))
                if flight is not None:
                    flight.progress()  # forward what has arrived
        if flight is not None:
            flight.finish()
    return dst


_SCHEDULES: dict[tuple[Any, ...], tuple[ReallocPlan, list[Message], list[int], list[tuple[int, ...]]]] = {}
_SCHEDULES_KEPT = 16  # plans whose schedule is remembered (a run reuses the plan of each weight sync)


def _schedule(
    plan: ReallocPlan, dtype: DtypeSpec, bucket_bytes: int, direct_bytes: int
) -> tuple[list[Message], list[int], list[tuple[int, ...]]]:
    """``schedule_messages``, ``issue_order`` and ``GroupCache.groups_for`` of ``plan``, remembered for
    the last ``_SCHEDULES_KEPT`` plans (the same plan object and arguments give the same values)."""
    dkey = dtype if isinstance(dtype, torch.dtype) else tuple(sorted(dtype.items()))
    key = (id(plan), dkey, bucket_bytes, direct_bytes)
    held = _SCHEDULES.get(key)
    if held is not None and held[0] is plan:
        return held[1], held[2], held[3]
    messages = schedule_messages(plan, dtype, bucket_bytes, direct_bytes)
    order = issue_order(messages)
    group_keys = GroupCache.groups_for(plan)
    if len(_SCHEDULES) >= _SCHEDULES_KEPT:
        del _SCHEDULES[next(iter(_SCHEDULES))]
    _SCHEDULES[key] = (plan, messages, order, group_keys)
    return messages, order, group_keys


def _staged_here(m: Message, rank: int, views: RegionViews) -> bool:
    """Whether this rank copies ``m`` through a staging buffer (packed, or a region not contiguous in its
    shard); a contiguous single region is broadcast straight from / into the shard."""
    if not m.direct:
        return True
    (t,) = m.transfers
    return not (views.source(t) if rank == m.src else views.target(t)).is_contiguous()


_ARENA: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)]


def _arena(nbytes: int) -> torch.Tensor:
    """The process's staging arena: a flat uint8 buffer of at least ``nbytes`` bytes, reused across
    reallocations (grown on demand, never shrunk).

    Reuse matters: fresh staging buffers cost their page faults every time (measured ≈2× slower packed
    broadcasts on 2 cores).
    """
    if _ARENA[0].numel() < nbytes:
        _ARENA[0] = torch.empty(nbytes, dtype=torch.uint8)
    return _ARENA[0]


def issue_order(messages: Sequence[Message]) -> list[int]:
    """Indices of ``messages`` in the order every rank issues them: round-robin over the ``(src, dsts)``
    pairs (the k-th message of every pair before the (k+1)-th of any), so that the two directions of an
    exchange and different senders proceed at once. Pure; the same on every rank."""
    seen: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
    keys = []
    for i, m in enumerate(messages):
        k = seen[(m.src, m.dsts)]
        seen[(m.src, m.dsts)] += 1
        keys.append((k, m.src, m.dsts, i))
    return [key[-1] for key in sorted(keys)]


def _typed(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return buf.view(like.dtype).view(like.shape)


class _Pending:
    """One message on this rank: its buffer, the work to wait for, and what follows the wait."""

    __slots__ = ("buf", "forward", "group", "span", "tag", "unpack", "work")

    def __init__(self, buf: torch.Tensor, work: Any, group: Any, tag: int) -> None:
        self.buf, self.work, self.group, self.tag = buf, work, group, tag
        self.forward: int | None = None  # the next rank of a chain, sent to once this rank has the bytes
        self.span: tuple[int, int] | None = None  # bytes of the staging ring it holds
        self.unpack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target region, staged bytes)


class _InFlight:
    """This rank's messages, all issued asynchronously in the global order before any wait.

    Wire (CPU tensors, gloo): a message is a chain of point-to-point sends ``src -> dsts[0] -> dsts[1] ...``
    (one destination: a single send / receive); every receive is posted at issue time, and a rank in the
    middle of a chain forwards a message as soon as it has it (checked between local copies and while
    waiting), so a chain is pipelined message by message and the sender sends each byte once, as in a
    broadcast. Other devices (NCCL): one ``broadcast`` per message.

    A zero-copy message (a contiguous region of a shard) needs no buffer. A staged message takes the next
    ``nbytes`` of a ring over the staging arena (16-byte aligned); the sender packs into it before
    issuing, a receiver unpacks after its receive. A staged message whose bytes the ring needs again is
    completed first (received, forwarded, unpacked, its sends done), oldest first.

    No deadlock: a rank only ever blocks on a message it issued earlier (its receive or its sends), and
    the globally first unfinished message has been issued (every receive posted) by all its members,
    which forward it when their own wait reaches it.
    """

    def __init__(self, size: int) -> None:
        self.ring = _arena(size)[:size]
        self.size = size
        self.pos = 0
        self.pending: deque[_Pending] = deque()  # not yet received (or sent, on a broadcast), issue order
        self.sends: list[tuple[_Pending, Any]] = []  # sends in flight (a chain's first send or a forward)

    def _complete(self, p: _Pending) -> None:
        """Wait for ``p``'s receive; forward and unpack it."""
        if p.work is not None:
            p.work.wait()
            p.work = None
        if p.forward is not None:
            self.sends.append((p, dist.isend(p.buf, p.forward, group=p.group, tag=p.tag)))
            p.forward = None
        for region, staged in p.unpack:
            region.copy_(_typed(staged, region))
        p.unpack = []

    def progress(self) -> None:
        """Complete the oldest messages whose receive has arrived (forwarding them), without blocking."""
        while self.pending and (self.pending[0].work is None or self.pending[0].work.is_completed()):
            self._complete(self.pending.popleft())

    def _free(self, start: int, end: int) -> None:
        """Complete every message holding ring bytes in ``[start, end)`` and wait for its sends."""
        busy = [p for p in self.pending if p.span is not None and p.span[0] < end and start < p.span[1]]
        busy += [p for p, _ in self.sends if p.span is not None and p.span[0] < end and start < p.span[1]]
        if not busy:
            return
        while busy and any(p in self.pending for p in busy):
            self._complete(self.pending.popleft())
        for p, work in self.sends:
            if p in busy:
                work.wait()
        self.sends = [(p, w) for p, w in self.sends if p not in busy]

    def _take(self, nbytes: int) -> tuple[int, int]:
        start = -(-self.pos // _ALIGN) * _ALIGN
        if start + nbytes > self.size:
            start = 0
        self._free(start, start + nbytes)
        self.pos = start + nbytes
        return start, start + nbytes

    def start(self, m: Message, rank: int, views: RegionViews, group: Any, tag: int) -> None:
        span = None
        if _staged_here(m, rank, views):
            span = self._take(m.nbytes)
            buf = self.ring[span[0] : span[1]]
        else:
            (t,) = m.transfers
            buf = bytes_view(views.source(t) if rank == m.src else views.target(t))
        unpack = []
        if span is not None:
            for t, off in zip(m.transfers, m.offsets, strict=True):
                region = views.source(t) if rank == m.src else views.target(t)
                staged = buf[off : off + region.numel() * region.element_size()]
                if rank == m.src:
                    _typed(staged, region).copy_(region)
                else:
                    unpack.append((region, staged))
        chain = (m.src, *m.dsts)
        at = chain.index(rank)
        p = _Pending(buf, None, group, tag)
        p.span, p.unpack = span, unpack
        if buf.device.type != "cpu":
            p.work = dist.broadcast(buf, src=m.src, group=group, async_op=True)
        elif at == 0:
            self.sends.append((p, dist.isend(buf, chain[1], group=group, tag=tag)))
            return
        else:
            p.work = dist.irecv(buf, chain[at - 1], group=group, tag=tag)
            p.forward = chain[at + 1] if at + 1 < len(chain) else None
        self.pending.append(p)

    def finish(self) -> None:
        while self.pending:
            self._complete(self.pending.popleft())
        for _, work in self.sends:
            work.wait()
        self.sends = []
