"""Cost model: hand-derived FLOPs, communication and memory; layout checks; reallocation pricing."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.call_cost import forward_flops
from rlflow.schedulers.planner.cluster import ClusterSpec, EngineRates, LinkSpec, Overheads
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.comm_cost import collectives_time
from rlflow.schedulers.planner.cost import CostModel, layout_problem
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem, ppo_problem
from rlflow.schedulers.planner.shapes import ModelShape

# hidden 8, intermediate 16, 4 heads, 2 kv heads (kv_dim 4), vocab 16.
CFG = dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16)


def shape(layers: int = 1) -> ModelShape:
    return ModelShape.from_config({**CFG, "num_hidden_layers": layers})


def link_cluster(**changes: object) -> ClusterSpec:
    """One host of 8 devices whose links move 1000 B/s with 0.1 s per ring step; cores not limited."""
    base = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=8, cores_per_host=None)
    return dataclasses.replace(base, intra_host=LinkSpec(bandwidth=1000.0, latency=0.1), **changes)


def test_param_count_and_forward_flops_golden() -> None:
    s = shape(1)
    # layer: q,o 2·8·8 = 128; k,v 2·4·8 = 64; gate,up,down 3·16·8 = 384; 2 norms 16 -> 592
    assert s.layer_params == 592
    # + embedding 16·8 + lm_head 16·8 + final norm 8 = 592 + 264 = 856
    assert s.num_params == 856 == sum(int(__import__("math").prod(v)) for v in s.param_shapes().values())
    # rows 2, seq 4: tokens 8; matmul 2·8·(592 + 128) = 11520; attention 4·2·4²·8·1 = 1024
    assert forward_flops(s, 2, 4) == 12544


def test_collective_ring_formulas_and_profiled_links() -> None:
    link = LinkSpec(bandwidth=1000.0, latency=0.1)
    cluster = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=8, intra_host=link)
    four = (0, 1, 2, 3)
    # all-reduce: 2(n−1)/n · bytes/bw + 2(n−1)·latency = 1.5·1000/1000 + 6·0.1 = 2.1 s
    assert cluster.collective_time("all_reduce", 1000, four) == pytest.approx(2.1)
    # all-gather / reduce-scatter: (n−1)/n · bytes/bw + (n−1)·latency = 0.75 + 0.3 = 1.05 s
    assert cluster.collective_time("all_gather", 1000, four) == pytest.approx(1.05)
    assert cluster.collective_time("reduce_scatter", 1000, four) == pytest.approx(1.05)
    # broadcast (pipelined chain): bytes/bw + (n−1)·latency = 1 + 0.3 = 1.3 s
    assert cluster.collective_time("broadcast", 1000, four) == pytest.approx(1.3)
    assert cluster.collective_time("all_reduce", 1000, (0,)) == 0.0
    # A profiled fit for all-gather among 2 (bw 2000 B/s, 0.01 s per step) is used at 2 and carried to 4
    # (nearest measured size): 3·0.01 + 0.75·1000/2000 = 0.405 s; other collectives keep intra_host.
    fitted = dataclasses.replace(cluster, collectives={("all_gather", 2): LinkSpec(2000.0, 0.01)})
    assert fitted.collective_time("all_gather", 1000, (0, 1)) == pytest.approx(0.01 + 0.5 * 1000 / 2000)
    assert fitted.collective_time("all_gather", 1000, four) == pytest.approx(0.405)
    assert fitted.collective_time("all_reduce", 1000, four) == pytest.approx(2.1)


def test_collective_latency_is_paid_once_per_call() -> None:
    """A link's ``collective_latency`` (NCCL's base latency) once per collective, beside the ring steps'."""
    link = LinkSpec(bandwidth=1000.0, latency=0.1, collective_latency=0.05)
    cluster = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=8, intra_host=link)
    four = (0, 1, 2, 3)
    # all-reduce: 1.5·1000/1000 + 6·0.1 + 0.05 = 2.15 s; all-gather 0.75 + 0.3 + 0.05 = 1.1 s
    assert cluster.collective_time("all_reduce", 1000, four) == pytest.approx(2.15)
    assert cluster.collective_time("all_gather", 1000, four) == pytest.approx(1.1)
    assert cluster.collective_time("all_reduce", 1000, (0,)) == 0.0
    # 3 all-reduces of 1000 bytes in all: 3 · (0.6 + 0.05) + 1.5 = 3.45 s
    assert collectives_time(cluster, "all_reduce", 3, 1000, four) == pytest.approx(3.45)
    # a profile's fitted link holds its latency in its per-step figure: no base added (0.405 s as above)
    fitted = dataclasses.replace(cluster, collectives={("all_gather", 2): LinkSpec(2000.0, 0.01)})
    assert fitted.collective_time("all_gather", 1000, four) == pytest.approx(0.405)


