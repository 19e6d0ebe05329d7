"""The planner prices mixture-of-experts models from their experts (issue 34, "Planner"; "Bad input", first
bullet): parameter counts equal the models transformers builds on the meta device (every architecture the
planner prices, and every model config of examples/ and bench/), FLOPs come from the active parameters,
a decode step reads the experts its rows touch, the expert-parallel all-to-all has hand-derived bytes and
seconds, and a config the planner cannot price is refused naming the file, model and key.

Reproduce: ``python -m pytest -q tests/test_planner_moe.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.call_cost import decode_step_time, token_flops
from rlflow.schedulers.planner.cluster import LinkSpec
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.comm_cost import moe_all_to_all_bytes, moe_all_to_all_time
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.memory_cost import (
    activation_bytes,
    dense_mlp_bytes,
    sparse_mlp_bytes,
    stage_params,
    train_activations,
)
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode
from rlflow.schedulers.planner.shapes import ModelShape, expected_distinct_experts
from rlflow.schedulers.planner.vllm_cost import engine_kv_per_token

ROOT = Path(__file__).resolve().parent.parent
BASE = {"vocab_size": 19, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
# layer 0 sparse (8 experts of width 32, top-2), layer 1 dense (mlp_only_layers)
TINY_MOE = {**BASE, "model_type": "qwen3_moe", "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2, "mlp_only_layers": [1]}  # fmt: skip
# DeepSeek-V3: layer 0 dense (first_k_dense_replace), layers 1-2 sparse with a shared expert; latent attention
TINY_DS = {**BASE, "model_type": "deepseek_v3", "num_hidden_layers": 3, "num_key_value_heads": 4,
           "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
           "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
           "v_head_dim": 16}  # fmt: skip
ARCHITECTURES = {
    "qwen3_moe, a dense layer": TINY_MOE,
    "qwen3_moe, sparse step 2": {**TINY_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2,
                                 "mlp_only_layers": []},
    "qwen3_moe defaults": {**BASE, "model_type": "qwen3_moe", "moe_intermediate_size": 16},  # 128 experts
    "qwen2_moe, shared expert": {**BASE, "model_type": "qwen2_moe", "moe_intermediate_size": 32,
                                 "shared_expert_intermediate_size": 48, "num_experts": 8,
                                 "num_experts_per_tok": 2},
    "mixtral": {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "mixtral tied": {**BASE, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1,
                     "tie_word_embeddings": True},
    "qwen2 qkv bias": {**BASE, "model_type": "qwen2"},
    "qwen3 qk norm": {**BASE, "model_type": "qwen3", "head_dim": 24},
    "llama biases": {**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "deepseek_v3, latent attention": TINY_DS,
    "deepseek_v3, full q, biases, 2 shared": {**TINY_DS, "q_lora_rank": None, "attention_bias": True,
                                              "n_shared_experts": 2},
}  # fmt: skip


def _hf_params(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: a 70 B-parameter config takes no memory
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _graph_configs() -> dict[str, dict[str, Any]]:
    """Every distinct model ``config`` of the graph files in examples/ and bench/ (the first file:model
    that has it -> config)."""
    out: dict[str, dict[str, Any]] = {}
    for path in sorted([*ROOT.glob("examples/**/*.yaml"), *ROOT.glob("bench/**/*.yaml")]):
        spec = yaml.safe_load(path.read_text())
        models = spec.get("models") if isinstance(spec, dict) else None
        for name, model in (models or {}).items():
            config = model.get("config") if isinstance(model, dict) else None
            if isinstance(config, dict) and config not in out.values():
                out[f"{path.relative_to(ROOT)}:{name}"] = config
    return out


GRAPH_CONFIGS = _graph_configs()


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architectures_match_the_meta_device_model(name: str) -> None:
    """Names, shapes and the count of every priced architecture equal transformers' (fused experts)."""
    config = ARCHITECTURES[name]
    real = _hf_params(config)
    shape = ModelShape.from_config(config)
    assert shape.param_shapes() == real
    assert shape.num_params == sum(torch.Size(s).numel() for s in real.values())


