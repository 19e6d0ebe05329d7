"""Dynamic sampling (issue 37): filter nodes, their predicates, rounds of generation, the bound, exact
resume, validation before anything runs, the planner's price of rounds and the dashboard's curves.

The runs are ``examples/dapo.yaml`` in one process (tiny model, 2-token responses)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError, NodeError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeContext
from rlflow.nodes.group_filters import keep_groups
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import NodePlacement
from rlflow.schedulers.planner.rounds import binomial_below, expected_rounds, rounds_line
from rlflow.schedulers.records.metric_groups import curve_plots
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
DAPO = "examples/dapo.yaml"
QUICK = ("algorithm.max_new_tokens=2", "run.checkpoint_interval=0", "run.eval_interval=0")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the example names paths relative to the repository root
    torch.set_num_threads(1)


def _controller(tmp: Path, *overrides: str, resume: bool = False) -> Controller:
    return Controller(load_graph(DAPO, [f"run.output_dir={tmp}", *QUICK, *overrides]), resume=resume)


# -- predicates ------------------------------------------------------------------------------------


def test_predicates_golden() -> None:
    # groups of 2: [1, 0] has spread, [1, 1] and [0, 0] do not; means 0.5, 1, 0
    values = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    assert keep_groups(values, 2, ["reward_spread"], {}).tolist() == [True, False, False]
    bounds = {"min_mean": 0.0, "max_mean": 1.0}
    assert keep_groups(values, 2, ["mean_between"], bounds).tolist() == [True, False, False]
    assert keep_groups(values, 2, ["mean_between"], {"min_mean": 0.25}).tolist() == [True, True, False]


def test_filter_function_through_the_registry() -> None:
    """Every argument reaches the predicates; the keep flag is per row, equal within each group."""
    load_builtin_functions()
    fn = NODE_FUNCTIONS.get("filter_groups").fn
    node = load_graph(DAPO).node("dynamic_sampling")
    ctx = NodeContext(node=node, model=None, group_size=3)
    batch = Batch({"metric": torch.tensor([0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.2, 0.2, 0.3])})
    out = fn(ctx, batch).outputs["keep"]
    assert out == [True] * 3 + [False] * 3 + [True] * 3
    out = fn(ctx, batch, predicates=["reward_spread", "mean_between"], max_mean=0.5).outputs["keep"]
    assert out == [False] * 6 + [True] * 3  # group means 0.5 (not below 0.5), 1, 0.233


# -- the runtime -----------------------------------------------------------------------------------


def _record(c: Controller) -> dict[str, list[Batch]]:
    """Record each node's input batch and outputs, per call, in call order."""
    seen: dict[str, list[Any]] = {}
    run_node = c.executor.run_node

    def wrapped(name: str, batch: Batch, iteration: int, segment: Any = None) -> Any:
        result = run_node(name, batch, iteration, segment)
        seen.setdefault(name, []).append((batch, result))
        return result

    c.executor.run_node = wrapped  # type: ignore[method-assign]
    return seen  # type: ignore[return-value]


def _rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [
        [t for t, m in zip(r, k, strict=True) if m] for r, k in zip(ids.tolist(), mask.tolist(), strict=True)
    ]


def test_train_node_gets_exactly_the_passing_groups_in_order(tmp_path: Path) -> None:
    c = _controller(tmp_path, "run.iterations=1")
    seen = _record(c)
    metrics = c.run().metrics
    rounds = len(seen["actor_gen"])
    assert rounds == metrics["filter/rounds"] > 1 and len(seen["dynamic_sampling"]) == rounds
    g = c.graph.group_size("actor_train")
    expected: list[list[int]] = []
    judged = passed = 0
    for (_, gen), (fin, _) in zip(seen["actor_gen"], seen["dynamic_sampling"], strict=True):
        acc = fin.tensor("metric").reshape(-1, g)
        rows = _rows(gen.outputs["response_ids"], gen.outputs["response_mask"])
        for i, group in enumerate(acc):
            judged += 1
            if group.max() > group.min():  # the predicate, written out
                passed += 1
                expected += rows[i * g : (i + 1) * g]
    ((train_in, _),) = seen["actor_train"]
    got = _rows(train_in.tensor("response_ids"), train_in.tensor("response_mask"))
    kept = int(metrics["filter/groups"])
    assert got == expected[: kept * g] and len(got) == kept * g
    assert metrics["filter/pass_rate"] == pytest.approx(passed / judged)
    assert kept == min(4, passed)  # 4 groups to pass; those beyond the 4th were dropped
    # the nodes after the filter ran once, on the kept rows
    ((ref_in, _),) = seen["ref"]
    assert len(ref_in) == kept * g


