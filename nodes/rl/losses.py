"""Policy, value, KL, entropy, preference, SFT and reward-model losses, with exact loss aggregation.

Shapes (DESIGN.md): B rows (sequences), R response tokens. Token tensors are padded ``[B, R]`` with a 0/1
``mask`` (see :mod:`rlflow.nodes.rl.masks`); mask-0 values (NaN, ±inf included) never reach a loss or a
gradient.

Aggregation (:func:`aggregate`), with ``ℓ_bt`` the per-token loss, ``n_b`` the trainable tokens of row b,
``n_seq`` the number of rows with ``n_b > 0``, ``n_tok = Σ n_b`` and ``c`` the constant ``norm_length``:

==========================  ==========================================  =====================================
mode                        loss                                        ``global_normalizer`` to supply
==========================  ==========================================  =====================================
``token-mean``              ``Σ_bt ℓ_bt / n_tok``                        n_tok of the whole global batch
``seq-mean-token-mean``     ``Σ_b (Σ_t ℓ_bt / n_b) / n_seq``             n_seq of the whole global batch
``seq-mean-token-sum``      ``Σ_b Σ_t ℓ_bt / n_seq``                     n_seq of the whole global batch
``seq-mean-token-sum-norm`` ``Σ_bt ℓ_bt / (n_seq · c)`` (Dr. GRPO)      n_seq of the whole global batch
==========================  ==========================================  =====================================

Exactness: pass ``global_normalizer = loss_normalizer(full_mask, mode)`` computed on the whole global batch
(all micro-batches of all data-parallel ranks) and ``norm_length`` (c, e.g. ``max_new_tokens``) for the
``-norm`` mode; then the micro-batch losses *sum* to the full-batch loss, for any split. Accumulate
micro-batch gradients by summing; across data-parallel ranks sum gradients (with DDP/FSDP's averaging,
multiply the loss by the dp degree). Without ``global_normalizer`` the local count is used. Sequences with
no trainable token contribute nothing and are not counted; a loss over zero tokens is an explicit 0 that
still has a ``grad_fn`` (never NaN).

Every loss returns ``(loss, metrics)``: a scalar float32 tensor and a dict of detached scalar tensors named
as the metric suffixes of the field (``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``vf_loss``, ...), local
token means over this call's batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlflow.nodes.rl.kl import kl_terms
from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, masked_mean, sanitize

__all__ = [
    "AGG_MODES",
    "LOG_RATIO_BOUND",
    "aggregate",
    "entropy_bonus",
    "gspo_policy_loss",
    "kl_loss",
    "local_loss",
    "loss_normalizer",
    "masked_frac",
    "policy_loss",
    "preference_loss",
    "reward_model_loss",
    "sequence_logps",
    "sft_loss",
    "value_loss",
    "weighted_tokens",
]

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
Metrics = dict[str, torch.Tensor]
LOG_RATIO_BOUND = 20.0
"""Bound on a log importance ratio before ``exp`` (nats): one stale token cannot overflow the ratio (as verl
clamps it). Shared by the PPO ratio and decoupled PPO's behaviour weight."""


def _check_agg(agg: str) -> None:
    if agg not in AGG_MODES:
        raise RLInputError(f"unknown loss aggregation {agg!r}; expected one of {list(AGG_MODES)}")


