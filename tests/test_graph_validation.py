"""Graph validation: every mistake the issue lists raises GraphError/PlanError naming file, node and key."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest

from rlflow.dataflow import GraphError, GraphWarning, PlanError, loads_graph
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.dataflow.registry import NodeFunction, Registry
from tests.graph_helpers import DELETE, SEQ, base, dump, put


def load(raw: dict[str, Any], reg: Registry[NodeFunction], overrides: tuple[str, ...] = ()) -> Graph:
    return loads_graph(dump(raw), source="g.yaml", overrides=overrides, registry=reg)


def expect(raw: dict[str, Any], reg: Registry[NodeFunction], err: type[Exception], *fragments: str) -> str:
    with pytest.raises(err) as info:
        load(raw, reg)
    msg = str(info.value)
    assert msg.startswith("g.yaml: "), msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def mutated(*changes: tuple[str, Any]) -> dict[str, Any]:
    raw = base()
    for path, value in changes:
        put(raw, path, value)
    return raw


def test_base_graph_is_valid(catalogue_registry: Registry[NodeFunction]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = load(base(), catalogue_registry)
    assert g.execution_order() == ["gen", "reward", "ref", "train"]
    assert g.producer("prompt_ids") == "data" and g.producer("ref_logprobs") == "ref"
    assert g.consumers("response_ids") == ["reward", "ref", "train"]
    # gen takes 4 prompts and samples n=2 each: downstream nodes see 4 × 2 = 8 rows.
    assert [g.group_size(n) for n in g.execution_order()] == [2, 2, 2, 2]
    assert g.rows("gen") == 4 and g.rows("reward") == 8 and g.rows("train") == 8
    assert g.prompts("reward") == 4
    assert g.node("ref").outputs == {"logprobs": "ref_logprobs"}
    assert g.node("train").inputs == dict.fromkeys([*SEQ, "logprobs", "ref_logprobs", "scores"], None) | {
        k: k for k in [*SEQ, "logprobs", "ref_logprobs", "scores"]
    }
    assert g.is_per_prompt("answer") and not g.is_per_prompt("scores")
    assert g.placement("gen").devices == (0,) and str(g.placement("gen").layout) == "d1t1p1m1"


def test_data_edges_carry_kind_and_key(catalogue_registry: Registry[NodeFunction]) -> None:
    g = load(base(), catalogue_registry)
    data_edges = {(u, v, d["key"]) for u, v, d in g.dag.edges(data=True) if d["kind"] == "data"}
    assert ("data", "gen", "prompt_ids") in data_edges
    assert ("reward", "train", "scores") in data_edges
    assert ("ref", "train", "ref_logprobs") in data_edges
    assert g.dag.has_edge("gen", "train", "logprobs")  # the multi-edge key is the batch key


def test_version_edges_and_read_before_write(catalogue_registry: Registry[NodeFunction]) -> None:
    raw = base()
    # A second call of the trainable actor that the train node does not depend on: it must read the
    # weights before train overwrites them (order edge) and read train's weights next iteration (version).
    raw["nodes"]["probe"] = {
        "model": "actor", "kind": "inference", "function": "logprobs", "inputs": SEQ,
        "outputs": {"logprobs": "probe_logprobs"}, "batch_size": 4,
    }  # fmt: skip
    with pytest.warns(GraphWarning, match="'probe_logprobs' is produced by node 'probe' but never consumed"):
        g = load(raw, catalogue_registry)
    version = {(u, v) for u, v, _ in g.edges("version")}
    assert version == {("train", "gen"), ("train", "probe")}  # none for the frozen ref
    assert {(u, v) for u, v, _ in g.edges("order")} == {("probe", "train")}
    order = g.execution_order()
    assert order.index("probe") < order.index("train")
    assert all(d["model"] == "actor" for _, _, d in g.edges("version"))


def test_frozen_model_has_no_version_edges(catalogue_registry: Registry[NodeFunction]) -> None:
    g = load(base(), catalogue_registry)
    assert not any(d["model"] == "ref" for _, _, d in g.edges("version"))


def test_ema_model_is_written_by_its_sources_train_node(catalogue_registry: Registry[NodeFunction]) -> None:
    """A reference that follows the actor as an EMA gets the version edge of the actor's train node."""
    g = load(mutated(("models.ref.ema", {"source": "actor", "eta": 0.1})), catalogue_registry)
    assert ("train", "ref", {"kind": "version", "model": "ref"}) in g.edges("version")
    assert g.spec.models["ref"].ema.source == "actor"  # type: ignore[union-attr]
    assert load(dump_back(g), catalogue_registry).spec.models["ref"].ema == g.spec.models["ref"].ema


def dump_back(g: Graph) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(g.to_yaml())  # type: ignore[no-any-return]


