"""The builtin node functions graph files name (``function: ppo_actor``), registered in ``NODE_FUNCTIONS``.

Each is called by the runtime as ``fn(ctx, batch, **args) -> NodeResult`` (see :mod:`rlflow.nodes.context`);
``batch`` holds the canonical inputs listed in the decorator, in the padded batch format of the contract
(prompts ``[B,P]`` left-padded, responses ``[B,R]`` right-padded with ``response_mask``).
The RL maths lives in :mod:`rlflow.nodes.rl`; this module only wires it to models and the optimisation loop.

Every function declares its arguments (:class:`rlflow.dataflow.args.Arg`: type, range or choices, default,
meaning, source); graph validation checks a node's ``args`` against them before anything runs and the
function receives every declared argument, checked, with the schema's default where the graph file leaves
it out (``rlflow functions NAME`` prints them).

Truncation convention (Pardo et al. 2018, "Time Limits in Reinforcement Learning"): a response that ends
with EOS or a stop token is *terminal* (the value after its last token is 0); one cut at ``max_new_tokens``
without a stop token is *truncated*: the episode did not end, so PPO's GAE and the critic's target
bootstrap from ``V(s_T)``, the critic's value of the state after the last generated token. ``generate``
reports ``truncated`` ``[B]`` (0/1) and ``values`` ``bootstrap_values`` ``[B]``; ``ppo_actor`` and
``ppo_critic`` read both when the graph binds them (unbound: every response is treated as terminal).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlflow.dataflow.args import ENABLE_SLEEP_MODE, GPU_MEMORY_UTILIZATION, SAMPLING_ARGS, TOP_K, TOP_P, Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.registry import ArgInput, node_function
from rlflow.nodes import rl
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.generation import decode_responses, generate, truncated_rows
from rlflow.nodes.models import TokenizerInfo, response_logits, response_scores, response_values
from rlflow.nodes.partial import PartialRollout
from rlflow.nodes.rewards import resolve_reward, score_texts
from rlflow.nodes.rl.losses import POLICY_LOSS_DEFAULTS
from rlflow.nodes.train import no_grad_forward, optimize

SEQ = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
PAIR = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")


def _model(ctx: NodeContext) -> nn.Module:
    if ctx.model is None:
        raise NodeError(f"node '{ctx.node.name}': function '{ctx.node.function}' needs a model")
    return ctx.model.module


def _seq(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(prompt_ids, prompt_mask, response_ids, response_mask)`` of a batch in the padded format."""
    return (
        b.tensor("prompt_ids"),
        b.tensor("prompt_mask"),
        b.tensor("response_ids"),
        b.tensor("response_mask"),
    )


def _seq_tokens(batch: Batch, resp_key: str = "response_mask") -> int:
    return int(batch.tensor("prompt_mask").sum()) + int(batch.tensor(resp_key).sum())


def _stop_ids(ctx: NodeContext, stop_tokens: Any) -> list[int]:
    """The ids of ``args.stop_tokens`` (ids, or vocabulary strings resolved with the model's tokenizer).

    Graph validation (:mod:`rlflow.dataflow.sampling`) holds ids to the configured vocabulary when the
    config is known before the model is built; this holds every id to the built model's ``vocab_size``.

    Raises:
        NodeError: a string the tokenizer does not know, or an id outside ``0 .. vocab_size - 1`` (the
            sampler can never produce it, so it would never end a response); names node, key and model.
    """
    ids: list[int] = []
    for tok in stop_tokens or ():
        if isinstance(tok, int):
            ids.append(tok)
            continue
        tid = ctx.model.tokenizer.convert_tokens_to_ids(str(tok)) if ctx.model else None
        if tid is None or tid == getattr(ctx.model.tokenizer if ctx.model else None, "unk_token_id", -1):
            raise NodeError(
                f"node '{ctx.node.name}': stop token {tok!r} is not in the tokenizer's vocabulary"
            )
        ids.append(int(tid))
    vocab = getattr(getattr(ctx.model.module, "config", None), "vocab_size", None) if ctx.model else None
    for tok, tid in zip(stop_tokens or (), ids, strict=True):
        where = f"node '{ctx.node.name}': args.stop_tokens: stop token {tok!r}" + (
            "" if tok == tid else f" (id {tid})"
        )
        if tid < 0:
            raise NodeError(f"{where} is negative; token ids start at 0")
        if isinstance(vocab, int) and tid >= vocab:
            raise NodeError(
                f"{where} is outside the vocabulary of model '{ctx.model.name if ctx.model else ''}' "
                f"(vocab_size {vocab}: ids 0..{vocab - 1}); it can never be generated, so it would never "
                "end a response"
            )
    return ids


