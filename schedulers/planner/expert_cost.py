"""Expert parallelism priced: what a layout with ``ep`` > 1 changes in a train or inference node's memory and
time, by the rule the runtime follows (:mod:`rlflow.schedulers.runtime.distributed.experts`).

Notation and units: ``cost.py``. ``Ψₑ`` = the routed experts' parameters (every sparse layer's ``E``
experts, ``ModelShape.expert_params`` each; with ``pp`` > 1 those of the busiest stage's sparse layers),
``Ψ`` the stage's parameters over tp (``memory_cost.stage_params``), ``n_e`` the sparse layers (of a stage).

Which layouts: ``dataflow.layout_rules.layout_problem`` (ep divides dp and the expert count; train,
inference and built-in-loop generate nodes on rlflow's own engine; a mixture-of-experts model). The
runtime then, per tp rank (and per pipeline stage: a stage's dp ranks form its own ep groups, and it
dispatches its own sparse layers):
  * **experts**: an ep group is ``ep`` consecutive data-parallel ranks, rank ``i`` of it holding experts
    ``[i·E/ep, (i+1)·E/ep)`` of every sparse layer, whole (FSDP2 leaves them out: ``ignored_params``) and
    replicated over tp (expert tensor parallel size 1): ``Ψₑ / ep`` parameters per device, with their
    gradients and Adam state (2 + 12 bytes each) on a train node. Every other parameter is where the dense
    layout puts it: ``Ψ − Ψₑ / t`` per device, FSDP2-sharded over dp on a train node (weights, gradients,
    Adam state ``/d``; its all-gathers and reduce-scatters move only these bytes, and the gathered units are
    the layers without their routed experts). At ep = 1 every expert is with the rest (FSDP2-sharded over dp
    and gathered like any parameter), whole over tp too: tensor parallel splits attention, dense MLPs and
    shared experts (``layouts.tp_plan``), not the fused experts.
  * **compute**: a token's FLOPs are unchanged (its ``K`` experts run on the ranks holding them); under
    uniform routing each rank receives as many (token, expert) pairs as it sends, so the compute per rank is
    the ep = 1 compute. Under tp > 1 every tp rank runs the routed experts of the same tokens, so their
    FLOPs are not split ``t`` ways (:func:`expert_tp_flops`).
  * **token dispatch**, per sparse layer per micro-batch forward: the hidden states of every routed copy
    out and the expert outputs back (``comm_cost.moe_all_to_all_time``: two all-to-alls forward, their two
    gradients backward), plus two small exchanges the dispatch needs first (the per-rank split counts,
    ``ep`` int64s, and the routed copies' expert ids, ``n·K`` int64s of which ``(ep − 1)/ep`` leave the
    rank: ``ShardedExperts.forward``), each ``(ep − 1)`` latencies plus its off-rank bytes over the group's
    link (the pairwise-exchange all-to-all, Thakur, Rabenseifner & Gropp 2005, §3.3). A recomputed forward
    (activation recompute) and a no-grad first pass dispatch again. With ``pp`` > 1 the dispatches of a
    micro-batch run stage after stage and overlap across micro-batches as the stages' compute does (1F1B,
    ``pipeline_schedule``): per flush of ``m`` micro-batches ``Σ_s n_s + (m − 1)·max_s n_s`` layer
    dispatches (``n_s``: stage ``s``'s sparse layers; ``m`` the layout's micro-batch count, 1 under a token
    budget, whose count is known per call only: then every pass pays the fill, an upper bound).
  * **generation** (the built-in loop, ``call_cost.generate_cost``): each prefill and decode step is a
    forward dispatching its tokens (:func:`generation_dispatch_time`: per sparse layer, latency-bound at a
    decode step's few rows) plus one lockstep flag; a device reads only its ``E/ep`` experts, those the
    group's ``ep·b`` tokens touch; and the ep group decodes in lockstep, so each of a replica's calls
    lasts until the longest of the group's ``ep·b`` rows ends (``lengths.slowest_replica_steps`` over
    ``ep·b`` rows and ``dp / ep`` groups). Interrupted generation (``segment_cost.py``): every segment
    call's prefill and decode steps pay their dispatch and lockstep (``call_cost.generate_cost``, in the
    segment's prefill and decode seconds).
  * **expert gradients**: once per optimizer step every expert tensor's gradient (``2·n_e`` tensors,
    ``Ψₑ / ep`` parameters, the busiest stage's with ``pp`` > 1: the stages reduce at once) is all-reduced
    over its expert-data-parallel group (the ``dp / ep`` ranks at the same position of every ep group;
    ``experts.reduce_expert_grads``), no collective when ``dp = ep``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.schedulers.planner.comm_cost import collectives_time, moe_all_to_all_time
from rlflow.schedulers.planner.memory_cost import GRAD_BYTES, stage_params
from rlflow.schedulers.realloc.shards import stage_layers

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.plans import Layout, NodePlacement
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = [
    "ExpertSplit",
    "dispatch_time",
    "expert_device_groups",
    "expert_grad_time",
    "expert_split",
    "expert_tp_flops",
    "generation_dispatch_time",
    "pipeline_dispatches",
    "routed_expert_params",
]

ID_BYTES = 8  # int64 split counts and expert ids of the dispatch (``ShardedExperts.forward``)


def routed_expert_params(shape: ModelShape) -> int:
    """``Ψₑ``: parameters of the routed experts of every sparse layer (``E · 3·H·I_e`` each; 0 when dense;
    a shared expert is not routed and stays with the dense parameters)."""
    return len(shape.moe_layers) * shape.num_experts * shape.expert_params


@dataclass(frozen=True)
class ExpertSplit:
    """Parameters per device of a layout, split as the runtime holds them (module docstring).

    Attributes:
        dense: the parameters FSDP2 (a train node) shards over dp and tensor parallel splits as the dense
            layout does: the stage's over tp less, at ep > 1, the routed experts (``Ψ − Ψₑ/t``; ``Ψ`` at
            ep = 1).
        experts: routed-expert parameters each device holds whole at ep > 1 (``Ψₑ / ep``; 0 at ep = 1).
        unit: parameters of the largest FSDP2 unit (a decoder layer, over tp) as it is gathered: without its
            routed experts at ep > 1.
    """

    dense: float
    experts: float
    unit: float

    @property
    def held(self) -> float:
        """Parameters per device: ``dense + experts``."""
        return self.dense + self.experts


def expert_split(shape: ModelShape, layout: Layout) -> ExpertSplit:
    """:class:`ExpertSplit` of ``shape`` under ``layout`` (module docstring)."""
    t, ep = layout.tp, layout.ep
    stage = stage_params(shape, layout)
    if not shape.is_moe:
        return ExpertSplit(stage, 0.0, shape.max_layer_params / t)
    per_layer = shape.num_experts * shape.expert_params
    sparse = set(shape.moe_layers)
    layers: range | list[int] = range(shape.num_hidden_layers)
    if layout.pp > 1:  # the largest stage's layers, as ``stage_params`` takes them
        stages = stage_layers(shape.num_hidden_layers, min(layout.pp, shape.num_hidden_layers))
        layers = max(stages, key=shape.stage_sizes)
    # each layer's parameters but its routed experts, over tp (the experts are whole on every tp rank)
    rests = [(shape.layer_sizes[i] - (per_layer if i in sparse else 0)) / t for i in layers]
    routed = per_layer * sum(1 for i in layers if i in sparse)
    rest = stage - routed / t  # everything but the routed experts, over tp
    if ep == 1:  # every expert with the rest (FSDP2-sharded over dp on a train node), whole over tp
        whole = [r + (per_layer if i in sparse else 0) for i, r in zip(layers, rests, strict=True)]
        return ExpertSplit(rest + routed, 0.0, max(whole))
    return ExpertSplit(rest, routed / ep, max(rests))


def expert_tp_flops(shape: ModelShape, tokens: float, tp: int) -> float:
    """FLOPs of a forward over ``tokens`` tokens that tensor parallel repeats rather than splits: every tp
    rank runs the routed experts of the same tokens (experts replicated over tp), ``(t − 1) ·
    2·tokens·K·3·H·I_e`` per sparse layer on top of the FLOPs split ``t`` ways; 0 at tp = 1 or when dense."""
    return (tp - 1) * 2.0 * tokens * shape.experts_per_token * shape.expert_params * len(shape.moe_layers)


def expert_device_groups(placement: NodePlacement) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the first ep group, the first expert-data-parallel group) of ``placement`` as device ids: the dp
    ranks of tp rank 0 (``devices[: t·d : t]``, the mesh's tp-innermost order) cut as the runtime cuts them
    (``runtime.distributed.experts.ep_groups``, which the planner does not import: ``ep`` consecutive dp
    ranks, and those at the same position of every ep group; ``tests/test_planner_ep.py`` compares the
    two); every tp rank's groups are alike."""
    lay = placement.layout
    dp_ranks = placement.devices[: lay.tp * lay.dp : lay.tp]
    return tuple(dp_ranks[: lay.ep]), tuple(dp_ranks[:: lay.ep])


