"""Issue 33: the planner prices token-budget micro-batches (``max_tokens_per_micro_batch``) from the length
model: packed real tokens in ``⌈N / β⌉`` micro-batches, activation memory bounded by the budget, one
micro-batch per layout; and the padded path's micro-batches at their own longest rows."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner import call_cost
from rlflow.schedulers.planner.call_cost import (
    NodeCost,
    micro_batch_work,
    packed_attention_varlen,
    token_flops,
)
from rlflow.schedulers.planner.candidates import SearchSpace
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.lengths import capped_exponential_rate, expected_longest, expected_square
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.shapes import ModelShape

# 2 layers, hidden 8, intermediate 16, 4 heads (q width 8), 2 kv heads (kv width 4), vocab 16:
# layer_params = 2·q·h + 2·kv·h + 3·h·i + 2·h = 128 + 64 + 384 + 16 = 592; head_params = 16·8 = 128.
SHAPE = ModelShape.from_config(
    dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
         num_hidden_layers=2)
)  # fmt: skip
# a wider model (hidden 256), where the matmuls outweigh attention
WIDE = ModelShape.from_config(
    dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
         vocab_size=512, num_hidden_layers=2)
)  # fmt: skip


def _node(kind: str = "inference", budget: int | None = 64, **kw: object) -> PlanNode:
    """8 rows of a 16-token padded prompt (10 real on average) and responses of mean 20 capped at 64."""
    args: dict = dict(rows=8, prompt_len=16, gen_len=64, prompt_mean=10.0, gen_mean=20.0) | kw
    return PlanNode("n", "m", kind, max_tokens_per_micro_batch=budget, **args)


def _cost(node: PlanNode, cluster: str = "cpu-local", m: int = 1, shape: ModelShape = SHAPE) -> NodeCost:
    model = CostModel(PlanProblem({"m": shape}, (node,)), load_cluster(cluster))
    return model.node_cost(node.name, NodePlacement((0,), Layout(micro_batches=m)))


def test_expected_square_golden() -> None:
    # uncapped exponential (cap far in the tail): E[X²] = 2μ²
    assert expected_square(100.0, 1e5) == pytest.approx(2 * 100.0**2, rel=1e-9)
    # no early ends: every response at the cap
    assert expected_square(64.0, 64.0) == 64.0**2
    # capped: ∫₀^G 2x·e^{−λx} dx = (2/λ²)(1 − e^{−λG}(1 + λG)), between μ² (Jensen) and G·μ (X ≤ G)
    lam = capped_exponential_rate(20.0, 64.0)
    closed = 2 / lam**2 * (1 - math.exp(-lam * 64) * (1 + lam * 64))
    assert expected_square(20.0, 64.0) == pytest.approx(closed, rel=1e-12)
    assert 20.0**2 < expected_square(20.0, 64.0) < 64 * 20.0


@pytest.fixture
def varlen(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashAttention-2's varlen kernel on CUDA, as where ``flash_attn`` is installed."""
    monkeypatch.setattr(call_cost, "packed_attention_varlen", lambda device, nbytes: device == "cuda")


def test_packed_attention_runs_per_sequence_only_with_varlen_kernels() -> None:
    assert not packed_attention_varlen("cpu", 2)
    assert not packed_attention_varlen("cuda", 4)  # FlashAttention-2 runs fp16/bf16 models only
    assert packed_attention_varlen("cuda", 2) == (importlib.util.find_spec("flash_attn") is not None)


