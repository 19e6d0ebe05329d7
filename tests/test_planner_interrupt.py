"""Interruptible generation (``interrupt_every``) priced call by call (``planner/segment_cost.py``):
hand-derived goldens for the segment length model, the built-in loop's and the vLLM engine's segment calls,
a graph's ``interrupt_every`` reaching the cost model, the simulator replaying each segment for its own
seconds, and ``rlflow plan`` saying how it priced them."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.commands.plan import length_model_lines
from rlflow.schedulers.planner.call_cost import forward_flops
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.lengths import (
    capped_exponential_rate,
    compacted_decode_s,
    expected_longest,
    segment_mean,
    survival,
    window_longest,
)
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.segment_cost import segment_warnings, segments_of
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.planner.simulator import simulate

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# 2 layers, hidden 8, intermediate 16, 4 heads (q width 8), 2 kv heads, vocab 16: a decode step reads 2896 B
# of weights and 2·L·kv_dim·w = 32 B of KV cache per row and context token (test_planner_lengths' shape)
SHAPE = ModelShape.from_config(
    dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
         num_hidden_layers=2)
)  # fmt: skip
BANDWIDTH = 3.35e12 * 0.7  # h100-8x: HBM bytes/s at the decode step's streaming efficiency


def roofline_h100() -> ClusterSpec:
    """h100-8x without the eager loop's kernel-launch bound, so a tiny model's steps are the roofline."""
    c = load_cluster("h100-8x")
    return dataclasses.replace(c, overheads=dataclasses.replace(c.overheads, launch_layer_s=0.0))


def test_segment_length_model_golden() -> None:
    # by hand, mean 100 far below the cap 1e5: λ = 1/100 (the cap's share e^{−1000} is nothing)
    assert capped_exponential_rate(100.0, 1e5) == pytest.approx(0.01, rel=1e-9)
    assert survival(100.0, 1e5, 100.0) == pytest.approx(math.exp(-1.0), rel=1e-9)
    assert survival(100.0, 200.0, 200.0) == 0.0  # at the cap every response has ended
    assert survival(64.0, 64.0, 10.0) == 1.0  # every response runs to the cap
    # what a response still going samples in a 50-token segment: ∫₀⁵⁰ e^{−x/100} dx = 100·(1 − e^{−1/2})
    assert segment_mean(100.0, 1e5, 50.0) == pytest.approx(100 * -math.expm1(-0.5), rel=1e-9)
    assert segment_mean(64.0, 64.0, 16.0) == 16.0
    # the longest of 2 rows between 0 and 50 tokens: ∫ 1 − (1 − e^{−x/100})² = ∫ 2e^{−x/100} − e^{−x/50}
    two = 200 * -math.expm1(-0.5) - 50 * -math.expm1(-1.0)
    assert window_longest(100.0, 1e5, 2, 0.0, 50.0) == pytest.approx(two, rel=1e-8)
    # windows that tile [0, G] add up to the whole call's expected longest row
    windows = [window_longest(300.0, 1000.0, 64, lo, lo + 250.0) for lo in (0.0, 250.0, 500.0, 750.0)]
    assert sum(windows) == pytest.approx(expected_longest(300.0, 1000.0, 64), rel=1e-6)
    assert window_longest(64.0, 64.0, 8, 16.0, 32.0) == 16.0  # every row to the cap: the window itself
    # a compacting loop's segments: the whole call's decode less each later segment's first token (its
    # prefill's); with one row per step costing 1 s that is ∫ over the boundaries' unit intervals
    row = compacted_decode_s(300.0, 1000.0, 8, 8, lambda live, s: 1.0)
    parts = [
        compacted_decode_s(300.0, 1000.0, 8, 8, lambda live, s: 1.0, lo, lo + 250.0)
        for lo in (0, 250, 500, 750)
    ]
    boundaries = sum(window_longest(300.0, 1000.0, 8, lo, lo + 1.0) for lo in (250.0, 500.0, 750.0))
    assert sum(parts) == pytest.approx(row - boundaries, rel=2e-3)


def _interrupted(mean: float, engine: str = "builtin", rows: int = 16, every: int = 16) -> PlanNode:
    """A generate node of ``rows`` rows, prompts of 4 tokens, responses up to 64, ``interrupt_every``
    ``every`` (64 / every segments) under staleness 1."""
    return PlanNode(
        "g", "m", "generate", rows, 4, 64, engine=engine, staleness=1, segments=-(-64 // every),
        interrupt_every=every, gen_mean=mean,
    )  # fmt: skip


def _price(node: PlanNode, cluster: ClusterSpec, layout: Layout | None = None) -> object:
    placement = NodePlacement(tuple(range(max(1, (layout or Layout()).dp))), layout or Layout())
    return CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster).node_cost("g", placement)


def test_builtin_loop_segments_golden() -> None:
    """Every response to the cap (no mean): 4 segments of 16 tokens, each a call of all 16 rows that
    prefills prompt + tokens so far (4, 20, 36, 52 tokens) and then steps 15 times (its first token is the
    prefill's): 60 steps in all, where one call steps 63 times."""
    cluster = roofline_h100()
    whole_node = dataclasses.replace(_interrupted(0.0), segments=1, interrupt_every=0)
    cut, whole = _price(_interrupted(0.0), cluster), _price(whole_node, cluster)
    # segment j's steps at s = 16j + 8 tokens in (the segment's mean): 2896 + 32·16·(4 + 16j + 8) bytes
    golden = sum(15 * (2896 + 512 * (4 + 16 * j + 8)) for j in range(4)) / BANDWIDTH
    assert cut.decode_s == pytest.approx(golden, rel=1e-9)
    assert whole.decode_s == pytest.approx(63 * (2896 + 512 * (4 + 32)) / BANDWIDTH, rel=1e-9)
    # prefills: forward_flops of 16 rows at each width, at the matmul rate of its tokens
    peak, eff = cluster.device.peak_flops, cluster.efficiency
    widths = (4, 20, 36, 52)
    prefill = sum(forward_flops(SHAPE, 16, w) / (peak * eff.matmul_at(16 * w)) for w in widths)
    assert cut.compute_s == pytest.approx(prefill, rel=1e-9)
    assert whole.compute_s == pytest.approx(
        forward_flops(SHAPE, 16, 4) / (peak * eff.matmul_at(64)), rel=1e-9
    )
    assert len(cut.segment_s) == 4 and sum(cut.segment_s) == pytest.approx(cut.time_s, rel=1e-12)
    assert whole.segment_s == ()


def test_builtin_loop_segments_step_the_live_rows() -> None:
    """Early ends (mean 8 of 64): each segment steps the rows still going, as one call would, from its
    second token: decode = [2896·Σ_j ∫_{16j+1}^{16j+16} P(max of 16 > s) ds + 512·Σ_j ∫ e^{−λs}·(4 + s) ds]
    / bandwidth (test_planner_lengths' derivation of the compacted loop, per window)."""
    lam = capped_exponential_rate(8.0, 64.0)

    def antiderivative(s: float) -> float:  # of e^{−λs}·(4 + s)
        return -math.exp(-lam * s) * ((4 + s) / lam + 1 / lam**2)

    def longest(lo: float, hi: float) -> float:  # ∫ 1 − (1 − e^{−λs})¹⁶ ds by the midpoint rule
        n = 4000
        h = (hi - lo) / n
        return h * sum(1 - (1 - math.exp(-lam * (lo + (i + 0.5) * h))) ** 16 for i in range(n))

    windows = [(16 * j + 1, 16 * j + 16) for j in range(4)]
    kv = sum(512 * (antiderivative(hi) - antiderivative(lo)) for lo, hi in windows)
    golden = (2896 * sum(longest(lo, hi) for lo, hi in windows) + kv) / BANDWIDTH
    assert _price(_interrupted(8.0), roofline_h100()).decode_s == pytest.approx(golden, rel=2e-3)


def test_segments_after_the_first_run_on_one_micro_batch() -> None:
    """The built-in loop splits a segment's rows into m micro-batches only when they divide by m: segment 0
    on the layout's m, the survivors of later ones on one (segment_cost.py)."""
    node = _interrupted(8.0)
    segs = segments_of(node, 16, 4)
    assert [s.calls for s in segs] == [4, 1, 1, 1]
    assert [s.rows for s in segs] == [4.0, 16.0, 16.0, 16.0]
    lam = capped_exponential_rate(8.0, 64.0)
    assert [s.alive for s in segs] == pytest.approx([1.0] + [math.exp(-lam * 16 * j) for j in (1, 2, 3)])
    # the call of segment j samples unless none of the node's 16 rows is still going
    assert segs[2].runs == pytest.approx(1 - (1 - math.exp(-lam * 32)) ** 16)


def test_vllm_segments_golden() -> None:
    """On vLLM, each segment an engine call of the rows still going (every response to the cap: all 16):
    15 decode steps of 16 rows at context 4 + 16j + 8, its prefill over prompt + tokens so far."""
    cluster = roofline_h100()
    cut = _price(_interrupted(0.0, "vllm"), cluster)
    golden = sum(15 * (2896 + 512 * (4 + 16 * j + 8)) for j in range(4)) / BANDWIDTH
    assert cut.decode_s == pytest.approx(golden, rel=1e-9)
    rates = cluster.engine_rates()
    peak, eff = cluster.device.peak_flops, cluster.efficiency
    roofline = sum(forward_flops(SHAPE, 16, w) / (peak * eff.matmul_at(16 * w)) for w in (4, 20, 36, 52))
    assert cut.compute_s == pytest.approx(rates.prefill_scale * roofline, rel=1e-9)
    # the engine's fixed costs once per segment: its call, and per step
    whole = _price(dataclasses.replace(_interrupted(0.0, "vllm"), segments=1, interrupt_every=0), cluster)
    assert cut.overhead_s - whole.overhead_s == pytest.approx(
        3 * rates.prefill_call_s + (60 - 63) * (rates.decode_step_s + 16 * rates.decode_row_s), abs=1e-12
    )


def test_graph_interrupt_reaches_the_cost_model_and_the_replay() -> None:
    """A graph's interrupt_every reaches the planner (PlanNode), its segments are priced as calls of their
    own, and the simulator replays each for its own seconds plus its round trip."""
    over = ["nodes.actor_gen.staleness=1", "nodes.actor_gen.interrupt_every=4", "run.devices=2", "plan=auto"]
    graph = load_graph(str(EXAMPLES / "grpo.yaml"), over)
    problem = problem_from_graph(graph, device_type="cuda")
    gen = problem.node("actor_gen")
    assert (gen.interrupt_every, gen.segments) == (4, graph.segments("actor_gen"))
    cost = CostModel(problem, load_cluster("h100-8x", hosts=1))  # no processor sharing on GPUs
    plan = {n.name: NodePlacement((0,) if n.kind == "generate" else (1,), Layout()) for n in problem.nodes}
    nc = cost.node_cost(gen, plan["actor_gen"])
    assert len(nc.segment_s) == gen.segments > 1
    timeline = simulate(cost, plan)
    spans = sorted({round(e.end_s - e.start_s, 12) for e in timeline.events if e.node == "actor_gen"})
    assert spans == sorted({round(s, 12) for s in nc.segment_s})
    # rlflow plan's length-model line says how it priced them
    (line,) = length_model_lines(SimpleNamespace(problem=problem), plan, given=False)  # type: ignore[arg-type]
    assert f"interrupted every 4 tokens: {gen.segments} calls per iteration" in line


def test_what_the_segments_cannot_price_is_warned() -> None:
    """Segments reading the version of the segment before them (j >= η + 1: the schedule caps a segment's
    version at k - 1) see no weight load between them, so vLLM's prefix cache may hold their prompts;
    the planner prices their prefill in full and says so (segment_cost.segment_warnings)."""
    node = _interrupted(8.0, "vllm")  # staleness 1, 4 segments: segments 2 and 3 repeat a version
    (line,) = segment_warnings([node])
    assert line.startswith("nodes.g.interrupt_every: 16 tokens make 4 segments, more than staleness 1 + 1: ")
    assert "segments 2 to 3 read the version the segment before them read" in line
    assert segment_warnings([dataclasses.replace(node, staleness=3)]) == []  # each segment a new version
    assert segment_warnings([_interrupted(8.0)]) == []  # the built-in loop keeps no prefix cache


def test_every_segment_pays_its_round_trip() -> None:
    """Each segment is a command: the controller's fixed round trip (``Overheads.dispatch_s``) J times, the
    batch's bytes once. Replayed as one task (generation sharing its device with training: no overlap
    credited) the node's span holds the J − 1 extra round trips."""
    over = ["nodes.actor_gen.staleness=1", "nodes.actor_gen.interrupt_every=4", "run.devices=1", "plan=auto"]
    problem = problem_from_graph(load_graph(str(EXAMPLES / "grpo.yaml"), over), device_type="cuda")
    h100 = load_cluster("h100-8x", hosts=1)
    cluster = dataclasses.replace(h100, overheads=dataclasses.replace(h100.overheads, dispatch_s=0.01))
    cost = CostModel(problem, cluster)
    plan = {n.name: NodePlacement((0,), Layout()) for n in problem.nodes}  # everything on device 0
    gen = problem.node("actor_gen")
    nc = cost.node_cost(gen, plan["actor_gen"])
    (span,) = {round(e.end_s - e.start_s, 12) for e in simulate(cost, plan).events if e.node == "actor_gen"}
    assert span == pytest.approx(nc.time_s + (gen.segments - 1) * 0.01, rel=1e-9)