def _stage_sparse_layers(shape: ModelShape, layout: Layout) -> list[int]:
    """Each pipeline stage's count of sparse layers (one stage at ``pp = 1``; ``realloc.shards``' split)."""
    sparse = set(shape.moe_layers)
    stages = stage_layers(shape.num_hidden_layers, min(layout.pp, shape.num_hidden_layers))
    return [sum(1 for i in r if i in sparse) for r in stages]


def pipeline_dispatches(shape: ModelShape, layout: Layout) -> float:
    """Sparse-layer dispatches one micro-batch pass costs on the critical path: ``n_e`` at ``pp = 1``; with
    pipeline stages ``max_s n_s + (Σ_s n_s − max_s n_s) / m`` (the module docstring's flush, per pass)."""
    counts = _stage_sparse_layers(shape, layout)
    busiest = max(counts)
    return busiest + (sum(counts) - busiest) / max(1, layout.micro_batches)


def dispatch_time(
    cluster: ClusterSpec,
    shape: ModelShape,
    placement: NodePlacement,
    tokens: float,
    trained: float,
    forwards: float,
    slow: float,
    lockstep: bool = False,
) -> float:
    """Seconds of the token dispatch of ``trained`` micro-batch passes with a backward and ``forwards``
    more without one (no-grad first passes, recomputed forwards), each of ``tokens`` tokens per rank,
    through every sparse layer (module docstring); 0 at ep = 1 or for a dense model. ``slow``: the node's
    oversubscription (``comm_cost.collectives_time``). ``lockstep``: ``forwards`` forwards of the built-in
    generation loop (:func:`generation_dispatch_time` each)."""
    ep = placement.layout.ep
    if ep == 1 or not shape.is_moe:
        return 0.0
    if lockstep:
        return forwards * generation_dispatch_time(cluster, shape, placement, tokens, slow)
    group, _ = expert_device_groups(placement)
    layers = pipeline_dispatches(shape, placement.layout)
    metadata = _metadata_time(cluster, shape, group, tokens, slow)
    full = moe_all_to_all_time(cluster, shape, tokens, group, backward=True, slow=slow)
    forward = moe_all_to_all_time(cluster, shape, tokens, group, backward=False, slow=slow)
    return layers * (trained * (full + metadata) + forwards * (forward + metadata))


