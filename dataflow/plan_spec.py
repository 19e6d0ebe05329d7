"""The ``plan`` section of a graph file: each node's mesh (device ids) and layout, and what the plan chooses.

Device ids and layouts are graph-file values, like batch sizes: this module parses and checks them
(:class:`PlanError` naming the field) and knows nothing of the hardware behind the ids. A node's
``engine``/``recompute``/``reshard`` set to ``auto`` is resolved against the plan's choice here
(:func:`resolve_engine`, :func:`resolve_recompute`, :func:`resolve_reshard`), the one rule the runtime
and the planner follow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from rlflow.dataflow.errors import PlanError, did_you_mean
from rlflow.dataflow.fields import check_int, fail, show
from rlflow.dataflow.node_spec import ENGINES, UNPLANNED

__all__ = [
    "DECISIONS",
    "DEFAULT_PLACEMENT",
    "MAX_DEVICES",
    "Layout",
    "NodePlacement",
    "Plan",
    "check_decision_list",
    "check_plan_engine",
    "check_plan_flag",
    "check_plan_share",
    "devices_text",
    "parse_devices",
    "resolve_engine",
    "resolve_recompute",
    "resolve_reshard",
    "share_problem",
]

# Upper bound on device ids and counts: keeps a typo such as ``devices: 0-99999999`` from allocating.
MAX_DEVICES = 65536

_LAYOUT_RE = re.compile(r"([dtpem])(\d+)")
_DEGREES = {"d": "dp", "t": "tp", "p": "pp", "e": "ep", "m": "micro_batches"}  # layout letter -> Layout field
_MAX_DIGITS = 18  # longer digit runs in a layout or device list are out of range anyway


@dataclass(frozen=True)
class Layout:
    """Parallel degrees of one node on its mesh: data (``dp``), tensor (``tp``), pipeline (``pp``), the
    number of micro-batches each data-parallel rank splits its rows into, and expert parallel (``ep``: a
    mixture-of-experts model's experts split over ``ep`` of the dp ranks,
    :mod:`rlflow.dataflow.layout_rules`). Written ``d2t2p1m4``, or ``d2t2p1e2m4`` with ``ep`` > 1 (``e``
    omitted means ``ep = 1``, and is not printed then). ``ep`` is the last field so that positional
    ``Layout(dp, tp, pp, m)`` keeps its meaning; it uses no devices of its own (``size`` is ``dp·tp·pp``).

    Raises:
        PlanError: a degree below 1 or too large, or ``ep`` not dividing ``dp``.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batches", "ep"):
            check_int(f"layout.{name}", getattr(self, name), 1, PlanError)
            if getattr(self, name) > MAX_DEVICES * 1024:
                fail(f"layout.{name}", f"{getattr(self, name)} is too large", PlanError)
        if self.dp % self.ep:
            raise PlanError(
                f"layout.ep: ep={self.ep} does not divide dp={self.dp} (expert-parallel ranks are carved out "
                "of the data-parallel ranks)"
            )

    @property
    def size(self) -> int:
        """Devices the layout needs: dp × tp × pp."""
        return self.dp * self.tp * self.pp

    @classmethod
    def parse(cls, text: str) -> Layout:
        """Parse ``d2t2p1m4`` or ``d2t1p1e2m1`` (any order, each of d/t/p/e/m at most once, missing ones = 1).

        Raises:
            PlanError: on any other text.
        """
        if not isinstance(text, str):
            raise PlanError(f"layout: expected a string like 'd2t2p1m4', got {show(text)}")
        parts = _LAYOUT_RE.findall(text)
        if any(len(b) > _MAX_DIGITS for _, b in parts):  # int() of 4300+ digits raises ValueError
            raise PlanError(f"layout {show(text)}: a degree is too large")
        if not text or "".join(a + b for a, b in parts) != text or len({a for a, _ in parts}) != len(parts):
            raise PlanError(
                f"layout '{text}': expected letters d (data), t (tensor), p (pipeline), e (experts), "
                "m (micro-batches) each followed by a degree, e.g. 'd2t2p1m4' or 'd2t1p1e2m1'"
            )
        return cls(**{_DEGREES[a]: int(b) for a, b in parts})

    def __str__(self) -> str:
        experts = f"e{self.ep}" if self.ep > 1 else ""
        return f"d{self.dp}t{self.tp}p{self.pp}{experts}m{self.micro_batches}"


