"""``plan: auto`` at launch (``rlflow.schedulers.planner.auto.resolve_plan``): the planner's plan for the
local host, validated like a hand-written plan, without starting any worker process."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path

import pytest

import rlflow.schedulers.planner.auto as auto_mod
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.layout_rules import node_layout_problem
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.auto import auto_plan, resolve_plan
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.search import Searcher, SearchResult
from rlflow.schedulers.runtime.choose_executor import is_trivial_plan
from rlflow.schedulers.runtime.distributed.placement import PlanView

PPO = str(Path(__file__).resolve().parent.parent / "examples" / "ppo.yaml")


def test_auto_on_two_devices_resolves_to_a_valid_runtime_plan() -> None:
    graph = load_graph(PPO, ["plan=auto", "run.devices=2"])
    err = io.StringIO()
    planned = auto_plan(graph, time_budget_s=2.0, stream=err)
    plan = planned.spec.plan
    assert isinstance(plan, dict) and set(plan) == set(graph.spec.nodes)
    Graph.from_spec(planned.spec, planned.registry)  # validates again from the spec alone
    view = PlanView.of(planned)  # the runtime's checks (pp, devices, groups), no process started
    assert view.world == 2
    assert {d for p in plan.values() for d in p.devices} <= {0, 1}
    for name, placement in plan.items():
        assert placement.layout.pp == 1 or planned.node(name).kind != "generate"
        assert node_layout_problem(planned, name, placement.layout) is None
    text = err.getvalue()
    assert "plan auto on cpu-local (2 devices)" in text and "actor_train" in text and "fallback" not in text
    # the same seed gives the same plan through resolve_plan (what `rlflow run` calls)
    assert resolve_plan(graph, None, time_budget_s=2.0).spec.plan == plan


def test_auto_on_one_device_is_the_trivial_plan() -> None:
    planned = resolve_plan(load_graph(PPO, ["plan=auto", "run.devices=1"]), None)
    assert planned.spec.plan == {}
    assert is_trivial_plan(planned)


def test_runtime_rules_allow_pipelined_generation_and_reject_uneven_shares() -> None:
    graph = load_graph(PPO, ["run.devices=4"])  # batch 8 prompts; trains use 2 mini-batches of 4 rows
    assert node_layout_problem(graph, "actor_train", Layout(2, 1, 1, 2)) is None
    assert node_layout_problem(graph, "actor_train", Layout(1, 1, 2, 1)) is None
    assert node_layout_problem(graph, "actor_gen", Layout(1, 1, 2, 1)) is None  # the built-in loop, 2 stages
    assert "pipeline stages" in str(node_layout_problem(graph, "actor_gen", Layout(1, 1, 3, 1)))  # 2 layers
    assert "divide" in str(node_layout_problem(graph, "actor_train", Layout(8, 1, 1, 1)))
    assert "divide" in str(node_layout_problem(graph, "actor_gen", Layout(4, 1, 1, 4)))


def test_a_searched_plan_that_fails_validation_falls_back_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make = auto_mod.graph_searcher

    def broken_searcher(graph: Graph, cluster: ClusterSpec, prompt_len: int | None = None) -> Searcher:
        searcher = make(graph, cluster, prompt_len)
        search = searcher.search

        def search_gen_pp2(
            seed: int = 0,
            restarts: int = 4,
            steps: int = 1500,
            time_budget_s: float = math.inf,
            *,
            since: float | None = None,
        ) -> SearchResult:
            result = search(
                seed=seed, restarts=restarts, steps=steps, time_budget_s=time_budget_s, since=since
            )
            plan = dict(result.plan)
            # 8 prompts over dp 2 leave 4 per rank, which 3 micro-batches do not divide: refused
            plan["actor_gen"] = NodePlacement((0, 1), Layout(2, 1, 1, 3))
            return dataclasses.replace(result, plan=plan)

        searcher.search = search_gen_pp2  # type: ignore[method-assign]
        return searcher

    graph = load_graph(PPO, ["plan=auto", "run.devices=2"])
    monkeypatch.setattr(auto_mod, "graph_searcher", broken_searcher)
    err = io.StringIO()
    planned = auto_plan(graph, time_budget_s=1.0, stream=err)
    assert "searched plan does not validate" in err.getvalue() and "fallback" in err.getvalue()
    plan = planned.spec.plan
    assert isinstance(plan, dict) and plan["actor_gen"].layout.micro_batches != 3

    def no_plan(graph: Graph, cluster: ClusterSpec, prompt_len: int | None = None) -> Searcher:
        raise PlanError("nothing fits")

    monkeypatch.setattr(auto_mod, "graph_searcher", no_plan)
    err = io.StringIO()
    plan = auto_plan(graph, stream=err).spec.plan
    assert "device 0" in err.getvalue()
    assert isinstance(plan, dict) and {p.devices for p in plan.values()} == {(0,)}
