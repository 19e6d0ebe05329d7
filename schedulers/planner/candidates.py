"""The space a plan search explores: the candidate meshes of a cluster and, per node, its candidate
placements on them.

A *mesh* is a contiguous range of whole hosts, or a power-of-two sub-range of one host aligned to its size
(so tensor groups never straddle hosts). A node's *placement* on a mesh is a *layout* with dp·tp·pp = mesh
size, tp dividing the devices per host, for a mixture-of-experts node each expert degree ep dividing dp
(ep = 1 included; with pp > 1 each stage's ep groups are its own; a generate node's on the built-in loop,
whose ep group decodes in lockstep, not vLLM's; ``expert_cost.py`` prices them), degrees the model's
shapes allow (``cost.layout_problem``) and micro-batches dividing the rows per data-parallel rank (one
for a node with a token budget, ``PlanNode.max_tokens_per_micro_batch``: the budget cuts its micro-batches,
and the cost model prices them);
for a generate node with ``engine: auto`` also the *engine* (``PlanNode.engines``: builtin, and vllm where it
can serve the node, at one micro-batch, which the engine does not use), for ``recompute: auto`` /
``reshard: auto`` both choices. Candidates that cannot fit memory even alone are dropped; of the rest, each
mesh keeps its ``layouts_per_mesh`` fastest layouts by isolated node time (a node's own time is what its
layout changes; the interaction between nodes is through meshes, which the search explores in full), and,
for each kept layout and engine, the fastest placement with each other recompute / reshard value: slower
alone, they free memory the plan may spend elsewhere (a colocated vLLM engine's share), so the search,
which prices whole plans, must be able to choose them.
Meshes of one class (size; on one host or several) price a node alike, so each class is priced once.
"""

from __future__ import annotations

import math
import time

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.call_cost import NodeCost
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.engine_share import alone_share, unpinned_engine, with_share
from rlflow.schedulers.planner.no_fit import no_fit_message
from rlflow.schedulers.planner.plans import Layout, NodePlacement, parse_devices
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.vllm_cost import engine_start_problem

__all__ = ["SearchSpace", "candidate_meshes", "divisors"]


