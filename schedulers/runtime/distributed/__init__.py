"""The distributed runtime: worker processes, per-node meshes and layouts, weight sync between layouts.

Modules, by job:

* :mod:`~rlflow.schedulers.runtime.distributed.dist_executor`: ``DistExecutor``, the
  :class:`~rlflow.schedulers.runtime.executor.Executor` over workers (row references, running nodes,
  model state); :func:`rlflow.schedulers.runtime.choose_executor.make_executor` picks it for
  non-trivial plans.
  :mod:`~rlflow.schedulers.runtime.distributed.held_rows`: its row references (source puts, readers
  left, dp shares, pulls); :mod:`~rlflow.schedulers.runtime.distributed.node_reports`: what it makes of
  the replies (outputs, combined metrics, weight-sync records).
* :mod:`~rlflow.schedulers.runtime.distributed.pool`: launching workers, connections, messaging.
* :mod:`~rlflow.schedulers.runtime.distributed.protocol`: the commands and replies, and ``DistConfig``.
* :mod:`~rlflow.schedulers.runtime.distributed.worker`: a worker process (entry points) and its command
  loop; :mod:`~rlflow.schedulers.runtime.distributed.worker_state`: a worker's state and one method per
  command; :mod:`~rlflow.schedulers.runtime.distributed.hosted`: the instances, contexts and engines it
  builds; :mod:`~rlflow.schedulers.runtime.distributed.replicas`: instances released to their vLLM
  engines between syncs.
* :mod:`~rlflow.schedulers.runtime.distributed.sync_routes`: how each weight sync runs, decided at
  start-up; :mod:`~rlflow.schedulers.runtime.distributed.sync_runner`: a worker's part of a weight sync.
* :mod:`~rlflow.schedulers.runtime.distributed.weight_sync`: the worker side of a weight sync (planned
  reallocation and the gather fallback).
* placement, layouts, experts, pipeline, mesh, rows, transfer, launch: plan views, DTensor layouts,
  expert parallel, pipeline stages, process groups, dp shares, row transfers, process helpers.
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
