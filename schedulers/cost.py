"""Cost model: seconds and bytes of a node under a (mesh, layout), of a reallocation, and of an edge.

Units: time in seconds, memory and traffic in bytes, rates in FLOP/s and bytes/s — everywhere.

Notation: ``B`` rows (sequences) per iteration, ``P``/``G`` prompt/generated tokens, ``S = P + G``,
``L`` layers, ``H`` hidden, ``V`` vocabulary, ``a`` attention heads, ``t/d/p`` tensor/data/pipeline
degrees, ``m`` micro-batches, ``b`` rows per micro-batch per data-parallel rank.

Time (sources):
  * FLOPs of a forward pass: ``2 · tokens · (L · layer_params + head_params) + 4 · B · S² · H · L``
    (matmul FLOPs are twice the multiply-adds; attention scores and the weighted sum each ``2·B·S²·H``
    per layer; Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", §5.1). Backward = 2 × forward, so training = 3 × forward.
  * Compute time = FLOPs / (devices · peak · efficiency(tokens per micro-batch)) (``cluster.Efficiency``).
  * Pipeline bubble (1F1B / GPipe): the (compute + tensor comm) time grows by ``(p − 1)/m``
    (Narayanan et al. 2021, §2.2).
  * Tensor-parallel comm (Megatron-LM, Shoeybi et al. 2019): 2 all-reduces of ``b·S·H`` activations
    per layer forward, 2 more backward; ring all-reduce time ``2(n−1)/n · bytes/bw + 2(n−1) · latency``.
  * Data-parallel comm (train, FSDP/ZeRO, Rajbhandari et al. 2020): per optimizer step a reduce-scatter
    of gradients and an all-gather of parameters, together one all-reduce of the stage's weight shard.
  * Optimizer step: Adam reads and writes weights, grads, fp32 master and moments
    (2 · (2 + 2 + 12) bytes per local parameter) at the device's memory bandwidth.
  * Generation (pp = 1): prefill = one forward over the prompts; then ``G`` decode steps, each
    ``max(FLOPs / compute rate, (weights + KV cache read) / memory bandwidth)`` plus two latency-bound
    tensor all-reduces per layer (the memory-bound decoding model of ReaL, Mei et al. 2024, §5);
    ``m`` micro-batches run as ``m`` sequential generation passes (less KV cache, weights re-read).

Memory per device (bytes):
  * weights ``2``/param (bf16) of the largest stage's shard; train adds grads (2) and Adam state (12:
    fp32 master, m, v), sharded over dp (FSDP) plus one gathered layer;
  * activations of a train micro-batch: ``S·b·H·(10 + 24/t + 5·a·S/(H·t))`` per layer (Korthikanti et
    al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2, tensor parallel,
    no recomputation), ``L/p`` layers for each of ``min(m, p)`` micro-batches in flight (1F1B), plus fp32
    logits and their gradient ``2 · 4 · b·S·V/t``;
  * inference: one layer's activations plus fp32 logits; generation: KV cache
    ``2 · L · kv_dim · S · b · 2 / t`` plus logits of the last position.

Reallocation time comes from ``realloc.plan_reallocation`` bytes per device and link class; an edge
costs ``bytes / link bandwidth + latency`` when producer and consumer meshes differ.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from dataflow.errors import PlanError
from schedulers.cluster import ClusterSpec
from schedulers.layout_shards import ModelMeta, stage_layers
from schedulers.plan import Layout, NodePlacement
from schedulers.problem import ModelShape, PlanNode, PlanProblem
from schedulers.realloc import plan_reallocation

__all__ = [
    "CostModel",
    "MemoryBreakdown",
    "NodeCost",
    "allreduce_time",
    "forward_flops",
    "layout_problem",
]

GRAD_BYTES = 2  # bf16 gradients
OPTIM_BYTES = 12  # fp32 master weights + Adam m + v
LOGIT_BYTES = 4  # fp32 logits


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device of one node: resident state and transient working memory."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float

    @property
    def state(self) -> float:
        """Bytes that live as long as the model copy (weights + grads + optimizer state)."""
        return self.weights + self.grads + self.optimizer

    @property
    def transient(self) -> float:
        """Bytes that live only while the node runs (activations + KV cache)."""
        return self.activations + self.kv_cache

    @property
    def peak(self) -> float:
        return self.state + self.transient


@dataclass(frozen=True)
class NodeCost:
    """Predicted seconds (by component) and memory of one node under one placement."""

    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    pp_comm_s: float
    bubble_s: float
    optimizer_s: float
    decode_s: float
    memory: MemoryBreakdown

    @property
    def time_s(self) -> float:
        return (
            self.compute_s + self.tp_comm_s + self.dp_comm_s + self.pp_comm_s + self.bubble_s
            + self.optimizer_s + self.decode_s
        )  # fmt: skip


def forward_flops(shape: ModelShape, rows: float, seq_len: float) -> float:
    """FLOPs of one forward pass over ``rows`` sequences of ``seq_len`` tokens (Narayanan et al. 2021)."""
    tokens = rows * seq_len
    matmul = 2.0 * tokens * (shape.num_hidden_layers * shape.layer_params + shape.head_params)
    attention = 4.0 * rows * seq_len * seq_len * shape.hidden_size * shape.num_hidden_layers
    return matmul + attention


def allreduce_time(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` among ``n`` devices: ``2(n−1)/n · bytes/bw + 2(n−1) · latency`` s."""
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / bandwidth + 2.0 * (n - 1) * latency


