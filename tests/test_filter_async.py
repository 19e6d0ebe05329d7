"""Dynamic sampling under asynchronous RL (issue 37): a filter's rounds as each iteration's generation stage.

``examples/dapo.yaml`` with ``nodes.actor_gen.staleness=1`` in one process (tiny model, 2-token responses,
3 iterations): the train node gets exactly the groups the predicate passed, in order; every round of
iteration k samples with the weights after iteration max(0, k - 2) (the rounds of one iteration share its
version) and iteration k + 1's rounds run before iteration k trains; a second run killed after iteration 3
and resumed from the checkpoint after iteration 2 (iteration 3's rounds in it) gives every metric and
weight of the first; on 2 workers (``slow``) the same rounds run beside training. The simulator replays
the round side as that stage.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.planner.simulator import simulate
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
DAPO = "examples/dapo.yaml"
COMMON = (
    "algorithm.max_new_tokens=2", "run.eval_interval=0", "run.iterations=3", "nodes.actor_gen.staleness=1",
)  # fmt: skip
STEPS = 2  # examples/dapo.yaml's actor_train: 1 epoch x 2 mini-batches = 2 optimizer steps per version
TIMED = ("timing_s/", "perf/", "memory_bytes/", "realloc/seconds", "async/queue_depth")


class Crash(Exception):
    """Stands for a killed run."""


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the example names paths relative to the repository root
    torch.set_num_threads(1)


def _graph(*overrides: str) -> Graph:
    with warnings.catch_warnings():  # one process: generation and training cannot overlap (warned)
        warnings.simplefilter("ignore", GraphWarning)
        return load_graph(DAPO, [*COMMON, *overrides])


def _controller(out: Path, *overrides: str, resume: bool = False) -> Controller:
    return Controller(_graph(f"run.output_dir={out}", *overrides), resume=resume)


def _record(c: Controller) -> list[tuple[str, int, Any, Any]]:
    """Every node call of ``c``: (node, iteration, input batch, result), in the order they ran."""
    seen: list[tuple[str, int, Any, Any]] = []
    run_node = c.executor.run_node

    def wrapped(name: str, batch: Any, iteration: int, segment: Any = None) -> Any:
        result = run_node(name, batch, iteration, segment)
        seen.append((name, iteration, batch, result))
        return result

    c.executor.run_node = wrapped  # type: ignore[method-assign]
    return seen


def _weights(c: Controller) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in c.executor.models["actor"].module.state_dict().items()}


def _rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    return {
        int(r["iteration"]): {k: v for k, v in r.items() if not k.startswith(TIMED) and v is not None}
        for r in read_metrics(run_dir).to_pylist()
    }


def _texts(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [
        [t for t, m in zip(r, k, strict=True) if m] for r, k in zip(ids.tolist(), mask.tolist(), strict=True)
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of 3 iterations with η = 1: its calls, metrics and final actor weights."""
    out = tmp_path_factory.mktemp("async_filter") / "a"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the example names paths relative to the repository root
        torch.set_num_threads(1)
        c = _controller(out, "run.checkpoint_interval=0")
        calls = _record(c)
        try:
            c.run()
            assert c.loop is not None and c.loop.stages is not None
            return {"calls": calls, "rows": _rows(out), "weights": _weights(c)}
        finally:
            c.close()


