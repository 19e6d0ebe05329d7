"""Cost model: seconds and bytes of a node under a (mesh, layout), of a weight sync, and of an edge.

Units: time in seconds, memory and traffic in bytes, rates in FLOP/s and bytes/s — everywhere.

Notation: ``B`` rows (sequences) per iteration, ``P``/``G`` prompt/generated tokens, ``S = P + G`` (for an
inference or train micro-batch ``G = E[max]`` of its ``b`` rows' responses, below),
``L`` layers (``Lₛ`` on the largest pipeline stage), ``H`` hidden, ``V`` vocabulary, ``a`` attention
heads, ``Q = a · head_dim`` the attention width (``H`` unless the config's ``head_dim`` differs from
``H / a``), ``t/d/p`` tensor/data/pipeline degrees, ``m`` micro-batches, ``b`` rows per micro-batch per
data-parallel rank, ``k = epochs · mini_batches`` optimizer steps of a train node, ``w`` bytes per weight.

Time (sources):
  * FLOPs of a forward pass: ``2 · tokens · (L · layer_params + head_params) + 4 · B · S² · Q · L``
    (matmul FLOPs are twice the multiply-adds; attention scores and the weighted sum each ``2·B·S²·Q``
    per layer; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", §5.1). Backward = 2 × forward, so training = 3 × forward.
  * Real tokens per micro-batch: the runtime cuts every inference and train micro-batch to the columns its
    rows use (``nodes/train.py``, ``dataflow.batch.trim_padding``; verl/OpenRLHF remove padding, NeMo RL
    packs), so a micro-batch of ``b`` rows per data-parallel rank costs ``S = P + E[max]`` tokens per row,
    ``E[max] = lengths.expected_longest(mean, G_cap, b)`` at the node's mean response (``PlanNode.gen_mean``;
    the mean itself at ``b = 1``), or the cap ``G_cap = max_new_tokens`` without a mean. Activation memory
    is priced at the longest of the rank's rows (the micro-batch that holds it is the peak).
  * Compute time = FLOPs / (devices · peak · efficiency(tokens per micro-batch)) (``cluster.Efficiency``).
  * Collectives: ring model ``steps · latency + volume · bytes / bandwidth`` (``cluster.ring_shape``;
    Thakur, Rabenseifner & Gropp 2005), with the link (bandwidth, latency) that ``rlflow profile`` fitted
    for that collective and group size (``ClusterSpec.collective_time``; Hockney's α-β model, 1994).
    ``n`` collectives of ``X`` bytes in total cost ``n · T(0) + (T(X) − T(0))``.
  * Tensor-parallel comm, counted from what the runtime's DTensor plan (``runtime.distributed.layouts``:
    column-parallel q/k/v/gate/up, row-parallel o/down, vocabulary-parallel embedding and head) issues on
    torch 2.13 per micro-batch (measured with the torch profiler): forward ``2·Lₛ + 1`` all-reduces of
    ``b·S·H·w`` (o/down outputs — Megatron-LM's two per layer, Shoeybi et al. 2019 — plus the masked
    embedding lookup) and, for an ``lm`` head, one all-gather of the ``b·S·V·w`` logits; backward
    ``5·Lₛ`` more all-reduces (the input gradient of each column-parallel projection) plus one for the
    ``lm`` head's input. A train node adds one all-reduce per optimizer step for the gradient norm.
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
    recomputes the old policy's log-probs (``PlanNode.first_pass``) runs one more no-grad forward over
    its rows (compute, calls, tensor-parallel comm and FSDP2 all-gathers). Per node a dispatch
    ``dispatch_s + (t · input bytes + output bytes) / dispatch_bandwidth`` (the controller sends every
    mesh rank its dp share and reads the dp leaders' outputs), which is not part of the node's span on
    its workers (``NodeCost.time_s``) but occupies its devices in the simulator.
  * CPU oversubscription (``cores_per_host``): a node whose mesh runs ``n`` busy workers on a host of
    ``c`` cores computes ``slowdown(n) = max(1, n/c)`` times slower (or the profile's measured slowdown of
    ``n`` busy processes, ``ClusterSpec.slowdown``), fixed costs included; a collective of a group of
    ``g`` ranks, profiled with ``g`` busy, by ``slowdown(n) / slowdown(g)`` (processor sharing; the
    simulator applies the same rule to nodes that overlap on one host).
  * Pipeline bubble (the runtime's 1F1B schedule for train nodes, PipeDream-Flush, Narayanan et al. 2021,
    "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2.1; forwards
    only for inference: see ``schedulers/runtime/distributed/pipeline.py``; ``(m + p − 1)·(f + b)`` per
    mini-batch for balanced stages, as GPipe's): the (compute + tensor comm + the calls' fixed costs) time
    grows by ``(p − 1)/m`` (Narayanan et al. 2021, §2.2.1); every stage makes its own calls.
  * Rank skew: a node's span runs from its first rank's start to its last rank's end, and the ranks of
    its mesh get their commands one after another: ``(ranks − 1) · rank_skew_s`` (measured by the
    profile's runtime probe).
  * Generation with the built-in loop: prefill = one forward over the prompts; then ``G − 1`` decode steps
    (the prefill's logits give the first token; ``G`` the call's expected longest response,
    ``lengths.expected_longest`` of its ``b`` rows at the node's mean response length, capped at
    ``max_new_tokens``: the loop stops when every row has ended, all rows' KV caches kept till then),
    each ``max(FLOPs / compute rate, (weights + KV cache read at context P + G/2) / memory
    bandwidth, L · launch_layer_s)`` plus the forward's tensor-parallel collectives on one token (the
    memory-bound decoding model of ReaL, Mei et al. 2024, §5; the third term: the loop runs eager Hugging
    Face forwards, whose kernel launches bound a step on a GPU, ``Overheads.launch_layer_s``); ``m``
    micro-batches run as ``m`` sequential generation passes (less KV cache, weights re-read). On ``p``
    pipeline stages (``runtime.distributed.pipeline``: each forward passes the stages in turn, no
    micro-batch overlap) a step is ``p`` times the largest stage's step (its ``⌈L/p⌉`` layers, weights and
    KV cache; the head counted on it), and each forward adds ``p − 1`` hidden-state sends over the chain's
    link (``b·T·H`` values) and a broadcast of the last stage's logits (``b·V`` values) along the chain:
    pipeline stages fit a model one host cannot hold, at no speed-up over one stage doing all the work.
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
    ``runtime.distributed.stream_sync``, or loads them at the node's start, ``nodes.functions._engine_sync``;
    both before the node's generation, so the planner prices the load with the node):
    ``engine_sync = model bytes / e.load_bandwidth + e.verify_s`` (model bytes: every parameter at the
    model's dtype, the full tensors each replica's engine receives; at ``t > 1`` gathered first from the
    instance's tensor-parallel shards, one all-gather per tensor over the ``t`` devices), after the
    instance's own weight sync.
  * KV-cache budget of the vLLM engine (Kwon et al. 2023, "Efficient Memory Management for Large Language
    Model Serving with PagedAttention": KV in blocks, a finished sequence frees its blocks; Yu et al. 2022,
    "Orca": iteration-level (continuous) batching). With ``gpu_memory_utilization = f`` the engine holds
    ``f · device memory`` on each of its ``t`` devices; its KV pool there is that less the weight shard
    ``W / t`` and its activation workspace ``A`` (``CostModel._engine_workspace``), in tokens ``K = pool /
    kv_per_token`` (the bytes of the device's ``max(1, kv heads // t)`` heads:
    ``sizing.kv_bytes_per_token``); without ``f`` the pool is ``sizing.engine_kv_cache_bytes``. A running
    sequence holds its prompt and its tokens so far; averaged over the sequences running at a step
    (length-biased sampling, renewal theory) that is
    ``P + E[ℓ²]/(2·E[ℓ])`` tokens, ``P + μ`` for the exponential length model of ``lengths.py`` (``μ`` the
    mean response): ``c = min(b, max_num_seqs, K / (P + μ))`` sequences run at once. With ``b > c`` rows the
    engine runs at full occupancy until its queue is empty — the other ``b − c`` rows' ``(b − c) · μ``
    tokens at ``c`` per step — and then until the last ``c`` running rows end, whose remaining lengths are
    again exponential (memoryless), so the tail is the expected longest of ``c`` rows::

        G = max(b − c, 0) · μ / c + longest(c)        (decode steps: G − 1 after the prefill's token)

    which is ``longest(b)`` when every row fits (``b ≤ c``). Preemption (a sequence evicted when the pool
    runs out) is not priced: ``P + μ`` per slot is the pool's steady-state use. The per-row fixed cost
    applies to the ``min(b, c)`` rows of a step.

Memory per device (bytes):
  * weights ``2``/param (bf16) of the largest stage's shard; train adds grads (2) and Adam state (12:
    fp32 master, m, v), sharded over dp (FSDP) plus two gathered layers (the current one and the one
    prefetched); with ``reshard: false`` instead of the two layers the stage's full weights and full
    (unsharded) gradients, ``Ψₛ · (w + 2)``, held through the step (``MemoryBreakdown.gathered``,
    transient: freed by the reshard after the step's last backward), the Adam state still ``/d`` (ZeRO-1's
    split, Rajbhandari et al. 2020, §5.1: ``(2 + 2 + 12/d)·Ψ`` for bf16 weights and gradients);
  * activations of a train micro-batch: ``S·b·(H·(10 + 16/t) + 8·Q/t + 5·a·S/t)`` per layer (Korthikanti
    et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2, tensor
    parallel, no recomputation: ``S·b·H·(10 + 24/t + 5·a·S/(H·t))`` with the q/k/v/attention-output
    terms, ``8·S·b·H/t``, at the attention width ``Q``), ``L/p`` layers, plus fp32 logits and their
    gradient ``2 · 4 · b·S·V/t``, for ``min(m, p)`` micro-batches of ``b`` rows (one at pp = 1): under
    1F1B stage ``s`` holds at most ``min(m, p − s)`` micro-batches' activations (its ``p − 1 − s`` warm-up
    forwards plus one; Narayanan et al. 2021, §2.2.1), so the first stage, which also has the most layers
    (``⌈L/p⌉``), is the largest (stages before the last hold placeholder logits of the same shape; GPipe
    would hold all ``m``); on a GPU cluster without the ``5·a·S/t`` scores term
    (FlashAttention-style SDPA kernels keep O(S) per head); with ``PlanNode.recompute`` (full
    recomputation, Korthikanti et al. §4) ``2·S·b·H`` per layer plus one layer's activations, and the
    train step runs one more forward per micro-batch (compute, calls, tensor-parallel collectives);
  * DeepSpeed ZeRO train nodes (``PlanNode.zero``): memory, collectives and CPU offload of ``zero_cost.py``;
  * inference: one layer's activations plus fp32 logits; generation: KV cache
    ``2 · L · kv_dim · S · b · w / t`` (``kv_dim`` = key/value heads · head_dim) plus logits of the last
    position;
  * an ``engine: vllm`` generate node: on each of its devices (one engine per data-parallel rank, tensor
    parallel over its ``t`` devices) the engine's shard of the weights (``params · w / t``) and, with
    ``gpu_memory_utilization = f``, the rest of its reservation ``f · device memory − params · w / t`` (KV
    cache and activation workspace; vLLM takes all of it), else the KV cache it allocates for the run
    (``rlflow.nodes.engines.sizing.engine_kv_cache_bytes``, the bytes the engine passes to vLLM: sized for
    every row at the model's ``max_position_embeddings``), in place of the decode loop's KV cache. Both are
    resident for the run. The node's own model instance (``params · w / t``, the weight sync's target) is
    transient when the model is trained: the runtime frees it once the engines have loaded the weights and
    allocates it again for the next sync (``runtime.distributed.worker.Worker``; vLLM-based trainers keep no
    such copy either), so it is priced as ``MemoryBreakdown.replica``, working memory beside the other nodes'
    transients; ``resources`` counts it resident when another node (built-in generate, inference, train)
    shares the instance, as the runtime then keeps it. The runtime streams the sync into the engines unit by
    unit (embedding, each decoder layer, final norm, head; ``runtime.distributed.stream_sync``), so the
    replica's peak is the largest unit's shard (a tied embedding held until the head), not the whole shard;
    from a DeepSpeed ZeRO-3 trainer (not streamed) it is the whole shard. A frozen model's instance is never
    synced and stays resident. With ``args.enable_sleep_mode`` on CUDA (``PlanNode.sleep_mode``) the engine
    sleeps between calls (vLLM's sleep level 1: weights to host memory, KV cache freed), so its bytes are
    working memory of the node (``MemoryBreakdown.engine_sleeps``), not resident: a colocated train node gets
    the device between generations; each call then pays the weight shard's copy to host and back at the host's
    PCIe bandwidth (``ClusterSpec.host_spec``).

Weight sync after a train node (what ``Worker.sync`` runs, priced by ``sync_time``): every *instance*
of the model other than the train node's (nodes with the same devices, dp, tp and sharding share one, as
in ``runtime.distributed.placement``) receives the new weights. An FSDP2 source first all-gathers every
parameter tensor over dp; a plan-path target then gets ``realloc.plan_reallocation``'s transfers, packed into
broadcasts as ``realloc.execute.schedule_messages`` packs them, local copies at memory bandwidth; an FSDP2
target takes the gather path (every tensor gathered on the source mesh, one broadcast of the model).
Every target is verified: two all-gathers on the union of both meshes and hashing its shards twice at
``Overheads.digest_bandwidth``. An edge costs ``bytes / link bandwidth + latency`` when producer and
consumer meshes differ.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from rlflow.dataflow import layout_rules as rules
from rlflow.dataflow.errors import PlanError
from rlflow.nodes.engines.sizing import (
    ENGINE_BLOCK_TOKENS,
    engine_batched_tokens,
    engine_kv_cache_bytes,
    engine_max_rows,
    engine_reservation_bytes,
    engine_rows,
    kv_bytes_per_token,
)
from rlflow.schedulers.planner.cluster import ClusterSpec, human_bytes
from rlflow.schedulers.planner.lengths import expected_longest
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import ModelShape, PlanNode, PlanProblem
from rlflow.schedulers.planner.zero_cost import CPU_ADAM_BYTES, ZeroConfig, zero_memory
from rlflow.schedulers.realloc.planning import DEFAULT_BUCKET_BYTES, DEFAULT_DIRECT_BYTES, region_moves
from rlflow.schedulers.realloc.shards import ModelMeta, stage_layers

__all__ = [
    "CostModel",
    "MemoryBreakdown",
    "NodeCost",
    "forward_flops",
    "layout_problem",
]

GRAD_BYTES = 2  # bf16 gradients
OPTIM_BYTES = 12  # fp32 master weights + Adam m + v
LOGIT_BYTES = 4  # fp32 logits


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device of one node: resident state, transient working memory and, for an
    ``engine: vllm`` node, its engine on the device (``engine_weights``: the engine's own copy of the
    weights; ``engine_kv_cache``: the KV cache it allocates; both live as long as the run).

    ``replica``: an ``engine: vllm`` node's model instance (bytes), allocated only from a weight sync
    until its engines have loaded the weights (the runtime frees it in between; module docstring,
    "Memory per device"), so transient; ``weights`` is then 0.

    ``engine_sleeps``: the engine sleeps between the node's calls (``PlanNode.sleep_mode`` on CUDA), so its
    weights and KV cache are working memory of the node (in ``transient``), not resident.
    """

    weights: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    engine_weights: float = 0.0
    engine_kv_cache: float = 0.0
    replica: float = 0.0
    host: float = 0.0  # state a DeepSpeed CPU offload keeps in host memory (not on the device, not in peak)
    gathered: float = 0.0  # FSDP2 weights and gradients held unsharded through a train step (reshard: false)
    engine_sleeps: bool = False

    @property
    def resident_engine(self) -> float:
        """Bytes of the node's vLLM engine held for the run (0 when it sleeps between calls)."""
        return 0.0 if self.engine_sleeps else self.engine

    @property
    def engine(self) -> float:
        """Bytes of the node's vLLM engine on the device (weights + KV cache; 0 without one)."""
        return self.engine_weights + self.engine_kv_cache

    @property
    def state(self) -> float:
        """Bytes that live as long as the model copy (weights + grads + optimizer state)."""
        return self.weights + self.grads + self.optimizer

    @property
    def transient(self) -> float:
        """Bytes that live only while the node runs or is fed (activations + KV cache + a vLLM node's
        replica + the weights and gradients a ``reshard: false`` train step keeps gathered + a sleeping
        engine, awake only for its calls)."""
        awake = self.engine if self.engine_sleeps else 0.0
        return self.activations + self.kv_cache + self.replica + self.gathered + awake

    @property
    def peak(self) -> float:
        return self.state + self.transient + self.resident_engine


