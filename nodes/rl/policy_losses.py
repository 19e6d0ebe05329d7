"""The policy losses a clipped policy-gradient train node optimises, keyed by name, with their defaults.

:data:`POLICY_LOSSES` maps a name (``ppo``, ``gspo``) to a :class:`PolicyLoss`: the surrogate (a function of
:mod:`rlflow.nodes.rl.losses`) and the clip range and aggregation a node uses when its graph leaves them
out. A node's ``loss`` argument takes its choices from this registry; a new surrogate is one
:func:`register_policy_loss` call, with no branch in the node functions.

Shapes (DESIGN.md): B rows, R response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from rlflow.dataflow.registry import Registry
from rlflow.nodes.rl.losses import Metrics, gspo_policy_loss, policy_loss

__all__ = ["POLICY_LOSSES", "PolicyLoss", "PolicyLossFn", "register_policy_loss"]


class PolicyLossFn(Protocol):
    """A clipped surrogate: ``(loss, metrics)`` from the policy's and the old policy's log-probs ``[B, R]``
    (nats), the advantages (``[B, R]``; a sequence-level loss may take ``[B]``) and the 0/1 ``mask``
    ``[B, R]``, aggregated as :func:`rlflow.nodes.rl.losses.aggregate` (``agg``, ``global_normalizer``,
    ``norm_length``), each token's loss times the constant ``weights`` ``[B, R]`` when given.

    Raises:
        RLInputError: bad shapes, mask or clip arguments.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip_eps: float,
        clip_eps_high: float | None,
        *,
        dual_clip: float | None,
        agg: str,
        global_normalizer: float | int | torch.Tensor | None,
        norm_length: int | None,
        weights: torch.Tensor | None,
    ) -> tuple[torch.Tensor, Metrics]: ...


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss and the defaults a node uses when its graph leaves them out.

    Attributes:
        name: what a node's ``loss`` argument names.
        fn: the surrogate (:class:`PolicyLossFn`).
        clip_eps: the default clip range ε of the ratio.
        clip_eps_high: the default upper clip ε (``None``: ``clip_eps``, symmetric).
        agg: the default aggregation (one of :data:`rlflow.nodes.rl.losses.AGG_MODES`).
        source: the paper the loss and its defaults follow.
        doc: one line saying what the loss is, for argument descriptions.
    """

    name: str
    fn: PolicyLossFn
    clip_eps: float
    clip_eps_high: float | None
    agg: str
    source: str
    doc: str


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
"""Policy losses by name, in registration order (``ppo`` first)."""


def register_policy_loss(loss: PolicyLoss) -> PolicyLoss:
    """Add ``loss`` to :data:`POLICY_LOSSES` under its name; returns it.

    Raises:
        RegistryError: a loss of that name is already registered.
    """
    return POLICY_LOSSES.add(loss.name, loss)


# PPO: Schulman et al. 2017 (ε = 0.2; clip_eps_high None: symmetric); token-mean aggregation.
register_policy_loss(
    PolicyLoss("ppo", policy_loss, 0.2, None, "token-mean", "Schulman et al. 2017", "token-level PPO clip")
)
# GSPO: Zheng et al. 2025 (ε = 3e-4 / 4e-4 on the sequence ratio); the sequence-level objective averages over
# sequences, i.e. seq-mean-token-mean (each sequence's tokens carry its ratio).
register_policy_loss(
    PolicyLoss(
        "gspo",
        gspo_policy_loss,
        3e-4,
        4e-4,
        "seq-mean-token-mean",
        "Zheng et al. 2025 (GSPO)",
        "sequence-level GSPO",
    )
)
