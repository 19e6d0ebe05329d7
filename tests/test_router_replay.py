"""Route replay (R3, issue 34): the experts each token was routed to while it was generated, forced in the
trainer's forwards (:mod:`rlflow.nodes.moe_routes`).

Tier 2, through the node functions: the ``generate`` node records the routes of a tiny mixture-of-experts
model (Qwen3-MoE and Mixtral from a config, random init) whose routers are near-tied: every router row is
one shared random row plus a 3e-9 perturbation, so the experts' logits differ by less than the float
rounding that separates the sampler's KV-cached decode steps from the trainer's one teacher-forced forward
(other matmul shapes, other summation orders). Those real rounding differences flip routes; the experts
themselves differ (random init), so a flipped route changes the log-probs. ``grpo_actor`` then reports the
trainer-vs-sampler gap (``rollout/logprob_gap_max``): clearly above float noise without replay, float noise
(~1e-7) with it; the ``logprobs`` node replays the same way (π_prox, a reference). Hand-checked:
``rollout/router_agreement`` of routes edited at known places; replayed routes equal to the trainer's own
change no bit of the logits; the router still gets gradients. Bad input: routes that do not fit the model
(or the two swapped) are refused before any forward, naming the node and input; ``rlflow validate``'s check
refuses recording on the vLLM engine or a pipeline, a graph whose routes would go nowhere, route inputs bound
to the other route output, and a decoupled loss beside a prox node that does not replay. Tier 4: replay on
d1t2, d1t1p2 and d2e2 against one process, on one 2-process gloo group (and the router metrics and the
load-balancing loss's step there). Tier 5: GRPO iterations through the runtime with recording and replay
(one process with a replaying prox node; pipeline stages on 2 workers).
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.checks import launch_mistakes
from rlflow.nodes.context import ModelState, NodeContext, NodeResult, TrainHooks
from rlflow.nodes.forward import response_logits, sequence_inputs
from rlflow.nodes.functions.policy import first_pass_logprobs
from rlflow.nodes.models import build_model
from rlflow.nodes.moe import MOE_METRICS
from rlflow.nodes.moe_routes import (
    NO_ROUTE,
    PROMPT_ROUTES,
    RESPONSE_ROUTES,
    ROUTER_AGREEMENT,
    RouteRecorder,
    RouteReplay,
    moe_routers,
)
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[1]
load_builtin_functions()
BASE = {"vocab_size": 19, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "num_experts_per_tok": 2, "max_position_embeddings": 64,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False}  # fmt: skip
CONFIGS = {  # Y = 2 MoE layers, top-2 of E = 8 experts
    "qwen3_moe": {**BASE, "model_type": "qwen3_moe", "intermediate_size": 64, "moe_intermediate_size": 32,
                  "num_experts": 8, "norm_topk_prob": True},
    "mixtral": {**BASE, "model_type": "mixtral", "intermediate_size": 32, "num_local_experts": 8},
}  # fmt: skip
NEAR_TIE = 3e-9  # router rows = one shared row + this × N(0, 1): ties within float rounding
PROMPTS = torch.tensor([[1, 5, 14, 6], [0, 1, 7, 16], [1, 8, 15, 9], [0, 0, 1, 6]])
SCORES = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.3, 0.9, 0.1, 0.0])
# the tests reading the cached models, rollouts and train steps below run on one pytest-xdist worker (make
# test's --dist loadgroup), so that each is computed once
SHARED = pytest.mark.xdist_group("test_router_replay_models")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(ROOT / "examples" / "arith" / "tokenizer")


@functools.cache
def _model(kind: str, near_tie: float | None = NEAR_TIE, vocab_size: int = 19) -> torch.nn.Module:
    config = {**CONFIGS[kind], "vocab_size": vocab_size}  # 20: tp = 2 divides it (the tokenizer's is 19)
    model = build_model(config=config, head="lm", seed=0).float().eval()
    if near_tie is not None:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for router in moe_routers(model):
                w = router.weight
                w.copy_(w[:1].expand_as(w) + near_tie * torch.randn(w.shape, generator=g))
    return model


def _ctx(
    kind: str, function: str, module: torch.nn.Module, spec: dict[str, Any] | None = None, **args: Any
) -> NodeContext:
    state = ModelState(name="actor", module=module, head="lm", tokenizer=_tokenizer())
    if kind == "train":
        state.optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
        state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    name = "actor_gen" if kind == "generate" else "actor_train"
    node = NodeSpec(name, kind, function, model="actor", args=dict(args), **(spec or {}))
    m = 1 if node.max_tokens_per_micro_batch else 2  # a token budget sets the micro-batches itself
    return NodeContext(node=node, model=state, group_size=2, tokenizer=_tokenizer(), micro_batches=m,
                       generator=torch.Generator().manual_seed(0))  # fmt: skip


def _generate(model: torch.nn.Module) -> dict[str, Any]:
    """The ``generate`` node (n = 2, 8 new tokens, recording routes) on :data:`PROMPTS`: its outputs."""
    args = {"n": 2, "max_new_tokens": 8, "record_routes": True}
    prompts = Batch({"prompt_ids": PROMPTS, "prompt_mask": (PROMPTS != 0).long()})
    ctx = _ctx("generate", "generate", model, **args)
    return NODE_FUNCTIONS.get("generate").fn(ctx, prompts, **args).outputs


@functools.cache
def _rollout(kind: str, vocab_size: int = 19) -> Batch:
    """The train node's batch: :func:`_generate`'s rows, reference log-probs and scores."""
    out = _generate(_model(kind, NEAR_TIE, vocab_size))
    rows = Batch({"prompt_ids": PROMPTS.repeat_interleave(2, dim=0),
                  "prompt_mask": (PROMPTS != 0).long().repeat_interleave(2, dim=0)})  # fmt: skip
    for key in ("response_ids", "response_mask", "logprobs", RESPONSE_ROUTES, PROMPT_ROUTES):
        rows[key] = out[key]
    rows["ref_logprobs"] = out["logprobs"].clone()
    rows["scores"] = SCORES
    return rows


def _train(
    kind: str,
    batch: Batch,
    module: torch.nn.Module | None = None,
    spec: dict[str, Any] | None = None,
    **args: Any,
) -> NodeResult:
    module = copy.deepcopy(_model(kind)) if module is None else module
    keep = [k for k in batch if args.get("route_replay") or k not in (PROMPT_ROUTES, RESPONSE_ROUTES)]
    spec = dict(spec or {})
    forwards_first = spec.pop("forwards_first", False)
    ctx = _ctx("train", "grpo_actor", module, spec, **args)
    if forwards_first:  # every micro-batch's forward, then the backwards (GPipe; a 1F1B warm-up)
        ctx.train_hooks = _ForwardsFirst()
    return NODE_FUNCTIONS.get("grpo_actor").fn(ctx, batch.select(keep), **args)


class _ForwardsFirst(TrainHooks):
    def micro_batch_order(self, m: int) -> list[tuple[str, int]]:
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]


@functools.cache
def _replayed(kind: str, mini_batches: int = 1) -> tuple[dict[str, float], torch.nn.Module]:
    """``grpo_actor`` with route replay on :func:`_rollout` (``mini_batches`` steps): its metrics and the
    trained model (shared by the tests that compare against it: never modify it)."""
    module = copy.deepcopy(_model(kind))
    spec = {"mini_batches": mini_batches} if mini_batches != 1 else None
    return _train(kind, _rollout(kind), module, spec, route_replay=True).metrics, module


@functools.cache
def _gaps(kind: str) -> tuple[dict[str, float], dict[str, float]]:
    return _train(kind, _rollout(kind)).metrics, _replayed(kind)[0]


# ---- the sampler/trainer gap, through the node functions -------------------------------------------------
@SHARED
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_replay_closes_the_sampler_trainer_gap(kind: str) -> None:
    rollout = _rollout(kind)
    routes, prompt_routes = rollout.tensor(RESPONSE_ROUTES), rollout.tensor(PROMPT_ROUTES)
    assert routes.shape == (8, 8, 2, 2) and prompt_routes.shape == (8, 4, 2, 2)  # [B, R|S, Y, K]
    assert routes.dtype == torch.int32
    # recorded where a real token was fed back: every prompt token, every response token but the row's last
    assert bool((prompt_routes[..., 0] >= 0).eq(rollout.tensor("prompt_mask")[:, :, None].bool()).all())
    assert bool((routes[rollout.tensor("response_mask") == 0] == NO_ROUTE).all())
    assert bool((routes[:, 0] >= 0).all()) and bool((routes[:, -1] == NO_ROUTE).all())
    off, on = _gaps(kind)
    # without replay the trainer routes some near-tied tokens elsewhere than the sampler did: its log-probs
    # differ by far more than float rounding; with replay the gap is float rounding (~1e-7 nats)
    assert off["rollout/logprob_gap_max"] > 1e-3 and off["rollout/logprob_gap_mean"] > 1e-4
    assert on["rollout/logprob_gap_max"] < 1e-5 and on["rollout/logprob_gap_mean"] < 1e-6
    # the trainer alone would have picked other experts for a share of the token-layer routes
    assert 0.3 < on[ROUTER_AGREEMENT] < 0.99
    assert ROUTER_AGREEMENT not in off


@SHARED
@pytest.mark.parametrize(
    "spec",
    [{"recompute": True}, {"recompute": True, "forwards_first": True}, {"max_tokens_per_micro_batch": 40},
     {"mini_batches": 2}],
    ids=["recompute", "recompute-forwards-first", "packed", "two-mini-batches"],
)  # fmt: skip
def test_replay_holds_in_every_way_a_train_node_runs_its_forwards(spec: dict[str, Any]) -> None:
    # recomputed activations (the backward reruns each layer's forward, routers included: it must force its
    # own micro-batch's routes, also when the other micro-batch's forward came in between, as a pipeline
    # schedule runs them), packed token-budget micro-batches (routes packed like the tokens),
    # two mini-batches (a first pass over the second's rows; agreement counted before the first step only)
    kind = "qwen3_moe"
    model = copy.deepcopy(_model(kind))
    base, plain_model = _replayed(kind, spec.get("mini_batches", 1))
    other = _train(kind, _rollout(kind), model, spec, route_replay=True).metrics
    assert other["rollout/logprob_gap_max"] < 1e-5
    if "max_tokens_per_micro_batch" in spec:  # other rounding: the trainer's own picks differ a little
        assert abs(other[ROUTER_AGREEMENT] - base[ROUTER_AGREEMENT]) < 0.05
    else:  # the same forwards at the sampler's weights
        assert other[ROUTER_AGREEMENT] == base[ROUTER_AGREEMENT]
    for p, q in zip(plain_model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)  # the same step


@SHARED
def test_a_model_that_routes_alike_reports_full_agreement() -> None:
    # the random init (no near-ties): sampler and trainer pick the same experts; replay changes nothing
    kind = "qwen3_moe"
    model = _model(kind, None)
    out = _generate(model)
    batch = _rollout(kind).select(_rollout(kind).keys())
    for key in ("response_ids", "response_mask", "logprobs", RESPONSE_ROUTES, PROMPT_ROUTES):
        batch[key] = out[key]
    on = _train(kind, batch, copy.deepcopy(model), route_replay=True).metrics
    assert on[ROUTER_AGREEMENT] == 1.0
    assert on["rollout/logprob_gap_max"] < 1e-5


@SHARED
def test_a_logprobs_node_replays_as_the_train_node_does() -> None:
    """The ``logprobs`` inference node with ``route_replay`` (the π_prox of a decoupled loss, or a
    reference): its log-probs are the train node's replayed first pass at the same weights, bit for bit,
    and the sampler's within float rounding; without replay the near-tied routers route elsewhere and they
    are not. A decoupled ``grpo_actor`` reading them as π_prox then sees no π_prox/sampler gap."""
    kind = "qwen3_moe"
    model, rollout = _model(kind), _rollout(kind)

    def logprobs(replay: bool) -> torch.Tensor:
        keep = [k for k in rollout if replay or k not in (PROMPT_ROUTES, RESPONSE_ROUTES)]
        ctx = _ctx("inference", "logprobs", model, route_replay=replay)
        return (
            NODE_FUNCTIONS.get("logprobs")
            .fn(ctx, rollout.select(keep), route_replay=replay)
            .outputs["logprobs"]
        )

    on, off = logprobs(True), logprobs(False)
    ctx = _ctx("train", "grpo_actor", copy.deepcopy(model))
    replay = RouteReplay.start(ctx, rollout)
    first, _ = first_pass_logprobs(ctx, rollout, 1.0, None, None, replay)
    replay.finish()
    assert torch.equal(on, first)
    mask = rollout.tensor("response_mask").bool()

    def gap(lp: torch.Tensor) -> float:
        return float((lp - rollout.tensor("logprobs")).abs()[mask].max())

    assert gap(on) < 1e-5 and gap(off) > 1e-3
    assert not any(m._forward_hooks for m in moe_routers(model))  # the node's hooks are gone
    batch = rollout.select(rollout.keys())
    batch["prox_logprobs"] = on
    metrics = _train(kind, batch, route_replay=True, decoupled_loss=True).metrics
    assert metrics["rollout/logprob_gap_max"] < 1e-5  # π_prox vs the sampler's π_behav


# ---- hand-checked pieces ---------------------------------------------------------------------------------
def _own_routes(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The trainer's own routes ``[B, L, Y, K]`` over the sequence positions of ``batch``."""
    ids, mask, pos = sequence_inputs(*(batch.tensor(k) for k in ("prompt_ids", "prompt_mask", "response_ids",
                                                                  "response_mask")))  # fmt: skip
    with torch.no_grad(), RouteRecorder(model) as rec:
        model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
    (call,) = rec.calls
    return call.view(*ids.shape, *call.shape[1:])