def _engine_config(shape: ModelShape) -> dict[str, int]:
    """The Hugging Face config fields :func:`engine_kv_cache_bytes` reads, from ``shape``."""
    return {
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "hidden_size": shape.hidden_size,
        "head_dim": shape.head_dim,
        "max_position_embeddings": shape.max_positions,
    }


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

    @property
    def time_s(self) -> float:
        return (
            self.compute_s + self.tp_comm_s + self.dp_comm_s + self.pp_comm_s + self.bubble_s
            + self.optimizer_s + self.decode_s + self.overhead_s + self.engine_sync_s + self.offload_s
        )  # fmt: skip


def forward_flops(shape: ModelShape, rows: float, seq_len: float) -> float:
    """FLOPs of one forward pass over ``rows`` sequences of ``seq_len`` tokens (Narayanan et al. 2021)."""
    tokens = rows * seq_len
    matmul = 2.0 * tokens * (shape.num_hidden_layers * shape.layer_params + shape.head_params)
    attention = 4.0 * rows * seq_len * seq_len * shape.q_dim * shape.num_hidden_layers
    return matmul + attention


def layout_problem(
    shape: ModelShape, node: PlanNode, layout: Layout, engine: str | None = None
) -> str | None:
    """Why ``layout`` cannot run ``node`` on ``shape`` with the placement's ``engine`` (``None``: the node's
    own, ``PlanNode.engine_of``) (None when it can): the shared rule
    :func:`rlflow.dataflow.layout_rules.layout_problem` on the shape's config fields and the node's rows
    (``PlanNode.split_rows``)."""
    if node.zero is not None and (layout.tp > 1 or layout.pp > 1):
        return (
            f"DeepSpeed ZeRO ({node.zero}) runs with tensor and pipeline degree 1, "
            f"got tp {layout.tp}, pp {layout.pp}"
        )
    config = {f.name: getattr(shape, f.name) for f in fields(shape)}
    why = rules.layout_problem(
        node.kind,
        node.split_rows,
        node.mini_batches,
        node.group_size,
        config,
        layout,
        node.model,
        node.engine_of(engine),
        node.function,
    )
    return None if why is None else str(why)


