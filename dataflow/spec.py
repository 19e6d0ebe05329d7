"""Graph specification dataclasses: what a graph file says, validated field by field on construction.

These are plain frozen values; :class:`rlflow.dataflow.graph.Graph` checks how they fit together (keys, edges,
functions, batch divisibility, plan). Errors name the field by its path in the graph file
(``nodes.actor_gen.batch_size``) and raise :class:`GraphError` (plan fields: :class:`PlanError`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeAlias

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.registry import NODE_KINDS, did_you_mean

__all__ = [
    "BATCH_UNITS",
    "DTYPES",
    "ENGINES",
    "HEADS",
    "LAUNCHERS",
    "MAX_DEVICES",
    "MAX_STALENESS",
    "NODE_ENGINES",
    "OFFLOAD_DEVICES",
    "SCHEDULES",
    "TRAIN_ENGINES",
    "ZERO_STAGES",
    "DataSpec",
    "DeepSpeedSpec",
    "EmaSpec",
    "GeneratorSpec",
    "GraphSpec",
    "Layout",
    "ModelSpec",
    "NodePlacement",
    "NodeSpec",
    "OptimizerSpec",
    "Plan",
    "RunSpec",
    "check_plan_engine",
    "check_plan_flag",
    "parse_devices",
    "resolve_dtype",
    "resolve_engine",
    "resolve_recompute",
    "resolve_reshard",
]

HEADS: tuple[str, ...] = ("lm", "value", "score")
# ``auto``: what the runtime builds on the model's device (resolve_dtype): bfloat16 on CUDA, float32 on CPU
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
BATCH_UNITS: tuple[str, ...] = ("prompts", "samples")
# What executes a generate node: rlflow's decode loop (rlflow.nodes.generation) or a vLLM engine
# (rlflow.nodes.engines.vllm_engine; one per data-parallel replica, tensor-parallel degree 1).
ENGINES: tuple[str, ...] = ("builtin", "vllm")
# What a node may say: an engine, or ``auto`` (the plan chooses one: :func:`resolve_engine`).
NODE_ENGINES: tuple[str, ...] = (*ENGINES, "auto")
# What trains a train node: rlflow's own FSDP2 / DTensor / pipeline (1F1B) layouts (``builtin``) or DeepSpeed
# ZeRO (rlflow.schedulers.runtime.distributed.zero; data parallel only: tp = pp = 1).
TRAIN_ENGINES: tuple[str, ...] = ("builtin", "deepspeed")
# DeepSpeed's ``zero_optimization.stage`` values rlflow runs (0, plain data parallel, is FSDP2's job here).
ZERO_STAGES: tuple[int, ...] = (1, 2, 3)
# DeepSpeed's ``offload_optimizer.device`` / ``offload_param.device`` values (NVMe is not supported).
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu")
# Upper bound on device ids and counts: keeps a typo such as ``devices: 0-99999999`` from allocating.
MAX_DEVICES = 65536
# Upper bound on a generate node's staleness: each unit keeps one more batch and weight version in flight
# (and the planner replays 2·η + 3 iterations); AReaL's runs use single digits.
MAX_STALENESS = 64

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def _fail(path: str, msg: str, err: type[Exception] = GraphError) -> None:
    raise err(f"{path}: {msg}")


def _show(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit string limit
        return "an integer of more than 4300 digits"
    return text if len(text) <= 60 else text[:57] + "..."


def _check_int(
    path: str, value: object, minimum: int | None = None, err: type[Exception] = GraphError
) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(path, f"expected an integer, got {_show(value)}", err)
    assert isinstance(value, int)
    if minimum is not None and value < minimum:
        _fail(path, f"must be >= {minimum}, got {value}", err)


def _check_float(path: str, value: object, minimum: float | None = None, strict: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(path, f"expected a number, got {_show(value)}")
    assert isinstance(value, int | float)
    if (isinstance(value, int) and abs(value) > 2**1000) or not math.isfinite(value):
        _fail(path, f"must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        _fail(path, f"must be {'>' if strict else '>='} {minimum}, got {value}")


def _check_str(path: str, value: object, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        _fail(path, f"expected a non-empty string, got {_show(value)}")


def _check_bool(path: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(path, f"expected true or false, got {_show(value)}")


def _check_choice(path: str, value: object, choices: tuple[str, ...]) -> None:
    _check_str(path, value)
    if value not in choices:
        _fail(path, f"'{value}' is not one of {', '.join(choices)}{did_you_mean(str(value), choices)}")


def _a_node(kind: str) -> str:
    """``a generate node`` / ``an inference node``: a node kind with its article, for messages."""
    return f"{'an' if kind[:1] in ('a', 'e', 'i', 'o', 'u') else 'a'} {kind} node"


def _check_name(path: str, value: object) -> None:
    _check_str(path, value)
    assert isinstance(value, str)
    if not _NAME_RE.match(value):
        _fail(
            path, f"'{value}' is not a valid name (letters, digits, '_', '-', '.'; not starting with a digit)"
        )


def _check_str_mapping(path: str, value: object) -> None:
    if not isinstance(value, Mapping):
        _fail(path, f"expected a mapping, got {_show(value)}")
    assert isinstance(value, Mapping)
    for k in value:
        if not isinstance(k, str):
            _fail(path, f"keys must be strings, got {_show(k)}")


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
        _check_float("optimizer.lr", self.lr, 0.0, strict=True)
        _check_float("optimizer.weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.betas, tuple | list) or len(self.betas) != 2:
            _fail("optimizer.betas", f"expected two numbers [beta1, beta2], got {_show(self.betas)}")
        for i, beta in enumerate(self.betas):
            _check_float(f"optimizer.betas[{i}]", beta, 0.0)
            if beta >= 1.0:
                _fail(f"optimizer.betas[{i}]", f"must be < 1, got {beta}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        _check_float("optimizer.eps", self.eps, 0.0, strict=True)
        _check_float("optimizer.grad_clip", self.grad_clip, 0.0)
        _check_int("optimizer.warmup_steps", self.warmup_steps, 0)
        _check_choice("optimizer.schedule", self.schedule, SCHEDULES)
        _check_float("optimizer.min_lr_ratio", self.min_lr_ratio, 0.0)
        if self.min_lr_ratio > 1.0:
            _fail("optimizer.min_lr_ratio", f"must be <= 1, got {self.min_lr_ratio}")


@dataclass(frozen=True)
class DeepSpeedSpec:
    """DeepSpeed ZeRO settings of a train node with ``engine: deepspeed`` (Rajbhandari et al. 2020, "ZeRO:
    Memory Optimizations Toward Training Trillion Parameter Models"; Ren et al. 2021, "ZeRO-Offload").

    Named after DeepSpeed's own config keys: ``zero_stage`` is ``zero_optimization.stage`` (1: optimizer
    states partitioned over the node's data-parallel ranks, 2: and gradients, 3: and parameters);
    ``offload_optimizer`` / ``offload_param`` are ``zero_optimization.offload_optimizer.device`` /
    ``offload_param.device`` (``none`` or ``cpu``; DeepSpeed offloads parameters with stage 3 only).
    """

    zero_stage: int = 2
    offload_optimizer: str = "none"
    offload_param: str = "none"

    def __post_init__(self) -> None:
        _check_int("deepspeed.zero_stage", self.zero_stage)
        if self.zero_stage not in ZERO_STAGES:
            _fail(
                "deepspeed.zero_stage",
                f"{self.zero_stage} is not one of {', '.join(map(str, ZERO_STAGES))} (ZeRO stage 1: "
                "optimizer states, 2: and gradients, 3: and parameters partitioned)",
            )
        _check_choice("deepspeed.offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        _check_choice("deepspeed.offload_param", self.offload_param, OFFLOAD_DEVICES)
        if self.offload_param != "none" and self.zero_stage != 3:
            _fail(
                "deepspeed.offload_param",
                f"DeepSpeed offloads parameters with ZeRO stage 3 only; this node has zero_stage "
                f"{self.zero_stage} (use zero_stage: 3, or offload_optimizer alone)",
            )


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
        _check_str("ema.source", self.source)
        _check_float("ema.eta", self.eta, 0.0, strict=True)
        if self.eta > 1.0:
            _fail("ema.eta", f"must be in (0, 1], got {self.eta}")


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

    Exactly one of ``path`` (a local Hugging Face directory) and ``config`` (a Hugging Face config dict to
    initialise from) unless ``init_from`` names another model, whose architecture and initial weights are
    then copied (``path``/``config`` may be omitted). ``tokenizer`` defaults to ``path``.
    ``head``: ``lm`` (next-token logits), ``value`` (per-token value, a critic), ``score`` (a scalar at the
    last real token, a reward model). ``dtype``: the parameters' dtype, ``auto`` (default: bfloat16 on a
    CUDA device, float32 on CPU, :func:`resolve_dtype`), ``float32``, ``bfloat16`` or ``float16``.
    ``ema``: the model follows another model's weights instead of being trained (:class:`EmaSpec`).
    """

    name: str
    path: str | None = None
    config: dict[str, Any] | None = None
    tokenizer: str | None = None
    init_from: str | None = None
    head: str = "lm"
    trainable: bool = True
    dtype: str = "auto"
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    ema: EmaSpec | None = None

    def __post_init__(self) -> None:
        _check_name("models", self.name)
        p = f"models.{self.name}"
        _check_str(f"{p}.path", self.path, optional=True)
        if self.config is not None:
            _check_str_mapping(f"{p}.config", self.config)
            object.__setattr__(self, "config", dict(self.config))
        _check_str(f"{p}.tokenizer", self.tokenizer, optional=True)
        _check_str(f"{p}.init_from", self.init_from, optional=True)
        if self.path is not None and self.config is not None:
            _fail(p, "give either 'path' (a Hugging Face directory) or 'config' (a model config), not both")
        if self.path is None and self.config is None and self.init_from is None:
            _fail(p, "needs 'path' (a Hugging Face directory) or 'config' (a model config to initialise)")
        if self.init_from == self.name:
            _fail(f"{p}.init_from", "a model cannot be initialised from itself")
        _check_choice(f"{p}.head", self.head, HEADS)
        _check_bool(f"{p}.trainable", self.trainable)
        _check_choice(f"{p}.dtype", self.dtype, DTYPES)
        if self.dtype == "float16" and self.trainable:
            _fail(
                f"{p}.dtype",
                "float16 training overflows without loss scaling, which rlflow does not do; train in "
                "bfloat16 (the same memory) or float32 (float16 stays allowed for frozen models)",
            )
        if not isinstance(self.optimizer, OptimizerSpec):
            _fail(f"{p}.optimizer", f"expected an OptimizerSpec, got {_show(self.optimizer)}")
        if self.ema is not None:
            if not isinstance(self.ema, EmaSpec):
                _fail(f"{p}.ema", f"expected an EmaSpec, got {_show(self.ema)}")
            if self.ema.source == self.name:
                _fail(f"{p}.ema.source", "a model cannot follow itself")

    @property
    def tokenizer_dir(self) -> str | None:
        """The tokenizer directory given for this model itself (``tokenizer``, else ``path``)."""
        return self.tokenizer if self.tokenizer is not None else self.path


@dataclass(frozen=True)
class GeneratorSpec:
    """A registered data generator (``name``) and its keyword arguments."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_str("data.generator.name", self.name)
        _check_str_mapping("data.generator.args", self.args)
        object.__setattr__(self, "args", dict(self.args))


@dataclass(frozen=True)
class DataSpec:
    """Where prompts (and answers, preferences, ...) come from and which batch keys they produce.

    Exactly one of ``train`` (a .jsonl or .parquet file) and ``generator``. ``fields`` maps batch key ->
    column name. Each key in ``tokenize`` produces ``<key>_ids`` / ``<key>_mask`` (``prompt`` left-padded,
    others right-padded with EOS appended) instead of the raw key, using the tokenizer of model ``tokenizer``.
    A tokenized prompt may have at most ``max_prompt_tokens`` tokens (and at most what generation leaves
    of the model's positions, ``rlflow.dataflow.context.prompt_limit``); ``overlong`` says what happens to a
    longer one: ``error`` (default: the run stops before training, naming file, row and length),
    ``truncate`` (its last tokens are kept: cut on the left, as verl's ``truncation: left``) or ``drop``.
    """

    train: str | None = None
    generator: GeneratorSpec | None = None
    eval: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    tokenize: tuple[str, ...] = ()
    tokenizer: str | None = None
    shuffle: bool = True
    max_prompt_tokens: int | None = None
    overlong: str = "error"

    def __post_init__(self) -> None:
        _check_str("data.train", self.train, optional=True)
        _check_str("data.eval", self.eval, optional=True)
        if self.generator is not None and not isinstance(self.generator, GeneratorSpec):
            _fail("data.generator", f"expected a GeneratorSpec, got {_show(self.generator)}")
        if (self.train is None) == (self.generator is None):
            _fail("data", "give exactly one of 'train' (a .jsonl/.parquet file) and 'generator'")
        if self.train is not None and not self.train.endswith((".jsonl", ".parquet")):
            _fail("data.train", f"'{self.train}' must be a .jsonl or .parquet file")
        _check_str_mapping("data.fields", self.fields)
        for key, column in self.fields.items():
            _check_name("data.fields", key)
            _check_str(f"data.fields.{key}", column)
        object.__setattr__(self, "fields", dict(self.fields))
        if isinstance(self.tokenize, str) or not isinstance(self.tokenize, tuple | list):
            _fail("data.tokenize", f"expected a list of field keys, got {_show(self.tokenize)}")
        for key in self.tokenize:
            _check_str("data.tokenize", key)
            if key not in self.fields:
                _fail(
                    "data.tokenize",
                    f"'{key}' is not a key of data.fields{did_you_mean(key, self.fields)}; "
                    f"fields: {', '.join(self.fields) or '(none)'}",
                )
        if len(set(self.tokenize)) != len(self.tokenize):
            _fail("data.tokenize", f"lists a key twice: {list(self.tokenize)}")
        object.__setattr__(self, "tokenize", tuple(self.tokenize))
        _check_str("data.tokenizer", self.tokenizer, optional=True)
        if self.tokenize and self.tokenizer is None:
            _fail("data.tokenizer", "data.tokenize needs 'tokenizer': the model whose tokenizer to use")
        _check_bool("data.shuffle", self.shuffle)
        if self.max_prompt_tokens is not None:
            _check_int("data.max_prompt_tokens", self.max_prompt_tokens, 1)
        _check_choice("data.overlong", self.overlong, OVERLONG)
        produced: dict[str, str] = {}
        for key in self.fields:
            for out in (f"{key}_ids", f"{key}_mask") if key in self.tokenize else (key,):
                if out in produced:
                    _fail("data.fields", f"keys '{produced[out]}' and '{key}' both produce batch key '{out}'")
                produced[out] = key

    def batch_keys(self) -> dict[str, str]:
        """Batch keys the data set produces -> the field key they come from."""
        out: dict[str, str] = {}
        for key in self.fields:
            if key in self.tokenize:
                out[f"{key}_ids"] = key
                out[f"{key}_mask"] = key
            else:
                out[key] = key
        return out


@dataclass(frozen=True)
class NodeSpec:
    """One model function call.

    ``inputs``/``outputs`` bind the function's canonical parameters to batch keys: a tuple of keys
    (positional) or a mapping ``param -> key``; :class:`~rlflow.dataflow.graph.Graph` resolves them to ordered
    mappings. An output bound to ``None`` is discarded. ``batch_size`` counts rows per iteration in
    ``batch_unit`` (``prompts``, or ``samples`` = prompts × the upstream generate node's ``args.n``);
    ``mini_batches`` optimizer steps per epoch and ``epochs`` passes (train nodes). ``engine`` (generate
    nodes): ``builtin`` (rlflow's decode loop), ``vllm`` (:data:`ENGINES`) or ``auto``: the plan's
    choice (:func:`resolve_engine`; ``plan: auto`` prices both). ``staleness`` (generate nodes; η, an
    integer >= 0): how many policy versions (train iterations of the node's model) behind the newest the
    node may sample with; 0 is the synchronous loop, η >= 1 lets the runtime generate the batches of the
    next iterations while the current one trains (asynchronous RL; README "Asynchronous RL").
    ``interrupt_every`` (generate nodes with ``staleness`` >= 1; tokens, 0: off): interruptible
    generation (partial rollouts): the responses are sampled in segments of this many new tokens, and
    each later segment continues the unfinished ones under one policy version newer (as far as the
    iteration's own on-policy version), so every token carries the version that sampled it
    (``token_weight_version``; README "Asynchronous RL").
    Train nodes: ``engine: deepspeed`` trains with DeepSpeed ZeRO, set by ``deepspeed``
    (:class:`DeepSpeedSpec`: ``zero_stage``, ``offload_optimizer``, ``offload_param``). ``recompute``
    (train nodes): full activation recomputation (gradient checkpointing: each decoder layer keeps only its
    input and reruns its forward in the backward, Chen et al. 2016; Korthikanti et al. 2022): ``false``
    (default), ``true``, or ``auto``: the plan's choice (:func:`resolve_recompute`; ``plan: auto`` turns it
    on where a layout would not fit otherwise or where it is faster overall). ``reshard`` (train nodes on
    FSDP2, data parallel dp > 1): ``true`` (default) re-gathers every FSDP2 unit's weights each micro-batch,
    forward and backward, and reduce-scatters its gradients each micro-batch (ZeRO-3); ``false`` keeps the
    weights gathered and accumulates full gradients locally for the whole optimizer step: one all-gather
    and one reduce-scatter per unit per step (the communication of Megatron-LM's distributed optimizer,
    ZeRO-1; Rajbhandari et al. 2020) for full stage weights and gradients in memory; ``auto``: the plan's
    choice (:func:`resolve_reshard`). Refused with ``engine: deepspeed`` (its ``zero_stage`` decides).
    """

    name: str
    kind: str
    function: str
    model: str | None = None
    inputs: tuple[str, ...] | dict[str, str] = ()
    outputs: tuple[str, ...] | dict[str, str | None] = ()
    batch_size: int = 1
    batch_unit: str = "prompts"
    mini_batches: int = 1
    epochs: int = 1
    args: dict[str, Any] = field(default_factory=dict)
    engine: str = "builtin"
    staleness: int = 0
    interrupt_every: int = 0
    deepspeed: DeepSpeedSpec | None = None
    recompute: bool | str = False
    reshard: bool | str = True

    def __post_init__(self) -> None:
        _check_name("nodes", self.name)
        p = f"nodes.{self.name}"
        if self.name == "data":
            _fail(p, "'data' is reserved for the data set (the producer of dataset keys)")
        _check_choice(f"{p}.kind", self.kind, NODE_KINDS)
        _check_str(f"{p}.function", self.function)
        _check_str(f"{p}.model", self.model, optional=True)
        for what in ("inputs", "outputs"):
            value = getattr(self, what)
            if isinstance(value, Mapping):
                _check_str_mapping(f"{p}.{what}", value)
                for param, key in value.items():
                    if not (what == "outputs" and key is None):
                        _check_name(f"{p}.{what}.{param}", key)
                object.__setattr__(self, what, dict(value))
            elif isinstance(value, tuple | list):
                for i, key in enumerate(value):
                    if not (what == "outputs" and key is None):
                        _check_name(f"{p}.{what}[{i}]", key)
                object.__setattr__(self, what, tuple(value))
            else:
                _fail(f"{p}.{what}", f"expected a list of keys or a mapping param: key, got {_show(value)}")
        _check_int(f"{p}.batch_size", self.batch_size, 1)
        _check_choice(f"{p}.batch_unit", self.batch_unit, BATCH_UNITS)
        _check_int(f"{p}.mini_batches", self.mini_batches, 1)
        _check_int(f"{p}.epochs", self.epochs, 1)
        if self.kind != "train" and self.epochs != 1:
            _fail(f"{p}.epochs", f"only train nodes make several passes; this is {_a_node(self.kind)}")
        _check_str_mapping(f"{p}.args", self.args)
        object.__setattr__(self, "args", dict(self.args))
        allowed = TRAIN_ENGINES if self.kind == "train" else NODE_ENGINES if self.kind == "generate" else ()
        if (
            self.engine != "builtin"
            and self.engine not in allowed
            and self.engine in (*NODE_ENGINES, *TRAIN_ENGINES)
        ):
            runs = "train" if self.engine in TRAIN_ENGINES else "generate"
            _fail(
                f"{p}.engine", f"engine '{self.engine}' runs {runs} nodes only; this is {_a_node(self.kind)}"
            )
        _check_choice(f"{p}.engine", self.engine, allowed or ("builtin",))
        if self.deepspeed is not None:
            if not isinstance(self.deepspeed, DeepSpeedSpec):
                _fail(f"{p}.deepspeed", f"expected a DeepSpeedSpec, got {_show(self.deepspeed)}")
            if self.engine != "deepspeed":
                _fail(
                    f"{p}.deepspeed",
                    f"DeepSpeed settings need 'engine: deepspeed' (engine is '{self.engine}')",
                )
        elif self.engine == "deepspeed":
            object.__setattr__(self, "deepspeed", DeepSpeedSpec())
        _check_int(f"{p}.staleness", self.staleness, 0)
        if self.staleness > MAX_STALENESS:
            _fail(
                f"{p}.staleness",
                f"must be <= {MAX_STALENESS} (one batch in flight per version of lag), got {self.staleness}",
            )
        if self.staleness and self.kind != "generate":
            _fail(
                f"{p}.staleness",
                f"only generate nodes may sample with older weights; this is {_a_node(self.kind)}",
            )
        _check_int(f"{p}.interrupt_every", self.interrupt_every, 0)
        if not isinstance(self.recompute, bool) and self.recompute != "auto":
            _fail(f"{p}.recompute", f"expected true, false or 'auto', got {_show(self.recompute)}")
        if self.recompute is not False and self.kind != "train":
            _fail(
                f"{p}.recompute",
                f"activation recomputation saves a backward's memory; this is {_a_node(self.kind)}",
            )
        if not isinstance(self.reshard, bool) and self.reshard != "auto":
            _fail(f"{p}.reshard", f"expected true, false or 'auto', got {_show(self.reshard)}")
        if self.reshard is not True and self.kind != "train":
            _fail(
                f"{p}.reshard",
                f"resharding applies to a train node's FSDP2 units; this is {_a_node(self.kind)}",
            )
        if self.reshard is not True and self.engine == "deepspeed":
            _fail(
                f"{p}.reshard",
                "applies to FSDP2 train nodes; with 'engine: deepspeed' the ZeRO stage decides what is "
                f"sharded (set nodes.{self.name}.deepspeed.zero_stage, or drop reshard)",
            )
        if self.interrupt_every and self.kind != "generate":
            _fail(
                f"{p}.interrupt_every",
                f"only generate nodes sample tokens to interrupt; this is {_a_node(self.kind)}",
            )
        if self.interrupt_every and not self.staleness:
            _fail(
                f"{p}.interrupt_every",
                "interruptible generation continues a rollout under newer weights, which only an "
                "asynchronous node (staleness >= 1) samples ahead of; set nodes."
                f"{self.name}.staleness or drop interrupt_every",
            )

    @property
    def input_keys(self) -> tuple[str, ...]:
        """Batch keys read, in binding order."""
        return tuple(self.inputs.values()) if isinstance(self.inputs, dict) else tuple(self.inputs)

    @property
    def output_keys(self) -> tuple[str, ...]:
        """Batch keys written (discarded outputs left out), in binding order."""
        values = self.outputs.values() if isinstance(self.outputs, dict) else self.outputs
        return tuple(k for k in values if k is not None)


OVERLONG = ("error", "truncate", "drop")
"""What ``data.overlong`` may say about a prompt longer than the limit."""

_LAYOUT_RE = re.compile(r"([dtpm])(\d+)")
_MAX_DIGITS = 18  # longer digit runs in a layout or device list are out of range anyway


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one node on its mesh: data (``dp``), tensor (``tp``), pipeline (``pp``), and
    the number of micro-batches each data-parallel rank splits its rows into. Written ``d2t2p1m4``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batches"):
            _check_int(f"layout.{name}", getattr(self, name), 1, PlanError)
            if getattr(self, name) > MAX_DEVICES * 1024:
                _fail(f"layout.{name}", f"{getattr(self, name)} is too large", PlanError)

    @property
    def size(self) -> int:
        """Devices the layout needs: dp × tp × pp."""
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``d2t2p1m4`` (any order, each of d/t/p/m at most once, missing ones = 1).

        Raises:
            PlanError: on any other text.
        """
        if not isinstance(text, str):
            raise PlanError(f"layout: expected a string like 'd2t2p1m4', got {_show(text)}")
        parts = _LAYOUT_RE.findall(text)
        if any(len(b) > _MAX_DIGITS for _, b in parts):  # int() of 4300+ digits raises ValueError
            raise PlanError(f"layout {_show(text)}: a degree is too large")
        if not text or "".join(a + b for a, b in parts) != text or len({a for a, _ in parts}) != len(parts):
            raise PlanError(
                f"layout '{text}': expected letters d (data), t (tensor), p (pipeline), m (micro-batches) "
                "each followed by a degree, e.g. 'd2t2p1m4'"
            )
        degrees = {a: int(b) for a, b in parts}
        return cls(degrees.get("d", 1), degrees.get("t", 1), degrees.get("p", 1), degrees.get("m", 1))

    def __str__(self) -> str:
        return f"d{self.dp}t{self.tp}p{self.pp}m{self.micro_batches}"


def parse_devices(value: object, limit: int = MAX_DEVICES) -> tuple[int, ...]:
    """Parse a device set: an int, a list of ints, or text ``"0-3"``, ``"0,2,4"``, ``"0-1,4-5"``.

    Raises:
        PlanError: on malformed text, an id outside ``[0, limit)``, or a device listed twice.
    """
    items: list[tuple[int, int]] = []
    if isinstance(value, bool):
        raise PlanError(f"devices: expected ids like '0-3' or [0, 1], got {_show(value)}")
    if isinstance(value, int):
        items.append((value, value))
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int):
                raise PlanError(f"devices: expected integer ids, got {_show(v)}")
            items.append((v, v))
    elif isinstance(value, str):
        for part in value.replace(" ", "").split(","):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not m:
                raise PlanError(f"devices '{value}': expected ids like '0-3', '0,2,4' or '0-1,4-5'")
            if max(len(m.group(1)), len(m.group(2) or "")) > _MAX_DIGITS:  # int() of 4300+ digits raises
                raise PlanError(
                    f"devices {_show(value)}: a device id is too large (devices are 0..{limit - 1})"
                )
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise PlanError(f"devices '{value}': range {lo}-{hi} is empty")
            items.append((lo, hi))
    else:
        raise PlanError(f"devices: expected ids like '0-3' or [0, 1], got {_show(value)}")
    if not items:
        raise PlanError("devices: the mesh is empty")
    for lo, hi in items:
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise PlanError(f"devices: device {bad} does not exist (devices are 0..{limit - 1})")
    devices = [d for lo, hi in items for d in range(lo, hi + 1)]
    seen: set[int] = set()
    for d in devices:
        if d in seen:
            raise PlanError(f"devices: device {d} is listed twice in {_show(value)}")
        seen.add(d)
    return tuple(devices)


@dataclass(frozen=True)
class NodePlacement:
    """The mesh (ordered device ids) and layout of one node. ``len(devices)`` must equal ``layout.size``.

    ``engine``: the engine the plan runs a generate node with (:data:`ENGINES`; ``None``: the node's own,
    builtin for ``engine: auto``, :func:`resolve_engine`). ``recompute``: whether a train node with
    ``recompute: auto`` recomputes activations (``None``: the node's own, off for ``auto``,
    :func:`resolve_recompute`). ``reshard``: whether a train node with ``reshard: auto`` reshards its FSDP2
    units after every micro-batch (``None``: the node's own, on for ``auto``, :func:`resolve_reshard`).
    """

    devices: tuple[int, ...]
    layout: Layout = field(default_factory=Layout)
    engine: str | None = None
    recompute: bool | None = None
    reshard: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", parse_devices(self.devices))
        self._check()

    @classmethod
    def on_mesh(
        cls,
        devices: tuple[int, ...],
        layout: Layout,
        engine: str | None = None,
        recompute: bool | None = None,
        reshard: bool | None = None,
    ) -> NodePlacement:
        """A placement on a mesh the caller built itself (the planner's candidate meshes, ranges of
        device ids): ``devices`` is taken as a valid mesh, distinct ids in ``[0, MAX_DEVICES)``, without
        the constructor's ``parse_devices`` pass, which costs O(devices) per placement and dominated
        planning on 1,024 devices. The layout, engine, recompute, reshard and mesh size are checked as the
        constructor checks them. Devices read from a user's file go through the constructor.

        Raises:
            PlanError: as the constructor, except for the device ids themselves.
        """
        if type(devices) is not tuple:
            raise PlanError(f"devices: expected a tuple of device ids, got {_show(devices)}")
        placement = object.__new__(cls)
        for name, value in (
            ("devices", devices),
            ("layout", layout),
            ("engine", engine),
            ("recompute", recompute),
            ("reshard", reshard),
        ):
            object.__setattr__(placement, name, value)
        placement._check()
        return placement

    def _check(self) -> None:
        """The checks of everything but the device ids (``parse_devices`` checks those)."""
        if not isinstance(self.layout, Layout):
            raise PlanError(f"layout: expected a Layout, got {_show(self.layout)}")
        check_plan_engine(self.engine)
        check_plan_flag("recompute", self.recompute)
        check_plan_flag("reshard", self.reshard)
        if self.layout.size != len(self.devices):
            raise PlanError(
                f"layout {self.layout} needs dp×tp×pp = {self.layout.dp}×{self.layout.tp}×{self.layout.pp}"
                f" = {self.layout.size} devices but the mesh has {len(self.devices)}: "
                f"{_devices_text(self.devices)}"
            )


def check_plan_engine(value: object) -> str | None:
    """``value`` as a placement's ``engine``: ``None`` (not given) or one of :data:`ENGINES`.

    Raises:
        PlanError: ``engine: <reason>`` (callers prefix the file and node).
    """
    if value is not None and value not in ENGINES:
        raise PlanError(
            f"engine: {_show(value)} is not one of {', '.join(ENGINES)}{did_you_mean(str(value), ENGINES)}"
        )
    return value if value is None else str(value)


def check_plan_flag(key: str, value: object) -> bool | None:
    """``value`` as a placement's true/false choice ``key`` (``recompute``, ``reshard``): ``None`` (not
    given), ``true`` or ``false``.

    Raises:
        PlanError: ``<key>: <reason>`` (callers prefix the file and node).
    """
    if value is not None and not isinstance(value, bool):
        raise PlanError(f"{key}: expected true or false, got {_show(value)}")
    return value


def resolve_recompute(node_recompute: bool | str, plan_recompute: bool | None) -> bool:
    """Whether a train node recomputes activations: the plan's choice (``NodePlacement.recompute``) when it
    makes one, else the node's own (``NodeSpec.recompute``), off for ``auto`` the plan leaves open.
    Consistency of the two is checked by the graph's plan check."""
    if plan_recompute is not None:
        return plan_recompute
    return node_recompute is True


def resolve_reshard(node_reshard: bool | str, plan_reshard: bool | None) -> bool:
    """Whether a train node's FSDP2 units reshard after every micro-batch: the plan's choice
    (``NodePlacement.reshard``) when it makes one, else the node's own (``NodeSpec.reshard``), on (the
    default behaviour) for ``auto`` the plan leaves open. Consistency of the two is checked by the graph's
    plan check."""
    if plan_reshard is not None:
        return plan_reshard
    return node_reshard is not False


def resolve_engine(node_engine: str, plan_engine: str | None) -> str:
    """The engine a generate node runs with: the plan's (``NodePlacement.engine``) when it names one, else
    the node's own (``NodeSpec.engine``), and ``builtin`` for ``engine: auto`` the plan leaves open (a
    hand-written plan without ``engine``). Consistency of the two is checked by the graph's plan check."""
    if plan_engine is not None:
        return plan_engine
    return "builtin" if node_engine == "auto" else node_engine


def _devices_text(devices: tuple[int, ...]) -> str:
    if devices and list(devices) == list(range(devices[0], devices[0] + len(devices))) and len(devices) > 1:
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)


# Held-out evaluation settings (greedy decoding): the generating model, the rule reward, the response
# limit in tokens, prompts per generation call, how many held-out prompts, and the score that counts as
# correct; ``agent``: evaluate with multi-turn tool rollouts (``agent_generate``'s arguments: tools, env,
# call_stop_tokens, max_turns, ...), with and without the tool.
EVAL_KEYS: tuple[str, ...] = (
    "model",
    "reward",
    "max_new_tokens",
    "batch_size",
    "size",
    "accuracy_threshold",
    "agent",
)


# how the workers of a multi-device plan start (``run.launcher``)
LAUNCHERS = ("embedded", "ray", "torchrun")


@dataclass(frozen=True)
class RunSpec:
    """Run settings: ``iterations`` of the whole graph, RNG ``seed``, ``output_dir`` for records,
    checkpoint/eval every ``*_interval`` iterations (0 = never), how many checkpoints to keep (0 = all),
    the number of ``devices`` (ids 0..n-1), ``eval`` settings for the held-out evaluation
    (keys in :data:`EVAL_KEYS`; ``model``, if given, must name a model), and the ``launcher`` that starts
    the workers of a multi-device plan (one of :data:`LAUNCHERS`: ``embedded`` processes on this host,
    ``ray`` actors on a Ray cluster, ``torchrun`` workers started by the user)."""

    iterations: int = 1
    seed: int = 0
    output_dir: str = "runs/rlflow"
    checkpoint_interval: int = 0
    eval_interval: int = 0
    devices: int = 1
    keep_checkpoints: int = 2
    eval: dict[str, Any] = field(default_factory=dict)
    launcher: str = "embedded"

    def __post_init__(self) -> None:
        _check_int("run.iterations", self.iterations, 1)
        _check_choice("run.launcher", self.launcher, LAUNCHERS)
        _check_int("run.seed", self.seed, 0)
        if self.seed >= 2**63:
            _fail("run.seed", f"must be < 2**63, got {self.seed}")
        _check_str("run.output_dir", self.output_dir)
        _check_int("run.checkpoint_interval", self.checkpoint_interval, 0)
        _check_int("run.eval_interval", self.eval_interval, 0)
        _check_int("run.keep_checkpoints", self.keep_checkpoints, 0)
        _check_str_mapping("run.eval", self.eval)
        for key in self.eval:
            if key not in EVAL_KEYS:
                _fail(
                    f"run.eval.{key}",
                    f"unknown field{did_you_mean(key, EVAL_KEYS)}; fields: {', '.join(EVAL_KEYS)}",
                )
        object.__setattr__(self, "eval", dict(self.eval))
        _check_int("run.devices", self.devices, 1, PlanError)
        if self.devices > MAX_DEVICES:
            _fail(
                "run.devices",
                f"{self.devices} devices is more than rlflow supports ({MAX_DEVICES})",
                PlanError,
            )


Plan: TypeAlias = dict[str, NodePlacement] | Literal["auto"]


@dataclass(frozen=True)
class GraphSpec:
    """A whole graph file. ``plan``: ``"auto"`` (the planner chooses), or node -> placement; an empty
    mapping puts every node on device 0 with layout d1t1p1m1, and a mapping may leave out model-free nodes
    (rule rewards: device 0, d1t1p1m1). ``source`` names the file in error messages."""

    models: dict[str, ModelSpec]
    nodes: dict[str, NodeSpec]
    data: DataSpec
    algorithm: dict[str, Any] = field(default_factory=dict)
    plan: Plan = field(default_factory=dict)
    run: RunSpec = field(default_factory=RunSpec)
    source: str = ""

    def __post_init__(self) -> None:
        for section, cls in (("models", ModelSpec), ("nodes", NodeSpec)):
            value = getattr(self, section)
            if not isinstance(value, Mapping):
                _fail(section, f"expected a mapping name -> {cls.__name__}, got {_show(value)}")
            for name, spec in value.items():
                if not isinstance(spec, cls):
                    _fail(f"{section}.{name}", f"expected a {cls.__name__}, got {_show(spec)}")
                if spec.name != name:
                    _fail(f"{section}.{name}", f"is keyed '{name}' but named '{spec.name}'")
            object.__setattr__(self, section, dict(value))
        if not self.nodes:
            _fail("nodes", "the graph has no nodes")
        if not isinstance(self.data, DataSpec):
            _fail("data", f"expected a DataSpec, got {_show(self.data)}")
        _check_str_mapping("algorithm", self.algorithm)
        if self.plan != "auto":
            if not isinstance(self.plan, Mapping):
                raise PlanError(
                    f"plan: expected 'auto' or a mapping node -> placement, got {_show(self.plan)}"
                )
            for name, placement in self.plan.items():
                if not isinstance(placement, NodePlacement):
                    raise PlanError(f"plan.{name}: expected a NodePlacement, got {_show(placement)}")
            object.__setattr__(self, "plan", dict(self.plan))
        if not isinstance(self.run, RunSpec):
            _fail("run", f"expected a RunSpec, got {_show(self.run)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain containers in graph-file form (positional/named bindings kept as given)."""
        models: dict[str, Any] = {}
        for name, m in self.models.items():
            d = asdict(m)
            d.pop("name")
            d["optimizer"]["betas"] = list(m.optimizer.betas)
            models[name] = d
        nodes: dict[str, Any] = {}
        for name, n in self.nodes.items():
            d = asdict(n)
            d.pop("name")
            for what in ("inputs", "outputs"):
                d[what] = dict(d[what]) if isinstance(d[what], dict) else list(d[what])
            if not d["staleness"]:  # the synchronous default: graph files and fingerprints stay as they were
                d.pop("staleness")
            if not d["interrupt_every"]:
                d.pop("interrupt_every")
            if d["deepspeed"] is None:  # likewise for nodes without DeepSpeed
                d.pop("deepspeed")
            if d["recompute"] is False:
                d.pop("recompute")
            if d["reshard"] is True:
                d.pop("reshard")
            nodes[name] = d
        data = asdict(self.data)
        data["tokenize"] = list(self.data.tokenize)
        plan: Any = (
            "auto"
            if self.plan == "auto"
            else {
                name: {
                    "devices": _devices_text(p.devices),
                    "layout": str(p.layout),
                    **({"engine": p.engine} if p.engine is not None else {}),
                    **({"recompute": p.recompute} if p.recompute is not None else {}),
                    **({"reshard": p.reshard} if p.reshard is not None else {}),
                }
                for name, p in self.plan.items()
            }
        )
        return {
            "models": models,
            "data": data,
            "algorithm": dict(self.algorithm),
            "nodes": nodes,
            "plan": plan,
            "run": asdict(self.run),
        }
