"""Ray nodes seen by the controller: which hold the workers, which were lost, and a restart's wait for
the devices a plan needs.

Ray's own verdict on a node comes late: its control store (GCS) marks a node dead once the node misses its
health checks, ``health_check_period_ms`` × ``health_check_failure_threshold`` (3 s × 5, ~15 s, by default),
and an actor there is reported dead only then. A node's raylet, killed or crashed, stops listening at
once; so :class:`NodeWatch` also knocks on each raylet's port (a TCP connect): refused, the raylet is gone
(measured on one host: refused at once, while the GCS took 15 s); no answer within :data:`PROBE_TIMEOUT_S`
on :data:`SILENT_PROBES` probes in a row, its host is gone. The Ray launcher's monitor runs the watch every
:data:`PROBE_INTERVAL_S` seconds while the controller waits on anything, so a lost node is named within
about a second, whatever the workers are doing (no collective timeout involved):
:mod:`rlflow.schedulers.runtime.distributed.ray_launch`.

A restart after a lost node or actor (:func:`wait_for_devices`) waits, bounded, until the cluster again
holds the plan's devices: Ray places the same plan on whichever nodes are alive. It does not re-plan a run
with a checkpoint for fewer devices, ``plan: auto`` included: a checkpoint's weights are stored whole, but
each worker's optimizer and scheduler shards and node random generators are stored per rank of the plan
that wrote it (:meth:`~rlflow.schedulers.runtime.distributed.dist_executor.DistExecutor.state_dict`), and
a run under another plan cannot load them (``PlanError``). Only ``plan: auto`` with no checkpoint yet (the
restart starts the run again) is re-planned for the devices left.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from types import ModuleType

from rlflow.dataflow.errors import ProcessLost
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.planner.cluster import WORKER_THREADS

__all__ = [
    "PROBE_INTERVAL_S",
    "PROBE_TIMEOUT_S",
    "SILENT_PROBES",
    "NodeWatch",
    "RayNode",
    "bundle",
    "device_kind",
    "lost_node_message",
    "probe_raylet",
    "ray_nodes",
    "reserved_cpus",
    "wait_for_devices",
]

PROBE_INTERVAL_S = 0.5  # how often the launcher's monitor checks the workers' nodes
PROBE_TIMEOUT_S = 1.0  # a raylet's port must accept a TCP connection within this
SILENT_PROBES = 2  # probes in a row without an answer (no refusal either) before a node counts as lost
GCS_EVERY_S = 2.0  # how often the watch also reads Ray's own node table (one GCS request)
RESTART_POLL_S = 0.5  # how often a restart's wait looks at the cluster again


def device_kind(ray: ModuleType) -> str:
    """``"GPU"`` if the cluster has GPUs (a device is a GPU), else ``"CPU"`` (a device is a worker
    process with its CPU cores)."""
    return "GPU" if ray.cluster_resources().get("GPU", 0) >= 1 else "CPU"


def reserved_cpus(threads: int | None) -> int:
    """CPUs one worker's bundle reserves on a CPU cluster: ``threads`` (``DistConfig.threads``), else
    ``WORKER_THREADS``."""
    return WORKER_THREADS if threads is None else threads


def bundle(kind: str, threads: int) -> dict[str, float]:
    """The resources of one device's placement-group bundle (``threads``: its CPUs on a CPU cluster)."""
    return {"GPU": 1.0, "CPU": 1.0} if kind == "GPU" else {"CPU": float(threads)}


@dataclass(frozen=True)
class RayNode:
    """One node of Ray's node table: its id (hex), IP, its raylet's port, and whether the GCS holds it
    alive."""

    node_id: str
    ip: str
    port: int
    alive: bool

    @property
    def name(self) -> str:
        """``Ray node <first 12 hex digits of its id> (<IP>)``, as error messages name it."""
        return f"Ray node {self.node_id[:12]} ({self.ip})"


def ray_nodes(ray: ModuleType) -> dict[str, RayNode]:
    """Node id -> :class:`RayNode`, from ``ray.nodes()`` (one GCS request)."""
    return {
        n["NodeID"]: RayNode(
            n["NodeID"], n["NodeManagerAddress"], int(n["NodeManagerPort"]), bool(n["Alive"])
        )
        for n in ray.nodes()
    }