def parse_devices(value: object, limit: int = MAX_DEVICES) -> tuple[int, ...]:
    """Parse a device set: an int, a list of ints, or text ``"0-3"``, ``"0,2,4"``, ``"0-1,4-5"``.

    Raises:
        PlanError: on malformed text, an id outside ``[0, limit)``, or a device listed twice.
    """
    items: list[tuple[int, int]] = []
    if isinstance(value, bool):
        raise PlanError(f"devices: expected ids like '0-3' or [0, 1], got {show(value)}")
    if isinstance(value, int):
        items.append((value, value))
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int):
                raise PlanError(f"devices: expected integer ids, got {show(v)}")
            items.append((v, v))
    elif isinstance(value, str):
        for part in value.replace(" ", "").split(","):
            m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if not m:
                raise PlanError(f"devices '{value}': expected ids like '0-3', '0,2,4' or '0-1,4-5'")
            if max(len(m.group(1)), len(m.group(2) or "")) > _MAX_DIGITS:  # int() of 4300+ digits raises
                raise PlanError(
                    f"devices {show(value)}: a device id is too large (devices are 0..{limit - 1})"
                )
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise PlanError(f"devices '{value}': range {lo}-{hi} is empty")
            items.append((lo, hi))
    else:
        raise PlanError(f"devices: expected ids like '0-3' or [0, 1], got {show(value)}")
    if not items:
        raise PlanError("devices: the mesh is empty")
    for lo, hi in items:
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise PlanError(f"devices: device {bad} does not exist (devices are 0..{limit - 1})")
    devices = [d for lo, hi in items for d in range(lo, hi + 1)]
    seen: set[int] = set()
    for d in devices:
        if d in seen:
            raise PlanError(f"devices: device {d} is listed twice in {show(value)}")
        seen.add(d)
    return tuple(devices)


@dataclass(frozen=True)
class NodePlacement:
    """The mesh (ordered device ids) and layout of one node. ``len(devices)`` must equal ``layout.size``.

    ``engine``: the engine the plan runs a generate node with (:data:`ENGINES`; ``None``: the node's own,
    builtin for ``engine: auto``, :func:`resolve_engine`). ``recompute``: whether a train node with
    ``recompute: auto`` recomputes activations (``None``: the node's own, off for ``auto``,
    :func:`resolve_recompute`). ``reshard``: whether a train node with ``reshard: auto`` reshards its FSDP2
    units after every micro-batch (``None``: the node's own, on for ``auto``, :func:`resolve_reshard`).
    ``gpu_memory_utilization``: the share of each device's memory (in (0, 1]) a vLLM generate node's engine
    takes, as the planner chose it for a node whose ``args`` pin none (``None``: the node's own, else the
    engine's default, ``rlflow.nodes.engines.sizing``).
    """

    devices: tuple[int, ...]
    layout: Layout = field(default_factory=Layout)
    engine: str | None = None
    recompute: bool | None = None
    reshard: bool | None = None
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", parse_devices(self.devices))
        self._check()

    @classmethod
    def on_mesh(
        cls,
        devices: tuple[int, ...],
        layout: Layout,
        engine: str | None = None,
        recompute: bool | None = None,
        reshard: bool | None = None,
        gpu_memory_utilization: float | None = None,
    ) -> NodePlacement:
        """A placement on a mesh the caller built itself (the planner's candidate meshes, ranges of
        device ids): ``devices`` is taken as a valid mesh, distinct ids in ``[0, MAX_DEVICES)``, without
        the constructor's ``parse_devices`` pass, which costs O(devices) per placement and dominated
        planning on 1,024 devices. The layout, engine, recompute, reshard and mesh size are checked as the
        constructor checks them. Devices read from a user's file go through the constructor.

        Raises:
            PlanError: as the constructor, except for the device ids themselves.
        """
        if type(devices) is not tuple:
            raise PlanError(f"devices: expected a tuple of device ids, got {show(devices)}")
        placement = object.__new__(cls)
        for name, value in (
            ("devices", devices),
            ("layout", layout),
            ("engine", engine),
            ("recompute", recompute),
            ("reshard", reshard),
            ("gpu_memory_utilization", gpu_memory_utilization),
        ):
            object.__setattr__(placement, name, value)
        placement._check()
        return placement

    def _check(self) -> None:
        """The checks of everything but the device ids (``parse_devices`` checks those)."""
        if not isinstance(self.layout, Layout):
            raise PlanError(f"layout: expected a Layout, got {show(self.layout)}")
        check_plan_engine(self.engine)
        check_plan_flag("recompute", self.recompute)
        check_plan_flag("reshard", self.reshard)
        check_plan_share(self.gpu_memory_utilization)
        if self.layout.size != len(self.devices):
            raise PlanError(
                f"layout {self.layout} needs dp×tp×pp = {self.layout.dp}×{self.layout.tp}×{self.layout.pp}"
                f" = {self.layout.size} devices but the mesh has {len(self.devices)}: "
                f"{devices_text(self.devices)}"
            )