def test_gpu_preset_prices_nccl_latencies() -> None:
    """h100-8x: 3 µs per NVLink ring step, 10 µs per network step, 6.6 µs per call (NCCL's ring LL base
    latency, the preset's source); an empty all-reduce among 8 on one host: 14 · 3 + 6.6 = 48.6 µs; among
    16 on two hosts (the inter-host link): 30 · 10 + 6.6 = 306.6 µs."""
    h100 = load_cluster("h100-8x", hosts=2)
    assert h100.collective_time("all_reduce", 0.0, tuple(range(8))) == pytest.approx(48.6e-6)
    assert h100.collective_time("all_reduce", 0.0, tuple(range(16))) == pytest.approx(306.6e-6)


def test_layout_problem_messages() -> None:
    s = shape(2)
    gen = PlanNode("gen", "m", "generate", 8, 4, 4)
    assert layout_problem(s, gen, Layout(1, 1, 2)) is None  # the built-in loop on two stages
    assert "without pipeline stages" in (layout_problem(s, gen, Layout(1, 1, 2), engine="vllm") or "")
    assert "num_key_value_heads" in (layout_problem(s, gen, Layout(1, 4, 1)) or "")
    train = PlanNode("train", "m", "train", 8, 4, 4, mini_batches=2)
    why = layout_problem(s, train, Layout(2, 1, 1, 4))  # 8 % (2·2·4) != 0
    assert why == "8 rows do not divide into dp=2 × 2 mini-batches × 4 micro-batches"
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
    with pytest.raises(PlanError, match=r"node 'n'.*pp=4 pipeline stages but model 'm' has 2 layers"):
        cm.node_cost("n", NodePlacement((0, 1, 2, 3), Layout(1, 1, 4)))


def test_realloc_and_edge_cost() -> None:
    problem = ppo_problem("7b", "7b")
    cm = CostModel(problem, load_cluster("h100-8x", hosts=2))
    a = NodePlacement(tuple(range(8)), Layout(1, 8, 1))
    assert cm.transfers.realloc_time("actor", a, NodePlacement(tuple(range(8)), Layout(1, 8, 1, 4))) == 0.0
    intra = cm.transfers.realloc_time("actor", a, NodePlacement(tuple(range(8)), Layout(2, 4, 1)))
    inter = cm.transfers.realloc_time("actor", a, NodePlacement(tuple(range(8, 16)), Layout(2, 4, 1)))
    assert 0 < intra < inter  # NVLink beats InfiniBand
    # a node's own mesh costs nothing; across hosts: bytes / (lanes · bw · eff) + latency
    assert cm.transfers.edge_time(1e9, a, a) == 0.0
    far = NodePlacement(tuple(range(8, 16)), Layout(8, 1, 1))
    assert cm.transfers.edge_time(1e9, a, far) == pytest.approx(1e9 / (8 * 50e9 * 0.8) + 10e-6)


# The two-layer model of ``shape(2)``: 1448 parameters (2·592 in layers + 2·128 embedding/head + 8 norm),
# 2 bytes each = 2896 bytes; 21 parameter tensors (9 per layer + embedding, final norm, lm_head).
# Ring links of ``link_cluster`` among n = 2: all-gather / reduce-scatter T(X) = 0.1 + 0.5·X/1000 s,
# all-reduce T(X) = 0.2 + X/1000 s, broadcast T(X) = 0.1 + X/1000 s; k collectives of X bytes in all
# cost k·T(0) + T(X) − T(0).


