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

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod

from rlflow.dataflow.spec import Layout
from rlflow.schedulers.realloc.shards import ModelMeta, Slice, shard_groups

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_DIRECT_BYTES", "ReallocPlan", "Transfer", "plan_reallocation"]

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
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return None if any(lo >= hi for lo, hi in out) else out


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
    src = shard_groups(param_shapes, model_meta, src_devices, src_layout)
    dst = shard_groups(param_shapes, model_meta, dst_devices, dst_layout)
    load: dict[int, int] = defaultdict(int)
    transfers: list[Transfer] = []
    for name in param_shapes:
        pieces: dict[Box, tuple[int, ...]] = {_box(sl): owners for sl, owners in src[name] if owners}
        regions: dict[Box, tuple[Box, list[int]]] = {}
        for sl, devices in dst[name]:
            want = _box(sl)
            for piece in pieces:
                region = _intersect(piece, want)
                if region is not None:
                    regions.setdefault(region, (piece, []))[1].extend(devices)
        for region, (piece, targets) in regions.items():
            holders = pieces[piece]
            holder_set = set(holders)
            nbytes = prod(hi - lo for lo, hi in region) * dtype_bytes
            slices = tuple(slice(lo, hi) for lo, hi in region)
            remote = []
            for d in targets:
                if d in holder_set:
                    transfers.append(Transfer(d, (d,), name, slices, nbytes))
                else:
                    remote.append(d)
            if remote:
                sender = min(holders, key=lambda h: (load[h], h))
                load[sender] += nbytes
                transfers.append(Transfer(sender, tuple(sorted(remote)), name, slices, nbytes))
    return ReallocPlan(tuple(transfers))