def check_plan_engine(value: object) -> str | None:
    """``value`` as a placement's ``engine``: ``None`` (not given) or one of :data:`ENGINES`.

    Raises:
        PlanError: ``engine: <reason>`` (callers prefix the file and node).
    """
    if value is not None and value not in ENGINES:
        raise PlanError(
            f"engine: {show(value)} is not one of {', '.join(ENGINES)}{did_you_mean(str(value), ENGINES)}"
        )
    return value if value is None else str(value)


def check_plan_share(value: object) -> float | None:
    """``value`` as a placement's ``gpu_memory_utilization``: ``None`` (not given) or a number in (0, 1].

    Raises:
        PlanError: ``gpu_memory_utilization: <reason>`` (callers prefix the file and node).
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise PlanError(
            f"gpu_memory_utilization: expected a share of device memory in (0, 1], got {show(value)}"
        )
    return float(value)


def share_problem(
    name: str, kind: str, pinned: object, placement: NodePlacement, node_engine: str | None = None
) -> str | None:
    """Why ``placement``'s ``gpu_memory_utilization`` (the planner's share for a vLLM engine) does not suit
    node ``name`` of ``kind`` whose ``args.gpu_memory_utilization`` is ``pinned`` and whose ``engine`` is
    ``node_engine`` (None when it does): it is a generate node's that runs vLLM (its own engine or, where
    that is searched, the placement's: :func:`resolve_engine`; a share on the built-in loop would be
    dropped unseen), and a plan chooses it only where the graph pins none (or restates the same)."""
    share = placement.gpu_memory_utilization
    if share is None:
        return None
    if kind != "generate":
        return f"a vLLM engine's memory share, but '{name}' is a {kind} node"
    engine = resolve_engine(node_engine, placement.engine)
    if engine != "vllm":
        if placement.engine is not None:
            how = "the placement's engine"
        elif node_engine in (None, "auto"):
            how = "its engine is searched and the placement names none"
        else:
            how = f"nodes.{name}.engine"
        return (
            f"a vLLM engine's memory share, but node '{name}' runs the {engine} engine ({how}); remove the "
            "share or give the placement engine: vllm"
        )
    if pinned is not None and pinned != share:
        return (
            f"{share:g} but nodes.{name}.args.gpu_memory_utilization pins {pinned}; a plan chooses the share "
            "only where the graph leaves it out"
        )
    return None


def check_plan_flag(key: str, value: object) -> bool | None:
    """``value`` as a placement's true/false choice ``key`` (``recompute``, ``reshard``): ``None`` (not
    given), ``true`` or ``false``.

    Raises:
        PlanError: ``<key>: <reason>`` (callers prefix the file and node).
    """
    if value is not None and not isinstance(value, bool):
        raise PlanError(f"{key}: expected true or false, got {show(value)}")
    return value


# What a plan may say it decided for a node, in the order a plan file lists them (``searched:`` and
# ``pinned:``, which ``rlflow plan`` writes as a record: ``schedulers/planner/decisions.py``).
DECISIONS: tuple[str, ...] = (
    "micro_batches", "engine", "gpu_memory_utilization", "recompute", "reshard", "staleness"
)  # fmt: skip


def check_decision_list(key: str, value: object) -> tuple[str, ...]:
    """``value`` as a placement's ``searched`` / ``pinned`` record (``key``): absent (``None``: empty) or a
    list of names of :data:`DECISIONS`, each once.

    Raises:
        PlanError: ``<key>: <reason>`` (callers prefix the file and node).
    """
    if value is None:
        return ()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise PlanError(f"{key}: expected a list of decisions ({', '.join(DECISIONS)}), got {show(value)}")
    for name in value:
        if name not in DECISIONS:
            raise PlanError(
                f"{key}: {name!r} is not a decision a plan records ({', '.join(DECISIONS)})"
                f"{did_you_mean(name, DECISIONS)}"
            )
    if len(set(value)) != len(value):
        raise PlanError(f"{key}: a decision is listed twice in {show(value)}")
    return tuple(value)


def resolve_recompute(node_recompute: bool | str | None, plan_recompute: bool | None) -> bool:
    """Whether a train node recomputes activations: the plan's choice (``NodePlacement.recompute``) when it
    makes one, else the node's own (``NodeSpec.recompute``), and for ``auto`` (or left out) the plan leaves
    open :data:`~rlflow.dataflow.node_spec.UNPLANNED`'s (off). Consistency of the two is checked by the
    graph's plan check."""
    if plan_recompute is not None:
        return plan_recompute
    return node_recompute if isinstance(node_recompute, bool) else bool(UNPLANNED["recompute"])


