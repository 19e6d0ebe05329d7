"""Apply a node's layout to a model on a device mesh: tensor parallel (DTensor) and data parallel (FSDP2).

The sharding follows :mod:`rlflow.schedulers.realloc.shards` (the single source of truth):

* tensor parallel with ``parallelize_module`` on the mesh's ``tp`` axis — column-parallel ``q/k/v/gate/up``
  (weight dim 0), row-parallel ``o/down`` (weight dim 1), vocabulary-parallel ``embed_tokens``
  (``RowwiseParallel`` on ``nn.Embedding``: weight dim 0, masked lookup + all-reduce) and ``lm_head``
  (``ColwiseParallel`` with the logits gathered, so node functions see full ``[B,T,V]`` logits). Norms
  and the value/score head stay replicated (plain tensors, identical on every tp rank), except Qwen3's
  per-head ``q_norm``/``k_norm``, which see only their rank's heads: ``SequenceParallel`` over the heads
  dim makes their weights ``Replicate()`` DTensors whose gradients are summed over the tp ranks (as
  plain tensors each rank's update would use its own heads only, and the replicas would drift). A tied head is
  re-tied to the sharded embedding (both are ``Shard(0)`` on the same mesh).
* data parallel: a train node's model is sharded with FSDP2 ``fully_shard`` over the ``dp`` axis (each
  decoder layer, then the root); inference and generation nodes keep plain replicas (each dp rank runs its
  own rows).
* expert parallel (``ep`` > 1, a mixture-of-experts model): each ep group of consecutive dp ranks splits
  every MoE block's experts ``ep`` ways and dispatches tokens to them by all-to-all
  (:mod:`rlflow.schedulers.runtime.distributed.experts`); FSDP2 leaves the expert parameters alone, and
  :class:`DataParallelHooks` reduces their gradients over the ranks holding the same experts.
* pipeline parallel: each stage's ranks form their own ``("dp", "tp")`` mesh over the stage's model
  (:mod:`rlflow.schedulers.runtime.distributed.pipeline` cuts the model to the stage first; this module then
  shards the stage as above).

Also here: the hooks that make train nodes data-parallel-correct (:class:`DataParallelHooks`): the loss
normaliser and batch-wide statistics are all-reduced over the dp ranks (the whole global mini-batch or
batch), and gradient clipping computes the global norm over DTensor shards; with a node's
``reshard: false`` they keep the FSDP2 units gathered through each optimizer step (one all-gather and one
reduce-scatter per unit per step).

Mesh axes are named ``("dp", "tp")``; mesh position ``r`` of a node's device list has
``tp_rank = r % tp``, ``dp_rank = (r // tp) % dp`` and ``pp_rank = r // (tp·dp)`` (Megatron order, tp
fastest).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.dataflow.errors import PlanError
from rlflow.nodes.context import TrainHooks
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.runtime.distributed.experts import (
    ExpertGroups,
    ep_groups,
    reduce_expert_grads,
    shard_experts,
    sharded_experts,
)

__all__ = [
    "DataParallelHooks",
    "MeshSpec",
    "apply_layout",
    "check_tensor_parallel",
    "dist_clip_grad_norm_",
    "tp_plan",
]

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")
_HEAD_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head RMSNorms of queries and keys
_LAYER_RE = re.compile(r"(?:^|\.)layers\.\d+$")


@dataclass(frozen=True)
class MeshSpec:
    """A node's mesh: the global ranks (device ids) in mesh order and the layout degrees.

    Positions follow :func:`rlflow.schedulers.realloc.shards.mesh_coords` (see the module docstring): pipeline
    stage ``s`` is the ``dp·tp`` consecutive positions from ``s·dp·tp``, itself a ``pp = 1`` mesh
    (:meth:`stage`).

    Attributes:
        devices: global ranks, ``len == dp * tp * pp``.
        dp, tp, pp: data, tensor and pipeline degrees.
        ep: expert degree (ep groups are ``ep`` consecutive ranks of each dp group, :meth:`ep_groups`).
    """

    devices: tuple[int, ...]
    dp: int
    tp: int
    pp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, devices: Iterable[int], layout: Layout) -> MeshSpec:
        devs = tuple(int(d) for d in devices)
        if len(devs) != layout.size:
            raise PlanError(f"layout {layout} needs {layout.size} devices, got {len(devs)}")
        if layout.dp % layout.ep:
            raise PlanError(f"layout {layout}: ep={layout.ep} does not divide dp={layout.dp}")
        return cls(devs, layout.dp, layout.tp, layout.pp, layout.ep)

    @property
    def layout(self) -> Layout:
        """The degrees as a :class:`Layout` (one micro-batch)."""
        return Layout(self.dp, self.tp, self.pp, 1, self.ep)

    def coords(self, rank: int) -> tuple[int, int]:
        """``(dp_rank, tp_rank)`` of global ``rank`` in this mesh."""
        pos = self.devices.index(rank)
        return (pos // self.tp) % self.dp, pos % self.tp

    def stage_of(self, rank: int) -> int:
        """The pipeline stage (``pp_rank``) of global ``rank``."""
        return self.devices.index(rank) // (self.dp * self.tp)

    def shard_key(self, rank: int) -> tuple[int, ...]:
        """``(pp_rank, tp_rank)``, and with ep > 1 the rank's place in its ep group (which experts it holds):
        ranks with the same key hold the same shards (dp replicas)."""
        dp_rank, tp_rank = self.coords(rank)
        if self.ep > 1:
            return self.stage_of(rank), tp_rank, dp_rank % self.ep
        return self.stage_of(rank), tp_rank

    def stage(self, s: int) -> MeshSpec:
        """The ``pp = 1`` mesh of pipeline stage ``s``."""
        n = self.dp * self.tp
        return MeshSpec(self.devices[s * n : (s + 1) * n], self.dp, self.tp, 1, self.ep)

    def tp_groups(self) -> list[tuple[int, ...]]:
        """Ranks of each tensor-parallel group (consecutive mesh positions), by stage, then dp rank."""
        if self.pp > 1:
            return [g for s in range(self.pp) for g in self.stage(s).tp_groups()]
        return [self.devices[d * self.tp : (d + 1) * self.tp] for d in range(self.dp)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        """Ranks of each data-parallel group, by stage, then tp rank."""
        if self.pp > 1:
            return [g for s in range(self.pp) for g in self.stage(s).dp_groups()]
        return [tuple(self.devices[d * self.tp + t] for d in range(self.dp)) for t in range(self.tp)]

    def ep_groups(self) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
        """Ranks of each expert-parallel group (``ep`` consecutive ranks of a dp group) and of each
        expert-data-parallel group (ranks holding the same experts), by stage, then tp rank
        (:func:`rlflow.schedulers.runtime.distributed.experts.ep_groups`)."""
        eps: list[tuple[int, ...]] = []
        edps: list[tuple[int, ...]] = []
        for ranks in self.dp_groups():
            e, d = ep_groups(ranks, self.ep)
            eps += e
            edps += d
        return eps, edps

    def pp_groups(self) -> list[tuple[int, ...]]:
        """Ranks of each pipeline chain (one rank per stage, in stage order), by stage-0 mesh position."""
        n = self.dp * self.tp
        return [tuple(self.devices[p + s * n] for s in range(self.pp)) for p in range(n)]

    def leaders(self) -> list[int]:
        """The last stage's tp-rank-0 rank of each dp group, by dp rank (they return a dp shard's outputs)."""
        return [g[0] for g in self.stage(self.pp - 1).tp_groups()]


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def check_tensor_parallel(model: nn.Module, tp: int, where: str = "model") -> None:
    """Check that ``model`` can be split ``tp`` ways under the convention of
    :mod:`rlflow.schedulers.realloc.shards`.

    Raises:
        PlanError: a tensor dim that must be split is not divisible by ``tp`` (attention heads, grouped-query
            kv heads, intermediate size, vocabulary) or the architecture has no Llama-style projections.
    """
    if tp == 1:
        return
    cfg = _config(model)
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        value = getattr(cfg, field, None)
        if isinstance(value, int) and value % tp:
            extra = (
                " (grouped-query attention: kv heads are split, not replicated)"
                if field == "num_key_value_heads"
                else ""
            )
            raise PlanError(f"{where}: tensor degree tp={tp} does not divide {field}={value}{extra}")
    if not any(name.rsplit(".", 1)[-1] in _COLUMN for name, _ in model.named_modules()):
        raise PlanError(
            f"{where}: tensor parallel needs Llama-style q/k/v/o and gate/up/down projections "
            f"({type(model).__name__} has none)"
        )
    head_dim = getattr(cfg, "head_dim", None)
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        weight = getattr(mod, "weight", None)
        if leaf in _HEAD_NORMS and isinstance(weight, torch.Tensor) and weight.shape != (head_dim,):
            raise PlanError(
                f"{where}: tensor parallel splits attention heads, but '{name}' normalises across heads "
                f"(weight {tuple(weight.shape)}, head_dim {head_dim})"
            )
        if leaf in (*_COLUMN, *_ROW, "lm_head") and isinstance(mod, nn.Linear):
            dim = 1 if leaf in _ROW else 0
            if mod.weight.shape[dim] % tp:
                raise PlanError(
                    f"{where}: parameter '{name}.weight' dim {dim} of size {mod.weight.shape[dim]} is not "
                    f"divisible by tensor degree tp={tp}"
                )


def tp_plan(model: nn.Module) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a Llama-style model: module path -> ParallelStyle."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {}
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _COLUMN:
            plan[name] = ColwiseParallel()
        elif leaf in _HEAD_NORMS:  # input [B, T, heads, head_dim], heads split: a replicated weight whose
            # gradient is summed over the tp ranks (each holds its heads' share of it)
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif leaf in _ROW:
            plan[name] = RowwiseParallel()
        elif leaf == "embed_tokens" and isinstance(mod, nn.Embedding):
            plan[name] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        elif leaf == "lm_head" and isinstance(mod, nn.Linear):
            plan[name] = ColwiseParallel(output_layouts=Replicate())
    return plan


def _tied(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(emb, "weight", None)


def apply_layout(
    model: nn.Module,
    mesh: Any,
    *,
    train: bool,
    where: str = "model",
    experts: ExpertGroups | None = None,
) -> nn.Module:
    """Shard ``model`` in place on ``mesh`` (a 2-D ``DeviceMesh`` with axes ``("dp", "tp")``).

    Args:
        model: a transformers causal LM or :class:`rlflow.nodes.models.HeadModel`, full weights, on the mesh
            device (or one pipeline stage of it, cut by
            :func:`rlflow.schedulers.runtime.distributed.pipeline.make_stage`).
        mesh: the node's device mesh (``mesh["dp"]``, ``mesh["tp"]``; a pipeline stage's own mesh).
        train: FSDP2-shard over ``dp`` (a train node) when dp > 1; otherwise dp ranks are replicas.
        where: name for error messages.
        experts: this rank's expert-parallel groups (``GroupCache.experts``) for a layout with ep > 1: the
            experts are split over them (:func:`~rlflow.schedulers.runtime.distributed.experts.shard_experts`)
            and left out of FSDP2.

    Returns:
        the same module, parallelized (parameters become DTensors where sharded).

    Raises:
        PlanError: see :func:`check_tensor_parallel` and
            :func:`~rlflow.schedulers.runtime.distributed.experts.check_expert_parallel`.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh["tp"].size()
    dp = mesh["dp"].size()
    if tp > 1:
        check_tensor_parallel(model, tp, where)
        tied = _tied(model)
        parallelize_module(model, mesh["tp"], tp_plan(model))
        if tied:
            emb = model.get_input_embeddings()  # type: ignore[operator]
            if isinstance(emb, nn.Embedding):
                model.lm_head.weight = emb.weight  # type: ignore[union-attr]
            else:  # a last pipeline stage: its received-embedding module holds the tied (sharded) head
                emb.weight = model.lm_head.weight  # type: ignore[union-attr]
    ignored = set(shard_experts(model, experts, where)) if experts is not None and experts.ep > 1 else set()
    if train and dp > 1:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = mesh["dp"]
        for name, mod in list(model.named_modules()):
            if _LAYER_RE.search(name):
                fully_shard(mod, mesh=dp_mesh, ignored_params=ignored or None)
        # The root reshards after forward too: a no-grad forward (PPO's first pass) on a root that keeps its
        # parameters unsharded corrupts the next backward's gradients (measured: wrong grad norm).
        fully_shard(model, mesh=dp_mesh, reshard_after_forward=True, ignored_params=ignored or None)
    return model


