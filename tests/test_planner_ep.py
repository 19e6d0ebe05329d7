"""The planner prices and searches expert parallelism (issue 34, "Expert parallelism" and "Planner"): a layout
with ep > 1 holds E/ep experts whole per device and leaves the rest to FSDP2, pays the token dispatch per
sparse layer per micro-batch, and the search tries every legal ep for a mixture of experts (none for a dense
model), taking ep > 1 where memory forces it. Numbers derived by hand in the docstrings.

Reproduce: ``python -m pytest -q tests/test_planner_ep.py``.
"""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.cluster import ClusterSpec, LinkSpec
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.expert_cost import expert_device_groups, expert_split, routed_expert_params
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.runtime.distributed.experts import ep_groups

# 2 sparse layers, hidden 64, 4 heads (2 kv) of 16, 8 experts of width 32, top-2, vocabulary 16, untied, bf16.
# A layer: q 64·64 + k, v 32·64 each + o 64·64 = 12,288; norms 2·64 = 128; router 8·64 = 512; experts
# 8 · 3·64·32 = 49,152: 62,080. Embedding and head 16·64 each + final norm 64: 2,112. Ψ = 126,272,
# Ψₑ = 2 · 49,152 = 98,304 routed-expert parameters.
MOE = ModelShape(64, 128, 2, 4, 2, 16, num_experts=8, experts_per_token=2, moe_intermediate_size=32)
DENSE = ModelShape(64, 128, 2, 4, 2, 16)
ONE_LAYER = ModelShape(64, 128, 1, 4, 2, 16, num_experts=8, experts_per_token=2, moe_intermediate_size=32)


def _cluster(devices: int = 2, memory: float = 80e9) -> ClusterSpec:
    """One host of ``devices`` H100s, memory ``memory / 0.9`` (capacity ``memory``), every collective on
    one link of 100 GB/s and 10 µs at efficiency 1, no fixed costs."""
    base = load_cluster("h100-8x")
    return dataclasses.replace(
        base,
        hosts=1,
        devices_per_host=devices,
        device=dataclasses.replace(base.device, memory_bytes=memory / base.usable_memory_fraction),
        intra_host=LinkSpec(1e11, 1e-5),
        collectives={},
        efficiency=dataclasses.replace(base.efficiency, link=1.0),
    )


def _train(rows: int = 4) -> PlanNode:
    return PlanNode("tr", "m", "train", rows, 8, 8, mini_batches=1)


def _infer(rows: int = 4) -> PlanNode:
    return PlanNode("inf", "m", "inference", rows, 8, 8)


def test_counts_and_groups_by_hand() -> None:
    assert MOE.num_params == 126_272 and routed_expert_params(MOE) == 98_304
    assert routed_expert_params(DENSE) == 0
    one, two = expert_split(MOE, Layout(2, 1, 1, 1)), expert_split(MOE, Layout(2, 1, 1, 1, 2))
    assert (one.dense, one.experts, one.unit) == (126_272, 0.0, 62_080)
    # ep 2: the rest 126,272 − 98,304 = 27,968; 4 of 8 experts per device: 49,152; a unit 62,080 − 49,152
    assert (two.dense, two.experts, two.unit) == (27_968, 49_152, 12_928)
    # experts are replicated over tp: the rest is over t, the experts are not
    wide = expert_split(MOE, Layout(2, 2, 1, 1, 2))
    assert (wide.dense, wide.experts, wide.unit) == (126_272 / 2 - 98_304 / 2, 49_152, 12_928 / 2)
    # ep 1 under tp: tensor parallel splits the rest, not the experts (each layer gathered with all 8)
    tp1 = expert_split(MOE, Layout(1, 2, 1, 1))
    assert (tp1.dense, tp1.experts, tp1.unit) == (126_272 / 2 + 98_304 / 2, 0.0, 12_928 / 2 + 49_152)
    # pp 2 × tp 2: a stage holds one layer and the embedding (or the head) and norm, 62,080 + 1,088, over 2,
    # but its layer's 49,152 experts whole: 31,584 − 24,576 + 49,152
    assert expert_split(MOE, Layout(1, 2, 2, 1)).dense == 56_160
    # the runtime's groups: ep consecutive dp ranks (tp innermost), edp the same position in each
    place = NodePlacement(tuple(range(8)), Layout(4, 2, 1, 1, 2))
    assert expert_device_groups(place) == ((0, 2), (0, 4))
    for dp, ep in ((4, 2), (8, 4), (8, 8), (6, 3)):
        eps, edps = ep_groups(tuple(range(dp)), ep)
        place = NodePlacement(tuple(range(dp)), Layout(dp, 1, 1, 1, ep))
        assert expert_device_groups(place) == (eps[0], edps[0])


