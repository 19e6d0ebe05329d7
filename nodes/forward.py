"""The uniform forward of rlflow's models over the batch format: logits, per-token values, sequence scores
and response log-probs.

Batch format: ``prompt_ids``/``prompt_mask`` ``[B,S]`` left-padded, ``response_ids``/``response_mask``
``[B,R]`` right-padded (:func:`sequence_inputs` joins them). Every model is called through
:func:`forward_logits` (``lm`` head), :func:`forward_values` and :func:`forward_scores` (``value``/``score``
heads, :class:`rlflow.nodes.models.HeadModel`); :func:`response_logits`, :func:`response_values`,
:func:`response_scores` and :func:`batch_logprobs` read them at the response's positions.

Packed forwards: inside :func:`packed_forwards` (a node with ``max_tokens_per_micro_batch``;
:mod:`rlflow.nodes.train` opens it), :func:`forward_logits` and :func:`forward_values` lay a micro-batch's
real tokens end to end in one row ``[1,N]`` (:mod:`rlflow.nodes.rl.packing`) with ``position_ids``
restarting at 0 per sequence and ``attention_mask=None``; transformers then masks attention per sequence
(``masking_utils.find_packed_sequence_indices``: a block-diagonal causal mask for SDPA; FlashAttention-2's
varlen kernel for a model with ``attn_implementation: flash_attention_2``, which :func:`packed_forwards`
chooses on CUDA where ``flash_attn`` is installed and the model is fp16/bf16). No padding token is computed;
outputs come back in the padded ``[B,L]``/``[B,K,V]`` format, 0 at padding, so callers do not change.
``bench/bench_packed.py`` measures the backends on CPU (``flex_attention`` has no backward on CPU in
torch 2.13).

Shapes (DESIGN.md): B rows, S prompt tokens, R response tokens, L = S + R, V vocabulary, N packed tokens.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import ModelError
from rlflow.nodes.models import HeadModel
from rlflow.nodes.moe_routes import NO_ROUTE, RouteReplay
from rlflow.nodes.rl.logprobs import entropy_from_logits, label_logprobs
from rlflow.nodes.rl.packing import PackedLayout, pack, packed_layout, unpack

__all__ = [
    "PackedAttentionWarning",
    "batch_logprobs",
    "forward_logits",
    "forward_scores",
    "forward_values",
    "last_token_index",
    "packed_forwards",
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


_PACKED: ContextVar[bool] = ContextVar("rlflow_packed_forwards", default=False)


class PackedAttentionWarning(UserWarning):
    """A model was switched to FlashAttention-2 for its packed forwards (CUDA, ``flash_attn`` installed)."""


@contextlib.contextmanager
def packed_forwards(on: bool = True) -> Iterator[None]:
    """While open (``on``), :func:`forward_logits` and :func:`forward_values` (and everything built on them)
    run packed: see the module docstring. Results equal the padded forward's within float rounding at real
    tokens (``tests/test_packed.py``)."""
    token = _PACKED.set(on)
    try:
        yield
    finally:
        _PACKED.reset(token)


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _varlen_kernel(model: nn.Module, device: torch.device) -> None:
    """On CUDA with ``flash_attn`` installed, an fp16/bf16 SDPA model is switched to FlashAttention-2 (whose
    varlen kernel transformers runs for packed ``position_ids``), with a :class:`PackedAttentionWarning`."""
    if device.type != "cuda" or not _flash_attn_installed():
        return
    hf = model.backbone if isinstance(model, HeadModel) else model
    config = getattr(hf, "config", None)
    dtype = next(hf.parameters()).dtype
    if getattr(config, "_attn_implementation", None) != "sdpa" or dtype not in (
        torch.float16,
        torch.bfloat16,
    ):
        return
    hf.set_attn_implementation("flash_attention_2")  # type: ignore[operator]
    warnings.warn(
        f"{type(hf).__name__}: packed forwards run FlashAttention-2's varlen kernel (attn_implementation "
        "'flash_attention_2' from now on, for its padded forwards too)",
        PackedAttentionWarning,
        stacklevel=3,
    )


def _packed_call(model: nn.Module, input_ids: torch.Tensor, layout: PackedLayout, **kwargs: Any) -> Any:
    """``model`` on the real tokens of ``input_ids`` ``[B,L]`` packed into ``[1,N]`` by ``layout``."""
    _varlen_kernel(model, input_ids.device)
    ids_1N = pack(input_ids, layout).unsqueeze(0)
    pos_1N = layout.position_ids.unsqueeze(0)
    return model(input_ids=ids_1N, attention_mask=None, position_ids=pos_1N, **kwargs)


def forward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
    replay: RouteReplay | None = None,
    routes_BLYK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token logits of an ``lm`` model.

    Args:
        input_ids, attention_mask, position_ids: ``[B,L]``.
        keep: optional 1-D positions to compute logits for (saves the ``[B,L,V]`` projection).
        replay, routes_BLYK: route replay (:mod:`rlflow.nodes.moe_routes`): the experts ``[B,L,Y,K]`` each
            position's MoE layers are forced to (-1: the router's choice; padding is never forced).

    Returns:
        logits ``[B,L,V]`` (or ``[B,len(keep),V]``) in the model's dtype; position ``i`` predicts token
        ``i+1``. Packed (:func:`packed_forwards`): computed at real tokens only, 0 at padding.
    """
    if _PACKED.get():
        return _packed_logits(model, input_ids, attention_mask, position_ids, keep, replay, routes_BLYK)
    if replay is not None and routes_BLYK is not None:
        replay.arm(routes_BLYK.masked_fill(attention_mask[:, :, None, None] == 0, NO_ROUTE).flatten(0, 1))
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


