"""The supervised train node functions: SFT (masked negative log-likelihood), preference optimisation (DPO,
IPO, cDPO) and pairwise reward-model training."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.registry import node_function
from rlflow.nodes import rl
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.forward import batch_logprobs, response_scores
from rlflow.nodes.functions.common import SEQ, sequence_tokens, stop_token_ids
from rlflow.nodes.functions.schemas import AGG_ARG
from rlflow.nodes.moe import AUX_LOSS_ARG
from rlflow.nodes.train import optimize

__all__ = ["PAIR", "dpo_node", "reward_model_node", "sft_node"]

PAIR = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
"""The keys of a preference pair batch: one prompt, a chosen and a rejected response."""


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
        AUX_LOSS_ARG,
    ),
)
def sft_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    agg: str,
    observation_tokens: list[Any] | None,
    router_aux_loss_coef: float,
) -> NodeResult:
    """Supervised fine-tuning: masked negative log-likelihood of the response tokens (observation spans of
    multi-turn demonstrations excluded with ``observation_tokens``: :func:`rlflow.nodes.rl.mask_spans`)."""
    width = int(batch.tensor("response_ids").shape[1])
    if observation_tokens is not None:
        if len(observation_tokens) != 2:
            raise NodeError(
                f"node '{ctx.node.name}': args.observation_tokens must be [open, close], got "
                f"{observation_tokens!r}"
            )
        open_id, close_id = stop_token_ids(ctx, observation_tokens)
        batch = batch.select(SEQ)
        batch["response_mask"] = rl.mask_spans(
            batch.tensor("response_ids"), batch.tensor("response_mask"), open_id, close_id
        )

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        lp, _ = batch_logprobs(module, b)
        loss, m = rl.sft_loss(
            lp, b.tensor("response_mask"), agg=agg, global_normalizer=norm, norm_length=width
        )
        return loss, {k: float(v) for k, v in m.items()}, float(b.tensor("response_mask").sum())

    metrics = optimize(
        ctx, batch.select(SEQ), loss_fn, prefix="actor", agg=agg, router_aux_loss_coef=router_aux_loss_coef
    )
    return NodeResult({}, metrics, sequence_tokens(batch) * ctx.node.epochs)


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
        AUX_LOSS_ARG,
    ),
)
def dpo_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    beta: float,
    loss: str,
    label_smoothing: float,
    router_aux_loss_coef: float,
) -> NodeResult:
    """DPO (Rafailov et al. 2023), IPO (Azar et al. 2023) or cDPO from per-sequence log-probs.

    Metrics (TRL's names under ``actor/``): ``actor/dpo_loss`` (the chosen loss per pair, whichever of
    dpo/ipo/cdpo), ``actor/rewards/chosen``, ``actor/rewards/rejected``, ``actor/rewards/margins`` (β ×
    log-ratio to the reference, nats), ``actor/rewards/accuracies`` (fraction of pairs with a positive
    margin), and :func:`~rlflow.nodes.train.optimize`'s ``actor/grad_norm`` and ``actor/lr``."""

    def loss_fn(module: nn.Module, b: Batch, norm: float) -> tuple[torch.Tensor, dict[str, float], float]:
        logps = {}
        lengths = {}
        for which in ("chosen", "rejected"):
            view = _pair_view(b, which)
            lp, _ = batch_logprobs(module, view)
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
        metrics = {k: float(v) for k, v in m.items()}
        metrics["dpo_loss"] = float(total.detach()) * norm / len(b)  # `total` is Σ over these pairs / norm
        return total, metrics, float(len(b))

    metrics = optimize(
        ctx, batch, loss_fn, prefix="actor", mask_key="", agg="token-mean",
        router_aux_loss_coef=router_aux_loss_coef,
    )  # fmt: skip
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
        AUX_LOSS_ARG,
    ),
)
def reward_model_node(
    ctx: NodeContext, batch: Batch, *, margin: float | None, router_aux_loss_coef: float
) -> NodeResult:
    """Pairwise Bradley–Terry reward-model training (Ouyang et al. 2022, eq. 1).

    Metrics: ``reward/loss`` (per pair), ``reward/accuracy`` (fraction of pairs scored chosen > rejected),
    ``reward/margin`` (mean score difference), ``reward/grad_norm`` and ``reward/lr``."""

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
        metrics = {k: float(v) for k, v in m.items()}
        metrics["loss"] = float(total.detach()) * norm / len(b)  # `total` is Σ over these pairs / norm
        return total, metrics, float(len(b))

    metrics = optimize(
        ctx, batch, loss_fn, prefix="reward", mask_key="", agg="token-mean",
        router_aux_loss_coef=router_aux_loss_coef,
    )  # fmt: skip
    return NodeResult({}, metrics, _pair_tokens(batch) * ctx.node.epochs)
