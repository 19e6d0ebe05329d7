"""Seconds and bytes of a node on the built-in engines: an inference node, an FSDP2/DTensor train node (on
pipeline stages: 1F1B) and a generate node on the built-in decode loop; and the terms every model call
shares (:class:`NodeCost`, FLOPs, a micro-batch's real tokens, a decode step's roofline, fixed costs, the
pipeline bubble), which the DeepSpeed and vLLM pricing (``zero_cost.py``, ``vllm_cost.py``) reuse.

Notation, units and the rules every node follows (CPU oversubscription, rank skew, dispatch): ``cost.py``;
collectives: ``comm_cost.py``; memory: ``memory_cost.py``; what a layout with expert parallelism (ep > 1)
changes (experts whole per device, FSDP2 over the rest, token dispatch, expert-gradient all-reduces):
``expert_cost.py``.

Time (sources):
  * FLOPs of a forward pass: ``2 · tokens · (L · layer_params + head_params) + 4 · B · S² · Q · L``
    (matmul FLOPs are twice the multiply-adds; attention scores and the weighted sum each ``2·B·S²·Q``
    per layer; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", §5.1); over attention blocks of other lengths ``B · S²`` is their sum of squared
    lengths (:func:`token_flops`). Backward = 2 × forward, so training = 3 × forward (Kaplan et al. 2020,
    "Scaling Laws for Neural Language Models", §2.1: 6N per token = 2N forward + 4N backward: an input and a
    weight gradient per matmul). A LoRA model (``ModelShape.lora``) adds its adapters' ``2 · tokens ·
    adapters`` to a forward, and its backward computes no weight gradient for the frozen base: its matmuls
    1 × forward, attention 2 ×, adapters 2 × (``adapters.lora_backward_flops``). ``layer_params`` are
    the parameters a token multiplies (``ModelShape.active_layer_params``): in a mixture-of-experts layer
    its attention, router, shared expert and the ``K`` of ``E`` experts it is routed to (the "active
    parameters" of a MoE model: Fedus et al. 2022, "Switch Transformers", §2: FLOPs per token independent
    of the expert count), while memory holds every expert (``memory_cost.py``).
  * Real tokens per micro-batch: the runtime cuts every inference and train micro-batch to the columns its
    rows use (``nodes/train.py``, ``dataflow.batch.trim_padding``; verl/OpenRLHF remove padding, NeMo RL
    packs), so a micro-batch of ``b`` rows per data-parallel rank costs ``S = P + E[max]`` tokens per row,
    ``E[max] = lengths.expected_longest(mean, G_cap, b)`` at the node's mean response (``PlanNode.gen_mean``;
    the mean itself at ``b = 1``), or the cap ``G_cap = max_new_tokens`` without a mean. Activation memory
    is priced at the longest of the rank's rows (the micro-batch that holds it is the peak). The response
    has a distribution (``lengths.py``); the prompt has only a width: ``P`` is the data's padded prompt
    width of 16-row batches (``rlflow.nodes.data_lengths``), priced as it is at every ``b``.
  * Token-budget micro-batches (``PlanNode.max_tokens_per_micro_batch``, ``β`` tokens; the runtime's
    ``m = 1``, ``pp = 1``): a data-parallel rank's ``r`` rows of a mini-batch hold
    ``N = r · (P̄ + R̄)`` real tokens (``P̄`` the mean real prompt, ``PlanNode.prompt_tokens``; ``R̄`` the
    mean response, ``PlanNode.response_mean``; no padding is computed), cut into
    ``n = min(r, max(1, ⌈N / β⌉))`` micro-batches of ``N / n`` tokens (rows whole: at least one row each).
    The runtime (``rlflow.nodes.rl.packing.budget_partition``) balances the rows over first-fit
    decreasing's count of micro-batches, at least ``⌈N / β⌉`` and at most ``11/9`` of the fewest plus
    ``6/9`` (Johnson 1973; Dósa 2007's tight bound), the data-parallel ranks running the largest count
    among them; the model has the lengths' moments, not the rows, and prices the lower bound ``⌈N / β⌉``.
    Attention (:func:`packed_attention_varlen`, the rule ``rlflow.nodes.forward.packed_forwards``
    follows): per sequence with FlashAttention-2's varlen kernel
    (Dao 2023, "FlashAttention-2"; CUDA, a 16-bit model, ``flash_attn`` installed), ``Σ s²`` over a
    micro-batch's rows, ``(N / n) / (P̄ + R̄) · E[s²]`` with ``E[s²] = P̄² + 2·P̄·R̄ + E[R²]`` (the prompt a
    constant, ``lengths.expected_square``); otherwise transformers' SDPA over a dense ``[N, N]``
    block-diagonal causal mask, every score computed, ``(N / n)²``. Activation memory is bounded by the
    budget: one micro-batch of ``min(β, r · (P + G_cap))`` tokens (its ``[N, N]`` scores on ``cpu``,
    ``memory_cost.activation_bytes``) instead of ``b`` rows at the padded width.
  * Compute time = FLOPs / (devices · peak · efficiency(tokens per micro-batch)) (``cluster.Efficiency``).
  * Data-parallel comm of a train node (FSDP2, Zhao et al. 2023, "PyTorch FSDP"): the runtime wraps each
    decoder layer and the root (embedding, final norm, head), so per micro-batch it all-gathers every
    unit forward and again backward (``reshard_after_forward``) and reduce-scatters every unit's
    gradients backward: ``2·(Lₛ + 1)`` all-gathers and ``Lₛ + 1`` reduce-scatters of the unit's weights
    ``/t`` over the dp group (gloo runs a reduce-scatter as an all-reduce; the profile measures it as
    such); per step two (three with tp > 1) 8-byte all-reduces (loss normaliser and gradient norm).
    With ``reshard: false`` (``PlanNode.reshard``; ``runtime.distributed.layouts.DataParallelHooks``) the
    units stay gathered and accumulate unsharded gradients without syncing through an optimizer step's
    micro-batches and reshard after its last backward: per *step* ``Lₛ + 1`` all-gathers and ``Lₛ + 1``
    reduce-scatters (the communication of ZeRO-1 / Megatron-LM's distributed optimizer: Rajbhandari et al.
    2020, "ZeRO", §7.2; Zhao et al. 2023, "PyTorch FSDP": gradient accumulation without
    communication), ``k·(gather + scatter)`` instead of ``k·m·(2·gather + scatter)``. A first pass
    (no-grad, resharded after every forward either way) adds ``m`` gathers of every unit.
  * Optimizer step: Adam reads and writes weights, grads, fp32 master and moments
    (2 · (2 + 2 + 12) bytes per local parameter) at the memory bandwidth times the optimizer's profiled
    efficiency, plus ``step_s`` per step and ``step_tensor_s`` (+ ``dtensor_tensor_s`` for DTensor
    parameters, dp·tp > 1) per parameter tensor.
  * Fixed software costs (``cluster.Overheads``, measured by ``rlflow profile``; on CPU and small models
    they dominate): per node ``node_s`` (its first call after the worker idled); per micro-batch model
    call ``call_s`` forward, ``backward_s`` backward, plus ``tp_module_s`` / ``tp_module_backward_s`` per
    tensor-parallel module (``7·Lₛ + 1`` + 1 for an ``lm`` head: DTensor dispatch) and ``fsdp_unit_s``
    per FSDP2 unit of a train micro-batch; per generated token ``decode_s``. A train node whose trainer
    recomputes the old policy's log-probs (``PlanNode.first_pass``: the share of its rows that need it)
    runs one more no-grad forward over that share of its rows (compute) in ``m`` more calls (their fixed
    costs, tensor-parallel comm and FSDP2 all-gathers).
  * Pipeline bubble (the runtime's 1F1B schedule for train nodes, PipeDream-Flush, Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2.1; forwards
    only for inference: ``schedulers/runtime/distributed/pipeline_schedule.py``; ``(m + p − 1)·(f + b)`` per
    mini-batch for balanced stages, as GPipe's): the (compute + tensor comm + the calls' fixed costs) time
    grows by ``(p − 1)/m`` (Narayanan et al. 2021, §2.2.1); every stage makes its own calls.
  * Generation with the built-in loop: prefill = one forward over the prompts; then ``G − 1`` decode steps
    (the prefill's logits give the first token; ``G`` the call's expected longest response,
    ``lengths.expected_longest`` of its ``b`` rows at the node's mean response length, capped at
    ``max_new_tokens``: the loop stops when every row has ended; the node ends with its slowest
    data-parallel replica, so over its ``m`` calls the steps are ``lengths.slowest_replica_steps``: the
    last call's longest row is that of all ``d`` replicas' last calls). The loop compacts
    (``rlflow.nodes.generation.generate(compact=True)``, ``PlanNode.compact``): it prefills each prompt once
    for its ``n`` samples (the prefill's FLOPs over ``b/n`` rows) and drops finished rows from the decode
    forwards, so a step at ``s`` tokens runs the expected live rows of the length model
    (``lengths.compacted_decode_s``: each call's steps integrated over ``s``, a step of ``live(s)`` rows at
    context ``P + s``); where it does not (``args.record_routes``) or every row runs to the cap, every
    step runs all ``b`` rows at context ``P + G/2``. Interrupted (``interrupt_every``): one call per
    segment (``segment_cost.py``). A step takes ``max(FLOPs / compute rate, (weights + KV cache read) /
    memory bandwidth, L · launch_layer_s)`` plus the forward's tensor-parallel collectives on one token (the
    memory-bound decoding model of ReaL, Mei et al. 2024, §5; the third term: the loop runs eager Hugging
    Face forwards, whose kernel launches bound a step on a GPU, ``Overheads.launch_layer_s``); ``m``
    micro-batches run as ``m`` sequential generation passes (less KV cache, weights re-read). On ``p``
    pipeline stages (``runtime.distributed.pipeline``: each forward passes the stages in turn, no
    micro-batch overlap) a step is ``p`` times the largest stage's step (its ``⌈L/p⌉`` layers, weights and
    KV cache; the head counted on it), and each forward adds ``p − 1`` hidden-state sends over the chain's
    link (``b·T·H`` values) and a broadcast of the last stage's logits (``b·V`` values) along the chain:
    pipeline stages fit a model one host cannot hold, at no speed-up over one stage doing all the work.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.schedulers.planner.adapters import adapter_count, lora_backward_flops
from rlflow.schedulers.planner.comm_cost import collectives_time, param_tensors, tp_forward_time, tp_modules
from rlflow.schedulers.planner.expert_cost import (
    dispatch_time,
    expert_grad_time,
    expert_split,
    expert_tp_flops,
)
from rlflow.schedulers.planner.lengths import (
    capped_exponential_rate,
    compacted_decode_s,
    expected_longest,
    expected_square,
    slowest_replica_steps,
)
from rlflow.schedulers.planner.memory_cost import (
    GRAD_BYTES,
    LOGIT_BYTES,
    OPTIM_BYTES,
    MemoryBreakdown,
    activation_bytes,
    train_activations,
)
from rlflow.schedulers.planner.segment_cost import builtin_segments, interrupted, segments_of

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.plans import NodePlacement
    from rlflow.schedulers.planner.problem import PlanNode
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = [
    "CallTerms",
    "MicroBatchWork",
    "NodeCost",
    "call_terms",
    "decode_step_time",
    "forward_flops",
    "generate_cost",
    "inference_cost",
    "longest_response",
    "micro_batch_work",
    "packed_attention_varlen",
    "token_flops",
    "train_cost",
    "trained_tensors",
]


@dataclass(frozen=True)
class NodeCost:
    """Predicted seconds (by component) and memory of one node under one placement.

    ``time_s`` is the node's span on its devices (``timing_s/<node>`` of the runtime, weight sync
    excluded, but a vLLM node's load of the new weights into its engine, ``engine_sync_s``, included);
    ``dispatch_s``, the controller's round trip around it, is not part of it.
    """

    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    optimizer_s: float
    decode_s: float
    memory: MemoryBreakdown
    overhead_s: float = 0.0
    dispatch_s: float = 0.0
    engine_sync_s: float = 0.0
    offload_s: float = 0.0  # host <-> device copies of a DeepSpeed CPU offload (``zero_cost.py``)
    ep_comm_s: float = 0.0  # expert parallel: token dispatch, expert-gradient all-reduces (``expert_cost``)
    segment_s: tuple[float, ...] = ()  # interruptible generation: each segment call's part of time_s

    @property
    def time_s(self) -> float:
        """Seconds of the node's span on its devices: the sum of its components but ``dispatch_s``."""
        return (
            self.compute_s + self.tp_comm_s + self.dp_comm_s + self.pp_comm_s + self.bubble_s
            + self.optimizer_s + self.decode_s + self.overhead_s + self.engine_sync_s + self.offload_s
            + self.ep_comm_s
        )  # fmt: skip


