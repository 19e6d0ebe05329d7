"""Token-level rewards from sequence scores, with a per-token KL penalty; DAPO's over-long length penalty.

Shapes (DESIGN.md): B rows, R response tokens. Source: Ziegler et al. 2019, "Fine-Tuning Language Models
from Human Preferences"; Stiennon et al. 2020; Ouyang et al. 2022 (InstructGPT): the score of the reward
model sits on the last token of the response and ``-β·KL`` is paid on every token. Over-long shaping: Yu et
al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv:2503.14476), eq. 13.
"""

from __future__ import annotations

import torch

from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, sanitize

__all__ = ["last_token_index", "overlong_penalty", "response_lengths", "token_rewards"]


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


def response_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Each response's length in tokens ``[B]`` (int64): the position of its last mask-1 token plus one, so
    observation spans (mask 0) inside a response count, as they count against its token budget; 0 for a row
    with no mask-1 token. ``mask`` ``[B, R]`` 0/1 (EOS included when the sampler kept it, as verl's
    ``valid_response_length``)."""
    last, has_any = last_token_index(mask)
    return torch.where(has_any, last + 1, torch.zeros_like(last))


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft over-long punishment ``[B]`` float32 of response lengths ``[B]`` (tokens).

    Source: Yu et al. 2025, "DAPO" (arXiv:2503.14476), eq. 13, with ``L_max = max_length`` and
    ``L_cache = buffer``::

        R_length(y) = 0                                  |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                    = -1                                 L_max < |y|

    times ``penalty_factor`` (DAPO's released recipe's ``overlong_penalty_factor``, 1 in the paper), added to
    the task reward. verl's DAPO reward manager computes ``min(-(|y| - (L_max - L_cache))/L_cache · factor,
    0)``, the same for every ``|y| <= L_max`` (its ``L_max`` is the generation cap, so it never sees more).

    Raises:
        RLInputError: ``buffer`` < 1, ``buffer`` > ``max_length``, ``penalty_factor`` < 0, or ``lengths`` not
            ``[B]``.
    """
    if lengths.dim() != 1:
        raise RLInputError(f"lengths: expected shape [B], got {tuple(lengths.shape)}")
    if buffer < 1 or buffer > max_length:
        raise RLInputError(f"buffer must lie in [1, max_length={max_length}], got {buffer}")
    if penalty_factor < 0:
        raise RLInputError(f"penalty_factor must be >= 0, got {penalty_factor}")
    expected = max_length - buffer
    return ((expected - lengths.float()) / buffer).clamp(min=-1.0, max=0.0) * penalty_factor
