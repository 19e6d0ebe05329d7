"""Planning at scale: work per mesh class rather than per mesh or device, and the search's time budget.

Timings are never asserted; the tests count what the planner does (spies) and check that the shortcuts
give exactly what the direct computation gives.
"""

from __future__ import annotations

import dataclasses
import math
import random
import types
from pathlib import Path

import pytest

from rlflow.dataflow import plan_spec as spec
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import Layout, NodePlacement, load_plan
from rlflow.schedulers.planner.problem import ppo_problem
from rlflow.schedulers.planner.resources import device_consumers, device_totals
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.simulator import _cells, _Task
from rlflow.schedulers.planner.zero_cost import ZeroConfig

ROOT = Path(__file__).resolve().parents[1]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _mesh_classes(searcher: Searcher) -> dict[tuple[int, bool], tuple[int, ...]]:
    """(size, on several hosts) -> the first candidate mesh of that class."""
    out: dict[tuple[int, bool], tuple[int, ...]] = {}
    for mesh in searcher.meshes:
        hosts = {searcher.cluster.host_of(d) for d in mesh}
        out.setdefault((len(mesh), len(hosts) > 1), mesh)
    return out


@pytest.mark.parametrize("hosts", [2, 8])
def test_candidates_price_each_mesh_class_once_and_trust_their_meshes(
    hosts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the candidates prices every placement of a node once per mesh class (size, one host or
    several), however many meshes the class has, and never re-parses the meshes it built itself."""
    calls = {"node_cost": 0, "parse_devices": 0}
    node_cost, parse_devices = CostModel.node_cost, spec.parse_devices

    def count_node_cost(self: CostModel, node: object, placement: NodePlacement) -> object:
        calls["node_cost"] += 1
        return node_cost(self, node, placement)  # type: ignore[arg-type]

    def count_parse(value: object, limit: int = spec.MAX_DEVICES) -> tuple[int, ...]:
        calls["parse_devices"] += 1
        return parse_devices(value, limit)

    monkeypatch.setattr(CostModel, "node_cost", count_node_cost)
    monkeypatch.setattr(spec, "parse_devices", count_parse)
    searcher = Searcher(ppo_problem("7b", "7b"), load_cluster("h100-8x", hosts=hosts))
    built = dict(calls)
    classes = _mesh_classes(searcher)
    # whole hosts: 1..hosts of them; inside one host: 1, 2 and 4 devices
    assert len(classes) == hosts + 3
    assert len(searcher.meshes) == hosts * (hosts + 1) // 2 + hosts * (8 + 4 + 2)
    priced = sum(
        len(searcher.placements(n, mesh)) for n in searcher.problem.nodes for mesh in classes.values()
    )
    assert built == {"node_cost": priced, "parse_devices": 0}


def test_placements_on_built_meshes_keep_the_checks_that_do_not_read_the_ids() -> None:
    assert NodePlacement.on_mesh((4, 5), Layout(2, 1, 1, 2)) == NodePlacement((4, 5), Layout(2, 1, 1, 2))
    with pytest.raises(PlanError, match="needs dp×tp×pp = 4×1×1 = 4 devices but the mesh has 2"):
        NodePlacement.on_mesh((0, 1), Layout(4))
    with pytest.raises(PlanError, match="engine: 'vllmm' is not one of"):
        NodePlacement.on_mesh((0,), Layout(), engine="vllmm")
    with pytest.raises(PlanError, match="expected a tuple"):
        NodePlacement.on_mesh([0, 1], Layout(2))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="device 1 is listed twice"):  # users' meshes are still parsed
        NodePlacement((1, 1), Layout(2))
    searcher = Searcher(ppo_problem("7b", "7b"), load_cluster("h100-8x", hosts=1))
    with pytest.raises(PlanError, match="device 3 is listed twice"):
        searcher.placements(searcher.problem.nodes[0], (3, 3))


@pytest.mark.parametrize("zero", [None, ZeroConfig(3, offload_optimizer=True)])
def test_device_totals_add_up_the_consumers_in_their_order(zero: ZeroConfig | None) -> None:
    """``device_totals`` (one sum per cell of devices) is bit for bit the per-device sum of
    ``device_consumers``, keys in the same order, on the searcher's candidates and on overlapping,
    non-contiguous meshes of a hand-written plan."""
    searcher = Searcher(ppo_problem("7b", "7b", zero=zero), load_cluster("h100-8x", hosts=2))
    rng = random.Random(0)
    plans = [
        {n.name: rng.choice(searcher.candidates[n.name]) for n in searcher.problem.nodes} for _ in range(40)
    ]
    odd = {
        "actor_gen": NodePlacement((9, 3, 1, 12), Layout(4)),
        "ref_inf": NodePlacement((3, 1), Layout(2)),
        "reward_inf": NodePlacement((12, 9), Layout(2)),
        "critic_inf": NodePlacement((1,), Layout()),
        "actor_train": NodePlacement((1, 3, 9, 12), Layout(4)),
        "critic_train": NodePlacement((15, 0, 1, 3), Layout(4)),
    }
    for plan in [*plans, odd]:
        consumers = device_consumers(searcher.cost, plan)
        expected = {d: sum(c.nbytes for c in cs) for d, cs in consumers.items()}
        totals = device_totals(searcher.cost, plan)
        assert list(totals) == list(expected) and totals == expected
    assert searcher.memory(odd) == device_totals(searcher.cost, odd)


def test_simulator_cells_are_the_devices_that_share_their_tasks() -> None:
    """The replay keeps one FIFO per cell: devices in a cell run exactly the same tasks, devices in
    different cells do not, and the cells cover every device of every task."""
    meshes = [(0, 1, 2, 3), (2, 3, 4, 5), (5, 9), (0, 1, 2, 3), (7,), (9, 5, 2)]
    tasks = [_Task(0, f"t{i}", "node", m, 1.0, []) for i, m in enumerate(meshes)]
    cells = [set(c) for c in _cells(tasks)]
    runs = {d: {i for i, m in enumerate(meshes) if d in m} for m in meshes for d in m}  # device -> tasks
    every = set().union(*cells)
    cell_of = {}
    for d, mine in runs.items():  # the cells of d's tasks and of no other task
        (cell_of[d],) = every.intersection(*(cells[i] for i in mine)).difference(
            *(cells[i] for i in range(len(meshes)) if i not in mine)
        )
    for i, m in enumerate(meshes):
        assert cells[i] == {cell_of[d] for d in m}
    for d in runs:
        for e in runs:
            assert (cell_of[d] == cell_of[e]) == (runs[d] == runs[e])
    assert len(every) == 7  # {0, 1} share their tasks; every other device is a cell of its own


def _budget_searcher() -> Searcher:
    return Searcher(ppo_problem("7b", "7b"), load_cluster("h100-8x", hosts=2))


def test_search_without_budget_runs_every_step() -> None:
    result = _budget_searcher().search(seed=0, restarts=2, steps=30)
    assert not result.cut_short and result.steps_run == 60
    assert result.describe().endswith("all 60 annealing steps (2 restarts × 30) ran, no time budget")


def test_search_with_no_time_left_returns_the_best_baseline() -> None:
    searcher = _budget_searcher()
    result = searcher.search(seed=0, restarts=4, steps=1500, time_budget_s=0.0)
    assert result.cut_short and result.steps_run == 0
    best = min(s for _, s in result.baselines.values())
    assert math.isfinite(best) and result.iteration_s == best
    assert max(searcher.memory(result.plan).values()) <= searcher.capacity
    assert "the 0 s time budget cut it short after 0 of 6000 annealing steps" in result.describe()


def test_a_budget_never_turns_a_plannable_graph_into_infeasible() -> None:
    """examples/ppo.yaml's 8 rows spread over no baseline of 32 GPUs (every baseline is infeasible): with
    no time left the search still anneals until it holds a feasible plan, instead of reporting a random
    plan as "no memory-feasible plan" (fresh-user finding)."""
    graph = load_graph(str(ROOT / "examples" / "ppo.yaml"))
    searcher = Searcher(problem_from_graph(graph, device_type="cuda"), load_cluster("h100-8x", hosts=4))
    result = searcher.search(seed=0, restarts=4, steps=300, time_budget_s=0.0)
    assert not any(math.isfinite(s) for _, s in result.baselines.values())
    assert result.steps_run > 0 and max(searcher.memory(result.plan).values()) <= searcher.capacity


def test_search_cut_short_keeps_the_best_plan_found_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that ticks once per reading ends the search in the middle of its second chain; the plan
    returned is the best of the baselines, the finished chain and the part of the cut chain that ran
    (anytime search), and memory-feasible."""
    searcher = _budget_searcher()
    ticks = iter(range(10**9))
    clock = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)))
    monkeypatch.setattr("rlflow.schedulers.planner.search.time", clock)
    chains: list[tuple[int, float]] = []  # (steps run, best energy) per chain
    chain = searcher._chain

    def spy(*args: object) -> tuple[dict[str, NodePlacement], float, int]:
        plan, energy, ran = chain(*args)  # type: ignore[arg-type]
        chains.append((ran, energy))
        return plan, energy, ran

    monkeypatch.setattr(searcher, "_chain", spy)
    result = searcher.search(seed=0, restarts=3, steps=200, time_budget_s=300.0)
    # 300 readings: the baselines read the clock three times (before split, disaggregate and heuristic),
    # the chains once a step
    assert result.cut_short and [ran for ran, _ in chains] == [200, 94] and result.steps_run == 294
    found = [s for _, s in result.baselines.values()] + [energy for _, energy in chains]
    assert math.isfinite(chains[1][1]) and result.iteration_s == min(found)
    assert max(searcher.memory(result.plan).values()) <= searcher.capacity
    assert "after 294 of 600 annealing steps" in result.describe()