def forward_flops(shape: ModelShape, rows: float, seq_len: float) -> float:
    """FLOPs of one forward pass over ``rows`` sequences of ``seq_len`` tokens (Narayanan et al. 2021)."""
    return token_flops(shape, rows * seq_len, rows * seq_len * seq_len)


def token_flops(shape: ModelShape, tokens: float, squares: float) -> float:
    """FLOPs of one forward pass over ``tokens`` tokens whose attention blocks' squared lengths sum to
    ``squares`` (tokens²): ``2·tokens·(L·layer_params + head_params) + 4·squares·Q·L`` (Narayanan et al.
    2021, §5.1; a padded batch of ``B`` rows of ``S`` tokens has ``squares = B·S²``; ``layer_params`` a
    token's active ones, ``ModelShape.active_layer_params``), plus ``2·tokens·adapters`` for a LoRA model
    (``ModelShape.adapter_params``: unmerged adapters, ``B (A x)``)."""
    params = shape.num_hidden_layers * shape.active_layer_params + shape.head_params + shape.adapter_params
    matmul = 2.0 * tokens * params
    return matmul + 4.0 * squares * shape.attention_width * shape.num_hidden_layers


def trained_tensors(shape: ModelShape, layers: int) -> float:
    """Parameter tensors an optimizer step of a stage of ``layers`` decoder layers walks: every tensor
    (``comm_cost.param_tensors``), or a LoRA model's two per targeted layer and its trained head's
    (``adapters.AdapterCount.tensors``), the stage's ``layers / L`` of them."""
    if shape.lora is not None:
        return adapter_count(shape, shape.lora).tensors * layers / shape.num_hidden_layers
    per_layer, ends = param_tensors(shape)
    return layers * per_layer + ends