CASES: list[tuple[str, list[tuple[str, Any]], type[Exception], list[str]]] = [
    # -- EMA models
    (
        "ema unknown source",
        [("models.ref.ema", {"source": "actr"})],
        GraphError,
        ["models.ref.ema.source", "unknown model 'actr'", "did you mean 'actor'"],
    ),
    (
        "ema eta out of range",
        [("models.ref.ema", {"source": "actor", "eta": 1.5})],
        GraphError,
        ["models.ref.ema.eta", "(0, 1]"],
    ),
    (
        "ema unknown field",
        [("models.ref.ema", {"source": "actor", "decay": 0.9})],
        GraphError,
        ["models.ref.ema", "decay"],
    ),
    (
        "ema of itself",
        [("models.ref.ema", {"source": "ref"})],
        GraphError,
        ["models.ref.ema.source", "cannot follow itself"],
    ),
    (
        "ema model also trained",
        [
            ("models.ref.ema", {"source": "actor"}),
            ("models.ref.trainable", True),
            ("nodes.train.model", "ref"),
        ],
        GraphError,
        ["nodes.train.model", "follows 'actor' as an EMA", "cannot also be trained"],
    ),
    (
        "ema source never trained",
        [("models.ref2", {"init_from": "actor", "ema": {"source": "ref"}})],
        GraphError,
        ["models.ref2.ema.source", "no train node trains 'ref'"],
    ),
    # -- structure
    (
        "cycle",
        [("nodes.gen.inputs", {"prompt_ids": "prompt_ids", "prompt_mask": "scores"})],
        GraphError,
        ["cycle", "gen", "reward", "'scores'", "->"],
    ),
    (
        "self loop",
        [
            ("nodes.ref.outputs", {"logprobs": "ref_logprobs"}),
            ("nodes.ref.inputs", ["prompt_ids", "prompt_mask", "response_ids", "ref_logprobs"]),
        ],
        GraphError,
        ["cycle", "ref -> ref"],
    ),
    (
        "no producer",
        [("nodes.train.inputs", [*SEQ, "logprobs", "ref_logprob", "scores"])],
        GraphError,
        ["nodes.train.inputs.ref_logprobs", "'ref_logprob' has no producer", "did you mean 'ref_logprobs'"],
    ),
    (
        "two producers",
        [("nodes.ref.outputs", ["logprobs"])],
        GraphError,
        ["nodes.ref.outputs.logprobs", "'logprobs' has two producers", "node 'gen'", "node 'ref'"],
    ),
    (
        "data and node produce",
        [("nodes.reward.outputs", ["answer"])],
        GraphError,
        ["'answer' has two producers: the data set and node 'reward'"],
    ),
    (
        "unknown model",
        [("nodes.gen.model", "actr")],
        GraphError,
        ["nodes.gen.model", "unknown model 'actr'", "did you mean 'actor'"],
    ),
    (
        "unknown kind",
        [("nodes.gen.kind", "generat")],
        GraphError,
        ["nodes.gen.kind", "'generat'", "did you mean 'generate'"],
    ),
    (
        "unknown function",
        [("nodes.ref.function", "logprob")],
        GraphError,
        ["nodes.ref.function", "'logprob'", "did you mean 'logprobs'"],
    ),
    (
        "kind mismatch",
        [("nodes.ref.kind", "train")],
        GraphError,
        ["nodes.ref.kind", "function 'logprobs' has kind inference", "node's kind is train"],
    ),
    (
        "too few inputs",
        [("nodes.gen.inputs", ["prompt_ids"])],
        GraphError,
        ["nodes.gen.inputs", "takes 2 inputs (prompt_ids, prompt_mask)", "lists 1"],
    ),
    (
        "too many outputs",
        [("nodes.reward.outputs", ["scores", "extra"])],
        GraphError,
        ["nodes.reward.outputs", "takes 1 output (scores)", "lists 2"],
    ),
    (
        "unknown param",
        [("nodes.ref.inputs", {"prompt_id": "prompt_ids"})],
        GraphError,
        ["nodes.ref.inputs.prompt_id", "has no input 'prompt_id'", "did you mean 'prompt_ids'"],
    ),
    (
        "unbound param",
        [("nodes.ref.inputs", {"prompt_ids": "prompt_ids"})],
        GraphError,
        ["nodes.ref.inputs", "prompt_mask, response_ids, response_mask are not bound"],
    ),
    (
        "function without model given one",
        [("nodes.reward.model", "actor")],
        GraphError,
        ["nodes.reward.model", "runs without a model"],
    ),
    (
        "function needs a model",
        [("nodes.ref.model", DELETE)],
        GraphError,
        ["nodes.ref.model", "runs on a model"],
    ),
    (
        "wrong head",
        [("nodes.ref.function", "values"), ("nodes.ref.outputs", {"values": "ref_logprobs"})],
        GraphError,
        ["nodes.ref.model", "head value", "model 'ref' has head lm"],
    ),
    (
        "train on frozen",
        [("nodes.train.model", "ref")],
        GraphError,
        ["nodes.train.model", "train node on frozen model 'ref'"],
    ),
    (
        "reserved node name",
        [("nodes.data", {"kind": "inference", "function": "logprobs"})],
        GraphError,
        ["nodes.data", "reserved"],
    ),
    # -- models
    (
        "model without weights",
        [("models.actor.config", DELETE)],
        GraphError,
        ["models.actor", "needs 'path'", "or 'config'"],
    ),
    ("model with both", [("models.actor.path", "some/dir")], GraphError, ["models.actor", "not both"]),
    (
        "init_from unknown",
        [("models.ref.init_from", "actr")],
        GraphError,
        ["models.ref.init_from", "unknown model 'actr'", "did you mean 'actor'"],
    ),
    (
        "init_from loop",
        [("models.actor.init_from", "ref")],
        GraphError,
        ["init_from", "actor -> ref -> actor"],
    ),
    (
        "config without model_type",
        [("models.actor.config.model_type", DELETE)],
        GraphError,
        ["models.actor.config", "model_type"],
    ),
    (
        "generate without tokenizer",
        [("models.plain", {"config": {"model_type": "llama"}}), ("nodes.gen.model", "plain")],
        GraphError,
        ["nodes.gen.model", "generate node on model 'plain', which has no tokenizer"],
    ),
    (
        "data tokenizer unknown",
        [("data.tokenizer", "actr")],
        GraphError,
        ["data.tokenizer", "did you mean 'actor'"],
    ),
    (
        "tokenize unknown field",
        [("data.tokenize", ["promt"])],
        GraphError,
        ["data.tokenize", "'promt'", "did you mean 'prompt'"],
    ),
    ("data train and generator", [("data.train", "x.jsonl")], GraphError, ["data", "exactly one"]),
    # -- batch sizes
    (
        "samples not whole groups",
        [("nodes.reward.batch_size", 7)],
        GraphError,
        ["nodes.reward.batch_size", "7 samples is not a whole number of groups of n=2"],
    ),
    (
        "edge disagrees",
        [("nodes.ref.batch_size", 3)],
        GraphError,
        [
            "nodes.ref.batch_size",
            "'gen' (4 prompts)",
            "'ref' (6 rows (3 prompts × 2 samples))",
            "different numbers of prompts per iteration",
        ],
    ),
    (
        "edge disagrees on a node key",
        [("nodes.train.batch_size", 2)],
        GraphError,
        [
            "nodes.train.batch_size",
            "'gen' (4 prompts)",
            "'train' (4 rows (2 prompts × 2 samples))",
            "share key",
        ],
    ),
    (
        "mini-batches do not divide",
        [("nodes.train.mini_batches", 3)],
        GraphError,
        ["nodes.train.mini_batches", "8 rows (4 prompts × 2 samples) do not divide into 3 mini-batches"],
    ),
    (
        "mini-batches split groups",
        [("nodes.train.mini_batches", 8)],
        GraphError,
        ["nodes.train.mini_batches", "would split groups of n=2", "GRPO normalises"],
    ),
    (
        "grpo needs groups",
        [("algorithm.n", 1), ("nodes.reward.batch_size", 4)],
        GraphError,
        ["nodes.train", "needs groups of at least 2", "GRPO"],
    ),
    (
        "rloo needs groups",
        [("algorithm.n", 1), ("nodes.reward.batch_size", 4), ("nodes.train.function", "rloo_actor")],
        GraphError,
        ["nodes.train", "needs groups of at least 2", "RLOO"],
    ),
    (
        "generate n not an int",
        [("nodes.gen.args.n", "four")],
        GraphError,
        ["nodes.gen.args.n", "positive integer", "'four'"],
    ),
    ("epochs on inference", [("nodes.ref.epochs", 2)], GraphError, ["nodes.ref.epochs", "only train nodes"]),
    # -- staleness (asynchronous RL)
    (
        "staleness negative",
        [("nodes.gen.staleness", -1)],
        GraphError,
        ["nodes.gen.staleness: must be >= 0, got -1"],
    ),
    (
        "staleness huge",
        [("nodes.gen.staleness", 10**12)],
        GraphError,
        ["nodes.gen.staleness: must be <= 64", "got 1000000000000"],
    ),
    (
        "staleness fraction",
        [("nodes.gen.staleness", 1.5)],
        GraphError,
        ["nodes.gen.staleness: expected an integer, got 1.5"],
    ),
    (
        "staleness text",
        [("nodes.gen.staleness", "one")],
        GraphError,
        ["nodes.gen.staleness: expected an integer, got 'one'"],
    ),
    (
        "staleness on a train node",
        [("nodes.train.staleness", 1)],
        GraphError,
        ["nodes.train.staleness", "only generate nodes", "this is a train node"],
    ),
    (
        "staleness on an inference node",
        [("nodes.ref.staleness", 2)],
        GraphError,
        ["nodes.ref.staleness", "only generate nodes", "this is an inference node"],
    ),
    # -- types and fields
    (
        "batch_size type",
        [("nodes.gen.batch_size", "eight")],
        GraphError,
        ["nodes.gen.batch_size: expected an integer, got 'eight'"],
    ),
    ("batch_size zero", [("nodes.gen.batch_size", 0)], GraphError, ["nodes.gen.batch_size: must be >= 1"]),
    (
        "float for int",
        [("run.iterations", 2.5)],
        GraphError,
        ["run.iterations: expected an integer, got 2.5"],
    ),
    (
        "bool type",
        [("models.ref.trainable", "maybe")],
        GraphError,
        ["models.ref.trainable: expected true or false"],
    ),
    (
        "lr type",
        [("models.actor.optimizer", {"lr": "fast"})],
        GraphError,
        ["models.actor.optimizer.lr: expected a number, got 'fast'"],
    ),
    (
        "infinite lr",
        [("models.actor.optimizer", {"lr": float("inf")})],
        GraphError,
        ["models.actor.optimizer.lr: must be finite"],
    ),
    (
        "schedule choice",
        [("models.actor.optimizer", {"schedule": "cosin"})],
        GraphError,
        ["models.actor.optimizer.schedule", "did you mean 'cosine'"],
    ),
    (
        "unknown top field",
        [("nodez", {})],
        GraphError,
        ["nodez: unknown field 'nodez'", "did you mean 'nodes'"],
    ),
    (
        "unknown node field",
        [("nodes.gen.batchsize", 4)],
        GraphError,
        ["nodes.gen.batchsize: unknown field", "did you mean 'batch_size'"],
    ),
    (
        "unknown model field",
        [("models.ref.trainble", False)],
        GraphError,
        ["models.ref.trainble", "did you mean 'trainable'"],
    ),
    (
        "unknown optimizer field",
        [("models.actor.optimizer", {"weight_decy": 0.1})],
        GraphError,
        ["models.actor.optimizer.weight_decy", "did you mean 'weight_decay'"],
    ),
    ("unknown data field", [("data.feilds", {})], GraphError, ["data.feilds", "did you mean 'fields'"]),
    ("unknown run field", [("run.iteratons", 3)], GraphError, ["run.iteratons", "did you mean 'iterations'"]),
    ("missing section", [("nodes", DELETE)], GraphError, ["missing required field 'nodes'"]),
    (
        "missing node field",
        [("nodes.gen.function", DELETE)],
        GraphError,
        ["nodes.gen: missing required field 'function'"],
    ),
    ("section not a mapping", [("models", [1, 2])], GraphError, ["models: expected a mapping"]),
    (
        "unresolvable interpolation",
        [("nodes.gen.args.n", "${algorithm.nn}")],
        GraphError,
        ["nodes.gen.args.n", "${algorithm.nn}"],
    ),
    (
        "run.eval model unknown",
        [("run.eval", {"model": "actr"})],
        GraphError,
        ["run.eval.model", "did you mean 'actor'"],
    ),
    # -- plan
    (
        "plan device out of range",
        [("plan", {"gen": {"devices": "0-8", "layout": "d9"}})],
        PlanError,
        ["plan.gen.devices", "device 8 does not exist"],
    ),
    (
        "plan device listed twice",
        [("plan", {"gen": {"devices": "0-1,1", "layout": "d3"}})],
        PlanError,
        ["plan.gen.devices", "device 1 is listed twice"],
    ),
    (
        "plan layout size",
        [("plan", {"gen": {"devices": "0-1", "layout": "d2t2p1m1"}})],
        PlanError,
        ["plan.gen", "layout d2t2p1m1 needs dp×tp×pp = 2×2×1 = 4 devices but the mesh has 2"],
    ),
    (
        "plan layout syntax",
        [("plan", {"gen": {"devices": "0-1", "layout": "d2x"}})],
        PlanError,
        ["plan.gen.layout 'd2x'"],
    ),
    (
        "plan unknown field",
        [("plan", {"gen": {"device": 0, "layout": "d1"}})],
        GraphError,
        ["plan.gen.device", "did you mean 'devices'"],
    ),
    ("plan not auto", [("plan", "automatic")], PlanError, ["plan: expected 'auto'"]),
    # -- engines
    (
        "engine unknown",
        [("nodes.gen.engine", "vlm")],
        GraphError,
        ["nodes.gen.engine", "'vlm' is not one of builtin, vllm, auto", "did you mean 'vllm'"],
    ),
    (
        "engine auto on an inference node",
        [("nodes.ref.engine", "auto")],
        GraphError,
        ["nodes.ref.engine", "engine 'auto' runs generate nodes only"],
    ),
    (
        "plan engine unknown",
        [("nodes.gen.engine", "auto"), ("plan", {"gen": {"devices": 0, "layout": "d1", "engine": "auto"}})],
        PlanError,
        ["plan.gen.engine: 'auto' is not one of builtin, vllm"],
    ),
    (
        "plan engine on a node that is not a generate node",
        [
            (
                "plan",
                {
                    "gen": {"devices": 0, "layout": "d1"},
                    "ref": {"devices": 0, "layout": "d1", "engine": "vllm"},
                    "train": {"devices": 0, "layout": "d1"},
                },
            )
        ],
        PlanError,
        ["plan.ref.engine: engines run generate nodes, not inference node 'ref'"],
    ),
    (
        "plan engine against the node's own",
        [
            ("nodes.gen.engine", "builtin"),  # pinned: a plan may not choose it
            (
                "plan",
                {
                    "gen": {"devices": 0, "layout": "d1", "engine": "vllm"},
                    "ref": {"devices": 0, "layout": "d1"},
                    "train": {"devices": 0, "layout": "d1"},
                },
            ),
        ],
        PlanError,
        [
            "plan.gen.engine: 'vllm' but nodes.gen.engine is 'builtin'",
            "leaves nodes.gen.engine out (or 'auto')",
        ],
    ),
]