def test_budgeted_inference_golden(varlen: None) -> None:
    """One priced call derived by hand: 8 rows of 10 + 20 = 30 real tokens on one CPU rank, budget 64."""
    cluster = load_cluster("cpu-local")
    work = micro_batch_work(_node(), SHAPE, 1, 1, "cpu")
    # N = 8·30 = 240 tokens; ⌈240/64⌉ = 4 micro-batches of 60 tokens (≤ 8 rows: rows whole)
    assert (work.count, work.tokens, work.rows) == (4, 60.0, 2.0)
    # CPU: a dense [60, 60] block-diagonal mask, every score computed
    assert work.squares == 3600.0
    # FLOPs per micro-batch: 2·60·(2·592 + 128) + 4·3600·8·2 = 157440 + 230400 = 387840; 4 of them
    assert token_flops(SHAPE, 60, 3600) == 387840.0
    cost = _cost(_node())
    eff = cluster.efficiency.matmul_at(60.0)  # at 60 tokens per micro-batch
    assert cost.compute_s == pytest.approx(4 * 387840 / (cluster.device.peak_flops * eff), rel=1e-12)
    # memory: one micro-batch of min(64, 8·(16 + 64)) = 64 tokens, one row of them; per layer (t = 1)
    # N·(H·26 + 8·Q + 5·a·N) = 64·(208 + 64 + 1280) = 99328, fp32 logits 4·64·16 = 4096
    assert cost.memory.activations == 99328 + 4096
    # varlen attention (CUDA, flash_attn) per sequence, Σ s² = (60/30)·(P̄² + 2·P̄·R̄ + E[R²]) per micro-batch
    cuda = micro_batch_work(_node(), SHAPE, 1, 1, "cuda")
    assert cuda.squares == pytest.approx(2 * (100 + 2 * 10 * 20 + expected_square(20.0, 64.0)))


def test_padded_path_prices_each_micro_batch_at_its_longest_row() -> None:
    """Without a budget a micro-batch of b rows computes the padded prompt plus the expected longest of b
    responses (the length model's capped exponential), at every row: b·S tokens, b·S² attention."""
    for m in (1, 2, 8):
        work = micro_batch_work(_node(budget=None), SHAPE, 1, m, "cpu")
        b = 8 / m
        seq = 16 + expected_longest(20.0, 64.0, b)
        assert (work.count, work.rows) == (m, b)
        assert work.tokens == pytest.approx(b * seq)
        assert work.squares == pytest.approx(b * seq * seq)
        assert work.peak_seq == pytest.approx(16 + expected_longest(20.0, 64.0, 8))  # the rank's longest


@pytest.mark.parametrize("kind", ["inference", "train"])
@pytest.mark.parametrize("cluster", ["cpu-local", "h100-8x"])
def test_budget_prices_less_time_than_padding_with_mixed_lengths(kind: str, cluster: str) -> None:
    """Mixed lengths (mean 20 of a 64 cap, prompts 10 of 16 real): packed micro-batches compute fewer
    tokens than the padded ones at the same micro-batch count."""
    row = 10 + 20
    for m in (1, 2, 4):
        budget = math.ceil(8 * row / m)  # the budget that cuts 8 rows into m micro-batches
        packed = _cost(_node(kind, budget), cluster, shape=WIDE)
        padded = _cost(_node(kind, None), cluster, m=m, shape=WIDE)
        assert micro_batch_work(_node(kind, budget), WIDE, 1, 1, "cpu").count == m
        assert packed.compute_s < padded.compute_s
        assert packed.time_s < padded.time_s


def test_equal_lengths_price_packing_as_padding_with_varlen_attention(varlen: None) -> None:
    """Every row at the cap and every prompt at its width: nothing to save; with varlen attention (on a
    GPU cluster) the packed call prices exactly the padded one, and a dense block-diagonal mask (on CPU)
    prices more attention (the N² scores it computes)."""
    # prompt_mean and gen_mean 0: prompt_len and gen_len for every row
    packed = _node(budget=80 * 8, prompt_mean=0.0, gen_mean=0.0)
    padded = _node(budget=None, prompt_mean=0.0, gen_mean=0.0)
    assert _cost(packed, "h100-8x").compute_s == pytest.approx(_cost(padded, "h100-8x").compute_s)
    assert _cost(packed, "cpu-local").compute_s > _cost(padded, "cpu-local").compute_s