def longest_response(node: PlanNode, rows: float) -> float:
    """Expected longest response (tokens) of ``rows`` rows: a generate call's decode steps, or the
    response width of an inference/train micro-batch cut to its rows (``lengths.expected_longest`` at the
    node's ``response_mean``, capped at ``gen_len``; ``gen_len`` without a mean)."""
    if node.gen_len <= 0:
        return 0.0
    return expected_longest(node.response_mean, node.gen_len, max(rows, 1.0))


@dataclass(frozen=True)
class MicroBatchWork:
    """What one data-parallel rank computes per micro-batch of a mini-batch (an inference node's call),
    padded or packed (module docstring, "Real tokens" and "Token-budget micro-batches").

    Attributes:
        count: micro-batches per mini-batch per rank: the layout's ``m``, or a token budget's ``n``.
        rows: rows per micro-batch (an average: may be fractional).
        tokens: tokens computed per micro-batch (padding included on the padded path).
        squares: the sum of its attention blocks' squared lengths (tokens²; :func:`token_flops`).
        peak_rows, peak_seq: the micro-batch at the memory peak as rows × tokens per row (a packed one:
            one row of all its tokens).
    """

    count: int
    rows: float
    tokens: float
    squares: float
    peak_rows: float
    peak_seq: float


@functools.cache
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def packed_attention_varlen(device_type: str, dtype_bytes: int) -> bool:
    """Whether a packed forward's attention runs per sequence (FlashAttention-2's varlen kernel) on
    ``device_type`` for a model of ``dtype_bytes`` bytes per weight: on ``cuda``, 16-bit, with ``flash_attn``
    installed where the planner runs (the rule ``rlflow.nodes.forward.packed_forwards`` follows on the
    workers); otherwise over a dense ``[N, N]`` block-diagonal mask (transformers' SDPA)."""
    return device_type == "cuda" and dtype_bytes == 2 and _flash_attn_installed()