def _hand_batch() -> Batch:
    """2 rows (one GRPO group), prompts of 3 and responses of 3 real tokens: L = 6 positions each."""
    prompt = torch.tensor([[1, 5, 14], [1, 7, 16]])
    response = torch.tensor([[6, 3, 2], [9, 4, 2]])
    b = Batch({"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "response_ids": response,
               "response_mask": torch.ones_like(response), "scores": torch.tensor([1.0, 0.0])})  # fmt: skip
    b["logprobs"] = torch.zeros(2, 3)
    b["ref_logprobs"] = torch.zeros(2, 3)
    return b


@SHARED
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_routes_equal_to_the_trainers_own_change_no_bit(kind: str) -> None:
    model = _model(kind)
    batch = _hand_batch()
    routes = _own_routes(model, batch).flip(-1)  # the same sets, in the other order
    replay = RouteReplay("n", model, lambda: 0)
    args = [batch.tensor(k) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    with torch.no_grad():
        free = response_logits(model, *args)
        forced = response_logits(model, *args, replay, routes)
    assert replay.finish() == {ROUTER_AGREEMENT: 1.0}
    assert torch.equal(free, forced)  # the weights of the chosen experts: the router's own recipe


@SHARED
def test_router_agreement_by_hand() -> None:
    # 2 rows × L = 6 positions × Y = 2 layers = 24 token-layer routes; the rows' last tokens carry none
    # (as the sampler leaves them): 20 are replayed. Edited only in the last MoE layer (an edit there changes
    # no router input of any layer): 4 routes swapped for two other experts (the trainer disagrees) and 2
    # reordered (the same set: it agrees). Agreement = (20 − 4)/20 = 0.8, measured in the train forward at
    # the sampler's weights (one mini-batch: no first pass, no forward after the step).
    kind = "qwen3_moe"
    model = _model(kind, None)  # the random init: no near-tie, the trainer's own picks are the recorded ones
    batch = _hand_batch()
    routes = _own_routes(model, batch).clone()
    routes[:, -1] = NO_ROUTE
    for row, pos in ((0, 0), (0, 3), (1, 1), (1, 4)):
        own = set(routes[row, pos, 1].tolist())
        routes[row, pos, 1] = torch.tensor([e for e in range(8) if e not in own][:2])
    for row, pos in ((0, 2), (1, 2)):
        routes[row, pos, 1] = routes[row, pos, 1].flip(0)
    batch[PROMPT_ROUTES], batch[RESPONSE_ROUTES] = routes[:, :3], routes[:, 3:]
    metrics = _train(kind, batch, copy.deepcopy(model), route_replay=True).metrics
    assert metrics[ROUTER_AGREEMENT] == pytest.approx(16 / 20, abs=0)


@SHARED
def test_the_router_keeps_its_gradient_under_replay() -> None:
    # R3 fixes the selection only: the chosen experts' weights are the trainer's softmax, so the router learns
    model = copy.deepcopy(_model("mixtral"))
    batch = _hand_batch()
    routes = _own_routes(model, batch)
    replay = RouteReplay("n", model, lambda: 0)
    args = [batch.tensor(k) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    response_logits(model, *args, replay, routes).logsumexp(-1).sum().backward()
    replay.finish()
    for router in moe_routers(model):
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0


# ---- bad input -------------------------------------------------------------------------------------------
@SHARED
@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: r[:, :, :1], r"input 'routed_experts' is torch.int32 \[8, 8, 1, 2\], expected integer "
                                r"\[8, 8, 2, 2\]: model 'actor' has 2 MoE layers, top-2 of 8 experts"),
        (lambda r: r[..., :1], r"input 'routed_experts' is torch.int32 \[8, 8, 2, 1\], expected integer"),
        (lambda r: r.float(), r"input 'routed_experts' is torch.float32"),
        (lambda r: r.masked_fill(r == 7, 8),
         r"input 'routed_experts' names experts in \[-1, 8\], outside \[0, 8\)"),
    ],
)  # fmt: skip
def test_routes_that_do_not_fit_the_model_are_refused_before_training(edit: Any, match: str) -> None:
    batch = _rollout("qwen3_moe").select(_rollout("qwen3_moe").keys())
    batch[RESPONSE_ROUTES] = edit(batch.tensor(RESPONSE_ROUTES))
    module = copy.deepcopy(_model("qwen3_moe"))
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(NodeError, match=r"node 'actor_train': " + match):
        _train("qwen3_moe", batch, module, route_replay=True)
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))
    assert not any(m._forward_hooks for m in moe_routers(module))  # nothing left hooked