def test_activation_memory_respects_the_budget() -> None:
    """A budgeted micro-batch's activations are those of the budget's tokens, whatever the rows."""
    for kind in ("inference", "train"):
        small, large = _cost(_node(kind, 96)), _cost(_node(kind, 320))
        assert small.memory.activations < large.memory.activations
        assert _cost(_node(kind, 96, rows=64)).memory.activations == small.memory.activations
        padded = _cost(_node(kind, None))  # 8 rows at the rank's longest response
        assert small.memory.activations < padded.memory.activations
    # train: the same layer formula for the budget's 96 tokens, fp32 logits and their gradient
    per_layer = 96 * (8 * 26 + 8 * 8 + 5 * 4 * 96)
    assert _cost(_node("train", 96)).memory.activations == 2 * per_layer + 2 * 4 * 96 * 16
    # a rank whose rows hold fewer tokens than the budget: its rows' widest extent, 8·80 = 640
    assert _cost(_node("train", 4096)).memory.activations == _cost(_node("train", 640)).memory.activations


def test_candidates_keep_one_micro_batch_and_stage_for_budgeted_nodes() -> None:
    cluster = dataclasses.replace(load_cluster("cpu-local"), devices_per_host=4)
    nodes = (
        PlanNode("a", "m", "train", 64, 16, 64, gen_mean=20.0, max_tokens_per_micro_batch=256),
        PlanNode("b", "m", "train", 64, 16, 64, gen_mean=20.0),
    )
    problem = PlanProblem({"m": SHAPE}, nodes)
    space = SearchSpace(problem, cluster, CostModel(problem, cluster), layouts_per_mesh=20)
    budgeted = {c.layout for c in space.candidates["a"]}
    assert budgeted and all(lay.micro_batches == 1 and lay.pp == 1 for lay in budgeted)
    assert any(lay.micro_batches > 1 for lay in (c.layout for c in space.candidates["b"]))


def test_plans_with_micro_batches_or_stages_under_a_budget_are_refused() -> None:
    node = _node("train", 256)
    cm = CostModel(PlanProblem({"m": SHAPE}, (node,)), load_cluster("cpu-local"))
    assert cm.layout_problem(node, Layout()) is None
    for layout in (Layout(micro_batches=2), Layout(pp=2)):
        why = cm.layout_problem(node, layout)
        assert why is not None and "max_tokens_per_micro_batch=256" in why
        with pytest.raises(PlanError, match="max_tokens_per_micro_batch"):
            cm.node_cost("n", NodePlacement((0, 1)[: layout.pp], layout))


def test_budget_on_a_generate_node_is_an_error() -> None:
    with pytest.raises(PlanError, match="max_tokens_per_micro_batch"):
        PlanNode("g", "m", "generate", 8, 16, 64, max_tokens_per_micro_batch=128)
    with pytest.raises(PlanError, match="max_tokens_per_micro_batch"):
        PlanNode("t", "m", "train", 8, 16, 64, max_tokens_per_micro_batch=0)


def test_graph_budget_and_real_prompt_reach_the_planner() -> None:
    """``nodes.<n>.max_tokens_per_micro_batch`` becomes ``PlanNode.max_tokens_per_micro_batch``, and the
    data's mean real prompt (``DataLengths.prompt_mean``, at most the padded width) ``prompt_mean``."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.graph_problem import problem_from_graph

    path = str(Path(__file__).resolve().parent.parent / "examples" / "grpo.yaml")
    graph = load_graph(path, ["nodes.actor_train.max_tokens_per_micro_batch=128"])
    problem = problem_from_graph(graph)
    train, ref = problem.node("actor_train"), problem.node("ref")
    assert (train.max_tokens_per_micro_batch, ref.max_tokens_per_micro_batch) == (128, None)
    # arithmetic prompts of mixed length, left-padded to each batch's longest: fewer real tokens
    assert 0 < train.prompt_mean < train.prompt_len
    assert train.prompt_tokens == train.prompt_mean == ref.prompt_mean
