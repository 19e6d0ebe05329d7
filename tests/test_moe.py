"""Mixture-of-experts models (issue 34, "Models"): tiny random ``qwen3_moe``, ``mixtral`` and ``deepseek_v3``
models through the node kinds, the load-balancing loss's coefficient in the gradient, the router metrics on
hand-checkable routings, the validation refusals, and runs of ``examples/moe/grpo.yaml`` on 2 workers (FSDP2,
generation apart from training, ``staleness: 1``) and with a DeepSpeed ZeRO actor. That the coefficient
changes every train function's step is ``tests/test_args_reach.py``'s check (on this file's tiny qwen3_moe).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.checks import launch_mistakes
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.models import build_model
from rlflow.nodes.moe import MOE_METRICS, layer_stats, router_stats
from rlflow.nodes.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/moe/grpo.yaml"
_BASE = {
    "vocab_size": 19, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 64, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
}  # fmt: skip
QWEN3_MOE = {**_BASE, "model_type": "qwen3_moe", "intermediate_size": 128, "moe_intermediate_size": 64,
             "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True}  # fmt: skip
CONFIGS = {
    "qwen3_moe": QWEN3_MOE,
    "mixtral": {**_BASE, "model_type": "mixtral", "intermediate_size": 64, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "deepseek_v3": {**_BASE, "model_type": "deepseek_v3", "intermediate_size": 128,
                    "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_shared_experts": 1, "n_group": 2, "head_dim": 8,
                    "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16},
}  # fmt: skip
load_builtin_functions()
# the tests reading moe_model's and _tokenizer's cached models run on one pytest-xdist worker (make test's
# --dist loadgroup), so that each model is built once
SHARED = pytest.mark.xdist_group("test_moe_models")


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@functools.cache
def moe_model(head: str, family: str = "qwen3_moe") -> torch.nn.Module:
    """A tiny MoE model of ``family`` with an ``head`` head (never trained: callers take a deep copy)."""
    return build_model(config=CONFIGS[family], head=head, seed=0).float().eval()


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(ROOT / "examples" / "arith" / "tokenizer")


def _ctx(name: str, module: torch.nn.Module | None, head: str = "lm", **args: Any) -> NodeContext:
    entry = NODE_FUNCTIONS.get(name)
    state = None
    if module is not None:
        state = ModelState(name="m", module=module, head=head, tokenizer=_tokenizer())
        if entry.kind == "train":
            state.optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
            state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
            state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    node = NodeSpec("node", entry.kind, name, model="m" if state else None, args=dict(args))
    generator = torch.Generator().manual_seed(0)
    return NodeContext(node=node, model=state, group_size=2, generator=generator, tokenizer=_tokenizer())


def _call(name: str, module: torch.nn.Module | None, batch: Batch, head: str = "lm", **args: Any) -> Any:
    return NODE_FUNCTIONS.get(name).fn(_ctx(name, module, head, **args), batch, **args)


def _prompts() -> Batch:
    ids = torch.tensor([[0, 1, 5, 6], [1, 7, 8, 9]])  # left-padded
    return Batch({"prompt_ids": ids, "prompt_mask": (ids != 0).long() | (torch.arange(4) > 0).long()})


@SHARED
@pytest.mark.parametrize("family", list(CONFIGS))
def test_each_family_generates_infers_and_trains_in_one_process(family: str) -> None:
    """Built-in generation, reference log-probs, values of a value head on the MoE backbone, and a GRPO step
    whose router metrics are reported (the load-balancing loss where the family has one)."""
    actor = copy.deepcopy(moe_model("lm", family))
    gen = _call("generate", actor, _prompts(), n=2, max_new_tokens=4)
    rows = Batch({k: v.repeat_interleave(2, dim=0) for k, v in _prompts().items()})
    for k, v in gen.outputs.items():
        rows[k] = v
    ref = _call("logprobs", copy.deepcopy(actor), rows).outputs["logprobs"]
    assert torch.allclose(ref, rows.tensor("logprobs"), atol=1e-4)  # the sampler's own weights
    values = _call("values", copy.deepcopy(moe_model("value", family)), rows, head="value").outputs["values"]
    assert values.shape == rows.tensor("response_ids").shape and torch.isfinite(values).all()
    rows["ref_logprobs"] = ref
    rows["scores"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    coef = 0.1 if family != "deepseek_v3" else 0.0
    metrics = _call("grpo_actor", actor, rows, router_aux_loss_coef=coef).metrics
    want = set(MOE_METRICS) - ({"moe/aux_loss"} if family == "deepseek_v3" else set())
    assert want <= set(metrics) and all(math.isfinite(metrics[k]) for k in want)
    assert 0.0 <= metrics["moe/expert_load_min"] <= 0.5 <= metrics["moe/expert_load_max"] <= 1.0  # K/E = 0.5


@SHARED
@pytest.mark.parametrize("head", ["lm", "value"])
def test_a_local_directory_round_trips(tmp_path: Path, head: str) -> None:
    """A model saved in Hugging Face format (transformers writes each expert's tensors apart) loads back with
    the same forward, from ``models.<m>.path``."""
    from rlflow.nodes.forward import forward_logits, forward_values
    from rlflow.nodes.models import save_pretrained

    model = moe_model(head)
    save_pretrained(model, None, tmp_path)
    loaded = build_model(path=tmp_path, head=head).eval()
    ids = torch.tensor([[0, 3, 4, 5], [6, 7, 8, 9]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    forward = forward_logits if head == "lm" else forward_values
    with torch.no_grad():
        torch.testing.assert_close(forward(loaded, ids, mask, pos), forward(model, ids, mask, pos))


def test_router_metrics_by_hand() -> None:
    """E = 4 experts, K = 1, four real tokens and one padding token. Router probabilities (logits = their
    logs): rows 1-2 [.7 .1 .1 .1] (expert 0), row 3 [.1 .7 .1 .1] (expert 1), row 4 [.1 .1 .7 .1] (expert 2),
    the padding row [.1 .1 .1 .7] (expert 3, not counted). Counts [2 1 1 0]; f = counts / 4 =
    [.5 .25 .25 0]; P = mean probabilities = [.4 .25 .25 .1]; loss E·Σ f·P = 4·(.2 + .0625 + .0625) = 1.3."""
    p = torch.tensor(
        [[0.7, 0.1, 0.1, 0.1]] * 2 + [[0.1, 0.7, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1], [0.1, 0.1, 0.1, 0.7]]
    )
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    index = p.argmax(-1, keepdim=True)
    counts, tokens, aux = layer_stats(
        p.log(), index, torch.tensor([1, 1, 1, 1, 0]).bool(), load_balancing_loss_func
    )
    assert counts.tolist() == [2.0, 1.0, 1.0, 0.0] and tokens == 4
    assert aux is not None and float(aux) == pytest.approx(1.3, abs=1e-6)


@SHARED
def test_every_expert_chosen_gives_load_one_and_loss_e() -> None:
    """K = E = 2 (every token goes to both experts): each expert's load is 1 in every layer and the loss is
    E·Σ_e 1·P_e = E = 2 whatever the router's probabilities: the GRPO step's metrics, exactly."""
    config = {**QWEN3_MOE, "num_experts": 2, "num_experts_per_tok": 2}
    actor = build_model(config=config, seed=0).float().eval()
    rows = _grpo_rows(actor)
    metrics = _call("grpo_actor", actor, rows, router_aux_loss_coef=0.5).metrics
    assert metrics["moe/expert_load_max"] == metrics["moe/expert_load_min"] == 1.0
    assert metrics["moe/aux_loss"] == pytest.approx(2.0, abs=1e-5)


@SHARED
def test_a_recomputed_router_takes_its_own_forwards_mask() -> None:
    """A DPO step runs two forwards per micro-batch (chosen, rejected: other padding); with activation
    recompute the backward reruns the rejected forward's layers first. Each rerun's load-balancing loss
    takes its own forward's padding mask (RouterStats.recompute_context), so the step with recompute
    equals the step without, bit for bit (before: the last forward's mask, weights 0.02 away)."""
    ids = torch.tensor([[0, 1, 5, 6], [1, 7, 8, 9]])
    rows = Batch(
        {
            "prompt_ids": ids,
            "prompt_mask": (ids != 0).long(),
            "chosen_ids": torch.tensor([[5, 6, 2, 0], [7, 2, 0, 0]]),
            "rejected_ids": torch.tensor([[8, 9, 10, 2], [5, 2, 0, 0]]),
            "ref_chosen_logps": torch.tensor([-9.0, -7.5]),
            "ref_rejected_logps": torch.tensor([-8.0, -12.0]),
        }
    )
    for key in ("chosen", "rejected"):
        rows[f"{key}_mask"] = (rows.tensor(f"{key}_ids") != 0).long()
    weights = []
    for recompute in (False, True):
        model = copy.deepcopy(moe_model("lm"))
        ctx = _ctx("dpo", model, router_aux_loss_coef=0.5)
        ctx.node = dataclasses.replace(ctx.node, recompute=recompute)
        NODE_FUNCTIONS.get("dpo").fn(ctx, rows, router_aux_loss_coef=0.5)
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


def _grpo_rows(actor: torch.nn.Module) -> Batch:
    rows = Batch({k: v.repeat_interleave(2, dim=0) for k, v in _prompts().items()})
    gen = _call("generate", copy.deepcopy(actor), _prompts(), n=2, max_new_tokens=4)
    for k, v in gen.outputs.items():
        rows[k] = v
    rows["ref_logprobs"] = rows.tensor("logprobs")
    rows["scores"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    return rows


@SHARED
def test_the_coefficient_is_the_weight_of_the_loss_in_the_gradient() -> None:
    """With a zero main loss, the gradient is coef × ∇ of the mean over layers of Hugging Face's per-layer
    load-balancing loss over the real tokens (padding excluded): on the routers and on every weight before
    them (a layer's router reads the earlier layers' output), and nowhere else."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = copy.deepcopy(moe_model("lm"))
    ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    mask = (ids != 0).long()
    coef = 0.3
    with router_stats(model, coef) as stats:
        assert stats is not None and stats.layers == 2
        stats.scale = coef
        (model(input_ids=ids, attention_mask=mask).logits * 0).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
    ref = copy.deepcopy(moe_model("lm"))
    out = ref(input_ids=ids, attention_mask=mask, output_router_logits=True)
    real = mask.reshape(-1).bool()
    losses = [load_balancing_loss_func((lg[real],), 4, 2, None) for lg in out.router_logits]
    (coef * sum(losses) / len(losses)).backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None and p.grad.any()}
    assert set(got) == set(want) and "lm_head.weight" not in got and any(".gate." in n for n in got)
    for n in got:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7)


def _mistakes(path: str, *overrides: str) -> list[str]:
    return launch_mistakes(load_graph(path, list(overrides)))


def _about(key: str, path: str, *overrides: str) -> list[str]:
    """The mistakes naming ``key``: a model_type switched on the example's config also leaves keys the new
    architecture ignores (the models.config check, tests/test_model_config.py)."""
    return [m for m in _mistakes(path, *overrides) if f".{key}: " in m]


def test_validate_refuses_what_the_runtime_cannot_serve() -> None:
    assert _mistakes(EXAMPLE) == []
    aux = "nodes.actor_train.args.router_aux_loss_coef"
    (dense,) = _mistakes("examples/grpo.yaml", f"{aux}=0.1")
    assert dense.startswith(
        "examples/grpo.yaml: nodes.actor_train.args.router_aux_loss_coef: 0.1: model 'actor'"
    )
    assert "not a mixture-of-experts model" in dense
    (jitter,) = _about(
        "router_jitter_noise",
        EXAMPLE,
        "models.actor.config.model_type=mixtral",
        "models.actor.config.router_jitter_noise=0.1",
    )
    assert (
        jitter.startswith(f"{EXAMPLE}: models.actor.config.router_jitter_noise: 0.1: ")
        and "eval mode" in jitter
    )
    (unknown,) = _about("model_type", EXAMPLE, "models.actor.config.model_type=olmoe")
    assert unknown.startswith(f"{EXAMPLE}: models.actor.config.model_type: 'olmoe' is a mixture-of-experts")
    ds = [
        f"models.actor.config.{k}={v}"
        for k, v in CONFIGS["deepseek_v3"].items()
        if k in ("model_type", "n_group")
    ]
    (groups,) = _about("n_group", EXAMPLE, *ds, "models.actor.config.n_routed_experts=5")
    assert groups == f"{EXAMPLE}: models.actor.config.n_group: 2 expert groups do not divide 5 experts"
    (no_aux,) = _about("router_aux_loss_coef", EXAMPLE, *ds, "models.actor.config.n_routed_experts=4")
    assert no_aux.startswith(
        f"{EXAMPLE}: {aux}: 0.01: model 'actor' (deepseek_v3) has no load-balancing loss"
    )


MIXTRAL = ["models.actor.config.model_type=mixtral", "models.actor.config.num_local_experts=4"]
TP2 = ["run.devices=2", "models.actor.config.vocab_size=20", "plan.actor_gen.devices=0-1"]
TP2 += ["plan.actor_gen.layout=d1t2p1m1"]
TP2 += [f"plan.{n}.{k}" for n in ("ref", "actor_train") for k in ("devices=0", "layout=d1t1p1m1")]


def test_validate_serves_qwen3_moe_and_mixtral_with_vllm_and_refuses_mixtral_at_tp2_on_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """qwen3_moe and mixtral pass (tests/test_vllm_moe.py syncs both into a real engine); mixtral on a CUDA
    engine at tp 2 is refused naming file, node, model and reason (its per-expert renaming is not done on
    the tp group's IPC path), installed or not; at tp 2 on CPU it passes (no IPC handles there)."""
    from rlflow.dataflow.errors import GraphError
    from rlflow.nodes.engines import validation
    from rlflow.nodes.engines.validation import check_engines

    monkeypatch.setattr(validation, "vllm_missing", lambda: None)
    check_engines(load_graph(EXAMPLE, ["nodes.actor_gen.engine=vllm"]), "cpu")
    check_engines(load_graph(EXAMPLE, ["nodes.actor_gen.engine=vllm", *MIXTRAL]), "cpu")
    tp2 = load_graph(EXAMPLE, ["nodes.actor_gen.engine=vllm", *MIXTRAL, *TP2])
    check_engines(tp2, "cpu")
    why = r"\(mixtral\) at the node's layout d1t2p1m1 \(tp=2\) on CUDA: its experts are renamed per expert"
    with pytest.raises(
        GraphError, match=rf"^{EXAMPLE}: nodes.actor_gen.engine: vllm cannot serve model 'actor' {why}"
    ):
        check_engines(tp2, "cuda")


# -- runs -----------------------------------------------------------------------------------------------
FAST = ["run.eval_interval=0", "run.checkpoint_interval=0", "run.iterations=2"]


def _run(out: Path, *overrides: str, exact: bool = True) -> list[dict[str, Any]]:
    """The example's run into ``out``; every iteration's router metrics are finite and, when ``exact``, the
    trainer's first pass reads the weights the sampler used (the weight syncs were exact)."""
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    c = Controller(load_graph(EXAMPLE, [*FAST, f"run.output_dir={out}", *overrides]))
    try:
        c.run()
    finally:
        c.close()
    rows = read_metrics(out).to_pylist()
    for r in rows:
        assert all(math.isfinite(r[k]) for k in MOE_METRICS), r
        assert not exact or r["rollout/logprob_gap_mean"] < 1e-4
    return rows


def test_the_example_runs_in_one_process(tmp_path: Path) -> None:
    _run(tmp_path, "run.iterations=1")


def _plan(**nodes: tuple[str, str]) -> list[str]:
    return [
        f"plan.{n}.{k}={v}" for n, (d, lay) in nodes.items() for k, v in (("devices", d), ("layout", lay))
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_with_staleness_one(tmp_path: Path) -> None:
    """``staleness: 1``, generation on worker 0 and the rest on worker 1: iteration 2 samples with the weights
    before iteration 1's update, while iteration 1 trains."""
    one = ("1", "d1t1p1m1")
    plan = _plan(actor_gen=("0", "d1t1p1m1"), reward=one, ref=one, actor_train=one)
    rows = _run(tmp_path, "run.devices=2", "nodes.actor_gen.staleness=1", *plan, exact=False)
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0]
    assert rows[0]["rollout/logprob_gap_mean"] < 1e-4  # the first iteration is on-policy


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_an_actor_trained_over_two_workers_steps(tmp_path: Path, engine: str) -> None:
    """The actor trained over both workers by FSDP2 or by DeepSpeed ZeRO-3, generation apart from training
    on worker 0 (its own replica), the reward and the reference on worker 1. FSDP2: 2 iterations, so that
    the second samples with the trained weights reallocated to the generation replica, exactly (one worker
    group checks both); ZeRO-3: one iteration."""
    zero = [
        "nodes.actor_train.engine=deepspeed",
        "nodes.actor_train.deepspeed.zero_stage=3",
        "run.iterations=1",
    ]
    plan = _plan(actor_gen=("0", "d1t1p1m1"), reward=("1", "d1t1p1m1"), ref=("1", "d1t1p1m1"),
                 actor_train=("0-1", "d2t1p1m1"))  # fmt: skip
    rows = _run(tmp_path, "run.devices=2", *plan, *(zero if engine == "deepspeed" else []))
    assert len(rows) == (1 if engine == "deepspeed" else 2)