def _full_plan(**override: dict[str, str]) -> dict[str, dict[str, str]]:
    plan = {n: {"devices": "0", "layout": "d1t1p1m1"} for n in ("gen", "reward", "ref", "train")}
    plan.update(override)
    return plan


PLAN_CASES: list[tuple[str, dict[str, dict[str, str]], list[str]]] = [
    # The issue's example: 4 prompts × 2 samples = 8 rows on 8 dp ranks = 1 row per rank, which cannot be
    # cut into 2 micro-batches (it would be 0 rows each, and a NaN later).
    ("issue example", _full_plan(train={"devices": "0-7", "layout": "d8t1p1m2"}),
     ["nodes.train", "1 rows per rank", "m=2 micro-batches", "d8t1p1m2"]),
    ("dp does not divide", _full_plan(ref={"devices": "0-2", "layout": "d3"}),
     ["nodes.ref", "8 rows", "do not divide over dp=3"]),
    ("generate on more stages than layers", _full_plan(gen={"devices": "0-3", "layout": "d1t1p4m1"}),
     ["plan.gen.layout", "pp=4 pipeline stages but model 'actor' has 2 layers"]),
    ("tp does not divide heads", _full_plan(train={"devices": "0-2", "layout": "t3"}),
     ["plan.train.layout", "tp=3 does not divide model 'actor' num_attention_heads=4"]),
    ("pp beyond layers", _full_plan(train={"devices": "0-3", "layout": "p4"}),
     ["plan.train.layout", "pp=4 pipeline stages but model 'actor' has 2 layers"]),
    ("unknown node", {**_full_plan(), "trian": {"devices": "0", "layout": "d1"}},
     ["plan.trian", "did you mean 'train'"]),
    ("missing node", {k: v for k, v in _full_plan().items() if k != "ref"},
     ["plan: no placement for node ref"]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "changes", "err", "fragments"), CASES, ids=[c[0] for c in CASES])
