"""On-policy distillation: the per-token reverse KL to a teacher as a policy-gradient advantage.

Shapes (DESIGN.md): B rows, R response tokens. The student π samples ``y ~ π``; a frozen teacher π_T scores
every sampled token (its log-prob ``log π_T(y_t)`` of the same prefix). The reverse KL the student
minimises, per visited prefix, is ``KL(π‖π_T) = E_{y~π}[log π(y) − log π_T(y)]``; its sampled (k1) value at
token t is ``d_t = log π(y_t) − log π_T(y_t)`` (nats). With the advantage ``A_t = −coef·d_t``, constant
(stop-gradient) and without summing future tokens' terms (discount 0), the policy-gradient loss
``−A_t·π(y_t)/sg[π(y_t)]`` has expected gradient ``coef·∇KL(π‖π_T)`` at each prefix, because
``E_{y~π}[∇log π(y)] = 0`` removes the ``+1`` of ``∇(π log π)`` (derived for a categorical in
``tests/test_distill.py``).

Sources: Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (GKD, arXiv:2306.13649: the student's own samples, reverse KL among its divergences);
Lu & Thinking Machines Lab 2025, "On-Policy Distillation" (per-token advantage −(log π − log π_T), discount
0, an importance-sampling policy-gradient loss; tinker-cookbook's ``kl_penalty_coef``, default 1); Qwen
Team 2025, "Qwen3 Technical Report" (arXiv:2505.09388: on-policy distillation of the smaller models); slime's
OPD (``--opd-kl-coef``, default 1: ``A_t − λ·d_t`` added to any advantage estimator's).
"""

from __future__ import annotations

import torch

from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, sanitize

__all__ = ["reverse_kl_advantages"]


def reverse_kl_advantages(
    logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    coef: float,
    task_advantages: torch.Tensor | None = None,
    task_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages ``[B, R]`` float32 of on-policy distillation, and the sampled reverse KL
    ``[B, R]``.

    ``A_t = task_coef·task_advantages_t − coef·(log π(y_t) − log π_T(y_t))``; the second output is
    ``d_t = log π(y_t) − log π_T(y_t)`` (nats; its mean over tokens estimates ``KL(π‖π_T)`` per token).
    Both are detached and 0 at mask-0 positions (NaN/inf there never leak).

    Args:
        logprobs: ``[B, R]`` log π(y_t) of the sampled tokens under the student (the sampler's log-probs,
            as Thinking Machines' ``sampled_logprobs``).
        teacher_logprobs: ``[B, R]`` log π_T(y_t) of the same tokens under the teacher.
        mask: ``[B, R]`` 0/1 trainable tokens.
        coef: the distillation coefficient (> 0; Thinking Machines' ``kl_penalty_coef``, slime's
            ``opd_kl_coef``).
        task_advantages: optional ``[B, R]`` advantages of a task reward (e.g. GRPO's group advantage
            broadcast to the tokens), added with weight ``task_coef``.
        task_coef: weight of ``task_advantages`` (ignored when they are ``None``).

    Raises:
        MaskError: ``mask`` is not 0/1.
        RLInputError: a shape differs from ``mask``'s, ``coef`` is not positive, or a log-prob on a trainable
            token is not finite (a teacher that gives a sampled token probability 0, e.g. under top-k,
            would make its advantage infinite).
    """
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs, teacher_logprobs=teacher_logprobs, task_advantages=task_advantages)
    if not coef > 0:
        raise RLInputError(f"coef: the distillation coefficient must be > 0, got {coef!r}")
    student = sanitize(logprobs.detach().float(), m)
    teacher = sanitize(teacher_logprobs.detach().float(), m)
    for name, x in (("logprobs", student), ("teacher_logprobs", teacher)):
        if not bool(torch.isfinite(x).all()):
            raise RLInputError(
                f"{name}: a trainable token has a non-finite log-prob ({x[~torch.isfinite(x)][:3].tolist()});"
                " a token the model gives probability 0 has an infinite reverse KL"
            )
    reverse_kl = student - teacher
    adv = -coef * reverse_kl
    if task_advantages is not None:
        adv = adv + task_coef * sanitize(task_advantages.detach().float(), m)
    return sanitize(adv, m), sanitize(reverse_kl, m)
