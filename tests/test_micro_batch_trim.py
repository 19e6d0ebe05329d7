"""Micro-batches compute on their own tokens: each is cut to the prompt and response columns its rows use
(:func:`rlflow.dataflow.batch.trim_padding`, applied by :func:`rlflow.nodes.train.micro_batches`), and the
node functions give the outputs, losses and updates of an uncut forward."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from rlflow.dataflow.batch import Batch, trim_padding
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes import train
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.models import build_model
from rlflow.nodes.train import micro_batches
from tests.harness import TINY_LLAMA

load_builtin_functions()

CONFIG = TINY_LLAMA
# rows 0-1 (micro-batch 0 of 2) are short, rows 2-3 long: the call is P = 6 prompt, R = 9 response columns.
# Row 1 is a multi-turn agent row: trained tokens 0-1, a tool observation at 2-3 (mask 0), trained token 4,
# then a trailing observation at 5 (mask 0, after its last trained token: never attended).
PROMPT_LENS = [2, 1, 6, 3]
RESPONSE_MASKS = [
    [1, 1, 1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 0, 0],
]
P, R = 6, 9


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.tensor([[0] * (P - n) + [1] * n for n in PROMPT_LENS])
    prompt_ids = torch.randint(3, 19, (4, P), generator=g) * prompt_mask
    response_mask = torch.tensor(RESPONSE_MASKS)
    response_ids = torch.randint(3, 19, (4, R), generator=g)
    response_ids[1, 5] = 7  # the trailing observation token (mask 0) is real text, not padding
    response_ids[[0, 2, 3]] *= response_mask[[0, 2, 3]]
    response_ids[1, 6:] = 0
    b = Batch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids)
    b["response_mask"] = response_mask
    b["logprobs"] = -torch.rand(4, R, generator=g) * response_mask
    b["ref_logprobs"] = (b.tensor("logprobs") - 0.1) * response_mask
    b["values"] = torch.rand(4, R, generator=g) * response_mask
    b["scores"] = torch.tensor([1.0, 0.0, 0.5, 0.2])
    b["answer"] = ["a", "b", "c", "d"]
    return b


def test_trimmed_micro_batches_have_golden_widths() -> None:
    b = _batch()
    b["bootstrap_values"] = torch.zeros(4, R + 1)  # not the response's width: never cut
    first, second = micro_batches(b, 2)
    # micro-batch 0: prompts 2 and 1 tokens -> 2 columns; last trained token at 2 (row 0) and 4 (row 1) -> 5
    # (row 1's observation at 2-3 stays: a trained token follows it; its trailing one at 5 goes)
    assert tuple(first.tensor("prompt_ids").shape) == (2, 2)
    assert tuple(first.tensor("prompt_mask").shape) == (2, 2)
    for key in ("response_ids", "response_mask", "logprobs", "ref_logprobs", "values"):
        assert tuple(first.tensor(key).shape) == (2, 5), key
    assert tuple(first.tensor("bootstrap_values").shape) == (2, R + 1)
    assert first.tensor("prompt_ids").tolist() == _batch().tensor("prompt_ids")[:2, 4:].tolist()
    assert first.tensor("response_mask").tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 1]]
    assert first.list_of("answer") == ["a", "b"] and first.tensor("scores").tolist() == [1.0, 0.0]
    # micro-batch 1: row 2 uses every column
    assert tuple(second.tensor("prompt_ids").shape) == (2, P)
    assert tuple(second.tensor("response_ids").shape) == (2, R)
    # one micro-batch of the whole call: nothing to cut; all-padding responses keep one column
    whole = micro_batches(b, 1)[0]
    assert tuple(whole.tensor("response_ids").shape) == (4, R) and tuple(
        whole.tensor("prompt_ids").shape
    ) == (4, P)
    empty = trim_padding(Batch(prompt_mask=torch.tensor([[0, 1]]), response_mask=torch.zeros(1, 4)))
    assert tuple(empty.tensor("response_mask").shape) == (1, 1) and tuple(
        empty.tensor("prompt_mask").shape
    ) == (1, 1)


@functools.cache
def _model(head: str) -> nn.Module:
    return build_model(config=CONFIG, head=head, seed=0).float().eval()


def _ctx(kind: str, function: str, head: str, micro: int, args: dict[str, Any]) -> NodeContext:
    module = copy.deepcopy(_model(head))
    state = ModelState(name="m", module=module, head=head)
    if kind == "train":
        state.optimizer = torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=1.0)
        state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
        state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    spec = NodeSpec("node", kind, function, model="m", args=dict(args))
    return NodeContext(node=spec, model=state, group_size=2, micro_batches=micro)


def _widths(ctx: NodeContext) -> list[tuple[int, ...]]:
    """Records the ``input_ids`` shape of every forward of ``ctx``'s model."""
    seen: list[tuple[int, ...]] = []
    assert ctx.model is not None
    module = ctx.model.module
    target = module.backbone if hasattr(module, "backbone") else module

    def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(tuple(ids.shape))

    target.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _unpadded(head: str, row: int) -> torch.Tensor:
    """Hand-built forward of one row without any padding: its real prompt tokens, then its response up to
    its last trained token (observations inside included, as the sampler saw them); ``[T]`` logits rows or
    values."""
    b = _batch()
    prompt = b.tensor("prompt_ids")[row, P - PROMPT_LENS[row] :]
    last = max(i for i, v in enumerate(RESPONSE_MASKS[row]) if v)
    ids = torch.cat([prompt, b.tensor("response_ids")[row, : last + 1]])[None]
    model = _model(head)
    with torch.no_grad():
        if head == "lm":
            return model(input_ids=ids, use_cache=False).logits[0].float()
        return model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0]


