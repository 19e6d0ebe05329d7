"""Golden cases of issue 3 for rlflow.nodes.rl, each with its hand derivation."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.nodes.rl import (
    KL_ESTIMATORS,
    RLInputError,
    align_to_response,
    cu_seqlens_from_lengths,
    first_eos_lengths,
    gae,
    grpo_advantages,
    label_logprobs,
    lengths_to_mask,
    masked_mean,
    next_token_logprobs,
    packed_layout,
    policy_loss,
    preference_loss,
    process_logits,
    response_logprobs,
    reward_to_go,
    sample_from_logits,
    sampled_entropy,
    sequence_logps,
    token_rewards,
)
from rlflow.nodes.rl.kl import kl_terms

NAN = float("nan")


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a: torch.Tensor, b: list | float, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# ---- case 1 -------------------------------------------------------------------------------------------
def test_case1_reward_to_go_skips_holes() -> None:
    # trainable tokens 0, 3, 4 with rewards 0, 0, 2; γ=1: every trainable token's return is 2
    mask = t([[1, 0, 0, 1, 1]])
    rtg = reward_to_go(t([[0, 0, 0, 0, 2]]), mask, gamma=1.0)
    close(rtg[mask.bool()], [2.0, 2.0, 2.0])


def test_case1_discount_counts_trainable_tokens() -> None:
    # trainable tokens 0 and 3; G_3 = 4, G_0 = 0 + 0.5·G_3 = 2 (one trainable step, not three positions)
    mask = t([[1, 0, 0, 1]])
    rtg = reward_to_go(t([[0, 0, 0, 4]]), mask, gamma=0.5)
    close(rtg, [[2.0, 0.0, 0.0, 4.0]])


def test_case1_gae_ignores_values_on_masked_tokens() -> None:
    # terminal end: δ_3 = 4 + 0 - 0.5 = 3.5 = A_3;  δ_0 = 0 + 1·V_3 - V_0 = 0.5 - 0.2 = 0.3,
    # A_0 = 0.3 + 1·0.95·3.5 = 3.625. The 9.9s (or NaN) at masked positions 1, 2 must not matter.
    mask = t([[1, 0, 0, 1]])
    rewards = t([[0, 0, 0, 4]])
    for filler in (9.9, NAN, float("inf")):
        adv, ret = gae(rewards, t([[0.2, filler, filler, 0.5]]), mask, gamma=1.0, lam=0.95)
        close(adv, [[3.625, 0.0, 0.0, 3.5]])
        close(ret, [[3.825, 0.0, 0.0, 4.0]])  # returns = A + V


# ---- case 2 -------------------------------------------------------------------------------------------
def test_case2_score_on_last_real_token_and_none_for_empty() -> None:
    # lengths [3, 0] in width 4: row 0's last real token is index 2; row 1 has no token, gets nothing
    mask = lengths_to_mask(torch.tensor([3, 0]), 4)
    close(token_rewards(t([1.0, 5.0]), mask), [[0, 0, 1, 0], [0, 0, 0, 0]])


# ---- case 3 -------------------------------------------------------------------------------------------
def test_case3_ppo_rewards_and_gae() -> None:
    # [x, y, EOS, PAD]: mask from length 3 -> [1,1,1,0]; score 2 on EOS: rewards [0,0,2,0].
    # V = 0, γ = 1, λ = 0.9: δ = r; A_2 = 2, A_1 = 0 + 0.9·2 = 1.8, A_0 = 0.9·1.8 = 1.62.
    ids = torch.tensor([[11, 12, 2, 0]])
    mask = lengths_to_mask(first_eos_lengths(ids, eos_ids=2), 4)
    rewards = token_rewards(t([2.0]), mask)
    close(rewards, [[0, 0, 2, 0]])
    adv, _ = gae(rewards, torch.zeros(1, 4), mask, gamma=1.0, lam=0.9)
    close(adv, [[1.62, 1.8, 2.0, 0.0]])


# ---- case 4 -------------------------------------------------------------------------------------------
def test_case4_mask_from_lengths_when_pad_equals_eos() -> None:
    # pad = EOS = 2: the first 2 is the generated EOS (inside the mask), later 2s are padding.
    ids = torch.tensor([[5, 7, 2, 2, 2]])
    mask = lengths_to_mask(first_eos_lengths(ids, eos_ids=2), 5)
    assert mask.long().tolist() == [[1, 1, 1, 0, 0]]
    assert (ids != 2).long().tolist() == [[1, 1, 0, 0, 0]]  # the id-based mask would drop the EOS


# ---- case 5 -------------------------------------------------------------------------------------------
def test_case5_cu_seqlens() -> None:
    # lengths 3 and 2 fill 5 tokens exactly: no padding segment (never a zero-length one);
    # padded to 8: one trailing padding segment [5, 8).
    assert cu_seqlens_from_lengths([3, 2], pad_to=5).tolist() == [0, 3, 5]
    assert cu_seqlens_from_lengths([3, 2], pad_to=8).tolist() == [0, 3, 5, 8]
    assert cu_seqlens_from_lengths([3, 0, 2]).tolist() == [0, 3, 5]  # empty row: no segment
    attn = t([[1, 1, 1, 0], [0, 0, 0, 0], [0, 1, 1, 0]])
    assert packed_layout(attn, pad_to=5).cu_seqlens.tolist() == [0, 3, 5]
    assert packed_layout(attn, pad_to=8).cu_seqlens.tolist() == [0, 3, 5, 8]


# ---- case 6 -------------------------------------------------------------------------------------------
def _expected_kl(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact E_{x~π}[k(x)] and its gradient w.r.t. π's logits (pathwise through log π(x), π weights fixed)."""
    pi = t([0.5, 0.3, 0.2])
    ref = t([0.25, 0.25, 0.5])
    theta = pi.log().clone().requires_grad_(True)
    logp = torch.log_softmax(theta, dim=-1)
    terms = kl_terms(logp[None], ref.log()[None], torch.ones(1, 3), kind)[0]
    expectation = (pi * terms).sum()
    expectation.backward()
    assert theta.grad is not None
    return expectation.detach(), theta.grad


