"""Asynchronous RL (``nodes.<generate node>.staleness``): the version schedule under the real Controller.

η = 0 through the asynchronous loop is bit-identical to the synchronous loop; η >= 1 follows the
deterministic schedule (generation of iteration k samples with the weights after iteration k - 1 - η) in one
process and on 2 CPU workers (generation on one, everything else on the other), where generation of the
next iteration overlaps the current one's training, runs are reproducible, and a run killed with batches in
flight resumes exactly. Tests never assert timings: the overlap is read from the trace's order of events.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.schedulers.runtime.controller as controller_mod
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.loader import loads_graph
from rlflow.schedulers.records.rundir import TraceRow, read_metrics, read_trace
from rlflow.schedulers.runtime.asynchronous import AsyncLoop
from rlflow.schedulers.runtime.choose_executor import make_executor
from rlflow.schedulers.runtime.controller import Controller
from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor
from rlflow.schedulers.runtime.executor import LocalExecutor
from rlflow.schedulers.runtime.iteration import busy_spans, idle_ratios

ROOT = Path(__file__).resolve().parents[1]
FAST = {"start_timeout_s": 120.0, "node_timeout_s": 60.0, "collective_timeout_s": 30.0}
COMMON = ["run.eval_interval=0", "run.checkpoint_interval=0", "run.iterations=4"]
STEPS = 4  # examples/ppo.yaml's actor_train: 2 epochs x 2 mini-batches = 4 optimizer steps per version
# generation on worker 0, everything else (reward, reference, critic, both train nodes) on worker 1
PLAN_SPLIT = """
plan:
  actor_gen: {devices: 0, layout: d1t1p1m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 1, layout: d1t1p1m1}
  critic_values: {devices: 1, layout: d1t1p1m1}
  actor_train: {devices: 1, layout: d1t1p1m1}
  critic_train: {devices: 1, layout: d1t1p1m1}