def test_train_memory_per_rank_ep2_vs_ep1() -> None:
    """d2 train, bf16 (w 2, grads 2, Adam 12 bytes). ep 1: FSDP2 shards all 126,272 parameters over 2 ranks
    and gathers two whole layers: weights 126,272 + 2·62,080·2 = 374,592; grads 126,272; Adam 757,632.
    ep 2: the rest 27,968 sharded, 49,152 experts whole, two gathered layers without their experts:
    weights 27,968 + 98,304 + 2·12,928·2 = 177,984; grads (13,984 + 49,152)·2 = 126,272; Adam 757,632.
    Activations: the same per rank (each ep rank receives as many routed copies as it sends), plus one
    layer's dispatch buffers in flight at ep 2: 2 rows of 16 tokens per rank, 2·32·2·64·2 = 16,384 bytes."""
    cm = CostModel(PlanProblem({"m": MOE}, (_train(),)), _cluster())
    one = cm.node_cost("tr", NodePlacement((0, 1), Layout(2, 1, 1, 1))).memory
    two = cm.node_cost("tr", NodePlacement((0, 1), Layout(2, 1, 1, 1, 2))).memory
    assert (one.weights, one.grads, one.optimizer) == (374_592, 126_272, 757_632)
    assert (two.weights, two.grads, two.optimizer) == (177_984, 126_272, 757_632)
    assert two.activations - one.activations == 16_384
    # an inference node: replicas hold the whole model at ep 1, the rest + 4 of 8 experts at ep 2
    cm = CostModel(PlanProblem({"m": MOE}, (_infer(),)), _cluster())
    assert cm.node_cost("inf", NodePlacement((0, 1), Layout(2, 1, 1, 1))).memory.weights == 252_544
    assert cm.node_cost("inf", NodePlacement((0, 1), Layout(2, 1, 1, 1, 2))).memory.weights == 154_240


