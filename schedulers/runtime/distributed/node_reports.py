"""What the controller makes of the workers' replies to a submitted node: the node's outputs as row
references (from its dp leaders' metadata; the tensors stay on the leaders), the dp ranks' metrics
combined, and the records of each weight sync, whose target checksums are checked here.

:class:`Pending` is a submitted node (the distributed executor's ticket): every reply it waits for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow.dataflow.batch import padding_side
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.runtime.distributed.placement import PlanView
from rlflow.schedulers.runtime.distributed.pool import WorkerPool
from rlflow.schedulers.runtime.distributed.protocol import (
    ListMeta,
    NodeReport,
    OutputMeta,
    SyncReport,
    TensorMeta,
)
from rlflow.schedulers.runtime.distributed.rows import output_rows
from rlflow.schedulers.runtime.distributed.transfer import Holding, RowRef

__all__ = ["Pending", "SyncLog", "combine_metrics", "node_outputs"]

_log = logging.getLogger("rlflow.realloc")


@dataclass
class Pending:
    """A submitted node: its command ids per rank, and where its outputs are.

    Attributes:
        ranks: the node's mesh; ``holders``: the other ranks that send it rows in the same command.
        leaders: the dp leaders (tp rank 0), by dp rank; they keep the outputs.
        shares: the global input rows of each dp rank, in its local order.
        moved: bytes of input rows moved between workers for this node.
    """

    name: str
    iteration: int
    cmd: int
    ranks: tuple[int, ...]
    leaders: tuple[int, ...]
    shares: list[list[int]]
    holders: tuple[int, ...] = ()
    moved: int = 0
    sync_cmd: int | None = None
    sync_ranks: tuple[int, ...] = ()
    xfer_cmd: int | None = None
    xfer_ranks: tuple[int, ...] = ()
    submitted: float = field(default_factory=time.monotonic)
    sync_only: bool = False  # a weight sync sent on its own (submit_sync): ``cmd`` is the Sync command
    sync_version: int = 0
    sync_deferred: bool = False  # a train node whose weight sync is left to submit_sync

    def replies(self) -> set[tuple[int, int]]:
        """Every ``(rank, cmd)`` reply this node (its input transfer, run and weight sync) waits for."""
        keys = {(r, self.cmd) for r in self.ranks}
        if self.xfer_cmd is not None:
            keys |= {(r, self.xfer_cmd) for r in self.xfer_ranks}
        if self.sync_cmd is not None:
            keys |= {(r, self.sync_cmd) for r in self.sync_ranks}
        return keys


def node_outputs(
    graph: Graph, pending: Pending, payloads: Sequence[NodeReport], track: Callable[[RowRef], RowRef]
) -> dict[str, Any]:
    """Row references (and lists) of a node's outputs from its dp leaders' metadata ``payloads`` (by dp
    rank); ``track`` counts each new reference's readers
    (:meth:`~rlflow.schedulers.runtime.distributed.held_rows.HeldRows.track`)."""
    binding = graph.node(pending.name).outputs
    assert isinstance(binding, dict), "graph validation resolves bindings to dicts"
    out: dict[str, Any] = {}
    for param in payloads[0].outputs:
        metas: list[OutputMeta] = [p.outputs[param] for p in payloads]
        rows_of = [  # global output rows of each leader's local rows
            output_rows(share, meta.rows) for share, meta in zip(pending.shares, metas, strict=True)
        ]
        total = sum(len(r) for r in rows_of)
        lists = [m for m in metas if isinstance(m, ListMeta)]
        if lists:
            assert len(lists) == len(metas), "every dp leader reports the same output kind"
            values: list[Any] = [None] * total
            for rows, lst in zip(rows_of, lists, strict=True):
                for row, v in zip(rows, lst.values, strict=True):
                    values[row] = v
            out[param] = values
            continue
        key = binding.get(param)
        if key is None:  # discarded by the graph: not kept on the workers
            continue
        tensors = [m for m in metas if isinstance(m, TensorMeta)]
        lengths: list[int] | None = [0] * total if tensors[0].lengths is not None else None
        holdings = []
        for leader, rows, meta in zip(pending.leaders, rows_of, tensors, strict=True):
            holdings.append(Holding(leader, tuple(rows), meta.shape))
            if lengths is not None and meta.lengths is not None:
                for row, n in zip(rows, meta.lengths, strict=True):
                    lengths[row] = int(n)
        handle = (pending.iteration, key, pending.cmd)
        left = padding_side(key) == "left"  # the bound key, as the rows' readers see it
        ref = RowRef(key, handle, tensors[0].dtype, holdings, lengths=lengths, left_pad=left)
        out[param] = track(ref)
    return out


class SyncLog:
    """The weight syncs of a run, as their workers reported them.

    Args:
        graph: the validated graph; view: its plan's instances and sync targets.
        pool: the workers (stopped when a sync's checksums disagree).

    Attributes:
        timings: train node -> rank -> (start, end, bytes sent + received) of the weight sync after its
            last execution (wall-clock seconds; the controller records them as "reallocation" trace rows).
        counts: weight syncs per path (``plan``: planned reallocation, ``zero``: ZeRO-3 partitions moved
            piece by piece, ``gather``: the gather path), counted per target instance.
        log: one record per target instance and sync: node, model, version, instance, path, bytes and the
            target ranks' checksums.
    """

    def __init__(self, graph: Graph, view: PlanView, pool: WorkerPool) -> None:
        self.graph = graph
        self.view = view
        self.pool = pool
        self.timings: dict[str, dict[int, tuple[float, float, int]]] = {}
        self.counts: dict[str, int] = {"plan": 0, "gather": 0}
        self.log: list[dict[str, Any]] = []

    def record(self, name: str, version: int, reports: Mapping[int, SyncReport]) -> dict[str, float]:
        """Record the weight sync after train node ``name`` from its workers' reports; its metrics.

        Checks the target checksums: the ranks of a target instance that hold the same shard (its dp
        replicas) must report the same checksum. Metrics: ``realloc/bytes`` (bytes moved over links,
        summed over receivers and targets), ``realloc/seconds`` (first start to last end over the workers),
        ``realloc/checksum_ok`` (1.0; a mismatch raises instead).

        Raises:
            NodeError: replicas of a target disagree (every worker is stopped first).
        """
        model = self.graph.node(name).model or name
        self.timings[name] = {r: (p.sync_start, p.sync_end, p.bytes) for r, p in reports.items()}
        moved = 0
        for dst in self.view.sync_targets.get(name, ()):
            target = self.view.instances[dst]
            entries = {r: p.targets[dst] for r, p in reports.items() if dst in p.targets}
            path = next(iter(entries.values())).path
            dst_bytes = max(e.moved or 0 for e in entries.values())  # known where it ran
            moved += dst_bytes
            self.counts[path] = self.counts.get(path, 0) + 1
            checksums = {r: e.checksum for r, e in entries.items() if r in target.mesh.devices}
            if not target.sharded:  # replicas: same (pp rank, tp rank), same shard, same bytes
                by_shard: dict[tuple[int, ...], set[str]] = {}
                for r, c in checksums.items():
                    by_shard.setdefault(target.mesh.shard_key(r), set()).add(str(c))
                bad = [t for t, cs in by_shard.items() if len(cs) > 1]
                if bad:
                    rank = min(r for r in checksums if target.mesh.shard_key(r) == bad[0])
                    raise self.pool.fail(
                        rank,
                        f"weight sync after node '{name}'",
                        "reallocation checksum mismatch: the dp replicas of (pp rank, tp rank[, ep rank]) "
                        f"{bad[0]} of model '{model}' (instance {dst}) hold different weights: "
                        f"{sorted(by_shard[bad[0]])}",
                    )
            record = {
                "node": name,
                "model": target.model,
                "version": version,
                "instance": dst,
                "path": path,
                "bytes": dst_bytes,
                "checksums": dict(sorted(checksums.items())),
            }
            self.log.append(record)
            _log.info("reallocation %s", record)
        starts = [t[0] for t in self.timings[name].values()]
        ends = [t[1] for t in self.timings[name].values()]
        return {
            "realloc/bytes": float(moved),
            "realloc/seconds": float(max(ends) - min(starts)) if starts else 0.0,
            "realloc/checksum_ok": 1.0,
        }


def combine_metrics(parts: Sequence[Mapping[str, float]], rows: Sequence[int]) -> dict[str, float]:
    """The dp ranks' metrics: ``*/max`` max, ``*/min`` min, ``faults/*`` (counts) summed, anything else the
    mean weighted by ``rows``."""
    out: dict[str, float] = {}
    for key in parts[0]:
        pairs = [(float(p[key]), max(1, n)) for p, n in zip(parts, rows, strict=True) if key in p]
        if key.endswith("/max"):
            out[key] = max(v for v, _ in pairs)
        elif key.endswith("/min"):
            out[key] = min(v for v, _ in pairs)
        elif key.startswith("faults/"):
            out[key] = sum(v for v, _ in pairs)
        else:
            out[key] = sum(v * n for v, n in pairs) / sum(n for _, n in pairs)
    return out
