"""Expert parallelism: a mixture-of-experts model's experts sharded over the ``ep`` ranks of a node's mesh.

The layout rule (:mod:`rlflow.dataflow.layout_rules`): the ``ep`` ranks are carved out of the data-parallel
ranks (Megatron-LM's ``expert_model_parallel_size``, which must divide the data-parallel size; Shoeybi et
al., Megatron-Core MoE docs "Expert Parallelism"; verl's Megatron backend uses the same groups). Along one
tp rank's data-parallel ranks (mesh order, :class:`~rlflow.schedulers.runtime.distributed.layouts.MeshSpec`),
an **ep group** is ``ep`` consecutive dp ranks; the ranks at the same position of every ep group form an
**expert data-parallel (edp) group** of ``dp / ep`` ranks holding the same experts.

* Experts: each rank of an ep group holds ``num_experts / ep`` consecutive experts (rank ``i``: experts
  ``[i·E/ep, (i+1)·E/ep)``) of every sparse MoE block, as a DTensor ``Shard(0)`` over the ep group's 1-D
  ``("ep",)`` mesh, under the names Hugging Face gives them (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
  ``mlp.experts.down_proj`` ``[E, H, I]``; transformers 5 ``Qwen3MoeExperts``, ``MixtralExperts`` and every
  experts class with the same fused 3-D layout). ``full_tensor()`` therefore gathers them like any other
  sharded parameter (checkpoints, tests), and the gradient norm sums their squares over the ep group
  (:func:`~rlflow.schedulers.runtime.distributed.layouts.dist_clip_grad_norm_`). A weight sync moves the
  local blocks shard to shard: :func:`rlflow.schedulers.realloc.shards.param_shards` cuts the fused tensors
  the same way (dp rank ``d`` holds block ``d % ep``).
* Pipeline stages (``pp`` > 1): each stage's dp ranks form its own ep and edp groups
  (:meth:`~rlflow.schedulers.runtime.distributed.mesh.GroupCache.experts`), which dispatch the stage's MoE
  layers; every micro-batch of the stage's schedule runs its all-to-alls, and
  :class:`~rlflow.schedulers.runtime.distributed.pipeline_schedule.PipelineHooks` reduces the stage's expert
  gradients.
* Non-expert parameters (attention, router, norms, embeddings) stay as the dense layout has them: FSDP2 over
  all dp ranks for a train node (the experts are FSDP2's ``ignored_params``), replicas otherwise; with tp > 1
  the experts are replicated across the tp ranks (expert tensor parallel size 1).
* Token dispatch (:class:`ShardedExperts`): each rank routes its own tokens (the HF router, unchanged), sends
  every (token, chosen expert) pair to the rank holding that expert with one ``all_to_all_single`` (gloo on
  CPU — supported for uneven splits in torch 2.13 — and NCCL on CUDA; autograd through
  ``torch.distributed._functional_collectives.all_to_all_single_autograd``), runs its local experts on what it
  received, and sends the results back the same way; the sender weights them with the router's top-k
  weights and sums them per token in ascending expert order, as the HF loop does.
* Gradients: the all-to-all's backward returns each expert's gradient to the rank holding it, summed over
  the ep group's tokens; :func:`reduce_expert_grads` then sums it over the edp group and divides it by the
  factor FSDP2 divides the other gradients by (``layouts.DataParallelHooks`` calls it once per optimizer
  step, before clipping), so every parameter's gradient is the one of the whole global mini-batch.

Every rank of an ep group must run the same number of forwards (each MoE layer is a collective): train nodes
do (equal row shares, token-budget micro-batch counts agreed with ``global_max``). A generate node's
built-in loop would end at a different decode step on each rank (its rows finish when they sample a stop
token), so the group decodes in lockstep (:func:`decode_lockstep`, the node's ``NodeContext.keep_going``):
each decode step (and each micro-batch) the ranks agree, with one all-reduce of a flag over the ep group,
whether any of them has a row left, and a rank whose rows have finished forwards one dummy cache row, never
sampled, until the group's last row has (:func:`rlflow.nodes.generation.generate`). Its samples, log-probs
and random state are those of the same rows decoded alone; the group decodes as long as its slowest rank.
The vLLM engine holds its experts its own way: a vLLM generate node is refused at ep > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.dataflow.errors import PlanError

__all__ = [
    "ExpertGroups",
    "ShardedExperts",
    "check_expert_parallel",
    "decode_lockstep",
    "ep_groups",
    "expert_modules",
    "reduce_expert_grads",
    "shard_experts",
    "sharded_experts",
]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's expert-parallel groups in one node mesh.

    Attributes:
        ep: experts are split this many ways (the ep group's size).
        ep_rank: this rank's position in its ep group (it holds experts ``[ep_rank·E/ep, (ep_rank+1)·E/ep)``).
        ep_group: the ep group's process group.
        ep_mesh: the ep group as a 1-D ``DeviceMesh`` named ``("ep",)`` (the experts' DTensor mesh).
        edp: ranks holding the same experts (``dp / ep``).
        edp_group: their process group (``None`` when ``edp == 1``).
    """

    ep: int
    ep_rank: int
    ep_group: Any
    ep_mesh: Any
    edp: int
    edp_group: Any


