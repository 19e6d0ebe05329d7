"""Issue 18's memory and length models: hand-derived goldens for the capped-exponential length model,
activation recompute, FlashAttention-style attention memory on GPU clusters, and their use by node costs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml

from rlflow.dataflow.errors import PlanError
from rlflow.nodes.data_lengths import measure_data_lengths
from rlflow.schedulers.planner.call_cost import forward_flops
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.lengths import (
    capped_exponential_rate,
    compacted_decode_s,
    expected_longest,
    slowest_replica_steps,
)
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.shapes import ModelShape

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def roofline_h100() -> ClusterSpec:
    """h100-8x without the eager loop's kernel-launch bound (``Overheads.launch_layer_s``), so that a tiny
    model's decode steps are the memory-bound roofline the length tests derive by hand."""
    c = load_cluster("h100-8x")
    return dataclasses.replace(c, overheads=dataclasses.replace(c.overheads, launch_layer_s=0.0))


# 2 layers, hidden 8, intermediate 16, 4 heads (q width 8), 2 kv heads, vocab 16.
SHAPE = ModelShape.from_config(
    dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
         num_hidden_layers=2)
)  # fmt: skip


CONFIG_8 = dict(
    hidden_size=8,
    intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=16,
    num_hidden_layers=2,
)


def test_capped_exponential_golden() -> None:
    rate = capped_exponential_rate(300.0, 1000.0)
    assert -math.expm1(-rate * 1000.0) / rate == pytest.approx(300.0, rel=1e-9)  # (1 − e^{−λG})/λ = μ
    assert capped_exponential_rate(1000.0, 1000.0) == 0.0  # mean at the cap: no early ends
    # one row: its mean; the cap far in the tail: μ·H₄ = 100 · 25/12 (Rényi)
    assert expected_longest(300.0, 1000.0, 1) == pytest.approx(300.0, rel=1e-6)
    assert expected_longest(100.0, 1e5, 4) == pytest.approx(100.0 * 25 / 12, rel=1e-5)
    # two rows: E[max] = ∫₀^G 1 − (1 − e^{−λx})² dx = G − ∫₀^G (1 − e^{−λx})² dx, whose closed form is
    # G − 2(1 − e^{−λG})/λ + (1 − e^{−2λG})/(2λ)
    lam, cap = rate, 1000.0
    square = cap - 2 * (-math.expm1(-lam * cap)) / lam + (-math.expm1(-2 * lam * cap)) / (2 * lam)
    assert expected_longest(300.0, cap, 2) == pytest.approx(cap - square, rel=1e-6)
    assert expected_longest(1000.0, 1000.0, 64) == 1000.0
    assert 990 < expected_longest(300.0, 1000.0, 64) < 1000.0  # many rows: the longest nears the cap
    with pytest.raises(ValueError, match="rows must be >= 1"):
        expected_longest(300.0, 1000.0, 0.5)
    with pytest.raises(ValueError, match="must be positive"):
        capped_exponential_rate(0.0, 1000.0)
    # a compacting loop: row-steps ∫₁^∞ 64·e^{−s/5} ds = 64·5·e^{−1/5} (the cap far in the tail); steps
    # of a constant second: ∫₁^G P(max > s) ds = E[max] − 1 where the max is surely past one token
    by_rows = compacted_decode_s(5.0, 1e5, 64, 64, lambda live, s: live)
    assert by_rows == pytest.approx(320 * math.exp(-0.2), rel=1e-3)  # Simpson, 32 panels: within 0.1 %
    steps = compacted_decode_s(5.0, 1e5, 64, 64, lambda live, s: 1.0)
    assert steps == pytest.approx(expected_longest(5.0, 1e5, 64) - 1, rel=1e-3)
    assert compacted_decode_s(64.0, 64.0, 8, 8, lambda live, s: live) == pytest.approx(
        8 * 63
    )  # no early ends
    with pytest.raises(ValueError, match="rows"):
        compacted_decode_s(5.0, 64.0, 8, 4, lambda live, s: 1.0)


def _train(cluster_name: str, recompute: bool) -> object:
    node = PlanNode("n", "m", "train", 8, 4, 4, mini_batches=2, recompute=recompute)
    cluster = dataclasses.replace(load_cluster(cluster_name), devices_per_host=8)
    return CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster).node_cost(
        "n", NodePlacement((0,), Layout())
    )


