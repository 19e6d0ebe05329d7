"""Batches between meshes, worker to worker: row references, transfer plans and their execution.

Shape legend: B rows of one batch key; a held tensor is ``[B_local, ...]`` (``[B_local, R]`` for a
response tensor), the *width* is its trailing dims.

A node's output tensors stay on the workers that computed them (the tp rank 0 of each dp group), in each
worker's :class:`RowStore` under a :data:`Handle` ``(iteration, key, producing command)``. The controller
gets metadata only — for each key its dtype, which rank holds which global rows with what local shape
(:class:`Holding`), and the per-row sums of mask keys (tokens) — and keeps a :class:`RowRef` per key in its
store. The controller's source tensors (the data set's prompts) are put on the workers the same way, on
the mesh of the first node that reads them.

When a node reads references, the controller plans (:func:`plan_transfers`, a pure function) for every rank
of the node's mesh the rows it needs (its dp share, in its local order) and where each comes from: the rank
itself (a local copy) or a holder (a replica on the same rank is preferred, else one chosen by the
receiving rank, which spreads the load). Every participant, holder or receiver, gets its :class:`Part`.
One message per (sender, receiver) pair and command: the sender packs the selected rows of every key as
bytes; the receiver knows every size from the plan, unpacks, and pads each key to the global width (keys
starting with ``prompt`` on the left, others on the right, with 0, like :meth:`Batch.concat`), so a
consumer sees exactly the tensors a single process would. All receives and sends of one command are posted
at once (one ``batch_isend_irecv``, tagged with the command id) and then waited, so their order inside a
command cannot deadlock; the order across commands is the worker's
(:mod:`rlflow.schedulers.runtime.distributed.worker`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlflow.dataflow.batch import RemoteRows

__all__ = [
    "PULL",
    "Fill",
    "Handle",
    "Holding",
    "Part",
    "Piece",
    "RowRef",
    "RowStore",
    "assemble",
    "exchange",
    "mask_lengths",
    "plan_transfers",
]

# (iteration, batch key, id of the command that produced or put the rows)
Handle = tuple[int, str, int]
# the receiving "rank" of rows pulled to the controller (DistExecutor.pull)
PULL = -1


def mask_lengths(key: str, value: torch.Tensor) -> list[int] | None:
    """Per-row sums of a ``*_mask`` tensor ``[B, T]`` (its tokens per row), else ``None``: the metadata
    the token-balanced split reads."""
    return value.sum(-1).tolist() if key.endswith("_mask") and value.dim() == 2 else None


@dataclass(frozen=True)
class Holding:
    """Rows of one key held by one worker.

    Attributes:
        rank: the worker's global rank.
        rows: the global row index of each local row, in local order.
        shape: the local tensor's shape ``[len(rows), ...]``.
    """

    rank: int
    rows: tuple[int, ...]
    shape: tuple[int, ...]


class RowRef(RemoteRows):
    """A batch key whose rows are held by workers (:class:`rlflow.dataflow.batch.RemoteRows`).

    Args:
        key: the batch key (for messages).
        handle: where every holder keeps the rows (:class:`RowStore`).
        dtype: the tensor dtype.
        holdings: who holds which rows; every stored row ``0 .. n-1`` is held at least once (replicas
            allowed).
        lengths: per stored row, the sum of a mask key's row (tokens), else ``None``.
        left_pad: pad narrower holdings on the left (prompt keys) when assembling.
        rows_map: row ``i`` of this reference is stored row ``rows_map[i]`` (default: the identity).

    Raises:
        ValueError: a stored row is held nowhere, or holdings disagree beyond dim 1.
    """

    def __init__(
        self,
        key: str,
        handle: Handle,
        dtype: torch.dtype,
        holdings: Sequence[Holding],
        *,
        lengths: Sequence[int] | None = None,
        left_pad: bool = False,
        rows_map: Sequence[int] | None = None,
        _where: dict[int, list[tuple[int, int]]] | None = None,
    ) -> None:
        self.key = key
        self.handle = handle
        self.dtype = dtype
        self.holdings = tuple(holdings)
        self.lengths = tuple(int(n) for n in lengths) if lengths is not None else None
        self.left_pad = left_pad
        if _where is None:  # stored row -> [(rank, local row)], replicas in holding order
            _where = {}
            for h in self.holdings:
                for local, row in enumerate(h.rows):
                    _where.setdefault(int(row), []).append((h.rank, local))
            if sorted(_where) != list(range(len(_where))):
                raise ValueError(f"key '{key}': holdings do not cover rows 0..{len(_where) - 1}")
            shapes = {tuple(h.shape[2:]) for h in self.holdings}
            if len(shapes) > 1:
                raise ValueError(f"key '{key}': holdings differ beyond dim 1: {sorted(shapes)}")
        self._where = _where
        self.rows_map = tuple(rows_map) if rows_map is not None else tuple(range(len(_where)))
        # the global width: the widest holding (only dim 1 may differ)
        self.width = tuple(
            max(h.shape[d] for h in self.holdings) for d in range(1, len(self.holdings[0].shape))
        )

    def __len__(self) -> int:
        return len(self.rows_map)

    def index(self, rows: Sequence[int]) -> RowRef:
        return RowRef(
            self.key,
            self.handle,
            self.dtype,
            self.holdings,
            lengths=self.lengths,
            left_pad=self.left_pad,
            rows_map=[self.rows_map[int(i)] for i in rows],
            _where=self._where,
        )

    @property
    def nbytes(self) -> int:
        return len(self) * math.prod(self.width) * self.dtype.itemsize

    def row_lengths(self) -> list[int] | None:
        """Per row of this reference, the mask sum (tokens) of a mask key, else ``None``."""
        if self.lengths is None:
            return None
        return [self.lengths[j] for j in self.rows_map]

    def source(self, stored: int, dst: int) -> tuple[int, int]:
        """``(rank, local row)`` to read stored row ``stored`` from, for receiver ``dst``: ``dst`` itself
        when it holds a replica, else the replica ``dst`` picks (spreads receivers over replicas)."""
        replicas = self._where[stored]
        for rank, local in replicas:
            if rank == dst:
                return rank, local
        return replicas[max(dst, 0) % len(replicas)]

    def __repr__(self) -> str:
        ranks = sorted({h.rank for h in self.holdings})
        return f"RowRef({self.key!r}, rows={len(self)}, width={self.width}, {self.dtype}, ranks={ranks})"


@dataclass(frozen=True)
class Piece:
    """Rows of one key inside one message: where they go and how they are laid out.

    Attributes:
        param: the receiving node's input name.
        positions: the receiver's local rows they fill, in message order.
        shape: their trailing dims as the sender holds them.
        dtype: their dtype.
    """

    param: str
    positions: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return len(self.positions) * math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Fill:
    """A tensor ``[rows, *width]`` the receiver assembles (zeros where narrower rows leave padding)."""

    rows: int
    width: tuple[int, ...]
    dtype: torch.dtype
    left_pad: bool


@dataclass
class Part:
    """What one rank does in one transfer command.

    Attributes:
        fills: the input tensors it assembles (receivers only): parameter -> layout.
        copies: rows it holds itself: ``(param, handle, local rows, positions)``.
        recvs: per sender rank (ascending), the pieces of its message in order.
        sends: per receiver rank (ascending), the ``(handle, local rows)`` of its message in order.
        frees: handles it drops after sending (their last reader has read them).
    """

    fills: dict[str, Fill] = field(default_factory=dict)
    copies: list[tuple[str, Handle, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    recvs: list[tuple[int, list[Piece]]] = field(default_factory=list)
    sends: list[tuple[int, list[tuple[Handle, tuple[int, ...]]]]] = field(default_factory=list)
    frees: list[Handle] = field(default_factory=list)

    @property
    def received_bytes(self) -> int:
        """Bytes this rank receives from other ranks."""
        return sum(p.nbytes for _, pieces in self.recvs for p in pieces)


def plan_transfers(
    refs: Mapping[str, RowRef], need: Mapping[int, Sequence[int]], free: Iterable[RowRef] = ()
) -> dict[int, Part]:
    """The part of every participant in delivering ``refs`` to the receivers in ``need``.

    Args:
        refs: the node's input name -> reference.
        need: receiving rank -> the rows of the references it gets (its dp share), in its local order.
            ``PULL`` is the controller (:meth:`DistExecutor.pull`).
        free: references whose holders drop the rows after this command.

    Returns:
        rank -> its part; receivers, the holders they read from, and the holders that free.
    """
    parts: dict[int, Part] = {}
    for dst in sorted(need):
        mine = parts.setdefault(dst, Part())
        # sender -> (pieces, items) of the one message it sends to dst, in input-name order
        messages: dict[int, tuple[list[Piece], list[tuple[Handle, tuple[int, ...]]]]] = {}
        for param, ref in refs.items():
            mine.fills[param] = Fill(len(need[dst]), ref.width, ref.dtype, ref.left_pad)
            by_src: dict[int, tuple[list[int], list[int]]] = {}
            for pos, row in enumerate(need[dst]):
                src, local = ref.source(ref.rows_map[int(row)], dst)
                locals_, positions = by_src.setdefault(src, ([], []))
                locals_.append(local)
                positions.append(pos)
            shape_of = {h.rank: tuple(h.shape[1:]) for h in ref.holdings}
            for src in sorted(by_src):
                locals_, positions = by_src[src]
                if src == dst:
                    mine.copies.append((param, ref.handle, tuple(locals_), tuple(positions)))
                    continue
                pieces, items = messages.setdefault(src, ([], []))
                pieces.append(Piece(param, tuple(positions), shape_of[src], ref.dtype))
                items.append((ref.handle, tuple(locals_)))
        for src in sorted(messages):
            pieces, items = messages[src]
            mine.recvs.append((src, pieces))
            parts.setdefault(src, Part()).sends.append((dst, items))
    for ref in free:
        for rank in sorted({h.rank for h in ref.holdings}):
            parts.setdefault(rank, Part()).frees.append(ref.handle)
    for part in parts.values():
        part.sends.sort(key=lambda s: s[0])
    return parts


class RowStore:
    """One worker's held rows: :data:`Handle` -> tensor ``[B_local, ...]`` (rows in holding order)."""

    def __init__(self) -> None:
        self._rows: dict[Handle, torch.Tensor] = {}

    def put(self, handle: Handle, rows: torch.Tensor) -> None:
        self._rows[handle] = rows

    def get(self, handle: Handle) -> torch.Tensor:
        """The rows of ``handle``.

        Raises:
            KeyError: not held here (never stored, or freed after its last reader).
        """
        try:
            return self._rows[handle]
        except KeyError:
            iteration, key, cmd = handle
            raise KeyError(
                f"rows of key '{key}' (iteration {iteration}, command {cmd}) are not held on this worker "
                "(freed after their last reader, or never stored)"
            ) from None

    def select(self, handle: Handle, rows: Sequence[int]) -> torch.Tensor:
        """Local rows ``rows`` of ``handle``."""
        held = self.get(handle)
        return held.index_select(0, torch.tensor(rows, dtype=torch.long, device=held.device))

    def free(self, handles: Iterable[Handle]) -> None:
        for h in handles:
            self._rows.pop(h, None)

    def handles(self) -> list[Handle]:
        return sorted(self._rows)