def test_case6_kl_estimators_values_and_gradients() -> None:
    # ℓ = ln(π/π_ref) = [ln 2, ln 1.2, ln 0.4] = [0.693147, 0.182322, -0.916291]
    # E[k1] = Σπℓ = 0.346574 + 0.054697 - 0.183258 = 0.218012 = KL(π‖π_ref);
    # E[k3] = Σ(π_ref - π) + KL = KL; E[k2] = ½Σπℓ² = ½(0.240227 + 0.009972 + 0.167918) = 0.209058.
    # Gradients w.r.t. logits θ (∇_θ log π_x = e_x - π):
    #   k1: E[∇ℓ] = Σ π_x (e_x - π) = 0.
    #   k2: E[ℓ ∇ℓ] = π⊙(ℓ - KL) = [0.5·0.475135, 0.3·(-0.035690), 0.2·(-1.134303)]
    #       = [0.237568, -0.010707, -0.226861] — the reverse-KL gradient.
    #   k3: E[(1 - π_ref/π) ∇ℓ] = Σ(π_x - ref_x)(e_x - π) = π - π_ref = [0.25, 0.05, -0.3] — forward KL.
    v1, g1 = _expected_kl("k1")
    v2, g2 = _expected_kl("k2")
    v3, g3 = _expected_kl("k3")
    close(v1, 0.218012)
    close(v3, 0.218012)
    close(v2, 0.209058)
    close(g1, [0.0, 0.0, 0.0])
    close(g2, [0.237568, -0.010707, -0.226861])
    close(g3, [0.25, 0.05, -0.3])
    # the labels say the same
    assert KL_ESTIMATORS["k2"].gradient_follows.startswith("reverse")
    assert KL_ESTIMATORS["k3"].gradient_follows.startswith("forward")
    assert KL_ESTIMATORS["k1"].gradient_follows.startswith("none")