def micro_batch_work(
    node: PlanNode, shape: ModelShape, dp: int, micro_batches: int, device_type: str
) -> MicroBatchWork:
    """:class:`MicroBatchWork` of inference or train node ``node`` of model ``shape`` at ``dp`` data-parallel
    ranks and the layout's ``micro_batches`` (unused under a token budget, whose layout has ``m = 1``) on
    ``device_type`` (packed attention: :func:`packed_attention_varlen`)."""
    per_rank = node.rows / (node.mini_batches if node.kind == "train" else 1) / dp
    budget = node.max_tokens_per_micro_batch
    if budget is None:  # cut to its own longest response; the memory peak holds the rank's longest
        b = per_rank / micro_batches
        seq = node.prompt_len + longest_response(node, b)
        peak_seq = node.prompt_len + longest_response(node, node.rows / dp)
        return MicroBatchWork(micro_batches, b, b * seq, b * seq * seq, b, peak_seq)
    p_mean = node.prompt_tokens
    r_mean = node.response_mean if node.gen_len > 0 else 0.0
    row = p_mean + r_mean  # real tokens of a row
    peak = min(float(budget), per_rank * node.seq_len)  # a micro-batch never exceeds the budget
    if row <= 0:
        return MicroBatchWork(1, per_rank, 0.0, 0.0, 1.0, peak)
    total = per_rank * row
    count = max(1, min(math.floor(per_rank), math.ceil(total / budget)))
    tokens = total / count
    if packed_attention_varlen(device_type, shape.dtype_bytes):  # each sequence over its own length
        r_square = expected_square(r_mean, node.gen_len) if r_mean > 0 else 0.0
        squares = tokens / row * (p_mean * p_mean + 2 * p_mean * r_mean + r_square)
    else:  # a dense [N, N] block-diagonal mask: every score computed, the masked ones too
        squares = tokens * tokens
    return MicroBatchWork(count, tokens / row, tokens, squares, 1.0, peak)


