"""The ``models`` section of a graph file: named sets of weights, their optimizer and EMA settings.

Plain frozen values checked field by field on construction (:class:`GraphError` naming the field's path,
``models.actor.optimizer.lr``); how models refer to each other (``init_from``, ``ema.source``) is checked by
:class:`~rlflow.dataflow.graph.Graph`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlflow.dataflow.fields import (
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_name,
    check_str,
    check_str_mapping,
    fail,
    show,
)

__all__ = [
    "DTYPES",
    "HEADS",
    "LORA_INITS",
    "SCHEDULES",
    "EmaSpec",
    "LoraSpec",
    "ModelSpec",
    "OptimizerSpec",
    "model_tokenizer",
    "resolve_dtype",
]

HEADS: tuple[str, ...] = ("lm", "value", "score")
# ``auto``: what the runtime builds on the model's device (resolve_dtype): bfloat16 on CUDA, float32 on CPU
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
# peft's ``init_lora_weights``: ``default`` Kaiming-uniform A, zero B; ``gaussian`` N(0, 1/r) A, zero B
LORA_INITS: tuple[str, ...] = ("default", "gaussian")


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW settings of a trainable model (Loshchilov & Hutter, 2019, "Decoupled Weight Decay").

    ``lr`` is the peak learning rate; ``schedule`` decays it after ``warmup_steps`` (linear warmup) down to
    ``lr * min_lr_ratio`` (constant | linear | cosine); ``grad_clip`` is the max global grad norm (0 = off).
    """

    lr: float = 1.0e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1.0e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        check_float("optimizer.lr", self.lr, 0.0, strict=True)
        check_float("optimizer.weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.betas, tuple | list) or len(self.betas) != 2:
            fail("optimizer.betas", f"expected two numbers [beta1, beta2], got {show(self.betas)}")
        for i, beta in enumerate(self.betas):
            check_float(f"optimizer.betas[{i}]", beta, 0.0)
            if beta >= 1.0:
                fail(f"optimizer.betas[{i}]", f"must be < 1, got {beta}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        check_float("optimizer.eps", self.eps, 0.0, strict=True)
        check_float("optimizer.grad_clip", self.grad_clip, 0.0)
        check_int("optimizer.warmup_steps", self.warmup_steps, 0)
        check_choice("optimizer.schedule", self.schedule, SCHEDULES)
        check_float("optimizer.min_lr_ratio", self.min_lr_ratio, 0.0)
        if self.min_lr_ratio > 1.0:
            fail("optimizer.min_lr_ratio", f"must be <= 1, got {self.min_lr_ratio}")


@dataclass(frozen=True)
class EmaSpec:
    """A model that follows another as an exponential moving average (e.g. a reference that tracks the
    actor: TR-DPO's soft update, Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good
    Alignment", §3).

    After every execution of a train node of ``source`` (once per iteration), before the model's next call:
    ``w ← η · w_source + (1 − η) · w`` for every parameter (``torch.lerp(w, w_source, η)``).
    """

    source: str
    eta: float = 0.01

    def __post_init__(self) -> None:
        check_str("ema.source", self.source)
        check_float("ema.eta", self.eta, 0.0, strict=True)
        if self.eta > 1.0:
            fail("ema.eta", f"must be in (0, 1], got {self.eta}")


@dataclass(frozen=True)
class LoraSpec:
    """Low-rank adapters on a model's linear layers (Hu et al. 2022, "LoRA: Low-Rank Adaptation of Large
    Language Models", eq. 3): a targeted layer computes ``W x + (alpha / rank) · B A x`` with ``A [rank, in]``
    and ``B [out, rank]``; ``W`` (the base) stays frozen and only ``A``/``B`` are trained, through the
    ``peft`` library.

    ``target_modules``: module names (the last part of a dotted name, as peft matches them: ``q_proj``,
    ``v_proj``; or ``all-linear``, every linear layer but the output head). ``init``: ``default``
    (Kaiming-uniform ``A``, zero ``B``) or ``gaussian`` (``A ~ N(0, 1/rank)``, zero ``B``); both start as
    the base model exactly. ``dropout``: 0 only (rlflow trains in eval mode, dropout off; a value is refused,
    not ignored). ``train_head``: train a ``value``/``score`` head in full beside the adapters
    (default: yes, a fresh head has to learn; peft's sequence-classification default too); an ``lm`` head
    model cannot ask for it (target ``lm_head`` instead).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"
    init: str = "default"
    train_head: bool | None = None

    def __post_init__(self) -> None:
        check_int("lora.rank", self.rank, 1)
        check_float("lora.alpha", self.alpha, 0.0, strict=True)
        check_float("lora.dropout", self.dropout, 0.0)
        if self.dropout != 0.0:
            fail(
                "lora.dropout",
                f"{self.dropout}: rlflow trains with dropout off (eval mode, so that the trainer's log-probs "
                "are the sampler's), so adapter dropout would do nothing; leave it 0",
            )
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != "all-linear":
                targets = (targets,)
        elif isinstance(targets, list | tuple):
            if not targets:
                fail(
                    "lora.target_modules", "lists no module; name some (q_proj, v_proj, ...) or 'all-linear'"
                )
            targets = tuple(targets)
            if "all-linear" in targets:
                fail("lora.target_modules", "write all-linear as a plain string (target_modules: all-linear)")
        else:
            fail(
                "lora.target_modules", f"expected a list of module names or 'all-linear', got {show(targets)}"
            )
        if isinstance(targets, tuple):
            for i, t in enumerate(targets):
                check_str(f"lora.target_modules[{i}]", t)
        object.__setattr__(self, "target_modules", targets)
        check_choice("lora.init", self.init, LORA_INITS)
        if self.train_head is not None:
            check_bool("lora.train_head", self.train_head)

    @property
    def scaling(self) -> float:
        """``alpha / rank``: the factor on ``B A x`` (Hu et al. 2022, §4.1)."""
        return self.alpha / self.rank


def resolve_dtype(dtype: str, device_type: str) -> str:
    """The dtype a model of graph ``dtype`` is built in on a ``device_type`` (``cuda``, ``cpu``, ...) device:
    ``auto`` is ``bfloat16`` on CUDA (what GPU RL trainers run: half float32's memory and traffic, the
    tensor cores' rate) and ``float32`` elsewhere (CPU matmuls in bfloat16 are slower and less exact);
    any other name is returned unchanged."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type == "cuda" else "float32"


@dataclass(frozen=True)
class ModelSpec:
    """A named set of weights.

    Exactly one of ``path`` (a Hugging Face model: a local directory, or a Hub id such as
    ``Qwen/Qwen3-0.6B``) and ``config`` (a Hugging Face config dict to initialise from) unless ``init_from``
    names another model, whose architecture and initial weights are then copied (``path``/``config`` may be
    omitted). ``tokenizer`` (a directory or a Hub id) defaults to ``path``. ``revision``: the branch, tag
    or commit of a Hub id ``path`` (default ``main``; ``<id>@<revision>`` in ``path`` or ``tokenizer`` says
    the same). A Hub id is resolved once, when the graph is loaded, to its snapshot in the Hugging Face
    cache, downloaded unless ``HF_HUB_OFFLINE=1`` (:mod:`rlflow.dataflow.hub`); an existing directory of
    the same name wins.
    ``head``: ``lm`` (next-token logits), ``value`` (per-token value, a critic), ``score`` (a scalar at the
    last real token, a reward model). ``dtype``: the parameters' dtype, ``auto`` (default: bfloat16 on a
    CUDA device, float32 on CPU, :func:`resolve_dtype`), ``float32``, ``bfloat16`` or ``float16``.
    ``ema``: the model follows another model's weights instead of being trained (:class:`EmaSpec`).
    ``lora``: train low-rank adapters on frozen base weights instead of every weight (:class:`LoraSpec`).
    ``base_of``: this (frozen) model is the base of that LoRA model: its calls run that model's weights
    with the adapters disabled, no copy is built (a LoRA actor's reference); no ``path``/``config``.
    """

    name: str
    path: str | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None
    revision: str | None = None
    init_from: str | None = None
    head: str = "lm"
    trainable: bool = True
    dtype: str = "auto"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    ema: EmaSpec | None = None
    lora: LoraSpec | None = None
    base_of: str | None = None

    def __post_init__(self) -> None:
        check_name("models", self.name)
        p = f"models.{self.name}"
        check_str(f"{p}.path", self.path, optional=True)
        if self.config is not None:
            check_str_mapping(f"{p}.config", self.config)
            object.__setattr__(self, "config", dict(self.config))
        check_str(f"{p}.tokenizer", self.tokenizer, optional=True)
        check_str(f"{p}.revision", self.revision, optional=True)
        if self.revision is not None and self.path is None:
            fail(f"{p}.revision", "picks a revision of a Hub id 'path', and the model has no 'path'")
        check_str(f"{p}.init_from", self.init_from, optional=True)
        check_str(f"{p}.base_of", self.base_of, optional=True)
        if self.base_of is not None:
            given = [
                k for k in ("path", "config", "init_from", "ema", "lora") if getattr(self, k) is not None
            ]
            if given:
                fail(
                    f"{p}.base_of",
                    f"the model runs the weights of '{self.base_of}' with its adapters off; it takes no "
                    f"{', '.join(repr(k) for k in given)}",
                )
            if self.base_of == self.name:
                fail(f"{p}.base_of", "a model cannot be its own base")
        if self.path is not None and self.config is not None:
            fail(p, "give either 'path' (a Hugging Face directory) or 'config' (a model config), not both")
        if self.path is None and self.config is None and self.init_from is None and self.base_of is None:
            fail(p, "needs 'path' (a Hugging Face directory) or 'config' (a model config to initialise)")
        if self.init_from == self.name:
            fail(f"{p}.init_from", "a model cannot be initialised from itself")
        check_choice(f"{p}.head", self.head, HEADS)
        check_bool(f"{p}.trainable", self.trainable)
        check_choice(f"{p}.dtype", self.dtype, DTYPES)
        if self.dtype == "float16" and self.trainable:
            fail(
                f"{p}.dtype",
                "float16 training overflows without loss scaling, which rlflow does not do; train in "
                "bfloat16 (the same memory) or float32 (float16 stays allowed for frozen models)",
            )
        if not isinstance(self.optimizer, OptimizerSpec):
            fail(f"{p}.optimizer", f"expected an OptimizerSpec, got {show(self.optimizer)}")
        if self.ema is not None:
            if not isinstance(self.ema, EmaSpec):
                fail(f"{p}.ema", f"expected an EmaSpec, got {show(self.ema)}")
            if self.ema.source == self.name:
                fail(f"{p}.ema.source", "a model cannot follow itself")
        if self.lora is not None:
            if not isinstance(self.lora, LoraSpec):
                fail(f"{p}.lora", f"expected a LoraSpec, got {show(self.lora)}")
            if not self.trainable:
                fail(f"{p}.lora", "the model is frozen (trainable: false): adapters on it would never train")
            if self.ema is not None:
                fail(f"{p}.lora", "a model that follows an EMA is not trained; it cannot carry adapters")
            if self.head == "lm" and self.lora.train_head:
                fail(
                    f"{p}.lora.train_head",
                    "an lm head is the vocabulary projection, not a fresh head; list 'lm_head' in "
                    "target_modules to adapt it",
                )

    @property
    def tokenizer_dir(self) -> str | None:
        """The tokenizer directory given for this model itself (``tokenizer``, else ``path``)."""
        return self.tokenizer if self.tokenizer is not None else self.path


def model_tokenizer(models: Mapping[str, ModelSpec], model: str) -> str | None:
    """The tokenizer directory of ``model``: its own ``tokenizer``/``path``, else its ``init_from``'s
    or ``base_of`` (followed to the first model that names one); ``None`` when none does."""
    m: ModelSpec | None = models[model]
    while m is not None:
        if m.tokenizer_dir is not None:
            return m.tokenizer_dir
        source = m.init_from if m.init_from is not None else m.base_of
        m = models[source] if source is not None else None
    return None
