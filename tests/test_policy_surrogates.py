"""CISPO, SAPO and Dr. GRPO (issue 37): hand-derived goldens of the losses and their gradients, the registry's
defaults, and the same through the train node functions (``loss: cispo`` / ``loss: sapo`` change the update).

Sources: MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), eq. 4-5 (CISPO); Gao et al. 2025, "Soft Adaptive
Policy Optimization" (arXiv:2511.20347) (SAPO); Liu et al. 2025, "Understanding R1-Zero-Like Training"
(arXiv:2503.20783), eq. 3 (Dr. GRPO). verl's ``compute_policy_loss_cispo`` / ``compute_policy_loss_sapo`` were
read for their behaviour on the same inputs (facts noted next to each golden).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.nodes.rl as rl
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.functions import policy as F
from rlflow.nodes.models import build_model
from rlflow.nodes.rl.policy_losses import POLICY_LOSSES
from rlflow.schedulers.cli import main

load_builtin_functions()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- CISPO ----------------------------------------------------------------------------------------------
# One row of 3 tokens. log π = [-1, -0.5, -2], log π_old = [-1.2, -0.5, -1]: ρ = [e^0.2, 1, e^-1]
# = [1.221403, 1, 0.367879]; A = [2, 2, -1].
CISPO_LP, CISPO_OLD, CISPO_ADV = [[-1.0, -0.5, -2.0]], [[-1.2, -0.5, -1.0]], [[2.0, 2.0, -1.0]]


def test_cispo_golden_value_and_gradient() -> None:
    # The registry's defaults: ε_low = inf (no lower bound), ε_high = 0.2, token-mean (1/Σ|o_i|).
    # ŵ = clip(ρ, -inf, 1.2) = [1.2, 1, 0.367879]; ℓ_t = -ŵ_t·A_t·log π_t:
    #   t0: -1.2·2·(-1) = 2.4;  t1: -1·2·(-0.5) = 1.0;  t2: -0.367879·(-1)·(-2) = -0.735759
    # token-mean over 3 tokens: (2.4 + 1.0 - 0.735759)/3 = 0.888080. verl's compute_policy_loss_cispo with
    # clip_ratio_low=10 (1 - 10 < 0: no lower bound for a positive ratio), clip_ratio_high=0.2 and token-mean
    # computes the same per-token losses on these inputs.
    d = POLICY_LOSSES.get("cispo")
    assert (d.clip_eps, d.clip_eps_high, d.agg, d.dual_clip) == (math.inf, 0.2, "token-mean", False)
    lp = t(CISPO_LP).requires_grad_(True)
    loss, met = rl.cispo_policy_loss(
        lp, t(CISPO_OLD), t(CISPO_ADV), t([[1, 1, 1]]), d.clip_eps, d.clip_eps_high
    )
    rho2 = math.exp(-1.0)
    expected = (2.4 + 1.0 - rho2 * 2.0) / 3
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6) and expected == pytest.approx(
        0.888080, abs=1e-6
    )
    # the clipped weight is a constant (stop-gradient): ∂ℓ/∂log π_t = -ŵ_t·A_t / 3, never through ρ
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, t([[-1.2 * 2 / 3, -1.0 * 2 / 3, rho2 / 3]]), atol=1e-6, rtol=0)
    assert float(met["pg_clipfrac"]) == pytest.approx(1 / 3)  # t0's weight was clipped at 1 + ε_high
    assert float(met["pg_loss"]) == pytest.approx(expected, abs=1e-6)
    assert float(met["ppo_kl"]) == pytest.approx((-0.2 + 0.0 + 1.0) / 3, abs=1e-6)  # mean(log π_old - log π)


def test_cispo_keeps_the_gradient_ppo_clips() -> None:
    # With a lower bound ε_low = 0.2, t2's weight is clip(0.367879, 0.8, 1.2) = 0.8:
    # ℓ_2 = -0.8·(-1)·(-2) = -1.6, loss (2.4 + 1 - 1.6)/3 = 0.6, its gradient -0.8·(-1)/3 = 0.266667. PPO on
    # the same token (A < 0, ρ < 1 - ε): max(-Aρ, -A·0.8) = 0.8 is the clipped constant, gradient 0; CISPO's
    # stays.
    lp = t(CISPO_LP).requires_grad_(True)
    loss, met = rl.cispo_policy_loss(lp, t(CISPO_OLD), t(CISPO_ADV), t([[1, 1, 1]]), 0.2, None)
    assert float(loss.detach()) == pytest.approx(0.6, abs=1e-6)
    loss.backward()
    assert lp.grad is not None and float(lp.grad[0, 2]) == pytest.approx(0.8 / 3, abs=1e-6)
    assert float(met["pg_clipfrac"]) == pytest.approx(2 / 3)
    lp2 = t(CISPO_LP).requires_grad_(True)
    ppo, _ = rl.policy_loss(lp2, t(CISPO_OLD), t(CISPO_ADV), t([[1, 1, 1]]), 0.2)
    ppo.backward()
    assert lp2.grad is not None and float(lp2.grad[0, 2]) == 0.0


def test_cispo_weights_and_refusals() -> None:
    # constant per-token weights multiply ℓ_t: w = [0.5, 1, 1] halves t0's 2.4 -> (1.2 + 1 - 0.735759)/3
    loss, _ = rl.cispo_policy_loss(
        t(CISPO_LP), t(CISPO_OLD), t(CISPO_ADV), t([[1, 1, 1]]), math.inf, 0.2, weights=t([[0.5, 1, 1]])
    )
    assert float(loss) == pytest.approx((1.2 + 1.0 - 2 * math.exp(-1.0)) / 3, abs=1e-6)
    with pytest.raises(rl.RLInputError, match="dual clip"):
        rl.cispo_policy_loss(
            t(CISPO_LP), t(CISPO_OLD), t(CISPO_ADV), t([[1, 1, 1]]), 0.2, None, dual_clip=3.0
        )
    with pytest.raises(rl.RLInputError, match="clip_eps must be >= 0"):
        rl.cispo_policy_loss(t(CISPO_LP), t(CISPO_OLD), t(CISPO_ADV), t([[1, 1, 1]]), -0.1, None)


# ---- SAPO -----------------------------------------------------------------------------------------------
# Row 0: 2 tokens, A = +1, log-ratios [0.1, 0]; row 1: 1 token (then padding), A = -1, log-ratio -0.2.
SAPO_LP, SAPO_OLD = [[-1.0, -2.0], [-0.7, 0.0]], [[-1.1, -2.0], [-0.5, 0.0]]
SAPO_ADV, SAPO_MASK = [[1.0, 1.0], [-1.0, 0.0]], [[1, 1], [1, 0]]


def test_sapo_golden_value_gradient_and_defaults() -> None:
    # The paper's (and verl's) τ_pos = 1, τ_neg = 1.05; f(ρ) = σ(τ(ρ - 1))·4/τ; ℓ = -f(ρ)·A; per-sequence
    # token mean, then the mean over the 2 sequences (seq-mean-token-mean, the paper's 1/G Σ 1/|y_i| Σ_t).
    d = POLICY_LOSSES.get("sapo")
    assert (d.clip_eps, d.clip_eps_high, d.agg, d.dual_clip) == (None, None, "seq-mean-token-mean", False)
    assert {a.name: a.default for a in d.args} == {"tau_pos": 1.0, "tau_neg": 1.05}
    r00, r01, r10 = math.exp(0.1), 1.0, math.exp(-0.2)  # 1.105171, 1, 0.818731
    # σ(τ(ρ - 1)): 0.526269, 0.5, 0.452560
    s00, s01, s10 = sigmoid(1.0 * (r00 - 1)), sigmoid(0.0), sigmoid(1.05 * (r10 - 1))
    l00, l01, l10 = -4 * s00, -4 * s01, +s10 * 4 / 1.05  # -2.105074, -2, +1.724038
    expected = ((l00 + l01) / 2 + l10) / 2  # -0.164250
    assert expected == pytest.approx(-0.164250, abs=1e-6)
    lp = t(SAPO_LP).requires_grad_(True)
    loss, met = rl.sapo_policy_loss(lp, t(SAPO_OLD), t(SAPO_ADV), t(SAPO_MASK), tau_pos=1.0, tau_neg=1.05)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-6)
    # ∂ℓ/∂log π = -A·4σ(1-σ)·ρ, divided by n_b (tokens of the row) and n_seq = 2; at ρ = 1 it is -A/(n_b·2),
    # the plain policy gradient's, whatever τ (row 0 token 1)
    g = [
        4 * s00 * (1 - s00) * r00,
        4 * s01 * (1 - s01) * r01,
        4 * s10 * (1 - s10) * r10,
    ]  # 1.102120, 1, 0.811360
    loss.backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, t([[-g[0] / 4, -g[1] / 4], [g[2] / 2, 0.0]]), atol=1e-6, rtol=0)
    assert float(met["sapo_weight_mean"]) == pytest.approx(sum(g) / 3, abs=1e-6)  # 0.971160
    assert "pg_clipfrac" not in met  # no clip to count (verl logs a constant 0)


def test_sapo_refuses_a_clip_range_and_a_bad_temperature() -> None:
    args = (t(SAPO_LP), t(SAPO_OLD), t(SAPO_ADV), t(SAPO_MASK))
    with pytest.raises(rl.RLInputError, match="no clip range"):
        rl.sapo_policy_loss(*args, 0.2, None, tau_pos=1.0, tau_neg=1.05)
    with pytest.raises(rl.RLInputError, match="dual clip"):
        rl.sapo_policy_loss(*args, tau_pos=1.0, tau_neg=1.05, dual_clip=3.0)
    with pytest.raises(rl.RLInputError, match="temperatures must be > 0"):
        rl.sapo_policy_loss(*args, tau_pos=0.0, tau_neg=1.05)


# ---- through the node functions --------------------------------------------------------------------------
LP = torch.tensor([[-0.8, -1.0, -1.5], [-1.2, -1.0, -0.6]])  # the current policy's log-probs, 2 rows


def _node_loss(
    monkeypatch: pytest.MonkeyPatch, function: str, batch: Batch, **args: Any
) -> tuple[float, dict]:
    """``function`` run through its registered function with the policy's log-probs fixed to LP; the old
    log-probs are the batch's ``logprobs`` (recompute_logprobs false); returns the loss and its metrics."""
    out: list[tuple[float, dict]] = []

    def fake_optimize(
        ctx: Any, work: Batch, loss_fn: Any, prefix: str, agg: str, mask_key: str = "response_mask", **_: Any
    ) -> dict[str, float]:
        loss, metrics, _ = loss_fn(None, work, F.rl.loss_normalizer(work.tensor(mask_key), agg))
        out.append((float(loss), metrics))
        return {}

    monkeypatch.setattr(F, "optimize", fake_optimize)
    monkeypatch.setattr(F, "batch_logprobs", lambda m, b, **kw: (LP.clone(), torch.zeros_like(LP)))
    ctx = NodeContext(node=NodeSpec("n", "train", function), model=None, group_size=2)
    NODE_FUNCTIONS.get(function).fn(ctx, batch, recompute_logprobs=False, kl_loss_coef=0.0, **args)
    return out[-1]