@pytest.mark.xdist_group("filter_async")  # one uninterrupted run for both
def test_train_node_gets_the_passing_groups_sampled_with_the_scheduled_version(
    uninterrupted: dict[str, Any],
) -> None:
    calls, rows = uninterrupted["calls"], uninterrupted["rows"]
    g = 4  # samples per prompt
    order = [(name, k) for name, k, _, _ in calls]
    several = 0
    for k in (1, 2, 3):
        gens = [(b, r) for name, it, b, r in calls if name == "actor_gen" and it == k]
        judged = [b for name, it, b, _ in calls if name == "dynamic_sampling" and it == k]
        assert len(gens) == len(judged) == rows[k]["filter/rounds"]
        several += len(gens) > 1
        # every round of iteration k sampled with the weights after iteration max(0, k - 2)
        assert {r.metrics["rollout/weight_version"] for _, r in gens} == {STEPS * max(0, k - 2)}
        assert rows[k]["async/staleness_max"] == rows[k]["async/staleness_mean"] == min(k - 1, 1)
        expected: list[list[int]] = []
        for (_, gen), fin in zip(gens, judged, strict=True):
            acc = fin.tensor("metric").reshape(-1, g)
            texts = _texts(gen.outputs["response_ids"], gen.outputs["response_mask"])
            for i, group in enumerate(acc):
                if group.max() > group.min():  # the predicate, written out
                    expected += texts[i * g : (i + 1) * g]
        (train_in,) = [b for name, it, b, _ in calls if name == "actor_train" and it == k]
        kept = int(rows[k]["filter/groups"])
        assert (
            _texts(train_in.tensor("response_ids"), train_in.tensor("response_mask")) == expected[: kept * g]
        )
        assert rows[k]["filter/pass_rate"] == pytest.approx(len(expected) / g / (len(judged) * 8))
    assert several  # rows of several rounds were joined
    # generation runs ahead: iteration 2's rounds before iteration 1 trains, iteration 3's after it
    assert order.index(("actor_gen", 2)) < order.index(("actor_train", 1)) < order.index(("actor_gen", 3))
    last_round_2 = max(i for i, c in enumerate(order) if c == ("dynamic_sampling", 2))
    assert last_round_2 < order.index(("actor_train", 1))  # the stage of 2 ended before the weights changed


@pytest.mark.xdist_group("filter_async")
def test_a_second_run_killed_and_resumed_reproduces_the_first(
    uninterrupted: dict[str, Any], tmp_path: Path
) -> None:
    """Checkpoint after iteration 2 (iteration 3's rounds ended and are in it), killed after iteration 3,
    resumed: every metric (the rounds and groups of each iteration included) and weight of the first run."""
    b = _controller(tmp_path / "b", "run.checkpoint_interval=2")
    assert b.loop is not None
    real = b.loop.next

    def next_then_crash(k: int, total: int) -> dict[str, float]:
        out = real(k, total)
        if k == 3:
            raise Crash("killed after iteration 3")
        return out

    b.loop.next = next_then_crash  # type: ignore[method-assign]
    with pytest.raises(Crash):
        b.run()
    b.close()
    state = torch.load(tmp_path / "b/checkpoints/iter-000002/state.pt", weights_only=False)
    assert sorted(state["inflight"]["iterations"]) == [3]
    assert "dynamic_sampling/rounds" in state["inflight"]["iterations"][3]["finished"]
    resumed = _controller(tmp_path / "b", "run.checkpoint_interval=2", resume=True)
    try:
        assert resumed.start_iteration == 2
        resumed.run()
        weights = _weights(resumed)
    finally:
        resumed.close()
    assert _rows(tmp_path / "b") == uninterrupted["rows"]
    assert all(torch.equal(weights[k], v) for k, v in uninterrupted["weights"].items())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("filter_async")
