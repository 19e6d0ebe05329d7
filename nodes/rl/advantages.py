"""Advantages and returns: GAE, reward-to-go, GRPO, RLOO, ReMax, REINFORCE++.

Shapes (DESIGN.md): B rows, R response tokens, G samples per prompt, P = B / G prompts.

Conventions shared by every function here:
- Token tensors are padded ``[B, R]`` with a 0/1 ``mask`` (``response_mask``). A mask-0 token *inside* a
  response (a tool or observation token) is skipped: the recursion jumps from one trainable token to the
  next, it is not an episode end, and discounting counts trainable tokens only. Rewards and values at
  mask-0 positions are ignored (put rewards on trainable tokens, e.g. with
  :func:`rlflow.nodes.rl.rewards.token_rewards`).
- Groups are contiguous rows: rows ``[g·G, (g+1)·G)`` answer prompt g (``repeat_interleave`` layout).
- A sequence with zero trainable tokens gets advantage 0 and is left out of every baseline, mean and std.
- Every ``std`` is the unbiased (Bessel, ``n-1``) sample standard deviation, as ``torch.std`` and the
  GRPO reference implementations (TRL, verl); with fewer than 2 values it is defined as 0. Normalised
  advantages are ``(x - mean) / (std + eps)``, and 0 where the spread is 0 (a group of one, an all-equal
  group), for every ``eps >= 0`` (with ``eps = 0`` the formula would be 0/0).
"""

from __future__ import annotations

import torch

from rlflow.nodes.rl.masks import (
    AllSum,
    RLInputError,
    check_mask,
    check_shapes,
    masked_moments,
    masked_whiten,
    sanitize,
)

__all__ = [
    "broadcast_to_tokens",
    "gae",
    "grpo_advantages",
    "reinforce_pp_advantages",
    "remax_advantages",
    "reward_to_go",
    "rloo_advantages",
]


def _end_values(
    batch: int,
    bootstrap_value: torch.Tensor | None,
    truncated: torch.Tensor | None,
    like: torch.Tensor,
) -> torch.Tensor:
    """Value after each sequence's last trainable token: 0 if terminal, bootstrap value if truncated."""
    if truncated is None:
        if bootstrap_value is not None:
            raise RLInputError("bootstrap_value given without truncated: say which sequences were truncated")
        return torch.zeros(batch, dtype=like.dtype, device=like.device)
    trunc = check_mask(truncated, "truncated")
    if trunc.shape != (batch,):
        raise RLInputError(f"truncated: expected shape [{batch}], got {tuple(trunc.shape)}")
    if bootstrap_value is None:
        if bool(trunc.any()):
            raise RLInputError("truncated sequences need bootstrap_value (the value after their last token)")
        return torch.zeros(batch, dtype=like.dtype, device=like.device)
    if bootstrap_value.shape != (batch,):
        raise RLInputError(f"bootstrap_value: expected shape [{batch}], got {tuple(bootstrap_value.shape)}")
    return sanitize(bootstrap_value.to(like.dtype), trunc)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
    bootstrap_value: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns ``(advantages [B, R], returns [B, R])`` float32.

    Source: Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage
    Estimation". Over the trainable tokens ``t_1 < … < t_n`` of a row (mask-0 tokens skipped):
    ``δ_i = r_{t_i} + γ·V_{t_{i+1}} - V_{t_i}``, ``A_i = δ_i + γλ·A_{i+1}``, ``returns = A + V``.
    After the last token, ``V_{t_{n+1}}`` is 0 for a terminal end (EOS) and ``bootstrap_value[b]`` for a
    truncated one (``truncated[b]`` true: the length limit cut the episode).

    ``token_rewards``, ``values``, ``mask`` ``[B, R]``; ``gamma``, ``lam`` in [0, 1]; ``bootstrap_value``
    ``[B]`` (value of the state after the last token; only read where ``truncated``); ``truncated`` ``[B]``
    bool/0-1. Mask-0 positions of both outputs are 0. Raises :class:`RLInputError` when a truncated
    sequence has no bootstrap value, or for shape/mask errors.
    """
    m = check_mask(mask)
    check_shapes(m, token_rewards=token_rewards, values=values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise RLInputError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    r = sanitize(token_rewards.float(), m)
    v = sanitize(values.float(), m)
    next_value = _end_values(m.shape[0], bootstrap_value, truncated, v)
    if m.shape[1] == 0:
        return r, r
    next_adv = torch.zeros_like(next_value)
    advs: list[torch.Tensor] = []
    for t in reversed(range(m.shape[1])):
        mt = m[:, t]
        adv_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * next_adv
        # mask-0 tokens pass the running value/advantage through unchanged (skipped, not an episode end)
        next_value = torch.where(mt, v[:, t], next_value)
        next_adv = torch.where(mt, adv_t, next_adv)
        advs.append(adv_t)
    adv = sanitize(torch.stack(advs[::-1], dim=1), m)
    return adv, sanitize(adv + v, m)


def reward_to_go(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    bootstrap_value: torch.Tensor | None = None,
    truncated: torch.Tensor | None = None,
) -> torch.Tensor:
    """Discounted reward-to-go ``G_i = Σ_{j≥i} γ^{j-i} r_{t_j}`` (+ ``γ^{n-i+1}·bootstrap`` if truncated).

    Over trainable tokens only (mask-0 tokens skipped, discount counts trainable tokens). Shapes as
    :func:`gae`; returns ``[B, R]`` float32, 0 at mask-0. Source: Williams 1992 (REINFORCE); it is GAE
    with ``V = 0``, ``λ = 1``.
    """
    zeros = torch.zeros(token_rewards.shape, dtype=torch.float32, device=token_rewards.device)
    adv, _ = gae(token_rewards, zeros, mask, gamma, 1.0, bootstrap_value, truncated)
    return adv


def broadcast_to_tokens(seq_values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Copy a per-sequence value ``[B]`` onto every trainable token: ``[B, R]`` float32, 0 at mask-0."""
    m = check_mask(mask)
    if seq_values.shape != (m.shape[0],):
        raise RLInputError(
            f"expected per-sequence values of shape [{m.shape[0]}], got {tuple(seq_values.shape)}"
        )
    return sanitize(seq_values.float().unsqueeze(1).expand(m.shape), m)


