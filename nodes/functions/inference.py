"""The inference node functions: the model's log-probs of given responses (per token or per sequence),
a critic's values, a reward model's scores, and rule rewards on decoded responses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.registry import node_function
from rlflow.nodes import rl
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.forward import batch_logprobs, response_scores, response_values
from rlflow.nodes.functions.common import SEQ, sequence_tokens
from rlflow.nodes.functions.schemas import LOGPROB_ROUTE_REPLAY_ARG, ROUTE_INPUTS, processing_args
from rlflow.nodes.generation import decode_responses
from rlflow.nodes.moe_routes import RouteReplay
from rlflow.nodes.rewards import resolve_reward, reward_name_mistakes, score_texts
from rlflow.nodes.train import no_grad_forward

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "LOGPROB_ARGS",
    "logprobs_node",
    "rm_score_node",
    "rule_reward_mistakes",
    "rule_reward_node",
    "score_metrics",
    "sequence_logps_node",
    "values_node",
]


LOGPROB_ARGS = (*processing_args("the log-probs"), LOGPROB_ROUTE_REPLAY_ARG)
"""The ``logprobs`` node's arguments: the logits processing of the sampler it scores, and route replay."""


@node_function(
    "logprobs",
    "inference",
    inputs=SEQ,
    outputs=("logprobs",),
    heads=("lm",),
    args=LOGPROB_ARGS,
    arg_inputs=ROUTE_INPUTS,
)
def logprobs_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    route_replay: bool,
) -> NodeResult:
    """Log-probs ``[B,R]`` (nats) of the response tokens under the model (e.g. the reference policy, or the
    proximal policy of a decoupled loss).

    ``route_replay`` (:mod:`rlflow.nodes.moe_routes`): every forward routes each token through the experts
    the batch's ``prompt_routed_experts`` ``[B,S,Y,K]`` / ``routed_experts`` ``[B,R,Y,K]`` recorded, so the
    log-probs are those a train node with ``route_replay`` computes at the same weights (no agreement
    metric here: the train node reports ``rollout/router_agreement``).

    Raises:
        NodeError: with ``route_replay``, routes missing or not fitting the model (:meth:`RouteReplay.start`).
    """
    replay = RouteReplay.start(ctx, batch) if route_replay else None
    opts: dict[str, Any] = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "replay": replay}
    try:
        parts = no_grad_forward(ctx, batch, lambda m, b: batch_logprobs(m, b, **opts)[0])
    finally:
        if replay is not None:
            replay.finish()
    return NodeResult({"logprobs": torch.cat(parts)}, {}, sequence_tokens(batch))


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
        lp, _ = batch_logprobs(m, b)
        return rl.sequence_logps(lp, b.tensor("response_mask"), average=average)

    return NodeResult({"logps": torch.cat(no_grad_forward(ctx, batch, fn))}, {}, sequence_tokens(batch))


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
        {"values": values, "bootstrap_values": bootstrap},
        {"critic/values/mean": mean},
        sequence_tokens(batch),
    )


def score_metrics(key: str, scores: torch.Tensor) -> dict[str, float]:
    """``<name>/mean``, ``/max``, ``/min`` of scores ``[B]`` (``name``: ``critic/score`` for ``scores``)."""
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
    return NodeResult({"scores": scores}, score_metrics("scores", scores), sequence_tokens(batch))


def rule_reward_mistakes(graph: Graph, node: str) -> list[str]:
    """The ``rule_reward`` node's pre-launch check: its ``args.fn`` must resolve, with its other args as the
    reward's options (:func:`resolve_reward`); one message naming the file and key when it does not."""
    where = f"{graph.spec.source or '<graph>'}: nodes.{node}.args"
    options = dict(graph.args(node))
    return reward_name_mistakes(str(options.pop("fn")), f"{where}.fn", options, where)


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
            "the rule reward: a registered name (arith_exact, math_final_answer, math_verify, "
            "format_check, tagged_answer_exact) or a dotted path pkg.mod:fn",
        ),
    ),
    extra_args="options of the reward function, passed to it as keyword arguments (format_check: pattern; "
    "math_verify: timeout_s)",
    check=rule_reward_mistakes,
)
def rule_reward_node(ctx: NodeContext, batch: Batch, *, fn: str, **options: Any) -> NodeResult:
    """Scores ``[B]`` from a rule reward ``fn(response_text, answer) -> float`` (name or dotted path)."""
    if ctx.tokenizer is None:
        raise NodeError(f"node '{ctx.node.name}': rule_reward needs a tokenizer to decode responses")
    try:
        reward = resolve_reward(fn, **options)
    except NodeError as e:
        raise NodeError(f"node '{ctx.node.name}': {e}") from None
    texts = decode_responses(ctx.tokenizer, batch.tensor("response_ids"), batch.tensor("response_mask"))
    answers = [str(a) for a in batch.list_of("answer")]
    try:
        values = score_texts(reward, texts, answers, name=fn)
    except NodeError as e:
        raise NodeError(f"node '{ctx.node.name}': {e}") from e
    scores = torch.tensor(values, dtype=torch.float32)
    return NodeResult(
        {"scores": scores}, score_metrics("scores", scores), int(batch.tensor("response_mask").sum())
    )