def decode_step_time(
    cluster: ClusterSpec,
    shape: ModelShape,
    b: float,
    ctx: float,
    t: int,
    weights: float,
    layers: int | None = None,
    experts_whole: bool = False,
    ep: int = 1,
) -> float:
    """Roofline seconds of one decode step of ``b`` rows at context ``ctx`` (tokens) on one of ``t``
    tensor-parallel devices holding ``weights`` bytes and ``layers`` decoder layers (default: all; a
    pipeline stage's, with the head counted on it): the larger of its FLOPs at the matmul rate and its
    weights + KV cache read at the memory streaming rate (ReaL, Mei et al. 2024, §5). A mixture of experts
    reads only the experts its ``b`` tokens are routed to: the expected untouched experts
    (``ModelShape.read_params``, uniform routing) of the device's share of the sparse layers (its
    ``layers / L`` of them) are taken off ``weights``; its FLOPs are the active parameters'.
    ``experts_whole``: every device holds its routed experts whole (the built-in loop: tp does not split
    the fused experts; at ``ep`` > 1 it holds ``E/ep``, read as the ep group's ``ep·b`` tokens touch them:
    ``expert_cost.py``), so neither their untouched share nor their FLOPs are divided by ``t`` (vLLM splits
    them: False); it is transformers' modules stepping, whose latent attention re-expands its cached latent
    every step (vLLM absorbs it): ``ModelShape.decode_attention``. KV read: ``kv_cache_width`` per token."""
    c, eff = cluster, cluster.efficiency
    L, w = layers or shape.num_hidden_layers, shape.dtype_bytes
    share = L / shape.num_hidden_layers  # the device's share of the layers
    attn_flops, attn_moved = shape.decode_attention(ctx, expanded=experts_whole)
    kv_read = L * b * (shape.kv_cache_width(t) * ctx + attn_moved / t) * w
    matmul = 2 * b * (L * shape.active_layer_params + shape.head_params + shape.adapter_params * share)
    step_flops = (matmul + b * attn_flops * L) / t
    if experts_whole:  # each tp rank runs the routed experts of all b tokens
        step_flops += expert_tp_flops(shape, b, t) * share / t
    step_compute = step_flops / (c.device.peak_flops * eff.matmul_at(b))
    untouched = (shape.num_params - shape.read_params(b * ep)) / ep * share * w / (1 if experts_whole else t)
    step_memory = (weights - untouched + kv_read) / (c.device.memory_bandwidth * eff.memory)
    return max(step_compute, step_memory)


@dataclass(frozen=True)
class CallTerms:
    """Seconds of an inference or train node's model calls on its devices, common to every train engine
    (FSDP2 and DeepSpeed ZeRO): compute (first pass and recomputed forwards included), tensor-parallel
    collectives, pipeline sends, the pipeline bubble and fixed costs (``node_s``, the calls' fixed costs,
    rank skew). ``units``: the FSDP2 units (ZeRO buckets) of a train node with dp > 1 (every layer of the
    stage + the root), else 0."""

    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    overhead_s: float
    units: int


def call_terms(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, placement: NodePlacement
) -> CallTerms:
    """:class:`CallTerms` of inference or train node ``node`` of model ``shape`` under ``placement``
    (module docstring: FLOPs, real tokens, compute time, fixed costs, pipeline bubble)."""
    c, lay = cluster, placement.layout
    eff, ov = c.efficiency, c.overheads
    d, t, p, m = lay.dp, lay.tp, lay.pp, lay.micro_batches
    n_dev = d * t * p
    w = shape.dtype_bytes
    devs = placement.devices
    tp_group = devs[:t]
    pp_link = c.link(devs[:: t * d])
    slow = c.mesh_slowdown(devs)
    H = shape.hidden_size
    layers = math.ceil(shape.num_hidden_layers / p)
    train = node.kind == "train"

    steps = node.epochs * node.mini_batches if train else 1
    epochs = node.epochs if train else 1
    # each micro-batch is cut to its own longest response (nodes/train.py), or packed under a token budget
    work = micro_batch_work(node, shape, d, m, c.device_type)
    m = work.count  # micro-batches per mini-batch per dp rank
    calls = steps * m  # micro-batch passes per device
    first = m if train and node.first_pass else 0  # no-grad micro-batches of a first pass
    tokens_mb = work.tokens  # tokens computed per micro-batch
    rate = c.device.peak_flops * eff.matmul_at(tokens_mb)
    redo = calls if train and node.recompute else 0  # forwards rerun in the backward (recompute)
    # fwd + bwd (2×fwd), + a forward with recompute (Korthikanti et al. 2022: 4× instead of 3×)
    passes = ((4.0 if redo else 3.0) * epochs if train else 1.0) + (float(node.first_pass) if first else 0.0)
    # every rank's micro-batches of one pass over the rows (one mini-batch each for inference)
    micro_total = d * (node.mini_batches if train else 1) * m
    # experts are replicated over tp: each tp rank runs its tokens' routed experts (``expert_cost.py``)
    replicated = expert_tp_flops(shape, tokens_mb, t)
    forward = token_flops(shape, tokens_mb, work.squares) + replicated
    flops = micro_total * forward
    if train and shape.lora is not None:  # the backward computes no weight gradient for the frozen base
        backward = lora_backward_flops(shape, shape.lora, tokens_mb, work.squares) + replicated  # experts 1×
        flops = micro_total * ((passes - 2.0 * epochs) * forward + epochs * backward)
        passes = 1.0
    compute = slow * passes * flops / (n_dev * rate)
    modules = tp_modules(shape, layers, t)
    forward_call = ov.call_s + modules * ov.tp_module_s
    call_overhead = slow * (calls + first + redo) * forward_call  # fixed costs of the micro-batch calls
    tp_comm = (calls + first + redo) * tp_forward_time(c, shape, layers, 1.0, tokens_mb, tp_group, slow)
    units = (layers + 1) if train and d > 1 else 0  # FSDP2 units (ZeRO buckets): every layer + the root
    zero = node.zero if train else None
    hooked = units if zero is None or zero.stage == 3 else 0  # units with gather/release hooks
    if train:
        backward_call = ov.backward_s + modules * ov.tp_module_backward_s + hooked * ov.fsdp_unit_s
        call_overhead += slow * calls * backward_call
        # backward: 5 all-reduces per layer, 1 for the lm head's input; 1 grad-norm per step
        act = tokens_mb * H * w
        n_bwd = 5 * layers + (1 if shape.head == "lm" else 0)
        tp_comm += calls * collectives_time(c, "all_reduce", n_bwd, n_bwd * act, tp_group, slow)
        tp_comm += steps * collectives_time(c, "all_reduce", 1, 8, tp_group, slow)
    # Pipeline p2p of one micro-batch's activations per boundary (forward, and backward for train).
    pp_comm = 0.0
    if p > 1:
        msgs = steps * m * (2 if train else 1)
        pp_comm = msgs * (tokens_mb * H * w / t / (pp_link.bandwidth * eff.link) + pp_link.latency)
    # every stage makes its own calls one after another along the pipeline, fixed costs included
    bubble = (compute + tp_comm + call_overhead) * (p - 1) / m
    # the mesh's ranks get their commands one after another: the last starts that much later
    overhead = slow * ov.node_s + call_overhead + (n_dev - 1) * ov.rank_skew_s
    return CallTerms(compute, tp_comm, pp_comm, bubble, overhead, units)


