"""The whole graph file as one value: :class:`GraphSpec`, built from its sections' dataclasses.

Sections, one module each: ``models`` (:mod:`~rlflow.dataflow.model_spec`), ``data``
(:mod:`~rlflow.dataflow.data_spec`), ``nodes`` (:mod:`~rlflow.dataflow.node_spec`), ``plan``
(:mod:`~rlflow.dataflow.plan_spec`), ``run`` (:mod:`~rlflow.dataflow.run_spec`); ``algorithm`` is a free
mapping the nodes interpolate. These are plain frozen values checked field by field on construction;
:class:`rlflow.dataflow.graph.Graph` checks how they fit together (keys, edges, functions, batch
divisibility, plan). Errors name the field by its path in the graph file (``nodes.actor_gen.batch_size``)
and raise :class:`GraphError` (plan fields: :class:`PlanError`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from rlflow.dataflow.data_spec import DataSpec
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.fields import check_str_mapping, fail, show
from rlflow.dataflow.model_spec import ModelSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.plan_spec import NodePlacement, Plan, devices_text
from rlflow.dataflow.run_spec import RunSpec

__all__ = ["GraphSpec"]


@dataclass(frozen=True)
class GraphSpec:
    """A whole graph file. ``plan``: ``"auto"`` (the planner chooses), or node -> placement; an empty
    mapping puts every node on device 0 with layout d1t1p1m1, and a mapping may leave out model-free nodes
    (rule rewards: device 0, d1t1p1m1). ``source`` names the file in error messages."""

    models: dict[str, ModelSpec]
    nodes: dict[str, NodeSpec]
    data: DataSpec
    algorithm: dict[str, Any] = field(default_factory=dict)
    plan: Plan = field(default_factory=dict)
    run: RunSpec = field(default_factory=RunSpec)
    source: str = ""

    def __post_init__(self) -> None:
        for section, cls in (("models", ModelSpec), ("nodes", NodeSpec)):
            value = getattr(self, section)
            if not isinstance(value, Mapping):
                fail(section, f"expected a mapping name -> {cls.__name__}, got {show(value)}")
            for name, spec in value.items():
                if not isinstance(spec, cls):
                    fail(f"{section}.{name}", f"expected a {cls.__name__}, got {show(spec)}")
                if spec.name != name:
                    fail(f"{section}.{name}", f"is keyed '{name}' but named '{spec.name}'")
            object.__setattr__(self, section, dict(value))
        if not self.nodes:
            fail("nodes", "the graph has no nodes")
        if not isinstance(self.data, DataSpec):
            fail("data", f"expected a DataSpec, got {show(self.data)}")
        check_str_mapping("algorithm", self.algorithm)
        if self.plan != "auto":
            if not isinstance(self.plan, Mapping):
                raise PlanError(
                    f"plan: expected 'auto' or a mapping node -> placement, got {show(self.plan)}"
                )
            for name, placement in self.plan.items():
                if not isinstance(placement, NodePlacement):
                    raise PlanError(f"plan.{name}: expected a NodePlacement, got {show(placement)}")
            object.__setattr__(self, "plan", dict(self.plan))
        if not isinstance(self.run, RunSpec):
            fail("run", f"expected a RunSpec, got {show(self.run)}")

    def to_dict(self) -> dict[str, Any]:
        """Plain containers in graph-file form (positional/named bindings kept as given)."""
        models: dict[str, Any] = {}
        for name, m in self.models.items():
            d = asdict(m)
            d.pop("name")
            d["optimizer"]["betas"] = list(m.optimizer.betas)
            for key in (
                "lora",
                "base_of",
                "revision",
            ):  # absent unless given: graph files and fingerprints stay as they were
                if d[key] is None:
                    d.pop(key)
            if isinstance(d.get("lora"), dict) and isinstance(d["lora"]["target_modules"], tuple):
                d["lora"]["target_modules"] = list(d["lora"]["target_modules"])
            models[name] = d
        nodes: dict[str, Any] = {}
        for name, n in self.nodes.items():
            d = asdict(n)
            d.pop("name")
            for what in ("inputs", "outputs"):
                d[what] = dict(d[what]) if isinstance(d[what], dict) else list(d[what])
            if not d["staleness"]:  # the synchronous default: graph files and fingerprints stay as they were
                d.pop("staleness")
            if not d["interrupt_every"]:
                d.pop("interrupt_every")
            if d["deepspeed"] is None:  # likewise for nodes without DeepSpeed
                d.pop("deepspeed")
            # a decision left out reads back as left out: `auto`, or no decision on this node
            if d["recompute"] == "auto" or n.kind != "train":
                d.pop("recompute")
            if d["reshard"] == "auto" or n.kind != "train" or n.engine == "deepspeed":
                d.pop("reshard")
            if d["max_tokens_per_micro_batch"] is None:
                d.pop("max_tokens_per_micro_batch")
            nodes[name] = d
        data = asdict(self.data)
        data["tokenize"] = list(self.data.tokenize)
        if data["dataset"] is None:  # absent unless given: graph files and fingerprints stay as they were
            data.pop("dataset")
        plan: Any = (
            "auto"
            if self.plan == "auto"
            else {
                name: {
                    "devices": devices_text(p.devices),
                    "layout": str(p.layout),
                    **({"engine": p.engine} if p.engine is not None else {}),
                    **({"recompute": p.recompute} if p.recompute is not None else {}),
                    **({"reshard": p.reshard} if p.reshard is not None else {}),
                }
                for name, p in self.plan.items()
            }
        )
        return {
            "models": models,
            "data": data,
            "algorithm": dict(self.algorithm),
            "nodes": nodes,
            "plan": plan,
            "run": asdict(self.run),
        }
