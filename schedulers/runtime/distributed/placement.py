"""The distributed view of a plan: node meshes, model instances and weight-sync targets (pure values).

A **model instance** is one copy of a model's weights in one (mesh, layout, sharding): nodes of the same
model with the same devices, dp, tp and pp, and the same sharding (FSDP2 for a train node with dp > 1, a
DeepSpeed engine for an ``engine: deepspeed`` train node, replicas otherwise) share an instance, so e.g. a
generate node and a train node in the same pure tensor-parallel layout read the same weights and need no
synchronisation. After a train node, every *other* instance of its model receives the new weights (version
edges) before anything else runs on their devices, and every instance of a model that follows it as an EMA
(``models.<m>.ema``) receives them blended in.

A **base view** (``models.<m>.base_of``: a LoRA model's base, run with its adapters off) placed on the same
devices and degrees as an instance of its LoRA model shares that instance's module (:attr:`PlanView.shares`):
no copy, and the weight syncs into that instance serve it too. Elsewhere it is its own frozen copy, which
:func:`lora_placement` says (:class:`BaseCopyWarning`).

Computed identically by the controller and every worker (the order of instances and meshes is the order
in which process groups are created, which must agree on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.dataflow.layout_rules import node_layout_problem
from rlflow.dataflow.node_spec import DeepSpeedSpec
from rlflow.schedulers.runtime.distributed.layouts import MeshSpec

__all__ = ["BaseCopyWarning", "Instance", "PlanView", "lora_placement"]


@dataclass(frozen=True)
class Instance:
    """One copy of a model: ``model`` name, its mesh, whether it is FSDP2-sharded over dp, and the DeepSpeed
    settings of a train node with ``engine: deepspeed`` (``None``: rlflow's own layouts)."""

    model: str
    mesh: MeshSpec
    fsdp: bool
    zero: DeepSpeedSpec | None = None

    @property
    def zero3(self) -> bool:
        """Parameters partitioned over dp by DeepSpeed ZeRO-3."""
        return self.zero is not None and self.zero.zero_stage == 3

    @property
    def sharded(self) -> bool:
        """Whether dp ranks hold different parts of the weights (FSDP2 or ZeRO-3), not replicas."""
        return self.fsdp or self.zero3


@dataclass(frozen=True)
class PlanView:
    """Node meshes, model instances and sync targets of a validated graph.

    Attributes:
        world: number of workers (``run.devices``).
        order: execution order of the nodes.
        meshes: node -> its mesh.
        instances: every model instance, in a deterministic order.
        node_instance: node -> index into ``instances`` (absent for model-free nodes).
        sync_targets: train node -> indices of the other instances of its model, then the instances of
            the models that follow it as an EMA.
        ema: instance index -> the EMA weight ``eta`` of an instance whose model follows another.
        shares: base-view instance -> the instance of its LoRA model whose module it runs (same devices,
            dp, tp and pp; a replicated instance first, else an FSDP2-sharded one; never a DeepSpeed engine's,
            whose module DeepSpeed owns).
    """

    world: int
    order: tuple[str, ...]
    meshes: dict[str, MeshSpec]
    instances: tuple[Instance, ...]
    node_instance: dict[str, int]
    sync_targets: dict[str, tuple[int, ...]]
    ema: dict[int, float]
    shares: dict[int, int]

    @classmethod
    def of(cls, graph: Graph) -> PlanView:
        """Build the view.

        Raises:
            PlanError: a device outside ``run.devices``, or a layout the shared rule rejects
                (``rlflow.dataflow.layout_rules``: e.g. rows that do not divide over the dp ranks in whole
                groups; GRPO/RLOO groups must stay on one rank).
        """
        world = graph.spec.run.devices
        order = tuple(graph.execution_order())
        meshes: dict[str, MeshSpec] = {}
        instances: list[Instance] = []
        node_instance: dict[str, int] = {}
        for name in order:
            placement = graph.placement(name)
            try:
                spec = MeshSpec.of(placement.devices, placement.layout)
            except PlanError as e:
                raise PlanError(f"node '{name}': {e}") from None
            bad = [d for d in spec.devices if d >= world]
            if bad:
                raise PlanError(f"node '{name}': device {bad[0]} does not exist (run.devices is {world})")
            node = graph.node(name)
            why = node_layout_problem(graph, name, placement.layout)
            if why is not None:
                raise PlanError(f"node '{name}': {why} (layout {placement.layout})")
            meshes[name] = spec
            if node.model is None:
                continue
            zero = node.deepspeed if node.kind == "train" and node.engine == "deepspeed" else None
            inst = Instance(
                node.model, spec, fsdp=node.kind == "train" and spec.dp > 1 and zero is None, zero=zero
            )
            if inst not in instances:
                instances.append(inst)
            node_instance[name] = instances.index(inst)
        models = graph.spec.models
        ema = {
            i: models[inst.model].ema.eta  # type: ignore[union-attr]
            for i, inst in enumerate(instances)
            if models[inst.model].ema is not None
        }
        sync: dict[str, tuple[int, ...]] = {}
        for name in order:
            node = graph.node(name)
            if node.kind == "train" and node.model is not None:
                mine = node_instance[name]
                same = [i for i, inst in enumerate(instances) if inst.model == node.model and i != mine]
                follow = [
                    i
                    for i in ema
                    if models[instances[i].model].ema.source == node.model  # type: ignore[union-attr]
                ]
                sync[name] = (*same, *follow)
        shares = _shares(graph, instances)
        return cls(world, order, meshes, tuple(instances), node_instance, sync, ema, shares)

    def primary(self, model: str) -> int:
        """The instance whose weights are read for saving/evaluation: a train node's, else the first."""
        for name in self.order:
            if name in self.sync_targets and self.instances[self.node_instance[name]].model == model:
                return self.node_instance[name]
        return next(i for i, inst in enumerate(self.instances) if inst.model == model)

    def sync_ranks(self, src: int, dst: int) -> tuple[int, ...]:
        """The broadcast group of one weight sync: the source mesh's first rank, then the target's ranks."""
        root = self.instances[src].mesh.devices[0]
        return (root, *(d for d in self.instances[dst].mesh.devices if d != root))


def _shares(graph: Graph, instances: list[Instance]) -> dict[int, int]:
    """Base-view instance -> the instance of its LoRA model it shares (see :attr:`PlanView.shares`)."""
    out: dict[int, int] = {}
    for i, inst in enumerate(instances):
        base = graph.spec.models[inst.model].base_of
        if base is None:
            continue
        same = [
            j
            for j, other in enumerate(instances)
            if other.model == base and other.zero is None and other.mesh == inst.mesh
        ]
        same.sort(key=lambda j: instances[j].fsdp)  # a replicated instance first
        if same:
            out[i] = same[0]
    return out


class BaseCopyWarning(GraphWarning):
    """A base view (``base_of``) placed where no instance of its LoRA model is: it holds its own frozen copy
    of the base weights (adapters off), one more copy in memory."""


def lora_placement(graph: Graph, view: PlanView) -> list[str]:
    """Check the instances of LoRA models and base views against what the multi-process runtime runs.

    Returns:
        one :class:`BaseCopyWarning` message per base-view instance that shares no instance (the caller
        warns).

    Raises:
        PlanError: a LoRA model or base view in a tensor- or pipeline-parallel layout (tp > 1 or pp > 1):
            tensor parallelism shards ``nn.Linear`` layers that ``peft`` has wrapped, and a pipeline stage
            is cut from the model's own layer list, so neither knows the adapters; names the node and
            layout.
    """
    models = graph.spec.models
    for name in view.order:
        k = view.node_instance.get(name)
        if k is None:
            continue
        inst = view.instances[k]
        spec = models[inst.model]
        if (spec.lora is not None or spec.base_of is not None) and (inst.mesh.tp > 1 or inst.mesh.pp > 1):
            what = "a LoRA model" if spec.lora is not None else f"the base of LoRA model '{spec.base_of}'"
            raise PlanError(
                f"node '{name}': model '{inst.model}' is {what}; layout {inst.mesh.layout} has "
                f"tp={inst.mesh.tp}, pp={inst.mesh.pp}, but LoRA runs with tp = pp = 1 only (tensor "
                "parallelism shards the nn.Linear layers peft wrapped, and a pipeline stage does not carry "
                "the adapters); use dp (FSDP2 or DeepSpeed ZeRO) instead"
            )
    out: list[str] = []
    for i, inst in enumerate(view.instances):
        base = models[inst.model].base_of
        if base is not None and i not in view.shares:
            nodes = sorted(n for n, k in view.node_instance.items() if k == i)
            out.append(
                f"model '{inst.model}' (base_of '{base}') on devices {list(inst.mesh.devices)}, layout "
                f"{inst.mesh.layout} (node {', '.join(nodes)}): no instance of '{base}' has these devices "
                f"and degrees, so it holds its own frozen copy of the base (adapters off) instead of sharing "
                f"'{base}''s weights; place it with a node of '{base}' to save the copy"
            )
    return out