def inference_cost(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, placement: NodePlacement, dispatch_s: float
) -> NodeCost:
    """Seconds and bytes of inference node ``node`` under ``placement`` (its calls, :func:`call_terms`;
    one layer's activations and the fp32 logits of a micro-batch at the rank's longest response, beside its
    stage's weights); ``dispatch_s``: the controller's round trip (``CostModel.dispatch_time``)."""
    lay = placement.layout
    d, t, m = lay.dp, lay.tp, lay.micro_batches
    terms = call_terms(cluster, node, shape, placement)
    # memory peaks at the micro-batch that holds the longest response of the rank's rows (packed: the
    # budget's tokens)
    work = micro_batch_work(node, shape, d, m, cluster.device_type)
    b, peak_seq = work.peak_rows, work.peak_seq
    split = expert_split(shape, lay)  # ep > 1: each device holds E/ep experts whole (``expert_cost.py``)
    weights = (split.dense + split.experts) * shape.dtype_bytes
    slow = cluster.mesh_slowdown(placement.devices)
    ep_comm = dispatch_time(cluster, shape, placement, work.tokens, 0, work.count, slow)
    acts = activation_bytes(shape, b, peak_seq, t, cluster.device_type, lay.ep)
    acts += LOGIT_BYTES * b * peak_seq * (shape.vocab_size if shape.head == "lm" else 1) / t
    mem = MemoryBreakdown(weights, 0.0, 0.0, acts, 0.0)
    return NodeCost(
        compute_s=terms.compute_s, tp_comm_s=terms.tp_comm_s, dp_comm_s=0.0, pp_comm_s=terms.pp_comm_s,
        bubble_s=terms.bubble_s, optimizer_s=0.0, decode_s=0.0, overhead_s=terms.overhead_s, memory=mem,
        dispatch_s=dispatch_s, ep_comm_s=ep_comm,
    )  # fmt: skip


