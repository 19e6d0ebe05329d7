"""The clipped policy-gradient train node functions: PPO's actor and critic, GRPO, RLOO, ReMax and
REINFORCE++ actors, and the optimisation loop they share (:func:`pg_train`: the old policy's first pass,
the registered surrogate, entropy and KL terms, decoupled PPO, mismatch correction).

Shapes (DESIGN.md): B rows, R response tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.registry import node_function
from rlflow.nodes import rl
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.forward import batch_logprobs, response_values
from rlflow.nodes.functions.common import SEQ, sequence_tokens
from rlflow.nodes.functions.overlong import overlong_filter_mistakes
from rlflow.nodes.functions.schemas import (
    AGG_ARG,
    GAE_ARGS,
    GAMMA_ARG,
    KL_ESTIMATOR_ARG,
    PG_ARG_INPUTS,
    kl_coef_arg,
    pg_args,
)
from rlflow.nodes.moe import AUX_LOSS_ARG
from rlflow.nodes.moe_routes import PROMPT_ROUTES, RESPONSE_ROUTES, RouteReplay
from rlflow.nodes.rl.policy_losses import POLICY_LOSSES
from rlflow.nodes.train import mini_batches, no_grad_forward, optimize

__all__ = [
    "FIRST_PASS_SHARE",
    "first_pass_logprobs",
    "first_pass_share",
    "grpo_actor",
    "pg_train",
    "ppo_actor",
    "ppo_advantages",
    "ppo_critic",
    "reinforce_pp_actor",
    "remax_actor",
    "rloo_actor",
]


def _logprob_gap(old: torch.Tensor, batch: Batch) -> dict[str, float]:
    """``rollout/logprob_gap_mean|max``: |log π_old − log π_rollout| over the trainable tokens (nats).

    ~0 on-policy; a large value means a weight-sync or temperature bug, or (asynchronous RL, π_old the
    proximal policy) stale samples.
    """
    mask = batch.tensor("response_mask")
    if "logprobs" not in batch or not mask.any():
        return {}
    gap = (old - batch.tensor("logprobs")).abs().masked_fill(mask == 0, 0.0)
    return {
        "rollout/logprob_gap_mean": float(gap.sum() / mask.sum()),
        "rollout/logprob_gap_max": float(gap.max()),
    }


def first_pass_logprobs(
    ctx: NodeContext, batch: Batch, temperature: float, top_k: Any, top_p: Any, replay: Any = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Trainer log-probs before any update (PPO's old policy) and their gap to the sampler's log-probs;
    ``replay`` (a :class:`~rlflow.nodes.moe_routes.RouteReplay`): with the batch's recorded routes forced."""
    opts = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "replay": replay}
    parts = no_grad_forward(ctx, batch, lambda m, b: batch_logprobs(m, b, **opts)[0])
    old = torch.cat(parts)
    return old, _logprob_gap(old, batch)


FIRST_PASS_SHARE = "perf/first_pass_share"
"""Metric: the share of a clipped policy-gradient node's rows (0 to 1) its π_old first pass ran over
(:func:`first_pass_share`); 0 when π_old came without one (the train forward's own log-probs, the
sampler's, or the graph's proximal forward). Data-parallel ranks' values combine weighted by rows."""