def test_all_to_all_seconds_in_a_priced_call() -> None:
    """4 rows of 8 + 8 tokens over d2, one micro-batch: 2 rows, 32 tokens per rank. Per sparse layer and
    forward at ep 2 on 100 GB/s, 10 µs: dispatch sends 32·2·64·2 = 8,192 bytes, half off-rank, 10 µs +
    4,096 / 1e11 s each way (two: 20.08192 µs); the split counts and expert ids, 32·2·8/2 = 256 bytes off
    rank, 20 µs + 2.56 ns. Inference: 2 layers · 40.08448 µs = 80.16896 µs. Train (one pass with a backward:
    the two all-to-alls' gradients too, the ids not): 2 · (40.16384 + 20.00256) µs = 120.3328 µs, and no
    expert-gradient all-reduce (dp = ep: each expert on one rank)."""
    place = NodePlacement((0, 1), Layout(2, 1, 1, 1, 2))
    inf = CostModel(PlanProblem({"m": MOE}, (_infer(),)), _cluster()).node_cost("inf", place)
    assert inf.ep_comm_s == pytest.approx(80.16896e-6)
    tr = CostModel(PlanProblem({"m": MOE}, (_train(),)), _cluster()).node_cost("tr", place)
    assert tr.ep_comm_s == pytest.approx(120.3328e-6)
    at_one = CostModel(PlanProblem({"m": MOE}, (_train(),)), _cluster())
    assert at_one.node_cost("tr", NodePlacement((0, 1), Layout(2, 1, 1, 1))).ep_comm_s == 0.0
    # d4 e2: two ranks hold each expert, whose gradients (2 layers × 2 tensors, 49,152 params · 2 bytes)
    # are all-reduced once per step over them: a ring all-reduce of 98,304 bytes on 2 ranks
    cluster = _cluster(4)
    four = CostModel(PlanProblem({"m": MOE}, (_train(8),)), cluster)
    cost = four.node_cost("tr", NodePlacement((0, 1, 2, 3), Layout(4, 1, 1, 1, 2)))
    grads = 4 * cluster.collective_time("all_reduce", 0.0, (0, 2))
    grads += cluster.collective_time("all_reduce", 98_304, (0, 2)) - cluster.collective_time(
        "all_reduce", 0.0, (0, 2)
    )
    assert cost.ep_comm_s == pytest.approx(120.3328e-6 + grads)


@pytest.mark.parametrize("kind", ["train", "inference"])
def test_search_chooses_ep_where_memory_forces_it(kind: str) -> None:
    """One sparse layer (no pipeline stages), capacity 5 % above the d2e2 peak (one row per rank: one
    micro-batch count): no ep 1 layout fits (d2: every expert per replica, or the whole layer gathered twice;
    d1t2: the experts whole on each tp rank; one device: all of it), so the search takes ep 2; the plan's
    layout says so (``d2t1p1e2m1``)."""
    node = _train(2) if kind == "train" else _infer(2)
    cm = CostModel(PlanProblem({"m": ONE_LAYER}, (node,)), _cluster())
    peak1 = cm.node_cost(node, NodePlacement((0, 1), Layout(2, 1, 1, 1))).memory.peak
    peak2 = cm.node_cost(node, NodePlacement((0, 1), Layout(2, 1, 1, 1, 2))).memory.peak
    assert peak2 * 1.05 < peak1
    searcher = Searcher(PlanProblem({"m": ONE_LAYER}, (node,)), _cluster(memory=peak2 * 1.05))
    assert {c.layout.ep for c in searcher.candidates[node.name]} == {2}
    plan = searcher.search(restarts=1, steps=20).plan[node.name]
    assert plan.layout.ep == 2 and str(plan.layout) == "d2t1p1e2m1"


def test_no_ep_for_a_dense_model_or_vllm_generation() -> None:
    """A dense model gets no ep > 1 candidate (and the layout rule refuses one by name); nor does a vLLM
    generate node of a mixture of experts, while the built-in loop's does (its ep group decodes in
    lockstep)."""
    searcher = Searcher(PlanProblem({"m": DENSE}, (_train(),)), _cluster())
    assert {lay.ep for lay in searcher.layouts(_train(), 2)} == {1}
    assert searcher.search(restarts=1, steps=20).plan["tr"].layout.ep == 1
    assert "dense" in str(searcher.layout_problem(_train(), Layout(2, 1, 1, 1, 2)))
    moe = Searcher(PlanProblem({"m": MOE}, (_train(),)), _cluster())
    assert {lay.ep for lay in moe.layouts(_train(), 2)} == {1, 2}
    gen = PlanNode("gen", "m", "generate", 4, 8, 8)
    assert {lay.ep for lay in Searcher(PlanProblem({"m": MOE}, (gen,)), _cluster()).layouts(gen, 2)} == {1, 2}
    vllm = dataclasses.replace(gen, engine="vllm", engines=("vllm",))
    assert {lay.ep for lay in Searcher(PlanProblem({"m": MOE}, (vllm,)), _cluster()).layouts(vllm, 2)} == {1}
    with pytest.raises(PlanError, match="vLLM generate node runs without expert parallel"):
        CostModel(PlanProblem({"m": MOE}, (vllm,)), _cluster()).node_cost(
            vllm, NodePlacement((0, 1), Layout(2, 1, 1, 1, 2))
        )


