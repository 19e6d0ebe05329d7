"""Which executor runs a graph: :func:`make_executor` (one process for the trivial plan, else workers)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlflow.dataflow.graph import Graph
from rlflow.schedulers.runtime.devices import default_device
from rlflow.schedulers.runtime.executor import Executor, LocalExecutor
from rlflow.schedulers.runtime.threads import allowed_cores, apply_threads, choose_threads

__all__ = ["LAUNCH_OF", "is_trivial_plan", "make_executor"]

# run.launcher -> DistConfig.launch
LAUNCH_OF = {"embedded": "spawn", "ray": "ray", "torchrun": "external"}


def is_trivial_plan(graph: Graph) -> bool:
    """One device and every node on device 0 with dp = tp = pp = 1 (what :class:`LocalExecutor` runs)."""
    if graph.spec.run.devices != 1:
        return False
    for name in graph.nodes:
        placement = graph.placement(name)
        layout = placement.layout
        if len(placement.devices) != 1 or (layout.dp, layout.tp, layout.pp) != (1, 1, 1):
            return False
    return True


def make_executor(graph: Graph, checkpoint_dir: Path | None = None, **config: Any) -> Executor[Any]:
    """:class:`LocalExecutor` for a trivial plan (this process then uses the threads of
    :func:`~rlflow.schedulers.runtime.threads.choose_threads` for its allowed cores, and prints them), else
    :class:`~rlflow.schedulers.runtime.distributed.dist_executor.DistExecutor` (``config``:
    :class:`~rlflow.schedulers.runtime.distributed.protocol.DistConfig` fields; ``launch`` defaults to the
    one ``run.launcher`` names, :data:`LAUNCH_OF`).

    Raises:
        PlanError: an invalid or unsupported plan (before any process starts).
        GraphError: a generate node's engine cannot serve it
            (:func:`rlflow.nodes.engines.validation.check_engines`).
        NodeError: a worker failed to start or build its models, or a node's engine failed to start.
    """
    from rlflow.nodes.engines.validation import check_engines

    check_engines(graph, default_device().type)
    if is_trivial_plan(graph):  # this process alone: the cores it may use (threads.py's rule)
        apply_threads(choose_threads(allowed_cores(), 1, os.environ))
        return LocalExecutor(graph, checkpoint_dir=checkpoint_dir)
    from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor
    from rlflow.schedulers.runtime.distributed.protocol import DistConfig

    config.setdefault("launch", LAUNCH_OF[graph.spec.run.launcher])
    return DistExecutor(graph, checkpoint_dir=checkpoint_dir, config=DistConfig(**config))