def _packed_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: torch.Tensor | None,
    replay: RouteReplay | None,
    routes_BLYK: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`forward_logits` packed: the output projection runs only on the real tokens among ``keep``."""
    batch, width = attention_mask.shape
    layout = packed_layout(attention_mask)
    if layout.num_real == 0:  # nothing to pack: the padded call
        with packed_forwards(False):
            return forward_logits(model, input_ids, attention_mask, position_ids, keep, replay, routes_BLYK)
    if replay is not None and routes_BLYK is not None:
        replay.arm(pack(routes_BLYK, layout, NO_ROUTE))
    cols = torch.arange(width, device=input_ids.device) if keep is None else keep
    where = torch.full((batch * width,), -1, dtype=torch.int64, device=input_ids.device)
    where[layout.flat_index] = torch.arange(layout.num_real, device=input_ids.device)
    sel_BK = where.view(batch, width)[:, cols]
    valid = (sel_BK >= 0).flatten()
    keep_N = sel_BK.flatten()[valid]
    logits = _packed_call(model, input_ids, layout, use_cache=False, logits_to_keep=keep_N).logits[0]
    out = logits.new_zeros((batch * int(cols.numel()), logits.shape[-1]))
    out = out.index_copy(0, torch.nonzero(valid).flatten(), logits)
    return out.view(batch, int(cols.numel()), logits.shape[-1])


def forward_values(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token scalars ``[B,L]`` (float32) of a ``value``/``score`` :class:`HeadModel`.

    Raises:
        ModelError: the model has an ``lm`` head.

    Packed (:func:`packed_forwards`): computed at real tokens only, 0 at padding.
    """
    if not isinstance(model, HeadModel):
        raise ModelError("forward_values needs a model with a 'value' or 'score' head, got an 'lm' model")
    if _PACKED.get():
        layout = packed_layout(attention_mask)
        if layout.num_real > 0:
            return unpack(_packed_call(model, input_ids, layout)[0], layout)
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
    replay: RouteReplay | None = None,
    routes_BLYK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[B,R,V]`` predicting each response token (row ``t`` comes from position ``S+t-1``).

    Only the ``R`` needed positions go through the output projection. ``replay``/``routes_BLYK``: route
    replay, as :func:`forward_logits`.
    """
    p = _check_prompt_width(prompt_ids)
    r = int(response_ids.shape[1])
    input_ids, attention_mask, position_ids = sequence_inputs(
        prompt_ids, prompt_mask, response_ids, response_mask
    )
    keep = torch.arange(p - 1, p + r - 1, device=input_ids.device)
    return forward_logits(model, input_ids, attention_mask, position_ids, keep, replay, routes_BLYK)


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
    replay: RouteReplay | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Label log-probs ``[B,R]`` (nats, float32) of a batch's response tokens under ``module``, and their
    entropies ``[B,R]`` when ``entropy`` (else ``None``).

    ``ids_key``/``mask_key`` name the response (``chosen_ids``/``chosen_mask`` for a preference pair's view);
    ``temperature``/``top_k``/``top_p`` process the logits first, as the sampler did
    (:func:`rlflow.nodes.rl.process_logits`). ``replay``: force the batch's recorded routes
    (:meth:`rlflow.nodes.moe_routes.RouteReplay.routes`) in the forward.
    """
    logits = response_logits(
        module,
        batch.tensor("prompt_ids"),
        batch.tensor("prompt_mask"),
        batch.tensor(ids_key),
        batch.tensor(mask_key),
        replay,
        None if replay is None else replay.routes(batch),
    ).float()
    lp = label_logprobs(logits, batch.tensor(ids_key), batch.tensor(mask_key), temperature, top_k, top_p)
    ent = entropy_from_logits(logits, batch.tensor(mask_key), temperature, top_k, top_p) if entropy else None
    return lp, ent