@SHARED
def test_replay_on_a_dense_model_is_refused() -> None:
    module = build_model(config=TINY_LLAMA, head="lm", seed=0)
    with pytest.raises(NodeError, match=r"node 'actor_train' \(model 'actor'\): route_replay: .*model type "
                                        r"'llama' has no mixture-of-experts router"):  # fmt: skip
        _train("qwen3_moe", _rollout("qwen3_moe"), module, route_replay=True)


TRAIN_INPUTS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "logprobs",
    "ref_logprobs",
    "scores",
)
TP_PLAN = [f"plan.{n}.{k}={v}" for n, d, lay in (("actor_gen", "0", "d1t1p1m1"), ("ref", "1", "d1t1p1m1"),
                                                  ("actor_train", "0-1", "d1t1p2m1"))
           for k, v in (("devices", d), ("layout", lay))]  # fmt: skip
GRAPH = """
models:
  actor:
    config: {model_type: qwen3_moe, vocab_size: 19, hidden_size: 32, intermediate_size: 64,
             moe_intermediate_size: 32, num_experts: 4, num_experts_per_tok: 2, norm_topk_prob: true,
             num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 2, head_dim: 16,
             max_position_embeddings: 64, bos_token_id: 1, eos_token_id: 2, pad_token_id: 0,
             tie_word_embeddings: false}
    tokenizer: examples/arith/tokenizer
  ref: {init_from: actor, trainable: false}
data:
  generator: {name: arith, args: {digits: 1, train_size: 64, eval_size: 8, seed: 0}}
  fields: {prompt: prompt, answer: answer}
  tokenize: [prompt]
  tokenizer: actor
nodes:
  actor_gen:
    {model: actor, kind: generate, function: generate, inputs: [prompt_ids, prompt_mask],
     outputs: {response_ids: response_ids, response_mask: response_mask, logprobs: logprobs,
               routed_experts: routes, prompt_routed_experts: prompt_routes},
     batch_size: 2, batch_unit: prompts, args: {n: 2, max_new_tokens: 4, record_routes: true}}
  reward:
    {kind: inference, function: rule_reward, inputs: [response_ids, response_mask, answer],
     outputs: [scores], batch_size: 4, batch_unit: samples}
  ref:
    {model: ref, kind: inference, function: logprobs,
     inputs: [prompt_ids, prompt_mask, response_ids, response_mask], outputs: {logprobs: ref_logprobs},
     batch_size: 2}
  actor_train:
    {model: actor, kind: train, function: grpo_actor,
     inputs: [prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ref_logprobs, scores,
              prompt_routes, routes],
     batch_size: 2, args: {route_replay: true}}
run: {iterations: 1, seed: 1, checkpoint_interval: 0, eval_interval: 0, devices: 1}
"""


