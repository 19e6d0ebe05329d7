"""Example graph files validate against the contract's catalogue; the Python API validates the same way."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest

from rlflow.dataflow import (
    DataSpec,
    GeneratorSpec,
    Graph,
    GraphError,
    GraphSpec,
    Layout,
    ModelSpec,
    NodePlacement,
    NodeSpec,
    PlanError,
    load_graph,
    loads_graph,
)
from rlflow.dataflow.plan_spec import parse_devices
from rlflow.dataflow.registry import NODE_FUNCTIONS, NodeFunction, Registry, load_builtin_functions
from tests.conftest import ARG_INPUTS, CATALOGUE, GROUP_WISE

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))
NAMES = [
    "cispo",
    "dapo",
    "dapo_overlong",
    "dpo",
    "dr_grpo",
    "grpo",
    "grpo_decoupled",
    "ppo",
    "reinforce_pp",
    "remax",
    "reward_model",
    "rloo",
    "sapo",
    "sft",
]


def test_every_algorithm_has_an_example() -> None:
    assert [p.stem for p in EXAMPLES] == NAMES


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_without_warnings(path: Path, catalogue_registry: Registry[NodeFunction]) -> None:
    text = path.read_text()
    header = text.split("\n", 1)[0]
    assert header.startswith("# ") and "Source" in text.split("models:", 1)[0], "comment header with source"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = load_graph(path, registry=catalogue_registry)
    for name in g.nodes:
        spec = g.node(name)
        if spec.model is not None:
            m = g.spec.models[spec.model]
            cfg = m.config or g.spec.models[m.init_from or ""].config
            assert cfg is not None and cfg["model_type"] == "llama" and cfg["hidden_size"] == 64
            assert cfg["vocab_size"] == 19  # examples/arith/tokenizer: 4 specials + 15 characters
    if "generator" in text:
        assert g.spec.data.generator is not None and g.spec.data.generator.name == "arith"
    else:
        assert g.spec.data.train is not None and Path(g.spec.data.train).exists()


def test_ppo_shape(catalogue_registry: Registry[NodeFunction]) -> None:
    g = load_graph("examples/ppo.yaml", registry=catalogue_registry)
    order = g.execution_order()
    assert order[0] == "actor_gen" and set(order[-2:]) == {"actor_train", "critic_train"}
    assert {(u, v) for u, v, _ in g.edges("version")} == {
        ("actor_train", "actor_gen"),
        ("critic_train", "critic_values"),
    }
    assert g.edges("order") == []  # every other call already feeds its model's train node
    assert g.node("actor_train").args["kl_coef"] == pytest.approx(0.05)  # ${algorithm.kl_coef}


def test_grpo_decoupled_shows_the_proximal_forward(catalogue_registry: Registry[NodeFunction]) -> None:
    # the proximal policy's log-probs come from an ordinary inference node on the trained model, which runs
    # after generation and before the train node in every iteration (the weights actor_train then updates)
    g = load_graph("examples/grpo_decoupled.yaml", registry=catalogue_registry)
    prox = g.node("actor_prox")
    assert (prox.kind, prox.function, prox.model) == ("inference", "logprobs", "actor")
    assert g.producer("prox_logprobs") == "actor_prox" and g.consumers("prox_logprobs") == ["actor_train"]
    assert g.node("actor_train").inputs["prox_logprobs"] == "prox_logprobs"
    assert g.node("actor_train").inputs["logprobs"] == "logprobs"  # π_behav: the sampler's
    assert g.node("actor_train").args["decoupled_loss"] is True
    order = g.execution_order()
    assert order.index("actor_gen") < order.index("actor_prox") < order.index("actor_train")
    assert {(u, v) for u, v, _ in g.edges("version")} == {
        ("actor_train", "actor_gen"),
        ("actor_train", "actor_prox"),
    }


def test_remax_has_two_generations(catalogue_registry: Registry[NodeFunction]) -> None:
    g = load_graph("examples/remax.yaml", registry=catalogue_registry)
    gens = [n for n in g.nodes if g.node(n).kind == "generate"]
    assert gens == ["actor_gen", "actor_greedy"] and g.node("actor_greedy").args["greedy"] is True
    assert g.producer("greedy_scores") == "greedy_reward"


def test_to_yaml_round_trips(catalogue_registry: Registry[NodeFunction]) -> None:
    for path in EXAMPLES:
        g = load_graph(path, registry=catalogue_registry)
        again = loads_graph(g.to_yaml(), source=str(path), registry=catalogue_registry)
        assert again.spec == g.spec


def test_builtin_functions_match_catalogue() -> None:
    """The builtins nodes/functions/ registers declare the contract's signatures."""
    load_builtin_functions()
    for name, (kind, inputs, outputs, heads, needs_model) in CATALOGUE.items():
        fn = NODE_FUNCTIONS.get(name)
        assert (fn.kind, fn.inputs, fn.outputs, fn.heads, fn.needs_model) == (
            kind,
            inputs,
            outputs,
            heads,
            needs_model,
        ), name
        assert fn.group_wise == GROUP_WISE.get(name), name
        assert fn.arg_inputs == ARG_INPUTS.get(name, ()), name
    for path in EXAMPLES:
        load_graph(path)  # the examples validate against the real registry too


