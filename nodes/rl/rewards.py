"""Token-level rewards from sequence scores, with a per-token KL penalty.

Shapes (DESIGN.md): B rows, R response tokens. Source: Ziegler et al. 2019, "Fine-Tuning Language Models
from Human Preferences"; Stiennon et al. 2020; Ouyang et al. 2022 (InstructGPT): the score of the reward
model sits on the last token of the response and ``-β·KL`` is paid on every token.
"""

from __future__ import annotations

import torch

from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, sanitize

__all__ = ["last_token_index", "token_rewards"]


def last_token_index(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index ``[B]`` (int64) of the last mask-1 position of each row, and ``[B]`` bool "row has one".

    Rows with no mask-1 token get index 0 and ``False``. ``mask`` ``[B, R]`` 0/1.
    """
    m = check_mask(mask)
    width = m.shape[-1]
    has_any = m.any(dim=-1)
    last = width - 1 - m.flip(-1).to(torch.int8).argmax(dim=-1)
    return torch.where(has_any, last, torch.zeros_like(last)), has_any


def token_rewards(
    scores: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards ``[B, R]`` float32: ``r_t = -kl_coef·kl_t``, plus ``scores[b]`` on the last token.

    ``scores`` ``[B]`` (one scalar per sequence, e.g. a reward model or rule score), ``mask`` ``[B, R]``
    0/1 (the last mask-1 position receives the score, so an EOS inside the mask is rewarded and trailing
    padding never is), ``kl`` optional ``[B, R]`` per-token KL estimate (usually k1 from
    :func:`rlflow.nodes.rl.kl.kl_estimate`). A sequence with no real token receives nothing (all zeros).
    Mask-0 positions are 0. Raises :class:`MaskError`/:class:`RLInputError` on bad shapes or masks.
    """
    m = check_mask(mask)
    check_shapes(m, kl=kl)
    if scores.shape != (m.shape[0],):
        raise RLInputError(f"scores: expected shape [{m.shape[0]}], got {tuple(scores.shape)}")
    last, has_any = last_token_index(m)
    safe_scores = scores.float().masked_fill(~has_any, 0.0)
    rewards = torch.zeros(m.shape, dtype=torch.float32, device=m.device)
    rewards = rewards.scatter(1, last.unsqueeze(1), safe_scores.unsqueeze(1))
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * sanitize(kl.float(), m)
    return sanitize(rewards, m)