def _expected_logprobs() -> torch.Tensor:
    b = _batch()
    out = torch.zeros(4, R)
    for row in range(4):
        logits = _unpadded("lm", row).log_softmax(-1)
        p = PROMPT_LENS[row]
        for t, on in enumerate(RESPONSE_MASKS[row]):
            if on:
                out[row, t] = logits[p + t - 1, b.tensor("response_ids")[row, t]]
    return out


def _run(
    function: str, micro: int, batch: Batch, **args: Any
) -> tuple[Any, NodeContext, list[tuple[int, ...]]]:
    entry = NODE_FUNCTIONS.get(function)
    head = entry.heads[0] if entry.heads else "lm"
    ctx = _ctx(entry.kind, function, head, micro, args)
    seen = _widths(ctx)
    keys = [k for k in entry.inputs if k in batch]
    return entry.fn(ctx, batch.select(keys), **args), ctx, seen


def test_logprobs_node_equals_the_unpadded_forward_of_each_row() -> None:
    out, _, seen = _run("logprobs", 2, _batch())
    # micro-batch 0 runs on 2 + 5 columns, micro-batch 1 on 6 + 9
    assert seen == [(2, 7), (2, P + R)]
    lp = out.outputs["logprobs"]
    assert tuple(lp.shape) == (4, R)
    torch.testing.assert_close(lp, _expected_logprobs(), atol=1e-6, rtol=0)
    # the agent row's trained tokens after its observation read the observation: same as the sampler
    assert float(lp[1, 4]) != 0.0 and float(lp[1, 2]) == 0.0 == float(lp[1, 5])


def test_values_node_equals_the_unpadded_forward_of_each_row() -> None:
    out, _, seen = _run("values", 2, _batch())
    assert seen == [(2, 7), (2, P + R)]
    values, boot = out.outputs["values"], out.outputs["bootstrap_values"]
    assert tuple(values.shape) == (4, R) and tuple(boot.shape) == (4,)
    want, want_boot = torch.zeros(4, R), torch.zeros(4)
    for row in range(4):
        v, p = _unpadded("value", row), PROMPT_LENS[row]
        last = max(i for i, on in enumerate(RESPONSE_MASKS[row]) if on)
        for t, on in enumerate(RESPONSE_MASKS[row]):
            if on:
                want[row, t] = v[p + t - 1]
        want_boot[row] = v[p + last]  # the state after the last trained token
    torch.testing.assert_close(values, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(boot, want_boot, atol=1e-6, rtol=0)


def _tight(b: Batch, rows: list[int]) -> Batch:
    """Rows ``rows`` of ``b`` as their own call, padded only to their own widths (nothing left to cut)."""
    return trim_padding(b.index(rows))


@pytest.mark.parametrize(
    ("function", "args"),
    [
        ("ppo_actor", {}),
        ("ppo_actor", {"agg": "seq-mean-token-sum-norm", "kl_loss_coef": 0.1, "entropy_coef": 0.01}),
        ("ppo_critic", {}),
        ("grpo_actor", {}),
    ],
)
def test_train_step_equals_the_uncut_step(
    function: str, args: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Same two micro-batches, cut and uncut (the reference patches the cut out of this test's process
    # only): micro-batch 0 runs on 2 + 5 columns instead of 6 + 9; same loss, metrics and update.
    cut, cut_ctx, cut_seen = _run(function, 2, _batch(), **args)
    with monkeypatch.context() as patch:
        patch.setattr(train, "trim_padding", lambda b: b)
        ref, ref_ctx, ref_seen = _run(function, 2, _batch(), **args)
    assert set(ref_seen) == {(2, P + R)} and cut_seen[-2:] == [(2, 7), (2, P + R)]
    assert ref.metrics.keys() == cut.metrics.keys()
    for key, value in ref.metrics.items():
        assert cut.metrics[key] == pytest.approx(value, abs=1e-6), key
    assert ref_ctx.model is not None and cut_ctx.model is not None
    for a, b in zip(ref_ctx.model.module.parameters(), cut_ctx.model.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert ref.tokens == cut.tokens


def test_inference_outputs_equal_a_call_of_only_the_short_rows() -> None:
    # the short rows alone (a tight call of 2 + 5 columns) give the same log-probs as inside the wide call
    wide, _, _ = _run("logprobs", 2, _batch())
    short, _, seen = _run("logprobs", 1, _tight(_batch(), [0, 1]))
    assert seen == [(2, 7)]
    torch.testing.assert_close(wide.outputs["logprobs"][:2, :5], short.outputs["logprobs"], atol=1e-6, rtol=0)
    assert not wide.outputs["logprobs"][:2, 5:].any()  # padded back with the masked value, 0
