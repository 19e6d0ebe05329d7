"""DAPO's over-long reward shaping (issue 37): the soft over-long punishment (goldens by hand, verl's DAPO
reward manager's behaviour on the same lengths), the ``overlong_penalty`` node, the train nodes' over-long
filtering, and validate's refusals naming file, node and key.

Source: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale" (arXiv:2503.14476),
section 3.4, eq. 13.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.nodes.rl as rl
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import NodeContext
from rlflow.nodes.functions import policy as F
from rlflow.schedulers.cli import main

load_builtin_functions()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# ---- the penalty ----------------------------------------------------------------------------------------
# L_max = 8, L_cache = 4: 0 up to 8 - 4 = 4 tokens; ((8 - 4) - |y|)/4 in (4, 8]; -1 beyond 8 (eq. 13).
#   |y| = 0, 3, 4 -> 0;  5 -> -1/4;  6 -> -2/4;  7 -> -3/4;  8 -> -1;  9 -> -1
LENGTHS = [0, 3, 4, 5, 6, 7, 8, 9]
PENALTY = [0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]


def test_soft_overlong_punishment_golden() -> None:
    out = rl.overlong_penalty(torch.tensor(LENGTHS), 8, 4, 1.0)
    torch.testing.assert_close(out, torch.tensor(PENALTY), atol=1e-7, rtol=0)
    # penalty_factor scales it (DAPO's recipe's overlong_penalty_factor): 0.5 halves every value
    half = rl.overlong_penalty(torch.tensor(LENGTHS), 8, 4, 0.5)
    torch.testing.assert_close(half, torch.tensor([p / 2 for p in PENALTY]), atol=1e-7, rtol=0)


def test_matches_verls_dapo_reward_manager_up_to_the_generation_limit() -> None:
    # verl's DAPORewardManager: expected = max_resp_len - overlong_buffer.len; exceed = |y| - expected;
    # reward += min(-exceed / overlong_buffer.len * penalty_factor, 0). Its |y| never exceeds max_resp_len
    # (the generation limit), and on every such length it equals eq. 13 (verl has no -1 cap: it needs none).
    for max_len, buffer, factor in ((8, 4, 1.0), (10, 3, 0.7), (5, 5, 2.0)):
        lengths = list(range(max_len + 1))
        verl = [min(-(n - (max_len - buffer)) / buffer * factor, 0.0) for n in lengths]
        ours = rl.overlong_penalty(torch.tensor(lengths), max_len, buffer, factor)
        torch.testing.assert_close(ours, torch.tensor(verl), atol=1e-6, rtol=0)


def test_response_lengths_count_observation_spans() -> None:
    # the last mask-1 position + 1: a row [1, 1, 0, 1, 0] (an observation span at 2) is 4 tokens long, as
    # verl's valid_response_length (attention mask) counts it; an empty row is 0
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    assert rl.response_lengths(mask).tolist() == [4, 5, 0]


@pytest.mark.parametrize(
    ("max_length", "buffer", "factor", "match"),
    [(8, 0, 1.0, "buffer must lie in"), (8, 9, 1.0, "buffer must lie in"), (8, 4, -0.1, "penalty_factor")],
)
def test_bad_values_raise(max_length: int, buffer: int, factor: float, match: str) -> None:
    with pytest.raises(rl.RLInputError, match=match):
        rl.overlong_penalty(torch.tensor([1]), max_length, buffer, factor)


# ---- the node -------------------------------------------------------------------------------------------
def test_overlong_penalty_node_adds_the_penalty_to_the_task_scores() -> None:
    # 4 responses of 3, 5, 8 and 6 tokens; L_max 8, L_cache 4: penalties 0, -0.25, -1, -0.5
    mask = torch.tensor([[1] * 3 + [0] * 5, [1] * 5 + [0] * 3, [1] * 8, [1] * 6 + [0] * 2])
    batch = Batch({"response_mask": mask, "task_scores": torch.tensor([1.0, 1.0, 0.0, 0.5])})
    ctx = NodeContext(node=NodeSpec("overlong", "inference", "overlong_penalty"), model=None)
    out = NODE_FUNCTIONS.get("overlong_penalty").fn(ctx, batch, max_length=8, buffer=4)
    torch.testing.assert_close(out.outputs["scores"], torch.tensor([1.0, 0.75, -1.0, 0.0]))
    assert out.metrics["overlong/penalty_mean"] == pytest.approx(-1.75 / 4)
    assert out.metrics["overlong/penalised_frac"] == pytest.approx(3 / 4)


# ---- over-long filtering in the train nodes --------------------------------------------------------------
LP = torch.tensor([[-0.8, -1.0, -1.5], [-1.2, -1.0, -0.6], [-0.5, -0.9, -1.1], [-1.0, -1.3, -0.7]])


def _node_loss(
    monkeypatch: pytest.MonkeyPatch, function: str, batch: Batch, **args: Any
) -> tuple[float, dict]:
    """``function`` through its registered function with the policy's log-probs fixed to LP (old: the
    batch's ``logprobs``); returns the loss (at the train loop's normaliser) and the node's metrics."""
    out: list[float] = []

    def fake_optimize(
        ctx: Any, work: Batch, loss_fn: Any, prefix: str, agg: str, mask_key: str = "response_mask", **_: Any
    ) -> dict[str, float]:
        loss, _, _ = loss_fn(None, work, F.rl.loss_normalizer(work.tensor(mask_key), agg))
        out.append(float(loss))
        return {}

    monkeypatch.setattr(F, "optimize", fake_optimize)
    monkeypatch.setattr(F, "batch_logprobs", lambda m, b, **kw: (LP.clone(), torch.zeros_like(LP)))
    ctx = NodeContext(node=NodeSpec("n", "train", function), model=None, group_size=2)
    result = NODE_FUNCTIONS.get(function).fn(ctx, batch, recompute_logprobs=False, kl_loss_coef=0.0, **args)
    return out[-1], result.metrics