def first_pass_share(args: Mapping[str, Any], mini_batches: int) -> float:
    """The ``first_pass`` trait of every clipped policy-gradient node: the share of a call's rows (0 to 1)
    that :func:`first_pass_logprobs` (a no-grad forward of its model before the update) runs over, from the
    node's bound arguments and its ``mini_batches`` M (the planner prices that share of a forward).

    * 0 with ``decoupled_loss`` (π_old is the ``prox_logprobs`` input, an inference node of the graph) or
      ``recompute_logprobs`` false (π_old is the sampler's ``logprobs``);
    * 1 with mismatch correction (``rollout_is``/``rollout_rs``): its weights and loss mask need π_old of
      the whole batch before the first mini-batch's forward (the mask sets the mini-batch's normaliser);
    * otherwise (M − 1)/M, 0 with one mini-batch: π_old is the trainer's weights before the call's first
      optimizer step, and the rows of the first mini-batch of the first epoch have their train forward
      before that step, so their log-probs there, detached, *are* π_old's (:func:`pg_train`); only the later
      mini-batches' rows need the pass. TRL's GRPO does the same with one step per generation
      (``old_per_token_logps = per_token_logps.detach()``).
    """
    if args["decoupled_loss"] or not args["recompute_logprobs"]:
        return 0.0
    if args["rollout_is"] is not None or args["rollout_rs"] is not None:
        return 1.0
    return (mini_batches - 1) / mini_batches


