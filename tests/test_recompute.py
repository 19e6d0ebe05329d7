"""Activation recomputation (``recompute`` on a train node, or the plan's choice for ``recompute: auto``):
the same step as without it, layers really recomputed, the option validated and priced."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from rlflow.dataflow.errors import GraphError, ModelError, PlanError
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.nodes.train import recompute_activations
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import dump_plan, load_plan
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.runtime.controller import Controller
from tests.graph_helpers import base, dump, put
from tests.harness import CheckpointSpy

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["run.checkpoint_interval=0", "run.eval_interval=0", "run.iterations=1"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


def _sft(tmp: Path, *overrides: str) -> tuple[float, dict[str, torch.Tensor]]:
    graph = resolve_plan(load_graph("examples/sft.yaml", [f"run.output_dir={tmp}", *SMALL, *overrides]), None)
    c = Controller(graph)
    loss = c.run().metrics["actor/nll"]
    weights = {k: v.detach().clone() for k, v in c.executor.models["actor"].module.state_dict().items()}
    return loss, weights


def test_recomputed_step_equals_the_plain_one_through_the_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain_loss, plain = _sft(tmp_path / "plain")
    spy = CheckpointSpy(monkeypatch)
    loss, weights = _sft(tmp_path / "redo", "nodes.actor_train.recompute=true")
    layers = load_graph("examples/sft.yaml").spec.models["actor"].config["num_hidden_layers"]
    # every decoder layer of every micro-batch forward went through the checkpoint (m = 1 here)
    assert spy.calls >= layers and spy.calls % layers == 0
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    for k in plain:
        torch.testing.assert_close(weights[k], plain[k], rtol=0, atol=1e-6)


def test_the_plan_turns_recompute_on_for_an_auto_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = CheckpointSpy(monkeypatch)
    plan = "plan={actor_train: {devices: '0', layout: d1t1p1m1, recompute: true}}"
    _sft(tmp_path / "auto", "nodes.actor_train.recompute=auto", plan)
    assert spy.calls > 0
    spy.calls = 0
    _sft(tmp_path / "auto-off", "nodes.actor_train.recompute=auto")  # a plan that names none: off
    assert spy.calls == 0


def test_layers_are_restored_and_a_model_without_layers_is_refused() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=50)  # fmt: skip
    model = LlamaForCausalLM(config)
    with recompute_activations(model) as wrapped:
        assert wrapped == 2 and all("forward" in layer.__dict__ for layer in model.model.layers)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    with (
        pytest.raises(ModelError, match="recompute: Linear has no decoder layer"),
        recompute_activations(torch.nn.Linear(2, 2)),
    ):
        pass


@pytest.mark.parametrize(
    ("path", "value", "match"),
    [
        ("nodes.train.recompute", "yes", r"nodes\.train\.recompute: expected true, false or 'auto'"),
        ("nodes.gen.recompute", True, r"nodes\.gen\.recompute: .*this is a generate node"),
        ("nodes.ref.recompute", "auto", r"nodes\.ref\.recompute: .*this is an inference node"),
    ],
)
def test_bad_recompute_names_the_key(path: str, value: object, match: str) -> None:
    with pytest.raises(GraphError, match=match):
        loads_graph(dump(put(base(), path, value)), source="g.yaml")


def _base() -> dict[str, object]:
    return put(base(), "nodes.train.args", {})


def test_a_plan_may_choose_recompute_only_where_the_graph_leaves_it() -> None:
    one = {"devices": "0", "layout": "d1t1p1m1"}
    plan = {"gen": one, "ref": one, "train": {**one, "recompute": True}}
    left_out = put(put(_base(), "run.devices", 1), "plan", plan)
    assert loads_graph(dump(left_out), source="g.yaml").run_node("train").recompute is True
    raw = put(left_out, "nodes.train.recompute", False)  # pinned
    expected = (
        r"g\.yaml: plan\.train\.recompute: true but nodes\.train\.recompute is false; a plan chooses "
        r"recomputation only where the graph leaves nodes\.train\.recompute out \(or 'auto'\)"
    )
    with pytest.raises(PlanError, match=expected):
        loads_graph(dump(raw), source="g.yaml")
    same = put(raw, "plan.train.recompute", False)  # restating the node's own setting is no conflict
    assert loads_graph(dump(same), source="g.yaml").run_node("train").recompute is False
    raw = put(raw, "plan.train.recompute", "on")
    with pytest.raises(PlanError, match=r"plan\.train\.recompute: expected true or false"):
        loads_graph(dump(raw), source="g.yaml")
    ok = put(put(raw, "plan.train.recompute", True), "nodes.train.recompute", "auto")
    assert loads_graph(dump(ok), source="g.yaml").run_node("train").recompute is True


def test_plan_files_keep_the_choice(tmp_path: Path) -> None:
    plan = {"train": NodePlacement((0, 1), Layout(2, 1, 1, 1), recompute=True)}
    path = tmp_path / "plan.yaml"
    path.write_text(dump_plan(plan))
    assert "recompute: true" in path.read_text() and load_plan(path) == plan
    assert yaml.safe_load(path.read_text())["train"]["recompute"] is True


def test_recompute_is_priced_and_chosen_where_memory_needs_it() -> None:
    """Recompute costs one more forward (4 passes instead of 3, Korthikanti et al. 2022) and keeps only each
    layer's input; on an H100 host a 7B-shaped train node that does not fit without it gets it from the
    search, and the plan says so."""
    raw = put(_base(), "nodes.train.recompute", "auto")
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
           "max_position_embeddings": 8192}  # fmt: skip
    raw = put(raw, "models.actor.config", cfg)
    raw = put(raw, "models.actor.dtype", "bfloat16")
    raw = put(raw, "models.ref.dtype", "bfloat16")
    raw = put(put(raw, "algorithm.prompts", 64), "nodes.train.batch_size", 64)
    raw = put(put(raw, "nodes.ref.batch_size", 64), "nodes.reward.batch_size", 128)
    raw = put(raw, "nodes.gen.args.max_new_tokens", 4096)
    graph = loads_graph(dump(raw), source="g.yaml")
    problem = problem_from_graph(graph, prompt_len=512, device_type="cuda")
    cluster = load_cluster("h100-8x")
    cost = CostModel(problem, cluster)
    node = problem.node("train")
    at = Layout(8, 1, 1, 1)
    plain = cost.node_cost(node, NodePlacement(tuple(range(8)), at, recompute=False))
    redo = cost.node_cost(node, NodePlacement(tuple(range(8)), at, recompute=True))
    searcher = Searcher(problem, cluster)
    # one micro-batch of 8 rows × 4.6 k tokens: its activations fit only when recomputed
    assert plain.memory.peak > searcher.capacity >= redo.memory.peak and redo.time_s > plain.time_s
    options = {p.recompute for p in searcher.placements(node, tuple(range(8))) if p.layout == at}
    assert options == {False, True}
    result = searcher.search(seed=0, restarts=1, steps=100, time_budget_s=10)
    assert result.plan["train"].recompute is not None  # the search made the choice, and the plan says it


@pytest.mark.slow
def test_recompute_inside_pipeline_stages_gives_the_one_process_step(tmp_path: Path) -> None:
    """Two pipeline stages on two worker processes (1F1B over 2 micro-batches), each recomputing its own
    decoder layers: the same loss and weights as one process without recomputation."""
    plain_loss, plain = _sft(tmp_path / "one")
    plan = "plan={actor_train: {devices: 0-1, layout: d1t1p2m2}}"
    loss, weights = _sft(tmp_path / "pp2", "run.devices=2", "nodes.actor_train.recompute=true", plan)
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    for k in plain:
        torch.testing.assert_close(weights[k], plain[k], rtol=0, atol=1e-6)
