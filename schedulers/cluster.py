"""Cluster files: hosts × devices per host and the rates the cost model prices work with.

A cluster file (YAML) looks like ``examples/clusters/h100-8x.yaml``::

    name: h100-8x
    hosts: 1
    devices_per_host: 8
    device: {name: H100-SXM-80GB, memory_bytes: 80.0e9, peak_flops: 989.0e12, memory_bandwidth: 3.35e12}
    intra_host: {bandwidth: 450.0e9, latency: 3.0e-6}    # NVLink, bytes/s per direction per device
    inter_host: {bandwidth: 50.0e9, latency: 10.0e-6}    # InfiniBand, per device (one NIC per GPU)
    efficiency: {matmul: 0.55, memory: 0.7, link: 0.8, half_tokens: 64}  # fractions of peak reached

Units: bytes, bytes/s, FLOP/s, seconds. ``peak_flops`` is the dense bf16 (GPU) or fp32 (CPU) matmul
rate. ``efficiency`` holds analytic defaults; a profile (``rlflow profile``) replaces them with measured
values for the same hardware. Device ``i`` lives on host ``i // devices_per_host``.
Presets: ``cpu-local``, ``h100-8x``, ``h200-8x``, ``a100-8x`` (``load_cluster("h100-8x", hosts=4)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from dataflow.errors import PlanError

__all__ = ["PRESET_DIR", "ClusterSpec", "DeviceSpec", "Efficiency", "LinkSpec", "load_cluster"]

PRESET_DIR = Path(__file__).resolve().parent.parent / "examples" / "clusters"


# The search enumerates meshes per node; beyond this the candidate lists outgrow memory (the planner's
# target scale is 128 GPUs, ReaL's largest setting).
MAX_PLAN_DEVICES = 1024


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator (or one CPU worker process): memory (bytes), peak matmul FLOP/s, memory bytes/s."""

    name: str
    memory_bytes: float
    peak_flops: float
    memory_bandwidth: float


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth per device and direction (bytes/s) and latency per message (s)."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached: matmul FLOPs, memory streaming (decode), link bandwidth.

    Matmul efficiency saturates with the tokens a device processes per micro-batch ``x``:
    ``matmul · x / (x + half_tokens)`` (small micro-batches leave the device underused); ``rlflow profile``
    fits both numbers from its batch × sequence grid.
    """

    matmul: float = 0.5
    memory: float = 0.7
    link: float = 0.8
    half_tokens: float = 64.0

    def matmul_at(self, tokens: float) -> float:
        """Matmul efficiency at ``tokens`` tokens per micro-batch per device."""
        return self.matmul * tokens / (tokens + self.half_tokens)


@dataclass(frozen=True)
class ClusterSpec:
    """Hosts × devices per host with rates; ``usable_memory_fraction`` leaves room for the allocator."""

    name: str
    hosts: int
    devices_per_host: int
    device: DeviceSpec
    intra_host: LinkSpec
    inter_host: LinkSpec
    efficiency: Efficiency = field(default_factory=Efficiency)
    usable_memory_fraction: float = 0.9

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.devices_per_host < 1:
            raise PlanError(f"cluster {self.name!r}: hosts and devices_per_host must be >= 1")
        if self.hosts * self.devices_per_host > MAX_PLAN_DEVICES:
            raise PlanError(
                f"cluster {self.name!r}: {self.hosts} hosts × {self.devices_per_host} devices is more than "
                f"the planner handles ({MAX_PLAN_DEVICES} devices)"
            )
        if min(self.device.memory_bytes, self.device.peak_flops, self.device.memory_bandwidth) <= 0:
            raise PlanError(f"cluster {self.name!r}: device rates must be positive")

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def memory_capacity(self) -> float:
        """Bytes a plan may use per device."""
        return self.device.memory_bytes * self.usable_memory_fraction

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def link(self, devices: tuple[int, ...] | list[int]) -> LinkSpec:
        """The slowest link class a group of devices communicates over (intra if one host)."""
        hosts = {self.host_of(d) for d in devices}
        return self.intra_host if len(hosts) <= 1 else self.inter_host

    def with_hosts(self, hosts: int) -> ClusterSpec:
        return replace(self, hosts=hosts, name=f"{self.name.split('@')[0]}@{hosts}")

    def with_efficiency(self, efficiency: Efficiency) -> ClusterSpec:
        return replace(self, efficiency=efficiency)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "<cluster>") -> ClusterSpec:
        """Build from a parsed cluster file; raises PlanError naming the missing key."""
        try:
            return cls(
                name=str(data.get("name", Path(source).stem)),
                hosts=int(data.get("hosts", 1)),
                devices_per_host=int(data["devices_per_host"]),
                device=_device(data["device"]),
                intra_host=LinkSpec(**{k: float(v) for k, v in data["intra_host"].items()}),
                inter_host=LinkSpec(**{k: float(v) for k, v in data["inter_host"].items()}),
                efficiency=Efficiency(**{k: float(v) for k, v in (data.get("efficiency") or {}).items()}),
                usable_memory_fraction=float(data.get("usable_memory_fraction", 0.9)),
            )
        except KeyError as err:
            raise PlanError(f"{source}: cluster file lacks key {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise PlanError(f"{source}: bad cluster file: {err}") from None


def _device(data: dict[str, Any]) -> DeviceSpec:
    return DeviceSpec(
        name=str(data["name"]),
        memory_bytes=float(data["memory_bytes"]),
        peak_flops=float(data["peak_flops"]),
        memory_bandwidth=float(data["memory_bandwidth"]),
    )


def load_cluster(name_or_path: str | Path, hosts: int | None = None) -> ClusterSpec:
    """Load a preset by name (``h100-8x``) or a cluster YAML file; ``hosts`` overrides the host count.

    Raises:
        PlanError: unknown preset / unreadable file / missing keys.
    """
    path = Path(name_or_path)
    if not path.exists():
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise PlanError(
            f"cluster {str(name_or_path)!r}: no such file or preset (presets: {', '.join(known)})"
        )
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise PlanError(f"{path}: cannot read cluster file: {err}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a cluster file is a mapping")
    spec = ClusterSpec.from_mapping(data, str(path))
    return spec.with_hosts(hosts) if hosts is not None else spec
