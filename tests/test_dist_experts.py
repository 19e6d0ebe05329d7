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
the loss and log-probs from the last stage, the weights of each stage, the global gradient norm on each rank;
trained with the load-balancing loss against one process whose forwards see the same rows, and the router
metrics ``moe/*`` over both stages and dp ranks on every rank).
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
from rlflow.nodes.moe import MOE_METRICS
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.rows import shard_rows
from tests.ep_generation import CASES, generation_diffs

EXPERTS = 4
AUX_COEF = 0.5  # router_aux_loss_coef of the pipeline layout's step (_pp_ep_diffs)
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
    why = _why("generate", MOE, "d2e2", "vllm")
    assert why is not None and why.key == "ep" and "vLLM generate node" in why and "d2t1p1e2m1" in why
    why = layout_problem("generate", 8, 1, 1, MOE, Layout.parse("d2e2"), "m", "builtin", "agent_generate")
    assert why is not None and why.key == "ep" and "agent_generate" in why
    assert _why("train", MOE, "d2t2e2") is None  # experts replicated over tp
    assert _why("train", MOE, "d2t1p2e2") is None  # each pipeline stage its own ep groups
    assert _why("inference", MOE, "d4t1p2e4") is None


_VLLM_GEN = "function: generate\n    engine: vllm"


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
    # the MoE example's generate node at d2e2 on vLLM is refused by name (the built-in loop's runs:
    # test_realloc_between_ep_and_other_layouts_is_bit_exact)
    moe = (Path(__file__).parents[1] / "examples" / "moe" / "grpo.yaml").read_text()
    moe += _EP_PLAN.replace("layout: d2t1p1m1}", "layout: d2t1p1e2m1}", 1)  # actor_gen's
    path = tmp_path / "moe_grpo.yaml"
    path.write_text(moe.replace("devices: 1}", "devices: 2}").replace("function: generate", _VLLM_GEN))
    with pytest.raises(PlanError) as err:
        load_graph(path, registry=catalogue_registry)
    text = str(err.value)
    assert "moe_grpo.yaml" in text and "plan.actor_gen.layout" in text and "vLLM generate node" in text, text


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
    if rank < 2:  # the generate node at d2e2 (ranks 0, 1: one ep group) against each rank's rows alone
        spec = MeshSpec.of(range(2), Layout(2, 1, 1, 1, ep=2))
        diffs.update(generation_diffs(rank, lm, (cache.mesh(spec), cache.experts(spec))))
    for dp, pp, ep in pp_layouts:
        diffs.update(_pp_ep_diffs(rank, cache, (dp, pp, ep), lm, batch, (ref_lp, ref_metrics, ref_w, start)))
    diffs.update(_realloc_diffs(rank, cache, lm))
    return diffs


# (dp, tp, pp, ep) pairs reallocated shard to shard on the 4 ranks: ep -> ep', ep -> ep x pp, ep x pp -> tp
REALLOC_PAIRS = [((4, 1, 1, 4), (4, 1, 1, 2)), ((4, 1, 1, 2), (2, 1, 2, 2)), ((2, 1, 2, 2), (2, 2, 1, 1))]


def _realloc_diffs(rank: int, cache: Any, lm: torch.nn.Module) -> dict[str, float]:
    """Each of :data:`REALLOC_PAIRS` executed with the planned reallocation between inference replicas of
    ``lm`` (source) and of another initialisation (target): whether the target then holds ``lm``'s weights
    bit for bit, whether each side's DTensor boxes are ``param_shards``', and how far the bytes this rank
    received are from the plan's (every receive counted at ``torch.distributed.irecv``, gloo's path)."""
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.realloc.execute import execute_reallocation
    from rlflow.schedulers.realloc.groups import GroupCache as ReallocGroups
    from rlflow.schedulers.realloc.planning import plan_reallocation
    from rlflow.schedulers.realloc.verify import verify_reallocation
    from rlflow.schedulers.runtime.distributed import weight_sync as ws
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.pipeline import make_stage

    other = build_model(config=MOE, seed=2)
    info = ws.model_info(lm)
    want = _full_state(lm)
    groups = ReallocGroups(timeout=cache.timeout)
    received = [0]
    irecv = torch.distributed.irecv

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        received[0] += tensor.numel() * tensor.element_size()
        return irecv(tensor, *args, **kwargs)

    def place(model: torch.nn.Module, spec: Any) -> torch.nn.Module:
        cut = copy.deepcopy(model)
        if spec.pp > 1:
            cut = make_stage(cut, spec, rank, cache)
        return apply_layout(cut, cache.mesh(spec), train=False, experts=cache.experts(spec))

    diffs: dict[str, float] = {}
    for pair in REALLOC_PAIRS:
        tag = "realloc/" + "->".join("d{}t{}p{}e{}".format(*degrees) for degrees in pair)
        src, dst = (MeshSpec.of(range(4), Layout(d, t, p, 1, ep=e)) for d, t, p, e in pair)
        source, target = place(lm, src), place(other, dst)
        offsets = [ws.expected_boxes(info, spec, rank) for spec in (src, dst)]
        for side, module, boxes in (("source", source, offsets[0]), ("target", target, offsets[1])):
            diffs[f"{tag}/{side}_boxes"] = float(
                bool(ws.boxes_match(ws.local_boxes(module, gather_dp=False), boxes))
            )
        plan = plan_reallocation(
            info.shapes,
            info.meta,
            src.devices,
            src.layout,
            dst.devices,
            dst.layout,
            dtype_bytes=info.dtype_bytes,
        )
        src_shards, dst_shards = ws.source_shards(source, gather_dp=False), ws.target_shards(target)
        received[0] = 0
        torch.distributed.irecv = counted  # type: ignore[assignment]
        try:
            execute_reallocation(
                plan, rank, src_shards, dst_shards, dtype=info.dtypes, groups=groups,
                src_offsets=offsets[0], dst_offsets=offsets[1],
            )  # fmt: skip
        finally:
            torch.distributed.irecv = irecv
        verify_reallocation(  # raises ChecksumError on a region whose digest differs from its source's
            plan, rank, src_shards, dst_shards, src_offsets=offsets[0], dst_offsets=offsets[1]
        )
        diffs[f"{tag}/bytes_off"] = float(abs(received[0] - plan.received_bytes().get(rank, 0)))
        got = _full_state(target)
        diffs[f"{tag}/unequal"] = float(sum(not torch.equal(got[k], want[k]) for k in got))
    return diffs


def _pp_ep_diffs(
    rank: int, cache: Any, degrees: tuple[int, int, int], lm: torch.nn.Module, batch: Any, refs: tuple
) -> dict[str, float]:
    """One rank's differences from the one-process run at ``d{dp}p{pp}e{ep}``: each pipeline stage's MoE
    layers dispatch over the stage's own ep group; 2 micro-batches of the 1F1B schedule per mini-batch.

    The step trains on the load-balancing loss (``router_aux_loss_coef`` :data:`AUX_COEF`), a loss of each
    forward's tokens: the one-process reference runs ``dp × 2`` micro-batches per mini-batch, so its forwards
    see the rows of the layout's forwards (one row each). The router metrics (``moe/*``, over both stages'
    MoE layers and both dp ranks) are compared on every rank."""
    from rlflow.nodes.functions.inference import logprobs_node
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.schedulers.runtime.distributed.experts import sharded_experts
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.pipeline import make_stage, stage_scope
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks

    ref_lp, _, _, start = refs
    dp, pp, ep = degrees
    aux = {"router_aux_loss_coef": AUX_COEF}
    one = copy.deepcopy(lm)
    one_ctx = _ctx(NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2), one, True)
    one_ctx.micro_batches = 2 * dp
    ref_metrics, ref_w = sft_node(one_ctx, batch, **aux).metrics, _full_state(one)
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
        metrics = sft_node(ctx, rows, **aux).metrics
    tokens = float(rows.tensor("response_mask").sum())
    both = hooks.all_sum(torch.tensor([metrics["actor/nll"] * tokens, tokens], dtype=torch.float64))
    if leader:
        diffs[f"{tag}/loss"] = abs(float(both[0] / both[1]) - ref_metrics["actor/nll"])
    for key in MOE_METRICS:  # every rank: the whole node's values
        diffs[f"{tag}/{key}"] = abs(metrics[key] - ref_metrics[key])
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
            if key.endswith(("/steps", "/last_rows")):  # counts, checked by the caller
                continue
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
    # generation at d2e2: every output of every case within 1e-5 of one process's (_check; tokens, masks
    # and routes exactly: integers), where the two ranks' rows ended at different decode steps
    gen = [{k: v for k, v in r.items() if k.startswith("gen/")} for r in results[:2]]
    assert len(gen[0]) == len(gen[1]) > 4 * 6 and not any(k.startswith("gen/") for k in results[2]), gen
    for case in CASES:
        steps = sorted(r[f"gen/{case}/steps"] for r in gen)
        assert steps[0] < steps[1], (case, steps)  # one rank forwarded dummies while the other decoded
    assert sorted(r["gen/segments/last_rows"] for r in gen)[0] == 0.0  # a rank without rows decoded on
    assert max(r["gen/segments/last_rows"] for r in gen) > 0.0
    # the reallocations ran on every rank (bit-exact, boxes and received bytes checked by _check)
    assert all(sum(k.startswith("realloc/") and k.endswith("/unequal") for k in r) == 3 for r in results)


def test_expert_reallocation_plans_move_each_expert_once_per_receiver() -> None:
    """The plans of ``REALLOC_PAIRS`` (executed in the 4-process test) move the experts shard to shard.

    One expert of ``MOE``: ``gate_up_proj`` ``[32, 32]`` + ``down_proj`` ``[32, 16]`` rows, fp32: 6144 bytes.
    * d4e4 -> d4e2: rank r holds expert r; rank d needs experts of block d % 2: expert 0 goes to rank 2
      (rank 0 has it), expert 1 to ranks 0 and 2, expert 2 to 1 and 3, expert 3 to 1: 6 per layer, 2 layers;
      every dense tensor is a local copy (whole on every rank on both sides).
    * d4e2 -> d2p2e2: stage 0 (ranks 0, 1) needs layer 0's blocks 0 and 1, stage 1 (ranks 2, 3) layer 1's:
      each rank already holds its block of every layer: nothing moves.
    * d2p2e2 -> d2t2e1: every rank needs all 4 experts of both layers and holds 2 of one layer: 6 each.
    """
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.realloc.planning import plan_reallocation
    from rlflow.schedulers.realloc.shards import ModelMeta
    from rlflow.schedulers.runtime.distributed.weight_sync import model_info

    info = model_info(build_model(config=MOE, seed=0))
    assert info.meta == ModelMeta(2, False) and info.dtype_bytes == 4
    per_expert = 4 * (32 * 32 + 32 * 16)
    want = [2 * 6 * per_expert, 0, 4 * 6 * per_expert]
    for (src, dst), expert_bytes in zip(REALLOC_PAIRS, want, strict=True):
        plan = plan_reallocation(
            info.shapes, info.meta, (0, 1, 2, 3), Layout(*src[:3], 1, ep=src[3]), (0, 1, 2, 3),
            Layout(*dst[:3], 1, ep=dst[3]), dtype_bytes=4,
        )  # fmt: skip
        moved = sum(t.bytes * len(t.dsts) for t in plan.transfers if not t.is_local and "experts" in t.param)
        assert moved == expert_bytes, (src, dst, moved)
        if src[2] == dst[2] == 1:  # no pipeline on either side: only experts cross a link
            assert plan.remote_bytes == expert_bytes


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
    # pipeline stages into expert-parallel generation (and dp replicas): the generate node at d2e2 then
    # samples the synced weights in lockstep (_check_ep_generation)
    "pp->ep generate,dp": """
plan:
  actor_gen: {devices: 0-1, layout: d2t1p1e2m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1m1}
  actor_train: {devices: 0-1, layout: d1t1p2m1}
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
        "nodes.actor_gen.args.stop_tokens=[3,4,5,6,7,8,9,10]",  # rows end early, on each rank at its step
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
        # every sync takes the planned path: each expert block moves shard to shard (no full gather)
        assert ex.realloc_counts == {"plan": 2, "gather": 0}, ex.realloc_counts
        plans = _sync_plans(ex, "actor_train")
        assert result.metrics["realloc/bytes"] == float(sum(p.remote_bytes for p in plans.values()))
        # one expert's gate_up_proj [128, 64] and down_proj [64, 64] rows, fp32: 4·(128·64 + 64·64) bytes
        per_expert = 4 * (128 * 64 + 64 * 64)
        expert_bytes = {
            n: sum(t.bytes * len(t.dsts) for t in p.transfers if not t.is_local and "experts" in t.param)
            for n, p in plans.items()
        }
        if case == "ep->tp,ep":  # d2e2 -> d1t2: each of the 2 devices receives the 2 experts it lacks, per
            # layer (2 layers), from the device holding them, once; -> d2e2 on the same devices: all local
            assert expert_bytes == {"actor_gen": 2 * 2 * 2 * per_expert, "ref": 0}, expert_bytes
            assert plans["ref"].remote_bytes == 0
        elif case == "tp->dp,ep":  # d1t2 holds every expert whole on both devices: none crosses a link
            assert expert_bytes == {"actor_gen": 0, "ref": 0}, expert_bytes
        else:  # d1p2 -> d2e2: device 0 holds layer 0's 4 experts and needs layer 1's block 0 (2 experts)
            # from device 1, which needs layer 0's block 1 (2); -> d2: each needs the other layer's 4
            assert expert_bytes == {"actor_gen": 4 * per_expert, "ref": 8 * per_expert}, expert_bytes
            _check_ep_generation(ex, synced_gen=ex.fetch("actor", node["actor_gen"]))
    finally:
        ex.close(force=True)


def _check_ep_generation(ex: Any, synced_gen: dict[str, torch.Tensor]) -> None:
    """The generate node at d2e2 (the runtime's lockstep over its ep group) samples what each dp rank's
    rows give decoded alone by one process at ep 1, from the synced weights with the rank's own generator:
    the same tokens and masks, log-probs within 1e-5; and the two ranks' rows end at different steps."""
    from rlflow.nodes.context import ModelState
    from rlflow.nodes.functions.generate import generate_node
    from rlflow.schedulers.runtime.instances import node_context
    from tests.test_dist_executor import _seq_batch

    prompts = _seq_batch(8, seed=2)
    prompts["prompt_ids"] = prompts.tensor("prompt_ids") % 20
    got = ex.pull(ex.run_node("actor_gen", prompts.select(["prompt_ids", "prompt_mask"]), 1).outputs)
    mirror = ex.mirror.models["actor"]
    module = copy.deepcopy(mirror.module)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(synced_gen[name])
    state = ModelState(name="actor", module=module, head="lm", tokenizer=mirror.tokenizer)
    longest = []
    for dp_rank, rows in enumerate(shard_rows(8, 2)):
        ctx = node_context(ex.graph, "actor_gen", state, torch.device("cpu"), dp_rank, mirror.tokenizer)
        ref = generate_node(ctx, prompts.index(rows), **ctx.node.args).outputs
        samples = [r * 4 + j for r in rows for j in range(4)]  # n = 4 samples per prompt
        for key in ("response_ids", "response_mask"):
            assert torch.equal(got.tensor(key)[samples], ref[key]), (dp_rank, key)
        assert float((got.tensor("logprobs")[samples] - ref["logprobs"]).abs().max()) < 1e-5
        longest.append(int(ref["response_mask"].sum(-1).max()))
    assert longest[0] != longest[1] and min(longest) < 8, (
        longest
    )  # one rank forwarded while the other sampled


def _sync_plans(ex: Any, train: str) -> dict[str, Any]:
    """The reallocation plan of each sync after ``train`` (target node -> plan), computed here without a
    process group from the instances' meshes (ep included)."""
    from rlflow.schedulers.realloc.planning import plan_reallocation
    from rlflow.schedulers.runtime.distributed.weight_sync import model_info

    view = ex.view
    src = view.instances[view.node_instance[train]]
    info = model_info(ex.mirror.models[src.model].module)
    out = {}
    for node, idx in view.node_instance.items():
        if idx in view.sync_targets[train]:
            dst = view.instances[idx].mesh
            out[node] = plan_reallocation(
                info.shapes, info.meta, src.mesh.devices, src.mesh.layout, dst.devices, dst.layout,
                dtype_bytes=info.dtype_bytes,
            )  # fmt: skip
    return out


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

    def controller(out: Path, resume: bool = False, *extra: str) -> Controller:
        text = (ROOT / "examples/moe/grpo.yaml").read_text() + _EP_PLAN
        overrides = [
            "run.devices=2",
            "run.iterations=2",
            "run.checkpoint_interval=1",
            "run.eval_interval=0",
            f"run.output_dir={out}",
            *extra,
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
    # the same checkpoint on the layouts without ep (a fresh user's trial: the ep moments then met a dp mesh
    # in a worker's optimizer step) is refused before any step, the saved layouts named with their ep
    no_ep = ("plan.ref.layout=d2t1p1m1", "plan.actor_train.layout=d2t1p1m1")
    with pytest.raises(PlanError, match=r"written under .*actor_train devices \[0, 1\] d2t1p1e2\).*plan is "):
        controller(stopped_copy(tmp_path / "a", 1, tmp_path / "c"), True, *no_ep)