def test_fsdp2_collectives_per_unit_golden() -> None:
    node = PlanNode("n", "m", "train", 8, 4, 4, epochs=1, mini_batches=2)
    cm = CostModel(PlanProblem({"m": shape(2)}, (node,)), link_cluster())
    cost = cm.node_cost("n", NodePlacement((0, 1), Layout(2, 1, 1, 1)))
    # units = 2 layers + root = 3 over 2896 bytes: gather = 3·0.1 + 0.5·2896/1000 = 1.748 s, scatter the
    # same; per micro-batch 2 gathers + 1 scatter = 5.244 s; 2 steps × 1 micro-batch; per step 2 all-reduces
    # of 8 bytes = 2·0.2 + 16/1000 = 0.416 s.  2·5.244 + 2·0.416 = 11.32 s.
    assert cost.dp_comm_s == pytest.approx(11.32)
    first = CostModel(
        PlanProblem({"m": shape(2)}, (dataclasses.replace(node, first_pass=True),)), link_cluster()
    )
    # a first no-grad pass all-gathers every unit once more: + 1.748 s
    assert first.node_cost("n", NodePlacement((0, 1), Layout(2, 1, 1, 1))).dp_comm_s == pytest.approx(13.068)


def test_tensor_parallel_collectives_per_layer_golden() -> None:
    problem = PlanProblem(
        {"m": shape(2)}, (PlanNode("inf", "m", "inference", 8, 4, 4), PlanNode("tr", "m", "train", 8, 4, 4))
    )
    cm = CostModel(problem, link_cluster())
    tp2 = NodePlacement((0, 1), Layout(1, 2, 1, 1))
    # forward: 2·2 + 1 = 5 all-reduces of b·S·H·2 = 8·8·8·2 = 1024 bytes: 5·0.2 + 5120/1000 = 6.12 s;
    # lm head: all-gather of the logits 8·8·16·2 = 2048 bytes: 0.1 + 0.5·2048/1000 = 1.124 s.
    assert cm.node_cost("inf", tp2).tp_comm_s == pytest.approx(7.244)
    # train adds 5·2 + 1 = 11 backward all-reduces of 1024 bytes (2.2 + 11.264 s) and one 8-byte
    # grad-norm all-reduce per step (0.208 s): 7.244 + 13.464 + 0.208 = 20.916 s.
    assert cm.node_cost("tr", tp2).tp_comm_s == pytest.approx(20.916)


def test_fixed_overheads_and_dispatch_golden() -> None:
    ov = Overheads(
        node_s=0.5, call_s=0.01, backward_s=0.02, step_s=0.03, step_tensor_s=0.001, tp_module_s=0.001,
        dispatch_s=0.004, dispatch_bandwidth=1000.0,
    )  # fmt: skip
    nodes = (
        PlanNode("inf", "m", "inference", 8, 4, 4),
        PlanNode("tr", "m", "train", 8, 4, 4, mini_batches=2, first_pass=True),
    )
    edges = (("data", "inf", "prompt_ids", 100), ("inf", "tr", "logprobs", 50))
    problem = PlanProblem({"m": shape(2)}, nodes, edges)
    plain, timed = CostModel(problem, link_cluster()), CostModel(problem, link_cluster(overheads=ov))
    one, tp2 = NodePlacement((0,), Layout(1, 1, 1, 1)), NodePlacement((0, 1), Layout(1, 2, 1, 1))
    # train: node 0.5 + (2 steps + 1 first-pass) calls · 0.01 + 2 backward calls · 0.02 = 0.57 s
    assert timed.node_cost("tr", one).overhead_s == pytest.approx(0.57)
    # optimizer: per step 0.03 + 21 tensors · 0.001, two steps: +0.102 s
    extra = timed.node_cost("tr", one).optimizer_s - plain.node_cost("tr", one).optimizer_s
    assert extra == pytest.approx(0.102)
    # tp = 2 calls 7·2 + 1 + 1 = 16 tensor-parallel modules per forward: 0.5 + 0.01 + 16·0.001 = 0.526 s
    assert timed.node_cost("inf", tp2).overhead_s == pytest.approx(0.526)
    # dispatch: 0.004 + t · 100 data-set bytes / 1000 B/s, not in the node's span; the 50 output bytes stay
    # on the workers (worker-to-worker batches), and the train node reads no data-set rows: 0.004 s
    assert timed.node_cost("inf", one).dispatch_s == pytest.approx(0.104)
    assert timed.node_cost("inf", tp2).dispatch_s == pytest.approx(0.204)
    assert timed.node_cost("tr", one).dispatch_s == pytest.approx(0.004)
    assert timed.node_cost("inf", one).time_s == pytest.approx(plain.node_cost("inf", one).time_s + 0.51)


