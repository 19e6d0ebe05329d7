"""DeepSpeed ZeRO for the cost model: a train node's per-rank memory, collectives and CPU offload.

A train node with ``engine: deepspeed`` runs ZeRO stage ``zero_stage`` (1, 2 or 3) over its data-
parallel group (tensor and pipeline degree 1), optionally with the optimizer state (``offload_optimizer``)
and, at stage 3, the parameters (``offload_param``) in host memory. Notation: ``Ψ`` parameters of the
model, ``d`` data-parallel ranks, ``w`` bytes per weight (the model's dtype), ``K = 12`` bytes of Adam
state per parameter (fp32 master weights, momentum and variance), gradients in 2 bytes (bf16).

Memory per rank (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §5.1 and Figure 1: ``P_os``, ``P_os+g``, ``P_os+g+p``):

  ============  ===========================  ============  ==========
  stage         weights                      gradients     optimizer
  ============  ===========================  ============  ==========
  1 (P_os)      ``Ψ·w``                      ``2Ψ``        ``KΨ/d``
  2 (P_os+g)    ``Ψ·w``                      ``2Ψ/d``      ``KΨ/d``
  3 (P_os+g+p)  ``Ψ·w/d + 2·layer·w``        ``2Ψ/d``      ``KΨ/d``
  ============  ===========================  ============  ==========

Stage 3 holds the layer being computed and the one prefetched, gathered (as FSDP2 does; DeepSpeed's
``stage3_prefetch_bucket_size``). Stages 1 and 2 add DeepSpeed's communication buckets,
``reduce_bucket_size`` and ``allgather_bucket_size`` (default ``5e8`` elements each, DeepSpeed
configuration reference, "ZeRO optimizations"): ``2 · min(Ψ, 5e8) · 2`` bytes.

CPU offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", §4; Rajbhandari
et al. 2021, "ZeRO-Infinity", §5): ``offload_optimizer`` keeps the optimizer partition (``KΨ/d``) and an
fp32 gradient partition (``4Ψ/d``) in host memory and runs Adam on the CPU; the device keeps its weights
and, at stage 1, its full gradients (stages 2/3 move each reduced partition to the host). ``offload_param``
(stage 3 only) keeps the weight partition (``Ψ·w/d``) in host memory; the device holds only the gathered
layers.

Communication of one train node (ZeRO paper §7: stages 1/2 move ``2Ψ`` per step, as data-parallel all-
reduce does; stage 3 ``3Ψ``): stage 1 reduce-scatters the gradients once per optimizer step (gradient
accumulation keeps them whole) and all-gathers the updated weights; stage 2 reduce-scatters every micro-
batch's gradients (each rank keeps only its partition) and all-gathers the weights per step; stage 3
all-gathers the weights forward and again backward and reduce-scatters the gradients, every micro-batch
(as the runtime's FSDP2). Each collective is issued per layer bucket (``L + 1`` messages).

Offload time per rank (host link: PCIe, ``HostSpec.pcie_bandwidth``): ``offload_optimizer`` sends the
gradient partition to the host (``2Ψ/d`` bytes: per micro-batch at stages 2/3, per step at stage 1),
runs CPU Adam over ``Ψ/d`` parameters streaming :data:`CPU_ADAM_BYTES` per parameter at the host's
memory bandwidth shared by its devices, and sends the updated weights back (``Ψ·w/d`` per step); the
device's own Adam step is not run. ``offload_param`` copies the weight partition host → device before each
all-gather (forward and backward of every micro-batch, and the first pass). Transfers are priced without
overlap (an upper bound: DeepSpeed overlaps part of them).

A LoRA model (``ModelShape.lora``): ``Ψ`` counts its stored weights (base + adapters), while gradients,
Adam state, buckets, the reduce-scatters, a stage 1/2 step's gather of the updated weights and CPU
offload's optimizer traffic count its trained parameters only (``ModelShape.trainable_params``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.node_spec import ZERO_STAGES
from rlflow.schedulers.planner.call_cost import NodeCost, call_terms, micro_batch_work, trained_tensors
from rlflow.schedulers.planner.comm_cost import collectives_time
from rlflow.schedulers.planner.memory_cost import (
    GRAD_BYTES,
    OPTIM_BYTES,
    MemoryBreakdown,
    stage_params,
    train_activations,
)

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.plans import NodePlacement
    from rlflow.schedulers.planner.problem import PlanNode
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = ["CPU_ADAM_BYTES", "ZeroConfig", "ZeroMemory", "zero_memory", "zero_train_cost"]

# the ZeRO paper's K (Adam state) and gradient bytes: memory_cost.OPTIM_BYTES, GRAD_BYTES
HOST_GRAD_BYTES = 4  # the fp32 gradient partition offload keeps on the host
BUCKET_ELEMENTS = 5e8  # DeepSpeed's default reduce_bucket_size and allgather_bucket_size
# CPU Adam per parameter: reads fp32 weight, gradient, m, v (16 B), writes weight, m, v (12 B).
CPU_ADAM_BYTES = 28


@dataclass(frozen=True)
class ZeroConfig:
    """A train node's DeepSpeed ZeRO settings (the node's ``zero_stage``, ``offload_optimizer``,
    ``offload_param``).

    Raises:
        PlanError: a stage outside 1–3, or ``offload_param`` below stage 3.
    """

    stage: int = 3
    offload_optimizer: bool = False
    offload_param: bool = False

    def __post_init__(self) -> None:
        if self.stage not in ZERO_STAGES:
            raise PlanError(f"zero_stage {self.stage!r} is not one of {ZERO_STAGES}")
        if self.offload_param and self.stage != 3:
            raise PlanError(
                f"offload_param needs zero_stage 3 (only it partitions the parameters), got {self.stage}"
            )

    def __str__(self) -> str:
        kinds = (("optimizer", self.offload_optimizer), ("param", self.offload_param))
        offload = [what for what, on in kinds if on]
        return f"zero{self.stage}" + (f"+offload({','.join(offload)})" if offload else "")


@dataclass(frozen=True)
class ZeroMemory:
    """Bytes per rank of a ZeRO train node's model state: on the device (``weights``, ``grads``,
    ``optimizer``, ``buckets``) and in host memory (``host``)."""

    weights: float
    grads: float
    optimizer: float
    buckets: float
    host: float


def zero_memory(
    params: float, layer_params: float, dp: int, w: int, zero: ZeroConfig, trained: float | None = None
) -> ZeroMemory:
    """Per-rank bytes of ZeRO stage ``zero.stage`` (module docstring's table) for a model of ``params``
    parameters whose largest decoder layer has ``layer_params``, over ``dp`` ranks, ``w`` bytes per weight;
    gradients, Adam state and buckets for ``trained`` of them (default: all; a LoRA model's adapters,
    ``ModelShape.trainable_params``: its frozen base has neither gradients nor optimizer state)."""
    psi, d = float(params), float(dp)
    phi = psi if trained is None else float(trained)
    weights = psi * w if zero.stage < 3 else psi * w / d + 2 * layer_params * w
    grads = GRAD_BYTES * phi if zero.stage == 1 else GRAD_BYTES * phi / d
    optimizer = OPTIM_BYTES * phi / d
    buckets = 2 * min(phi, BUCKET_ELEMENTS) * GRAD_BYTES if zero.stage < 3 else 0.0
    host = 0.0
    if zero.offload_optimizer:
        host += optimizer + HOST_GRAD_BYTES * phi / d
        optimizer = 0.0
        if zero.stage > 1:
            grads = 0.0
    if zero.offload_param:
        host += psi * w / d
        weights = 2 * layer_params * w
    return ZeroMemory(weights, grads, optimizer, buckets, host)


def zero_train_cost(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, placement: NodePlacement, dispatch_s: float
) -> NodeCost:
    """Seconds and bytes of a train node on DeepSpeed ZeRO (``node.zero``; tp = pp = 1) under ``placement``:
    its collectives, optimizer step, CPU offload and memory per rank (module docstring); compute and fixed
    costs as the built-in train node's (``call_cost.call_terms``); ``dispatch_s``: the controller's round
    trip (``CostModel.dispatch_time``)."""
    zero = node.zero
    assert zero is not None
    c, lay = cluster, placement.layout
    eff, ov = c.efficiency, c.overheads
    d, m, w = lay.dp, lay.micro_batches, shape.dtype_bytes
    devs = placement.devices
    slow = c.mesh_slowdown(devs)
    terms = call_terms(c, node, shape, placement)
    units = terms.units
    steps = node.epochs * node.mini_batches
    work = micro_batch_work(node, shape, d, m, c.device_type)  # m: a token budget's micro-batch count
    m = work.count
    calls = steps * m
    first = m if node.first_pass else 0
    psi = stage_params(shape, lay)  # every parameter: tp = pp = 1
    trained = psi * shape.trainable_share  # a LoRA model: its adapters (+ head), no state for the base
    dp_comm = 0.0
    if d > 1:
        gather = collectives_time(c, "all_gather", units, psi * w, devs, slow)
        # stages 1/2 gather the updated weights after a step: a LoRA model's trained ones only
        updated = collectives_time(c, "all_gather", units, trained * w, devs, slow)
        scatter = collectives_time(c, "reduce_scatter", units, trained * GRAD_BYTES, devs, slow)
        per_step = collectives_time(c, "all_reduce", 2, 16, devs, slow)  # loss normaliser, grad norm
        if zero.stage == 1:  # accumulated gradients reduced once per step, then the new weights gathered
            dp_comm = steps * (scatter + updated)
        elif zero.stage == 2:  # every micro-batch's gradients reduced into their partitions
            dp_comm = calls * scatter + steps * updated
        else:  # weights gathered forward and backward, gradients reduce-scattered, every micro-batch
            dp_comm = calls * (2 * gather + scatter) + first * gather
        dp_comm += steps * per_step
    tensors = trained_tensors(shape, shape.num_hidden_layers)
    part = trained / d  # trained parameters of this rank's partition
    offload = 0.0
    if zero.offload_optimizer:
        host = c.host_spec()
        pcie = host.pcie_bandwidth * eff.link
        # the host's memory bandwidth is shared by this node's ranks on it
        ranks = max(c.host_loads(devs))
        cpu_rate = host.memory_bandwidth * eff.memory / ranks
        moves = calls if zero.stage > 1 else steps  # gradient partitions leave per micro-batch at 2/3
        offload += (moves * GRAD_BYTES * part + steps * part * w) / pcie
        optimizer = steps * (part * CPU_ADAM_BYTES / cpu_rate + tensors * ov.step_tensor_s + ov.step_s)
    else:
        adam_bytes = 2 * part * (w + GRAD_BYTES + OPTIM_BYTES)
        optimizer = slow * steps * (
            adam_bytes / (c.device.memory_bandwidth * (eff.optimizer or eff.memory))
            + tensors * ov.step_tensor_s + ov.step_s
        )  # fmt: skip
    if zero.offload_param:  # the weight partition comes from the host before every gather
        pcie = c.host_spec().pcie_bandwidth * eff.link
        offload += (2 * calls + first) * (psi / d) * w / pcie
    zm = zero_memory(psi, shape.max_layer_params, d, w, zero, trained)
    # the micro-batch at the memory peak (call_cost.micro_batch_work: packed, the budget's tokens)
    layers = shape.num_hidden_layers
    acts = train_activations(node, shape, work.peak_rows, 1, layers, 1, work.peak_seq, c.device_type)
    # DeepSpeed's all-gather bucket holds weights, its reduce bucket gradients: half the buckets each
    mem = MemoryBreakdown(
        zm.weights + zm.buckets / 2, zm.grads + zm.buckets / 2, zm.optimizer, acts, 0.0, host=zm.host
    )
    return NodeCost(
        compute_s=terms.compute_s, tp_comm_s=terms.tp_comm_s, dp_comm_s=dp_comm, pp_comm_s=terms.pp_comm_s,
        bubble_s=terms.bubble_s, optimizer_s=optimizer, decode_s=0.0, overhead_s=terms.overhead_s,
        memory=mem, dispatch_s=dispatch_s, offload_s=offload,
    )  # fmt: skip
