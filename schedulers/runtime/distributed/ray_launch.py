"""The Ray launcher: the workers as Ray actors, one per device, placed with a placement group.

``rlflow run GRAPH --launcher ray [--address HOST:PORT]`` (or ``run.launcher: ray``) starts the
``run.devices`` workers of a plan as actors of :class:`WorkerActor` on a Ray cluster: one placement-group
bundle per device (``{"GPU": 1, "CPU": 1}`` on a cluster with GPUs, ``{"CPU": n}`` on a CPU cluster, ``n`` =
``DistConfig.threads`` or the planner's ``WORKER_THREADS``), strategy ``PACK`` so that consecutive ranks — a
tensor-parallel mesh's devices — share a host where they fit. Once placed, each actor uses the threads of
:func:`~rlflow.schedulers.runtime.threads.per_host_threads`: its node's CPUs (at most the cores the actors'
processes may run on) divided among the actors placed on that node (or the driver's
``RLFLOW_NUM_THREADS``/``OMP_NUM_THREADS``, or ``DistConfig.threads``), one line per node on stderr; the
OpenMP wait settings travel in the actor's ``runtime_env``, so they are in its environment before it
imports torch.
Inside each actor the worker joins torch.distributed (NCCL on GPU, gloo on CPU; rendezvous at rank 0's
host) and then serves the controller exactly as a spawned worker does
(:func:`rlflow.schedulers.runtime.distributed.worker.serve`): commands keep rlflow's socket protocol
(:mod:`rlflow.schedulers.runtime.distributed.protocol`), because a Ray actor call costs several times a
socket round trip per command (measured in ``bench/bench_ray.py``, figures in ``bench/README.md``).

Failure detection: each actor's ``serve`` call is an object reference that a monitor thread waits on;
when it ends (the actor process was killed, or it returned after
:class:`~rlflow.schedulers.runtime.distributed.protocol.Stop`) the rank's sentinel, a pipe the pool waits
on with its connections, becomes readable, and :attr:`RayWorker.cause` holds Ray's reason with the
worker's host and node. The same thread watches the nodes the actors live on
(:class:`~rlflow.schedulers.runtime.distributed.ray_nodes.NodeWatch`, every
:data:`~rlflow.schedulers.runtime.distributed.ray_nodes.PROBE_INTERVAL_S` s): a lost node ends every
worker on it at once, its cause naming the node, its IP and the ranks and pids it held, without waiting
for Ray's health check (~15 s) or a collective's timeout. :meth:`RayWorker.loss` says which kind of
:class:`~rlflow.dataflow.errors.ProcessLost` the pool raises: ``"ray_node"``, or ``"ray_actor"`` for an
actor that died on a node that lives. :class:`RayWorker` offers the ``multiprocessing.Process`` surface
the pool uses (``sentinel``, ``is_alive``, ``exitcode``, ``join``, ``terminate``, ``kill``).

Bad input is found before any actor starts (:func:`prepare`): Ray not installed, an address nothing
answers on within a few seconds (:func:`rlflow.schedulers.ray_connect.connect`), a cluster with fewer free
devices than the plan needs (:func:`check_cluster`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any

from rlflow.dataflow.errors import HostError, NodeError, ProcessLost
from rlflow.schedulers.ray_connect import connect, import_ray
from rlflow.schedulers.runtime.distributed.protocol import DistConfig
from rlflow.schedulers.runtime.distributed.ray_nodes import (
    PROBE_INTERVAL_S,
    NodeWatch,
    bundle,
    device_kind,
    lost_node_message,
    reserved_cpus,
)
from rlflow.schedulers.runtime.threads import allowed_cores, per_host_threads, wait_settings

__all__ = [
    "RayGroup",
    "RayWorker",
    "WorkerActor",
    "check_cluster",
    "prepare",
    "start_workers",
]


def check_cluster(world: int, threads: int) -> str:
    """Check that the connected cluster has ``world`` devices free now; the device kind.

    Raises:
        HostError: fewer free devices than ``world`` (one line: what the plan needs, what the cluster has
            in total and free, its node count).
    """
    ray = import_ray()
    kind = device_kind(ray)
    need = bundle(kind, threads)[kind] * world
    total = ray.cluster_resources().get(kind, 0.0)
    free = ray.available_resources().get(kind, 0.0)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    if free < need:
        per = "1 GPU" if kind == "GPU" else f"{threads} CPU"
        raise HostError(
            f"the plan needs {world} devices ({per} each: {need:g} {kind}s); the Ray cluster has {total:g} "
            f"{kind}s on {nodes} node(s), {free:g} free"
        )
    return kind


class WorkerActor:
    """One worker as a Ray actor (wrapped by ``ray.remote`` in :func:`start_workers`).

    Args:
        env: environment variables to set (the OpenMP wait settings, ``DistConfig.env``; they are also in
            the actor's ``runtime_env``, so in its environment before it imports torch).
    """

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def where(self) -> tuple[str, str, int]:
        """``(host address, Ray node id, pid)`` of this actor."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), os.getpid()

    def cores(self) -> int:
        """Cores this actor's process may run on (its affinity: the host's real cores, which a node's
        declared ``CPU`` resource may exceed)."""
        return allowed_cores()

    def free_port(self) -> int:
        """A TCP port free on this host now (the process-group rendezvous, on rank 0's host)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])

    def serve(
        self,
        rank: int,
        world: int,
        init_method: str,
        address: tuple[str, int],
        authkey: bytes,
        config: DistConfig,
    ) -> None:
        """Join the process group and serve the controller until :class:`Stop` (or the controller is gone)."""
        from rlflow.schedulers.runtime.distributed.worker import join_and_serve

        join_and_serve(rank, world, init_method, address, authkey, config)


class RayWorker:
    """A worker actor seen as a process by the pool: a pipe ``sentinel`` that becomes readable when the
    actor's ``serve`` call ends, ``cause`` (why, with host and node) once it has.

    ``exitcode``: ``None`` while serving, ``0`` after a clean return, ``-1`` after the actor died or its
    node was lost, ``1`` after ``serve`` raised.
    """

    def __init__(self, rank: int, actor: Any, host: str, node: str, pid: int) -> None:
        self.rank = rank
        self.actor = actor
        self.host, self.node, self.pid = host, node, pid
        self.ref: Any = None
        self.exitcode: int | None = None
        self.cause = ""
        self.lost_cause: str | None = None  # "ray_actor" or "ray_node" once known
        self._read, self._write = os.pipe()
        self.sentinel = self._read
        self._done = threading.Event()

    @property
    def where(self) -> str:
        """``host H, Ray node N…, pid P`` (for error messages)."""
        return f"host {self.host}, Ray node {self.node[:12]}, pid {self.pid}"

    def finished(self, error: BaseException | None) -> None:
        """Record the end of ``serve`` (``error``: what ``ray.get`` raised) and wake the pool."""
        if self._done.is_set():
            return
        from ray.exceptions import RayActorError

        if error is None:
            self.exitcode, self.cause = 0, f"the worker actor returned ({self.where})"
        elif isinstance(error, RayActorError):  # the process was killed, or its node lost
            lines = [ln.strip() for ln in str(error).splitlines()]
            reason = next((ln for ln in lines if "died" in ln or "lost" in ln or "killed" in ln), "")
            detail = next((ln for ln in lines if "exit type:" in ln), "")
            if detail:  # e.g. "Worker exit type: SYSTEM_ERROR Worker exit detail: ... End of file."
                detail = detail[detail.index("exit type:") :].split(" Some common causes")[0]
                reason = f"{reason} ({detail})" if reason else detail
            self.exitcode, self.lost_cause = -1, "ray_actor"
            self.cause = f"the Ray actor died ({self.where}): {type(error).__name__}" + (
                f": {reason}" if reason else ""
            )
        else:  # serve raised outside a command (joining the process group, connecting)
            cause = error.__cause__ or error
            self.exitcode = 1
            self.cause = f"the worker actor raised ({self.where}): {type(cause).__name__}: {cause}"
        self._wake()

    def node_lost(self, message: str) -> None:
        """Record that this worker's node was lost (``message``: :func:`lost_node_message`) and wake the
        pool."""
        if self._done.is_set():
            return
        self.exitcode, self.lost_cause, self.cause = -1, "ray_node", message
        self._wake()

    def loss(self) -> str | None:
        """The :class:`~rlflow.dataflow.errors.ProcessLost` cause of this worker's end: ``"ray_node"``,
        ``"ray_actor"`` (also while Ray has not reported yet: the pool saw its connection close), or
        ``None`` when ``serve`` returned or raised (no process lost)."""
        if self.exitcode in (0, 1):
            return None
        return self.lost_cause or "ray_actor"

    def _wake(self) -> None:
        self._done.set()
        with contextlib.suppress(OSError):
            os.write(self._write, b"x")

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        """End the actor's process (Ray SIGKILLs it); the monitor then records the end."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)

    def close_pipe(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class RayGroup:
    """The actors of one pool, their placement group and the monitor thread; :meth:`close` frees them
    (and disconnects from Ray when this group made the connection)."""

    def __init__(self, workers: list[RayWorker], pg: Any, owns_ray: bool) -> None:
        self.workers = workers
        self.pg = pg
        self.owns_ray = owns_ray
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._monitor, name="rlflow-ray-monitor", daemon=True)

    def start_monitor(self) -> None:
        self._thread.start()

    def _monitor(self) -> None:
        """Until every ``serve`` call has ended: record each end, and every :data:`PROBE_INTERVAL_S`
        seconds check the workers' nodes; a lost node ends all its workers (:meth:`_node_lost`)."""
        import ray
        from ray.exceptions import RayActorError

        pending = {w.ref: w for w in self.workers if w.ref is not None}
        try:
            watch = NodeWatch(ray, [w.node for w in self.workers])
        except Exception:  # Ray shut down under us
            return
        probe_at = time.monotonic() + PROBE_INTERVAL_S
        while pending and not self._stop.is_set():
            try:
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.2)
                for ref in ready:
                    worker = pending.pop(ref)
                    try:
                        ray.get(ref)
                        worker.finished(None)
                    except RayActorError as e:  # the actor's process ended: was its node lost with it?
                        why = watch.why_lost(worker.node)
                        if why is None:
                            worker.finished(e)
                        else:
                            self._node_lost(watch, worker.node, why)
                    except Exception as e:  # serve raised
                        worker.finished(e)
                if time.monotonic() >= probe_at:
                    probe_at = time.monotonic() + PROBE_INTERVAL_S
                    for node, why in watch.check().items():
                        self._node_lost(watch, node, why)
            except Exception:  # Ray shut down under us
                return
            pending = {ref: w for ref, w in pending.items() if w.is_alive()}

    def _node_lost(self, watch: NodeWatch, node: str, why: str) -> None:
        """End every worker on Ray node ``node`` (lost because ``why``), one message naming them all."""
        on = [w for w in self.workers if w.node == node]
        message = lost_node_message(watch.nodes[node], why, [w.rank for w in on], [w.pid for w in on])
        for w in on:
            w.node_lost(message)

    def close(self) -> None:
        """Kill every actor, remove the placement group, stop the monitor; idempotent."""
        import ray

        if not ray.is_initialized():
            return
        for w in self.workers:
            w.kill()
        deadline = time.monotonic() + 5.0
        for w in self.workers:  # the monitor records the ends (bounded: a lost node never answers)
            w.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        self._thread.join(2.0)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.pg)
        for w in self.workers:
            w.close_pipe()
        if self.owns_ray:
            ray.shutdown()


