"""What one worker builds from the plan and holds for the run: the node meshes, the model instances placed
on its rank (a pipeline stage, TP/FSDP2-sharded, or inside a DeepSpeed engine), the node contexts and the
generation engines of its nodes.

The model building, seeds, optimizers and contexts are the single-process executor's
(:mod:`rlflow.schedulers.runtime.instances`); this module adds what a rank of a mesh needs: one laid-out
copy per instance hosted here, and engines per data-parallel replica or tensor-parallel group.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from rlflow.dataflow.graph import Graph
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.tokenizers import data_tokenizer
from rlflow.schedulers.runtime.distributed.experts import decode_lockstep
from rlflow.schedulers.runtime.distributed.layouts import apply_layout
from rlflow.schedulers.runtime.distributed.mesh import GroupCache
from rlflow.schedulers.runtime.distributed.pipeline import gather_stage_params, make_stage
from rlflow.schedulers.runtime.distributed.placement import PlanView
from rlflow.schedulers.runtime.distributed.weight_sync import ModelInfo, full_params, model_info
from rlflow.schedulers.runtime.distributed.zero import build_engine, destroy_engine, zero_full_params
from rlflow.schedulers.runtime.instances import (
    build_models,
    close_engines,
    engine_settings,
    node_context,
    train_or_freeze,
    train_steps,
)

__all__ = ["Hosted"]


class Hosted:
    """The meshes, model instances, node contexts and engines of rank ``rank``.

    Built collectively, in the same order on every rank: the node meshes, the instances (pipeline stages
    and layouts create process groups), then the engines (a tensor-parallel group's engine starts in step
    on every rank of the group).

    Attributes:
        meshes: node -> its device mesh (``None`` off the node's devices).
        instances: model instance (index into the plan's instances) -> its state, for those hosted here.
        engines: instance -> its DeepSpeed engine (the instances of ``engine: deepspeed`` train nodes).
        full_infos: instance -> the whole model's shapes and dtypes, taken before a pipeline stage drops
            the other stages' layers.
        tokenizers: model -> its tokenizer (or ``None``), for the models built here.
        data_tokenizer: the tokenizer the data set is tokenized with.
        contexts: node -> its context, for the nodes placed on this rank.

    Raises:
        ModelError: a model or tokenizer cannot be loaded or built.
        NodeError: a generation engine failed to start (the engines started so far are stopped).
    """

    def __init__(
        self,
        rank: int,
        graph: Graph,
        view: PlanView,
        device: torch.device,
        groups: GroupCache,
        checkpoint_dir: Path | None,
    ) -> None:
        self.rank = rank
        self.graph = graph
        self.view = view
        self.device = device
        self.groups = groups
        self.meshes = {name: groups.mesh(spec) for name, spec in view.meshes.items()}
        self.instances: dict[int, ModelState] = {}
        self.engines: dict[int, Any] = {}
        self.full_infos: dict[int, ModelInfo] = {}
        self._build(checkpoint_dir)
        self.contexts = self._contexts()
        self._start_engines()

    def _build(self, checkpoint_dir: Path | None) -> None:
        """One laid-out copy of its model per instance hosted here, with its optimizer (rlflow's AdamW, or
        a DeepSpeed engine for ``engine: deepspeed``) when a train node here trains it, else frozen. A base
        view that shares an instance (:attr:`PlanView.shares`) gets that instance's module, not a copy."""
        spec = self.graph.spec
        mine = sorted(i for i, inst in enumerate(self.view.instances) if self.rank in inst.mesh.devices)
        models = {self.view.instances[i].model for i in mine}
        full, self.tokenizers = build_models(self.graph, self.device, checkpoint_dir, models, move=False)
        self.data_tokenizer = data_tokenizer(self.graph, self.tokenizers)
        steps = train_steps(self.graph)
        shares = self.view.shares
        # a base view that shares an instance comes after it (its module is that instance's)
        for i in sorted(mine, key=lambda k: k in shares):
            inst = self.view.instances[i]
            mspec = spec.models[inst.model]
            self.full_infos[i] = model_info(full[inst.model])
            if i in shares:  # the LoRA model's instance on the same devices and degrees: no copy
                module = self.instances[shares[i]].module
                self.instances[i] = ModelState(
                    name=inst.model, module=module, head=mspec.head, tokenizer=self.tokenizers[inst.model],
                    base_of=mspec.base_of,
                )  # fmt: skip
                continue
            module = copy.deepcopy(full[inst.model]).to(self.device)
            if mspec.base_of is not None:  # its own frozen copy of the base (lora_placement warned)
                module.requires_grad_(False)
            trains = any(
                k == i and self.graph.node(n).kind == "train" for n, k in self.view.node_instance.items()
            )
            where = f"model '{inst.model}' ({len(inst.mesh.devices)} devices, {inst.mesh.layout})"
            if inst.mesh.pp > 1:  # keep this rank's stage only; apply_layout then shards it on the stage mesh
                module = make_stage(module, inst.mesh, self.rank, self.groups)
            mesh = self.meshes[self._node_of(i)]
            experts = self.groups.experts(inst.mesh)  # with pp > 1: this rank's stage's ep groups
            module = apply_layout(module, mesh, train=inst.fsdp, where=where, experts=experts)
            state = ModelState(
                name=inst.model,
                module=module,
                head=mspec.head,
                tokenizer=self.tokenizers[inst.model],
                base_of=mspec.base_of,
            )
            model_steps = steps.get(inst.model, 0) if trains else 0
            if mspec.trainable and model_steps > 0 and inst.zero is not None:
                engine = build_engine(
                    module, inst.zero, mspec.optimizer, model_steps, mesh["dp"].get_group(),
                    mesh["tp"].get_group(),
                )  # fmt: skip
                self.engines[i] = engine
                state.module, state.optimizer, state.scheduler = (
                    engine.module,
                    engine.optimizer,
                    engine.lr_scheduler,
                )
                state.optimizer_spec = mspec.optimizer
            else:
                train_or_freeze(state, mspec, model_steps)
            self.instances[i] = state

    def _node_of(self, instance: int) -> str:
        """The first node (execution order) that calls ``instance``: its mesh lays the instance out."""
        return next(n for n, k in self.view.node_instance.items() if k == instance)

    def _contexts(self) -> dict[str, NodeContext]:
        """A context per node placed on this rank, seeded for this rank's dp coordinate."""
        out: dict[str, NodeContext] = {}
        for name, spec in self.view.meshes.items():
            if self.rank not in spec.devices:
                continue
            dp_rank, _ = spec.coords(self.rank)
            inst = self.view.node_instance.get(name)
            state = self.instances[inst] if inst is not None else None
            out[name] = node_context(self.graph, name, state, self.device, dp_rank, self.data_tokenizer)
            experts = self.groups.experts(spec) if self.graph.node(name).kind == "generate" else None
            if experts is not None:  # expert parallel: the ep group decodes in lockstep
                out[name].keep_going = decode_lockstep(experts, self.device)
        return out

    def _start_engines(self) -> None:
        """A vLLM engine for every data-parallel replica of every node placed here whose engine is vLLM
        (``engine: vllm``, or ``auto`` that the plan resolved to it), fed by the model instance, which the
        weight sync writes after each train step (the node then loads it into the engine and verifies it).
        At tp = 1 each rank starts its own (an instance only engines read is freed in between:
        :class:`~rlflow.schedulers.runtime.distributed.replicas.Replicas`; allocated again for the next
        weight sync); at tp > 1 one engine per tp group, started by the group's tp rank 0 with
        ``tensor_parallel_size = tp`` on the group's devices, and every rank of the group gets a
        :class:`~rlflow.nodes.engines.tp_group.GroupEngine` (collective generate and sync; the engine starts
        in step on every rank of the group)."""
        from rlflow.nodes.engines.validation import engine_nodes

        names = [n for n in engine_nodes(self.graph) if n in self.contexts]
        if not names:
            return
        from rlflow.nodes.engines.engine_restart import start_engine
        from rlflow.nodes.engines.tp_group import start_group_engine

        try:
            for name in names:
                spec = self.view.meshes[name]
                dp_rank, _ = spec.coords(self.rank)
                settings = engine_settings(self.graph, name, spec.dp, dp_rank)
                if spec.tp > 1:
                    ranks = next(g for g in spec.tp_groups() if self.rank in g)
                    self.contexts[name].engine = start_group_engine(
                        self.contexts[name],
                        self.groups.group(ranks),
                        ranks,
                        max_rows=settings.max_rows,
                        seed=settings.seed,
                        gpu_memory_utilization=settings.gpu_memory_utilization,
                        device_memory=settings.device_memory,
                        max_model_len=settings.max_model_len,
                    )
                    continue
                self.contexts[name].engine = start_engine(
                    self.contexts[name],
                    max_rows=settings.max_rows,
                    seed=settings.seed,
                    gpu_memory_utilization=settings.gpu_memory_utilization,
                    device_memory=settings.device_memory,
                    max_model_len=settings.max_model_len,
                    max_restarts=settings.max_restarts,
                )
        except BaseException:
            self.close()
            raise

    def full_params(self, instance: int) -> dict[str, torch.Tensor]:
        """Full parameters of ``instance``, gathered on its mesh (collective there): the whole model on
        the mesh's first rank, and on every rank of a ``pp = 1`` mesh; ``{}`` elsewhere with ``pp > 1``."""
        inst = self.view.instances[instance]
        module = self.instances[instance].module
        params = zero_full_params(module) if inst.zero3 else full_params(module)
        if inst.mesh.pp > 1:
            params = gather_stage_params(params, inst.mesh, self.rank, self.groups)
        return params

    def close(self) -> None:
        """Stop the generation engines and release the DeepSpeed engines (idempotent)."""
        close_engines(self.contexts)
        engines, self.engines = self.engines, {}
        for ds in engines.values():
            destroy_engine(ds)
