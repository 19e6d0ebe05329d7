"""What a cluster is to the planner: hosts × devices per host and the rates the cost model prices work
with (:class:`ClusterSpec` and its parts: device, links, host, efficiencies, the runtime's fixed overheads,
the vLLM engine's rates). Reading cluster files and presets, and the cluster of this host:
``cluster_files.py``.

Units: bytes, bytes/s, FLOP/s, seconds. ``peak_flops`` is the dense bf16 (GPU) or fp32 (CPU) matmul
rate. ``efficiency`` holds analytic defaults; a profile (``rlflow profile``) replaces them with measured
values for the same hardware, and adds what only a measurement gives: the α-β fit of each collective per
group size (``collectives``), the runtime's fixed overheads (``overheads``) and the host's cores.
Device ``i`` lives on host ``i // devices_per_host``. On CPU clusters, where a device is a worker process,
``cores_per_host`` is set: a host with more busy worker processes than cores slows down proportionally,
``slowdown(busy) = max(1, busy / cores)`` (None: every device computes on its own, as GPUs do).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from rlflow.dataflow.errors import PlanError

# Cores one CPU device stands for: a worker process of a CPU cluster (a Ray bundle's CPUs, a profile's
# measured worker). The runtime's threads per process follow from the cores a plan gives it
# (``schedulers/runtime/threads.py``); a profile is measured and fitted with this many.
WORKER_THREADS = 1

__all__ = [
    "COLLECTIVES",
    "MAX_PLAN_DEVICES",
    "WORKER_THREADS",
    "ClusterSpec",
    "DeviceSpec",
    "Efficiency",
    "EngineRates",
    "HostSpec",
    "LinkSpec",
    "Overheads",
    "human_bytes",
    "ring_shape",
]

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
    """A link class: bandwidth per device and direction (bytes/s), latency per message (s: per ring step
    of a collective, per point-to-point message) and ``collective_latency``, seconds once per collective
    call on it (NCCL's base latency, :meth:`ClusterSpec.collective_time`; 0 for a profile's fitted link,
    whose per-step latency already holds it)."""

    bandwidth: float
    latency: float
    collective_latency: float = 0.0


# Collectives the cost model prices; bytes are the full tensor (all-gather: the gathered output,
# reduce-scatter: the input before scattering).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def ring_shape(op: str, n: int) -> tuple[float, float]:
    """(latency steps, bandwidth volume factor) of ring collective ``op`` among ``n`` ranks.

    Time = ``steps · latency + volume · bytes / bandwidth`` (+ the link's per-collective latency,
    :meth:`ClusterSpec.collective_time`) (Thakur, Rabenseifner & Gropp 2005,
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
    """The vLLM engine's rates relative to the cost model's roofline (``vllm_cost.py``, "Generation with the
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

    def fixed_costs(self) -> dict[str, float]:
        """The fixed costs this cluster prices, in seconds, keyed as its cluster file spells them
        (``intra_host.latency``, ``inter_host.collective_latency``, ``overheads.launch_layer_s``,
        ``engine.decode_step_s``, ...): the links' latencies, :class:`Overheads`' and the published
        :class:`EngineRates`' seconds, those above 0 only (a cost at 0 is not priced)."""
        costs = {
            f"{name}.{key}": getattr(link, key)
            for name, link in (("intra_host", self.intra_host), ("inter_host", self.inter_host))
            for key in ("latency", "collective_latency")
        }
        costs |= {f"overheads.{f.name}": getattr(self.overheads, f.name) for f in fields(Overheads)}
        if self.engine is not None:
            costs |= {f"engine.{f.name}": getattr(self.engine, f.name) for f in fields(EngineRates)}
        return {k: v for k, v in costs.items() if k.endswith(("_s", "latency")) and 0 < v < math.inf}

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

        Ring model (:func:`ring_shape`) plus, once per call, the link's ``collective_latency``:
        ``steps · latency + collective_latency + volume · bytes / (bandwidth · eff)``, the shape of NCCL's
        own tuning model (a base latency per collective, then a hardware latency per ring step: NVIDIA/nccl
        ``src/graph/tuning.cc``, ``ncclTopoTuneModel``, ``latencies = baseLatencies + nsteps · hwLatency``
        for ring all-reduce, all-gather and reduce-scatter). Inside one host the link is the profile's fit
        for ``op`` at this group size, else the fit of ``op`` at the nearest measured size (its per-step
        latency and bandwidth carried over; the fit's latency holds the per-collective term, its
        ``collective_latency`` is 0), else ``intra_host``; across hosts ``inter_host``. Link efficiency
        scales the analytic links only (a fit already is what the hardware reaches).
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
        return steps * link.latency + link.collective_latency + volume * nbytes / (link.bandwidth * eff)

    def with_hosts(self, hosts: int) -> ClusterSpec:
        return replace(self, hosts=hosts, name=f"{self.name.split('@')[0]}@{hosts}")

    def with_efficiency(self, efficiency: Efficiency) -> ClusterSpec:
        return replace(self, efficiency=efficiency)


def human_bytes(n: float) -> str:
    """``1.5e9`` -> ``"1.40 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.2f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.2f} TiB"
