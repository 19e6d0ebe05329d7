"""No pass whose result is known (issue 33): the π_old first pass of the clipped policy-gradient nodes runs
only over the rows whose train forward comes after the call's first optimizer step.

Tier 2, through the registry on a tiny Llama: with one mini-batch the node skips the pass and reaches the
weights, losses and metrics of the forced pass (every row through the no-grad forward) to float tolerance,
forwarding fewer rows; with two mini-batches and two epochs the first mini-batch's π_old is its own first
forward's log-probs, detached (the ratio is exactly 1 there and those values come back in epoch 2), and the
second mini-batch's is the first pass's under the weights before any step; mismatch correction keeps the
whole pass, the decoupled loss and ``recompute_logprobs: false`` run none. The models train in eval mode,
so a dropout in the model's config changes nothing. Tier 3: the planner prices the share of rows the trait
gives.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import rlflow.nodes.functions.policy as F
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import ModelState, NodeContext, NodeResult
from rlflow.nodes.models import build_model
from rlflow.nodes.rl.policy_losses import POLICY_LOSSES
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.shapes import ModelShape
from tests.test_rl_rollout_correction import CONFIG

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [4, 3, 2, 4, 1, 4, 3, 2]  # 8 rows in groups of 2
SHARE = F.FIRST_PASS_SHARE
load_builtin_functions()


@functools.cache
def _model(dropout: float = 0.0) -> torch.nn.Module:
    return build_model(config={**CONFIG, "attention_dropout": dropout}, head="lm", seed=0).float()


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(ROOT / "examples" / "arith" / "tokenizer")


def _ctx(
    kind: str, function: str, module: torch.nn.Module, mini_batches: int = 1, epochs: int = 1
) -> NodeContext:
    state = ModelState(name="actor", module=module, head="lm", tokenizer=_tokenizer())
    if kind == "train":
        state.optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.5)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
        state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    spec = NodeSpec("node", kind, function, model="actor", mini_batches=mini_batches, epochs=epochs)
    return NodeContext(node=spec, model=state, group_size=2, micro_batches=2, tokenizer=_tokenizer())


def _logprobs(module: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """The trainer's log-probs ``[B, R]`` under ``module`` (the ``logprobs`` inference node)."""
    return NODE_FUNCTIONS.get("logprobs").fn(_ctx("inference", "logprobs", module), batch).outputs["logprobs"]


@functools.cache
def _batch() -> Batch:
    """8 rows in groups of 2, lengths :data:`LENGTHS`; the sampler's log-probs are the trainer's minus 0.05
    (a gap the metrics see), the reference's minus 0.1."""
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, 19, (8, 3), generator=g)
    prompt_ids[1::3, 0] = 0  # some left padding
    mask = (torch.arange(4)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(3, 19, (8, 4), generator=g).masked_fill(mask == 0, 0)
    b = Batch({"prompt_ids": prompt_ids, "prompt_mask": (prompt_ids != 0).long(), "response_ids": ids,
               "response_mask": mask})  # fmt: skip
    old = _logprobs(copy.deepcopy(_model()).eval(), b)
    b["logprobs"] = (old - 0.05) * mask
    b["ref_logprobs"] = (old - 0.1) * mask
    b["values"] = torch.full((8, 4), 0.2) * mask
    b["scores"] = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3, 0.8])
    return b


@dataclasses.dataclass
class Run:
    result: NodeResult
    params: list[torch.Tensor]
    rows: int  # rows through the model's forward, every pass
    losses: list[tuple[torch.Tensor, torch.Tensor]]  # (log π_θ, log π_old) of each loss call, detached