def test_pipeline_activation_memory_is_1f1b_first_stage() -> None:
    """Train activations at pp > 1 are those of the first stage under 1F1B: min(m, p) micro-batches of
    b = 8/m rows through ⌈L/p⌉ layers (Narayanan et al. 2021, §2.2.1; GPipe would hold all m)."""
    cm = CostModel(_problem("train", layers=4), load_cluster("cpu-local"))

    def acts(pp: int, m: int) -> float:
        devices = tuple(range(pp))
        return cm.node_cost("n", NodePlacement(devices, Layout(1, 1, pp, m))).memory.activations

    # S = 8, H = 8, a = 4, Q = 8, V = 16, t = 1. Per layer and row (Korthikanti Table 2):
    # S·(H·26 + 8·Q + 5·a·S) = 8·(208 + 64 + 160) = 3456; logits and their gradient 2·4·S·V = 1024 per row.
    per_row = {1: 3456 + 1024, 2: 2 * 3456 + 1024, 4: 4 * 3456 + 1024}  # by layers on the stage
    assert acts(1, 4) == pytest.approx(1 * 2 * per_row[4])  # pp = 1: one micro-batch of 2 rows
    assert acts(2, 1) == pytest.approx(1 * 8 * per_row[2])  # m = 1 < p: one micro-batch of 8 rows
    assert acts(2, 2) == pytest.approx(2 * 4 * per_row[2])  # m = p: both micro-batches of 4 rows
    assert acts(2, 4) == pytest.approx(2 * 2 * per_row[2])  # m > p: 2 of the 4 (GPipe: 4·2 rows)
    assert acts(2, 8) == pytest.approx(2 * 1 * per_row[2])
    assert acts(4, 2) == pytest.approx(2 * 4 * per_row[1])  # 1 layer per stage, m = 2 < p = 4
    assert acts(4, 8) == pytest.approx(4 * 1 * per_row[1])  # m = 8 > p = 4: stage 0 holds 4


def test_rank_skew_and_pipeline_stages_pay_fixed_costs() -> None:
    problem = PlanProblem({"m": shape(2)}, (PlanNode("inf", "m", "inference", 8, 4, 4),))
    plain = CostModel(problem, link_cluster())
    timed = CostModel(problem, link_cluster(overheads=Overheads(call_s=0.01, rank_skew_s=0.002)))

    def extra(placement: NodePlacement) -> float:
        return timed.node_cost("inf", placement).time_s - plain.node_cost("inf", placement).time_s

    # one device: one call; dp = 4: the same call on each replica plus 3 ranks started 2 ms apart
    assert extra(NodePlacement((0,), Layout(1, 1, 1, 1))) == pytest.approx(0.01)
    assert extra(NodePlacement((0, 1, 2, 3), Layout(4, 1, 1, 1))) == pytest.approx(0.01 + 3 * 0.002)
    # pp = 2, one micro-batch (GPipe): each stage calls in turn, so the bubble doubles the call's cost
    assert extra(NodePlacement((0, 1), Layout(1, 1, 2, 1))) == pytest.approx(2 * 0.01 + 0.002)


def test_cpu_oversubscription_slows_compute_and_relative_collectives() -> None:
    problem = PlanProblem({"m": shape(2)}, (PlanNode("n", "m", "train", 8, 4, 4),))
    free, shared = CostModel(problem, link_cluster()), CostModel(problem, link_cluster(cores_per_host=2))
    four = NodePlacement((0, 1, 2, 3), Layout(2, 2, 1, 1))
    # 4 busy workers on 2 cores: compute 4/2 = 2× slower; the tp pairs' collectives (profiled with 2 busy
    # ranks, slowdown 1) by 2/1 as well
    assert shared.node_cost("n", four).compute_s == pytest.approx(2 * free.node_cost("n", four).compute_s)
    assert shared.node_cost("n", four).tp_comm_s == pytest.approx(2 * free.node_cost("n", four).tp_comm_s)
    two = NodePlacement((0, 1), Layout(2, 1, 1, 1))
    assert shared.node_cost("n", two).compute_s == pytest.approx(free.node_cost("n", two).compute_s)
    # measured slowdowns replace n / cores: interpolated between counts, proportional beyond the last
    measured = link_cluster(cores_per_host=2, slowdowns={2: 1.5, 4: 3.5})
    assert [measured.slowdown(n) for n in (1, 2, 3, 4, 8)] == pytest.approx([1.0, 1.5, 2.5, 3.5, 7.0])


