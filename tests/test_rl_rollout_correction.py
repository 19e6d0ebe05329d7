"""Training/inference mismatch: truncated IS (TIS) and rejection beyond a ratio bound (issue 15).

Tier 1: :func:`rlflow.nodes.rl.rollout_correction` and the ``weights`` of the policy losses on tiny tensors,
values worked by hand in the comments. Tier 2: the clipped policy-gradient node functions through the
registry, with a rollout log-prob perturbed by a known factor: the metrics and the surrogate loss take the
hand-derived values. Tier 5: a PPO graph through the runtime whose sampler really differs from the trainer
(sampling temperature 0.5, trainer temperature 1). Validation: a correction that cannot be meaningful
(π_old taken from the sampler) stops ``load_graph`` naming the file, node and argument.
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.nodes.rl as rl
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import ModelState, NodeContext, NodeResult
from rlflow.nodes.models import build_model
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")
load_builtin_functions()


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def close(a: torch.Tensor | float, b: Any, atol: float = 1e-5) -> None:
    a = torch.as_tensor(a, dtype=torch.float32)
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=atol, rtol=0)


# ---- tier 1: rollout_correction -------------------------------------------------------------------------
def test_token_tis_truncates_each_ratio() -> None:
    # δ = old − rollout = [0.5, −1, 0]: r = [e^0.5 = 1.6487, e^-1 = 0.3679, 1]; C = 1.5
    # w = [1.5, 0.3679, 1]; one of three truncated; mean w = (1.5 + 0.36788 + 1)/3 = 0.95596
    w, keep, m = rl.rollout_correction(
        t([[-1.0, -2.0, -0.5]]), t([[-1.5, -1.0, -0.5]]), t([[1, 1, 1]]),
        rollout_is="token", rollout_is_threshold=1.5,
    )  # fmt: skip
    close(w, [[1.5, math.exp(-1.0), 1.0]])
    assert keep.tolist() == [[True, True, True]]
    close(m["tis_clipfrac"], 1 / 3)
    close(m["tis_weight_mean"], (1.5 + math.exp(-1.0) + 1.0) / 3)
    assert "mask_frac" not in m


def test_sequence_tis_uses_the_product_of_the_rows_ratios() -> None:
    # row 0: Σδ = 0.5 − 1 + 0 = −0.5 → r = e^-0.5 = 0.60653 on its 3 tokens (below C = 1.5)
    # row 1: Σδ over its 2 trainable tokens = 0.3 + 0.4 = 0.7 → r = 2.0138 → truncated to 1.5; the NaN
    # at its mask-0 position never counts. Truncated tokens 2 of 5; mean w = (3·0.60653 + 2·1.5)/5 = 0.96392
    old = t([[-1.0, -2.0, -0.5], [-0.7, -0.6, NAN]])
    roll = t([[-1.5, -1.0, -0.5], [-1.0, -1.0, 5.0]])
    w, _, m = rl.rollout_correction(
        old, roll, t([[1, 1, 1], [1, 1, 0]]), rollout_is="sequence", rollout_is_threshold=1.5
    )
    close(w, [[math.exp(-0.5)] * 3, [1.5, 1.5, 0.0]])
    close(m["tis_clipfrac"], 2 / 5)
    close(m["tis_weight_mean"], (3 * math.exp(-0.5) + 3.0) / 5)


def test_token_rejection_masks_ratios_outside_the_bounds() -> None:
    # δ = [0.5, −1, 0, 0.8]; bounds [1/2, 2] → log bounds ±0.6931: tokens 1 (−1) and 3 (0.8) rejected
    # (2 of 4 → mask_frac 0.5); IS off: weights 1 on kept tokens, 0 on rejected ones
    w, keep, m = rl.rollout_correction(
        t([[0.5, -1.0, 0.0, 0.8]]), torch.zeros(1, 4), t([[1, 1, 1, 1]]), rollout_rs="token"
    )
    assert keep.tolist() == [[True, False, True, False]]
    close(w, [[1.0, 0.0, 1.0, 0.0]])
    close(m["mask_frac"], 0.5)
    assert "tis_weight_mean" not in m


@pytest.mark.parametrize(("level", "frac"), [("sequence", 0.5), ("geometric", 0.0)])
def test_sequence_and_geometric_rejection_keep_or_drop_whole_rows(level: str, frac: float) -> None:
    # row 0: δ = [0.5, 0.4]: product e^0.9 = 2.46 > 2 (dropped by "sequence"); geometric mean e^0.45 =
    # 1.57 ≤ 2 (kept by "geometric"). row 1: δ = [−0.2, 0.1]: product e^-0.1, mean e^-0.05: kept by both.
    _, keep, m = rl.rollout_correction(
        t([[0.5, 0.4], [-0.2, 0.1]]), torch.zeros(2, 2), t([[1, 1], [1, 1]]), rollout_rs=level
    )
    assert keep.tolist() == [[level == "geometric"] * 2, [True, True]]
    close(m["mask_frac"], frac)


def test_lower_bound_and_is_on_kept_tokens_only() -> None:
    # δ = [0.3, −0.3, 1.0]: r = [1.3499, 0.7408, 2.7183]; rs bounds [0.8, 3]: token 1 (0.7408) rejected.
    # TIS C = 1.2 over the kept tokens 0 and 2: w = [1.2, 0, 1.2], both truncated → clipfrac 2/2 = 1,
    # mean w over kept = 1.2; mask_frac = 1/3
    w, _, m = rl.rollout_correction(
        t([[0.3, -0.3, 1.0]]), torch.zeros(1, 3), t([[1, 1, 1]]),
        rollout_is="token", rollout_is_threshold=1.2,
        rollout_rs="token", rollout_rs_threshold=3.0, rollout_rs_threshold_lower=0.8,
    )  # fmt: skip
    close(w, [[1.2, 0.0, 1.2]])
    close(m["tis_clipfrac"], 1.0)
    close(m["tis_weight_mean"], 1.2)
    close(m["mask_frac"], 1 / 3)


def test_on_policy_weights_are_exactly_one_and_nothing_is_rejected() -> None:
    lp = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) - 1.0
    mask = torch.ones(3, 5)
    w, keep, m = rl.rollout_correction(lp, lp.clone(), mask, rollout_is="sequence", rollout_rs="geometric")
    assert torch.equal(w, torch.ones(3, 5)) and bool(keep.all())
    assert float(m["tis_clipfrac"]) == 0.0 and float(m["mask_frac"]) == 0.0


def test_extreme_log_ratios_neither_overflow_nor_nan() -> None:
    # δ = ±1000 nats: e^δ overflows float32; compared in log space, |δ| > log(1e30) = 69 is rejected and
    # the TIS weights are min(e^δ, 2) = [2, 0]
    _, keep, _ = rl.rollout_correction(
        t([[1000.0, -1000.0]]), t([[0.0, 0.0]]), t([[1, 1]]),
        rollout_rs="token", rollout_rs_threshold=1e30, rollout_rs_threshold_lower=1e-30,
    )  # fmt: skip
    assert keep.tolist() == [[False, False]]
    w, _, m = rl.rollout_correction(t([[1000.0, -1000.0]]), t([[0.0, 0.0]]), t([[1, 1]]), rollout_is="token")
    close(w, [[2.0, 0.0]])
    close(m["tis_weight_mean"], 1.0)


def test_an_empty_batch_reports_zeros() -> None:
    w, keep, m = rl.rollout_correction(
        torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), rollout_is="token", rollout_rs="token"
    )
    assert not bool(keep.any()) and float(w.abs().sum()) == 0.0
    assert {k: float(v) for k, v in m.items()} == {
        "mask_frac": 0.0,
        "tis_clipfrac": 0.0,
        "tis_weight_mean": 0.0,
    }


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rollout_is": "tokens"},
        {"rollout_rs": "product"},
        {"rollout_is": "token", "rollout_is_threshold": 0.5},
        {"rollout_rs": "token", "rollout_rs_threshold": 1.0},
        {"rollout_rs": "token", "rollout_rs_threshold_lower": 1.5},
    ],
)
def test_bad_options_raise(kwargs: dict[str, Any]) -> None:
    with pytest.raises(rl.RLInputError):
        rl.rollout_correction(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)


# ---- tier 1: weighted policy losses --------------------------------------------------------------------
def test_policy_loss_weights_each_tokens_surrogate() -> None:
    # ratio 1 (lp = old): per-token loss −A·w = [−2·1.5, +1·0.5] = [−3, 0.5]; token-mean −1.25.
    # d loss/d lp_t = −A_t·w_t·ρ_t / N = [−1.5, 0.25]
    lp = t([[-1.0, -2.0]]).requires_grad_(True)
    loss, _ = rl.policy_loss(lp, lp.detach(), t([[2.0, -1.0]]), t([[1, 1]]), weights=t([[1.5, 0.5]]))
    close(loss, -1.25)
    loss.backward()
    assert lp.grad is not None
    close(lp.grad, [[-1.5, 0.25]])


def test_gspo_loss_weights_each_token() -> None:
    # one row, ratio 1, A = 1 per sequence: tokens' loss −1·w = [−2, −1]; seq-mean-token-mean: −1.5
    lp = t([[-1.0, -2.0]])
    loss, _ = rl.gspo_policy_loss(lp, lp, t([1.0]), t([[1, 1]]), weights=t([[2.0, 1.0]]))
    close(loss, -1.5)


def test_token_tis_below_its_threshold_equals_decoupled_ppo() -> None:
    # AReaL's decoupled loss with proximal = π_old and behaviour = π_rollout is the per-token product
    # w·ppo(π_θ/π_old), w = π_old/π_rollout: token TIS whose threshold truncates nothing (two implementations
    # of the ratio agree); a threshold that binds makes them differ
    g = torch.Generator().manual_seed(3)
    lp, old, roll, adv = (torch.randn(4, 6, generator=g) * s - 1 for s in (0.3, 0.3, 0.6, 1.0))
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    b, _ = rl.decoupled_policy_loss(lp, old, roll, adv, mask, 0.2)
    w, _, met = rl.rollout_correction(old, roll, mask, rollout_is="token", rollout_is_threshold=100.0)
    assert float(met["tis_clipfrac"]) == 0.0
    a, _ = rl.policy_loss(lp, old, adv, mask, 0.2, weights=w)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    w, _, met = rl.rollout_correction(old, roll, mask, rollout_is="token", rollout_is_threshold=1.5)
    assert float(met["tis_clipfrac"]) > 0.0
    a, _ = rl.policy_loss(lp, old, adv, mask, 0.2, weights=w)
    assert not torch.allclose(a, b)


# ---- tier 2: the node functions through the registry ---------------------------------------------------
CONFIG = TINY_LLAMA
LENGTHS = [4, 3, 2, 4]  # N = 13 trainable tokens
PG_FUNCTIONS = [
    n for n in NODE_FUNCTIONS.names() if any(a.name == "rollout_is" for a in NODE_FUNCTIONS.get(n).args or ())
]


@functools.cache
def _model() -> torch.nn.Module:
    return build_model(config=CONFIG, head="lm", seed=0).float().eval()


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(ROOT / "examples" / "arith" / "tokenizer")


def _ctx(kind: str, function: str, args: dict[str, Any]) -> NodeContext:
    module = copy.deepcopy(_model())
    state = ModelState(name="actor", module=module, head="lm", tokenizer=_tokenizer())
    if kind == "train":
        params = [p for p in module.parameters() if p.requires_grad]
        state.optimizer = torch.optim.SGD(params, lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
        state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    spec = NodeSpec("node", kind, function, model="actor", args=dict(args))
    return NodeContext(node=spec, model=state, group_size=2, micro_batches=2, tokenizer=_tokenizer())


@functools.cache
def _batch() -> Batch:
    """4 rows in groups of 2; the sampler's log-probs are the trainer's own (computed by the ``logprobs``
    node with the same micro-batches as the train node's first pass: bit-equal), except two tokens:
    π_rollout = π_old/3 at (0, 0) (ratio 3) and 4·π_old at (2, 1) (ratio 1/4)."""
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.tensor([[1, 5, 14], [0, 1, 6], [1, 7, 16], [0, 1, 8]])
    mask = (torch.arange(4)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(3, 19, (4, 4), generator=g).masked_fill(mask == 0, 0)
    b = Batch({"prompt_ids": prompt_ids, "prompt_mask": (prompt_ids != 0).long(), "response_ids": ids,
               "response_mask": mask})  # fmt: skip
    old = NODE_FUNCTIONS.get("logprobs").fn(_ctx("inference", "logprobs", {}), b).outputs["logprobs"]
    shift = torch.zeros(4, 4)
    shift[0, 0], shift[2, 1] = math.log(3.0), -math.log(4.0)
    b["logprobs"] = (old - shift) * mask
    b["ref_logprobs"] = (old - 0.1) * mask
    b["teacher_logprobs"] = (old + 0.2) * mask  # distill_actor's teacher: its advantage is shift - 0.2 ≠ 0
    b["values"] = torch.full((4, 4), 0.2) * mask
    b["scores"] = torch.tensor([1.0, 0.0, 0.5, 0.2])
    b["greedy_scores"] = torch.tensor([0.4, 0.4, 0.1, 0.1])
    return b


def _train(function: str, **args: Any) -> tuple[NodeResult, list[torch.Tensor]]:
    entry = NODE_FUNCTIONS.get(function)
    ctx = _ctx("train", function, args)
    assert ctx.model is not None
    before = [p.detach().clone() for p in ctx.model.module.parameters()]
    batch = _batch().select([k for k in entry.inputs if k in _batch()])
    result = entry.fn(ctx, batch, **args)
    update = [p.detach() - b for p, b in zip(ctx.model.module.parameters(), before, strict=True)]
    return result, update


@pytest.mark.parametrize("function", PG_FUNCTIONS)
def test_every_policy_gradient_node_applies_the_correction(function: str) -> None:
    # ratios π_old/π_rollout: 3 at (0,0), 1/4 at (2,1), exactly 1 on the other 11 of N = 13 tokens.
    # TIS (C = 2): w = 2 at (0,0) (truncated), 0.25 at (2,1): mean (2 + 0.25 + 11)/13 = 1.01923,
    # clipfrac 1/13. Rejection (bounds [1/2, 2]): both perturbed tokens leave the loss: mask_frac 2/13.
    assert set(PG_FUNCTIONS) >= {"ppo_actor", "grpo_actor", "rloo_actor", "remax_actor", "reinforce_pp_actor"}
    off, update_off = _train(function)
    assert not any(k.startswith("rollout/tis") or k == "rollout/mask_frac" for k in off.metrics)
    tis, update_tis = _train(function, rollout_is="token")
    close(tis.metrics["rollout/tis_weight_mean"], 13.25 / 13)
    close(tis.metrics["rollout/tis_clipfrac"], 1 / 13)
    rs, _ = _train(function, rollout_rs="token")
    close(rs.metrics["rollout/mask_frac"], 2 / 13)
    assert any(not torch.allclose(a, b, atol=1e-7) for a, b in zip(update_off, update_tis, strict=True))


def test_grpo_surrogate_takes_the_hand_derived_values() -> None:
    # GRPO advantages of scores [1, 0 | 0.5, 0.2] (groups of 2, unbiased std): A = [a, −a, a, −a],
    # a = 0.5/0.70711 = 0.15/0.21213 = 0.70711 (eps 1e-6 aside). Every micro-batch sees ρ = π_θ/π_old = 1
    # (one mini-batch: no update before the last), so pg_loss = token-mean of −A·w over the tokens left
    # in the loss (rows of 4, 3, 2, 4 tokens):
    # off:      −(4a − 3a + 2a − 4a)/13                        = a/13      = 0.054393
    # TIS:      −(a·(2+1+1+1) − 3a + a·(1+0.25) − 4a)/13     = 0.75a/13  = 0.040795
    # rs token: (0,0) and (2,1) rejected: −(3a − 3a + a − 4a)/11 = 3a/11     = 0.192848
    # rs seq:   rows 0 (ratio 3) and 2 (1/4) rejected: −(−3a − 4a)/7 = a  = 0.707107
    a = float(rl.grpo_advantages(_batch().tensor("scores"), _batch().tensor("response_mask"), 2)[0, 0])
    close(a, 0.70711, atol=1e-5)
    cases = {
        (): a / 13,
        (("rollout_is", "token"),): 0.75 * a / 13,
        (("rollout_rs", "token"),): 3 * a / 11,
        (("rollout_rs", "sequence"),): a,
    }
    for args, expected in cases.items():
        result, _ = _train("grpo_actor", **dict(args))
        close(result.metrics["actor/pg_loss"], expected, atol=2e-6)


# ---- tier 5: through the runtime -----------------------------------------------------------------------
def _ppo_run(tmp: Path, *overrides: str) -> dict[str, float]:
    """One PPO iteration of ``examples/ppo.yaml`` (tiny Llama, 2-digit arithmetic). PPO, not GRPO: with a
    random-init policy every exact-match reward is 0, so GRPO's advantages (and its loss) are all 0, while
    PPO's come from the critic and the KL penalty and are not."""
    graph = load_graph(
        "examples/ppo.yaml",
        [f"run.output_dir={tmp}", "run.iterations=1", "run.checkpoint_interval=0", "run.eval_interval=0",
         "run.seed=3", *overrides],
    )  # fmt: skip
    return Controller(resolve_plan(graph, None)).run().metrics


@pytest.fixture
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # example graphs name paths relative to the repository root
    torch.set_num_threads(1)


TIS_ON = ("nodes.actor_train.args.rollout_is=token", "nodes.actor_train.args.rollout_is_threshold=1.0")
RS_ON = ("nodes.actor_train.args.rollout_rs=token", "nodes.actor_train.args.rollout_rs_threshold=1.1")


@pytest.mark.usefixtures("_in_repo")
def test_runtime_on_policy_correction_changes_nothing(tmp_path: Path) -> None:
    # sampler and trainer agree (rollout/logprob_gap ≈ 0): every weight min(r, 1) ≈ 1, nothing rejected
    off = _ppo_run(tmp_path / "off")
    on = _ppo_run(tmp_path / "on", *TIS_ON, *RS_ON)
    assert on["rollout/logprob_gap_mean"] < 1e-5
    close(on["rollout/tis_weight_mean"], 1.0, atol=1e-4)
    assert on["rollout/mask_frac"] == 0.0
    close(on["actor/pg_loss"], off["actor/pg_loss"], atol=1e-5)


@pytest.mark.usefixtures("_in_repo")
def test_runtime_temperature_mismatch_is_weighted_and_masked(tmp_path: Path) -> None:
    # the sampler draws at temperature 0.5 while the trainer scores at 1: π_rollout is sharper, so the
    # ratio π_old/π_rollout of a sampled token is mostly < 1 (likely tokens) and sometimes > 1 (rare ones).
    # (|log-ratio| up to ≈ 0.37 on this near-uniform random model). With C = 1 every weight is ≤ 1 and
    # those above are cut: mean < 1, clipfrac > 0; the bound [1/1.1, 1.1] rejects tokens; the loss differs
    # from the uncorrected run on the same samples (same seed).
    hot = "nodes.actor_gen.args.temperature=0.5"
    off = _ppo_run(tmp_path / "off", hot)
    tis = _ppo_run(tmp_path / "tis", hot, *TIS_ON)
    rs = _ppo_run(tmp_path / "rs", hot, *RS_ON)
    assert off["rollout/logprob_gap_mean"] > 0.01
    assert tis["rollout/logprob_gap_mean"] == off["rollout/logprob_gap_mean"]  # the same samples
    assert 0.0 < tis["rollout/tis_weight_mean"] < 1.0
    assert 0.0 < tis["rollout/tis_clipfrac"] < 1.0
    assert 0.0 < rs["rollout/mask_frac"] < 1.0
    assert abs(tis["actor/pg_loss"] - off["actor/pg_loss"]) > 1e-4
    assert abs(rs["actor/pg_loss"] - off["actor/pg_loss"]) > 1e-4


# ---- validation -----------------------------------------------------------------------------------------
@pytest.mark.usefixtures("_in_repo")
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["nodes.actor_train.args.rollout_is=token", "nodes.actor_train.args.recompute_logprobs=false"],
            "rollout_is",
        ),
        (
            ["nodes.actor_train.args.rollout_rs=token", "nodes.actor_train.args.recompute_logprobs=false"],
            "rollout_rs",
        ),
        (["nodes.actor_train.args.rollout_is_threshold=3"], "rollout_is_threshold"),
        (["nodes.actor_train.args.rollout_rs_threshold_lower=0.4"], "rollout_rs_threshold_lower"),
        (["nodes.actor_train.args.rollout_is=tokens"], "rollout_is"),
    ],
)
def test_a_correction_that_cannot_apply_is_rejected_at_validation(overrides: list[str], key: str) -> None:
    # with recompute_logprobs false, π_old *is* the sampler's log-probs: every ratio would be 1 and the
    # option silently do nothing, so the graph is rejected before anything runs
    with pytest.raises(GraphError, match=rf"examples/grpo.yaml: nodes.actor_train.args.{key}: "):
        load_graph("examples/grpo.yaml", overrides)