def _logprobs_and_entropy(
    module: nn.Module,
    b: Batch,
    ids_key: str = "response_ids",
    mask_key: str = "response_mask",
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Label log-probs ``[B,R]`` (and optionally entropies ``[B,R]``) of the response tokens."""
    logits = response_logits(
        module, b.tensor("prompt_ids"), b.tensor("prompt_mask"), b.tensor(ids_key), b.tensor(mask_key)
    ).float()
    lp = rl.label_logprobs(logits, b.tensor(ids_key), b.tensor(mask_key), temperature, top_k, top_p)
    ent = rl.entropy_from_logits(logits, b.tensor(mask_key), temperature, top_k, top_p) if entropy else None
    return lp, ent


# ------------------------------------------------------------------------------------------------
# argument schemas shared by several functions


def _processing_args(what: str) -> tuple[Arg, ...]:
    """``temperature``, ``top_k``, ``top_p`` of logits processing (:func:`rlflow.nodes.rl.process_logits`)."""
    return (
        Arg(
            "temperature",
            float,
            1.0,
            f"softmax temperature of {what} (match the sampler's)",
            low=0,
            low_open=True,
        ),
        TOP_K,
        TOP_P,
    )


KL_ESTIMATOR_ARG = Arg(
    "kl_estimator",
    str,
    "k1",
    "estimator of the per-token KL to the reference in the reward",
    "Schulman 2020, Approximating KL Divergence",
    choices=tuple(rl.KL_ESTIMATORS),
)


def _kl_coef_arg(default: float, where: str = "per-token KL penalty in the reward") -> Arg:
    return Arg("kl_coef", float, default, f"β of the {where} (0: off)", "Ouyang et al. 2022, eq. 2", low=0)


GAMMA_ARG = Arg(
    "gamma", float, 1.0, "discount per trainable token", "Schulman et al. 2016 (GAE)", low=0, high=1
)
GAE_ARGS = (
    GAMMA_ARG,
    Arg(
        "lam",
        float,
        0.95,
        "GAE λ (0: one-step TD, 1: Monte-Carlo)",
        "Schulman et al. 2016 (GAE)",
        low=0,
        high=1,
    ),
)
AGG_ARG = Arg(
    "agg",
    str,
    "token-mean",
    "loss aggregation over tokens and sequences (table in nodes/rl/losses.py)",
    "verl; Liu et al. 2025 (Dr. GRPO)",
    choices=rl.AGG_MODES,
)
_PPO = POLICY_LOSS_DEFAULTS["ppo"]
_MISMATCH = "Yao et al. 2025 (TIS); verl algorithm.rollout_correction"
_ON_TRAINER_PASS = ("recompute_logprobs", (True,))  # π_old must be the trainer's own, not the sampler's
_DECOUPLED = "Fu et al. 2025 (AReaL), decoupled PPO"
DECOUPLED_ARGS = (
    Arg(
        "decoupled_loss",
        bool,
        False,
        "decoupled PPO: clip against the proximal policy (input prox_logprobs, a forward of this node's "
        "model before its update, replaces the first pass) and weight each token by π_prox/π_behav "
        "(π_behav: the sampler's logprobs)",
        _DECOUPLED,
    ),
    Arg(
        "behav_imp_weight_cap",
        float,
        None,
        "tokens whose π_prox/π_behav exceeds the cap leave the policy loss (still counted in its "
        "normaliser) (null: no cap)",
        _DECOUPLED,
        low=1,
        low_open=True,
        optional=True,
        needs=("decoupled_loss", (True,)),
    ),
)
"""Decoupled PPO options of every clipped policy-gradient node (:mod:`rlflow.nodes.rl.decoupled`)."""
PROX_INPUT = ArgInput(
    "prox_logprobs",
    "decoupled_loss",
    (True,),
    "the proximal policy's log-probs [B,R]: an inference node (function: logprobs) on this node's model, "
    "upstream of it, with this node's temperature/top_k/top_p",
    own_forward=True,
)
"""The input the decoupled loss reads its π_prox from (graph validation checks it is bound and produced by an
inference node on the train node's model)."""
ROLLOUT_CORRECTION_ARGS = (
    Arg(
        "rollout_is",
        str,
        None,
        "truncated importance sampling of the sampler/trainer mismatch: each token's policy-gradient loss "
        "times min(π_old/π_rollout, rollout_is_threshold), the ratio per token or per sequence (null: off)",
        _MISMATCH,
        choices=rl.ROLLOUT_IS_LEVELS,
        optional=True,
        needs=_ON_TRAINER_PASS,
        excludes=(
            "decoupled_loss",
            (True,),
            "the decoupled loss already weights each token by π_prox/π_behav, the same ratio (cap it with "
            "behav_imp_weight_cap)",
        ),
    ),
    Arg(
        "rollout_is_threshold",
        float,
        2.0,
        "truncation C of the importance weight min(π_old/π_rollout, C)",
        _MISMATCH,
        low=1,
        needs=("rollout_is", rl.ROLLOUT_IS_LEVELS),
    ),
    Arg(
        "rollout_rs",
        str,
        None,
        "reject (mask out of the loss and its normaliser) tokens, or whole sequences, whose π_old/π_rollout "
        "ratio (per token, sequence product or geometric mean) lies outside "
        "[rollout_rs_threshold_lower, rollout_rs_threshold] (null: off)",
        "verl algorithm.rollout_correction (rejection sampling); Liu, Li et al. 2025",
        choices=rl.ROLLOUT_RS_LEVELS,
        optional=True,
        needs=_ON_TRAINER_PASS,
    ),
    Arg(
        "rollout_rs_threshold",
        float,
        2.0,
        "upper bound of the ratios rollout_rs keeps",
        "verl algorithm.rollout_correction",
        low=1,
        low_open=True,
        needs=("rollout_rs", rl.ROLLOUT_RS_LEVELS),
    ),
    Arg(
        "rollout_rs_threshold_lower",
        float,
        None,
        "lower bound of the ratios rollout_rs keeps (null: 1/rollout_rs_threshold)",
        "verl algorithm.rollout_correction",
        low=0,
        high=1,
        low_open=True,
        high_open=True,
        optional=True,
        needs=("rollout_rs", rl.ROLLOUT_RS_LEVELS),
    ),
)
"""Training/inference mismatch options of every clipped policy-gradient node
(:func:`rlflow.nodes.rl.rollout_correction.rollout_correction`); all off by default."""


def _pg_args(*, kl_loss_coef: float = 0.0, per_loss: bool = False) -> tuple[Arg, ...]:
    """Arguments of the clipped policy-gradient loop (:func:`_pg_train`). ``per_loss``: the node chooses its
    ``loss`` (ppo | gspo) and a left-out clip range or aggregation is that loss's default
    (:data:`rlflow.nodes.rl.losses.POLICY_LOSS_DEFAULTS`)."""
    defaults = "; ".join(
        f"{loss}: ε {d['clip_eps']:g}/{d['clip_eps_high'] or d['clip_eps']:g}, {d['agg']}"
        for loss, d in POLICY_LOSS_DEFAULTS.items()
    )
    if per_loss:
        clip = (
            Arg(
                "clip_eps",
                float,
                None,
                f"clip range ε of the ratio (null: the loss's default; {defaults})",
                "Schulman et al. 2017; Zheng et al. 2025 (GSPO)",
                low=0,
                high=1,
                low_open=True,
                high_open=True,
                optional=True,
            ),
            Arg(
                "clip_eps_high",
                float,
                None,
                "upper clip ε (clip-higher; null: clip_eps if given, else the loss's default)",
                "Yu et al. 2025 (DAPO)",
                low=0,
                low_open=True,
                optional=True,
            ),
            Arg(
                "agg",
                str,
                None,
                f"loss aggregation (null: the loss's default; {defaults})",
                "verl; Zheng et al. 2025 (GSPO)",
                choices=rl.AGG_MODES,
                optional=True,
            ),
        )
    else:
        clip = (
            Arg(
                "clip_eps",
                float,
                _PPO["clip_eps"],
                "clip range ε of the ratio ρ = π/π_old",
                "Schulman et al. 2017",
                low=0,
                high=1,
                low_open=True,
                high_open=True,
            ),
            Arg(
                "clip_eps_high",
                float,
                None,
                "upper clip ε (clip-higher; null: clip_eps)",
                "Yu et al. 2025 (DAPO)",
                low=0,
                low_open=True,
                optional=True,
            ),
            AGG_ARG,
        )
    return (
        *clip,
        Arg(
            "dual_clip",
            float,
            None,
            "dual-clip bound c: loss of a negative advantage at most -c·A (null: off)",
            "Ye et al. 2020",
            low=1,
            low_open=True,
            optional=True,
        ),
        Arg(
            "entropy_coef",
            float,
            0.0,
            "coefficient of the entropy bonus (0: off)",
            "Schulman et al. 2017",
            low=0,
        ),
        Arg(
            "kl_loss_coef",
            float,
            kl_loss_coef,
            "coefficient of the KL-to-reference loss term (0: off)",
            "Shao et al. 2024 (GRPO)",
            low=0,
        ),
        Arg(
            "kl_loss_type",
            str,
            "k3",
            "KL estimator of the loss term",
            "Schulman 2020",
            choices=tuple(rl.KL_ESTIMATORS),
        ),
        *_processing_args("the trainer's log-probs"),
        Arg(
            "recompute_logprobs",
            bool,
            True,
            "old log-probs from a trainer pass (true) or the sampler's (false); decoupled_loss reads them "
            "from its prox_logprobs input instead",
            needs=("decoupled_loss", (False,)),
        ),
        *DECOUPLED_ARGS,
        *ROLLOUT_CORRECTION_ARGS,
    )


PG_NAMES = tuple(a.name for a in _pg_args())

# ------------------------------------------------------------------------------------------------
# generate / inference


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
    ),
    optional_outputs=("truncated", "weight_version", "token_weight_version"),
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
) -> NodeResult:
    """Sample ``n`` responses per prompt: tokens, mask, sampler log-probs ``[B·n,R]``, truncation ``[B·n]``,
    weight version ``[B·n]``, per-token weight version ``[B·n,R]``.

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
    after bringing it to the model's current weights (:func:`_engine_sync`: adds
    ``perf/weight_sync_bytes/<node>``, ``timing_s/weight_sync/<node>`` and ``timing_s/weight_verify/<node>``
    when it loaded new weights); the built-in loop otherwise. ``gpu_memory_utilization`` sizes that engine
    (its share of the device's memory; ``rlflow.nodes.engines.sizing``): the runtime reads it when it
    starts the engine, so this function does not. With ``enable_sleep_mode`` (which the runtime also reads
    when it starts the engine) the engine sleeps once the call's responses are in
    (:meth:`~rlflow.nodes.engines.vllm_engine.VllmEngine.sleep`) and wakes for the next weight load or
    call.
    """
    module = _model(ctx)
    assert ctx.model is not None
    info = TokenizerInfo.from_tokenizer(ctx.model.tokenizer)
    stop = _stop_ids(ctx, stop_tokens)
    metrics: dict[str, float] = {}

    def sample(
        prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, rows_n: int, budget: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if ctx.node.engine == "vllm":
            if ctx.engine is None:
                raise NodeError(f"node '{ctx.node.name}': engine vllm was not started by the runtime")
            metrics.update(_engine_sync(ctx))
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
            if enable_sleep_mode:  # the device's memory is the colocated nodes' until the next call
                ctx.engine.sleep()
            return out  # type: ignore[no-any-return]
        prompts = Batch({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask})
        return _builtin_generate(
            ctx, module, info, prompts, rows_n, temperature, top_p, top_k, budget, greedy, stop
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
    if rows and budget > 0:
        new_ids, new_mask, new_lp = sample(ids, mask, 1, budget)
        tokens += state.extend(
            rows, new_ids, new_mask, new_lp, ctx.model.version, budget, max_new_tokens, [info.eos_id, *stop]
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


def _engine_sync(ctx: NodeContext) -> dict[str, float]:
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
        verification alone: the probe's forward on the trainer's model and on the engine; streamed: the
        engine's probe) and ``rollout/engine_probe_gap/<node>`` (nats); ``{}`` when the engine is current
        and nothing is left to report.

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
    return {
        f"perf/weight_sync_bytes/{node}": float(stats.bytes),
        f"timing_s/weight_sync/{node}": stats.seconds + stats.verify_seconds,
        f"timing_s/weight_verify/{node}": stats.verify_seconds,
        f"rollout/engine_probe_gap/{node}": stats.probe_gap,
    }


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The built-in decode loop (:func:`rlflow.nodes.generation.generate`) over the layout's micro-batches."""
    module.eval()
    parts = []
    for micro in batch.split(ctx.micro_batches if len(batch) % max(1, ctx.micro_batches) == 0 else 1):
        parts.append(
            generate(
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
            )
        )
    return (
        torch.cat([p[0] for p in parts]),
        torch.cat([p[1] for p in parts]),
        torch.cat([p[2] for p in parts]),
    )


LOGPROB_ARGS = _processing_args("the log-probs")


@node_function("logprobs", "inference", inputs=SEQ, outputs=("logprobs",), heads=("lm",), args=LOGPROB_ARGS)
def logprobs_node(
    ctx: NodeContext, batch: Batch, *, temperature: float, top_k: int | None, top_p: float | None
) -> NodeResult:
    """Log-probs ``[B,R]`` of the response tokens under the model (e.g. the reference policy)."""
    parts = no_grad_forward(
        ctx,
        batch,
        lambda m, b: _logprobs_and_entropy(m, b, temperature=temperature, top_k=top_k, top_p=top_p)[0],
    )
    return NodeResult({"logprobs": torch.cat(parts)}, {}, _seq_tokens(batch))


@node_function(
    "sequence_logps",
    "inference",
    inputs=SEQ,
    outputs=("logps",),
    heads=("lm",),
    args=(
        Arg(
            "average",
            bool,
            False,
            "per-token mean instead of the sum (length-normalised, as IPO)",
            "Azar et al. 2023",
        ),
    ),
)
def sequence_logps_node(ctx: NodeContext, batch: Batch, *, average: bool) -> NodeResult:
    """Per-sequence log-prob ``[B]`` (sum over response tokens, nats; ``average``: per token)."""

    def fn(m: nn.Module, b: Batch) -> torch.Tensor:
        lp, _ = _logprobs_and_entropy(m, b)
        return rl.sequence_logps(lp, b.tensor("response_mask"), average=average)

    return NodeResult({"logps": torch.cat(no_grad_forward(ctx, batch, fn))}, {}, _seq_tokens(batch))


@node_function(
    "values",
    "inference",
    inputs=SEQ,
    outputs=("values", "bootstrap_values"),
    optional_outputs=("bootstrap_values",),
    heads=("value",),
    args=(),
)
def values_node(ctx: NodeContext, batch: Batch) -> NodeResult:
    """Critic values ``[B,R]`` before each response token; ``bootstrap_values`` V(s_T) ``[B]`` after the last.

    Value ``t`` is V of the state before response token ``t``; ``bootstrap_values[b]`` is V of the state after
    row b's last trainable token (read at that token's position; what GAE bootstraps from when the row was
    truncated; 0 for an empty row).
    """
    parts = no_grad_forward(
        ctx,
        batch,
        lambda m, b: response_values(
            m,
            b.tensor("prompt_ids"),
            b.tensor("prompt_mask"),
            b.tensor("response_ids"),
            b.tensor("response_mask"),
            with_next=True,
        ),
    )
    full = torch.cat(parts).float()  # [B, R+1]: entry t is read before response token t, entry R after all
    mask = batch.tensor("response_mask")
    last, has_any = rl.last_token_index(mask)
    bootstrap = full.gather(1, (last + 1).unsqueeze(1)).squeeze(1) * has_any
    values = full[:, :-1] * mask
    mean = (
        float(rl.masked_mean(values, batch.tensor("response_mask")))
        if batch.tensor("response_mask").any()
        else 0.0
    )
    return NodeResult(
        {"values": values, "bootstrap_values": bootstrap}, {"critic/values/mean": mean}, _seq_tokens(batch)
    )


def _score_metrics(key: str, scores: torch.Tensor) -> dict[str, float]:
    name = "critic/score" if key == "scores" else key
    return {
        f"{name}/mean": float(scores.mean()),
        f"{name}/max": float(scores.max()),
        f"{name}/min": float(scores.min()),
    }


@node_function("rm_score", "inference", inputs=SEQ, outputs=("scores",), heads=("score",), args=())
def rm_score_node(ctx: NodeContext, batch: Batch) -> NodeResult:
    """Reward-model scores ``[B]`` read at the last real token of prompt + response."""
    parts = no_grad_forward(
        ctx,
        batch,
        lambda m, b: response_scores(
            m,
            b.tensor("prompt_ids"),
            b.tensor("prompt_mask"),
            b.tensor("response_ids"),
            b.tensor("response_mask"),
        ),
    )
    scores = torch.cat(parts).float()
    return NodeResult({"scores": scores}, _score_metrics("scores", scores), _seq_tokens(batch))


@node_function(
    "rule_reward",
    "inference",
    inputs=("response_ids", "response_mask", "answer"),
    outputs=("scores",),
    needs_model=False,
    args=(
        Arg(
            "fn",
            str,
            "arith_exact",
            "the rule reward: a registered name (arith_exact, math_final_answer, "
            "format_check) or a dotted path pkg.mod:fn",
        ),
    ),
    extra_args="options of the reward function, passed to it as keyword arguments (format_check: pattern)",
)
def rule_reward_node(ctx: NodeContext, batch: Batch, *, fn: str, **options: Any) -> NodeResult:
    """Scores ``[B]`` from a rule reward ``fn(response_text, answer) -> float`` (name or dotted path)."""
    if ctx.tokenizer is None:
        raise NodeError(f"node '{ctx.node.name}': rule_reward needs a tokenizer to decode responses")
    reward = resolve_reward(fn, **options)
    texts = decode_responses(ctx.tokenizer, batch.tensor("response_ids"), batch.tensor("response_mask"))
    answers = [str(a) for a in batch.list_of("answer")]
    try:
        values = score_texts(reward, texts, answers, name=fn)
    except NodeError as e:
        raise NodeError(f"node '{ctx.node.name}': {e}") from e
    scores = torch.tensor(values, dtype=torch.float32)
    return NodeResult(
        {"scores": scores}, _score_metrics("scores", scores), int(batch.tensor("response_mask").sum())
    )


# ------------------------------------------------------------------------------------------------
# policy-gradient train nodes


def _logprob_gap(old: torch.Tensor, batch: Batch) -> dict[str, float]:
    """``rollout/logprob_gap_mean|max``: |log π_old − log π_rollout| over the trainable tokens (nats).

    ~0 on-policy; a large value means a weight-sync or temperature bug, or (asynchronous RL, π_old the
    proximal policy) stale samples.
    """
    mask = batch.tensor("response_mask")
    if "logprobs" not in batch or not mask.any():
        return {}
    gap = (old - batch.tensor("logprobs")).abs().masked_fill(mask == 0, 0.0)
    return {
        "rollout/logprob_gap_mean": float(gap.sum() / mask.sum()),
        "rollout/logprob_gap_max": float(gap.max()),
    }


def _first_pass(
    ctx: NodeContext, batch: Batch, temperature: float, top_k: Any, top_p: Any
) -> tuple[torch.Tensor, dict[str, float]]:
    """Trainer log-probs before any update (PPO's old policy) and their gap to the sampler's log-probs."""
    parts = no_grad_forward(
        ctx,
        batch,
        lambda m, b: _logprobs_and_entropy(m, b, temperature=temperature, top_k=top_k, top_p=top_p)[0],
    )
    old = torch.cat(parts)
    return old, _logprob_gap(old, batch)


def _pg_train(
    ctx: NodeContext,
    batch: Batch,
    advantages: torch.Tensor,
    *,
    clip_eps: float | None,
    clip_eps_high: float | None,
    dual_clip: float | None,
    entropy_coef: float,
    kl_loss_coef: float,
    kl_loss_type: str,
    agg: str | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    recompute_logprobs: bool,
    decoupled_loss: bool,
    behav_imp_weight_cap: float | None,
    rollout_is: str | None,
    rollout_is_threshold: float,
    rollout_rs: str | None,
    rollout_rs_threshold: float,
    rollout_rs_threshold_lower: float | None,
    loss: str = "ppo",
) -> dict[str, float]:
    """Clipped policy-gradient optimisation (PPO / GSPO surrogate) of ``advantages`` ``[B,R]``.

    The old policy's log-probs come from a first no-grad pass of the trainer (``recompute_logprobs``, the
    default: it also measures the sampler/trainer gap) or, when off, from the sampler's ``logprobs``
    (saves one forward; only right when sampling is on-policy with the same logits processing).
    ``clip_eps``/``agg`` ``None``: the loss's defaults
    (:data:`rlflow.nodes.rl.losses.POLICY_LOSS_DEFAULTS`); with ``clip_eps`` ``None`` a ``None``
    ``clip_eps_high`` is the loss's default too, otherwise ``clip_eps``.

    Mismatch correction (``rollout_is``/``rollout_rs``, :data:`ROLLOUT_CORRECTION_ARGS`): π_old is the
    first pass's log-probs, π_rollout the sampler's ``logprobs``; both are fixed before the first update, so
    the weights and the loss mask are computed once for the whole batch and split with it. Rejected tokens
    leave the policy, entropy and KL terms and the global normaliser (``loss_mask``); the forward pass still
    attends to them. Metrics ``rollout/tis_weight_mean``, ``rollout/tis_clipfrac``, ``rollout/mask_frac``.

    Decoupled PPO (``decoupled_loss``, :mod:`rlflow.nodes.rl.decoupled`; Fu et al. 2025, AReaL): π_old is
    the proximal policy, read from the ``prox_logprobs`` input (a forward of this node's model in the graph,
    before this node; no first pass here), and the behaviour policy is the sampler's ``logprobs``. Each
    token's policy-gradient loss (PPO or GSPO surrogate) is weighted by the constant π_prox/π_behav, set to 0
    above ``behav_imp_weight_cap``; computed once for the batch, on the tokens ``rollout_rs`` keeps (it
    composes; ``rollout_is`` would weight by the same ratio twice and is rejected by the schema). Metrics
    ``actor/behav_imp_weight_mean|max``, ``actor/behav_imp_weight_capfrac`` (with a cap), and
    ``rollout/logprob_gap_mean|max`` between π_prox and π_behav.
    """
    defaults = POLICY_LOSS_DEFAULTS[loss]
    if clip_eps is None:
        clip_eps, high = float(defaults["clip_eps"] or 0.0), defaults["clip_eps_high"]
        clip_eps_high = (
            clip_eps_high if clip_eps_high is not None else (None if high is None else float(high))
        )
    agg = str(defaults["agg"]) if agg is None else agg
    if decoupled_loss:  # the graph's proximal forward replaces the first pass
        if "prox_logprobs" not in batch:  # graph validation binds it; a direct call may not
            raise NodeError(
                f"node '{ctx.node.name}': decoupled_loss reads input 'prox_logprobs', not in the batch"
            )
        old = batch.tensor("prox_logprobs")
        metrics = _logprob_gap(old, batch)
    elif recompute_logprobs or "logprobs" not in batch:
        old, metrics = _first_pass(ctx, batch, temperature, top_k, top_p)
    else:  # on-policy and the sampler's logits processing: its log-probs are the old policy's
        old, metrics = batch.tensor("logprobs"), {}
    work = batch.select([*SEQ, *(["ref_logprobs"] if "ref_logprobs" in batch else [])])
    work["old_logprobs"] = old
    work["advantages"] = advantages
    width = int(batch.tensor("response_ids").shape[1])
    mask_key = "response_mask"
    if rollout_is is not None or rollout_rs is not None:
        weights, loss_mask, corr = rl.rollout_correction(
            old, batch.tensor("logprobs"), batch.tensor("response_mask"),
            rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold, rollout_rs=rollout_rs,
            rollout_rs_threshold=rollout_rs_threshold, rollout_rs_threshold_lower=rollout_rs_threshold_lower,
        )  # fmt: skip
        work["pg_weights"] = weights
        work["loss_mask"] = loss_mask.long()
        mask_key = "loss_mask"  # the normaliser counts only the tokens left in the loss
        metrics.update({f"rollout/{k}": float(v) for k, v in corr.items()})
    if decoupled_loss:  # on the tokens left in the loss; capped ones stay in its normaliser (AReaL)
        weights, behav = rl.behav_imp_weights(
            old, batch.tensor("logprobs"), work.tensor(mask_key), behav_imp_weight_cap
        )
        work["pg_weights"] = weights
        metrics.update({f"actor/{k}": float(v) for k, v in behav.items()})

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        mask = b.tensor(mask_key)
        lp, ent = _logprobs_and_entropy(
            module, b, temperature=temperature, top_k=top_k, top_p=top_p, entropy=True
        )
        assert ent is not None
        surrogate = rl.gspo_policy_loss if loss == "gspo" else rl.policy_loss
        total, m = surrogate(
            lp, b.tensor("old_logprobs"), b.tensor("advantages"), mask, clip_eps, clip_eps_high,
            agg=agg, global_normalizer=norm, norm_length=width, dual_clip=dual_clip,
            weights=b.tensor("pg_weights") if "pg_weights" in b else None,
        )  # fmt: skip
        out = {k: float(v) for k, v in m.items()}
        if entropy_coef:
            e_loss, _ = rl.entropy_bonus(
                ent, mask, entropy_coef, agg=agg, global_normalizer=norm, norm_length=width
            )
            total = total + e_loss
        if kl_loss_coef and "ref_logprobs" in b:
            k_loss, km = rl.kl_loss(
                lp,
                b.tensor("ref_logprobs"),
                mask,
                kind=kl_loss_type,
                coef=kl_loss_coef,
                agg=agg,
                global_normalizer=norm,
                norm_length=width,
            )
            total = total + k_loss
            out["kl_loss"] = float(km["kl"])  # the KL estimate the loss term penalises (nats/token)
        tokens = float(mask.sum())
        out["entropy"] = float(rl.masked_sum(ent.detach(), mask) / max(tokens, 1.0))
        return total, out, tokens

    metrics.update(optimize(ctx, work, loss_fn, prefix="actor", mask_key=mask_key, agg=agg))
    return metrics


def _reward_kl(batch: Batch, kl_estimator: str) -> torch.Tensor:
    return rl.kl_estimate(
        batch.tensor("logprobs"),
        batch.tensor("ref_logprobs"),
        batch.tensor("response_mask"),
        kind=kl_estimator,
    )


def _kl_metrics(kl: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    return {"actor/reward_kl": float(rl.masked_sum(kl, mask) / max(1, int(mask.sum())))} if mask.any() else {}


def _ppo_advantages(
    batch: Batch, kl_coef: float, kl_estimator: str, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE advantages and returns ``[B,R]`` of KL-penalised token rewards (Ouyang et al. 2022, eq. 2).

    With ``truncated`` and ``bootstrap_values`` ``[B]`` in the batch, a truncated row bootstraps from
    V(s_T) after its last token (Pardo et al. 2018); otherwise every row is terminal (value 0 after it).
    """
    mask = batch.tensor("response_mask")
    kl = _reward_kl(batch, kl_estimator)
    rewards = rl.token_rewards(batch.tensor("scores"), mask, kl, kl_coef)
    trunc = batch.tensor("truncated") if "truncated" in batch else None
    boot = batch.tensor("bootstrap_values").float() if "bootstrap_values" in batch else None
    adv, ret = rl.gae(
        rewards, batch.tensor("values"), mask, gamma, lam, bootstrap_value=boot, truncated=trunc
    )
    return adv, ret, kl


PPO_IN = (*SEQ, "logprobs", "ref_logprobs", "values", "scores", "truncated", "bootstrap_values")
PPO_OPTIONAL = ("truncated", "bootstrap_values")
PPO_REWARD_ARGS = (_kl_coef_arg(0.05), KL_ESTIMATOR_ARG, *GAE_ARGS)


@node_function(
    "ppo_actor",
    "train",
    inputs=PPO_IN,
    optional_inputs=PPO_OPTIONAL,
    heads=("lm",),
    arg_inputs=(PROX_INPUT,),
    args=(
        *PPO_REWARD_ARGS,
        Arg(
            "whiten_advantages",
            bool,
            True,
            "whiten the advantages over the whole batch",
            "OpenAI Baselines PPO2",
        ),
        *_pg_args(),
    ),
)
def ppo_actor(
    ctx: NodeContext,
    batch: Batch,
    *,
    kl_coef: float,
    kl_estimator: str,
    gamma: float,
    lam: float,
    whiten_advantages: bool,
    **pg: Any,
) -> NodeResult:
    """PPO policy step (Schulman et al. 2017; RLHF form of Ouyang et al. 2022): GAE, KL-penalised rewards.

    Needs a critic's ``values``; binding ``truncated`` (from ``generate``) and ``bootstrap_values`` (from
    ``values``) bootstraps truncated responses. Without a critic, use ``reinforce_pp_actor`` (REINFORCE++:
    the batch mean of the reward-to-go as baseline) or the group baselines of ``rloo_actor``/``grpo_actor``.
    """
    adv, ret, kl = _ppo_advantages(batch, kl_coef, kl_estimator, gamma, lam)
    mask = batch.tensor("response_mask")
    if whiten_advantages:  # over the whole batch, all data-parallel shares
        adv = rl.masked_whiten(adv, mask, all_sum=ctx.train_hooks.all_sum)
    metrics = _pg_train(ctx, batch, adv, **pg)
    metrics.update(_kl_metrics(kl, mask))
    metrics["critic/returns/mean"] = float(rl.masked_mean(ret, mask)) if mask.any() else 0.0
    return NodeResult({}, metrics, _seq_tokens(batch) * ctx.node.epochs)


@node_function(
    "ppo_critic",
    "train",
    inputs=PPO_IN,
    optional_inputs=PPO_OPTIONAL,
    heads=("value",),
    args=(
        *PPO_REWARD_ARGS,
        Arg(
            "value_clip",
            float,
            0.2,
            "clip range of the value change from the old values (null: off)",
            "OpenAI Baselines PPO2",
            low=0,
            low_open=True,
            optional=True,
        ),
        AGG_ARG,
    ),
)
def ppo_critic(
    ctx: NodeContext,
    batch: Batch,
    *,
    kl_coef: float,
    kl_estimator: str,
    gamma: float,
    lam: float,
    value_clip: float | None,
    agg: str,
) -> NodeResult:
    """PPO value step: clipped value loss towards the GAE returns of the same rewards the actor uses
    (bootstrapped for truncated responses when ``truncated``/``bootstrap_values`` are bound)."""
    _, ret, _ = _ppo_advantages(batch, kl_coef, kl_estimator, gamma, lam)
    work = batch.select(SEQ)
    work["old_values"] = batch.tensor("values")
    work["returns"] = ret
    width = int(batch.tensor("response_ids").shape[1])

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        v = response_values(
            module,
            b.tensor("prompt_ids"),
            b.tensor("prompt_mask"),
            b.tensor("response_ids"),
            b.tensor("response_mask"),
        ).float()
        loss, m = rl.value_loss(
            v,
            b.tensor("old_values"),
            b.tensor("returns"),
            b.tensor("response_mask"),
            value_clip,
            agg=agg,
            global_normalizer=norm,
            norm_length=width,
        )
        return loss, {k: float(val) for k, val in m.items()}, float(b.tensor("response_mask").sum())

    metrics = optimize(ctx, work, loss_fn, prefix="critic", agg=agg)
    return NodeResult({}, metrics, _seq_tokens(batch) * ctx.node.epochs)


def _outcome_node(
    ctx: NodeContext, batch: Batch, advantages: torch.Tensor, pg: dict[str, Any], loss: str = "ppo"
) -> NodeResult:
    metrics = _pg_train(ctx, batch, advantages, **pg, loss=loss)
    metrics.update(_kl_metrics(_reward_kl(batch, "k1"), batch.tensor("response_mask")))
    mask = batch.tensor("response_mask")
    metrics["critic/advantages/mean"] = float(rl.masked_mean(advantages, mask)) if mask.any() else 0.0
    return NodeResult({}, metrics, _seq_tokens(batch) * ctx.node.epochs)


OUTCOME_IN = (*SEQ, "logprobs", "ref_logprobs", "scores")
SHAPED_ARGS = (_kl_coef_arg(0.05, "KL penalty subtracted from each sequence's score"), KL_ESTIMATOR_ARG)


@node_function(
    "grpo_actor",
    "train",
    inputs=OUTCOME_IN,
    heads=("lm",),
    arg_inputs=(PROX_INPUT,),
    group_wise="GRPO normalises each reward by the mean and std of its prompt's group (Shao et al., 2024)",
    args=(
        Arg(
            "std",
            str,
            "group",
            "reward normaliser: the group's std (GRPO), the batch's std (Lite PPO) or none (Dr. GRPO)",
            "Shao et al. 2024; Liu et al. 2025",
            choices=("group", "batch", "none"),
        ),
        Arg(
            "eps",
            float,
            1e-6,
            "added to the std; a zero-spread group gets advantage 0 for any eps >= 0",
            "Shao et al. 2024",
            low=0,
        ),
        Arg(
            "loss",
            str,
            "ppo",
            "policy loss: token-level PPO clip or sequence-level GSPO",
            "Zheng et al. 2025",
            choices=tuple(POLICY_LOSS_DEFAULTS),
        ),
        *_pg_args(kl_loss_coef=0.001, per_loss=True),
    ),
)
def grpo_actor(ctx: NodeContext, batch: Batch, *, std: str, eps: float, loss: str, **pg: Any) -> NodeResult:
    """GRPO (Shao et al. 2024): group-relative advantages, KL to the reference as a loss term (k3)."""
    adv = rl.grpo_advantages(
        batch.tensor("scores"),
        batch.tensor("response_mask"),
        ctx.group_size,
        std=std,
        eps=eps,
        all_sum=ctx.train_hooks.all_sum,
    )
    return _outcome_node(ctx, batch, adv, pg, loss=loss)


def _kl_shaped_scores(batch: Batch, kl_coef: float, kl_estimator: str) -> torch.Tensor:
    """Sequence scores minus ``kl_coef`` × the sequence's summed KL to the reference (RLOO/ReMax reward)."""
    kl = _reward_kl(batch, kl_estimator)
    return batch.tensor("scores").float() - kl_coef * rl.masked_sum(kl, batch.tensor("response_mask"), dim=-1)


@node_function(
    "rloo_actor",
    "train",
    inputs=OUTCOME_IN,
    heads=("lm",),
    arg_inputs=(PROX_INPUT,),
    group_wise="RLOO's baseline is the mean reward of the other samples of the same prompt "
    "(Ahmadian et al., 2024)",
    args=(*SHAPED_ARGS, *_pg_args()),
)
def rloo_actor(ctx: NodeContext, batch: Batch, *, kl_coef: float, kl_estimator: str, **pg: Any) -> NodeResult:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline over the group's KL-shaped sequence rewards."""
    scores = _kl_shaped_scores(batch, kl_coef, kl_estimator)
    adv = rl.rloo_advantages(scores, batch.tensor("response_mask"), ctx.group_size)
    return _outcome_node(ctx, batch, adv, pg)


@node_function(
    "remax_actor",
    "train",
    inputs=(*OUTCOME_IN, "greedy_scores"),
    heads=("lm",),
    arg_inputs=(PROX_INPUT,),
    args=(*SHAPED_ARGS, *_pg_args()),
)
def remax_actor(
    ctx: NodeContext, batch: Batch, *, kl_coef: float, kl_estimator: str, **pg: Any
) -> NodeResult:
    """ReMax (Li et al. 2023): REINFORCE with the greedy response's reward as the baseline."""
    scores = _kl_shaped_scores(batch, kl_coef, kl_estimator)
    adv = rl.remax_advantages(scores, batch.tensor("greedy_scores").float(), batch.tensor("response_mask"))
    return _outcome_node(ctx, batch, adv, pg)


@node_function(
    "reinforce_pp_actor",
    "train",
    inputs=OUTCOME_IN,
    heads=("lm",),
    arg_inputs=(PROX_INPUT,),
    args=(_kl_coef_arg(0.01), KL_ESTIMATOR_ARG, GAMMA_ARG, *_pg_args()),
)
def reinforce_pp_actor(
    ctx: NodeContext, batch: Batch, *, kl_coef: float, kl_estimator: str, gamma: float, **pg: Any
) -> NodeResult:
    """REINFORCE++ (Hu 2025): KL-penalised token rewards, reward-to-go, whitened over the whole batch.

    PPO without a critic: the whitening subtracts the batch mean of the reward-to-go, a baseline.
    """
    mask = batch.tensor("response_mask")
    rewards = rl.token_rewards(batch.tensor("scores"), mask, _reward_kl(batch, kl_estimator), kl_coef)
    adv = rl.reinforce_pp_advantages(rewards, mask, gamma, all_sum=ctx.train_hooks.all_sum)
    return _outcome_node(ctx, batch, adv, pg)


# ------------------------------------------------------------------------------------------------
# supervised / preference train nodes


@node_function(
    "sft",
    "train",
    inputs=SEQ,
    heads=("lm",),
    args=(
        AGG_ARG,
        Arg(
            "observation_tokens",
            list,
            None,
            "[open, close] tokens (ids or vocabulary strings) of environment observations in demonstration "
            "trajectories; each span open … close (both included) leaves the loss (null: none)",
            "Jin et al. 2025 (Search-R1): retrieved tokens are masked out of the loss",
            optional=True,
        ),
    ),
)
def sft_node(ctx: NodeContext, batch: Batch, *, agg: str, observation_tokens: list[Any] | None) -> NodeResult:
    """Supervised fine-tuning: masked negative log-likelihood of the response tokens (observation spans of
    multi-turn demonstrations excluded with ``observation_tokens``: :func:`rlflow.nodes.rl.mask_spans`)."""
    width = int(batch.tensor("response_ids").shape[1])
    if observation_tokens is not None:
        if len(observation_tokens) != 2:
            raise NodeError(
                f"node '{ctx.node.name}': args.observation_tokens must be [open, close], got "
                f"{observation_tokens!r}"
            )
        open_id, close_id = _stop_ids(ctx, observation_tokens)
        batch = batch.select(SEQ)
        batch["response_mask"] = rl.mask_spans(
            batch.tensor("response_ids"), batch.tensor("response_mask"), open_id, close_id
        )

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        lp, _ = _logprobs_and_entropy(module, b)
        loss, m = rl.sft_loss(
            lp, b.tensor("response_mask"), agg=agg, global_normalizer=norm, norm_length=width
        )
        return loss, {k: float(v) for k, v in m.items()}, float(b.tensor("response_mask").sum())

    metrics = optimize(ctx, batch.select(SEQ), loss_fn, prefix="actor", agg=agg)
    return NodeResult({}, metrics, _seq_tokens(batch) * ctx.node.epochs)


def _pair_view(b: Batch, which: str) -> Batch:
    return Batch(
        {
            "prompt_ids": b.tensor("prompt_ids"),
            "prompt_mask": b.tensor("prompt_mask"),
            "response_ids": b.tensor(f"{which}_ids"),
            "response_mask": b.tensor(f"{which}_mask"),
        }
    )


def _pair_tokens(batch: Batch) -> int:
    return (
        2 * int(batch.tensor("prompt_mask").sum())
        + int(batch.tensor("chosen_mask").sum())
        + int(batch.tensor("rejected_mask").sum())
    )


@node_function(
    "dpo",
    "train",
    inputs=(*PAIR, "ref_chosen_logps", "ref_rejected_logps"),
    heads=("lm",),
    args=(
        Arg(
            "beta",
            float,
            0.1,
            "β: strength of the implicit KL to the reference",
            "Rafailov et al. 2023",
            low=0,
            low_open=True,
        ),
        Arg(
            "loss",
            str,
            "dpo",
            "preference loss",
            "Rafailov et al. 2023; Azar et al. 2023 (IPO); Mitchell 2023 (cDPO)",
            choices=("dpo", "ipo", "cdpo"),
        ),
        Arg(
            "label_smoothing",
            float,
            0.0,
            "cDPO's assumed label-flip rate ε",
            "Mitchell 2023",
            low=0,
            high=0.5,
            high_open=True,
            needs=("loss", ("cdpo",)),
        ),
    ),
)
def dpo_node(ctx: NodeContext, batch: Batch, *, beta: float, loss: str, label_smoothing: float) -> NodeResult:
    """DPO (Rafailov et al. 2023), IPO (Azar et al. 2023) or cDPO from per-sequence log-probs."""

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        logps = {}
        lengths = {}
        for which in ("chosen", "rejected"):
            view = _pair_view(b, which)
            lp, _ = _logprobs_and_entropy(module, view)
            logps[which] = rl.sequence_logps(lp, view.tensor("response_mask"))
            lengths[which] = view.tensor("response_mask").sum(-1)
        total, m = rl.preference_loss(
            logps["chosen"],
            logps["rejected"],
            b.tensor("ref_chosen_logps"),
            b.tensor("ref_rejected_logps"),
            beta=beta,
            loss_type=loss,
            label_smoothing=label_smoothing,  # type: ignore[arg-type]
            chosen_lengths=lengths["chosen"],
            rejected_lengths=lengths["rejected"],
            global_normalizer=norm,
        )
        return total, {k: float(v) for k, v in m.items()}, float(len(b))

    metrics = optimize(ctx, batch, loss_fn, prefix="actor", mask_key="", agg="token-mean")
    return NodeResult({}, metrics, _pair_tokens(batch) * ctx.node.epochs)


@node_function(
    "reward_model",
    "train",
    inputs=PAIR,
    heads=("score",),
    args=(
        Arg(
            "margin",
            float,
            None,
            "margin m in -log σ(r_w - r_l - m) (null: 0)",
            "Touvron et al. 2023",
            optional=True,
        ),
    ),
)
def reward_model_node(ctx: NodeContext, batch: Batch, *, margin: float | None) -> NodeResult:
    """Pairwise Bradley–Terry reward-model training (Ouyang et al. 2022, eq. 1)."""

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        s = {}
        for which in ("chosen", "rejected"):
            v = _pair_view(b, which)
            s[which] = response_scores(
                module,
                v.tensor("prompt_ids"),
                v.tensor("prompt_mask"),
                v.tensor("response_ids"),
                v.tensor("response_mask"),
            ).float()
        total, m = rl.reward_model_loss(s["chosen"], s["rejected"], margin, global_normalizer=norm)
        return total, {k: float(v) for k, v in m.items()}, float(len(b))

    metrics = optimize(ctx, batch, loss_fn, prefix="reward", mask_key="", agg="token-mean")
    return NodeResult({}, metrics, _pair_tokens(batch) * ctx.node.epochs)