# ---- case 7 -------------------------------------------------------------------------------------------
def test_case7_mean_entropy_over_completion() -> None:
    # 5 positions, 2-token prompt: the 3 completion tokens are predicted from positions 1, 2, 3,
    # entropies [0.8, 0.4, 0.6]: mean 0.6 (not [0.4, 0.6, 0.5] -> 0.5, the off-by-one).
    ent = t([[0.9, 0.8, 0.4, 0.6, 0.5]])
    completion = align_to_response(ent, response_width=3)
    close(completion, [[0.8, 0.4, 0.6]])
    close(masked_mean(completion, torch.ones(1, 3)), 0.6)


def test_case7_label_logprobs_shift() -> None:
    # position t predicts token t+1: row [0,2,0] -> token 1, [0,0,2] -> token 2, [0,2,0] -> token 1;
    # each is the large entry: 2 - ln(e² + 1 + 1) = 2 - 2.239545 = -0.239545. Row [1,1,1] predicts nothing.
    logits = t([[[0, 2, 0], [0, 0, 2], [0, 2, 0], [1, 1, 1]]])
    ids = torch.tensor([[0, 1, 2, 1]])
    expected = 2 - math.log(math.exp(2) + 2)
    assert abs(expected - -0.239545) < 1e-6
    close(next_token_logprobs(logits, ids), [[expected] * 3])
    # same through the response view: prompt [0], response [1, 2, 1]
    close(response_logprobs(logits, ids[:, 1:], torch.ones(1, 3)), [[expected] * 3])


# ---- case 8 -------------------------------------------------------------------------------------------
def test_case8_group_mean_ignores_empty_sequences() -> None:
    # token counts [0, 2, 3]: the empty sequence (score 4) is left out; baseline = mean(1, 3) = 2,
    # advantages [0, 1 - 2, 3 - 2] = [0, -1, +1].
    mask = lengths_to_mask(torch.tensor([0, 2, 3]), 3)
    adv = grpo_advantages(t([4.0, 1.0, 3.0]), mask, group_size=3, std="none")
    close(adv, [[0, 0, 0], [-1, -1, 0], [1, 1, 1]])


# ---- case 9 -------------------------------------------------------------------------------------------
def test_case9_ipo_length_averaged() -> None:
    # averages: chosen π -1.5, ref -2.0 (ratio 0.5); rejected π -2.0, ref -5/3 (ratio -1/3);
    # h = 0.5 + 1/3 = 0.833333; 1/(2β) = 5; loss = (0.833333 - 5)² = 4.166667² = 17.361111.
    chosen_mask = t([[1, 1, 0]])
    rejected_mask = t([[1, 1, 1]])
    pc = sequence_logps(t([[-1, -2, NAN]]), chosen_mask)
    rc = sequence_logps(t([[-1.5, -2.5, NAN]]), chosen_mask)
    pr = sequence_logps(t([[-3, -1, -2]]), rejected_mask)
    rr = sequence_logps(t([[-2, -1, -2]]), rejected_mask)
    loss, _ = preference_loss(
        pc, pr, rc, rr, beta=0.1, loss_type="ipo", chosen_lengths=chosen_mask.sum(-1),
        rejected_lengths=rejected_mask.sum(-1),
    )  # fmt: skip
    close(loss, 17.361111, atol=1e-4)
    # the same from length-averaged sequence log-probs
    avg = [sequence_logps(x, mk, average=True) for x, mk in ((t([[-1, -2, 0]]), chosen_mask),)]
    close(avg[0], [-1.5])


