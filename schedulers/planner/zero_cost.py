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
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.spec import ZERO_STAGES

__all__ = ["CPU_ADAM_BYTES", "ZeroConfig", "ZeroMemory", "zero_memory"]

ADAM_STATE_BYTES = 12  # K of the ZeRO paper: fp32 master weights + Adam m + v
GRAD_BYTES = 2  # bf16 gradients on the device
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


def zero_memory(params: float, layer_params: float, dp: int, w: int, zero: ZeroConfig) -> ZeroMemory:
    """Per-rank bytes of ZeRO stage ``zero.stage`` (module docstring's table) for a model of ``params``
    parameters whose largest decoder layer has ``layer_params``, over ``dp`` ranks, ``w`` bytes per weight."""
    psi, d = float(params), float(dp)
    weights = psi * w if zero.stage < 3 else psi * w / d + 2 * layer_params * w
    grads = GRAD_BYTES * psi if zero.stage == 1 else GRAD_BYTES * psi / d
    optimizer = ADAM_STATE_BYTES * psi / d
    buckets = 2 * min(psi, BUCKET_ELEMENTS) * GRAD_BYTES if zero.stage < 3 else 0.0
    host = 0.0
    if zero.offload_optimizer:
        host += optimizer + HOST_GRAD_BYTES * psi / d
        optimizer = 0.0
        if zero.stage > 1:
            grads = 0.0
    if zero.offload_param:
        host += psi * w / d
        weights = 2 * layer_params * w
    return ZeroMemory(weights, grads, optimizer, buckets, host)
