"""LoRA adapters as the planner prices them: which linear layers of a decoder a graph's ``lora`` section
targets, the adapter parameters and tensors that follow, and the backward pass through a frozen base.

Adapters (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): a targeted linear
layer ``W [out, in]`` gets ``A [rank, in]`` and ``B [out, rank]``, ``rank · (in + out)`` parameters
(``peft``'s ``lora_A``/``lora_B``, built in the base layer's dtype). Targets are matched as ``peft`` matches
a list of names: a module whose dotted name is the target or ends in ``.<target>``; ``all-linear`` is
every ``nn.Linear`` of the model but its output head (``peft``'s ``_maybe_include_all_linear_layers``
leaves out ``get_output_embeddings()``; a value/score model's adapters sit in its backbone, which has no
head). The linear layers are the 2-D ``.weight`` tensors of ``ModelShape.param_shapes`` other than the
embedding and a sparse layer's router ``mlp.gate`` (transformers builds it as a router module, not an
``nn.Linear``; the fused expert tensors are parameters, no layers either: neither gets adapters; a shared
expert's projections and gate are linear layers). A ``value``/``score`` head trains in full beside
the adapters unless ``lora.train_head`` is false: ``nn.Linear(hidden, 1)``, ``hidden + 1`` parameters
(``rlflow.nodes.models.HeadModel``). A target named ``embed_tokens`` or ``lm_head`` (an embedding layer
by ``peft``'s ``EMBEDDING_LAYER_NAMES``) gets adapters as a linear layer does (``rank·(V + H)``); its
frozen base weight is never saved or synced (the runtime asks peft for ``save_embedding_layers=False``: the
base is rebuilt, never moved). :func:`adapter_params` is the count the runtime's adapter state
(``rlflow.nodes.lora.adapter_state_dict``) holds; a test checks the two agree on built models.

Backward through a frozen base (:func:`lora_backward_flops`): a linear layer's forward is one matmul
``Y = X Wᵀ`` (``2·n·in·out`` FLOPs for ``n`` tokens); its backward is two of the same size, the input
gradient ``dX = dY W`` and the weight gradient ``dW = dYᵀ X`` — hence backward = 2 × forward and a training
step = 6·N FLOPs per token (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", §2.1:
``C ≈ 6N``, 2N forward + 4N backward; Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", §5.1: backward = 2 × forward). A frozen base computes no
weight gradient, only the input gradient that the adapters and activations below it need: its matmuls'
backward is 1 × their forward. The attention score and weighted-sum products (``4·S²·Q`` per layer) have
two activation operands, both needing a gradient: 2 × forward. The adapters train: 2 × their forward
(``2·n·rank·(in + out)`` per targeted layer). Not priced: the first layer's input gradient, which nothing
needs below a frozen embedding (one layer's ``1/L`` of the base's backward; autograd computes it anyway
when a later adapter needs the layer's output gradient only as far down as the lowest adapter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import PlanError

if TYPE_CHECKING:
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = [
    "AdapterCount",
    "LoraShape",
    "adapter_count",
    "adapter_params",
    "adapter_shapes",
    "lora_backward_flops",
]

ALL_LINEAR = "all-linear"
_OUTPUT_HEAD = "lm_head"
_EMBEDDINGS = ("model.embed_tokens", _OUTPUT_HEAD)  # peft's EMBEDDING_LAYER_NAMES, in HF naming


@dataclass(frozen=True)
class LoraShape:
    """What the planner reads of a model's ``lora`` section (``rlflow.dataflow.model_spec.LoraSpec``):
    ``rank``, ``target_modules`` (module names, or ``all-linear``) and whether a ``value``/``score`` head
    trains (``train_head``: None or True train it, as the runtime does)."""

    rank: int
    target_modules: tuple[str, ...] | str = ALL_LINEAR
    train_head: bool | None = None

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise PlanError(f"lora.rank must be >= 1, got {self.rank}")


@dataclass(frozen=True)
class AdapterCount:
    """A LoRA model's trained parameters: ``adapters`` (``lora_A`` + ``lora_B`` elements), ``modules``
    (targeted linear layers; two adapter tensors each), ``head`` (a trained value/score head's elements,
    0 for an ``lm`` model or ``train_head: false``) and ``head_tensors`` (its weight and bias)."""

    adapters: int
    modules: int
    head: int
    head_tensors: int

    @property
    def synced(self) -> int:
        """Elements of the adapter state a sync or checkpoint moves: the trained parameters."""
        return self.params

    @property
    def params(self) -> int:
        """Every trained parameter: adapters + head."""
        return self.adapters + self.head

    @property
    def tensors(self) -> int:
        """Trained tensors (what an optimizer step and a sync walk): two per targeted layer + the head's."""
        return 2 * self.modules + self.head_tensors


