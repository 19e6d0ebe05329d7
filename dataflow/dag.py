"""The DAG of a bound graph: data, version and order edges, the cycle check and the execution order.

A ``networkx.MultiDiGraph`` whose vertices are node names plus the special producer :data:`DATA`:

- **data edges** ``producer -> consumer`` (``kind="data", key=<batch key>``; the multi-edge key is the
  batch key too) — one per key a node reads;
- **version edges** ``T -> C`` (``kind="version", model=<model>``) from a trainable model's train node ``T``
  to every other call ``C`` of that model: ``C`` at iteration i+1 reads the weights ``T`` wrote at
  iteration i. They cross iterations, so they are left out of cycle checks and execution order;
- **order edges** ``C -> T`` (``kind="order", model=<model>``) when ``C`` is not downstream of ``T``: within
  one iteration ``C`` reads the weights before ``T`` overwrites them (read-before-write).

Errors raise :class:`GraphError` prefixed by the graph file and naming both ends of an edge.
"""

from __future__ import annotations

from collections.abc import Mapping

import networkx as nx

from rlflow.dataflow.args import SAMPLING_ARGS
from rlflow.dataflow.binding import BoundNode
from rlflow.dataflow.errors import GraphError, did_you_mean
from rlflow.dataflow.spec import GraphSpec

__all__ = ["DATA", "PROCESSING_ARGS", "build_dag", "execution_order", "flow"]

DATA = "data"
"""The vertex of the data set: the producer of every key in ``data.fields``."""

PROCESSING_ARGS = ("temperature", "top_k", "top_p")
"""The logits-processing arguments an ``own_forward`` input's producer and its consumer must agree on."""
_SAMPLING_DEFAULTS = {a.name: a.default for a in SAMPLING_ARGS if a.name in PROCESSING_ARGS}


def build_dag(spec: GraphSpec, bound: Mapping[str, BoundNode]) -> tuple[nx.MultiDiGraph, dict[str, str]]:
    """The DAG of ``spec`` (its nodes bound: :func:`~rlflow.dataflow.binding.bind_node`) and every batch
    key -> its producer (a node name or :data:`DATA`).

    Raises:
        GraphError: a key with two producers or none, a cycle within one iteration, an ``own_forward``
            input not computed by an inference node on the consumer's model with the same logits
            processing, an EMA model trained by a node or whose source no node trains.
    """
    builder = _DagBuilder(spec, bound)
    builder.data_edges()
    builder.check_cycles()
    builder.version_edges()
    return builder.dag, builder.producers


def flow(dag: nx.MultiDiGraph, kinds: tuple[str, ...] = ("data", "order")) -> nx.DiGraph:
    """Within-iteration dependencies of ``dag`` (data and order edges by default), as a simple digraph."""
    out: nx.DiGraph = nx.DiGraph()
    out.add_nodes_from(dag.nodes)
    out.add_edges_from((u, v) for u, v, d in dag.edges(data=True) if d["kind"] in kinds)
    return out


def execution_order(spec: GraphSpec, dag: nx.MultiDiGraph) -> list[str]:
    """Node names of ``dag`` in an order that respects data and order edges (ties: declaration order in
    ``spec``); the data set is left out."""
    index = {name: i for i, name in enumerate(spec.nodes)}
    index[DATA] = -1
    order = list(nx.lexicographical_topological_sort(flow(dag), key=lambda n: index[n]))
    return [n for n in order if n != DATA]


