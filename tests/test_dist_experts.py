"""Expert parallelism (ep): the layout field and its checks (tier 1), ep parity on gloo processes (tier 3).

Parity: a tiny ``qwen3_moe`` (hidden 32, 2 layers, 4 experts, top-2; random init from a config) runs the same
node functions single-process (ep 1, the reference every worker computes) and with its experts split over
the ep ranks of a dp mesh (FSDP2 over dp for the rest, all-to-all token dispatch on gloo):

* inference: ``logprobs`` within 1e-5;
* training: one ``sft`` call (2 mini-batches, grad clip active, AdamW lr 1e-4) leaves the same weights within
  1e-6 (as the dense layouts' parity test, ``tests/test_dist_layouts.py``), the loss within 1e-5, and the
  global gradient norm within 1e-5 relative.

Layouts, in one group of 4 processes: ``d2e2`` (each rank holds 2 of the 4 experts), ``d4e4`` (one expert per
rank) and ``d4e2`` (2 ep groups: each expert's gradient is also summed over its 2 holders), without ep
``d1t2`` and ``d2t2`` (tensor parallel on the MoE model, under FSDP2 for d2t2), and ``d2t2e2`` (an ep group
per tp rank, the experts replicated over tp); with pipeline stages ``d2p2e2`` (stage 0 on ranks 0-1, stage 1
on ranks 2-3, each stage's MoE layer dispatched over its own ep group, 2 micro-batches of the 1F1B schedule:
the loss and log-probs from the last stage, the weights of each stage, the global gradient norm on each rank).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.layout_rules import layout_problem
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.plan_spec import Layout
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.rows import shard_rows

EXPERTS = 4
MOE: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": EXPERTS,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 2,
    "bos_token_id": 1,
}
DENSE = {
    **{k: v for k, v in MOE.items() if k not in ("num_experts", "num_experts_per_tok", "norm_topk_prob")},
    "model_type": "llama",
}


# -- tier 1: the layout field and the shared rule -------------------------------------------------


def test_layout_spells_ep_and_keeps_ep1_text() -> None:
    assert Layout.parse("d2t1p1e2m1") == Layout(2, 1, 1, 1, ep=2)
    assert str(Layout.parse("d2t1p1e2m1")) == "d2t1p1e2m1"
    assert str(Layout.parse("d2t2p1m4")) == "d2t2p1m4"  # ep 1 prints as before
    assert Layout.parse("d4e1") == Layout(4)
    assert Layout(4, 1, 1, 1, ep=2).size == 4  # ep uses dp's devices
    with pytest.raises(PlanError, match="ep=2 does not divide dp=3"):
        Layout.parse("d3e2")
    with pytest.raises(PlanError, match="e \\(experts\\)"):
        Layout.parse("d2x2")


def _why(kind: str, config: dict[str, Any], layout: str, engine: str = "builtin") -> Any:
    return layout_problem(kind, 8, 1, 1, config, Layout.parse(layout), "m", engine)


def test_layout_problem_refuses_ep_it_cannot_run() -> None:
    assert _why("train", MOE, "d2e2") is None
    assert _why("inference", MOE, "d4e4") is None
    why = _why("train", {**MOE, "num_experts": 6}, "d4e4")
    assert why is not None and why.key == "num_experts" and "ep=4 does not divide" in why
    why = _why("train", {"num_local_experts": 6}, "d4e4")  # mixtral's field
    assert why is not None and why.key == "num_local_experts"
    why = _why("train", DENSE, "d2e2")
    assert why is not None and why.key == "ep" and "dense" in why
    # a qwen3_moe config without num_experts has Hugging Face's default, 128
    assert _why("train", {"model_type": "qwen3_moe"}, "d4e4") is None
    why = _why("train", {"model_type": "qwen3_moe"}, "d6e3")
    assert why is not None and why.key == "num_experts" and "num_experts=128" in why
    why = _why("train", MOE, "d2e2", "deepspeed")
    assert why is not None and why.key == "ep" and "DeepSpeed" in why
    for engine in ("vllm", "builtin"):
        why = _why("generate", MOE, "d2e2", engine)
        assert why is not None and why.key == "ep" and "generate" in why
    assert _why("train", MOE, "d2t2e2") is None  # experts replicated over tp
    assert _why("train", MOE, "d2t1p2e2") is None  # each pipeline stage its own ep groups
    assert _why("inference", MOE, "d4t1p2e4") is None


def test_validate_names_file_node_and_key(tmp_path: Any, catalogue_registry: Any) -> None:
    import yaml

    from rlflow.dataflow.loader import load_graph

    with open(Path(__file__).parents[1] / "examples" / "sft.yaml") as f:
        graph = yaml.safe_load(f)
    graph["run"]["devices"] = 2
    graph["plan"] = {"actor_train": {"devices": "0-1", "layout": "d2t1p1e2m1"}}
    path = tmp_path / "moe_sft.yaml"
    for config, fragments in (
        (graph["models"]["actor"]["config"], ("ep=2", "dense")),
        ({**MOE, "num_experts": 3}, ("ep=2 does not divide", "num_experts=3")),
    ):
        graph["models"]["actor"]["config"] = config
        path.write_text(yaml.safe_dump(graph))
        with pytest.raises(PlanError) as err:
            load_graph(path, registry=catalogue_registry)
        text = str(err.value)
        assert "moe_sft.yaml" in text and "plan.actor_train.layout" in text, text
        assert all(f in text for f in fragments), text


def test_check_expert_parallel_on_built_models() -> None:
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.experts import check_expert_parallel, expert_modules

    moe = build_model(config=MOE, seed=0)
    assert len(expert_modules(moe)) == 2
    check_expert_parallel(moe, 4, "actor")
    with pytest.raises(PlanError, match="ep=3 does not divide the 4 experts"):
        check_expert_parallel(moe, 3, "actor")
    with pytest.raises(PlanError, match="no mixture-of-experts layers"):
        check_expert_parallel(build_model(config=DENSE, seed=0), 2, "actor")
    mixtral = {**DENSE, "model_type": "mixtral", "num_local_experts": 6, "num_experts_per_tok": 2}
    mixtral["intermediate_size"] = 16
    mixtral_model = build_model(config=mixtral, seed=0)
    assert len(expert_modules(mixtral_model)) == 2  # the same fused 3-D layout
    with pytest.raises(PlanError, match="ep=4 does not divide the 6 experts"):
        check_expert_parallel(mixtral_model, 4, "actor")


# -- tier 3: processes ---------------------------------------------------------------------------


def _batch(rows: int) -> Any:
    from rlflow.dataflow.batch import Batch

    g = torch.Generator().manual_seed(0)
    p, r = 5, 6
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    response_mask = torch.ones(rows, r, dtype=torch.long)
    for i in range(rows):  # left padding of prompts, right padding of responses
        prompt_mask[i, : i % 3] = 0
        response_mask[i, r - (i % 4) :] = 0
    return Batch(
        {
            "prompt_ids": torch.randint(3, 32, (rows, p), generator=g) * prompt_mask,
            "prompt_mask": prompt_mask,
            "response_ids": torch.randint(3, 32, (rows, r), generator=g) * response_mask,
            "response_mask": response_mask,
        }
    )


def _ctx(node: NodeSpec, module: torch.nn.Module, train: bool) -> Any:
    from rlflow.nodes.context import ModelState, NodeContext
    from rlflow.nodes.train import build_optimizer

    state = ModelState(name="m", module=module, head="lm")
    if train:
        spec = OptimizerSpec(lr=1e-4, grad_clip=0.5, weight_decay=0.01)
        state.optimizer, state.scheduler = build_optimizer(module, spec, 4)
        state.optimizer_spec = spec
    return NodeContext(node=node, model=state, micro_batches=1)


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


def _ep_worker(
    rank: int, world: int, layouts: list[tuple[int, int, int]], pp_layouts: list[tuple[int, int, int]]
) -> dict[str, float]:
    from rlflow.nodes.functions.inference import logprobs_node
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks, MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache

    torch.manual_seed(0)
    lm = build_model(config=MOE, seed=1)
    batch = _batch(8)
    lp_node = NodeSpec(name="ref", kind="inference", function="logprobs", model="m")
    sft = NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2)
    ref_lp = logprobs_node(_ctx(lp_node, lm, False), batch).outputs["logprobs"]
    ref = copy.deepcopy(lm)
    ref_metrics = sft_node(_ctx(sft, ref, True), batch).metrics
    ref_w = _full_state(ref)
    start = _full_state(lm)

    cache = GroupCache(timeout_s=60)
    diffs: dict[str, float] = {}
    for dp, tp, ep in layouts:
        spec = MeshSpec.of(range(dp * tp), Layout(dp, tp, 1, 1, ep=ep))
        mesh, experts = cache.mesh(spec), cache.experts(spec)
        if mesh is None:
            continue
        dp_rank, _ = spec.coords(rank)
        tag = f"d{dp}t{tp}e{ep}"
        shares = shard_rows(len(batch), dp)
        m_lp = apply_layout(copy.deepcopy(lm), mesh, train=False, experts=experts)
        lp = logprobs_node(_ctx(lp_node, m_lp, False), batch.index(shares[dp_rank])).outputs["logprobs"]
        diffs[f"{tag}/logprobs"] = float((lp - ref_lp[shares[dp_rank]]).abs().max())
        model = apply_layout(copy.deepcopy(lm), mesh, train=True, experts=experts)
        if ep > 1:  # this rank holds its E / ep experts only
            local = _local(model.model.layers[0].mlp.experts.gate_up_proj)
            diffs[f"{tag}/local_experts"] = float(local.shape[0] != EXPERTS // ep)
        ctx = _ctx(sft, model, True)
        rows = batch.index(shard_rows(len(batch), dp, sft.mini_batches)[dp_rank])
        ctx.train_hooks = hooks = DataParallelHooks(model, mesh["dp"].get_group(), dp)
        with hooks:
            metrics = sft_node(ctx, rows).metrics
        # the node's loss metric (token-mean nll, per rank over its tokens) over the whole batch
        tokens = float(rows.tensor("response_mask").sum())
        both = hooks.all_sum(torch.tensor([metrics["actor/nll"] * tokens, tokens], dtype=torch.float64))
        diffs[f"{tag}/loss"] = abs(float(both[0] / both[1]) - ref_metrics["actor/nll"])
        diffs[f"{tag}/gradnorm"] = abs(metrics["actor/grad_norm"] / ref_metrics["actor/grad_norm"] - 1.0)
        got = _full_state(model)
        assert got.keys() == ref_w.keys(), (got.keys(), ref_w.keys())
        diffs[f"{tag}/weights"] = max(float((got[k] - ref_w[k]).abs().max()) for k in got)
        experts_moved = [k for k in got if "experts" in k]
        diffs[f"{tag}/moved"] = min(float((got[k] - start[k]).abs().max()) for k in experts_moved)
    for dp, pp, ep in pp_layouts:
        diffs.update(_pp_ep_diffs(rank, cache, (dp, pp, ep), lm, batch, (ref_lp, ref_metrics, ref_w, start)))
    return diffs


def _pp_ep_diffs(
    rank: int, cache: Any, degrees: tuple[int, int, int], lm: torch.nn.Module, batch: Any, refs: tuple
) -> dict[str, float]:
    """One rank's differences from the one-process run at ``d{dp}p{pp}e{ep}``: each pipeline stage's MoE
    layers dispatch over the stage's own ep group; 2 micro-batches of the 1F1B schedule per mini-batch."""
    from rlflow.nodes.functions.inference import logprobs_node
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.schedulers.runtime.distributed.experts import sharded_experts
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.pipeline import make_stage, stage_scope
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks

    ref_lp, ref_metrics, ref_w, start = refs
    dp, pp, ep = degrees
    spec = MeshSpec.of(range(dp * pp), Layout(dp, 1, pp, 1, ep=ep))
    mesh, experts = cache.mesh(spec), cache.experts(spec)
    if mesh is None:
        return {}
    tag, dp_rank, leader = f"d{dp}p{pp}e{ep}", spec.coords(rank)[0], rank in spec.leaders()
    diffs: dict[str, float] = {}
    lp_node = NodeSpec(name="ref", kind="inference", function="logprobs", model="m")
    sft = NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2)

    def stage(train: bool) -> torch.nn.Module:
        cut = make_stage(copy.deepcopy(lm), spec, rank, cache)
        return apply_layout(cut, mesh, train=train, experts=experts)

    shares = shard_rows(len(batch), dp)
    module = stage(False)
    with stage_scope(module):
        lp = logprobs_node(_ctx(lp_node, module, False), batch.index(shares[dp_rank])).outputs["logprobs"]
    if leader:  # the last stage's outputs
        diffs[f"{tag}/logprobs"] = float((lp - ref_lp[shares[dp_rank]]).abs().max())
    model = stage(True)
    held = sharded_experts(model)  # this stage's MoE layers, E / ep experts each
    diffs[f"{tag}/local_experts"] = float(not held or _local(held[0].gate_up_proj).shape[0] != EXPERTS // ep)
    ctx = _ctx(sft, model, True)
    ctx.micro_batches = 2
    rows = batch.index(shard_rows(len(batch), dp, sft.mini_batches)[dp_rank])
    ctx.train_hooks = hooks = train_hooks(model, mesh["dp"].get_group(), dp)
    with hooks, stage_scope(model):
        metrics = sft_node(ctx, rows).metrics
    tokens = float(rows.tensor("response_mask").sum())
    both = hooks.all_sum(torch.tensor([metrics["actor/nll"] * tokens, tokens], dtype=torch.float64))
    if leader:
        diffs[f"{tag}/loss"] = abs(float(both[0] / both[1]) - ref_metrics["actor/nll"])
    diffs[f"{tag}/gradnorm"] = abs(metrics["actor/grad_norm"] / ref_metrics["actor/grad_norm"] - 1.0)
    got = _full_state(model)
    assert set(got) < set(ref_w), sorted(set(got) - set(ref_w))
    diffs[f"{tag}/weights"] = max(float((got[k] - ref_w[k]).abs().max()) for k in got)
    diffs[f"{tag}/moved"] = min(float((got[k] - start[k]).abs().max()) for k in got if "experts" in k)
    return diffs


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _check(results: list[dict[str, float]], layouts: list[tuple[int, int, int]]) -> None:
    print({k: f"{v:.1e}" for k, v in results[0].items()})
    for rank, diffs in enumerate(results):
        for key, value in diffs.items():
            if key.endswith("/moved"):  # every expert's weights moved: each got a gradient
                assert value > 1e-5, f"rank {rank} {key}: the step did not change the experts"
            elif key.endswith("/weights"):
                assert value < 1e-6, f"rank {rank} {key}: {value}"
            else:
                assert value < 1e-5, f"rank {rank} {key}: {value}"
    for dp, tp, ep in layouts:
        assert f"d{dp}t{tp}e{ep}/weights" in results[0]


@pytest.mark.slow
def test_ep_parity_on_4_processes() -> None:
    # one group for every layout (ranks 2 and 3 sit out the 2-rank ones); d1t2: tensor parallel on the MoE
    # model (experts replicated over tp, Qwen3's per-head q/k norms summed over tp); d2t2e2: both
    layouts = [(2, 1, 2), (4, 1, 4), (4, 1, 2), (1, 2, 1), (2, 2, 1), (2, 2, 2)]
    pp_layouts = [(2, 2, 2)]  # d2p2e2: stage 0 (ranks 0, 1) and stage 1 (ranks 2, 3) each an ep group
    results = run_group(_ep_worker, 4, (layouts, pp_layouts), timeout_s=240)
    _check(results, layouts)
    for dp, pp, ep in pp_layouts:  # every rank trained its stage; the last stage's ranks checked the loss
        tag = f"d{dp}p{pp}e{ep}"
        assert all(f"{tag}/weights" in r and f"{tag}/moved" in r for r in results), results
        assert sum(f"{tag}/loss" in r for r in results) == dp


# -- reallocation between ep and other layouts (DistExecutor, 2 workers) --------------------------------

# The MoE example's GRPO graph, its ref node reading the actor (so that the actor has three instances):
# an ep source (FSDP2 + ep) into tensor-parallel generation and ep inference replicas, and a tensor-parallel
# source into dp replicas (whose checksums agree only if the tp ranks' replicated weights do: Qwen3's q/k
# norms) and ep inference replicas. Each sync is checked bit for bit and by the replicas' checksums.
_REALLOC_PLANS = {
    "ep->tp,ep": """
plan:
  actor_gen: {devices: 0-1, layout: d1t2p1m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1e2m1}
  actor_train: {devices: 0-1, layout: d2t1p1e2m1}
""",
    "tp->dp,ep": """
plan:
  actor_gen: {devices: 0-1, layout: d2t1p1m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1e2m1}
  actor_train: {devices: 0-1, layout: d1t2p1m1}
""",
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", sorted(_REALLOC_PLANS))
def test_realloc_between_ep_and_other_layouts_is_bit_exact(case: str) -> None:
    from rlflow.dataflow.loader import loads_graph
    from rlflow.schedulers.runtime.choose_executor import make_executor
    from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor
    from tests.test_dist_executor import FAST, ROOT, _seq_batch

    text = (ROOT / "examples/moe/grpo.yaml").read_text() + _REALLOC_PLANS[case]
    overrides = [
        "run.devices=2",
        "run.eval_interval=0",
        "run.checkpoint_interval=0",
        "models.actor.config.vocab_size=20",  # tp=2 divides the vocabulary
        "nodes.ref.model=actor",
    ]
    ex = make_executor(loads_graph(text, str(ROOT / "examples/moe/grpo.yaml"), overrides), None, **FAST)
    assert isinstance(ex, DistExecutor)
    try:
        node = ex.view.node_instance
        before = {n: ex.fetch("actor", node[n]) for n in ("actor_gen", "ref")}
        batch = _seq_batch(32, seed=1)
        batch["prompt_ids"] = batch.tensor("prompt_ids") % 20
        batch["response_ids"] = batch.tensor("response_ids") % 20
        result = ex.run_node("actor_train", batch, 1)
        trained = ex.fetch("actor", node["actor_train"])
        for target in ("actor_gen", "ref"):
            synced = ex.fetch("actor", node[target])
            assert synced.keys() == trained.keys()
            assert all(torch.equal(trained[k], synced[k]) for k in trained), f"{case}: {target} differs"
            moved = [k for k in synced if not torch.equal(before[target][k], synced[k])]
            assert any("experts" in k for k in moved), f"{case}: the step moved no expert of {target}"
        assert result.metrics["realloc/checksum_ok"] == 1.0
        # a sync from or to an ep layout takes the gathering path (param_shards knows no experts)
        want = {"ep->tp,ep": {"plan": 0, "gather": 2}, "tp->dp,ep": {"plan": 1, "gather": 1}}[case]
        assert ex.realloc_counts == want, ex.realloc_counts
    finally:
        ex.close(force=True)


_EP_PLAN = """
plan:
  actor_gen: {devices: 0-1, layout: d2t1p1m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1e2m1}
  actor_train: {devices: 0-1, layout: d2t1p1e2m1}
"""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ep_run_resumes_exactly(tmp_path: Path) -> None:
    """The MoE GRPO example at ep 2 on 2 workers: 2 iterations == resumed from the checkpoint after iteration
    1 (the run directory as a run stopped there leaves it), 1 iteration (the experts' Adam moments are
    DTensor shards of the ep mesh, saved and restored per rank)."""
    from rlflow.dataflow.loader import loads_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime.controller import Controller
    from tests.harness import stopped_copy
    from tests.test_dist_executor import ROOT

    def controller(out: Path, resume: bool = False) -> Controller:
        text = (ROOT / "examples/moe/grpo.yaml").read_text() + _EP_PLAN
        overrides = [
            "run.devices=2",
            "run.iterations=2",
            "run.checkpoint_interval=1",
            "run.eval_interval=0",
            f"run.output_dir={out}",
        ]
        graph = loads_graph(text, str(ROOT / "examples/moe/grpo.yaml"), overrides)
        return Controller(resolve_plan(graph, None), resume=resume)

    def weights(c: Controller) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in c.executor.models["actor"].module.state_dict().items()}

    full = controller(tmp_path / "a")
    try:
        full.run()
        w_full = weights(full)
    finally:
        full.close()
    resumed = controller(stopped_copy(tmp_path / "a", 1, tmp_path / "b"), resume=True)
    try:
        assert resumed.start_iteration == 1
        resumed.run()
        w_resumed = weights(resumed)
    finally:
        resumed.close()
    assert w_full.keys() == w_resumed.keys() and any("experts" in k for k in w_full)
    for k in w_full:
        assert torch.equal(w_full[k], w_resumed[k]), k