def probe_raylet(ip: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Knock on a raylet's port: ``"answers"`` (a TCP connection accepted within ``timeout_s`` seconds),
    ``"refused"`` (nothing listens there: the raylet is gone) or ``"silent"`` (no answer: the host may be
    gone, or slow)."""
    try:
        socket.create_connection((ip, port), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return "refused"
    except OSError:  # a timeout, or an unreachable host or network
        return "silent"
    return "answers"


class NodeWatch:
    """Watches the Ray nodes a run's workers live on; :meth:`check` names the ones lost since.

    Args:
        ray: the ``ray`` module (connected).
        node_ids: the nodes to watch (hex ids, as ``ray.get_runtime_context().get_node_id()`` gives).
        probe: how a raylet is probed (:func:`probe_raylet`; a test may pass another).
    """

    def __init__(
        self, ray: ModuleType, node_ids: Iterable[str], probe: Callable[[str, int], str] = probe_raylet
    ) -> None:
        self._ray = ray
        self._probe = probe
        table = ray_nodes(ray)
        self.nodes = {i: table[i] for i in dict.fromkeys(node_ids) if i in table}
        self._silent = dict.fromkeys(self.nodes, 0)
        self._lost: set[str] = set()
        self._gcs_at = time.monotonic()

    def why_lost(self, node_id: str) -> str | None:
        """Probe one node now: why it counts as lost (its raylet refused the connection, stayed silent
        :data:`SILENT_PROBES` times in a row, or the GCS marked the node dead), or ``None`` while it
        lives. A node already reported stays lost."""
        node = self.nodes.get(node_id)
        if node is None:
            return None
        state = self._probe(node.ip, node.port)
        self._silent[node_id] = self._silent[node_id] + 1 if state == "silent" else 0
        if state == "refused":
            return f"its raylet refuses connections at {node.ip}:{node.port}"
        if self._silent[node_id] >= SILENT_PROBES:
            return (
                f"its raylet at {node.ip}:{node.port} did not answer {SILENT_PROBES} probes of "
                f"{PROBE_TIMEOUT_S:g} s"
            )
        if not node.alive:
            return "Ray marked it dead (its health checks failed)"
        return None

    def check(self) -> dict[str, str]:
        """Probe every watched node not reported yet (and, every :data:`GCS_EVERY_S` seconds, re-read the
        GCS's table); node id -> why, for the nodes lost since the last call."""
        if time.monotonic() - self._gcs_at >= GCS_EVERY_S:
            self._gcs_at = time.monotonic()
            table = ray_nodes(self._ray)
            for i, node in self.nodes.items():
                self.nodes[i] = table.get(i, RayNode(i, node.ip, node.port, alive=False))
        lost = {}
        for i in self.nodes:
            if i in self._lost:
                continue
            why = self.why_lost(i)
            if why is not None:
                self._lost.add(i)
                lost[i] = why
        return lost


def lost_node_message(node: RayNode, why: str, ranks: Collection[int], pids: Collection[int]) -> str:
    """One line naming a lost node, why it counts as lost, and the worker ranks and pids it held::

    Ray node 1507a909e1a2 (192.0.2.2) was lost (its raylet refuses connections at 192.0.2.2:46390);
    worker ranks [1] lived there (pids [26971])
    """
    return f"{node.name} was lost ({why}); worker ranks {sorted(ranks)} lived there (pids {sorted(pids)})"


def wait_for_devices(
    graph: Graph,
    error: BaseException,
    deadline: float,
    address: str | None = None,
    checkpoint: bool = True,
    threads: int | None = None,
    say: Callable[[str], None] | None = None,
) -> Graph:
    """A restart's wait after a lost Ray node or actor: until the connected Ray cluster's alive nodes have
    the plan's ``run.devices`` devices free again (the same plan, placed by Ray on whichever nodes hold
    them), at most until ``deadline`` (``time.monotonic`` seconds); the graph to restart with.

    Re-planned only where nothing stored per rank is lost: ``plan: auto`` and no ``checkpoint`` to resume
    from (the run directory has none yet: the restart starts the run again) re-plans for the devices the
    alive nodes have free (``run.devices`` lowered; the planner then searches again), else the graph is
    returned unchanged.
    ``address``: the cluster (``--address``; ``None``: the connected one, else ``RAY_ADDRESS``). Any other
    error, another launcher, or a local Ray instance started for the run (neither: it starts afresh): the
    graph at once. While a node the GCS still holds alive does not answer on its raylet's port (lost, not
    marked dead yet: Ray could place a bundle there, and counts its free devices), the wait goes on. One
    line (``say``; default: stderr) when it must wait, one when the devices are back or it re-planned.
    ``threads``: the CPUs a worker reserves on a CPU cluster (``DistConfig.threads``; ``None``: the
    launcher's default).

    Raises:
        HostError: the cluster cannot be reached (its head lost too).
        ProcessLost: the devices were not back by ``deadline`` (``error``'s cause; naming what the plan
            needs, what the alive nodes have free, and the nodes lost): the run stops.
    """
    if not isinstance(error, ProcessLost) or error.cause not in ("ray_node", "ray_actor"):
        return graph
    if graph.spec.run.launcher != "ray":
        return graph
    from rlflow.schedulers.ray_connect import connect, import_ray

    tell = say or (lambda line: print(line, file=sys.stderr, flush=True))
    ray = import_ray()
    if not ray.is_initialized() and not (address or os.environ.get("RAY_ADDRESS")):
        return graph
    ours = connect(address)
    world = graph.spec.run.devices
    replan = graph.spec.plan == "auto" and not checkpoint
    why_not = (
        "not re-planned for fewer devices: a checkpoint's optimizer state is stored per rank of its plan"
        if not replan
        else "plan: auto is re-planned for fewer devices once the lost node is marked dead"
    )
    try:
        waited = False
        while True:
            short = _shortfall(ray, world, reserved_cpus(threads))
            if not short.missing:
                if waited:
                    tell(f"rlflow: restart: the Ray cluster has the plan's devices again: {short.text}")
                return graph
            if replan and not short.quiet and short.devices >= 1:
                tell(
                    f"rlflow: restart: plan: auto re-planned for the {short.devices} device(s) the Ray "
                    f"cluster's alive nodes have free ({short.text}; no checkpoint yet: the run starts again)"
                )
                run = dataclasses.replace(graph.spec.run, devices=short.devices)
                return Graph.from_spec(dataclasses.replace(graph.spec, run=run))
            if time.monotonic() >= deadline:
                raise ProcessLost(
                    f"restart: the Ray cluster did not get back the devices the plan needs in time: "
                    f"{short.text}; lost: {', '.join(short.lost) or 'none'} ({why_not})",
                    error.cause,
                )
            if not waited:
                left = max(0.0, deadline - time.monotonic())
                tell(f"rlflow: restart: waiting up to {left:.0f} s for Ray devices: {short.text} ({why_not})")
                waited = True
            time.sleep(RESTART_POLL_S)
    finally:
        if ours:
            ray.shutdown()


@dataclass(frozen=True)
class _Shortfall:
    """The cluster against a plan: ``text`` (what the plan needs, what the alive nodes have free),
    ``missing`` (devices are missing, or a node does not answer), ``quiet`` (a node the GCS holds alive
    does not answer: its free devices are not real), ``devices`` (whole devices free), ``lost`` (the nodes
    lost, named)."""

    text: str
    missing: bool
    quiet: bool
    devices: int
    lost: list[str]


def _shortfall(ray: ModuleType, world: int, threads: int) -> _Shortfall:
    kind = device_kind(ray)
    per = bundle(kind, threads)[kind]
    table = ray_nodes(ray)
    quiet = [n for n in table.values() if n.alive and probe_raylet(n.ip, n.port) != "answers"]
    free = float(ray.available_resources().get(kind, 0.0))
    alive = sum(1 for n in table.values() if n.alive) - len(quiet)
    unit = "1 GPU" if kind == "GPU" else f"{threads} CPU"
    text = (
        f"the plan needs {world} devices ({unit} each: {per * world:g} {kind}s), the {alive} alive node(s) "
        f"have {free:g} free"
    )
    lost = [f"{n.name}, not answering" for n in quiet] + [n.name for n in table.values() if not n.alive]
    missing = bool(quiet) or free < per * world
    return _Shortfall(text, missing, bool(quiet), int(free // per), lost)