def ep_groups(dp_ranks: tuple[int, ...], ep: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The ep groups (``ep`` consecutive ranks) and edp groups (same position in every ep group) of one
    data-parallel group ``dp_ranks`` (mesh order).

    Raises:
        PlanError: ``ep`` does not divide ``len(dp_ranks)``.
    """
    dp = len(dp_ranks)
    if ep < 1 or dp % ep:
        raise PlanError(f"ep={ep} does not divide dp={dp} (expert-parallel ranks are carved out of dp)")
    eps = [dp_ranks[i * ep : (i + 1) * ep] for i in range(dp // ep)]
    edps = [dp_ranks[j::ep] for j in range(ep)]
    return eps, edps


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The fused experts modules of ``model``: those with 3-D ``gate_up_proj`` and ``down_proj`` parameters
    (transformers 5 ``Qwen3MoeExperts``, ``MixtralExperts``, ...), in module order; a :class:`ShardedExperts`
    counts too."""
    out = []
    for name, mod in model.named_modules():
        gu, dn = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3:
            out.append((name, mod))
    return out


def check_expert_parallel(model: nn.Module, ep: int, where: str = "model") -> None:
    """Check that ``model``'s experts can be split ``ep`` ways.

    Raises:
        PlanError: the model has no fused experts (a dense model), stores them in a form this module does
            not dispatch (transposed, interleaved gate/up, biases, no gate), or ``ep`` does not divide the
            expert count.
    """
    if ep == 1:
        return
    found = expert_modules(model)
    if not found:
        raise PlanError(f"{where}: ep={ep} but {type(model).__name__} has no mixture-of-experts layers")
    for name, mod in found:
        flags = {"is_transposed": False, "has_bias": False, "has_gate": True, "is_concatenated": True}
        bad = [f"{k}={getattr(mod, k)}" for k, v in flags.items() if getattr(mod, k, v) != v]
        if bad:
            raise PlanError(
                f"{where}: expert parallel cannot dispatch '{name}' ({type(mod).__name__}: {bad})"
            )
        experts = _tensor(mod.gate_up_proj).shape[0]
        if experts % ep:
            raise PlanError(f"{where}: ep={ep} does not divide the {experts} experts of '{name}'")


def _tensor(value: object) -> torch.Tensor:
    assert isinstance(value, torch.Tensor), type(value)
    return value


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a plain tensor as it is)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class ShardedExperts(nn.Module):
    """One MoE block's experts, ``E / ep`` of them on this rank, with all-to-all token dispatch.

    Replaces a fused HF experts module (same call: ``(hidden [N, H], top_k_index [N, k] int, top_k_weights
    [N, k]) -> [N, H]``; same parameter names and global shapes ``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``, as ``Shard(0)`` DTensors over ``groups.ep_mesh``).
    """

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    act_fn: Any  # the source module's activation (an ``nn.Module`` from transformers' ACT2FN)

    def __init__(self, source: nn.Module, groups: ExpertGroups) -> None:
        from torch.distributed.tensor import DTensor, Shard

        super().__init__()
        gu, dn = _tensor(source.gate_up_proj), _tensor(source.down_proj)
        self.num_experts = int(gu.shape[0])
        self.local_experts = self.num_experts // groups.ep
        self.groups = groups
        self.act_fn = source.act_fn
        lo = groups.ep_rank * self.local_experts
        for name, full in (("gate_up_proj", gu), ("down_proj", dn)):
            local = full.detach()[lo : lo + self.local_experts].clone()
            value = DTensor.from_local(
                local, groups.ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
            )
            self.register_parameter(name, nn.Parameter(value, requires_grad=full.requires_grad))

    def _exchange(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        y = all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, self.groups.ep_group)
        return wait_tensor(y)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        n, k = top_k_index.shape
        ep, e_local = self.groups.ep, self.local_experts
        expert = top_k_index.reshape(-1)
        token = torch.arange(n, device=expert.device).repeat_interleave(k)
        weight = top_k_weights.reshape(-1)
        keep = expert < self.num_experts  # HF marks dropped (token, slot) pairs with index num_experts
        expert, token, weight = expert[keep], token[keep], weight[keep]
        order = torch.argsort(expert, stable=True)  # by expert, hence by destination rank
        expert, token, weight = expert[order], token[order], weight[order]
        send = torch.bincount(expert // e_local, minlength=ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.groups.ep_group)
        in_splits, out_splits = send.tolist(), recv.tolist()
        x = self._exchange(hidden_states[token], out_splits, in_splits)
        ids = self._exchange(expert.unsqueeze(1), out_splits, in_splits).squeeze(1).detach()
        local = ids - self.groups.ep_rank * e_local
        y = self._local_experts(x, local)
        back = self._exchange(y, in_splits, out_splits)
        final = torch.zeros_like(hidden_states)
        final.index_add_(0, token, (back * weight[:, None]).to(final.dtype))
        return final

    def _local_experts(self, x: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """Rows ``x [R, H]`` through their local experts ``local [R]`` (ids ``[0, E/ep)``) -> ``[R, H]``."""
        gu, dn = _local(self.gate_up_proj), _local(self.down_proj)
        perm = torch.argsort(local, stable=True)
        counts = torch.bincount(local, minlength=self.local_experts).tolist()
        pieces = []
        for j, rows in enumerate(torch.split(x[perm], counts)):
            if counts[j] == 0:
                continue
            gate, up = nn.functional.linear(rows, gu[j]).chunk(2, dim=-1)
            pieces.append(nn.functional.linear(self.act_fn(gate) * up, dn[j]))
        if not pieces:  # nothing received: zero gradients, so that every rank reduces the same tensors
            return x[:0] + 0.0 * (gu.sum() + dn.sum())
        return torch.cat(pieces)[torch.argsort(perm)]


def shard_experts(model: nn.Module, groups: ExpertGroups, where: str = "model") -> list[nn.Parameter]:
    """Replace every fused experts module of ``model`` by a :class:`ShardedExperts` holding this rank's
    ``E / ep`` experts (in place).

    Returns:
        the new expert parameters (FSDP2 must leave them alone: ``fully_shard(..., ignored_params=...)``).

    Raises:
        PlanError: see :func:`check_expert_parallel`.
    """
    check_expert_parallel(model, groups.ep, where)
    params: list[nn.Parameter] = []
    for name, mod in expert_modules(model):
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        sharded = ShardedExperts(mod, groups)
        setattr(parent, leaf, sharded)
        params += [sharded.gate_up_proj, sharded.down_proj]  # type: ignore[list-item]
    return params


def sharded_experts(module: nn.Module) -> list[ShardedExperts]:
    """The :class:`ShardedExperts` of ``module`` (empty for a model without expert parallelism)."""
    return [m for m in module.modules() if isinstance(m, ShardedExperts)]


@torch.no_grad()
def reduce_expert_grads(modules: Iterable[ShardedExperts], divide: float) -> None:
    """Sum each expert gradient over its edp group, then divide it by ``divide`` (the factor FSDP2 divides
    the other gradients by: ``dp`` for a mean over the dp ranks, 1 when the loss is already normalised by the
    whole mini-batch's count). Call once per optimizer step, after the last backward."""
    for mod in modules:
        for p in (mod.gate_up_proj, mod.down_proj):
            if p.grad is None:
                continue
            local = _local(p.grad)
            if mod.groups.edp > 1:
                dist.all_reduce(local, group=mod.groups.edp_group)
            if divide != 1.0:
                local.div_(divide)


def decode_lockstep(groups: ExpertGroups, device: torch.device) -> Callable[[bool], bool]:
    """A generate node's lockstep over its ep group (``NodeContext.keep_going``): ``keep_going(done_here)``
    all-reduces (MAX) a 1-element int64 flag "this rank has rows left" over ``groups.ep_group`` and returns
    whether any rank has (the flag lives on ``device``: the group's backend's, CUDA for NCCL). Collective:
    every rank of the group calls it alike (the built-in loop does, once
    per micro-batch and decode step)."""

    def keep_going(done_here: bool) -> bool:
        flag = torch.tensor([0 if done_here else 1], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=groups.ep_group)
        return bool(flag.item())

    return keep_going
