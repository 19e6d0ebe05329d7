"""Plan values and the plan YAML format.

``Layout``, ``NodePlacement`` and ``parse_devices`` are the graph layer's (``rlflow.dataflow.plan_spec``),
re-exported here so planner code imports one place. A plan is ``dict[node_name, NodePlacement]``.

Plan YAML (what ``rlflow plan`` writes and ``load_plan`` / ``rlflow run --plan`` read)::

    actor_gen: {devices: 0-7, layout: d8t1p1m1, engine: vllm}
    actor_train: {devices: 0-3, layout: d2t2p1m4}

``devices`` is ``"a-b"`` (inclusive), a single integer, or a comma list (``"0,1,4-5"``). ``engine``
(optional, generate nodes whose engine the graph leaves out or sets ``auto``): the engine the plan runs the
node with, ``builtin`` or ``vllm``; without it such a node runs the built-in loop
(``rlflow.dataflow.plan_spec.resolve_engine``); ``recompute`` / ``reshard`` likewise for train nodes.
``searched`` / ``pinned`` (optional; ``rlflow plan`` writes them): which of the node's decisions the search
made and which the graph set (``decisions.py``), a record read back without effect::

    actor_train: {devices: 0-3, layout: d4t1p1m2, recompute: false, reshard: true,
                  searched: [micro_batches, recompute, reshard], pinned: []}
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.plan_spec import Layout, NodePlacement, parse_devices

__all__ = [
    "Layout",
    "NodePlacement",
    "dump_plan",
    "format_devices",
    "load_plan",
    "parse_devices",
    "plan_from_mapping",
]


def format_devices(devices: tuple[int, ...]) -> str:
    """Inverse of ``parse_devices``: (0,1,2,3) -> ``"0-3"``; (0,2) -> ``"0,2"``."""
    parts: list[str] = []
    i = 0
    while i < len(devices):
        j = i
        while j + 1 < len(devices) and devices[j + 1] == devices[j] + 1:
            j += 1
        parts.append(str(devices[i]) if i == j else f"{devices[i]}-{devices[j]}")
        i = j + 1
    return ",".join(parts)


def plan_from_mapping(data: Mapping[str, Any], source: str = "<plan>") -> dict[str, NodePlacement]:
    """Build a plan from ``{node: {devices: "0-3", layout: "d2t2p1m4", engine: vllm}}`` (``engine``,
    ``recompute``, ``reshard`` optional), read as a graph file's ``plan:`` section is
    (``rlflow.dataflow.loader.plan_placements``).

    Raises:
        PlanError: ``<source>: plan.<node>[.<key>]: ...``: an entry that is not a mapping, an unknown or
            missing field, bad devices, layout, engine or flag.
    """
    from rlflow.dataflow.loader import plan_placements  # lazily: the graph loader imports torch

    try:
        return plan_placements(source, data)
    except GraphError as err:  # the entry's shape: still the plan file's mistake
        raise PlanError(str(err)) from None


def dump_plan(
    plan: Mapping[str, NodePlacement],
    header: str = "",
    decisions: Mapping[str, Mapping[str, list[str]]] | None = None,
) -> str:
    """Plan YAML text (node -> devices, layout and, where the plan chose them, engine, recompute and
    reshard); ``header`` lines become ``#`` comments; ``decisions``: node -> ``{"searched": [...],
    "pinned": [...]}`` (``decisions.decision_lists``), written beside each placement as a record."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for node, placement in plan.items():
        engine = f", engine: {placement.engine}" if placement.engine is not None else ""
        if placement.recompute is not None:
            engine += f", recompute: {str(placement.recompute).lower()}"
        if placement.reshard is not None:
            engine += f", reshard: {str(placement.reshard).lower()}"
        if placement.gpu_memory_utilization is not None:
            engine += f", gpu_memory_utilization: {placement.gpu_memory_utilization:g}"
        for how, names in (decisions or {}).get(node, {}).items():
            engine += f", {how}: [{', '.join(names)}]"
        lines.append(
            f"{node}: {{devices: {format_devices(placement.devices)}, layout: {placement.layout}{engine}}}"
        )
    return "\n".join(lines) + "\n"


def load_plan(path: str | Path) -> dict[str, NodePlacement]:
    """Read a plan YAML file written by ``dump_plan`` (or a graph file's ``plan:`` mapping).

    Raises:
        PlanError: unreadable file, or a malformed node entry (named).
    """
    try:
        with open(path, encoding="utf-8") as stream:  # a syntax error's mark names the file (stream.name)
            data = yaml.safe_load(stream)
    except (OSError, yaml.YAMLError, ValueError) as err:  # ValueError: an int of 4300+ digits
        raise PlanError(f"{path}: cannot read plan: {err}") from None
    if isinstance(data, Mapping) and isinstance(data.get("plan"), Mapping):
        data = data["plan"]
    if not isinstance(data, Mapping):
        raise PlanError(f"{path}: a plan file is a mapping node -> {{devices, layout[, engine]}}")
    return plan_from_mapping(data, str(path))
