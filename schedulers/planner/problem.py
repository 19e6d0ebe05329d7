"""The planner's input: models (shapes), nodes (work per iteration) and edges.

``PlanProblem`` is a pure value the planner reads; ``problem_from_graph`` builds one from a
``rlflow.dataflow.graph.Graph`` (the graph layer), and ``ppo_problem`` builds the PPO problem of the ReaL
paper (Mei et al. 2024, "ReaLHF: Optimized RLHF Training for Large Language Models through Parameter
Reallocation") from model presets, for benchmarks.

Parameter names follow Hugging Face Llama (``model.layers.{i}.self_attn.q_proj.weight``...), so the same
names index real modules in the runtime.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.layout_rules import attention_kinds
from rlflow.dataflow.spec import (
    ENGINES,
    NODE_ENGINES,
    resolve_dtype,
    resolve_engine,
    resolve_recompute,
    resolve_reshard,
)
from rlflow.schedulers.planner.zero_cost import ZeroConfig

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "MODEL_PRESETS",
    "ModelShape",
    "PlanNode",
    "PlanProblem",
    "data_prompt_len",
    "data_response_mean",
    "engine_choices",
    "float32_warnings",
    "ppo_problem",
    "problem_from_graph",
]

NODE_KINDS = ("generate", "inference", "train")
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
        what the runtime builds on ``device_type`` (``rlflow.dataflow.spec.resolve_dtype``: 2 bytes on
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


@dataclass(frozen=True)
class PlanNode:
    """One node's work per iteration, as the cost model sees it.

    Attributes:
        rows: sequences the node processes per iteration (samples: prompts × group size for nodes after
            generation; for generate nodes, the number of generated sequences).
        prompt_len / gen_len: tokens per sequence (prompt, response); a forward pass sees both.
        epochs, mini_batches: train nodes only: optimizer steps per iteration = epochs × mini_batches.
        first_pass: train nodes only: the node first recomputes the old policy's log-probs with a
            no-grad forward over its rows (PPO-style trainers, ``rlflow.nodes.functions._pg_train``).
        group_size: samples per prompt in the rows (``Graph.group_size``); a generate node's rows are
            ``rows / group_size`` prompts for the layout rule (``rlflow.dataflow.layout_rules``).
        engine: generate nodes only: ``builtin``, ``vllm`` (the layout rule allows vLLM pp = 1 only) or
            ``auto``: the plan chooses (``NodePlacement.engine``; ``builtin`` when it names none).
        engines: the engines the planner may choose from for an ``engine: auto`` node (default
            ``("builtin",)``; ``problem_from_graph`` adds ``vllm`` where vLLM can serve the node); for any
            other node just its ``engine``.
        staleness: generate nodes only: η, the policy versions generation may lag (asynchronous RL; the
            simulator then replays the runtime's version schedule).
        segments: generate nodes only: the calls one iteration takes under interruptible generation
            (``Graph.segments``; 1: one call), each reading one version more.
        gen_mean: mean response tokens of the node's rows (the length model of ``lengths.py``): a generate
            call runs until its longest row ends, and an inference or train micro-batch is cut to its own
            longest response (``rlflow.nodes.train.micro_batches``); 0 (default): every response runs to
            ``gen_len``.
        recompute: train nodes only: full activation recomputation (gradient checkpointing per decoder
            layer; ``NodeSpec.recompute``): priced with one more forward per micro-batch and only each
            layer's input kept; ``"auto"``: the plan chooses (``NodePlacement.recompute``, off when it names
            none; the search tries both).
        reshard: train nodes on FSDP2 only (``NodeSpec.reshard``): ``True`` re-gathers every unit's weights
            each micro-batch (forward and backward) and reduce-scatters its gradients each micro-batch;
            ``False`` gathers and reduce-scatters once per optimizer step, holding the stage's full weights
            and gradients meanwhile; ``"auto"``: the plan chooses (``NodePlacement.reshard``, on when it
            names none; the search tries both).
        zero: train nodes only: DeepSpeed ZeRO settings (``engine: deepspeed``;
            ``zero_cost.ZeroConfig``), None for the FSDP2 path.
        gpu_memory_utilization: generate nodes only: the share of a device's memory its vLLM engine takes
            (``args.gpu_memory_utilization``, in (0, 1]); None: a KV cache sized for every row at full context
            (``rlflow.nodes.engines.sizing``). Read only when the node runs vLLM.
        sleep_mode: generate nodes only: its vLLM engine sleeps between calls (``args.enable_sleep_mode``;
            on CUDA its memory is then the node's working memory, not resident). Read only when the node
            runs vLLM.
        function: the node's function name (the layout rule keeps ``agent_generate`` off pipeline stages).
    """

    name: str
    model: str
    kind: str
    rows: int
    prompt_len: int
    gen_len: int
    epochs: int = 1
    mini_batches: int = 1
    first_pass: bool = False
    group_size: int = 1
    engine: str = "builtin"
    engines: tuple[str, ...] = ()
    staleness: int = 0
    segments: int = 1
    zero: ZeroConfig | None = None
    recompute: bool | str = False
    reshard: bool | str = True
    gen_mean: float = 0.0
    gpu_memory_utilization: float | None = None
    sleep_mode: bool = False
    function: str = ""

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise PlanError(f"node {self.name!r}: kind {self.kind!r} is not one of {NODE_KINDS}")
        if self.engine not in NODE_ENGINES:
            raise PlanError(f"node {self.name!r}: engine {self.engine!r} is not one of {NODE_ENGINES}")
        auto = self.engine == "auto"
        engines = tuple(self.engines) or (("builtin",) if auto else (self.engine,))
        if not set(engines) <= set(ENGINES) or (not auto and engines != (self.engine,)):
            raise PlanError(
                f"node {self.name!r}: engines {engines} must be engines of {ENGINES} and, unless the node's "
                f"engine is 'auto', just its engine {self.engine!r}"
            )
        object.__setattr__(self, "engines", engines)
        if self.rows < 1 or self.prompt_len < 0 or self.gen_len < 0:
            raise PlanError(f"node {self.name!r}: rows must be >= 1 and lengths >= 0")
        if self.group_size < 1:
            raise PlanError(f"node {self.name!r}: group_size must be >= 1")
        if self.gen_mean < 0:
            raise PlanError(f"node {self.name!r}: gen_mean is the mean response tokens of its rows (>= 0)")
        if not isinstance(self.recompute, bool) and self.recompute != "auto":
            raise PlanError(f"node {self.name!r}: recompute must be true, false or 'auto'")
        if not isinstance(self.reshard, bool) and self.reshard != "auto":
            raise PlanError(f"node {self.name!r}: reshard must be true, false or 'auto'")
        if self.reshard is not True and (self.kind != "train" or self.zero is not None):
            raise PlanError(f"node {self.name!r}: reshard applies to FSDP2 train nodes only")
        util = self.gpu_memory_utilization
        if util is not None and (self.kind != "generate" or not 0 < util <= 1):
            raise PlanError(
                f"node {self.name!r}: gpu_memory_utilization is a generate node's share of device memory "
                f"in (0, 1], got {util!r}"
            )
        if self.sleep_mode and self.kind != "generate":
            raise PlanError(f"node {self.name!r}: sleep_mode applies to generate nodes only")
        if self.recompute and self.kind != "train":
            raise PlanError(f"node {self.name!r}: activation recompute applies to train nodes only")
        if self.zero is not None and self.kind != "train":
            raise PlanError(
                f"node {self.name!r}: DeepSpeed ZeRO runs train nodes only, not {self.kind} nodes"
            )

    @property
    def seq_len(self) -> int:
        """Tokens per row of a call padded to the cap: prompt + ``gen_len`` (what a generate node's KV cache
        is sized for; the cost model prices a forward micro-batch at its rows' expected longest response,
        ``lengths.py``)."""
        return self.prompt_len + self.gen_len

    @property
    def response_mean(self) -> float:
        """Mean response tokens: ``gen_mean``, or ``gen_len`` when not given (every response to the cap)."""
        return min(self.gen_mean, self.gen_len) if self.gen_mean else float(self.gen_len)

    @property
    def recompute_options(self) -> tuple[bool | None, ...]:
        """What a placement of this node may say for ``recompute``: both for ``recompute: auto``, else
        nothing (``None``: the node's own)."""
        return (False, True) if self.recompute == "auto" else (None,)

    def recompute_of(self, plan_recompute: bool | None) -> bool:
        """Whether this node recomputes activations under a placement whose ``recompute`` is
        ``plan_recompute`` (:func:`rlflow.dataflow.spec.resolve_recompute`, the rule the runtime follows)."""
        return resolve_recompute(self.recompute, plan_recompute)

    @property
    def reshard_options(self) -> tuple[bool | None, ...]:
        """What a placement of this node may say for ``reshard``: both for ``reshard: auto``, else nothing
        (``None``: the node's own)."""
        return (True, False) if self.reshard == "auto" else (None,)

    def reshard_of(self, plan_reshard: bool | None) -> bool:
        """Whether this node's FSDP2 units reshard after every micro-batch under a placement whose
        ``reshard`` is ``plan_reshard`` (:func:`rlflow.dataflow.spec.resolve_reshard`, the rule the runtime
        follows)."""
        return resolve_reshard(self.reshard, plan_reshard)

    def engine_of(self, plan_engine: str | None) -> str:
        """The engine this node runs with under a placement whose ``engine`` is ``plan_engine``
        (:func:`rlflow.dataflow.spec.resolve_engine`, the rule the runtime follows)."""
        return resolve_engine(self.engine, plan_engine)

    @property
    def split_rows(self) -> int:
        """Rows a layout splits over mini-batches, dp ranks and micro-batches: prompts for a generate
        node (``rows / group_size``), ``rows`` otherwise (``Graph.rows``)."""
        return self.rows // self.group_size if self.kind == "generate" else self.rows


@dataclass(frozen=True)
class PlanProblem:
    """Everything the planner needs: models, nodes (in execution order) and edges.

    Attributes:
        models: model name -> shape. ``None`` shape = a node without a model (rule reward): it costs
            nothing on devices and is not placed.
        nodes: in a valid execution (topological) order.
        data_edges: (src node or "data", dst node, key, bytes per iteration).
        version_edges: (train node, other node of the same model): dst in iteration i+1 reads the weights
            src wrote in iteration i.
        order: every node of the graph in execution order, the model-free ones (rule rewards) included:
            no plan places those (a plan that leaves a node out runs it on device 0, d1t1p1m1) and the
            cost model prices no time for them; ``()`` when built without a graph (``nodes`` only).
    """

    models: dict[str, ModelShape]
    nodes: tuple[PlanNode, ...]
    data_edges: tuple[tuple[str, str, str, int], ...] = ()
    version_edges: tuple[tuple[str, str], ...] = ()
    order: tuple[str, ...] = ()
    model_nodes: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise PlanError("plan problem: node names repeat")
        for node in self.nodes:
            if node.model not in self.models:
                raise PlanError(f"node {node.name!r}: unknown model {node.model!r}")
        groups: dict[str, list[str]] = {}
        for node in self.nodes:
            groups.setdefault(node.model, []).append(node.name)
        self.model_nodes.clear()
        self.model_nodes.update({m: tuple(v) for m, v in groups.items()})

    def node(self, name: str) -> PlanNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise PlanError(f"unknown node {name!r}")

    def train_node(self, model: str) -> str | None:
        """The node that trains ``model``, if any."""
        for name in self.model_nodes.get(model, ()):
            if self.node(name).kind == "train":
                return name
        return None


def _ppo_edges(
    nodes: list[PlanNode], rows: int, prompt_len: int, gen_len: int
) -> list[tuple[str, str, str, int]]:
    # int64 ids/masks (8 bytes), float32 per-token tensors (4 bytes), per-sequence scores (4 bytes).
    ids = rows * gen_len * 8
    tok = rows * gen_len * 4
    prompts = rows * prompt_len * 8
    edges = [("data", "actor_gen", "prompt_ids", prompts), ("data", "actor_gen", "prompt_mask", prompts)]
    for dst in ("ref_inf", "reward_inf", "critic_inf", "actor_train", "critic_train"):
        edges += [("actor_gen", dst, "response_ids", ids), ("actor_gen", dst, "response_mask", ids)]
    for dst in ("actor_train", "critic_train"):
        edges += [
            ("actor_gen", dst, "logprobs", tok),
            ("ref_inf", dst, "ref_logprobs", tok),
            ("critic_inf", dst, "values", tok),
            ("reward_inf", dst, "scores", rows * 4),
        ]
    names = {n.name for n in nodes}
    return [e for e in edges if e[0] in names | {"data"} and e[1] in names]


def ppo_problem(
    actor: str | ModelShape = "7b",
    critic: str | ModelShape = "7b",
    rows: int = 512,
    prompt_len: int = 128,
    gen_len: int = 384,
    mini_batches: int = 8,
    epochs: int = 1,
    zero: ZeroConfig | None = None,
    recompute: bool = False,
    gen_mean: float = 0.0,
) -> PlanProblem:
    """PPO as in the ReaL paper's experiments: actor/critic/ref/reward, 6 nodes.

    Defaults follow ReaL §7: batch 512 prompts, prompt length 128, generation length 384 (total 512),
    8 PPO mini-batches, 1 epoch. The reference model has the actor's shape, the reward model the critic's.
    ``zero``: both train nodes run DeepSpeed ZeRO with these settings (None: FSDP2); ``recompute``: both
    recompute activations; ``gen_mean``: mean response tokens (0: every response to ``gen_len``).
    """
    a = MODEL_PRESETS[actor] if isinstance(actor, str) else actor
    z = zero
    c = MODEL_PRESETS[critic] if isinstance(critic, str) else critic
    models = {"actor": a, "ref": a, "critic": c.with_head("value"), "reward": c.with_head("score")}
    nodes = [
        PlanNode("actor_gen", "actor", "generate", rows, prompt_len, gen_len, gen_mean=gen_mean),
        PlanNode("ref_inf", "ref", "inference", rows, prompt_len, gen_len, gen_mean=gen_mean),
        PlanNode("reward_inf", "reward", "inference", rows, prompt_len, gen_len, gen_mean=gen_mean),
        PlanNode("critic_inf", "critic", "inference", rows, prompt_len, gen_len, gen_mean=gen_mean),
        PlanNode(
            "actor_train", "actor", "train", rows, prompt_len, gen_len, epochs, mini_batches, zero=z,
            recompute=recompute, gen_mean=gen_mean,
        ),
        PlanNode(
            "critic_train", "critic", "train", rows, prompt_len, gen_len, epochs, mini_batches, zero=z,
            recompute=recompute, gen_mean=gen_mean,
        ),
    ]  # fmt: skip
    version = (("actor_train", "actor_gen"), ("critic_train", "critic_inf"))
    return PlanProblem(models, tuple(nodes), tuple(_ppo_edges(nodes, rows, prompt_len, gen_len)), version)


def float32_warnings(problem: PlanProblem, device_type: str) -> list[str]:
    """One line per float32 model of ``problem`` planned on GPUs (``device_type`` ``cuda``): a graph that
    sets ``dtype: float32`` gets float32 on every device (``rlflow.nodes.models.build_model``; the default
    ``auto`` is bfloat16 on GPUs), so the planner prices 4-byte weights, gradients and KV cache as it runs
    them, twice bfloat16's memory and memory traffic. No lines on CPUs or for 2-byte models."""
    if device_type != "cuda":
        return []
    wide = sorted(name for name, shape in problem.models.items() if shape.dtype_bytes > 2)
    return [
        f"model {name!r} is float32 (the graph's `dtype: float32`): priced as the runtime runs it on GPUs, "
        "4 bytes per weight, gradient and KV-cache element; drop the key (`auto`: bfloat16 on GPUs) or set "
        f"`models.{name}.dtype: bfloat16` for half the memory and memory traffic"
        for name in wide
    ]


def _recomputes_logprobs(graph: Graph, name: str) -> bool:
    """A policy trainer (an ``lm`` model) that reads the sampler's ``logprobs`` recomputes them with a no-grad
    first pass (the old policy of PPO-style trainers) unless ``args.recompute_logprobs`` is false or
    ``args.decoupled_loss`` is true (its proximal forward is an inference node of the graph, priced as
    one)."""
    nspec = graph.spec.nodes[name]
    model = graph.spec.models.get(nspec.model or "")
    if nspec.kind != "train" or model is None or model.head != "lm":
        return False
    args = graph.args(name)
    # undeclared functions: True
    if args.get("decoupled_loss", False):
        return False
    return "logprobs" in graph.function(name).inputs and bool(args.get("recompute_logprobs", True))


def _data_batches(graph: Graph, key: str, sample: int, batch: int) -> list[Any] | None:
    """The first ``sample`` training rows' ``key`` tokenized as the runtime tokenizes them
    (``rlflow.dataflow.data.make_batch``), in ``batch``-row batches; ``None`` when the graph does not
    tokenize ``key`` or its data or tokenizer cannot be read."""
    from rlflow.dataflow.data import load_splits, make_batch
    from rlflow.dataflow.errors import RlflowError
    from rlflow.nodes.models import data_tokenizer

    data = graph.spec.data
    if data is None or key not in tuple(data.tokenize or ()):
        return None
    try:
        train, _ = load_splits(data, base_dir=None)
        tokenizer = data_tokenizer(graph, {})
        rows = train.take(range(min(sample, len(train))))
        return [
            make_batch({key: rows[key][start : start + batch]}, tokenizer, (key,))
            for start in range(0, len(rows[key]), batch)
        ]
    except (RlflowError, OSError, KeyError):
        return None


def data_prompt_len(graph: Graph, sample: int = 64, batch: int = 16) -> int | None:
    """Prompt tokens per row as the nodes see them: the padded width of ``batch``-row batches of the first
    ``sample`` training prompts, tokenized as the runtime tokenizes them (``rlflow.dataflow.data.make_batch``:
    special tokens, left padding), averaged over those batches. ``None`` when the graph tokenizes no
    prompt or its data or tokenizer cannot be read (the caller falls back to a default)."""
    batches = _data_batches(graph, "prompt", sample, batch)
    if not batches:
        return None
    widths = [b.tensor("prompt_ids").shape[1] for b in batches]
    return max(1, round(sum(widths) / len(widths)))


RESPONSE_KEYS = ("reference", "response")


def data_response_mean(graph: Graph, sample: int = 256) -> float | None:
    """Mean response tokens of the data set's own responses: a ``reference`` (reference responses beside
    the prompts of a graph that generates, whose sampler owns ``response_ids``) or ``response`` (SFT data)
    field the graph tokenizes, the first of the two; the mean of its mask's row sums over the first
    ``sample`` training rows, tokenized as the runtime tokenizes them (EOS appended, which a sampler emits
    too). ``None`` when the graph tokenizes neither or its data cannot be read: the length model then has
    no mean and every response runs to ``max_new_tokens``."""
    for key in RESPONSE_KEYS:
        batches = _data_batches(graph, key, sample, sample)
        if batches:
            lengths = [float(n) for b in batches for n in b.tensor(f"{key}_mask").sum(dim=1).tolist()]
            return sum(lengths) / len(lengths)
    return None


def engine_choices(graph: Graph, node: str, device_type: str = "cpu") -> tuple[str, ...]:
    """The engines ``plan: auto`` may run generate node ``node`` with: its own engine, or for
    ``engine: auto`` ``builtin`` plus ``vllm`` where vLLM can serve the node on ``device_type``
    (``rlflow.nodes.engines.validation.vllm_problem``: installed, the built-in ``generate`` function, a
    model shape it serves; the layout rule then keeps it at tp = 1)."""
    spec = graph.spec.nodes[node]
    if spec.engine != "auto":
        return (spec.engine,)
    from rlflow.nodes.engines.validation import vllm_problem

    return ("builtin",) if vllm_problem(graph, node, device_type) else ("builtin", "vllm")


def problem_from_graph(
    graph: Graph,
    prompt_len: int | None = None,
    default_gen_len: int = 128,
    device_type: str = "cpu",
    mean_new_tokens: float | None = None,
) -> PlanProblem:
    """Build the planner's problem from a ``rlflow.dataflow.graph.Graph`` (contract API).

    Reads ``graph.spec.models`` (``config`` dict, or ``path`` to an HF dir with ``config.json``; ``head``,
    ``dtype``), ``graph.spec.nodes`` (``model``, ``kind``, ``batch_size``, ``batch_unit``, ``epochs``,
    ``mini_batches``, ``args.max_new_tokens``, ``args.gpu_memory_utilization``; a train node's
    ``engine: deepspeed`` with its ``deepspeed`` settings as ``PlanNode.zero``), ``graph.execution_order()``,
    ``graph.group_size(node)`` and the data / version edges of ``graph.dag``.

    Rows: ``graph.rows(node)`` (sequences per iteration, group size applied).
    Lengths: prompt length from ``prompt_len``, else measured on the data (:func:`data_prompt_len`), else
    128 tokens; generated length = the generate node's ``args.max_new_tokens``. Mean response tokens of
    the length model (``PlanNode.gen_mean``, ``lengths.py``): ``mean_new_tokens``, else measured on the
    data set's responses (:func:`data_response_mean`: a tokenized ``reference`` or ``response``), else
    none (every response runs to ``max_new_tokens``).
    Engines: a node's ``engine``; for ``engine: auto`` the choices :func:`engine_choices` gives on
    ``device_type`` (``cpu`` or ``cuda``).

    Raises:
        GraphError: a node refers to a model without a readable config.
        PlanError: ``mean_new_tokens`` is not positive.
    """
    import json
    from pathlib import Path

    from rlflow.dataflow.context import max_positions

    spec = graph.spec
    models: dict[str, ModelShape] = {}
    for name, mspec in spec.models.items():
        config = mspec.config
        source, seen = mspec, {name}
        while not config and not source.path and source.init_from:
            parent = str(source.init_from)  # e.g. ref: init_from actor -> the actor's shape
            if parent in seen or parent not in spec.models:
                break
            seen.add(parent)
            source = spec.models[parent]
            config = source.config
        if not config and source.path:
            cfg_path = Path(str(source.path)) / "config.json"
            try:
                config = json.loads(cfg_path.read_text())
            except OSError as err:
                raise GraphError(f"model {name!r}: cannot read {cfg_path}: {err}") from None
        if not config:
            raise GraphError(f"model {name!r}: needs a config or a path for planning")
        shape = ModelShape.from_config(
            dict(config), head=mspec.head, dtype=mspec.dtype, device_type=device_type
        )
        # a config without max_position_embeddings gets its model_type's default when built
        models[name] = replace(shape, max_positions=max_positions(graph, name) or shape.max_positions)
    order = list(graph.execution_order())
    p_len = int(prompt_len or data_prompt_len(graph) or 128)
    if mean_new_tokens is not None and not mean_new_tokens > 0:
        raise PlanError(f"mean_new_tokens must be > 0 tokens, got {mean_new_tokens}")
    gen_mean = float(mean_new_tokens or data_response_mean(graph) or 0.0)
    gen_len = default_gen_len
    for name in order:
        if spec.nodes[name].kind == "generate":
            args = graph.args(name)  # checked, with the function's declared defaults filled in
            gen_len = int(args.get("max_new_tokens") or default_gen_len)
    nodes: list[PlanNode] = []
    for name in order:
        nspec = spec.nodes[name]
        model = nspec.model
        if model is None:
            continue  # rule rewards: no model, no devices
        # prompts for a generate node: it emits group_size sequences per prompt
        rows = graph.rows(name) * (graph.group_size(name) if nspec.kind == "generate" else 1)
        deepspeed = nspec.deepspeed is not None  # a train node's engine; PlanNode.engine is generation's
        zero = (
            ZeroConfig(
                nspec.deepspeed.zero_stage,
                nspec.deepspeed.offload_optimizer != "none",
                nspec.deepspeed.offload_param != "none",
            )
            if nspec.deepspeed is not None
            else None
        )
        nodes.append(
            PlanNode(
                name,
                str(model),
                str(nspec.kind),
                rows,
                p_len,
                gen_len,
                nspec.epochs,
                nspec.mini_batches,
                _recomputes_logprobs(graph, name),
                int(graph.group_size(name)),
                "builtin" if deepspeed else str(nspec.engine),
                ("builtin",) if deepspeed else engine_choices(graph, name, device_type),
                staleness=int(nspec.staleness),
                segments=graph.segments(name),
                gen_mean=gen_mean,  # every node's rows hold the same generated responses
                zero=zero,
                recompute=nspec.recompute,
                reshard=nspec.reshard,
                gpu_memory_utilization=(
                    graph.args(name).get("gpu_memory_utilization") if nspec.kind == "generate" else None
                ),
                sleep_mode=nspec.kind == "generate" and bool(graph.args(name).get("enable_sleep_mode")),
                function=str(nspec.function),
            )
        )
    placed = {n.name for n in nodes}
    rows_of = {n.name: n.rows for n in nodes}
    data_edges: list[tuple[str, str, str, int]] = []
    version_edges: list[tuple[str, str]] = []
    for src, dst, attrs in graph.dag.edges(data=True):
        if dst not in placed:
            continue
        if attrs.get("kind") == "version":
            if src in placed:
                version_edges.append((str(src), str(dst)))
            continue
        if attrs.get("kind") != "data":
            continue  # "order" edges: implied by version edges in the simulator
        key = str(attrs.get("key", ""))
        per_row = (
            (p_len if key.startswith("prompt") else gen_len) * 8
            if key.endswith(("_ids", "_mask"))
            else gen_len * 4
        )
        if key in ("scores", "logps", "greedy_scores"):
            per_row = 4
        data_edges.append((str(src), str(dst), key, rows_of[dst] * per_row))
    used = {n.model for n in nodes}
    return PlanProblem(
        {m: s for m, s in models.items() if m in used},
        tuple(nodes),
        tuple(data_edges),
        tuple(version_edges),
        order=tuple(order),
    )