@pytest.fixture
def graph_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(ROOT)  # the tokenizer's path is relative to the repository root
    path = tmp_path / "r3.yaml"
    path.write_text(GRAPH)
    return path


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["nodes.actor_gen.interrupt_every=2", "nodes.actor_gen.staleness=1"],
         r"actor_gen.args.record_routes: routes are recorded in one"),
        (["nodes.actor_gen.args.record_routes=false"],
         r"nodes.actor_gen.outputs.routed_experts: bound, but args.record_routes is not true"),
        (["nodes.actor_gen.outputs.prompt_routed_experts=null", "nodes.actor_train.args.route_replay=false",
          f"nodes.actor_train.inputs=[{','.join(TRAIN_INPUTS)}]"],
         r"nodes.actor_gen.outputs: args.record_routes is true but prompt_routed_experts is not bound"),
        (["run.devices=2", *TP_PLAN, "plan.actor_gen.devices=0-1", "plan.actor_gen.layout=d1t1p2m1"],
         r"actor_gen.args.record_routes: the plan's layout has pp=2; routes are recorded on a whole model"),
    ],
)  # fmt: skip
def test_validate_refuses_routes_that_cannot_be_recorded_or_would_go_nowhere(
    graph_file: Path, overrides: list[str], message: str
) -> None:
    assert launch_mistakes(load_graph(str(graph_file))) == []
    # replay on pipeline and tensor-parallel train layouts is accepted (parity: test_replay_on_layouts)
    for layout in ("d1t1p2m2", "d1t2p1m1"):
        plan = [*TP_PLAN, f"plan.actor_train.layout={layout}", "models.actor.config.vocab_size=20"]
        graph = load_graph(str(graph_file), ["run.devices=2", *plan])
        assert launch_mistakes(graph) == []
    mistakes = launch_mistakes(load_graph(str(graph_file), overrides))
    assert any(m.startswith(f"{graph_file}: ") and re.search(message, m) for m in mistakes), mistakes


