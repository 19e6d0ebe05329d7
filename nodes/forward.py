"""The uniform forward of rlflow's models over the batch format: logits, per-token values, sequence scores
and response log-probs.

Batch format: ``prompt_ids``/``prompt_mask`` ``[B,S]`` left-padded, ``response_ids``/``response_mask``
``[B,R]`` right-padded (:func:`sequence_inputs` joins them). Every model is called through
:func:`forward_logits` (``lm`` head), :func:`forward_values` and :func:`forward_scores` (``value``/``score``
heads, :class:`rlflow.nodes.models.HeadModel`); :func:`response_logits`, :func:`response_values`,
:func:`response_scores` and :func:`batch_logprobs` read them at the response's positions.

Shapes (DESIGN.md): B rows, S prompt tokens, R response tokens, L = S + R, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import ModelError
from rlflow.nodes.models import HeadModel
from rlflow.nodes.rl.logprobs import entropy_from_logits, label_logprobs

__all__ = [
    "batch_logprobs",
    "forward_logits",
    "forward_scores",
    "forward_values",
    "last_token_index",
    "response_logits",
    "response_scores",
    "response_values",
    "sequence_inputs",
]


def sequence_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-sequence inputs from the batch format.

    Args:
        prompt_ids, prompt_mask: ``[B,S]`` left-padded.
        response_ids, response_mask: ``[B,R]`` right-padded.

    Returns:
        ``(input_ids [B,L], attention_mask [B,L], position_ids [B,L])`` with ``L = S + R``,
        ``position_ids = cumsum(attention_mask) - 1`` clamped at 0 (so the first real token is position 0
        however much left padding there is). A mask-0 span *inside* a response (a tool's observation in a
        multi-turn rollout: context the sampler saw, never trained) is attended to: the response's attention
        mask is 1 up to each row's last mask-1 token, so the forward sees what the sampler saw.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1).long()
    seen = response_mask.long().flip(1).cummax(dim=1).values.flip(1)  # holes before the last token filled
    attention_mask = torch.cat([prompt_mask.long(), seen], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def forward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token logits of an ``lm`` model.

    Args:
        input_ids, attention_mask, position_ids: ``[B,L]``.
        keep: optional 1-D positions to compute logits for (saves the ``[B,L,V]`` projection).

    Returns:
        logits ``[B,L,V]`` (or ``[B,len(keep),V]``) in the model's dtype; position ``i`` predicts token
        ``i+1``.
    """
    kwargs: dict[str, Any] = {}
    if keep is not None:
        kwargs["logits_to_keep"] = keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    return out.logits


def forward_values(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token scalars ``[B,L]`` (float32) of a ``value``/``score`` :class:`HeadModel`.

    Raises:
        ModelError: the model has an ``lm`` head.
    """
    if not isinstance(model, HeadModel):
        raise ModelError("forward_values needs a model with a 'value' or 'score' head, got an 'lm' model")
    return model(input_ids, attention_mask, position_ids)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index ``[B]`` of the last position with ``attention_mask == 1`` (0 for an all-padding row)."""
    t = attention_mask.shape[1]
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.zeros_like(positions)).amax(dim=1)


def forward_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Sequence scores ``[B]`` (float32): the head's output at each row's last real token.

    Raises:
        ModelError: the model has an ``lm`` head.
    """
    values = forward_values(model, input_ids, attention_mask, position_ids)
    idx = last_token_index(attention_mask)
    return values.gather(1, idx[:, None]).squeeze(1)


def _check_prompt_width(prompt_ids: torch.Tensor) -> int:
    p = int(prompt_ids.shape[1])
    if p < 1:
        raise ValueError("prompt_ids needs >= 1 column: the last prompt token predicts response token 0")
    return p


def response_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[B,R,V]`` predicting each response token (row ``t`` comes from position ``S+t-1``).

    Only the ``R`` needed positions go through the output projection.
    """
    p = _check_prompt_width(prompt_ids)
    r = int(response_ids.shape[1])
    input_ids, attention_mask, position_ids = sequence_inputs(
        prompt_ids, prompt_mask, response_ids, response_mask
    )
    keep = torch.arange(p - 1, p + r - 1, device=input_ids.device)
    return forward_logits(model, input_ids, attention_mask, position_ids, keep=keep)


def response_values(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    with_next: bool = False,
) -> torch.Tensor:
    """Critic values ``[B,R]`` (float32): value ``t`` is read at position ``S+t-1``.

    That is the state *before* response token ``t`` is emitted, the same position whose logits give its
    log-prob (the PPO convention of OpenRLHF/TRL: ``V(s_t)`` for action ``a_t``). ``with_next``: ``[B,R+1]``,
    entry ``t`` read at ``S+t-1`` for ``t = 0..R``, so entry ``n_b`` (``n_b`` = index after row b's last
    token) is the value of the state after the last token, V(s_T), which GAE bootstraps from when a
    response was truncated (Pardo et al. 2018).
    """
    p = _check_prompt_width(prompt_ids)
    r = int(response_ids.shape[1]) + int(with_next)
    values = forward_values(model, *sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask))
    return values[:, p - 1 : p + r - 1]


def response_scores(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Reward-model scores ``[B]`` (float32) of prompt + response, read at the last real token."""
    return forward_scores(model, *sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask))


def batch_logprobs(
    module: nn.Module,
    batch: Batch,
    ids_key: str = "response_ids",
    mask_key: str = "response_mask",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Label log-probs ``[B,R]`` (nats, float32) of a batch's response tokens under ``module``, and their
    entropies ``[B,R]`` when ``entropy`` (else ``None``).

    ``ids_key``/``mask_key`` name the response (``chosen_ids``/``chosen_mask`` for a preference pair's view);
    ``temperature``/``top_k``/``top_p`` process the logits first, as the sampler did
    (:func:`rlflow.nodes.rl.process_logits`).
    """
    logits = response_logits(
        module,
        batch.tensor("prompt_ids"),
        batch.tensor("prompt_mask"),
        batch.tensor(ids_key),
        batch.tensor(mask_key),
    ).float()
    lp = label_logprobs(logits, batch.tensor(ids_key), batch.tensor(mask_key), temperature, top_k, top_p)
    ent = entropy_from_logits(logits, batch.tensor(mask_key), temperature, top_k, top_p) if entropy else None
    return lp, ent