def layout_problem(shape: ModelShape, node: PlanNode, layout: Layout) -> str | None:
    """Why ``layout`` cannot run ``node`` on ``shape`` (None when it can).

    Checks: heads, kv-heads, intermediate size and vocabulary divisible by tp; layers >= pp; generation
    without pipeline stages; rows divisible by dp × mini-batches × micro-batches.
    """
    t = layout.tp
    for what, n in (
        ("num_attention_heads", shape.num_attention_heads),
        ("num_key_value_heads", shape.num_key_value_heads),
        ("intermediate_size", shape.intermediate_size),
        ("vocab_size", shape.vocab_size),
    ):
        if n % t:
            return f"{what}={n} is not divisible by tp={t}"
    if shape.num_hidden_layers < layout.pp:
        return f"{shape.num_hidden_layers} layers < pp={layout.pp}"
    if node.kind == "generate" and layout.pp > 1:
        return "generation does not use pipeline stages (pp must be 1)"
    groups = node.mini_batches if node.kind == "train" else 1
    if node.rows % (layout.dp * groups * layout.micro_batches):
        return (
            f"rows={node.rows} not divisible by dp={layout.dp} × mini_batches={groups} × "
            f"micro_batches={layout.micro_batches}"
        )
    return None


class CostModel:
    """Prices nodes, reallocations and edges of one problem on one cluster (caches every result)."""

    def __init__(self, problem: PlanProblem, cluster: ClusterSpec) -> None:
        self.problem = problem
        self.cluster = cluster
        self._node_cache: dict[tuple[str, int, bool, Layout], NodeCost] = {}
        self._realloc_cache: dict[tuple[str, NodePlacement, NodePlacement], float] = {}

    # ---- nodes -------------------------------------------------------------------------------------
    def node_cost(self, node: str | PlanNode, placement: NodePlacement) -> NodeCost:
        """Seconds and bytes of ``node`` under ``placement``.

        Raises:
            PlanError: the layout does not fit the model or the rows (message names the node).
        """
        spec = self.problem.node(node) if isinstance(node, str) else node
        devices = placement.devices
        multi_host = len({self.cluster.host_of(d) for d in devices}) > 1
        key = (spec.name, len(devices), multi_host, placement.layout)
        cached = self._node_cache.get(key)
        if cached is None:
            shape = self.problem.models[spec.model]
            why = layout_problem(shape, spec, placement.layout)
            if why is not None:
                raise PlanError(f"node {spec.name!r}: layout {placement.layout} does not fit: {why}")
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
        """Korthikanti et al. 2022, Table 2 (tensor parallel, no sequence parallel): bytes per layer."""
        h, a = shape.hidden_size, shape.num_attention_heads
        return seq * rows * h * (10 + 24 / t + 5 * a * seq / (h * t))

    def _compute(self, node: PlanNode, shape: ModelShape, placement: NodePlacement) -> NodeCost:
        c, lay = self.cluster, placement.layout
        eff = c.efficiency
        d, t, p, m = lay.dp, lay.tp, lay.pp, lay.micro_batches
        n_dev = d * t * p
        dtype = shape.dtype_bytes
        devs = placement.devices
        tp_link = c.link(devs[:t])
        dp_link = c.link(devs[: t * d : t])
        pp_link = c.link(devs[:: t * d])
        link_eff = eff.link
        L, H, V = shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
        stage_params = self._stage_params(shape, lay)
        weights = stage_params * dtype
        layers_per_stage = math.ceil(L / p)

        if node.kind == "generate":
            return self._generate(node, shape, lay, devs)

        steps = node.epochs * node.mini_batches if node.kind == "train" else 1
        passes = 3.0 if node.kind == "train" else 1.0  # fwd + bwd (2×fwd)
        epochs = node.epochs if node.kind == "train" else 1
        seq = node.seq_len
        rows_step = node.rows / (node.mini_batches if node.kind == "train" else 1)
        b = rows_step / (d * m)  # rows per micro-batch per dp rank
        tokens_mb = b * seq
        rate = c.device.peak_flops * eff.matmul_at(tokens_mb)
        compute = passes * epochs * forward_flops(shape, node.rows, seq) / (n_dev * rate)
        # Megatron tensor comm: 2 all-reduces per layer forward (+2 backward) of b·S·H activations.
        n_ar = (4 if node.kind == "train" else 2) * layers_per_stage
        tp_comm = (
            epochs
            * node.mini_batches ** (1 if node.kind == "train" else 0)
            * m
            * n_ar
            * allreduce_time(tokens_mb * H * dtype, t, tp_link.bandwidth * link_eff, tp_link.latency)
        )
        # Pipeline p2p of one micro-batch's activations per boundary (forward, and backward for train).
        pp_comm = 0.0
        if p > 1:
            msgs = steps * m * (2 if node.kind == "train" else 1)
            pp_comm = msgs * (tokens_mb * H * dtype / t / (pp_link.bandwidth * link_eff) + pp_link.latency)
        bubble = (compute + tp_comm) * (p - 1) / m
        dp_comm = 0.0
        optimizer = 0.0
        grads = optim = 0.0
        if node.kind == "train":
            dp_comm = steps * allreduce_time(weights, d, dp_link.bandwidth * link_eff, dp_link.latency)
            optimizer = (
                steps
                * 2
                * stage_params
                / d
                * (dtype + GRAD_BYTES + OPTIM_BYTES)
                / (c.device.memory_bandwidth * eff.memory)
            )
            grads = stage_params * GRAD_BYTES / d
            optim = stage_params * OPTIM_BYTES / d
            layer_full = shape.layer_params / t * dtype
            state_weights = weights / d + 2 * layer_full  # FSDP shard + gathered current/prefetched layer
            in_flight = min(m, p)
            acts = layers_per_stage * in_flight * self._activation_bytes(shape, b, seq, t)
            acts += 2 * LOGIT_BYTES * b * seq * (V if shape.head == "lm" else 1) / t
            mem = MemoryBreakdown(state_weights, grads, optim, acts, 0.0)
        else:
            acts = self._activation_bytes(shape, b, seq, t)
            acts += LOGIT_BYTES * b * seq * (V if shape.head == "lm" else 1) / t
            mem = MemoryBreakdown(weights, 0.0, 0.0, acts, 0.0)
        return NodeCost(compute, tp_comm, dp_comm, pp_comm, bubble, optimizer, 0.0, mem)

    def _generate(self, node: PlanNode, shape: ModelShape, lay: Layout, devs: tuple[int, ...]) -> NodeCost:
        c, eff = self.cluster, self.cluster.efficiency
        d, t, m = lay.dp, lay.tp, lay.micro_batches
        dtype = shape.dtype_bytes
        tp_link = c.link(devs[:t])
        L, H, V = shape.num_hidden_layers, shape.hidden_size, shape.vocab_size
        b = node.rows / (d * m)
        weights = self._stage_params(shape, lay) * dtype
        # Prefill: one forward over the prompts of each micro-batch.
        rate = c.device.peak_flops * eff.matmul_at(b * node.prompt_len)
        prefill = forward_flops(shape, node.rows, node.prompt_len) / (d * t * rate)
        prefill_tp = (
            m
            * 2
            * L
            * allreduce_time(
                b * node.prompt_len * H * dtype, t, tp_link.bandwidth * eff.link, tp_link.latency
            )
        )
        # Decode: per step, memory-bound read of weights + KV cache at the mean context length.
        ctx = node.prompt_len + node.gen_len / 2
        kv_read = 2 * L * shape.kv_dim * ctx * b * dtype / t
        step_flops = (2 * b * (L * shape.layer_params + shape.head_params) + 4 * b * ctx * H * L) / t
        step_compute = step_flops / (c.device.peak_flops * eff.matmul_at(b))
        step_memory = (weights + kv_read) / (c.device.memory_bandwidth * eff.memory)
        step_tp = 2 * L * allreduce_time(b * H * dtype, t, tp_link.bandwidth * eff.link, tp_link.latency)
        decode = m * node.gen_len * (max(step_compute, step_memory) + step_tp)
        kv = 2 * L * shape.kv_dim * node.seq_len * b * dtype / t
        acts = self._activation_bytes(shape, b, node.prompt_len, t) + LOGIT_BYTES * b * V / t
        mem = MemoryBreakdown(weights, 0.0, 0.0, acts, kv)
        return NodeCost(prefill, prefill_tp, 0.0, 0.0, 0.0, 0.0, decode, mem)

    # ---- reallocation ------------------------------------------------------------------------------
    def realloc_time(self, model: str, src: NodePlacement, dst: NodePlacement) -> float:
        """Seconds to move ``model``'s weights from ``src`` to ``dst`` (0 for identical shards).

        Prices ``plan_reallocation`` per device: bytes sent and received over each link class divided by
        its bandwidth, local copies at memory bandwidth, plus one latency per transfer; the busiest device
        sets the time. Layers with the same (source stage, target stage) move identically, so one
        representative layer per such class is planned and its bytes multiplied by the class size.
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
            src = NodePlacement(tuple(d - shift for d in src.devices), src.layout)
            dst = NodePlacement(tuple(d - shift for d in dst.devices), dst.layout)
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
        full = shape.param_shapes()
        shapes: dict[str, tuple[int, ...]] = {}
        scale: dict[str, int] = {}
        for name, shp in full.items():
            if ".layers." in name:
                layer = int(name.split(".layers.")[1].split(".")[0])
                if layer not in weight_of:
                    continue
                scale[name] = weight_of[layer]
            else:
                scale[name] = 1
            shapes[name] = shp
        plan = plan_reallocation(
            shapes,
            ModelMeta(L, shape.tied),
            src.devices,
            src.layout,
            dst.devices,
            dst.layout,
            shape.dtype_bytes,
        )
        busy: dict[int, float] = defaultdict(float)
        count: dict[int, int] = defaultdict(int)
        link_eff = c.efficiency.link
        dph = c.devices_per_host
        for tr in plan.transfers:
            nbytes = tr.bytes * scale[tr.param]
            if tr.is_local:
                busy[tr.src] += 2 * nbytes / (c.device.memory_bandwidth * c.efficiency.memory)
                continue
            host = tr.src // dph
            link = c.intra_host if all(dv // dph == host for dv in tr.dsts) else c.inter_host
            seconds = nbytes / (link.bandwidth * link_eff)
            busy[tr.src] += seconds
            count[tr.src] += scale[tr.param]
            for dev in tr.dsts:
                busy[dev] += seconds
                count[dev] += scale[tr.param]
        latency = c.inter_host.latency if c.num_devices > c.devices_per_host else c.intra_host.latency
        result = max((busy[dv] + count[dv] * latency for dv in busy), default=0.0)
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