def test_generation_at_ep2_pays_a_dispatch_per_forward_and_holds_half_the_experts() -> None:
    """The built-in loop at d2e2 against d2 on 2 devices, 4 prompts of 8 tokens, 8 new tokens (every row
    runs to the cap: no length mean), m = 1: b = 2 rows per rank.

    One forward's dispatch (``expert_cost.generation_dispatch_time``), ``x`` tokens per rank, 2 sparse
    layers: per layer the dispatch and combine all-to-alls, each 10 µs + (x·K·H·2 bytes / 2 off-rank)/1e11
    s, and the counts and ids exchanges, 2·10 µs + (x·K·8 / 2)/1e11 s; then the lockstep flag, a ring
    all-reduce of 8 bytes on 2 ranks: 2 steps of 10 µs + 8/1e11 s = 20.00008 µs.
    * a decode step of 1 row: 2·(20.00256 + 20.00008) + 20.00008 = 100.00536 µs;
    * a decode step of b = 2 rows: 2·(20.00512 + 20.00016) + 20.00008 = 100.01064 µs;
    * the prefill, 2 rows × 8 tokens = 16: 2·(20.04096 + 20.00128) + 20.00008 = 100.08456 µs, the node's
      ``ep_comm_s`` (one prefill per rank);
    * the decode: 8 − 1 = 7 steps of 2 rows (h100's launch-bound step is the same at both layouts):
      7 · 100.01064 = 700.07448 µs more than at d2;
    * weights per device: (Ψ − Ψₑ + Ψₑ/2)·2 bytes = (27,968 + 49,152)·2 = 154,240 (d2: 252,544)."""
    from rlflow.schedulers.planner.expert_cost import generation_dispatch_time

    c = _cluster()
    ep2, dp2 = NodePlacement((0, 1), Layout(2, 1, 1, 1, 2)), NodePlacement((0, 1), Layout(2, 1, 1, 1))
    assert generation_dispatch_time(c, MOE, ep2, 1, 1.0) == pytest.approx(100.00536e-6, rel=1e-12)
    assert generation_dispatch_time(c, MOE, ep2, 2, 1.0) == pytest.approx(100.01064e-6, rel=1e-12)
    assert generation_dispatch_time(c, MOE, dp2, 2, 1.0) == 0.0
    gen = PlanNode("gen", "m", "generate", 4, 8, 8)
    cm = CostModel(PlanProblem({"m": MOE}, (gen,)), c)
    with_ep, without = cm.node_cost(gen, ep2), cm.node_cost(gen, dp2)
    assert with_ep.ep_comm_s == pytest.approx(100.08456e-6, rel=1e-12) and without.ep_comm_s == 0.0
    assert with_ep.decode_s - without.decode_s == pytest.approx(700.07448e-6, rel=1e-9)
    assert with_ep.memory.weights == 154_240 and without.memory.weights == 252_544


def test_generation_at_ep2_decodes_as_long_as_its_slowest_rank() -> None:
    """Lockstep priced: 8 prompts at d2 m2 (b = 2 rows per call), responses of mean 4 capped at 8. At d2
    each replica's first call lasts the longest of its own 2 rows, E[max of 2]; at d2e2 the ep group's
    ranks decode together, so it lasts the longest of the group's 4, E[max of 4] (the last call is the
    slowest of all 4 rows at both). The steps' fixed cost (``Overheads.decode_s`` a step, t = 1) differs
    by (E[max of 4] − E[max of 2])·decode_s (``lengths.expected_longest``)."""
    from rlflow.schedulers.planner.lengths import expected_longest

    c = _cluster()
    gen = dataclasses.replace(PlanNode("gen", "m", "generate", 8, 8, 8), gen_mean=4.0)
    cm = CostModel(PlanProblem({"m": MOE}, (gen,)), c)
    ep2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 2, 2)))
    dp2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 2)))
    longer = expected_longest(4.0, 8, 4) - expected_longest(4.0, 8, 2)
    assert longer > 0.5
    assert ep2.overhead_s - dp2.overhead_s == pytest.approx(longer * c.overheads.decode_s, rel=1e-9)


