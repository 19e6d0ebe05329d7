"""The worker side of a weight sync: planned reallocation between a model's instances, gather fallback.

After a train node, :meth:`rlflow.schedulers.runtime.distributed.sync_runner.SyncRunner.sync` moves the new
weights to every other instance of the model. Where the layouts allow it, it runs the pure plan of
:func:`rlflow.schedulers.realloc.planning.plan_reallocation` with
:func:`rlflow.schedulers.realloc.execute.execute_reallocation` (shard-to-shard broadcasts in cached
groups, local copies where a rank holds both; no full-model gather) and checks it with
:func:`rlflow.schedulers.realloc.verify.verify_reallocation`. This module maps a module's parameters to
the plan's shards:

* The plan's shards are :func:`rlflow.schedulers.realloc.shards.param_shards` boxes (Megatron rank order,
  tp fastest; column-parallel dim 0, row-parallel dim 1, vocabulary dim 0, equal aligned blocks). A
  DTensor's local shard box comes from its placements (``compute_local_shape_and_global_offset``); a
  ``ColwiseParallel``/``RowwiseParallel``/vocabulary-parallel parameter is ``Shard(0)``/``Shard(1)`` on the
  ``tp`` mesh dim, chunked equally when divisible, so the boxes agree. The worker does not assume it: at
  start-up every rank compares its boxes with ``param_shards`` (:func:`boxes_match`) and the plan path is
  used only if all ranks agree (else the gather path, with the reason logged).
* A source sharded by FSDP2 over ``dp`` (a train node with dp > 1, possibly over TP: ``_StridedShard`` on
  ``dp``) first re-gathers over ``dp`` only: each parameter is redistributed to ``Replicate()`` on the
  ``dp`` mesh dim, keeping its ``tp`` placement (:func:`source_shards`), which is the ``param_shards`` form
  (every dp replica holds its full tp shard). That is one all-gather inside each dp group, never across tp.
* A target sharded by FSDP2 (two train nodes of one model in different layouts) is not expressed by
  ``param_shards``; such a sync uses the gather path (below).
* A pipeline stage (:mod:`rlflow.schedulers.runtime.distributed.pipeline`) holds only its stage's
  parameters, under the full model's names: exactly its ``param_shards`` entries for the ``pp > 1`` layout.
* Expert parallel (``ep`` > 1): a fused expert tensor is a ``Shard(0)`` DTensor on the ``("ep",)`` mesh
  (:mod:`rlflow.schedulers.runtime.distributed.experts`), the ``param_shards`` block of the rank's place in
  its ep group; FSDP2 leaves it alone, so the dp re-gather keeps it as it is.

The gather path (the fallback): :func:`full_params` all-gathers a (possibly TP- and FSDP-sharded) module's
parameters inside its mesh; the worker broadcasts them flat from the source mesh's first rank to each
target mesh, and :func:`load_full_params` writes full tensors into another layout's shards (each rank
slices the part its DTensor placement holds).

Names: ``param_shards`` matches HF Llama names by their module (``...q_proj.weight`` etc.) and layer
(``layers.<i>.``), so ``model.*``/``lm_head.*`` of a causal LM and ``backbone.*``/``value_head.*`` of a
:class:`rlflow.nodes.models.HeadModel` both work; a tied head appears once (as the embedding), as in
``named_parameters``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.schedulers.realloc.groups import GroupCache as ReallocGroups
from rlflow.schedulers.realloc.planning import ReallocPlan
from rlflow.schedulers.realloc.shards import ModelMeta, Slice, param_shards
from rlflow.schedulers.runtime.distributed.layouts import MeshSpec
from rlflow.schedulers.runtime.distributed.mesh import GroupCache
from rlflow.schedulers.runtime.distributed.zero_transfer import Piece

__all__ = [
    "ModelInfo",
    "Route",
    "SharedGroups",
    "boxes_match",
    "expected_boxes",
    "full_params",
    "load_full_params",
    "local_boxes",
    "local_slices",
    "model_info",
    "plan_bytes_of",
    "source_shards",
    "target_shards",
]


@dataclass(frozen=True)
class ModelInfo:
    """What the plan needs of a model: full parameter shapes and dtypes (``named_parameters`` order), and
    for a LoRA model the names of the parameters it trains (its adapters, and a head that trains; empty for
    any other model)."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    meta: ModelMeta
    adapters: frozenset[str] = frozenset()

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of the first parameter (rlflow models have one dtype)."""
        return next(iter(self.dtypes.values())).itemsize if self.dtypes else 4

    @property
    def nbytes(self) -> int:
        """Bytes of every parameter."""
        return sum(int(torch.Size(s).numel()) * self.dtypes[k].itemsize for k, s in self.shapes.items())

    def adapters_only(self) -> ModelInfo:
        """The same model seen as its adapters alone (an adapter sync: the frozen base is in place on
        both sides since start-up); ``named_parameters`` order kept."""
        keep = [k for k in self.shapes if k in self.adapters]
        return ModelInfo(
            {k: self.shapes[k] for k in keep}, {k: self.dtypes[k] for k in keep}, self.meta, self.adapters
        )


@dataclass(frozen=True)
class Route:
    """How one weight sync ``src -> dst`` runs: the planned reallocation, ZeRO-3 pieces
    (:mod:`rlflow.schedulers.runtime.distributed.zero`: a source or target whose parameters are ZeRO-3
    partitions), or the gather path.

    Attributes:
        plan: the reallocation plan (global ranks), or ``None`` for the ZeRO and gather paths.
        reason: why the gather path is used ("" for the plan path).
        verify_ranks: the ranks of the source and target meshes (sorted; the verification group).
        pieces: the ZeRO path's pieces
            (:func:`rlflow.schedulers.runtime.distributed.zero_transfer.plan_pieces`).
    """

    plan: ReallocPlan | None
    reason: str
    verify_ranks: tuple[int, ...]
    pieces: tuple[Piece, ...] | None = None


def _tied(module: nn.Module) -> bool:
    head = getattr(module, "lm_head", None)
    get = getattr(module, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    return head is not None and emb is not None and head.weight is emb.weight


def model_info(module: nn.Module) -> ModelInfo:
    """Shapes (a DTensor's full shape), dtypes, layer count and tied head of ``module``; for a module that
    carries LoRA adapters (:func:`rlflow.nodes.lora.has_adapters`), the names of its trainable parameters
    (as :func:`rlflow.nodes.lora.apply_lora` left them: the adapters, and a head that trains)."""
    from rlflow.nodes.lora import has_adapters

    config = getattr(module, "config", None)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    shapes = {k: tuple(int(n) for n in p.shape) for k, p in module.named_parameters()}
    dtypes = {k: p.dtype for k, p in module.named_parameters()}
    adapters = (
        frozenset(k for k, p in module.named_parameters() if p.requires_grad)
        if has_adapters(module)
        else frozenset()
    )
    return ModelInfo(shapes, dtypes, ModelMeta(max(1, layers), _tied(module)), adapters)


def _gathered_placements(p: Any) -> tuple[Any, ...]:
    """``p``'s placements with the ``dp`` mesh dim (FSDP2) replicated, the ``tp`` dim kept."""
    from torch.distributed.tensor import Replicate

    names = p.device_mesh.mesh_dim_names or ()
    return tuple(
        Replicate() if i < len(names) and names[i] == "dp" else pl for i, pl in enumerate(p.placements)
    )


def local_boxes(module: nn.Module, *, gather_dp: bool) -> dict[str, Slice]:
    """Per parameter, the box of the full tensor this rank holds (after the dp re-gather if ``gather_dp``).

    No communication: computed from DTensor placements (plain tensors hold the full box).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, Slice] = {}
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            out[name] = tuple(slice(0, int(n)) for n in p.shape)
            continue
        placements = _gathered_placements(p) if gather_dp else tuple(p.placements)
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
        out[name] = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offset, shape, strict=True))
    return out


def expected_boxes(info: ModelInfo, mesh: MeshSpec, rank: int) -> dict[str, Slice]:
    """This rank's ``param_shards`` boxes on ``mesh`` (its devices and dp/tp/pp degrees); ``{}`` off it."""
    return param_shards(info.shapes, info.meta, mesh.devices, mesh.layout).get(rank, {})


def boxes_match(got: Mapping[str, Slice], want: Mapping[str, Slice]) -> str:
    """ "" if the boxes agree exactly, else a description of the first difference."""
    if set(got) != set(want):
        diff = sorted(set(got) ^ set(want))
        return f"parameter names differ from the plan's: {diff[:3]}"
    for name, box in got.items():
        if _key(box) != _key(want[name]):
            return f"{name}: the local shard is {_fmt(box)}, param_shards says {_fmt(want[name])}"
    return ""


def _key(box: Slice) -> tuple[tuple[int, int], ...]:
    return tuple((int(s.start), int(s.stop)) for s in box)


def _fmt(box: Slice) -> str:
    return "[" + ", ".join(f"{s.start}:{s.stop}" for s in box) + "]"


@torch.no_grad()
def source_shards(
    module: nn.Module, *, gather_dp: bool, names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's source shards: the local tensors, re-gathered over ``dp`` first if ``gather_dp``.
    ``names``: only these parameters (those of them this rank holds); default all.

    Collective on the dp groups of the module's mesh when ``gather_dp`` (every rank of the mesh calls it,
    same parameter order and ``names``); the result is read only (a plain parameter's tensor is returned
    as is).
    """
    from torch.distributed.tensor import DTensor

    wanted = set(names) if names is not None else None
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        if wanted is not None and name not in wanted:
            continue
        if not isinstance(p, DTensor):
            out[name] = p.detach()
            continue
        placements = _gathered_placements(p) if gather_dp else tuple(p.placements)
        if placements != tuple(p.placements):
            out[name] = p.redistribute(p.device_mesh, placements).to_local().detach()
        else:
            out[name] = p.to_local().detach()
    return out


def target_shards(module: nn.Module | Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """This rank's target shards: the parameters' local tensors (of a module, or of named parameters),
    written in place by the reallocation."""
    from torch.distributed.tensor import DTensor

    named = module.named_parameters() if isinstance(module, nn.Module) else module.items()
    out: dict[str, torch.Tensor] = {}
    for name, p in named:
        local = p.to_local() if isinstance(p, DTensor) else p
        out[name] = local.detach()  # shares storage with the parameter
    return out


class SharedGroups(ReallocGroups):
    """The reallocation's group cache backed by the worker's :class:`GroupCache` (one group per rank set).

    Groups must exist before a sync runs (a sync involves only some ranks, and creating a group is
    collective over the world): the worker creates them at start-up with :meth:`prepare` on every rank.
    A missing group at sync time is an internal error, raised instead of hanging.
    """

    def __init__(self, cache: GroupCache) -> None:
        super().__init__(timeout=cache.timeout)
        self.cache = cache
        self.frozen = False

    def get(self, ranks: Iterable[int]) -> Any:
        key = tuple(sorted({int(r) for r in ranks}))
        if self.frozen and key not in self._groups:
            raise RuntimeError(f"reallocation group {key} was not created at start-up")
        group = self.cache.group(key)
        self._groups[key] = group
        return group if group is not None else dist.GroupMember.NON_GROUP_MEMBER

    def destroy(self) -> None:
        """Nothing to do: the groups belong to the worker's :class:`GroupCache`."""
        self._groups.clear()


def plan_bytes_of(plan: ReallocPlan, rank: int) -> int:
    """Bytes rank ``rank`` sends plus receives over links in ``plan``."""
    return int(plan.sent_bytes().get(rank, 0) + plan.received_bytes().get(rank, 0))


# -- the gather path ---------------------------------------------------------------------------------


@torch.no_grad()
def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor (name -> tensor), gathered over its mesh where it is a DTensor.

    Collective on the module's mesh: every rank of the mesh must call it (same parameter order).
    Tied parameters appear once (``named_parameters`` order).
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    return out


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full tensor that this rank's local shard of DTensor ``p`` holds (full for plain)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def load_full_params(module: nn.Module, full: dict[str, torch.Tensor], *, partial: bool = False) -> None:
    """Copy full tensors into ``module``'s parameters (each rank writes its own shard); no collective.
    With ``partial`` only the parameters in ``full`` are written (an adapter sync), else every one.

    Raises:
        KeyError: a parameter of ``module`` is missing from ``full`` (not ``partial``).
    """
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        if partial and name not in full:
            continue
        src = full[name]
        if isinstance(p, DTensor):
            local = p.to_local()
            local.copy_(src[local_slices(p)].to(local.device, local.dtype))
        else:
            p.copy_(src.to(p.device, p.dtype))
