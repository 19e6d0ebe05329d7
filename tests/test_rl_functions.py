"""Unit tests of rlflow.nodes.rl beyond the issue's golden cases: hand-derived values, errors, exactness."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import rlflow.nodes.rl as rl
from rlflow.dataflow.errors import DataError

NAN = float("nan")


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a: torch.Tensor, b: list | float, atol: float = 1e-6) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# ---- masks ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [[1.0, 0.5], [2, 0], [NAN, 1.0], [-1, 1]])
def test_non_binary_mask_raises(bad: list) -> None:
    with pytest.raises(rl.MaskError) as info:
        rl.policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([bad]))
    assert isinstance(info.value, ValueError) and isinstance(info.value, DataError)


@pytest.mark.parametrize("mask", [torch.tensor([[True, False]]), torch.tensor([[1, 0]]), t([[1, 0]])])
def test_mask_dtypes_accepted(mask: torch.Tensor) -> None:
    assert rl.check_mask(mask).tolist() == [[True, False]]


def test_shape_mismatch_raises() -> None:
    with pytest.raises(rl.RLInputError):
        rl.masked_mean(torch.zeros(2, 3), torch.ones(2, 2))


def test_masked_whiten_and_var() -> None:
    # values 1, 2, 3 selected: mean 2, unbiased var (1 + 0 + 1)/2 = 1 -> whitened [-1, 0, 1]
    x, m = t([[1, 99, 2, 3]]), t([[1, 0, 1, 1]])
    close(rl.masked_var(x, m), 1.0)
    close(rl.masked_whiten(x, m, eps=0.0), [[-1, 0, 0, 1]])
    close(rl.masked_whiten(x, m, shift_mean=False, eps=0.0), [[1, 0, 2, 3]])
    close(rl.masked_var(t([[5.0]]), t([[1]])), 0.0)  # one value: 0 by definition


def test_lengths_to_mask_errors() -> None:
    with pytest.raises(rl.RLInputError):
        rl.lengths_to_mask(torch.tensor([5]), 4)
    assert rl.first_eos_lengths(torch.tensor([[4, 4, 4]]), [2, 3]).tolist() == [3]  # no EOS: truncated


# ---- log-probs ------------------------------------------------------------------------------------------
def test_process_logits_top_k_and_errors() -> None:
    z = rl.process_logits(t([3.0, 1.0, 2.0, 1.0]), top_k=2)
    assert torch.isfinite(z).tolist() == [True, False, True, False]
    z = rl.process_logits(t([3.0, 1.0, 2.0, 2.0]), top_k=2)  # tie at the k-th value: both kept
    assert torch.isfinite(z).tolist() == [True, False, True, True]
    for kwargs in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}):
        with pytest.raises(rl.RLInputError):
            rl.process_logits(t([1.0, 2.0]), **kwargs)  # type: ignore[arg-type]


def test_top_p_boundary_keeps_smallest_prefix() -> None:
    # probs 0.5, 0.3, 0.2: mass before token 2 is 0.8. top_p just below 0.8: {0, 1} already reach it ->
    # token 2 dropped; top_p just above 0.8: {0, 1} fall short -> token 2 kept.
    z = rl.process_logits(t([0.5, 0.3, 0.2]).log(), top_p=0.8 - 1e-4)
    assert torch.isfinite(z).tolist() == [True, True, False]
    z = rl.process_logits(t([0.5, 0.3, 0.2]).log(), top_p=0.8 + 1e-4)
    assert torch.isfinite(z).tolist() == [True, True, True]
    z = rl.process_logits(t([0.9, 0.05, 0.05]).log(), top_p=0.1)  # the top token is always kept
    assert torch.isfinite(z).tolist() == [True, False, False]


def test_sampler_and_trainer_agree_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, 11, generator=gen) * 3
    cfg = {"temperature": 0.7, "top_k": 6, "top_p": 0.85}
    tokens, sampler_lp = [], []
    for step in range(5):  # the sampler sees one position at a time, [B, V]
        tok, lp = rl.sample_from_logits(logits[:, step], generator=gen, **cfg)  # type: ignore[arg-type]
        tokens.append(tok)
        sampler_lp.append(lp)
    ids = torch.stack(tokens, 1)
    trainer = rl.label_logprobs(logits, ids, torch.ones(6, 5), **cfg)  # type: ignore[arg-type]
    assert torch.equal(trainer, torch.stack(sampler_lp, 1))
    greedy, _ = rl.sample_from_logits(logits[:, 0], greedy=True)
    assert torch.equal(greedy, logits[:, 0].argmax(-1))


def test_entropy_from_logits() -> None:
    close(rl.entropy_from_logits(torch.zeros(1, 1, 4)), [[math.log(4)]])
    # top-k 2 of [3, 2, 0, 0]: entropy of softmax([3, 2]) = ln(1 + e) - e/(1 + e)... computed directly
    p = torch.softmax(t([3.0, 2.0]), -1)
    expected = float(-(p * p.log()).sum())
    logits = t([[[3.0, 2.0, 0.0, 0.0]]]).requires_grad_(True)
    ent = rl.entropy_from_logits(logits, top_k=2)
    close(ent, [[expected]])
    ent.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    close(logits.grad[0, 0, 2:], [0.0, 0.0])


# ---- rewards, KL ----------------------------------------------------------------------------------------
def test_token_rewards_with_kl_and_hole() -> None:
    # last real token is index 2 even with a hole at 1; KL penalty -0.1·kl on trainable tokens only
    mask = t([[1, 0, 1, 0]])
    r = rl.token_rewards(t([3.0]), mask, kl=t([[1.0, 50.0, 2.0, NAN]]), kl_coef=0.1)
    close(r, [[-0.1, 0.0, 3.0 - 0.2, 0.0]])


def test_kl_values() -> None:
    # ℓ = 0.5: k1 = 0.5, k2 = 0.125, k3 = e^-0.5 - 1 + 0.5 = 0.106531
    lp, ref, m = t([[-1.0]]), t([[-1.5]]), t([[1]])
    close(rl.kl_terms(lp, ref, m, "k1"), [[0.5]])
    close(rl.kl_terms(lp, ref, m, "k2"), [[0.125]])
    close(rl.kl_terms(lp, ref, m, "k3"), [[0.106531]])
    with pytest.raises(rl.RLInputError):
        rl.kl_terms(lp, ref, m, "k4")


# ---- advantages -----------------------------------------------------------------------------------------
def test_gae_truncated_bootstraps() -> None:
    # one token, r = 0, V = 0.5, γ = 0.9: terminal δ = -0.5; truncated with V_next = 2: δ = 1.8 - 0.5 = 1.3
    r, v, m = t([[0.0], [0.0]]), t([[0.5], [0.5]]), t([[1], [1]])
    adv, ret = rl.gae(
        r, v, m, 0.9, 0.95, bootstrap_value=t([2.0, NAN]), truncated=torch.tensor([True, False])
    )
    close(adv, [[1.3], [-0.5]])
    close(ret, [[1.8], [0.0]])
    with pytest.raises(rl.RLInputError):
        rl.gae(r, v, m, 0.9, 0.95, truncated=torch.tensor([True, False]))
    with pytest.raises(rl.RLInputError):
        rl.gae(r, v, m, 0.9, 0.95, bootstrap_value=t([1.0, 1.0]))


@settings(max_examples=20, deadline=None)
@given(bits=st.lists(st.booleans(), min_size=1, max_size=7), seed=st.integers(0, 1000))
def test_gae_with_holes_equals_gae_on_compacted_tokens(bits: list[bool], seed: int) -> None:
    # metamorphic: deleting the mask-0 columns does not change the advantages of trainable tokens
    gen = torch.Generator().manual_seed(seed)
    n = len(bits)
    r, v = torch.randn(1, n, generator=gen), torch.randn(1, n, generator=gen)
    m = torch.tensor([bits])
    adv, ret = rl.gae(r, v, m, 0.9, 0.7, t([0.3]), torch.tensor([True]))
    keep = m[0]
    k = int(keep.sum())
    adv_c, ret_c = rl.gae(r[:, keep], v[:, keep], torch.ones(1, k), 0.9, 0.7, t([0.3]), torch.tensor([True]))
    torch.testing.assert_close(adv[:, keep], adv_c)
    torch.testing.assert_close(ret[:, keep], ret_c)


def test_grpo_group_std() -> None:
    # [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], unbiased var 14/3, std 2.160247
    adv = rl.grpo_advantages(t([1, 2, 3, 6]), torch.ones(4, 1), group_size=4)
    close(adv[:, 0], [-2 / 2.160247, -1 / 2.160247, 0.0, 3 / 2.160247], atol=1e-5)


def test_grpo_batch_std() -> None:
    # groups [1, 3], [0, 4]: centred [-1, 1, -2, 2]; batch std of [1, 3, 0, 4] (mean 2): sqrt(10/3) = 1.825742
    adv = rl.grpo_advantages(t([1, 3, 0, 4]), torch.ones(4, 2), group_size=2, std="batch")
    close(adv[:, 0], [-1 / 1.825742, 1 / 1.825742, -2 / 1.825742, 2 / 1.825742], atol=1e-5)


def test_grpo_degenerate_groups_give_zero() -> None:
    ones = torch.ones(4, 2)
    assert torch.equal(rl.grpo_advantages(t([1, 2, 3, 4]), ones, group_size=1), torch.zeros(4, 2))
    assert torch.equal(rl.grpo_advantages(t([5, 5, 5, 5]), ones, group_size=2), torch.zeros(4, 2))
    # one valid sequence in the group: no baseline information -> 0
    mask = rl.lengths_to_mask(torch.tensor([0, 2]), 2)
    assert torch.equal(rl.grpo_advantages(t([9.0, 1.0]), mask, group_size=2), torch.zeros(2, 2))
    with pytest.raises(rl.RLInputError):
        rl.grpo_advantages(t([1, 2, 3]), torch.ones(3, 2), group_size=2)


def test_rloo_remax() -> None:
    # RLOO [1, 2, 3, 6]: 1 - 11/3 = -8/3, 2 - 10/3 = -4/3, 3 - 3 = 0, 6 - 2 = 4
    close(
        rl.rloo_advantages(t([1, 2, 3, 6]), torch.ones(4, 1), 4)[:, 0], [-8 / 3, -4 / 3, 0.0, 4.0], atol=1e-5
    )
    # empty first row (score 4) is no baseline: [0, 1 - 3, 3 - 1]
    mask = rl.lengths_to_mask(torch.tensor([0, 1, 1]), 1)
    close(rl.rloo_advantages(t([4, 1, 3]), mask, 3)[:, 0], [0.0, -2.0, 2.0])
    close(rl.remax_advantages(t([1.0, 2.0]), t([0.5, 3.0]), torch.ones(2, 1))[:, 0], [0.5, -1.0])


def test_reinforce_pp_whitened() -> None:
    # rewards-to-go with γ = 1 on trainable tokens: row 0 [1, 1], row 1 [3]: mean 5/3, whitened
    mask = t([[1, 1], [1, 0]])
    adv = rl.reinforce_pp_advantages(t([[0, 1], [3, NAN]]), mask, eps=0.0)
    sel = adv[mask.bool()]
    close(sel.mean(), 0.0)
    close(sel.std(), 1.0)


# ---- aggregation exactness ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", rl.AGG_MODES)
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1, 1], [2, 4], [3, 3], [5, 1]])
def test_aggregation_exact_under_any_split(mode: str, splits: list[int]) -> None:
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen).requires_grad_(True)
    mask = rl.lengths_to_mask(torch.tensor([3, 0, 5, 1, 0, 2]), 5)
    full = rl.aggregate(loss, mask, mode, norm_length=8)
    (g_full,) = torch.autograd.grad(full, loss)
    norm = rl.loss_normalizer(mask, mode)
    parts = [
        rl.aggregate(lc, mc, mode, global_normalizer=norm, norm_length=8)
        for lc, mc in zip(loss.split(splits), mask.split(splits), strict=True)
    ]
    total = torch.stack(parts).sum()
    (g_parts,) = torch.autograd.grad(total, loss)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_parts, g_full)


def test_aggregation_values() -> None:
    # rows: [1, 2] (2 tokens), [4] (1 token), empty. token-mean 7/3; seq-mean-token-mean (1.5 + 4)/2;
    # seq-mean-token-sum (3 + 4)/2; seq-mean-token-sum-norm (3 + 4)/(2·4) with L = 4
    loss = t([[1, 2, 0], [4, 0, 0], [9, 9, 9]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    close(rl.aggregate(loss, mask, "token-mean"), 7 / 3)
    close(rl.aggregate(loss, mask, "seq-mean-token-mean"), 2.75)
    close(rl.aggregate(loss, mask, "seq-mean-token-sum"), 3.5)
    close(rl.aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=4), 7 / 8)


def test_zero_token_loss_is_explicit_zero_with_grad() -> None:
    lp = torch.full((2, 3), NAN).requires_grad_(True)
    loss, metrics = rl.policy_loss(lp, lp.detach(), torch.ones(2, 3), torch.zeros(2, 3))
    assert loss.item() == 0.0 and loss.grad_fn is not None
    loss.backward()
    assert lp.grad is not None and torch.equal(lp.grad, torch.zeros(2, 3))
    assert all(torch.isfinite(v) for v in metrics.values())


def test_aggregate_errors() -> None:
    with pytest.raises(rl.RLInputError):
        rl.aggregate(torch.zeros(1, 2), torch.ones(1, 2), "mean")
    with pytest.raises(rl.RLInputError):
        rl.aggregate(torch.zeros(1, 2), torch.ones(1, 2), "token-mean", global_normalizer=1)


# ---- policy / value losses ------------------------------------------------------------------------------
def test_clip_higher_and_dual_clip() -> None:
    m = t([[1]])
    # A = 1, ρ = 1.5, ε_low 0.2, ε_high 0.28: max(-1.5, -1.28) = -1.28, clipped
    loss, met = rl.policy_loss(t([[math.log(1.5)]]), t([[0.0]]), t([[1.0]]), m, 0.2, clip_eps_high=0.28)
    close(loss, -1.28)
    close(met["pg_clipfrac"], 1.0)
    # A = -1, ρ = 5: max(5, 1.2) = 5, dual clip c = 3 caps it at -c·A = 3
    lp = t([[math.log(5.0)]]).requires_grad_(True)
    loss, met = rl.policy_loss(lp, t([[0.0]]), t([[-1.0]]), m, 0.2, dual_clip=3.0)
    close(loss, 3.0, atol=1e-5)
    close(met["pg_clipfrac_lower"], 1.0)
    loss.backward()
    assert lp.grad is not None and lp.grad.item() == 0.0
    with pytest.raises(rl.RLInputError):
        rl.policy_loss(lp, t([[0.0]]), t([[-1.0]]), m, dual_clip=0.5)


def test_ppo_kl_metric() -> None:
    # ppo_kl = mean(old - new) = mean(0.1, 0.3) = 0.2
    _, met = rl.policy_loss(t([[-1.1, -1.3]]), t([[-1.0, -1.0]]), t([[0.0, 0.0]]), t([[1, 1]]))
    close(met["ppo_kl"], 0.2)


def test_gspo_sequence_ratio() -> None:
    # log-ratios 0.1, 0.3 -> s = exp(0.2) = 1.221403 within [0.8, 1.28]; A = 1: loss -s,
    # d/d logp_t = -s/2 for each token (geometric mean). Default ε (3e-4/4e-4) clips -> zero gradient.
    old = t([[-1.0, -1.0]])
    lp = t([[-0.9, -0.7]]).requires_grad_(True)
    loss, _ = rl.gspo_policy_loss(lp, old, t([1.0]), t([[1, 1]]), 0.2, 0.28)
    close(loss, -math.exp(0.2))
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [[-math.exp(0.2) / 2] * 2])
    lp.grad = None
    loss, met = rl.gspo_policy_loss(lp, old, t([1.0]), t([[1, 1]]))
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [[0.0, 0.0]])
    close(met["pg_clipfrac"], 1.0)


def test_value_loss_clipped() -> None:
    # V 1.5, V_old 1, R 2, ε 0.2: (1.5-2)² = 0.25, clipped V 1.2: (1.2-2)² = 0.64; ½·max = 0.32
    loss, met = rl.value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), t([[1]]), clip_eps=0.2)
    close(loss, 0.32)
    close(met["vf_clipfrac"], 1.0)
    loss, _ = rl.value_loss(t([[1.5]]), t([[1.0]]), t([[2.0]]), t([[1]]), clip_eps=None)
    close(loss, 0.125)


def test_entropy_kl_sft_losses() -> None:
    m = t([[1, 1, 0]])
    bonus, met = rl.entropy_bonus(t([[1.0, 2.0, NAN]]), m, coef=0.01)
    close(bonus, -0.015)
    close(met["entropy"], 1.5)
    loss, _ = rl.sft_loss(t([[-1.0, -2.0, NAN]]), m)
    close(loss, 1.5)
    loss, met = rl.kl_loss(t([[-1.0, -1.0, 0]]), t([[-1.5, -1.5, 0]]), m, kind="k2", coef=2.0)
    close(loss, 0.25)
    close(met["kl"], 0.125)


def test_dpo_cdpo_and_reward_model() -> None:
    z = t([0.0])
    loss, met = rl.preference_loss(z, z, z, z, beta=0.1)
    close(loss, math.log(2))
    close(met["rewards/accuracies"], 0.0)
    # h = 10, β = 0.1: -log σ(1) = 0.313262; cDPO ε = 0.1: 0.9·0.313262 + 0.1·1.313262 = 0.413262
    ten = t([10.0])
    close(rl.preference_loss(ten, z, z, z, beta=0.1)[0], 0.313262)
    close(rl.preference_loss(ten, z, z, z, beta=0.1, loss_type="cdpo", label_smoothing=0.1)[0], 0.413262)
    loss, met = rl.reward_model_loss(t([1.0, 0.0]), t([0.0, 0.0]))
    close(loss, (0.313262 + math.log(2)) / 2)
    close(met["accuracy"], 0.5)
    with pytest.raises(rl.RLInputError):
        rl.preference_loss(z, z, z, z, loss_type="kto")


def test_sequence_logps() -> None:
    close(rl.sequence_logps(t([[-1.0, -2.0, NAN]]), t([[1, 1, 0]])), [-3.0])
    close(rl.sequence_logps(t([[-1.0, -2.0, NAN]]), t([[1, 1, 0]]), average=True), [-1.5])


# ---- packing ---------------------------------------------------------------------------------------------
def _attention(x: torch.Tensor, allowed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    q, k, v = (x @ w[i] for i in range(3))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def test_packed_attention_agrees_with_padded_and_isolates_sequences() -> None:
    gen = torch.Generator().manual_seed(0)
    # left-padded prompts + right-padded responses; row 2 is empty
    attn = t([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]])
    x = torch.randn(4, 6, 8, generator=gen)
    w = torch.randn(3, 8, 8, generator=gen)
    length = attn.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = causal & attn.bool()[:, None, :]
    allowed = allowed | torch.eye(length, dtype=torch.bool)  # padding rows attend to themselves only
    padded = _attention(x, allowed, w)
    layout = rl.packed_layout(attn, pad_to=16)
    assert layout.cu_seqlens.tolist() == [0, 4, 10, 12, 16]
    assert layout.rows.tolist() == [0, 1, 3]
    packed_x = rl.pack(x, layout)
    packed = _attention(packed_x, rl.packed_attention_mask(layout.cu_seqlens), w)
    back = rl.unpack(packed, layout)
    real = attn.bool()
    torch.testing.assert_close(back[real], padded[real], atol=1e-5, rtol=1e-5)
    # positions: packed restarts per segment == padded cumsum(mask) - 1 at real tokens
    pos_padded = (attn.cumsum(-1) - 1).clamp(min=0).long()
    assert torch.equal(rl.unpack(layout.position_ids, layout)[real], pos_padded[real])
    # no cross-contamination: changing row 1's tokens leaves rows 0 and 3 bit-identical
    x2 = x.clone()
    x2[1] = torch.randn(6, 8, generator=gen)
    back2 = rl.unpack(_attention(rl.pack(x2, layout), rl.packed_attention_mask(layout.cu_seqlens), w), layout)
    assert torch.equal(back2[0], back[0]) and torch.equal(back2[3], back[3])


def test_packing_errors() -> None:
    with pytest.raises(rl.MaskError):
        rl.packed_layout(t([[1, 0, 1]]))  # hole: not packable
    with pytest.raises(rl.RLInputError):
        rl.cu_seqlens_from_lengths([3, 2], pad_to=4)
    layout = rl.packed_layout(t([[1, 1, 0]]))
    assert layout.total == 2 and layout.num_padding == 0
    assert rl.cu_seqlens_from_lengths([0, 0]).tolist() == [0]
