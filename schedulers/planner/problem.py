"""The planner's input: nodes (work per iteration), the models they call (shapes) and the edges between
them, as pure values.

``PlanProblem`` is what the cost model, simulator and search read; ``graph_problem.problem_from_graph``
builds one from a graph, and :func:`ppo_problem` builds the PPO problem of the ReaL paper (Mei et al. 2024,
"ReaLHF: Optimized RLHF Training for Large Language Models through Parameter Reallocation") from model
presets (``shapes.MODEL_PRESETS``), for benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.node_spec import ENGINES, NODE_ENGINES
from rlflow.dataflow.plan_spec import resolve_engine, resolve_recompute, resolve_reshard
from rlflow.schedulers.planner.shapes import MODEL_PRESETS, ModelShape
from rlflow.schedulers.planner.zero_cost import ZeroConfig

__all__ = [
    "NODE_KINDS",
    "PlanNode",
    "PlanProblem",
    "float32_warnings",
    "ppo_problem",
]

NODE_KINDS = ("generate", "inference", "train")


@dataclass(frozen=True)
class PlanNode:
    """One node's work per iteration, as the cost model sees it.

    Attributes:
        rows: sequences the node processes per iteration (samples: prompts × group size for nodes after
            generation; for generate nodes, the number of generated sequences).
        prompt_len / gen_len: tokens per sequence (prompt, response); a forward pass sees both.
        epochs, mini_batches: train nodes only: optimizer steps per iteration = epochs × mini_batches.
        first_pass: train nodes only: the share of its rows (0 to 1; ``True`` is 1) over which the node
            first recomputes the old policy's log-probs with a no-grad forward (PPO-style trainers: the node
            function's ``first_pass`` trait, ``rlflow.dataflow.registry.NodeFunction.first_pass``), in
            ``micro_batches`` calls when above 0.
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
        interrupt_every: generate nodes only: the tokens of one such segment (``interrupt_every``; 0: not
            interrupted), which ``segment_cost.py`` prices call by call.
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
            (``args.gpu_memory_utilization``, in (0, 1]), pinned; None: the plan's share
            (``NodePlacement.gpu_memory_utilization``, chosen by ``engine_share``), else a KV cache sized
            for every row at the full context (``rlflow.nodes.engines.sizing``). Read only when the node runs
            vLLM.
        max_model_len: generate nodes only: its vLLM engine's context in tokens
            (``rlflow.nodes.engines.sizing.engine_context``: the most prompt tokens of a row plus
            ``max_new_tokens``, held to the model's positions); 0: the model's ``max_position_embeddings``.
        sleep_mode: generate nodes only: its vLLM engine sleeps between calls (``args.enable_sleep_mode``;
            on CUDA its memory is then the node's working memory, not resident). Read only when the node
            runs vLLM.
        function: the node's function name (the layout rule keeps ``agent_generate`` off pipeline stages).
        max_tokens_per_micro_batch: train and inference nodes only: the node's token budget
            (``NodeSpec.max_tokens_per_micro_batch``; None: off): each mini-batch's rows per data-parallel
            rank are cut into micro-batches of at most this many real tokens, rows whole, and each forward
            runs packed (no padding computed); the layout then has ``m = 1`` and ``pp = 1``
            (``cost.layout_problem``), and the cost model prices the packed tokens (``call_cost.py``).
        prompt_mean: mean real (unpadded) prompt tokens of a row (``rlflow.nodes.data_lengths``); 0
            (default): ``prompt_len``. Only a token-budget node's packed forward reads it; a padded
            micro-batch computes ``prompt_len`` columns.
        rounds: the expected calls of the node per iteration (>= 1): a node on the round side of a filter
            runs once per round of generation (``rounds.expected_rounds``); its time is priced that many
            times, its memory as one call's. 1 (default) for every other node.
        compact: generate nodes on the built-in loop only: the loop skips work whose result is known
            (``rlflow.nodes.generation.generate(compact=True)``: one prefill per prompt for its
            ``group_size`` samples, finished rows out of the decode forwards); False where the node records
            routes (``args.record_routes`` reads the uncompacted loop).
    """

    name: str
    model: str
    kind: str
    rows: int
    prompt_len: int
    gen_len: int
    epochs: int = 1
    mini_batches: int = 1
    first_pass: float = 0.0
    group_size: int = 1
    engine: str = "builtin"
    engines: tuple[str, ...] = ()
    staleness: int = 0
    segments: int = 1
    interrupt_every: int = 0
    zero: ZeroConfig | None = None
    recompute: bool | str = False
    reshard: bool | str = True
    gen_mean: float = 0.0
    gpu_memory_utilization: float | None = None
    max_model_len: int = 0
    sleep_mode: bool = False
    function: str = ""
    max_tokens_per_micro_batch: int | None = None
    prompt_mean: float = 0.0
    rounds: float = 1.0
    compact: bool = True

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
        if not 0.0 <= self.first_pass <= 1.0:
            raise PlanError(f"node {self.name!r}: first_pass is a share of its rows (0 to 1)")
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
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (self.kind == "generate" or isinstance(budget, bool) or budget < 1):
            raise PlanError(
                f"node {self.name!r}: max_tokens_per_micro_batch is a train or inference node's token budget "
                f"(an int >= 1), got {budget!r} on a {self.kind} node"
            )
        if self.prompt_mean < 0:
            raise PlanError(f"node {self.name!r}: prompt_mean is the mean real prompt tokens (>= 0)")
        if not self.rounds >= 1:
            raise PlanError(f"node {self.name!r}: rounds is the expected calls per iteration (>= 1)")
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
    def prompt_tokens(self) -> float:
        """Mean real prompt tokens: ``prompt_mean``, or ``prompt_len`` when not given (capped at it)."""
        return min(self.prompt_mean, self.prompt_len) if self.prompt_mean else float(self.prompt_len)

    @property
    def recompute_options(self) -> tuple[bool | None, ...]:
        """What a placement of this node may say for ``recompute``: both for ``recompute: auto``, else
        nothing (``None``: the node's own)."""
        return (False, True) if self.recompute == "auto" else (None,)

    def recompute_of(self, plan_recompute: bool | None) -> bool:
        """Whether this node recomputes activations under a placement whose ``recompute`` is
        ``plan_recompute`` (:func:`rlflow.dataflow.plan_spec.resolve_recompute`, the rule the runtime
        follows)."""
        return resolve_recompute(self.recompute, plan_recompute)

    @property
    def reshard_options(self) -> tuple[bool | None, ...]:
        """What a placement of this node may say for ``reshard``: both for ``reshard: auto``, else nothing
        (``None``: the node's own)."""
        return (True, False) if self.reshard == "auto" else (None,)

    def reshard_of(self, plan_reshard: bool | None) -> bool:
        """Whether this node's FSDP2 units reshard after every micro-batch under a placement whose
        ``reshard`` is ``plan_reshard`` (:func:`rlflow.dataflow.plan_spec.resolve_reshard`, the rule the
        runtime follows)."""
        return resolve_reshard(self.reshard, plan_reshard)

    def share_of(self, plan_share: float | None) -> float | None:
        """The memory share this node's vLLM engine runs with under a placement whose
        ``gpu_memory_utilization`` is ``plan_share``: the plan's, else the node's pinned
        ``args.gpu_memory_utilization`` (the graph's plan check refuses the two differing); None: the
        engine's default pool (``rlflow.nodes.engines.sizing``). ``resources.engine_memory`` is the
        runtime's side of the same rule."""
        return plan_share if plan_share is not None else self.gpu_memory_utilization

    def engine_of(self, plan_engine: str | None) -> str:
        """The engine this node runs with under a placement whose ``engine`` is ``plan_engine``
        (:func:`rlflow.dataflow.plan_spec.resolve_engine`, the rule the runtime follows)."""
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
        round_side: the nodes of a filter's round side (``rlflow.dataflow.filtering``; the filter itself
            included), which the asynchronous replay runs as one generation stage; ``()``: no filter.
    """

    models: dict[str, ModelShape]
    nodes: tuple[PlanNode, ...]
    data_edges: tuple[tuple[str, str, str, int], ...] = ()
    version_edges: tuple[tuple[str, str], ...] = ()
    order: tuple[str, ...] = ()
    round_side: tuple[str, ...] = ()
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