@pytest.mark.parametrize("where", sorted(GRAPH_CONFIGS))
def test_example_and_bench_configs_match_the_meta_device_model(where: str) -> None:
    """Each model config in examples/ and bench/ is priced with the parameters transformers builds, or
    refused naming the key that makes it an architecture the planner does not price (GPT-2's)."""
    config = GRAPH_CONFIGS[where]
    if config.get("model_type") == "gpt2":
        with pytest.raises(PlanError, match=r"config\.n_embd: model_type 'gpt2'"):
            ModelShape.from_config(config)
        return
    real = _hf_params(config)
    assert ModelShape.from_config(config).num_params == sum(torch.Size(s).numel() for s in real.values())


def test_moe_counts_by_hand() -> None:
    """TINY_MOE: embedding and head 19·64 = 1,216 each, final norm 64; attention q/o 64·64, k/v 32·64
    (12,288), q/k norms 2·16, two norms 2·64: 12,448 per layer; layer 0 adds the router 8·64 = 512 and 8
    experts of 3·64·32 = 6,144 (49,664), layer 1 a dense MLP 3·64·128 = 24,576. Total 101,632; a token uses
    2 of the 8 experts: 101,632 − 6·6,144 = 64,768 active."""
    shape = ModelShape.from_config(TINY_MOE)
    assert shape.layer_sizes == (12_448 + 49_664, 12_448 + 24_576)
    assert shape.expert_params == 6_144
    assert shape.num_params == 101_632
    assert shape.active_params == 64_768
    # forward FLOPs of 10 tokens, no attention scores: 2·10·(active decoder 62,272 + head 1,216)
    assert token_flops(shape, 10, 0) == 2 * 10 * (62_272 + 1_216)


def test_qwen3_30b_a3b_graph_is_priced_from_its_experts() -> None:
    """The example graph's Qwen3-30B-A3B (config.json values): per layer attention 2·4096·2048 + 2·512·2048
    = 18,874,368, q/k norms 256, norms 4,096, router 128·2048 = 262,144, 128 experts of 3·2048·768 =
    4,718,592; 48 layers + embedding and head 151,936·2048 each + final norm 2048 = 30,532,122,624
    parameters (the model card's "30.5B"), 30,532,122,624 − 48·120·4,718,592 = 3,353,032,704 active
    ("3.3B activated")."""
    graph = load_graph(str(ROOT / "examples" / "moe" / "qwen3_30b_a3b_grpo.yaml"))
    problem = problem_from_graph(graph, prompt_len=128, device_type="cuda", mean_new_tokens=3196)
    shape = problem.models["actor"]
    assert (shape.num_params, shape.active_params) == (30_532_122_624, 3_353_032_704)
    assert shape.key() == "h2048-i6144-l48-a32-kv4-v151936-d128-e128-k8-m768"
    # the key names the matrices (profiles are keyed by it), not the QK norms: 48 · 2 · 128 fewer
    assert ModelShape.from_key(shape.key()).num_params == shape.num_params - 48 * 256
    assert shape.describe().startswith(
        "mixture of experts: 30.53 B parameters in memory, 3.353 B active per token (FLOPs); 128 experts of "
        "width 768, 8 per token, in 48 of 48 layers"
    )
    # a training token costs its active parameters' FLOPs, not the dense 2048-wide model's nor all experts'
    dense = dataclasses.replace(shape, num_experts=0, experts_per_token=0, moe_layers=())
    assert token_flops(shape, 1, 0) == 2 * (3_353_032_704 - 151_936 * 2048 - 2048)
    assert token_flops(dense, 1, 0) < token_flops(shape, 1, 0)


def test_distinct_experts_by_hand() -> None:
    """E·(1 − (1 − K/E)^n): one token touches its K experts; 2 tokens of top-2 of 8 touch
    8·(1 − 0.75²) = 3.5; 64 tokens of Qwen3's top-8 of 128: 128·(1 − (15/16)^64) ≈ 125.94."""
    assert expected_distinct_experts(8, 2, 1) == pytest.approx(2.0)
    assert expected_distinct_experts(8, 2, 2) == pytest.approx(3.5)
    assert expected_distinct_experts(128, 8, 64) == pytest.approx(125.942, abs=1e-3)
    assert expected_distinct_experts(8, 2, 0) == 0.0
    shape = ModelShape.from_config(TINY_MOE)
    assert shape.read_params(1) == pytest.approx(64_768)  # the active parameters
    assert shape.read_params(2) == pytest.approx(101_632 - (8 - 3.5) * 6_144)


