"""``reshard: false`` on a data-parallel (FSDP2) train node: the FSDP2 units stay gathered through each
optimizer step and reduce-scatter once per step — the same step as ``reshard: true`` (losses and weights),
a single all-gather and reduce-scatter per unit per step (counted), the option validated, planned and
priced as executed."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.schedulers.planner.auto import format_plan_table
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.decisions import node_decisions
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.memory_cost import GRAD_BYTES, OPTIM_BYTES
from rlflow.schedulers.planner.plans import dump_plan, load_plan
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.runtime.controller import Controller
from rlflow.schedulers.runtime.distributed.launch import run_group
from tests.graph_helpers import base, dump, put
from tests.test_dist_layouts import CONFIG, _batch, _ctx, _full_state

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["run.checkpoint_interval=0", "run.eval_interval=0", "run.iterations=1"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


# -- the runtime's hooks on 2 processes, collectives counted --------------------------------------------


def _count_collectives() -> dict[str, int]:
    """Counts FSDP2's per-unit collectives in this process: one ``foreach_all_gather`` (all-gather) and one
    ``foreach_reduce`` (reduce-scatter) per FSDP unit each time it gathers or reduces."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod

    counts = {"all_gather": 0, "reduce_scatter": 0}
    gather, reduce = group_mod.foreach_all_gather, group_mod.foreach_reduce

    def counted_gather(*args: Any, **kwargs: Any) -> Any:
        counts["all_gather"] += 1
        return gather(*args, **kwargs)

    def counted_reduce(*args: Any, **kwargs: Any) -> Any:
        counts["reduce_scatter"] += 1
        return reduce(*args, **kwargs)

    group_mod.foreach_all_gather = counted_gather  # type: ignore[assignment]
    group_mod.foreach_reduce = counted_reduce  # type: ignore[assignment]
    return counts


def _hooks_worker(rank: int, world: int) -> dict[str, Any]:
    """dp = 2: SFT and PPO (its first pass) over 2 mini-batches × 2 micro-batches, with the runtime's
    :class:`DataParallelHooks` at ``reshard`` true and false; losses, weights and collectives per step."""
    from rlflow.nodes.functions.policy import ppo_actor
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks
    from rlflow.schedulers.runtime.distributed.rows import shard_rows

    torch.manual_seed(0)
    counts = _count_collectives()
    lm = build_model(config=CONFIG, seed=1)
    batch = _batch(8)
    cache = GroupCache(timeout_s=60)
    spec = MeshSpec.of(range(2), Layout(2, 1, 1, 1))
    mesh = cache.mesh(spec)
    dp_rank, _ = spec.coords(rank)
    out: dict[str, Any] = {}
    for name, fn, args in (("sft", sft_node, {}), ("ppo_actor", ppo_actor, {"whiten_advantages": True})):
        node = NodeSpec(name=name, kind="train", function=name, model="m", mini_batches=2)
        rows = batch.index(shard_rows(len(batch), 2, node.mini_batches)[dp_rank])
        weights: dict[bool, dict[str, torch.Tensor]] = {}
        for reshard in (True, False):
            model = apply_layout(copy.deepcopy(lm), mesh, train=True)
            ctx = _ctx(node, model, "lm", True)
            ctx.micro_batches = 2
            ctx.train_hooks = hooks = train_hooks(model, mesh["dp"].get_group(), 2, reshard=reshard)
            before = dict(counts)
            with hooks:
                metrics = fn(ctx, rows, **args).metrics
            tag = f"{name}/reshard={reshard}"
            out[f"{tag}/metrics"] = metrics
            weights[reshard] = _full_state(model)
            out[f"{tag}/counts"] = {k: counts[k] - before[k] for k in counts}
            out[f"{tag}/units"] = len(hooks.fsdp)
            # after the step every unit is sharded again and gradient sync is back on
            out[f"{tag}/resharded"] = all(
                g.is_sharded and g.reduce_grads
                for m in hooks.fsdp
                for g in m._get_fsdp_state()._fsdp_param_groups
            )
        start = _full_state(lm)
        out[f"{name}/weights_diff"] = max(
            float((weights[False][k] - weights[True][k]).abs().max()) for k in start
        )
        out[f"{name}/moved"] = max(float((weights[True][k] - start[k]).abs().max()) for k in start)
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_reshard_false_gives_the_same_step_with_one_gather_and_scatter_per_step() -> None:
    results = run_group(_hooks_worker, 2, timeout_s=220)
    for r in results:
        for name, first_pass in (("sft", 0), ("ppo_actor", 1)):
            units = r[f"{name}/reshard=True/units"]
            assert units == CONFIG["num_hidden_layers"] + 1  # every decoder layer + the root
            steps, m = 2, 2
            # per micro-batch 2 gathers (forward, backward) and 1 reduce-scatter per unit; a first pass
            # gathers every unit once per micro-batch (forward only) either way
            assert r[f"{name}/reshard=True/counts"] == {
                "all_gather": units * (steps * m * 2 + first_pass * m),
                "reduce_scatter": units * steps * m,
            }
            assert r[f"{name}/reshard=False/counts"] == {
                "all_gather": units * (steps + first_pass * m),
                "reduce_scatter": units * steps,
            }
            assert r[f"{name}/reshard=True/resharded"] and r[f"{name}/reshard=False/resharded"]
            a, b = r[f"{name}/reshard=True/metrics"], r[f"{name}/reshard=False/metrics"]
            assert a.keys() == b.keys()
            for k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-7), k
            assert r[f"{name}/weights_diff"] < 1e-6 and r[f"{name}/moved"] > 1e-4