def _linear_layers(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Module name -> (out, in) of every ``nn.Linear`` of the decoder and its output head and of the
    embedding (``[V, H]``), in HF naming (a tied ``lm_head`` is a layer too: it shares the embedding's
    weight)."""
    out: dict[str, tuple[int, int]] = {}
    for name, dims in shape.param_shapes().items():
        module = name.removesuffix(".weight")
        if module.endswith(".mlp.gate"):
            continue  # the router: no nn.Linear
        if name.endswith(".weight") and len(dims) == 2:
            out[module] = (dims[0], dims[1])
    if shape.head == "lm" and shape.tie_word_embeddings:
        out[_OUTPUT_HEAD] = (shape.vocab_size, shape.hidden_size)
    return out


def _targeted(shape: ModelShape, lora: LoraShape) -> dict[str, tuple[int, int]]:
    layers = _linear_layers(shape)
    if shape.head != "lm":  # a value/score model's adapters sit in its backbone: the head is not theirs
        layers = {n: d for n, d in layers.items() if n != "score"}
    if lora.target_modules == ALL_LINEAR:  # nn.Linear layers only: not the embedding, not the head
        return {n: d for n, d in layers.items() if n not in _EMBEDDINGS}
    names = tuple(lora.target_modules)
    return {n: d for n, d in layers.items() if any(n == t or n.endswith("." + t) for t in names)}


def adapter_count(shape: ModelShape, lora: LoraShape) -> AdapterCount:
    """:class:`AdapterCount` of ``shape`` under ``lora`` (module docstring: which layers, ``rank·(in+out)``
    each, the head).

    Raises:
        PlanError: the targets match no linear layer of the model (``validate`` refuses such a graph).
    """
    targeted = _targeted(shape, lora)
    if not targeted:
        raise PlanError(
            f"lora.target_modules {lora.target_modules!r} match no linear layer of the model "
            f"({', '.join(sorted({n.rsplit('.', 1)[-1] for n in _linear_layers(shape)}))})"
        )
    adapters = sum(lora.rank * (rows + cols) for rows, cols in targeted.values())
    head = shape.head != "lm" and lora.train_head is not False
    trained_head = shape.hidden_size + 1 if head else 0
    return AdapterCount(adapters, len(targeted), trained_head, 2 if head else 0)


def adapter_params(shape: ModelShape, lora: LoraShape) -> int:
    """Trained parameters of ``shape`` under ``lora``: ``Σ rank·(in + out)`` over the targeted linear layers,
    plus ``hidden + 1`` for a trained value/score head (:func:`adapter_count`). For
    ``examples/lora/grpo.yaml`` (rank 4 on q_proj and v_proj of 2 layers of width 128):
    ``2 · 2 · 4 · (128 + 128) = 4,096``."""
    return adapter_count(shape, lora).params


def adapter_shapes(shape: ModelShape, lora: LoraShape) -> dict[str, tuple[int, ...]]:
    """The adapter tensors' names (``<module>.lora_A.weight`` ``[rank, in]``, ``<module>.lora_B.weight``
    ``[out, rank]``; a trained head's ``score.weight`` ``[1, hidden]`` and ``score.bias`` ``[1]``) -> shapes:
    what an adapter sync or reallocation moves."""
    out: dict[str, tuple[int, ...]] = {}
    for name, (rows, cols) in _targeted(shape, lora).items():
        out[f"{name}.lora_A.weight"] = (lora.rank, cols)
        out[f"{name}.lora_B.weight"] = (rows, lora.rank)
    count = adapter_count(shape, lora)
    if count.head:
        out["score.weight"] = (1, shape.hidden_size)
        out["score.bias"] = (1,)
    return out


def lora_backward_flops(shape: ModelShape, lora: LoraShape, tokens: float, squares: float) -> float:
    """FLOPs of the backward pass of a LoRA model over ``tokens`` tokens whose attention blocks' squared
    lengths sum to ``squares`` (module docstring: the base's matmuls 1 × forward, attention 2 ×, adapters
    and a trained head 2 ×): ``2·tokens·(L·active_layer_params + head_params) + 8·squares·Q·L +
    4·tokens·adapters`` (a trained value/score head's ``hidden`` weights are in ``head_params``: +2 more
    per token for its weight gradient). The forward it follows: ``call_cost.token_flops``, which counts the
    adapters' ``2·tokens·adapters``."""
    count = adapter_count(shape, lora)
    base = 2.0 * tokens * (shape.num_hidden_layers * shape.active_layer_params + shape.head_params)
    attention = 8.0 * squares * shape.attention_width * shape.num_hidden_layers
    trained = 4.0 * tokens * count.adapters + (2.0 * tokens * shape.hidden_size if count.head else 0.0)
    return base + attention + trained
