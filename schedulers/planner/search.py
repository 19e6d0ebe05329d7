"""Plan search: simulated annealing with restarts, exhaustive search and the baselines over the candidate
placements of every node (the search space: ``candidates.py``), all priced by one cost model and
simulator.

Objective: the simulated steady-state iteration time (``simulator.simulate``, 2 iterations, so
reallocations and cross-iteration overlap count) plus a penalty ``iteration_s · overflow / capacity``
for bytes above device capacity (memory per device = state of every model instance placed there + the
largest transient working set of the nodes there: ``resources.device_consumers``). Only memory-feasible
plans are ever returned.

Annealer (design): a Metropolis chain over joint plans. A move re-places one random node by one of
  * *jump*: any of its candidates;  * *relayout*: another layout on the same mesh;
  * *colocate*: a layout on the mesh of another node;  * *resize*: a mesh of half, equal or double size.
Temperature falls geometrically from 5 % to 0.01 % of the start energy over ``steps``; restarts begin
from every baseline and from random plans, each with its own ``random.Random(seed, restart)`` stream,
so a seed gives the same plan on every run. Energies are memoised per plan, which makes revisits free.
ReaL (Mei et al. 2024, §5) searches with MCMC over the same kind of per-node space; restarts from the
baselines guarantee the result is never worse than them.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.candidates import SearchSpace
from rlflow.schedulers.planner.cluster import ClusterSpec, human_bytes
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.engine_share import choose_shares
from rlflow.schedulers.planner.plans import NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.resources import device_totals, host_offload
from rlflow.schedulers.planner.simulator import Timeline, simulate

__all__ = ["BASELINES", "SearchResult", "Searcher"]

BASELINES = ("colocate", "split", "disaggregate", "heuristic")
Plan = dict[str, NodePlacement]


@dataclass
class SearchResult:
    """The best plan found, its timeline and how the search went; baselines priced the same way.

    ``evaluated``: plans simulated (each distinct plan once); ``seconds``: wall-clock seconds of the search
    (baselines and annealing); ``restarts`` × ``steps``: the annealing asked for, of which ``steps_run``
    steps ran; ``cut_short``: the time budget (``time_budget_s``) ended the search before that, and
    ``plan`` is the best plan found until then. ``exhaustive``: every combination was simulated instead.
    """

    plan: Plan
    timeline: Timeline
    iteration_s: float
    evaluated: int
    seconds: float
    baselines: dict[str, tuple[Plan | None, float]] = field(default_factory=dict)
    restarts: int = 0
    steps: int = 0
    steps_run: int = 0
    time_budget_s: float = math.inf
    cut_short: bool = False
    exhaustive: bool = False

    def describe(self) -> str:
        """One line on how the search went, for the plan file's header and the command's output, e.g.
        ``search: 812 plans simulated in 44.1 s; the 45 s time budget cut it short after 2301 of 6000
        annealing steps (4 restarts × 1500): the best plan found by then``."""
        head = f"{self.evaluated} plans simulated in {self.seconds:.1f} s"
        if self.exhaustive:
            return f"exhaustive search: {head}"
        asked = f"{self.restarts * self.steps} annealing steps ({self.restarts} restarts × {self.steps})"
        budget = f"the {self.time_budget_s:.4g} s time budget"
        if self.cut_short:
            return (
                f"search: {head}; {budget} cut it short after {self.steps_run} of {asked}: the best plan "
                "found by then"
            )
        within = f"within {budget}" if math.isfinite(self.time_budget_s) else "no time budget"
        return f"search: {head}; all {asked} ran, {within}"


class Searcher(SearchSpace):
    """Searches plans for ``problem`` on ``cluster`` over its :class:`~rlflow.schedulers.planner.candidates.
    SearchSpace`: baselines, annealing, exhaustive search, each plan priced by :meth:`evaluate`.

    Args:
        layouts_per_mesh: layouts kept per (node, mesh), fastest first.
        max_micro_batches: largest micro-batch count tried, besides one row per micro-batch (train and
            inference nodes).
        iterations: iterations each plan is simulated for (2: reallocations and cross-iteration overlap
            count).
        deadline: a ``time.perf_counter()`` reading (``rlflow plan``: the end of its time budget). Once it
            has passed, building the candidates prices no further mesh class (size; one host or several)
            for a node that already has one that fits; ``candidates_cut`` then says so, and a search whose
            baselines all overflow memory, or an exhaustive search, completes them first.

    Raises:
        PlanError: a node fits on no mesh with any layout (names the node and the missing bytes).
    """

    def __init__(
        self,
        problem: PlanProblem,
        cluster: ClusterSpec,
        layouts_per_mesh: int = 3,
        max_micro_batches: int = 32,
        iterations: int = 2,
        *,
        deadline: float = math.inf,
    ) -> None:
        self.iterations = iterations
        self._energy: dict[tuple[NodePlacement, ...], tuple[float, float, float]] = {}
        self._shared: dict[tuple[NodePlacement, ...], Plan] = {}
        self.evaluated = 0
        self.infeasible: dict[str, str] = {}  # baseline -> why it found no plan
        self.budget_cut: dict[str, str] = {}  # baseline -> what of it the deadline left unpriced
        cost = CostModel(problem, cluster)
        super().__init__(problem, cluster, cost, layouts_per_mesh, max_micro_batches, deadline=deadline)

    # ---- evaluation --------------------------------------------------------------------------------
    def memory(self, plan: Mapping[str, NodePlacement]) -> dict[int, float]:
        """Bytes per device: the state of every model instance placed there (a train node's adds gradients
        and optimizer state), every ``engine: vllm`` node's engine (weights + KV cache), plus the largest
        transient working set among the nodes on that device (an ``engine: vllm`` node's includes its
        released model instance, ``MemoryBreakdown.replica``) (``resources.device_consumers``, which the
        launch check uses too; summed by ``resources.device_totals``), with the planner's engine shares
        (:meth:`shared`)."""
        return device_totals(self.cost, self.shared(plan))

    def shared(self, plan: Mapping[str, NodePlacement]) -> Plan:
        """``plan`` with each unpinned vLLM engine's memory share chosen for it
        (``engine_share.choose_shares``: the largest that fits beside the plan's other bytes); memoised."""
        key = tuple(plan[n.name] for n in self.problem.nodes)
        hit = self._shared.get(key)
        if hit is None:
            hit = self._shared[key] = choose_shares(self.cost, plan)
        return hit

    def evaluate(self, plan: Mapping[str, NodePlacement]) -> tuple[float, float, float]:
        """(energy, iteration seconds, overflow bytes) of ``plan`` (memoised)."""
        key = tuple(plan[n.name] for n in self.problem.nodes)
        hit = self._energy.get(key)
        if hit is not None:
            return hit
        self.evaluated += 1
        plan = self.shared(plan)
        seconds = simulate(self.cost, plan, self.iterations).iteration_s
        overflow = sum(max(0.0, b - self.capacity) for b in device_totals(self.cost, plan).values())
        offloaded = host_offload(self.cost, plan)  # DeepSpeed CPU offload fills the hosts' memory
        if offloaded:
            overflow += sum(max(0.0, b - self.cluster.host_capacity) for b in offloaded.values())
        result = (seconds * (1.0 + overflow / self.capacity), seconds, overflow)
        self._energy[key] = result
        return result

    def _feasible(self, plan: Mapping[str, NodePlacement] | None) -> bool:
        return plan is not None and self.evaluate(plan)[2] == 0.0

    # ---- baselines ---------------------------------------------------------------------------------
    def _options(
        self, node: PlanNode, mesh: tuple[int, ...], degrees: tuple[int, int, int] | None = None
    ) -> list[tuple[float, float, NodePlacement]]:
        """(seconds, peak bytes, placement) of every layout of ``node`` on ``mesh`` that fits alone (with
        ``degrees``: only those of (dp, tp, pp) = ``degrees``)."""
        out = []
        for placement in self.placements_on(node, mesh):
            lay = placement.layout
            if degrees is not None and (lay.dp, lay.tp, lay.pp) != degrees:
                continue
            nc = self.cost.node_cost(node, placement)
            if nc.memory.peak <= self.capacity:
                out.append((nc.time_s, nc.memory.peak, placement))
        out.sort(
            key=lambda o: (
                o[0], o[1], str(o[2].layout), o[2].engine or "", bool(o[2].recompute), o[2].reshard is False
            )
        )  # fmt: skip
        return out

    def _greedy_fit(
        self, mesh_of: Mapping[str, tuple[int, ...]], degrees: tuple[int, int, int] | None = None
    ) -> tuple[Plan | None, str]:
        """Each node's fastest layout on its mesh (of (dp, tp, pp) ``degrees`` if given); while memory
        overflows, the biggest node on the most loaded device moves to its fastest layout that needs less
        memory. (None, why) if nothing fits."""
        options = {n.name: self._options(n, mesh_of[n.name], degrees) for n in self.problem.nodes}
        for node in self.problem.nodes:
            if not options[node.name]:
                size = len(mesh_of[node.name])
                return None, self.no_layout(node, size) or (
                    f"node {node.name!r} does not fit memory on {size} devices"
                )
        choice = {name: opts[0] for name, opts in options.items()}
        while True:
            plan = {name: c[2] for name, c in choice.items()}
            usage = self.memory(plan)
            device = max(usage, key=lambda d: usage[d])
            if usage[device] <= self.capacity:
                return plan, ""
            for name in sorted(
                (n for n, p in plan.items() if device in p.devices), key=lambda n: -choice[n][1]
            ):
                smaller = [o for o in options[name] if o[1] < choice[name][1]]
                if smaller:
                    choice[name] = smaller[0]
                    break
            else:
                return None, "does not fit memory"

    def baseline_colocate(self) -> Plan | None:
        """DeepSpeed-Chat / verl: every node on all devices with one (dp, tp, pp); each node's fastest
        micro-batch count, fewer rows per micro-batch where the models do not fit together otherwise
        (``_greedy_fit``, as users of those systems shrink the micro-batch)."""
        mesh = tuple(range(self.cluster.num_devices))
        best: tuple[float, Plan] | None = None
        shared: set[tuple[int, int, int]] | None = None
        why: dict[str, str] = {}
        for node in self.problem.nodes:
            rejected: dict[str, str] = {}
            degrees = {(lay.dp, lay.tp, lay.pp) for lay in self.layouts(node, len(mesh), why=rejected)}
            shared = degrees if shared is None else shared & degrees
            for key, reason in rejected.items():
                why.setdefault(key, f"node {node.name!r}: {reason}")
        for shape in sorted(shared or ()):
            plan, _why = self._greedy_fit({n.name: mesh for n in self.problem.nodes}, shape)
            if plan is None:
                continue
            _energy, seconds, overflow = self.evaluate(plan)
            if overflow == 0.0 and (best is None or seconds < best[0]):
                best = (seconds, plan)
        if best is not None:
            return best[1]
        reasons = "; ".join(f"{k}: {v}" for k, v in sorted(why.items()))
        self.infeasible["colocate"] = (
            f"no layout on all {len(mesh)} devices suits every node ({reasons})" if not shared
            else "does not fit memory"
        )  # fmt: skip
        return None

    def _splits(self) -> list[int]:
        n, dph = self.cluster.num_devices, self.cluster.devices_per_host
        if self.cluster.hosts > 1:
            return [h * dph for h in range(1, self.cluster.hosts)]
        return [k for k in range(1, n) if (k & (k - 1)) == 0]

    def baseline_split(self, deadline: float = math.inf) -> Plan | None:
        """OpenRLHF: the generating model's nodes on devices [0, k), every other node on [k, N); each node's
        fastest layout on its part that lets the plan fit (``_greedy_fit``); the best k over host
        boundaries (or power-of-two splits inside one host). Once ``time.perf_counter()`` passes
        ``deadline`` with a split in hand, the best of the split points priced so far (``budget_cut``
        says how many)."""
        gen_models = {n.model for n in self.problem.nodes if n.kind == "generate"}
        return self._best_split("split", lambda node: node.model in gen_models, deadline)

    def baseline_disaggregate(self, deadline: float = math.inf) -> Plan | None:
        """Generation apart from everything else (AReaL's and NeMo RL's asynchronous placement, rollout
        workers vs. trainers): the generate nodes on devices [0, k), every inference and train node on
        [k, N); chosen as :meth:`baseline_split`."""
        return self._best_split("disaggregate", lambda node: node.kind == "generate", deadline)

    def _best_split(self, name: str, first: Callable[[PlanNode], bool], deadline: float) -> Plan | None:
        """The fastest plan that puts the nodes where ``first`` holds on devices [0, k) and the others on
        [k, N), each node at its fastest layout there that lets the plan fit, over k in :meth:`_splits`;
        None (and ``infeasible[name]``, why) if no k fits. Past ``deadline`` with a plan in hand, the best
        of the split points priced so far (``budget_cut[name]`` says how many)."""
        best: tuple[float, Plan] | None = None
        n = self.cluster.num_devices
        why: list[str] = []
        splits = self._splits()
        for i, k in enumerate(splits):
            if best is not None and time.perf_counter() >= deadline:
                self.budget_cut[name] = (
                    f"the best of the first {i} of {len(splits)} split points: the time budget ran out"
                )
                break
            mesh_of = {
                node.name: tuple(range(0, k)) if first(node) else tuple(range(k, n))
                for node in self.problem.nodes
            }
            plan, reason = self._greedy_fit(mesh_of)
            if plan is None:
                why.append(f"split at device {k}: {reason}")
                continue
            seconds = self.evaluate(plan)[1]
            if best is None or seconds < best[0]:
                best = (seconds, plan)
        if best is not None:
            return best[1]
        self.infeasible[name] = "; ".join(why) or "no split point"
        return None

    def baseline_heuristic(self) -> Plan | None:
        """Per-node hand rule: every node on all devices with its own fastest layout (isolated cost),
        trading speed for memory node by node until the models fit together (``_greedy_fit``)."""
        mesh = tuple(range(self.cluster.num_devices))
        plan, why = self._greedy_fit({n.name: mesh for n in self.problem.nodes})
        if plan is None:
            self.infeasible["heuristic"] = why
        return plan

    def baselines(self, deadline: float = math.inf) -> dict[str, tuple[Plan | None, float]]:
        """Name -> (plan or None if infeasible, iteration seconds or inf); ``infeasible`` then says why
        each missing plan is missing. Once ``time.perf_counter()`` passes ``deadline`` with a plan in hand,
        the baselines not yet priced are left out (None, inf) and the split baseline stops at the split
        points priced so far; ``budget_cut`` says which and how (baseline -> a phrase)."""
        out: dict[str, tuple[Plan | None, float]] = {}
        self.budget_cut.clear()
        for name in BASELINES:
            self.infeasible.pop(name, None)
            if any(p is not None for p, _ in out.values()) and time.perf_counter() >= deadline:
                self.budget_cut[name] = "not priced: the time budget ran out"
                out[name] = (None, math.inf)
                continue
            price = getattr(self, f"baseline_{name}")
            plan = price(deadline) if name in ("split", "disaggregate") else price()
            out[name] = (plan, self.evaluate(plan)[1] if plan is not None else math.inf)
        return out

    # ---- search ------------------------------------------------------------------------------------
    def _random_plan(self, rng: random.Random) -> Plan:
        return {n.name: rng.choice(self.candidates[n.name]) for n in self.problem.nodes}

    def _move(self, plan: Plan, rng: random.Random) -> Plan:
        node = rng.choice(self.problem.nodes).name
        cands = self.candidates[node]
        here = plan[node]
        kind = rng.random()
        if kind < 0.1:  # the same layout and engine with other memory decisions (recompute, reshard)
            pool = [
                c
                for c in self.on_mesh[node].get(here.devices, [])
                if c.layout == here.layout and c.engine == here.engine and c != here
            ]
        elif kind < 0.3:
            pool = cands
        elif kind < 0.6:
            pool = self.on_mesh[node].get(here.devices, [])
        elif kind < 0.8:
            other = plan[rng.choice(self.problem.nodes).name].devices
            pool = self.on_mesh[node].get(other, [])
        else:
            pool = self.resize_pool(node, here.devices)
        new = dict(plan)
        new[node] = rng.choice(pool or cands)
        return new

    def anneal(
        self, start: Plan, steps: int, rng: random.Random, deadline: float = math.inf
    ) -> tuple[Plan, float]:
        """One Metropolis chain from ``start``; returns its best feasible plan (or ``start``) and energy.
        It stops early once ``time.perf_counter()`` passes ``deadline`` (the best plan found by then)."""
        best, e_best, _ = self._chain(start, steps, rng, deadline)
        return best, e_best

    def _chain(self, start: Plan, steps: int, rng: random.Random, deadline: float) -> tuple[Plan, float, int]:
        """:meth:`anneal`, also returning the steps it ran."""
        current = dict(start)
        e_cur = self.evaluate(current)[0]
        best, e_best = (dict(current), e_cur) if self._feasible(current) else (dict(start), math.inf)
        t0, t_end = 0.05 * e_cur, 1e-4 * e_cur
        for i in range(steps):
            if time.perf_counter() >= deadline:
                return best, e_best, i
            temp = t0 * (t_end / t0) ** (i / max(1, steps - 1))
            cand = self._move(current, rng)
            e_new, _, overflow = self.evaluate(cand)
            if e_new <= e_cur or rng.random() < math.exp(-(e_new - e_cur) / temp):
                current, e_cur = cand, e_new
                if overflow == 0.0 and e_new < e_best:
                    best, e_best = dict(cand), e_new
        return best, e_best, steps

    def search(
        self,
        seed: int = 0,
        restarts: int = 4,
        steps: int = 1500,
        time_budget_s: float = math.inf,
        *,
        since: float | None = None,
    ) -> SearchResult:
        """Simulated annealing with restarts from each feasible baseline and from random plans.

        ``time_budget_s``: wall-clock seconds for the whole search (baselines and annealing). Once they are
        spent the baselines still to price are left out as soon as one has a plan (``baselines``,
        ``budget_cut``), annealing stops, and the result is the best plan found so far
        (``SearchResult.cut_short`` says so): never worse than the best baseline priced. While no
        feasible plan has been found (every baseline over memory) the budget does not stop the search, so
        "no memory-feasible plan" always means none was found in all ``restarts × steps``. Without a
        budget the result depends on ``seed`` only; with one that cuts the search short, also on how
        fast the machine ran it. ``since``: the ``time.perf_counter()`` reading the budget and
        ``SearchResult.seconds`` count from (default: this call); a caller that takes it before building
        the searcher counts the candidate placements in too, and builds them within the same deadline
        (``Searcher(..., deadline=since + time_budget_s)``).

        Raises:
            PlanError: no memory-feasible plan was found (names the most overloaded device, its nodes and
                the missing bytes).
        """
        t_start = time.perf_counter() if since is None else since
        deadline = t_start + time_budget_s
        baselines = self.baselines(deadline)
        starts = [plan for plan, _ in baselines.values() if plan is not None]
        best: Plan | None = None
        e_best = math.inf
        for plan in starts:
            energy = self.evaluate(plan)[0]
            if energy < e_best:
                best, e_best = plan, energy
        if best is None and self.candidates_cut:  # no plan in hand: anneal over every candidate, as ever
            self.build_candidates(math.inf)
        steps_run = 0
        for r in range(restarts):
            if time.perf_counter() >= deadline and best is not None:
                break
            rng = random.Random(f"{seed}:{r}")
            start = starts[r % len(starts)] if r < len(starts) else self._random_plan(rng)
            # the budget applies once a feasible plan is in hand: an infeasible answer must mean none exists
            plan, energy, ran = self._chain(start, steps, rng, deadline if best is not None else math.inf)
            steps_run += ran
            if energy < e_best and self._feasible(plan):
                best, e_best = plan, energy
        if best is None:
            self._raise_infeasible(self._random_plan(random.Random(seed)))
        assert best is not None
        best = self.shared(best)
        baselines = {k: (self.shared(p) if p is not None else None, v) for k, (p, v) in baselines.items()}
        timeline = simulate(self.cost, best, self.iterations)
        return SearchResult(
            best, timeline, timeline.iteration_s, self.evaluated, time.perf_counter() - t_start, baselines,
            restarts=restarts, steps=steps, steps_run=steps_run, time_budget_s=time_budget_s,
            cut_short=steps_run < restarts * steps or bool(self.budget_cut),
        )  # fmt: skip

    def exhaustive(self, max_plans: int = 200_000) -> SearchResult:
        """Evaluate every combination of the per-node candidates (small clusters only).

        Raises:
            PlanError: more than ``max_plans`` combinations, or none is memory-feasible.
        """
        t_start = time.perf_counter()
        if self.candidates_cut:
            self.build_candidates(math.inf)
        names = [n.name for n in self.problem.nodes]
        total = math.prod(len(self.candidates[n]) for n in names)
        if total > max_plans:
            raise PlanError(f"exhaustive search over {total} plans exceeds max_plans={max_plans}")
        best: Plan | None = None
        e_best = math.inf
        for combo in itertools.product(*(self.candidates[n] for n in names)):
            plan = dict(zip(names, combo, strict=True))
            energy, _, overflow = self.evaluate(plan)
            if overflow == 0.0 and energy < e_best:
                best, e_best = plan, energy
        if best is None:
            self._raise_infeasible(dict(zip(names, (self.candidates[n][0] for n in names), strict=True)))
        assert best is not None
        best = self.shared(best)
        timeline = simulate(self.cost, best, self.iterations)
        return SearchResult(
            best,
            timeline,
            timeline.iteration_s,
            self.evaluated,
            time.perf_counter() - t_start,
            exhaustive=True,
        )

    def _raise_infeasible(self, plan: Plan) -> None:
        usage = self.memory(plan)
        device = max(usage, key=lambda d: usage[d])
        nodes = [n for n, p in plan.items() if device in p.devices]
        raise PlanError(
            f"no memory-feasible plan found on cluster {self.cluster.name!r}: e.g. device {device} running "
            f"{', '.join(nodes)} lacks {human_bytes(usage[device] - self.capacity)} "
            f"(needs {human_bytes(usage[device])}, capacity {human_bytes(self.capacity)}); "
            "use more devices or devices with more memory"
        )