# -- through the runtime: the controller and 2 worker processes -----------------------------------------


def _run(graph: Any) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    c = Controller(graph)
    ex = c.executor
    try:
        metrics = c.run().metrics
        weights = ex.fetch("actor", ex.view.node_instance["actor_train"])
    finally:
        ex.close(force=True)
    return metrics, weights


def _same_step(a: tuple[dict[str, float], dict[str, torch.Tensor]], b: Any, keys: tuple[str, ...]) -> None:
    for k in keys:
        assert b[0][k] == pytest.approx(a[0][k], rel=1e-6, abs=1e-7), k
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        torch.testing.assert_close(b[1][k], a[1][k], rtol=0, atol=1e-6)


_SPY = """
import os

from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod


def _wrap(name, what):
    real = getattr(group_mod, name)

    def counted(*args, **kwargs):
        with open(os.environ["RESHARD_SPY_LOG"], "a") as log:
            log.write(f"{os.getpid()} {what}\\n")
        return real(*args, **kwargs)

    setattr(group_mod, name, counted)


_wrap("foreach_all_gather", "all_gather")
_wrap("foreach_reduce", "reduce_scatter")
"""


def _worker_spy(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``sitecustomize`` on the spawned workers' path that logs every FSDP2 unit collective they issue
    (pid and kind, one line each) to the returned file."""
    spy = tmp / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(_SPY)
    log = tmp / "collectives.log"
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(spy), os.environ.get("PYTHONPATH")) if p)
    )
    monkeypatch.setenv("RESHARD_SPY_LOG", str(log))
    # a sitecustomize runs when an interpreter starts: a worker forked from the fork server starts none
    monkeypatch.setenv("RLFLOW_WORKER_START", "spawn")
    return log


def _per_worker(log: Path) -> list[dict[str, int]]:
    counts: dict[str, dict[str, int]] = {}
    for line in log.read_text().splitlines() if log.exists() else []:
        pid, what = line.split()
        counts.setdefault(pid, {"all_gather": 0, "reduce_scatter": 0})[what] += 1
    return list(counts.values())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["d2t1p1m2", "d2t1p2m2"])
def test_sft_on_workers_plan_chosen_reshard_false_equals_reshard_true(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SFT with 2 mini-batches × 2 micro-batches per dp rank at dp = 2 on gloo workers (2; 4 for two 1F1B
    pipeline stages): ``reshard: auto`` with a plan that chooses ``false`` trains to the same loss and
    weights as the default, and every worker issued one all-gather and one reduce-scatter per FSDP2 unit
    (its stage's decoder layers and its root) per optimizer step instead of two and one per micro-batch
    (counted in the worker processes)."""
    lay = Layout.parse(layout)

    def graph(out: str, *extra: str) -> Any:
        plan = (
            f"plan={{actor_train: {{devices: 0-{lay.size - 1}, layout: {layout}"
            + "".join(f", {e}" for e in extra)
            + "}}"
        )
        overrides = [f"run.output_dir={tmp_path / out}", *SMALL, f"run.devices={lay.size}", plan]
        if extra:
            overrides.append("nodes.actor_train.reshard=auto")
        return load_graph("examples/sft.yaml", overrides)

    auto = graph("off", "reshard: false")
    assert auto.run_node("actor_train").reshard is False and auto.spec.plan["actor_train"].reshard is False
    log = _worker_spy(tmp_path, monkeypatch)
    plain = _run(graph("on"))
    on = _per_worker(log)
    log.unlink()
    _same_step(plain, _run(auto), ("actor/nll", "actor/grad_norm"))
    off = _per_worker(log)
    units, steps, m = CONFIG["num_hidden_layers"] // lay.pp + 1, 2, 2  # sft.yaml's actor has 2 layers too
    assert on == [{"all_gather": units * steps * m * 2, "reduce_scatter": units * steps * m}] * lay.size
    assert off == [{"all_gather": units * steps, "reduce_scatter": units * steps}] * lay.size


PLAN_DP2 = """
plan:
  actor_gen: {devices: 0-1, layout: d2t1p1m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1m1}
  critic_values: {devices: 0-1, layout: d2t1p1m1}
  actor_train: {devices: 0-1, layout: d2t1p1m2}
  critic_train: {devices: 0-1, layout: d2t1p1m2}
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ppo_on_two_workers_reshard_false_equals_reshard_true(tmp_path: Path) -> None:
    """PPO (the actor's no-grad first pass, then 2 mini-batches × 2 micro-batches per rank) with both train
    nodes at dp = 2 on 2 gloo workers: ``reshard: false`` on both gives the default's losses and weights."""
    from tests.test_dist_executor import COMMON

    def graph(out: str, *extra: str) -> Any:
        text = (ROOT / "examples/ppo.yaml").read_text() + PLAN_DP2
        overrides = ["run.devices=2", *COMMON, "run.iterations=1", f"run.output_dir={tmp_path / out}", *extra]
        return loads_graph(text, "examples/ppo.yaml", overrides)

    off = graph("off", "nodes.actor_train.reshard=false", "nodes.critic_train.reshard=false")
    problem = problem_from_graph(off)
    assert problem.node("actor_train").first_pass and problem.node("actor_train").reshard is False
    keys = ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
    _same_step(_run(graph("on")), _run(off), keys)


# -- the planner ---------------------------------------------------------------------------------------


def _cost(reshard: bool, first_pass: bool = False, layout: Layout | None = None) -> Any:
    from tests.test_cost_zero import SHAPE, cluster

    node = PlanNode(
        "n", "m", "train", 8, 4, 4, epochs=1, mini_batches=2, first_pass=first_pass, reshard="auto"
    )
    cm = CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster())  # type: ignore[arg-type]
    layout = layout or Layout(2, 1, 1, 2)
    return cm.node_cost("n", NodePlacement(tuple(range(layout.size)), layout, reshard=reshard))


def test_reshard_false_dp_comm_and_memory_golden() -> None:
    """tests/test_cost_zero.py's model and links: Ψ = 1448 parameters (a layer 592), bf16, 3 FSDP2 units
    (2 layers + root); all-gather = reduce-scatter of the units = 3·0.1 + 0.5·2896/1000 = 1.748 s; per step
    2 all-reduces of 8 B = 0.416 s. d2, 2 micro-batches, 2 steps (mini-batches)."""
    # true: 2 gathers + 1 scatter per micro-batch, 4 micro-batches: 4·5.244 + 2·0.416 = 21.808
    assert _cost(True).dp_comm_s == pytest.approx(21.808)
    # false: 1 gather + 1 scatter per step: 2·3.496 + 2·0.416 = 7.824 (ZeRO-1's, test_cost_zero)
    assert _cost(False).dp_comm_s == pytest.approx(7.824)
    # a first pass gathers every unit per micro-batch either way: + 2·1.748
    assert _cost(False, first_pass=True).dp_comm_s == pytest.approx(7.824 + 3.496)
    assert _cost(True, first_pass=True).dp_comm_s == pytest.approx(21.808 + 3.496)
    # memory, Ψ = 1448, d = 2: shard of the weights 2Ψ/2 = 1448, gradients 2Ψ/2 = 1448, Adam 12Ψ/2 = 8688;
    # true adds the current and the prefetched layer, 2·592·2 = 2368; false holds the stage's full weights
    # and gradients through the step instead, Ψ·(2 + 2) = 5792 (transient)
    on, off = _cost(True).memory, _cost(False).memory
    assert (on.weights, on.grads, on.optimizer, on.gathered) == (1448 + 2368, 1448, 8688, 0)
    assert (off.weights, off.grads, off.optimizer, off.gathered) == (1448, 1448, 8688, 1448 * (2 + 2))
    assert off.peak - on.peak == pytest.approx(5792 - 2368) and off.transient == off.activations + 5792
    assert GRAD_BYTES == 2 and OPTIM_BYTES == 12
    # compute, tensor-parallel comm and the optimizer step are the same; at dp = 1 nothing changes
    assert (off.activations, _cost(False).compute_s) == (on.activations, _cost(True).compute_s)
    one = Layout(1, 1, 1, 2)
    assert _cost(False, layout=one) == _cost(True, layout=one)


def _big_graph(layers: int, hidden: int, intermediate: int) -> Any:
    raw = put(put(base(), "nodes.train.args", {}), "nodes.train.reshard", "auto")
    # recompute and the engine pinned: resharding is the decision these tests search
    raw = put(put(raw, "nodes.train.recompute", False), "nodes.gen.engine", "builtin")
    cfg = {"model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
           "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 32000, "max_position_embeddings": 8192}  # fmt: skip
    raw = put(raw, "models.actor.config", cfg)
    raw = put(put(raw, "models.actor.dtype", "bfloat16"), "models.ref.dtype", "bfloat16")
    raw = put(put(raw, "algorithm.prompts", 64), "nodes.train.batch_size", 64)
    raw = put(put(raw, "nodes.ref.batch_size", 64), "nodes.reward.batch_size", 128)
    raw = put(put(raw, "nodes.train.mini_batches", 4), "nodes.gen.args.max_new_tokens", 512)
    return loads_graph(dump(raw), source="g.yaml")


def test_the_search_keeps_units_gathered_where_it_is_faster_and_fits() -> None:
    """An 8B-shaped (Llama-3.1-8B: 32 layers, hidden 4096, GQA 8) GRPO trainer with ``reshard: auto`` on an
    H100 host: at d8 keeping the units gathered is faster (one gather and scatter per step) and fits, the
    search chooses it and the plan and its table say so. A 48-layer, hidden-6144 model's full weights and
    gradients do not fit a device: only ``reshard: true`` placements remain at d8."""
    cluster = load_cluster("h100-8x")
    problem = problem_from_graph(_big_graph(32, 4096, 14336), prompt_len=256, device_type="cuda")
    searcher = Searcher(problem, cluster)
    node, mesh = problem.node("train"), tuple(range(8))
    for m in (1, 4):
        on, off = (
            searcher.cost.node_cost(node, NodePlacement(mesh, Layout(8, 1, 1, m), reshard=r))
            for r in (True, False)
        )
        assert off.dp_comm_s < on.dp_comm_s and off.time_s < on.time_s
        assert on.memory.peak < off.memory.peak <= searcher.capacity
    assert {p.reshard for p in searcher.placements(node, mesh) if p.layout.dp > 1} == {True, False}
    assert {p.reshard for p in searcher.placements(node, mesh) if p.layout.dp == 1} == {None}
    result = searcher.search(seed=0, restarts=1, steps=100, time_budget_s=20)
    chosen = result.plan["train"]
    assert chosen.layout.dp > 1 and chosen.reshard is False
    row = next(
        line for line in format_plan_table(searcher, result.plan).splitlines() if line.startswith("train")
    )
    # the table's last two columns: searched (`auto`), pinned (written in the graph)
    assert "no reshard" in row and row.endswith("micro_batches, reshard  recompute")
    marks = node_decisions(problem.node("train"), chosen)
    assert marks == {"micro_batches": "searched", "recompute": "pinned", "reshard": "searched"}
    text = dump_plan(result.plan)
    assert "reshard: false" in text

    big = problem_from_graph(_big_graph(48, 6144, 16384), prompt_len=256, device_type="cuda")
    searcher = Searcher(big, cluster)
    node = big.node("train")
    fits = [
        p for p in searcher.placements(node, mesh)
        if p.layout.dp == 8 and searcher.cost.node_cost(node, p).memory.peak <= searcher.capacity
    ]  # fmt: skip
    assert fits and {p.reshard for p in fits} == {True}


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("nodes.train.reshard", "no", r"g\.yaml: nodes\.train\.reshard: expected true, false or 'auto'"),
        ("nodes.gen.reshard", False, r"nodes\.gen\.reshard: .*this is a generate node"),
        ("nodes.ref.reshard", "auto", r"nodes\.ref\.reshard: .*this is an inference node"),
    ],
)
def test_bad_reshard_names_the_key(path: str, value: object, match: str) -> None:
    with pytest.raises(GraphError, match=match):
        loads_graph(dump(put(base(), path, value)), source="g.yaml")