def candidate_meshes(cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Contiguous whole-host ranges, plus aligned power-of-two sub-ranges inside each host."""
    dph = cluster.devices_per_host
    meshes: list[tuple[int, ...]] = []
    for start in range(cluster.hosts):
        for count in range(1, cluster.hosts - start + 1):
            meshes.append(tuple(range(start * dph, (start + count) * dph)))
    size = 1
    while size < dph:
        for host in range(cluster.hosts):
            for off in range(0, dph - size + 1, size):
                first = host * dph + off
                meshes.append(tuple(range(first, first + size)))
        size *= 2
    return meshes


def divisors(n: int, cap: int) -> list[int]:
    return [k for k in range(1, min(n, cap) + 1) if n % k == 0]


def _with_variants(scored: list[tuple], keep: int) -> list[tuple]:
    """The ``keep`` fastest of ``scored`` (sorted, fastest first) and, for each of them, the fastest of its
    layout and engine with every other recompute / reshard value that fits: those are slower alone, but
    the memory they free may buy a colocated node's time (a vLLM engine's pool, ``engine_share``), which
    only the search's plan-wide price sees. Each entry's fields 1-4 are (layout, engine, recompute,
    keeps gathered) as strings and flags."""
    kept = scored[:keep]
    chosen = {s[1:3] for s in kept}
    seen = {s[1:5] for s in kept}
    extra = []
    for s in scored[keep:]:  # fastest first: the first of each variant is its fastest
        if s[1:3] in chosen and s[1:5] not in seen:
            seen.add(s[1:5])
            extra.append(s)
    return kept + extra


class SearchSpace:
    """The candidate placements of every node of ``problem`` on ``cluster``, priced by ``cost``.

    Attributes:
        meshes: every candidate mesh (:func:`candidate_meshes`).
        candidates: node -> its candidate placements (fastest first per mesh).
        on_mesh: node -> mesh -> its candidates there (in candidate order).
        candidates_cut: the deadline stopped the pricing of mesh classes (``build_candidates``).

    Args:
        layouts_per_mesh: layouts kept per (node, mesh), fastest first.
        max_micro_batches: largest micro-batch count tried, besides one row per micro-batch (train and
            inference nodes).
        deadline: a ``time.perf_counter()`` reading. Once it has passed, building the candidates prices no
            further mesh class for a node that already has one that fits; ``candidates_cut`` then says so.

    Raises:
        PlanError: a node fits on no mesh with any layout (names the node and the missing bytes).
    """

    def __init__(
        self,
        problem: PlanProblem,
        cluster: ClusterSpec,
        cost: CostModel,
        layouts_per_mesh: int = 3,
        max_micro_batches: int = 32,
        *,
        deadline: float = math.inf,
    ) -> None:
        self.problem = problem
        self.cluster = cluster
        self.cost = cost
        self.capacity = cluster.memory_capacity
        self.meshes = candidate_meshes(cluster)
        # (size, on several hosts) of each mesh: the node's cost is the same across a class; a set of ids
        # is on several hosts iff its lowest and highest are (host_of is monotonic)
        host_of = cluster.host_of
        self._classes = [(len(m), host_of(min(m)) != host_of(max(m))) for m in self.meshes]
        self.candidates: dict[str, list[NodePlacement]] = {}
        self._layouts: dict[tuple[str, int, int, str | None], list[Layout]] = {}
        # node -> mesh -> its candidates, and (node, mesh) -> the resize move's pool (both in candidate order)
        self.on_mesh: dict[str, dict[tuple[int, ...], list[NodePlacement]]] = {}
        self._resize: dict[tuple[str, tuple[int, ...]], list[NodePlacement]] = {}
        self._keep = (layouts_per_mesh, max_micro_batches)
        self.candidates_cut = False
        self.build_candidates(deadline)

    def build_candidates(self, deadline: float) -> None:
        """Every node's candidates and their groups per mesh, pricing mesh classes until ``deadline`` (a
        ``time.perf_counter()`` reading; ``math.inf``: all of them).

        Raises:
            PlanError: a node fits on no mesh with any layout.
        """
        self.candidates_cut = False
        self._resize.clear()
        for node in self.problem.nodes:
            self.candidates[node.name] = self._node_candidates(node, *self._keep, deadline)
            groups: dict[tuple[int, ...], list[NodePlacement]] = {}
            for c in self.candidates[node.name]:
                groups.setdefault(c.devices, []).append(c)
            self.on_mesh[node.name] = groups

    def layout_problem(self, node: PlanNode, layout: Layout, engine: str | None = None) -> str | None:
        """Why ``layout`` cannot run ``node`` with ``engine`` (None when it can): ``cost.layout_problem``,
        the shared rule of ``rlflow.dataflow.layout_rules`` (the graph's plan checks and the runtime use it
        too)."""
        return self.cost.layout_problem(node, layout, engine)

    def layouts(
        self,
        node: PlanNode,
        size: int,
        max_micro_batches: int = 32,
        why: dict[str, str] | None = None,
        engine: str | None = None,
    ) -> list[Layout]:
        """Every layout of ``size`` devices the model and rows allow for ``node`` run by ``engine`` (``None``:
        the node's own, ``PlanNode.engine_of``); ``why`` collects, per degrees ``d…t…p…`` that allow none,
        the reason. A vLLM engine generates a replica's rows in one call: one micro-batch."""
        key = (node.name, size, max_micro_batches, engine)
        if why is None and key in self._layouts:  # the search asks for each (node, size) many times
            return list(self._layouts[key])
        shape = self.problem.models[node.model]
        dph = self.cluster.devices_per_host
        out: list[Layout] = []
        for tp in divisors(size, dph):
            if dph % tp:
                continue
            for pp in divisors(size // tp, shape.num_hidden_layers):
                dp = size // (tp * pp)
                # expert parallel: every ep dividing dp for a mixture of experts (the vLLM engine holds its
                # experts its own way); which of them run is the layout rule's to say
                vllm = node.kind == "generate" and node.engine_of(engine) == "vllm"
                experts = divisors(dp, dp) if shape.is_moe and not vllm else [1]
                for ep in experts:
                    problem = self.layout_problem(node, Layout(dp, tp, pp, 1, ep), engine)
                    if problem is not None:
                        if why is not None:
                            why.setdefault(str(Layout(dp, tp, pp, 1, ep))[:-2], problem)
                        continue
                    out += self._micro_batch_layouts(node, dp, tp, pp, ep, max_micro_batches, engine)
        self._layouts[key] = out
        return list(out)

    def _micro_batch_layouts(
        self, node: PlanNode, dp: int, tp: int, pp: int, ep: int, max_micro_batches: int, engine: str | None
    ) -> list[Layout]:
        """The layouts of degrees (dp, tp, pp, ep) with each micro-batch count ``node`` may run."""
        per_rank = node.split_rows // (dp * node.mini_batches)
        vllm = node.kind == "generate" and node.engine_of(engine) == "vllm"
        # vLLM and a token budget cut their own batches: one micro-batch
        single = vllm or node.max_tokens_per_micro_batch is not None
        cap = 1 if single else 8 if node.kind == "generate" else max_micro_batches
        counts = divisors(per_rank, cap)
        if not single and node.kind != "generate" and per_rank > cap:  # one row each (Megatron)
            counts.append(per_rank)
        layouts = (Layout(dp, tp, pp, m, ep) for m in counts)
        return [lay for lay in layouts if self.layout_problem(node, lay, engine) is None]

    def placements(
        self, node: PlanNode, mesh: tuple[int, ...], max_micro_batches: int = 32
    ) -> list[NodePlacement]:
        """Every placement of ``node`` on ``mesh``: each layout (:meth:`layouts`) with each engine the node
        may be given (``PlanNode.engines``; named in the placement only for ``engine: auto``) and, for
        ``recompute: auto``, with and without activation recomputation and, for ``reshard: auto``, with and
        without FSDP2 resharding per micro-batch.

        Raises:
            PlanError: ``mesh`` is not a set of device ids (``parse_devices``).
        """
        return self.placements_on(node, parse_devices(mesh), max_micro_batches)

    def placements_on(
        self, node: PlanNode, mesh: tuple[int, ...], max_micro_batches: int = 32
    ) -> list[NodePlacement]:
        """:meth:`placements` on a mesh of :attr:`meshes` (checked once, not per placement)."""
        engines = node.engines if node.engine == "auto" else (None,)
        out = [
            NodePlacement.on_mesh(mesh, layout, engine, recompute, reshard)
            for engine in engines
            for layout in self.layouts(node, len(mesh), max_micro_batches, engine=engine)
            for recompute in node.recompute_options
            for reshard in (node.reshard_options if layout.dp > 1 else (None,))
        ]
        # an unpinned vLLM engine's share: the largest it may take alone there (engine_share)
        return [
            with_share(p, alone_share(self.cost, node, p)) if unpinned_engine(node, p) else p for p in out
        ]

    def no_layout(self, node: PlanNode, size: int) -> str:
        """Why ``node`` has no layout on ``size`` devices (``""`` when it has one)."""
        why: dict[str, str] = {}
        if self.layouts(node, size, why=why):
            return ""
        reasons = "; ".join(f"{k}: {v}" for k, v in why.items()) or f"no degrees fit {size} devices"
        return f"node {node.name!r} has no layout on {size} devices ({reasons})"

    def _node_candidates(
        self, node: PlanNode, keep: int, max_m: int, deadline: float = math.inf
    ) -> list[NodePlacement]:
        """``node``'s candidates: on every mesh, the ``keep`` fastest of its placements (at most ``max_m``
        micro-batches) that fit memory alone, priced once per mesh class (module docstring).

        Raises:
            PlanError: the node fits nowhere (names the node, the missing bytes and, for a vLLM node, its
                engine's memory share).
        """
        Choice = tuple[Layout, str | None, bool | None, bool | None, float | None]
        by_class: dict[tuple[int, bool], list[Choice]] = {}
        best: tuple[NodePlacement, NodeCost] | None = None  # the least short placement, for the message
        out: list[NodePlacement] = []
        for mesh, cls in zip(self.meshes, self._classes, strict=True):
            if cls not in by_class and out and time.perf_counter() >= deadline:
                by_class[cls] = []  # past the deadline a node that fits somewhere keeps what was priced
                self.candidates_cut = True
            if cls not in by_class:
                scored = []
                for placement in self.placements_on(node, mesh, max_m):
                    nc = self.cost.node_cost(node, placement)
                    if nc.memory.peak <= self.capacity:
                        layout, engine, redo = placement.layout, placement.engine, placement.recompute
                        keep_gathered = placement.reshard is False
                        scored.append(
                            (nc.time_s, str(layout), engine or "", bool(redo), keep_gathered, layout, engine,
                             redo, placement.reshard, placement.gpu_memory_utilization)
                        )  # fmt: skip
                    elif best is None or nc.memory.peak < best[1].memory.peak:
                        best = (placement, nc)
                scored.sort(key=lambda s: s[:5])
                by_class[cls] = [
                    (layout, engine, redo, reshard, share)
                    for *_, layout, engine, redo, reshard, share in _with_variants(scored, keep)
                ]
            out.extend(NodePlacement.on_mesh(mesh, *choice) for choice in by_class[cls])
        if not out:
            share, usable = node.gpu_memory_utilization, self.cluster.usable_memory_fraction
            # the engine's start at the widest tensor degree one host allows (the least memory per device)
            widest = self.cluster.devices_per_host
            shape = self.problem.models[node.model]
            start = (
                engine_start_problem(self.cluster, node, shape, 1, widest) if "vllm" in node.engines else None
            )
            hint = (
                f"its args.gpu_memory_utilization {share:g} reserves more than the cluster's usable share "
                f"of a device ({usable:g}, usable_memory_fraction): lower it below {usable:g}"
                if share is not None and share >= usable and "vllm" in node.engines
                else f"its vLLM engine cannot start: args.{start}"
                if start is not None
                else ""
            )
            raise PlanError(no_fit_message(self.cost, node, best, hint))
        return out

    def resize_pool(self, node: str, devices: tuple[int, ...]) -> list[NodePlacement]:
        """Candidates of ``node`` on another mesh of half, equal or double the size of ``devices``."""
        key = (node, devices)
        pool = self._resize.get(key)
        if pool is None:
            size = len(devices)
            sizes = (size // 2, size, size * 2)
            pool = [c for c in self.candidates[node] if len(c.devices) in sizes and c.devices != devices]
            self._resize[key] = pool
        return pool