class CostModel:
    """Prices nodes, weight syncs, reallocations and edges of one problem on one cluster (caches results)."""

    def __init__(self, problem: PlanProblem, cluster: ClusterSpec) -> None:
        self.problem = problem
        self.cluster = cluster
        self._node_cache: dict[tuple[str, Layout, str, bool, bool, bool, tuple[int, ...]], NodeCost] = {}
        self._realloc_cache: dict[tuple[str, NodePlacement, NodePlacement], float] = {}
        self._sync_cache: dict[tuple[str, tuple[tuple[NodePlacement, bool], ...]], float] = {}
        self._fits: dict[tuple[PlanNode, Layout, str | None], str | None] = {}
        # (model, source pp, target pp) -> the representative parameters a reallocation plans, their scale
        self._realloc_params: dict[
            tuple[str, int, int], tuple[dict[str, tuple[int, ...]], dict[str, int]]
        ] = {}
        self._io = self._io_bytes()

    def _io_bytes(self) -> dict[str, tuple[float, float]]:
        """Node -> (input bytes, output bytes) per iteration that pass through the controller.

        Batches move worker to worker (``schedulers/runtime/distributed/transfer.py``; priced by
        :meth:`edge_time`) and outputs stay on the workers, so only the data set's rows go from the
        controller to a node's workers; the metadata of the replies is covered by ``dispatch_s``.
        """
        inputs: dict[str, float] = defaultdict(float)
        for src, dst, _key, size in self.problem.data_edges:
            if src == "data":
                inputs[dst] += size
        return {n.name: (inputs[n.name], 0.0) for n in self.problem.nodes}

    # ---- helpers -----------------------------------------------------------------------------------
    def _collectives(
        self, op: str, count: float, total_bytes: float, group: tuple[int, ...], slow: float | None = None
    ) -> float:
        """``count`` collectives ``op`` moving ``total_bytes`` together among ``group``: ``count · T(0) +
        T(total) − T(0)`` (``T`` is affine in bytes). ``slow``: the oversubscription of the node issuing
        them, relative to the group's own (the profile measured the group with its ranks busy)."""
        if count <= 0 or len(group) <= 1:
            return 0.0
        fixed = self.cluster.collective_time(op, 0.0, group)
        seconds = count * fixed + self.cluster.collective_time(op, total_bytes, group) - fixed
        return seconds if slow is None else seconds * slow / self.cluster.mesh_slowdown(group)

    @staticmethod
    def _tensors(shape: ModelShape) -> tuple[int, int]:
        """(parameter tensors per decoder layer, tensors outside the layers) in HF Llama naming."""
        names = replace(shape, num_hidden_layers=1).param_shapes()
        per_layer = sum(1 for n in names if ".layers." in n)
        return per_layer, len(names) - per_layer

    @staticmethod
    def _tp_modules(shape: ModelShape, layers: int, t: int) -> int:
        """Tensor-parallel modules one forward calls (0 for tp = 1): 7 projections per layer, the
        vocabulary-parallel embedding and, for an ``lm`` head, the head
        (``runtime.distributed.layouts.tp_plan``)."""
        if t == 1:
            return 0
        return 7 * layers + 1 + (1 if shape.head == "lm" else 0)

    def dispatch_time(self, node: str | PlanNode, placement: NodePlacement) -> float:
        """Seconds of the controller's round trip for one node: ``dispatch_s + (t · in + out) / bw``."""
        spec = self.problem.node(node) if isinstance(node, str) else node
        ov = self.cluster.overheads
        in_bytes, out_bytes = self._io.get(spec.name, (0.0, 0.0))
        return ov.dispatch_s + (placement.layout.tp * in_bytes + out_bytes) / ov.dispatch_bandwidth

    # ---- nodes -------------------------------------------------------------------------------------
    def layout_problem(self, node: PlanNode, layout: Layout, engine: str | None = None) -> str | None:
        """:func:`layout_problem` for ``node`` of this problem (memoised: the search asks it of every
        layout on every mesh size)."""
        key = (node, layout, engine)
        if key not in self._fits:
            why = layout_problem(self.problem.models[node.model], node, layout, engine)
            if why is None and node.kind == "generate" and node.engine_of(engine) == "vllm":
                why = self.engine_start_problem(node, layout.dp, layout.tp)
            self._fits[key] = why
        return self._fits[key]

    def node_cost(self, node: str | PlanNode, placement: NodePlacement) -> NodeCost:
        """Seconds and bytes of ``node`` under ``placement``.

        Raises:
            PlanError: the layout does not fit the model or the rows (message names the node).
        """
        spec = self.problem.node(node) if isinstance(node, str) else node
        recompute = spec.recompute_of(placement.recompute)
        if spec.recompute is not recompute:  # ``auto``: priced as the placement chooses
            spec = replace(spec, recompute=recompute)
        reshard = spec.reshard_of(placement.reshard)
        if spec.reshard is not reshard:
            spec = replace(spec, reshard=reshard)
        busy = self.cluster.host_loads(placement.devices)
        engine = spec.engine_of(placement.engine)
        key = (spec.name, placement.layout, engine, recompute, reshard, len(busy) > 1, busy)
        cached = self._node_cache.get(key)
        if cached is None:
            shape = self.problem.models[spec.model]
            why = self.layout_problem(spec, placement.layout, placement.engine)
            if why is not None:
                raise PlanError(f"node {spec.name!r}: layout {placement.layout} does not fit: {why}")
            if spec.kind == "generate" and engine == "vllm":
                cached = self._generate_vllm(spec, shape, placement)
            else:
                cached = self._compute(spec, shape, placement)
            self._node_cache[key] = cached
        return cached

    def _stage_params(self, shape: ModelShape, layout: Layout) -> float:
        """Parameters on the most loaded device: largest stage's layers + embedding/head, over tp."""
        layers = math.ceil(shape.num_hidden_layers / layout.pp)
        vocab_mats = 2 if (layout.pp == 1 and shape.head == "lm" and not shape.tied) else 1
        ends = vocab_mats * shape.vocab_size * shape.hidden_size + shape.hidden_size
        return (layers * shape.layer_params + ends) / layout.tp

    def _activation_bytes(self, shape: ModelShape, rows: float, seq: float, t: int) -> float:
        """Korthikanti et al. 2022, Table 2 (tensor parallel, no sequence parallel): bytes per layer; the
        q/k/v and attention-output terms at the attention width (``ModelShape.q_dim``). On a GPU cluster
        the ``5·a·S/t`` term (scores, softmax, its dropout mask: ``S × S`` per head) is left out: torch's
        scaled-dot-product attention, which Hugging Face models use, runs a FlashAttention / memory-
        efficient kernel there that keeps O(S) per head (Dao et al. 2022, "FlashAttention", §3.1)."""
        h, q, a = shape.hidden_size, shape.q_dim, shape.num_attention_heads
        scores = 0.0 if self.cluster.device_type == "cuda" else 5 * a * seq / t
        return seq * rows * (h * (10 + 16 / t) + 8 * q / t + scores)

    def _train_activations(
        self, node: PlanNode, shape: ModelShape, b: float, t: int, layers: int, in_flight: int, seq: float
    ) -> float:
        """Bytes of a train node's activations on one device: ``in_flight`` micro-batches of ``b`` rows of
        ``seq`` tokens through ``layers`` layers, plus fp32 logits and their gradient. With ``recompute``
        (full activation recomputation, Korthikanti et al. 2022 §4: "2sbh" per layer) each layer keeps only
        its 16-bit input, ``2·S·b·H``, and one layer's activations are rebuilt at a time in the backward
        pass."""
        full = self._activation_bytes(shape, b, seq, t)
        if node.recompute:
            acts = in_flight * layers * 2 * seq * b * shape.hidden_size + full
        else:
            acts = in_flight * layers * full
        return (
            acts + in_flight * 2 * LOGIT_BYTES * b * seq * (shape.vocab_size if shape.head == "lm" else 1) / t
        )

    def _tp_forward(
        self,
        shape: ModelShape,
        layers: int,
        rows: float,
        seq: float,
        group: tuple[int, ...],
        slow: float,
        logits: float | None = None,
    ) -> float:
        """Tensor-parallel collectives of one forward over ``rows × seq`` tokens: ``2·layers + 1``
        all-reduces of the activations plus, for an ``lm`` head, the all-gather of the logits of
        ``logits`` positions per row (default all ``seq``; generation keeps the last one)."""
        w = shape.dtype_bytes
        act = rows * seq * shape.hidden_size * w
        seconds = self._collectives("all_reduce", 2 * layers + 1, (2 * layers + 1) * act, group, slow)
        if shape.head == "lm":
            positions = seq if logits is None else logits
            seconds += self._collectives(
                "all_gather", 1, rows * positions * shape.vocab_size * w, group, slow
            )
        return seconds

    def _compute(self, node: PlanNode, shape: ModelShape, placement: NodePlacement) -> NodeCost:
        if node.kind == "generate":
            return self._generate(node, shape, placement)
        c, lay = self.cluster, placement.layout
        eff, ov = c.efficiency, c.overheads
        d, t, p, m = lay.dp, lay.tp, lay.pp, lay.micro_batches
        n_dev = d * t * p
        w = shape.dtype_bytes
        devs = placement.devices
        tp_group, dp_group = devs[:t], devs[: t * d : t]
        pp_link = c.link(devs[:: t * d])
        slow = self.cluster.mesh_slowdown(devs)
        L, H, V = shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
        stage_params = self._stage_params(shape, lay)
        weights = stage_params * w
        layers = math.ceil(L / p)
        train = node.kind == "train"

        steps = node.epochs * node.mini_batches if train else 1
        epochs = node.epochs if train else 1
        calls = steps * m  # micro-batch passes per device
        first = m if train and node.first_pass else 0  # no-grad micro-batches of a first pass
        b = node.rows / (node.mini_batches if train else 1) / (d * m)  # rows per micro-batch per dp rank
        # each micro-batch is cut to its own longest response (nodes/train.py): forward tokens per row
        seq = node.prompt_len + self._longest(node, b)
        tokens_mb = b * seq
        rate = c.device.peak_flops * eff.matmul_at(tokens_mb)
        redo = calls if train and node.recompute else 0  # forwards rerun in the backward (recompute)
        # fwd + bwd (2×fwd), + a forward with recompute (Korthikanti et al. 2022: 4× instead of 3×)
        passes = ((4.0 if redo else 3.0) * epochs if train else 1.0) + (1.0 if first else 0.0)
        compute = slow * passes * forward_flops(shape, node.rows, seq) / (n_dev * rate)
        tp_modules = self._tp_modules(shape, layers, t)
        forward_call = ov.call_s + tp_modules * ov.tp_module_s
        call_overhead = slow * (calls + first + redo) * forward_call  # fixed costs of the micro-batch calls
        tp_comm = (calls + first + redo) * self._tp_forward(shape, layers, b, seq, tp_group, slow)
        units = (layers + 1) if train and d > 1 else 0  # FSDP2 units (ZeRO buckets): every layer + the root
        zero = node.zero if train else None
        hooked = units if zero is None or zero.stage == 3 else 0  # units with gather/release hooks
        if train:
            backward_call = ov.backward_s + tp_modules * ov.tp_module_backward_s + hooked * ov.fsdp_unit_s
            call_overhead += slow * calls * backward_call
            # backward: 5 all-reduces per layer, 1 for the lm head's input; 1 grad-norm per step
            act = tokens_mb * H * w
            n_bwd = 5 * layers + (1 if shape.head == "lm" else 0)
            tp_comm += calls * self._collectives("all_reduce", n_bwd, n_bwd * act, tp_group, slow)
            tp_comm += steps * self._collectives("all_reduce", 1, 8, tp_group, slow)
        # Pipeline p2p of one micro-batch's activations per boundary (forward, and backward for train).
        pp_comm = 0.0
        if p > 1:
            msgs = steps * m * (2 if train else 1)
            pp_comm = msgs * (tokens_mb * H * w / t / (pp_link.bandwidth * eff.link) + pp_link.latency)
        # every stage makes its own calls one after another along the pipeline, fixed costs included
        bubble = (compute + tp_comm + call_overhead) * (p - 1) / m
        # the mesh's ranks get their commands one after another: the last starts that much later
        overhead = slow * ov.node_s + call_overhead + (n_dev - 1) * ov.rank_skew_s
        # memory peaks at the micro-batch that holds the longest response of the rank's rows
        peak_seq = node.prompt_len + self._longest(node, node.rows / d)
        if not train:
            acts = self._activation_bytes(shape, b, peak_seq, t)
            acts += LOGIT_BYTES * b * peak_seq * (V if shape.head == "lm" else 1) / t
            mem = MemoryBreakdown(weights, 0.0, 0.0, acts, 0.0)
            return NodeCost(
                compute_s=compute, tp_comm_s=tp_comm, dp_comm_s=0.0, pp_comm_s=pp_comm, bubble_s=bubble,
                optimizer_s=0.0, decode_s=0.0, overhead_s=overhead, memory=mem,
                dispatch_s=self.dispatch_time(node, placement),
            )  # fmt: skip
        if zero is not None:
            parts = (compute, tp_comm, pp_comm, bubble, overhead)
            return self._zero_train(node, shape, placement, zero, units, *parts)
        dp_comm = 0.0
        gathered = d > 1 and node.reshard is False  # units kept gathered through each optimizer step
        if d > 1:  # all-gather every unit forward (and again backward), reduce-scatter its gradients
            unit_bytes = stage_params * w  # the stage's weights over tp, summed over its units
            gather = self._collectives("all_gather", units, unit_bytes, dp_group, slow)
            scatter = self._collectives("reduce_scatter", units, unit_bytes, dp_group, slow)
            small = 2 + (1 if t > 1 else 0)  # loss normaliser + grad norm (+ its dp-only part under tp)
            per_step = self._collectives("all_reduce", small, 8 * small, dp_group, slow)
            # reshard false: one gather (first forward) and one reduce-scatter (last backward) per step
            train_comm = steps * (gather + scatter) if gathered else calls * (2 * gather + scatter)
            dp_comm = train_comm + first * gather + steps * per_step
        per_layer, ends = self._tensors(shape)
        adam_bytes = 2 * stage_params / d * (w + GRAD_BYTES + OPTIM_BYTES)
        per_tensor = ov.step_tensor_s + (ov.dtensor_tensor_s if d * t > 1 else 0.0)
        optimizer = slow * steps * (
            adam_bytes / (c.device.memory_bandwidth * (eff.optimizer or eff.memory))
            + (layers * per_layer + ends) * per_tensor + ov.step_s
        )  # fmt: skip
        grads = stage_params * GRAD_BYTES / d
        optim = stage_params * OPTIM_BYTES / d
        layer_full = shape.layer_params / t * w
        # FSDP shard + gathered current/prefetched layer; reshard false: the whole stage gathered instead
        state_weights = weights / d + (0.0 if gathered else 2 * layer_full)
        held = stage_params * (w + GRAD_BYTES) if gathered else 0.0  # full weights + unsharded gradients
        in_flight = min(m, p)  # 1F1B: stage s keeps min(m, p − s) micro-batches alive; stage 0 the most
        acts = self._train_activations(node, shape, b, t, layers, in_flight, peak_seq)
        mem = MemoryBreakdown(state_weights, grads, optim, acts, 0.0, gathered=held)
        return NodeCost(
            compute_s=compute, tp_comm_s=tp_comm, dp_comm_s=dp_comm, pp_comm_s=pp_comm, bubble_s=bubble,
            optimizer_s=optimizer, decode_s=0.0, overhead_s=overhead, memory=mem,
            dispatch_s=self.dispatch_time(node, placement),
        )  # fmt: skip

    def _zero_train(
        self,
        node: PlanNode,
        shape: ModelShape,
        placement: NodePlacement,
        zero: ZeroConfig,
        units: int,
        compute: float,
        tp_comm: float,
        pp_comm: float,
        bubble: float,
        overhead: float,
    ) -> NodeCost:
        """A train node on DeepSpeed ZeRO (tp = pp = 1): its collectives, optimizer step, CPU offload and
        memory per rank (formulas and sources in ``zero_cost.py``); compute and fixed costs as
        ``_compute``'s."""
        c, lay = self.cluster, placement.layout
        eff, ov = c.efficiency, c.overheads
        d, m, w = lay.dp, lay.micro_batches, shape.dtype_bytes
        devs = placement.devices
        slow = c.mesh_slowdown(devs)
        steps = node.epochs * node.mini_batches
        calls = steps * m
        first = m if node.first_pass else 0
        psi = self._stage_params(shape, lay)  # every parameter: tp = pp = 1
        dp_comm = 0.0
        if d > 1:
            gather = self._collectives("all_gather", units, psi * w, devs, slow)
            scatter = self._collectives("reduce_scatter", units, psi * GRAD_BYTES, devs, slow)
            per_step = self._collectives("all_reduce", 2, 16, devs, slow)  # loss normaliser, grad norm
            if zero.stage == 1:  # accumulated gradients reduced once per step, then the new weights gathered
                dp_comm = steps * (scatter + gather)
            elif zero.stage == 2:  # every micro-batch's gradients reduced into their partitions
                dp_comm = calls * scatter + steps * gather
            else:  # weights gathered forward and backward, gradients reduce-scattered, every micro-batch
                dp_comm = calls * (2 * gather + scatter) + first * gather
            dp_comm += steps * per_step
        per_layer, ends = self._tensors(shape)
        tensors = shape.num_hidden_layers * per_layer + ends
        part = psi / d  # parameters of this rank's partition
        offload = 0.0
        if zero.offload_optimizer:
            host = c.host_spec()
            pcie = host.pcie_bandwidth * eff.link
            # the host's memory bandwidth is shared by this node's ranks on it
            ranks = max(c.host_loads(devs))
            cpu_rate = host.memory_bandwidth * eff.memory / ranks
            moves = calls if zero.stage > 1 else steps  # gradient partitions leave per micro-batch at 2/3
            offload += (moves * GRAD_BYTES * part + steps * part * w) / pcie
            optimizer = steps * (part * CPU_ADAM_BYTES / cpu_rate + tensors * ov.step_tensor_s + ov.step_s)
        else:
            adam_bytes = 2 * part * (w + GRAD_BYTES + OPTIM_BYTES)
            optimizer = slow * steps * (
                adam_bytes / (c.device.memory_bandwidth * (eff.optimizer or eff.memory))
                + tensors * ov.step_tensor_s + ov.step_s
            )  # fmt: skip
        if zero.offload_param:  # the weight partition comes from the host before every gather
            pcie = c.host_spec().pcie_bandwidth * eff.link
            offload += (2 * calls + first) * part * w / pcie
        zm = zero_memory(psi, shape.layer_params, d, w, zero)
        b = node.rows / node.mini_batches / (d * m)
        peak_seq = node.prompt_len + self._longest(node, node.rows / d)
        acts = self._train_activations(node, shape, b, 1, shape.num_hidden_layers, 1, peak_seq)
        # DeepSpeed's all-gather bucket holds weights, its reduce bucket gradients: half the buckets each
        mem = MemoryBreakdown(
            zm.weights + zm.buckets / 2, zm.grads + zm.buckets / 2, zm.optimizer, acts, 0.0, host=zm.host
        )
        return NodeCost(
            compute_s=compute, tp_comm_s=tp_comm, dp_comm_s=dp_comm, pp_comm_s=pp_comm, bubble_s=bubble,
            optimizer_s=optimizer, decode_s=0.0, overhead_s=overhead, memory=mem,
            dispatch_s=self.dispatch_time(node, placement), offload_s=offload,
        )  # fmt: skip

    def _generate(self, node: PlanNode, shape: ModelShape, placement: NodePlacement) -> NodeCost:
        c, lay = self.cluster, placement.layout
        eff, ov = c.efficiency, c.overheads
        d, t, p, m = lay.dp, lay.tp, lay.pp, lay.micro_batches
        w = shape.dtype_bytes
        devs = placement.devices
        tp_group, chain = devs[:t], devs[:: t * d]
        slow = self.cluster.mesh_slowdown(devs)
        L, H, V = shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
        layers = math.ceil(L / p)  # the largest stage's
        b = node.rows / (d * m)
        weights = self._stage_params(shape, lay) * w
        # Prefill: one forward over the prompts of each micro-batch; the logits of the last position only.
        # On pipeline stages the forward passes the stages in turn: as long as one stage doing it all.
        rate = c.device.peak_flops * eff.matmul_at(b * node.prompt_len)
        prefill = slow * forward_flops(shape, node.rows, node.prompt_len) / (d * t * rate)
        prefill_tp = m * self._tp_forward(shape, L, b, node.prompt_len, tp_group, slow, logits=1)
        # Decode: G − 1 steps (the prefill's logits give token 0), each a memory-bound read of weights +
        # KV cache at the mean context length, and the forward's collectives on one token per row.
        # the call runs until its longest row ends (``lengths.py``); every row's KV cache stays till then
        longest = self._longest(node, b)
        ctx = node.prompt_len + longest / 2
        step_tp = self._tp_forward(shape, L, b, 1, tp_group, slow)
        steps = max(longest - 1, 0)
        # an eager step is host-bound when issuing its layers' kernels outlasts the device's work on them;
        # on pipeline stages the stages step one after another, each priced as the largest
        step = p * max(self._decode_step(shape, b, ctx, t, weights, layers), layers * ov.launch_layer_s)
        pp_comm = 0.0
        if p > 1:  # per forward: p − 1 hidden-state sends, then the last stage's logits broadcast
            link = c.link(chain)
            hop = (p - 1) * link.latency
            send = (p - 1) / (link.bandwidth * eff.link)
            logits = self._collectives("broadcast", 1, b * V * w, chain)  # the same every forward
            prefill_comm = hop + send * b * node.prompt_len * H * w + logits
            step_comm = hop + send * b * H * w + logits
            pp_comm = m * (prefill_comm + steps * step_comm)
        decode = m * steps * (slow * step + step_tp)
        tp_modules = self._tp_modules(shape, layers, t)
        overhead = (
            slow
            * (ov.node_s + m * (ov.call_s + steps * ov.decode_s + (1 + steps) * tp_modules * ov.tp_module_s))
            + (d * t * p - 1) * ov.rank_skew_s
        )
        kv = 2 * layers * shape.kv_dim * node.seq_len * b * w / t
        acts = self._activation_bytes(shape, b, node.prompt_len, t) + LOGIT_BYTES * b * V / t
        mem = MemoryBreakdown(weights, 0.0, 0.0, acts, kv)
        return NodeCost(
            compute_s=prefill, tp_comm_s=prefill_tp, dp_comm_s=0.0, pp_comm_s=pp_comm, bubble_s=0.0,
            optimizer_s=0.0, decode_s=decode, overhead_s=overhead, memory=mem,
            dispatch_s=self.dispatch_time(node, placement),
        )  # fmt: skip

    @staticmethod
    def _longest(node: PlanNode, rows: float) -> float:
        """Expected longest response (tokens) of ``rows`` rows: a generate call's decode steps, or the
        response width of an inference/train micro-batch cut to its rows (``lengths.expected_longest`` at the
        node's ``response_mean``, capped at ``gen_len``; ``gen_len`` without a mean)."""
        if node.gen_len <= 0:
            return 0.0
        return expected_longest(node.response_mean, node.gen_len, max(rows, 1.0))

    def _decode_step(
        self, shape: ModelShape, b: float, ctx: float, t: int, weights: float, layers: int | None = None
    ) -> float:
        """Roofline seconds of one decode step of ``b`` rows at context ``ctx`` on one of ``t`` tensor-
        parallel devices holding ``weights`` bytes and ``layers`` decoder layers (default: all; a pipeline
        stage's, with the head counted on it): the larger of its FLOPs at the matmul rate and its
        weights + KV cache read at the memory streaming rate (ReaL, Mei et al. 2024, §5)."""
        c, eff = self.cluster, self.cluster.efficiency
        L, w = layers or shape.num_hidden_layers, shape.dtype_bytes
        kv_read = 2 * L * shape.kv_dim * ctx * b * w / t
        matmul = 2 * b * (L * shape.layer_params + shape.head_params)
        step_flops = (matmul + 4 * b * ctx * shape.q_dim * L) / t
        step_compute = step_flops / (c.device.peak_flops * eff.matmul_at(b))
        step_memory = (weights + kv_read) / (c.device.memory_bandwidth * eff.memory)
        return max(step_compute, step_memory)

    def _engine_workspace(self, shape: ModelShape, seqs: float, tp: int = 1) -> float:
        """Bytes of a vLLM engine's activation workspace on one of its ``tp`` devices: one layer's
        activations over the engine's token budget per step (vLLM profiles a forward of
        ``max_num_batched_tokens`` tokens at start and keeps that peak out of the KV cache:
        :func:`engine_batched_tokens`), split ``tp`` ways as the built-in forward's, plus the fp32 logits of
        ``seqs`` sequences over the whole vocabulary (its sampler; vLLM gathers the logits of a tensor-
        parallel head)."""
        dev = self.cluster.device
        tokens = engine_batched_tokens(self.cluster.device_type, dev.memory_bytes, dev.name)
        return self._activation_bytes(shape, 1, tokens, tp) + LOGIT_BYTES * seqs * shape.vocab_size

    def _engine_context_kv(self, shape: ModelShape, tp: int = 1) -> float:
        """Bytes of KV cache of one ``max_position_embeddings`` sequence on one of ``tp`` devices, in whole
        blocks of the engine's (``sizing.ENGINE_BLOCK_TOKENS``), plus the block vLLM's block pool keeps as
        its null block (``BlockPool``): vLLM refuses to start without room for one ``max_model_len``
        request."""
        per_token = kv_bytes_per_token(_engine_config(shape), shape.dtype_bytes, tp)
        block = ENGINE_BLOCK_TOKENS[self.cluster.device_type]
        return per_token * (-(-shape.max_positions // block) + 1) * block

    def _engine_weights(self, shape: ModelShape, tp: int = 1) -> float:
        """Bytes of a vLLM engine's weights on one of its ``tp`` devices: every decoder layer, the
        embedding and the head split ``tp`` ways (vLLM's column/row-parallel linears and vocabulary-parallel
        embedding and head), as the built-in tensor-parallel shard (:meth:`_stage_params`)."""
        return self._stage_params(shape, Layout(1, tp, 1, 1)) * shape.dtype_bytes

    def _replica_peak(self, node: PlanNode, shape: ModelShape, tp: int) -> float:
        """Bytes per device of a trained vLLM node's own instance at the peak of a weight sync. The runtime
        streams the planned reallocation into the engines unit by unit (``runtime.distributed.stream_sync``):
        the largest of the embedding, one decoder layer, the final norm and the head, each split ``tp``
        ways, with a tied embedding held until the head; at ``tp > 1`` plus the largest unit gathered to
        full tensors for the engine's load. From a DeepSpeed ZeRO-3 trainer the sync writes the
        whole instance first (its pieces route is not streamed): the engine's shard
        (:meth:`_engine_weights`)."""
        train = self.problem.train_node(node.model)
        zero = self.problem.node(train).zero if train is not None else None
        if zero is not None and zero.stage == 3:
            return self._engine_weights(shape, tp)
        vocab = shape.vocab_size * shape.hidden_size
        largest = max(shape.layer_params, shape.hidden_size, 0 if shape.tied else vocab)
        held = vocab + largest if shape.tied else max(vocab, largest)
        # at tp > 1 each rank also gathers the unit it loads to full tensors (``GroupEngine.load_unit``)
        gathered = max(shape.layer_params, vocab) if tp > 1 else 0
        return (held / tp + gathered) * shape.dtype_bytes

    def engine_start_problem(self, node: PlanNode, dp: int, tp: int = 1) -> str | None:
        """Why ``node``'s vLLM engines (``dp`` of them, each tensor parallel over ``tp`` devices) cannot
        start under its ``gpu_memory_utilization`` ``f`` on this cluster's devices (None when they can, or
        without ``f``): on each device the reservation ``f · device memory`` must hold the engine's weight
        shard and one ``max_position_embeddings`` sequence of KV cache, and on CUDA the activation workspace
        too (:meth:`_engine_workspace`; the CPU engine gets the reservation less the weights as its KV cache
        alone, ``sizing.reserved_kv_cache_bytes``).

        Returns:
            ``gpu_memory_utilization f of X GiB is Y GiB, less than the ... GiB ...; at least f' starts``.
        """
        util = node.gpu_memory_utilization
        if util is None:
            return None
        shape = self.problem.models[node.model]
        device = self.cluster.device.memory_bytes
        seqs = engine_rows(engine_max_rows(node.split_rows, dp, node.group_size))
        weights = self._engine_weights(shape, tp)
        need = weights + self._engine_context_kv(shape, tp)
        if self.cluster.device_type == "cuda":
            need += self._engine_workspace(shape, seqs, tp)
        reserved = engine_reservation_bytes(util, device)
        if reserved >= need:
            return None
        least = need / device
        step = 10.0 ** (math.floor(math.log10(least)) - 1)  # rounded up to two significant digits
        return (
            f"gpu_memory_utilization {util:g} of the {human_bytes(device)} device is "
            f"{human_bytes(reserved)}, less than the {human_bytes(need)} its vLLM engine needs to start "
            f"(weights {human_bytes(weights)}{f' (tp {tp})' if tp > 1 else ''} and one "
            f"{shape.max_positions}-token context of KV cache, and "
            f"on a GPU its activation workspace); at least {math.ceil(least / step) * step:.2g} starts"
        )

    def engine_kv(
        self, node: PlanNode, shape: ModelShape, dp: int, tp: int = 1
    ) -> tuple[float, float, float]:
        """``(memory, kv_pool, concurrent)`` of one of ``node``'s vLLM engines (``dp`` of them, each tensor
        parallel over ``tp`` devices), per device.

        ``memory``: bytes on each of its devices beyond the engine's weight shard: with
        ``gpu_memory_utilization = f`` the rest of its reservation, ``f · device memory − weights / tp``
        (``sizing.engine_reservation_bytes``; at least the workspace plus one ``max_position_embeddings``
        sequence, the least vLLM starts with); else ``sizing.engine_kv_cache_bytes`` over ``tp``.
        ``kv_pool``: bytes of KV cache in it (the reservation's rest less :meth:`_engine_workspace`).
        ``concurrent``: sequences the engine runs at once, ``c = min(b, max_num_seqs, kv_pool / (kv bytes
        per token and device · (P + μ)))`` for its ``b`` rows (module docstring, "KV-cache budget")."""
        w = shape.dtype_bytes
        config = _engine_config(shape)
        rows = engine_max_rows(node.split_rows, dp, node.group_size)
        seqs = engine_rows(rows)  # max_num_seqs
        per_token = kv_bytes_per_token(config, w, tp)
        util = node.gpu_memory_utilization
        if util is None:
            pool = float(engine_kv_cache_bytes(config, w, rows, tp))
            memory = pool
        else:
            weights = self._engine_weights(shape, tp)
            workspace = self._engine_workspace(shape, seqs, tp)
            least = workspace + self._engine_context_kv(shape, tp)
            memory = max(engine_reservation_bytes(util, self.cluster.device.memory_bytes) - weights, least)
            pool = memory - workspace
        # a running sequence holds its prompt and the tokens it generated so far: on average over the
        # sequences running at any step (length-biased, renewal theory) E[ℓ²] / (2·E[ℓ]), which is μ for the
        # exponential length model (lengths.py); so P + μ tokens per slot
        per_seq = per_token * (node.prompt_len + node.response_mean)
        b = node.rows / dp
        concurrent = min(b, float(seqs), pool / per_seq) if per_seq > 0 else min(b, float(seqs))
        return memory, pool, max(concurrent, 1.0)

    def _engine_steps(self, node: PlanNode, rows: float, concurrent: float) -> float:
        """Decode tokens (steps, the prefill's included) of one engine call of ``rows`` rows with
        ``concurrent`` slots: ``G = max(b − c, 0) · μ / c + longest(c)`` (module docstring)."""
        if node.gen_len <= 0:
            return 0.0
        c = min(concurrent, rows)
        return max(rows - c, 0.0) * node.response_mean / c + self._longest(node, c)

    def _generate_vllm(self, node: PlanNode, shape: ModelShape, placement: NodePlacement) -> NodeCost:
        """A generate node on vLLM engines (module docstring, "Generation with the vLLM engine" and
        "KV-cache budget")."""
        c, lay, ov = self.cluster, placement.layout, self.cluster.overheads
        e = c.engine_rates()
        d, t = lay.dp, lay.tp
        slow = c.mesh_slowdown(placement.devices)
        tp_group = placement.devices[:t]
        b = node.rows / d  # each replica's engine generates its rows in one call
        P = node.prompt_len
        memory, _pool, concurrent = self.engine_kv(node, shape, d, t)
        # continuous batching: c rows run at once, a finished row's slot takes the next waiting row; the
        # engine steps until the last row ends
        longest = self._engine_steps(node, b, concurrent)
        steps = max(longest - 1, 0)
        weights = self._engine_weights(shape, t)  # per device: the replica's shard
        roofline = forward_flops(shape, b, P) / (t * c.device.peak_flops * c.efficiency.matmul_at(b * P))
        prefill = slow * e.prefill_scale * roofline
        mean = node.response_mean
        live = b * mean / longest if longest > 0 else b  # rows in the batch on an average step
        ctx = P + mean / 2
        decode = slow * steps * self._decode_step(shape, live, ctx, t, weights)
        # tensor parallel: the forward's all-reduces (and the head's gather), on the prompts, then per step
        tp_comm = 0.0
        if t > 1:
            tp_comm = self._tp_forward(shape, shape.num_hidden_layers, b, P, tp_group, slow, logits=1)
            tp_comm += steps * self._tp_forward(shape, shape.num_hidden_layers, live, 1, tp_group, slow)
        fixed = e.prefill_call_s + steps * (e.decode_step_s + e.decode_row_s * min(b, concurrent))
        sleeps = node.sleep_mode and c.device_type == "cuda"
        if sleeps:  # sleep level 1 after each call: the weight shard to host memory and back over PCIe
            fixed += node.segments * 2 * weights / c.host_spec().pcie_bandwidth
        overhead = slow * (ov.node_s + fixed) + (d * t - 1) * ov.rank_skew_s
        sync = 0.0
        trained = self.problem.train_node(node.model) is not None
        if trained:  # new weights every iteration: the full tensors, gathered over tp first
            model_bytes = shape.num_params * shape.dtype_bytes
            sync = slow * (model_bytes / e.load_bandwidth + e.verify_s)
            if t > 1:
                per_layer, ends = self._tensors(shape)
                tensors = shape.num_hidden_layers * per_layer + ends
                sync += self._collectives("all_gather", tensors, model_bytes / t, tp_group, slow)
        # the engine's own weights and KV cache (the loop's KV is unused), beside the node's model instance
        # (its shard at tp > 1): transient when a sync rewrites it (freed once the engine loaded it; a
        # streamed sync holds one unit of it at a time), else resident
        resident, replica = (0.0, self._replica_peak(node, shape, t)) if trained else (weights, 0.0)
        mem = MemoryBreakdown(
            resident, 0.0, 0.0, 0.0, 0.0, engine_weights=weights, engine_kv_cache=memory, replica=replica,
            engine_sleeps=sleeps,
        )  # fmt: skip
        return NodeCost(
            compute_s=prefill, tp_comm_s=tp_comm, dp_comm_s=0.0, pp_comm_s=0.0, bubble_s=0.0, optimizer_s=0.0,
            decode_s=decode, overhead_s=overhead, memory=mem, dispatch_s=self.dispatch_time(node, placement),
            engine_sync_s=sync,
        )  # fmt: skip

    # ---- weight sync -------------------------------------------------------------------------------
    def sync_targets(self, train: str, plan: Mapping[str, NodePlacement]) -> list[tuple[NodePlacement, bool]]:
        """The instances that receive ``train``'s new weights: (placement, FSDP2-sharded) of every other
        node of its model whose (devices, dp, tp, pp, sharding) differ from the train node's, once each
        (``runtime.distributed.placement.PlanView``'s instances)."""
        spec = self.problem.node(train)

        def instance(name: str) -> tuple[tuple[int, ...], int, int, int, bool]:
            lay = plan[name].layout
            return plan[name].devices, lay.dp, lay.tp, lay.pp, self._sharded(name, lay)

        own = instance(train)
        out: dict[tuple[tuple[int, ...], int, int, int, bool], tuple[NodePlacement, bool]] = {}
        for other in self.problem.model_nodes.get(spec.model, ()):
            key = instance(other)
            if other != train and key != own and key not in out:
                out[key] = (plan[other], key[4])
        return list(out.values())

    def _sharded(self, name: str, layout: Layout) -> bool:
        """Whether node ``name`` holds its weights sharded over dp under ``layout``: a train node with
        dp > 1 on FSDP2 or ZeRO-3 (ZeRO-1/2 keep whole weights on every rank)."""
        node = self.problem.node(name)
        return node.kind == "train" and layout.dp > 1 and (node.zero is None or node.zero.stage == 3)

    def sync_time(self, train: str, plan: Mapping[str, NodePlacement]) -> float:
        """Seconds of the weight sync after train node ``train`` under ``plan`` (0 without targets); the
        runtime's ``timing_s/<node>`` of a train node includes it (``simulator.node_spans``)."""
        targets = self.sync_targets(train, plan)
        if not targets:
            return 0.0
        src = plan[train]
        key = (train, ((src, False), *targets))
        if key in self._sync_cache:
            return self._sync_cache[key]
        spec = self.problem.node(train)
        shape = self.problem.models[spec.model]
        ov, lay = self.cluster.overheads, src.layout
        per_layer, ends = self._tensors(shape)
        tensors = shape.num_hidden_layers * per_layer + ends
        model_bytes = shape.num_params * shape.dtype_bytes
        seconds = 0.0
        if self._sharded(train, lay) and not all(fsdp for _, fsdp in targets):
            # the plan path from an FSDP2 source re-gathers each tensor over dp first, keeping its tp shard
            dp_group = src.devices[: lay.tp * lay.dp : lay.tp]
            seconds += self._collectives("all_gather", tensors, model_bytes / lay.tp, dp_group)
        for dst, fsdp in targets:
            union = tuple(sorted(set(src.devices) | set(dst.devices)))
            if fsdp:  # gather path: full tensors on the source mesh, one broadcast to the target mesh
                seconds += self._collectives("all_gather", tensors, model_bytes, src.devices)
                group = (src.devices[0], *(x for x in dst.devices if x != src.devices[0]))
                seconds += self._collectives("broadcast", 1, model_bytes, group)
            else:
                seconds += self.realloc_time(spec.model, src, dst)
            shard = self._stage_params(shape, dst.layout) * shape.dtype_bytes
            seconds += self._collectives("all_gather", 2, 2 * 64 * len(union), union)  # verification
            seconds += self.cluster.mesh_slowdown(union) * 2 * shard / ov.digest_bandwidth
        self._sync_cache[key] = seconds
        return seconds

    # ---- reallocation ------------------------------------------------------------------------------
    def realloc_time(self, model: str, src: NodePlacement, dst: NodePlacement) -> float:
        """Seconds to move ``model``'s weights from ``src`` to ``dst`` (0 for identical shards).

        Prices ``plan_reallocation`` per device: its transfers packed into broadcast messages as the runtime
        packs them (one collective per message in the group ``{src} ∪ dsts``), local copies at memory
        bandwidth; the busiest device sets the time. Layers with the same (source stage, target stage) move
        identically, so one representative layer per such class is planned and its bytes multiplied by the
        class size.
        """
        if src.devices == dst.devices and (src.layout.dp, src.layout.tp, src.layout.pp) == (
            dst.layout.dp,
            dst.layout.tp,
            dst.layout.pp,
        ):
            return 0.0
        # Shifting both meshes by whole hosts changes no link class: cache on host-normalised meshes.
        shift = min(min(src.devices), min(dst.devices)) // self.cluster.devices_per_host
        shift *= self.cluster.devices_per_host
        if shift:
            src = NodePlacement.on_mesh(tuple(d - shift for d in src.devices), src.layout)
            dst = NodePlacement.on_mesh(tuple(d - shift for d in dst.devices), dst.layout)
        key = (model, src, dst)
        if key in self._realloc_cache:
            return self._realloc_cache[key]
        shape = self.problem.models[model]
        c = self.cluster
        L = shape.num_hidden_layers
        src_stage = {layer: s for s, r in enumerate(stage_layers(L, src.layout.pp)) for layer in r}
        dst_stage = {layer: s for s, r in enumerate(stage_layers(L, dst.layout.pp)) for layer in r}
        classes: dict[tuple[int, int], list[int]] = defaultdict(list)
        for layer in range(L):
            classes[(src_stage[layer], dst_stage[layer])].append(layer)
        weight_of = {cls[0]: len(cls) for cls in classes.values()}
        params = (model, src.layout.pp, dst.layout.pp)  # the classes follow from the two stage splits
        if params not in self._realloc_params:
            shapes: dict[str, tuple[int, ...]] = {}
            scale: dict[str, int] = {}
            for name, shp in shape.param_shapes().items():
                if ".layers." in name:
                    layer = int(name.split(".layers.")[1].split(".")[0])
                    if layer not in weight_of:
                        continue
                    scale[name] = weight_of[layer]
                else:
                    scale[name] = 1
                shapes[name] = shp
            self._realloc_params[params] = (shapes, scale)
        shapes, scale = self._realloc_params[params]
        moves = region_moves(
            shapes,
            ModelMeta(L, shape.tied),
            src.devices,
            src.layout,
            dst.devices,
            dst.layout,
            shape.dtype_bytes,
        )
        busy: dict[int, float] = defaultdict(float)
        # (src, dsts) -> [messages, bytes]: transfers >= DEFAULT_DIRECT_BYTES go alone, smaller ones are
        # packed into buckets of DEFAULT_BUCKET_BYTES (realloc.execute.schedule_messages); one broadcast each.
        direct: dict[tuple[int, ...], list[float]] = defaultdict(lambda: [0.0, 0.0])
        packed: dict[tuple[int, ...], float] = defaultdict(float)
        # plan_reallocation's transfers region by region: a local copy per device in ``local``, one
        # broadcast from ``sender`` to ``remote``
        for param, _region, size, local, sender, remote in moves:
            nbytes = size * scale[param]
            copy = 2 * nbytes / (c.device.memory_bandwidth * c.efficiency.memory)
            for d in local:
                busy[d] += copy
            if not remote:
                continue
            if size >= DEFAULT_DIRECT_BYTES:
                direct[(sender, *remote)][0] += scale[param]
                direct[(sender, *remote)][1] += nbytes
            else:
                packed[(sender, *remote)] += nbytes
        for group in sorted(set(direct) | set(packed)):
            messages = direct[group][0] + math.ceil(packed[group] / DEFAULT_BUCKET_BYTES)
            seconds = self._collectives("broadcast", messages, direct[group][1] + packed[group], group)
            for dev in group:
                busy[dev] += seconds
        result = max(busy.values(), default=0.0)
        self._realloc_cache[key] = result
        return result

    # ---- edges -------------------------------------------------------------------------------------
    def edge_time(self, nbytes: float, src: NodePlacement | None, dst: NodePlacement) -> float:
        """Seconds to move an edge's ``nbytes`` from the producer's mesh to the consumer's (0 if same mesh;
        the dataset (``src=None``) feeds every mesh for free). Rows are spread over the consumer's
        devices, so the slower of the two meshes' aggregate link bandwidth bounds the time."""
        if src is None or set(src.devices) == set(dst.devices) or nbytes <= 0:
            return 0.0
        link = self.cluster.link(tuple(src.devices) + tuple(dst.devices))
        lanes = min(len(src.devices), len(dst.devices))
        return nbytes / (lanes * link.bandwidth * self.cluster.efficiency.link) + link.latency