def _batch(truncated: list[int]) -> Batch:
    return Batch(
        {
            "prompt_ids": torch.ones(4, 2, dtype=torch.long),
            "prompt_mask": torch.ones(4, 2, dtype=torch.long),
            "response_ids": torch.full((4, 3), 5),
            "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]),
            "logprobs": LP.clone(),  # on-policy: PPO's per-token loss is -A
            "ref_logprobs": LP.clone(),
            "values": torch.zeros(4, 3),
            "scores": torch.tensor([1.0, 0.0, 0.0, 1.0]),
            "truncated": torch.tensor(truncated),
        }
    )


def test_grpo_actor_filters_truncated_rows_out_of_the_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    # Groups (rows 0, 1) and (2, 3), scores [1, 0] and [0, 1], eps 0: A = [+a, -a, -a, +a], a = 0.707107
    # (unbiased std 0.707107: the truncated rows still count in the baselines). On-policy ℓ_t = -A_t.
    # Rows 1 and 2 truncated and filtered: the loss is over rows 0 (3 tokens) and 3 (1 token) only,
    # token-mean: (-a·3 - a·1)/4 = -a. Unfiltered: (-3a + 2a + 3a - a)/9 = a/9.
    a = 0.5 / 0.5**0.5
    batch = _batch([0, 1, 1, 0])
    loss, metrics = _node_loss(monkeypatch, "grpo_actor", batch, eps=0.0, overlong_filter=True)
    assert loss == pytest.approx(-a, abs=1e-6)
    assert metrics["overlong/filtered_frac"] == pytest.approx(0.5)
    loss, metrics = _node_loss(monkeypatch, "grpo_actor", batch, eps=0.0)
    assert loss == pytest.approx(a / 9, abs=1e-6) and "overlong/filtered_frac" not in metrics
    # the other outcome actors filter the same way
    loss, _ = _node_loss(monkeypatch, "rloo_actor", batch, overlong_filter=True, kl_coef=0.0)
    # RLOO: A_i = r_i - mean of the other: [1, -1, -1, 1]; rows 0 and 3: (-1·3 - 1·1)/4 = -1
    assert loss == pytest.approx(-1.0, abs=1e-6)


def test_ppo_actor_filters_with_its_own_truncated_input(monkeypatch: pytest.MonkeyPatch) -> None:
    # values 0, γ = λ = 1, no KL: A_t = the row's score on every token (GAE of a last-token reward); not
    # whitened. Rows 1 and 2 filtered: rows 0 (score 1, 3 tokens) and 3 (score 1, 1 token): (-3 - 1)/4 = -1
    batch = _batch([0, 1, 1, 0])
    batch["bootstrap_values"] = torch.zeros(4)
    args = {"whiten_advantages": False, "kl_coef": 0.0, "gamma": 1.0, "lam": 1.0}
    loss, metrics = _node_loss(monkeypatch, "ppo_actor", batch, overlong_filter=True, **args)
    assert loss == pytest.approx(-1.0, abs=1e-6) and metrics["overlong/filtered_frac"] == pytest.approx(0.5)


# ---- validate -------------------------------------------------------------------------------------------
EXAMPLE = "examples/dapo_overlong.yaml"
BAD = [
    ("nodes.overlong.args.buffer=0",
     f"{EXAMPLE}: nodes.overlong.args.buffer: must be a positive integer, got 0"),
    ("nodes.overlong.args.buffer=9",
     f"{EXAMPLE}: nodes.overlong.args.buffer: the penalty window L_cache (9 tokens) is longer than "
     "max_length"),
    ("nodes.overlong.args.penalty_factor=-1", f"{EXAMPLE}: nodes.overlong.args.penalty_factor: must be >= 0"),
    ("nodes.overlong.args.max_length=9",
     f"{EXAMPLE}: nodes.overlong.args.max_length: 9 exceeds the max_new_tokens (8) of node 'actor_gen'"),
    ("nodes.actor_train.inputs=[prompt_ids,prompt_mask,response_ids,response_mask,logprobs,ref_logprobs,scores]",
     f"{EXAMPLE}: nodes.actor_train.inputs.truncated: args.overlong_filter is True, which reads input "
     "'truncated'"),
]  # fmt: skip


@pytest.mark.parametrize(("override", "message"), BAD, ids=[b[0] for b in BAD])
def test_validate_refuses_bad_overlong_settings(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", EXAMPLE, override]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_ppo_actor_filter_needs_its_truncated_input(capsys: pytest.CaptureFixture[str]) -> None:
    inputs = "[prompt_ids,prompt_mask,response_ids,response_mask,logprobs,ref_logprobs,values,scores]"
    argv = ["validate", "examples/ppo.yaml", "nodes.actor_train.args.overlong_filter=true"]
    assert main([*argv, f"nodes.actor_train.inputs={inputs}"]) == 2
    err = capsys.readouterr().err
    assert "examples/ppo.yaml: nodes.actor_train.inputs.truncated: args.overlong_filter is True" in err
    assert main(argv) == 0  # examples/ppo.yaml binds truncated (and bootstrap_values)


def test_the_example_reads_like_the_paper() -> None:
    g = load_graph(EXAMPLE)
    assert g.producer("task_scores") == "reward" and g.producer("scores") == "overlong"
    assert g.args("overlong")["max_length"] == g.args("actor_gen")["max_new_tokens"] == 8
    assert g.args("actor_train")["overlong_filter"] is True
