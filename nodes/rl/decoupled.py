"""Decoupled PPO: the clip anchored at the proximal policy, the sample re-weighted from the behaviour policy.

Shapes (DESIGN.md): B rows, R response tokens. ``mask`` ``[B, R]`` 0/1 marks trainable tokens (see
:mod:`rlflow.nodes.rl.masks`); values at mask-0 positions (NaN, ±inf included) never reach an output.

Source: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language
Reasoning" (arXiv:2505.24298), the decoupled PPO objective; after Hilton et al. 2022, "Batch size-invariance
for policy optimization". Three policies score each sampled token y_t:

- the **behaviour** policy μ (``behavior_logprobs``): the weights that sampled it, possibly several versions
  old in asynchronous RL (the generate node's ``logprobs``);
- the **proximal** policy π_prox (``proximal_logprobs``): the weights at the start of the train step (a
  no-grad forward of the train node's model before its update);
- the **current** policy π_θ (``logprobs``, differentiable).

Per token, with ``u = π_θ/π_prox`` and the constant behaviour importance weight ``w = π_prox/μ``::

    ℓ_t = w_t · max(−A_t·u_t, −A_t·clip(u_t, 1 − ε, 1 + ε_high))      (loss to minimise)

i.e. ``−w·min(u·A, clip(u)·A)``: PPO's trust region around π_prox, not around the stale μ, while ``w``
corrects the sample's distribution. ``w`` carries no gradient. With π_prox = μ every ``w`` is exactly 1 and
the loss is PPO's, bit for bit.

``behav_imp_weight_cap`` (AReaL's option of that name): a token with ``w > cap`` gets weight 0, so it leaves
the policy loss, but it still counts in the loss normaliser (AReaL divides by the tokens of the original
loss mask). The comparison is in log space (``log π_prox − log μ > log cap``); ``w`` itself is
``exp(clamp(log π_prox − log μ, ±20))`` so a token with μ ≈ 0 cannot overflow.
"""

from __future__ import annotations

import math

import torch

from rlflow.nodes.rl.losses import LOG_RATIO_BOUND, Metrics, policy_loss
from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, masked_mean, sanitize

__all__ = ["behav_imp_weights", "decoupled_policy_loss"]


def behav_imp_weights(
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    mask: torch.Tensor,
    behav_imp_weight_cap: float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """The behaviour importance weights ``w = π_prox/μ`` of decoupled PPO, capped as AReaL caps them.

    Args:
        proximal_logprobs: ``[B, R]`` log π_prox of the sampled tokens (nats).
        behavior_logprobs: ``[B, R]`` log μ of the same tokens (nats; the sampler's ``logprobs``).
        mask: ``[B, R]`` 0/1 tokens in the loss.
        behav_imp_weight_cap: ``None`` (no cap) or the cap > 1: tokens with ``w > cap`` get weight 0.

    Returns:
        ``(weights, metrics)``: ``weights`` ``[B, R]`` float32, detached, 0 outside ``mask`` and at capped
        tokens; ``metrics`` (detached scalars over ``mask``): ``behav_imp_weight_mean`` and
        ``behav_imp_weight_max`` of ``w`` before the cap (0 for an empty mask), and with a cap
        ``behav_imp_weight_capfrac``, the fraction of tokens whose weight the cap set to 0.

    Raises:
        RLInputError: a cap ≤ 1, or shapes that differ from ``mask``.
        MaskError: ``mask`` is not 0/1.
    """
    m = check_mask(mask)
    check_shapes(m, proximal_logprobs=proximal_logprobs, behavior_logprobs=behavior_logprobs)
    if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 1.0:
        raise RLInputError(f"behav_imp_weight_cap must be > 1, got {behav_imp_weight_cap}")
    log_w = (sanitize(proximal_logprobs.float(), m) - sanitize(behavior_logprobs.float(), m)).detach()
    w = torch.exp(log_w.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))  # as PPO's ratio: no overflow
    metrics: Metrics = {
        "behav_imp_weight_mean": masked_mean(w, m).detach(),
        "behav_imp_weight_max": w.masked_fill(~m, 0.0).max() if m.any() else torch.zeros(()),
    }
    keep = m
    if behav_imp_weight_cap is not None:
        over = m & (log_w > math.log(behav_imp_weight_cap))
        keep = m & ~over
        metrics["behav_imp_weight_capfrac"] = masked_mean(over.float(), m).detach()
    return w.masked_fill(~keep, 0.0), metrics


def decoupled_policy_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Decoupled PPO loss (module docstring): :func:`rlflow.nodes.rl.losses.policy_loss` with
    ``old_logprobs = proximal_logprobs`` and ``weights`` = :func:`behav_imp_weights`.

    All tensors ``[B, R]`` (log-probs in nats; ``logprobs`` differentiable, the others constants). Clip,
    dual clip, aggregation and normaliser as :func:`~rlflow.nodes.rl.losses.policy_loss` (a capped token
    still counts in the normaliser). Metrics: ``pg_loss``, ``pg_clipfrac`` (clipped against π_prox),
    ``pg_clipfrac_lower``, ``ppo_kl`` (mean ``log π_prox − log π_θ``), and :func:`behav_imp_weights`'.

    Raises:
        RLInputError: bad shapes, a cap ≤ 1, or a clip argument :func:`policy_loss` rejects.
    """
    w, behav = behav_imp_weights(proximal_logprobs, behavior_logprobs, mask, behav_imp_weight_cap)
    loss, metrics = policy_loss(
        logprobs, proximal_logprobs, advantages, mask, clip_eps, clip_eps_high, dual_clip, agg,
        global_normalizer, norm_length, weights=w,
    )  # fmt: skip
    return loss, {**metrics, **behav}
