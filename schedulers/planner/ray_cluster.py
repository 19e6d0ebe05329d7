"""A cluster spec read from a live Ray cluster: ``rlflow plan GRAPH --cluster ray [--address HOST:PORT]``.

:func:`cluster_from_nodes` turns Ray's node table (``ray.nodes()``: alive flag, resources per node) into a
:class:`~rlflow.schedulers.planner.cluster.ClusterSpec`; :func:`read_ray_cluster` connects and reads it.

* A cluster with GPUs: a device is a GPU; hosts are the alive nodes with GPUs, ``devices_per_host`` the
  fewest GPUs on one of them (the spec is homogeneous; the rest of a larger node is left out and the name
  says so). Rates come from the preset of the nodes' accelerator type (Ray's ``accelerator_type:<name>``
  resource: H100, H200, A100); an accelerator without a preset is an error asking for a cluster file.
* A CPU cluster: a device is a worker process of ``WORKER_THREADS`` cores; hosts are the alive nodes,
  ``devices_per_host`` the fewest such workers a node holds, ``cores_per_host`` its cores, the device
  memory the node's memory (Ray's ``memory`` resource) shared by its devices; rates from ``cpu-local``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.cluster import WORKER_THREADS, ClusterSpec
from rlflow.schedulers.planner.cluster_files import load_cluster

__all__ = ["GPU_PRESETS", "cluster_from_nodes", "read_ray_cluster"]

# Ray accelerator type (substring, upper case) -> the preset whose device and link rates it has
GPU_PRESETS = {"H200": "h200-8x", "H100": "h100-8x", "A100": "a100-8x"}


def _accelerator(resources: Mapping[str, float]) -> str:
    """The node's ``accelerator_type:<name>`` resource name, or ``""``."""
    return next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), "")


def cluster_from_nodes(nodes: Sequence[Mapping[str, Any]]) -> ClusterSpec:
    """The cluster spec of Ray's node table ``nodes`` (``ray.nodes()``; dead nodes are ignored).

    Raises:
        PlanError: no alive node with a device, or GPUs of a type no preset describes.
    """
    alive = [n for n in nodes if n.get("Alive")]
    gpu_nodes = [n for n in alive if n.get("Resources", {}).get("GPU", 0) >= 1]
    if gpu_nodes:
        counts = [int(n["Resources"]["GPU"]) for n in gpu_nodes]
        kinds = sorted({_accelerator(n["Resources"]) for n in gpu_nodes})
        preset = next((p for key, p in GPU_PRESETS.items() if any(key in k.upper() for k in kinds)), None)
        if preset is None:
            shown = ", ".join(k or "(not reported)" for k in kinds)
            raise PlanError(
                f"--cluster ray: the Ray cluster's GPUs are {shown}; rlflow has rates for "
                f"{', '.join(GPU_PRESETS)} only: write a cluster file for them (see clusters/h100-8x.yaml)"
            )
        base = load_cluster(preset)
        per_host = min(counts)
        name = f"ray-{kinds[0] or 'gpu'}-{len(gpu_nodes)}x{per_host}"
        if max(counts) > per_host:
            name += f" (nodes hold {min(counts)}-{max(counts)} GPUs; {per_host} used per node)"
        return dataclasses.replace(base, name=name, hosts=len(gpu_nodes), devices_per_host=per_host)
    cpu_nodes = [n for n in alive if n.get("Resources", {}).get("CPU", 0) >= WORKER_THREADS]
    if not cpu_nodes:
        raise PlanError("--cluster ray: the Ray cluster has no alive node with a CPU or GPU")
    cores = [int(n["Resources"]["CPU"]) for n in cpu_nodes]
    per_host = min(cores) // WORKER_THREADS
    memory = min(float(n["Resources"].get("memory", 0.0)) for n in cpu_nodes)
    base = load_cluster("cpu-local")
    device = base.device
    if memory > 0:
        device = dataclasses.replace(device, memory_bytes=memory / per_host)
    name = f"ray-cpu-{len(cpu_nodes)}x{per_host}"
    if max(cores) > min(cores):
        name += f" (nodes hold {min(cores)}-{max(cores)} CPUs; {per_host} workers used per node)"
    return dataclasses.replace(
        base,
        name=name,
        hosts=len(cpu_nodes),
        devices_per_host=per_host,
        cores_per_host=min(cores),
        device=device,
    )


def read_ray_cluster(address: str | None = None) -> ClusterSpec:
    """Connect to the Ray cluster at ``address`` (``HOST:PORT``, ``auto``; ``None``: ``RAY_ADDRESS``, else
    ``auto``) and read its alive nodes (:func:`cluster_from_nodes`); disconnects again if it connected.

    Raises:
        HostError: Ray not installed, or no cluster at the address.
        PlanError: as :func:`cluster_from_nodes`.
    """
    import os

    from rlflow.schedulers.ray_connect import connect, import_ray

    owns = connect(address or os.environ.get("RAY_ADDRESS") or "auto")
    ray = import_ray()
    try:
        nodes = ray.nodes()
    finally:
        if owns:
            ray.shutdown()
    return cluster_from_nodes(nodes)
