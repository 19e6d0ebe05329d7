"""The ``generate`` node function: ``n`` sampled responses per prompt, from the built-in decode loop or the
runtime's vLLM engine, in one call or in segments (interruptible generation); and the engine's weight sync
that every engine-served generate function runs first (:func:`engine_sync`)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.args import ENABLE_SLEEP_MODE, GPU_MEMORY_UTILIZATION, SAMPLING_ARGS, Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.registry import node_function
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.functions.common import node_model, stop_token_ids
from rlflow.nodes.generation import generate, truncated_rows
from rlflow.nodes.moe_routes import PROMPT_ROUTES, RESPONSE_ROUTES, ROUTES_NEED, RouteRecorder
from rlflow.nodes.partial import PartialRollout
from rlflow.nodes.tokenizers import TokenizerInfo

__all__ = ["engine_sync", "generate_node"]


@node_function(
    "generate",
    "generate",
    inputs=("prompt_ids", "prompt_mask"),
    outputs=(
        "response_ids",
        "response_mask",
        "logprobs",
        "truncated",
        "weight_version",
        "token_weight_version",
        RESPONSE_ROUTES,
        PROMPT_ROUTES,
    ),
    optional_outputs=("truncated", "weight_version", "token_weight_version", RESPONSE_ROUTES, PROMPT_ROUTES),
    heads=("lm",),
    args=(
        *SAMPLING_ARGS,
        Arg("greedy", bool, False, "take the argmax (log-probs of the unprocessed logits)"),
        Arg(
            "stop_tokens",
            list,
            None,
            "extra tokens (ids or vocabulary strings) ending a response; EOS always does (null: none)",
            optional=True,
        ),
        GPU_MEMORY_UTILIZATION,
        ENABLE_SLEEP_MODE,
        Arg(
            "record_routes",
            bool,
            False,
            "record each token's experts (MoE models, built-in engine) as outputs routed_experts [B,R,Y,K] "
            "and prompt_routed_experts [B,S,Y,K], for a train node's route_replay",
            "Ma et al. 2025 (R3), arXiv 2510.11370",
            model_types=ROUTES_NEED,
        ),
    ),
)
def generate_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    n: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    max_new_tokens: int,
    greedy: bool,
    stop_tokens: list[Any] | None,
    gpu_memory_utilization: float | None,
    enable_sleep_mode: bool,
    record_routes: bool,
) -> NodeResult:
    """Sample ``n`` responses per prompt (``P`` prompts in, ``B = P·n`` rows out): tokens, mask, sampler
    log-probs ``[B,R]``, truncation ``[B]``, weight version ``[B]``, per-token weight version ``[B,R]``.

    ``truncated`` is int64 0/1: 1 for a response cut at ``max_new_tokens`` without a stop token
    (:func:`rlflow.nodes.generation.truncated_rows`). ``weight_version`` is int64: the version (optimizer
    steps) of the weights that sampled each response, which with ``staleness`` >= 1 may be older than the
    train node's (asynchronous RL); also reported as ``rollout/weight_version``. ``token_weight_version``
    (int64) is the version of each token: all the row's version, except under interruptible generation
    (``interrupt_every``: the runtime calls the node once per segment, ``ctx.segment``;
    :mod:`rlflow.nodes.partial`), where a response continues under newer weights and
    ``weight_version`` is the *oldest* version among its tokens (``rollout/weight_version``: the oldest
    of the batch; ``rollout/token_weight_version_mean`` the mean over response tokens;
    ``rollout/interrupted_ratio`` the share of responses with tokens of several versions). A node with
    ``engine: vllm`` (or ``auto`` that the plan resolved to it: ``ctx.node`` is the runtime's
    ``Graph.run_node``) samples with the vLLM engine the runtime started for this rank (``ctx.engine``; at
    tp > 1 the tp group's one engine, called collectively by every rank of the group),
    after bringing it to the model's current weights (:func:`engine_sync`: adds
    ``perf/weight_sync_bytes/<node>``, ``timing_s/weight_sync/<node>`` and ``timing_s/weight_verify/<node>``
    when it loaded new weights); the built-in loop otherwise. Where the run allows restarts
    (``run.max_restarts`` > 0) an engine whose processes die is restarted in place and the call retried
    (:mod:`rlflow.nodes.engines.engine_restart`); ``faults/engine_restarts`` counts those restarts
    (cumulative, summed over the node's dp ranks). ``gpu_memory_utilization`` sizes that engine
    (its share of the device's memory; ``rlflow.nodes.engines.sizing``): the runtime reads it when it
    starts the engine, so this function does not. With ``enable_sleep_mode`` (which the runtime also reads
    when it starts the engine) the engine sleeps once the call's responses are in
    (:meth:`~rlflow.nodes.engines.vllm_engine.VllmEngine.sleep`) and wakes for the next weight load or
    call. With ``record_routes`` (built-in engine, a mixture-of-experts model) the experts every MoE layer
    routed each token to are outputs too: ``routed_experts`` ``[B,R,Y,K]`` and ``prompt_routed_experts``
    ``[B,S,Y,K]`` int32, -1 where nothing was recorded (:mod:`rlflow.nodes.moe_routes`).
    """
    module = node_model(ctx)
    assert ctx.model is not None
    info = TokenizerInfo.from_tokenizer(ctx.model.tokenizer)
    stop = stop_token_ids(ctx, stop_tokens)
    metrics: dict[str, float] = {}
    routes: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if record_routes else None
    if record_routes and (
        ctx.node.engine == "vllm" or (ctx.segment is not None and ctx.node.interrupt_every)
    ):
        raise NodeError(f"node '{ctx.node.name}': record_routes runs on the built-in engine, in one call")

    def sample(
        prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows_n: int, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if ctx.node.engine == "vllm":
            if ctx.engine is None:
                raise NodeError(f"node '{ctx.node.name}': engine vllm was not started by the runtime")
            metrics.update(engine_sync(ctx))
            out = ctx.engine.generate(
                prompt_ids,
                prompt_mask,
                n=rows_n,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                max_new_tokens=budget,
                greedy=greedy,
                stop_token_ids=sorted({info.eos_id, *stop}),
                pad_id=info.pad_id,
                generator=ctx.generator,
            )
            if ctx.engine.restarts is not None:  # restarts in place allowed (engine_restart)
                metrics["faults/engine_restarts"] = float(ctx.engine.restarts)
            if enable_sleep_mode:  # the device's memory is the colocated nodes' until the next call
                ctx.engine.sleep()
            return out  # type: ignore[no-any-return]
        prompts = Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask})
        return _builtin_generate(
            ctx, module, info, prompts, rows_n, temperature, top_p, top_k, budget, greedy, stop, routes
        )

    if ctx.segment is not None and ctx.node.interrupt_every:
        return _generate_segment(ctx, batch, sample, info, stop, n, max_new_tokens, metrics)
    ids, mask, lp = sample(batch.tensor("prompt_ids"), batch.tensor("prompt_mask"), n, max_new_tokens)
    truncated = truncated_rows(ids, mask, [info.eos_id, *stop], max_new_tokens)
    lengths = mask.sum(-1).float()
    tokens = int(batch.tensor("prompt_mask").sum()) * n + int(mask.sum())
    metrics.update(
        {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
            "response_length/truncated_ratio": float(truncated.float().mean()),
        }
    )
    metrics["rollout/weight_version"] = float(ctx.model.version)
    version = torch.full((ids.shape[0],), ctx.model.version, dtype=torch.long, device=ids.device)
    outputs = {
        "response_ids": ids,
        "response_mask": mask,
        "logprobs": lp,
        "truncated": truncated,
        "weight_version": version,
        "token_weight_version": version[:, None].expand_as(ids).clone(),
    }
    if routes is not None:
        outputs[PROMPT_ROUTES] = torch.cat([p for p, _ in routes])
        outputs[RESPONSE_ROUTES] = torch.cat([r for _, r in routes])
    return NodeResult(outputs, metrics, tokens)


def _generate_segment(
    ctx: NodeContext,
    batch: Batch,
    sample: Any,
    info: TokenizerInfo,
    stop: list[int],
    n: int,
    max_new_tokens: int,
    metrics: dict[str, float],
) -> NodeResult:
    """Segment ``j`` of ``segments`` (``ctx.segment``) of an interruptible generate node's iteration: at most
    ``interrupt_every`` new tokens for every unfinished response, under the weights this rank holds now.
    Segment 0 reads the prompts from ``batch``; later ones continue the state kept in ``ctx.partial``. The
    last returns the generate node's outputs (earlier ones: none) with each token's version."""
    assert ctx.model is not None and ctx.segment is not None
    j, segments = ctx.segment
    k = ctx.iteration
    tokens = 0
    if j == 0:
        state = PartialRollout.start(
            batch.tensor("prompt_ids"), batch.tensor("prompt_mask"), n, ctx.model.version
        )
        ctx.partial[k] = state
        tokens = int(batch.tensor("prompt_mask").sum()) * n
    else:
        if k not in ctx.partial:
            raise NodeError(
                f"node '{ctx.node.name}': segment {j} of iteration {k} has no earlier segment on this rank"
            )
        state = ctx.partial[k]
    every = ctx.node.interrupt_every
    budget = min(every, max_new_tokens - j * every)
    rows, ids, mask = state.continuation(info.pad_id, ctx.device)
    # expert parallel: a rank without rows still samples (nothing), in lockstep with its ep group
    if budget > 0 and (rows or ctx.keep_going is not None):
        new_ids, new_mask, new_lp = sample(ids, mask, 1, budget)
        if rows:
            stops = [info.eos_id, *stop]
            tokens += state.extend(
                rows, new_ids, new_mask, new_lp, ctx.model.version, budget, max_new_tokens, stops
            )
    if j < segments - 1:
        return NodeResult({}, metrics, tokens)
    del ctx.partial[k]
    out_ids, out_mask, lp, token_versions, oldest = state.tensors(max_new_tokens, info.pad_id, ctx.device)
    truncated = truncated_rows(out_ids, out_mask, [info.eos_id, *stop], max_new_tokens)
    lengths = out_mask.sum(-1).float()
    real = out_mask.bool()
    versions_per_row = [set(v) for v in state.versions]
    metrics.update(
        {
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float((lengths >= max_new_tokens).float().mean()),
            "response_length/truncated_ratio": float(truncated.float().mean()),
            "rollout/weight_version": float(oldest.min()),
            "rollout/token_weight_version_mean": (
                float(token_versions[real].float().mean()) if bool(real.any()) else float(oldest.min())
            ),
            "rollout/interrupted_ratio": sum(len(v) > 1 for v in versions_per_row)
            / max(1, len(versions_per_row)),
        }
    )
    outputs = {
        "response_ids": out_ids,
        "response_mask": out_mask,
        "logprobs": lp,
        "truncated": truncated,
        "weight_version": oldest,
        "token_weight_version": token_versions,
    }
    return NodeResult(outputs, metrics, tokens)


def engine_sync(ctx: NodeContext) -> dict[str, float]:
    """Bring the node's engine to the model's current weight version (load + verify) when it is behind.

    The weights are the model instance's own tensors on this rank, i.e. what the runtime's weight sync
    (single process: the shared module; distributed: the planned reallocation) has just written. The
    distributed runtime may already have streamed them into the engine during its weight sync
    (:mod:`rlflow.schedulers.runtime.distributed.stream_sync`); the engine is then current and this
    reports that sync's figures (``engine.streamed``) once.

    Returns:
        ``perf/weight_sync_bytes/<node>`` (bytes loaded into the engine), ``timing_s/weight_sync/<node>``
        (seconds: load + prefix-cache reset + verification; a streamed sync's load overlaps the
        reallocation and the trainer's probe forward), ``timing_s/weight_verify/<node>`` (seconds of the
        checks alone: digests of the engine's tensors, the empty prefix cache, and the probe where it runs:
        :mod:`rlflow.nodes.engines.sync_check`) and, where the probe ran (the engine's first reload),
        ``rollout/engine_probe_gap/<node>`` (nats); ``{}`` when the engine is current and nothing is left
        to report.

    Raises:
        WeightSyncError: the engine does not serve the new weights (names node, model, version).
    """
    assert ctx.model is not None and ctx.engine is not None
    version = ctx.model.version
    if ctx.engine.weight_version == version:
        stats, ctx.engine.streamed = ctx.engine.streamed, None
        if stats is None:
            return {}
    else:
        stats = ctx.engine.sync(ctx.model.module, model=ctx.model.name, version=version)
    node = ctx.node.name
    metrics = {
        f"perf/weight_sync_bytes/{node}": float(stats.bytes),
        f"timing_s/weight_sync/{node}": stats.seconds + stats.verify_seconds,
        f"timing_s/weight_verify/{node}": stats.verify_seconds,
    }
    if stats.probe_gap is not None:
        metrics[f"rollout/engine_probe_gap/{node}"] = stats.probe_gap
    return metrics


def _builtin_generate(
    ctx: NodeContext,
    module: nn.Module,
    info: TokenizerInfo,
    batch: Batch,
    n: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    max_new_tokens: int,
    greedy: bool,
    stop: list[int],
    routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The built-in decode loop (:func:`rlflow.nodes.generation.generate`) over the layout's micro-batches;
    with ``routes`` (a list) each micro-batch's recorded (prompt, response) routes are appended to it."""
    module.eval()
    count = ctx.micro_batches if len(batch) % max(1, ctx.micro_batches) == 0 else 1
    micros = batch.split(count) if len(batch) else []
    parts = []
    k = 0

    def more() -> bool:  # expert parallel: out of micro-batches, a rank runs empty ones while its group runs
        return k < len(micros) if ctx.keep_going is None else ctx.keep_going(k >= len(micros))

    while more():
        micro = micros[k] if k < len(micros) else batch.index([])
        k += 1
        recorder = RouteRecorder(module) if routes is not None else contextlib.nullcontext()
        with recorder:
            out = generate(
                module,
                info,
                micro.tensor("prompt_ids"),
                micro.tensor("prompt_mask"),
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                max_new_tokens=max_new_tokens,
                greedy=greedy,
                stop_token_ids=stop,
                generator=ctx.generator,
                compact=routes is None,  # recording reads the uncompacted call layout
                keep_going=ctx.keep_going,
            )
        if not len(micro):
            continue
        parts.append(out)
        if isinstance(recorder, RouteRecorder) and routes is not None:
            mask = micro.tensor("prompt_mask").repeat_interleave(n, dim=0)
            routes.append(recorder.generation_routes(mask, out[1]))
    if not parts:  # no rows on this rank (a segment's finished rank): nothing sampled
        empty = batch.tensor("prompt_ids").new_zeros((0, max_new_tokens))
        return empty, empty.clone(), empty.float()
    return (
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts]),
    )
