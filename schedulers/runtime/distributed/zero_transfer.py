"""ZeRO-3 partitions moved to and from other layouts piece by piece (a weight sync into or out of a
DeepSpeed ZeRO-3 instance, :mod:`rlflow.schedulers.runtime.distributed.zero`).

Stage 3 keeps, on dp rank ``i`` of ``d``, the flat elements ``[i·s, min((i+1)·s, n))`` of every parameter of
``n`` elements (``s = ceil(n / d)``, :func:`~rlflow.schedulers.runtime.distributed.zero.partition_range`).
:func:`zero_holdings` describes them, and any other layout's ``param_shards`` boxes (:func:`box_holdings`),
as contiguous flat runs; :func:`plan_pieces` cuts every run a target rank needs into pieces each held
contiguously by one source rank (the target itself first), so a weight sync moves each rank's partition
straight to where it is needed (one message per source/target pair, no gather of the whole model anywhere),
and :func:`move_pieces` checks every piece by digest on both sides.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from rlflow.schedulers.realloc.shards import Slice
from rlflow.schedulers.realloc.verify import ChecksumError, weights_checksum
from rlflow.schedulers.runtime.distributed.zero import partition_range

__all__ = [
    "Holdings",
    "Piece",
    "Run",
    "box_holdings",
    "box_runs",
    "move_pieces",
    "plan_pieces",
    "zero_holdings",
]

_TAG = 0x5A30  # point-to-point tag of a ZeRO-3 weight sync's messages

Run = tuple[int, int, int]  # (flat start, flat stop) of the full tensor, and the local flat offset of start


def box_runs(shape: Sequence[int], box: Slice) -> list[Run]:
    """The contiguous flat runs of the full row-major tensor ``shape`` that a local shard ``box`` holds, with
    their offsets in the shard's own (row-major, contiguous) storage, in order.

    The trailing dims the box spans whole merge into each run, so a dim-0 block is one run and a dim-1 block
    of a matrix is one run per row.
    """
    dims = [int(n) for n in shape]
    if not dims:
        return [(0, 1, 0)]
    k = len(dims) - 1
    while k > 0 and box[k].start == 0 and box[k].stop == dims[k]:
        k -= 1
    inner = 1
    for n in dims[k + 1 :]:
        inner *= n
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    width = (box[k].stop - box[k].start) * inner
    runs: list[Run] = []
    local = 0
    for idx in itertools.product(*(range(box[i].start, box[i].stop) for i in range(k))):
        start = sum(i * s for i, s in zip(idx, strides, strict=False)) + box[k].start * strides[k]
        runs.append((start, start + width, local))
        local += width
    return [r for r in runs if r[1] > r[0]]


# rank -> parameter -> runs it holds
Holdings = dict[int, dict[str, list[Run]]]


def zero_holdings(shapes: Mapping[str, Sequence[int]], devices: Sequence[int]) -> Holdings:
    """What each rank of a ZeRO-3 mesh (dp ranks ``devices``) holds: one run per parameter."""
    out: Holdings = {}
    for i, rank in enumerate(devices):
        out[int(rank)] = {}
        for name, shape in shapes.items():
            n = 1
            for d in shape:
                n *= int(d)
            start, stop = partition_range(n, len(devices), i)
            if stop > start:
                out[int(rank)][name] = [(start, stop, 0)]
    return out


def box_holdings(shapes: Mapping[str, Sequence[int]], boxes: Mapping[int, Mapping[str, Slice]]) -> Holdings:
    """What each rank of another layout holds: its ``param_shards`` boxes as runs (:func:`box_runs`)."""
    return {
        int(rank): {name: box_runs(shapes[name], box) for name, box in per.items()}
        for rank, per in boxes.items()
    }


@dataclass(frozen=True)
class Piece:
    """One contiguous run of a parameter moved from ``src`` to ``dst``: full-tensor flat elements
    ``[start, stop)``, at ``src_offset`` in the source's local storage and ``dst_offset`` in the target's."""

    param: str
    src: int
    dst: int
    start: int
    stop: int
    src_offset: int
    dst_offset: int


def plan_pieces(source: Holdings, target: Holdings, params: Sequence[str]) -> list[Piece]:
    """Cut every run a target rank holds into pieces each held whole by one source rank.

    Sources are tried in order: the target rank itself (a local copy), then the others by distance from it in
    rank order (spreading the sends of replicated sources); every element of every target run is covered
    exactly once. Pure: every rank computes the same list (order: parameter, target rank, start).

    Raises:
        ValueError: an element a target needs is held by no source rank.
    """
    ranks = sorted(source)
    pieces: list[Piece] = []
    for name in params:
        for dst in sorted(target):
            for t_start, t_stop, t_off in target[dst].get(name, []):
                order = sorted(ranks, key=functools.partial(_preference, dst, max(ranks) + 1))
                todo = [(t_start, t_stop)]
                for src in order:
                    if not todo:
                        break
                    left: list[tuple[int, int]] = []
                    for a, b in todo:
                        for s_start, s_stop, s_off in source[src].get(name, []):
                            lo, hi = max(a, s_start), min(b, s_stop)
                            if lo < hi:
                                pieces.append(
                                    Piece(name, src, dst, lo, hi, s_off + lo - s_start, t_off + lo - t_start)
                                )
                        left += _uncovered(a, b, source[src].get(name, []))
                    todo = left
                if todo:
                    raise ValueError(f"no source rank holds elements {todo[0]} of {name!r}")
    pieces.sort(key=lambda p: (params.index(p.param), p.dst, p.start))
    return pieces


def _preference(dst: int, n: int, src: int) -> tuple[bool, int]:
    """Source order for target ``dst``: itself first, then by distance after it in rank order (mod ``n``)."""
    return src != dst, (src - dst) % n


def _uncovered(a: int, b: int, runs: Sequence[Run]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    pos = a
    for s, e, _ in sorted(runs):
        if e <= pos or s >= b:
            continue
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < b:
        out.append((pos, b))
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().data, digest_size=16).hexdigest()


@torch.no_grad()
def move_pieces(
    pieces: Sequence[Piece],
    rank: int,
    src_local: Mapping[str, torch.Tensor],
    dst_local: Mapping[str, torch.Tensor],
    group: Any,
) -> tuple[str, int]:
    """Move this rank's pieces (one point-to-point message per source/target pair, local copies where a
    rank holds both) and verify every piece by BLAKE2b digest on both sides.

    Args:
        pieces: :func:`plan_pieces`' list (identical on every rank).
        rank: this rank.
        src_local, dst_local: this rank's source / target local storages by parameter, flattened
            (contiguous views: the target's are written in place); ``{}`` off that side.
        group: the process group of every rank of both sides (the digests' ``all_gather_object``); all of
            them call this.

    Returns:
        ``(checksum, bytes)``: ``weights_checksum`` of this rank's target storages ("" off the target) and
        the bytes this rank sent plus received.

    Raises:
        ChecksumError: naming the parameter, elements and ranks of every mismatching piece (first 5).
    """
    src_flat = {k: v.reshape(-1) for k, v in src_local.items()}
    dst_flat = {k: v.reshape(-1) for k, v in dst_local.items()}
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    for p in pieces:
        if p.src == rank and p.dst == rank:
            n = p.stop - p.start
            dst_flat[p.param][p.dst_offset : p.dst_offset + n].copy_(
                src_flat[p.param][p.src_offset : p.src_offset + n]
            )
        elif p.src == rank:
            sends.setdefault(p.dst, []).append(p)
        elif p.dst == rank:
            recvs.setdefault(p.src, []).append(p)
    nbytes = 0
    works: list[Any] = []
    buffers: dict[int, torch.Tensor] = {}
    for dst, items in sorted(sends.items()):
        buf = torch.cat([src_flat[p.param][p.src_offset : p.src_offset + p.stop - p.start] for p in items])
        works.append(dist.isend(buf, dst, tag=_TAG))
        buffers[-1 - dst] = buf  # kept alive until sent
        nbytes += buf.numel() * buf.element_size()
    for src, items in sorted(recvs.items()):
        like = dst_flat[items[0].param]
        buf = torch.empty(sum(p.stop - p.start for p in items), dtype=like.dtype, device=like.device)
        works.append(dist.irecv(buf, src, tag=_TAG))
        buffers[src] = buf
        nbytes += buf.numel() * buf.element_size()
    for w in works:
        if w is not None:
            w.wait()
    for src, items in sorted(recvs.items()):
        buf, pos = buffers[src], 0
        for p in items:
            n = p.stop - p.start
            dst_flat[p.param][p.dst_offset : p.dst_offset + n].copy_(buf[pos : pos + n])
            pos += n
    # verification: every piece digested where it came from and where it landed
    mine: dict[int, tuple[str, str]] = {}
    for i, p in enumerate(pieces):
        n = p.stop - p.start
        s = _digest(src_flat[p.param][p.src_offset : p.src_offset + n]) if p.src == rank else ""
        d = _digest(dst_flat[p.param][p.dst_offset : p.dst_offset + n]) if p.dst == rank else ""
        if s or d:
            mine[i] = (s, d)
    gathered: list[Any] = [None] * int(dist.get_world_size(group))
    dist.all_gather_object(gathered, mine, group=group)
    src_d: dict[int, str] = {}
    dst_d: dict[int, str] = {}
    for part in gathered:
        for i, (s, d) in part.items():
            if s:
                src_d[i] = s
            if d:
                dst_d[i] = d
    bad = [
        f"{p.param}[{p.start}:{p.stop}] rank {p.src} -> rank {p.dst}"
        for i, p in enumerate(pieces)
        if src_d.get(i) is None or src_d.get(i) != dst_d.get(i)
    ]
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ChecksumError(
            f"ZeRO reallocation checksum mismatch in {len(bad)} piece(s): " + "; ".join(bad[:5]) + more
        )
    return (weights_checksum(dict(dst_local)) if dst_local else ""), nbytes
