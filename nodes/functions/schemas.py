"""Argument schemas several builtin node functions share: logits processing, the reward's KL penalty, GAE,
loss aggregation, and the clipped policy-gradient loop's options (the policy loss and its clip, entropy, KL
loss, the old policy's pass, decoupled PPO, sampler/trainer mismatch correction, route replay, over-long
filtering)."""

from __future__ import annotations

import dataclasses

from rlflow.dataflow.args import TOP_K, TOP_P, Arg
from rlflow.dataflow.registry import ArgInput
from rlflow.nodes import rl
from rlflow.nodes.moe import AUX_LOSS_ARG
from rlflow.nodes.moe_routes import PROMPT_ROUTES, RESPONSE_ROUTES, ROUTES_NEED
from rlflow.nodes.rl.policy_losses import POLICY_LOSSES

__all__ = [
    "AGG_ARG",
    "DECOUPLED_ARGS",
    "GAE_ARGS",
    "GAMMA_ARG",
    "KL_ESTIMATOR_ARG",
    "LOGPROB_ROUTE_REPLAY_ARG",
    "OVERLONG_FILTER_ARG",
    "PG_ARG_INPUTS",
    "PG_NAMES",
    "PROX_INPUT",
    "ROLLOUT_CORRECTION_ARGS",
    "ROUTE_INPUTS",
    "ROUTE_REPLAY_ARG",
    "TRUNCATED_INPUT",
    "kl_coef_arg",
    "pg_args",
    "processing_args",
]


def processing_args(what: str) -> tuple[Arg, ...]:
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


def kl_coef_arg(default: float, where: str = "per-token KL penalty in the reward") -> Arg:
    """``kl_coef`` with its ``default``: β of the KL penalty ``where`` says."""
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
_R3 = "Ma et al. 2025 (R3), arXiv 2510.11370; vLLM enable_return_routed_experts"
ROUTE_REPLAY_ARG = Arg(
    "route_replay",
    bool,
    False,
    "route replay (MoE models): every forward of this node (the old policy's pass and the train forward) "
    "routes each token through the experts the sampler chose (inputs prompt_routed_experts and "
    "routed_experts, from a generate node with record_routes); the experts' weights come from this "
    "model's own router logits (metric rollout/router_agreement)",
    _R3,
    model_types=ROUTES_NEED,
)
LOGPROB_ROUTE_REPLAY_ARG = Arg(
    "route_replay",
    bool,
    False,
    "route replay (MoE models): the forward routes each token through the experts the sampler chose "
    "(inputs prompt_routed_experts and routed_experts, from a generate node with record_routes), as a train "
    "node with route_replay does: the proximal log-probs of its decoupled loss, or a reference's, under the "
    "sampler's routes; the experts' weights come from this model's own router logits",
    _R3,
    model_types=ROUTES_NEED,
)
"""``route_replay`` of the ``logprobs`` inference node (``nodes/functions/inference.py``)."""
ROUTE_INPUTS = tuple(
    ArgInput(name, "route_replay", (True,),
             f"the {what} tokens' experts [B,{axis},Y,K] int (-1: none), a generate node's (record_routes)")
    for name, what, axis in ((PROMPT_ROUTES, "prompt", "S"), (RESPONSE_ROUTES, "response", "R"))
)  # fmt: skip
"""The recorded routes route replay reads (:mod:`rlflow.nodes.moe_routes`)."""
TRUNCATED_INPUT = ArgInput(
    "truncated",
    "overlong_filter",
    (True,),
    "1 for a response cut at max_new_tokens without a stop token [B] (the generate node's output truncated)",
)
"""The input over-long filtering (``overlong_filter``) reads."""
PG_ARG_INPUTS = (PROX_INPUT, *ROUTE_INPUTS, TRUNCATED_INPUT)
"""The arg inputs of every clipped policy-gradient node (one that already takes ``truncated`` as an input,
``ppo_actor``, leaves :data:`TRUNCATED_INPUT` out and checks its binding itself)."""
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


