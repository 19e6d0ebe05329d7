"""Model shapes: a decoder's Hugging Face config fields, its parameter names, shapes and counts (stored and
active per token), and the Llama presets of the ReaL paper's experiments.

Parameter names follow Hugging Face transformers 5.19 (``model.layers.{i}.self_attn.q_proj.weight``...;
a mixture-of-experts layer's router ``mlp.gate.weight`` ``[E, hidden]`` and its experts fused into two 3-D
tensors, ``mlp.experts.gate_up_proj`` ``[E, 2·I_e, hidden]`` and ``mlp.experts.down_proj``
``[E, hidden, I_e]``), so the same names index real modules in the runtime. Which architectures are priced,
and how their configs set the experts: ``architectures.py``.

Expected distinct experts (:func:`expected_distinct_experts`): a decode step's weight reads touch only the
experts its tokens are routed to. Under uniform routing each token picks ``K`` of the ``E`` experts,
every expert with probability ``K/E``, independently of the other tokens; an expert is then missed by all
``n`` tokens with probability ``(1 − K/E)^n`` and, by linearity of expectation, ``n`` tokens touch
``E · (1 − (1 − K/E)^n)`` distinct experts on average (the classical occupancy problem: Feller 1968,
"An Introduction to Probability Theory and Its Applications", vol. I, §IV.2, here with ``K`` draws without
replacement per token). A trained router routes unevenly (some experts hot), which touches fewer experts
than uniform: the formula is an upper bound on the reads under the same ``n``.

Multi-head latent attention (MLA: DeepSeek-V2, arXiv 2405.04434, §2.1; transformers 5.19's
``DeepseekV3Attention``), ``a`` heads: the query is ``q_b_proj(norm(q_a_proj(x)))`` (``[q_lora, H]`` then
``[a·(nope + rope), q_lora]``; a full ``q_proj`` without ``q_lora_rank``), the keys and values come from one
compressed latent ``kv_a_proj_with_mqa(x)`` (``[kv_lora + rope, H]``: the latent and a rope key shared by
the heads), normed and expanded by ``kv_b_proj`` (``[a·(nope + v), kv_lora]``), and ``o_proj`` is
``[H, a·v]``. Attention scores run over ``qk = nope + rope`` per head and the weighted sum over ``v``, so
the attention width ``Q`` of the FLOPs ``4·S²·Q`` and of the q/k/v/output activations is
``a·(qk + v)/2`` (:attr:`ModelShape.attention_width`). The KV cache keeps the compressed latent and the
rope key, ``kv_lora + rope`` values per token per layer (§2.1.2, "only ... needs to be cached"), not
per-head keys and values: transformers 5.19 updates its cache "while latent KV is still compressed", and
vLLM 0.32 sizes an MLA layer's cache as one head of ``kv_lora_rank + qk_rope_head_dim`` with no separate V
(``ModelArchConfigConvertor.get_head_size``, ``MLAAttentionSpec``), the same on every tensor-parallel
rank (``get_num_kv_heads`` returns 1). A decode step differs by engine (:meth:`ModelShape.decode_attention`):
transformers expands the whole cached latent through ``kv_b_proj`` at every step (``expand_kv``) and
attends over per-head keys and values it writes and reads; vLLM absorbs ``kv_b_proj`` into the query and
output (§2.1.3) and attends in the latent, ``kv_lora + rope`` wide for scores and ``kv_lora`` for values.
Tensor parallel splits the heads (``q_b_proj``, ``kv_b_proj``, ``o_proj``) but not the latent
down-projections and their norms, which vLLM replicates (``ReplicatedLinear``):
:attr:`ModelShape.tp_replicated_layer_params`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.layout_rules import attention_kinds
from rlflow.dataflow.model_spec import resolve_dtype
from rlflow.schedulers.planner.adapters import LoraShape, adapter_count
from rlflow.schedulers.planner.architectures import LatentAttention, read_architecture

__all__ = ["DTYPE_BYTES", "HEADS", "MODEL_PRESETS", "ModelShape", "expected_distinct_experts"]

HEADS = ("lm", "value", "score")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def expected_distinct_experts(num_experts: int, k: int, tokens: float) -> float:
    """Expected number of distinct experts (of ``num_experts``) that ``tokens`` tokens, each routed to
    ``k`` of them, touch in one MoE layer under uniform routing: ``E · (1 − (1 − K/E)^tokens)`` (module
    docstring: derivation and source). ``tokens`` may be fractional (an average batch); 0 for no tokens
    or no experts; ``k`` for one token; tends to ``E`` as tokens grow."""
    if num_experts <= 0 or tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder (HF config fields) plus its head and dtype: a Llama-style decoder, optionally
    with attention biases and QK norms, and with mixture-of-experts layers.

    ``head``: ``lm`` (vocabulary head, tied to the embedding when ``tie_word_embeddings``), ``value`` or
    ``score`` (a [1, hidden] head, ``score.weight``). ``dtype_bytes``: bytes per weight element.
    ``head_dim``: width of one attention head; 0 (the default) means ``hidden_size // num_attention_heads``
    and is replaced by that value. An explicit HF ``head_dim`` (Gemma, Qwen3, ...) need not equal it: q/o
    are then ``[heads·head_dim, hidden]`` / ``[hidden, heads·head_dim]``, as Hugging Face builds them.
    ``max_positions``: ``max_position_embeddings`` (tokens), the context a vLLM engine is sized for.
    ``layer_types``: the distinct attention types of its layers (``layout_rules.attention_kinds``; two or
    more keep generation off pipeline stages).

    Architecture fields (``architectures.Architecture``; defaults: a plain Llama): ``model_type``;
    ``biases``: the projections with a bias; ``qk_norm``: per-head q/k RMSNorms (``[head_dim]`` each);
    ``num_experts`` ``E`` routed experts of ``moe_intermediate_size`` ``I_e`` in the layers
    ``moe_layers`` (default: every layer when ``E > 0``), ``experts_per_token`` ``K`` of them per token;
    ``shared_expert_intermediate_size``: a shared expert every token runs (0: none), with a ``[1, hidden]``
    gate when ``shared_expert_gate``, named ``mlp.<shared_experts_name>``. The other layers have a dense
    SwiGLU MLP of ``intermediate_size``. ``mla``: multi-head latent attention's widths (module docstring;
    DeepSeek-V3) instead of q/k/v/o projections; ``mtp_layers``: DeepSeek-V3's multi-token-prediction
    layers, declared by the config but not built by transformers, so not priced (named by :meth:`describe`);
    ``router``, ``router_groups``: how the router picks (``architectures.Architecture``).

    LoRA (``adapters.py``): ``lora``, the model trains low-rank adapters on its frozen weights
    (:attr:`trainable_params`); ``base_of``, the model is that LoRA model's base with the adapters off (a
    reference without a copy where it is placed with it: ``resources.node_memory``).
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head: str = "lm"
    dtype_bytes: int = 2
    head_dim: int = 0
    max_positions: int = 2048
    layer_types: tuple[str, ...] = ()
    model_type: str = "llama"
    biases: tuple[str, ...] = ()
    qk_norm: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    moe_layers: tuple[int, ...] = ()
    shared_experts_name: str = "shared_expert"
    mla: LatentAttention | None = None
    mtp_layers: int = 0
    router: str = "softmax"
    router_groups: tuple[int, int] = (0, 0)
    lora: LoraShape | None = None
    base_of: str = ""

    def __post_init__(self) -> None:
        if self.num_attention_heads < 1 or self.head_dim < 0:
            raise PlanError("num_attention_heads must be >= 1 and head_dim >= 0")
        if not self.head_dim:
            # HF's default head width; only then must hidden divide into the heads
            if self.hidden_size % self.num_attention_heads:
                raise PlanError(
                    f"hidden_size {self.hidden_size} not divisible by {self.num_attention_heads} heads"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise PlanError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head not in HEADS:
            raise PlanError(f"model head {self.head!r} is not one of {HEADS}")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts or self.moe_intermediate_size < 1:
                raise PlanError(
                    f"{self.num_experts} experts need 1 <= experts_per_token ({self.experts_per_token}) "
                    f"<= num_experts and moe_intermediate_size >= 1 ({self.moe_intermediate_size})"
                )
            if not self.moe_layers:
                object.__setattr__(self, "moe_layers", tuple(range(self.num_hidden_layers)))
        elif self.moe_layers:
            raise PlanError(f"moe_layers {self.moe_layers} without experts (num_experts 0)")

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], head: str = "lm", dtype: str | None = None, device_type: str = "cpu"
    ) -> ModelShape:
        """Build from an HF config dict, with its ``model_type``'s defaults as transformers fills them in
        (``architectures.read_architecture``; no ``model_type``: a Llama-style decoder); missing
        ``num_key_value_heads`` means multi-head attention, a missing (or null) ``head_dim`` means
        ``hidden_size // num_attention_heads``. ``dtype`` (a graph model's ``dtype``; else the config's
        ``torch_dtype``, else bfloat16) sets ``dtype_bytes``; ``auto`` is what the runtime builds on
        ``device_type`` (``rlflow.dataflow.model_spec.resolve_dtype``: 2 bytes on ``cuda``, 4 on ``cpu``).

        Raises:
            PlanError: ``config.<key>: ...`` for an architecture the planner does not price
                (``architectures.read_architecture``), or a required field is missing.
        """
        fields, arch = read_architecture(config)
        try:
            heads = int(fields["num_attention_heads"])
            given = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
            dtype_name = resolve_dtype(str(given), device_type)
            return cls(
                hidden_size=int(fields["hidden_size"]),
                intermediate_size=int(fields["intermediate_size"]),
                num_hidden_layers=int(fields["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(fields.get("num_key_value_heads") or heads),
                vocab_size=int(fields["vocab_size"]),
                tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)),
                head=head,
                dtype_bytes=DTYPE_BYTES.get(dtype_name.replace("torch.", ""), 2),
                head_dim=int(fields.get("head_dim") or 0),
                max_positions=int(fields.get("max_position_embeddings") or 2048),
                layer_types=tuple(sorted(attention_kinds(config))),
                model_type=arch.model_type,
                biases=arch.biases,
                qk_norm=arch.qk_norm,
                num_experts=arch.num_experts,
                experts_per_token=arch.experts_per_token,
                moe_intermediate_size=arch.moe_intermediate_size,
                shared_expert_intermediate_size=arch.shared_expert_intermediate_size,
                shared_expert_gate=arch.shared_expert_gate,
                moe_layers=arch.moe_layers,
                shared_experts_name=arch.shared_experts_name,
                mla=arch.mla,
                mtp_layers=arch.mtp_layers,
                router=arch.router,
                router_groups=arch.router_groups,
            )
        except KeyError as err:
            raise PlanError(f"model config lacks {err.args[0]!r}") from None

    @property
    def q_dim(self) -> int:
        """Width of the q projection and of o's input (heads × head dim; ``hidden_size`` unless an
        explicit ``head_dim`` differs from hidden / heads)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the k and v projections (kv heads × head dim)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def attention_width(self) -> float:
        """``Q``, the attention width of the FLOPs ``4·S²·Q`` per layer and of the q/k/v/output activations:
        :attr:`q_dim`, or with latent attention the mean ``a·(qk + v)/2`` of the score and value widths
        (module docstring)."""
        if self.mla is None:
            return float(self.q_dim)
        m = self.mla
        return self.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2

    def kv_cache_width(self, t: int) -> float:
        """Values of KV cache one token keeps per layer on one of ``t`` tensor-parallel devices:
        ``2 · kv_dim / t`` (keys and values, heads split), or with latent attention ``kv_lora + rope``, the
        compressed latent, whole on every device (module docstring)."""
        if self.mla is None:
            return 2 * self.kv_dim / t
        return float(self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)

    def decode_attention(self, ctx: float, expanded: bool) -> tuple[float, float]:
        """``(FLOPs, values moved)`` per row per layer of one decode step's attention over ``ctx`` cached
        tokens, beyond reading the cache (whole model: tensor parallel divides both). q/k/v attention:
        ``4·ctx·Q`` FLOPs, nothing moved. Latent attention (module docstring), ``expanded`` (transformers:
        the built-in loop): the latent's expansion ``2·ctx·kv_lora·a·(nope + v)`` plus scores and sum
        ``2·ctx·a·(qk + v)``, and the expanded keys and values written and read, ``2·ctx·a·(qk + v)``
        values; absorbed (vLLM): ``2·ctx·a·(2·kv_lora + rope)`` FLOPs over the latent, nothing moved."""
        if self.mla is None:
            return 4 * ctx * self.q_dim, 0.0
        m, a = self.mla, self.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if not expanded:
            return 2 * ctx * a * (2 * m.kv_lora_rank + m.qk_rope_head_dim), 0.0
        expand = 2 * ctx * m.kv_lora_rank * a * (m.qk_nope_head_dim + m.v_head_dim)
        return expand + 2 * ctx * a * (qk + m.v_head_dim), 2 * ctx * a * (qk + m.v_head_dim)

    @property
    def latent_activation_width(self) -> float:
        """Values per token per layer a latent-attention layer keeps for its backward beyond the q/k/v
        terms, whole on every tensor-parallel device: the query latent before and after its norm
        (``2·q_lora``), the key/value latent with its rope key (``kv_lora + rope``) and the normed latent
        (``kv_lora``); 0 for q/k/v attention."""
        if self.mla is None:
            return 0.0
        m = self.mla
        return 2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_head_dim

    @property
    def tp_replicated_layer_params(self) -> int:
        """Parameters per decoder layer tensor parallel does not split: latent attention's down-projections
        and their norms (``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, biases
        included; module docstring); 0 for q/k/v attention."""
        if self.mla is None:
            return 0
        shapes = self._attention_shapes()
        down = ("self_attn.q_a_", "self_attn.kv_a_")
        return sum(math.prod(v) for k, v in shapes.items() if k.startswith(down))

    def _attention_shapes(self) -> dict[str, tuple[int, ...]]:
        """One decoder layer's attention parameters (after ``model.layers.{i}.``) -> shapes."""
        h, kv, q, d = self.hidden_size, self.kv_dim, self.q_dim, self.head_dim
        out: dict[str, tuple[int, ...]] = {}
        if self.mla is not None:
            m, a = self.mla, self.num_attention_heads
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            mats = [("kv_a_proj_with_mqa", m.kv_lora_rank + m.qk_rope_head_dim, h)]
            mats += [
                ("kv_b_proj", a * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                ("o_proj", h, a * m.v_head_dim),
            ]
            if m.q_lora_rank:
                mats += [("q_a_proj", m.q_lora_rank, h), ("q_b_proj", a * qk, m.q_lora_rank)]
                out["self_attn.q_a_layernorm.weight"] = (m.q_lora_rank,)
            else:
                mats.append(("q_proj", a * qk, h))
            out["self_attn.kv_a_layernorm.weight"] = (m.kv_lora_rank,)
        else:
            mats = list(zip(_ATTN, (q, kv, kv, h), (h, h, h, q), strict=True))
        for name, rows, cols in mats:
            out[f"self_attn.{name}.weight"] = (rows, cols)
            if name in self.biases:
                out[f"self_attn.{name}.bias"] = (rows,)
        if self.qk_norm:
            out["self_attn.q_norm.weight"] = (d,)
            out["self_attn.k_norm.weight"] = (d,)
        return out

    @property
    def tied(self) -> bool:
        """The output head is the embedding matrix (only for an ``lm`` head)."""
        return self.tie_word_embeddings and self.head == "lm"

    @property
    def is_moe(self) -> bool:
        """Some layers are mixture-of-experts layers."""
        return bool(self.moe_layers)

    def _layer_shapes(self, sparse: bool) -> dict[str, tuple[int, ...]]:
        """One decoder layer's parameter names (after ``model.layers.{i}.``) -> shapes."""
        h, i = self.hidden_size, self.intermediate_size
        out: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (h,), **self._attention_shapes()}
        out["post_attention_layernorm.weight"] = (h,)
        if sparse:
            e, ie, s = self.num_experts, self.moe_intermediate_size, self.shared_expert_intermediate_size
            out["mlp.gate.weight"] = (e, h)
            out["mlp.experts.gate_up_proj"] = (e, 2 * ie, h)
            out["mlp.experts.down_proj"] = (e, h, ie)
            if s:
                for name, rows, cols in zip(_MLP, (s, s, h), (h, h, s), strict=True):
                    out[f"mlp.{self.shared_experts_name}.{name}.weight"] = (rows, cols)
            if self.shared_expert_gate:
                out["mlp.shared_expert_gate.weight"] = (1, h)
            return out
        for name, rows, cols in zip(_MLP, (i, i, h), (h, h, i), strict=True):
            out[f"mlp.{name}.weight"] = (rows, cols)
            if name in self.biases:
                out[f"mlp.{name}.bias"] = (rows,)
        return out

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name -> shape, in transformers 5.19's naming for the architecture (module
        docstring)."""
        h, v = self.hidden_size, self.vocab_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        sparse = set(self.moe_layers)
        for layer in range(self.num_hidden_layers):
            for name, shape in self._layer_shapes(layer in sparse).items():
                shapes[f"model.layers.{layer}.{name}"] = shape
        shapes["model.norm.weight"] = (h,)
        if self.head == "lm":
            if not self.tie_word_embeddings:
                shapes["lm_head.weight"] = (v, h)
        else:
            shapes["score.weight"] = (1, h)
        return shapes

    @cached_property
    def _kind_params(self) -> tuple[int, int]:
        """(parameters of a dense layer, of a sparse layer: every expert)."""

        def count(sparse: bool) -> int:
            total = 0
            for shape in self._layer_shapes(sparse).values():
                n = 1
                for size in shape:
                    n *= size
                total += n
            return total

        return count(False), count(True) if self.moe_layers else 0

    @cached_property
    def layer_sizes(self) -> tuple[int, ...]:
        """Stored parameters of each decoder layer, in order (a sparse layer with all its experts)."""
        dense, sparse = self._kind_params
        moe = set(self.moe_layers)
        return tuple(sparse if layer in moe else dense for layer in range(self.num_hidden_layers))

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert of one layer (SwiGLU: ``3 · hidden · I_e``; 0 when dense)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.moe_layers else 0

    @cached_property
    def decoder_params(self) -> int:
        """Stored parameters of all decoder layers."""
        return sum(self.layer_sizes)

    @cached_property
    def layer_params(self) -> float:
        """Stored parameters of a decoder layer, averaged over the layers (attention + MLP or experts +
        norms; every layer's for a dense model)."""
        return self.decoder_params / self.num_hidden_layers

    @cached_property
    def max_layer_params(self) -> int:
        """Stored parameters of the largest decoder layer (an FSDP2 unit, a streamed sync unit)."""
        return max(self.layer_sizes, default=0)

    @cached_property
    def active_layer_params(self) -> float:
        """Parameters a token multiplies in a decoder layer, averaged over the layers: a sparse layer's
        attention, norms, router (all ``E`` logits), shared expert and ``K`` of its ``E`` experts."""
        idle = len(self.moe_layers) * (self.num_experts - self.experts_per_token) * self.expert_params
        return (self.decoder_params - idle) / self.num_hidden_layers

    def stage_sizes(self, layers: range) -> int:
        """Stored parameters of the decoder layers ``layers`` (a pipeline stage's)."""
        return sum(self.layer_sizes[i] for i in layers)

    def read_params(self, tokens: float) -> float:
        """Parameters a forward over ``tokens`` tokens reads: every parameter but, in each sparse layer,
        the experts no token is routed to (:func:`expected_distinct_experts`, uniform routing)."""
        if not self.moe_layers:
            return float(self.num_params)
        touched = expected_distinct_experts(self.num_experts, self.experts_per_token, tokens)
        return self.num_params - len(self.moe_layers) * (self.num_experts - touched) * self.expert_params

    @cached_property
    def head_params(self) -> int:
        """Parameters of the output head matrix (counted even when tied: it is used twice)."""
        return self.vocab_size * self.hidden_size if self.head == "lm" else self.hidden_size

    @cached_property
    def num_params(self) -> int:
        """Stored parameter count (a tied head counted once)."""
        extra = 0 if self.tied else self.head_params
        return self.decoder_params + self.vocab_size * self.hidden_size + self.hidden_size + extra

    @cached_property
    def adapter_params(self) -> int:
        """Parameters of the LoRA adapters alone (``adapters.adapter_count``; no trained head): what a
        forward adds to the base's FLOPs per token (twice them). 0 without ``lora``."""
        return adapter_count(self, self.lora).adapters if self.lora is not None else 0

    @cached_property
    def trainable_params(self) -> int:
        """Parameters a train node of this model gives gradients and Adam state: every one
        (:attr:`num_params`), or with ``lora`` the adapters and a trained value/score head
        (``adapters.adapter_params``)."""
        if self.lora is None:
            return self.num_params
        return adapter_count(self, self.lora).params

    @cached_property
    def synced_params(self) -> int:
        """Parameters a weight sync moves: every one, or with ``lora`` the adapter state the runtime holds
        (``adapters.AdapterCount.synced``: trained parameters, plus a targeted embedding layer's weight)."""
        if self.lora is None:
            return self.num_params
        return adapter_count(self, self.lora).synced

    @property
    def stored_params(self) -> int:
        """Parameters an instance of the model holds: :attr:`num_params` plus the adapters under ``lora``."""
        return self.num_params + self.adapter_params

    @property
    def trainable_share(self) -> float:
        """``trainable_params / stored_params``: 1 for full training, the trained share with ``lora``. A
        stage's or shard's trained parameters are priced in this proportion to its stored ones (exact for
        the whole model; adapters spread over pipeline stages and tensor shards as their weights)."""
        return self.trainable_params / self.stored_params

    @cached_property
    def active_params(self) -> float:
        """Parameters one token uses (the "A3B" of Qwen3-30B-A3B): :attr:`num_params` less the
        ``E − K`` experts it is not routed to in each sparse layer."""
        idle = len(self.moe_layers) * (self.num_experts - self.experts_per_token) * self.expert_params
        return float(self.num_params - idle)

    def describe(self) -> str:
        """One line on what the planner prices, e.g. ``mixture of experts: 30.53 B parameters in memory,
        3.353 B active per token (FLOPs); 128 experts of width 768, 8 per token, in 48 of 48 layers``
        (``dense: 8.03 B parameters`` without experts), then for a LoRA model ``; LoRA rank 16 on all-linear:
        39.98 M adapter parameters trained (0.5933 %): gradients, Adam state and weight syncs for them only``
        and for a base view ``; the base of LoRA model 'actor' (adapters off)``."""
        return self._describe_params() + self._describe_lora()

    def _describe_lora(self) -> str:
        if self.base_of:
            return f"; the base of LoRA model '{self.base_of}' (adapters off)"
        if self.lora is None:
            return ""
        targets = self.lora.target_modules
        named = targets if isinstance(targets, str) else ", ".join(targets)
        trained, share = self.trainable_params / 1e6, 100 * self.trainable_params / self.num_params
        return (
            f"; LoRA rank {self.lora.rank} on {named}: {trained:.4g} M adapter parameters trained "
            f"({share:.4g} %): gradients, Adam state and weight syncs for them only"
        )

    def _describe_params(self) -> str:
        return self._describe_experts() + self._describe_attention()

    def _describe_attention(self) -> str:
        if self.mla is None:
            return ""
        m = self.mla
        mtp = (
            f"; its {self.mtp_layers} multi-token-prediction layer(s) (num_nextn_predict_layers) are not "
            "priced: transformers does not build them, so rlflow does not run them"
            if self.mtp_layers
            else ""
        )
        return (
            f"; latent attention (kv_lora_rank {m.kv_lora_rank}, q_lora_rank {m.q_lora_rank}): KV cache "
            f"{m.kv_lora_rank + m.qk_rope_head_dim} values per token per layer{mtp}"
        )

    def _describe_experts(self) -> str:
        if not self.moe_layers:
            return f"dense: {self.num_params / 1e9:.4g} B parameters"
        shared = (
            f", a shared expert of width {self.shared_expert_intermediate_size}"
            if self.shared_expert_intermediate_size
            else ""
        )
        return (
            f"mixture of experts: {self.num_params / 1e9:.4g} B parameters in memory, "
            f"{self.active_params / 1e9:.4g} B active per token (FLOPs); {self.num_experts} experts of width "
            f"{self.moe_intermediate_size}, {self.experts_per_token} per token{shared}, in "
            f"{len(self.moe_layers)} of {self.num_hidden_layers} layers; a decode step reads the experts its "
            "rows touch (uniform routing)"
        )

    def key(self) -> str:
        """A short shape key, e.g. ``h4096-i11008-l32-a32-kv32-v32000`` (profiles are keyed by it), with
        ``-d<head_dim>`` appended only when the head dim is not hidden / heads (older keys stay valid),
        and for a mixture of experts ``-e<E>-k<K>-m<I_e>`` (``-s<shared width>`` with a shared expert), for
        latent attention ``-ql…-kl…-qn…-qr…-vh…`` (q_lora, kv_lora, nope, rope and v widths).
        Biases and QK norms (vectors: no FLOPs a profile would key) are not part of it."""
        key = (
            f"h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}-"
            f"a{self.num_attention_heads}-kv{self.num_key_value_heads}-v{self.vocab_size}"
        )
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            key += f"-d{self.head_dim}"
        if self.moe_layers:
            key += f"-e{self.num_experts}-k{self.experts_per_token}-m{self.moe_intermediate_size}"
            if self.shared_expert_intermediate_size:
                key += f"-s{self.shared_expert_intermediate_size}"
        if self.mla is not None:
            m = self.mla
            key += f"-ql{m.q_lora_rank}-kl{m.kv_lora_rank}-qn{m.qk_nope_head_dim}-qr{m.qk_rope_head_dim}"
            key += f"-vh{m.v_head_dim}"
        return key

    @classmethod
    def from_key(cls, key: str, head: str = "lm", dtype_bytes: int = 2) -> ModelShape:
        """The shape a :meth:`key` names (head dim from ``-d…``, else hidden / heads; untied head; experts
        from ``-e…-k…-m…``, in every layer; latent attention from ``-kl…``).

        Raises:
            PlanError: ``key`` is not of the form ``h…-i…-l…-a…-kv…-v…``.
        """
        parts = [re.fullmatch(r"([a-z]+)(\d+)", part) for part in key.split("-")]
        fields = {m.group(1): int(m.group(2)) for m in parts if m is not None}
        mla = None
        if "kl" in fields:
            mla = LatentAttention(
                fields.get("ql", 0),
                fields["kl"],
                fields.get("qn", 0),
                fields.get("qr", 0),
                fields.get("vh", 0),
            )
        try:
            return cls(
                fields["h"], fields["i"], fields["l"], fields["a"], fields["kv"], fields["v"], head=head,
                dtype_bytes=dtype_bytes, head_dim=fields.get("d", 0), num_experts=fields.get("e", 0),
                experts_per_token=fields.get("k", 0), moe_intermediate_size=fields.get("m", 0),
                shared_expert_intermediate_size=fields.get("s", 0), mla=mla,
            )  # fmt: skip
        except KeyError:
            raise PlanError(f"model shape key {key!r} is not of the form h…-i…-l…-a…-kv…-v…") from None

    def with_head(self, head: str) -> ModelShape:
        """This shape with another output head (``lm``, ``value`` or ``score``)."""
        return replace(self, head=head)


# Llama-2 7B/13B/70B (Touvron et al. 2023) and CodeLlama-34B configs, the sizes of the ReaL paper.
MODEL_PRESETS: dict[str, ModelShape] = {
    "7b": ModelShape(4096, 11008, 32, 32, 32, 32000),
    "13b": ModelShape(5120, 13824, 40, 40, 40, 32000),
    "34b": ModelShape(8192, 22016, 48, 64, 8, 32000),
    "70b": ModelShape(8192, 28672, 80, 64, 8, 32000),
}
