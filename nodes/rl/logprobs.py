"""Label log-probs and entropies from logits, with the sampler's exact logit processing.

Shapes (DESIGN.md): B rows, S prompt tokens, R response tokens, L = S + R, V vocabulary.

The sampler (``generate`` node) and every trainer compute log-probs through the same two functions,
:func:`process_logits` then :func:`logprobs_of`, so the log-prob of a token under the same weights and the
same logits is bit-for-bit identical in both places (an on-policy ratio is exactly 1). Temperature divides
the *logits* before the softmax; dividing a log-prob by the temperature is a different (wrong) quantity.
"""

from __future__ import annotations

import math

import torch

from rlflow.nodes.rl.masks import RLInputError, check_mask, check_shapes, sanitize

__all__ = [
    "align_to_response",
    "entropy_from_logits",
    "label_logprobs",
    "logprobs_of",
    "next_token_logprobs",
    "process_logits",
    "response_logprobs",
    "sample_from_logits",
    "sampled_entropy",
]


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise RLInputError(
            f"temperature must be a finite number > 0, got {temperature} (greedy: greedy=True)"
        )
    if top_k is not None and top_k < -1:
        raise RLInputError(f"top_k must be None, -1, 0 (all disabled) or a positive int, got {top_k}")
    if top_p is not None and not (0.0 < top_p <= 1.0):
        raise RLInputError(f"top_p must lie in (0, 1], got {top_p}")


