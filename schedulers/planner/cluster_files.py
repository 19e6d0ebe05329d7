"""Where a cluster comes from: a cluster file or preset (:func:`load_cluster`), and this host
(:func:`local_cluster`, the cluster ``plan: auto`` plans for). A Ray cluster's: ``ray_cluster.py``.

A cluster file (YAML) looks like the preset ``clusters/h100-8x.yaml`` next to this module::

    name: h100-8x
    hosts: 1
    devices_per_host: 8
    device: {name: H100-SXM-80GB, memory_bytes: 80.0e9, peak_flops: 989.0e12, memory_bandwidth: 3.35e12}
    intra_host: {bandwidth: 450.0e9, latency: 3.0e-6}    # NVLink, bytes/s per direction per device
    inter_host: {bandwidth: 50.0e9, latency: 10.0e-6}    # InfiniBand, per device (one NIC per GPU)
    efficiency: {matmul: 0.55, memory: 0.7, link: 0.8, half_tokens: 64}  # fractions of peak reached

Units and meanings: ``cluster.py``. Optional keys: ``host`` (``HostSpec``: ``{memory_bytes,
memory_bandwidth, pcie_bandwidth}``, what DeepSpeed's CPU offload uses), ``overheads`` (``Overheads``,
e.g. ``{dispatch_s: 3.0e-4}``), ``engine`` (``EngineRates``: published vLLM rates) and, for CPU clusters
where a device is a worker process, ``cores_per_host``; a link's ``collective_latency`` (seconds once per
collective call, NCCL's base latency; 0 when left out).
Presets: ``cpu-local``, ``h100-8x``, ``h200-8x``, ``a100-8x`` (``load_cluster("h100-8x", hosts=4)``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from rlflow.dataflow.errors import PlanError, did_you_mean
from rlflow.schedulers.planner.calibration import apply_profile, host_cores
from rlflow.schedulers.planner.cluster import (
    ClusterSpec,
    DeviceSpec,
    Efficiency,
    EngineRates,
    HostSpec,
    LinkSpec,
    Overheads,
)

__all__ = ["PRESETS", "cluster_from_mapping", "load_cluster", "local_cluster"]

# Presets are package data (``--cluster h100-8x`` works after a plain install, no checkout needed).
PRESETS = importlib.resources.files(__package__) / "clusters"


def load_cluster(name_or_path: str | Path, hosts: int | None = None) -> ClusterSpec:
    """Load a preset by name (``h100-8x``) or a cluster YAML file; ``hosts`` overrides the host count.

    Raises:
        PlanError: unknown preset / unreadable file / a mistake in it, naming the file and key.
    """
    given = Path(name_or_path)
    path: Path | Traversable = given if given.exists() else PRESETS / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".yaml") for p in PRESETS.iterdir() if p.name.endswith(".yaml"))
        raise PlanError(
            f"cluster {str(name_or_path)!r}: no such file or preset{did_you_mean(str(name_or_path), known)} "
            f"(presets: {', '.join(known)})"
        )
    try:
        with path.open(encoding="utf-8") as stream:  # a syntax error's mark names the file (stream.name)
            data = yaml.safe_load(stream)
    except (OSError, yaml.YAMLError, ValueError) as err:  # ValueError: an int of 4300+ digits
        raise PlanError(f"{path}: cannot read cluster file: {err}") from None
    if not isinstance(data, dict):
        raise PlanError(f"{path}: a cluster file is a mapping")
    spec = cluster_from_mapping(data, str(path))
    return spec.with_hosts(hosts) if hosts is not None else spec


def cluster_from_mapping(data: dict[str, Any], source: str = "<cluster>") -> ClusterSpec:
    """The cluster a parsed cluster file ``data`` (read from ``source``) describes.

    Raises:
        PlanError: naming ``source`` and the dotted key of an unknown key (with a "did you mean"),
            a missing key, a value that is not a number / integer / mapping, or one out of range.
    """
    read = _Reader(source)
    read.keys(data, "", _TOP_KEYS, required=("devices_per_host", "device", "intra_host", "inter_host"))
    device = read.section(data, "device")
    read.keys(device, "device.", _DEVICE_KEYS, required=_DEVICE_KEYS)
    links: dict[str, LinkSpec] = {}
    for key in ("intra_host", "inter_host"):
        link = read.section(data, key)
        read.keys(link, f"{key}.", _LINK_KEYS, required=("bandwidth", "latency"))
        links[key] = LinkSpec(
            bandwidth=read.number(link, f"{key}.bandwidth", positive=True),
            latency=read.number(link, f"{key}.latency"),
            collective_latency=read.number(link, f"{key}.collective_latency", default=0.0),
        )
    eff = read.section(data, "efficiency", optional=True)
    read.keys(eff, "efficiency.", _EFFICIENCY_KEYS)
    over = read.section(data, "overheads", optional=True)
    read.keys(over, "overheads.", _OVERHEAD_KEYS)
    host = read.section(data, "host", optional=True)
    read.keys(host, "host.", _HOST_KEYS, required=_HOST_KEYS if host else ())
    engine = read.section(data, "engine", optional=True)
    read.keys(engine, "engine.", _ENGINE_KEYS)
    efficiency: dict[str, Any] = {  # a fraction of peak each, but tokens; optimizer None: as memory
        k: None
        if k == "optimizer" and v is None
        else read.number(eff, f"efficiency.{k}", positive=k != "half_tokens")
        for k, v in eff.items()
    }
    fraction = read.number(data, "usable_memory_fraction", default=0.9, positive=True)
    if fraction > 1:
        raise read.fail("usable_memory_fraction", f"must be at most 1, got {fraction:g}")
    return ClusterSpec(
        name=str(data.get("name", Path(source).stem)),
        hosts=read.integer(data, "hosts", default=1),
        devices_per_host=read.integer(data, "devices_per_host"),
        device=DeviceSpec(
            name=str(device["name"]),
            **{k: read.number(device, f"device.{k}", positive=True) for k in _DEVICE_KEYS[1:]},
        ),
        intra_host=links["intra_host"],
        inter_host=links["inter_host"],
        efficiency=Efficiency(**efficiency),
        usable_memory_fraction=fraction,
        cores_per_host=(None if data.get("cores_per_host") is None else read.integer(data, "cores_per_host")),
        overheads=Overheads(
            **{k: read.number(over, f"overheads.{k}", positive=k.endswith("bandwidth")) for k in over}
        ),
        host=HostSpec(**{k: read.number(host, f"host.{k}", positive=True) for k in _HOST_KEYS})
        if host
        else None,
        engine=_engine_section(read, engine, efficiency, data),
    )


_TOP_KEYS = (
    "name",
    "hosts",
    "devices_per_host",
    "device",
    "intra_host",
    "inter_host",
    "efficiency",
    "usable_memory_fraction",
    "cores_per_host",
    "overheads",
    "host",
    "engine",
)
_HOST_KEYS = ("memory_bytes", "memory_bandwidth", "pcie_bandwidth")
_ENGINE_KEYS = tuple(f.name for f in fields(EngineRates) if f.name not in ("measured", "published"))


def _engine_section(
    read: _Reader, engine: Mapping[str, Any], efficiency: Mapping[str, Any], data: Mapping[str, Any]
) -> EngineRates | None:
    """The cluster file's published vLLM rates (``engine`` section; None without one): the keys given,
    the rest :meth:`EngineRates.default`'s (a load at half the memory streaming rate, no fixed costs)."""
    if not engine:
        return None

    def value(key: str, default: float) -> float:
        if key not in engine:
            return default
        return read.number(engine, f"engine.{key}", positive=key in ("prefill_scale", "load_bandwidth"))

    memory_rate = float(data["device"]["memory_bandwidth"]) * float(
        efficiency.get("memory", Efficiency.memory)
    )
    return EngineRates(
        prefill_call_s=value("prefill_call_s", 0.0),
        prefill_scale=value("prefill_scale", 1.0),
        decode_step_s=value("decode_step_s", 0.0),
        decode_row_s=value("decode_row_s", 0.0),
        load_bandwidth=value("load_bandwidth", memory_rate / 2.0),
        verify_s=value("verify_s", 0.0),
        start_s=value("start_s", 0.0),
        published=True,
    )