def test_validate_prints_the_vllm_refusal_of_recorded_routes_once(
    graph_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One mistake, one line: ``record_routes`` on the vLLM engine is the engine check's (before, the route
    check printed it a second time, naming args.record_routes)."""
    from rlflow.schedulers.cli import main

    assert main(["validate", str(graph_file), "nodes.actor_gen.engine=vllm"]) == 2
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if line.startswith("rlflow validate: error: ")]
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        f"rlflow validate: error: {graph_file}: nodes.actor_gen.engine: vllm: node 'actor_gen' sets "
        "args.record_routes, and rlflow's vLLM engine does not return routes"
    ), errors


def test_a_searched_engine_never_offers_vllm_to_a_node_recording_routes(graph_file: Path) -> None:
    # the engine is left out (searched): the plan may not choose vLLM, and the graph is not refused for it
    from rlflow.schedulers.planner.graph_problem import engine_choices

    for overrides in ([], ["nodes.actor_gen.engine=auto"]):
        graph = load_graph(str(graph_file), [*overrides, "plan=auto"])
        assert launch_mistakes(graph) == []
        assert engine_choices(graph, "actor_gen") == ("builtin",)


def test_a_decoupled_loss_replays_only_beside_a_replaying_prox_node(graph_file: Path, tmp_path: Path) -> None:
    # π_prox comes from an inference node: without its own replay the loss would mix replayed and free
    # routing (refused, naming the prox node); with it, accepted, and one iteration through the runtime
    # finds π_prox (replayed, at the sampler's weights) within float rounding of the sampler's log-probs
    prox = ("  prox: {model: actor, kind: inference, function: logprobs, batch_size: 2,\n"
            "         outputs: {logprobs: prox_logprobs},\n"
            "         inputs: [prompt_ids, prompt_mask, response_ids, response_mask, prompt_routes,\n"
            "                  routes],\n"
            "         args: {route_replay: true}}\n")  # fmt: skip
    text = graph_file.read_text().replace("route_replay: true}", "route_replay: true, decoupled_loss: true}")
    text = text.replace("  actor_train:\n", prox + "  actor_train:\n")
    text = text.replace(
        "scores,\n              prompt_routes", "scores,\n              prox_logprobs, prompt_routes"
    )
    graph_file.write_text(text)
    assert launch_mistakes(load_graph(str(graph_file))) == []
    off = ["nodes.prox.args.route_replay=false", "nodes.prox.inputs=[prompt_ids,prompt_mask,response_ids,"
           "response_mask]"]  # fmt: skip
    (mistake,) = launch_mistakes(load_graph(str(graph_file), off))
    assert mistake == (
        f"{graph_file}: nodes.actor_train.args.route_replay: decoupled_loss reads π_prox from node 'prox', "
        "whose forward does not replay the routes: the loss would mix replayed and free routing; set "
        "nodes.prox.args.route_replay: true"
    )
    graph = load_graph(str(graph_file), [f"run.output_dir={tmp_path / 'run'}"])
    metrics = Controller(resolve_plan(graph, None)).run().metrics
    assert metrics["rollout/logprob_gap_max"] < 1e-5 and 0.0 < metrics[ROUTER_AGREEMENT] <= 1.0


# ---- through the runtime ---------------------------------------------------------------------------------
def test_a_grpo_iteration_records_and_replays_routes(graph_file: Path, tmp_path: Path) -> None:
    graph = load_graph(str(graph_file), [f"run.output_dir={tmp_path / 'run'}"])
    metrics = Controller(resolve_plan(graph, None)).run().metrics
    assert 0.0 < metrics[ROUTER_AGREEMENT] <= 1.0
    assert metrics["rollout/logprob_gap_max"] < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_routes_travel_to_a_train_node_over_two_workers(graph_file: Path, tmp_path: Path) -> None:
    """Generation on worker 0 records the routes; the actor trains on two pipeline stages (d1t1p2m2, 1F1B):
    the routes reach the other worker, each stage forces its own MoE layer's (the runtime cuts the stages),
    and the agreement is the whole model's (FSDP2 over dp, tp and ep: :func:`test_replay_on_layouts`)."""
    where = {"actor_gen": ("0", "d1t1p1m1"), "reward": ("1", "d1t1p1m1"), "ref": ("1", "d1t1p1m1"),
             "actor_train": ("0-1", "d1t1p2m2")}  # fmt: skip
    plan = [
        f"plan.{n}.{k}={v}" for n, (d, lay) in where.items() for k, v in (("devices", d), ("layout", lay))
    ]
    graph = load_graph(str(graph_file), [f"run.output_dir={tmp_path / 'run'}", "run.devices=2", *plan])
    controller = Controller(graph)
    try:
        metrics = controller.run().metrics
    finally:
        controller.close()
    assert 0.0 < metrics[ROUTER_AGREEMENT] <= 1.0
    assert metrics["rollout/logprob_gap_max"] < 1e-5


