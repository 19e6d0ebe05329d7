"""How big a vLLM engine is: its context length, the rows it is sized for and its KV cache, in bytes.

One formula for the engine and the planner: :class:`~rlflow.nodes.engines.vllm_engine.VllmEngine` passes
:func:`engine_kv_cache_bytes` to vLLM as ``kv_cache_memory_bytes``, and the pre-launch memory check
(``rlflow.schedulers.planner.resources``, through the cost model) counts the same bytes, plus the engine's own
copy of the weights, for every data-parallel rank of an ``engine: vllm`` node. Pure Python (no torch, no
vLLM): the planner imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "BLOCK_TOKENS",
    "KV_HEADROOM",
    "MAX_ENGINE_ROWS",
    "MIN_KV_CACHE_BYTES",
    "engine_kv_cache_bytes",
    "engine_max_model_len",
    "engine_max_rows",
    "engine_rows",
]

MAX_ENGINE_ROWS = 256
"""Most sequences an engine schedules at once (vLLM's ``max_num_seqs``); more rows of a call wait."""
BLOCK_TOKENS = 32
"""Tokens of slack added to each sequence's context (vLLM allocates the KV cache in whole blocks)."""
KV_HEADROOM = 1.25
"""Factor over the K/V bytes of ``max_num_seqs`` full-length sequences (headroom for whole blocks)."""
MIN_KV_CACHE_BYTES = 32 << 20
"""Smallest KV cache an engine gets (32 MiB): tiny models still get room for vLLM's block table."""


def engine_max_model_len(config: Mapping[str, Any]) -> int:
    """The engine's context length in tokens (``max_model_len``): ``max_position_embeddings`` (GPT-2:
    ``n_positions``) of the Hugging Face ``config``, 2048 when it has neither."""
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def engine_rows(max_rows: int) -> int:
    """Sequences the engine is sized for (vLLM's ``max_num_seqs``): ``max_rows`` held to
    ``1 .. MAX_ENGINE_ROWS``."""
    return max(1, min(int(max_rows), MAX_ENGINE_ROWS))


def engine_max_rows(prompts: int, dp: int, group_size: int) -> int:
    """Most rows one data-parallel rank's engine generates per call: its share of the node's ``prompts``
    (``ceil(prompts / dp)``, the distributed worker's split) times ``group_size`` samples per prompt."""
    return -(-int(prompts) // max(1, int(dp))) * int(group_size)


def engine_kv_cache_bytes(config: Mapping[str, Any], dtype_bytes: int, max_rows: int) -> int:
    """Bytes of KV cache one vLLM engine allocates for a model of Hugging Face ``config``.

    The K and V tensors of every layer for :func:`engine_rows` sequences of the full context plus
    :data:`BLOCK_TOKENS` tokens each, times :data:`KV_HEADROOM`, at least :data:`MIN_KV_CACHE_BYTES`
    (vLLM turns the bytes into ``bytes / (block_size · per_token)`` blocks)::

        per_token = 2 · num_hidden_layers · num_key_value_heads · head_dim · dtype_bytes     (bytes)
        bytes     = max(MIN_KV_CACHE_BYTES, ⌊per_token · rows · (max_model_len + BLOCK_TOKENS) · KV_HEADROOM⌋)

    (the KV-cache size of a decoder with grouped-query attention; Kwon et al. 2023, "Efficient Memory
    Management for Large Language Model Serving with PagedAttention", §2.2). ``head_dim`` is the config's
    ``head_dim``, else ``hidden_size / num_attention_heads``; GPT-2's ``n_layer``/``n_head``/``n_embd`` are
    read too; ``max_model_len`` is :func:`engine_max_model_len`.

    Args:
        config: the model's Hugging Face config fields.
        dtype_bytes: bytes per element of the engine's dtype (the model's: 4 for float32, 2 for bfloat16).
        max_rows: most rows (prompts × n) one generate call submits to this engine.

    Returns:
        the KV cache in bytes (vLLM's ``kv_cache_memory_bytes``).
    """
    layers = int(config.get("num_hidden_layers") or config.get("n_layer") or 1)
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    head_dim = int(config.get("head_dim") or hidden // heads)
    per_token = 2 * layers * kv_heads * head_dim * int(dtype_bytes)
    tokens = engine_rows(max_rows) * (engine_max_model_len(config) + BLOCK_TOKENS)
    return max(MIN_KV_CACHE_BYTES, int(per_token * tokens * KV_HEADROOM))
