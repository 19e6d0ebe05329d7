"""Cluster files: hosts × devices per host and the rates the cost model prices work with.

A cluster file (YAML) looks like the preset ``clusters/h100-8x.yaml`` next to this module::

    name: h100-8x
    hosts: 1
    devices_per_host: 8
    device: {name: H100-SXM-80GB, memory_bytes: 80.0e9, peak_flops: 989.0e12, memory_bandwidth: 3.35e12}
    intra_host: {bandwidth: 450.0e9, latency: 3.0e-6}    # NVLink, bytes/s per direction per device
    inter_host: {bandwidth: 50.0e9, latency: 10.0e-6}    # InfiniBand, per device (one NIC per GPU)
    efficiency: {matmul: 0.55, memory: 0.7, link: 0.8, half_tokens: 64}  # fractions of peak reached

Units: bytes, bytes/s, FLOP/s, seconds. ``peak_flops`` is the dense bf16 (GPU) or fp32 (CPU) matmul
rate. ``efficiency`` holds analytic defaults; a profile (``rlflow profile``) replaces them with measured
values for the same hardware, and adds what only a measurement gives: the α-β fit of each collective per
group size (``collectives``), the runtime's fixed overheads (``overheads``) and the host's cores.
Device ``i`` lives on host ``i // devices_per_host``.

Optional keys: ``host`` (:class:`HostSpec`: ``{memory_bytes, memory_bandwidth, pcie_bandwidth}``, what
DeepSpeed's CPU offload uses), ``overheads`` (:class:`Overheads`, e.g. ``{dispatch_s: 3.0e-4}``) and, for
CPU clusters where a device is a worker process, ``cores_per_host``: a host with more busy worker
processes than cores slows down proportionally, ``slowdown(busy) = max(1, busy / cores)`` (None: every
device computes on its own, as GPUs do).
Presets: ``cpu-local``, ``h100-8x``, ``h200-8x``, ``a100-8x`` (``load_cluster("h100-8x", hosts=4)``).
"""

from __future__ import annotations

import functools
import importlib.resources
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.registry import did_you_mean

# Torch threads per runtime worker process (the runtime's ``DistConfig.threads`` default); a profile is
# measured and fitted with it.
WORKER_THREADS = 1

__all__ = [
    "COLLECTIVES",
    "PRESETS",
    "WORKER_THREADS",
    "ClusterSpec",
    "DeviceSpec",
    "Efficiency",
    "EngineRates",
    "HostSpec",
    "LinkSpec",
    "Overheads",
    "human_bytes",
    "load_cluster",
    "ring_shape",
]

# Presets are package data (``--cluster h100-8x`` works after a plain install, no checkout needed).
PRESETS = importlib.resources.files(__package__) / "clusters"


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
class HostSpec:
    """One host as DeepSpeed's CPU offload uses it: its memory (bytes), its memory bandwidth (bytes/s; CPU
    Adam streams the optimizer state at it, shared by the host's devices) and each device's link to it
    (``pcie_bandwidth``, bytes/s per direction)."""

    memory_bytes: float
    memory_bandwidth: float
    pcie_bandwidth: float


@dataclass(frozen=True)
class LinkSpec:
    """A link class: bandwidth per device and direction (bytes/s) and latency per message (s)."""

    bandwidth: float
    latency: float