def test_decode_reads_only_touched_experts() -> None:
    """A memory-bound decode step of b rows streams the weights less the untouched experts: at b = 1 the
    Qwen3-30B-A3B step reads its active parameters, not its 30.5 B."""
    cluster = load_cluster("h100-8x")
    shape = ModelShape.from_config(
        yaml.safe_load((ROOT / "examples" / "moe" / "qwen3_30b_a3b_grpo.yaml").read_text())["models"][
            "actor"
        ]["config"]
    )
    weights = shape.num_params * 2
    rate = cluster.device.memory_bandwidth * cluster.efficiency.memory
    step = decode_step_time(cluster, shape, 1, 0, 1, weights)
    assert step == pytest.approx(shape.active_params * 2 / rate)


def test_all_to_all_by_hand() -> None:
    """Qwen3-30B-A3B (K 8, hidden 2048, bf16), 4,096 tokens per rank at ep 4: dispatch sends
    4096·8·2048·2 = 134,217,728 bytes, 3/4 = 100,663,296 of them off-rank. On a link of 100 GB/s and 10 µs,
    efficiency 1: one all-to-all 3·10 µs + 100,663,296 / 1e11 s = 1.03663296 ms; dispatch + combine
    2.07326592 ms forward, with their gradients 4.14653184 ms."""
    wide = {"hidden_size": 2048, "num_experts": 128, "num_experts_per_tok": 8, "head_dim": 128}
    shape = ModelShape.from_config({**TINY_MOE, **wide})
    assert moe_all_to_all_bytes(shape, 4096, 4) == (134_217_728, 100_663_296)
    assert moe_all_to_all_bytes(shape, 4096, 1) == (134_217_728, 0)
    base = load_cluster("h100-8x")
    cluster = dataclasses.replace(
        base,
        intra_host=LinkSpec(1e11, 1e-5),
        collectives={},
        efficiency=dataclasses.replace(base.efficiency, link=1.0),
    )
    assert moe_all_to_all_time(cluster, shape, 4096, (0, 1, 2, 3)) == pytest.approx(2.07326592e-3)
    assert moe_all_to_all_time(cluster, shape, 4096, (0, 1, 2, 3), backward=True) == pytest.approx(
        4.14653184e-3
    )
    assert moe_all_to_all_time(cluster, shape, 4096, (0,)) == 0.0
    dense = ModelShape.from_config({**BASE, "model_type": "llama"})
    assert moe_all_to_all_time(cluster, dense, 4096, (0, 1, 2, 3)) == 0.0


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({**BASE, "model_type": "qwen3", "kv_lora_rank": 16},
         r"config\.kv_lora_rank: model_type 'qwen3'.*multi-head latent attention"),
        ({**TINY_DS, "kv_lora_rank": 0}, r"config\.kv_lora_rank: 0 is not a positive width"),
        ({**BASE, "model_type": "gemma"}, r"config\.model_type: 'gemma' is not an architecture the planner"),
        ({**BASE, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5,
          "moe_intermediate_size": 8}, r"config\.num_experts_per_tok: 5"),
    ],
)  # fmt: skip
def test_unpriced_configs_are_refused(config: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        ModelShape.from_config(config)


def test_unpriced_graph_names_file_and_model() -> None:
    """``rlflow plan`` on the GPT-2 bench graph: the error names the file, the model and the key."""
    graph = load_graph(str(ROOT / "bench" / "grpo_gpt2.yaml"))
    with pytest.raises(PlanError, match=r"grpo_gpt2\.yaml: models\.\w+: config\.n_embd: model_type 'gpt2'"):
        problem_from_graph(graph, prompt_len=16, mean_new_tokens=8.0)


def test_deepseek_v3_counts_by_hand() -> None:
    """TINY_DS (4 heads, qk = 16 + 8 = 24, v 16): attention q_a 32·64 = 2,048, q_a norm 32, q_b 96·32 =
    3,072, kv_a (16 + 8)·64 = 1,536, kv_a norm 16, kv_b 4·32·16 = 2,048, o 64·64 = 4,096: 12,848; norms 128.
    Layer 0 dense MLP 3·64·128 = 24,576 (37,552); layers 1-2 router 8·64 = 512, 8 experts of 3·64·32 = 6,144
    (49,152) and the shared expert 6,144 (68,784 each). Embedding + head 2·19·64 = 2,432, final norm 64:
    177,616; active 177,616 − 2·6·6,144 = 103,888. Tensor parallel keeps q_a, kv_a and their norms
    (2,048 + 32 + 1,536 + 16 = 3,632 per layer) whole on every rank."""
    shape = ModelShape.from_config(TINY_DS)
    assert shape.layer_sizes == (37_552, 68_784, 68_784)
    assert (shape.num_params, shape.active_params) == (177_616, 103_888)
    assert shape.tp_replicated_layer_params == 3_632
    # over tp 2: (177,616 − 3·3,632)/2 + 3·3,632
    assert stage_params(shape, Layout(1, 2, 1, 1)) == (177_616 - 10_896) / 2 + 10_896
    # FLOPs: Q = 4·(24 + 16)/2 = 80; 10 tokens with 100 squared lengths: 2·10·(103,888 active less the
    # embedding 1,216 and final norm 64) + 4·100·80·3
    assert shape.attention_width == 80
    assert token_flops(shape, 10, 100) == 2 * 10 * 102_608 + 4 * 100 * 80 * 3
    # the cache keeps the latent and the rope key, 16 + 8 values per token per layer, at any tp
    assert shape.kv_cache_width(1) == shape.kv_cache_width(4) == 24
    assert engine_kv_per_token(shape, 2) == 3 * 24 * shape.dtype_bytes
    # decode over 10 cached tokens: vLLM absorbs kv_b (scores 16 + 8, values 16 wide per head in the
    # latent): 2·10·4·40 = 3,200; transformers expands the latent, 2·10·16·4·32 = 40,960, then attends,
    # 2·10·4·40 = 3,200, writing and reading 2·10·4·40 = 3,200 expanded values
    assert shape.decode_attention(10, expanded=False) == (3_200, 0)
    assert shape.decode_attention(10, expanded=True) == (44_160, 3_200)


def test_deepseek_v3_real_size_is_the_reports() -> None:
    """DeepSeek-V3 with transformers' defaults (its config.json sizes): per layer attention q_a 1536·7168,
    q_b 24,576·1536, kv_a 576·7168, kv_b 32,768·512, o 7168·16,384, norms 1536 + 512: 187,107,328; 2 norms
    14,336; 3 dense layers' MLP 3·7168·18,432 = 396,361,728; 58 sparse layers' router 256·7168, 256
    experts and one shared of 3·7168·2048 = 44,040,192 each; embedding + head 2·129,280·7168, final norm
    7168: 671,026,404,352 ("671B total", arXiv 2412.19437, §1), 671,026,404,352 − 58·248·44,040,192 =
    37,552,282,624 active ("37B activated"; both with the embedding and head, without the 14 B MTP module,
    which transformers does not build). The meta-device model agrees (names, shapes, count)."""
    config = {"model_type": "deepseek_v3"}
    shape = ModelShape.from_config(config)
    assert (shape.num_params, shape.active_params) == (671_026_404_352, 37_552_282_624)
    assert shape.param_shapes() == _hf_params(config)
    assert shape.mtp_layers == 1
    assert "multi-token-prediction layer(s) (num_nextn_predict_layers) are not priced" in shape.describe()
    # vLLM's cache: 61 layers · (512 + 64) values · 2 bytes
    assert engine_kv_per_token(shape, 8) == 61 * 576 * 2


@pytest.mark.parametrize(
    ("config", "dtype"),
    [(TINY_MOE, torch.float32), ({**TINY_MOE, "norm_topk_prob": True}, torch.float32),
     (ARCHITECTURES["qwen2_moe, shared expert"], torch.float32), (ARCHITECTURES["mixtral"], torch.float32),
     (TINY_DS, torch.float32), ({**TINY_DS, "n_group": 4, "topk_group": 2}, torch.float32),
     ({**TINY_DS, "n_group": 4, "topk_group": 2}, torch.bfloat16), (ARCHITECTURES["mixtral"], torch.bfloat16),
     ({**TINY_MOE, "norm_topk_prob": True}, torch.bfloat16)],
    ids=["qwen3_moe", "qwen3_moe norm_topk_prob", "qwen2_moe shared+gate", "mixtral", "deepseek_v3",
         "deepseek_v3 4 groups", "deepseek_v3 4 groups bf16", "mixtral bf16", "qwen3_moe bf16"],
)  # fmt: skip
def test_sparse_layer_activations_are_what_autograd_saves(config: dict[str, Any], dtype: torch.dtype) -> None:
    """A sparse layer's MoE block, run forward and backward by transformers on 10 tokens: the bytes of every
    tensor autograd saves for the backward (each storage once; not the weights nor the block's input, which
    the dense terms count) equal :func:`sparse_mlp_bytes`, plus what is per layer, not per token, and left
    out of the price: transformers' int32 expert offsets (``4·E`` bytes) and, in a 16-bit DeepSeek-V3, its
    router's fp32 copy of the router weight (``4·E·H``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype)
    shape = ModelShape.from_config(config, dtype=str(dtype).removeprefix("torch."))
    per_layer = 4 * shape.num_experts
    if shape.router == "sigmoid_group" and dtype != torch.float32:
        per_layer += 4 * shape.num_experts * shape.hidden_size
    saved = _saved_bytes(model, model.model.layers[shape.moe_layers[0]].mlp, 10, dtype)
    assert saved == sparse_mlp_bytes(shape, 10, 1) + per_layer


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mistral"])
def test_dense_mlp_activations_are_what_autograd_saves(model_type: str) -> None:
    """A dense layer's SwiGLU MLP (hidden 64, width 176) in bf16, forward and backward on 10 tokens: autograd
    saves four 176-wide bf16 tensors per token besides its input (:func:`dense_mlp_bytes`, 8·10·176 =
    14,080 bytes), not the 16·H = 1,024 per token (10,240) of Korthikanti et al.'s GeLU MLP that the
    formula used before."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = {**BASE, "model_type": model_type, "intermediate_size": 176}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    saved = _saved_bytes(model, model.model.layers[0].mlp, 10, torch.bfloat16)
    assert saved == dense_mlp_bytes(ModelShape.from_config(config), 10, 1) == 14_080


def _saved_bytes(model: torch.nn.Module, block: torch.nn.Module, tokens: int, dtype: torch.dtype) -> int:
    """Bytes of every tensor autograd saves for ``block``'s backward on ``tokens`` random hidden states of
    ``model``'s width (each storage once; neither the weights nor the block's input)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randn(1, tokens, model.config.hidden_size, dtype=dtype, requires_grad=True)
    saved: dict[int, int] = {}
    held: list[torch.Tensor] = []  # alive till the end, so no saved storage's address is reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights | {x.untyped_storage().data_ptr()}:
            saved[storage.data_ptr()] = storage.nbytes()
            held.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x).sum().backward()
    return sum(saved.values())


def test_moe_train_activations_by_hand() -> None:
    """TINY_MOE in bf16 (w 2) on cuda (no score term), 1 row of 10 tokens, tp 1: the dense layer 1 keeps
    10·(64·10 + 8·128 + 8·64) = 21,760 bytes (Korthikanti et al., its SwiGLU MLP as
    :func:`dense_mlp_bytes`); the sparse layer 0 keeps the same less
    the MLP's 16·64 intermediates, 11,520, plus its MoE block: router 4·8 + 8·2 = 48 and 2 routed copies of
    2·(2·64 + 4·32 + 1) + 24 = 538 each, 1,124 per token, 11,240: 22,760. With the fp32 logits and their
    gradient 2·4·10·19 = 1,520: 46,040. At ep 2 one layer's dispatch buffers add 2·10·2·64·2 = 5,120."""
    shape = ModelShape.from_config(TINY_MOE)
    node = PlanNode("t", "actor", "train", 1, 0, 10)
    assert sparse_mlp_bytes(shape, 10, 1) == 11_240
    assert train_activations(node, shape, 1, 1, 2, 1, 10, "cuda") == 46_040
    assert train_activations(node, shape, 1, 1, 2, 1, 10, "cuda", ep=2) == 51_160
    # inference prices one layer, the largest (the sparse one), plus the dispatch at ep 2
    assert activation_bytes(shape, 1, 10, 1, "cuda") == 22_760
    assert activation_bytes(shape, 1, 10, 1, "cuda", ep=2) == 22_760 + 5_120


def test_deepseek_v3_graph_is_planned_with_its_latent_cache(tmp_path: Path) -> None:
    """examples/moe/grpo.yaml with a tiny deepseek_v3 actor (2 layers, the first dense; kv_lora 16, rope 16):
    the graph's generate node on the built-in loop, one device, holds a KV cache of the latent, 32 values
    per token per layer (not 2 · 2 heads · 32), for its 32 rows of at most 16 + 8 tokens in 2 layers at 4
    bytes (float32 on cpu): 2·32·24·32·4 = 196,608 bytes; and the model's FLOPs are its active
    parameters'."""
    spec = yaml.safe_load((ROOT / "examples" / "moe" / "grpo.yaml").read_text())
    config = spec["models"]["actor"]["config"]
    for key in ("num_experts", "head_dim"):
        config.pop(key)
    config.update(model_type="deepseek_v3", n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1,
                  n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                  qk_rope_head_dim=16, v_head_dim=32)  # fmt: skip
    for model in spec["models"].values():  # the file is written elsewhere: paths from the repository
        if "tokenizer" in model:
            model["tokenizer"] = str(ROOT / model["tokenizer"])
    path = tmp_path / "deepseek.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    problem = problem_from_graph(load_graph(str(path)), prompt_len=16, mean_new_tokens=8.0)
    shape = problem.models["actor"]
    assert shape.mla is not None and shape.moe_layers == (1,) and shape.kv_cache_width(1) == 32
    gen = problem.node("actor_gen")
    assert (gen.rows, gen.seq_len) == (32, 24)
    cost = CostModel(problem, load_cluster("cpu-local")).node_cost(
        "actor_gen", NodePlacement((0,), Layout(1, 1, 1, 1))
    )
    assert cost.memory.kv_cache == 2 * 32 * 24 * 32 * 4
    assert token_flops(shape, 1, 0) == 2 * (shape.active_params - 19 * 64 - 64)


def test_no_fit_names_the_layout_rule_that_caps_dp() -> None:
    """A GRPO train node keeps whole groups per dp rank of each mini-batch: 2048 rows in 4 mini-batches are
    512 per mini-batch, 16 groups of 32, so dp stops at 16 whatever the devices (the 671B DeepSeek-V3 plan's
    dp = ep = 16 on 256 GPUs); the fits-nowhere paragraph says so (no_fit.dp_cap)."""
    from rlflow.schedulers.planner.no_fit import dp_cap
    from rlflow.schedulers.planner.problem import PlanProblem

    shape = ModelShape.from_config(TINY_MOE)
    node = PlanNode("actor_train", "m", "train", 2048, 16, 16, mini_batches=4, group_size=32)
    cost = CostModel(PlanProblem({"m": shape}, (node,)), load_cluster("h100-8x", hosts=8))
    # 32 devices allow dp up to 32 (tp = pp = 1); at dp = 32 a rank holds 2048 / 4 / 32 = 16 rows
    assert dp_cap(cost, node, 32) == (
        "its data-parallel degree stops at 16 on 32 devices (and with it the expert degree ep, which "
        "divides dp); the next, 32: dp=32 leaves 16 rows per data-parallel rank, which split groups of 32 "
        "samples per prompt; choose dp so that whole groups stay together"
    )
    assert dp_cap(cost, node, 16) == ""  # dp 16, the most 16 devices allow, is allowed
    one = dataclasses.replace(node, mini_batches=1, group_size=1)
    assert dp_cap(cost, one, 32) == ""