def test_weight_sync_golden() -> None:
    nodes = (PlanNode("gen", "m", "generate", 8, 4, 4), PlanNode("train", "m", "train", 8, 4, 4))
    cm = CostModel(PlanProblem({"m": shape(2)}, nodes), link_cluster())
    same = {
        "gen": NodePlacement((0, 1), Layout(1, 2, 1, 1)),
        "train": NodePlacement((0, 1), Layout(1, 2, 1, 4)),
    }
    transfers = cm.transfers  # one instance:
    assert transfers.sync_targets("train", same) == [] and transfers.sync_time("train", same) == 0.0
    fsdp = {
        "gen": NodePlacement((0, 1), Layout(2, 1, 1, 1)),
        "train": NodePlacement((0, 1), Layout(2, 1, 1, 1)),
    }
    # FSDP2 source vs replicas on the same devices: each of 21 tensors re-gathered over dp,
    # 21·0.1 + 0.5·2896/1000 = 3.548 s; the shards are then local (no transfer); verification: 2
    # all-gathers of 64 bytes per rank on the 2-rank union, 2·0.1 + 0.5·256/1000 = 0.328 s (hashing free).
    assert cm.transfers.sync_targets("train", fsdp) == [(fsdp["gen"], False)]
    assert cm.transfers.sync_time("train", fsdp) == pytest.approx(3.876)
    # device 0 -> device 1: every transfer is small, packed into one broadcast of 2896 bytes
    # (0.1 + 2.896 s) on the pair; verification 0.328 s.
    apart = {"gen": NodePlacement((1,), Layout(1, 1, 1, 1)), "train": NodePlacement((0,), Layout(1, 1, 1, 1))}
    assert cm.transfers.realloc_time("m", apart["train"], apart["gen"]) == pytest.approx(2.996)
    assert cm.transfers.sync_time("train", apart) == pytest.approx(2.996 + 0.328)