_DEVICE_KEYS = ("name", "memory_bytes", "peak_flops", "memory_bandwidth")
_LINK_KEYS = ("bandwidth", "latency", "collective_latency")
_EFFICIENCY_KEYS = tuple(f.name for f in fields(Efficiency))
_OVERHEAD_KEYS = tuple(f.name for f in fields(Overheads))


@dataclass(frozen=True)
class _Reader:
    """Checks a parsed cluster file's keys and values; errors name the file and the dotted key."""

    source: str

    def fail(self, key: str, what: str) -> PlanError:
        return PlanError(f"{self.source}: {key}: {what}")

    def keys(
        self, data: Mapping[str, Any], prefix: str, known: tuple[str, ...], required: tuple[str, ...] = ()
    ) -> None:
        for key in data:
            if key not in known:
                if not isinstance(key, str):  # YAML keys may be numbers, null or lists
                    raise self.fail(f"{prefix}{_show(key)}", "unknown key (keys are names)")
                raise self.fail(f"{prefix}{key}", f"unknown key{did_you_mean(key, known)}")
        for key in required:
            if key not in data:
                raise self.fail(f"{prefix}{key}", "missing required key")

    def section(self, data: Mapping[str, Any], key: str, optional: bool = False) -> Mapping[str, Any]:
        value = data.get(key)
        if value is None and optional:
            return {}
        if not isinstance(value, Mapping):
            raise self.fail(key, f"must be a mapping, got {_show(value)}")
        return value

    def number(
        self, data: Mapping[str, Any], key: str, default: float | None = None, positive: bool = False
    ) -> float:
        """The number at dotted ``key`` (its last part looked up in ``data``), >= 0 (> 0 if ``positive``)."""
        value = data.get(key.rpartition(".")[2], default)
        out = self._float(key, value)
        if out < 0 or (positive and out == 0):
            raise self.fail(key, f"must be {'positive' if positive else '>= 0'}, got {_show(value)}")
        return out

    def integer(self, data: Mapping[str, Any], key: str, default: int | None = None) -> int:
        value = data.get(key, default)
        out = self._float(key, value)
        if not math.isfinite(out) or out != int(out):
            raise self.fail(key, f"{_show(value)} is not an integer")
        if out < 1:
            raise self.fail(key, f"must be >= 1, got {_show(value)}")
        return int(out)

    def _float(self, key: str, value: Any) -> float:
        # numeric strings pass: YAML reads ``80e9`` (no dot) as a string
        try:
            if isinstance(value, bool):
                raise TypeError
            out = float(value)
        except OverflowError:  # an int beyond the float range, e.g. 10**400
            raise self.fail(key, "is too large for a number (beyond 1.8e308)") from None
        except (TypeError, ValueError):
            raise self.fail(key, f"{_show(value)} is not a number") from None
        if not math.isfinite(out):
            raise self.fail(key, f"{_show(value)} is not a finite number")
        return out