def _pack(store: RowStore, items: Sequence[tuple[Handle, tuple[int, ...]]]) -> torch.Tensor:
    """The bytes of one message: the selected rows of each item, one after another."""
    return torch.cat([store.select(h, rows).contiguous().view(-1).view(torch.uint8) for h, rows in items])


def _unpack(buf: torch.Tensor, pieces: Sequence[Piece]) -> list[torch.Tensor]:
    out = []
    offset = 0
    for p in pieces:
        # clone: a dtype view needs an aligned start, which a byte offset inside the buffer may not be
        chunk = buf[offset : offset + p.nbytes].clone()
        out.append(chunk.view(p.dtype).view(len(p.positions), *p.shape))
        offset += p.nbytes
    return out


def _place(out: torch.Tensor, rows: torch.Tensor, positions: Sequence[int], left_pad: bool) -> None:
    """Write ``rows`` into rows ``positions`` of ``out``, padding a narrower dim 1 on the left or right."""
    idx = torch.tensor(positions, dtype=torch.long, device=out.device)
    rows = rows.to(out.device, out.dtype)
    if rows.dim() >= 2 and rows.shape[1] != out.shape[1]:
        w = int(rows.shape[1])
        target = out[:, out.shape[1] - w :] if left_pad else out[:, :w]
        target.index_copy_(0, idx, rows)
    else:
        out.index_copy_(0, idx, rows)


