"""Which slice of each parameter a rank holds under a (mesh, layout) — the sharding convention.

This is the single source of truth for how rlflow shards a Llama-style model; the planner costs
reallocations with it and the distributed runtime shards real modules the same way.

Rank order on a mesh (Megatron-LM convention, Shoeybi et al. 2019 / Narayanan et al. 2021): the tensor
axis varies fastest, then data, then pipeline. Mesh position ``r`` (index into ``devices``) has::

    tp_rank = r % tp;   dp_rank = (r // tp) % dp;   pp_rank = r // (tp * dp)

so a tensor-parallel group is ``tp`` consecutive devices (kept inside a host by the planner).

Tensor parallelism (Megatron-LM column/row parallel linear layers):
  * column-parallel, dim 0 split: ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj``;
  * row-parallel, dim 1 split: ``o_proj``, ``down_proj``;
  * vocabulary-parallel, dim 0 split: ``embed_tokens`` and ``lm_head``;
  * replicated: norms, ``score.weight`` (value/score head [1, hidden]) and anything else.
  Rank ``t`` holds rows/columns ``[t·n/tp, (t+1)·n/tp)``; a split dim not divisible by ``tp`` is a
  PlanError (grouped-query attention with ``kv_heads % tp != 0`` is rejected, not replicated).

Pipeline parallelism: layers are split contiguously; with ``L`` layers and ``pp`` stages the first
``L % pp`` stages get ``L // pp + 1`` layers and the others ``L // pp``. The embedding lives on the first
stage; the final norm and the head (``lm_head`` or ``score``) on the last. A tied head (no ``lm_head``
parameter; the embedding is the output matrix) puts ``embed_tokens`` on both the first and the last stage.

Data parallelism: every dp rank holds the same shards (replicas, as inference and generation use them;
a train node's FSDP sharding over dp is a runtime detail on top of this and not described here).

Expert parallelism (``ep`` > 1, carved out of dp: :mod:`rlflow.schedulers.runtime.distributed.experts`): a
mixture-of-experts block's fused expert tensors (:func:`is_expert_param`: ``...experts.gate_up_proj``
``[E, 2I, H]`` and ``...experts.down_proj`` ``[E, H, I]``) are cut along dim 0 into ``ep`` equal blocks;
the dp rank ``d`` holds block ``d % ep`` (experts ``[j·E/ep, (j+1)·E/ep)``, ``j = d % ep``: its place in its
ep group of ``ep`` consecutive dp ranks), whole over tp (expert tensor parallel size 1). Every other
parameter is sharded as without ep. So a reallocation between ep layouts moves each expert block from a
rank that holds it to the ranks that need it, as it moves tp slices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.plan_spec import Layout

__all__ = [
    "ModelMeta",
    "is_expert_param",
    "mesh_coords",
    "param_shards",
    "shard_groups",
    "shard_rule",
    "stage_layers",
]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_VOCAB = ("embed_tokens", "lm_head")
_EXPERTS = ("gate_up_proj", "down_proj")  # fused expert tensors, ``[E, ...]`` (transformers 5)

Slice = tuple[slice, ...]


@dataclass(frozen=True)
class ModelMeta:
    """What sharding needs beyond shapes: the layer count and whether the head is tied to the embedding."""

    num_layers: int
    tied_head: bool = False


def shard_rule(name: str) -> int | None:
    """The tensor dim split by tensor parallelism for parameter ``name``, or None if replicated."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else name
    if module in _COLUMN or module in _VOCAB:
        return 0
    if module in _ROW:
        return 1
    return None