def _show(value: Any) -> str:
    """A short ``repr`` for messages (``repr`` of an int beyond 4300 digits raises ValueError)."""
    try:
        text = repr(value)
    except ValueError:
        return "an integer of more than 4300 digits"
    return text if len(text) <= 60 else text[:57] + "..."


def local_cluster(devices: int, profile: Path | None = None) -> ClusterSpec:
    """The cluster ``plan: auto`` plans for: this host with ``devices`` devices, fitted to ``profile``
    (:func:`~rlflow.schedulers.planner.calibration.apply_profile`) when one is given.

    CPU: the ``cpu-local`` preset (one worker process per device) with this host's cores, which the workers
    share. CUDA: the preset whose name matches the GPU (``h200-8x``, ``h100-8x``, ``a100-8x``), else
    ``h100-8x``'s rates with the GPU's own memory (bytes).
    Either way one host with ``devices`` devices (``run.devices``: the worker processes the runtime starts).
    """
    import torch  # lazily: the rest of the planner is torch-free

    if not torch.cuda.is_available():
        base = dataclasses.replace(load_cluster("cpu-local"), cores_per_host=host_cores())
    else:
        name = torch.cuda.get_device_name(0)
        preset = next((p for p in ("h200", "h100", "a100") if p in name.lower()), None)
        base = load_cluster(f"{preset}-8x" if preset else "h100-8x")
        if preset is None:
            memory = float(torch.cuda.get_device_properties(0).total_memory)
            device = dataclasses.replace(base.device, name=name, memory_bytes=memory)
            base = dataclasses.replace(base, name=f"local-{name}", device=device)
    if profile is not None:
        base = apply_profile(base, profile)
    return dataclasses.replace(base, hosts=1, devices_per_host=devices)
