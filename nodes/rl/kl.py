"""KL estimators k1, k2, k3 between the policy π and a reference π_ref, from sampled-token log-probs.

Shapes (DESIGN.md): B rows, R response tokens. Source: J. Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html). With ``ℓ = log π(y) - log π_ref(y)`` for ``y ~ π``:

- ``k1 = ℓ``                     unbiased for KL(π‖π_ref), high variance, can be negative.
- ``k2 = ℓ² / 2``                biased (low variance) estimate of KL(π‖π_ref).
- ``k3 = exp(-ℓ) - 1 + ℓ``       unbiased for KL(π‖π_ref), always ≥ 0 (the GRPO/"low_var_kl" term).

Used as a *loss term* (differentiated through ``log π(y)`` of the drawn samples, no score-function term),
their expected gradients differ from their expected values (checked exactly in the tests):

- ``k1``: ``E[∇k1] = E[∇log π] = 0`` — no gradient in expectation; use k1 inside the reward instead.
- ``k2``: ``E[∇k2] = ∇ KL(π‖π_ref)`` — follows the reverse KL; the correct reverse-KL loss.
- ``k3``: ``E[∇k3] = ∇ KL(π_ref‖π)`` — follows the *forward* KL (gradient ``π - π_ref`` w.r.t. logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, sanitize

__all__ = ["KL_ESTIMATORS", "KLEstimator", "kl_estimate", "kl_terms"]


@dataclass(frozen=True)
class KLEstimator:
    """What an estimator estimates as a value and which divergence its gradient follows as a loss."""

    name: str
    formula: str
    value_estimates: str
    gradient_follows: str


KL_ESTIMATORS: dict[str, KLEstimator] = {
    "k1": KLEstimator("k1", "log(π/π_ref)", "KL(π‖π_ref), unbiased", "none (zero expected gradient)"),
    "k2": KLEstimator("k2", "½·log(π/π_ref)²", "KL(π‖π_ref), biased, low variance", "reverse KL(π‖π_ref)"),
    "k3": KLEstimator(
        "k3", "π_ref/π - 1 - log(π_ref/π)", "KL(π‖π_ref), unbiased, ≥ 0", "forward KL(π_ref‖π)"
    ),
}


def kl_terms(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k3",
    clamp: float | None = None,
) -> torch.Tensor:
    """Per-token KL estimator ``[B, R]`` float32 (differentiable w.r.t. ``logprobs``), 0 at mask-0.

    ``logprobs`` = log π(y_t) (nats) of the sampled tokens, ``ref_logprobs`` = log π_ref(y_t), ``mask``
    0/1, all ``[B, R]``. ``kind`` in ``KL_ESTIMATORS`` (k1, k2, k3; formulas in the module docstring).
    ``clamp``: optional symmetric bound on the result (verl clamps k3 to ±10 for stability).
    Aggregate as a loss with :func:`rlflow.nodes.rl.losses.aggregate`, or as a reward penalty with
    :func:`rlflow.nodes.rl.rewards.token_rewards`. Raises :class:`RLInputError` for an unknown ``kind``.
    """
    if kind not in KL_ESTIMATORS:
        raise RLInputError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_ESTIMATORS)}")
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs, ref_logprobs=ref_logprobs)
    log_ratio = sanitize(logprobs, m) - sanitize(ref_logprobs, m)
    if kind == "k1":
        out = log_ratio
    elif kind == "k2":
        out = 0.5 * log_ratio * log_ratio
    else:
        # k3 with r = π_ref/π = exp(-ℓ): (r - 1) - log r
        out = torch.expm1(-log_ratio) + log_ratio
    if clamp is not None:
        out = out.clamp(min=-clamp, max=clamp)
    return sanitize(out, m)


def kl_estimate(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str = "k1"
) -> torch.Tensor:
    """Per-token KL value ``[B, R]`` for logging or for the reward penalty: :func:`kl_terms`, detached."""
    return kl_terms(logprobs.detach(), ref_logprobs.detach(), mask, kind)