class _DagBuilder:
    """The edges of one graph, added check by check."""

    def __init__(self, spec: GraphSpec, bound: Mapping[str, BoundNode]) -> None:
        self.spec = spec
        self.bound = bound
        self.dag: nx.MultiDiGraph = nx.MultiDiGraph()
        self.producers: dict[str, str] = {}
        self._src = f"{spec.source}: " if spec.source else ""

    def _error(self, msg: str) -> GraphError:
        return GraphError(self._src + msg)

    def data_edges(self) -> None:
        """One data edge per key a node reads, from its producer; a key has exactly one producer."""
        dag = self.dag
        dag.add_node(DATA, kind="data")
        for key in self.spec.data.batch_keys():
            self.producers[key] = DATA
        for name, node in self.spec.nodes.items():
            dag.add_node(name, kind=node.kind, model=node.model, function=node.function)
            assert isinstance(node.outputs, dict)
            for param, out in node.outputs.items():
                if out is None:
                    continue
                key = str(out)
                if key in self.producers:
                    other = self.producers[key]
                    where = "the data set" if other == DATA else f"node '{other}'"
                    raise self._error(
                        f"nodes.{name}.outputs.{param}: key '{key}' has two producers: {where} and "
                        f"node '{name}'; rename one of them"
                    )
                self.producers[key] = name
        for name, node in self.spec.nodes.items():
            assert isinstance(node.inputs, dict)
            for param, key in node.inputs.items():
                if key not in self.producers:
                    raise self._error(
                        f"nodes.{name}.inputs.{param}: key '{key}' has no producer (no node outputs it and "
                        f"the data set does not provide it){did_you_mean(key, self.producers)}; "
                        f"known keys: {', '.join(sorted(self.producers)) or '(none)'}"
                    )
                producer = self.producers[key]
                if param in {a.name for a in self.bound[name].arg_inputs if a.own_forward}:
                    self._check_own_forward(name, param, key, producer)
                if not dag.has_edge(producer, name, key):
                    dag.add_edge(producer, name, key=key, kind="data")
                    dag.edges[producer, name, key]["key"] = key

    def _check_own_forward(self, name: str, param: str, key: str, producer: str) -> None:
        """An ``own_forward`` arg input must come from an inference node on the consumer's model."""
        model = self.spec.nodes[name].model
        src = None if producer == DATA else self.spec.nodes[producer]
        if src is not None and src.kind == "inference" and src.model == model:
            # the forward must score the distribution the node's loss uses (logits processing included)
            mine_args, their_args = self.bound[name].args, self.bound[producer].args
            for arg in PROCESSING_ARGS:
                mine = mine_args[arg] if arg in mine_args else _SAMPLING_DEFAULTS[arg]
                theirs = their_args[arg] if arg in their_args else _SAMPLING_DEFAULTS[arg]
                if mine != theirs:
                    raise self._error(
                        f"nodes.{producer}.args.{arg}: {theirs!r} differs from node '{name}''s "
                        f"{arg} {mine!r}; '{key}' (input {param}) must score the distribution node "
                        f"'{name}' trains (set the same {arg} on both)"
                    )
            return
        where = "the data set" if src is None else f"node '{producer}' ({src.kind}, model {src.model})"
        raise self._error(
            f"nodes.{name}.inputs.{param}: key '{key}' comes from {where}, but '{param}' must be a forward "
            f"pass of the weights node '{name}' updates: an inference node on model '{model}' (e.g. "
            f"function: logprobs) whose output the node reads"
        )

    def check_cycles(self) -> None:
        """No key depends on itself within one iteration (data edges only exist yet)."""
        try:
            cycle = nx.find_cycle(self.dag)
        except nx.NetworkXNoCycle:
            return
        hops = "".join(f"{u} -[{k}]-> " for u, _, k in cycle) + str(cycle[-1][1])
        u, v, k = cycle[-1]
        raise self._error(
            f"nodes.{v}.inputs: cycle through key '{k}' (edge {u} -> {v}): {hops}; a key cannot depend "
            "on itself within one iteration"
        )

    def version_edges(self) -> None:
        """Every call of a model reads the weights its train nodes (or, for an EMA model, its source's
        train nodes) wrote in the previous iteration: a version edge from the writer to the call, and an
        order edge that runs the call before the writer when nothing else orders them."""
        within = flow(self.dag)
        nodes = self.spec.nodes
        for model_name, model in self.spec.models.items():
            calls = [n for n, spec in nodes.items() if spec.model == model_name]
            if model.ema is not None:
                trainers = [
                    n for n, spec in nodes.items() if spec.model == model.ema.source and spec.kind == "train"
                ]
                self._check_ema_model(model_name, calls, trainers)
            elif model.trainable:
                trainers = [n for n in calls if nodes[n].kind == "train"]
            else:
                continue
            for t in trainers:
                for c in calls:
                    if c == t:
                        continue
                    self.dag.add_edge(t, c, key="version", kind="version", model=model_name)
                    if not nx.has_path(within, t, c) and not nx.has_path(within, c, t):
                        self.dag.add_edge(c, t, key="order", kind="order", model=model_name)
                        within.add_edge(c, t)

    def _check_ema_model(self, model: str, calls: list[str], trainers: list[str]) -> None:
        trained = [n for n in calls if self.spec.nodes[n].kind == "train"]
        source = self.spec.models[model].ema.source  # type: ignore[union-attr]
        if trained:
            raise self._error(
                f"nodes.{trained[0]}.model: model '{model}' follows '{source}' as an EMA "
                f"(models.{model}.ema) and cannot also be trained by a node"
            )
        if not trainers:
            raise self._error(
                f"models.{model}.ema.source: no train node trains '{source}', so the EMA would never move"
            )
