"""The ``nodes`` section of a graph file: one model function call each, with its engine settings.

Plain frozen values checked field by field on construction (:class:`GraphError` naming the field's path,
``nodes.actor_gen.batch_size``); how a node fits its function, its model and the other nodes is checked by
:class:`~rlflow.dataflow.graph.Graph`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rlflow.dataflow.fields import (
    a_node,
    check_choice,
    check_int,
    check_name,
    check_str,
    check_str_mapping,
    fail,
    show,
)
from rlflow.dataflow.registry import NODE_KINDS

__all__ = [
    "BATCH_UNITS",
    "ENGINES",
    "MAX_STALENESS",
    "NODE_ENGINES",
    "OFFLOAD_DEVICES",
    "TRAIN_ENGINES",
    "UNPLANNED",
    "ZERO_STAGES",
    "DeepSpeedSpec",
    "NodeSpec",
]

BATCH_UNITS: tuple[str, ...] = ("prompts", "samples")
# What executes a generate node: rlflow's decode loop (rlflow.nodes.generation) or a vLLM engine
# (rlflow.nodes.engines.vllm_engine; one per data-parallel replica, tensor-parallel degree 1).
ENGINES: tuple[str, ...] = ("builtin", "vllm")
# What a node may say: an engine, or ``auto`` (the plan chooses one: ``plan_spec.resolve_engine``).
NODE_ENGINES: tuple[str, ...] = (*ENGINES, "auto")
# What trains a train node: rlflow's own FSDP2 / DTensor / pipeline (1F1B) layouts (``builtin``) or DeepSpeed
# ZeRO (rlflow.schedulers.runtime.distributed.zero; data parallel only: tp = pp = 1).
TRAIN_ENGINES: tuple[str, ...] = ("builtin", "deepspeed")
# DeepSpeed's ``zero_optimization.stage`` values rlflow runs (0, plain data parallel, is FSDP2's job here).
ZERO_STAGES: tuple[int, ...] = (1, 2, 3)
# DeepSpeed's ``offload_optimizer.device`` / ``offload_param.device`` values (NVMe is not supported).
OFFLOAD_DEVICES: tuple[str, ...] = ("none", "cpu")
# The one home of what each decision the planner searches (a generate node's engine, a train node's activation
# recomputation and FSDP2 resharding) resolves to when no plan chooses it: the graph runs without the
# planner (no ``plan:``, or a hand-written plan or plan file that leaves it out: ``plan_spec.resolve_engine``
# and its siblings), and on the nodes where it is no decision (recompute on an inference node). The engine
# that needs nothing installed, activations kept (no recompute), FSDP2's own default (reshard after forward).
UNPLANNED: dict[str, str | bool] = {"engine": "builtin", "recompute": False, "reshard": True}
# Upper bound on a generate node's staleness: each unit keeps one more batch and weight version in flight
# (and the planner replays 2·η + 3 iterations); AReaL's runs use single digits.
MAX_STALENESS = 64


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
        check_int("deepspeed.zero_stage", self.zero_stage)
        if self.zero_stage not in ZERO_STAGES:
            fail(
                "deepspeed.zero_stage",
                f"{self.zero_stage} is not one of {', '.join(map(str, ZERO_STAGES))} (ZeRO stage 1: "
                "optimizer states, 2: and gradients, 3: and parameters partitioned)",
            )
        check_choice("deepspeed.offload_optimizer", self.offload_optimizer, OFFLOAD_DEVICES)
        check_choice("deepspeed.offload_param", self.offload_param, OFFLOAD_DEVICES)
        if self.offload_param != "none" and self.zero_stage != 3:
            fail(
                "deepspeed.offload_param",
                f"DeepSpeed offloads parameters with ZeRO stage 3 only; this node has zero_stage "
                f"{self.zero_stage} (use zero_stage: 3, or offload_optimizer alone)",
            )


@dataclass(frozen=True)
class NodeSpec:
    """One model function call.

    ``inputs``/``outputs`` bind the function's canonical parameters to batch keys: a tuple of keys
    (positional) or a mapping ``param -> key``; :class:`~rlflow.dataflow.graph.Graph` resolves them to ordered
    mappings. An output bound to ``None`` is discarded. ``batch_size`` counts rows per iteration in
    ``batch_unit`` (``prompts``, or ``samples`` = prompts × the upstream generate node's ``args.n``);
    ``mini_batches`` optimizer steps per epoch and ``epochs`` passes (train nodes). ``engine`` (generate
    nodes): ``builtin`` (rlflow's decode loop), ``vllm`` (:data:`ENGINES`) or ``auto``: the plan's choice
    (:func:`plan_spec.resolve_engine`; ``plan: auto`` prices both). A decision left out (``None``: ``engine``,
    ``recompute``, ``reshard``) is ``auto`` where the planner prices it, and a value written pins it
    (:meth:`_leave_to_plan`); without a plan's choice it is :data:`UNPLANNED`'s. ``staleness`` (generate
    nodes; η, an integer >= 0): how many policy versions (train iterations of the node's model) behind the
    newest the node may sample with; 0 is the synchronous loop, η >= 1 lets the runtime generate the batches
    of the next iterations while the current one trains (asynchronous RL; README "Asynchronous RL").
    ``interrupt_every`` (generate nodes with ``staleness`` >= 1; tokens, 0: off): interruptible generation
    (partial rollouts): the responses are sampled in segments of this many new tokens, and each later segment
    continues the unfinished ones under one policy version newer (as far as the iteration's own on-policy
    version), so every token carries the version that sampled it (``token_weight_version``; README
    "Asynchronous RL"). Train nodes: ``engine: deepspeed`` trains with DeepSpeed ZeRO, set by ``deepspeed``
    (:class:`DeepSpeedSpec`: ``zero_stage``, ``offload_optimizer``, ``offload_param``). ``recompute`` (train
    nodes): full activation recomputation (gradient checkpointing: each decoder layer keeps only its input and
    reruns its forward in the backward, Chen et al. 2016; Korthikanti et al. 2022): ``false``, ``true``, or
    ``auto`` (also when left out; off without a plan's choice): the plan's choice
    (:func:`plan_spec.resolve_recompute`; ``plan: auto`` turns it on where a layout would not fit otherwise or
    where it is faster overall). ``reshard`` (train nodes on FSDP2, data parallel dp > 1): ``true`` re-gathers
    every FSDP2 unit's weights each micro-batch, forward and backward, and reduce-scatters its gradients each
    micro-batch (ZeRO-3); ``false`` keeps the weights gathered and accumulates full gradients locally for the
    whole optimizer step: one all-gather and one reduce-scatter per unit per step (the communication of
    Megatron-LM's distributed optimizer, ZeRO-1; Rajbhandari et al. 2020) for full stage weights and gradients
    in memory; ``auto`` (also when left out; on without a plan's choice): the plan's choice
    (:func:`plan_spec.resolve_reshard`). Refused with ``engine: deepspeed`` (its ``zero_stage`` decides).
    ``max_tokens_per_micro_batch`` (train and inference nodes; tokens, or ``None``: off, the default; the name
    verl and slime use): a token budget per micro-batch instead of the plan's micro-batch count: each
    mini-batch's rows (per data-parallel rank) are cut into micro-batches of at most this many real
    (attention-mask-1) tokens, rows kept whole, and each micro-batch's forward runs packed (its sequences laid
    end to end, no padding computed; ``rlflow.nodes.rl.packing``). :class:`~rlflow.dataflow.graph.Graph`
    refuses a budget below the longest sequence the node can see and one with a plan's m > 1 or pp > 1.
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
    engine: str | None = None
    staleness: int = 0
    interrupt_every: int = 0
    deepspeed: DeepSpeedSpec | None = None
    recompute: bool | str | None = None
    reshard: bool | str | None = None
    max_tokens_per_micro_batch: int | None = None

    def __post_init__(self) -> None:
        check_name("nodes", self.name)
        p = f"nodes.{self.name}"
        if self.name == "data":
            fail(p, "'data' is reserved for the data set (the producer of dataset keys)")
        check_choice(f"{p}.kind", self.kind, NODE_KINDS)
        check_str(f"{p}.function", self.function)
        check_str(f"{p}.model", self.model, optional=True)
        for what in ("inputs", "outputs"):
            value = getattr(self, what)
            if isinstance(value, Mapping):
                check_str_mapping(f"{p}.{what}", value)
                for param, key in value.items():
                    if not (what == "outputs" and key is None):
                        check_name(f"{p}.{what}.{param}", key)
                object.__setattr__(self, what, dict(value))
            elif isinstance(value, tuple | list):
                for i, key in enumerate(value):
                    if not (what == "outputs" and key is None):
                        check_name(f"{p}.{what}[{i}]", key)
                object.__setattr__(self, what, tuple(value))
            else:
                fail(f"{p}.{what}", f"expected a list of keys or a mapping param: key, got {show(value)}")
        check_int(f"{p}.batch_size", self.batch_size, 1)
        check_choice(f"{p}.batch_unit", self.batch_unit, BATCH_UNITS)
        check_int(f"{p}.mini_batches", self.mini_batches, 1)
        check_int(f"{p}.epochs", self.epochs, 1)
        if self.kind != "train" and self.epochs != 1:
            fail(f"{p}.epochs", f"only train nodes make several passes; this is {a_node(self.kind)}")
        check_str_mapping(f"{p}.args", self.args)
        object.__setattr__(self, "args", dict(self.args))
        self._leave_to_plan()
        allowed = TRAIN_ENGINES if self.kind == "train" else NODE_ENGINES if self.kind == "generate" else ()
        if (
            self.engine != "builtin"
            and self.engine not in allowed
            and self.engine in (*NODE_ENGINES, *TRAIN_ENGINES)
        ):
            runs = "train" if self.engine in TRAIN_ENGINES else "generate"
            fail(f"{p}.engine", f"engine '{self.engine}' runs {runs} nodes only; this is {a_node(self.kind)}")
        check_choice(f"{p}.engine", self.engine, allowed or ("builtin",))
        if self.deepspeed is not None:
            if not isinstance(self.deepspeed, DeepSpeedSpec):
                fail(f"{p}.deepspeed", f"expected a DeepSpeedSpec, got {show(self.deepspeed)}")
            if self.engine != "deepspeed":
                fail(
                    f"{p}.deepspeed",
                    f"DeepSpeed settings need 'engine: deepspeed' (engine is '{self.engine}')",
                )
        elif self.engine == "deepspeed":
            object.__setattr__(self, "deepspeed", DeepSpeedSpec())
        check_int(f"{p}.staleness", self.staleness, 0)
        if self.staleness > MAX_STALENESS:
            fail(
                f"{p}.staleness",
                f"must be <= {MAX_STALENESS} (one batch in flight per version of lag), got {self.staleness}",
            )
        if self.staleness and self.kind != "generate":
            fail(
                f"{p}.staleness",
                f"only generate nodes may sample with older weights; this is {a_node(self.kind)}",
            )
        check_int(f"{p}.interrupt_every", self.interrupt_every, 0)
        if not isinstance(self.recompute, bool) and self.recompute != "auto":
            fail(f"{p}.recompute", f"expected true, false or 'auto', got {show(self.recompute)}")
        if self.recompute is not False and self.kind != "train":
            fail(
                f"{p}.recompute",
                f"activation recomputation saves a backward's memory; this is {a_node(self.kind)}",
            )
        if not isinstance(self.reshard, bool) and self.reshard != "auto":
            fail(f"{p}.reshard", f"expected true, false or 'auto', got {show(self.reshard)}")
        if self.reshard is not True and self.kind != "train":
            fail(
                f"{p}.reshard",
                f"resharding applies to a train node's FSDP2 units; this is {a_node(self.kind)}",
            )
        if self.reshard is not True and self.engine == "deepspeed":
            fail(
                f"{p}.reshard",
                "applies to FSDP2 train nodes; with 'engine: deepspeed' the ZeRO stage decides what is "
                f"sharded (set nodes.{self.name}.deepspeed.zero_stage, or drop reshard)",
            )
        if self.max_tokens_per_micro_batch is not None:
            check_int(f"{p}.max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1)
            if self.kind not in ("train", "inference"):
                fail(
                    f"{p}.max_tokens_per_micro_batch",
                    f"a token budget cuts the micro-batches of train and inference nodes' forwards; this is "
                    f"{a_node(self.kind)}",
                )
        if self.interrupt_every and self.kind != "generate":
            fail(
                f"{p}.interrupt_every",
                f"only generate nodes sample tokens to interrupt; this is {a_node(self.kind)}",
            )
        if self.interrupt_every and not self.staleness:
            fail(
                f"{p}.interrupt_every",
                "interruptible generation continues a rollout under newer weights, which only an "
                "asynchronous node (staleness >= 1) samples ahead of; set nodes."
                f"{self.name}.staleness or drop interrupt_every",
            )

    def _leave_to_plan(self) -> None:
        """A decision the graph leaves out (``None``) is the plan's to make, as ``auto`` is, where the planner
        prices it: a generate node's ``engine``, a train node's ``recompute`` and (FSDP2) ``reshard``. Where
        it is not a decision it takes the node kind's one value (``builtin``, off, on), the values
        of :data:`UNPLANNED`."""
        train, fsdp = self.kind == "train", self.kind == "train" and self.engine != "deepspeed"
        for key, searched in (("engine", self.kind == "generate"), ("recompute", train), ("reshard", fsdp)):
            if getattr(self, key) is None:
                object.__setattr__(self, key, "auto" if searched else UNPLANNED[key])

    @property
    def input_keys(self) -> tuple[str, ...]:
        """Batch keys read, in binding order."""
        return tuple(self.inputs.values()) if isinstance(self.inputs, dict) else tuple(self.inputs)

    @property
    def output_keys(self) -> tuple[str, ...]:
        """Batch keys written (discarded outputs left out), in binding order."""
        values = self.outputs.values() if isinstance(self.outputs, dict) else self.outputs
        return tuple(k for k in values if k is not None)
