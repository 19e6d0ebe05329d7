"""Which Hugging Face architectures the planner prices, and the fields of their configs that set a model's
parameters: attention biases and QK norms, multi-head latent attention (DeepSeek-V3), and a mixture-of-experts
model's experts (count, top-k, expert width, shared experts, which layers are sparse).

A config is read with its ``model_type``'s defaults filled in as transformers builds it
(``AutoConfig.for_model(**config)``: a Qwen3-MoE config that omits ``num_experts`` has transformers'
128). A ``model_type`` outside :data:`PRICED` is refused (``PlanError`` naming the key), never priced as a
dense Llama of whatever fields it shares with one: GPT-2's ``n_embd``/``n_head`` would be silently wrong, and
so would a latent-attention key (``kv_lora_rank``, ``q_lora_rank``) on any ``model_type`` but ``deepseek_v3``.
A config without ``model_type`` (the planner's own tests, profiles) is read as a Llama-style decoder.

MoE layer rules (transformers 5.19's modeling code): Qwen2-MoE / Qwen3-MoE layer ``i`` is sparse when
``i ∉ mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (``num_experts > 0``), else a dense
SwiGLU MLP of ``intermediate_size``; every Mixtral layer is sparse (``num_local_experts``; its
``intermediate_size`` is the expert width). Qwen2-MoE adds one shared expert of
``shared_expert_intermediate_size`` and its ``[1, hidden]`` sigmoid gate to every sparse layer.
DeepSeek-V3: layer ``i`` is sparse when ``i >= first_k_dense_replace`` (the first ``k`` layers a dense
SwiGLU MLP of ``intermediate_size``), with ``n_routed_experts`` experts of ``moe_intermediate_size``, top
``num_experts_per_tok``, and ``n_shared_experts`` shared experts run as one ungated SwiGLU of
``n_shared_experts · moe_intermediate_size``; its router adds an ``[E]`` score-correction *buffer* (not a
parameter). Its group-limited routing (``n_group``, ``topk_group``) changes no parameter or FLOP, and under
uniform routing leaves each expert's chance per token at ``K/E``, so the decode-read model of ``shapes.py``
holds. Its attention is multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, §2.1): ``shapes.py``
prices its projections, FLOPs and the latent KV cache. The multi-token-prediction module
(``num_nextn_predict_layers``; the V3 report, arXiv 2412.19437, §2.2) is not built by transformers, so
rlflow never runs it: the planner prices the model as built and ``ModelShape.describe`` says MTP is left out.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from rlflow.dataflow.errors import PlanError

__all__ = ["PRICED", "Architecture", "LatentAttention", "read_architecture"]

# model_type -> the projections that carry a bias whatever the config says (Qwen2's q/k/v)
_FIXED_BIASES: dict[str, tuple[str, ...]] = {
    "llama": (),
    "mistral": (),
    "qwen2": ("q_proj", "k_proj", "v_proj"),
    "qwen3": (),
    "qwen2_moe": ("q_proj", "k_proj", "v_proj"),
    "qwen3_moe": (),
    "mixtral": (),
    "deepseek_v3": (),
}
PRICED = tuple(_FIXED_BIASES)
"""The ``model_type`` values whose every parameter the planner's shape accounts for (checked against the
model transformers builds on the meta device: ``tests/test_model_shape_params.py``)."""
_QK_NORM = ("qwen3", "qwen3_moe")
_READ = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "tie_word_embeddings", "head_dim", "max_position_embeddings", "attention_bias", "mlp_bias",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "n_routed_experts",
    "n_shared_experts", "first_k_dense_replace", "norm_topk_prob", "n_group", "topk_group", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers",
)  # fmt: skip  # per-head RMSNorm of q and k: 2 × head_dim per layer
# a config key -> why the planner cannot price a model that sets it (an architecture it does not model);
# the latent-attention keys are priced on deepseek_v3 only (the one MLA model_type transformers builds here)
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank")
_UNPRICED_KEYS = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek-V2/V3): compressed key/value projections",
    "q_lora_rank": "multi-head latent attention (DeepSeek-V2/V3): a low-rank query projection",
    "n_embd": "a GPT-2-style decoder (learned positions, LayerNorm with biases, a GELU MLP)",
}


@dataclass(frozen=True)
class Architecture:
    """The parameter-setting fields of a priced config beyond the dense Llama ones.

    Attributes:
        model_type: the config's ``model_type`` (``llama`` when it has none).
        biases: projections with a bias (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
            ``up_proj``, ``down_proj``): Qwen2's q/k/v, Llama's ``attention_bias`` and ``mlp_bias``.
        qk_norm: a ``[head_dim]`` RMSNorm of q and of k per layer (Qwen3).
        num_experts: routed experts per sparse layer (0: dense).
        experts_per_token: experts each token is routed to (top-k).
        moe_intermediate_size: one routed expert's SwiGLU width.
        shared_expert_intermediate_size: the width of the shared expert every token runs (0: none).
        shared_expert_gate: the shared expert's output has a ``[1, hidden]`` sigmoid gate (Qwen2-MoE).
        moe_layers: indices of the sparse layers (empty when dense).
        shared_experts_name: the shared expert's module under ``mlp.`` (``shared_expert``: Qwen2-MoE;
            ``shared_experts``: DeepSeek-V3).
        mla: multi-head latent attention's widths (DeepSeek-V3), None for q/k/v/o attention.
        mtp_layers: multi-token-prediction layers the config declares (DeepSeek-V3's
            ``num_nextn_predict_layers``), which transformers does not build (module docstring).
        router: how the router picks (what it keeps for the backward: ``memory_cost.sparse_mlp_bytes``):
            ``softmax`` top-k, ``softmax_norm`` top-k renormalised (Mixtral; ``norm_topk_prob``),
            ``sigmoid_group`` (DeepSeek-V3's group-limited sigmoid routing; ``router_groups``: its
            ``(n_group, topk_group)``).
    """

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


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention's widths (DeepSeek-V2, arXiv 2405.04434, §2.1; transformers'
    ``DeepseekV3Attention``), each the config field of the same name: ``q_lora_rank`` (0: a full-rank
    ``q_proj``, the config's null), ``kv_lora_rank`` (the compressed key/value latent), ``qk_nope_head_dim``
    and ``qk_rope_head_dim`` (a query/key head's widths without and with rotary positions), ``v_head_dim``."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@functools.lru_cache(maxsize=128)
def _resolved(config_json: str) -> dict[str, Any]:
    """The config with its model type's defaults, as transformers builds it (the raw fields where
    transformers refuses it: ``validate`` reports that, the planner prices what it was given)."""
    config = json.loads(config_json)
    try:
        from transformers import AutoConfig

        built = AutoConfig.for_model(**config)
    except Exception:  # a malformed config: the runtime's validation names it
        return config
    # attributes through the config class's attribute_map (Qwen3-MoE's num_experts is num_local_experts)
    named = {key: getattr(built, key, None) for key in _READ}
    return {**built.to_dict(), **{k: v for k, v in named.items() if v is not None}}


def read_architecture(config: Mapping[str, Any]) -> tuple[dict[str, Any], Architecture]:
    """``(fields, architecture)`` of HF config ``config``: the config with its ``model_type``'s defaults
    (module docstring) and its :class:`Architecture`.

    Raises:
        PlanError: ``config.<key>: ...`` for a config the planner cannot price faithfully: a key of an
            unmodelled architecture (``n_embd``; ``kv_lora_rank`` but on ``deepseek_v3``), a ``model_type``
            outside :data:`PRICED`, ``num_experts_per_tok`` outside ``1..experts``, an expert width below 1,
            or a latent-attention width below 1; ``config: ...`` for a field that is not a number.
    """
    try:
        return _read_architecture(config)
    except (TypeError, ValueError) as err:  # a field transformers refuses too (``num_experts: four``)
        raise PlanError(f"config: a field is not a number the planner can read ({err})") from None


def _read_architecture(config: Mapping[str, Any]) -> tuple[dict[str, Any], Architecture]:
    model_type = config.get("model_type")
    for key, why in _UNPRICED_KEYS.items():
        if config.get(key) is not None and not (model_type == "deepseek_v3" and key in _MLA_KEYS):
            kind = f"model_type {model_type!r}" if model_type else "a config"
            raise PlanError(
                f"config.{key}: {kind} with {key!r} is {why}, which the planner does not price "
                f"(it prices {', '.join(PRICED)})"
            )
    if model_type is None:
        return dict(config), Architecture()
    model_type = str(model_type)
    if model_type not in _FIXED_BIASES:
        raise PlanError(
            f"config.model_type: {model_type!r} is not an architecture the planner prices "
            f"(it prices {', '.join(PRICED)}): its parameters would be counted as a dense Llama's"
        )
    fields = _resolved(json.dumps(dict(config), sort_keys=True, default=str))
    biases = list(_FIXED_BIASES[model_type])
    if model_type in ("llama", "qwen3", "qwen3_moe") and fields.get("attention_bias"):
        biases += ["q_proj", "k_proj", "v_proj", "o_proj"]
    if model_type == "deepseek_v3" and fields.get("attention_bias"):  # its latent down-projections and o
        biases += ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"]
    if model_type == "llama" and fields.get("mlp_bias"):
        biases += ["gate_proj", "up_proj", "down_proj"]
    arch = Architecture(model_type, tuple(dict.fromkeys(biases)), model_type in _QK_NORM)
    layers = int(fields.get("num_hidden_layers") or 0)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        experts = int(fields.get("num_experts") or 0)
        step = int(fields.get("decoder_sparse_step") or 1)
        dense = {int(i) for i in fields.get("mlp_only_layers") or ()}
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0) if experts else ()
        shared = int(fields.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        arch = _moe(arch, fields, experts, int(fields.get("moe_intermediate_size") or 0), sparse, shared)
    elif model_type == "mixtral":
        experts = int(fields.get("num_local_experts") or 0)
        arch = _moe(arch, fields, experts, int(fields["intermediate_size"]), tuple(range(layers)), 0)
    elif model_type == "deepseek_v3":
        arch = _deepseek_v3(arch, fields, layers)
    return fields, arch


def _deepseek_v3(arch: Architecture, fields: Mapping[str, Any], layers: int) -> Architecture:
    """DeepSeek-V3's experts, shared experts, dense first layers and latent attention (module docstring)."""
    mla = LatentAttention(
        int(fields.get("q_lora_rank") or 0), int(fields.get("kv_lora_rank") or 0),
        int(fields.get("qk_nope_head_dim") or 0), int(fields.get("qk_rope_head_dim") or 0),
        int(fields.get("v_head_dim") or 0),
    )  # fmt: skip
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if getattr(mla, key) < 1:
            raise PlanError(f"config.{key}: {fields.get(key)!r} is not a positive width of latent attention")
    experts = int(fields.get("n_routed_experts") or 0)
    first = int(fields.get("first_k_dense_replace") or 0)
    width = int(fields.get("moe_intermediate_size") or 0)
    shared = int(fields.get("n_shared_experts") or 0) * width
    moe = _moe(arch, fields, experts, width, tuple(range(first, layers)), shared)
    return replace(
        moe, shared_expert_gate=False, shared_experts_name="shared_experts", mla=mla,
        mtp_layers=int(fields.get("num_nextn_predict_layers") or 0), router="sigmoid_group",
        router_groups=(int(fields.get("n_group") or 1), int(fields.get("topk_group") or 1)),
    )  # fmt: skip


def _moe(
    arch: Architecture,
    fields: Mapping[str, Any],
    experts: int,
    width: int,
    sparse: tuple[int, ...],
    shared: int,
) -> Architecture:
    """``arch`` with its experts (dense when ``experts`` is 0 or no layer is sparse)."""
    if not experts or not sparse:
        return arch
    k = int(fields.get("num_experts_per_tok") or 0)
    if not 1 <= k <= experts:
        raise PlanError(f"config.num_experts_per_tok: {k} is not between 1 and the {experts} experts")
    if width < 1:
        raise PlanError(f"config.moe_intermediate_size: {width} is not a positive expert width")
    norm = arch.model_type == "mixtral" or bool(fields.get("norm_topk_prob"))
    return Architecture(
        arch.model_type, arch.biases, arch.qk_norm, experts, k, width, shared, shared > 0, sparse,
        router="softmax_norm" if norm else "softmax",
    )  # fmt: skip
