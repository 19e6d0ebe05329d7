"""Building what runs a graph's nodes, shared by the single-process executor and the distributed workers.

One home for: the order models are built in and their seeds, the models themselves (from a checkpoint, a
directory, a config or a copy of another model) with their tokenizers, their optimizers, the node contexts
with their seeded random generators, the sizing of a node's generation engine, stopping those engines, and
the contexts' part of a checkpoint. :class:`~rlflow.schedulers.runtime.executor.LocalExecutor` builds every
model once on one device; a worker (:mod:`rlflow.schedulers.runtime.distributed.hosted`) builds the models
its instances need and lays out a copy per instance.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.errors import ModelError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.model_spec import ModelSpec
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.lora import apply_lora, is_adapter_dir, load_adapter, save_adapter
from rlflow.nodes.models import build_model, build_model_from_spec, save_pretrained
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.nodes.train import build_optimizer

__all__ = [
    "EngineSettings",
    "build_models",
    "close_engines",
    "contexts_state",
    "engine_settings",
    "load_contexts_state",
    "model_order",
    "node_context",
    "node_seed",
    "save_model",
    "stable_seed",
    "train_or_freeze",
    "train_steps",
]


def model_order(models: Mapping[str, ModelSpec]) -> list[str]:
    """Model names in build order: the graph's order, each ``init_from`` source before its copies."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        src = models[name].init_from
        if src is not None:
            visit(src)
        order.append(name)

    for name in models:
        visit(name)
    return order


def stable_seed(seed: int, name: str) -> int:
    """A seed for ``name`` drawn from the run's ``seed``, the same in every process (CRC-32 of the name, not
    Python's salted ``hash``); in ``[0, 2**63 - 1)``."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def node_seed(seed: int, name: str, dp_rank: int) -> int:
    """A node's sampling seed on dp rank ``dp_rank`` (rank 0 has the single-process seed)."""
    return stable_seed(seed, name if dp_rank == 0 else f"{name}#dp{dp_rank}")


def train_steps(graph: Graph) -> dict[str, int]:
    """Model -> its optimizer steps over the run (iterations × epochs × mini-batches, summed over the train
    nodes of the model); a model no train node trains is absent."""
    run = graph.spec.run
    steps: dict[str, int] = {}
    for node in graph.nodes.values():
        if node.model and node.kind == "train":
            steps[node.model] = steps.get(node.model, 0) + run.iterations * node.epochs * node.mini_batches
    return steps