def process_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Apply temperature, then top-k, then top-p (nucleus) to logits; removed tokens become ``-inf``.

    Shapes: ``logits`` ``[..., V]`` any float dtype; returns float32 ``[..., V]``.
    - temperature: ``z = logits / temperature`` (Ackley et al. 1985; as HF ``TemperatureLogitsWarper``).
    - top-k (Fan et al. 2018): keep tokens whose logit is ≥ the k-th largest (ties kept); ``None``, 0
      or -1 disables; ``k ≥ V`` keeps all.
    - top-p (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"): on the distribution
      left after top-k, keep the smallest prefix of tokens sorted by descending probability (stable sort)
      whose mass is ≥ ``top_p``, i.e. token i is kept iff the mass strictly before it is < ``top_p``;
      the most likely token is always kept. ``None`` or 1.0 disables.
    Raises :class:`RLInputError` for temperature ≤ 0, top_p outside (0, 1] or top_k < -1.
    Both the sampler and the trainer must call this function so their log-probs agree bit for bit.
    """
    _check_sampling(temperature, top_k, top_p)
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    vocab = z.shape[-1]
    if top_k is not None and 0 < top_k < vocab:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_z, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        remove_sorted = mass_before >= top_p
        remove_sorted[..., 0] = False
        remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
        z = z.masked_fill(remove, float("-inf"))
    return z


def logprobs_of(processed_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``labels`` ``[...]`` (int64) under processed logits ``[..., V]``: ``z[y] - logsumexp(z)``.

    A label removed by top-k/top-p gets ``-inf`` (it cannot be sampled; only stale data can hold one).
    """
    picked = processed_logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(processed_logits, dim=-1)


def label_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Log-probs ``[B, R]`` float32 of ``labels`` ``[B, R]`` under aligned ``logits`` ``[B, R, V]``.

    Position t of ``logits`` scores ``labels[:, t]`` (already shifted; see :func:`response_logprobs` and
    :func:`next_token_logprobs` for the shift). Logits are processed by :func:`process_logits`. With a
    ``mask`` ``[B, R]`` (0/1), mask-0 positions give 0 and their logits/labels (even NaN or out-of-range
    ids) never matter. Units: nats. Raises :class:`MaskError` / :class:`RLInputError` on bad inputs.
    """
    if logits.dim() != labels.dim() + 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise RLInputError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [V]")
    if mask is None:
        return logprobs_of(process_logits(logits, temperature, top_k, top_p), labels)
    m = check_mask(mask)
    check_shapes(m, labels=labels)
    z = process_logits(sanitize(logits, m.unsqueeze(-1)), temperature, top_k, top_p)
    return sanitize(logprobs_of(z, sanitize(labels, m, 0)), m)


def entropy_from_logits(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Entropy ``H = logsumexp(z) - Σ softmax(z)·z`` (nats) of the processed distribution, ``[B, R]`` float32.

    ``logits`` ``[B, R, V]``; ``z = process_logits(...)``. Tokens removed by top-k/top-p contribute exactly
    0 (their ``-inf`` is replaced before the product, so gradients stay finite). Mask-0 positions give 0.
    """
    if mask is not None:
        m = check_mask(mask)
        check_shapes(m, logits_BR=logits[..., 0])
        logits = sanitize(logits, m.unsqueeze(-1))
    z = process_logits(logits, temperature, top_k, top_p)
    p = torch.softmax(z, dim=-1)
    z_finite = z.masked_fill(torch.isneginf(z), 0.0)
    ent = torch.logsumexp(z, dim=-1) - (p * z_finite).sum(dim=-1)
    return ent if mask is None else sanitize(ent, m)


def align_to_response(x: torch.Tensor, response_width: int) -> torch.Tensor:
    """Select the full-sequence positions that predict the response tokens.

    ``x`` ``[B, L, ...]`` is a per-position quantity of a forward pass over ``cat(prompt, response)``
    (logits, entropies); returns ``x[:, L-R-1 : L-1]`` ``[B, R, ...]``: response token t is predicted by
    full position ``S + t - 1`` (contract). Raises :class:`RLInputError` unless ``1 ≤ R < L``.
    """
    length = x.shape[1]
    if not 0 < response_width < length:
        raise RLInputError(
            f"response width {response_width} must lie in [1, {length - 1}] for length {length}"
        )
    return x[:, length - response_width - 1 : length - 1]


def response_logprobs(
    logits: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Log-probs ``[B, R]`` of response tokens from the logits ``[B, L, V]`` of the full sequence.

    Uses :func:`align_to_response` (position ``S+t-1`` predicts response token t) and
    :func:`label_logprobs`. Padding (mask 0) gives 0.
    """
    aligned = align_to_response(logits, response_ids.shape[1])
    return label_logprobs(aligned, response_ids, response_mask, temperature, top_k, top_p)


def next_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Causal-LM label log-probs ``[B, L-1]``: entry t is log p(``input_ids[:, t+1]`` | logits at t).

    ``logits`` ``[B, L, V]``, ``input_ids`` ``[B, L]``; ``mask`` ``[B, L]`` (0/1) marks which *labels*
    count (entry t uses ``mask[:, t+1]``).
    """
    labels = input_ids[:, 1:]
    label_mask = None if mask is None else mask[:, 1:]
    return label_logprobs(logits[:, :-1], labels, label_mask, temperature, top_k, top_p)


def sampled_entropy(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence entropy estimate ``[B]`` (nats): ``-Σ_t mask·logprob`` of the sampled tokens.

    For tokens sampled from π this is an unbiased Monte-Carlo estimate of the sequence entropy
    ``H(π(·|prompt))`` (``E[-log π(y)]``). ``logprobs``/``mask`` ``[B, R]``; padding never counts, so the
    estimate is ≥ 0 whatever padding holds. Divide by lengths for a per-token estimate.
    """
    m = check_mask(mask)
    check_shapes(m, logprobs=logprobs)
    return -sanitize(logprobs, m).sum(dim=-1)


def sample_from_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from ``logits`` ``[B, V]``; returns ``(tokens [B] int64, logprobs [B])``.

    The sampler's step: ``z = process_logits(logits, ...)``, draw from ``softmax(z)`` (or argmax when
    ``greedy``), log-prob ``logprobs_of(z, token)``, so it equals what :func:`label_logprobs` gives the
    trainer for the same logits.
    """
    z = process_logits(logits, temperature, top_k, top_p)
    if greedy:
        tokens = z.argmax(dim=-1)
    else:
        tokens = torch.multinomial(torch.softmax(z, dim=-1), 1, generator=generator).squeeze(-1)
    return tokens, logprobs_of(z, tokens)