def prepare(world: int, config: DistConfig) -> tuple[bool, str]:
    """Connect to ``config.ray_address`` and check it has ``world`` free devices; ``(whether this call
    connected, this driver's address in the cluster)`` (the controller listens there).

    Raises:
        HostError: Ray missing, the cluster unreachable or too small (disconnected again if this call
            connected).
    """
    owns = connect(config.ray_address, local_cpus=world * reserved_cpus(config.threads))
    ray = import_ray()
    try:
        check_cluster(world, reserved_cpus(config.threads))
        return owns, str(ray.util.get_node_ip_address())
    except BaseException:
        if owns:
            ray.shutdown()
        raise


def start_workers(
    world: int, address: tuple[str, int], authkey: bytes, config: DistConfig, owns_ray: bool
) -> RayGroup:
    """Start ``world`` worker actors serving the controller at ``address``; their group (which
    disconnects from Ray when it closes if ``owns_ray``). Call :func:`prepare` first.

    Order: reserve one bundle per rank in a ``PACK`` placement group (ready within
    ``config.start_timeout_s``), one actor per bundle (rank ``r`` in bundle ``r``), then the process-group
    rendezvous on rank 0's host and each actor's ``serve`` call.

    Raises:
        NodeError: the placement group or an actor did not come up within ``config.start_timeout_s``
            (everything started is removed first).
        ProcessLost: an actor died while starting (cause ``ray_actor``).
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    res = bundle(device_kind(ray), reserved_cpus(config.threads))
    pg = placement_group([dict(res) for _ in range(world)], strategy="PACK")
    group = RayGroup([], pg, owns_ray)
    try:
        try:
            ray.get(pg.ready(), timeout=config.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise NodeError(
                f"Ray could not place {world} devices ({res}) within {config.start_timeout_s:.0f} s"
            ) from None
        env = {**wait_settings(os.environ), **config.env}
        remote = ray.remote(WorkerActor)
        actors = [
            remote.options(
                num_cpus=res["CPU"],
                num_gpus=res.get("GPU", 0.0),
                max_restarts=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
            ).remote(env)
            for rank in range(world)
        ]
        where = ray.get([a.where.remote() for a in actors], timeout=config.start_timeout_s)
        group.workers = [RayWorker(r, a, *where[r]) for r, a in enumerate(actors)]
        # a node's cores: its declared CPUs, at most the cores its actors' processes may run on
        node_cpus = {n["NodeID"]: int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes()}
        cores = ray.get([a.cores.remote() for a in actors], timeout=config.start_timeout_s)
        for (_, node, _), n in zip(where, cores, strict=True):
            node_cpus[node] = min(node_cpus[node], n)
        threads = per_host_threads([w[1] for w in where], node_cpus, os.environ, config.threads)
        for node in dict.fromkeys(w[1] for w in where):  # one line per node, in rank order
            r = next(r for r, w in enumerate(where) if w[1] == node)
            line = threads[r].line("per worker", f"Ray node {node[:12]} ({where[r][0]})", wait=env)
            print(line, file=sys.stderr, flush=True)
        port = ray.get(actors[0].free_port.remote(), timeout=config.start_timeout_s)
        init = f"tcp://{where[0][0]}:{port}"
        for r, (w, a) in enumerate(zip(group.workers, actors, strict=True)):
            w.ref = a.serve.remote(
                r, world, init, address, authkey, replace(config, threads=threads[r].threads)
            )
        group.start_monitor()
    except BaseException as e:
        group.close()
        if isinstance(e, ray.exceptions.RayActorError):  # an actor (or its node) lost while starting
            first = (str(e).strip().splitlines() or [""])[0]
            message = f"starting the Ray worker actors failed: {type(e).__name__}: {first}"
            raise ProcessLost(message, "ray_actor") from None
        if isinstance(e, ray.exceptions.RayError):
            raise NodeError(f"starting the Ray worker actors failed: {type(e).__name__}: {e}") from None
        raise
    return group
