"""rlflow's sampling as vLLM requests, and vLLM's outputs as rlflow's response tensors.

Sampling matches :func:`rlflow.nodes.generation.generate`: the same ``n``/temperature/top-k/top-p/
``max_new_tokens``/stop ids, temperature 0 or ``greedy`` is greedy decoding, and the returned log-probs
are of the *processed* distribution (the engine's ``logprobs_mode='processed_logprobs'``: after temperature,
top-k and top-p), which is what the trainer's :func:`rlflow.nodes.rl.label_logprobs` recomputes. Each
response row is its own request with its own seed drawn from the node's generator (:func:`draw_seeds`), so
a run resumed from a checkpoint (generator state restored) draws the same seeds.

Shape legend: B prompts, N = B * n rows, P prompt width, R = ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["draw_seeds", "response_tensors", "sampling_requests"]


def draw_seeds(rows: int, generator: torch.Generator | None) -> list[int]:
    """One sampling seed per response row, drawn from ``generator`` (``None``: torch's global RNG); every
    rank of a tensor-parallel group draws them so that its generator stays in step with the leader's."""
    device = generator.device if generator is not None else torch.device("cpu")
    return [int(s) for s in torch.randint(0, 2**31 - 1, (rows,), generator=generator, device=device)]


def sampling_requests(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    n: int,
    seeds: Sequence[int],
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    max_new_tokens: int,
    greedy: bool,
    stop_token_ids: Sequence[int],
) -> tuple[list[Any], list[Any]]:
    """vLLM's ``(prompts, params)`` for ``n`` responses to each of the ``[B,P]`` left-padded prompts (pads
    dropped): one ``TokensPrompt`` and one ``SamplingParams`` per row, rows ``i*n .. i*n+n-1`` for prompt
    ``i``, row ``r`` seeded with ``seeds[r]`` (``N`` seeds). Temperature 0 or ``greedy``: argmax, no
    top-k/top-p. Each asks for the sampled token's log-prob, keeps special tokens and does not detokenize.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    greedy = greedy or temperature == 0
    prompts, params = [], []
    for i in range(prompt_ids.shape[0]):
        ids = prompt_ids[i][prompt_mask[i].bool()].tolist()
        for j in range(n):
            prompts.append(TokensPrompt(prompt_token_ids=ids))
            params.append(
                SamplingParams(
                    n=1,
                    temperature=0.0 if greedy else float(temperature),
                    top_k=0 if greedy or top_k is None else int(top_k),
                    top_p=1.0 if greedy or top_p is None else float(top_p),
                    max_tokens=int(max_new_tokens),
                    stop_token_ids=list(stop_token_ids),
                    logprobs=0,
                    seed=int(seeds[i * n + j]),
                    detokenize=False,
                    skip_special_tokens=False,
                )
            )
    return prompts, params


def response_tensors(
    outs: Sequence[Any], rows: int, max_new_tokens: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's request outputs (one per row, in order; ``rows`` = N) as ``(response_ids [N,R] int64,
    response_mask [N,R] int64, logprobs [N,R] float32)`` on CPU, right-padded (pad id, mask 0, log-prob 0);
    a response longer than ``max_new_tokens`` is cut there."""
    ids_NR = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long)
    mask_NR = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    lp_NR = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
    for r, out in enumerate(outs):
        comp = out.outputs[0]
        toks = list(comp.token_ids)[:max_new_tokens]
        if not toks:
            continue
        ids_NR[r, : len(toks)] = torch.tensor(toks)
        mask_NR[r, : len(toks)] = 1
        lps = comp.logprobs or []
        lp_NR[r, : len(toks)] = torch.tensor([float(lps[t][tok].logprob) for t, tok in enumerate(toks)])
    return ids_NR, mask_NR, lp_NR
