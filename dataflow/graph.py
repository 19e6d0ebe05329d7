"""The validated dataflow graph: :class:`Graph`, what the planner, the runtime and the CLI read.

:meth:`Graph.from_spec` checks a :class:`~rlflow.dataflow.spec.GraphSpec` against the node-function registry,
in this order: model references and each node against its function (:mod:`~rlflow.dataflow.binding`), the
DAG of data, version and order edges (:mod:`~rlflow.dataflow.dag`), samples per prompt, the plan, batch sizes
and their divisibility by each layout (:mod:`~rlflow.dataflow.layout_rules`), generation lengths
(:mod:`~rlflow.dataflow.context`), stop tokens (:mod:`~rlflow.dataflow.sampling`), staleness; then it warns
about keys nobody reads and greedy groups. The graph then answers queries: a node's spec, function, checked
arguments, rows, placement and resolved engine, the producers and consumers of keys, the execution order.

Every error raises before anything runs and names the file, the node, the key, and both ends of an edge.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import networkx as nx

from rlflow.dataflow.binding import bind_nodes, check_references
from rlflow.dataflow.context import check_generation
from rlflow.dataflow.dag import DATA, build_dag, execution_order, flow
from rlflow.dataflow.errors import GraphError, PlanError, did_you_mean
from rlflow.dataflow.fields import plural
from rlflow.dataflow.filtering import FilterSplit, check_filter, split_at_filter, through_filter
from rlflow.dataflow.layout_rules import EXPERT_FIELDS, TP_FIELDS, node_layout_problem
from rlflow.dataflow.model_configs import check_model_configs
from rlflow.dataflow.model_spec import model_tokenizer
from rlflow.dataflow.node_spec import DeepSpeedSpec, NodeSpec
from rlflow.dataflow.plan_spec import (
    DEFAULT_PLACEMENT,
    NodePlacement,
    resolve_engine,
    resolve_recompute,
    resolve_reshard,
    share_problem,
)
from rlflow.dataflow.registry import NODE_FUNCTIONS, NodeFunction, Registry, load_builtin_functions
from rlflow.dataflow.sampling import check_stop_tokens, greedy_group_warnings
from rlflow.dataflow.spec import GraphSpec

__all__ = ["Graph", "GraphWarning", "default_registry", "warn_unplanned_devices"]

# generate functions that sample in segments (interruptible generation, ``interrupt_every``):
# ``rlflow.nodes.functions.generate.generate_node`` continues its rollouts between calls
# (``NodeContext.segment``)
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


class Graph:
    """A validated graph: build with :meth:`from_spec` (or :func:`rlflow.dataflow.loader.load_graph`).

    Attributes:
        spec: the spec with every node's ``inputs``/``outputs`` resolved to ordered ``param -> key`` dicts,
            and a non-empty plan completed with device 0 (``d1t1p1m1``) for model-free nodes it leaves out.
        dag: ``networkx.MultiDiGraph`` over node names and ``"data"`` (data, version and order edges).
        registry: the node-function registry validated against.
        warnings: the :class:`GraphWarning` messages raised while building.
        filter: the filter node and the sides it splits the graph into (``None``: no filter;
            :mod:`~rlflow.dataflow.filtering`).
    """

    def __init__(self, spec: GraphSpec, registry: Registry[NodeFunction]) -> None:
        """Validate ``spec``; prefer :meth:`from_spec`.

        Raises:
            GraphError: structural mistakes (keys, edges, cycles, functions, models, batch sizes, stop
                tokens outside the model's vocabulary: :mod:`rlflow.dataflow.sampling`);
                :class:`~rlflow.dataflow.errors.GraphMistakes` where several nodes do not bind to their
                functions (each node's first mistake: arguments, inputs, outputs).
            PlanError: placement mistakes (devices, layouts, divisibility by dp/micro-batches).
        """
        self.registry = registry
        self.warnings: list[str] = []
        self._src = f"{spec.source}: " if spec.source else ""
        self._group: dict[str, int] = {}
        self._prompts: dict[str, int] = {}
        check_references(spec)  # init_from, ema.source, data.tokenizer, run.eval.model
        check_model_configs(spec)  # sizes and config.json, before any layout rule reads them
        bound = bind_nodes(spec, registry)  # every node that does not bind: GraphMistakes
        self._functions = {name: b.function for name, b in bound.items()}
        self._args = {name: b.args for name, b in bound.items()}
        self.spec = dataclasses.replace(spec, nodes={name: b.spec for name, b in bound.items()})
        self.dag, self._producers = build_dag(self.spec, bound)
        # a filter node: the nodes it reads from run per round, the rest after it (order edges)
        self.filter: FilterSplit | None = split_at_filter(self.spec, self.dag, self._functions, self._args)
        self._order = execution_order(self.spec, self.dag)
        self._check_group_sizes()
        self._check_plan()
        self._check_batch_sizes()
        check_filter(self)  # its groups against its predicates, its target against its rounds
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

    # -- models ---------------------------------------------------------------------------------------
    def tokenizer(self, model: str) -> str | None:
        """The tokenizer directory of ``model``: its own ``tokenizer``/``path``, else its ``init_from``'s."""
        return model_tokenizer(self.spec.models, model)

    # -- batch sizes ----------------------------------------------------------------------------------
    def _check_group_sizes(self) -> None:
        rows = flow(self.dag, ("data",))  # rows follow data edges only; order edges carry no rows
        for name in self._order:
            node = self.spec.nodes[name]
            if node.kind == "generate":
                self._group[name] = int(self._args[name]["n"])
                continue
            sources = {
                a: int(self._args[a]["n"])
                for a in nx.ancestors(rows, name)
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
            return f"{plural(self._prompts[name], 'prompt')}"
        if g == 1:
            return f"{self._prompts[name]} rows"
        return f"{self._prompts[name] * g} rows ({plural(self._prompts[name], 'prompt')} × {g} samples)"

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
            through = through_filter(self.filter, u, v)  # rows that pass a filter: its count
            if through is None:
                continue
            u = through
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
        elif why.key in ("pp", "tp", "ep", "num_hidden_layers", *EXPERT_FIELDS):
            msg = f"{where}: {why}"
        elif why.key == "group_size":
            msg = f"{p}: {why} (layout {layout})"
        elif why.key == "micro_batches":
            per_rank = per_mb // layout.dp
            msg = (
                f"{p}: {what} in {plural(node.mini_batches, 'mini-batch')} over dp={layout.dp} ranks leave "
                f"{per_rank} rows per rank, which do not divide into m={layout.micro_batches} micro-batches "
                f"(layout {layout})"
            )
        else:  # dp (mini-batches are checked above, without the layout)
            msg = (
                f"{p}: {what} in {plural(node.mini_batches, 'mini-batch')} of {per_mb} rows do not divide "
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
        plan = {n: plan.get(n, DEFAULT_PLACEMENT) for n in nodes}
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
                    f"a plan chooses {what} only where the graph leaves nodes.{name}.{key} out (or 'auto')",
                    PlanError,
                )
            budget, layout = node.max_tokens_per_micro_batch, placement.layout
            if budget is not None and layout.micro_batches > 1:
                raise self._error(
                    f"{p}.layout: {layout} has m={layout.micro_batches} micro-batches, but "
                    f"nodes.{name}.max_tokens_per_micro_batch is {budget}: the token budget sets the "
                    "micro-batches (use m1, or drop the budget)",
                    PlanError,
                )
            if budget is not None and layout.pp > 1:
                raise self._error(
                    f"{p}.layout: {layout} has pp={layout.pp} pipeline stages, but "
                    f"nodes.{name}.max_tokens_per_micro_batch is {budget}: token-budget micro-batches vary "
                    "in number and width, which a pipeline schedule does not take (use pp1, or drop the "
                    "budget)",
                    PlanError,
                )
            self._warn_zero_unsharded(name, placement)
            pinned = node.args.get("gpu_memory_utilization")
            why = share_problem(name, node.kind, pinned, placement, node.engine)
            if why is not None:
                raise self._error(f"{p}.gpu_memory_utilization: {why}", PlanError)
            if engine is None:
                continue
            if node.kind != "generate":
                raise self._error(
                    f"{p}.engine: engines run generate nodes, not {node.kind} node '{name}'", PlanError
                )
            if node.engine not in ("auto", engine):
                raise self._error(
                    f"{p}.engine: '{engine}' but nodes.{name}.engine is '{node.engine}'; a plan chooses the "
                    f"engine only where the graph leaves nodes.{name}.engine out (or 'auto')",
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
        return plan.get(node, DEFAULT_PLACEMENT)

    def engine(self, node: str) -> str:
        """The engine generate node ``node`` runs with (``builtin`` for other nodes): the node's own, or for
        ``engine: auto`` (or left out) the plan's choice (``NodePlacement.engine``; ``builtin`` when a
        hand-written plan names none: :func:`~rlflow.dataflow.plan_spec.resolve_engine`); ``auto`` while the
        plan is ``auto``.
        """
        spec = self._node(node)
        if self.spec.plan == "auto":
            return str(spec.engine)  # set by now: NodeSpec fills a left-out engine
        return resolve_engine(spec.engine, self.placement(node).engine)

    def recompute(self, node: str) -> bool:
        """Whether train node ``node`` recomputes activations: the node's ``recompute``, or for ``auto`` the
        plan's choice (``NodePlacement.recompute``; off when a hand-written plan makes none:
        :func:`~rlflow.dataflow.plan_spec.resolve_recompute`); ``False`` while the plan is ``auto``."""
        spec = self._node(node)
        if self.spec.plan == "auto":
            return spec.recompute is True
        return resolve_recompute(spec.recompute, self.placement(node).recompute)

    def reshard(self, node: str) -> bool:
        """Whether train node ``node`` reshards its FSDP2 units after every micro-batch: the node's
        ``reshard``, or for ``auto`` the plan's choice (``NodePlacement.reshard``; on when a hand-written plan
        makes none: :func:`~rlflow.dataflow.plan_spec.resolve_reshard`); ``True`` while the plan is
        ``auto``."""
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
        budget = int(self._args[node]["max_new_tokens"])
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
        within = flow(self.dag)
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
            after = [t for t in trainers if nx.has_path(within, t, name)]
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
    def _warn_zero_unsharded(self, name: str, placement: NodePlacement) -> None:
        """A DeepSpeed ZeRO node on one data-parallel rank of a multi-device run partitions nothing (ZeRO
        shards over dp ranks only) and offloads nothing: it trains as plain data parallel would."""
        node = self.spec.nodes[name]
        ds = node.deepspeed or DeepSpeedSpec()
        offloads = "cpu" in (ds.offload_optimizer, ds.offload_param)
        if node.engine != "deepspeed" or placement.layout.dp > 1 or offloads or self.spec.run.devices < 2:
            return
        self._warn(
            f"{self._src}plan.{name}: engine deepspeed with ZeRO stage {ds.zero_stage} on one data-parallel "
            f"rank (layout {placement.layout}) shards nothing and offloads nothing; place it on dp >= 2 "
            "devices (e.g. a plan with d2) or set nodes."
            f"{name}.deepspeed.offload_optimizer: cpu",
            6,
        )

    def _warn_unconsumed(self) -> None:
        run = self.spec.run
        evaluated = bool(run.eval_interval and run.eval.get("reward"))  # the held-out reward reads 'answer',
        reward = str(run.eval.get("reward"))  # or a scoring node function's data inputs ('tests')
        read = set(NODE_FUNCTIONS.get(reward).inputs) if reward in NODE_FUNCTIONS else {"answer"}
        for key, producer in self._producers.items():
            if key in read and producer == DATA and evaluated:
                continue
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
        before = set(flow(self.dag).predecessors(node))
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