def _train(
    monkeypatch: pytest.MonkeyPatch,
    function: str,
    *,
    forced: bool = False,
    mini_batches: int = 1,
    epochs: int = 1,
    dropout: float = 0.0,
    prox: torch.Tensor | None = None,
    **args: Any,
) -> Run:
    """One call of ``function`` from the shared initial model; ``forced``: the trait says every row needs
    the first pass (the behaviour before issue 33)."""
    entry = NODE_FUNCTIONS.get(function)
    module = copy.deepcopy(_model(dropout))
    ctx = _ctx("train", function, module, mini_batches, epochs)
    batch = _batch().select([k for k in entry.inputs if k in _batch()])
    if prox is not None:
        batch["prox_logprobs"] = prox
    rows: list[int] = []
    forward = module.forward
    monkeypatch.setattr(
        module, "forward", lambda *a, **k: rows.append(len(k["input_ids"])) or forward(*a, **k)
    )
    losses: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Losses:  # each policy loss, recording what it is given
        @staticmethod
        def get(name: str) -> Any:
            real = POLICY_LOSSES.get(name)

            def recording(lp: torch.Tensor, old: torch.Tensor, *a: Any, **k: Any) -> Any:
                losses.append((lp.detach().clone(), old.detach().clone()))
                return real.fn(lp, old, *a, **k)

            return dataclasses.replace(real, fn=recording)

    with monkeypatch.context() as m:
        m.setattr(F, "POLICY_LOSSES", Losses)
        if forced:
            m.setattr(F, "first_pass_share", lambda a, mb: 1.0)
        result = entry.fn(ctx, batch, **args)
    return Run(result, [p.detach().clone() for p in module.parameters()], sum(rows), losses)


def _same(a: Run, b: Run) -> None:
    for x, y in zip(a.params, b.params, strict=True):
        torch.testing.assert_close(x, y, atol=2e-6, rtol=1e-5)
    ma, mb = dict(a.result.metrics), dict(b.result.metrics)
    ma.pop(SHARE), mb.pop(SHARE)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-5, abs=2e-6), k


@pytest.mark.parametrize("function", ["ppo_actor", "grpo_actor"])
@pytest.mark.parametrize("epochs", [1, 2])
def test_one_mini_batch_skips_the_pass_and_takes_the_same_step(
    monkeypatch: pytest.MonkeyPatch, function: str, epochs: int
) -> None:
    skip = _train(monkeypatch, function, epochs=epochs)
    forced = _train(monkeypatch, function, epochs=epochs, forced=True)
    _same(skip, forced)
    assert skip.result.metrics[SHARE] == 0.0 and forced.result.metrics[SHARE] == 1.0
    assert forced.rows == skip.rows + 8 == 8 * epochs + 8  # the no-grad pass over the 8 rows is gone
    # the first pass's gap to the sampler, now from the train forward: 0.05 on every trainable token
    assert skip.result.metrics["rollout/logprob_gap_mean"] == pytest.approx(0.05, abs=1e-5)
    assert skip.result.metrics["rollout/logprob_gap_max"] == pytest.approx(0.05, abs=1e-5)
    # the first step's ratio is exactly 1; epoch 2 reads the stored π_old, not its own forward
    for lp, old in skip.losses[:2]:
        assert torch.equal(lp, old)
    assert len(skip.losses) == 2 * epochs
    for (_, old2), (_, old1) in zip(skip.losses[2:], skip.losses[:2], strict=False):
        assert torch.equal(old2, old1)
    assert all(float((lp - old).abs().max()) > 1e-3 for lp, old in skip.losses[2:])


def test_later_mini_batches_keep_the_old_policy_of_the_first_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 mini-batches × 2 epochs × 2 micro-batches: loss calls 0-1 mini-batch 1 (before any step), 2-3
    # mini-batch 2 (after one step), 4-7 epoch 2. Rows 4-7 need π_old from the pass; rows 0-3 have it from
    # their own first forward.
    skip = _train(monkeypatch, "grpo_actor", mini_batches=2, epochs=2)
    forced = _train(monkeypatch, "grpo_actor", mini_batches=2, epochs=2, forced=True)
    _same(skip, forced)
    assert skip.result.metrics[SHARE] == 0.5
    assert forced.rows == skip.rows + 4 == 2 * 8 + 8  # the pass covers the 4 rows of mini-batch 2 only
    before = _logprobs(copy.deepcopy(_model()).eval(), _batch())  # π_old: the weights before any step
    mask = _batch().tensor("response_mask")
    for k, (lp, old) in enumerate(skip.losses):
        rows = slice(0, 2) if k % 4 == 0 else slice(2, 4) if k % 4 == 1 else None
        rows = rows or (slice(4, 6) if k % 4 == 2 else slice(6, 8))
        width = int(lp.shape[1])
        torch.testing.assert_close(old * mask[rows, :width], before[rows, :width], atol=1e-6, rtol=0)
        if k in (0, 1):
            assert torch.equal(lp, old)  # the train forward's own, detached
        if k in (2, 3):  # after the first step: π_θ moved away from the true π_old
            assert float(((lp - old) * mask[rows, :width]).abs().max()) > 1e-3
    assert torch.equal(skip.losses[4][1], skip.losses[0][1]) and torch.equal(
        skip.losses[5][1], skip.losses[1][1]
    )


