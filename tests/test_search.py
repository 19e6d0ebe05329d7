"""Search: annealer vs exhaustive optimum, seeded reproducibility, baselines, errors, plan YAML."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.candidates import candidate_meshes
from rlflow.schedulers.planner.cluster import ClusterSpec, EngineRates, Overheads, human_bytes
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.plans import dump_plan, load_plan
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem, ppo_problem
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.shapes import ModelShape

CFG = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256
)


def small_cluster() -> ClusterSpec:
    return dataclasses.replace(load_cluster("cpu-local"), devices_per_host=4)


def small_problem() -> PlanProblem:
    actor = ModelShape.from_config({**CFG, "num_hidden_layers": 2})
    nodes = (
        PlanNode("gen", "actor", "generate", 16, 32, 32),
        PlanNode("ref", "ref", "inference", 16, 32, 32),
        PlanNode("train", "actor", "train", 16, 32, 32, mini_batches=2),
    )
    edges = (("gen", "ref", "response_ids", 4096), ("gen", "train", "response_ids", 4096),
             ("ref", "train", "ref_logprobs", 2048))  # fmt: skip
    return PlanProblem({"actor": actor, "ref": actor}, nodes, edges, (("train", "gen"),))


def test_candidate_meshes_align_to_hosts() -> None:
    meshes = candidate_meshes(load_cluster("cpu-local", hosts=2))
    # whole-host ranges (0-1, 0-3, 2-3) + single devices inside a host
    assert sorted(meshes) == sorted([(0, 1), (0, 1, 2, 3), (2, 3), (0,), (1,), (2,), (3,)])


def test_annealer_finds_exhaustive_optimum_and_is_reproducible() -> None:
    problem, cluster = small_problem(), small_cluster()
    exhaustive = Searcher(problem, cluster, layouts_per_mesh=2).exhaustive()
    first = Searcher(problem, cluster, layouts_per_mesh=2).search(seed=3, restarts=3, steps=400)
    second = Searcher(problem, cluster, layouts_per_mesh=2).search(seed=3, restarts=3, steps=400)
    assert first.iteration_s == pytest.approx(exhaustive.iteration_s, rel=1e-9)
    assert first.plan == second.plan
    for _name, (plan, seconds) in first.baselines.items():
        assert plan is None or first.iteration_s <= seconds + 1e-12


def test_baselines_follow_their_rules() -> None:
    searcher = Searcher(ppo_problem("7b", "7b"), load_cluster("h100-8x", hosts=2))
    everything = tuple(range(16))
    colocate = searcher.baseline_colocate()
    assert colocate is not None
    assert all(p.devices == everything for p in colocate.values())
    assert len({(p.layout.dp, p.layout.tp, p.layout.pp) for p in colocate.values()}) == 1
    split = searcher.baseline_split()
    assert split is not None
    actor = {split["actor_gen"].devices, split["actor_train"].devices}
    others = {split[n].devices for n in ("ref_inf", "reward_inf", "critic_inf", "critic_train")}
    assert len(actor) == 1 and len(others) == 1 and not set(*actor) & set(*others)
    heuristic = searcher.baseline_heuristic()
    assert heuristic is not None and all(p.devices == everything for p in heuristic.values())
    result = searcher.search(seed=0, restarts=2, steps=300)
    assert all(result.iteration_s <= s for _, s in result.baselines.values() if math.isfinite(s))
    assert max(searcher.memory(result.plan).values()) <= searcher.capacity


def test_model_that_fits_nowhere_names_node_and_shortfall() -> None:
    cluster = load_cluster("h100-8x")  # 8 × 80 GB cannot train a 70B model with Adam (16 B/param)
    with pytest.raises(PlanError, match=r"node 'actor_train'.*lacks [0-9.]+ GiB"):
        Searcher(ppo_problem("70b", "7b"), cluster)


def test_human_bytes_and_plan_yaml_roundtrip(tmp_path: Path) -> None:
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(12) == "12 B"
    result = Searcher(small_problem(), small_cluster(), layouts_per_mesh=1).search(
        seed=0, restarts=1, steps=50
    )
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(result.plan, "predicted\nby test"))
    assert load_plan(path) == result.plan


def test_infeasible_baselines_say_why() -> None:
    three = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=3)
    searcher = Searcher(small_problem(), three)
    baselines = searcher.baselines()
    # 16 rows cannot split over dp = 3; 4 heads cannot split over tp = 3; 2 layers cannot fill pp = 3
    assert baselines["colocate"] == (None, math.inf)
    why = searcher.infeasible["colocate"]
    assert why.startswith("no layout on all 3 devices suits every node")
    assert "d3t1p1: node 'gen': 16 rows do not divide into dp=3" in why
    assert "d1t3p1: node 'gen': num_attention_heads=4 is not divisible by tp=3" in why
    assert "heuristic" in searcher.infeasible and "memory" not in searcher.infeasible["heuristic"]
    assert "split" not in searcher.infeasible  # 1 + 2 devices work


def _engine_problem(engines: tuple[str, ...]) -> PlanProblem:
    problem = small_problem()
    gen = dataclasses.replace(problem.nodes[0], engine="auto", engines=engines)
    return dataclasses.replace(problem, nodes=(gen, *problem.nodes[1:]))


@pytest.mark.parametrize(("decode_step_s", "chosen"), [(0.001, "vllm"), (0.05, "builtin")])
def test_search_chooses_the_engine_by_predicted_cost(
    decode_step_s: float, chosen: str, tmp_path: Path
) -> None:
    """``engine: auto``: the built-in loop pays 10 ms per generated token; an engine whose profiled decode
    step costs 1 ms wins, one whose step costs 50 ms loses; the choice is named in the placement, and an
    engine that cannot serve the node (not among ``engines``) is never chosen."""
    rates = EngineRates(prefill_call_s=0.005, decode_step_s=decode_step_s, load_bandwidth=1e12, measured=True)
    cluster = dataclasses.replace(
        small_cluster(), overheads=Overheads(call_s=0.005, decode_s=0.01), engine=rates
    )
    searcher = Searcher(_engine_problem(("builtin", "vllm")), cluster, layouts_per_mesh=2)
    gen = searcher.problem.node("gen")
    assert {p.engine for p in searcher.placements(gen, (0, 1))} == {"builtin", "vllm"}
    assert chosen in {p.engine for p in searcher.candidates["gen"]}
    assert all(p.layout.micro_batches == 1 for p in searcher.candidates["gen"] if p.engine == "vllm")
    result = searcher.search(seed=0, restarts=2, steps=200)
    exhaustive = Searcher(_engine_problem(("builtin", "vllm")), cluster, layouts_per_mesh=2).exhaustive()
    assert result.plan["gen"].engine == exhaustive.plan["gen"].engine == chosen
    assert result.iteration_s == pytest.approx(exhaustive.iteration_s, rel=1e-9)
    assert {result.plan[n].engine for n in ("ref", "train")} == {None}  # only engine: auto nodes name one
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(result.plan))
    assert f"engine: {chosen}" in path.read_text() and load_plan(path) == result.plan
    unavailable = Searcher(_engine_problem(("builtin",)), cluster, layouts_per_mesh=2)
    assert {p.engine for p in unavailable.placements(unavailable.problem.node("gen"), (0, 1))} == {"builtin"}
    assert unavailable.search(seed=0, restarts=2, steps=200).plan["gen"].engine == "builtin"
