"""The optimisation loop shared by every train node: epochs × mini-batches × micro-batches.

One call of :func:`optimize` runs ``epochs`` passes over a node's batch; each pass splits the rows into
``mini_batches`` mini-batches (one optimizer step each; equal, or the sizes a data-parallel runtime gives
in ``ctx.mini_batch_rows``) and each mini-batch into ``micro_batches`` micro-batches (gradient
accumulation; sizes differ by at most one row), whose forwards and backwards run in the order
``ctx.train_hooks.micro_batch_order`` gives (one after another; a pipeline stage's 1F1B schedule: every
order backpropagates in micro-batch order, so the gradients are the same). Gradients are
*token-weighted*: the loss function receives the mini-batch's global normaliser
(:func:`rlflow.nodes.rl.loss_normalizer`, summed over data-parallel ranks by ``ctx.train_hooks``), so the
accumulated gradient equals the gradient of the whole mini-batch's loss for every micro-batch split and
every split over ranks (tested).

With ``ctx.node.recompute`` every decoder layer recomputes its activations in the backward
(:func:`recompute_activations`).

With ``ctx.node.max_tokens_per_micro_batch`` (a token budget) the micro-batches are cut by tokens instead of
the plan's ``m`` (:func:`rlflow.nodes.token_budget.budget_micro_batches`: balanced, rows whole, as many on
every data-parallel rank) and every forward runs packed (:func:`rlflow.nodes.forward.packed_forwards`): no
padding token is computed, and losses, gradients and outputs equal the padded path's within float rounding.

Each micro-batch is cut to the token columns its own rows use (:func:`rlflow.dataflow.batch.trim_padding`):
its forward and backward cost its longest prompt and response, not the call's (the remove-padding of
verl/OpenRLHF). Losses keep their maths: normalisers come from masks and from the call's width
(``norm_length``), never from a micro-batch's; :func:`no_grad_forward` pads its outputs back to the call's
width.

Also builds AdamW (Loshchilov & Hutter 2019) and its learning-rate schedule (linear warm-up, then constant,
linear or cosine decay to ``min_lr_ratio · lr``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.batch import Batch, trim_padding
from rlflow.dataflow.errors import ModelError, NodeError
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.forward import packed_forwards
from rlflow.nodes.moe import router_stats
from rlflow.nodes.rl import loss_normalizer
from rlflow.nodes.token_budget import MicroBatch, budget_micro_batches

__all__ = [
    "LossFn",
    "build_optimizer",
    "lr_lambda",
    "micro_batches",
    "mini_batches",
    "node_micro_batches",
    "optimize",
    "recompute_activations",
]

# loss_fn(module, micro_batch, global_normalizer) -> (loss to backpropagate, metrics, metric weight)
LossFn = Callable[[nn.Module, Batch, float], tuple[torch.Tensor, dict[str, float], float]]


def lr_lambda(spec: OptimizerSpec, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR after ``step`` optimizer steps.

    Linear warm-up over ``warmup_steps`` (from ``1/(warmup+1)``), then ``constant`` (1), ``linear`` or
    ``cosine`` decay from 1 to ``min_lr_ratio`` at ``total_steps``.
    """
    warmup = spec.warmup_steps
    floor = spec.min_lr_ratio

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if spec.schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if spec.schedule == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def build_optimizer(
    module: nn.Module, spec: OptimizerSpec, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters of ``module`` and a ``LambdaLR`` schedule (:func:`lr_lambda`).

    torch's fused kernel is used where every parameter is a plain floating-point tensor on CPU or CUDA: on
    CPU it steps a 124M-parameter model about 6x faster than the default per-parameter loop (same update up
    to rounding; ``bench/bench_optimizer.py``). Sharded parameters (DTensor: FSDP2, tensor parallel) keep
    the default, as torch 2.13's fused kernel refuses a mix of DTensor and plain state tensors.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    fused = bool(params) and all(
        type(p) is nn.Parameter and p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params
    )
    optimizer = torch.optim.AdamW(
        params,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        fused=fused or None,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec, total_steps))
    return optimizer, scheduler


def _cut(batch: Batch, sizes: list[int] | tuple[int, ...]) -> list[Batch]:
    bounds = [0, *itertools.accumulate(int(n) for n in sizes)]
    return [batch.index(list(range(a, b))) for a, b in itertools.pairwise(bounds)]


