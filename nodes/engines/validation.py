"""Whether each generate node's engine can serve it: checked before anything starts.

:func:`check_engines` runs in ``rlflow validate``, before ``rlflow run`` launches anything, and when an
executor is made (the Python API), so a graph that names ``engine: vllm`` for a node vLLM cannot serve
stops with one line naming the file, node, key and reason. Does not import vLLM (only looks it up).
"""

from __future__ import annotations

from rlflow.dataflow.context import model_hf_config
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph
from rlflow.nodes.engines.vllm_engine import vllm_missing, vllm_model_problem

__all__ = ["check_engines", "engine_nodes"]

# the node function the vLLM engine replaces (rlflow.nodes.functions.generate_node)
_ENGINE_FUNCTIONS = ("generate",)


def engine_nodes(graph: Graph, engine: str = "vllm") -> list[str]:
    """Names of the nodes whose ``engine`` is ``engine``, in the graph's order."""
    return [name for name, node in graph.nodes.items() if node.engine == engine]


def check_engines(graph: Graph, device_type: str = "cpu") -> None:
    """Reject ``engine: vllm`` where vLLM cannot serve the node on ``device_type`` (``cpu`` or ``cuda``).

    Raises:
        GraphError: ``<file>: nodes.<node>.engine: ...`` when vLLM is not installed, the node's function
            is not the built-in ``generate``, its model follows another as an EMA, vLLM does not serve
            the model's architecture or (on CPU) its attention head size. (Graph validation already
            holds ``max_new_tokens`` plus the prompt to the model's context, ``rlflow.dataflow.context``,
            and stop token ids to the model's vocabulary, ``rlflow.dataflow.sampling``, for every engine; the
            engine's memory is in the pre-launch memory check, ``rlflow.schedulers.planner.resources``.)
    """
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    for name in engine_nodes(graph):
        node = graph.node(name)
        where = f"{src}nodes.{name}.engine: vllm"
        if node.function not in _ENGINE_FUNCTIONS:
            raise GraphError(
                f"{where} serves the built-in 'generate' function; node '{name}' calls '{node.function}'"
            )
        assert node.model is not None, "generate nodes call a model (graph validation)"
        mspec = graph.spec.models[node.model]
        if mspec.ema is not None:
            raise GraphError(
                f"{where}: model '{node.model}' follows '{mspec.ema.source}' as an EMA; the vLLM engine "
                "receives the weights of train steps only (use engine: builtin)"
            )
        missing = vllm_missing()
        if missing:
            raise GraphError(f"{where}: {missing}")
        config = model_hf_config(graph, node.model)  # None: unreadable (building the model reports it)
        if config is None:
            continue  # nothing to check before the model is built; the engine checks it at start
        problem = vllm_model_problem(config, device_type)
        if problem:
            raise GraphError(f"{where} cannot serve model '{node.model}': {problem}")