def _batch(old: list[list[float]], scores: list[float], mask: list[list[int]] | None = None) -> Batch:
    rows, width = len(scores), 3
    return Batch(
        {
            "prompt_ids": torch.ones(rows, 2, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "response_ids": torch.full((rows, width), 5),
            "response_mask": torch.tensor(mask) if mask else torch.ones(rows, width, dtype=torch.long),
            "logprobs": torch.tensor(old),
            "ref_logprobs": torch.tensor(old),
            "scores": torch.tensor(scores),
        }
    )


def test_grpo_actor_runs_cispo_with_the_papers_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    # Group of 2 with scores [1, 0], eps 0: A = ±(0.5/0.707107) = ±0.707107 (unbiased std). Old log-probs
    # [-1, -1, -1] per row: log-ratios row 0 [0.2, 0, -0.5], row 1 [-0.2, 0, 0.4];
    # ŵ = clip(ρ, -inf, 1.2): row 0 [1.2 (1.221403 clipped), 1, e^-0.5], row 1 [e^-0.2, 1,
    # 1.2 (e^0.4 clipped)]; ℓ = -ŵ·A·log π; token-mean over 6 tokens.
    a = 0.5 / math.sqrt(0.5)
    w0, w1 = [1.2, 1.0, math.exp(-0.5)], [math.exp(-0.2), 1.0, 1.2]
    lp0, lp1 = LP[0].tolist(), LP[1].tolist()
    expected = (
        sum(-w * a * x for w, x in zip(w0, lp0, strict=True))
        + sum(w * a * x for w, x in zip(w1, lp1, strict=True))
    ) / 6
    loss, metrics = _node_loss(
        monkeypatch, "grpo_actor", _batch([[-1.0] * 3] * 2, [1.0, 0.0]), loss="cispo", eps=0.0
    )
    assert loss == pytest.approx(expected, abs=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 6)
    # ppo_actor takes the loss too (its advantages are GAE's; the surrogate is CISPO's: a clip fraction)
    ppo_batch = _batch([[-1.0] * 3] * 2, [1.0, 0.0])
    ppo_batch["values"] = torch.zeros(2, 3)
    _, m = _node_loss(monkeypatch, "ppo_actor", ppo_batch, loss="cispo", whiten_advantages=False)
    assert "pg_clipfrac" in m and "sapo_weight_mean" not in m
    _, m = _node_loss(monkeypatch, "ppo_actor", ppo_batch, loss="sapo", whiten_advantages=False)
    assert "sapo_weight_mean" in m


def test_grpo_actor_runs_sapo_with_the_nodes_temperatures(monkeypatch: pytest.MonkeyPatch) -> None:
    # A = ±0.707107 as above; the node's τ_pos = 2, τ_neg = 3; seq-mean-token-mean (the loss's default).
    a = 0.5 / math.sqrt(0.5)
    r0 = [math.exp(0.2), 1.0, math.exp(-0.5)]
    r1 = [math.exp(-0.2), 1.0, math.exp(0.4)]
    row0 = sum(-sigmoid(2 * (r - 1)) * 4 / 2 * a for r in r0) / 3
    row1 = sum(sigmoid(3 * (r - 1)) * 4 / 3 * a for r in r1) / 3
    loss, _ = _node_loss(
        monkeypatch,
        "grpo_actor",
        _batch([[-1.0] * 3] * 2, [1.0, 0.0]),
        loss="sapo",
        eps=0.0,
        tau_pos=2.0,
        tau_neg=3.0,
    )
    assert loss == pytest.approx((row0 + row1) / 2, abs=1e-5)


def test_dr_grpo_is_expressible_by_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    # Dr. GRPO (Liu et al. 2025, eq. 3): A_i = R_i - mean(R) (std: none) and Σ_i Σ_t ℓ / (G·L) with L
    # constant (agg: seq-mean-token-sum-norm; L = the call's response width, the generate node's
    # max_new_tokens, 3 here). On-policy (old = LP): PPO's ℓ_t = -A_t. Scores [1, 0]: A = [+0.5, -0.5]; row 0
    # has 3 tokens, row 1 only 1: Σ ℓ = -0.5·3 + 0.5·1 = -1.0; / (2 sequences · 3) = -0.166667. GRPO's
    # defaults instead (std: group, token-mean): A = ±0.707107, (-0.707107·3 + 0.707107)/4 tokens = -0.353553.
    batch = _batch(LP.tolist(), [1.0, 0.0], [[1, 1, 1], [1, 0, 0]])
    loss, _ = _node_loss(monkeypatch, "grpo_actor", batch, std="none", agg="seq-mean-token-sum-norm", eps=0.0)
    assert loss == pytest.approx(-1.0 / 6, abs=1e-6)
    loss, _ = _node_loss(monkeypatch, "grpo_actor", batch, eps=0.0)
    assert loss == pytest.approx((-3 + 1) * 0.5 / math.sqrt(0.5) / 4, abs=1e-6)


# ---- the update of a tiny model changes with the loss ----------------------------------------------------
CONFIG = {"model_type": "llama", "vocab_size": 19, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 32, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
          "tie_word_embeddings": False}  # fmt: skip


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_model(config=CONFIG, head="lm", seed=0).float().eval()


def _update(tiny: torch.nn.Module, function: str, **args: Any) -> list[torch.Tensor]:
    """The weight change of one SGD step (lr 1) of ``function`` on a fixed off-policy batch of 4 rows."""
    module = copy.deepcopy(tiny)
    state = ModelState(name="m", module=module, head="lm")
    state.optimizer = torch.optim.SGD(module.parameters(), lr=1.0)
    state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
    state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    before = [p.detach().clone() for p in module.parameters()]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 19, (4, 4), generator=gen)
    # sampler log-probs far from the policy's (ratios well outside [0.8, 1.28]) so the surrogates differ
    shift = torch.tensor(
        [[-0.9, 0.5, 0.0, 0.3], [0.4, -0.6, 0.2, 0.0], [0.0, 0.7, -0.5, 0.1], [-0.3, 0.0, 0.6, -0.8]]
    )
    batch = Batch(
        {
            "prompt_ids": torch.tensor([[1, 5, 14]] * 4),
            "prompt_mask": torch.ones(4, 3, dtype=torch.long),
            "response_ids": ids,
            "response_mask": torch.ones(4, 4, dtype=torch.long),
            "logprobs": torch.full((4, 4), -3.0) + shift,
            "ref_logprobs": torch.full((4, 4), -3.0),
            "values": torch.zeros(4, 4),
            "scores": torch.tensor([1.0, 0.0, 0.5, 0.2]),
        }
    )
    entry = NODE_FUNCTIONS.get(function)
    batch = batch.select([k for k in entry.inputs if k in batch])
    node = NodeSpec("node", "train", function, model="m", args=dict(args))
    entry.fn(NodeContext(node=node, model=state, group_size=2), batch, recompute_logprobs=False, **args)
    return [p.detach() - b for p, b in zip(module.parameters(), before, strict=True)]


