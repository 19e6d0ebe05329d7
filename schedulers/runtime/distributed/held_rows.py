"""The controller's rows on the workers: where an iteration's source rows are put, how many readers each held
reference still has (its rows are freed after the last one), which rows each dp rank of a node reads, and
copying rows back to the controller.

Batches move worker to worker (:mod:`rlflow.schedulers.runtime.distributed.transfer`); the controller keeps
only row references (:class:`~rlflow.schedulers.runtime.distributed.transfer.RowRef`: which worker holds
which rows, and their mask lengths) and hands them to the nodes that read them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from rlflow.dataflow.batch import Batch, padding_side
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.runtime.distributed.placement import PlanView
from rlflow.schedulers.runtime.distributed.pool import WorkerPool, to_ranks
from rlflow.schedulers.runtime.distributed.protocol import Free, Pull, Put, Stored
from rlflow.schedulers.runtime.distributed.rows import balance_rows, shard_rows
from rlflow.schedulers.runtime.distributed.transfer import (
    PULL,
    Handle,
    Holding,
    RowRef,
    assemble,
    mask_lengths,
    plan_transfers,
)

__all__ = ["HeldRows", "row_tokens"]


class HeldRows:
    """The row references of one distributed run and the readers each still has.

    Args:
        graph: the validated graph (its consumers of each key are a reference's readers).
        view: the plan's meshes.
        pool: the workers' connections (puts, frees and pulls go through it).

    Attributes:
        producers: batch key -> the node that produces it (``Graph.keys`` copies on every call).
        readers: held rows -> the reads still to come (graph consumers).
    """

    def __init__(self, graph: Graph, view: PlanView, pool: WorkerPool) -> None:
        self.graph = graph
        self.view = view
        self.pool = pool
        self.producers = graph.keys()
        self.readers: dict[Handle, int] = {}

    def consumers(self, key: str) -> list[str]:
        """The graph's readers of ``key`` in execution order (none for a key the graph does not know)."""
        return self.graph.consumers(key) if key in self.producers else []

    def track(self, ref: RowRef, readers: int | None = None) -> RowRef:
        """Count ``ref``'s readers (default: the graph's consumers of its key); rows nobody reads are
        dropped now."""
        readers = len(self.consumers(ref.key)) if readers is None else readers
        if readers:
            self.readers[ref.handle] = readers
        else:
            cmd = self.pool.reserve()
            self.pool.post(cmd, to_ranks(sorted({h.rank for h in ref.holdings}), Free(cmd, [ref.handle])))
        return ref

    def read(self, refs: Sequence[RowRef]) -> list[RowRef]:
        """One more read of each of ``refs``; those read by their last reader."""
        done: list[RowRef] = []
        for ref in refs:
            left = self.readers.get(ref.handle)
            if left is None:
                continue
            if left <= 1:
                del self.readers[ref.handle]
                done.append(ref)
            else:
                self.readers[ref.handle] = left - 1
        return done

    def release(self, refs: Sequence[RowRef]) -> None:
        """Free ``refs``' rows now, whatever reads were still counted (rows no node will read)."""
        freed: dict[Handle, RowRef] = {}
        for ref in refs:
            if self.readers.pop(ref.handle, None) is not None:
                freed[ref.handle] = ref
        for handle, ref in freed.items():
            cmd = self.pool.reserve()
            self.pool.post(cmd, to_ranks(sorted({h.rank for h in ref.holdings}), Free(cmd, [handle])))

    def source(self, batch: Batch, iteration: int, done: Collection[str] = ()) -> dict[str, Any]:
        """The controller's store entries for an iteration's source data (the data set's batch; on a
        resume, the values of an iteration in flight whose nodes ``done`` have run).

        Each tensor key is put on the mesh of the first node that reads it (equal consecutive shares over
        its dp ranks, every tp rank holding its dp group's share) and becomes a :class:`RowRef`; per-row
        lists and keys no node reads stay as they are. The put is not waited for (its failure surfaces in
        the next wait).
        """
        out = dict(batch.items())
        first: dict[str, list[str]] = {}  # first reader -> the tensor keys put on its mesh
        readers_of = {key: [n for n in self.consumers(key) if n not in done] for key, _ in batch.items()}
        for key, value in batch.items():
            readers = readers_of[key]
            if isinstance(value, torch.Tensor) and readers:
                first.setdefault(readers[0], []).append(key)
        rows = len(batch)
        for name, keys in first.items():
            spec = self.view.meshes[name]
            shares = [list(range(d * rows // spec.dp, (d + 1) * rows // spec.dp)) for d in range(spec.dp)]
            share = {r: shares[spec.coords(r)[0]] for r in spec.devices}
            cmd = self.pool.reserve()
            puts = {
                r: Put(cmd, iteration, {k: batch.tensor(k)[share[r]] for k in keys}) for r in spec.devices
            }
            self.pool.post(cmd, puts)
            for key in keys:
                value = batch.tensor(key)
                holdings = [Holding(r, tuple(s), (len(s), *value.shape[1:])) for r, s in share.items()]
                lengths = mask_lengths(key, value)
                left = padding_side(key) == "left"
                out[key] = self.track(
                    RowRef(key, (iteration, key, cmd), value.dtype, holdings, lengths=lengths, left_pad=left),
                    len(readers_of[key]),
                )
        return out

    def pull(self, values: Mapping[str, Any]) -> Batch:
        """``values`` with every :class:`RowRef` replaced by its rows, copied to the controller in row order.

        For checks and debugging only: it moves bulk tensors through the controller, which running nodes
        never does. Does not count as a read.
        """
        out: dict[str, Any] = {}
        for param, value in values.items():
            if not isinstance(value, RowRef):
                out[param] = value
                continue
            parts = plan_transfers({param: value}, {PULL: range(len(value))})
            senders = [(src, items) for src, part in parts.items() if src != PULL for _, items in part.sends]
            cmd = self.pool.reserve()
            got = self.pool.ask(cmd, {r: Pull(cmd, items) for r, items in senders}, "pull of rows")
            out[param] = assemble(parts[PULL], got, None, "cpu")[param]
        return Batch(out)

    def stored(self) -> dict[int, list[Handle]]:
        """The handles every worker holds now (rank -> sorted handles)."""
        cmd = self.pool.reserve()
        handles: dict[int, list[Handle]] = self.pool.ask(
            cmd, to_ranks(range(self.view.world), Stored(cmd)), "stored rows"
        )
        return handles

    def shares(self, name: str, batch: Batch) -> list[list[list[int]]]:
        """The global input rows of each dp rank of ``name``, per mini-batch (``out[dp_rank][mini]``)."""
        node = self.graph.node(name)
        spec = self.view.meshes[name]
        if spec.dp == 1:
            return [[list(range(len(batch)))]]
        if node.kind == "generate":  # its cost is the responses it has not sampled yet: equal shares
            return [[rows] for rows in shard_rows(len(batch), spec.dp)]
        train = node.kind == "train"
        return balance_rows(
            row_tokens(batch),
            spec.dp,
            node.mini_batches if train else 1,
            self.graph.group_size(name),
            # FSDP2: every rank runs the layout's micro-batches in each mini-batch
            self.graph.placement(name).layout.micro_batches if train else 1,
        )


def row_tokens(batch: Batch) -> list[int]:
    """Tokens of each row: the sum of its ``*_mask`` inputs (prompt + response tokens); 0 without masks
    (the split is then by rows)."""
    tokens = [0] * len(batch)
    for key, value in batch.items():
        if not key.endswith("_mask"):
            continue
        if isinstance(value, RowRef):
            lengths = value.row_lengths()
        else:
            lengths = mask_lengths(key, value) if isinstance(value, torch.Tensor) else None
        if lengths is not None:
            tokens = [t + int(n) for t, n in zip(tokens, lengths, strict=True)]
    return tokens
