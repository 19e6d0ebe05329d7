"""DeepSpeed ZeRO in the cost model: hand-derived memory per rank of each stage, collectives, CPU offload."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.cluster import HostSpec, LinkSpec
from rlflow.schedulers.planner.cluster_files import cluster_from_mapping, load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem, ppo_problem
from rlflow.schedulers.planner.resources import device_consumers, host_offload
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.planner.zero_cost import ZeroConfig, zero_memory

# 2 layers, hidden 8, intermediate 16, 4 heads, 2 kv heads, vocab 16, bf16: Ψ = 1448 params, a layer 592.
SHAPE = ModelShape.from_config(
    dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
         num_hidden_layers=2)
)  # fmt: skip
PSI, LAYER = 1448, 592


def cluster(**host: float) -> object:
    """One host of 8 devices, links of 1000 B/s and 0.1 s per ring step, no fixed costs; a host whose
    memory streams 1680 B/s and whose PCIe links move 100 B/s (efficiencies: link 1.0, memory 0.6)."""
    base = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=8, cores_per_host=None)
    spec = HostSpec(**{"memory_bytes": 1e9, "memory_bandwidth": 1680.0, "pcie_bandwidth": 100.0, **host})
    return dataclasses.replace(base, intra_host=LinkSpec(bandwidth=1000.0, latency=0.1), host=spec)


def cost_of(zero: ZeroConfig | None, layout: Layout, **host: float) -> object:
    node = PlanNode("n", "m", "train", 8, 4, 4, epochs=1, mini_batches=2, zero=zero)
    cm = CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster(**host))  # type: ignore[arg-type]
    return cm.node_cost("n", NodePlacement(tuple(range(layout.size)), layout))


def test_zero_memory_per_rank_golden() -> None:
    assert SHAPE.num_params == PSI and SHAPE.layer_params == LAYER and SHAPE.dtype_bytes == 2
    # ZeRO paper §5.1 with d = 2, w = 2, K = 12: stage 1 weights 2Ψ = 2896, gradients 2Ψ = 2896, optimizer
    # 12Ψ/2 = 8688; stages 1/2 add two buckets of min(Ψ, 5e8) · 2 bytes = 5792.
    one = zero_memory(PSI, LAYER, 2, 2, ZeroConfig(1))
    assert (one.weights, one.grads, one.optimizer, one.buckets, one.host) == (2896, 2896, 8688, 5792, 0)
    two = zero_memory(PSI, LAYER, 2, 2, ZeroConfig(2))  # gradients 2Ψ/2 = 1448
    assert (two.weights, two.grads, two.optimizer, two.buckets) == (2896, 1448, 8688, 5792)
    # stage 3: weights 2Ψ/2 + 2 gathered layers 2·592·2 = 1448 + 2368 = 3816, no buckets
    three = zero_memory(PSI, LAYER, 2, 2, ZeroConfig(3))
    assert (three.weights, three.grads, three.optimizer, three.buckets) == (3816, 1448, 8688, 0)
    # optimizer offload: host 12Ψ/2 + fp32 gradients 4Ψ/2 = 8688 + 2896 = 11584; device keeps weights only
    off = zero_memory(PSI, LAYER, 2, 2, ZeroConfig(3, offload_optimizer=True))
    assert (off.weights, off.grads, off.optimizer, off.host) == (3816, 0, 0, 11584)
    # + parameter offload: the device keeps the 2 gathered layers (2368), the host the partition (1448) too
    both = zero_memory(PSI, LAYER, 2, 2, ZeroConfig(3, offload_optimizer=True, offload_param=True))
    assert (both.weights, both.grads, both.optimizer, both.host) == (2368, 0, 0, 13032)
    # stage 1 accumulates whole gradients on the device even with its optimizer offloaded
    assert zero_memory(PSI, LAYER, 2, 2, ZeroConfig(1, offload_optimizer=True)).grads == 2896


def test_zero_memory_reaches_node_cost() -> None:
    m = cost_of(ZeroConfig(2), Layout(2, 1, 1, 1)).memory  # type: ignore[attr-defined]
    # buckets split: all-gather bucket with the weights, reduce bucket with the gradients (2896 each)
    assert (m.weights, m.grads, m.optimizer, m.host) == (2896 + 2896, 1448 + 2896, 8688, 0)
    m = cost_of(ZeroConfig(3, True, True), Layout(2, 1, 1, 1)).memory  # type: ignore[attr-defined]
    assert (m.weights, m.grads, m.optimizer, m.host) == (2368, 0, 0, 13032)
    assert m.peak == m.weights + m.activations  # offloaded state is not on the device


def test_zero_collectives_per_stage_golden() -> None:
    # d2, 2 micro-batches, 2 steps (mini-batches): calls = 4. Per layer bucket (3 messages) of Ψ·2 = 2896
    # bytes: all-gather = reduce-scatter = 3·0.1 + 0.5·2896/1000 = 1.748 s; per step 2 all-reduces of 8 B
    # = 2·0.2 + 16/1000 = 0.416 s.
    lay = Layout(2, 1, 1, 2)
    # stage 1: per step one reduce-scatter + one all-gather: 2·3.496 + 2·0.416 = 7.824
    assert cost_of(ZeroConfig(1), lay).dp_comm_s == pytest.approx(7.824)  # type: ignore[attr-defined]
    # stage 2: a reduce-scatter per micro-batch, an all-gather per step: 4·1.748 + 2·1.748 + 0.832 = 11.32
    assert cost_of(ZeroConfig(2), lay).dp_comm_s == pytest.approx(11.32)  # type: ignore[attr-defined]
    # stage 3 (as FSDP2): 2 gathers + 1 scatter per micro-batch: 4·5.244 + 0.832 = 21.808
    assert cost_of(ZeroConfig(3), lay).dp_comm_s == pytest.approx(21.808)  # type: ignore[attr-defined]
    assert cost_of(None, lay).dp_comm_s == pytest.approx(21.808)  # type: ignore[attr-defined]


def test_cpu_offload_time_golden() -> None:
    lay = Layout(2, 1, 1, 2)  # partition 724 params per rank, 4 micro-batches, 2 steps
    off = cost_of(ZeroConfig(3, offload_optimizer=True), lay)
    # gradient partitions to the host per micro-batch (4·2·724 B) and new weights back per step (2·724·2 B)
    # over 100 B/s: (5792 + 2896)/100 = 86.88 s
    assert off.offload_s == pytest.approx(86.88)  # type: ignore[attr-defined]
    # CPU Adam: 724 params · 28 B at 1680·0.6 / 2 ranks = 504 B/s: 40.222 s per step, 2 steps
    assert off.optimizer_s == pytest.approx(2 * 724 * 28 / 504)  # type: ignore[attr-defined]
    both = cost_of(ZeroConfig(3, offload_optimizer=True, offload_param=True), lay)
    # + the weight partition to the device before each gather: 2 per micro-batch · 4 · 724·2 B / 100 B/s
    assert both.offload_s == pytest.approx(86.88 + 8 * 1448 / 100)  # type: ignore[attr-defined]
    assert cost_of(ZeroConfig(3), lay).offload_s == 0.0  # type: ignore[attr-defined]


def test_zero_bad_settings_and_layouts() -> None:
    with pytest.raises(PlanError, match="zero_stage 4"):
        ZeroConfig(4)
    with pytest.raises(PlanError, match="offload_param needs zero_stage 3"):
        ZeroConfig(2, offload_param=True)
    with pytest.raises(PlanError, match="train nodes only"):
        PlanNode("g", "m", "generate", 8, 4, 4, zero=ZeroConfig(3))
    with pytest.raises(PlanError, match=r"node 'n'.*DeepSpeed ZeRO \(zero3\) runs with tensor and pipeline"):
        cost_of(ZeroConfig(3), Layout(1, 2, 1, 1))
    gpu = dataclasses.replace(cluster(), host=None)  # type: ignore[type-var]
    node = PlanNode("n", "m", "train", 8, 4, 4, mini_batches=2, zero=ZeroConfig(3, offload_optimizer=True))
    with pytest.raises(PlanError, match="CPU offload needs a 'host' section"):
        CostModel(PlanProblem({"m": SHAPE}, (node,)), gpu).node_cost("n", NodePlacement((0, 1), Layout(2)))


def test_presets_have_a_host_and_offload_fills_it() -> None:
    h100 = load_cluster("h100-8x", hosts=2)
    assert h100.host == HostSpec(2.0e12, 614.4e9, 64.0e9)
    problem = ppo_problem("7b", "7b", zero=ZeroConfig(3, offload_optimizer=True))
    plan = {n.name: NodePlacement(tuple(range(16)), Layout(16, 1, 1, 4)) for n in problem.nodes}
    per_host = host_offload(CostModel(problem, h100), plan)
    # two 7B models' optimizer state + fp32 gradients (16 B/param) split over 16 ranks, 8 per host
    psi = problem.models["actor"].num_params, problem.models["critic"].num_params
    assert per_host == {0: pytest.approx(8 * 16 * sum(psi) / 16), 1: pytest.approx(8 * 16 * sum(psi) / 16)}
    # a host too small for the offloaded state makes the plan overflow
    small = dataclasses.replace(h100, host=HostSpec(10e9, 614.4e9, 64.0e9))
    assert Searcher(problem, small).evaluate(plan)[2] > 0


def test_cluster_file_host_section_is_checked() -> None:

    base = {
        "devices_per_host": 8,
        "device": {"name": "g", "memory_bytes": 8e10, "peak_flops": 1e15, "memory_bandwidth": 3e12},
        "intra_host": {"bandwidth": 4.5e11, "latency": 3e-6},
        "inter_host": {"bandwidth": 5e10, "latency": 1e-5},
    }
    host = {"memory_bytes": 2e12, "memory_bandwidth": 6e11, "pcie_bandwidth": 6.4e10}
    assert cluster_from_mapping({**base, "host": host}).host == HostSpec(2e12, 6e11, 6.4e10)
    with pytest.raises(PlanError, match=r"c.yaml: host.pcie_bandwidth: missing required key"):
        cluster_from_mapping({**base, "host": {"memory_bytes": 2e12, "memory_bandwidth": 6e11}}, "c.yaml")
    with pytest.raises(PlanError, match=r"c.yaml: host.memory_bytes: must be positive"):
        cluster_from_mapping({**base, "host": {**host, "memory_bytes": 0}}, "c.yaml")


def test_graph_deepspeed_settings_reach_the_cost_model() -> None:
    """``engine: deepspeed`` with its ZeRO settings on a graph's train node becomes ``PlanNode.zero`` and
    prices the node's state: optimizer state and fp32 gradients offloaded to the host, which the CPU
    launch check counts (a CPU worker's host is the machine itself)."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.cluster_files import local_cluster
    from rlflow.schedulers.planner.graph_problem import problem_from_graph
    from rlflow.schedulers.planner.resources import MachineMemory, check_plan_memory

    ds = ["nodes.actor_train.engine=deepspeed", "nodes.actor_train.deepspeed.zero_stage=3"]
    off = [*ds, "nodes.actor_train.deepspeed.offload_optimizer=cpu"]
    graph = load_graph("examples/grpo.yaml", off)
    problem = problem_from_graph(graph)
    assert problem.node("actor_train").zero == ZeroConfig(3, offload_optimizer=True)
    assert problem.node("actor_gen").zero is None
    cost = CostModel(problem, local_cluster(1))
    plan = {n.name: graph.placement(n.name) for n in problem.nodes}
    mem = cost.node_cost("actor_train", plan["actor_train"]).memory
    psi = problem.models["actor"].num_params
    assert (mem.optimizer, mem.grads) == (0, 0)
    assert mem.host == pytest.approx(16 * psi)  # d = 1: Adam state 12 B + fp32 gradients 4 B per parameter
    assert host_offload(cost, plan) == {0: pytest.approx(16 * psi)}
    on_device = sum(c.nbytes for cs in device_consumers(cost, plan).values() for c in cs)
    with pytest.raises(PlanError, match="the plan needs"):  # fits without the offloaded state, not with it
        check_plan_memory(graph, MachineMemory(on_device + 8 * psi))
    check_plan_memory(graph, MachineMemory(on_device + 17 * psi))