def _relative(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    diff = math.sqrt(sum(float(((x - y) ** 2).sum()) for x, y in zip(a, b, strict=True)))
    return diff / math.sqrt(sum(float((x**2).sum()) for x in a))


@pytest.mark.parametrize("function", ["grpo_actor", "ppo_actor"])
def test_the_loss_changes_the_update(tiny: torch.nn.Module, function: str) -> None:
    ppo = _update(tiny, function)
    for loss in ("cispo", "sapo"):
        assert _relative(ppo, _update(tiny, function, loss=loss)) > 1e-2, loss
    # SAPO's temperatures reach the update
    assert (
        _relative(_update(tiny, function, loss="sapo"), _update(tiny, function, loss="sapo", tau_neg=4.0))
        > 1e-3
    )


# ---- validate refuses bad loss arguments, naming file, node and key --------------------------------------
BAD = [
    ("examples/sapo.yaml", "nodes.actor_train.args.tau_neg=0",
     "examples/sapo.yaml: nodes.actor_train.args.tau_neg: must be > 0, got 0"),
    ("examples/sapo.yaml", "nodes.actor_train.args.clip_eps=0.2",
     "examples/sapo.yaml: nodes.actor_train.args.clip_eps: cannot be combined with loss 'sapo'"),
    ("examples/cispo.yaml", "nodes.actor_train.args.dual_clip=3",
     "examples/cispo.yaml: nodes.actor_train.args.dual_clip: cannot be combined with loss 'cispo'"),
    ("examples/cispo.yaml", "nodes.actor_train.args.tau_pos=2",
     "examples/cispo.yaml: nodes.actor_train.args.tau_pos: is read only when loss is sapo, but loss is "
     "'cispo'"),
    ("examples/cispo.yaml", "nodes.actor_train.args.clip_eps_high=-1",
     "examples/cispo.yaml: nodes.actor_train.args.clip_eps_high: must be > 0, got -1"),
]  # fmt: skip


@pytest.mark.parametrize(("graph_file", "override", "message"), BAD, ids=[b[1] for b in BAD])
def test_validate_refuses_a_bad_loss_argument(
    graph_file: str, override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", graph_file, override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