def loss_normalizer(mask: torch.Tensor, agg: str = "token-mean") -> int:
    """Denominator of ``agg`` over ``mask`` ``[B, R]``: trainable tokens (token-mean) or non-empty rows.

    Compute it once on the whole global batch and pass it to every micro-batch as ``global_normalizer``.
    """
    _check_agg(agg)
    m = check_mask(mask)
    if agg == "token-mean":
        return int(m.sum())
    return int(m.any(dim=-1).sum())


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, R]`` to a scalar with mode ``agg`` (table in the module docstring).

    ``global_normalizer``: n_tok or n_seq of the whole global batch (see :func:`loss_normalizer`);
    ``norm_length``: the constant c of ``seq-mean-token-sum-norm`` (default: this batch's width R; give the
    same c to every micro-batch). Raises :class:`RLInputError` for an unknown mode, or a normaliser smaller
    than this batch's own count (it would over-weight this batch).
    """
    _check_agg(agg)
    m = check_mask(mask)
    check_shapes(m, loss=loss)
    x = sanitize(loss.float(), m)
    local = loss_normalizer(m, agg)
    if global_normalizer is None:
        denom: torch.Tensor | float = float(local)
    else:
        denom = global_normalizer if isinstance(global_normalizer, torch.Tensor) else float(global_normalizer)
        if float(denom) < local:
            raise RLInputError(
                f"global_normalizer {float(denom)} is below this batch's own {agg} count {local}"
            )
    if agg == "token-mean":
        total = x.sum()
    elif agg == "seq-mean-token-mean":
        total = (x.sum(dim=-1) / m.sum(dim=-1).clamp(min=1)).sum()
    elif agg == "seq-mean-token-sum":
        total = x.sum()
    else:
        length = m.shape[-1] if norm_length is None else norm_length
        if length <= 0:
            raise RLInputError(f"norm_length must be > 0, got {length}")
        total = x.sum() / length
    # zero tokens: total is an exact 0 with a grad_fn, divided by 1 instead of 0
    if isinstance(denom, torch.Tensor):
        return total / denom.clamp(min=1)
    return total / max(denom, 1.0)


def _ppo_token_loss(
    log_ratio: torch.Tensor,
    adv: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate (to minimise), "clipped" flags and "dual-clip bound hit" flags."""
    if clip_eps < 0 or (clip_eps_high is not None and clip_eps_high < 0):
        raise RLInputError(f"clip_eps must be ≥ 0, got {clip_eps}, {clip_eps_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise RLInputError(f"dual_clip must be > 1, got {dual_clip}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if dual_clip is None:
        return loss, clipped, torch.zeros_like(clipped)
    pg3 = -adv * dual_clip
    lower_hit = (adv < 0) & (loss > pg3)
    return torch.where(adv < 0, torch.minimum(loss, pg3), loss), clipped, lower_hit


def weighted_tokens(tok: torch.Tensor, weights: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor:
    """Per-token loss ``[B, R]`` times constant per-token ``weights`` ``[B, R]`` (``None``: unweighted);
    mask-0 weights (``m`` 0) never reach it and the weights carry no gradient."""
    return tok if weights is None else tok * sanitize(weights.float(), m).detach()


def local_loss(tok: torch.Tensor, m: torch.Tensor, agg: str, norm_length: int | None) -> torch.Tensor:
    """The loss metric of this call's batch on its own (local normaliser), detached.

    The loss itself is a share of the global mini-batch's loss (divided by the global normaliser, so
    micro-batch losses sum to it); its metric must not shrink with the number of micro-batches or dp
    ranks, so it is this batch's own mean, which the train loop averages weighted by tokens.
    """
    return aggregate(tok.detach(), m, agg, None, norm_length).detach()


def masked_frac(flags: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The share (0 to 1) of mask-1 entries of ``m`` ``[B, R]`` where ``flags`` ``[B, R]`` holds, detached."""
    return masked_mean(flags.float(), m).detach()


def _pg_metrics(
    loss: torch.Tensor,
    clipped: torch.Tensor,
    lower: torch.Tensor,
    old: torch.Tensor,
    logp: torch.Tensor,
    m: torch.Tensor,
) -> Metrics:
    """Standard policy-loss metrics: loss, clip fractions and the KL ``mean(log π_old − log π)``."""
    return {
        "pg_loss": loss.detach(),
        "pg_clipfrac": masked_frac(clipped, m),
        "pg_clipfrac_lower": masked_frac(lower, m),
        "ppo_kl": masked_mean(old - logp, m).detach(),
    }


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """PPO clipped surrogate loss, optional asymmetric (clip-higher) and dual clip.

    Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; clip-higher: Yu et al. 2025
    (DAPO); dual clip: Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL".
    ``ρ = exp(logprobs - old_logprobs)``; per token
    ``ℓ = max(-A·ρ, -A·clip(ρ, 1-clip_eps, 1+clip_eps_high))``, and with ``dual_clip`` c > 1, for A < 0,
    ``ℓ = min(ℓ, -c·A)``. ``weights`` ``[B, R]`` (constants, e.g. the truncated importance weights of
    :func:`rlflow.nodes.rl.rollout_correction.rollout_correction`) multiply ``ℓ`` per token:
    ``ℓ_t · w_t``. Aggregated by :func:`aggregate`. All tensors ``[B, R]`` (log-probs in nats,
    ``old_logprobs`` and ``advantages`` treated as constants). Metrics: ``pg_loss``, ``pg_clipfrac``,
    ``pg_clipfrac_lower`` (dual-clip bound hit), ``ppo_kl`` (mean ``old - new``, k1).
    """
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, weights=weights)
    logp = sanitize(logprobs.float(), m)
    old = sanitize(old_logprobs.float(), m).detach()
    adv = sanitize(advantages.float(), m).detach()
    tok, clipped, lower = _ppo_token_loss(logp - old, adv, clip_eps, clip_eps_high, dual_clip)
    tok = weighted_tokens(tok, weights, m)
    loss = aggregate(tok, m, agg, global_normalizer, norm_length)
    return loss, _pg_metrics(local_loss(tok, m, agg, norm_length), clipped, lower, old, logp, m)


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    agg: str = "seq-mean-token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
    dual_clip: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """GSPO: PPO clipping on the sequence-level ratio (geometric mean of token ratios).

    Source: Zheng et al. 2025, "Group Sequence Policy Optimization". ``s_b = exp(mean_t(logπ - logπ_old))``
    over the row's trainable tokens; token form (GSPO-token) ``s_bt = sg[s_b] · π_θ(y_t)/sg[π_θ(y_t)]``, so
    every token carries the value ``s_b`` and, with the default ``seq-mean-token-mean`` aggregation, the
    gradient equals that of ``min(s_b·A_b, clip(s_b)·A_b)`` averaged over sequences. ``advantages``
    ``[B]`` (per sequence) or ``[B, R]``; defaults ε = 3e-4 / 4e-4 follow the paper (registered in
    :data:`rlflow.nodes.rl.policy_losses.POLICY_LOSSES`). ``dual_clip`` c > 1 bounds the loss of a
    negative-advantage sequence by ``-c·A`` as :func:`policy_loss` does per token (Ye et al. 2020).
    ``weights`` ``[B, R]`` (constants) multiply each token's loss, as in :func:`policy_loss`. Metrics as
    :func:`policy_loss` (``pg_clipfrac`` is then a fraction of tokens of clipped sequences).
    """
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs, old_logprobs=old_logprobs, weights=weights)
    if advantages.dim() == 1:
        if advantages.shape != (m.shape[0],):
            raise RLInputError(f"advantages: expected [{m.shape[0]}] or {tuple(m.shape)}")
        adv_bt = advantages.float().unsqueeze(1).expand(m.shape)
    else:
        check_shapes(m, advantages=advantages)
        adv_bt = advantages.float()
    adv = sanitize(adv_bt, m).detach()
    logp = sanitize(logprobs.float(), m)
    old = sanitize(old_logprobs.float(), m).detach()
    seq_log_ratio = (logp - old).sum(dim=-1) / m.sum(dim=-1).clamp(min=1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(1) + logp - logp.detach()
    tok, clipped, lower = _ppo_token_loss(token_log_ratio, adv, clip_eps, clip_eps_high, dual_clip)
    tok = weighted_tokens(tok, weights, m)
    loss = aggregate(tok, m, agg, global_normalizer, norm_length)
    return loss, _pg_metrics(local_loss(tok, m, agg, norm_length), clipped, lower, old, logp, m)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = 0.2,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Clipped value loss ``½·max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)`` per token, aggregated.

    Source: PPO2 in OpenAI Baselines (Dhariwal et al. 2017); Ziegler et al. 2019. ``clip_eps=None``
    gives the plain ``½·(V - R)²``. ``values`` (differentiable), ``old_values`` (the critic's values at
    rollout), ``returns`` (targets, e.g. from :func:`rlflow.nodes.rl.advantages.gae`), ``mask``: all
    ``[B, R]``. Metrics: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean``.
    """
    m = check_mask(mask)
    check_shapes(m, values=values, old_values=old_values, returns=returns)
    v = sanitize(values.float(), m)
    old = sanitize(old_values.float(), m).detach()
    ret = sanitize(returns.float(), m).detach()
    vf1 = (v - ret) ** 2
    if clip_eps is None:
        tok, clipped = vf1, torch.zeros_like(m)
    else:
        if clip_eps < 0:
            raise RLInputError(f"clip_eps must be ≥ 0, got {clip_eps}")
        v_clip = old + (v - old).clamp(-clip_eps, clip_eps)
        vf2 = (v_clip - ret) ** 2
        tok, clipped = torch.maximum(vf1, vf2), vf2 > vf1
    loss = aggregate(0.5 * tok, m, agg, global_normalizer, norm_length)
    shown = local_loss(0.5 * tok, m, agg, norm_length)
    return loss, {
        "vf_loss": shown,
        "vf_clipfrac": masked_frac(clipped, m),
        "vpred_mean": masked_mean(v, m).detach(),
    }


def entropy_bonus(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Entropy bonus as a loss term ``-coef · aggregate(H)``; add it to the policy loss.

    Source: Williams & Peng 1991; Mnih et al. 2016 (A3C); PPO (Schulman et al. 2017). ``entropy``
    ``[B, R]`` (nats, e.g. :func:`rlflow.nodes.rl.logprobs.entropy_from_logits`), ``mask`` ``[B, R]``.
    Metric ``entropy``.
    """
    ent = aggregate(entropy, mask, agg, global_normalizer, norm_length)
    return -coef * ent, {"entropy": ent.detach()}


def kl_loss(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "k2",
    coef: float = 1.0,
    clamp: float | None = None,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KL penalty as a loss term ``coef · aggregate(k(logπ, logπ_ref))`` (GRPO-style, Shao et al. 2024).

    ``kind``: ``k2`` (default) follows the reverse KL(π‖π_ref) in gradient; ``k3`` (GRPO's choice) follows
    the forward KL(π_ref‖π); ``k1`` has zero expected gradient (see :mod:`rlflow.nodes.rl.kl`). Tensors
    ``[B, R]``. Metric ``kl`` (aggregated value).
    """
    terms = kl_terms(logprobs, ref_logprobs, mask, kind, clamp)
    value = aggregate(terms, mask, agg, global_normalizer, norm_length)
    return coef * value, {"kl": value.detach()}


def sft_loss(
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    agg: str = "token-mean",
    global_normalizer: float | int | torch.Tensor | None = None,
    norm_length: int | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Supervised fine-tuning: masked negative log-likelihood ``aggregate(-logprobs)`` (nats/token).

    ``logprobs`` ``[B, R]`` of the target tokens (:func:`rlflow.nodes.rl.logprobs.response_logprobs`),
    ``mask`` ``[B, R]`` (1 on the tokens to learn). Metric ``nll``.
    """
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs)
    nll = -sanitize(logprobs.float(), m)
    loss = aggregate(nll, m, agg, global_normalizer, norm_length)
    return loss, {"nll": local_loss(nll, m, agg, norm_length)}


def sequence_logps(logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-prob ``[B]``: ``Σ_t mask·logprobs`` (``average=True``: divided by the length).

    ``average=True`` raises :class:`RLInputError` if a row has no trainable token (a zero-token
    completion has no average log-prob).
    """
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs)
    total = sanitize(logprobs.float(), m).sum(dim=-1)
    if not average:
        return total
    lengths = m.sum(dim=-1)
    if bool((lengths == 0).any()):
        raise RLInputError(
            f"sequence_logps: rows {torch.nonzero(lengths == 0).flatten().tolist()} have no tokens"
        )
    return total / lengths


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "dpo",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    global_normalizer: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPO / IPO / cDPO loss from per-sequence log-probs ``[B]`` (sums over completion tokens, nats).

    With ``h = (logπ(y_w) - logπ_ref(y_w)) - (logπ(y_l) - logπ_ref(y_l))``:
    - ``dpo``: ``-log σ(β·h)`` (Rafailov et al. 2023, "Direct Preference Optimization").
    - ``cdpo``: ``-(1-ε)·log σ(β·h) - ε·log σ(-β·h)``, ε = ``label_smoothing`` in [0, 0.5) (Mitchell 2023,
      "A note on DPO with noisy preferences").
    - ``ipo``: ``(h - 1/(2β))²`` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning
      from Human Preferences").
    ``chosen_lengths``/``rejected_lengths`` ``[B]``: if given, all four log-probs are length-averaged first
    (as IPO is usually run); a zero length raises :class:`RLInputError`. Mean over pairs, or
    ``Σ / global_normalizer`` (number of pairs in the global batch). Metrics: ``rewards/chosen``,
    ``rewards/rejected`` (β·log-ratio means), ``rewards/margins``, ``rewards/accuracies``.
    """
    if loss_type not in ("dpo", "ipo", "cdpo"):
        raise RLInputError(f"loss_type must be 'dpo', 'ipo' or 'cdpo', got {loss_type!r}")
    if beta <= 0:
        raise RLInputError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise RLInputError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    shape = policy_chosen_logps.shape
    if len(shape) != 1 or any(
        t.shape != shape for t in (policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    ):
        raise RLInputError("preference_loss: all four log-prob tensors must have the same shape [B]")
    pc, pr = policy_chosen_logps.float(), policy_rejected_logps.float()
    rc, rr = ref_chosen_logps.float().detach(), ref_rejected_logps.float().detach()
    for name, lengths in (("chosen_lengths", chosen_lengths), ("rejected_lengths", rejected_lengths)):
        if lengths is not None and (lengths.shape != shape or bool((lengths <= 0).any())):
            raise RLInputError(f"{name}: must be [B] and > 0 (a zero-token completion cannot be scored)")
    if chosen_lengths is not None:
        pc, rc = pc / chosen_lengths, rc / chosen_lengths
    if rejected_lengths is not None:
        pr, rr = pr / rejected_lengths, rr / rejected_lengths
    chosen_ratio, rejected_ratio = pc - rc, pr - rr
    h = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        per_pair = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        eps = label_smoothing if loss_type == "cdpo" else 0.0
        per_pair = -(1.0 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    denom = float(shape[0]) if global_normalizer is None else global_normalizer
    loss = per_pair.sum() / (
        denom.clamp(min=1) if isinstance(denom, torch.Tensor) else max(float(denom), 1.0)
    )
    with torch.no_grad():
        metrics = {
            "rewards/chosen": (beta * chosen_ratio).mean(),
            "rewards/rejected": (beta * rejected_ratio).mean(),
            "rewards/margins": (beta * h).mean(),
            "rewards/accuracies": (h > 0).float().mean(),
        }
    return loss, metrics


def reward_model_loss(
    chosen_scores: torch.Tensor,
    rejected_scores: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    global_normalizer: float | int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """Pairwise (Bradley–Terry) reward-model loss ``-log σ(r_w - r_l - m)``, mean over pairs.

    Source: Ouyang et al. 2022 (InstructGPT), Bradley & Terry 1952; optional margin ``m`` ``[B]`` or
    scalar (Touvron et al. 2023, Llama 2). ``chosen_scores``/``rejected_scores`` ``[B]``. Metrics
    ``accuracy`` (fraction with ``r_w > r_l``), ``margin`` (mean ``r_w - r_l``).
    """
    if chosen_scores.dim() != 1 or chosen_scores.shape != rejected_scores.shape:
        raise RLInputError("reward_model_loss: chosen_scores and rejected_scores must both be [B]")
    diff = chosen_scores.float() - rejected_scores.float()
    logits = diff if margin is None else diff - margin
    per_pair = -F.logsigmoid(logits)
    denom = float(diff.shape[0]) if global_normalizer is None else global_normalizer
    loss = per_pair.sum() / (
        denom.clamp(min=1) if isinstance(denom, torch.Tensor) else max(float(denom), 1.0)
    )
    return loss, {"accuracy": (diff > 0).float().mean().detach(), "margin": diff.mean().detach()}