def train_cost(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, placement: NodePlacement, dispatch_s: float
) -> NodeCost:
    """Seconds and bytes of a train node on FSDP2/DTensor (and pipeline stages) under ``placement``: its
    calls (:func:`call_terms`), FSDP2's collectives, the optimizer step, and its state, gathered layers and
    activations per device (module docstring; ``memory_cost.py``); ``dispatch_s``: the controller's round
    trip (``CostModel.dispatch_time``)."""
    c, lay = cluster, placement.layout
    eff, ov = c.efficiency, c.overheads
    d, t, p, m = lay.dp, lay.tp, lay.pp, lay.micro_batches
    w = shape.dtype_bytes
    dp_group = placement.devices[: t * d : t]
    slow = c.mesh_slowdown(placement.devices)
    terms = call_terms(c, node, shape, placement)
    units = terms.units
    split = expert_split(shape, lay)  # ep > 1: E/ep experts whole per device, the rest FSDP2's (expert_cost)
    stage, experts = split.dense, split.experts
    layers = math.ceil(shape.num_hidden_layers / p)
    steps = node.epochs * node.mini_batches
    work = micro_batch_work(node, shape, d, m, c.device_type)  # m: a token budget's micro-batch count
    m = work.count
    calls = steps * m  # micro-batch passes per device
    first = m if node.first_pass else 0  # no-grad micro-batches of a first pass
    redo = calls if node.recompute else 0  # forwards rerun in the backward
    ep_comm = dispatch_time(c, shape, placement, work.tokens, calls, first + redo, slow)
    ep_comm += expert_grad_time(c, shape, placement, steps, slow)
    dp_comm = 0.0
    gathered = d > 1 and node.reshard is False  # units kept gathered through each optimizer step
    share = shape.trainable_share  # 1, or a LoRA model's adapters (+ head): no gradients for its base
    if d > 1:  # all-gather every unit forward (and again backward), reduce-scatter its gradients
        unit_bytes = stage * w  # the stage's weights over tp, summed over its units
        gather = collectives_time(c, "all_gather", units, unit_bytes, dp_group, slow)
        scatter = collectives_time(c, "reduce_scatter", units, unit_bytes * share, dp_group, slow)
        small = 2 + (1 if t > 1 else 0)  # loss normaliser + grad norm (+ its dp-only part under tp)
        per_step = collectives_time(c, "all_reduce", small, 8 * small, dp_group, slow)
        # reshard false: one gather (first forward) and one reduce-scatter (last backward) per step
        train_comm = steps * (gather + scatter) if gathered else calls * (2 * gather + scatter)
        dp_comm = train_comm + first * gather + steps * per_step
    trained = (stage / d + experts) * share  # parameters with gradients and Adam state on the device
    adam_bytes = 2 * trained * (w + GRAD_BYTES + OPTIM_BYTES)
    per_tensor = ov.step_tensor_s + (ov.dtensor_tensor_s if d * t > 1 else 0.0)
    optimizer = slow * steps * (
        adam_bytes / (c.device.memory_bandwidth * (eff.optimizer or eff.memory))
        + trained_tensors(shape, layers) * per_tensor + ov.step_s
    )  # fmt: skip
    grads = trained * GRAD_BYTES
    optim = trained * OPTIM_BYTES
    layer_full = split.unit * w
    # FSDP shard + gathered current/prefetched layer; reshard false: the whole stage gathered instead
    state_weights = (stage / d + experts) * w + (0.0 if gathered else 2 * layer_full)
    held = stage * (w + share * GRAD_BYTES) if gathered else 0.0  # full weights + unsharded gradients
    in_flight = min(m, p)  # 1F1B: stage s keeps min(m, p − s) micro-batches alive; stage 0 the most
    # memory peaks at the micro-batch that holds the longest response of the rank's rows (packed: the
    # budget's tokens)
    acts = train_activations(
        node, shape, work.peak_rows, t, layers, in_flight, work.peak_seq, c.device_type, lay.ep
    )
    mem = MemoryBreakdown(state_weights, grads, optim, acts, 0.0, gathered=held)
    return NodeCost(
        compute_s=terms.compute_s, tp_comm_s=terms.tp_comm_s, dp_comm_s=dp_comm, pp_comm_s=terms.pp_comm_s,
        bubble_s=terms.bubble_s, optimizer_s=optimizer, decode_s=0.0, overhead_s=terms.overhead_s,
        memory=mem, dispatch_s=dispatch_s, ep_comm_s=ep_comm,
    )  # fmt: skip