def test_recompute_and_flash_attention_memory_golden() -> None:
    # b = 8 rows / 2 mini-batches = 4, S = 8. Per layer (Korthikanti Table 2, t = 1):
    # S·b·(H·26 + 8·Q + 5·a·S) = 32·(208 + 64 + 160) = 13824; logits + their gradient 2·4·(4·8·16) = 4096.
    plain = _train("cpu-local", recompute=False)
    assert plain.memory.activations == 2 * 13824 + 4096  # type: ignore[attr-defined]
    # recompute: each layer keeps its input 2·S·b·H = 512, one layer's activations rebuilt at a time
    redo = _train("cpu-local", recompute=True)
    assert redo.memory.activations == 2 * 512 + 13824 + 4096  # type: ignore[attr-defined]
    # one more forward: compute 4/3 of the plain step's
    assert redo.compute_s == pytest.approx(plain.compute_s * 4 / 3)  # type: ignore[attr-defined]
    # GPU cluster: no S×S scores (FlashAttention / memory-efficient SDPA): 32·272 = 8704 per layer
    gpu = _train("h100-8x", recompute=False)
    assert gpu.memory.activations == 2 * 8704 + 4096  # type: ignore[attr-defined]


def test_generation_runs_to_its_longest_row() -> None:
    """A generate call's decode steps are the expected longest of its rows, not max_new_tokens."""
    cluster = roofline_h100()

    def decode(mean: float, engine: str = "builtin") -> float:
        # compact=False: the loop that keeps finished rows (args.record_routes); compacted: the next test
        node = PlanNode("g", "m", "generate", 16, 4, 64, gen_mean=mean, engine=engine, compact=False)
        cm = CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster)
        return float(cm.node_cost("g", NodePlacement((0,), Layout())).decode_s)

    full = decode(0.0)  # every row to the cap: 63 steps
    short = decode(8.0)
    longest = expected_longest(8.0, 64.0, 16)
    assert 8 < longest < 64
    # memory-bound steps: weights (1448 params · 2 B) + KV cache 2·L·kv_dim·ctx·b·w = 512·ctx bytes read at
    # the mean context P + longest/2 of a call whose rows all stay until its longest ends
    step = lambda ctx: (2896 + 512 * ctx) / (3.35e12 * 0.7)  # noqa: E731
    assert full == pytest.approx(63 * step(4 + 32))
    assert short == pytest.approx((longest - 1) * step(4 + longest / 2))
    assert decode(64.0) == full == decode(1000.0)  # a mean at (or past) the cap: no early ends
    assert decode(8.0, "vllm") < decode(0.0, "vllm")  # the engine too stops at its longest row
    with pytest.raises(PlanError, match="gen_mean"):
        PlanNode("t", "m", "train", 16, 4, 64, gen_mean=-1.0)
    with pytest.raises(PlanError, match="train nodes only"):
        PlanNode("g", "m", "generate", 16, 4, 64, recompute=True)


def test_generation_waits_for_its_slowest_replica() -> None:
    """A node's rows split over replicas end with the slowest: one call each is the longest of all their rows
    (the maximum of maxima), more calls add each earlier call's own expected longest."""
    # cap far in the tail: E[max of n] = μ·Hₙ (Rényi); 3 calls of 2 rows on 2 replicas: 2·μ·H₂ + μ·H₄
    assert slowest_replica_steps(100.0, 1e5, 2, 2, 3) == pytest.approx(100.0 * (2 * 1.5 + 25 / 12), rel=1e-5)
    assert slowest_replica_steps(300.0, 1000.0, 4, 8) == expected_longest(300.0, 1000.0, 32)
    assert slowest_replica_steps(300.0, 1000.0, 4, 1, 2) == 2 * expected_longest(300.0, 1000.0, 4)
    with pytest.raises(ValueError, match="replicas"):
        slowest_replica_steps(300.0, 1000.0, 4, 0)
    # the built-in loop on 4 replicas of 4 rows: the longest of the 16 rows' steps, each step reading the
    # weights (2896 B) and its 4 rows' KV cache (128·ctx B) at the replica's own context P + longest(4)/2
    node = PlanNode("g", "m", "generate", 16, 4, 64, gen_mean=8.0, compact=False)
    cm = CostModel(PlanProblem({"m": SHAPE}, (node,)), roofline_h100())
    decode = cm.node_cost("g", NodePlacement((0, 1, 2, 3), Layout(dp=4))).decode_s
    step = (2896 + 128 * (4 + expected_longest(8.0, 64.0, 4) / 2)) / (3.35e12 * 0.7)
    assert decode == pytest.approx((expected_longest(8.0, 64.0, 16) - 1) * step)


