"""The planner's problem built from a graph (the graph layer's ``Graph``): model shapes from the models'
configs, one ``PlanNode`` per model node with the work the graph gives it (rows, lengths, engine choices,
first pass, memory settings), and the data and version edges.

Token lengths come from the data layer as plain numbers (``rlflow.nodes.data_lengths``); a node's first
pass from its function's trait; engines from the vLLM capability check (``rlflow.nodes.engines``). Nothing
here reads data rows, loads a tokenizer or branches on a function's name.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.model_configs import read_config_json
from rlflow.schedulers.planner.adapters import LoraShape, adapter_count
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.rounds import round_calls
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.planner.zero_cost import ZeroConfig

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["engine_choices", "engine_context_of", "first_pass_share", "problem_from_graph"]


def first_pass_share(graph: Graph, name: str) -> float:
    """The share of train node ``name``'s rows (0 to 1) over which it first runs a no-grad forward of its
    model (a PPO-style trainer recomputing the old policy's log-probs): its node function's ``first_pass``
    trait (``rlflow.dataflow.registry.NodeFunction.first_pass``) on the node's bound arguments and
    ``mini_batches``, for a policy (a model with an ``lm`` head); 0 for a function without the trait,
    another node kind, or a value or reward model's trainer. A decoupled trainer's proximal forward is an
    inference node of the graph, priced as one: its function's trait says no first pass."""
    nspec = graph.spec.nodes[name]
    model = graph.spec.models.get(nspec.model or "")
    if nspec.kind != "train" or model is None or model.head != "lm":
        return 0.0
    trait = graph.function(name).first_pass
    return 0.0 if trait is None else float(trait(graph.args(name), nspec.mini_batches))


def engine_choices(graph: Graph, node: str, device_type: str = "cpu") -> tuple[str, ...]:
    """The engines ``plan: auto`` may run generate node ``node`` with: its own engine, or for
    ``engine: auto`` ``builtin`` plus ``vllm`` where vLLM can serve the node on ``device_type``
    (``rlflow.nodes.engines.validation.vllm_problem``: installed, the built-in ``generate`` function, a
    model shape it serves; the layout rule then keeps it at tp = 1)."""
    spec = graph.spec.nodes[node]
    if spec.engine != "auto":
        return (str(spec.engine),)
    from rlflow.nodes.engines.validation import vllm_problem

    return ("builtin",) if vllm_problem(graph, node, device_type) else ("builtin", "vllm")


def engine_context_of(graph: Graph, node: str) -> int:
    """Generate node ``node``'s engine context in tokens (``sizing.engine_context``): the most prompt
    tokens a data row may have (``rlflow.dataflow.context.prompt_limit``) plus its ``max_new_tokens``, held
    to its model's positions; 0 when the model's positions are unknown. The runtime starts the engine with
    the same (``rlflow.schedulers.runtime.instances.engine_settings``)."""
    from rlflow.dataflow.context import max_positions, prompt_limit  # lazily: the data layer imports torch
    from rlflow.nodes.engines.sizing import engine_context

    model = graph.spec.nodes[node].model
    positions = max_positions(graph, str(model)) if model is not None else None
    if positions is None:
        return 0
    limit = prompt_limit(graph)
    new = int(graph.args(node).get("max_new_tokens") or 0)
    return engine_context(limit[0] if limit is not None else None, new, positions)


def problem_from_graph(
    graph: Graph,
    prompt_len: int | None = None,
    default_gen_len: int = 128,
    device_type: str = "cpu",
    mean_new_tokens: float | None = None,
    pass_rate: float | None = None,
) -> PlanProblem:
    """Build the planner's problem from a ``rlflow.dataflow.graph.Graph`` (contract API).

    Reads ``graph.spec.models`` (``config`` dict, or ``path`` to an HF dir with ``config.json``, or those of
    the model it is ``init_from`` or the ``base_of``; ``head``, ``dtype``; ``lora`` as
    ``ModelShape.lora``, ``base_of`` as ``ModelShape.base_of`` with its LoRA model's head and dtype),
    ``graph.spec.nodes`` (``model``, ``kind``, ``batch_size``, ``batch_unit``, ``epochs``,
    ``mini_batches``, ``args.max_new_tokens``, ``args.gpu_memory_utilization``; a train node's
    ``engine: deepspeed`` with its ``deepspeed`` settings as ``PlanNode.zero``), ``graph.execution_order()``,
    ``graph.group_size(node)`` and the data / version edges of ``graph.dag``.

    Rows: ``graph.rows(node)`` (sequences per iteration, group size applied).
    Lengths: prompt length from ``prompt_len``, else measured on the data
    (``rlflow.nodes.data_lengths.measure_data_lengths``), else 128 tokens; generated length = the generate
    node's ``args.max_new_tokens``. Mean response tokens of the length model (``PlanNode.gen_mean``,
    ``lengths.py``): ``mean_new_tokens``, else measured on the data set's responses (the same function: a
    tokenized ``reference`` or ``response``), else none (every response runs to ``max_new_tokens``). Mean
    real prompt tokens (``PlanNode.prompt_mean``, what a token-budget node's packed forward computes of a
    prompt): measured on the data, else (the data not read: ``prompt_len`` and ``mean_new_tokens`` both
    given, or no tokenized ``prompt``) the prompt width. A node's token budget:
    ``max_tokens_per_micro_batch``.
    First pass of a train node: :func:`first_pass_share`.
    Rounds: a filter's round side runs ``rounds.round_calls`` times per iteration (``PlanNode.rounds``), at
    ``pass_rate``, else the rate a run in ``run.output_dir`` measured, else the filter's stated one.
    Engines: a node's ``engine``; for ``engine: auto`` the choices :func:`engine_choices` gives on
    ``device_type`` (``cpu`` or ``cuda``).

    Raises:
        GraphError: a node refers to a model without a readable config.
        PlanError: ``mean_new_tokens`` is not positive; ``<file>: models.<model>: config.<key>: ...`` for a
            model whose architecture the planner does not price (``architectures.read_architecture``).
    """
    from rlflow.dataflow.context import max_positions  # lazily: the data layer imports torch
    from rlflow.nodes.data_lengths import DataLengths, measure_data_lengths

    spec = graph.spec
    models: dict[str, ModelShape] = {}
    for name, mspec in spec.models.items():
        config = mspec.config
        source, seen = mspec, {name}
        while not config and not source.path and (source.init_from or source.base_of):
            # e.g. ref: init_from actor, or base_of actor -> the actor's shape
            parent = str(source.init_from or source.base_of)
            if parent in seen or parent not in spec.models:
                break
            seen.add(parent)
            source = spec.models[parent]
            config = source.config
        if not config and source.path:
            cfg_path = Path(str(source.path)) / "config.json"
            config = read_config_json(cfg_path, f"models.{name}.path", spec.source)
            if config is None:
                raise GraphError(f"model {name!r}: cannot read {cfg_path}")
        if not config:
            raise GraphError(f"model {name!r}: needs a config or a path for planning")
        try:
            # a base view runs its LoRA model's module: that model's head and dtype, no adapters
            owner = spec.models.get(mspec.base_of or "", mspec)
            shape = ModelShape.from_config(
                dict(config), head=owner.head, dtype=owner.dtype, device_type=device_type
            )
            if mspec.lora is not None:
                lora = LoraShape(mspec.lora.rank, mspec.lora.target_modules, mspec.lora.train_head)
                adapter_count(shape, lora)  # targets that match no layer: refused here, naming the model
                shape = replace(shape, lora=lora)
            if mspec.base_of is not None:
                shape = replace(shape, base_of=mspec.base_of)
        except PlanError as err:  # name the file and the model whose config the planner cannot price
            src = f"{spec.source}: " if spec.source else ""
            raise PlanError(f"{src}models.{name}: {err}") from None
        # a config without max_position_embeddings gets its model_type's default when built
        models[name] = replace(shape, max_positions=max_positions(graph, name) or shape.max_positions)
    order = list(graph.execution_order())
    if mean_new_tokens is not None and not mean_new_tokens > 0:
        raise PlanError(f"mean_new_tokens must be > 0 tokens, got {mean_new_tokens}")
    measured = measure_data_lengths(graph) if not (prompt_len and mean_new_tokens) else DataLengths()
    p_len = int(prompt_len or measured.prompt_len or 128)
    gen_mean = float(mean_new_tokens or measured.response_mean or 0.0)
    prompt_mean = float(measured.prompt_mean or 0.0)  # 0: a packed row's prompt priced at p_len
    gen_len = default_gen_len
    for name in order:
        if spec.nodes[name].kind == "generate":
            args = graph.args(name)  # checked, with the function's declared defaults filled in
            gen_len = int(args.get("max_new_tokens") or default_gen_len)
    calls = round_calls(graph, pass_rate)  # a filter's round side: expected rounds per iteration
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
                first_pass_share(graph, name),
                int(graph.group_size(name)),
                "builtin" if deepspeed else str(nspec.engine),
                ("builtin",) if deepspeed else engine_choices(graph, name, device_type),
                staleness=int(nspec.staleness),
                segments=graph.segments(name),
                interrupt_every=int(nspec.interrupt_every) if graph.segments(name) > 1 else 0,
                gen_mean=gen_mean,  # every node's rows hold the same generated responses
                zero=zero,
                # a decision left out is `auto` by now (NodeSpec._leave_to_plan)
                recompute="auto" if nspec.recompute is None else nspec.recompute,
                reshard="auto" if nspec.reshard is None else nspec.reshard,
                gpu_memory_utilization=(
                    graph.args(name).get("gpu_memory_utilization") if nspec.kind == "generate" else None
                ),
                max_model_len=engine_context_of(graph, name) if nspec.kind == "generate" else 0,
                sleep_mode=nspec.kind == "generate" and bool(graph.args(name).get("enable_sleep_mode")),
                function=str(nspec.function),
                max_tokens_per_micro_batch=nspec.max_tokens_per_micro_batch,
                prompt_mean=prompt_mean,
                rounds=calls.get(name, 1.0),
                compact=graph.args(name).get("record_routes") is not True,
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
        round_side=(*graph.filter.rounds, graph.filter.node) if graph.filter is not None else (),
    )