def test_reshard_is_refused_with_deepspeed() -> None:
    raw = put(put(base(), "nodes.train.engine", "deepspeed"), "nodes.train.reshard", False)
    with pytest.raises(GraphError, match=r"g\.yaml: nodes\.train\.reshard: applies to FSDP2 train nodes; "
                       r"with 'engine: deepspeed' the ZeRO stage decides"):  # fmt: skip
        loads_graph(dump(raw), source="g.yaml")
    with pytest.raises(PlanError, match="reshard applies to FSDP2 train nodes only"):
        PlanNode("n", "m", "inference", 8, 4, 4, reshard=False)


def _with(raw: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A copy of ``raw`` with ``path`` set (``put`` changes its argument)."""
    return put(copy.deepcopy(raw), path, value)


def test_a_plan_may_choose_reshard_only_where_the_graph_leaves_it() -> None:
    two = {"devices": "0-1", "layout": "d2t1p1m1"}
    plan = {"gen": dict(two), "ref": dict(two), "train": {**two, "reshard": False}}
    left_out = put(put(put(base(), "nodes.train.args", {}), "run.devices", 2), "plan", plan)
    assert loads_graph(dump(left_out), source="g.yaml").run_node("train").reshard is False
    raw = _with(left_out, "nodes.train.reshard", True)  # pinned
    expected = (
        r"g\.yaml: plan\.train\.reshard: false but nodes\.train\.reshard is true; a plan chooses resharding "
        r"only where the graph leaves nodes\.train\.reshard out \(or 'auto'\)"
    )
    with pytest.raises(PlanError, match=expected):
        loads_graph(dump(raw), source="g.yaml")
    same = _with(raw, "plan.train.reshard", True)  # restating the node's own setting is no conflict
    assert loads_graph(dump(same), source="g.yaml").run_node("train").reshard is True
    with pytest.raises(PlanError, match=r"g\.yaml: plan\.train\.reshard: expected true or false, got 'off'"):
        loads_graph(dump(_with(raw, "plan.train.reshard", "off")), source="g.yaml")
    with pytest.raises(PlanError, match=r"plan\.ref\.reshard: false, but only a train node has reshard; "
                       r"'ref' is an inference node"):  # fmt: skip
        loads_graph(dump(_with(same, "plan.ref.reshard", False)), source="g.yaml")
    auto = _with(raw, "nodes.train.reshard", "auto")
    graph = loads_graph(dump(auto), source="g.yaml")
    assert graph.run_node("train").reshard is False and graph.reshard("train") is False
    assert (
        loads_graph(dump(_with(auto, "plan.train", two)), source="g.yaml").run_node("train").reshard is True
    )
    # the node's own false runs without a plan choice, and the graph file keeps it
    own = loads_graph(
        dump(put(_with(same, "plan.train", two), "nodes.train.reshard", False)), source="g.yaml"
    )
    assert own.run_node("train").reshard is False
    assert own.spec.to_dict()["nodes"]["train"]["reshard"] is False
    assert "reshard" not in loads_graph(dump(left_out), source="g.yaml").spec.to_dict()["nodes"]["train"]


@pytest.mark.filterwarnings("ignore:.*no node reads it")  # the written file resolved ${algorithm.n}
def test_plan_files_keep_the_choice(tmp_path: Path) -> None:
    plan = {"train": NodePlacement((0, 1), Layout(2, 1, 1, 2), reshard=False), "gen": NodePlacement((0,))}
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(plan))
    assert "reshard: false" in path.read_text() and load_plan(path) == plan
    assert yaml.safe_load(path.read_text())["train"]["reshard"] is False
    path.write_text("train: {devices: 0-1, layout: d2t1p1m1, reshard: 1}\n")
    with pytest.raises(PlanError, match=r"plan\.yaml: plan\.train\.reshard: expected true or false, got 1"):
        load_plan(path)
    # a graph's plan written back (GraphSpec.to_dict) keeps it too
    raw = put(put(put(base(), "nodes.train.args", {}), "run.devices", 2), "nodes.train.reshard", "auto")
    two = {"devices": "0-1", "layout": "d2t1p1m1"}
    raw = put(raw, "plan", {"gen": dict(two), "ref": dict(two), "train": {**two, "reshard": False}})
    written = loads_graph(dump(raw), source="g.yaml").spec.to_dict()
    assert written["plan"]["train"]["reshard"] is False
    assert loads_graph(dump(written), source="g2.yaml").spec.plan["train"].reshard is False