def mini_batches(ctx: NodeContext, batch: Batch) -> list[Batch]:
    """The node's mini-batches of ``batch``, rows in order: sizes ``ctx.mini_batch_rows`` when set (a
    data-parallel share balanced by tokens), else ``ctx.node.mini_batches`` equal parts.

    Raises:
        DataError: the rows do not divide into equal mini-batches.
        ValueError: ``ctx.mini_batch_rows`` does not add up to the batch's rows.
    """
    sizes = ctx.mini_batch_rows
    if sizes is None:
        return batch.split(ctx.node.mini_batches)
    if sum(sizes) != len(batch):
        raise ValueError(f"mini-batch sizes {list(sizes)} do not add up to the batch's {len(batch)} rows")
    return _cut(batch, sizes)


def micro_batches(batch: Batch, m: int) -> list[Batch]:
    """``min(m, rows)`` consecutive micro-batches whose sizes differ by at most one row (``m`` equal ones
    when ``m`` divides the rows). Every data-parallel rank with at least ``m`` rows gets exactly ``m``
    parts: FSDP2 needs the same number of forward/backward passes on every rank. Each part is cut to the
    prompt and response columns its own rows use (:func:`rlflow.dataflow.batch.trim_padding`)."""
    m = max(1, min(int(m), len(batch)))
    q, r = divmod(len(batch), m)
    return [trim_padding(part) for part in _cut(batch, [q + (1 if i < r else 0) for i in range(m)])]


def node_micro_batches(ctx: NodeContext, batch: Batch) -> list[MicroBatch]:
    """The micro-batches of mini-batch ``batch`` a node runs: by its token budget
    (:func:`~rlflow.nodes.token_budget.budget_micro_batches`) when ``ctx.node.max_tokens_per_micro_batch``
    is set, else the plan's ``ctx.micro_batches`` consecutive parts (:func:`micro_batches`)."""
    if ctx.node.max_tokens_per_micro_batch is not None:
        return budget_micro_batches(ctx, batch)
    m = max(1, min(int(ctx.micro_batches), len(batch)))
    q, r = divmod(len(batch), m)
    bounds = [0, *itertools.accumulate(q + (1 if i < r else 0) for i in range(m))]
    parts = micro_batches(batch, ctx.micro_batches)
    return [
        MicroBatch(p, list(range(a, b))) for p, (a, b) in zip(parts, itertools.pairwise(bounds), strict=True)
    ]


def _checkpointed(
    forward: Callable[..., Any], *args: Any, rlflow_context: Callable[[], Any] | None = None, **kwargs: Any
) -> Any:
    # rlflow_context: torch's context_fn (a forward's context and its recomputation's, made at the forward)
    ckpt = torch.utils.checkpoint
    context = rlflow_context or ckpt.noop_context_fn  # torch's default
    return ckpt.checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


@contextlib.contextmanager
def recompute_activations(
    module: nn.Module, on: bool = True, context_fn: Callable[[], Any] | None = None
) -> Iterator[int]:
    """While open (``on``), every decoder layer of ``module`` keeps only its inputs in the forward and reruns
    its forward in the backward: full activation recomputation (gradient checkpointing; Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost"; Korthikanti et al. 2022 §4): per micro-batch a layer's
    stored activations drop to its input for one more forward of compute.
    Decoder layers are the modules Hugging Face marks as checkpointable (``GradientCheckpointingLayer``);
    transformers' own switch is not used because it acts only in training mode, and rlflow trains in eval
    mode (no dropout). Non-reentrant ``torch.utils.checkpoint`` (the RNG state is replayed), so the loss and
    gradients equal those without recomputation; wrapping each layer's ``forward`` (inside its FSDP2 unit's
    hooks) is the order torchtitan applies activation checkpointing and FSDP2 in. ``context_fn``: torch's
    ``checkpoint`` argument, called at each layer's forward for a context of that forward and one its
    recomputation runs in (:meth:`rlflow.nodes.moe.RouterStats.recompute_context`: the forward's padding
    mask, whatever forwards came between).

    Yields:
        the number of layers wrapped (0 when ``on`` is false).

    Raises:
        ModelError: ``on`` and ``module`` has no decoder layer to recompute.
    """
    if not on:
        yield 0
        return
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in module.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ModelError(
            f"recompute: {type(module).__name__} has no decoder layer that supports activation recomputation "
            "(a transformers GradientCheckpointingLayer)"
        )
    own = [layer.__dict__.get("forward") for layer in layers]  # a forward set on the instance, kept
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, layer.forward, rlflow_context=context_fn)  # type: ignore[method-assign]
    try:
        yield len(layers)
    finally:
        for layer, forward in zip(layers, own, strict=True):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward  # type: ignore[method-assign]