def test_compacted_generation_prices_live_rows_and_one_prefill_per_prompt() -> None:
    """The built-in loop drops finished rows and prefills a prompt once for its samples: a step at s tokens
    reads the weights and the KV cache of the expected live rows only (lengths.compacted_decode_s)."""
    cluster = roofline_h100()

    def cost(mean: float, compact: bool, group: int = 1) -> object:
        node = PlanNode("g", "m", "generate", 16, 4, 64, gen_mean=mean, group_size=group, compact=compact)
        return CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster).node_cost(
            "g", NodePlacement((0,), Layout())
        )

    # by hand: a step of `live` rows at s tokens in reads 2896 B of weights and 2·L·kv_dim·w = 32 B per row
    # and context token; the expected live rows times P(the call goes on) is 16·e^{−λs} (lengths.py), so
    # decode = [2896·∫₁^64 P(max of 16 > s) ds + 512·∫₁^64 e^{−λs}·(4 + s) ds] / (3.35e12 · 0.7), the first
    # integral E[max of 16] − 1 (P(max of 16 > s) = 1 − (1 − e^{−λs})¹⁶ ≈ 1 below s = 1 at λ ≈ 0.12)
    lam = capped_exponential_rate(8.0, 64.0)

    def antiderivative(s: float) -> float:  # of e^{−λs}·(4 + s)
        return -math.exp(-lam * s) * ((4 + s) / lam + 1 / lam**2)

    kv = 512 * (antiderivative(64.0) - antiderivative(1.0))
    golden = (2896 * (expected_longest(8.0, 64.0, 16) - 1) + kv) / (3.35e12 * 0.7)
    assert cost(8.0, True).decode_s == pytest.approx(golden, rel=2e-3)
    assert cost(8.0, True).decode_s < cost(8.0, False).decode_s  # fewer rows read than the kept ones
    assert cost(0.0, True).decode_s == cost(0.0, False).decode_s  # no early ends: nothing to drop
    # 4 samples per prompt: the prefill's FLOPs over the 4 prompts, not the 16 rows (uncompacted: 16)
    # (the matmul rate at the prefill's 16 tokens, not 64: Efficiency.matmul_at)
    eff = cluster.efficiency
    quarter = cost(8.0, True).compute_s / 4 * eff.matmul_at(64) / eff.matmul_at(16)
    assert cost(8.0, True, 4).compute_s == pytest.approx(quarter, rel=1e-9)
    assert cost(8.0, False, 4).compute_s == cost(8.0, False).compute_s


def _forward_node(kind: str, mean: float, m: int) -> tuple[PlanNode, object]:
    node = PlanNode("n", "m", kind, 8, 4, 64, gen_mean=mean)
    cluster = load_cluster("h100-8x")
    return node, CostModel(PlanProblem({"m": SHAPE}, (node,)), cluster).node_cost(
        "n", NodePlacement((0,), Layout(micro_batches=m))
    )


@pytest.mark.parametrize("kind", ["train", "inference"])
def test_forward_micro_batches_price_their_own_longest_response(kind: str) -> None:
    """An inference/train micro-batch is cut to its rows' longest response (nodes/train.py): b rows of
    mean 8 capped at 64 cost P + expected_longest(8, 64, b) tokens each, not P + 64."""
    c = load_cluster("h100-8x")
    passes = 3.0 if kind == "train" else 1.0  # forward + backward (2× forward)

    def compute(seq: float, b: float) -> float:  # 8 rows on one device, matmul efficiency at b·seq tokens
        return passes * forward_flops(SHAPE, 8, seq) / (c.device.peak_flops * c.efficiency.matmul_at(b * seq))

    # one row per micro-batch (m = 8): its own length, the mean: 4 + 8 = 12 tokens
    _, one = _forward_node(kind, 8.0, 8)
    assert one.compute_s == pytest.approx(compute(12.0, 1))  # type: ignore[attr-defined]
    # two micro-batches of b = 4 rows: the expected longest of 4
    _, four = _forward_node(kind, 8.0, 2)
    longest4 = expected_longest(8.0, 64.0, 4)
    assert 8 < longest4 < 64
    assert four.compute_s == pytest.approx(compute(4 + longest4, 4))  # type: ignore[attr-defined]
    # no mean: every response to the cap (today's pricing): 4 + 64 tokens
    _, capped = _forward_node(kind, 0.0, 2)
    assert capped.compute_s == pytest.approx(compute(68.0, 4))  # type: ignore[attr-defined]
    # memory peaks at the micro-batch holding the longest of the rank's 8 rows: b = 4 rows of that length
    # (S·b·(H·26 + 8·Q + 5·a·S) per layer on a GPU cluster without the scores term, plus fp32 logits)
    peak = 4 + expected_longest(8.0, 64.0, 8)
    per_layer = peak * 4 * (8 * 26 + 8 * 8)
    logits = (2 if kind == "train" else 1) * 4 * 4 * peak * 16
    layers = 2 if kind == "train" else 1  # inference holds one layer's activations at a time
    assert four.memory.activations == pytest.approx(layers * per_layer + logits)  # type: ignore[attr-defined]