def _metadata_time(
    cluster: ClusterSpec, shape: ModelShape, group: tuple[int, ...], tokens: float, slow: float
) -> float:
    """One sparse layer's two small exchanges before the dispatch (split counts, expert ids; module
    docstring) for ``tokens`` tokens per rank of the ep group ``group``."""
    ep = len(group)
    link = cluster.link(group)
    ids = tokens * shape.experts_per_token * ID_BYTES * (ep - 1) / ep  # off-rank bytes of the expert ids
    metadata = 2 * (ep - 1) * link.latency + ids / (link.bandwidth * cluster.efficiency.link)
    return metadata * slow / cluster.mesh_slowdown(group)


def generation_dispatch_time(
    cluster: ClusterSpec, shape: ModelShape, placement: NodePlacement, tokens: float, slow: float
) -> float:
    """Seconds of one forward of the built-in generation loop at ep > 1 (a prefill over ``tokens`` tokens
    per rank, or a decode step of ``tokens`` live rows): the token dispatch of every sparse layer (module
    docstring; no backward, and on pipeline stages the stages step one after another, so all ``n_e``
    layers are on the critical path), plus the ep group's lockstep flag (one 8-byte all-reduce a forward:
    ``experts.decode_lockstep``, called once per decode step and once per micro-batch before its
    prefill); 0 at ep = 1 or for a dense model. A decode step's messages are a few KB: latency-bound, each
    exchange ``(ep − 1)`` link latencies."""
    if placement.layout.ep == 1 or not shape.is_moe:
        return 0.0
    group, _ = expert_device_groups(placement)
    forward = moe_all_to_all_time(cluster, shape, tokens, group, backward=False, slow=slow)
    per_layer = forward + _metadata_time(cluster, shape, group, tokens, slow)
    flag = collectives_time(cluster, "all_reduce", 1, ID_BYTES, group, slow)
    return len(shape.moe_layers) * per_layer + flag


def expert_grad_time(
    cluster: ClusterSpec, shape: ModelShape, placement: NodePlacement, steps: int, slow: float
) -> float:
    """Seconds of ``steps`` optimizer steps' expert-gradient all-reduces over the expert-data-parallel
    group (module docstring); 0 at ep = 1, for a dense model, when ``dp = ep``, or for a LoRA model (its
    fused experts are frozen: ``peft`` puts adapters on ``nn.Linear`` layers only, ``adapters.py``)."""
    lay = placement.layout
    if lay.ep == 1 or not shape.is_moe or shape.lora is not None:
        return 0.0
    _, edp = expert_device_groups(placement)
    tensors = 2 * max(_stage_sparse_layers(shape, lay))
    grad_bytes = expert_split(shape, lay).experts * GRAD_BYTES
    return steps * collectives_time(cluster, "all_reduce", tensors, grad_bytes, edp, slow)
