"""Bad generation input is reported before anything starts (issue 15), for both engines (builtin, vllm):

- stop token ids outside the model's vocabulary (or negative) are refused by ``rlflow validate`` and by
  ``rlflow run`` before it starts anything, naming file, node and key; the node refuses an id outside the
  built model's vocabulary (a vocabulary string of a tokenizer larger than the model);
- greedy decoding with n > 1 samples per prompt is a GraphWarning (all n responses identical: group-relative
  advantages are all zero), shown by ``validate`` and ``run``;
- the pre-launch memory check counts every ``engine: vllm`` node's engines: the KV cache each allocates
  (:func:`rlflow.nodes.engines.sizing.engine_kv_cache_bytes`, golden values derived here by hand) plus its own
  copy of the weights, on the device (or host) of each data-parallel rank.

No test starts a vLLM engine (``tests/test_vllm_engine.py`` checks that the engine allocates the function's
bytes); the CLI's ``validate`` of an ``engine: vllm`` graph that gets past the graph checks needs vLLM
installed and is skipped without it.

Reproduce: ``python -m pytest -q tests/test_bad_generation_input.py``.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError, NodeError, PlanError
from rlflow.dataflow.graph import GraphWarning
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.dataflow.model_spec import ModelSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.engines.sizing import engine_kv_cache_bytes, engine_max_rows
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner import resources
from rlflow.schedulers.planner.auto import with_placements
from rlflow.schedulers.planner.cluster_files import local_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.resources import MachineMemory, check_plan_memory, device_consumers

GIB = 2**30
GRPO = "examples/grpo.yaml"
VLLM_GRPO = "examples/vllm/grpo.yaml"  # actor: vocab 19, 2 layers, 2 kv heads of 32, 64 positions, float32
NO_VLLM = importlib.util.find_spec("vllm") is None
ENGINES = ["builtin", "vllm"]


def _engine(engine: str) -> str:
    return f"nodes.actor_gen.engine={engine}"


# -- stop tokens ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_validate_refuses_stop_ids_outside_the_vocabulary(
    engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    where = f"error: {VLLM_GRPO}: nodes.actor_gen.args.stop_tokens: stop token id"
    assert main(["validate", VLLM_GRPO, _engine(engine), "nodes.actor_gen.args.stop_tokens=[12, 19]"]) == 2
    assert f"{where} 19 is outside the vocabulary of model 'actor' (vocab_size 19: ids 0..18)" in (
        capsys.readouterr().err
    )
    assert main(["validate", VLLM_GRPO, _engine(engine), "nodes.actor_gen.args.stop_tokens=[-1]"]) == 2
    assert f"{where} -1 is negative; token ids start at 0" in capsys.readouterr().err
    assert main(["validate", VLLM_GRPO, _engine(engine), "nodes.actor_gen.args.stop_tokens=[3, 1.5]"]) == 2
    assert "nodes.actor_gen.args.stop_tokens: 1.5 is neither a token id" in capsys.readouterr().err
    graph = load_graph(VLLM_GRPO, [_engine(engine), "nodes.actor_gen.args.stop_tokens=[0, 18, '+']"])
    assert graph.args("actor_gen")["stop_tokens"] == [0, 18, "+"]  # the last id and a string are fine


def test_run_refuses_a_bad_stop_id_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = [
        "run",
        VLLM_GRPO,
        "nodes.actor_gen.args.stop_tokens=[19]",
        f"run.output_dir={out}",
        "--no-progress",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        f"rlflow run: error: {VLLM_GRPO}: nodes.actor_gen.args.stop_tokens: stop token id 19 is outside"
        in err
    )
    assert not out.exists()  # no run directory, no engine, no worker


def _graph_text(actor: dict[str, object]) -> str:
    raw = yaml.safe_load(Path(VLLM_GRPO).read_text())
    raw["models"]["actor"] = {**actor, "tokenizer": "examples/arith/tokenizer"}
    raw["nodes"]["actor_gen"]["args"]["stop_tokens"] = [19]
    return yaml.safe_dump(raw)


def test_vocabulary_from_the_checkpoint_config_or_the_model_types_default(tmp_path: Path) -> None:
    """A model known by its checkpoint directory: ``vocab_size`` of its config.json; a config without
    ``vocab_size``: the default of its model_type (llama: 32000), as the built model gets it."""
    config = yaml.safe_load(Path(VLLM_GRPO).read_text())["models"]["actor"]["config"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        GraphError, match=r"^ckpt\.yaml: nodes\.actor_gen\.args\.stop_tokens: stop token id 19 "
    ):
        loads_graph(_graph_text({"path": str(ckpt)}), source="ckpt.yaml")
    no_vocab = {k: v for k, v in config.items() if k != "vocab_size"}
    loads_graph(_graph_text({"config": no_vocab}), source="default.yaml")  # 19 < 32000
    text = _graph_text({"config": no_vocab}).replace("- 19", "- 32000")
    with pytest.raises(
        GraphError, match=r"stop token id 32000 is outside .* \(vocab_size 32000: ids 0\.\.31999\)"
    ):
        loads_graph(text, source="default.yaml")


def test_the_node_refuses_a_stop_token_outside_the_built_models_vocabulary() -> None:
    """A vocabulary string of a tokenizer with more tokens than the model (id 19 of a 19-token model) is
    known only once the model is built: the generate node refuses it, naming node, key and model."""
    load_builtin_functions()
    config = yaml.safe_load(Path(VLLM_GRPO).read_text())["models"]["actor"]["config"]
    module = build_model_from_spec(ModelSpec(name="actor", config=config), seed=0, name="actor")
    tok = load_tokenizer(Path("examples/arith/tokenizer"))
    tok.add_tokens(["<tool>"])
    assert tok.convert_tokens_to_ids("<tool>") == 19
    entry = NODE_FUNCTIONS.get("generate")
    args = entry.bind({"n": 1, "max_new_tokens": 3})
    batch = Batch(
        {"prompt_ids": torch.tensor([[1, 5, 14, 6]]), "prompt_mask": torch.ones(1, 4, dtype=torch.long)}
    )

    def run(stop: list[object]) -> None:
        ctx = NodeContext(
            node=NodeSpec("actor_gen", "generate", "generate", model="actor", args={}),
            model=ModelState(name="actor", module=module, head="lm", tokenizer=tok),
            generator=torch.Generator().manual_seed(0),
            tokenizer=tok,
        )
        entry.fn(ctx, batch, **{**args, "stop_tokens": stop})

    run([18, "+"])  # inside the vocabulary
    with pytest.raises(NodeError) as err:
        run(["<tool>"])
    assert str(err.value) == (
        "node 'actor_gen': args.stop_tokens: stop token '<tool>' (id 19) is outside the vocabulary of model "
        "'actor' (vocab_size 19: ids 0..18); it can never be generated, so it would never end a response"
    )
    with pytest.raises(NodeError, match=r"^node 'actor_gen': args\.stop_tokens: stop token -2 is negative"):
        run([-2])


# -- greedy decoding with n > 1 ---------------------------------------------------------------------------


def _greedy_warning(src: str, key: str, setting: str) -> str:
    return (
        f"{src}: nodes.actor_gen.args.{key}: greedy decoding ({setting}) with nodes.actor_gen.args.n: 4 "
        "samples per prompt makes the 4 responses to a prompt identical, so group-relative advantages (GRPO, "
        "RLOO) are all zero and the policy gets no gradient from them; sample (temperature > 0) or set n: 1"
    )


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize(
    ("override", "key", "setting"),
    [("greedy=true", "greedy", "greedy: true"), ("temperature=0", "temperature", "temperature: 0")],
)
def test_validate_warns_of_greedy_decoding_with_several_samples(
    engine: str, override: str, key: str, setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["validate", VLLM_GRPO, _engine(engine), f"nodes.actor_gen.args.{override}"])
    assert f"warning: {_greedy_warning(VLLM_GRPO, key, setting)}\n" in capsys.readouterr().err
    with pytest.warns(GraphWarning) as record:
        graph = load_graph(VLLM_GRPO, [_engine(engine), f"nodes.actor_gen.args.{override}"])
    assert _greedy_warning(VLLM_GRPO, key, setting) in graph.warnings
    assert [str(w.message) for w in record] == graph.warnings


def test_no_warning_for_sampling_or_a_single_greedy_sample() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        load_graph(GRPO, ["nodes.actor_gen.args.temperature=0.5"])
        load_graph("examples/remax.yaml")  # its greedy baseline: n = 1


def test_run_shows_the_greedy_warning_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlflow run` shows it as `rlflow: warning:` (stopped here by a machine too small for the plan), and a
    graph rebuilt with a plan's placements does not repeat it."""
    monkeypatch.setattr(resources, "local_memory", lambda: MachineMemory(1024.0))
    out = tmp_path / "run"
    argv = ["run", GRPO, "nodes.actor_gen.args.greedy=true", f"run.output_dir={out}", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("rlflow: warning: ") == 1
    assert f"rlflow: warning: {_greedy_warning(GRPO, 'greedy', 'greedy: true')}\n" in err
    assert not out.exists()
    with pytest.warns(GraphWarning):
        graph = load_graph(GRPO, ["nodes.actor_gen.args.greedy=true"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        placed = with_placements(graph, {n: NodePlacement((0,), Layout()) for n in graph.spec.nodes})
    assert placed.warnings == graph.warnings


# -- a vLLM engine's memory -------------------------------------------------------------------------------


def test_kv_cache_formula_by_hand() -> None:
    """2 · layers · kv heads · head dim · bytes per token, × rows × (positions + 32), × 1.25, ≥ 32 MiB."""
    example = yaml.safe_load(Path(VLLM_GRPO).read_text())["models"]["actor"]["config"]
    # 2·2·2·32·4 = 1024 B/token; 32 rows × (64 + 32) tokens × 1.25 = 3.75 MiB: the 32 MiB floor
    assert engine_kv_cache_bytes(example, 4, 32) == 32 * 2**20
    # 65536 positions: 1024 · 32 · 65568 · 1.25 = 2 685 665 280 B; 16 rows (dp = 2): half
    wide = {**example, "max_position_embeddings": 65536}
    assert engine_kv_cache_bytes(wide, 4, 32) == 2_685_665_280
    assert engine_kv_cache_bytes(wide, 4, 16) == 1_342_832_640
    assert engine_kv_cache_bytes(wide, 2, 16) == 671_416_320  # bfloat16: 2 bytes per element
    assert engine_kv_cache_bytes(wide, 4, 1000) == engine_kv_cache_bytes(wide, 4, 256)  # max_num_seqs 256
    # GPT-2 small's names: 2·12 layers·12 heads·(768/12)·2 B = 36 864 B/token; 8 rows × 1056 × 1.25
    gpt2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}
    assert engine_kv_cache_bytes(gpt2, 2, 8) == 389_283_840
    # grouped-query attention and an explicit head_dim: 2·4 layers·2 kv heads·128·2 B = 4096 B/token
    gqa = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
           "head_dim": 128, "max_position_embeddings": 8192}  # fmt: skip
    assert engine_kv_cache_bytes(gqa, 2, 64) == int(4096 * 64 * (8192 + 32) * 1.25)
    assert engine_max_rows(8, 1, 4) == 32 and engine_max_rows(9, 2, 4) == 20  # ceil(9 / 2) · 4


WIDE = "models.actor.config.max_position_embeddings=65536"
# the example's 84 672 float32 parameters: 2 layers × 41 088 + embedding and head 2 × 19·64 + norm 64
ENGINE_WEIGHTS = 84_672 * 4
DP2 = [
    "run.devices=2",
    "plan={actor_gen: {devices: 0-1, layout: d2t1p1m1}, ref: {devices: 1, layout: d1t1p1m1},"
    " actor_train: {devices: 1, layout: d1t1p1m1}}",
]


def _usage(*overrides: str) -> dict[int, dict[str, float]]:
    graph = load_graph(VLLM_GRPO, list(overrides))
    cost = CostModel(problem_from_graph(graph), local_cluster(graph.spec.run.devices))
    plan = {n.name: graph.placement(n.name) for n in cost.problem.nodes}
    return {d: {c.what: c.nbytes for c in cs} for d, cs in device_consumers(cost, plan).items()}


def test_each_data_parallel_rank_holds_an_engine() -> None:
    """Each rank's engine: its own weights and the KV cache of its 16 of the 32 rows; the decode loop's KV
    cache is not counted for an engine: vllm node (the builtin engine's is)."""
    usage = _usage(WIDE, *DP2)
    for d in (0, 1):
        assert usage[d]["vLLM engine KV cache (actor_gen)"] == 1_342_832_640
        assert usage[d]["vLLM engine weights (actor_gen)"] == ENGINE_WEIGHTS
    assert "KV cache (actor_gen)" not in usage[0]
    one = _usage(WIDE)[0]
    assert one["vLLM engine KV cache (actor_gen)"] == 2_685_665_280  # one rank: all 32 rows
    assert not any(what.startswith("vLLM") for what in _usage(WIDE, _engine("builtin"))[0])
    for engine in ENGINES:
        graph = load_graph(VLLM_GRPO, [WIDE, _engine(engine)])
        cost = CostModel(problem_from_graph(graph), local_cluster(1))
        mem = cost.node_cost("actor_gen", graph.placement("actor_gen")).memory
        assert (mem.kv_cache > 0) == (engine == "builtin") and (mem.engine > 0) == (engine == "vllm")


def _host(gib: float) -> MachineMemory:
    return MachineMemory(gib * GIB)


def test_the_check_names_node_model_and_bytes() -> None:
    graph = load_graph(VLLM_GRPO, [WIDE])
    with pytest.raises(PlanError) as err:
        check_plan_memory(graph, _host(2))
    first, device, *_, advice = str(err.value).splitlines()
    assert first == (
        f"{VLLM_GRPO}: the plan needs 2.50 GiB on this host (devices 0), more than its 2.00 GiB of available "
        "host memory, of which the vLLM engine of node 'actor_gen' (model 'actor') needs 2.50 GiB (KV cache "
        "2.50 GiB + weights 0.00 GiB); biggest consumers:"
    )
    assert device.startswith("  device 0 (2.50 GiB): actor vLLM engine KV cache (actor_gen) 2.50 GiB")
    assert "max_position_embeddings" in advice
    check_plan_memory(load_graph(VLLM_GRPO, [WIDE, _engine("builtin")]), _host(2))  # no engine: fits
    check_plan_memory(graph, _host(3))
    # on CPU the two ranks' engines share the host's memory
    with pytest.raises(
        PlanError, match=r"of which the 2 vLLM engines of node 'actor_gen' \(model 'actor'\) need 2\.50 GiB"
    ):
        check_plan_memory(load_graph(VLLM_GRPO, [WIDE, *DP2]), _host(2))


def test_each_gpu_holds_its_ranks_engine() -> None:
    gpus = MachineMemory(None, {0: 2 * GIB, 1: 2 * GIB}, "GPU memory")
    check_plan_memory(load_graph(VLLM_GRPO, [WIDE, *DP2]), gpus)  # 1.25 GiB of KV cache per GPU
    one_gpu = ["run.devices=2"] + [
        f"plan.{node}={{devices: {d}, layout: d1t1p1m1}}"
        for node, d in (("actor_gen", 0), ("ref", 1), ("actor_train", 1))
    ]
    over = (
        r"2\.50 GiB on device 0, more than its 2\.00 GiB of GPU memory, of which the vLLM engine of node "
        r"'actor_gen' \(model 'actor'\) needs 2\.50 GiB"
    )
    with pytest.raises(PlanError, match=over):
        check_plan_memory(load_graph(VLLM_GRPO, [WIDE, *one_gpu]), gpus)


def test_run_stops_before_any_engine_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(resources, "local_memory", lambda: _host(2))
    out = tmp_path / "run"
    assert main(["run", VLLM_GRPO, WIDE, f"run.output_dir={out}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "rlflow run: error: examples/vllm/grpo.yaml: the plan needs 2.50 GiB on this host" in err
    assert "the vLLM engine of node 'actor_gen' (model 'actor') needs 2.50 GiB" in err
    assert not out.exists()


@pytest.mark.skipif(NO_VLLM, reason="validate checks that vLLM serves the node before the memory")
def test_validate_refuses_an_engine_that_does_not_fit(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(resources, "local_memory", lambda: _host(2))
    assert main(["validate", VLLM_GRPO, WIDE]) == 2
    assert "the vLLM engine of node 'actor_gen' (model 'actor') needs 2.50 GiB" in capsys.readouterr().err
    assert main(["validate", VLLM_GRPO]) == 0
