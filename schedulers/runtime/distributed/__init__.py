"""The distributed runtime: worker processes, per-node meshes and layouts, weight sync between layouts.

Modules, by job:

* :mod:`~rlflow.schedulers.runtime.distributed.dist_executor`: ``DistExecutor``, the
  :class:`~rlflow.schedulers.runtime.executor.Executor` over workers (row references, running nodes,
  model state); :func:`rlflow.schedulers.runtime.executor.make_executor` picks it for non-trivial plans.
* :mod:`~rlflow.schedulers.runtime.distributed.pool`: launching workers, connections, messaging.
* :mod:`~rlflow.schedulers.runtime.distributed.protocol`: the commands and replies, and ``DistConfig``.
* :mod:`~rlflow.schedulers.runtime.distributed.worker`: a worker process and its command loop.
* :mod:`~rlflow.schedulers.runtime.distributed.weight_sync`: the worker side of a weight sync (planned
  reallocation and the gather fallback).
* placement, layouts, pipeline, mesh, rows, transfer, launch: plan views, DTensor layouts, pipeline
  stages, process groups, dp shares, row transfers, process helpers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DistConfig", "DistExecutor"]


def __getattr__(name: str) -> Any:
    # lazy: importing the package must not import torch.distributed machinery for the single-process path
    if name == "DistConfig":
        from rlflow.schedulers.runtime.distributed.protocol import DistConfig

        return DistConfig
    if name == "DistExecutor":
        from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor

        return DistExecutor
    raise AttributeError(name)