def _grouped(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``[P, G]`` (0 where invalid) and validity ``[P, G]`` (row has ≥ 1 trainable token)."""
    m = check_mask(mask)
    batch = m.shape[0]
    if scores.shape != (batch,):
        raise RLInputError(f"scores: expected shape [{batch}], got {tuple(scores.shape)}")
    if group_size < 1 or batch % group_size != 0:
        raise RLInputError(f"batch of {batch} rows does not split into groups of {group_size}")
    valid = m.any(dim=-1)
    s = sanitize(scores.float(), valid)
    return s.view(-1, group_size), valid.view(-1, group_size)


def _safe_sqrt(var: torch.Tensor) -> torch.Tensor:
    """``sqrt(var)``, 0 where ``var`` is 0 (finite gradient at 0)."""
    pos = var > 0
    return torch.where(pos, torch.where(pos, var, torch.ones_like(var)).sqrt(), torch.zeros_like(var))


def _normalised(centered: torch.Tensor, std: torch.Tensor, eps: float) -> torch.Tensor:
    """``centered / (std + eps)``, and 0 where ``std + eps`` is 0 (zero spread with ``eps = 0``)."""
    denom = std + eps
    ok = denom > 0
    return torch.where(
        ok, centered / torch.where(ok, denom, torch.ones_like(denom)), torch.zeros_like(centered)
    )


def _safe_std(sum_sq: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Unbiased std from a sum of squared deviations; 0 when count < 2 (finite gradient at 0)."""
    return _safe_sqrt(sum_sq / (count - 1).clamp(min=1))


def grpo_advantages(
    scores: torch.Tensor,
    mask: torch.Tensor,
    group_size: int,
    std: str = "group",
    eps: float = 1e-6,
    all_sum: AllSum | None = None,
) -> torch.Tensor:
    """Group-relative advantages ``[B, R]`` float32 (GRPO outcome supervision), equal on every token.

    Source: Shao et al. 2024, "DeepSeekMath" (GRPO): ``A_i = (r_i - mean_group(r)) / (std + eps)``.
    ``std="group"``: unbiased std of the group's scores (GRPO); ``"batch"``: unbiased std of all valid
    scores of the batch with group means (Liu et al. 2025, "Part I: Tricks or Traps?", Lite PPO);
    ``"none"``: mean baseline only (Liu et al. 2025, Dr. GRPO). ``eps`` (>= 0, default 1e-6) is added to the
    std. A group of size one, a group with one valid sequence, and an all-equal group give 0, also with
    ``eps = 0``. Raises :class:`RLInputError` for an unknown ``std`` or a negative ``eps``.
    ``scores`` ``[B]``, ``mask`` ``[B, R]``, ``group_size`` G with ``B % G == 0``. ``all_sum``: the rows are
    one data-parallel share of the batch (whole groups); the ``"batch"`` std is then the whole batch's
    (:func:`rlflow.nodes.rl.masks.masked_moments`).
    """
    if std not in ("group", "batch", "none"):
        raise RLInputError(f"std must be 'group', 'batch' or 'none', got {std!r}")
    if not eps >= 0:
        raise RLInputError(f"eps must be >= 0, got {eps}")
    s, valid = _grouped(scores, mask, group_size)
    count = valid.sum(dim=1, keepdim=True)
    mean = s.sum(dim=1, keepdim=True) / count.clamp(min=1)
    centered = sanitize(s - mean, valid)
    if std == "group":
        centered = _normalised(
            centered, _safe_std((centered * centered).sum(dim=1, keepdim=True), count), eps
        )
    elif std == "batch":
        _, var = masked_moments(s, valid, all_sum=all_sum)
        centered = _normalised(centered, _safe_sqrt(var), eps)
    return broadcast_to_tokens(sanitize(centered, valid).reshape(-1), mask)


def rloo_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """Leave-one-out advantages ``[B, R]``: ``A_i = r_i - mean_{j≠i} r_j`` over the group's valid samples.

    Source: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. 2024,
    "Back to Basics" (RLOO). Equals ``k/(k-1)·(r_i - mean)`` for k valid samples; k ≤ 1 gives 0.
    """
    s, valid = _grouped(scores, mask, group_size)
    count = valid.sum(dim=1, keepdim=True)
    others = (s.sum(dim=1, keepdim=True) - s) / (count - 1).clamp(min=1)
    adv = sanitize(s - others, valid & (count > 1))
    return broadcast_to_tokens(adv.reshape(-1), mask)


def remax_advantages(scores: torch.Tensor, greedy_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """ReMax advantages ``[B, R]``: ``A_i = r_i - r(greedy response to the same prompt)``.

    Source: Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models". ``scores`` and ``greedy_scores`` ``[B]`` (row-aligned: the caller
    repeats a prompt's greedy score for each of its samples); ``mask`` ``[B, R]``.
    """
    m = check_mask(mask)
    valid = m.any(dim=-1)
    if greedy_scores.shape != scores.shape:
        raise RLInputError(
            f"greedy_scores {tuple(greedy_scores.shape)} must match scores {tuple(scores.shape)}"
        )
    diff = sanitize(scores.float(), valid) - sanitize(greedy_scores.float(), valid)
    return broadcast_to_tokens(diff, m)


def reinforce_pp_advantages(
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    eps: float = 1e-8,
    all_sum: AllSum | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages ``[B, R]``: reward-to-go whitened over all trainable tokens of the batch.

    Source: Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models":
    ``G_t = Σ_{k≥t} γ^{k-t} r_k`` with ``r`` the token rewards (score on the last token minus the per-token
    KL penalty, :func:`rlflow.nodes.rl.rewards.token_rewards`), then ``A = (G - mean) / sqrt(var + eps)`` with
    masked batch statistics (:func:`rlflow.nodes.rl.masks.masked_whiten`). Pass the whole global batch, or one
    data-parallel share with ``all_sum`` (:meth:`rlflow.nodes.context.TrainHooks.all_sum`), so the statistics
    are the whole batch's.
    """
    m = check_mask(mask)
    check_shapes(m, token_rewards=token_rewards)
    returns = reward_to_go(token_rewards, m, gamma)
    return masked_whiten(returns, m, shift_mean=True, eps=eps, all_sum=all_sum)