LAYOUTS = ((1, 2, 1, 1), (1, 1, 2, 1), (2, 1, 1, 2))
"""(dp, tp, pp, ep) of the layouts route replay runs on in :func:`test_replay_on_layouts`: d1t2, d1t1p2
(1F1B over the context's 2 micro-batches, recomputing activations), d2e2."""
AUX_COEF = 0.5  # router_aux_loss_coef of the hand-routed step in test_replay_on_layouts


def _full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name.replace("_fsdp_wrapped_module.", ""): (p.full_tensor() if isinstance(p, DTensor) else p)
            .detach().clone() for name, p in module.named_parameters()}  # fmt: skip


def _layout_worker(rank: int, world: int) -> dict[str, float]:
    """On each of :data:`LAYOUTS`, each rank on its rows and its part of the model: the replayed ``logprobs``
    node and one ``grpo_actor`` step with and without replay on the near-tied Qwen3-MoE (vocabulary 20),
    against the same calls in this process (the reference every rank computes); and the agreement of a
    replay whose disagreements are known by hand. Returns ``<layout>/<what>`` values (leaders' metrics)."""
    from rlflow.dataflow.plan_spec import Layout
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.pipeline import make_stage, stage_scope
    from rlflow.schedulers.runtime.distributed.pipeline_schedule import train_hooks
    from rlflow.schedulers.runtime.distributed.rows import shard_rows

    kind, vocab = "qwen3_moe", 20
    model, batch = _model(kind, NEAR_TIE, vocab), _rollout(kind, vocab)
    free = batch.select([k for k in batch if k not in (PROMPT_ROUTES, RESPONSE_ROUTES)])
    # agreement by hand: the random init (no near-ties) forced through its own routes with 6 of them swapped
    # for two other experts in the last MoE layer (which changes no router's input): (n - 6) / n of the n
    # token-layer routes at real positions, in any layout
    untied, hand = _model(kind, None, vocab), batch.select(batch.keys())
    routes, width = _own_routes(untied, batch).clone(), int(batch.tensor("prompt_ids").shape[1])
    for row in range(6):  # each row's first response token
        own = set(routes[row, width, 1].tolist())
        routes[row, width, 1] = torch.tensor([e for e in range(8) if e not in own][:2])
    hand[PROMPT_ROUTES], hand[RESPONSE_ROUTES] = routes[:, :width], routes[:, width:]
    n = 2 * int(batch.tensor("prompt_mask").sum() + batch.tensor("response_mask").sum())  # Y = 2

    def logprobs(module: torch.nn.Module, rows: Batch) -> torch.Tensor:
        ctx = _ctx("inference", "logprobs", module, route_replay=True)
        return NODE_FUNCTIONS.get("logprobs").fn(ctx, rows, route_replay=True).outputs["logprobs"]

    ref_lp = logprobs(model, batch)
    ref: dict[bool, tuple[dict[str, float], dict[str, torch.Tensor]]] = {}
    for replay in (True, False):
        trained = copy.deepcopy(model)
        ref[replay] = (_train(kind, batch, trained, route_replay=replay).metrics, _full_state(trained))
    out = {f"one/replay={r}/gap": m["rollout/logprob_gap_max"] for r, (m, _) in ref.items()}
    out["one/agreement"] = ref[True][0][ROUTER_AGREEMENT]
    # the hand-routed step also trains on the load-balancing loss: its router metrics and weights compared
    hand_model = copy.deepcopy(untied)
    hand_metrics = _train(kind, hand, hand_model, route_replay=True, router_aux_loss_coef=AUX_COEF).metrics
    hand_weights = _full_state(hand_model)
    out["one/hand"] = hand_metrics[ROUTER_AGREEMENT]
    out.update({f"one/{k}": hand_metrics[k] for k in (*MOE_METRICS, "actor/pg_loss")})
    out["hand/expected"] = (n - 6) / n
    cache = GroupCache(timeout_s=60)
    for dp, tp, pp, ep in LAYOUTS:
        spec = MeshSpec.of(range(dp * tp * pp), Layout(dp, tp, pp, 1, ep=ep))
        mesh, experts = cache.mesh(spec), cache.experts(spec)
        if mesh is None:
            continue
        tag, leader = f"d{dp}t{tp}p{pp}e{ep}", rank in spec.leaders()
        share = shard_rows(len(batch), dp)[spec.coords(rank)[0]]

        def laid(full: torch.nn.Module, train: bool) -> torch.nn.Module:
            m = copy.deepcopy(full)
            m = make_stage(m, spec, rank, cache) if pp > 1 else m  # noqa: B023
            return apply_layout(m, mesh, train=train and dp > 1, experts=experts)  # noqa: B023

        def step(module: torch.nn.Module, rows: Batch, replay: bool, **args: Any) -> dict[str, float]:
            # 1F1B with recompute: a micro-batch's backward reruns its routers after the other's forward
            spec = {"recompute": True} if pp > 1 else None  # noqa: B023
            ctx = _ctx("train", "grpo_actor", module, spec, route_replay=replay, **args)
            ctx.train_hooks = hooks = train_hooks(module, mesh["dp"].get_group(), dp)  # noqa: B023
            with hooks, stage_scope(module):
                return NODE_FUNCTIONS.get("grpo_actor").fn(ctx, rows, route_replay=replay, **args).metrics

        module = laid(model, False)
        with stage_scope(module):
            lp = logprobs(module, batch.index(share))
        module = laid(untied, True)
        hand_step = step(module, hand.index(share), True, router_aux_loss_coef=AUX_COEF)
        got = _full_state(module)
        out[f"{tag}/hand/weights"] = max(float((got[k] - hand_weights[k]).abs().max()) for k in got)
        metrics = {"hand": hand_step[ROUTER_AGREEMENT]}
        metrics.update({f"hand/{k}": hand_step[k] for k in (*MOE_METRICS, "actor/pg_loss")})
        for replay in (True, False):
            module = laid(model, True)
            m = step(module, (batch if replay else free).index(share), replay)
            metrics[f"replay={replay}/gap"] = m["rollout/logprob_gap_max"]
            metrics.update({"agreement": m[ROUTER_AGREEMENT]} if replay else {})
            got, want = _full_state(module), ref[replay][1]
            assert set(got) <= set(want), sorted(set(got) - set(want))
            out[f"{tag}/replay={replay}/weights"] = max(float((got[k] - want[k]).abs().max()) for k in got)
        if leader:
            out[f"{tag}/logprobs"] = float((lp - ref_lp[share]).abs().max())
            out.update({f"{tag}/{k}": v for k, v in metrics.items()})
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_replay_on_layouts() -> None:
    """Route replay through tensor, pipeline and expert parallel layouts (:data:`LAYOUTS`), on one group of 2
    gloo processes: each layout's replayed log-probs (``logprobs`` node) and replayed ``grpo_actor`` step
    equal one process's within float rounding. Without replay the near-tied routers route differently at
    d1t2 and d2e2 (other matmul shapes round differently: the step moves the weights 3e-3 to 5e-3 away from
    one process's): replay is what makes those layouts agree. ``rollout/router_agreement`` counts the
    trainer's own picks at near-ties, which are rounding noise there (0.44, 0.62 against 0.55 measured); it
    is exact on the routes swapped by hand, on every layout (the counts summed over the shares and the
    stages), and bit for bit one process's on the pipeline (the same matmuls, stage by stage).

    The hand-routed step also trains on the load-balancing loss (``router_aux_loss_coef`` 0.5): its expert
    loads equal one process's exactly on every layout (the forced routes, counted over every share and
    stage); on d1t2 and d1t1p2 (each forward sees one process's tokens) the loss, ``moe/aux_loss`` and the
    weights after the step do too, the pipeline's over both stages' MoE layers (before the fix: the last
    stage's layer only, 2.038 against 2.055, each stage's loss term weighted for its own layer count, the
    weights 0.09 away; recomputation under 1F1B raised CheckpointError, its mask that of a later forward).
    d2e2 is not compared there: each rank's forwards see half the tokens, a loss of other token sets."""
    from rlflow.schedulers.runtime.distributed.launch import run_group

    results = run_group(_layout_worker, 2, timeout_s=240)
    out = {k: v for r in results for k, v in r.items()}  # the leaders' values, and every rank's weights
    assert out["one/replay=True/gap"] < 1e-5 < 1e-3 < out["one/replay=False/gap"]
    assert out["one/hand"] == out["hand/expected"]
    for dp, tp, pp, ep in LAYOUTS:
        tag = f"d{dp}t{tp}p{pp}e{ep}"
        assert out[f"{tag}/logprobs"] < 1e-5, (tag, out)
        assert out[f"{tag}/replay=True/gap"] < 1e-5, (tag, out)
        worst = max(r[f"{tag}/replay=True/weights"] for r in results)  # each rank's part of the model
        assert worst < 1e-6, (tag, out)
        # the tally is exact: summed over the data-parallel shares and the pipeline stages
        assert out[f"{tag}/hand"] == out["hand/expected"], (tag, out)
        for key in ("moe/expert_load_max", "moe/expert_load_min"):
            assert out[f"{tag}/hand/{key}"] == out[f"one/{key}"], (tag, key, out)
        if dp == 1:  # one process's tokens in every forward: the load-balancing loss and its gradient
            for key in ("moe/aux_loss", "actor/pg_loss"):
                assert abs(out[f"{tag}/hand/{key}"] - out[f"one/{key}"]) < 1e-6, (tag, key, out)
            assert max(r[f"{tag}/hand/weights"] for r in results) < 1e-6, (tag, out)
        if pp > 1:  # the same matmuls as one process, stage by stage: bit for bit, agreement included
            assert out[f"{tag}/agreement"] == out["one/agreement"] and worst == 0.0, (tag, out)
        else:  # other shapes round otherwise: unforced, the near-tied routers pick other experts
            assert 0.3 < out[f"{tag}/agreement"] < 0.99, (tag, out)
            assert min(r[f"{tag}/replay=False/weights"] for r in results) > 1e-4, (tag, out)
            assert out[f"{tag}/replay=False/gap"] > 1e-3, (tag, out)