def test_on_short_error_stops_with_the_pass_rate(tmp_path: Path) -> None:
    c = _controller(
        tmp_path, "run.iterations=1", "nodes.dynamic_sampling.args.max_rounds=1",
        "nodes.dynamic_sampling.args.on_short=error",
    )  # fmt: skip
    with pytest.raises(
        NodeError, match=r"node 'dynamic_sampling': \d of 8 groups passed in 1 round .*on_short"
    ):
        c.run()


def test_on_short_train_trains_on_what_passed(tmp_path: Path) -> None:
    c = _controller(tmp_path, "run.iterations=1", "nodes.dynamic_sampling.args.max_rounds=1")
    seen = _record(c)
    m = c.run().metrics
    assert m["filter/rounds"] == 1 and 0 < m["filter/groups"] < 4
    assert m["filter/groups"] % 2 == 0  # 2 mini-batches of whole groups: an even number of groups
    ((train_in, _),) = seen["actor_train"]
    assert len(train_in) == m["filter/groups"] * 4


def test_resume_reproduces_the_filtered_groups(tmp_path: Path) -> None:
    """3 iterations == 2, stop, resume, 1: the same prompts drawn by every round, the same weights."""
    common = ("run.iterations=3", "run.checkpoint_interval=1")

    def prompts(c: Controller) -> list[Any]:
        out: list[Any] = []
        draw = c.stream.next_batch

        def wrapped(n: int) -> Batch:
            batch = draw(n)
            out.append(batch.tensor("prompt_ids").tolist())
            return batch

        c.stream.next_batch = wrapped  # type: ignore[method-assign]
        return out

    full = _controller(tmp_path / "a", *common)
    seen_full = prompts(full)
    m_full = full.run().metrics
    first = _controller(tmp_path / "b", *common)
    seen_b = prompts(first)
    first.run(iterations=2)
    resumed = _controller(tmp_path / "b", *common, resume=True)
    seen_r = prompts(resumed)
    m_resumed = resumed.run().metrics
    assert seen_b + seen_r == seen_full and len(seen_full) > 3  # rounds: more draws than iterations
    for key in ("filter/pass_rate", "filter/rounds", "filter/groups", "actor/pg_loss"):
        assert m_resumed[key] == m_full[key], key
    for name in full.executor.models:
        a, b = (
            full.executor.models[name].module.state_dict(),
            resumed.executor.models[name].module.state_dict(),
        )
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert (
        read_metrics(tmp_path / "b").column("filter/rounds").to_pylist()
        == read_metrics(tmp_path / "a").column("filter/rounds").to_pylist()
    )


# -- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nodes.dynamic_sampling.inputs.metric=correct"],
         r"examples/dapo.yaml: nodes\.dynamic_sampling\.inputs\.metric: key 'correct' has no producer"),
        (["nodes.dynamic_sampling.args.predicates=[reward_sprad]"],
         r"nodes\.dynamic_sampling\.args\.predicates: unknown predicate 'reward_sprad' \(did you mean "
         r"'reward_spread'\?\)"),
        (["nodes.dynamic_sampling.args.max_rounds=0"],
         r"nodes\.dynamic_sampling\.args\.max_rounds: .*positive integer"),
        (["algorithm.groups=80"],
         r"nodes\.dynamic_sampling\.batch_size: 80 groups to pass, but args\.max_rounds 8 rounds of 8 "
         r"prompts \(nodes\.actor_gen\.batch_size\) examine 64 groups at most"),
        (["nodes.dynamic_sampling.inputs.metric=answer"],
         r"nodes\.dynamic_sampling\.inputs: filter 'dynamic_sampling' reads 'answer', which no generate "
         r"node"),
        (["nodes.actor_gen.staleness=1", "nodes.actor_gen.interrupt_every=1"],
         r"nodes\.actor_gen\.interrupt_every: 1, but filter 'dynamic_sampling' reads its rounds: every round "
         r"of an iteration samples with the iteration's version"),
        (["algorithm.n_samples=1", "nodes.actor_train.function=reinforce_pp_actor"],
         r"nodes\.dynamic_sampling\.args\.predicates: \['reward_spread'\] need groups of at least 2 samples "
         r"per prompt, but generate node 'actor_gen' samples n=1"),
        (["nodes.dynamic_sampling.args.min_mean=0.0"],
         r"nodes\.dynamic_sampling\.args\.min_mean: is read by mean_between only"),
    ],
)  # fmt: skip
def test_mistakes_are_refused_before_anything_runs(overrides: list[str], message: str) -> None:
    with pytest.raises(GraphError, match=message):
        load_graph(DAPO, overrides)


# -- planner and dashboard -------------------------------------------------------------------------


def test_expected_rounds_golden() -> None:
    assert binomial_below(8, 0.5, 4) == pytest.approx(93 / 256)
    # P = 8 groups a round, N = 4 to pass, p = 0.5, at most 4 rounds: 1 + P(Bin(8)<4) + P(Bin(16)<4) + ...
    golden = 1 + 93 / 256 + 697 / 65536 + 2325 / 16777216
    assert expected_rounds(0.5, 8, 4, 4) == pytest.approx(golden)
    assert expected_rounds(1.0, 8, 20, 10) == 3  # ⌈20 / 8⌉
    assert expected_rounds(1e-9, 8, 4, 6) == pytest.approx(6)  # nothing passes: every round runs


