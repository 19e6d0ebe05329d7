"""Token-budget micro-batches and packed forwards (``max_tokens_per_micro_batch``; issue 33).

Through the node functions: a node with a token budget cuts its rows by tokens and runs each micro-batch
packed (``[1,N]``, position ids restarting per sequence); its outputs, losses and updates equal the padded
path's within float rounding, for every loss aggregation, on rows of mixed prompt and response lengths
(left-padded prompts, EOS at varied points, a multi-turn row with an observation inside its response).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes import train
from rlflow.nodes.checks import launch_mistakes
from rlflow.nodes.context import ModelState, NodeContext, TrainHooks
from rlflow.nodes.models import build_model
from rlflow.nodes.rl.losses import AGG_MODES
from rlflow.nodes.rl.masks import RLInputError
from rlflow.nodes.rl.packing import budget_partition
from rlflow.nodes.token_budget import row_tokens
from tests.harness import TINY_LLAMA

load_builtin_functions()

CONFIG = TINY_LLAMA
# 6 rows, P = 5 prompt and R = 7 response columns; row 3 is a multi-turn row (observation at 2-3, mask 0).
PROMPT_LENS = [2, 5, 1, 4, 3, 5]
RESPONSE_MASKS = [
    [1, 1, 1, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1],
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 1, 0],
    [1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 0, 0, 0],
]
P, R = 5, 7
# real tokens per row: prompt + response up to its last mask-1 token
TOKENS = [5, 12, 2, 10, 8, 9]
BUDGET = 16


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    rows = len(PROMPT_LENS)
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in PROMPT_LENS])
    prompt_ids = torch.randint(3, 19, (rows, P), generator=g) * prompt_mask
    response_mask = torch.tensor(RESPONSE_MASKS)
    response_ids = torch.randint(3, 19, (rows, R), generator=g)
    seen = response_mask.flip(1).cummax(1).values.flip(1)
    response_ids = response_ids * seen
    for row, mask in enumerate(RESPONSE_MASKS):  # EOS (id 2) ends each finished response
        last = max(i for i, on in enumerate(mask) if on)
        if last < R - 1:
            response_ids[row, last] = 2
    b = Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids)
    b["response_mask"] = response_mask
    b["logprobs"] = -torch.rand(rows, R, generator=g) * response_mask
    b["ref_logprobs"] = (b.tensor("logprobs") - 0.1) * response_mask
    b["values"] = torch.rand(rows, R, generator=g) * response_mask
    b["scores"] = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.7, 0.1])
    return b


def test_budget_partition_goldens() -> None:
    # FFD: 5 -> bin 0, 4 -> bin 1 (5+4 > 7), 3 -> bin 1, 2 -> bin 0: 2 bins; worst-fit then balances 7 / 7
    assert budget_partition([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]
    assert budget_partition([5, 3, 4, 2], 7, parts=3) == [[0], [1, 3], [2]]
    assert budget_partition([1] * 10, 3) == [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]  # 3, 3, 2, 2 tokens
    with pytest.raises(RLInputError, match="row 1 has 9 tokens, more than the budget of 7"):
        budget_partition([5, 9], 7)
    with pytest.raises(RLInputError, match=r"between 2 .* and 4"):
        budget_partition([5, 3, 4, 2], 7, parts=5)
    assert row_tokens(_batch()) == TOKENS
    for rows in budget_partition(TOKENS, BUDGET):
        assert sum(TOKENS[r] for r in rows) <= BUDGET


@functools.cache
def _model(head: str) -> nn.Module:
    return build_model(config=CONFIG, head=head, seed=0).float().eval()


class _MoreMicroBatches(TrainHooks):
    """A data-parallel peer that needs ``extra`` more micro-batches than this rank."""

    def __init__(self, extra: int) -> None:
        self.extra = extra

    def global_max(self, local: int) -> int:
        return local + self.extra


def _run(
    function: str, budget: int | None, batch: Batch, hooks: TrainHooks | None = None, **args: Any
) -> tuple[Any, NodeContext, list[tuple[int, ...]]]:
    entry = NODE_FUNCTIONS.get(function)
    head = entry.heads[0] if entry.heads else "lm"
    module = copy.deepcopy(_model(head))
    state = ModelState(name="m", module=module, head=head)
    if entry.kind == "train":
        state.optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
        state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    spec = NodeSpec(
        "node", entry.kind, function, model="m", args=dict(args), max_tokens_per_micro_batch=budget
    )
    ctx = NodeContext(node=spec, model=state, group_size=2, train_hooks=hooks or TrainHooks())
    seen: list[tuple[int, ...]] = []
    target = module.backbone if hasattr(module, "backbone") else module

    def hook(_m: nn.Module, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        seen.append(tuple(kw.get("input_ids", a[0] if a else None).shape))

    target.register_forward_pre_hook(hook, with_kwargs=True)
    keys = [k for k in entry.inputs if k in batch]
    return entry.fn(ctx, batch.select(keys), **args), ctx, seen


def _assert_packed(seen: list[tuple[int, ...]]) -> None:
    assert seen and all(s[0] == 1 and s[1] <= BUDGET for s in seen), seen
    assert sum(s[1] for s in seen) % sum(TOKENS) == 0  # every real token, no padding, once per pass


@pytest.mark.parametrize(
    ("function", "outputs"),
    [
        ("logprobs", ("logprobs",)),
        ("values", ("values", "bootstrap_values")),
        ("rm_score", ("scores",)),
        ("sequence_logps", ("logps",)),
    ],
)
def test_inference_outputs_equal_the_padded_forward(function: str, outputs: tuple[str, ...]) -> None:
    padded, _, _ = _run(function, None, _batch())
    packed, _, seen = _run(function, BUDGET, _batch())
    _assert_packed(seen)
    assert len(seen) == len(budget_partition(TOKENS, BUDGET)) > 1
    for key in outputs:
        assert packed.outputs[key].shape == padded.outputs[key].shape, key
        torch.testing.assert_close(packed.outputs[key], padded.outputs[key], atol=2e-6, rtol=1e-5)
    assert packed.metrics.keys() == padded.metrics.keys() and packed.tokens == padded.tokens


def _same_step(ref: Any, ref_ctx: NodeContext, got: Any, got_ctx: NodeContext, metrics: bool) -> None:
    if metrics:
        assert ref.metrics.keys() == got.metrics.keys()
        for key, value in ref.metrics.items():
            assert got.metrics[key] == pytest.approx(value, abs=2e-6, rel=1e-5), key
    assert ref_ctx.model is not None and got_ctx.model is not None
    for a, b in zip(ref_ctx.model.module.parameters(), got_ctx.model.module.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-5)


CASES = [
    *[("ppo_actor", {"agg": agg, "kl_loss_coef": 0.1, "entropy_coef": 0.01}) for agg in AGG_MODES],
    ("sft", {"agg": "seq-mean-token-sum-norm"}),
    ("grpo_actor", {}),
    ("ppo_critic", {}),
]


@pytest.mark.parametrize(("function", "args"), CASES)
def test_train_step_equals_the_padded_step(
    function: str, args: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the whole batch padded in one micro-batch: the same update (losses are token-weighted over the
    # mini-batch, so the split does not matter)
    whole, whole_ctx, _ = _run(function, None, _batch(), **args)
    packed, packed_ctx, seen = _run(function, BUDGET, _batch(), **args)
    _assert_packed(seen)
    _same_step(whole, whole_ctx, packed, packed_ctx, metrics=False)
    # the same token-budget micro-batches run padded (packing patched off in this process only): the same
    # losses and metrics micro-batch by micro-batch
    with monkeypatch.context() as patch:
        patch.setattr(train, "packed_forwards", lambda on=True: contextlib.nullcontext())
        padded, padded_ctx, padded_seen = _run(function, BUDGET, _batch(), **args)
    assert all(s[0] > 1 or s[1] > 0 for s in padded_seen) and len(padded_seen) == len(seen)
    _same_step(padded, padded_ctx, packed, packed_ctx, metrics=True)
    assert packed.tokens == whole.tokens


def _pairs() -> Batch:
    """Preference pairs: the rows' responses chosen, the next row's (rolled) rejected."""
    b = _batch()
    roll = [*range(1, len(TOKENS)), 0]
    out = b.select(["prompt_ids", "prompt_mask"])
    out["chosen_ids"], out["chosen_mask"] = b.tensor("response_ids"), b.tensor("response_mask")
    out["rejected_ids"], out["rejected_mask"] = (
        b.tensor("response_ids")[roll],
        b.tensor("response_mask")[roll],
    )
    out["ref_chosen_logps"] = torch.linspace(-3.0, -1.0, len(TOKENS))
    out["ref_rejected_logps"] = torch.linspace(-2.0, -4.0, len(TOKENS))
    return out


@pytest.mark.parametrize("function", ["dpo", "reward_model"])
def test_pair_train_step_equals_the_padded_step(function: str) -> None:
    # a pair row runs two forwards (prompt + chosen, prompt + rejected); the budget holds both
    budget = 2 * BUDGET
    whole, whole_ctx, _ = _run(function, None, _pairs())
    packed, packed_ctx, seen = _run(function, budget, _pairs())
    lengths = row_tokens(_pairs())
    assert max(lengths) <= budget and len(seen) == 2 * len(budget_partition(lengths, budget)) > 2
    assert all(s[0] == 1 for s in seen)
    _same_step(whole, whole_ctx, packed, packed_ctx, metrics=False)


def test_ranks_agree_on_the_micro_batch_count_with_fillers() -> None:
    # a peer rank needs 2 more micro-batches than the rows here allow as their own: this rank runs its
    # 6 rows one per micro-batch plus fillers, and the update is unchanged
    whole, whole_ctx, _ = _run("ppo_actor", None, _batch())
    parts = len(budget_partition(TOKENS, BUDGET))
    got, got_ctx, seen = _run("ppo_actor", BUDGET, _batch(), _MoreMicroBatches(len(TOKENS) - parts + 2))
    assert len(seen) == len(TOKENS) + 2
    _same_step(whole, whole_ctx, got, got_ctx, metrics=False)
    out, _, seen = _run("logprobs", BUDGET, _batch(), _MoreMicroBatches(1))
    assert len(seen) == parts + 1
    ref, _, _ = _run("logprobs", None, _batch())
    torch.testing.assert_close(out.outputs["logprobs"], ref.outputs["logprobs"], atol=2e-6, rtol=1e-5)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo.yaml"


def test_validate_rejects_a_budget_below_the_longest_sequence() -> None:
    # the arithmetic prompts have at most 7 tokens and actor_gen samples 8 more: 15 tokens is the least
    fine = load_graph(EXAMPLE, ["nodes.actor_train.max_tokens_per_micro_batch=15"])
    assert launch_mistakes(fine) == []
    small = load_graph(EXAMPLE, ["nodes.actor_train.max_tokens_per_micro_batch=14"])
    (message,) = [m for m in launch_mistakes(small) if "max_tokens_per_micro_batch" in m]
    assert message.startswith(f"{EXAMPLE}: nodes.actor_train.max_tokens_per_micro_batch: 14 tokens")
    assert "15 tokens" in message and "nodes.actor_gen.args.max_new_tokens=8" in message
    with pytest.raises(PlanError, match=r"plan.actor_train.layout: d1t1p1m2 .* nodes.actor_train.max_tokens"):
        load_graph(
            EXAMPLE,
            [
                "nodes.actor_train.max_tokens_per_micro_batch=64",
                "plan={actor_gen: {devices: '0', layout: d1t1p1m1}, ref: {devices: '0', layout: d1t1p1m1},"
                " actor_train: {devices: '0', layout: d1t1p1m2}}",
            ],
        )


@pytest.mark.parametrize(
    ("graph", "node", "longest", "seqs"),
    [
        ("dpo.yaml", "ref_chosen", 11, "prompt + chosen"),  # reads one sequence of each pair
        ("dpo.yaml", "actor_train", 22, "prompt + chosen + prompt + rejected"),  # a row holds both
        ("reward_model.yaml", "reward_train", 22, "prompt + chosen + prompt + rejected"),
    ],
)
def test_validate_counts_every_sequence_of_a_data_row(graph: str, node: str, longest: int, seqs: str) -> None:
    """Nodes whose sequences come from the data (preference pairs): the budget must hold the longest whole
    row, measured row by row as the runtime counts it (``row_tokens``), not the prompt alone (a fresh
    user's DPO budget of 7 passed validate and failed in iteration 1 with 'row 0 has 11 tokens')."""
    path = EXAMPLE.parent / graph
    key = f"nodes.{node}.max_tokens_per_micro_batch"
    assert not [m for m in launch_mistakes(load_graph(path, [f"{key}={longest}"])) if key in m]
    (message,) = [m for m in launch_mistakes(load_graph(path, [f"{key}={longest - 1}"])) if key in m]
    assert message.startswith(f"{path}: {key}: {longest - 1} tokens is below the longest row")
    assert f"{longest} tokens" in message and f"data rows, {seqs})" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_forward_on_cuda_equals_the_padded_one(dtype: torch.dtype) -> None:
    # on CUDA in bfloat16 with flash_attn installed the packed forward runs FlashAttention-2's varlen kernel
    # (the model is switched, with a PackedAttentionWarning); else SDPA with the block-diagonal mask
    from rlflow.nodes.forward import packed_forwards, response_logits

    b = _batch().to("cuda")
    args = [b.tensor(k) for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    model = copy.deepcopy(_model("lm")).to("cuda", dtype)
    with torch.no_grad():
        padded = response_logits(model, *args).float()
        with warnings.catch_warnings(record=True), packed_forwards():
            packed = response_logits(model, *args).float()
    mask = b.tensor("response_mask")[..., None].bool()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(packed * mask, padded * mask, atol=tol, rtol=tol)