def test_two_workers_overlap_the_next_stage_with_training_as_one_process_computes(
    uninterrupted: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation on worker 0, training on worker 1: the rounds of iteration 2 begin while iteration 1
    trains, the weight sync of iteration 1 waits for their end, the rounds, groups and losses are the one
    process's, and every row the workers held is freed."""
    from rlflow.schedulers.records.rundir import read_trace
    from tests.test_filter import PLAN_APART, record_executors

    made = record_executors(monkeypatch)
    c = _controller(tmp_path, "run.checkpoint_interval=0", "run.devices=2", PLAN_APART)
    try:
        c.run()
        assert made[0].stored() == {0: [], 1: []}
    finally:
        c.close()
    for k, want in uninterrupted["rows"].items():
        got = _rows(tmp_path)[k]
        for key in ("filter/rounds", "filter/groups", "filter/pass_rate", "async/staleness_max"):
            assert got[key] == want[key], (k, key)
        assert got["actor/pg_loss"] == pytest.approx(want["actor/pg_loss"], rel=1e-4, abs=1e-6)
    trace = read_trace(tmp_path).to_pylist()

    def spans(k: int, node: str, kind: str = "node") -> list[tuple[float, float]]:
        return [
            (r["start_s"], r["end_s"])
            for r in trace
            if (r["iteration"], r["node"], r["kind"]) == (k, node, kind)
        ]

    stage = spans(2, "actor_gen") + spans(2, "dynamic_sampling")
    ((_, train_end),) = spans(1, "actor_train")
    assert min(a for a, _ in stage) < train_end  # the rounds of 2 began while iteration 1 trained
    # (same host: worker clocks agree to well under a millisecond)
    assert min(a for a, _ in spans(1, "actor", "reallocation")) >= max(b for _, b in stage) - 1e-3


def test_a_round_side_reader_of_the_trained_weights_at_another_lag_is_refused() -> None:
    """The actor's own log-probs upstream of the filter would read the newest version, while the rounds
    sample one η behind: the rounds would wait for the training that waits for them."""
    logp = (
        "  actor_logp:\n    model: actor\n    kind: inference\n    function: logprobs\n"
        "    inputs: [prompt_ids, prompt_mask, response_ids, response_mask]\n"
        "    outputs: {logprobs: cur_logprobs}\n    batch_size: 8\nrun:"
    )
    text = (ROOT / DAPO).read_text().replace("\nrun:", "\n" + logp, 1)
    with pytest.raises(
        GraphError,
        match=r"examples/dapo.yaml: nodes\.actor_logp: 'actor_logp' reads the weights train node "
        r"'actor_train' writes at staleness 0, upstream of filter 'dynamic_sampling', whose generate node "
        r"'actor_gen' samples them at staleness 1: an iteration's rounds read one version.*run 'actor_logp' "
        r"after",
    ):
        loads_graph(text, DAPO, [*COMMON, "nodes.dynamic_sampling.inputs.metric=cur_logprobs"])


# -- the planner -----------------------------------------------------------------------------------
SHAPE = ModelShape.from_config(
    {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
     "vocab_size": 16, "num_hidden_layers": 2}
)  # fmt: skip


def test_the_replay_runs_the_round_side_as_one_stage() -> None:
    """Generation (device 0) and a reward model (device 1) on the round side, training on device 1, η = 1:
    the generation of iteration k + 1 starts once the stage of k ended (its reward included), and the
    weight sync of iteration k waits for the end of the stage of k + 1, which reads the old weights."""
    one = Layout(1, 1, 1)
    problem = PlanProblem(
        {"actor": SHAPE, "rm": SHAPE},
        (
            PlanNode("g", "actor", "generate", 8, 4, 4, staleness=1, rounds=2.5),
            PlanNode("score", "rm", "inference", 8, 4, 4, rounds=2.5),
            PlanNode("t", "actor", "train", 8, 4, 4),
        ),
        (("g", "score", "response_ids", 0), ("g", "t", "response_ids", 0), ("score", "t", "scores", 0)),
        (("t", "g"),),
        round_side=("g", "score", "filter"),
    )
    cm = CostModel(problem, load_cluster("cpu-local", hosts=1))
    plan = {"g": NodePlacement((0,), one), "score": NodePlacement((1,), one), "t": NodePlacement((1,), one)}
    timeline = simulate(cm, plan)
    ev = {(e.iteration, e.node, e.kind): e for e in timeline.events}
    its = len(timeline.iteration_ends)
    for k in range(its - 1):
        assert ev[(k + 1, "g", "node")].start_s >= ev[(k, "score", "node")].end_s - 1e-12
        assert ev[(k, "actor", "reallocation")].start_s >= ev[(k + 1, "score", "node")].end_s - 1e-12
    assert ev[(1, "g", "node")].start_s < ev[(0, "t", "node")].end_s  # the stage of 1 overlaps training 0


def test_the_problem_of_a_graph_names_its_round_side() -> None:
    problem = problem_from_graph(_graph(), prompt_len=8, mean_new_tokens=2)
    assert problem.round_side == ("actor_gen", "accuracy", "dynamic_sampling")