def test_route_inputs_listed_the_other_way_round_are_named(graph_file: Path) -> None:
    """Bound by position, prompt routes come before response routes; keys named as the inputs but listed
    swapped would feed [B,R,...] routes as [B,S,...]: refused at load, naming the input and the order."""
    from rlflow.dataflow.errors import GraphError

    names = ["nodes.actor_gen.outputs.routed_experts=routed_experts",
             "nodes.actor_gen.outputs.prompt_routed_experts=prompt_routed_experts"]  # fmt: skip
    right = f"nodes.actor_train.inputs=[{','.join(TRAIN_INPUTS)},prompt_routed_experts,routed_experts]"
    assert launch_mistakes(load_graph(str(graph_file), [*names, right])) == []
    swapped = f"nodes.actor_train.inputs=[{','.join(TRAIN_INPUTS)},routed_experts,prompt_routed_experts]"
    expected = (r"nodes\.actor_train\.inputs\.prompt_routed_experts: bound by position to key "
                r"'routed_experts'.*order prompt_routed_experts, routed_experts")  # fmt: skip
    with pytest.raises(GraphError, match=expected):
        load_graph(str(graph_file), [*names, swapped])


@pytest.mark.parametrize(
    ("overrides", "keys"),
    [
        # the train node lists the renamed keys the other way round (binding cannot tell: other names)
        ([f"nodes.actor_train.inputs=[{','.join(TRAIN_INPUTS)},routes,prompt_routes]"],
         ("routes", "prompt_routes")),
        # the generate node binds its outputs to each other's keys
        (["nodes.actor_gen.outputs.routed_experts=prompt_routes",
          "nodes.actor_gen.outputs.prompt_routed_experts=routes"], ("prompt_routes", "routes")),
    ],
    ids=["inputs", "outputs"],
)  # fmt: skip
def test_route_keys_bound_the_other_way_round_are_named_by_validate(
    graph_file: Path, overrides: list[str], keys: tuple[str, str]
) -> None:
    """The keys bound to the train node's prompt / response route inputs (``keys``) come from the generate
    node's response / prompt route outputs: both named, with the output each reads."""
    mistakes = launch_mistakes(load_graph(str(graph_file), overrides))
    key = dict(zip(("prompt_routed_experts", "routed_experts"), keys, strict=True))
    assert mistakes == [
        f"{graph_file}: nodes.actor_train.inputs.prompt_routed_experts: bound to key "
        f"'{key['prompt_routed_experts']}', output routed_experts of node 'actor_gen' (the response's routes "
        "[B,R,Y,K]), but prompt_routed_experts reads the prompt's routes [B,S,Y,K]; bind it to the key of "
        "output prompt_routed_experts of node 'actor_gen' (were prompt_routed_experts and routed_experts "
        "swapped?)",
        f"{graph_file}: nodes.actor_train.inputs.routed_experts: bound to key "
        f"'{key['routed_experts']}', output prompt_routed_experts of node 'actor_gen' (the prompt's routes "
        "[B,S,Y,K]), but routed_experts reads the response's routes [B,R,Y,K]; bind it to the key of "
        "output routed_experts of node 'actor_gen' (were prompt_routed_experts and routed_experts swapped?)",
    ]


@SHARED
def test_routes_swapped_at_run_time_are_named_as_swapped() -> None:
    # a direct call (no validate): the [B,S,..] routes in the response's slot are named as the prompt's
    batch = _rollout("qwen3_moe").select(_rollout("qwen3_moe").keys())
    batch[PROMPT_ROUTES], batch[RESPONSE_ROUTES] = batch.tensor(RESPONSE_ROUTES), batch.tensor(PROMPT_ROUTES)
    expected = (r"input 'prompt_routed_experts' is torch.int32 \[8, 8, 2, 2\], expected integer "
                r"\[8, 4, 2, 2\].*its width 8 is the response's, not the prompt's 4: are "
                r"prompt_routed_experts and routed_experts bound the other way round\?")  # fmt: skip
    with pytest.raises(NodeError, match=expected):
        _train("qwen3_moe", batch, copy.deepcopy(_model("qwen3_moe")), route_replay=True)