# Collectives the cost model prices; bytes are the full tensor (all-gather: the gathered output,
# reduce-scatter: the input before scattering).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def ring_shape(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth volume factor) of ring collective ``op`` among ``n`` ranks.

    Time = ``steps · latency + volume · bytes / bandwidth`` (Thakur, Rabenseifner & Gropp 2005,
    "Optimization of Collective Communication Operations in MPICH", §2; ring all-reduce = reduce-scatter
    + all-gather, Patarasuk & Yuan 2009): all-reduce ``2(n−1)`` steps and ``2(n−1)/n``; all-gather and
    reduce-scatter ``n−1`` and ``(n−1)/n``; broadcast (pipelined chain) ``n−1`` and ``1``.
    """
    if op == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return float(n - 1), (n - 1) / n
    if op == "broadcast":
        return float(n - 1), 1.0
    raise ValueError(f"unknown collective {op!r} (one of {COLLECTIVES})")


@dataclass(frozen=True)
class Overheads:
    """Fixed software costs of the runtime, measured by ``rlflow profile`` (0 or inf: not priced).

    Attributes:
        dispatch_s: seconds from a node's last dependency ending to the node starting on its workers
            (the reply, the controller's bookkeeping, the transfer and run commands; ``rlflow profile``
            reads it off a real run, else one command round trip); paid once per node, outside the node's
            span on its workers.
        dispatch_bandwidth: bytes/s of carrying a batch through that round trip (per direction).
        node_s: seconds per node beyond its calls timed warm: the first call after the worker idled
            (caches cooled) and the node function's own work; ``rlflow profile`` sets it on whole nodes
            of its runtime probe (else on a model call after 20 ms idle).
        call_s: seconds per model forward call beyond its decoder layers' FLOPs: embedding, attention
            masks, rotary tables, final norm, the call's Python and the log-prob read-out of the logits.
        backward_s: the same for the backward pass of a train call.
        decode_s: seconds per generated token (one decode step of the whole batch) beyond the decoder
            layers: the model call with its KV cache and sampling (set on the runtime probe's generate
            node when measured, else on ``generate`` timed in a loop).
        step_s: seconds per optimizer step beyond its calls, Adam's streaming and ``step_tensor_s``: the
            schedule, clipping, the loss's own work, and the caches the optimizer's sweep over the state
            cools for the next call (set on the runtime probe's train node when measured).
        step_tensor_s: seconds per parameter tensor of one optimizer step (AdamW, zero_grad, grad clip)
            beyond streaming the optimizer state at memory bandwidth.
        tp_module_s: seconds per call of a tensor-parallel module (a DTensor projection, embedding or
            head) in a forward pass or a decode step, beyond its FLOPs and collectives (DTensor dispatch).
        tp_module_backward_s: the same in a backward pass.
        fsdp_unit_s: seconds per FSDP2 unit (a wrapped layer or the root) per train micro-batch beyond
            its collectives (hooks, copy-in/out of the gathered parameters).
        launch_layer_s: host seconds to issue one decoder layer's kernels in an eager (not graph-captured)
            forward. A GPU runs the kernels asynchronously, so a decode step of the built-in loop takes the
            larger of its device time and ``layers × launch_layer_s``: eager decoding is host-bound at any
            batch that fits (the GPU presets cite PyTorch's "GPT, Fast"). The vLLM engine captures its
            decode steps in CUDA graphs and does not pay it; neither does a CPU device (no asynchronous
            launches: its profile prices the host's work as compute).
        dtensor_tensor_s: extra seconds per parameter tensor of an optimizer step when the parameters are
            DTensors (FSDP2 or tensor parallel: sharded AdamW and the global-norm clip).
        digest_bandwidth: bytes/s of hashing weights (the weight sync verifies every region it moves).
        rank_skew_s: seconds by which each further rank of a node's mesh starts it later than the first
            (the controller sends the ranks' commands one after another); part of the node's span.
        iteration_s: seconds per iteration the controller spends outside every node (the next batch, its
            source rows, the trace and metrics): between two iterations in the simulator.
    """

    dispatch_s: float = 0.0
    dispatch_bandwidth: float = math.inf
    node_s: float = 0.0
    call_s: float = 0.0
    backward_s: float = 0.0
    decode_s: float = 0.0
    step_s: float = 0.0
    step_tensor_s: float = 0.0
    tp_module_s: float = 0.0
    tp_module_backward_s: float = 0.0
    fsdp_unit_s: float = 0.0
    launch_layer_s: float = 0.0
    dtensor_tensor_s: float = 0.0
    digest_bandwidth: float = math.inf
    rank_skew_s: float = 0.0
    iteration_s: float = 0.0


@dataclass(frozen=True)
class EngineRates:
    """The vLLM engine's rates relative to the cost model's roofline (``cost.py``, "Generation with the
    vLLM engine"), as :class:`Efficiency` and :class:`Overheads` are the built-in loop's: ``rlflow profile``
    times the engine's calls on a small model and ``calibration`` fits them against the roofline at that
    shape, so they carry over to other model shapes: the prefill scales with its FLOPs, the fixed costs
    stay.

    Attributes:
        prefill_call_s: seconds per generate call (a replica's whole batch, one call) beyond its prefill.
        prefill_scale: the engine's prefill seconds per second of the roofline's (its FLOPs at the fitted
            matmul rate): below 1 where the engine's kernels outrun the profile's torch calls.
        decode_step_s: seconds per decode step beyond the step's roofline (weights + KV cache read).
        decode_row_s: seconds per row per decode step beyond it (per-sequence sampling and bookkeeping).
        load_bandwidth: bytes/s of loading a full weight version into the engine
            (``VllmEngine.load_weights``: copy, hand-over and vLLM's ``load_weights``).
        verify_s: seconds of the probe that verifies each load (``VllmEngine.verify``: 4 × 24 tokens
            through the trainer's model and the engine, a fixed cost next to the load).
        start_s: seconds to start one engine (once per run: not part of an iteration's time).
        measured: a profile measured these; False: :meth:`default`, or a cluster file's ``engine`` section
            (published figures, each with its source in the file: :attr:`published`).
        published: the rates come from a cluster file's ``engine`` section.
    """

    prefill_call_s: float = 0.0
    prefill_scale: float = 1.0
    decode_step_s: float = 0.0
    decode_row_s: float = 0.0
    load_bandwidth: float = math.inf
    verify_s: float = 0.0
    start_s: float = 0.0
    measured: bool = False
    published: bool = False

    @classmethod
    def default(cls, overheads: Overheads, memory_rate: float) -> EngineRates:
        """The rates without a measurement: the built-in loop's (the roofline's prefill, ``call_s`` per
        call, ``decode_s`` per step), a load at half the memory streaming rate ``memory_rate`` (bytes/s:
        every byte read and written once), no verify or start cost. The engine is then priced as the built-in
        loop plus its weight load, so ``plan: auto`` chooses vLLM only on measured rates."""
        return cls(
            prefill_call_s=overheads.call_s,
            decode_step_s=overheads.decode_s,
            load_bandwidth=memory_rate / 2.0,
        )


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak reached: matmul FLOPs, memory streaming (decode), link bandwidth, and the
    optimizer step's streaming (None: as ``memory``).

    Matmul efficiency saturates with the tokens a device processes per micro-batch ``x``:
    ``matmul · x / (x + half_tokens)`` (small micro-batches leave the device underused); ``rlflow profile``
    fits both numbers from its batch × sequence grid. Fitted fractions are relative to the cluster file's
    peaks and may exceed 1 where a file's peak is conservative.
    """

    matmul: float = 0.5
    memory: float = 0.7
    link: float = 0.8
    half_tokens: float = 64.0
    optimizer: float | None = None

    def matmul_at(self, tokens: float) -> float:
        """Matmul efficiency at ``tokens`` tokens per micro-batch per device."""
        return self.matmul * tokens / (tokens + self.half_tokens)


# Memo sizes: a search on 1,024 devices visits some thousands of distinct meshes and unions of meshes.
@functools.lru_cache(maxsize=4096)
def _host_counts(devices_per_host: int, devices: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(host, devices of ``devices`` on it) in the order of each host's first device."""
    out: dict[int, int] = {}
    for d in devices:
        host = d // devices_per_host
        out[host] = out.get(host, 0) + 1
    return tuple(out.items())


@functools.lru_cache(maxsize=4096)
def _host_loads(devices_per_host: int, devices: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(n for _, n in _host_counts(devices_per_host, devices)))


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
    cores_per_host: int | None = None
    overheads: Overheads = field(default_factory=Overheads)
    # (collective, group size) -> fitted link (bandwidth, latency per ring step) inside one host
    collectives: Mapping[tuple[str, int], LinkSpec] = field(default_factory=dict, hash=False)
    # busy workers on a host -> measured slowdown (``rlflow profile``); used with ``cores_per_host``
    slowdowns: Mapping[int, float] = field(default_factory=dict, hash=False)
    # the vLLM engine's measured rates (``rlflow profile`` with vLLM installed); None: not measured
    engine: EngineRates | None = None
    # the host CPU offload uses (``host`` key); None: a GPU cluster cannot offload, a CPU one uses itself
    host: HostSpec | None = None

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
        if self.cores_per_host is not None and self.cores_per_host < 1:
            raise PlanError(f"cluster {self.name!r}: cores_per_host must be >= 1")

    @property
    def num_devices(self) -> int:
        return self.hosts * self.devices_per_host

    @property
    def device_type(self) -> str:
        """``cpu`` for a CPU cluster (one whose file sets ``cores_per_host``: a device is a worker process),
        else ``cuda``."""
        return "cpu" if self.cores_per_host is not None else "cuda"

    def engine_rates(self) -> EngineRates:
        """The vLLM engine's rates: measured by a profile or published in the cluster file (:attr:`engine`),
        else :meth:`EngineRates.default` at this cluster's fitted memory streaming rate."""
        if self.engine is not None:
            return self.engine
        return EngineRates.default(self.overheads, self.device.memory_bandwidth * self.efficiency.memory)

    def host_spec(self) -> HostSpec:
        """The host DeepSpeed offloads to: the file's ``host`` section; on a CPU cluster without one the
        devices' own memory (a worker already lives in host memory: copies at its memory bandwidth).

        Raises:
            PlanError: a GPU cluster without a ``host`` section (offload cannot be priced).
        """
        if self.host is not None:
            return self.host
        if self.device_type == "cpu":
            bw = self.device.memory_bandwidth
            return HostSpec(self.device.memory_bytes * self.devices_per_host, bw, bw)
        raise PlanError(
            f"cluster {self.name!r}: CPU offload needs a 'host' section (memory_bytes, memory_bandwidth, "
            "pcie_bandwidth) in the cluster file"
        )

    @property
    def host_capacity(self) -> float:
        """Bytes of host memory a plan may use per host (offloaded state; ``usable_memory_fraction``)."""
        return self.host_spec().memory_bytes * self.usable_memory_fraction

    @property
    def memory_capacity(self) -> float:
        """Bytes a plan may use per device."""
        return self.device.memory_bytes * self.usable_memory_fraction

    def host_of(self, device: int) -> int:
        return device // self.devices_per_host

    def link(self, devices: tuple[int, ...] | list[int]) -> LinkSpec:
        """The slowest link class a group of devices communicates over (intra if one host)."""
        # host_of is monotonic: the group is on one host iff its lowest and highest ids are
        if not devices or self.host_of(min(devices)) == self.host_of(max(devices)):
            return self.intra_host
        return self.inter_host

    def slowdown(self, busy: int) -> float:
        """CPU oversubscription: how much slower work runs with ``busy`` worker processes on one host.

        ``max(1, busy / cores_per_host)``; with measured ``slowdowns`` (``rlflow profile``, other tenants
        of the cores included) their linear interpolation, proportional beyond the largest measured
        count. 1 without ``cores_per_host`` (devices that compute on their own, as GPUs do).
        """
        if self.cores_per_host is None or busy <= 1:
            return 1.0
        if not self.slowdowns:
            return max(1.0, busy / self.cores_per_host)
        table = {1: 1.0, **self.slowdowns}
        lo = max(n for n in table if n <= busy)
        above = [n for n in table if n >= busy]
        if not above:
            return table[lo] * busy / lo
        hi = min(above)
        if hi == lo:
            return table[lo]
        return table[lo] + (table[hi] - table[lo]) * (busy - lo) / (hi - lo)

    def busy_per_host(self, devices: tuple[int, ...] | list[int]) -> dict[int, int]:
        """Host -> how many of ``devices`` (one worker process each) live on it, hosts in the order of
        their first device (memoised per device tuple: the planner asks for the same meshes again and
        again)."""
        return dict(_host_counts(self.devices_per_host, tuple(devices)))

    def host_loads(self, devices: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        """The counts of :meth:`busy_per_host`, ascending (memoised): what a node's cost depends on."""
        return _host_loads(self.devices_per_host, tuple(devices))

    def mesh_slowdown(self, devices: tuple[int, ...] | list[int]) -> float:
        """Slowdown of work that keeps every one of ``devices`` busy: its most loaded host's."""
        if self.cores_per_host is None:  # devices that compute on their own: 1 whatever the load
            return 1.0
        return max((self.slowdown(n) for n in self.host_loads(devices)), default=1.0)

    def collective_time(self, op: str, nbytes: float, devices: tuple[int, ...] | list[int]) -> float:
        """Seconds of collective ``op`` over ``nbytes`` among ``devices`` (0 for one device).

        Ring model (:func:`ring_shape`). Inside one host the link is the profile's fit for ``op`` at this
        group size, else the fit of ``op`` at the nearest measured size (its per-step latency and
        bandwidth carried over), else ``intra_host``; across hosts ``inter_host``. Link efficiency scales
        the analytic links only (a fit already is what the hardware reaches).
        """
        n = len(devices)
        if n <= 1:
            return 0.0
        steps, volume = ring_shape(op, n)
        link, eff = self.link(devices), self.efficiency.link
        if link is self.intra_host:
            sizes = [k for o, k in self.collectives if o == op]
            if sizes:
                link, eff = self.collectives[(op, min(sizes, key=lambda k: (abs(k - n), -k)))], 1.0
        return steps * link.latency + volume * nbytes / (link.bandwidth * eff)

    def with_hosts(self, hosts: int) -> ClusterSpec:
        return replace(self, hosts=hosts, name=f"{self.name.split('@')[0]}@{hosts}")

    def with_efficiency(self, efficiency: Efficiency) -> ClusterSpec:
        return replace(self, efficiency=efficiency)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "<cluster>") -> ClusterSpec:
        """Build from a parsed cluster file.

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
            read.keys(link, f"{key}.", ("bandwidth", "latency"), required=("bandwidth", "latency"))
            links[key] = LinkSpec(
                bandwidth=read.number(link, f"{key}.bandwidth", positive=True),
                latency=read.number(link, f"{key}.latency"),
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
        return cls(
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
            cores_per_host=(
                None if data.get("cores_per_host") is None else read.integer(data, "cores_per_host")
            ),
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
    spec = ClusterSpec.from_mapping(data, str(path))
    return spec.with_hosts(hosts) if hosts is not None else spec


def human_bytes(n: float) -> str:
    """``1.5e9`` -> ``"1.40 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} TiB"