"""
# metrics that measure time (or depend on it), left out of exact comparisons
TIMED = ("timing_s/", "perf/", "memory_bytes/", "realloc/seconds", "async/queue_depth")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


def _graph(out: Path, *overrides: str, plan: str = "", devices: int = 1) -> Graph:
    text = (ROOT / "examples/ppo.yaml").read_text() + plan
    return loads_graph(
        text, "examples/ppo.yaml", [f"run.devices={devices}", *COMMON, f"run.output_dir={out}", *overrides]
    )


def _exact(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if not k.startswith(TIMED) and v is not None}


def _rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(r["iteration"]): _exact(r) for r in read_metrics(run_dir).to_pylist()}


def _actor(c: Controller) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in c.executor.models["actor"].module.named_parameters()}


def _run(graph: Graph, **kwargs: Any) -> tuple[Controller, dict[str, torch.Tensor]]:
    c = Controller(graph, **kwargs)
    try:
        c.run()
        return c, _actor(c)
    finally:
        c.close()


class Crash(Exception):
    """Stands for a killed run."""


def _crash_after(c: Controller, iteration: int) -> None:
    """Make ``c`` die once ``iteration`` has completed, before it is logged (later batches in flight)."""
    assert c.loop is not None
    real = c.loop.next

    def next_then_crash(k: int, total: int) -> dict[str, float]:
        out = real(k, total)
        if k == iteration:
            raise Crash(f"killed after iteration {k}")
        return out

    c.loop.next = next_then_crash  # type: ignore[method-assign]


# -- pure parts -------------------------------------------------------------------------------------------
def test_idle_ratios() -> None:
    # worker 0: (0, 2) and (1, 3) cover [1, 3] of [1, 5] -> idle 2/4; worker 1: nothing; worker 2: all
    spans = {0: [(0.0, 2.0), (1.0, 3.0)], 1: [], 2: [(0.5, 9.0)], 3: [(1.5, 2.0), (4.0, 4.5), (4.25, 6.0)]}
    got = idle_ratios(spans, 1.0, 5.0)
    assert got == {0: 0.5, 1: 1.0, 2: 0.0, 3: pytest.approx(1 - (0.5 + 1.0) / 4)}
    assert idle_ratios({0: [(0.0, 1.0)]}, 2.0, 2.0) == {0: 0.0}
    # a weight sync is busy from the moment its last participant arrived: worker 0 entered at 1.0 and
    # waited for worker 1, which entered at 3.0 after its train step (2.0 - 3.0); both ended at 4.0
    rows = [
        TraceRow(1, "actor_train", 1, 1, 2.0, 3.0),
        TraceRow(1, "actor", 0, 0, 1.0, 4.0, kind="reallocation"),
        TraceRow(1, "actor", 1, 1, 3.0, 4.0, kind="reallocation"),
        TraceRow(2, "actor", 0, 0, 5.0, 6.0, kind="reallocation"),  # another sync: its own arrival
    ]
    assert busy_spans(rows) == {0: [(3.0, 4.0), (5.0, 6.0)], 1: [(2.0, 3.0), (3.0, 4.0)]}


def test_generate_node_outputs_the_version_that_sampled(tmp_path: Path) -> None:
    ex = LocalExecutor(_graph(tmp_path))
    ctx = ex.contexts["actor_gen"]
    assert ctx.model is not None
    ctx.model.version = 7
    prompts = Batch(
        {
            "prompt_ids": torch.tensor([[1, 5, 6], [1, 7, 8]]),
            "prompt_mask": torch.ones(2, 3, dtype=torch.long),
        }
    )
    result = ex.run_node("actor_gen", prompts, 1)
    assert torch.equal(result.outputs["weight_version"], torch.full((2,), 7, dtype=torch.long))
    assert result.metrics["rollout/weight_version"] == 7.0


# -- one process ------------------------------------------------------------------------------------------
def test_eta_0_through_the_async_loop_is_the_synchronous_run_bit_for_bit(tmp_path: Path) -> None:
    """The asynchronous loop with η = 0 everywhere (forced here; the controller never builds it for a
    synchronous graph) submits the same nodes in the same order: identical metrics and weights."""
    sync, w_sync = _run(_graph(tmp_path / "sync"))
    assert sync.loop is None
    c = Controller(_graph(tmp_path / "loop"))
    c.loop = AsyncLoop(c, 0)
    try:
        c.run()
        w_loop = _actor(c)
    finally:
        c.close()
    loop_rows = _rows(tmp_path / "loop")
    assert all(loop_rows[k].pop("async/staleness_max") == 0.0 for k in loop_rows)  # the loop's own records
    for k in loop_rows:
        loop_rows[k] = {m: v for m, v in loop_rows[k].items() if not m.startswith("async/")}
    assert _rows(tmp_path / "sync") == loop_rows
    assert all(torch.equal(w_sync[k], w_loop[k]) for k in w_sync)
    explicit, w_explicit = _run(_graph(tmp_path / "explicit", "nodes.actor_gen.staleness=0"))
    assert explicit.loop is None and all(torch.equal(w_sync[k], w_explicit[k]) for k in w_sync)


@pytest.mark.parametrize("eta", [1, 2])
def test_one_process_follows_the_version_schedule(tmp_path: Path, eta: int) -> None:
    """Iteration k samples with version max(0, k - 1 - η) (measured: the weights' optimizer steps), so the
    lag is min(k - 1, η); the single process runs the schedule one node after the other (warned)."""
    with pytest.warns(UserWarning, match="cannot overlap"):
        graph = _graph(tmp_path, f"nodes.actor_gen.staleness={eta}")
    c, _ = _run(graph)
    assert c.loop is not None
    rows = read_metrics(tmp_path).to_pylist()
    for r in rows:
        k = r["iteration"]
        assert r["rollout/weight_version"] == STEPS * max(0, k - 1 - eta)
        assert r["async/staleness_mean"] == r["async/staleness_max"] == min(k - 1, eta)
        assert r["async/at_bound"] == (1.0 if k - 1 >= eta else 0.0)
        assert 0.0 <= r["perf/idle_ratio/0"] <= 1.0


def test_one_process_resumes_batches_in_flight_exactly_and_keeps_the_bound(tmp_path: Path) -> None:
    _, w_a = _run(_graph(tmp_path / "a", "nodes.actor_gen.staleness=1"))
    b = Controller(_graph(tmp_path / "b", "nodes.actor_gen.staleness=1", "run.checkpoint_interval=2"))
    _crash_after(b, 3)
    with pytest.raises(Crash):
        b.run()
    b.close()
    state = torch.load(tmp_path / "b/checkpoints/iter-000002/state.pt", weights_only=False)
    assert sorted(state["inflight"]["iterations"]) == [3]  # generated before iteration 2 trained
    assert "actor_gen" in state["inflight"]["iterations"][3]["finished"]
    shutil.copytree(tmp_path / "b", tmp_path / "b2", ignore=shutil.ignore_patterns("run.lock"))
    resumed, w_b = _run(_graph(tmp_path / "b", "nodes.actor_gen.staleness=1"), resume=True)
    assert resumed.start_iteration == 2
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    # the batch generated ahead was sampled under η = 1: another bound is refused, naming the key
    with pytest.raises(GraphError, match=r"examples/ppo.yaml: --resume: the checkpoint holds 1 batch.*"
                       r"staleness actor_gen: 1; this graph has actor_gen: 2.*staleness"):  # fmt: skip
        Controller(_graph(tmp_path / "b2", "nodes.actor_gen.staleness=2"), resume=True)
    with pytest.raises(GraphError, match=r"this graph has 0 everywhere \(synchronous\)"):
        Controller(_graph(tmp_path / "b2"), resume=True)


def test_a_synchronous_checkpoint_resumed_asynchronously_stays_within_the_bound(tmp_path: Path) -> None:
    """No batch in flight: the schedule restarts at the checkpoint (versions max(s, k - 1 - η))."""
    _run(_graph(tmp_path, "run.iterations=2", "run.checkpoint_interval=2"))
    _run(_graph(tmp_path, "nodes.actor_gen.staleness=1"), resume=True)
    rows = {r["iteration"]: r for r in read_metrics(tmp_path).to_pylist()}
    assert rows[2].get("async/staleness_max") is None  # written by the synchronous run
    assert [rows[k]["async/staleness_max"] for k in (3, 4)] == [0.0, 1.0]
    assert [rows[k]["rollout/weight_version"] for k in (3, 4)] == [2 * STEPS, 2 * STEPS]


# -- two workers ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_overlap_reproduce_match_one_process_and_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """η = 1 with generation on worker 0 and training on worker 1: every iteration's lag is min(k - 1, 1);
    generation of iteration k + 1 runs before the weight sync of iteration k on its worker and overlaps
    iteration k's work on the other; a second run, killed after iteration 3 with iteration 4 generated and
    resumed from the checkpoint after iteration 2 (iteration 3 in flight), gives every metric and weight of
    the first bit for bit; one process computes the same schedule (to float rounding of the two builds)."""
    made: list[DistExecutor] = []

    def factory(graph: Graph, checkpoint_dir: Path | None = None) -> object:
        made.append(make_executor(graph, checkpoint_dir, **FAST, realloc="gather"))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(controller_mod, "make_executor", factory)
    split = ["nodes.actor_gen.staleness=1", "run.checkpoint_interval=2"]
    a, w_a = _run(_graph(tmp_path / "a", *split, plan=PLAN_SPLIT, devices=2))
    assert isinstance(made[0], DistExecutor) and a.loop is not None
    rows = read_metrics(tmp_path / "a").to_pylist()
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["rollout/weight_version"] for r in rows] == [0.0, 0.0, STEPS, 2 * STEPS]
    assert all(0.0 <= r[f"perf/idle_ratio/{w}"] <= 1.0 for r in rows for w in (0, 1))

    trace = read_trace(tmp_path / "a").to_pylist()

    def span(k: int, node: str, worker: int, kind: str = "node") -> tuple[float, float]:
        (row,) = [
            r for r in trace if (r["iteration"], r["node"], r["worker"], r["kind"]) == (k, node, worker, kind)
        ]
        return row["start_s"], row["end_s"]

    overlaps = 0
    for k in (1, 2, 3):
        gen_start, gen_end = span(k + 1, "actor_gen", 0)
        sync_start, _ = span(k, "actor", 0, "reallocation")  # the weights of iteration k reach worker 0
        assert gen_end <= sync_start + 1e-3  # (same host: worker clocks agree to well under a millisecond)
        work = [(r["start_s"], r["end_s"]) for r in trace if r["iteration"] == k and r["worker"] == 1]
        overlaps += any(s < gen_end and gen_start < e for s, e in work)
    assert overlaps >= 1

    made.clear()
    b = Controller(_graph(tmp_path / "b", *split, plan=PLAN_SPLIT, devices=2))
    _crash_after(b, 3)
    with pytest.raises(Crash):
        b.run()
    b.close()
    _, w_b = _run(_graph(tmp_path / "b", *split, plan=PLAN_SPLIT, devices=2), resume=True)
    assert _rows(tmp_path / "a") == _rows(tmp_path / "b")
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)

    local, w_local = _run(_graph(tmp_path / "local", *split))
    assert isinstance(local.executor, LocalExecutor)
    one, two = _rows(tmp_path / "local"), _rows(tmp_path / "a")
    for k in one:
        for key, value in one[k].items():
            if "clipfrac" not in key:  # a count of values past a threshold flips with the last bit
                assert two[k][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (k, key)
    assert max(float((w_a[k] - w_local[k]).abs().max()) for k in w_a) < 1e-5


def test_run_checks_overlap_on_the_plan_it_runs(tmp_path: Path) -> None:
    """`rlflow run --plan`: the shared-devices warning is about --plan's placements, not the file's (whose
    plan puts everything on device 0): silent for a disjoint --plan, warned for one that shares."""
    import argparse
    import warnings

    from rlflow.schedulers.commands.stage import load_run_graph
    from rlflow.schedulers.planner.auto import resolve_plan

    def graph_with(plan: str) -> list[str]:
        plan_file = tmp_path / "plan.yaml"
        plan_file.write_text(plan)
        args = argparse.Namespace(
            graph=str(ROOT / "examples/ppo.yaml"), overrides=["nodes.actor_gen.staleness=1"], devices=2,
            launcher=None, plan=plan_file,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resolve_plan(load_run_graph(args, args.graph, args.overrides), plan_file)
        return [str(w.message) for w in seen if "cannot overlap" in str(w.message)]

    assert graph_with(PLAN_SPLIT) == []
    shared = graph_with(PLAN_SPLIT.replace("actor_gen: {devices: 0", "actor_gen: {devices: 1"))
    assert len(shared) == 1 and "share device [1]" in shared[0]