def build_models(
    graph: Graph,
    runs_on: torch.device,
    checkpoint_dir: Path | None,
    names: Collection[str] | None = None,
    *,
    move: bool,
) -> tuple[dict[str, nn.Module], dict[str, Any]]:
    """Build the models ``names`` (default: every model) and the ``init_from`` sources they copy, in
    :func:`model_order`: from ``checkpoint_dir/models/<name>`` when it holds the model (a resume), else
    from the model's spec (its directory or config; a copy of its ``init_from`` source) seeded with
    ``run.seed`` + the model's index in that order. A LoRA model (``lora``) is its base built from its spec,
    then its adapters (:func:`~rlflow.nodes.lora.apply_lora`; on a resume, the checkpoint's adapters); only
    they are trainable; on a resume, one that copies (``init_from``) a model the run trains copies that
    model's initial weights (rebuilt on the CPU), not the checkpoint's. A base view (``base_of``) is the very
    module of its LoRA model (no copy).
    ``dtype: auto`` resolves for ``runs_on``; ``move`` puts each model there (else it stays on the CPU).
    Every other parameter comes back trainable (:func:`train_or_freeze` decides).

    Returns:
        model -> module and model -> tokenizer (``tokenizer_dir``'s, else its ``init_from`` source's, else
        ``None``), both in build order.

    Raises:
        ModelError: a model or tokenizer cannot be loaded or built; a checkpoint's model that is LoRA
            adapters for a model without ``lora``, or a whole model for one with it.
    """
    spec = graph.spec
    needed = set(spec.models if names is None else names)
    for name in list(needed):
        src = spec.models[name].init_from or spec.models[name].base_of
        while src is not None:
            needed.add(src)
            src = spec.models[src].init_from
    device = runs_on if move else None
    modules: dict[str, nn.Module] = {}
    tokenizers: dict[str, Any] = {}
    order = model_order(spec.models)
    restored: set[str] = set()  # models whose weights come from the checkpoint, trained since the start
    changing = set(train_steps(graph)) | {n for n, m in spec.models.items() if m.ema is not None}

    def initial(name: str) -> nn.Module:
        """``name``'s weights at the start of the run (as a fresh start builds them), on the CPU."""
        m = spec.models[name]
        src = initial(m.init_from) if m.init_from else None
        return build_model_from_spec(
            m, init_from=src, seed=spec.run.seed + order.index(name), name=name, runs_on=runs_on
        )

    for idx, name in enumerate(order):
        mspec = spec.models[name]
        if name not in needed or mspec.base_of is not None:
            continue
        saved = checkpoint_dir / "models" / name if checkpoint_dir is not None else None
        if saved is not None and saved.is_dir() and (mspec.lora is not None) != is_adapter_dir(saved):
            held = "LoRA adapters" if mspec.lora is None else "a whole model"
            raise ModelError(
                f"model '{name}': the checkpoint's '{saved}' holds {held}, but the graph gives "
                f"models.{name} {'no ' if mspec.lora is None else 'a '}'lora' section; resume with the graph "
                "the run was started with"
            )
        if saved is not None and saved.is_dir() and mspec.lora is None:
            module = build_model(
                path=saved, head=mspec.head, dtype=mspec.dtype, device=device, name=name, runs_on=runs_on
            )
            if name in changing:
                restored.add(name)
        else:
            source = modules[mspec.init_from] if mspec.init_from else None
            if mspec.init_from in restored:  # a LoRA base copies its source's initial weights
                source = initial(mspec.init_from)
            module = build_model_from_spec(
                mspec, init_from=source, seed=spec.run.seed + idx, device=device, name=name, runs_on=runs_on
            )
        modules[name] = module
        tokenizer = None
        if mspec.tokenizer_dir is not None:
            tokenizer = load_tokenizer(mspec.tokenizer_dir)
        elif mspec.init_from:
            tokenizer = tokenizers.get(mspec.init_from)
        tokenizers[name] = tokenizer
    # Adapters go in once every copy is made: an ``init_from`` copy of a LoRA model copies its base. Their
    # random init is seeded per model, the same in every process.
    for name, module in modules.items():
        lora = spec.models[name].lora
        if lora is None:
            continue
        apply_lora(module, lora, f"models.{name}", seed=stable_seed(spec.run.seed, f"{name}.lora"))
        saved = checkpoint_dir / "models" / name if checkpoint_dir is not None else None
        if saved is not None and is_adapter_dir(saved):
            load_adapter(module, saved, f"models.{name}", spec=lora)
    for name in needed:
        base = spec.models[name].base_of
        if base is not None:
            modules[name], tokenizers[name] = modules[base], tokenizers[base]
    return modules, tokenizers


def save_model(module: nn.Module, spec: ModelSpec, tokenizer: Any, directory: Path) -> None:
    """One model of a checkpoint under ``directory``: a LoRA model's adapters only, as a PEFT adapter
    directory (:func:`~rlflow.nodes.lora.save_adapter`; :func:`build_models` rebuilds the base from the
    spec), any other model in Hugging Face format; nothing for a base view (its weights are its LoRA
    model's)."""
    if spec.base_of is not None:
        return
    if spec.lora is not None:
        save_adapter(module, spec.lora, directory, base=spec.path, tokenizer=tokenizer)
    else:
        save_pretrained(module, tokenizer, directory)


def train_or_freeze(state: ModelState, spec: ModelSpec, steps: int) -> None:
    """Give ``state`` rlflow's AdamW and LR schedule over ``steps`` optimizer steps
    (:func:`~rlflow.nodes.train.build_optimizer`) when its model is trainable and ``steps`` > 0; else
    freeze its parameters (``requires_grad`` off). A base view (``base_of``) is left as it is: its parameters
    are its LoRA model's."""
    if state.base_of is not None:
        return
    if spec.trainable and steps > 0:
        state.optimizer, state.scheduler = build_optimizer(state.module, spec.optimizer, steps)
        state.optimizer_spec = spec.optimizer
    else:
        state.module.requires_grad_(False)


