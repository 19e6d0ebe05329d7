"""Model shapes: a Llama-style decoder's Hugging Face config fields, its parameter names, shapes and
counts, and the Llama presets of the ReaL paper's experiments.

Parameter names follow Hugging Face Llama (``model.layers.{i}.self_attn.q_proj.weight``...), so the same
names index real modules in the runtime.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property
from typing import Any

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.layout_rules import attention_kinds
from rlflow.dataflow.model_spec import resolve_dtype

__all__ = ["DTYPE_BYTES", "HEADS", "MODEL_PRESETS", "ModelShape"]

HEADS = ("lm", "value", "score")
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


@dataclass(frozen=True)
class ModelShape:
    """Shape of a Llama-style decoder (HF config fields) plus its head and dtype.

    ``head``: ``lm`` (vocabulary head, tied to the embedding when ``tie_word_embeddings``), ``value`` or
    ``score`` (a [1, hidden] head, ``score.weight``). ``dtype_bytes``: bytes per weight element.
    ``head_dim``: width of one attention head; 0 (the default) means ``hidden_size // num_attention_heads``
    and is replaced by that value. An explicit HF ``head_dim`` (Gemma, Qwen3, ...) need not equal it: q/o
    are then ``[heads·head_dim, hidden]`` / ``[hidden, heads·head_dim]``, as Hugging Face builds them.
    ``max_positions``: ``max_position_embeddings`` (tokens), the context a vLLM engine is sized for.
    ``layer_types``: the distinct attention types of its layers (``layout_rules.attention_kinds``; two or
    more keep generation off pipeline stages).
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

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], head: str = "lm", dtype: str | None = None, device_type: str = "cpu"
    ) -> ModelShape:
        """Build from an HF config dict; missing ``num_key_value_heads`` means multi-head attention, a
        missing (or null) ``head_dim`` means ``hidden_size // num_attention_heads``. ``dtype`` (a graph
        model's ``dtype``; else the config's ``torch_dtype``, else bfloat16) sets ``dtype_bytes``; ``auto`` is
        what the runtime builds on ``device_type`` (``rlflow.dataflow.model_spec.resolve_dtype``: 2 bytes on
        ``cuda``, 4 on ``cpu``).

        Raises:
            PlanError: a required field is missing.
        """
        try:
            heads = int(config["num_attention_heads"])
            given = dtype or config.get("torch_dtype") or config.get("dtype") or "bfloat16"
            dtype_name = resolve_dtype(str(given), device_type)
            return cls(
                hidden_size=int(config["hidden_size"]),
                intermediate_size=int(config["intermediate_size"]),
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config.get("num_key_value_heads") or heads),
                vocab_size=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                head=head,
                dtype_bytes=DTYPE_BYTES.get(dtype_name.replace("torch.", ""), 2),
                head_dim=int(config.get("head_dim") or 0),
                max_positions=int(config.get("max_position_embeddings") or config.get("n_positions") or 2048),
                layer_types=tuple(sorted(attention_kinds(config))),
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
    def tied(self) -> bool:
        """The output head is the embedding matrix (only for an ``lm`` head)."""
        return self.tie_word_embeddings and self.head == "lm"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name -> shape, in HF Llama naming (no biases)."""
        h, i, v, kv, q = self.hidden_size, self.intermediate_size, self.vocab_size, self.kv_dim, self.q_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
        for layer in range(self.num_hidden_layers):
            p = f"model.layers.{layer}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "self_attn.q_proj.weight"] = (q, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            shapes[p + "mlp.gate_proj.weight"] = (i, h)
            shapes[p + "mlp.up_proj.weight"] = (i, h)
            shapes[p + "mlp.down_proj.weight"] = (h, i)
        shapes["model.norm.weight"] = (h,)
        if self.head == "lm":
            if not self.tie_word_embeddings:
                shapes["lm_head.weight"] = (v, h)
        else:
            shapes["score.weight"] = (1, h)
        return shapes

    @cached_property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention + SwiGLU MLP + two norms)."""
        h, i, kv, q = self.hidden_size, self.intermediate_size, self.kv_dim, self.q_dim
        return 2 * q * h + 2 * kv * h + 3 * h * i + 2 * h

    @cached_property
    def head_params(self) -> int:
        """Parameters of the output head matrix (counted even when tied: it is used twice)."""
        return self.vocab_size * self.hidden_size if self.head == "lm" else self.hidden_size

    @cached_property
    def num_params(self) -> int:
        """Stored parameter count (a tied head counted once)."""
        extra = 0 if self.tied else self.head_params
        return (
            self.num_hidden_layers * self.layer_params
            + self.vocab_size * self.hidden_size
            + self.hidden_size
            + extra
        )

    def key(self) -> str:
        """A short shape key, e.g. ``h4096-i11008-l32-a32-kv32-v32000`` (profiles are keyed by it), with
        ``-d<head_dim>`` appended only when the head dim is not hidden / heads (older keys stay valid)."""
        key = (
            f"h{self.hidden_size}-i{self.intermediate_size}-l{self.num_hidden_layers}-"
            f"a{self.num_attention_heads}-kv{self.num_key_value_heads}-v{self.vocab_size}"
        )
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            key += f"-d{self.head_dim}"
        return key

    @classmethod
    def from_key(cls, key: str, head: str = "lm", dtype_bytes: int = 2) -> ModelShape:
        """The shape a :meth:`key` names (head dim from ``-d…``, else hidden / heads; untied head).

        Raises:
            PlanError: ``key`` is not of the form ``h…-i…-l…-a…-kv…-v…``.
        """
        parts = [re.fullmatch(r"([a-z]+)(\d+)", part) for part in key.split("-")]
        fields = {m.group(1): int(m.group(2)) for m in parts if m is not None}
        try:
            return cls(
                fields["h"], fields["i"], fields["l"], fields["a"], fields["kv"], fields["v"], head=head,
                dtype_bytes=dtype_bytes, head_dim=fields.get("d", 0),
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