# ------------------------------------------------------------------------------------------------
# Data-parallel-correct training hooks for rlflow.nodes.train.optimize


def _shard_dims(t: Any) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    """A DTensor's sharded mesh dims: (their names, a rank-independent sort key; their process groups)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2 over TP: dp dim is strided

    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard | _StridedShard)]
    return tuple(names[i] for i in dims), tuple(mesh.get_group(i) for i in dims)


def _reduce_partial_grads(params: Sequence[torch.Tensor]) -> None:
    """Sum the pending (``Partial``) mesh dims of DTensor gradients: a replicated weight applied to sharded
    activations (Qwen3's per-head q/k norms under tensor parallel) gets each tp rank's share of its gradient;
    counted as it is, each rank would see its own gradient norm and clip by its own factor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(isinstance(pl, Partial) for pl in g.placements):
            done = [Replicate() if isinstance(pl, Partial) else pl for pl in g.placements]
            p.grad = g.redistribute(g.device_mesh, done)


@torch.no_grad()
def dist_clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    stage_group: Any = None,
    uncounted: Collection[torch.Tensor] = (),
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over a mix of DTensor shards (TP, FSDP2, both) and plain tensors.

    The global 2-norm ``sqrt(sum_p ||g_p||²)`` counts every element once: a DTensor's local squares are
    summed over the mesh dims where it is sharded, a plain (replicated) tensor counts locally; a DTensor
    gradient still ``Partial`` over a mesh dim is summed over it first (and kept so). Gradients are
    scaled by ``min(1, max_norm / (norm + 1e-6))`` as torch does. Falls back to torch for other norms.

    Args:
        stage_group: for a pipeline stage, the group of its pipeline chain: the stages' sums of squares
            are added over it, so the norm covers the whole model (every stage holds other parameters).
        uncounted: parameters scaled but not counted here because another stage counts them (a tied
            embedding held by the first and the last stage).

    Returns:
        the total norm, a plain 0-d float32 tensor (identical on every rank of the mesh and the chain).
    """
    from torch.distributed.tensor import DTensor

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    _reduce_partial_grads(params)
    grads = [p.grad for p in params if p.grad is not None]
    skip = {id(p) for p in uncounted}
    counted = [p.grad for p in params if p.grad is not None and id(p) not in skip]
    local_only = stage_group is None and not any(isinstance(g, DTensor) for g in grads)
    if float(norm_type) != 2.0 or local_only:
        if stage_group is not None:
            raise ValueError("a pipeline stage's gradient norm supports norm_type 2 only")
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
    # sharded mesh-dim names -> (their groups, local sum of squares); names sort the same on every rank
    sums: dict[tuple[str, ...], tuple[tuple[Any, ...], torch.Tensor]] = {}
    plain = torch.zeros((), dtype=torch.float64)
    device = grads[0].device if grads else torch.device("cpu")
    for g in counted:
        if isinstance(g, DTensor):
            names, groups = _shard_dims(g)
            local = g.to_local().double().pow(2).sum()
            prev = sums.get(names, (groups, torch.zeros((), dtype=torch.float64, device=device)))[1]
            sums[names] = (groups, prev + local)
        else:
            plain += g.double().pow(2).sum().cpu()
    total = plain
    for names in sorted(sums):
        groups, part = sums[names]
        for group in groups:
            dist.all_reduce(part, group=group)
        total = total + part.cpu()
    if stage_group is not None:
        over_stages = total.to(device)
        dist.all_reduce(over_stages, group=stage_group)
        total = over_stages.cpu()
    norm = total.sqrt().float()
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"the total norm of gradients is non-finite ({float(norm)})")
    coef = min(1.0, float(max_norm) / (float(norm) + 1e-6)) if math.isfinite(float(max_norm)) else 1.0
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return norm


def _fsdp_modules(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class DataParallelHooks(TrainHooks):
    """:class:`rlflow.nodes.context.TrainHooks` for one train call on a mesh with ``dp`` data-parallel ranks.

    * :meth:`all_sum` all-reduces (sum) a tensor over ``dp_group``: batch-wide statistics (advantage
      whitening, the batch std of rewards) are the whole batch's, not this rank's share's.
    * :meth:`global_count` sums the local count of this rank's share of the mini-batch (tokens, or rows
      for a loss without a mask such as DPO's) the same way, so every rank divides by the count of the
      whole global mini-batch; FSDP2 then sums (divide factor 1) the ranks' gradients. Exact for shares
      of any sizes (the token-balanced split gives ranks different row counts).
    * :meth:`clip_grad_norm` is :func:`dist_clip_grad_norm_` (global norm over shards), after the
      step's expert gradients (ep > 1) are summed over their edp group and divided as FSDP2 divides the
      others (:func:`~rlflow.schedulers.runtime.distributed.experts.reduce_expert_grads`).
    * :meth:`global_max` all-reduces (max) a count: the token-budget micro-batches every rank runs.
    * ``reshard=False`` (the node's ``reshard: false``): from the first forward of an optimizer step
      (:meth:`begin`) the FSDP2 units neither reshard after forward nor after backward and accumulate
      unsharded gradients without reducing them (``set_reshard_after_forward``,
      ``set_reshard_after_backward``, ``set_requires_gradient_sync``); the step's last backward
      (:meth:`backward` with ``last``) reduce-scatters the accumulated gradients and reshards, and
      resharding after forward is restored for what runs outside the step (a no-grad first pass on units
      kept unsharded corrupted the next backward's gradients). Each unit is all-gathered once and
      reduce-scattered once per step instead of twice and once per micro-batch (Zhao et al. 2023,
      "PyTorch FSDP": gradient accumulation without communication; ZeRO-1's volume, Rajbhandari et al.
      2020, §7.2); the full stage weights and gradients are held meanwhile. Gradients are the same up to
      summation order.

    Use it as a context manager around the call: it sets FSDP2's reduction on entry and restores it (and
    resharding, should a step have raised).
    """

    def __init__(self, module: nn.Module, dp_group: Any, dp: int, reshard: bool = True) -> None:
        self.fsdp = _fsdp_modules(module)
        self.experts = sharded_experts(module)
        self._divide = float(dp)
        self.dp_group = dp_group
        self.dp = dp
        self.reshard = reshard
        self._gathered = False  # inside a reshard=False step: units kept unsharded, gradients unsynced

    def _keep_gathered(self, on: bool) -> None:
        for m in self.fsdp:  # each FSDP module's own setting (recurse would repeat the nested ones)
            m.set_reshard_after_forward(not on, recurse=False)
            m.set_reshard_after_backward(not on, recurse=False)
            m.set_requires_gradient_sync(not on, recurse=False)
        self._gathered = on

    def begin(self, op: str, k: int) -> None:
        if not self.reshard and not self._gathered and self.fsdp:
            self._keep_gathered(True)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        if not (self._gathered and last):
            loss.backward()
            return
        for m in self.fsdp:  # the step's last backward: reduce-scatter what accumulated, then reshard
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
        loss.backward()
        self._keep_gathered(False)

    def _set_divide(self, factor: float) -> None:
        self._divide = factor
        for m in self.fsdp:
            m.set_force_sum_reduction_for_comms(True)  # SUM, then divide: gloo has no PREMUL_SUM
            m.set_gradient_divide_factor(factor)

    def __enter__(self) -> DataParallelHooks:
        self._set_divide(float(self.dp))
        return self

    def __exit__(self, *exc: object) -> None:
        self._set_divide(float(self.dp))
        if self._gathered:  # a step that raised before its last backward
            self._keep_gathered(False)
            for m in self.fsdp:
                m.reshard()

    def all_sum(self, local: torch.Tensor) -> torch.Tensor:
        out = local.detach().clone()
        if self.dp > 1:
            dist.all_reduce(out, group=self.dp_group)
        return out

    def global_count(self, local: float) -> float:
        count = self.all_sum(torch.tensor([float(local)], dtype=torch.float64))
        if self.dp > 1:
            self._set_divide(1.0)
        return float(round(float(count.item())))

    def global_max(self, local: int) -> int:
        out = torch.tensor([int(local)], dtype=torch.int64)
        if self.dp > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.dp_group)
        return int(out.item())

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        # the step's expert gradients: summed over the ranks holding the same experts, divided as FSDP2's
        reduce_expert_grads(self.experts, self._divide)
        return dist_clip_grad_norm_(params, max_norm)