def test_builtin_generation_holds_the_experts_whole_under_tp() -> None:
    """The built-in loop at d1t2 (tensor parallel leaves the fused experts whole on each rank): weights
    (126,272/2 + 98,304/2) · 2 = 224,576 bytes per device, not 126,272 (all of it over tp); its prefill
    computes the routed experts of every token on both ranks."""
    gen = PlanNode("gen", "m", "generate", 4, 8, 8)
    cm = CostModel(PlanProblem({"m": MOE}, (gen,)), _cluster())
    tp2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(1, 2, 1, 1)))
    dp2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 2)))
    assert tp2.memory.weights == 224_576 and dp2.memory.weights == 252_544
    dense = CostModel(PlanProblem({"m": DENSE}, (gen,)), _cluster())
    assert dense.node_cost(gen, NodePlacement((0, 1), Layout(1, 2, 1, 1))).memory.weights == DENSE.num_params


def test_ep_with_pipeline_stages_searched_and_priced() -> None:
    """d2p2e2 on 4 devices: each stage's 2 dp ranks form its ep group and dispatch its own sparse layer (one
    per stage). Per flush of m micro-batches the stages' dispatches cost Σ_s n_s + (m − 1)·max_s n_s = m + 1
    layer dispatches. Inference, 4 rows of 8 + 8 tokens, 2 rows per dp rank:
    * m = 1: 32 tokens per pass, 2 layer dispatches of 40.08448 µs (as at pp = 1 above): 80.16896 µs;
    * m = 2: 16 tokens per pass: 16·2·64·2 = 4,096 bytes half off-rank, 10 µs + 2,048 / 1e11 s each way
      (20.04096 µs), ids 16·2·8/2 = 128 bytes, 20 µs + 1.28 ns: 40.04224 µs a layer; 3 layer dispatches per
      flush: 120.12672 µs.
    The search offers ep 2 with pp 2 for a train node, and the layout rule lets it through."""
    cm = CostModel(PlanProblem({"m": MOE}, (_infer(),)), _cluster(4))
    devices = (0, 1, 2, 3)
    assert cm.node_cost("inf", NodePlacement(devices, Layout(2, 1, 2, 1, 2))).ep_comm_s == pytest.approx(
        80.16896e-6
    )
    assert cm.node_cost("inf", NodePlacement(devices, Layout(2, 1, 2, 2, 2))).ep_comm_s == pytest.approx(
        120.12672e-6
    )
    searcher = Searcher(PlanProblem({"m": MOE}, (_train(8),)), _cluster(4))
    assert any(lay.pp == 2 and lay.ep == 2 for lay in searcher.layouts(_train(8), 4))
    assert searcher.layout_problem(_train(8), Layout(2, 1, 2, 1, 2)) is None


