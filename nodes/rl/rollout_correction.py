"""Training/inference mismatch: truncated importance sampling and rejection of tokens beyond a ratio bound.

Shapes (DESIGN.md): B rows, R response tokens. ``mask`` ``[B, R]`` 0/1 marks trainable tokens (see
:mod:`rlflow.nodes.rl.masks`); values at mask-0 positions (NaN, ±inf included) never reach an output.

The sampler (π_rollout: vLLM, another kernel, another precision, or weights a few versions old) and the
trainer (π_old: the trainer's own log-probs of the sampled tokens with the weights before the update) give
the same token different probabilities. PPO's ratio ``π_θ/π_old`` does not see that gap, so the policy
gradient is silently off-policy. With the per-token log-ratio ``δ_t = log π_old(y_t) − log π_rollout(y_t)``
and the ratio ``r = e^δ`` at one of three levels,

==============  =====================================  ==========================================
level           ratio of token t in row b              source
==============  =====================================  ==========================================
``token``       ``r_bt = exp(δ_bt)``                   Yao et al. 2025 (TIS)
``sequence``    ``r_b = exp(Σ_t δ_bt)`` (product)      verl ``rollout_is: sequence``
``geometric``   ``r_b = exp(Σ_t δ_bt / n_b)``          verl ``rollout_rs: geometric``
==============  =====================================  ==========================================

- **truncated importance sampling** (``rollout_is``, token or sequence level): each token's policy-gradient
  loss is multiplied by the constant ``w = min(r, C)``, ``C = rollout_is_threshold`` (Yao et al. 2025, "Your
  Efficient RL Framework Secretly Brings You Off-Policy RL Training"; truncation as in IMPALA, Espeholt et
  al. 2018). On-policy (``δ = 0``) every weight is exactly 1.
- **rejection beyond a ratio bound** (``rollout_rs``, token, sequence or geometric level; verl's
  "rollout correction" rejection sampling, the "masked importance sampling" of Liu, Li et al. 2025, "When
  Speed Kills Stability"): a token whose ratio lies outside ``[lower, upper]`` leaves the loss entirely (its
  policy-gradient, entropy and KL terms) and the loss normaliser; at the sequence levels a row is kept or
  dropped as a whole. ``lower`` defaults to ``1/upper``.

Both compare in log space (no overflow for any δ); the IS weight is ``exp(min(level δ, log C))``. Argument
names follow verl's ``algorithm.rollout_correction`` (``rollout_is``, ``rollout_is_threshold``,
``rollout_rs``, ``rollout_rs_threshold``, ``rollout_rs_threshold_lower``).
"""

from __future__ import annotations

import math

import torch

from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, masked_mean, sanitize

__all__ = ["ROLLOUT_IS_LEVELS", "ROLLOUT_RS_LEVELS", "rollout_correction"]

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""Levels of the truncated importance weight (``rollout_is``)."""
ROLLOUT_RS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
"""Levels of the ratio bound that rejects tokens or rows (``rollout_rs``)."""

Metrics = dict[str, torch.Tensor]


def _level(delta: torch.Tensor, m: torch.Tensor, level: str) -> torch.Tensor:
    """Log-ratio ``[B, R]`` of each token at ``level`` (``delta`` is 0 at mask-0 positions)."""
    if level == "token":
        return delta
    total = delta.sum(dim=-1, keepdim=True)
    if level == "geometric":
        total = total / m.sum(dim=-1, keepdim=True).clamp(min=1)
    return total.expand_as(delta)


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float = 2.0,
    rollout_rs_threshold_lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Metrics]:
    """Truncated IS weights and the loss mask after rejection, from trainer and sampler log-probs.

    Args:
        old_logprobs: ``[B, R]`` log π_old of the sampled tokens (nats; the trainer's pass before the update).
        rollout_logprobs: ``[B, R]`` log π_rollout of the same tokens (nats; the sampler's ``logprobs``).
        mask: ``[B, R]`` 0/1 trainable tokens.
        rollout_is: ``None`` (weights 1), ``"token"`` or ``"sequence"`` (module docstring table).
        rollout_is_threshold: the truncation C ≥ 1 of ``w = min(r, C)``.
        rollout_rs: ``None`` (no rejection), ``"token"``, ``"sequence"`` or ``"geometric"``.
        rollout_rs_threshold: upper bound (> 1) of the kept ratios.
        rollout_rs_threshold_lower: lower bound in (0, 1) of the kept ratios (``None``: ``1/upper``).

    Returns:
        ``(weights, loss_mask, metrics)``: ``weights`` ``[B, R]`` float32, the constant per-token factor of
        the policy-gradient loss (0 outside ``loss_mask``); ``loss_mask`` ``[B, R]`` bool, ``mask`` minus
        rejected tokens; ``metrics`` (detached scalars): with ``rollout_is``, ``tis_weight_mean`` (mean
        weight over ``loss_mask``) and ``tis_clipfrac`` (fraction of ``loss_mask`` tokens whose weight was
        truncated); with ``rollout_rs``, ``mask_frac`` (fraction of ``mask`` tokens rejected).

    Raises:
        RLInputError: an unknown level, a threshold out of range, or shapes that differ from ``mask``.
        MaskError: ``mask`` is not 0/1.
    """
    m = check_mask(mask)
    check_shapes(m, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise RLInputError(f"rollout_is must be one of {list(ROLLOUT_IS_LEVELS)} or None, got {rollout_is!r}")
    if rollout_rs is not None and rollout_rs not in ROLLOUT_RS_LEVELS:
        raise RLInputError(f"rollout_rs must be one of {list(ROLLOUT_RS_LEVELS)} or None, got {rollout_rs!r}")
    if not rollout_is_threshold >= 1.0:
        raise RLInputError(f"rollout_is_threshold must be >= 1, got {rollout_is_threshold}")
    lower = 1.0 / rollout_rs_threshold if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
    if not (rollout_rs_threshold > 1.0 and 0.0 < lower < 1.0):
        raise RLInputError(
            f"rollout_rs bounds must satisfy 0 < lower < 1 < upper, got [{lower}, {rollout_rs_threshold}]"
        )
    delta = (sanitize(old_logprobs.float(), m) - sanitize(rollout_logprobs.float(), m)).detach()
    keep = m
    metrics: Metrics = {}
    if rollout_rs is not None:
        d = _level(delta, m, rollout_rs)
        keep = m & (d >= math.log(lower)) & (d <= math.log(rollout_rs_threshold))
        metrics["mask_frac"] = ((m & ~keep).sum() / m.sum().clamp(min=1)).float()
    weights = torch.ones_like(delta)
    if rollout_is is not None:
        d = _level(delta, m, rollout_is)
        cap = math.log(rollout_is_threshold)
        weights = torch.exp(d.clamp(max=cap))
        metrics["tis_clipfrac"] = masked_mean((d > cap).float(), keep).detach()
    weights = weights.masked_fill(~keep, 0.0)
    if rollout_is is not None:
        metrics["tis_weight_mean"] = masked_mean(weights, keep).detach()
    return weights, keep, metrics