def assemble(
    part: Part, received: Mapping[int, Sequence[torch.Tensor]], store: RowStore | None, device: Any
) -> dict[str, torch.Tensor]:
    """The receiver's input tensors from its local copies and the rows received per sender.

    Args:
        part: the receiver's part.
        received: sender rank -> one tensor per piece of ``part.recvs`` for it, in order.
        store: the receiver's store (for ``part.copies``; ``None`` when it has none).
        device: where the tensors are built.
    """
    out = {
        param: torch.zeros((f.rows, *f.width), dtype=f.dtype, device=device)
        for param, f in part.fills.items()
    }
    for param, handle, local, positions in part.copies:
        assert store is not None
        _place(out[param], store.select(handle, local), positions, part.fills[param].left_pad)
    for src, pieces in part.recvs:
        for piece, rows in zip(pieces, received[src], strict=True):
            _place(out[piece.param], rows, piece.positions, part.fills[piece.param].left_pad)
    return out


def exchange(part: Part, store: RowStore, tag: int, device: Any) -> dict[str, torch.Tensor]:
    """Run this rank's part of a transfer command (point-to-point on the default process group).

    Posts every receive and send of the part at once, waits for all, assembles the inputs (returned:
    input name -> tensor, empty on a pure sender), then frees the handles whose last reader this was.

    Raises:
        KeyError: rows to send are not held here.
        RuntimeError: a peer failed (the process group's timeout bounds the wait).
    """
    buffers = {
        src: torch.empty(sum(p.nbytes for p in pieces), dtype=torch.uint8, device=device)
        for src, pieces in part.recvs
    }
    payloads = [_pack(store, items) for _, items in part.sends]  # alive until every send is done
    ops = [dist.P2POp(dist.irecv, buf, src, tag=tag) for src, buf in buffers.items()]
    ops += [
        dist.P2POp(dist.isend, buf, dst, tag=tag) for (dst, _), buf in zip(part.sends, payloads, strict=True)
    ]
    # one batch: NCCL would otherwise serialise a pair's receive and send on one stream (deadlock)
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()
    pieces_of = dict(part.recvs)
    inputs = assemble(part, {s: _unpack(b, pieces_of[s]) for s, b in buffers.items()}, store, device)
    store.free(part.frees)
    return inputs
