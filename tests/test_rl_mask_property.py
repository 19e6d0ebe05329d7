"""Metamorphic property: values at mask-0 positions (NaN, ±inf included) never change an output or gradient.

For every public function of ``rlflow.nodes.rl`` that takes a mask: build clean inputs, then a copy whose
mask-0 entries (and per-sequence inputs of rows with no trainable token) are replaced by a poison value;
outputs and gradients must be bit-identical, finite, and gradients must be 0 at the poisoned positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rlflow.nodes.rl as rl

POISONS = [float("nan"), float("inf"), float("-inf"), 1e30, -7.0]
V = 5
G = 2  # group size for group-relative functions

Inputs = dict[str, torch.Tensor]


@dataclass
class Case:
    name: str
    call: Callable[[Inputs, torch.Tensor], Any]
    tok: tuple[str, ...] = ()  # [B, T] float inputs, poisoned at mask-0
    seq: tuple[str, ...] = ()  # [B] float inputs, poisoned on rows with no trainable token
    grad: tuple[str, ...] = ()
    logits: bool = False  # adds "logits" [B, T, V] and "labels" [B, T]
    extra: dict[str, Callable[[torch.Generator, int, int], torch.Tensor]] = field(default_factory=dict)


def _call(fn: Callable[..., Any], *keys: str, **kwargs: Any) -> Callable[[Inputs, torch.Tensor], Any]:
    """``fn(*inputs[keys], mask, **kwargs)``: a case whose option is fixed at construction."""
    return lambda d, m: fn(*(d[k] for k in keys), m, **kwargs)


def _agg_cases() -> list[Case]:
    out = []
    for mode in rl.AGG_MODES:
        out.append(
            Case(
                f"aggregate[{mode}]",
                _call(rl.aggregate, "x", agg=mode),
                ("x",),
                grad=("x",),
            )
        )
    return out


CASES: list[Case] = [
    Case("masked_sum", lambda d, m: rl.masked_sum(d["x"], m), ("x",), grad=("x",)),
    Case("masked_sum[dim]", lambda d, m: rl.masked_sum(d["x"], m, dim=-1), ("x",), grad=("x",)),
    Case("masked_mean", lambda d, m: rl.masked_mean(d["x"], m), ("x",), grad=("x",)),
    Case("masked_mean[dim]", lambda d, m: rl.masked_mean(d["x"], m, dim=-1), ("x",), grad=("x",)),
    Case("masked_var", lambda d, m: rl.masked_var(d["x"], m), ("x",), grad=("x",)),
    Case("masked_moments", lambda d, m: torch.stack(rl.masked_moments(d["x"], m)), ("x",), grad=("x",)),
    Case("masked_whiten", lambda d, m: rl.masked_whiten(d["x"], m), ("x",), grad=("x",)),
    Case(
        "label_logprobs",
        lambda d, m: rl.label_logprobs(d["logits"], d["labels"], m, temperature=0.7, top_k=4, top_p=0.9),
        grad=("logits",),
        logits=True,
    ),
    Case(
        "entropy_from_logits",
        lambda d, m: rl.entropy_from_logits(d["logits"], m, temperature=0.7, top_k=4, top_p=0.9),
        grad=("logits",),
        logits=True,
    ),
    Case("sampled_entropy", lambda d, m: rl.sampled_entropy(d["lp"], m), ("lp",), grad=("lp",)),
    *[
        Case(
            f"kl_terms[{k}]",
            _call(rl.kl_terms, "lp", "ref", kind=k),
            ("lp", "ref"),
            grad=("lp",),
        )
        for k in ("k1", "k2", "k3")
    ],
    Case("kl_estimate", lambda d, m: rl.kl_estimate(d["lp"], d["ref"], m, "k3"), ("lp", "ref")),
    Case("last_token_index", lambda d, m: rl.last_token_index(m)),
    Case(
        "token_rewards",
        lambda d, m: rl.token_rewards(d["scores"], m, d["kl"], kl_coef=0.1),
        ("kl",),
        ("scores",),
        grad=("scores", "kl"),
    ),
    Case(
        "gae",
        lambda d, m: rl.gae(d["r"], d["v"], m, 0.9, 0.8, d["boot"], d["trunc"]),
        ("r", "v"),
        grad=("r", "v"),
        extra={
            "boot": lambda g, b, t: torch.randn(b, generator=g),
            "trunc": lambda g, b, t: torch.rand(b, generator=g) < 0.5,
        },
    ),
    Case("reward_to_go", lambda d, m: rl.reward_to_go(d["r"], m, 0.9), ("r",), grad=("r",)),
    Case("broadcast_to_tokens", lambda d, m: rl.broadcast_to_tokens(d["s"], m), seq=("s",), grad=("s",)),
    *[
        Case(
            f"grpo_advantages[{std}]",
            _call(rl.grpo_advantages, "s", group_size=G, std=std),
            seq=("s",),
            grad=("s",),
        )
        for std in ("group", "batch", "none")
    ],
    Case("rloo_advantages", lambda d, m: rl.rloo_advantages(d["s"], m, G), seq=("s",), grad=("s",)),
    Case(
        "remax_advantages",
        lambda d, m: rl.remax_advantages(d["s"], d["g"], m),
        seq=("s", "g"),
        grad=("s", "g"),
    ),
    Case("reinforce_pp_advantages", lambda d, m: rl.reinforce_pp_advantages(d["r"], m), ("r",), grad=("r",)),
    *_agg_cases(),
    Case("loss_normalizer", lambda d, m: torch.tensor(float(rl.loss_normalizer(m, "seq-mean-token-mean")))),
    Case(
        "policy_loss",
        lambda d, m: rl.policy_loss(d["lp"], d["old"], d["adv"], m, 0.2, 0.28, dual_clip=3.0),
        ("lp", "old", "adv"),
        grad=("lp",),
    ),
    *[
        Case(
            f"decoupled_policy_loss[{cap}]",
            _call(rl.decoupled_policy_loss, "lp", "prox", "behav", "adv", behav_imp_weight_cap=cap),
            ("lp", "prox", "behav", "adv"),
            grad=("lp",),
        )
        for cap in (None, 2.0)
    ],
    Case(
        "behav_imp_weights",
        lambda d, m: rl.behav_imp_weights(d["prox"], d["behav"], m, behav_imp_weight_cap=1.5)[0],
        ("prox", "behav"),
    ),
    Case(
        "reverse_kl_advantages",
        lambda d, m: rl.reverse_kl_advantages(
            d["lp"], d["ref"], m, coef=0.5, task_advantages=d["adv"], task_coef=2.0
        ),
        ("lp", "ref", "adv"),
    ),
    Case(
        "policy_loss[weights]",
        lambda d, m: rl.policy_loss(d["lp"], d["old"], d["adv"], m, 0.2, weights=d["w"]),
        ("lp", "old", "adv", "w"),
        grad=("lp",),
    ),
    *[
        Case(
            f"rollout_correction[{level}]",
            _call(
                rl.rollout_correction,
                "old",
                "behav",
                rollout_is=is_level,
                rollout_rs=level,
                rollout_rs_threshold=1.5,
            ),
            ("old", "behav"),
        )
        for level, is_level in (("token", "sequence"), ("sequence", "token"), ("geometric", "token"))
    ],
    Case(
        "gspo_policy_loss",
        lambda d, m: rl.gspo_policy_loss(d["lp"], d["old"], d["adv"], m, 0.2, 0.28),
        ("lp", "old", "adv"),
        grad=("lp",),
    ),
    Case(
        "cispo_policy_loss",
        lambda d, m: rl.cispo_policy_loss(d["lp"], d["old"], d["adv"], m, 0.2, 0.28, weights=d["w"]),
        ("lp", "old", "adv", "w"),
        grad=("lp",),
    ),
    Case(
        "sapo_policy_loss",
        lambda d, m: rl.sapo_policy_loss(d["lp"], d["old"], d["adv"], m, tau_pos=1.0, tau_neg=1.05),
        ("lp", "old", "adv"),
        grad=("lp",),
    ),
    Case("response_lengths", lambda d, m: rl.response_lengths(m)),
    Case(
        "value_loss",
        lambda d, m: rl.value_loss(d["v"], d["old"], d["ret"], m, 0.2, agg="seq-mean-token-mean"),
        ("v", "old", "ret"),
        grad=("v",),
    ),
    Case("entropy_bonus", lambda d, m: rl.entropy_bonus(d["x"], m, 0.01), ("x",), grad=("x",)),
    *[
        Case(
            f"kl_loss[{k}]",
            _call(rl.kl_loss, "lp", "ref", kind=k),
            ("lp", "ref"),
            grad=("lp",),
        )
        for k in ("k1", "k2", "k3")
    ],
    Case("sft_loss", lambda d, m: rl.sft_loss(d["lp"], m, "seq-mean-token-sum"), ("lp",), grad=("lp",)),
    Case("sequence_logps", lambda d, m: rl.sequence_logps(d["lp"], m), ("lp",), grad=("lp",)),
    Case(
        # per-sequence preference losses get their masks through sequence_logps
        "preference_loss",
        lambda d, m: rl.preference_loss(
            rl.sequence_logps(d["lp"], m),
            rl.sequence_logps(d["lp2"], m),
            rl.sequence_logps(d["ref"], m),
            rl.sequence_logps(d["ref2"], m),
            beta=0.1,
            loss_type="cdpo",
            label_smoothing=0.1,
        ),
        ("lp", "lp2", "ref", "ref2"),
        grad=("lp", "lp2"),
    ),
    Case(
        "reward_model_loss",
        lambda d, m: rl.reward_model_loss(
            rl.masked_mean(d["x"], m, dim=-1), rl.masked_mean(d["y"], m, dim=-1), margin=0.5
        ),
        ("x", "y"),
        grad=("x", "y"),
    ),
]


def _flatten(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [v for _, v in sorted(out.items())]
    if isinstance(out, tuple | list):
        return [x for item in out for x in _flatten(item)]
    raise TypeError(type(out))


def _run(case: Case, inputs: Inputs, mask: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    d = {k: (v.clone().requires_grad_(True) if k in case.grad else v.clone()) for k, v in inputs.items()}
    outs = _flatten(case.call(d, mask))
    grads: list[torch.Tensor] = []
    diff = [o for o in outs if o.requires_grad]
    if case.grad:
        assert diff, f"{case.name}: no differentiable output"
        gen = torch.Generator().manual_seed(1)
        total = sum((o * torch.rand(o.shape, generator=gen)).sum() for o in diff)
        assert isinstance(total, torch.Tensor)
        total.backward()
        for k in case.grad:
            grad = d[k].grad
            grads.append(torch.zeros_like(d[k]) if grad is None else grad)
    return [o.detach() for o in outs], grads


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, int, float]:
    b = G * draw(st.integers(1, 2))
    t = draw(st.integers(1, 5))
    bits = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    mask = torch.tensor(bits, dtype=torch.float32).view(b, t)
    seed = draw(st.integers(0, 2**16))
    poison = draw(st.sampled_from(POISONS))
    return mask, seed, poison


def _inputs(case: Case, mask: torch.Tensor, seed: int) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    b, t = mask.shape
    d: Inputs = {}
    for k in case.tok:
        d[k] = torch.randn(b, t, generator=gen) - (1.0 if k in ("lp", "lp2", "ref", "ref2", "old") else 0.0)
    for k in case.seq:
        d[k] = torch.randn(b, generator=gen)
    for k, make in case.extra.items():
        d[k] = make(gen, b, t)
    if case.logits:
        d["logits"] = torch.randn(b, t, V, generator=gen) * 2
        d["labels"] = d["logits"].argmax(-1)  # always kept by top-k/top-p: finite log-probs
    return d


def _poisoned(case: Case, d: Inputs, mask: torch.Tensor, poison: float) -> Inputs:
    m = mask.bool()
    empty = ~m.any(-1)
    p = dict(d)
    for k in case.tok:
        p[k] = d[k].masked_fill(~m, poison)
    for k in case.seq:
        p[k] = d[k].masked_fill(empty, poison)
    if "boot" in d:
        p["boot"] = d["boot"].masked_fill(~d["trunc"], poison)
    if case.logits:
        p["logits"] = d["logits"].masked_fill(~m.unsqueeze(-1), poison)
        p["labels"] = d["labels"].masked_fill(~m, 10_000)  # out-of-range id on padding
    return p


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=batches())
def test_mask0_values_never_matter(case: Case, data: tuple[torch.Tensor, int, float]) -> None:
    mask, seed, poison = data
    clean = _inputs(case, mask, seed)
    outs_a, grads_a = _run(case, clean, mask)
    outs_b, grads_b = _run(case, _poisoned(case, clean, mask, poison), mask)
    for a, b in zip(outs_a, outs_b, strict=True):
        assert torch.isfinite(a.float()).all(), f"{case.name}: non-finite output on clean inputs"
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    m = mask.bool()
    for k, ga, gb in zip(case.grad, grads_a, grads_b, strict=True):
        assert torch.isfinite(gb).all(), f"{case.name}: non-finite gradient for {k}"
        torch.testing.assert_close(ga, gb, rtol=0, atol=0)
        if k in case.tok:
            assert bool((gb[~m] == 0).all()), f"{case.name}: gradient leaks to mask-0 {k}"
        if k in case.seq:
            assert bool((gb[~m.any(-1)] == 0).all()), f"{case.name}: gradient leaks to empty-row {k}"
        if k == "logits":
            assert bool((gb[~m] == 0).all())


# ---- functions whose mask-0 inputs are not a plain [B, T] tensor ----------------------------------------
@settings(max_examples=15, deadline=None)
@given(data=batches(), p=st.integers(1, 3))
def test_response_and_next_token_logprobs_ignore_padding(
    data: tuple[torch.Tensor, int, float], p: int
) -> None:
    mask, seed, poison = data
    b, t = mask.shape
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, p + t, V, generator=gen)
    ids = torch.randint(0, V, (b, t), generator=gen)
    m = mask.bool()
    # every logits position that predicts no trainable response token may hold anything
    used = torch.zeros(b, p + t, dtype=torch.bool)
    used[:, p - 1 : p + t - 1] = m
    bad_logits = logits.masked_fill(~used.unsqueeze(-1), poison)
    bad_ids = ids.masked_fill(~m, 999)
    results = []
    for lg, ii in ((logits, ids), (bad_logits, bad_ids)):
        x = lg.clone().requires_grad_(True)
        out = rl.response_logprobs(x, ii, mask, temperature=1.3, top_p=0.95)
        out.sum().backward()
        assert x.grad is not None
        results.append((out.detach(), x.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)
    # next_token_logprobs: label t+1 uses logits at t and mask[:, t+1]
    full_ids = torch.cat([torch.zeros(b, p, dtype=torch.long), ids], dim=1)
    full_mask = torch.cat([torch.zeros(b, p), mask], dim=1)
    a = rl.next_token_logprobs(logits, full_ids, full_mask)
    c = rl.next_token_logprobs(bad_logits, torch.cat([full_ids[:, :p], bad_ids], 1), full_mask)
    torch.testing.assert_close(a, c, rtol=0, atol=0)
    torch.testing.assert_close(a[:, p - 1 :], rl.response_logprobs(logits, ids, mask), rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    left=st.lists(st.integers(0, 2), min_size=4, max_size=4),
    poison=st.sampled_from(POISONS),
)
def test_pack_unpack_ignore_padding(lengths: list[int], left: list[int], poison: float) -> None:
    width = 6
    attn = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        attn[i, left[i] : left[i] + n] = 1
    x = torch.randn(len(lengths), width, 3)
    bad = x.masked_fill(~attn.bool().unsqueeze(-1), poison)
    layout = rl.packed_layout(attn, pad_to=sum(lengths) + 2)
    pa, pb = rl.pack(x, layout), rl.pack(bad, layout)
    assert torch.equal(pa, pb)
    ua, ub = rl.unpack(pa, layout), rl.unpack(pb, layout)
    assert torch.equal(ua, ub)
    assert torch.equal(ua, x.masked_fill(~attn.bool().unsqueeze(-1), 0.0))


@settings(max_examples=15, deadline=None)
@given(
    prefix=st.lists(st.integers(3, 9), max_size=4), tail=st.lists(st.integers(0, 9), min_size=0, max_size=4)
)
def test_first_eos_lengths_ignore_tokens_after_eos(prefix: list[int], tail: list[int]) -> None:
    # anything after the first EOS (id 2) is padding and never changes the length
    ids = torch.tensor([[*prefix, 2, *tail]])
    assert rl.first_eos_lengths(ids, 2).tolist() == [len(prefix) + 1]


def test_every_masked_public_function_is_covered() -> None:
    covered = {c.name.split("[")[0] for c in CASES} | {
        "response_logprobs",
        "next_token_logprobs",
        "pack",
        "unpack",
        "packed_layout",
        "first_eos_lengths",
    }
    # no mask argument: constants, types, validation/builders of masks, per-row samplers and slicers
    no_mask = {
        "AGG_MODES",
        "KL_ESTIMATORS",
        "KLEstimator",
        "MaskError",
        "RLInputError",
        "PackedLayout",
        "ROLLOUT_IS_LEVELS",
        "ROLLOUT_RS_LEVELS",
        "check_mask",
        "lengths_to_mask",
        "mask_spans",
        "cu_seqlens_from_lengths",
        "packed_attention_mask",
        "process_logits",
        "logprobs_of",
        "sample_from_logits",
        "align_to_response",
        "sapo_gate",  # of ratios and advantages; sapo_policy_loss masks them
        "overlong_penalty",  # of lengths [B]; response_lengths reads the mask
    }
    assert set(rl.__all__) - no_mask <= covered, set(rl.__all__) - no_mask - covered