def _weighted_mean(acc: dict[str, tuple[float, float]]) -> dict[str, float]:
    return {k: (s / w if w > 0 else 0.0) for k, (s, w) in acc.items()}


def optimize(
    ctx: NodeContext,
    batch: Batch,
    loss_fn: LossFn,
    *,
    prefix: str,
    mask_key: str = "response_mask",
    agg: str = "token-mean",
    router_aux_loss_coef: float = 0.0,
) -> dict[str, float]:
    """Run ``epochs × mini_batches`` optimizer steps of ``loss_fn`` on ``batch``; returns mean metrics.

    Args:
        ctx: node context; its model must be trainable (optimizer set). ``ctx.node.epochs`` and
            ``ctx.node.mini_batches`` and ``ctx.micro_batches`` set the loop.
        batch: the node's rows (this rank's share of them on a data-parallel mesh).
        loss_fn: ``(module, micro_batch, global_normalizer) -> (loss, metrics, weight)``; the loss must be
            normalised by ``global_normalizer`` (sum over micro-batches = the mini-batch loss).
        prefix: metric prefix (``actor``, ``critic``).
        mask_key: the key whose mask defines trainable tokens for the normaliser.
        agg: loss aggregation mode, for the normaliser.

    Rows are taken in order (no shuffle), so a mini-batch holds whole GRPO/RLOO groups whenever its size is
    a multiple of the group size (the graph validator checks that). The module runs in eval mode: dropout
    stays off so the trainer's log-probs match the sampler's and the first pass (Ziegler et al. 2019 and
    most RLHF systems disable dropout for the policy).

    Returns:
        metrics ``{prefix}/…`` averaged over micro-batches (weighted), plus ``{prefix}/grad_norm`` and
        ``{prefix}/lr`` of the last step.

    With ``ctx.node.recompute`` the model's decoder layers recompute their activations in the backward
    (:func:`recompute_activations`). With ``ctx.node.max_tokens_per_micro_batch`` the micro-batches are cut
    by tokens and run packed (:func:`node_micro_batches`); a filler micro-batch's loss is multiplied by 0.

    A mixture-of-experts model's routers are watched (:func:`rlflow.nodes.moe.router_stats`): the metrics
    ``moe/aux_loss`` and ``moe/expert_load_max|min``, and with ``router_aux_loss_coef`` > 0 the
    load-balancing loss, weighted ``router_aux_loss_coef / (micro-batches × data-parallel ranks)`` per
    micro-batch (the mean over them), its gradient added in the backward of each MoE block.

    Raises:
        RuntimeError: if a loss or gradient norm is not finite (the step is not applied).
        ValueError: ``router_aux_loss_coef`` > 0 for a model without a load-balancing loss.
    """
    state = ctx.model
    assert state is not None and state.optimizer is not None and state.scheduler is not None
    module, optimizer, scheduler = state.module, state.optimizer, state.scheduler
    spec = state.optimizer_spec or OptimizerSpec()
    params = [p for p in module.parameters() if p.requires_grad]
    module.eval()
    acc: dict[str, tuple[float, float]] = {}
    grad_norms: list[float] = []
    packed = ctx.node.max_tokens_per_micro_batch is not None
    with (
        router_stats(module, router_aux_loss_coef, ctx.train_hooks.stage_sum) as routers,
        recompute_activations(
            module, ctx.node.recompute is True, routers.recompute_context if routers is not None else None
        ),
        packed_forwards(packed),
    ):
        for _epoch in range(ctx.node.epochs):
            for mini in mini_batches(ctx, batch):
                # tokens (or rows, for a loss without a mask) of the whole global mini-batch over all ranks
                local = loss_normalizer(mini.tensor(mask_key), agg) if mask_key in mini else len(mini)
                normalizer = ctx.train_hooks.global_count(float(local))
                optimizer.zero_grad(set_to_none=True)
                micros = node_micro_batches(ctx, mini)
                order = ctx.train_hooks.micro_batch_order(len(micros))
                last = max(i for i, (op, _) in enumerate(order) if op == "B")
                if routers is not None and routers.coef > 0:  # the mean over micro-batches and dp ranks
                    ranks = ctx.train_hooks.global_count(1.0)
                    share = routers.coef / max(1.0, ranks * sum(not m.filler for m in micros))
                losses: dict[int, torch.Tensor] = {}  # forwarded, not yet backpropagated (activations alive)
                for i, (op, k) in enumerate(order):
                    ctx.train_hooks.begin(op, k)
                    if routers is not None:  # a backward's recomputed forwards are not counted twice
                        routers.counting = op == "F" and not micros[k].filler
                        routers.scale = 0.0 if routers.coef == 0 or micros[k].filler else share
                    if op == "B":
                        ctx.train_hooks.backward(losses.pop(k), last=i == last)
                        ctx.train_hooks.end(op, k)
                        continue
                    loss, metrics, weight = loss_fn(module, micros[k].batch, max(normalizer, 1.0))
                    if not ctx.train_hooks.loss_is_finite(loss):
                        raise RuntimeError(f"non-finite loss {loss.item()} in node '{ctx.node.name}'")
                    losses[k] = loss * 0.0 if micros[k].filler else loss  # a filler adds no gradient
                    ctx.train_hooks.end(op, k)
                    if micros[k].filler:
                        continue
                    for name, v in metrics.items():
                        s, w = acc.get(name, (0.0, 0.0))
                        acc[name] = (s + float(v) * weight, w + weight)
                max_norm = spec.grad_clip if spec.grad_clip > 0 else math.inf
                norm = ctx.train_hooks.step(params, optimizer, scheduler, max_norm)
                if not torch.isfinite(norm):  # the step was not applied
                    raise RuntimeError(f"non-finite gradient norm in node '{ctx.node.name}'")
                grad_norms.append(float(norm))
                state.version += 1
        moe = routers.metrics(ctx.train_hooks.all_sum) if routers is not None else {}
    out = {f"{prefix}/{k}": v for k, v in _weighted_mean(acc).items()}
    out.update(moe)
    out[f"{prefix}/grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
    out[f"{prefix}/lr"] = float(scheduler.get_last_lr()[0])
    return out


def _pad_response(out: Any, width: int | None, micro: Batch) -> Any:
    """``out`` ``[b, r + k, ...]`` (response-aligned, ``r`` the micro-batch's cut response width) padded with
    0 on the right to ``[b, width + k, ...]``; per-row outputs ``[b]`` and other values unchanged."""
    if width is None or not isinstance(out, torch.Tensor) or out.dim() < 2:
        return out
    extra = width - int(micro.tensor("response_mask").shape[1])
    if extra == 0:
        return out
    pad = torch.zeros((out.shape[0], extra, *out.shape[2:]), dtype=out.dtype, device=out.device)
    return torch.cat([out, pad], dim=1)


def no_grad_forward(ctx: NodeContext, batch: Batch, fn: Callable[[nn.Module, Batch], Any]) -> list[Any]:
    """Run ``fn(module, micro_batch)`` under ``torch.no_grad`` over the node's micro-batches (eval mode).

    Micro-batches are cut to the columns their rows use (:func:`node_micro_batches`); a tensor ``fn`` returns
    with a second dim is response-aligned (``[b, r + k]``: log-probs ``k = 0``, values with the state after
    the last token ``k = 1``) and comes back padded with 0 to the call's response width (``[b, R + k]``), the
    value masked-out positions held before the cut, so callers see the shapes and values of an uncut
    forward. With a token budget the forwards run packed and the micro-batches are not consecutive rows: the
    outputs come back as one tensor in row order (fillers dropped), so ``torch.cat`` of the list is the
    batch's in both cases.

    Raises:
        NodeError: with a token budget, ``fn`` returned something other than a tensor with a row dim.
    """
    state: ModelState | None = ctx.model
    assert state is not None
    module = state.module
    module.eval()
    mask = batch.get("response_mask")
    width = int(mask.shape[1]) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    packed = ctx.node.max_tokens_per_micro_batch is not None
    with torch.no_grad(), packed_forwards(packed):
        micros = node_micro_batches(ctx, batch)
        outs = [_pad_response(fn(module, m.batch), width, m.batch) for m in micros]
    if not packed:
        return outs
    kept = [(m, out) for m, out in zip(micros, outs, strict=True) if not m.filler]
    if not all(isinstance(out, torch.Tensor) and out.dim() >= 1 for _, out in kept):
        raise NodeError(f"node '{ctx.node.name}': a token-budget forward must return a tensor per row")
    rows = torch.tensor([r for m, _ in kept for r in m.rows], dtype=torch.int64)
    joined = torch.cat([out for _, out in kept])
    return [joined.index_select(0, torch.argsort(rows).to(joined.device))]
