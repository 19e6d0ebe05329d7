"""Memory per device of a node: what the cost model counts (:class:`MemoryBreakdown`) and the formulas that
size a stage's weights and a micro-batch's activations.

Notation and units: ``cost.py``.

Memory per device (bytes):
  * weights ``2``/param (bf16) of the largest stage's shard; train adds grads (2) and Adam state (12:
    fp32 master, m, v), sharded over dp (FSDP) plus two gathered layers (the current one and the one
    prefetched); with ``reshard: false`` instead of the two layers the stage's full weights and full
    (unsharded) gradients, ``Ψₛ · (w + 2)``, held through the step (``MemoryBreakdown.gathered``,
    transient: freed by the reshard after the step's last backward), the Adam state still ``/d`` (ZeRO-1's
    split, Rajbhandari et al. 2020, §5.1: ``(2 + 2 + 12/d)·Ψ`` for bf16 weights and gradients);
  * activations of a train micro-batch: ``S·b·(10·H + 8·I/t + 8·Q/t + 5·a·S/t)`` per layer (Korthikanti
    et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2, tensor
    parallel, no recomputation: ``S·b·H·(10 + 24/t + 5·a·S/(H·t))`` with the q/k/v/attention-output
    terms, ``8·S·b·H/t``, at the attention width ``Q``, and its GeLU MLP's ``16·S·b·H/t`` — the 4H-wide
    GeLU input and output — replaced by what a SwiGLU MLP of width ``I`` keeps, four 16-bit ``I``-wide
    tensors per token: the gate projection's output (SiLU's input), SiLU's output, the up projection's
    output and their product, the down projection's input; checked against what autograd saves in
    ``tests/test_planner_moe.py``), ``L/p`` layers, plus fp32 logits and their
    gradient ``2 · 4 · b·S·V/t``, for ``min(m, p)`` micro-batches of ``b`` rows (one at pp = 1): under
    1F1B stage ``s`` holds at most ``min(m, p − s)`` micro-batches' activations (its ``p − 1 − s`` warm-up
    forwards plus one; Narayanan et al. 2021, §2.2.1), so the first stage, which also has the most layers
    (``⌈L/p⌉``), is the largest (stages before the last hold placeholder logits of the same shape; GPipe
    would hold all ``m``); on a GPU cluster without the ``5·a·S/t`` scores term
    (FlashAttention-style SDPA kernels keep O(S) per head); with ``PlanNode.recompute`` (full
    recomputation, Korthikanti et al. §4) ``2·S·b·H`` per layer plus one layer's activations, and the
    train step runs one more forward per micro-batch (compute, calls, tensor-parallel collectives);
  * a mixture-of-experts model (``ModelShape.moe_layers``): its weights, gradients and Adam state count
    every expert (all parameters, the largest pipeline stage's layers summed: ``stage_params``), while its
    FLOPs count the active ones (``call_cost.py``); on train and inference nodes and in the built-in
    generation loop the routed experts are held as the runtime holds them, whole over tp and, at ep > 1,
    ``E/ep`` of them per device outside FSDP2 (``expert_cost.expert_split``);
  * a sparse layer's activations (:func:`sparse_mlp_bytes`): the dense formula's MLP intermediates,
    ``8·S·b·I/t`` (the SwiGLU MLP's four ``I``-wide tensors), are replaced by what the MoE block
    keeps for its backward, per token: the router's fp32 probabilities ``4·E`` and int64 top-k ids ``8·K``
    (``4·K + 4`` more where the top-k weights are renormalised, Mixtral and ``norm_topk_prob``; DeepSeek-V3's
    group-limited sigmoid router over ``G`` groups choosing ``G_k``, ``5·E + 16·G + 8·G_k + 12·K + 4``, and in
    a 16-bit model an fp32 copy of the hidden state, ``4·H``: ``ModelShape.router``); per routed copy (``K``
    per token, each at the expert width ``I_e``) the token's gathered hidden state ``H``, its gate/up output
    ``2·I_e``, the activation and the gated product ``I_e`` each, the expert's output ``H`` (kept for the
    routing-weight product), all ``w`` bytes, its routing weight (``w`` bytes; fp32, 4, from Mixtral's and
    DeepSeek-V3's routers) and three int64 indices (token, slot, sort order): ``K·(w·(2H + 4·I_e + 1) + 24)``
    at ``w`` bytes per weight; a shared expert once, ``4·I_s·w/t`` (split over tp as a dense MLP), with
    Qwen2-MoE's sigmoid gate ``w·(H + 1)``. The routed terms are not divided by tp (the experts are whole on
    every tp rank, each running all its tokens' copies) and, under uniform routing, each ep rank receives as
    many copies as it sends, so they hold at any ep; at ep > 1 one layer's dispatch adds its in-flight send
    and receive buffers, ``2·n·K·H·w`` for the ``n`` tokens of a micro-batch, once. Derived from transformers
    5.19's default experts forward (``integrations/moe.py``, ``grouped_mm_experts_forward``) and checked
    tensor by tensor against the tensors autograd saves (``tests/test_planner_moe.py``); the dense terms
    (layer norms, attention, the MLP's input) are Korthikanti et al.'s as above;
  * DeepSpeed ZeRO train nodes (``PlanNode.zero``): memory, collectives and CPU offload of ``zero_cost.py``;
  * a LoRA model (``ModelShape.lora``, ``adapters.py``): its weights are the base's plus the adapters'
    (``ModelShape.stored_params``); gradients and Adam state only for the trained ones
    (``ModelShape.trainable_params``: adapters and a trained value/score head; the frozen base gets
    neither), a stage's share in proportion to its weights (``ModelShape.trainable_share``); activations
    as a full model's (the backward still flows through the base); a base view (``ModelShape.base_of``)
    placed with its LoRA model holds no weights of its own (``resources.node_memory``), elsewhere a
    full frozen copy;
  * latent attention (DeepSeek-V3, ``shapes.py``): the q/k/v/output terms at its attention width
    (``ModelShape.attention_width``), plus the latents it keeps for the backward,
    ``2 · ModelShape.latent_activation_width`` bytes per token per layer, not split over tp; its latent
    down-projections replicated over tp (``ModelShape.tp_replicated_layer_params``, in ``stage_params``);
  * inference: one layer's activations plus fp32 logits; generation: KV cache
    ``L · kv_width · S · b · w`` (``ModelShape.kv_cache_width``: ``2 · kv_dim / t``, ``kv_dim`` = key/value
    heads · head_dim; latent attention's ``kv_lora + rope``, whole per device) plus logits of the last
    position;
  * an ``engine: vllm`` generate node: its engine's weights and KV cache, and its own model instance as a
    transient replica (``vllm_cost.py``, "Memory per device").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.schedulers.realloc.shards import stage_layers

if TYPE_CHECKING:
    from rlflow.schedulers.planner.plans import Layout
    from rlflow.schedulers.planner.problem import PlanNode
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = [
    "GRAD_BYTES",
    "LOGIT_BYTES",
    "OPTIM_BYTES",
    "MemoryBreakdown",
    "activation_bytes",
    "dense_mlp_bytes",
    "dispatch_buffer_bytes",
    "sparse_mlp_bytes",
    "stage_params",
    "train_activations",
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
    until its engines have loaded the weights (the runtime frees it in between; ``vllm_cost.py``,
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
        """Bytes of the node alone on a device: state + transient + its resident engine."""
        return self.state + self.transient + self.resident_engine


def stage_params(shape: ModelShape, layout: Layout) -> float:
    """Parameters on the most loaded device: the largest pipeline stage's layers (the runtime's contiguous
    split, ``realloc.shards.stage_layers``; every expert of a sparse layer: memory holds all parameters,
    ``ModelShape.layer_sizes``) plus the embedding, final norm and (untied, at pp = 1 on the same stage)
    head, over ``tp`` but for latent attention's down-projections, whole on every tp rank
    (``ModelShape.tp_replicated_layer_params``); with ``lora`` the adapters too, in proportion to the
    weights (``ModelShape.stored_params``)."""
    if layout.pp == 1:
        layers, count = shape.decoder_params, shape.num_hidden_layers
    else:
        pp = min(layout.pp, shape.num_hidden_layers)  # more stages than layers: refused by the layout rule
        stage = max(stage_layers(shape.num_hidden_layers, pp), key=shape.stage_sizes)
        layers, count = shape.stage_sizes(stage), len(stage)
    vocab_mats = 2 if (layout.pp == 1 and shape.head == "lm" and not shape.tied) else 1
    ends = vocab_mats * shape.vocab_size * shape.hidden_size + shape.hidden_size
    whole = count * shape.tp_replicated_layer_params  # on every tp rank
    return ((layers + ends - whole) / layout.tp + whole) * (shape.stored_params / shape.num_params)


INDEX_BYTES = 8  # int64 top-k ids and the routed copies' indices
# routers that hand the experts fp32 routing weights (the others cast them to the model's dtype)
_FP32_ROUTING_WEIGHTS = ("mixtral", "deepseek_v3")
# bytes per token a router keeps for the backward (``ModelShape.router``; module docstring), from E, K and
# the router's (groups G, groups chosen)
_ROUTER_BYTES = {
    "softmax": lambda e, k, g: 4 * e + INDEX_BYTES * k,  # fp32 probabilities, int64 top-k ids
    "softmax_norm": lambda e, k, g: 4 * e + INDEX_BYTES * k + 4 * k + 4,  # + fp32 weights and their sum
    # fp32 sigmoid scores, the [E] bool mask of the chosen groups, the int64 ids of each group's top 2 and
    # of the chosen groups, the int64 top-k ids, fp32 weights and their sum
    "sigmoid_group": lambda e, k, g: 5 * e + INDEX_BYTES * (2 * g[0] + g[1] + k) + 4 * k + 4,
}


def sparse_mlp_bytes(shape: ModelShape, tokens: float, t: int) -> float:
    """Bytes a sparse layer's mixture-of-experts block keeps for its backward over ``tokens`` tokens on one of
    ``t`` tensor-parallel devices (module docstring): ``tokens · (4·E + 8·K + K·(w·(2H + 4·I_e + 1) + 24) +
    4·I_s·w/t [+ w·(H + 1)])`` (the router's term by ``ModelShape.router``; an fp32 routing weight, 4 bytes,
    in place of ``w`` per copy for Mixtral and DeepSeek-V3), ``w`` the model's bytes per element; 0 for a
    dense model."""
    if not shape.is_moe:
        return 0.0
    w, h, k = shape.dtype_bytes, shape.hidden_size, shape.experts_per_token
    router = _ROUTER_BYTES[shape.router](shape.num_experts, k, shape.router_groups)
    if shape.router == "sigmoid_group" and w != 4:  # it multiplies an fp32 copy of the hidden state
        router += 4 * h
    weight = 4 if shape.model_type in _FP32_ROUTING_WEIGHTS else w  # a copy's routing weight
    routed = k * (w * (2 * h + 4 * shape.moe_intermediate_size) + weight + 3 * INDEX_BYTES)
    shared = 4 * shape.shared_expert_intermediate_size * w / t
    gate = w * (h + 1) if shape.shared_expert_gate else 0.0
    return tokens * (router + routed + shared + gate)


def dense_mlp_bytes(shape: ModelShape, tokens: float, t: int) -> float:
    """Bytes a dense SwiGLU MLP of width ``I`` (``shape.intermediate_size``) keeps for its backward over
    ``tokens`` tokens on one of ``t`` tensor-parallel devices, its input aside (the dense formula's ``10·H``
    counts it): ``8·tokens·I/t``, four 16-bit ``I``-wide tensors per token — the gate projection's output
    (SiLU's input), SiLU's output, the up projection's output, and their product (the down projection's
    input); transformers' ``LlamaMLP``/``Qwen3MLP`` forward ``down(act(gate(x)) · up(x))``. It replaces
    Korthikanti et al. 2022's ``16·H/t`` (a 4H-wide GeLU MLP's input and output), which undercounts a
    SwiGLU of ``I ≈ 2.7·H`` by ~1.75×."""
    return tokens * 8 * shape.intermediate_size / t


def _layer_bytes(
    shape: ModelShape, tokens: float, seq: float, t: int, device_type: str, sparse: bool
) -> float:
    """One decoder layer's activations (:func:`activation_bytes`) over ``tokens`` tokens in rows of ``seq``,
    a sparse layer's MoE block in place of the dense MLP's intermediates."""
    h, q, a = shape.hidden_size, shape.attention_width, shape.num_attention_heads
    scores = 0.0 if device_type == "cuda" else 5 * a * seq / t
    mlp = 0.0 if sparse else dense_mlp_bytes(shape, 1, t)
    dense = tokens * (h * 10 + mlp + 8 * q / t + scores + 2 * shape.latent_activation_width)
    return dense + (sparse_mlp_bytes(shape, tokens, t) if sparse else 0.0)


def dispatch_buffer_bytes(shape: ModelShape, tokens: float, ep: int) -> float:
    """Bytes of one sparse layer's token dispatch in flight at ep > 1 (send and receive buffers of the
    ``tokens · K`` routed copies' hidden states, ``2·tokens·K·H·w``); 0 at ep 1 or for a dense model."""
    if ep == 1 or not shape.is_moe:
        return 0.0
    return 2 * tokens * shape.experts_per_token * shape.hidden_size * shape.dtype_bytes


