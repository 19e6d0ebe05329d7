"""The distributed runtime: worker processes, per-node meshes and layouts, weight sync between layouts.

:func:`make_executor` picks the executor for a graph: the single-process
:class:`~rlflow.schedulers.runtime.executor.LocalExecutor` for the trivial plan (one device, every node
``d1t1p1``), else :class:`~rlflow.schedulers.runtime.distributed.executor.DistExecutor`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlflow.dataflow.graph import Graph

__all__ = ["DistConfig", "DistExecutor", "is_trivial_plan", "make_executor"]


def is_trivial_plan(graph: Graph) -> bool:
    """One device and every node on device 0 with dp = tp = pp = 1 (what LocalExecutor runs)."""
    if graph.spec.run.devices != 1:
        return False
    for name in graph.nodes:
        placement = graph.placement(name)
        layout = placement.layout
        if len(placement.devices) != 1 or (layout.dp, layout.tp, layout.pp) != (1, 1, 1):
            return False
    return True


def make_executor(graph: Graph, checkpoint_dir: Path | None = None, **config: Any) -> Any:
    """``LocalExecutor`` for a trivial plan, else ``DistExecutor`` (``config``: :class:`DistConfig` fields).

    Raises:
        PlanError: an invalid or unsupported plan (before any process starts).
    """
    from rlflow.schedulers.runtime.executor import LocalExecutor

    if is_trivial_plan(graph):
        return LocalExecutor(graph, checkpoint_dir=checkpoint_dir)
    from rlflow.schedulers.runtime.distributed.executor import DistConfig, DistExecutor

    return DistExecutor(graph, checkpoint_dir=checkpoint_dir, config=DistConfig(**config))


def __getattr__(name: str) -> Any:
    if name in ("DistConfig", "DistExecutor"):
        from rlflow.schedulers.runtime.distributed import executor

        return getattr(executor, name)
    raise AttributeError(name)