def node_context(
    graph: Graph,
    name: str,
    model: ModelState | None,
    device: torch.device,
    dp_rank: int,
    data_tokenizer: Any,
) -> NodeContext:
    """The context node ``name`` runs in on dp rank ``dp_rank``: its node as the plan runs it (``engine:
    auto`` resolved), ``model`` (the instance it calls, or ``None``), its group size and micro-batches, a
    generator on ``device`` seeded with :func:`node_seed`, and the model's tokenizer (else
    ``data_tokenizer``)."""
    gen = torch.Generator(device=device).manual_seed(node_seed(graph.spec.run.seed, name, dp_rank))
    return NodeContext(
        node=graph.run_node(name),
        model=model,
        group_size=graph.group_size(name),
        micro_batches=graph.placement(name).layout.micro_batches,
        device=device,
        generator=gen,
        tokenizer=model.tokenizer if model is not None and model.tokenizer is not None else data_tokenizer,
    )


@dataclass(frozen=True)
class EngineSettings:
    """How one dp rank's generation engine of a node is sized (``start_engine``'s arguments).

    Attributes:
        max_rows: most rows (prompts × samples) it generates in one call: its dp share of the node's
            prompts (:func:`~rlflow.nodes.engines.sizing.engine_max_rows`).
        seed: the engine's seed (:func:`node_seed`).
        gpu_memory_utilization: the engine's share of device memory: the plan's
            (``NodePlacement.gpu_memory_utilization``, the planner's choice), else the node's
            ``args.gpu_memory_utilization``, else ``None`` (the default pool,
            ``rlflow.nodes.engines.sizing``).
        device_memory: the device memory (bytes) that share is of, or ``None``
            (:func:`~rlflow.schedulers.planner.resources.engine_memory`).
        max_model_len: the engine's context in tokens, as the planner prices it
            (:func:`~rlflow.schedulers.planner.graph_problem.engine_context_of`; 0: the model's positions).
        max_restarts: in-place restarts of the engine if its processes die (``run.max_restarts``;
            :mod:`rlflow.nodes.engines.engine_restart`).
    """

    max_rows: int
    seed: int
    gpu_memory_utilization: float | None
    device_memory: float | None
    max_model_len: int = 0
    max_restarts: int = 0


def engine_settings(graph: Graph, name: str, dp: int, dp_rank: int) -> EngineSettings:
    """The settings of node ``name``'s engine on dp rank ``dp_rank`` of ``dp``."""
    from rlflow.nodes.engines.sizing import engine_max_rows
    from rlflow.schedulers.planner.graph_problem import engine_context_of
    from rlflow.schedulers.planner.resources import engine_memory

    fraction, device_memory = engine_memory(graph, name)
    return EngineSettings(
        max_rows=engine_max_rows(graph.rows(name), dp, graph.group_size(name)),
        seed=node_seed(graph.spec.run.seed, name, dp_rank),
        gpu_memory_utilization=fraction,
        device_memory=device_memory,
        max_model_len=engine_context_of(graph, name),
        max_restarts=graph.spec.run.max_restarts,
    )


def close_engines(contexts: Mapping[str, NodeContext]) -> None:
    """Stop the generation engine of every context that has one (idempotent: each is taken out first)."""
    for ctx in contexts.values():
        engine, ctx.engine = ctx.engine, None
        if engine is not None:
            engine.close()


def contexts_state(contexts: Mapping[str, NodeContext]) -> dict[str, Any]:
    """The contexts' part of a checkpoint: ``generators`` (node -> its generator's state) and ``partial``
    (node -> the rollouts it keeps between segments of interruptible generation)."""
    return {
        "generators": {name: ctx.generator.get_state() for name, ctx in contexts.items() if ctx.generator},
        "partial": {name: dict(ctx.partial) for name, ctx in contexts.items() if ctx.partial},
    }


def load_contexts_state(contexts: Mapping[str, NodeContext], state: Mapping[str, Any]) -> None:
    """Restore :func:`contexts_state` into ``contexts`` (``partial`` may be absent: older checkpoints)."""
    for name, gen_state in state["generators"].items():
        gen = contexts[name].generator
        if gen is not None:
            gen.set_state(gen_state)
    for name, partial in state.get("partial", {}).items():
        contexts[name].partial = dict(partial)
