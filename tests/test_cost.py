"""Cost model: hand-derived FLOPs, communication and memory; layout checks; reallocation pricing."""

from __future__ import annotations

import dataclasses

import pytest

from dataflow.errors import PlanError
from schedulers.cluster import load_cluster
from schedulers.cost import CostModel, allreduce_time, forward_flops, layout_problem
from schedulers.plan import Layout, NodePlacement
from schedulers.problem import ModelShape, PlanNode, PlanProblem, ppo_problem

# hidden 8, intermediate 16, 4 heads, 2 kv heads (kv_dim 4), vocab 16.
CFG = dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16)


def shape(layers: int = 1) -> ModelShape:
    return ModelShape.from_config({**CFG, "num_hidden_layers": layers})


def test_param_count_and_forward_flops_golden() -> None:
    s = shape(1)
    # layer: q,o 2·8·8 = 128; k,v 2·4·8 = 64; gate,up,down 3·16·8 = 384; 2 norms 16 -> 592
    assert s.layer_params == 592
    # + embedding 16·8 + lm_head 16·8 + final norm 8 = 592 + 264 = 856
    assert s.num_params == 856 == sum(int(__import__("math").prod(v)) for v in s.param_shapes().values())
    # rows 2, seq 4: tokens 8; matmul 2·8·(592 + 128) = 11520; attention 4·2·4²·8·1 = 1024
    assert forward_flops(s, 2, 4) == 12544


def test_allreduce_ring_formula() -> None:
    # 2(n−1)/n · bytes/bw + 2(n−1)·latency = 1.5·1000/1000 + 6·0.1 = 2.1 s
    assert allreduce_time(1000, 4, 1000.0, 0.1) == pytest.approx(2.1)
    assert allreduce_time(1000, 1, 1000.0, 0.1) == 0.0


def test_layout_problem_messages() -> None:
    s = shape(2)
    gen = PlanNode("gen", "m", "generate", 8, 4, 4)
    assert "pp must be 1" in (layout_problem(s, gen, Layout(1, 1, 2)) or "")
    assert "num_key_value_heads" in (layout_problem(s, gen, Layout(1, 4, 1)) or "")
    train = PlanNode("train", "m", "train", 8, 4, 4, mini_batches=2)
    assert "rows=8" in (layout_problem(s, train, Layout(2, 1, 1, 4)) or "")  # 8 % (2·2·4) != 0
    assert layout_problem(s, train, Layout(2, 2, 1, 2)) is None


def _problem(kind: str, layers: int = 2) -> PlanProblem:
    return PlanProblem({"m": shape(layers)}, (PlanNode("n", "m", kind, 8, 4, 4, 1, 1),))


def test_inference_time_and_memory_golden() -> None:
    cluster = load_cluster("cpu-local")
    cluster = dataclasses.replace(
        cluster, efficiency=dataclasses.replace(cluster.efficiency, half_tokens=0.0, matmul=0.5)
    )
    cm = CostModel(_problem("inference", layers=1), cluster)
    cost = cm.node_cost("n", NodePlacement((0,), Layout(1, 1, 1, 1)))
    # 8 rows × 8 tokens: forward_flops = 2·64·720 + 4·8·64·8 = 92160 + 16384 = 108544 FLOPs,
    # at 60e9 · 0.5 FLOP/s = 3.6181e-6 s; one device: no communication or bubble.
    assert cost.compute_s == pytest.approx(108544 / 30e9)
    assert cost.time_s == pytest.approx(cost.compute_s)
    # weights 2 bytes × 856 params; activations (Korthikanti) S·b·H·(10 + 24 + 5·a·S/H) = 8·8·8·(34 + 20)
    # = 27648 bytes, plus fp32 logits 4·8·8·16 = 4096 bytes.
    assert cost.memory.weights == 2 * 856
    assert cost.memory.activations == pytest.approx(27648 + 4096)


def test_pipeline_bubble_and_train_state() -> None:
    cm = CostModel(_problem("train"), load_cluster("cpu-local"))
    one = cm.node_cost("n", NodePlacement((0, 1), Layout(1, 1, 2, 1)))
    four = cm.node_cost("n", NodePlacement((0, 1), Layout(1, 1, 2, 4)))
    # bubble = (compute + tp comm)·(p−1)/m
    assert one.bubble_s == pytest.approx(one.compute_s * 1 / 1)
    assert four.bubble_s == pytest.approx((four.compute_s + four.tp_comm_s) / 4)
    dp2 = cm.node_cost("n", NodePlacement((0, 1), Layout(2, 1, 1, 1)))
    # Adam state: 12 bytes per parameter, sharded over dp = 2; 2 layers: 2·592 + 2·128 + 8 = 1448 params
    assert dp2.memory.optimizer == pytest.approx(12 * 1448 / 2)
    assert dp2.dp_comm_s > 0 and one.dp_comm_s == 0


def test_node_cost_rejects_bad_layout() -> None:
    cm = CostModel(_problem("generate"), load_cluster("cpu-local"))
    with pytest.raises(PlanError, match=r"node 'n'.*pp must be 1"):
        cm.node_cost("n", NodePlacement((0, 1), Layout(1, 1, 2)))


def test_realloc_and_edge_cost() -> None:
    problem = ppo_problem("7b", "7b")
    cm = CostModel(problem, load_cluster("h100-8x", hosts=2))
    a = NodePlacement(tuple(range(8)), Layout(1, 8, 1))
    assert cm.realloc_time("actor", a, NodePlacement(tuple(range(8)), Layout(1, 8, 1, 4))) == 0.0
    intra = cm.realloc_time("actor", a, NodePlacement(tuple(range(8)), Layout(2, 4, 1)))
    inter = cm.realloc_time("actor", a, NodePlacement(tuple(range(8, 16)), Layout(2, 4, 1)))
    assert 0 < intra < inter  # NVLink beats InfiniBand
    # a node's own mesh costs nothing; across hosts: bytes / (lanes · bw · eff) + latency
    assert cm.edge_time(1e9, a, a) == 0.0
    far = NodePlacement(tuple(range(8, 16)), Layout(8, 1, 1))
    assert cm.edge_time(1e9, a, far) == pytest.approx(1e9 / (8 * 50e9 * 0.8) + 10e-6)