_NO_CLIP = tuple(n for n in POLICY_LOSSES if POLICY_LOSSES.get(n).clip_eps is None)
_NO_DUAL_CLIP = tuple(n for n in POLICY_LOSSES if not POLICY_LOSSES.get(n).dual_clip)
_WHY_NO_CLIP = "that loss has no clip range (SAPO: its gate's temperatures tau_pos/tau_neg take its place)"
OVERLONG_FILTER_ARG = Arg(
    "overlong_filter",
    bool,
    False,
    "over-long filtering: responses cut at max_new_tokens (input truncated, the generate node's) leave the "
    "whole actor loss and its normaliser; they still count in the advantages' baselines "
    "(metric overlong/filtered_frac)",
    "Yu et al. 2025 (DAPO), over-long filtering",
)
"""DAPO's over-long filtering, an argument of every clipped policy-gradient node."""


def _loss_args() -> tuple[Arg, ...]:
    """Every registered policy loss's own arguments, each read only when ``loss`` names that loss."""
    return tuple(
        dataclasses.replace(a, needs=("loss", (name,)))
        for name in POLICY_LOSSES
        for a in POLICY_LOSSES.get(name).args
    )


def pg_args(*, kl_loss_coef: float = 0.0) -> tuple[Arg, ...]:
    """Arguments of the clipped policy-gradient loop (:func:`rlflow.nodes.functions.policy.pg_train`), with
    ``kl_loss_coef``'s default. The node chooses its ``loss`` (a name of
    :data:`rlflow.nodes.rl.policy_losses.POLICY_LOSSES`, PPO's by default); a left-out clip range or
    aggregation is that loss's default, and each loss's own arguments (SAPO's temperatures) are read only
    with it. A clip range given to a loss that does not clip, or a dual clip to a loss without one, is
    refused."""
    defaults = "; ".join(POLICY_LOSSES.get(name).defaults_text() for name in POLICY_LOSSES)
    return (
        Arg(
            "loss",
            str,
            "ppo",
            "policy loss: " + " or ".join(POLICY_LOSSES.get(name).doc for name in POLICY_LOSSES),
            "; ".join(POLICY_LOSSES.get(name).source for name in POLICY_LOSSES),
            choices=tuple(POLICY_LOSSES),
        ),
        Arg(
            "clip_eps",
            float,
            None,
            f"clip range ε of the ratio (null: the loss's default; {defaults})",
            "Schulman et al. 2017; Zheng et al. 2025 (GSPO); MiniMax 2025 (CISPO)",
            low=0,
            high=1,
            low_open=True,
            high_open=True,
            optional=True,
            excludes=("loss", _NO_CLIP, _WHY_NO_CLIP),
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
            excludes=("loss", _NO_CLIP, _WHY_NO_CLIP),
        ),
        Arg(
            "agg",
            str,
            None,
            f"loss aggregation (null: the loss's default; {defaults})",
            "verl; Zheng et al. 2025 (GSPO); Liu et al. 2025 (Dr. GRPO)",
            choices=rl.AGG_MODES,
            optional=True,
        ),
        Arg(
            "dual_clip",
            float,
            None,
            "dual-clip bound c: loss of a negative advantage at most -c·A (null: off)",
            "Ye et al. 2020",
            low=1,
            low_open=True,
            optional=True,
            excludes=(
                "loss",
                _NO_DUAL_CLIP,
                "that loss has no clipped objective for a dual clip to bound (CISPO bounds its weights, "
                "SAPO gates them)",
            ),
        ),
        *_loss_args(),
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
        *processing_args("the trainer's log-probs"),
        Arg(
            "recompute_logprobs",
            bool,
            True,
            "old log-probs from the trainer (true: the first mini-batch's rows from their own train "
            "forward, the rest from a no-grad pass) or the sampler's (false); decoupled_loss reads them "
            "from its prox_logprobs input instead",
            needs=("decoupled_loss", (False,)),
        ),
        *DECOUPLED_ARGS,
        *ROLLOUT_CORRECTION_ARGS,
        ROUTE_REPLAY_ARG,
        AUX_LOSS_ARG,
        OVERLONG_FILTER_ARG,
    )


PG_NAMES = tuple(a.name for a in pg_args())
"""The names of :func:`pg_args` (every clipped policy-gradient node's ``**pg``)."""