def test_case9_zero_token_completion_rejected() -> None:
    with pytest.raises(RLInputError):
        sequence_logps(t([[-1.0, -2.0]]), t([[0, 0]]), average=True)
    one = t([-1.0])
    with pytest.raises(RLInputError):
        preference_loss(one, one, one, one, beta=0.1, loss_type="ipo", chosen_lengths=t([0.0]),
                        rejected_lengths=t([2.0]))  # fmt: skip


# ---- case 10 ------------------------------------------------------------------------------------------
def test_case10_token_mean_policy_loss() -> None:
    # ratio 1: per-token loss -A = [-2, 1, (masked)]; token-mean over 2 tokens = -0.5
    lp = torch.zeros(1, 3)
    loss, metrics = policy_loss(lp, lp, t([[2, -1, 0]]), t([[1, 1, 0]]), clip_eps=0.2)
    close(loss, -0.5)
    close(metrics["pg_clipfrac"], 0.0)


# ---- case 11 ------------------------------------------------------------------------------------------
def test_case11_nan_old_logprob_on_masked_token() -> None:
    # only token 0 counts: ratio exp(-0.5 + 0.5) = 1, loss = -2; d loss / d logp_0 = -A·ρ = -2
    lp = t([[-0.5, -1.0]]).requires_grad_(True)
    loss, _ = policy_loss(lp, t([[-0.5, NAN]]), t([[2.0, 3.0]]), t([[1, 0]]), clip_eps=0.2)
    close(loss, -2.0)
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()
    close(lp.grad, [[-2.0, 0.0]])


# ---- case 12 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad", [1.0, -50.0, NAN, float("inf"), float("-inf")])
def test_case12_sampled_entropy_ignores_padding(pad: float) -> None:
    # -(-0.5 - 1.0) = 1.5 nats for the sequence; padding (+1.0 would give 1.5 - 2 = -0.5) never counts
    ent = sampled_entropy(t([[-0.5, -1.0, pad, pad]]), t([[1, 1, 0, 0]]))
    close(ent, [1.5])
    assert bool((ent >= 0).all())


# ---- case 13 ------------------------------------------------------------------------------------------
def test_case13_temperature_before_softmax() -> None:
    # z = [2,1,0]/0.5 = [4,2,0]; log p_0 = 4 - ln(e⁴ + e² + 1) = 4 - 4.142932 = -0.142932.
    # Dividing the T=1 log-prob by T gives (2 - 2.407606)/0.5 = -0.815212: a different number.
    logits = t([[[2.0, 1.0, 0.0]]])
    lp = label_logprobs(logits, torch.tensor([[0]]), temperature=0.5)
    close(lp, [[-0.142932]])
    wrong = torch.log_softmax(logits, -1)[..., 0] / 0.5
    assert abs(float(wrong) - -0.815212) < 1e-5


# ---- case 14 ------------------------------------------------------------------------------------------
def test_case14_top_p_kept_mass_and_on_policy_ratio() -> None:
    # sorted probs 0.5, 0.3, 0.15, 0.05; mass before each: 0, 0.5, 0.8, 0.95; keep while < 0.75:
    # tokens 0 and 1, kept mass 0.8 (the smallest prefix with mass ≥ 0.75).
    logits = t([0.5, 0.3, 0.15, 0.05]).log()
    z = process_logits(logits, top_p=0.75)
    kept = torch.isfinite(z)
    assert kept.tolist() == [True, True, False, False]
    close(torch.softmax(logits, -1)[kept].sum(), 0.8)
    # sampler and trainer agree bit for bit: ratio exactly 1
    gen = torch.Generator().manual_seed(0)
    batch_logits = logits.expand(64, 4).contiguous()
    tokens, sampler_lp = sample_from_logits(batch_logits, top_p=0.75, generator=gen)
    assert set(tokens.tolist()) <= {0, 1}
    trainer_lp = label_logprobs(batch_logits[:, None, :], tokens[:, None], top_p=0.75)[:, 0]
    assert torch.equal(torch.exp(trainer_lp - sampler_lp), torch.ones(64))