def activation_bytes(
    shape: ModelShape, rows: float, seq: float, t: int, device_type: str, ep: int = 1
) -> float:
    """Bytes of one decoder layer's activations for ``rows × seq`` tokens on one of ``t`` tensor-parallel
    devices (the largest layer: a sparse one in a mixture of experts, :func:`sparse_mlp_bytes`, plus its
    dispatch buffers at ``ep`` > 1, :func:`dispatch_buffer_bytes`): Korthikanti et al. 2022, Table 2
    (tensor parallel, no sequence parallel), the q/k/v and
    attention-output terms at the attention width (``ModelShape.attention_width``; latent attention adds its
    latents, ``ModelShape.latent_activation_width`` 16-bit values per token, whole per device). On
    ``device_type`` ``cuda`` the
    ``5·a·S/t`` term (scores, softmax, its dropout mask: ``S × S`` per head) is left out: torch's
    scaled-dot-product attention, which Hugging Face models use, runs a FlashAttention / memory-efficient
    kernel there that keeps O(S) per head (Dao et al. 2022, "FlashAttention", §3.1)."""
    tokens = seq * rows
    layer = _layer_bytes(shape, tokens, seq, t, device_type, shape.is_moe)
    return layer + dispatch_buffer_bytes(shape, tokens, ep)


