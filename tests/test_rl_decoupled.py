"""Decoupled PPO (Fu et al. 2025, AReaL; issue 16): golden values, the reduction to PPO, the cap, the nodes.

Tier 1: :func:`rlflow.nodes.rl.decoupled_policy_loss` and :func:`rlflow.nodes.rl.behav_imp_weights` on a
hand-derived case with π_prox ≠ π_behav (loss, gradient, metrics, with and without the cap), and the bit-for-
bit reduction to :func:`rlflow.nodes.rl.policy_loss` when π_prox = π_behav. Tier 2: every clipped
policy-gradient node function through the registry with ``decoupled_loss`` and a ``prox_logprobs`` input: the
metrics and GRPO's surrogate take hand-derived values, and with ``prox_logprobs`` = the sampler's
``logprobs`` the weight update is PPO's bit for bit. Tier 5: a PPO graph with the proximal forward as a node,
through the runtime. Validation: a decoupled loss without the proximal log-probs, or with them from the wrong
node, stops ``load_graph`` naming the file, node and key.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import rlflow.nodes.rl as rl
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError, NodeError
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeResult
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.records.rundir import read_trace
from rlflow.schedulers.runtime.controller import Controller
from tests.test_rl_rollout_correction import _batch, _ctx

ROOT = Path(__file__).resolve().parents[1]
DEC = "examples/grpo_decoupled.yaml"
NAN = float("nan")
load_builtin_functions()


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a: torch.Tensor | float, b: Any, atol: float = 1e-5) -> None:
    a = torch.as_tensor(a, dtype=torch.float32)
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# ---- tier 1: the loss on a hand-derived case -----------------------------------------------------------
# Two rows of 3 tokens, the last of row 1 padding (NaN everywhere: it must not matter); ε = 0.2, token-mean.
# w = π_prox/π_behav, u = π_θ/π_prox, ℓ = w·max(−A·u, −A·clip(u, 0.8, 1.2)):
#   token   A     π_prox  π_behav  w     π_θ    u     clip(u)  ℓ
#   (0,0)  +1     0.5     0.25     2     0.65   1.3   1.2      2·max(−1.3, −1.2) = −2.4  (clipped)
#   (0,1)  −2     0.4     0.5      0.8   0.36   0.9   0.9      0.8·1.8            =  1.44
#   (0,2)  +0.5   0.3     0.1      3     0.3    1     1        3·(−0.5)           = −1.5
#   (1,0)  −1     0.2     0.2      1     0.1    0.5   0.8      1·max(0.5, 0.8)    =  0.8   (clipped)
#   (1,1)  +1     0.9     0.18     5     0.99   1.1   1.1      5·(−1.1)           = −5.5
# loss = (−2.4 + 1.44 − 1.5 + 0.8 − 5.5)/5 = −7.16/5 = −1.432; pg_clipfrac 2/5; w mean 11.8/5 = 2.36, max 5.
# d loss / d log π_θ = −w·A·u/N where unclipped, 0 where clipped:
#   (0,1) −0.8·(−2)·0.9/5 = 0.288; (0,2) −3·0.5·1/5 = −0.3; (1,1) −5·1·1.1/5 = −1.1.
# ppo_kl = mean(log π_prox − log π_θ) = (log(0.5/0.65) + log(0.4/0.36) + 0 + log 2 + log(0.9/0.99))/5
#        = (−0.262364 + 0.105361 + 0 + 0.693147 − 0.095310)/5 = 0.088167.
# Cap 2.5: w = 3 at (0,2) and 5 at (1,1) exceed it, their loss is 0 but N stays 5 (AReaL):
#   loss = (−2.4 + 1.44 + 0.8)/5 = −0.032; gradient 0.288 at (0,1) only; capfrac 2/5.
MASK = t([[1, 1, 1], [1, 1, 0]])
ADV = t([[1.0, -2.0, 0.5], [-1.0, 1.0, NAN]])
PROX = t([[0.5, 0.4, 0.3], [0.2, 0.9, NAN]]).log()
BEHAV = t([[0.25, 0.5, 0.1], [0.2, 0.18, NAN]]).log()
THETA = t([[0.65, 0.36, 0.3], [0.1, 0.99, NAN]]).log()


def _loss(prox: torch.Tensor, behav: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lp = THETA.clone().requires_grad_(True)
    loss, met = rl.decoupled_policy_loss(lp, prox, behav, ADV, MASK, 0.2, **kw)
    loss.backward()
    assert lp.grad is not None
    return loss, lp.grad, met


def test_hand_derived_loss_gradient_and_metrics() -> None:
    loss, grad, met = _loss(PROX, BEHAV)
    close(loss, -1.432)
    close(grad, [[0.0, 0.288, -0.3], [0.0, -1.1, 0.0]])
    close(met["pg_loss"], -1.432)
    close(met["pg_clipfrac"], 0.4)
    close(met["ppo_kl"], 0.088167)
    close(met["behav_imp_weight_mean"], 2.36)
    close(met["behav_imp_weight_max"], 5.0)
    assert "behav_imp_weight_capfrac" not in met


def test_the_cap_drops_tokens_from_the_loss_but_not_from_its_normaliser() -> None:
    loss, grad, met = _loss(PROX, BEHAV, behav_imp_weight_cap=2.5)
    close(loss, -0.032)
    close(grad, [[0.0, 0.288, 0.0], [0.0, 0.0, 0.0]])
    close(met["behav_imp_weight_capfrac"], 0.4)
    close(met["behav_imp_weight_mean"], 2.36)  # of w before the cap
    w, _ = rl.behav_imp_weights(PROX, BEHAV, MASK, behav_imp_weight_cap=2.5)
    close(w, [[2.0, 0.8, 0.0], [1.0, 0.0, 0.0]])
    for bad in (1.0, 0.5):
        with pytest.raises(rl.RLInputError, match="behav_imp_weight_cap must be > 1"):
            rl.behav_imp_weights(PROX, BEHAV, MASK, behav_imp_weight_cap=bad)


def test_the_weight_is_a_constant_of_the_proximal_and_behaviour_logprobs() -> None:
    # no gradient reaches π_prox or π_behav (both fixed before the update), only π_θ
    prox, behav = PROX.clone().requires_grad_(True), BEHAV.clone().requires_grad_(True)
    lp = THETA.clone().requires_grad_(True)
    rl.decoupled_policy_loss(lp, prox, behav, ADV, MASK)[0].backward()
    assert prox.grad is None and behav.grad is None and lp.grad is not None


@pytest.mark.parametrize("agg", rl.AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_reduces_to_ppo_bit_for_bit_when_proximal_is_behaviour(agg: str, dual_clip: float | None) -> None:
    # w = exp(log π_prox − log π_behav) = exp(0) = 1 exactly, and ℓ·1 = ℓ: loss and gradient are PPO's
    g = torch.Generator().manual_seed(5)
    lp0, old, adv = (torch.randn(4, 7, generator=g) * s - 1 for s in (0.4, 0.4, 1.0))
    mask = (torch.rand(4, 7, generator=g) > 0.3).float()
    mask[2] = 0  # an empty row
    old = old.masked_fill(mask == 0, NAN)
    grads = []
    losses = []
    for decoupled in (False, True):
        lp = lp0.clone().requires_grad_(True)
        kw = {"agg": agg, "dual_clip": dual_clip, "norm_length": 9, "global_normalizer": 20}
        if decoupled:
            loss, _ = rl.decoupled_policy_loss(lp, old, old.clone(), adv, mask, 0.2, 0.28, **kw)
        else:
            loss, _ = rl.policy_loss(lp, old, adv, mask, 0.2, 0.28, **kw)
        loss.backward()
        assert lp.grad is not None
        losses.append(loss.detach())
        grads.append(lp.grad)
    assert torch.equal(losses[0], losses[1])
    assert torch.equal(grads[0], grads[1])


def test_extreme_staleness_neither_overflows_nor_nans() -> None:
    # log π_prox − log π_behav = ±200: w is e^±20 (clamped), finite; the cap compares the unclamped log-ratio
    prox, behav = t([[0.0, -200.0]]), t([[-200.0, 0.0]])
    w, met = rl.behav_imp_weights(prox, behav, t([[1, 1]]))
    assert torch.isfinite(w).all() and float(w[0, 0]) == pytest.approx(math.exp(20.0), rel=1e-5)
    _, met = rl.behav_imp_weights(prox, behav, t([[1, 1]]), behav_imp_weight_cap=1e30)
    close(met["behav_imp_weight_capfrac"], 0.5)  # e^200 > 1e30 although w is clamped to e^20
    w, met = rl.behav_imp_weights(prox, behav, t([[0, 0]]))  # no token: zeros, never NaN
    assert float(w.abs().sum()) == 0.0 and float(met["behav_imp_weight_mean"]) == 0.0
    assert float(met["behav_imp_weight_max"]) == 0.0


# ---- tier 2: the node functions through the registry ---------------------------------------------------
# The batch of tests/test_rl_rollout_correction.py: 4 rows (lengths 4, 3, 2, 4: N = 13), groups of 2; the
# sampler's log-probs are the trainer's own (a `logprobs` node with the train node's micro-batches: bit-equal
# to its first pass) except π_behav = π/3 at (0, 0) and 4·π at (2, 1). Here π_prox is that trainer pass, so
# w = π_prox/π_behav = 3 at (0, 0), 1/4 at (2, 1), exactly 1 on the other 11 tokens.
PG_FUNCTIONS = [
    n
    for n in NODE_FUNCTIONS.names()
    if any(a.name == "decoupled_loss" for a in NODE_FUNCTIONS.get(n).args or ())
]


def _proximal() -> torch.Tensor:
    b = _batch()
    return NODE_FUNCTIONS.get("logprobs").fn(_ctx("inference", "logprobs", {}), b).outputs["logprobs"]


def _train(
    function: str, prox: torch.Tensor | None = None, **args: Any
) -> tuple[NodeResult, list[torch.Tensor]]:
    """One step of ``function`` from the shared initial model; ``prox``: the ``prox_logprobs`` input."""
    entry = NODE_FUNCTIONS.get(function)
    ctx = _ctx("train", function, args)
    assert ctx.model is not None
    before = [p.detach().clone() for p in ctx.model.module.parameters()]
    batch = _batch().select([k for k in entry.inputs if k in _batch()])
    if prox is not None:
        batch["prox_logprobs"] = prox
    result = entry.fn(ctx, batch, **args)
    after = [p.detach().clone() for p in ctx.model.module.parameters()]
    return result, [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize("function", PG_FUNCTIONS)
def test_every_policy_gradient_node_takes_the_decoupled_loss(function: str) -> None:
    # w: 3, 1/4 and 11 ones: mean 14.25/13 = 1.096154, max 3; cap 2 drops (0, 0): capfrac 1/13.
    # |log π_prox − log π_behav|: log 3 and log 4 on 2 of 13 tokens: gap mean
    # (1.098612 + 1.386294)/13 = 0.191147, max log 4 = 1.386294.
    assert set(PG_FUNCTIONS) == {
        "ppo_actor", "grpo_actor", "rloo_actor", "remax_actor", "reinforce_pp_actor", "distill_actor",
    }  # fmt: skip
    prox = _proximal()
    off, update_off = _train(function)
    assert not any(k.startswith("actor/behav") for k in off.metrics)
    dec, update_dec = _train(function, prox, decoupled_loss=True)
    close(dec.metrics["actor/behav_imp_weight_mean"], 14.25 / 13)
    close(dec.metrics["actor/behav_imp_weight_max"], 3.0)
    close(dec.metrics["rollout/logprob_gap_mean"], (math.log(3) + math.log(4)) / 13)
    close(dec.metrics["rollout/logprob_gap_max"], math.log(4))
    capped, update_cap = _train(function, prox, decoupled_loss=True, behav_imp_weight_cap=2.0)
    close(capped.metrics["actor/behav_imp_weight_capfrac"], 1 / 13)
    differs = [any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(u, v, strict=True))
               for u, v in ((update_off, update_dec), (update_dec, update_cap))]  # fmt: skip
    assert all(differs)


def test_grpo_decoupled_surrogate_takes_the_hand_derived_values() -> None:
    # GRPO advantages A = [a, −a, a, −a] per row, a = 0.70711 (scores [1, 0 | 0.5, 0.2], groups of 2). One
    # mini-batch: every micro-batch sees u = π_θ/π_prox = 1, so pg_loss = token-mean of −A·w (rows of 4, 3,
    # 2, 4 tokens; w = 3 at (0,0), 1/4 at (2,1)):
    # decoupled:           (−a·(3+1+1+1) + 3a − a·(1+0.25) + 4a)/13 = −0.25a/13 = −0.013598
    # cap 2 ((0,0) → 0):   (−3a + 3a − 1.25a + 4a)/13             =  2.75a/13 =  0.149581 (N stays 13)
    # + rollout_rs token:  (0,0) and (2,1) leave loss and normaliser, w = 1 on the rest:
    #                      (−3a + 3a − a + 4a)/11                  =  3a/11    =  0.192848
    a = float(rl.grpo_advantages(_batch().tensor("scores"), _batch().tensor("response_mask"), 2)[0, 0])
    close(a, 0.70711, atol=1e-5)
    prox = _proximal()
    cases = {
        (): -0.25 * a / 13,
        (("behav_imp_weight_cap", 2.0),): 2.75 * a / 13,
        (("rollout_rs", "token"),): 3 * a / 11,
    }
    for args, expected in cases.items():
        result, _ = _train("grpo_actor", prox, decoupled_loss=True, **dict(args))
        close(result.metrics["actor/pg_loss"], expected, atol=2e-6)
    rs, _ = _train("grpo_actor", prox, decoupled_loss=True, rollout_rs="token")
    close(rs.metrics["rollout/mask_frac"], 2 / 13)


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_node_reduces_to_ppo_bit_for_bit_when_proximal_is_behaviour(loss: str) -> None:
    # prox_logprobs = the sampler's logprobs: π_old is the same tensor as with recompute_logprobs false and
    # every weight is exactly 1: the same loss, metrics and weight update, bit for bit (PPO and GSPO
    # surrogates)
    behav = _batch().tensor("logprobs").clone()
    ppo, update_ppo = _train("grpo_actor", loss=loss, recompute_logprobs=False, clip_eps=0.1)
    dec, update_dec = _train("grpo_actor", behav, loss=loss, decoupled_loss=True, clip_eps=0.1)
    assert all(torch.equal(a, b) for a, b in zip(update_ppo, update_dec, strict=True))
    assert any(float(u.abs().max()) > 0 for u in update_dec)
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/grad_norm"):
        assert dec.metrics[key] == ppo.metrics[key], key
    assert dec.metrics["actor/behav_imp_weight_mean"] == 1.0


def test_a_direct_call_without_the_proximal_logprobs_names_the_node() -> None:
    with pytest.raises(NodeError, match="node 'node': decoupled_loss reads input 'prox_logprobs'"):
        _train("grpo_actor", decoupled_loss=True)


def test_the_decoupled_node_runs_no_first_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # π_prox comes from the graph's forward: the train node's own no-grad pass is not run
    import rlflow.nodes.functions.policy as F

    calls: list[int] = []
    real = F.first_pass_logprobs
    monkeypatch.setattr(F, "first_pass_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    _train("grpo_actor", _proximal(), decoupled_loss=True)
    assert calls == []
    _train("grpo_actor", rollout_is="token")  # a plain node with one mini-batch runs none either (issue 33)
    assert calls == [1]


# ---- tier 5: through the runtime -----------------------------------------------------------------------
def _decoupled_ppo_graph(tmp: Path, cap: float | None) -> Path:
    """``examples/ppo.yaml`` with the proximal forward as a node (``actor_prox``) and the decoupled loss."""
    raw = yaml.safe_load((ROOT / "examples/ppo.yaml").read_text())
    raw["nodes"]["actor_prox"] = {
        "model": "actor", "kind": "inference", "function": "logprobs",
        "inputs": ["prompt_ids", "prompt_mask", "response_ids", "response_mask"],
        "outputs": {"logprobs": "prox_logprobs"}, "batch_size": "${algorithm.batch}",
    }  # fmt: skip
    train = raw["nodes"]["actor_train"]
    train["inputs"] = [*train["inputs"], "prox_logprobs"]
    train["args"] = {**train["args"], "decoupled_loss": True, "behav_imp_weight_cap": cap}
    path = tmp / "ppo_decoupled.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))  # model order seeds the models
    return path


def _run(graph: Path | str, tmp: Path, *overrides: str) -> dict[str, float]:
    g = load_graph(
        graph,
        [f"run.output_dir={tmp}", "run.iterations=1", "run.checkpoint_interval=0", "run.eval_interval=0",
         "run.seed=3", *overrides],
    )  # fmt: skip
    return Controller(resolve_plan(g, None)).run().metrics


@pytest.fixture
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # example graphs name paths relative to the repository root
    torch.set_num_threads(1)


@pytest.mark.usefixtures("_in_repo")
def test_runtime_synchronous_decoupled_ppo_is_ppo(tmp_path: Path) -> None:
    # synchronous generation with the built-in sampler: π_prox (actor_prox) = π_behav (generate's log-probs)
    # to float precision, every w ≈ 1, nothing capped: the loss is PPO's on the same samples (same seed)
    off = _run("examples/ppo.yaml", tmp_path / "off")
    dec = _run(_decoupled_ppo_graph(tmp_path, 1.5), tmp_path / "dec")
    assert dec["rollout/logprob_gap_mean"] < 1e-5
    close(dec["actor/behav_imp_weight_mean"], 1.0, atol=1e-5)
    assert dec["actor/behav_imp_weight_capfrac"] == 0.0
    close(dec["actor/pg_loss"], off["actor/pg_loss"], atol=1e-5)
    assert "timing_s/actor_prox" in dec


@pytest.mark.usefixtures("_in_repo")
def test_runtime_off_policy_samples_are_weighted_and_capped(tmp_path: Path) -> None:
    # the sampler draws at temperature 0.5, the proximal forward scores at 1: π_behav is sharper, so
    # w = π_prox/π_behav is mostly < 1 (likely tokens) and sometimes > 1 (rare ones); a cap of 1.1 drops
    # some tokens; the loss differs from the uncapped one on the same samples
    hot = "nodes.actor_gen.args.temperature=0.5"
    free = _run(_decoupled_ppo_graph(tmp_path, None), tmp_path / "free", hot)
    capped = _run(_decoupled_ppo_graph(tmp_path, 1.1), tmp_path / "capped", hot)
    assert free["rollout/logprob_gap_mean"] > 0.01
    assert free["actor/behav_imp_weight_mean"] != 1.0 and free["actor/behav_imp_weight_max"] > 1.1
    assert 0.0 < capped["actor/behav_imp_weight_capfrac"] < 1.0
    assert abs(capped["actor/pg_loss"] - free["actor/pg_loss"]) > 1e-5


PLAN_2 = """
plan:
  actor_gen: {devices: 0-1, layout: d2t1p1m1}
  reward: {devices: 1, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d2t1p1m1}
  actor_prox: {devices: 0-1, layout: d2t1p1m1}
  actor_train: {devices: 0-1, layout: d2t1p1m1}