def test_vllm_generation_golden() -> None:
    """A generate node on vLLM engines: prefill and decode at the roofline plus the engine's profiled
    fixed costs, one call per data-parallel replica, and the load of each new weight version."""
    rates = EngineRates(
        prefill_call_s=0.01, prefill_scale=2.0, decode_step_s=0.002, decode_row_s=0.0005,
        load_bandwidth=1000.0, verify_s=0.05, start_s=12.0, measured=True,
    )  # fmt: skip
    cluster = link_cluster(
        efficiency=dataclasses.replace(load_cluster("cpu-local").efficiency, half_tokens=0.0, matmul=0.5),
        overheads=Overheads(node_s=0.1, rank_skew_s=0.003, call_s=0.7, decode_s=0.9),
        engine=rates,
    )
    gen = PlanNode("gen", "m", "generate", 8, 4, 4, engine="vllm")
    train = PlanNode("train", "m", "train", 8, 4, 4)
    cost = CostModel(PlanProblem({"m": shape(1)}, (gen, train)), cluster)
    c = cost.node_cost("gen", NodePlacement((0, 1), Layout(2, 1, 1, 1)))
    # dp = 2 engines, b = 4 rows each, one call. Prefill: forward_flops(4 rows, 4 tokens) = 2·16·720 +
    # 4·4·4²·8 = 23040 + 2048 = 25088 FLOPs at 60e9 · 0.5 FLOP/s, twice as long (prefill_scale 2).
    assert c.compute_s == pytest.approx(2 * 25088 / 30e9)
    # Decode: G − 1 = 3 steps at context 4 + 4/2 = 6, memory-bound: weights 856·2 = 1712 B + KV read
    # 2·1·4·6·4·2 = 384 B at 8e9 · 0.6 B/s (FLOPs 2·4·720 + 4·4·6·8 = 6528 take 2.2e-7 s < 4.4e-7 s).
    assert c.decode_s == pytest.approx(3 * 2096 / 4.8e9)
    # Fixed: node 0.1 + call 0.01 + 3 steps · (0.002 + 4 rows · 0.0005) = 0.122, + 1 rank started 3 ms
    # later; the built-in loop's call_s / decode_s do not apply.
    assert c.overhead_s == pytest.approx(0.125)
    # The model is trained: each iteration loads 1712 bytes at 1000 B/s and verifies them (0.05 s).
    assert c.engine_sync_s == pytest.approx(1.762)
    assert c.tp_comm_s == c.bubble_s == 0.0
    assert c.time_s == pytest.approx(2 * 25088 / 30e9 + 3 * 2096 / 4.8e9 + 0.125 + 1.762)
    # Memory: the engine's own copy plus its smallest KV pool (32 MiB), resident; the worker's replica of
    # the trained model only during a weight sync, which streams it one unit at a time (transient): the
    # largest unit is the layer's 592 parameters, 1184 B (tests/test_engine_release.py)
    assert c.memory.weights == 0 and c.memory.replica == c.memory.transient == 1184
    assert c.memory.engine == 1712 + 32 * 2**20
    assert c.memory.peak == 1712 + 1184 + 32 * 2**20
    # A frozen model gets no new weights: no load.
    frozen = CostModel(PlanProblem({"m": shape(1)}, (gen,)), cluster)
    fc = frozen.node_cost("gen", NodePlacement((0, 1), Layout(2, 1, 1, 1)))
    assert fc.engine_sync_s == 0.0
    assert fc.memory.weights == 1712 and fc.memory.replica == 0  # never synced: resident
    # One engine tensor parallel over both devices (tp = 2), all 8 rows at once. Prefill: forward_flops(8
    # rows, 4 tokens) = 2·32·720 + 4·8·4²·8 = 50176 FLOPs, split two ways, twice as long.
    tp = cost.node_cost("gen", NodePlacement((0, 1), Layout(1, 2, 1, 1)))
    assert tp.compute_s == pytest.approx(2 * 50176 / (2 * 30e9))
    # Decode: 3 steps reading the weight shard 856 B + KV 2·1·4·6·8·2 / 2 = 384 B per device.
    assert tp.decode_s == pytest.approx(3 * (856 + 384) / 4.8e9)
    # Collectives on the pair (ring: all-reduce x/1000 + 0.2 s, all-gather x/2000 + 0.1 s): the prefill's
    # 3 all-reduces of 8·4·8·2 = 512 B (0.6 + 1.536) and its last position's logits 8·16·2 = 256 B gathered
    # (0.228); each step 3 all-reduces of 128 B (0.6 + 0.384) and the logits (0.228): 2.364 + 3 · 1.212.
    assert tp.tp_comm_s == pytest.approx(2.364 + 3 * 1.212)
    # Fixed: 0.1 + 0.01 + 3 · (0.002 + 8 · 0.0005), + 1 rank started 3 ms later.
    assert tp.overhead_s == pytest.approx(0.131)
    # Each sync gathers the full tensors over tp first: 12 tensors of 856 B per rank (12 · 0.1 + 0.428 s).
    assert tp.engine_sync_s == pytest.approx(1.762 + 1.628)
    # Memory per device: the engine's shard (856 B) and KV pool; of the instance's tensor-parallel shard
    # only the streamed sync's largest unit, half the layer (296 parameters, 592 B), and that layer gathered
    # to full tensors for the engine's load (1184 B).
    assert tp.memory.engine_weights == 856 and tp.memory.replica == 592 + 1184 and tp.memory.weights == 0


