"""The validated dataflow graph.

:meth:`Graph.from_spec` checks a :class:`~rlflow.dataflow.spec.GraphSpec` against the node-function registry
and builds a networkx ``MultiDiGraph`` whose vertices are node names plus the special producer ``"data"``:

- **data edges** ``producer -> consumer`` (``kind="data", key=<batch key>``; the multi-edge key is the
  batch key too) — one per key a node reads;
- **version edges** ``T -> C`` (``kind="version", model=<model>``) from a trainable model's train node ``T``
  to every other call ``C`` of that model: ``C`` at iteration i+1 reads the weights ``T`` wrote at
  iteration i. They cross iterations, so they are left out of cycle checks and execution order;
- **order edges** ``C -> T`` (``kind="order", model=<model>``) when ``C`` is not downstream of ``T``: within
  one iteration ``C`` reads the weights before ``T`` overwrites them (read-before-write).

Every error raises before anything runs and names the file, the node, the key, and both ends of an edge.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

import networkx as nx

from rlflow.dataflow.args import SAMPLING_ARGS, ArgError, bind_args
from rlflow.dataflow.context import check_generation
from rlflow.dataflow.errors import GraphError, PlanError, RegistryError
from rlflow.dataflow.layout_rules import TP_FIELDS, node_layout_problem
from rlflow.dataflow.registry import (
    NODE_FUNCTIONS,
    ArgInput,
    NodeFunction,
    Registry,
    did_you_mean,
    load_builtin_functions,
)
from rlflow.dataflow.sampling import check_stop_tokens, greedy_group_warnings
from rlflow.dataflow.spec import (
    GraphSpec,
    Layout,
    ModelSpec,
    NodePlacement,
    NodeSpec,
    resolve_engine,
    resolve_recompute,
    resolve_reshard,
)

__all__ = ["DATA", "Graph", "GraphWarning", "default_registry", "warn_unplanned_devices"]

DATA = "data"
# generate functions that sample in segments (interruptible generation, ``interrupt_every``):
# ``rlflow.nodes.functions.generate_node`` continues its rollouts between calls (``NodeContext.segment``)
SEGMENTED_FUNCTIONS = ("generate",)


class GraphWarning(UserWarning):
    """A graph that will run but is probably not what was meant (e.g. a key produced and never read)."""


def warn_unplanned_devices(spec: GraphSpec, stacklevel: int = 2) -> None:
    """Warn (:class:`GraphWarning`) when ``spec`` has no plan but several devices: every node runs on
    device 0. ``rlflow run`` (without ``--plan``) and ``rlflow validate`` both say so."""
    if not spec.plan and spec.run.devices > 1:
        msg = (
            f"{spec.source or '<graph>'}: run.devices: {spec.run.devices} devices but no plan: every node "
            "runs on device 0 (write `plan: auto` or pass --plan FILE)"
        )
        warnings.warn(GraphWarning(msg), stacklevel=stacklevel + 1)


def default_registry() -> Registry[NodeFunction]:
    """``NODE_FUNCTIONS`` with its plug-ins (rlflow's own node functions included) loaded."""
    load_builtin_functions()
    return NODE_FUNCTIONS


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith(("ch", "sh", "s", "x")) else f"{n} {word}s"


class Graph:
    """A validated graph: build with :meth:`from_spec` (or :func:`rlflow.dataflow.loader.load_graph`).

    Attributes:
        spec: the spec with every node's ``inputs``/``outputs`` resolved to ordered ``param -> key`` dicts,
            and a non-empty plan completed with device 0 (``d1t1p1m1``) for model-free nodes it leaves out.
        dag: ``networkx.MultiDiGraph`` over node names and ``"data"`` (data, version and order edges).
        registry: the node-function registry validated against.
        warnings: the :class:`GraphWarning` messages raised while building.
    """

    def __init__(self, spec: GraphSpec, registry: Registry[NodeFunction]) -> None:
        """Validate ``spec``; prefer :meth:`from_spec`.

        Raises:
            GraphError: structural mistakes (keys, edges, cycles, functions, models, batch sizes, stop
                tokens outside the model's vocabulary: :mod:`rlflow.dataflow.sampling`).
            PlanError: placement mistakes (devices, layouts, divisibility by dp/micro-batches).
        """
        self.registry = registry
        self.warnings: list[str] = []
        self._src = f"{spec.source}: " if spec.source else ""
        self._functions: dict[str, NodeFunction] = {}
        self._producers: dict[str, str] = {}
        self._args: dict[str, dict[str, Any]] = {}
        self._arg_inputs: dict[str, list[ArgInput]] = {}
        self._group: dict[str, int] = {}
        self._prompts: dict[str, int] = {}
        self._order: list[str] = []
        self.spec = spec
        self._check_models()
        self._check_data()
        nodes = {name: self._check_node(node) for name, node in spec.nodes.items()}
        self.spec = dataclasses.replace(spec, nodes=nodes)
        self.dag: nx.MultiDiGraph = nx.MultiDiGraph()
        self._build_data_edges()
        self._check_cycles()
        self._build_version_edges()
        self._order = self._topological_order()
        self._check_group_sizes()
        self._check_plan()
        self._check_batch_sizes()
        check_generation(self)  # max_new_tokens against the model's max_position_embeddings
        check_stop_tokens(self)  # stop ids inside the model's vocabulary
        self._check_staleness()
        self._warn_unconsumed()
        for msg in greedy_group_warnings(self):  # n identical greedy samples per prompt
            self._warn(msg, stacklevel=4)

    @classmethod
    def from_spec(cls, spec: GraphSpec, registry: Registry[NodeFunction] | None = None) -> Graph:
        """Validate ``spec`` against ``registry`` (default: :func:`default_registry`) and build the graph."""
        return cls(spec, default_registry() if registry is None else registry)

    # -- errors ---------------------------------------------------------------------------------------
    def _error(self, msg: str, err: type[Exception] = GraphError) -> Exception:
        return err(self._src + msg)

    # -- models and data ------------------------------------------------------------------------------
    def _check_models(self) -> None:
        models = self.spec.models
        for name, m in models.items():
            if m.init_from is not None and m.init_from not in models:
                raise self._error(
                    f"models.{name}.init_from: unknown model '{m.init_from}'"
                    f"{did_you_mean(m.init_from, models)}; models: {', '.join(models)}"
                )
            if m.config is not None:
                mt = m.config.get("model_type")
                if not isinstance(mt, str) or not mt:
                    raise self._error(
                        f"models.{name}.config: needs 'model_type' (a Hugging Face model type such as llama)"
                    )
        for name in models:
            seen = [name]
            cur = models[name].init_from
            while cur is not None:
                if cur in seen:
                    chain = " -> ".join([*seen, cur])
                    raise self._error(f"models.{name}.init_from: models initialise from each other: {chain}")
                seen.append(cur)
                cur = models[cur].init_from

        for name, m in models.items():
            if m.ema is None:
                continue
            src = m.ema.source
            if src not in models:
                raise self._error(
                    f"models.{name}.ema.source: unknown model '{src}'{did_you_mean(src, models)}; "
                    f"models: {', '.join(models)}"
                )
            if models[src].head != m.head:
                raise self._error(
                    f"models.{name}.ema.source: '{name}' has head '{m.head}' but '{src}' has head "
                    f"'{models[src].head}'; an EMA needs the same architecture"
                )
            if models[src].ema is not None:
                raise self._error(
                    f"models.{name}.ema.source: '{src}' itself follows an EMA; chains are not supported"
                )

        eval_model = self.spec.run.eval.get("model")
        if eval_model is not None and eval_model not in models:
            raise self._error(
                f"run.eval.model: unknown model {eval_model!r}{did_you_mean(str(eval_model), models)}; "
                f"models: {', '.join(models)}"
            )

    def tokenizer(self, model: str) -> str | None:
        """The tokenizer directory of ``model``: its own ``tokenizer``/``path``, else its ``init_from``'s."""
        m: ModelSpec | None = self.spec.models[model]
        while m is not None:
            if m.tokenizer_dir is not None:
                return m.tokenizer_dir
            m = self.spec.models[m.init_from] if m.init_from is not None else None
        return None

    def _check_data(self) -> None:
        data = self.spec.data
        if data.tokenizer is not None:
            models = self.spec.models
            if data.tokenizer not in models:
                raise self._error(
                    f"data.tokenizer: unknown model '{data.tokenizer}'{did_you_mean(data.tokenizer, models)};"
                    f" models: {', '.join(models)}"
                )
            if self.tokenizer(data.tokenizer) is None:
                raise self._error(
                    f"data.tokenizer: model '{data.tokenizer}' has no tokenizer (give models."
                    f"{data.tokenizer}.tokenizer or a path)"
                )

    # -- nodes ----------------------------------------------------------------------------------------
    def _check_node(self, node: NodeSpec) -> NodeSpec:
        p = f"nodes.{node.name}"
        try:
            fn = self.registry.get(node.function)
        except RegistryError as e:
            raise self._error(f"{p}.function: {e}") from None
        if fn.kind != node.kind:
            raise self._error(
                f"{p}.kind: function '{fn.name}' has kind {fn.kind} but the node's kind is {node.kind}"
            )
        self._functions[node.name] = fn
        models = self.spec.models
        if fn.needs_model:
            if node.model is None:
                raise self._error(
                    f"{p}.model: function '{fn.name}' runs on a model; name one of: {', '.join(models)}"
                )
            if node.model not in models:
                raise self._error(
                    f"{p}.model: unknown model '{node.model}'{did_you_mean(node.model, models)}; "
                    f"models: {', '.join(models) or '(none)'}"
                )
            model = models[node.model]
            if fn.heads and model.head not in fn.heads:
                raise self._error(
                    f"{p}.model: function '{fn.name}' needs a model with head {' or '.join(fn.heads)}, "
                    f"but model '{model.name}' has head {model.head}"
                )
            if node.kind == "generate" and self.tokenizer(model.name) is None:
                raise self._error(
                    f"{p}.model: generate node on model '{model.name}', which has no tokenizer "
                    f"(set models.{model.name}.tokenizer)"
                )
            if node.kind == "train" and not model.trainable:
                raise self._error(
                    f"{p}.model: train node on frozen model '{model.name}' (models.{model.name}.trainable "
                    "is false)"
                )
        elif node.model is not None:
            raise self._error(f"{p}.model: function '{fn.name}' runs without a model; remove 'model'")
        self._args[node.name] = self._check_args(node, fn)
        inputs = self._bind_inputs(node, fn, self._args[node.name])
        outputs = self._bind(node, "outputs", fn.outputs, node.outputs, fn.optional_outputs)
        return dataclasses.replace(node, inputs=inputs, outputs=outputs)

    def _bind_inputs(self, node: NodeSpec, fn: NodeFunction, args: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`_bind` of ``node``'s inputs, plus the arg inputs (:class:`ArgInput`) its ``args`` ask for:
        last in a positional list, by name in a mapping; one asked for and not bound, or bound and not
        asked for, is an error naming the input and the argument."""
        on = [a for a in fn.arg_inputs if a.arg in args and args[a.arg] in a.values]
        self._arg_inputs[node.name] = on
        if not fn.arg_inputs:
            return self._bind(node, "inputs", fn.inputs, node.inputs, fn.optional_inputs)
        p = f"nodes.{node.name}.inputs"
        off = [a for a in fn.arg_inputs if a not in on]

        def when(a: ArgInput) -> str:
            return f"args.{a.arg} is {' or '.join(map(str, a.values))}"

        def missing(a: ArgInput) -> Exception:
            return self._error(
                f"{p}.{a.name}: args.{a.arg} is {args[a.arg]!r}, which reads input '{a.name}' "
                f"({a.doc}), but the node does not bind it; add it to the node's inputs (last in a list)"
            )

        given = node.inputs
        if isinstance(given, Mapping):
            for a in off:
                if a.name in given:
                    raise self._error(
                        f"{p}.{a.name}: read only when {when(a)}, but {a.arg} is {args.get(a.arg)!r}; remove "
                        f"the input or set args.{a.arg}"
                    )
            for a in on:
                if a.name not in given:
                    raise missing(a)
            rest: tuple[str | None, ...] | Mapping[str, str | None] = {
                k: v for k, v in given.items() if k not in {a.name for a in on}
            }
            extra = {a.name: given[a.name] for a in on}
        else:
            counts = {len(fn.inputs), len(fn.inputs) - len(fn.optional_inputs)}
            k = len(on)
            rest, extra = given, {}
            if k and len(given) - k in counts:
                rest, extra = given[:-k], {a.name: key for a, key in zip(on, given[-k:], strict=True)}
            elif k and len(given) in counts:
                raise missing(on[0])
            elif off and len(given) not in counts and len(given) - len(off) in counts:
                a = off[-1]
                raise self._error(
                    f"{p}.{a.name}: the node lists {len(given)} inputs, the last ({given[-1]!r}) as "
                    f"'{a.name}', read only when {when(a)}, but {a.arg} is {args.get(a.arg)!r}; remove it or "
                    f"set args.{a.arg}"
                )
        note = "; ".join(
            f"{a.name} last, when {when(a)}" if a in on else f"{a.name} only when {when(a)}"
            for a in fn.arg_inputs
        )
        bound = self._bind(node, "inputs", fn.inputs, rest, fn.optional_inputs, note=note)
        return {**bound, **extra}

    def _bind(
        self,
        node: NodeSpec,
        what: str,
        params: tuple[str, ...],
        given: tuple[str | None, ...] | Mapping[str, str | None],
        optional: tuple[str, ...] = (),
        note: str = "",
    ) -> dict[str, Any]:
        """``param -> key`` of a node's inputs or outputs; ``optional`` trailing params are bound all or
        none (unbound: left out of inputs, ``None`` (discarded) in outputs). Outputs may bind a leading
        part of the optional ones (listed in order, or named): the others are discarded. ``note`` ends a
        wrong-count message (the arg inputs)."""
        p = f"nodes.{node.name}.{what}"
        signature = f"{node.function}({', '.join(params)})" if what == "inputs" else ", ".join(params)
        required = params[: len(params) - len(optional)]
        if what == "outputs" and optional:
            if isinstance(given, Mapping) and any(q in given for q in optional):
                named = {**dict.fromkeys(q for q in optional if q not in given), **given}
                return self._bind(node, what, params, named)
            if not isinstance(given, Mapping) and len(required) < len(given) < len(params):
                bound = self._bind(node, what, params[: len(given)], given)
                return {**bound, **dict.fromkeys(params[len(given) :])}
        if optional and (
            (isinstance(given, Mapping) and not any(q in given for q in optional))
            or (not isinstance(given, Mapping) and len(given) == len(required))
        ):
            bound = self._bind(node, what, required, given)
            return bound if what == "inputs" else {**bound, **dict.fromkeys(optional)}
        if isinstance(given, Mapping):
            for param in given:
                if param not in params:
                    raise self._error(
                        f"{p}.{param}: function '{node.function}' has no {what[:-1]} '{param}'"
                        f"{did_you_mean(param, params)}; its {what}: {', '.join(params) or '(none)'}"
                    )
            missing = [q for q in params if q not in given]
            if missing:
                raise self._error(
                    f"{p}: function '{node.function}' {what[:-1]}s {', '.join(missing)} are not bound "
                    f"(its {what}: {', '.join(params)})"
                )
            return {q: given[q] for q in params}
        if len(given) != len(params):
            also = f" (or {len(params) - len(optional)} without the optional {', '.join(optional)})"
            raise self._error(
                f"{p}: function '{node.function}' takes {_plural(len(params), what[:-1])} "
                f"({', '.join(params) or 'none'}){also if optional else ''} but the node lists {len(given)}: "
                f"{list(given)}"
                + ("" if what == "inputs" or not params else f" (outputs of {signature})")
                + (f"; plus {note}" if note else "")
            )
        return dict(zip(params, given, strict=True))

    # -- edges ----------------------------------------------------------------------------------------
    def _build_data_edges(self) -> None:
        dag = self.dag
        dag.add_node(DATA, kind="data")
        for key in self.spec.data.batch_keys():
            self._producers[key] = DATA
        for name, node in self.spec.nodes.items():
            dag.add_node(name, kind=node.kind, model=node.model, function=node.function)
            assert isinstance(node.outputs, dict)
            for param, out in node.outputs.items():
                if out is None:
                    continue
                key = str(out)
                if key in self._producers:
                    other = self._producers[key]
                    where = "the data set" if other == DATA else f"node '{other}'"
                    raise self._error(
                        f"nodes.{name}.outputs.{param}: key '{key}' has two producers: {where} and "
                        f"node '{name}'; rename one of them"
                    )
                self._producers[key] = name
        for name, node in self.spec.nodes.items():
            assert isinstance(node.inputs, dict)
            for param, key in node.inputs.items():
                if key not in self._producers:
                    raise self._error(
                        f"nodes.{name}.inputs.{param}: key '{key}' has no producer (no node outputs it and "
                        f"the data set does not provide it){did_you_mean(key, self._producers)}; "
                        f"known keys: {', '.join(sorted(self._producers)) or '(none)'}"
                    )
                producer = self._producers[key]
                if param in {a.name for a in self._arg_inputs[name] if a.own_forward}:
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
            node = self.spec.nodes[name]
            for arg, default in (("temperature", 1.0), ("top_k", None), ("top_p", None)):
                mine, theirs = node.args.get(arg, default), src.args.get(arg, default)
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

    def _flow(self, kinds: tuple[str, ...] = ("data", "order")) -> nx.DiGraph:
        """Within-iteration dependencies (data and order edges by default), as a simple digraph."""
        flow: nx.DiGraph = nx.DiGraph()
        flow.add_nodes_from(self.dag.nodes)
        flow.add_edges_from((u, v) for u, v, d in self.dag.edges(data=True) if d["kind"] in kinds)
        return flow

    def _check_cycles(self) -> None:
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

    def _build_version_edges(self) -> None:
        """Every call of a model reads the weights its train nodes (or, for an EMA model, its source's
        train nodes) wrote in the previous iteration: a version edge from the writer to the call, and an
        order edge that runs the call before the writer when nothing else orders them."""
        flow = self._flow()
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
                    if not nx.has_path(flow, t, c) and not nx.has_path(flow, c, t):
                        self.dag.add_edge(c, t, key="order", kind="order", model=model_name)
                        flow.add_edge(c, t)

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

    def _topological_order(self) -> list[str]:
        index = {name: i for i, name in enumerate(self.spec.nodes)}
        index[DATA] = -1
        order = list(nx.lexicographical_topological_sort(self._flow(), key=lambda n: index[n]))
        return [n for n in order if n != DATA]

    # -- batch sizes ----------------------------------------------------------------------------------
    def _check_group_sizes(self) -> None:
        flow = self._flow(("data",))  # rows follow data edges only; order edges carry no rows
        for name in self._order:
            node = self.spec.nodes[name]
            if node.kind == "generate":
                self._group[name] = int(self._args[name]["n"])
                continue
            sources = {
                a: int(self._args[a]["n"])
                for a in nx.ancestors(flow, name)
                if a != DATA and self.spec.nodes[a].kind == "generate"
            }
            if len(set(sources.values())) > 1:
                desc = ", ".join(f"'{a}' (n={n})" for a, n in sorted(sources.items()))
                raise self._error(
                    f"nodes.{name}: reads from generate nodes with different samples per prompt: {desc}"
                )
            self._group[name] = next(iter(sources.values()), 1)

    def group_size(self, node: str) -> int:
        """Samples per prompt in ``node``'s rows: ``args.n`` of the node itself if it generates, else of
        the generate nodes upstream of it (1 if none)."""
        self._node(node)
        return self._group[node]

    def prompts(self, node: str) -> int:
        """Prompts ``node`` processes per iteration (``batch_size``, or ``batch_size / n`` for samples)."""
        self._node(node)
        return self._prompts[node]

    def rows(self, node: str) -> int:
        """Rows ``node`` splits across mini-batches, data-parallel ranks and micro-batches per iteration:
        prompts for a generate node (each rank then samples ``n`` per prompt), samples otherwise."""
        spec = self._node(node)
        return self._prompts[node] * (1 if spec.kind == "generate" else self._group[node])

    def _unit_text(self, name: str) -> str:
        node, g = self.spec.nodes[name], self._group[name]
        if node.kind == "generate":
            return f"{_plural(self._prompts[name], 'prompt')}"
        if g == 1:
            return f"{self._prompts[name]} rows"
        return f"{self._prompts[name] * g} rows ({_plural(self._prompts[name], 'prompt')} × {g} samples)"

    def _check_batch_sizes(self) -> None:
        for name in self._order:
            node, g = self.spec.nodes[name], self._group[name]
            p = f"nodes.{name}"
            if node.batch_unit == "samples":
                if node.batch_size % g:
                    raise self._error(
                        f"{p}.batch_size: {node.batch_size} samples is not a whole number of groups of "
                        f"n={g} samples per prompt"
                    )
                self._prompts[name] = node.batch_size // g
            else:
                self._prompts[name] = node.batch_size
        # One iteration moves one batch of prompts through the graph: the two ends of every edge agree.
        first_reader: str | None = None
        edges = [(u, v, k) for u, v, k, kind in self.dag.edges(keys=True, data="kind") if kind == "data"]
        edges.sort(key=lambda e: e[0] == DATA)  # node-to-node edges first: they name the key shared
        for u, v, key in edges:
            if u == DATA:
                if first_reader is None:
                    first_reader = v
                u = first_reader
            if self._prompts[u] != self._prompts[v]:
                how = "both read the data set" if self._producers[key] == DATA else f"share key '{key}'"
                raise self._error(
                    f"nodes.{v}.batch_size: nodes '{u}' ({self._unit_text(u)}) and '{v}' "
                    f"({self._unit_text(v)}) {how} but process different numbers of prompts per iteration"
                )
        for name in self._order:
            self._check_divisibility(name)

    def _check_divisibility(self, name: str) -> None:
        node, g = self.spec.nodes[name], self._group[name]
        rows = self.rows(name)
        p = f"nodes.{name}"
        what = self._unit_text(name)
        if rows % node.mini_batches:
            raise self._error(f"{p}.mini_batches: {what} do not divide into {node.mini_batches} mini-batches")
        per_mb = rows // node.mini_batches
        why = self.registry.get(node.function).group_wise
        if why is not None:  # a mini-batch that cut a group would compute its statistics from part of it
            if g < 2:
                raise self._error(
                    f"{p}: function '{node.function}' needs groups of at least 2 samples per prompt "
                    f"(upstream generate args.n is {g}): {why}"
                )
            if per_mb % g:
                raise self._error(
                    f"{p}.mini_batches: {node.mini_batches} mini-batches of {what} would split groups of "
                    f"n={g} samples ({per_mb} rows each): {why}"
                )
        if self.spec.plan == "auto":
            return
        layout = self.placement(name).layout
        why = node_layout_problem(self, name, layout)
        if why is None:
            return
        where = f"plan.{name}.layout"
        if why.key in TP_FIELDS:
            msg = f"{where}: tp={layout.tp} does not divide model '{node.model}' {why.key}={why.value}"
        elif why.key in ("pp", "tp", "num_hidden_layers"):
            msg = f"{where}: {why}"
        elif why.key == "group_size":
            msg = f"{p}: {why} (layout {layout})"
        elif why.key == "micro_batches":
            per_rank = per_mb // layout.dp
            msg = (
                f"{p}: {what} in {_plural(node.mini_batches, 'mini-batch')} over dp={layout.dp} ranks leave "
                f"{per_rank} rows per rank, which do not divide into m={layout.micro_batches} micro-batches "
                f"(layout {layout})"
            )
        else:  # dp (mini-batches are checked above, without the layout)
            msg = (
                f"{p}: {what} in {_plural(node.mini_batches, 'mini-batch')} of {per_mb} rows do not divide "
                f"over dp={layout.dp} data-parallel ranks (layout {layout})"
            )
        raise self._error(msg, PlanError)

    # -- plan -----------------------------------------------------------------------------------------
    def _check_plan(self) -> None:
        plan = self.spec.plan
        if plan == "auto" or not plan:
            return
        nodes = self.spec.nodes
        for name in plan:
            if name not in nodes:
                raise self._error(
                    f"plan.{name}: unknown node '{name}'{did_you_mean(name, nodes)}; "
                    f"nodes: {', '.join(nodes)}",
                    PlanError,
                )
        missing = [n for n in nodes if n not in plan and nodes[n].model is not None]
        if missing:
            raise self._error(
                f"plan: no placement for node{'s' if len(missing) > 1 else ''} {', '.join(missing)}; place "
                "every node that calls a model (model-free nodes default to device 0, d1t1p1m1), or write "
                "'plan: auto'",
                PlanError,
            )
        # Model-free nodes (rule rewards) need no device of their own; `rlflow plan` leaves them out.
        plan = {n: plan.get(n, NodePlacement((0,), Layout())) for n in nodes}
        self.spec = dataclasses.replace(self.spec, plan=plan)
        for name, placement in plan.items():
            p = f"plan.{name}"
            bad = [d for d in placement.devices if d >= self.spec.run.devices]
            if bad:
                raise self._error(
                    f"{p}.devices: device {bad[0]} does not exist; run.devices is {self.spec.run.devices} "
                    f"(ids 0..{self.spec.run.devices - 1})",
                    PlanError,
                )
            node, engine = nodes[name], placement.engine
            # a plan may restate the node's own setting (plans written under `recompute=auto` say false)
            for key, what in (("recompute", "recomputation"), ("reshard", "resharding")):
                chosen, own = getattr(placement, key), getattr(node, key)
                if chosen is None or own in ("auto", chosen):
                    continue
                if node.kind != "train":
                    article = "an" if node.kind == "inference" else "a"
                    raise self._error(
                        f"{p}.{key}: {str(chosen).lower()}, but only a train node has {key}; '{name}' is "
                        f"{article} {node.kind} node",
                        PlanError,
                    )
                raise self._error(
                    f"{p}.{key}: {str(chosen).lower()} but nodes.{name}.{key} is {str(own).lower()}; "
                    f"a plan chooses {what} only for '{key}: auto'",
                    PlanError,
                )
            if engine is None:
                continue
            if node.kind != "generate":
                raise self._error(
                    f"{p}.engine: engines run generate nodes, not {node.kind} node '{name}'", PlanError
                )
            if node.engine not in ("auto", engine):
                raise self._error(
                    f"{p}.engine: '{engine}' but nodes.{name}.engine is '{node.engine}'; a plan chooses the "
                    "engine only for 'engine: auto'",
                    PlanError,
                )

    def placement(self, node: str) -> NodePlacement:
        """Mesh and layout of ``node``: from the plan, or device 0 with d1t1p1m1 when the plan is omitted.

        Raises:
            PlanError: when the plan is ``auto`` (run the planner first).
        """
        self._node(node)
        plan = self.spec.plan
        if plan == "auto":
            raise PlanError(
                f"{self._src}plan is 'auto': node '{node}' has no placement until the planner runs"
            )
        return plan.get(node, NodePlacement((0,), Layout()))

    def engine(self, node: str) -> str:
        """The engine generate node ``node`` runs with (``builtin`` for other nodes): the node's own, or for
        ``engine: auto`` the plan's choice (``NodePlacement.engine``; ``builtin`` when a hand-written plan
        names none: :func:`~rlflow.dataflow.spec.resolve_engine`); ``auto`` while the plan is ``auto``.
        """
        spec = self._node(node)
        if self.spec.plan == "auto":
            return spec.engine
        return resolve_engine(spec.engine, self.placement(node).engine)

    def recompute(self, node: str) -> bool:
        """Whether train node ``node`` recomputes activations: the node's ``recompute``, or for ``auto`` the
        plan's choice (``NodePlacement.recompute``; off when a hand-written plan makes none:
        :func:`~rlflow.dataflow.spec.resolve_recompute`); ``False`` while the plan is ``auto``."""
        spec = self._node(node)
        if self.spec.plan == "auto":
            return spec.recompute is True
        return resolve_recompute(spec.recompute, self.placement(node).recompute)

    def reshard(self, node: str) -> bool:
        """Whether train node ``node`` reshards its FSDP2 units after every micro-batch: the node's
        ``reshard``, or for ``auto`` the plan's choice (``NodePlacement.reshard``; on when a hand-written plan
        makes none: :func:`~rlflow.dataflow.spec.resolve_reshard`); ``True`` while the plan is ``auto``."""
        spec = self._node(node)
        if self.spec.plan == "auto":
            return spec.reshard is not False
        return resolve_reshard(spec.reshard, self.placement(node).reshard)

    def run_node(self, node: str) -> NodeSpec:
        """The spec of ``node`` as the runtime runs it: :meth:`node` with ``engine: auto`` resolved
        (:meth:`engine`), ``recompute: auto`` (:meth:`recompute`) and ``reshard: auto`` (:meth:`reshard`)
        resolved, which the node function and the runtime's training hooks read from its context."""
        spec = self._node(node)
        engine, recompute, reshard = self.engine(node), self.recompute(node), self.reshard(node)
        if engine == spec.engine and recompute is spec.recompute and reshard is spec.reshard:
            return spec
        return dataclasses.replace(spec, engine=engine, recompute=recompute, reshard=reshard)

    def _check_args(self, node: NodeSpec, fn: NodeFunction) -> dict[str, Any]:
        """``node.args`` checked against ``fn``'s declared arguments (:attr:`NodeFunction.args`), defaults
        filled; what :meth:`args` returns.

        A function without a schema (a plug-in that predates schemas) is checked by name against its
        keyword parameters (any name when it takes ``**kwargs``), and its ``args`` are returned as written,
        with the sampling arguments (:data:`~rlflow.dataflow.args.SAMPLING_ARGS`) checked and filled for a
        generate node.
        """
        p = f"nodes.{node.name}.args"
        if fn.args is None and node.kind == "generate":
            try:
                sampling = bind_args(SAMPLING_ARGS, node.args, extra=True)
            except ArgError as e:
                raise self._error(f"{p}.{e.key}: {e}") from None
            plain = dataclasses.replace(  # other args
                node, kind="inference", engine="builtin", staleness=0, interrupt_every=0
            )
            return {**self._check_args(plain, fn), **sampling}
        if fn.args is not None:
            try:
                return fn.bind(node.args)
            except ArgError as e:
                who = "" if any(a.name == e.key for a in fn.args) else f"function '{fn.name}' "
                raise self._error(f"{p}.{e.key}: {who}{e}") from None
        try:
            params = inspect.signature(fn.fn).parameters
        except (TypeError, ValueError):  # builtins without a signature: nothing to check
            return dict(node.args)
        allowed = {q for q, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
        if not any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()):
            for arg in node.args:
                if arg not in allowed:
                    raise self._error(
                        f"{p}.{arg}: function '{node.function}' takes no argument '{arg}'"
                        f"{did_you_mean(arg, allowed)}; it takes: {', '.join(sorted(allowed)) or '(none)'}"
                    )
        return dict(node.args)

    def args(self, node: str) -> dict[str, Any]:
        """The checked arguments of ``node``: every declared argument of its function, defaults filled
        from the schema (as the function receives them); for an undeclared function, ``args`` as written."""
        self._node(node)
        return dict(self._args[node])

    # -- asynchrony ----------------------------------------------------------------------------------
    def segments(self, node: str) -> int:
        """How many calls one iteration of ``node`` takes: ``ceil(max_new_tokens / interrupt_every)`` for a
        generate node with interruptible generation (``interrupt_every`` tokens per segment), else 1."""
        spec = self._node(node)
        if not spec.interrupt_every:
            return 1
        budget = int(self._args[node].get("max_new_tokens", 0))
        return max(1, -(-budget // spec.interrupt_every))

    def trainers(self, node: str) -> list[str]:
        """The train nodes whose weights ``node`` reads across iterations (the sources of its version
        edges), in execution order; empty for a frozen model or a model-free node."""
        self._node(node)
        sources = {u for u, v, d in self.dag.in_edges(node, data=True) if d["kind"] == "version"}
        return [n for n in self._order if n in sources]

    def _check_staleness(self) -> None:
        """Generate nodes with ``staleness`` >= 1 (asynchronous RL).

        Raises:
            GraphError: the node reads its model after a train node of that model within the iteration
                (a data path from the trainer): generation of iteration k+1 would need iteration k+1's
                training, so it cannot run ahead.

        Warns:
            GraphWarning: the model is never trained (staleness has no effect); generation and a train
                node of its model share devices, so they cannot overlap in time (the version schedule
                still holds, the run is as slow as a synchronous one).
        """
        flow = self._flow()
        for name, node in self.spec.nodes.items():
            if not node.staleness:
                continue
            p = f"nodes.{name}.staleness"
            trainers = self.trainers(name)
            if not trainers:
                self._warn(
                    f"{self._src}{p}: model '{node.model}' is never trained, so staleness "
                    f"{node.staleness} has no effect",
                    5,
                )
                continue
            after = [t for t in trainers if nx.has_path(flow, t, name)]
            if after:
                raise self._error(
                    f"{p}: generate node '{name}' reads model '{node.model}' after its train node "
                    f"'{after[0]}' within an iteration (a path {after[0]} -> {name}); staleness needs "
                    "generation to come before training"
                )
            if node.interrupt_every and node.function not in SEGMENTED_FUNCTIONS:
                raise self._error(
                    f"nodes.{name}.interrupt_every: function '{node.function}' does not sample in segments "
                    f"(interruptible generation: {', '.join(SEGMENTED_FUNCTIONS)}); drop interrupt_every"
                )
            if node.interrupt_every and self.segments(name) == 1:
                self._warn(
                    f"{self._src}nodes.{name}.interrupt_every: {node.interrupt_every} tokens is not below "
                    f"max_new_tokens ({self._args[name].get('max_new_tokens')}), so a rollout is never "
                    "interrupted (one segment)",
                    5,
                )
            if self.spec.plan == "auto":
                continue  # placed by the planner: checked again on the planned graph
            devices = set(self.placement(name).devices)
            shared = [t for t in trainers if devices & set(self.placement(t).devices)]
            if shared:
                both = sorted(devices & set(self.placement(shared[0]).devices))
                self._warn(
                    f"{self._src}{p}: generation and training cannot overlap: '{name}' and train node "
                    f"'{shared[0]}' share device{'s' if len(both) > 1 else ''} {both}; the version schedule "
                    f"(weights up to {node.staleness} version{'s' if node.staleness > 1 else ''} old) "
                    "holds, but they run one after the other (place them on disjoint devices)",
                    5,
                )

    # -- warnings -------------------------------------------------------------------------------------
    def _warn_unconsumed(self) -> None:
        for key, producer in self._producers.items():
            if not self.consumers(key):
                where = "the data set" if producer == DATA else f"node '{producer}'"
                field = "data.fields" if producer == DATA else f"nodes.{producer}.outputs"
                self._warn(f"{self._src}{field}: key '{key}' is produced by {where} but never consumed", 5)

    def _warn(self, msg: str, stacklevel: int) -> None:
        """Record ``msg``; warn (:class:`GraphWarning`) at ``stacklevel``, the caller of :meth:`from_spec`."""
        self.warnings.append(msg)
        warnings.warn(GraphWarning(msg), stacklevel=stacklevel)

    # -- queries --------------------------------------------------------------------------------------
    def _node(self, name: str) -> NodeSpec:
        try:
            return self.spec.nodes[name]
        except (KeyError, TypeError):
            raise GraphError(
                f"{self._src}unknown node '{name}'{did_you_mean(name, self.spec.nodes)}; "
                f"nodes: {', '.join(self.spec.nodes)}"
            ) from None

    @property
    def nodes(self) -> dict[str, NodeSpec]:
        """Node specs (bindings resolved) in declaration order."""
        return self.spec.nodes

    def node(self, name: str) -> NodeSpec:
        """The spec of node ``name`` (GraphError with a suggestion if unknown)."""
        return self._node(name)

    def function(self, node: str) -> NodeFunction:
        """The registered function node ``node`` runs."""
        self._node(node)
        return self._functions[node]

    def execution_order(self) -> list[str]:
        """Node names in an order that respects data and order edges (ties: declaration order)."""
        return list(self._order)

    def dependencies(self, node: str) -> list[str]:
        """Nodes that must finish before ``node`` starts within one iteration (its data and order edges),
        in execution order; the data set is not a node.

        Raises:
            GraphError: ``node`` is not in the graph.
        """
        self._node(node)
        before = set(self._flow().predecessors(node))
        return [n for n in self._order if n in before]

    def keys(self) -> dict[str, str]:
        """Every batch key -> its producer (a node name or ``"data"``)."""
        return dict(self._producers)

    def producer(self, key: str) -> str:
        """The node producing ``key``, or ``"data"`` for a dataset field."""
        try:
            return self._producers[key]
        except (KeyError, TypeError):
            raise GraphError(f"{self._src}unknown key '{key}'{did_you_mean(key, self._producers)}") from None

    def consumers(self, key: str) -> list[str]:
        """Nodes reading ``key``, in execution order."""
        producer = self.producer(key)
        readers = {v for _, v, k in self.dag.out_edges(producer, keys=True) if k == key}
        return [n for n in self._order if n in readers]

    def is_per_prompt(self, key: str) -> bool:
        """Whether ``key`` has one row per prompt (from the data set or computed before any generation);
        a samples node reading it gets it repeated ``n`` times."""
        producer = self.producer(key)
        return producer == DATA or (
            self.spec.nodes[producer].kind != "generate" and self._group[producer] == 1
        )

    def edges(self, kind: str | None = None) -> list[tuple[str, str, dict[str, Any]]]:
        """``(u, v, attributes)`` for every edge, or only those of ``kind`` (data | version | order)."""
        return [(u, v, dict(d)) for u, v, d in self.dag.edges(data=True) if kind is None or d["kind"] == kind]

    def to_yaml(self) -> str:
        """The resolved graph as graph-file YAML (loads back to an equal graph)."""
        from omegaconf import OmegaConf

        return OmegaConf.to_yaml(OmegaConf.create(self.spec.to_dict()))

    def __repr__(self) -> str:
        return (
            f"Graph({self.spec.source or '<python>'}: {len(self.nodes)} nodes, {len(self._producers)} keys)"
        )
