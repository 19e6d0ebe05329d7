"""Policy-gradient surrogates that replace PPO's clipped minimum: CISPO's clipped importance-sampling weight
and SAPO's soft gate.

Shapes (DESIGN.md): B rows, R response tokens. ``logprobs`` (differentiable), ``old_logprobs`` and
``advantages`` (constants) and the 0/1 ``mask`` are ``[B, R]``; mask-0 values (NaN, ±inf included) never reach
a loss or a gradient (:mod:`rlflow.nodes.rl.masks`). ``ρ_t = exp(log π_θ(y_t) − log π_old(y_t))``, its log
clamped to ±:data:`~rlflow.nodes.rl.losses.LOG_RATIO_BOUND` as in PPO's. Both follow
:class:`rlflow.nodes.rl.policy_losses.PolicyLossFn` (registered in ``POLICY_LOSSES``): the per-token loss
times the constant ``weights`` when given, reduced by :func:`rlflow.nodes.rl.losses.aggregate`. Neither
clips the objective, so neither has PPO's dual clip (a ``dual_clip`` is an error, not ignored).
"""

from __future__ import annotations

import torch

from rlflow.nodes.rl.losses import (
    LOG_RATIO_BOUND,
    Metrics,
    aggregate,
    local_loss,
    masked_frac,
    weighted_tokens,
)
from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, masked_mean, sanitize

__all__ = ["cispo_policy_loss", "sapo_gate", "sapo_policy_loss"]


def _inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, log π, log π_old, A, ρ)``, mask-0 entries zeroed before any arithmetic; old and A detached."""
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, weights=weights)
    logp = sanitize(logprobs.float(), m)
    old = sanitize(old_logprobs.float(), m).detach()
    adv = sanitize(advantages.float(), m).detach()
    ratio = torch.exp((logp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return m, logp, old, adv, ratio


def _no_dual_clip(name: str, dual_clip: float | None) -> None:
    if dual_clip is not None:
        raise RLInputError(
            f"{name} has no clipped objective for a dual clip to bound; got dual_clip={dual_clip}"
        )


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    *,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """CISPO: REINFORCE on the tokens' log-probs, each weighted by its clipped importance ratio, a constant.

    Source: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
    (arXiv:2506.13585), eq. 4-5. Per token (to minimise) ``ℓ_t = −sg[ŵ_t]·A_t·log π_θ(y_t)``,
    ``ŵ_t = clip(ρ_t, 1 − clip_eps, 1 + clip_eps_high)``; the stop-gradient ``sg`` makes the gradient
    ``−ŵ_t·A_t·∇log π_θ(y_t)`` (divided by the aggregation's normaliser) for every token: unlike PPO's clip,
    a token whose ratio leaves the range keeps its gradient, only its weight is bounded. ``clip_eps``
    ``math.inf``: no lower bound (the paper's choice, "ε_low large"); ``clip_eps_high`` ``None``:
    ``clip_eps``. The loss's value depends on ``log π`` itself (it is a surrogate of the gradient, not of the
    objective). ``weights`` ``[B, R]`` (constants) multiply ``ℓ_t``. Metrics: ``pg_loss``, ``pg_clipfrac``
    (share of tokens whose weight was clipped, at either bound), ``ppo_kl`` (mean ``log π_old − log π``).

    Raises:
        RLInputError: a negative clip range, a ``dual_clip``, bad shapes or mask.
    """
    _no_dual_clip("CISPO", dual_clip)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if clip_eps < 0 or high < 0:
        raise RLInputError(f"clip_eps must be >= 0, got {clip_eps}, {clip_eps_high}")
    m, logp, old, adv, ratio = _inputs(logprobs, old_logprobs, advantages, mask, weights)
    w = ratio.clamp(max=1.0 + high).clamp(min=1.0 - clip_eps).detach()
    tok = weighted_tokens(-w * adv * logp, weights, m)
    loss = aggregate(tok, m, agg, global_normalizer, norm_length)
    return loss, {
        "pg_loss": local_loss(tok, m, agg, norm_length),
        "pg_clipfrac": masked_frac(w != ratio.detach(), m),
        "ppo_kl": masked_mean(old - logp, m).detach(),
    }


def sapo_gate(ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """SAPO's soft gate ``f(ρ) = σ(τ·(ρ − 1))·4/τ`` per entry; ``τ = tau_pos`` where ``A > 0``, else
    ``tau_neg``.

    Source: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347). ``df/dρ = 4·σ(1 − σ)``
    is 1 at ``ρ = 1`` for any τ (on-policy the gradient is plain policy gradient's) and decays smoothly as
    ``ρ`` leaves 1, faster for a larger τ. ``ratio`` and ``advantages`` of one shape.

    Raises:
        RLInputError: a temperature ≤ 0.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise RLInputError(f"SAPO temperatures must be > 0, got tau_pos={tau_pos}, tau_neg={tau_neg}")
    tau = torch.where(advantages > 0, float(tau_pos), float(tau_neg)).to(ratio.dtype)
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = None,
    clip_eps_high: float | None = None,
    *,
    tau_pos: float,
    tau_neg: float,
    dual_clip: float | None = None,
    agg: str = "seq-mean-token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SAPO: the ratio through a smooth sigmoid gate (:func:`sapo_gate`) in place of PPO's hard clip.

    Source: Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347): per token (to minimise)
    ``ℓ_t = −f_t(ρ_t)·A_t`` with the gate of temperature ``tau_pos`` (A > 0) or ``tau_neg`` (A ≤ 0; the
    paper takes ``tau_neg > tau_pos``: a negative update spreads over many unsampled tokens, so it decays
    faster), averaged per sequence then over sequences (``seq-mean-token-mean``, the paper's
    ``1/G Σ_i 1/|y_i| Σ_t``). Gradient per token ``−A_t·4σ(1 − σ)·ρ_t·∇log π_θ(y_t)``. SAPO has no clip
    range: ``clip_eps``/``clip_eps_high`` must be ``None``. ``weights`` ``[B, R]`` (constants) multiply
    ``ℓ_t``. Metrics: ``pg_loss``, ``ppo_kl``, ``sapo_weight_mean`` (mean of the gradient's factor
    ``4σ(1 − σ)·ρ`` over the tokens: 1 on-policy, toward 0 as the ratios leave 1; PPO's is 1 inside its clip
    range and 0 outside).

    Raises:
        RLInputError: a clip range or ``dual_clip`` given, a temperature ≤ 0, bad shapes or mask.
    """
    if clip_eps is not None or clip_eps_high is not None:
        raise RLInputError(
            f"SAPO has no clip range (its gate's temperatures replace it); got clip_eps={clip_eps}, "
            f"clip_eps_high={clip_eps_high}"
        )
    _no_dual_clip("SAPO", dual_clip)
    m, logp, old, adv, ratio = _inputs(logprobs, old_logprobs, advantages, mask, weights)
    gate = sapo_gate(ratio, adv, tau_pos, tau_neg)
    tok = weighted_tokens(-gate * adv, weights, m)
    loss = aggregate(tok, m, agg, global_normalizer, norm_length)
    with torch.no_grad():
        tau = torch.where(adv > 0, float(tau_pos), float(tau_neg))
        s = torch.sigmoid(tau * (ratio - 1.0))
        grad_factor = 4.0 * s * (1.0 - s) * ratio
    return loss, {
        "pg_loss": local_loss(tok, m, agg, norm_length),
        "ppo_kl": masked_mean(old - logp, m).detach(),
        "sapo_weight_mean": masked_mean(grad_factor, m).detach(),
    }