def generate_cost(
    cluster: ClusterSpec, node: PlanNode, shape: ModelShape, placement: NodePlacement, dispatch_s: float
) -> NodeCost:
    """Seconds and bytes of a generate node on the built-in decode loop under ``placement`` (module
    docstring, "Generation with the built-in loop"); ``dispatch_s``: the controller's round trip
    (``CostModel.dispatch_time``)."""
    c, lay = cluster, placement.layout
    eff, ov = c.efficiency, c.overheads
    d, t, p, m, e = lay.dp, lay.tp, lay.pp, lay.micro_batches, lay.ep
    w = shape.dtype_bytes
    devs = placement.devices
    tp_group, chain = devs[:t], devs[:: t * d]
    slow = c.mesh_slowdown(devs)
    L, H, V = shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
    layers = math.ceil(L / p)  # the largest stage's
    b = node.rows / (d * m)
    weights = expert_split(shape, lay).held * w  # the routed experts whole on every tp rank (E/ep at ep > 1)
    # Prefill: one forward over the prompts of each micro-batch; the logits of the last position only.
    # On pipeline stages the forward passes the stages in turn: as long as one stage doing it all.
    # a compacting loop prefills each prompt once for its n samples (module docstring)
    n = max(node.group_size, 1) if node.compact else 1
    rate = c.device.peak_flops * eff.matmul_at(b * node.prompt_len / n)
    prefill_flops = forward_flops(shape, node.rows / n, node.prompt_len)
    prefill_flops += expert_tp_flops(shape, node.rows * node.prompt_len / n, t)  # experts replicated over tp
    prefill = slow * prefill_flops / (d * t * rate)
    prefill_tp = m * tp_forward_time(c, shape, L, b, node.prompt_len, tp_group, slow, logits=1)
    # Decode: G − 1 steps (the prefill's logits give token 0), each a memory-bound read of weights + KV
    # cache, and the forward's collectives on one token per row, till the call's longest row ends (lengths.py)
    longest = longest_response(node, b)
    # the slowest replica's steps (``lengths.slowest_replica_steps``); an ep group decodes in lockstep
    mean, cap = node.response_mean, node.gen_len  # (each call waits for the longest of its e·b rows)
    span = slowest_replica_steps(mean, cap, b * e, d // e, m) if cap > 0 else 0.0
    steps = max(span - m, 0.0)  # G − 1 per call, summed over the m calls

    def step_at(live: float, s: float) -> float:  # one decode step of ``live`` rows at context P + s
        # an eager step is host-bound when issuing its layers' kernels outlasts the device's work on them;
        # on pipeline stages the stages step one after another, each priced as the largest
        one = decode_step_time(c, shape, live, node.prompt_len + s, t, weights, layers, True, e)
        return slow * (p * max(one, layers * ov.launch_layer_s)) + tp_forward_time(
            c, shape, L, live, 1, tp_group, slow
        ) + dispatch_time(c, shape, placement, live, 0.0, 1.0, slow, lockstep=True)  # fmt: skip

    pp_comm = step_comm = 0.0
    if p > 1:  # per forward: p − 1 hidden-state sends, then the last stage's logits broadcast
        link = c.link(chain)
        hop = (p - 1) * link.latency
        send = (p - 1) / (link.bandwidth * eff.link)
        logits = collectives_time(c, "broadcast", 1, b * V * w, chain)  # the same every forward
        prefill_comm = hop + send * b * node.prompt_len * H * w + logits
        step_comm = hop + send * b * H * w + logits
        pp_comm = m * prefill_comm + steps * step_comm
    if node.compact and capped_exponential_rate(node.response_mean, node.gen_len) > 0 and steps > 0:
        each = compacted_decode_s(mean, cap, b, e * b, step_at) if m > 1 else 0.0  # live rows per step
        decode = (m - 1) * each + compacted_decode_s(mean, cap, b, d * b, step_at)
    else:  # every row kept till the longest ends: all b rows at the mean context P + G/2
        decode = steps * step_at(b, longest / 2)
    modules = tp_modules(shape, layers, t)

    def fixed(calls: float, steps: float) -> float:  # one node call's fixed costs
        per = ov.node_s + calls * ov.call_s + steps * ov.decode_s + (calls + steps) * modules * ov.tp_module_s
        return slow * per + (d * t * p - 1) * ov.rank_skew_s

    overhead, rows = fixed(m, steps), b
    parts: tuple[float, ...] = ()
    if interrupted(node):  # one call per segment, its rows prefilled again (``segment_cost.py``)

        def prefill_at(rows: float, width: float) -> tuple[float, float, float]:
            flops = forward_flops(shape, rows, width) + expert_tp_flops(shape, rows * width, t)
            seconds = slow * flops / (t * c.device.peak_flops * eff.matmul_at(rows * width))
            seconds += dispatch_time(c, shape, placement, rows * width, 0.0, 1.0, slow, lockstep=True)
            sends = hop + send * rows * width * H * w + logits if p > 1 else 0.0
            return seconds, tp_forward_time(c, shape, L, rows, width, tp_group, slow, logits=1), sends

        works = builtin_segments(node, b * m, m, d, step_at, prefill_at, e)
        calls = [(s.prefill_pp_s + s.steps * step_comm, fixed(s.calls, s.steps)) for s in works]
        parts = tuple(
            s.prefill_s + s.prefill_tp_s + s.decode_s + sum(cl) for s, cl in zip(works, calls, strict=True)
        )
        prefill, prefill_tp = sum(s.prefill_s for s in works), sum(s.prefill_tp_s for s in works)
        pp_comm, overhead = sum(cl[0] for cl in calls), sum(cl[1] for cl in calls)
        decode = sum(s.decode_s for s in works)
        rows = max(b, *(seg.rows * seg.alive for seg in segments_of(node, b * m, m)))
    kv = layers * shape.kv_cache_width(t) * node.seq_len * rows * w
    acts = activation_bytes(shape, rows, node.prompt_len, t, c.device_type) + LOGIT_BYTES * rows * V / t
    mem = MemoryBreakdown(weights, 0.0, 0.0, acts, kv)
    ep_comm = dispatch_time(c, shape, placement, b * node.prompt_len / n, 0.0, m, slow, lockstep=True)
    return NodeCost(
        compute_s=prefill, tp_comm_s=prefill_tp, dp_comm_s=0.0, pp_comm_s=pp_comm, bubble_s=0.0,
        optimizer_s=0.0, decode_s=decode, overhead_s=overhead, memory=mem, dispatch_s=dispatch_s,
        segment_s=parts, ep_comm_s=0.0 if parts else ep_comm,
    )  # fmt: skip