@pytest.mark.parametrize(
    "args", [{"rollout_is": "token"}, {"rollout_rs": "token"}], ids=["rollout_is", "rollout_rs"]
)
def test_mismatch_correction_keeps_the_whole_pass(
    monkeypatch: pytest.MonkeyPatch, args: dict[str, Any]
) -> None:
    # its weights and loss mask are set from π_old of the whole batch before the first forward
    run = _train(monkeypatch, "grpo_actor", **args)
    assert run.result.metrics[SHARE] == 1.0 and run.rows == 8 + 8
    _same_values(run, _train(monkeypatch, "grpo_actor", forced=True, **args))


def _same_values(a: Run, b: Run) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a.params, b.params, strict=True))
    assert a.result.metrics == b.result.metrics


def test_decoupled_and_sampler_logprobs_run_no_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    prox = _logprobs(copy.deepcopy(_model()).eval(), _batch())
    dec = _train(monkeypatch, "grpo_actor", mini_batches=2, prox=prox, decoupled_loss=True)
    assert dec.result.metrics[SHARE] == 0.0 and dec.rows == 8
    sampler = _train(monkeypatch, "grpo_actor", mini_batches=2, recompute_logprobs=False)
    assert sampler.result.metrics[SHARE] == 0.0 and sampler.rows == 8
    assert "rollout/logprob_gap_mean" not in sampler.result.metrics  # π_old is the sampler's: no gap
    for _, old in sampler.losses:  # the sampler's log-probs, as before
        assert float(old.max()) <= 0.0
    assert torch.equal(
        sampler.losses[0][1], _batch().tensor("logprobs")[0:2, : sampler.losses[0][1].shape[1]]
    )


def test_a_dropout_in_the_config_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # the loop trains in eval mode: the train forward is the first pass's function even with dropout set
    assert _model(0.5).config.attention_dropout == 0.5
    skip = _train(monkeypatch, "ppo_actor", dropout=0.5)
    _same(skip, _train(monkeypatch, "ppo_actor", dropout=0.5, forced=True))
    _same(skip, _train(monkeypatch, "ppo_actor"))  # and the same as without dropout


# ---- tier 3: the planner --------------------------------------------------------------------------------
def test_the_trait_gives_the_share_of_rows() -> None:
    base = {"decoupled_loss": False, "recompute_logprobs": True, "rollout_is": None, "rollout_rs": None}
    share = NODE_FUNCTIONS.get("grpo_actor").first_pass
    assert share is not None
    assert [share(base, m) for m in (1, 2, 4)] == [0.0, 0.5, 0.75]
    assert share({**base, "rollout_rs": "seq"}, 4) == share({**base, "rollout_is": "token"}, 1) == 1.0
    assert (
        share({**base, "decoupled_loss": True}, 4) == share({**base, "recompute_logprobs": False}, 4) == 0.0
    )


def test_the_planner_prices_the_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    shares = {
        over: next(n for n in problem_from_graph(load_graph("examples/grpo.yaml", [over])).nodes
                   if n.name == "actor_train").first_pass
        for over in ("nodes.actor_train.mini_batches=2", "nodes.actor_train.mini_batches=1",
                     "nodes.actor_train.args.rollout_is=token")
    }  # fmt: skip
    assert list(shares.values()) == [0.5, 0.0, 1.0]
    cluster = load_cluster("cpu-local")
    shape = ModelShape.from_config(CONFIG)

    def compute(first: float) -> float:
        node = PlanNode("tr", "m", "train", 16, 8, 8, mini_batches=2, first_pass=first)
        cost = CostModel(PlanProblem({"m": shape}, (node,)), cluster).node_cost(
            "tr", NodePlacement((0,), Layout())
        )
        return cost.compute_s

    # the pass's compute is the share of one forward over the rows
    assert compute(1.0) - compute(0.0) == pytest.approx(2 * (compute(0.5) - compute(0.0)))
    assert compute(0.5) > compute(0.0)
