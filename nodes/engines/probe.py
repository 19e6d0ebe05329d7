"""The probe: proof that an engine serves the weights it was sent, by its output.

At the engine's start, on its first reload and after every load the digests cannot check
(:mod:`rlflow.nodes.engines.sync_check`) the engine's prompt log-probs of a fixed probe (:func:`probe_ids`,
seeded, the same every run) are compared with the trainer's (:func:`trainer_probe`, a teacher-forced fp32
forward of the model instance); a gap above :data:`PROBE_TOLERANCE` nats is a :class:`WeightSyncError`
(:func:`check_probe_gap`). :func:`engine_probe` asks a vLLM engine for its side.

Shape legend: K probe rows, L probe width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.engines.sizing import engine_max_model_len

__all__ = [
    "PROBE_TOLERANCE",
    "WeightSyncError",
    "check_probe_gap",
    "engine_probe",
    "probe_ids",
    "trainer_probe",
]

PROBE_TOLERANCE = 1e-3
"""Largest allowed |engine − trainer| prompt log-prob on the probe, in nats. fp32 kernels of the two
(oneDNN in vLLM, ATen in torch) differ by ~1e-6 on the example models and ~1e-5 on a 124M model; a missed
or corrupted update of even one tensor moves probe log-probs by far more (measured in the tests)."""

_PROBE_ROWS = 4
_PROBE_WIDTH = 24


class WeightSyncError(NodeError):
    """The engine does not serve the weights it was sent (the probe's log-probs differ from the trainer's)."""


def probe_ids(vocab_size: int, max_model_len: int) -> torch.Tensor:
    """The fixed weight probe: ``[K,L]`` int64 token ids below ``vocab_size`` (seeded, the same every run)."""
    g = torch.Generator().manual_seed(20251201)
    width = max(2, min(_PROBE_WIDTH, max_model_len))
    return torch.randint(0, vocab_size, (_PROBE_ROWS, width), generator=g)


def trainer_probe(module: nn.Module, device: torch.device | None = None) -> torch.Tensor:
    """``module``'s log-probs of the probe (teacher-forced fp32 forward, eval mode): ``[K,L-1]`` float32 on
    CPU (token ``t+1`` given ``..t``). The forward of a tensor-parallel module is collective over its tp
    group (every rank calls it). ``device``: where the probe's ids go (default: the first parameter's
    device; a streamed sync's parameters are on ``meta`` until its hooks allocate them)."""
    hf_config: Any = module.config
    config: dict[str, Any] = hf_config.to_dict()
    ids = probe_ids(int(config["vocab_size"]), engine_max_model_len(config))
    was_training = module.training
    module.eval()
    try:
        dev = device if device is not None else next(module.parameters()).device
        with torch.no_grad():
            logits = module(input_ids=ids.to(dev), use_cache=False).logits.float().cpu()
    finally:
        module.train(was_training)
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def engine_probe(generate: Callable[[list[Any], Any], Sequence[Any]], ids: torch.Tensor) -> torch.Tensor:
    """A vLLM engine's prompt log-probs of the probe ``ids`` ``[K,L]``: ``[K,L-1]`` float32 (token ``t+1``
    given ``..t``). ``generate(prompts, params)``: the engine's ``LLM.generate``, called once with one
    ``TokensPrompt`` per row and ``SamplingParams`` asking for the prompt's log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0, logprobs=None
    )
    outs = generate([TokensPrompt(prompt_token_ids=row.tolist()) for row in ids], params)
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for k, o in enumerate(outs):
        plp = o.prompt_logprobs or []
        for t in range(1, ids.shape[1]):
            out[k, t - 1] = float(plp[t][int(ids[k, t])].logprob)
    return out


def check_probe_gap(where: str, gap: float, *, model: str, version: int) -> None:
    """Raise :class:`WeightSyncError` naming ``where`` (node and model), ``model`` and ``version`` when the
    probe ``gap`` (nats) exceeds :data:`PROBE_TOLERANCE` (or is NaN)."""
    if not gap <= PROBE_TOLERANCE:
        raise WeightSyncError(
            f"{where}: the vLLM engine does not serve weight version {version} of model '{model}': probe "
            f"log-probs differ from the trainer's by {gap:.3g} nats (tolerance {PROBE_TOLERANCE:g}); the "
            "weight sync failed"
        )
