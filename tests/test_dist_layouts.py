"""Layout parity on 4 CPU gloo processes (tier 3), and the pure row-sharding helpers (tier 1).

One spawned group of 4 processes runs every layout of the matrix (d1t1p1, d2t1p1, d1t2p1, d2t2p1, d4t1p1,
d1t4p1) on a tiny Llama (hidden 32, 2 layers, 4 heads, 4 kv heads: tp=4 must divide them) and compares
against the same node functions run single-process in each worker:

* inference: ``logprobs`` (lm head) and ``values`` (value head) within 1e-5;
* training: one ``sft`` step (2 mini-batches, grad clip active) and one ``ppo_actor`` step (advantages
  whitened over the whole batch: ``DataParallelHooks.all_sum`` across the dp shares), AdamW,
  leave the same weights within 1e-6 (lr 1e-4: each element moves ~2e-4; AdamW amplifies rounding in
  near-zero gradient entries, so larger learning rates give proportionally larger deviations), and the
  global gradient norm (a direct check of the gradient, which AdamW's scale invariance would hide)
  matches within 1e-5 relative.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.rows import output_rows, shard_rows

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]  # (dp, tp)
CONFIG = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
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


# -- tier 1: row sharding ------------------------------------------------------------------------


def test_shard_rows_interleaves_mini_batches() -> None:
    # 8 rows, 2 mini-batches of 4, dp 2: each rank takes 2 rows of each mini-batch
    assert shard_rows(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert shard_rows(6, 3, 1) == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(PlanError, match="do not divide"):
        shard_rows(6, 4, 1)


def test_output_rows_put_samples_after_their_input_row() -> None:
    # rank 1 of shard_rows(8, 2, 2) has input rows [2, 3, 6, 7]; a generate node with n = 2 gives 8 outputs,
    # rows 2i, 2i+1 for input row i
    assert output_rows([2, 3, 6, 7], 8) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert output_rows([2, 3, 6, 7], 4) == [2, 3, 6, 7]
    shares = shard_rows(8, 2, 2)
    assert sorted(r for s in shares for r in output_rows(s, 3 * len(s))) == list(range(24))


def test_tp_rejects_indivisible_kv_heads() -> None:
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import check_tensor_parallel

    model = build_model(config={**CONFIG, "num_key_value_heads": 2}, seed=0)
    check_tensor_parallel(model, 2, "actor")
    with pytest.raises(PlanError, match="num_key_value_heads=2"):
        check_tensor_parallel(model, 4, "actor")


# -- tier 3: 4 processes -------------------------------------------------------------------------


def _batch(rows: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    p, r = 5, 6
    prompt_ids = torch.randint(3, 32, (rows, p), generator=g)
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    for i in range(rows):  # left padding of varying length
        prompt_mask[i, : i % 3] = 0
    prompt_ids = prompt_ids * prompt_mask
    response_ids = torch.randint(3, 32, (rows, r), generator=g)
    response_mask = torch.ones(rows, r, dtype=torch.long)
    for i in range(rows):  # right padding of varying length
        response_mask[i, r - (i % 4) :] = 0
    response_ids = response_ids * response_mask
    return Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "logprobs": -torch.rand(rows, r, generator=g) * response_mask,
            "ref_logprobs": -torch.rand(rows, r, generator=g) * response_mask,
            "values": torch.randn(rows, r, generator=g) * response_mask,
            "scores": torch.randn(rows, generator=g),
        }
    )


def _ctx(node: NodeSpec, module: torch.nn.Module, head: str, train: bool, steps: int = 4) -> Any:
    from rlflow.nodes.context import ModelState, NodeContext
    from rlflow.nodes.train import build_optimizer

    state = ModelState(name="m", module=module, head=head)
    if train:
        spec = OptimizerSpec(lr=1e-4, grad_clip=0.5, weight_decay=0.01)
        state.optimizer, state.scheduler = build_optimizer(module, spec, steps)
        state.optimizer_spec = spec
    return NodeContext(node=node, model=state, micro_batches=1)


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_fsdp_wrapped_module.", "")] = t.detach().clone()
    return out


def _parity_worker(rank: int, world: int) -> dict[str, float]:
    from rlflow.nodes.functions.inference import logprobs_node, values_node
    from rlflow.nodes.functions.policy import ppo_actor
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks, MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache

    torch.manual_seed(0)
    lm = build_model(config=CONFIG, seed=1)
    critic = build_model(config=CONFIG, head="value", seed=2)
    batch = _batch(8)
    lp_node = NodeSpec(name="ref", kind="inference", function="logprobs", model="m")
    v_node = NodeSpec(name="cv", kind="inference", function="values", model="m")
    sft = NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2)
    ppo = NodeSpec(name="ppo", kind="train", function="ppo_actor", model="m", mini_batches=2)
    ppo_args = {"whiten_advantages": True}
    # mismatch correction: π_old (the model's, ≈ log 1/32) over the batch's sampler log-probs (in [−1, 0])
    # is ≈ e^-3.5..e^-2.5; the bound [0.05, 2] rejects about half the tokens, so the global normaliser
    # over dp ranks must count only the kept ones for the layouts to agree
    ppo_rc = NodeSpec(name="ppo_rc", kind="train", function="ppo_actor", model="m", mini_batches=2)
    rc_args = {
        **ppo_args, "rollout_is": "token", "rollout_rs": "token", "rollout_rs_threshold_lower": 0.05,
    }  # fmt: skip

    # single-process references (every rank computes them locally, no collectives)
    ref_lp = logprobs_node(_ctx(lp_node, lm, "lm", False), batch).outputs["logprobs"]
    ref_v = values_node(_ctx(v_node, critic, "value", False), batch).outputs["values"]
    ref_w: dict[str, dict[str, torch.Tensor]] = {}
    ref_norm: dict[str, float] = {}
    for node, args in ((sft, {}), (ppo, ppo_args), (ppo_rc, rc_args)):
        model = copy.deepcopy(lm)
        fn = sft_node if node.function == "sft" else ppo_actor
        ref_metrics = fn(_ctx(node, model, "lm", True), batch, **args).metrics
        ref_norm[node.name] = ref_metrics["actor/grad_norm"]
        ref_w[node.name] = _full_state(model)
        if node is ppo_rc:  # the bound rejects some tokens, not all
            assert 0.1 < ref_metrics["rollout/mask_frac"] < 0.9, ref_metrics["rollout/mask_frac"]

    cache = GroupCache(timeout_s=60)
    diffs: dict[str, float] = {}
    for dp, tp in LAYOUTS:
        spec = MeshSpec.of(range(dp * tp), Layout(dp, tp, 1, 1))
        mesh = cache.mesh(spec)
        if mesh is None:
            continue
        dp_rank, tp_rank = spec.coords(rank)
        shares = shard_rows(len(batch), dp)
        tag = f"d{dp}t{tp}"
        # inference: replicas over dp, tp-sharded
        m_lp = apply_layout(copy.deepcopy(lm), mesh, train=False)
        m_v = apply_layout(copy.deepcopy(critic), mesh, train=False)
        local = batch.index(shares[dp_rank])
        lp = logprobs_node(_ctx(lp_node, m_lp, "lm", False), local).outputs["logprobs"]
        v = values_node(_ctx(v_node, m_v, "value", False), local).outputs["values"]
        diffs[f"{tag}/logprobs"] = float((lp - ref_lp[shares[dp_rank]]).abs().max())
        diffs[f"{tag}/values"] = float((v - ref_v[shares[dp_rank]]).abs().max())
        # training: FSDP2 over dp, TP over tp, the global normaliser over the dp group
        for node, args in ((sft, {}), (ppo, ppo_args), (ppo_rc, rc_args)):
            model = apply_layout(copy.deepcopy(lm), mesh, train=True)
            fn = sft_node if node.function == "sft" else ppo_actor
            rows = batch.index(shard_rows(len(batch), dp, node.mini_batches)[dp_rank])
            ctx = _ctx(node, model, "lm", True)
            ctx.train_hooks = hooks = DataParallelHooks(model, mesh["dp"].get_group(), dp)
            with hooks:
                norm = fn(ctx, rows, **args).metrics["actor/grad_norm"]
            diffs[f"{tag}/{node.name}_gradnorm"] = abs(norm / ref_norm[node.name] - 1.0)
            got = _full_state(model)
            assert got.keys() == ref_w[node.name].keys(), (got.keys(), ref_w[node.name].keys())
            diffs[f"{tag}/{node.name}_weights"] = max(
                float((got[k] - ref_w[node.name][k]).abs().max()) for k in got
            )
            moved = max(float((got[k] - _full_state(lm)[k]).abs().max()) for k in got)
            diffs[f"{tag}/{node.name}_moved"] = moved
        del tp_rank
    return diffs


@pytest.mark.slow
def test_layout_parity_on_4_processes() -> None:
    results = run_group(_parity_worker, 4, timeout_s=150)
    print({k: f"{v:.1e}" for k, v in results[0].items()})
    checked = 0
    for rank, diffs in enumerate(results):
        for key, value in diffs.items():
            if key.endswith("_moved"):
                assert value > 1e-4, f"rank {rank} {key}: the step did not change the weights"
            elif key.endswith("_weights"):  # the update itself is ~2e-4 per element (2 AdamW steps)
                assert value < 1e-6, f"rank {rank} {key}: {value}"
            elif key.endswith("_gradnorm"):  # relative error of the global gradient norm
                assert value < 1e-5, f"rank {rank} {key}: {value}"
            else:
                assert value < 1e-5, f"rank {rank} {key}: {value}"
            checked += 1
    # every layout was checked by at least its rank 0
    for dp, tp in LAYOUTS:
        assert f"d{dp}t{tp}/sft_weights" in results[0]
    assert checked > 0