def test_sync_from_ep_takes_the_planned_path() -> None:
    """A d2 train node syncing replicas on the same 2 devices, on links of 1000 B/s and 0.1 s a ring step
    (hashing free). ep 1: FSDP2 re-gathers every tensor over dp (21 tensors: 2.1 s of steps) and all Ψ·2 =
    252,544 bytes (ring on 2 ranks: half of them cross, 126.272 s); the shards are then local; verification
    2·0.1 + 0.5·256/1000 = 0.328 s: 128.7 s. ep 2 (train and replicas): the routed experts are ep shards,
    not re-gathered: (126,272 − 98,304)·2 bytes, 27.968 s; each rank's experts are already where the
    replicas need them (the plan is local copies): 30.396 s, where the gather path would broadcast the
    model."""
    base = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=8, cores_per_host=None)
    cluster = dataclasses.replace(base, intra_host=LinkSpec(bandwidth=1000.0, latency=0.1))
    nodes = (_infer(), _train())
    cm = CostModel(PlanProblem({"m": MOE}, nodes), cluster)
    for ep, seconds in ((1, 128.7), (2, 30.396)):
        plan = {n.name: NodePlacement((0, 1), Layout(2, 1, 1, 1, ep)) for n in nodes}
        assert cm.transfers.sync_targets("tr", plan) == [(plan["inf"], False)]
        assert cm.transfers.sync_time("tr", plan) == pytest.approx(seconds)
    # an ep 2 source into ep 1 replicas: each rank receives the 4 experts of each layer it lacks, once
    src, dst = NodePlacement((0, 1), Layout(2, 1, 1, 1, 2)), NodePlacement((0, 1), Layout(2, 1, 1, 1))
    assert cm.transfers.realloc_time("m", src, dst) > cm.transfers.realloc_time("m", dst, src)


def test_interrupted_generation_at_ep2_waits_for_the_group_in_each_segment() -> None:
    """The same node sampled in segments of 4 tokens (``interrupt_every``, staleness 1): segment 0 runs
    the m = 2 calls, whose first lasts the longest of the ep group's 4 rows over the window (tokens 1 to
    4) at d2e2 and of its own 2 at d2 (``lengths.window_longest``); later segments run one call (the
    slowest of all 4 rows at both). The steps' fixed cost differs by that window's difference times
    ``decode_s``."""
    from rlflow.schedulers.planner.lengths import window_longest

    c = _cluster()
    base = PlanNode("gen", "m", "generate", 8, 8, 8)
    gen = dataclasses.replace(base, gen_mean=4.0, staleness=1, interrupt_every=4, segments=2)
    cm = CostModel(PlanProblem({"m": MOE}, (gen,)), c)
    ep2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 2, 2)))
    dp2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 2)))
    longer = window_longest(4.0, 8, 4, 1, 4) - window_longest(4.0, 8, 2, 1, 4)
    assert longer > 0.1 and len(ep2.segment_s) == 2
    assert ep2.overhead_s - dp2.overhead_s == pytest.approx(longer * c.overheads.decode_s, rel=1e-9)


def test_interrupted_generation_at_ep2_pays_each_segments_prefill_dispatch() -> None:
    """The dispatch test's node (4 prompts of 8 tokens, 8 new tokens, every row to the cap, b = 2 rows per
    rank) sampled in segments of 4 tokens: segment 0 prefills 2 rows × 8 tokens (100.08456 µs, as there)
    and segment 1 prefills the same 2 rows again at 8 + 4 tokens, 24 per rank: per sparse layer the two
    all-to-alls 2·(10 + 24·2·64·2/2/1e5) = 20.06144 µs and the counts and ids 2·10 + (24·2·8/2)/1e5 =
    20.00192 µs, over 2 layers, plus the 20.00008 µs flag: 100.1268 µs. Each is in its segment's prefill
    seconds (``compute_s``), which d2 prices without them."""
    c = _cluster()
    base = PlanNode("gen", "m", "generate", 4, 8, 8)
    gen = dataclasses.replace(base, staleness=1, interrupt_every=4, segments=2)
    cm = CostModel(PlanProblem({"m": MOE}, (gen,)), c)
    ep2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 1, 2)))
    dp2 = cm.node_cost(gen, NodePlacement((0, 1), Layout(2, 1, 1, 1)))
    assert len(ep2.segment_s) == 2 and ep2.ep_comm_s == 0.0
    assert ep2.compute_s - dp2.compute_s == pytest.approx((100.08456 + 100.1268) * 1e-6, rel=1e-9)
