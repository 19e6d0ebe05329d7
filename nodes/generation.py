"""Autoregressive generation with a KV cache, returning the sampler's own log-probs.

Each step samples with :func:`rlflow.nodes.rl.logprobs.sample_from_logits`, which processes logits with
:func:`rlflow.nodes.rl.logprobs.process_logits` (temperature, top-k, top-p) as the trainer does, so the
log-probs it returns equal a teacher-forced forward's on the same tokens (the on-policy log-prob gap
the controller reports is ~0 unless weights or settings diverge).

Shape legend: B prompts, N = B * n sampled rows, P prompt width, R response width, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.rl.logprobs import sample_from_logits
from rlflow.nodes.tokenizers import TokenizerInfo

__all__ = ["decode_responses", "generate", "truncated_rows"]


def _normalise_sampling(
    temperature: float, top_k: int | None, top_p: float | None, greedy: bool
) -> tuple[float, int | None, float | None, bool]:
    if temperature < 0:
        raise NodeError(f"generate: temperature must be >= 0, got {temperature}")
    if temperature == 0:  # the vLLM convention: temperature 0 is greedy decoding
        greedy = True
    if top_k is not None and top_k <= 0:  # 0 / -1 mean "no top-k" in HF and vLLM
        top_k = None
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:
            raise NodeError(f"generate: top_p must be in (0, 1], got {top_p}")
        if top_p >= 1.0:
            top_p = None
    return temperature, top_k, top_p, greedy


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer_info: TokenizerInfo,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int = 16,
    greedy: bool = False,
    stop_token_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    pad_to_max: bool = True,
    compact: bool = True,
    keep_going: Callable[[bool], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``n`` responses per prompt from an ``lm`` model.

    Args:
        model: a ``transformers`` causal LM (``lm`` head); run in eval mode here (its mode is restored).
        tokenizer_info: pad and EOS ids.
        prompt_ids, prompt_mask: ``[B,P]`` left-padded prompts (``position_ids = cumsum(mask) - 1``).
        n: samples per prompt; output rows ``i*n .. i*n+n-1`` belong to prompt ``i``.
        temperature: softmax temperature (> 0; 0 means greedy).
        top_p: nucleus sampling mass (None or 1.0: off). top_k: keep the k largest logits (None/0: off).
        max_new_tokens: response length limit, in tokens.
        greedy: take the argmax; log-probs are then of the unprocessed logits (temperature 1, no top-k/p).
        stop_token_ids: extra ids that end a response (EOS always does); the stop token is kept in the mask.
        generator: the random source for sampling (same seed and inputs -> same samples); must live on
            the model's device. ``None`` uses torch's global RNG.
        pad_to_max: make ``R = max_new_tokens`` (constant shapes for concatenating batches); otherwise
            ``R`` is the longest response.
        compact: skip work whose result is known, where the model's cache supports it (a ``transformers``
            ``DynamicCache``): with ``n > 1`` the prefill runs once per prompt (``[B,P]``) and its KV cache
            and logits are repeated ``n`` times; a row that has finished leaves the decode forwards (its
            cache rows are dropped). Samples and log-probs are those of the uncompacted loop: every step
            still draws over all ``N`` rows (a finished row's draw is discarded, as before), and a row's
            forward does not depend on the other rows of its batch (bit for bit where the kernels do not
            change with the batch's size, as measured on CPU; a GPU's may, within float rounding).
            ``False``: every forward runs over all ``N`` rows, a prefill then one call per sampled token
            but the last (the call layout :class:`rlflow.nodes.moe_routes.RouteRecorder` reads).
        keep_going: lockstep with other processes whose forwards are collectives over a group (expert
            parallel: every MoE layer is an all-to-all over the ep group). Called once per decode step on
            every rank of the group, with whether this rank's rows have all finished; returns whether any
            rank of the group has a row left. While it does, a rank whose rows have finished keeps
            forwarding (with ``compact``: one cache row; else every row) without sampling: its results
            (and its ``generator``'s state) are those of the loop without ``keep_going``. ``B = 0`` rows:
            one dummy prompt of ``n`` rows (a pad token) is forwarded so the group's forwards match, and the
            result has 0 rows. ``None``: this process alone (the loop ends when its rows have).

    Returns:
        ``(response_ids [N,R] int64, response_mask [N,R] int64, logprobs [N,R] float32)``: right-padded with
        the pad id (mask 0, log-prob 0 after each row's end). ``logprobs[i,t] = log_softmax(
        process_logits(logits))[token]`` (nats) for the logits that sampled token ``t``.

    Raises:
        NodeError: invalid sampling arguments (negative temperature, top_p outside (0, 1], n < 1).
    """
    if n < 1:
        raise NodeError(f"generate: n (samples per prompt) must be >= 1, got {n}")
    if max_new_tokens < 0:
        raise NodeError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    temperature, top_k, top_p, greedy = _normalise_sampling(temperature, top_k, top_p, greedy)
    device = prompt_ids.device
    rows = prompt_ids.shape[0] * n
    pad_id, eos_id = tokenizer_info.pad_id, tokenizer_info.eos_id
    stop_ids = torch.tensor(sorted({eos_id, *(int(s) for s in stop_token_ids)}), device=device)

    tokens: list[torch.Tensor] = []
    alive_masks: list[torch.Tensor] = []
    logps: list[torch.Tensor] = []
    was_training = model.training
    model.eval()
    try:
        if max_new_tokens > 0 and (rows > 0 or keep_going is not None):
            _decode(model, prompt_ids.long(), prompt_mask.long(), n, compact, keep_going, max_new_tokens,
                    (tokens, alive_masks, logps),
                    lambda logits_NV: _sample(logits_NV, greedy, temperature, top_k, top_p, generator),
                    pad_id, stop_ids)  # fmt: skip
    finally:
        model.train(was_training)

    steps = len(tokens)
    width = max_new_tokens if pad_to_max else steps
    response_ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
    response_mask = torch.zeros((rows, width), dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, width), dtype=torch.float32, device=device)
    if steps:
        response_ids[:, :steps] = torch.stack(tokens, dim=1)
        response_mask[:, :steps] = torch.stack(alive_masks, dim=1)
        logprobs[:, :steps] = torch.stack(logps, dim=1)
    return response_ids, response_mask, logprobs


