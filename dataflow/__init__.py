"""rlflow's declarative layer: graph files, their validation, the batch type, registries and plug-ins.

Knows nothing of devices, processes or node implementations (``DESIGN.md``, "Layers"). Public API::

    from rlflow.dataflow import load_graph, Graph, GraphSpec, NodeSpec, ModelSpec, Batch
    graph = load_graph("examples/ppo.yaml", ["models.actor.optimizer.lr=1e-6"])
    graph.execution_order()

Heavy submodules (torch for ``Batch``, networkx/omegaconf for graphs) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import (
    DataError,
    GraphError,
    HostError,
    ModelError,
    NodeError,
    PlanError,
    RegistryError,
    RlflowError,
)
from rlflow.dataflow.registry import (
    NODE_FUNCTIONS,
    NodeFunction,
    Registry,
    load_builtin_functions,
    node_function,
)

if TYPE_CHECKING:
    from rlflow.dataflow.batch import Batch
    from rlflow.dataflow.data_spec import DatasetSpec, DataSpec, GeneratorSpec
    from rlflow.dataflow.graph import Graph, GraphWarning
    from rlflow.dataflow.loader import load_graph, load_spec, loads_graph, loads_spec, spec_from_dict
    from rlflow.dataflow.model_spec import ModelSpec, OptimizerSpec
    from rlflow.dataflow.node_spec import NodeSpec
    from rlflow.dataflow.plan_spec import Layout, NodePlacement
    from rlflow.dataflow.run_spec import RunSpec
    from rlflow.dataflow.spec import GraphSpec

_LAZY: dict[str, str] = {
    "Batch": "rlflow.dataflow.batch",
    "Graph": "rlflow.dataflow.graph",
    "GraphWarning": "rlflow.dataflow.graph",
    "load_graph": "rlflow.dataflow.loader",
    "load_spec": "rlflow.dataflow.loader",
    "loads_graph": "rlflow.dataflow.loader",
    "loads_spec": "rlflow.dataflow.loader",
    "spec_from_dict": "rlflow.dataflow.loader",
    "DataSpec": "rlflow.dataflow.data_spec",
    "DatasetSpec": "rlflow.dataflow.data_spec",
    "GeneratorSpec": "rlflow.dataflow.data_spec",
    "GraphSpec": "rlflow.dataflow.spec",
    "Layout": "rlflow.dataflow.plan_spec",
    "ModelSpec": "rlflow.dataflow.model_spec",
    "NodePlacement": "rlflow.dataflow.plan_spec",
    "NodeSpec": "rlflow.dataflow.node_spec",
    "OptimizerSpec": "rlflow.dataflow.model_spec",
    "RunSpec": "rlflow.dataflow.run_spec",
}

__all__ = [
    "NODE_FUNCTIONS",
    "Batch",
    "DataError",
    "DataSpec",
    "DatasetSpec",
    "GeneratorSpec",
    "Graph",
    "GraphError",
    "GraphSpec",
    "GraphWarning",
    "HostError",
    "Layout",
    "ModelError",
    "ModelSpec",
    "NodeError",
    "NodeFunction",
    "NodePlacement",
    "NodeSpec",
    "OptimizerSpec",
    "PlanError",
    "Registry",
    "RegistryError",
    "RlflowError",
    "RunSpec",
    "load_builtin_functions",
    "load_graph",
    "load_spec",
    "loads_graph",
    "loads_spec",
    "node_function",
    "spec_from_dict",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rlflow.dataflow' has no attribute '{name}'")
