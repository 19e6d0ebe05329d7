"""What the builtin node functions share: the node's model, the padded batch's sequence keys and token
count, and the token ids a node's arguments name."""

from __future__ import annotations

from typing import Any

from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.nodes.context import NodeContext

__all__ = ["SEQ", "node_model", "sequence_tokens", "stop_token_ids"]

SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""The keys of a prompt + response batch: prompts ``[B,S]`` left-padded, responses ``[B,R]`` right-padded."""


def node_model(ctx: NodeContext) -> nn.Module:
    """The module of the model the node calls.

    Raises:
        NodeError: the node has no model (names node and function).
    """
    if ctx.model is None:
        raise NodeError(f"node '{ctx.node.name}': function '{ctx.node.function}' needs a model")
    return ctx.model.module


def sequence_tokens(batch: Batch) -> int:
    """Real tokens of a prompt + response batch (prompt and response mask sums): a call's throughput count."""
    return int(batch.tensor("prompt_mask").sum()) + int(batch.tensor("response_mask").sum())


def stop_token_ids(ctx: NodeContext, stop_tokens: Any) -> list[int]:
    """The ids of ``args.stop_tokens`` (ids, or vocabulary strings resolved with the model's tokenizer).

    Graph validation (:mod:`rlflow.dataflow.sampling`) holds ids to the configured vocabulary when the
    config is known before the model is built; this holds every id to the built model's ``vocab_size``.

    Raises:
        NodeError: a string the tokenizer does not know, or an id outside ``0 .. vocab_size - 1`` (the
            sampler can never produce it, so it would never end a response); names node, key and model.
    """
    ids: list[int] = []
    for tok in stop_tokens or ():
        if isinstance(tok, int):
            ids.append(tok)
            continue
        tid = ctx.model.tokenizer.convert_tokens_to_ids(str(tok)) if ctx.model else None
        if tid is None or tid == getattr(ctx.model.tokenizer if ctx.model else None, "unk_token_id", -1):
            raise NodeError(
                f"node '{ctx.node.name}': stop token {tok!r} is not in the tokenizer's vocabulary"
            )
        ids.append(int(tid))
    vocab = getattr(getattr(ctx.model.module, "config", None), "vocab_size", None) if ctx.model else None
    for tok, tid in zip(stop_tokens or (), ids, strict=True):
        where = f"node '{ctx.node.name}': args.stop_tokens: stop token {tok!r}" + (
            "" if tok == tid else f" (id {tid})"
        )
        if tid < 0:
            raise NodeError(f"{where} is negative; token ids start at 0")
        if isinstance(vocab, int) and tid >= vocab:
            raise NodeError(
                f"{where} is outside the vocabulary of model '{ctx.model.name if ctx.model else ''}' "
                f"(vocab_size {vocab}: ids 0..{vocab - 1}); it can never be generated, so it would never "
                "end a response"
            )
    return ids