def _sample(
    logits_NV: torch.Tensor,
    greedy: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's tokens and log-probs ``[N]`` (greedy: of the unprocessed distribution, temperature 1)."""
    if greedy:
        return sample_from_logits(logits_NV, 1.0, None, None, greedy=True)
    return sample_from_logits(logits_NV, temperature, top_k, top_p, greedy=False, generator=generator)


def _decode(
    model: nn.Module,
    ids_BP: torch.Tensor,
    mask_BP: torch.Tensor,
    n: int,
    compact: bool,
    keep_going: Callable[[bool], bool] | None,
    max_new_tokens: int,
    out: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    sample: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    stop_ids: torch.Tensor,
) -> None:
    """:func:`generate`'s prefill and decode steps: appends each step's tokens, alive mask and log-probs
    ``[N]`` to ``out``. Every rank of a ``keep_going`` group runs the prefill and the same decode steps."""
    tokens, alive_masks, logps = out
    dummy = ids_BP.shape[0] == 0  # a rank without rows: forwards only (see generate's keep_going)
    if dummy:
        ids_BP, mask_BP = ids_BP.new_full((1, 1), pad_id), mask_BP.new_ones((1, 1))
    mask_NP = mask_BP.repeat_interleave(n, dim=0)
    rows = mask_NP.shape[0]
    logits_NV, past = _prefill(model, ids_BP, mask_BP, n, compact)
    compact = compact and _compactable(past)
    next_pos_N = mask_NP.sum(dim=1)  # position of response token 0 (prompt tokens are 0..L-1)
    attn = mask_NP
    finished_N = torch.full((rows,), dummy, dtype=torch.bool, device=ids_BP.device)
    tok_N = torch.full((rows,), pad_id, dtype=torch.long, device=ids_BP.device)
    live_M = torch.arange(rows, device=ids_BP.device)  # the rows the cache holds (all, unless compact)
    done = dummy
    for t in range(max_new_tokens):
        if not done:  # a finished rank draws nothing more: its generator stays where the loop left it
            tok_N, lp_N = sample(logits_NV)
            alive_N = ~finished_N
            tok_N = torch.where(alive_N, tok_N, torch.full_like(tok_N, pad_id))
            tokens.append(tok_N)
            alive_masks.append(alive_N.long())
            logps.append(torch.where(alive_N, lp_N, torch.zeros_like(lp_N)))
            finished_N = finished_N | (alive_N & torch.isin(tok_N, stop_ids))
            done = bool(finished_N.all())
        if t == max_new_tokens - 1:  # the same bound on every rank: no agreement needed
            break
        if not (keep_going(done) if keep_going is not None else not done):
            break
        if compact and bool(finished_N[live_M].any()):  # finished rows leave the forwards
            keep_M = (~finished_N[live_M]).nonzero().squeeze(1)
            if keep_M.numel() == 0:  # the group decodes on: one cache row stays, forwarded, never sampled
                keep_M = keep_M.new_zeros(1)
            if keep_M.numel() < live_M.numel():
                past.batch_select_indices(keep_M)
                live_M, attn = live_M[keep_M], attn[keep_M]
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        step = model(
            input_ids=tok_N[live_M, None],
            attention_mask=attn,
            position_ids=(next_pos_N[live_M] + t)[:, None],
            past_key_values=past,
            use_cache=True,
        )
        past = step.past_key_values
        if done:  # a lockstep forward: its logits are never sampled
            continue
        if live_M.shape[0] < rows:  # a finished row keeps its last logits: drawn from, never kept
            logits_NV.index_copy_(0, live_M, step.logits[:, -1].float())
        else:
            logits_NV = step.logits[:, -1].float()


def _compactable(past: Any) -> bool:
    """Whether a model's KV cache can drop and repeat batch rows (``transformers``' ``DynamicCache``)."""
    return callable(getattr(past, "batch_select_indices", None)) and callable(
        getattr(past, "batch_repeat_interleave", None)
    )


def _prefill(
    model: nn.Module, ids_BP: torch.Tensor, mask_BP: torch.Tensor, n: int, compact: bool
) -> tuple[torch.Tensor, Any]:
    """The prompts' forward: next-token logits ``[N,V]`` (float32) and the KV cache of the ``N = B·n`` rows
    (row ``i*n + j`` is prompt ``i``). ``compact`` and ``n > 1``: one forward over the ``B`` prompts, its
    logits and cache repeated ``n`` times (where the cache can be, :func:`_compactable`; else the forward
    is rerun over the repeated rows)."""

    def forward(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1].float(), out.past_key_values

    if compact and n > 1:
        logits_BV, past = forward(ids_BP, mask_BP)
        if _compactable(past):
            past.batch_repeat_interleave(n)
            return logits_BV.repeat_interleave(n, dim=0), past
    return forward(ids_BP.repeat_interleave(n, dim=0), mask_BP.repeat_interleave(n, dim=0))


def truncated_rows(
    response_ids: torch.Tensor, response_mask: torch.Tensor, stop_ids: Sequence[int], max_new_tokens: int
) -> torch.Tensor:
    """Which rows were cut by the length limit: ``[N]`` int64 0/1.

    A row is truncated when it holds ``max_new_tokens`` tokens and its last one is not a stop token
    (EOS or ``stop_ids``); a row ending in a stop token is terminal (also at the limit), as is a shorter
    one. ``response_ids``/``response_mask`` ``[N,R]`` right-padded, as :func:`generate` returns them.
    The convention follows Pardo et al. 2018, "Time Limits in Reinforcement Learning": a time-limit cut is
    not the end of the episode.
    """
    lengths = response_mask.long().sum(-1)
    last = response_ids.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    stops = torch.tensor(sorted(set(stop_ids)), dtype=response_ids.dtype, device=response_ids.device)
    return ((lengths >= max_new_tokens) & (lengths > 0) & ~torch.isin(last, stops)).long()


def decode_responses(
    tokenizer: Any, response_ids: torch.Tensor, response_mask: torch.Tensor, skip_special_tokens: bool = True
) -> list[str]:
    """Response texts ``list[str]`` (length N) of the masked tokens, special tokens (EOS, pad) removed."""
    ids = [row[m.bool()].tolist() for row, m in zip(response_ids.cpu(), response_mask.cpu(), strict=True)]
    return [str(s) for s in tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)]