"""


@pytest.mark.slow
@pytest.mark.usefixtures("_in_repo")
@pytest.mark.timeout(300)
def test_runtime_on_2_workers_the_proximal_logprobs_reach_the_train_ranks(tmp_path: Path) -> None:
    # the proximal forward runs data-parallel on the training mesh and its rows reach the train node's dp
    # ranks with the others: π_prox = π_behav on every rank (weights synced after the step), every w ≈ 1
    text = (ROOT / DEC).read_text() + PLAN_2
    g = loads_graph(
        text, DEC,
        ["run.devices=2", f"run.output_dir={tmp_path}", "run.iterations=2", "run.checkpoint_interval=0",
         "run.eval_interval=0"],
    )  # fmt: skip
    m = Controller(g).run().metrics
    trace = read_trace(tmp_path).to_pydict()
    for node in ("actor_prox", "actor_train"):  # one trace row per worker that ran it
        assert {w for n, w in zip(trace["node"], trace["worker"], strict=True) if n == node} == {0, 1}
    assert m["rollout/logprob_gap_mean"] < 1e-5
    close(m["actor/behav_imp_weight_mean"], 1.0, atol=1e-5)
    assert m["actor/behav_imp_weight_capfrac"] == 0.0


@pytest.mark.usefixtures("_in_repo")
def test_the_planner_prices_the_proximal_node_not_a_first_pass() -> None:
    g = load_graph("examples/grpo_decoupled.yaml")
    nodes = {n.name: n for n in problem_from_graph(g).nodes}
    assert "actor_prox" in nodes and nodes["actor_prox"].kind == "inference"
    assert not nodes["actor_train"].first_pass
    plain = {n.name: n for n in problem_from_graph(load_graph("examples/grpo.yaml")).nodes}
    assert plain["actor_train"].first_pass


# ---- validation -----------------------------------------------------------------------------------------


@pytest.mark.usefixtures("_in_repo")
@pytest.mark.parametrize(
    ("graph", "overrides", "where", "what"),
    [
        (  # the decoupled loss without its proximal log-probs
            "examples/grpo.yaml",
            ["nodes.actor_train.args.decoupled_loss=true"],
            "nodes.actor_train.inputs.prox_logprobs",
            "args.decoupled_loss is True, which reads input 'prox_logprobs'",
        ),
        (  # proximal log-probs of another model's weights
            DEC,
            ["nodes.actor_prox.model=ref"],
            "nodes.actor_train.inputs.prox_logprobs",
            "key 'prox_logprobs' comes from node 'actor_prox' (inference, model ref)",
        ),
        (  # proximal log-probs bound while the loss does not read them
            DEC,
            [
                "nodes.actor_train.args.decoupled_loss=false",
                "nodes.actor_train.args.behav_imp_weight_cap=null",
            ],
            "nodes.actor_train.inputs.prox_logprobs",
            "read only when args.decoupled_loss is True",
        ),
        (  # TIS would weight by the same ratio twice
            DEC,
            ["nodes.actor_train.args.rollout_is=token"],
            "nodes.actor_train.args.rollout_is",
            "cannot be combined with decoupled_loss True",
        ),
        (  # the first pass is replaced by the proximal node: its switch means nothing
            DEC,
            ["nodes.actor_train.args.recompute_logprobs=false"],
            "nodes.actor_train.args.recompute_logprobs",
            "is read only when decoupled_loss is False",
        ),
        (
            DEC,
            ["nodes.actor_train.args.decoupled_loss=false"],
            "nodes.actor_train.args.behav_imp_weight_cap",
            "is read only when decoupled_loss is True",
        ),
        (
            DEC,
            ["nodes.actor_train.args.behav_imp_weight_cap=1.0"],
            "nodes.actor_train.args.behav_imp_weight_cap",
            "must be > 1",
        ),
        (  # the proximal forward scores another distribution than the one the loss trains
            DEC,
            ["nodes.actor_prox.args.temperature=0.5"],
            "nodes.actor_prox.args.temperature",
            "0.5 differs from node 'actor_train''s temperature 1.0",
        ),
        (
            DEC,
            ["nodes.actor_train.args.top_k=5"],
            "nodes.actor_prox.args.top_k",
            "None differs from node 'actor_train''s top_k 5",
        ),
    ],
)
def test_a_decoupled_loss_that_cannot_apply_is_rejected_at_validation(
    graph: str, overrides: list[str], where: str, what: str
) -> None:
    with pytest.raises(GraphError) as info:
        load_graph(graph, overrides)
    assert str(info.value).startswith(f"{graph}: {where}: "), str(info.value)
    assert what in str(info.value)


def _graph_with_train_inputs(tmp: Path, inputs: Any, **args: Any) -> Path:
    raw = yaml.safe_load((ROOT / DEC).read_text())
    raw["nodes"]["actor_train"]["inputs"] = inputs
    raw["nodes"]["actor_train"]["args"].update(args)
    path = tmp / "g.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.usefixtures("_in_repo")
def test_inputs_by_name_bind_the_proximal_logprobs_too(tmp_path: Path) -> None:
    names = [
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "logprobs",
        "ref_logprobs",
        "scores",
    ]
    by_name = {k: k for k in names}
    g = load_graph(_graph_with_train_inputs(tmp_path, {**by_name, "prox_logprobs": "prox_logprobs"}))
    assert g.node("actor_train").inputs["prox_logprobs"] == "prox_logprobs"
    path = _graph_with_train_inputs(tmp_path, by_name)
    with pytest.raises(
        GraphError, match=r"g\.yaml: nodes\.actor_train\.inputs\.prox_logprobs: args\.decoupled"
    ):
        load_graph(path)
    path = _graph_with_train_inputs(
        tmp_path,
        {**by_name, "prox_logprobs": "prox_logprobs"},
        decoupled_loss=False,
        behav_imp_weight_cap=None,
    )
    with pytest.raises(
        GraphError, match=r"inputs\.prox_logprobs: read only when args\.decoupled_loss is True"
    ):
        load_graph(path)
    path = _graph_with_train_inputs(tmp_path, [*names, "logprobs"])  # π_behav is not π_prox
    with pytest.raises(
        GraphError, match=r"key 'logprobs' comes from node 'actor_gen' \(generate, model actor\)"
    ):
        load_graph(path)


def test_every_policy_gradient_node_declares_the_proximal_input() -> None:
    for name in PG_FUNCTIONS:
        extra = {a.name: a for a in NODE_FUNCTIONS.get(name).arg_inputs}["prox_logprobs"]
        assert (extra.name, extra.arg, extra.values, extra.own_forward) == (
            "prox_logprobs", "decoupled_loss", (True,), True,
        )  # fmt: skip


def test_batch_of_the_node_tests_is_what_the_derivations_say() -> None:
    # π_prox (the logprobs node) over π_behav (the batch's logprobs): 3 at (0, 0), 1/4 at (2, 1), 1 elsewhere
    mask = _batch().tensor("response_mask")
    w, _ = rl.behav_imp_weights(_proximal(), _batch().tensor("logprobs"), mask)
    expected = torch.ones(4, 4) * mask
    expected[0, 0], expected[2, 1] = 3.0, 0.25
    close(w, expected, atol=1e-5)
    assert isinstance(_batch(), Batch)