def test_colocate_baseline_shrinks_micro_batches_to_fit() -> None:
    """Colocation (one (dp, tp, pp) for every node on all devices) trades micro-batch size for memory as
    its users do: 13B actor + critic on 16 H100s fits (it was reported infeasible when each node kept
    its fastest micro-batch count)."""
    from rlflow.schedulers.planner.problem import ppo_problem
    from rlflow.schedulers.planner.search import Searcher

    searcher = Searcher(ppo_problem("13b", "13b"), load_cluster("h100-8x", hosts=2))
    plan = searcher.baseline_colocate()
    assert plan is not None, searcher.infeasible
    assert len({(p.layout.dp, p.layout.tp, p.layout.pp) for p in plan.values()}) == 1
    assert all(p.devices == tuple(range(16)) for p in plan.values())
    assert max(searcher.memory(plan).values()) <= searcher.capacity
    assert searcher.evaluate(plan)[2] == 0.0


def _grpo_with_responses(tmp_path: Path) -> Path:
    """examples/grpo.yaml reading the SFT data set, whose responses it tokenizes as ``reference``."""
    spec = yaml.safe_load((EXAMPLES / "grpo.yaml").read_text())
    spec["data"] = {
        "train": str(EXAMPLES / "data" / "sft.jsonl"),
        "fields": {"prompt": "prompt", "answer": "response", "reference": "response"},
        "tokenize": ["prompt", "reference"],
        "tokenizer": "actor",
    }
    for model in spec["models"].values():
        if model.get("tokenizer"):
            model["tokenizer"] = str(EXAMPLES.parent / model["tokenizer"])
    path = tmp_path / "grpo_sft.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_graph_mean_response_reaches_the_cost_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The generate node's mean response (``--mean-new-tokens``, else the data set's responses) becomes
    ``PlanNode.gen_mean`` and prices decode; ``rlflow plan`` says which mean it used."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.cli import main

    graph = load_graph(str(EXAMPLES / "grpo.yaml"))
    cluster = roofline_h100()
    given = problem_from_graph(graph, mean_new_tokens=3.0)
    # every node's rows hold the generated responses: the forward micro-batches are priced on them too
    assert {n.name: n.gen_mean for n in given.nodes} == {"actor_gen": 3.0, "ref": 3.0, "actor_train": 3.0}
    gen = given.node("actor_gen")
    assert gen.compact  # the built-in loop compacts (priced in the test above); here the loop that does not
    at = NodePlacement((0,), Layout())
    compacted = CostModel(given, cluster).node_cost("actor_gen", at).decode_s
    gen = dataclasses.replace(gen, compact=False)
    short = CostModel(dataclasses.replace(given, nodes=(gen,)), cluster).node_cost(gen, at).decode_s
    assert compacted < short
    capped = dataclasses.replace(gen, gen_mean=0.0)
    full = CostModel(dataclasses.replace(given, nodes=(capped,)), cluster).node_cost(capped, at).decode_s
    assert problem_from_graph(graph).node("actor_gen").gen_mean == 0.0  # arithmetic generator: no responses
    # 32 rows (8 prompts × 4) of mean 3 capped at 8: decode runs to the expected longest, not 8 tokens
    longest = expected_longest(3.0, 8.0, 32)
    assert 3 < longest < 8
    # memory-bound steps (t = 1, one micro-batch of 32 rows): weights + KV cache 2·L·kv_dim·ctx·b·w read per
    # step at the mean context P + longest/2; float32 (the graph gives no dtype)
    shape = given.models["actor"]
    w, kv = shape.dtype_bytes, 2 * shape.num_hidden_layers * shape.kv_dim
    step = lambda ctx: (shape.num_params * w + kv * ctx * 32 * w) / (3.35e12 * 0.7)  # noqa: E731
    assert short == pytest.approx((longest - 1) * step(gen.prompt_len + longest / 2))
    assert full == pytest.approx(7 * step(gen.prompt_len + 4))
    with pytest.raises(PlanError, match="mean_new_tokens"):
        problem_from_graph(graph, mean_new_tokens=0.0)
    # measured on the data set: "122" -> 3 digits + EOS; the mean of (characters + 1) over the file's rows
    assert measure_data_lengths(load_graph(str(EXAMPLES / "sft.yaml"))).response_mean == pytest.approx(3.375)
    rows = [json.loads(line) for line in (EXAMPLES / "data" / "sft.jsonl").read_text().splitlines()]
    mean = sum(len(r["response"]) + 1 for r in rows) / len(rows)
    with_data = _grpo_with_responses(tmp_path)
    assert measure_data_lengths(load_graph(str(with_data))).response_mean == pytest.approx(mean)
    assert problem_from_graph(load_graph(str(with_data))).node("actor_gen").gen_mean == pytest.approx(mean)
    out = str(tmp_path / "plan.yaml")
    assert main(["plan", str(EXAMPLES / "grpo.yaml"), "--mean-new-tokens", "3", "--out", out, "--steps", "20",
                 "--restarts", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "(actor_gen): mean response 3 tokens (--mean-new-tokens) of max_new_tokens = 8" in text
    assert "(built-in loop: each prompt prefilled once for its samples, finished rows dropped" in text
    assert "--mean-new-tokens 3.0" in Path(out).read_text()
    assert main(["plan", str(EXAMPLES / "grpo.yaml"), "--mean-new-tokens", "20", "--out", out,
                 "--steps", "20", "--restarts", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out  # a mean past the cap is said to be capped, not silently cut
    assert "mean response 8 tokens (--mean-new-tokens 20, capped at max_new_tokens) of" in text
    assert main(["plan", str(with_data), "--out", out, "--steps", "20", "--restarts", "1"]) == 0
    text = capsys.readouterr().out
    assert f"mean response {mean:.4g} tokens (measured on the data set's responses)" in text


def test_float32_weights_on_gpus_are_priced_as_run_and_warned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runtime builds `dtype: auto` (the default) in bfloat16 on GPUs and float32 on CPUs, and an explicit
    dtype on every device: the planner prices that, and warns about each explicit float32 model on GPUs."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.cli import main
    from rlflow.schedulers.planner.problem import float32_warnings

    graph = load_graph(str(EXAMPLES / "grpo.yaml"))  # no dtype: auto
    assert graph.spec.models["actor"].dtype == "auto"
    fp32 = ["models.actor.dtype=float32", "models.ref.dtype=float32"]
    auto_cpu = problem_from_graph(graph)
    auto_gpu = problem_from_graph(graph, device_type="cuda")
    wide = problem_from_graph(load_graph(str(EXAMPLES / "grpo.yaml"), fp32), device_type="cuda")
    assert {m: s.dtype_bytes for m, s in auto_cpu.models.items()} == {"actor": 4, "ref": 4}
    assert {m: s.dtype_bytes for m, s in auto_gpu.models.items()} == {"actor": 2, "ref": 2}
    assert {m: s.dtype_bytes for m, s in wide.models.items()} == {"actor": 4, "ref": 4}
    lines = float32_warnings(wide, "cuda")
    assert [line.split("'")[1] for line in lines] == ["actor", "ref"]
    assert "`dtype: float32`" in lines[0] and "models.actor.dtype: bfloat16" in lines[0]
    assert float32_warnings(wide, "cpu") == [] == float32_warnings(auto_gpu, "cuda")
    assert ModelShape.from_config(CONFIG_8, dtype="auto", device_type="cuda").dtype_bytes == 2
    assert ModelShape.from_config(CONFIG_8, dtype="auto").dtype_bytes == 4
    cluster, at = load_cluster("h100-8x"), NodePlacement((0,), Layout())
    weights = [CostModel(p, cluster).node_cost("actor_gen", at).memory.weights for p in (wide, auto_gpu)]
    assert weights == [wide.models["actor"].num_params * 4, wide.models["actor"].num_params * 2]
    argv = ["plan", str(EXAMPLES / "grpo.yaml"), "--cluster", "h100-8x", "--steps", "20", "--restarts", "1"]
    argv += ["--out", str(tmp_path / "plan.yaml")]
    assert main(argv) == 0
    assert "is float32" not in capsys.readouterr().err  # auto: bfloat16 on the GPU cluster
    assert main([*argv[:2], *fp32, *argv[2:]]) == 0
    err = capsys.readouterr().err
    assert "rlflow: warning: model 'actor' is float32" in err and "model 'ref' is float32" in err