def is_expert_param(name: str, shape: tuple[int, ...]) -> bool:
    """Whether parameter ``name`` of ``shape`` is a fused expert tensor ``[E, ...]`` that ep splits along
    dim 0: a 3-D ``gate_up_proj`` or ``down_proj`` of an ``experts`` module (transformers 5
    ``Qwen3MoeExperts``, ``MixtralExperts``; the runtime's ``experts.expert_modules`` finds the same)."""
    parts = name.split(".")
    return len(shape) == 3 and len(parts) >= 2 and parts[-1] in _EXPERTS and parts[-2] == "experts"


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """Contiguous layer ranges per pipeline stage (first ``L % pp`` stages take one extra layer).

    Raises:
        PlanError: fewer layers than stages.
    """
    if num_layers < pp:
        raise PlanError(f"{num_layers} layers cannot fill {pp} pipeline stages")
    base, extra = divmod(num_layers, pp)
    out, start = [], 0
    for s in range(pp):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def mesh_coords(position: int, layout: Layout) -> tuple[int, int, int]:
    """(dp_rank, tp_rank, pp_rank) of mesh position ``position`` (see module docstring)."""
    return (position // layout.tp) % layout.dp, position % layout.tp, position // (layout.tp * layout.dp)


def _stages_of(name: str, meta: ModelMeta, pp: int, layer_stage: list[int]) -> tuple[int, ...]:
    match = _LAYER_RE.search(name)
    if match is not None:
        layer = int(match.group(1))
        if layer >= meta.num_layers:
            raise PlanError(f"parameter {name!r} names layer {layer} but the model has {meta.num_layers}")
        return (layer_stage[layer],)
    if "embed_tokens" in name:
        return (0, pp - 1) if meta.tied_head and pp > 1 else (0,)
    return (pp - 1,)  # final norm, lm_head, score head and anything outside the layers


def shard_groups(
    param_shapes: Mapping[str, tuple[int, ...]],
    model_meta: ModelMeta,
    devices: tuple[int, ...],
    layout: Layout,
) -> dict[str, list[tuple[Slice, tuple[int, ...]]]]:
    """Per parameter, its distinct shards and the devices holding each: ``name -> [(slices, devices)]``.

    The same information as ``param_shards`` grouped by shard (replicas together), which is what a
    reallocation needs; see ``param_shards`` for arguments and errors.
    """
    if len(devices) != layout.size:
        raise PlanError(f"layout {layout} needs {layout.size} devices, got {len(devices)}")
    layer_stage = [0] * model_meta.num_layers
    for s, layers in enumerate(stage_layers(model_meta.num_layers, layout.pp)):
        for layer in layers:
            layer_stage[layer] = s
    # holders[pp_rank][tp_rank] = the dp replicas at that (stage, tensor rank), in mesh order.
    holders: list[list[list[int]]] = [[[] for _ in range(layout.tp)] for _ in range(layout.pp)]
    for position, device in enumerate(devices):
        _, tp_rank, pp_rank = mesh_coords(position, layout)
        holders[pp_rank][tp_rank].append(device)
    # the owner tuples, built once per stage (and tensor rank) rather than per parameter
    rank_owners = [[tuple(ranks) for ranks in stage] for stage in holders]
    stage_owners = [tuple(d for ranks in stage for d in ranks) for stage in holders]
    # ep_owners[pp_rank][j]: the devices holding expert block j (dp rank % ep == j, every tp rank)
    ep_owners: list[list[list[int]]] = [[[] for _ in range(layout.ep)] for _ in range(layout.pp)]
    for position, device in enumerate(devices):
        dp_rank, _, pp_rank = mesh_coords(position, layout)
        ep_owners[pp_rank][dp_rank % layout.ep].append(device)
    cuts_of: dict[tuple[tuple[int, ...], int], list[Slice]] = {}  # parameters alike share their slices
    out: dict[str, list[tuple[Slice, tuple[int, ...]]]] = {}
    for name, shape in param_shapes.items():
        stages = _stages_of(name, model_meta, layout.pp, layer_stage)
        if layout.ep > 1 and is_expert_param(name, shape):
            out[name] = _expert_blocks(name, shape, layout.ep, [ep_owners[st] for st in stages])
            continue
        rule = shard_rule(name)
        dim = -1 if rule is None or layout.tp == 1 or rule >= len(shape) else rule  # -1: kept whole
        whole = dim < 0
        if not whole and shape[dim] % layout.tp:
            raise PlanError(
                f"parameter {name!r}: dim {dim} of size {shape[dim]} is not divisible by tensor degree "
                f"{layout.tp}"
            )
        key = (tuple(shape), dim)
        cuts = cuts_of.get(key)
        if cuts is None:
            full = tuple(slice(0, n) for n in shape)
            if whole:
                cuts = [full]
            else:
                step = shape[dim] // layout.tp
                cuts = [
                    (*full[:dim], slice(t * step, (t + 1) * step), *full[dim + 1 :]) for t in range(layout.tp)
                ]
            cuts_of[key] = cuts
        if whole:
            owners = (
                stage_owners[stages[0]] if len(stages) == 1 else sum((stage_owners[st] for st in stages), ())
            )
            out[name] = [(cuts[0], owners)]
        else:
            out[name] = [
                (
                    cut,
                    rank_owners[stages[0]][t]
                    if len(stages) == 1
                    else sum((rank_owners[st][t] for st in stages), ()),
                )
                for t, cut in enumerate(cuts)
            ]
    return out


def _expert_blocks(
    name: str, shape: tuple[int, ...], ep: int, owners: list[list[list[int]]]
) -> list[tuple[Slice, tuple[int, ...]]]:
    """A fused expert tensor's ``ep`` blocks along dim 0 and their holders (``owners[stage][j]``, over the
    parameter's stages).

    Raises:
        PlanError: ``ep`` does not divide the expert count (dim 0).
    """
    if shape[0] % ep:
        raise PlanError(f"parameter {name!r}: ep={ep} does not divide its {shape[0]} experts (dim 0)")
    step = shape[0] // ep
    rest = tuple(slice(0, n) for n in shape[1:])
    return [
        ((slice(j * step, (j + 1) * step), *rest), tuple(d for stage in owners for d in stage[j]))
        for j in range(ep)
    ]


def param_shards(
    param_shapes: Mapping[str, tuple[int, ...]],
    model_meta: ModelMeta,
    devices: tuple[int, ...],
    layout: Layout,
) -> dict[int, dict[str, Slice]]:
    """The slice of every parameter each device holds.

    Args:
        param_shapes: parameter name -> full shape (HF Llama names).
        model_meta: layer count and tied head.
        devices: the mesh, ``len(devices) == layout.size``; position in the tuple is the mesh rank.
        layout: dp/tp/pp/ep degrees (micro-batches are irrelevant here).

    Returns:
        device -> {parameter name -> tuple of ``slice`` (one per dim, integer bounds)}; parameters a device
        does not hold are absent. Index a full tensor with it: ``full[slices]`` is the shard.

    Raises:
        PlanError: mesh size mismatch, fewer layers than stages, a split dim not divisible by tp, or an
            expert count not divisible by ep.
    """
    out: dict[int, dict[str, Slice]] = {d: {} for d in devices}
    for name, groups in shard_groups(param_shapes, model_meta, devices, layout).items():
        for slices, owners in groups:
            for device in owners:
                out[device][name] = slices
    return out