def test_planner_prices_the_rounds(tmp_path: Path) -> None:
    graph = load_graph(DAPO, [f"run.output_dir={tmp_path}"])  # no run there: the stated pass rate
    problem = problem_from_graph(graph, prompt_len=8, mean_new_tokens=2)
    calls = expected_rounds(0.1, 8, 4, 8)
    nodes = {n.name: n for n in problem.nodes}
    assert nodes["actor_gen"].rounds == pytest.approx(calls) and nodes["actor_train"].rounds == 1
    once = dataclasses.replace(
        problem, nodes=tuple(dataclasses.replace(n, rounds=1.0) for n in problem.nodes)
    )
    cluster, here = load_cluster("cpu-local"), NodePlacement((0,))
    priced = CostModel(problem, cluster).node_cost("actor_gen", here)
    single = CostModel(once, cluster).node_cost("actor_gen", here)
    assert priced.time_s == pytest.approx(calls * single.time_s)
    assert priced.memory == single.memory
    line = rounds_line(graph)
    assert line is not None and "actor_gen, accuracy priced 5.19 times" in line and "stated" in line
    measured = problem_from_graph(graph, prompt_len=8, mean_new_tokens=2, pass_rate=0.5)
    assert {n.name: n for n in measured.nodes}["actor_gen"].rounds == pytest.approx(
        expected_rounds(0.5, 8, 4, 8)
    )


def test_planner_reads_a_measured_pass_rate(tmp_path: Path) -> None:
    """A run in the graph's run.output_dir recorded filter/pass_rate: its mean replaces the stated rate."""
    from rlflow.schedulers.records.rundir import RunRecorder

    rec = RunRecorder(tmp_path)
    rec.log_metrics(1, {"filter/pass_rate": 0.2})
    rec.log_metrics(2, {"filter/pass_rate": 0.4})
    graph = load_graph(DAPO, [f"run.output_dir={tmp_path}"])
    nodes = {n.name: n for n in problem_from_graph(graph, prompt_len=8, mean_new_tokens=2).nodes}
    assert nodes["actor_gen"].rounds == pytest.approx(expected_rounds(0.3, 8, 4, 8))
    line = rounds_line(graph)
    assert line is not None and f"pass rate 0.3 (measured by the run in {tmp_path})" in line


def test_dashboard_draws_pass_rate_and_rounds() -> None:
    import json

    names = json.loads((ROOT / "tests" / "example_metrics.json").read_text())["dapo"]
    plots = {n: p.title for p in curve_plots(names, 1) for n in p.names}
    assert {"filter/pass_rate", "filter/rounds", "filter/groups"} <= set(plots)
    assert len({plots["filter/pass_rate"], plots["filter/rounds"]}) == 2  # a fraction apart from a count


# generation on worker 0, the reference and training on worker 1
PLAN_APART = (
    "plan={actor_gen: {devices: '0', layout: d1t1p1m1}, ref: {devices: '1', layout: d1t1p1m1}, "
    "actor_train: {devices: '1', layout: d1t1p1m1}}"
)


def record_executors(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The executors the controllers made from now on (the runtime's choice, with the start and node timeouts
    a loaded two-core machine needs), in order."""
    import rlflow.schedulers.runtime.controller as controller_mod
    from rlflow.schedulers.runtime.choose_executor import make_executor

    made: list[Any] = []

    def factory(graph: Any, checkpoint_dir: Path | None = None) -> Any:
        made.append(make_executor(graph, checkpoint_dir, start_timeout_s=120.0, node_timeout_s=60.0))
        return made[-1]

    monkeypatch.setattr(controller_mod, "make_executor", factory)
    return made


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_workers_filter_as_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Generation on worker 0, training on worker 1: the same rounds, groups and step as one process, and
    every row the workers held for the rounds is freed (those of groups that failed included)."""
    from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor

    made = record_executors(monkeypatch)
    dist = _controller(tmp_path / "dist", "run.iterations=2", "run.devices=2", PLAN_APART)
    local = _controller(tmp_path / "local", "run.iterations=2")
    ex = made[0]
    assert isinstance(ex, DistExecutor)
    try:
        for k in (1, 2):
            got, want = dist.run_iteration(k), local.run_iteration(k)
            for key in ("filter/rounds", "filter/groups", "filter/pass_rate"):
                assert got[key] == want[key], key
            assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-4, abs=1e-6)
        assert max(got["filter/rounds"], want["filter/rounds"]) > 1  # rows of several rounds were merged
        assert ex.stored() == {0: [], 1: []}
    finally:
        dist.close()
        local.close()