class _OwnForwardOld:
    """π_old ``[B, R]`` where the rows from ``first`` on came from a first pass and the rows before it take
    their first train forward's log-probs, detached, as that forward runs (before any optimizer step)."""

    def __init__(self, old_BR: torch.Tensor, first: int) -> None:
        self.old_BR = old_BR
        self.known = torch.arange(old_BR.shape[0], device=old_BR.device) >= first

    def take(self, rows: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
        """π_old ``[b, r]`` of micro-batch rows ``rows`` ``[b]`` whose train forward gave ``lp`` ``[b, r]``
        (cut to its own width ``r``): a row seen for the first time stores ``lp`` detached, exactly."""
        width = int(lp.shape[1])
        new = ~self.known[rows]
        if bool(new.any()):
            self.old_BR[rows[new], :width] = lp.detach()[new].to(self.old_BR.dtype)
            self.known[rows[new]] = True
        return self.old_BR[rows, :width]


def pg_train(
    ctx: NodeContext,
    batch: Batch,
    advantages: torch.Tensor,
    *,
    clip_eps: float | None,
    clip_eps_high: float | None,
    dual_clip: float | None,
    entropy_coef: float,
    kl_loss_coef: float,
    kl_loss_type: str,
    agg: str | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    recompute_logprobs: bool,
    decoupled_loss: bool,
    behav_imp_weight_cap: float | None,
    rollout_is: str | None,
    rollout_is_threshold: float,
    rollout_rs: str | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float | None,
    route_replay: bool,
    router_aux_loss_coef: float,
    overlong_filter: bool,
    loss: str,
    **loss_args: Any,
) -> dict[str, float]:
    """Clipped policy-gradient optimisation of ``advantages`` ``[B,R]`` with the registered policy loss
    ``loss`` (:data:`rlflow.nodes.rl.policy_losses.POLICY_LOSSES`: PPO's token-level, GSPO's sequence-level,
    CISPO's or SAPO's surrogate; ``loss_args``: the losses' own arguments, SAPO's temperatures); returns the
    step's metrics (``actor/*``, ``rollout/*``, ``overlong/*``).

    The old policy's log-probs are the trainer's (``recompute_logprobs``, the default: they also measure
    the sampler/trainer gap, ``rollout/logprob_gap_mean|max``) or, when off, the sampler's ``logprobs``
    (only right when sampling is on-policy with the same logits processing). The trainer's come from a
    no-grad first pass only for the rows whose train forward runs after the call's first optimizer step
    (:func:`first_pass_share`): the rows of the first mini-batch take π_old from their train forward in the
    first epoch, detached (the same weights, the same tokens and logits processing, the same eval mode: the
    loop trains without dropout, :func:`rlflow.nodes.train.optimize`), keep it for later epochs, and start
    at the ratio π_θ/π_old = 1 exactly. One mini-batch: no first pass at all; mismatch correction: a first
    pass over every row. Metric :data:`FIRST_PASS_SHARE` says which.
    ``clip_eps``/``agg`` ``None``: the loss's defaults
    (:data:`rlflow.nodes.rl.policy_losses.POLICY_LOSSES`); with ``clip_eps`` ``None`` a ``None``
    ``clip_eps_high`` is the loss's default too, otherwise ``clip_eps``.

    Mismatch correction (``rollout_is``/``rollout_rs``, :data:`ROLLOUT_CORRECTION_ARGS`): π_old is the
    first pass's log-probs, π_rollout the sampler's ``logprobs``; both are fixed before the first update, so
    the weights and the loss mask are computed once for the whole batch and split with it. Rejected tokens
    leave the policy, entropy and KL terms and the global normaliser (``loss_mask``); the forward pass still
    attends to them. Metrics ``rollout/tis_weight_mean``, ``rollout/tis_clipfrac``, ``rollout/mask_frac``.

    Decoupled PPO (``decoupled_loss``, :mod:`rlflow.nodes.rl.decoupled`; Fu et al. 2025, AReaL): π_old is
    the proximal policy, read from the ``prox_logprobs`` input (a forward of this node's model in the graph,
    before this node; no first pass here), and the behaviour policy is the sampler's ``logprobs``. Each
    token's policy-gradient loss (PPO or GSPO surrogate) is weighted by the constant π_prox/π_behav, set to 0
    above ``behav_imp_weight_cap``; computed once for the batch, on the tokens ``rollout_rs`` keeps (it
    composes; ``rollout_is`` would weight by the same ratio twice and is rejected by the schema). Metrics
    ``actor/behav_imp_weight_mean|max``, ``actor/behav_imp_weight_capfrac`` (with a cap), and
    ``rollout/logprob_gap_mean|max`` between π_prox and π_behav.

    Route replay (``route_replay``, :mod:`rlflow.nodes.moe_routes`): every forward here (first pass and train
    forward) routes each token through the experts the batch's ``prompt_routed_experts``/``routed_experts``
    recorded, checked against the model before any forward; metric ``rollout/router_agreement``.

    Over-long filtering (``overlong_filter``; Yu et al. 2025, DAPO): the rows whose ``truncated`` is 1 leave
    the policy, entropy and KL terms and the normaliser, as rejected rows do (the advantages, computed before,
    still counted their scores); metric ``overlong/filtered_frac``, the share of rows filtered.
    """
    replay = RouteReplay.start(ctx, batch) if route_replay else None
    policy = POLICY_LOSSES.get(loss)
    surrogate = policy.bind(loss_args)
    width = int(batch.tensor("response_ids").shape[1])
    if clip_eps is None:  # the loss's defaults (None for a loss with no clip: SAPO)
        clip_eps = policy.clip_eps
        clip_eps_high = clip_eps_high if clip_eps_high is not None else policy.clip_eps_high
    agg = policy.agg if agg is None else agg
    own: _OwnForwardOld | None = None  # π_old of the first mini-batch's rows from their train forward
    if decoupled_loss:  # the graph's proximal forward replaces the first pass
        if "prox_logprobs" not in batch:  # graph validation binds it; a direct call may not
            raise NodeError(
                f"node '{ctx.node.name}': decoupled_loss reads input 'prox_logprobs', not in the batch"
            )
        old = batch.tensor("prox_logprobs")
        metrics = {**_logprob_gap(old, batch), FIRST_PASS_SHARE: 0.0}
    elif recompute_logprobs or "logprobs" not in batch:
        trait = {"decoupled_loss": False, "recompute_logprobs": True, "rollout_is": rollout_is,
                 "rollout_rs": rollout_rs}  # fmt: skip
        if first_pass_share(trait, ctx.node.mini_batches) >= 1.0:
            old, metrics = first_pass_logprobs(ctx, batch, temperature, top_k, top_p, replay)
            metrics[FIRST_PASS_SHARE] = 1.0
        else:  # a first pass over the rows after the first mini-batch only (none with one mini-batch)
            first = len(mini_batches(ctx, batch)[0])
            rest = batch.index(list(range(first, len(batch))))
            head = batch.tensor("response_mask")[:first].new_zeros(first, width, dtype=torch.float32)
            parts = (
                [first_pass_logprobs(ctx, rest, temperature, top_k, top_p, replay)[0]] if len(rest) else []
            )
            own = _OwnForwardOld(torch.cat([head, *parts]), first)
            old, metrics = own.old_BR, {FIRST_PASS_SHARE: len(rest) / max(1, len(batch))}
    else:  # on-policy and the sampler's logits processing: its log-probs are the old policy's
        old, metrics = batch.tensor("logprobs"), {FIRST_PASS_SHARE: 0.0}
    routes = [PROMPT_ROUTES, RESPONSE_ROUTES] if replay else []
    work = batch.select([*SEQ, *(["ref_logprobs"] if "ref_logprobs" in batch else []), *routes])
    work["old_logprobs"] = old
    if own is not None:
        work["row"] = torch.arange(len(batch), device=old.device)
    work["advantages"] = advantages
    mask_key = "response_mask"
    if rollout_is is not None or rollout_rs is not None:
        weights, loss_mask, corr = rl.rollout_correction(
            old, batch.tensor("logprobs"), batch.tensor("response_mask"),
            rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold, rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold, rollout_rs_threshold_lower=rollout_rs_threshold_lower,
        )  # fmt: skip
        work["pg_weights"] = weights
        work["loss_mask"] = loss_mask.long()
        mask_key = "loss_mask"  # the normaliser counts only the tokens left in the loss
        metrics.update({f"rollout/{k}": float(v) for k, v in corr.items()})
    if overlong_filter:  # DAPO: truncated rows leave the loss and its normaliser
        if "truncated" not in batch:  # graph validation binds it; a direct call may not
            raise NodeError(
                f"node '{ctx.node.name}': overlong_filter reads input 'truncated', not in the batch"
            )
        cut = batch.tensor("truncated").to(old.device) != 0
        work["loss_mask"] = work.tensor(mask_key).long() * (~cut).long().unsqueeze(1)
        mask_key = "loss_mask"
        metrics["overlong/filtered_frac"] = float(cut.float().mean()) if len(cut) else 0.0
    if decoupled_loss:  # on the tokens left in the loss; capped ones stay in its normaliser (AReaL)
        weights, behav = rl.behav_imp_weights(
            old, batch.tensor("logprobs"), work.tensor(mask_key), behav_imp_weight_cap
        )
        work["pg_weights"] = weights
        metrics.update({f"actor/{k}": float(v) for k, v in behav.items()})

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        mask = b.tensor(mask_key)
        lp, ent = batch_logprobs(
            module, b, temperature=temperature, top_k=top_k, top_p=top_p, entropy=True, replay=replay
        )
        assert ent is not None
        old_b = b.tensor("old_logprobs") if own is None else own.take(b.tensor("row"), lp)
        total, m = surrogate(
            lp, old_b, b.tensor("advantages"), mask, clip_eps, clip_eps_high,
            agg=agg, global_normalizer=norm, norm_length=width, dual_clip=dual_clip,
            weights=b.tensor("pg_weights") if "pg_weights" in b else None,
        )  # fmt: skip
        out = {k: float(v) for k, v in m.items()}
        if entropy_coef:
            e_loss, _ = rl.entropy_bonus(
                ent, mask, entropy_coef, agg=agg, global_normalizer=norm, norm_length=width
            )
            total = total + e_loss
        if kl_loss_coef and "ref_logprobs" in b:
            k_loss, km = rl.kl_loss(
                lp,
                b.tensor("ref_logprobs"),
                mask,
                kind=kl_loss_type,
                coef=kl_loss_coef,
                agg=agg,
                global_normalizer=norm,
                norm_length=width,
            )
            total = total + k_loss
            out["kl_loss"] = float(km["kl"])  # the KL estimate the loss term penalises (nats/token)
        tokens = float(mask.sum())
        out["entropy"] = float(rl.masked_sum(ent.detach(), mask) / max(tokens, 1.0))
        return total, out, tokens

    aux = {"router_aux_loss_coef": router_aux_loss_coef}
    metrics.update(optimize(ctx, work, loss_fn, prefix="actor", mask_key=mask_key, agg=agg, **aux))
    if own is not None:  # every row's π_old known now: the gap the first pass would have measured
        assert bool(own.known.all())
        metrics.update(_logprob_gap(own.old_BR, batch))
    metrics.update(replay.finish(ctx.train_hooks) if replay else {})  # every share's and stage's
    return metrics


def _reward_kl(batch: Batch, kl_estimator: str) -> torch.Tensor:
    return rl.kl_estimate(
        batch.tensor("logprobs"),
        batch.tensor("ref_logprobs"),
        batch.tensor("response_mask"),
        kind=kl_estimator,
    )


def _kl_metrics(kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {"actor/reward_kl": float(rl.masked_sum(kl, mask) / max(1, int(mask.sum())))} if mask.any() else {}


def ppo_advantages(
    batch: Batch, kl_coef: float, kl_estimator: str, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE advantages and returns ``[B,R]`` of KL-penalised token rewards (Ouyang et al. 2022, eq. 2).

    With ``truncated`` and ``bootstrap_values`` ``[B]`` in the batch, a truncated row bootstraps from
    V(s_T) after its last token (Pardo et al. 2018); otherwise every row is terminal (value 0 after it).
    """
    mask = batch.tensor("response_mask")
    kl = _reward_kl(batch, kl_estimator)
    rewards = rl.token_rewards(batch.tensor("scores"), mask, kl, kl_coef)
    trunc = batch.tensor("truncated") if "truncated" in batch else None
    boot = batch.tensor("bootstrap_values").float() if "bootstrap_values" in batch else None
    adv, ret = rl.gae(
        rewards, batch.tensor("values"), mask, gamma, lam, bootstrap_value=boot, truncated=trunc
    )
    return adv, ret, kl


PPO_IN = (*SEQ, "logprobs", "ref_logprobs", "values", "scores", "truncated", "bootstrap_values")
PPO_OPTIONAL = ("truncated", "bootstrap_values")
PPO_ARG_INPUTS = tuple(a for a in PG_ARG_INPUTS if a.name not in PPO_IN)  # truncated: an optional input
PPO_REWARD_ARGS = (kl_coef_arg(0.05), KL_ESTIMATOR_ARG, *GAE_ARGS)


@node_function(
    "ppo_actor",
    "train",
    inputs=PPO_IN,
    optional_inputs=PPO_OPTIONAL,
    heads=("lm",),
    arg_inputs=PPO_ARG_INPUTS,
    first_pass=first_pass_share,
    check=overlong_filter_mistakes,
    args=(
        *PPO_REWARD_ARGS,
        Arg(
            "whiten_advantages",
            bool,
            True,
            "whiten the advantages over the whole batch",
            "OpenAI Baselines PPO2",
        ),
        *pg_args(),
    ),
)
def ppo_actor(
    ctx: NodeContext,
    batch: Batch,
    *,
    kl_coef: float,
    kl_estimator: str,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    loss: str,
    **pg: Any,
) -> NodeResult:
    """PPO policy step (Schulman et al. 2017; RLHF form of Ouyang et al. 2022): GAE, KL-penalised rewards.

    Needs a critic's ``values``; binding ``truncated`` (from ``generate``) and ``bootstrap_values`` (from
    ``values``) bootstraps truncated responses. Without a critic, use ``reinforce_pp_actor`` (REINFORCE++:
    the batch mean of the reward-to-go as baseline) or the group baselines of ``rloo_actor``/``grpo_actor``.
    """
    adv, ret, kl = ppo_advantages(batch, kl_coef, kl_estimator, gamma, lam)
    mask = batch.tensor("response_mask")
    if whiten_advantages:  # over the whole batch, all data-parallel shares
        adv = rl.masked_whiten(adv, mask, all_sum=ctx.train_hooks.all_sum)
    metrics = pg_train(ctx, batch, adv, **pg, loss=loss)
    metrics.update(_kl_metrics(kl, mask))
    metrics["critic/returns/mean"] = float(rl.masked_mean(ret, mask)) if mask.any() else 0.0
    return NodeResult({}, metrics, sequence_tokens(batch) * ctx.node.epochs)


@node_function(
    "ppo_critic",
    "train",
    inputs=PPO_IN,
    optional_inputs=PPO_OPTIONAL,
    heads=("value",),
    args=(
        *PPO_REWARD_ARGS,
        Arg(
            "value_clip",
            float,
            0.2,
            "clip range of the value change from the old values (null: off)",
            "OpenAI Baselines PPO2",
            low=0,
            low_open=True,
            optional=True,
        ),
        AGG_ARG,
        AUX_LOSS_ARG,
    ),
)
def ppo_critic(
    ctx: NodeContext,
    batch: Batch,
    *,
    kl_coef: float,
    kl_estimator: str,
    gamma: float,
    lam: float,
    value_clip: float | None,
    agg: str,
    router_aux_loss_coef: float,
) -> NodeResult:
    """PPO value step: clipped value loss towards the GAE returns of the same rewards the actor uses
    (bootstrapped for truncated responses when ``truncated``/``bootstrap_values`` are bound)."""
    _, ret, _ = ppo_advantages(batch, kl_coef, kl_estimator, gamma, lam)
    work = batch.select(SEQ)
    work["old_values"] = batch.tensor("values")
    work["returns"] = ret
    width = int(batch.tensor("response_ids").shape[1])

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        v = response_values(
            module,
            b.tensor("prompt_ids"),
            b.tensor("prompt_mask"),
            b.tensor("response_ids"),
            b.tensor("response_mask"),
        ).float()
        loss, m = rl.value_loss(
            v,
            b.tensor("old_values"),
            b.tensor("returns"),
            b.tensor("response_mask"),
            value_clip,
            agg=agg,
            global_normalizer=norm,
            norm_length=width,
        )
        return loss, {k: float(val) for k, val in m.items()}, float(b.tensor("response_mask").sum())

    metrics = optimize(
        ctx, work, loss_fn, prefix="critic", agg=agg, router_aux_loss_coef=router_aux_loss_coef
    )
    return NodeResult({}, metrics, sequence_tokens(batch) * ctx.node.epochs)


def _outcome_node(
    ctx: NodeContext, batch: Batch, advantages: torch.Tensor, pg: dict[str, Any], loss: str
) -> NodeResult:
    metrics = pg_train(ctx, batch, advantages, **pg, loss=loss)
    metrics.update(_kl_metrics(_reward_kl(batch, "k1"), batch.tensor("response_mask")))
    mask = batch.tensor("response_mask")
    metrics["critic/advantages/mean"] = float(rl.masked_mean(advantages, mask)) if mask.any() else 0.0
    return NodeResult({}, metrics, sequence_tokens(batch) * ctx.node.epochs)


OUTCOME_IN = (*SEQ, "logprobs", "ref_logprobs", "scores")
SHAPED_ARGS = (kl_coef_arg(0.05, "KL penalty subtracted from each sequence's score"), KL_ESTIMATOR_ARG)


@node_function(
    "grpo_actor",
    "train",
    inputs=OUTCOME_IN,
    heads=("lm",),
    arg_inputs=PG_ARG_INPUTS,
    first_pass=first_pass_share,
    group_wise="GRPO normalises each reward by the mean and std of its prompt's group (Shao et al., 2024)",
    args=(
        Arg(
            "std",
            str,
            "group",
            "reward normaliser: the group's std (GRPO), the batch's std (Lite PPO) or none (Dr. GRPO)",
            "Shao et al. 2024; Liu et al. 2025",
            choices=("group", "batch", "none"),
        ),
        Arg(
            "eps",
            float,
            1e-6,
            "added to the std; a zero-spread group gets advantage 0 for any eps >= 0",
            "Shao et al. 2024",
            low=0,
        ),
        *pg_args(kl_loss_coef=0.001),
    ),
)
def grpo_actor(ctx: NodeContext, batch: Batch, *, std: str, eps: float, loss: str, **pg: Any) -> NodeResult:
    """GRPO (Shao et al. 2024): group-relative advantages, KL to the reference as a loss term (k3)."""
    adv = rl.grpo_advantages(
        batch.tensor("scores"),
        batch.tensor("response_mask"),
        ctx.group_size,
        std=std,
        eps=eps,
        all_sum=ctx.train_hooks.all_sum,
    )
    return _outcome_node(ctx, batch, adv, pg, loss=loss)


def _kl_shaped_scores(batch: Batch, kl_coef: float, kl_estimator: str) -> torch.Tensor:
    """Sequence scores minus ``kl_coef`` × the sequence's summed KL to the reference (RLOO/ReMax reward)."""
    kl = _reward_kl(batch, kl_estimator)
    return batch.tensor("scores").float() - kl_coef * rl.masked_sum(kl, batch.tensor("response_mask"), dim=-1)


@node_function(
    "rloo_actor",
    "train",
    inputs=OUTCOME_IN,
    heads=("lm",),
    arg_inputs=PG_ARG_INPUTS,
    first_pass=first_pass_share,
    group_wise="RLOO's baseline is the mean reward of the other samples of the same prompt "
    "(Ahmadian et al., 2024)",
    args=(*SHAPED_ARGS, *pg_args()),
)
def rloo_actor(
    ctx: NodeContext, batch: Batch, *, kl_coef: float, kl_estimator: str, loss: str, **pg: Any
) -> NodeResult:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline over the group's KL-shaped sequence rewards."""
    scores = _kl_shaped_scores(batch, kl_coef, kl_estimator)
    adv = rl.rloo_advantages(scores, batch.tensor("response_mask"), ctx.group_size)
    return _outcome_node(ctx, batch, adv, pg, loss=loss)


@node_function(
    "remax_actor",
    "train",
    inputs=(*OUTCOME_IN, "greedy_scores"),
    heads=("lm",),
    arg_inputs=PG_ARG_INPUTS,
    first_pass=first_pass_share,
    args=(*SHAPED_ARGS, *pg_args()),
)
def remax_actor(
    ctx: NodeContext, batch: Batch, *, kl_coef: float, kl_estimator: str, loss: str, **pg: Any
) -> NodeResult:
    """ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline."""
    scores = _kl_shaped_scores(batch, kl_coef, kl_estimator)
    adv = rl.remax_advantages(scores, batch.tensor("greedy_scores").float(), batch.tensor("response_mask"))
    return _outcome_node(ctx, batch, adv, pg, loss=loss)


@node_function(
    "reinforce_pp_actor",
    "train",
    inputs=OUTCOME_IN,
    heads=("lm",),
    arg_inputs=PG_ARG_INPUTS,
    first_pass=first_pass_share,
    args=(kl_coef_arg(0.01), KL_ESTIMATOR_ARG, GAMMA_ARG, *pg_args()),
)
def reinforce_pp_actor(
    ctx: NodeContext, batch: Batch, *, kl_coef: float, kl_estimator: str, gamma: float, loss: str, **pg: Any
) -> NodeResult:
    """REINFORCE++ (Hu 2025): KL-penalised token rewards, reward-to-go, whitened over the whole batch.

    PPO without a critic: the whitening subtracts the batch mean of the reward-to-go, a baseline.
    """
    mask = batch.tensor("response_mask")
    rewards = rl.token_rewards(batch.tensor("scores"), mask, _reward_kl(batch, kl_estimator), kl_coef)
    adv = rl.reinforce_pp_advantages(rewards, mask, gamma, all_sum=ctx.train_hooks.all_sum)
    return _outcome_node(ctx, batch, adv, pg, loss=loss)