def train_activations(
    node: PlanNode,
    shape: ModelShape,
    b: float,
    t: int,
    layers: int,
    in_flight: int,
    seq: float,
    device_type: str,
    ep: int = 1,
) -> float:
    """Bytes of a train node's activations on one device: ``in_flight`` micro-batches of ``b`` rows of
    ``seq`` tokens through ``layers`` layers, the first stage's (:func:`activation_bytes` on
    ``device_type``: its sparse layers, those among the first ``layers`` of a mixture of experts, with their
    MoE blocks), plus fp32 logits and their gradient, and at ``ep`` > 1 one layer's dispatch buffers. With
    ``node.recompute`` (full activation recomputation, Korthikanti et al. 2022 §4: "2sbh" per layer) each
    layer keeps only its 16-bit input, ``2·S·b·H``, and one layer's activations (the largest) are rebuilt
    at a time in the backward pass."""
    tokens = b * seq
    full = activation_bytes(shape, b, seq, t, device_type, ep)
    if node.recompute:
        acts = in_flight * layers * 2 * tokens * shape.hidden_size + full
    else:
        sparse = sum(1 for i in shape.moe_layers if i < layers)
        stage = (layers - sparse) * _layer_bytes(shape, tokens, seq, t, device_type, False)
        stage += sparse * _layer_bytes(shape, tokens, seq, t, device_type, True)
        acts = in_flight * stage + dispatch_buffer_bytes(shape, tokens, ep)
    return acts + in_flight * 2 * LOGIT_BYTES * b * seq * (shape.vocab_size if shape.head == "lm" else 1) / t