def _python_spec(**node_changes: object) -> GraphSpec:
    actor = ModelSpec("actor", config={"model_type": "llama"}, tokenizer="examples/arith/tokenizer")
    data = DataSpec(
        generator=GeneratorSpec("arith"),
        fields={"prompt": "question", "answer": "answer"},
        tokenize=("prompt",),
        tokenizer="actor",
    )
    gen = NodeSpec(
        "gen", "generate", "generate", model="actor", inputs=("prompt_ids", "prompt_mask"),
        outputs=("response_ids", "response_mask", "logprobs"), batch_size=4,
    )  # fmt: skip
    reward = NodeSpec(
        "reward", "inference", "rule_reward", inputs=("response_ids", "response_mask", "answer"),
        outputs=("scores",), batch_size=4,
    )  # fmt: skip
    train = NodeSpec(
        "train", "train", "reinforce_pp_actor", model="actor",
        inputs={"prompt_ids": "prompt_ids", "prompt_mask": "prompt_mask", "response_ids": "response_ids",
                "response_mask": "response_mask", "logprobs": "logprobs", "ref_logprobs": "logprobs",
                "scores": "scores"},
        **{"batch_size": 4, **node_changes},  # type: ignore[arg-type]
    )  # fmt: skip
    return GraphSpec(models={"actor": actor}, nodes={"gen": gen, "reward": reward, "train": train}, data=data)


def test_python_api_same_validation(catalogue_registry: Registry[NodeFunction]) -> None:
    g = Graph.from_spec(_python_spec(), catalogue_registry)
    assert g.execution_order() == ["gen", "reward", "train"]
    assert g.node("gen").inputs == {"prompt_ids": "prompt_ids", "prompt_mask": "prompt_mask"}
    with pytest.raises(GraphError, match=r"nodes\.train\.mini_batches: 4 rows do not divide into 3"):
        Graph.from_spec(_python_spec(mini_batches=3), catalogue_registry)
    with pytest.raises(GraphError, match=r"nodes\.train\.batch_size: expected an integer, got 'eight'"):
        _python_spec(batch_size="eight")
    spec = _python_spec()
    placed = dataclasses.replace(
        spec, plan={n: NodePlacement((0, 1), Layout(dp=2, micro_batches=4)) for n in spec.nodes}
    )
    with pytest.raises(PlanError, match=r"device 1 does not exist; run\.devices is 1"):
        Graph.from_spec(placed, catalogue_registry)


def test_layout_and_devices_parsing() -> None:
    assert Layout.parse("d2t2p1m4") == Layout(2, 2, 1, 4)
    assert str(Layout.parse("t4d2")) == "d2t4p1m1"
    assert Layout.parse(str(Layout(3, 1, 2, 5))) == Layout(3, 1, 2, 5)
    assert Layout(2, 2, 2).size == 8
    for bad in ("", "d2d2", "x1", "d0", "d-1", "2d"):
        with pytest.raises(PlanError):
            Layout.parse(bad)
    assert parse_devices("0-3") == (0, 1, 2, 3)
    assert parse_devices("0-1,4-5") == (0, 1, 4, 5)
    assert parse_devices([3, 1]) == (3, 1) and parse_devices(2) == (2,)
    for bad in ("3-1", "a", "0-99999999999", True, [0, 0], -1, 1.5):
        with pytest.raises(PlanError):
            parse_devices(bad)
    with pytest.raises(PlanError, match="needs dp×tp×pp = 1×2×1 = 2 devices but the mesh has 3"):
        NodePlacement((0, 1, 2), Layout(tp=2))