def test_vllm_sleep_mode_makes_the_engine_working_memory_on_cuda() -> None:
    """``args.enable_sleep_mode``: on a GPU the engine's weights and KV cache are the generate node's working
    memory (asleep between calls), so a colocated trainer's working memory takes their place; each call pays
    the weight copy to host memory and back. On CPU vLLM has no sleep mode and nothing changes."""
    from rlflow.schedulers.planner.cluster import HostSpec
    from rlflow.schedulers.planner.resources import device_consumers, device_totals

    rates = EngineRates(prefill_call_s=0.01, decode_step_s=0.002, load_bandwidth=1000.0, measured=True)
    host = HostSpec(memory_bytes=1e12, memory_bandwidth=1e9, pcie_bandwidth=1000.0)

    def model(sleep: bool, cluster: ClusterSpec) -> CostModel:
        gen = PlanNode("gen", "m", "generate", 8, 4, 4, engine="vllm", sleep_mode=sleep)
        return CostModel(
            PlanProblem({"m": shape(1)}, (gen, PlanNode("train", "m", "train", 8, 4, 4))), cluster
        )

    both = NodePlacement((0, 1), Layout(2, 1, 1, 1))
    plan = {"gen": both, "train": both}
    gpus = link_cluster(engine=rates, host=host)
    awake, asleep = model(False, gpus), model(True, gpus)
    a, s = awake.node_cost("gen", both), asleep.node_cost("gen", both)
    # 1712 B of weights (856 bf16 parameters) to host memory and back at 1000 B/s: 3.424 s per call
    assert s.overhead_s - a.overhead_s == pytest.approx(2 * 1712 / 1000)
    engine = 1712 + 32 * 2**20  # weights + the smallest KV pool
    assert not a.memory.engine_sleeps and a.memory.resident_engine == a.memory.engine == engine
    assert s.memory.engine_sleeps and s.memory.resident_engine == 0
    assert s.memory.transient == 1184 + engine  # the replica's largest unit the sync streams, the engine
    assert s.memory.peak == a.memory.peak
    train = awake.node_cost("train", both).memory
    assert device_totals(awake, plan)[0] == pytest.approx(engine + train.state + max(train.transient, 1184))
    assert device_totals(asleep, plan)[0] == pytest.approx(train.state + max(train.transient, 1184 + engine))
    for cost in (awake, asleep):  # the consumers the launch check names add up to the search's totals
        consumers = device_consumers(cost, plan)
        assert sum(c.nbytes for c in consumers[0]) == pytest.approx(device_totals(cost, plan)[0])
    assert any("awake (gen)" in c.what for c in device_consumers(asleep, plan)[0])
    cpu = dataclasses.replace(gpus, cores_per_host=8)
    assert model(True, cpu).node_cost("gen", both) == model(False, cpu).node_cost("gen", both)


def test_vllm_default_rates_and_engine_auto() -> None:
    """Without profiled engine rates the engine costs the built-in loop's fixed costs plus a weight load at
    half the memory streaming rate; an ``engine: auto`` node costs what its placement's engine costs
    (builtin when the placement names none)."""
    cluster = link_cluster(overheads=Overheads(call_s=0.01, decode_s=0.002))
    rates = cluster.engine_rates()
    assert not rates.measured
    assert (rates.prefill_call_s, rates.prefill_scale, rates.decode_step_s, rates.decode_row_s) == (
        0.01, 1.0, 0.002, 0.0,
    )  # fmt: skip
    assert rates.load_bandwidth == pytest.approx(8e9 * 0.6 / 2)
    nodes = (
        PlanNode("auto", "m", "generate", 8, 4, 4, engine="auto", engines=("builtin", "vllm")),
        PlanNode("builtin", "m", "generate", 8, 4, 4),
        PlanNode("vllm", "m", "generate", 8, 4, 4, engine="vllm"),
        PlanNode("train", "m", "train", 8, 4, 4),
    )
    cost = CostModel(PlanProblem({"m": shape(1)}, nodes), cluster)
    one = NodePlacement((0,), Layout())
    vllm = cost.node_cost("vllm", one)
    # 0.01 per call + 3 steps · 0.002, as the built-in loop's one micro-batch; the load 1712 B at 2.4e9 B/s
    assert vllm.overhead_s == pytest.approx(0.016)
    assert vllm.engine_sync_s == pytest.approx(1712 / 2.4e9)
    assert cost.node_cost("builtin", one).overhead_s == pytest.approx(0.016)
    assert cost.node_cost("auto", one) == cost.node_cost("builtin", one)
    assert cost.node_cost("auto", NodePlacement((0,), Layout(), "builtin")) == cost.node_cost("builtin", one)
    assert cost.node_cost("auto", NodePlacement((0,), Layout(), "vllm")) == vllm
    with pytest.raises(PlanError, match="engines"):
        PlanNode("bad", "m", "generate", 8, 4, 4, engine="builtin", engines=("vllm",))