def _count_node_cost(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    calls = {"node_cost": 0}
    node_cost = CostModel.node_cost

    def count(self: CostModel, node: object, placement: NodePlacement) -> object:
        calls["node_cost"] += 1
        return node_cost(self, node, placement)  # type: ignore[arg-type]

    monkeypatch.setattr(CostModel, "node_cost", count)
    return calls


def test_candidates_past_the_deadline_keep_the_mesh_classes_priced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with a deadline already passed, each node prices mesh classes only until one fits: fewer
    placements priced, every node still has candidates (a subset of the full set), and ``candidates_cut``
    says so; without a deadline nothing is cut."""
    calls = _count_node_cost(monkeypatch)
    problem, cluster = ppo_problem("7b", "7b"), load_cluster("h100-8x", hosts=8)
    full = Searcher(problem, cluster)
    priced_full, calls["node_cost"] = calls["node_cost"], 0
    cut = Searcher(problem, cluster, deadline=-math.inf)
    assert cut.candidates_cut and not full.candidates_cut
    assert 0 < calls["node_cost"] < priced_full
    for node in problem.nodes:
        kept = cut.candidates[node.name]
        assert kept and set(kept) < set(full.candidates[node.name])
        classes = {
            (len(p.devices), cluster.host_of(min(p.devices)) != cluster.host_of(max(p.devices))) for p in kept
        }
        assert len(classes) == 1  # the first class that fits
    result = cut.search(seed=0, restarts=4, steps=1500, time_budget_s=0.0)
    assert result.cut_short and result.steps_run == 0
    assert max(cut.memory(result.plan).values()) <= cut.capacity


def test_a_passed_deadline_still_reports_a_node_that_fits_nowhere() -> None:
    with pytest.raises(PlanError, match=r"node 'actor_train'.*fits nowhere.*lacks [0-9.]+ GiB"):
        Searcher(ppo_problem("70b", "7b"), load_cluster("h100-8x", hosts=1), deadline=-math.inf)


def test_search_past_the_deadline_prices_no_baseline_after_the_first_plan() -> None:
    """With no time left the first baseline with a plan ends the baselines: the others are left out and
    ``budget_cut`` says so; the result is that plan, and the search says the budget cut it short (also
    with no annealing asked for)."""
    searcher = _budget_searcher()
    result = searcher.search(seed=0, restarts=0, time_budget_s=0.0)
    (first, (plan, seconds)), *rest = result.baselines.items()
    assert first == "colocate" and plan is not None and result.iteration_s == seconds
    later = ("split", "disaggregate", "heuristic")
    assert [(name, s) for name, (_, s) in rest] == [(n, math.inf) for n in later]
    assert searcher.budget_cut == {n: "not priced: the time budget ran out" for n in later}
    assert result.cut_short and "time budget cut it short" in result.describe()
    full = _budget_searcher()
    assert all(math.isfinite(s) for _, s in full.search(seed=0, restarts=0).baselines.values())
    assert not full.budget_cut


def test_split_baseline_past_the_deadline_keeps_the_split_points_priced() -> None:
    """The split baseline checks the deadline between split points: past it, the best of those priced
    (here the first of the three host boundaries of 4 hosts), and ``budget_cut`` counts them."""
    searcher = Searcher(ppo_problem("7b", "7b"), load_cluster("h100-8x", hosts=4))
    cut = searcher.baseline_split(deadline=-math.inf)
    assert searcher.budget_cut == {
        "split": "the best of the first 1 of 3 split points: the time budget ran out"
    }
    gen = {n.name for n in searcher.problem.nodes if n.model == "actor" and n.kind == "generate"}
    assert cut is not None and all(cut[n].devices == tuple(range(8)) for n in gen)
    assert max(searcher.memory(cut).values()) <= searcher.capacity


def test_plannable_graph_past_the_deadline_completes_the_candidates() -> None:
    """Every baseline over memory and candidates cut by a passed deadline: the search completes the
    candidates before annealing, so a plannable graph still gets a plan (as without a deadline)."""
    graph = load_graph(str(ROOT / "examples" / "ppo.yaml"))
    problem = problem_from_graph(graph, device_type="cuda")
    searcher = Searcher(problem, load_cluster("h100-8x", hosts=4), deadline=-math.inf)
    assert searcher.candidates_cut
    result = searcher.search(seed=0, restarts=4, steps=300, time_budget_s=0.0)
    assert not any(math.isfinite(s) for _, s in result.baselines.values())
    assert not searcher.candidates_cut and not searcher.budget_cut
    assert result.steps_run > 0 and max(searcher.memory(result.plan).values()) <= searcher.capacity


def test_plan_command_says_when_the_budget_cut_the_search_short(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlflow.schedulers.cli import main

    out = tmp_path / "plan.yaml"
    argv = ["plan", str(EXAMPLES / "ppo.yaml"), "--cluster", "cpu-local", "--hosts", "2", "--out", str(out)]
    assert main([*argv, "--time-budget", "0"]) == 0
    text = capsys.readouterr().out
    assert "the 0 s time budget cut it short after 0 of 6000 annealing steps" in text
    assert "baseline heuristic: not priced: the time budget ran out" in text  # after the first plan
    header = out.read_text()
    assert "--time-budget 0" in header and "plans simulated in" in header and "cut it short" in header
    assert set(load_plan(out)) >= {"actor_gen", "actor_train"}
    with pytest.raises(SystemExit):
        main([*argv, "--time-budget", "-1"])
    assert "expected seconds (a number >= 0, or inf), got '-1'" in capsys.readouterr().err
    for flag, value, least in (("--steps", "-5", 1), ("--restarts", "-2", 0), ("--steps", "x", 1)):
        with pytest.raises(SystemExit):
            main([*argv, flag, value])
        assert f"{flag}: expected an integer >= {least}, got '{value}'" in capsys.readouterr().err


def test_cluster_memo_answers_as_the_direct_count() -> None:
    cluster = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=4, hosts=3)
    for devices in [(0, 1, 2, 3, 4), (11, 0, 5, 4), [6, 7], (3,)]:
        direct: dict[int, int] = {}
        for d in devices:
            direct[d // 4] = direct.get(d // 4, 0) + 1
        assert cluster.busy_per_host(devices) == direct and list(cluster.busy_per_host(devices)) == list(
            direct
        )
        assert cluster.host_loads(devices) == tuple(sorted(direct.values()))
        one_host = len(direct) == 1
        assert cluster.link(devices) is (cluster.intra_host if one_host else cluster.inter_host)


LLAMA_405B = [  # meta-llama/Llama-3.1-405B config.json, on the 8B GRPO recipe's graph
    "models.actor.config.hidden_size=16384",
    "models.actor.config.intermediate_size=53248",
    "models.actor.config.num_hidden_layers=126",
    "models.actor.config.num_attention_heads=128",
    "run.devices=256",
]


def test_a_405b_actor_is_planned_on_80gb_gpus_with_pipelined_generation() -> None:
    """Llama-3.1-405B as the GRPO actor on 32 × 8 H100-80GB. Its parameters, by hand: embedding and head
    2 × 128,256 × 16,384 = 4,202,692,608; per layer q, o 2 × 16,384² + k, v 2 × 16,384 × 1,024 + MLP
    3 × 16,384 × 53,248 + 2 norms × 16,384 = 3,187,703,808, × 126 layers; + the final norm: 405,853,388,800,
    811.7 GB in bf16. No generation layout without pipeline stages fits (one host's tp 8 shard alone is
    101.5 GB of 80 GB), so the plan's generate node runs the built-in loop on pipeline stages, and the plan
    fits in memory (session 8: "actor_gen fits nowhere")."""
    # the engine left to the plan (the file pins NeMo RL's vLLM): the built-in loop on pipeline stages fits
    graph = load_graph(
        str(ROOT / "bench" / "published" / "grpo_llama31_8b.yaml"),
        [*LLAMA_405B, "nodes.actor_gen.engine=auto"],
    )
    problem = problem_from_graph(graph, device_type="cuda", prompt_len=128)
    assert problem.models["actor"].num_params == 2 * 128_256 * 16_384 + 126 * 3_187_703_808 + 16_384
    assert problem.models["actor"].num_params == 405_853_388_800
    searcher = Searcher(problem, load_cluster("h100-8x", hosts=32))
    gen = problem.node("actor_gen")
    host = tuple(range(8))
    unpipelined = [p for p in searcher.placements(gen, host) if p.layout.pp == 1]
    assert unpipelined and all(
        searcher.cost.node_cost(gen, p).memory.weights > searcher.capacity for p in unpipelined
    )
    result = searcher.search(seed=0, restarts=1, steps=100)
    placement = result.plan["actor_gen"]
    assert placement.layout.pp > 1 and placement.engine in (None, "builtin"), placement
    assert math.isfinite(result.iteration_s)
    assert max(searcher.memory(result.plan).values()) <= searcher.capacity