def test_mistake_is_reported(
    catalogue_registry: Registry[NodeFunction],
    name: str,
    changes: list[tuple[str, Any]],
    err: type[Exception],
    fragments: list[str],
) -> None:
    expect(mutated(*changes), catalogue_registry, err, *fragments)


@pytest.mark.parametrize(("name", "plan", "fragments"), PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_plan_mistake_is_reported(
    catalogue_registry: Registry[NodeFunction], name: str, plan: dict[str, Any], fragments: list[str]
) -> None:
    expect(mutated(("plan", plan)), catalogue_registry, PlanError, *fragments)


def test_valid_plan_and_auto(catalogue_registry: Registry[NodeFunction]) -> None:
    # 8 rows / (2 mini-batches) = 4 per mini-batch / dp 2 = 2 per rank / m2 = 1 row per micro-batch.
    raw = mutated(
        (
            "plan",
            _full_plan(
                train={"devices": "0-3", "layout": "d2t2p1m2"}, gen={"devices": [4, 5], "layout": "t2"}
            ),
        ),
        ("nodes.train.mini_batches", 2),
    )
    g = load(raw, catalogue_registry)
    assert g.placement("train").devices == (0, 1, 2, 3)
    assert (g.placement("train").layout.dp, g.placement("train").layout.micro_batches) == (2, 2)
    assert g.placement("gen").devices == (4, 5)
    auto = load(mutated(("plan", "auto")), catalogue_registry)
    with pytest.raises(PlanError, match="plan is 'auto'"):
        auto.placement("gen")


def test_engine_auto_is_resolved_by_the_plan(
    catalogue_registry: Registry[NodeFunction], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``engine: auto``: ``plan: auto`` leaves it open; a hand-written plan without ``engine`` runs the
    built-in loop; a plan that names an engine runs it (the runtime reads ``run_node`` and
    ``engine_nodes``, and the engine check names the plan's key). The choice survives the graph's dict."""
    from rlflow.nodes.engines.validation import check_engines, engine_nodes

    auto = load(mutated(("nodes.gen.engine", "auto"), ("plan", "auto")), catalogue_registry)
    assert auto.engine("gen") == "auto" and engine_nodes(auto) == []
    plan = _full_plan()
    hand = load(mutated(("nodes.gen.engine", "auto"), ("plan", plan)), catalogue_registry)
    assert hand.engine("gen") == "builtin" and hand.run_node("gen").engine == "builtin"
    assert hand.engine("ref") == "builtin" and engine_nodes(hand) == []
    plan["gen"] = {"devices": "0", "layout": "d1t1p1m1", "engine": "vllm"}
    chosen = load(mutated(("nodes.gen.engine", "auto"), ("plan", plan)), catalogue_registry)
    assert chosen.node("gen").engine == "auto"  # the spec keeps what the file says
    assert chosen.engine("gen") == "vllm" and chosen.run_node("gen").engine == "vllm"
    assert engine_nodes(chosen) == ["gen"]
    assert chosen.spec.to_dict()["plan"]["gen"] == {"devices": "0", "layout": "d1t1p1m1", "engine": "vllm"}
    again = load(dump_back(chosen), catalogue_registry)
    assert again.engine("gen") == "vllm"
    # a tensor-parallel layout runs one engine per tp group, for the engine the plan chose too
    plan["gen"] = {"devices": "0-1", "layout": "d1t2p1m1", "engine": "vllm"}
    tp2 = load(mutated(("nodes.gen.engine", "auto"), ("plan", plan)), catalogue_registry)
    assert tp2.engine("gen") == "vllm" and tp2.placement("gen").layout.tp == 2
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(GraphError, match=r"g.yaml: plan.gen.engine: vllm: vLLM is not installed"):
        check_engines(chosen)
    check_engines(hand)  # the built-in loop needs no vLLM


def test_plan_may_leave_out_model_free_nodes(catalogue_registry: Registry[NodeFunction]) -> None:
    """`rlflow plan` writes model nodes only: a plan (inline or its overrides) that leaves out the rule
    reward puts it on device 0 with d1t1p1m1; a model node left out is still an error naming it."""
    planned = {k: v for k, v in _full_plan(train={"devices": "2-3", "layout": "d2"}).items() if k != "reward"}
    g = load(mutated(("plan", planned)), catalogue_registry)
    assert g.placement("reward") == NodePlacement((0,), Layout())
    assert g.placement("train").devices == (2, 3)
    assert list(g.spec.plan) == ["gen", "reward", "ref", "train"]  # completed, in node order
    overrides = tuple(f"plan.{n}.{f}={v}" for n in ("gen", "ref", "train")
                      for f, v in (("devices", "1"), ("layout", "d1t1p1m1")))  # fmt: skip
    g = load(base(), catalogue_registry, overrides)
    assert g.placement("reward").devices == (0,) and g.placement("ref").devices == (1,)
    del planned["ref"]
    expect(mutated(("plan", planned)), catalogue_registry, PlanError, "plan: no placement for node ref;")


def test_unconsumed_data_field_warns(catalogue_registry: Registry[NodeFunction]) -> None:
    with pytest.warns(GraphWarning, match=r"data\.fields: key 'level' is produced by the data set but never"):
        g = load(mutated(("data.fields.level", "difficulty")), catalogue_registry)
    assert len(g.warnings) == 1


def test_discarded_output_is_not_a_key(catalogue_registry: Registry[NodeFunction]) -> None:
    raw = mutated(("nodes.probe", {
        "model": "actor", "kind": "generate", "function": "generate", "inputs": ["prompt_ids", "prompt_mask"],
        "outputs": {"response_ids": "g_ids", "response_mask": "g_mask", "logprobs": None}, "batch_size": 4,
    }))  # fmt: skip
    with pytest.warns(GraphWarning) as record:
        g = load(raw, catalogue_registry)
    keys = g.keys()
    assert "g_ids" in keys and None not in keys
    assert sorted(str(w.message).split("'")[1] for w in record) == ["g_ids", "g_mask"]


def test_generate_nodes_with_different_n_upstream(catalogue_registry: Registry[NodeFunction]) -> None:
    raw = mutated(("nodes.gen2", {
        "model": "actor", "kind": "generate", "function": "generate", "inputs": ["prompt_ids", "prompt_mask"],
        "outputs": {"response_ids": "g_ids", "response_mask": "g_mask", "logprobs": None}, "batch_size": 4,
        "args": {"n": 3},
    }), ("nodes.ref.inputs", {"prompt_ids": "prompt_ids", "prompt_mask": "prompt_mask",
                              "response_ids": "g_ids", "response_mask": "response_mask"}))  # fmt: skip
    expect(raw, catalogue_registry, GraphError, "nodes.ref", "'gen' (n=2)", "'gen2' (n=3)")


def test_overrides(catalogue_registry: Registry[NodeFunction]) -> None:
    g = load(
        base(),
        catalogue_registry,
        ("nodes.train.args.lr=1e-6", "algorithm.n=4", "nodes.reward.batch_size=16"),
    )
    assert g.node("train").args["lr"] == pytest.approx(1e-6)
    assert g.group_size("train") == 4  # ${algorithm.n} resolved after the override
    with pytest.raises(GraphError, match=r"no node 'trian' \(did you mean 'train'\?\)"):
        load(base(), catalogue_registry, ("nodes.trian.args.lr=1",))
    with pytest.raises(GraphError, match=r"expected key\.path=value"):
        load(base(), catalogue_registry, ("nodes.train.args.lr",))
    with pytest.raises(GraphError, match=r"nodes\.gen\.batch_size: expected an integer, got 'eight'"):
        load(base(), catalogue_registry, ("nodes.gen.batch_size=eight",))


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "the file is empty"),
        ("- 1\n- 2\n", "top level must be a mapping"),
        ("5", "top level must be a mapping"),
        ("models: {a: [}\n", "not valid YAML: while parsing a flow node"),
        ("models: {a: [}\n", 'in "g.yaml", line 1, column 14'),  # the mark names the file
        ("models: {}\ndata: {}\nnodes: {}\n", "models: the graph names no models"),
        ("a: ${a}\n", "a"),
    ],
)
def test_malformed_text(catalogue_registry: Registry[NodeFunction], text: str, fragment: str) -> None:
    with pytest.raises(GraphError) as info:
        loads_graph(text, source="g.yaml", registry=catalogue_registry)
    assert str(info.value).startswith("g.yaml: ") and fragment in str(info.value)


def test_error_names_both_ends_of_cycle_edge(catalogue_registry: Registry[NodeFunction]) -> None:
    msg = expect(
        mutated(("nodes.gen.inputs", {"prompt_ids": "prompt_ids", "prompt_mask": "scores"})),
        catalogue_registry,
        GraphError,
    )
    assert re.search(r"gen -\[response_ids\]-> reward -\[scores\]-> gen|reward -\[scores\]-> gen", msg), msg


def _async_plan() -> dict[str, dict[str, str]]:
    return _full_plan(
        gen={"devices": "0-3", "layout": "d4t1p1m1"},
        ref={"devices": "4-7", "layout": "d4t1p1m1"},
        train={"devices": "4-7", "layout": "d4t1p1m1"},
    )


def test_staleness_on_disjoint_meshes_is_quiet_and_kept(catalogue_registry: Registry[NodeFunction]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = load(mutated(("nodes.gen.staleness", 2), ("plan", _async_plan())), catalogue_registry)
    assert g.node("gen").staleness == 2 and g.trainers("gen") == ["train"]
    assert "staleness: 2" in g.to_yaml()  # and the synchronous default is left out of the resolved file
    assert "staleness" not in load(mutated(("plan", _async_plan())), catalogue_registry).to_yaml()


def test_staleness_on_shared_devices_warns_that_nothing_overlaps(
    catalogue_registry: Registry[NodeFunction],
) -> None:
    plan = {**_async_plan(), "train": {"devices": "2-5", "layout": "d4t1p1m1"}}
    with pytest.warns(
        GraphWarning,
        match=r"g\.yaml: nodes\.gen\.staleness: generation and training cannot "
        r"overlap: 'gen' and train node 'train' share devices \[2, 3\]",
    ):
        load(mutated(("nodes.gen.staleness", 1), ("plan", plan)), catalogue_registry)
    with pytest.warns(GraphWarning, match=r"share device \[0\]"):  # no plan: everything on device 0
        load(mutated(("nodes.gen.staleness", 1)), catalogue_registry)


def test_staleness_on_a_frozen_model_warns(catalogue_registry: Registry[NodeFunction]) -> None:
    raw = mutated(("nodes.probe", {
        "model": "ref", "kind": "generate", "function": "generate", "inputs": ["prompt_ids", "prompt_mask"],
        "outputs": {"response_ids": "g_ids", "response_mask": "g_mask", "logprobs": None}, "batch_size": 4,
        "staleness": 1,
    }), ("models.ref.tokenizer", "examples/arith/tokenizer"))  # fmt: skip
    with pytest.warns(GraphWarning) as record:
        load(raw, catalogue_registry)
    assert any("nodes.probe.staleness: model 'ref' is never trained" in str(w.message) for w in record)


def test_staleness_after_the_trainer_is_rejected(catalogue_registry: Registry[NodeFunction]) -> None:
    """A generate node fed by its own model's train node cannot run ahead of that training."""
    catalogue_registry.add(
        "train_with_stats",
        NodeFunction("train_with_stats", "train", lambda *a, **k: None, "", ("prompt_ids",), ("stats",)),
    )
    raw = mutated(
        ("nodes.stats", {"model": "actor", "kind": "train", "function": "train_with_stats",
                         "inputs": ["prompt_ids"], "outputs": ["stats"], "batch_size": 4}),
        ("nodes.gen2", {"model": "actor", "kind": "generate", "function": "generate",
                        "inputs": {"prompt_ids": "stats", "prompt_mask": "prompt_mask"},
                        "outputs": {"response_ids": "g_ids", "response_mask": "g_mask", "logprobs": None},
                        "batch_size": 4, "staleness": 1}),
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphWarning)
        expect(raw, catalogue_registry, GraphError, "nodes.gen2.staleness", "after its train node 'stats'",
               "a path stats -> gen2")  # fmt: skip


def test_leading_optional_outputs_bind(catalogue_registry: Registry[NodeFunction]) -> None:
    """``truncated`` alone (as before ``weight_version`` existed), both, or ``weight_version`` by name."""
    outs = ["response_ids", "response_mask", "logprobs"]
    for given, expected in (
        ([*outs, "truncated"], {"truncated": "truncated", "weight_version": None}),
        (
            [*outs, "truncated", "weight_version"],
            {"truncated": "truncated", "weight_version": "weight_version"},
        ),
        ({**{o: o for o in outs}, "weight_version": "wv"}, {"truncated": None, "weight_version": "wv"}),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", GraphWarning)
            g = load(mutated(("nodes.gen.outputs", given)), catalogue_registry)
        bound = g.node("gen").outputs
        assert isinstance(bound, dict)
        assert {k: bound[k] for k in expected} == expected


# -- inputs an argument asks for (ArgInput; the decoupled loss's proximal log-probs) -----------------------
def _arg_input_registry() -> Registry[NodeFunction]:
    """The catalogue plus ``pg``: inputs SEQ + logprobs [+ ref_logprobs, scores optional], and ``prox``
    when ``args.use`` is true (an own forward of the node's model)."""
    from rlflow.dataflow.args import Arg
    from rlflow.dataflow.registry import ArgInput
    from tests.conftest import make_catalogue_registry

    reg = make_catalogue_registry()
    reg.add(
        "pg",
        NodeFunction(
            "pg", "train", lambda ctx, batch, **a: None, "test", (*SEQ, "logprobs", "ref_logprobs", "scores"),
            heads=("lm",), optional_inputs=("ref_logprobs", "scores"),
            args=(Arg("use", bool, False, "read prox"),),
            arg_inputs=(ArgInput("prox", "use", (True,), "the proximal log-probs", own_forward=True),),
        ),
    )  # fmt: skip
    return reg


def _pg_graph(
    inputs: Any, use: bool, prox_model: str = "actor", prox_kind: str = "inference"
) -> dict[str, Any]:
    """:func:`base` with a node ``prox`` (a ``logprobs`` inference node, or a generate node) outputting
    ``prox_logprobs`` and the train node running ``pg`` on ``inputs`` with ``args.use``."""
    raw = base()
    if prox_kind == "inference":
        prox = {"function": "logprobs", "inputs": SEQ, "outputs": {"logprobs": "prox_logprobs"}}
    else:
        prox = {"function": "generate", "inputs": ["prompt_ids", "prompt_mask"], "args": {"n": 2},
                "outputs": [None, None, "prox_logprobs"]}  # fmt: skip
    raw["nodes"]["prox"] = {"model": prox_model, "kind": prox_kind, "batch_size": 4, **prox}
    raw["nodes"]["train"].update({"function": "pg", "inputs": inputs, "args": {"use": use}})
    return raw


def test_an_arg_input_is_bound_last_or_by_name_exactly_when_its_argument_asks() -> None:
    reg = _arg_input_registry()
    short, full = [*SEQ, "logprobs"], [*SEQ, "logprobs", "ref_logprobs", "scores"]
    for given in ([*short, "prox_logprobs"], [*full, "prox_logprobs"]):  # with or without the optional ones
        g = load(_pg_graph(given, True), reg)
        assert g.node("train").inputs["prox"] == "prox_logprobs" and "prox" in g.dependencies("train")
    g = load(_pg_graph({**{k: k for k in short}, "prox": "prox_logprobs"}, True), reg)
    assert g.node("train").inputs["prox"] == "prox_logprobs"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prox_logprobs produced and not read: a warning only
        assert "prox" not in load(_pg_graph(full, False), reg).node("train").inputs
    for given in (short, full, {k: k for k in full}):  # asked for, not bound
        expect(
            _pg_graph(given, True), reg, GraphError, "nodes.train.inputs.prox: args.use is True, which reads"
        )
    for given in ([*short, "prox_logprobs"], {**{k: k for k in short}, "prox": "prox_logprobs"}):
        expect(
            _pg_graph(given, False), reg, GraphError, "nodes.train.inputs.prox: ", "read only when args.use"
        )
    expect(_pg_graph([*SEQ], True), reg, GraphError, "nodes.train.inputs: function 'pg' takes 7 inputs",
           "plus prox last, when args.use is True")  # fmt: skip


@pytest.mark.parametrize(
    ("model", "kind", "fragment"),
    [
        ("ref", "inference", "comes from node 'prox' (inference, model ref)"),
        ("actor", "generate", "comes from node 'prox' (generate, model actor)"),
    ],
)
def test_an_own_forward_arg_input_comes_from_an_inference_node_on_the_same_model(
    model: str, kind: str, fragment: str
) -> None:
    reg = _arg_input_registry()
    raw = _pg_graph([*SEQ, "logprobs", "prox_logprobs"], True, model, kind)
    expect(raw, reg, GraphError, "nodes.train.inputs.prox: key 'prox_logprobs' ", fragment, "model 'actor'")
    raw = _pg_graph([*SEQ, "logprobs", "answer"], True)  # a data set field
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expect(raw, reg, GraphError, "nodes.train.inputs.prox: key 'answer' comes from the data set")


def test_a_malformed_arg_input_is_refused_at_registration() -> None:
    from rlflow.dataflow.args import Arg
    from rlflow.dataflow.errors import RegistryError
    from rlflow.dataflow.registry import ArgInput

    def fn(ctx: Any, batch: Any) -> None:
        return None

    arg = (Arg("use", bool, False, "read it"),)
    with pytest.raises(RegistryError, match="arg input 'x' is also one of its inputs"):
        NodeFunction(
            "f", "train", fn, inputs=("x",), args=arg, arg_inputs=(ArgInput("x", "use", (True,), "d"),)
        )
    with pytest.raises(
        RegistryError, match="arg input 'y' depends on 'other', which is not one of its arguments"
    ):
        NodeFunction(
            "f", "train", fn, inputs=("x",), args=arg, arg_inputs=(ArgInput("y", "other", (1,), "d"),)
        )