def resolve_reshard(node_reshard: bool | str | None, plan_reshard: bool | None) -> bool:
    """Whether a train node's FSDP2 units reshard after every micro-batch: the plan's choice
    (``NodePlacement.reshard``) when it makes one, else the node's own (``NodeSpec.reshard``), and for
    ``auto`` (or left out) the plan leaves open :data:`~rlflow.dataflow.node_spec.UNPLANNED`'s (on).
    Consistency of the two is checked by the graph's plan check."""
    if plan_reshard is not None:
        return plan_reshard
    return node_reshard if isinstance(node_reshard, bool) else bool(UNPLANNED["reshard"])


def resolve_engine(node_engine: str | None, plan_engine: str | None) -> str:
    """The engine a generate node runs with: the plan's (``NodePlacement.engine``) when it names one, else
    the node's own (``NodeSpec.engine``), and for ``engine: auto`` (or left out) the plan leaves open (a
    hand-written plan without ``engine``, or no plan) :data:`~rlflow.dataflow.node_spec.UNPLANNED`'s
    (``builtin``). Consistency of the two is checked by the graph's plan check."""
    if plan_engine is not None:
        return plan_engine
    return str(UNPLANNED["engine"]) if node_engine in (None, "auto") else str(node_engine)


def devices_text(devices: tuple[int, ...]) -> str:
    """A mesh as graph-file text: ``"0-3"`` for a run of consecutive ids, else ``"0,2,4"``."""
    if devices and list(devices) == list(range(devices[0], devices[0] + len(devices))) and len(devices) > 1:
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(str(d) for d in devices)


Plan: TypeAlias = dict[str, NodePlacement] | Literal["auto"]
"""The ``plan`` section: ``"auto"`` (the planner chooses) or node -> placement."""

DEFAULT_PLACEMENT = NodePlacement((0,), Layout())
"""Device 0, layout d1t1p1m1: where a node runs when the graph has no plan, or when a plan leaves out a
model-free node."""
