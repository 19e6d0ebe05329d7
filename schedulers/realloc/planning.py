"""The parameter reallocation plan: a pure function listing every transfer between two (mesh, layout)s.

Moving a model's weights from a source (mesh, layout) to a target (mesh, layout) — ReaL's parameter
reallocation (Mei et al. 2024, §4) — is planned here without a process group, so the planner can cost it and
the runtime can execute it (broadcast from ``src`` to ``dsts``, or a local copy when ``dsts == (src,)``).
Shards follow ``rlflow.schedulers.realloc.shards.param_shards`` (grouped by ``shard_groups``).

Algorithm, per parameter:
  1. The source layout cuts the tensor into disjoint *pieces* (its tensor-parallel slices); each piece is
     held by a set of *replicas* (dp ranks, and first + last stage for a tied embedding).
  2. Each target device needs its shard; intersecting it with every piece gives disjoint *regions*.
     Target devices needing the same region are grouped (one broadcast serves them all).
  3. A target device that already holds the region's piece copies it locally. For the others one replica
     sends it; the replica with the fewest bytes sent so far is chosen (ties: lowest device id), which
     spreads the load over replicas.
Every element of every target shard is then written exactly once, by a device that holds it, and no
device ever receives more than its own target shard (no full-model gather on one rank).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod

from rlflow.dataflow.plan_spec import Layout
from rlflow.schedulers.realloc.shards import ModelMeta, Slice, is_expert_param, shard_groups, shard_rule

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_DIRECT_BYTES",
    "ReallocPlan",
    "Transfer",
    "plan_reallocation",
    "region_moves",
]

# How ``realloc.execute`` packs a plan's transfers into broadcast messages (here, torch-free, so the
# planner prices the packing without importing torch): transfers of at least DEFAULT_DIRECT_BYTES go
# alone, smaller ones share buffers of at most DEFAULT_BUCKET_BYTES.
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_DIRECT_BYTES = 1 << 20  # bench: 1 MiB beat 4 MiB (packing) and 256 KiB (latency)

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Transfer:
    """Send ``param[slices]`` from device ``src`` to every device in ``dsts`` (a local copy if
    ``dsts == (src,)``). ``bytes`` is the size of one copy of the slice."""

    src: int
    dsts: tuple[int, ...]
    param: str
    slices: Slice
    bytes: int

    @property
    def is_local(self) -> bool:
        return self.dsts == (self.src,)


@dataclass(frozen=True)
class ReallocPlan:
    """Every transfer of one reallocation, in a deterministic order (parameter, region)."""

    transfers: tuple[Transfer, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes written on targets (local copies included), summed over target devices."""
        return sum(t.bytes * len(t.dsts) for t in self.transfers)

    @property
    def remote_bytes(self) -> int:
        """Bytes that cross a link (summed over receiving devices)."""
        return sum(t.bytes * len(t.dsts) for t in self.transfers if not t.is_local)

    def sent_bytes(self) -> dict[int, int]:
        """Device -> bytes it sends over links (one copy per broadcast)."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            if not t.is_local:
                out[t.src] += t.bytes
        return dict(out)

    def received_bytes(self) -> dict[int, int]:
        """Device -> bytes it receives over links."""
        out: dict[int, int] = defaultdict(int)
        for t in self.transfers:
            if not t.is_local:
                for d in t.dsts:
                    out[d] += t.bytes
        return dict(out)

    def link_bytes(self) -> dict[tuple[int, int], int]:
        """(src, dst) device pair -> bytes, for pricing each link (local copies excluded)."""
        out: dict[tuple[int, int], int] = defaultdict(int)
        for t in self.transfers:
            if not t.is_local:
                for d in t.dsts:
                    out[(t.src, d)] += t.bytes
        return dict(out)


def _box(slices: Slice) -> Box:
    return tuple((int(s.start), int(s.stop)) for s in slices)


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (x0, x1), (y0, y1) in zip(a, b, strict=True):
        lo, hi = (x0 if x0 > y0 else y0), (x1 if x1 < y1 else y1)
        if lo >= hi:  # most pieces miss a target shard in their first dim: stop there
            return None
        out.append((lo, hi))
    return tuple(out)


def region_moves(
    param_shapes: Mapping[str, tuple[int, ...]],
    model_meta: ModelMeta,
    src_devices: tuple[int, ...],
    src_layout: Layout,
    dst_devices: tuple[int, ...],
    dst_layout: Layout,
    dtype_bytes: int = 2,
) -> Iterator[tuple[str, Box, int, list[int], int, tuple[int, ...]]]:
    """The plan of :func:`plan_reallocation` region by region, in its order, without a ``Transfer`` per
    device (what the planner's cost model reads, many times per search): ``(param, region, bytes, local,
    sender, remote)`` with ``region`` the box ``((start, stop), ...)`` per dim, ``bytes`` one copy of it,
    ``local`` the target devices that copy it from their own source shard (in target order), and
    ``sender`` broadcasting it to the sorted ``remote`` devices (``sender`` -1 and ``remote`` empty when
    there are none). Arguments and errors as :func:`plan_reallocation`."""
    src = shard_groups(param_shapes, model_meta, src_devices, src_layout)
    dst = shard_groups(param_shapes, model_meta, dst_devices, dst_layout)
    load: dict[int, int] = defaultdict(int)
    # shard_groups keeps a parameter whole or cuts it into equal blocks along its shard_rule dim (an expert
    # tensor along dim 0 by ep), one per group: (shape, dim, expert, groups) fix the boxes, so parameters
    # alike (every layer's) share their regions
    regions_of: dict[tuple[object, ...], list[tuple[Box, int, list[int], int]]] = {}
    holder_sets: dict[int, set[int]] = {}  # id(owner tuple) -> its set; the tuples live as long as src
    for name in param_shapes:
        src_groups, dst_groups = src[name], dst[name]
        shape = param_shapes[name]
        key = (
            shape,
            shard_rule(name),
            is_expert_param(name, shape),
            len(dst_groups),
            tuple(bool(o) for _, o in src_groups),
        )
        regions = regions_of.get(key)
        if regions is None:
            regions = regions_of[key] = _regions(src_groups, dst_groups, dtype_bytes)
        for region, piece, wants, nbytes in regions:
            holders = src_groups[piece][1]
            holder_set = holder_sets.get(id(holders))
            if holder_set is None:
                holder_set = holder_sets[id(holders)] = set(holders)
            targets = (
                dst_groups[wants[0]][1] if len(wants) == 1 else sum((dst_groups[w][1] for w in wants), ())
            )
            local = list(filter(holder_set.__contains__, targets))
            remote = tuple(sorted(itertools.filterfalse(holder_set.__contains__, targets)))
            sender = -1
            if remote:
                sender = min(holders, key=lambda h: (load[h], h))
                load[sender] += nbytes
            yield name, region, nbytes, local, sender, remote


def _regions(
    src_groups: list[tuple[Slice, tuple[int, ...]]],
    dst_groups: list[tuple[Slice, tuple[int, ...]]],
    dtype_bytes: int,
) -> list[tuple[Box, int, list[int], int]]:
    """The regions of one parameter (module docstring, steps 1-2): (box, index of the source piece,
    indices of the target groups needing it, bytes of one copy), in first-met order."""
    pieces = {_box(sl): i for i, (sl, owners) in enumerate(src_groups) if owners}
    regions: dict[Box, tuple[int, list[int]]] = {}
    for w, (sl, _devices) in enumerate(dst_groups):
        want = _box(sl)
        for piece, i in pieces.items():
            region = _intersect(piece, want)
            if region is not None:
                regions.setdefault(region, (i, []))[1].append(w)
    return [
        (region, i, wants, prod(hi - lo for lo, hi in region) * dtype_bytes)
        for region, (i, wants) in regions.items()
    ]


def plan_reallocation(
    param_shapes: Mapping[str, tuple[int, ...]],
    model_meta: ModelMeta,
    src_devices: tuple[int, ...],
    src_layout: Layout,
    dst_devices: tuple[int, ...],
    dst_layout: Layout,
    dtype_bytes: int = 2,
) -> ReallocPlan:
    """Plan moving every parameter from (src mesh, layout) to (dst mesh, layout).

    Args:
        param_shapes: parameter name -> full shape.
        model_meta: layer count and tied head (see ``realloc.shards``).
        src_devices, dst_devices: meshes (may overlap or coincide).
        src_layout, dst_layout: layouts on them (micro-batches ignored).
        dtype_bytes: bytes per element (2 for bf16).

    Returns:
        A ReallocPlan; ``Transfer.bytes`` in bytes.

    Raises:
        PlanError: a layout does not fit the model (see ``param_shards``).
    """
    transfers: list[Transfer] = []
    moves = region_moves(
        param_shapes, model_meta, src_devices, src_layout, dst_devices, dst_layout, dtype_bytes
    )
    for name, region, nbytes, local, sender, remote in moves:
        slices = tuple(slice(lo, hi) for lo, hi in region)
        transfers += [Transfer(d, (d,), name, slices, nbytes) for d in local]
        if remote:
            transfers.append(Transfer(sender, remote, name, slices, nbytes))
    return ReallocPlan(tuple(transfers))
