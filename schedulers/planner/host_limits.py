"""How many worker processes a run starts on this host, and whether the host can hold them.

On CPU a device is a worker process of the embedded launcher. A plan over ``run.devices = 1000`` devices
may use a handful of them (``plan: auto`` picks the best mesh, not the widest): :func:`used_devices` are
the devices the plan places nodes on, and :func:`compact_devices` renumbers them ``0..k-1`` in order
(``run.devices = k``), so that only ``k`` workers start. CPU devices are interchangeable processes, so
the renumbering changes no mesh's shape nor any rank's role; on CUDA a device id is a GPU
(``rank % device_count``) and the plan is kept as written.

:func:`check_host_workers` refuses, before any process starts, more workers than this host's cores can run
(:data:`MAX_WORKERS_PER_CORE` per allowed core). The memory of each worker process itself is counted by
:func:`rlflow.schedulers.planner.resources.check_plan_memory` (:data:`WORKER_BASE_BYTES` per worker on top
of the plan's bytes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import HostError
from rlflow.schedulers.planner.calibration import host_cores
from rlflow.schedulers.planner.plans import format_devices

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "MAX_WORKERS_PER_CORE",
    "WORKER_BASE_BYTES",
    "check_host_workers",
    "compact_devices",
    "fit_to_host",
    "used_devices",
]

WORKER_BASE_BYTES = 200 * 2**20
"""Bytes of one CPU worker process before its plan's share: the proportional set size (``Pss`` of
``/proc/PID/smaps_rollup``: its private pages plus its share of the pages it shares with the fork server)
peaked at 181 MiB per worker of ``rlflow run examples/grpo.yaml --devices 2 plan=auto`` (tiny models, forked
from the fork server, 2-core host; ``VmRSS`` 397 MiB counts the shared pages whole), rounded up."""

MAX_WORKERS_PER_CORE = 8
"""Worker processes per allowed CPU core at most: each worker runs at least one compute thread and gloo's
threads, and past a few per core every collective waits on the scheduler (a run of 1000 workers on 2 cores
swapped the host for minutes)."""


def used_devices(graph: Graph) -> tuple[int, ...]:
    """The device ids ``graph``'s plan places a node on, ascending (a node the plan leaves out: device 0).
    ``()`` while the plan is ``auto`` (unknown until the planner runs)."""
    if graph.spec.plan == "auto":
        return ()
    devices = {d for name in graph.spec.nodes for d in graph.placement(name).devices}
    return tuple(sorted(devices))


def compact_devices(graph: Graph) -> tuple[Graph, str | None]:
    """``graph`` with the devices its plan uses renumbered ``0..k-1`` in order and ``run.devices = k``, and
    a line saying so; ``(graph, None)`` when the plan uses every device already or is ``auto``.

    Only for CPU devices (worker processes, all alike) started by the embedded launcher; the caller checks.
    """
    used = used_devices(graph)
    spec = graph.spec
    if not used or used == tuple(range(spec.run.devices)):
        return graph, None
    new_id = {d: i for i, d in enumerate(used)}
    placements = {name: graph.placement(name) for name in spec.nodes}
    plan = {
        name: dataclasses.replace(p, devices=tuple(new_id[d] for d in p.devices))
        for name, p in placements.items()
    }
    run = dataclasses.replace(spec.run, devices=len(used))
    compacted = type(graph).from_spec(dataclasses.replace(spec, plan=plan, run=run), graph.registry)
    k = len(used)
    start = "running in this process" if k == 1 else f"starting {k} worker processes"
    line = (
        f"rlflow: the plan uses {k} of run.devices={spec.run.devices} devices ({format_devices(used)}): "
        f"{start}, as device{'s' if k != 1 else ''} {format_devices(tuple(range(k)))}"
    )
    return compacted, line


def check_host_workers(graph: Graph, cores: int) -> None:
    """Refuse, before any process starts, a CPU run whose worker processes (``run.devices``, after
    :func:`compact_devices`) are more than :data:`MAX_WORKERS_PER_CORE` per core of the ``cores`` this
    process may run on.

    Raises:
        HostError: one line naming the graph file, ``run.devices``, the workers, the cores and the limit.
    """
    workers, limit = graph.spec.run.devices, MAX_WORKERS_PER_CORE * max(1, cores)
    if workers <= 1 or workers <= limit:
        return
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    raise HostError(
        f"{src}run.devices: the plan needs {workers} worker processes (on CPU a device is a process), more "
        f"than this host can run: {cores} core{'s' if cores != 1 else ''} × {MAX_WORKERS_PER_CORE} workers "
        f"per core = {limit}; use fewer devices (run.devices) or a plan over fewer of them"
    )


def fit_to_host(graph: Graph, cores: int | None = None) -> tuple[Graph, str | None]:
    """For a CPU run of the embedded launcher: :func:`compact_devices` then :func:`check_host_workers`
    (``cores``: default this process's allowed cores); any other run, and a ``plan: auto`` not yet resolved,
    as it is. Returns the graph and the
    line saying which devices start (None when all of them do).

    Raises:
        HostError: more worker processes than this host's cores can run (:func:`check_host_workers`).
    """
    import torch  # lazily: the rest of the planner is torch-free

    if graph.spec.plan == "auto" or torch.cuda.is_available() or graph.spec.run.launcher != "embedded":
        return graph, None  # `plan: auto`: checked once the planner has chosen the devices
    graph, line = compact_devices(graph)
    check_host_workers(graph, host_cores() if cores is None else cores)
    return graph, line
