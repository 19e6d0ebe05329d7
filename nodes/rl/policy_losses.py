"""The policy losses a clipped policy-gradient train node optimises, keyed by name, with their defaults.

:data:`POLICY_LOSSES` maps a name (``ppo``, ``gspo``, ``cispo``, ``sapo``) to a :class:`PolicyLoss`: the
surrogate (a function of :mod:`rlflow.nodes.rl.losses` or :mod:`rlflow.nodes.rl.surrogates`), the clip range
and aggregation a node uses when its graph leaves them out, and the node arguments of that loss alone (SAPO's
temperatures). A node's ``loss`` argument takes its choices from this registry and its argument schema takes
each loss's own arguments (read only with that loss); a new surrogate is one :func:`register_policy_loss`
call, with no branch in the node functions.

Shapes (DESIGN.md): B rows, R response tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlflow.dataflow.args import Arg
from rlflow.dataflow.registry import Registry
from rlflow.nodes.rl.losses import Metrics, gspo_policy_loss, policy_loss
from rlflow.nodes.rl.surrogates import cispo_policy_loss, sapo_policy_loss

__all__ = ["POLICY_LOSSES", "PolicyLoss", "PolicyLossFn", "register_policy_loss"]


class PolicyLossFn(Protocol):
    """A policy surrogate: ``(loss, metrics)`` from the policy's and the old policy's log-probs ``[B, R]``
    (nats), the advantages (``[B, R]``; a sequence-level loss may take ``[B]``) and the 0/1 ``mask``
    ``[B, R]``, aggregated as :func:`rlflow.nodes.rl.losses.aggregate` (``agg``, ``global_normalizer``,
    ``norm_length``), each token's loss times the constant ``weights`` ``[B, R]`` when given. ``clip_eps``
    ``None`` (and ``clip_eps_high``, ``dual_clip`` ``None``) for a loss that does not clip (SAPO); a loss
    that does takes a float (``math.inf``: no lower bound). :meth:`PolicyLoss.bind` gives one with the loss's
    own arguments set.

    Raises:
        RLInputError: bad shapes, mask or clip arguments.
    """

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        clip_eps: float | None,
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
    """One policy loss, the defaults a node uses when its graph leaves them out, and its own arguments.

    Attributes:
        name: what a node's ``loss`` argument names.
        fn: the surrogate: a :class:`PolicyLossFn` that also takes each of ``args`` by name as a keyword
            (:meth:`bind` sets them).
        clip_eps: the default clip range ε of the ratio (``math.inf``: no lower bound, CISPO); ``None``: the
            loss does not clip, and a node's ``clip_eps``, ``clip_eps_high`` and ``dual_clip`` are refused.
        clip_eps_high: the default upper clip ε (``None``: ``clip_eps``, symmetric).
        agg: the default aggregation (one of :data:`rlflow.nodes.rl.losses.AGG_MODES`).
        source: the paper the loss and its defaults follow.
        doc: one line saying what the loss is, for argument descriptions.
        dual_clip: whether the loss reads a node's ``dual_clip`` (PPO's bound on a negative advantage's loss);
            a node asking for one with a loss that has none is refused.
        args: node arguments of this loss alone (SAPO's ``tau_pos``, ``tau_neg``), with their defaults: the
            schema of every node that takes ``loss`` declares them, read only when ``loss`` names this one.
    """

    name: str
    fn: Callable[..., tuple[torch.Tensor, Metrics]]
    clip_eps: float | None
    clip_eps_high: float | None
    agg: str
    source: str
    doc: str
    dual_clip: bool = True
    args: tuple[Arg, ...] = ()

    def bind(self, options: Mapping[str, Any]) -> PolicyLossFn:
        """:attr:`fn` with this loss's own :attr:`args` set from ``options`` (a node's bound arguments; the
        other names in it are ignored).

        Raises:
            KeyError: ``options`` lacks one of :attr:`args` (a schema without this loss's arguments).
        """
        return functools.partial(self.fn, **{a.name: options[a.name] for a in self.args})

    def defaults_text(self) -> str:
        """The loss's defaults in a few words, for argument descriptions: ``ppo: ε 0.2/0.2, token-mean``."""
        if self.clip_eps is None:
            clip = "no clip"
        else:
            low = "no lower bound" if math.isinf(self.clip_eps) else f"{self.clip_eps:g}"
            clip = f"ε {low}/{self.clip_eps if self.clip_eps_high is None else self.clip_eps_high:g}"
        return f"{self.name}: {clip}, {self.agg}"


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
# CISPO: MiniMax 2025 (MiniMax-M1), eq. 4-5: the importance-sampling weight clipped to
# [1 - ε_low, 1 + ε_high] with no lower bound (the paper sets ε_low large and tunes only ε_high); the paper
# prints no ε_high, 0.2 is verl's CISPO recipe's (clip_ratio_high=0.2, with clip_ratio_low=10: no lower
# bound either). Its normaliser is 1/Σ|o_i|: token-mean.
register_policy_loss(
    PolicyLoss(
        "cispo",
        cispo_policy_loss,
        math.inf,
        0.2,
        "token-mean",
        "MiniMax 2025 (MiniMax-M1, CISPO)",
        "CISPO's clipped importance-sampling weight on REINFORCE",
        dual_clip=False,
    )
)
_SAPO = "Gao et al. 2025 (SAPO), arXiv 2511.20347"
# SAPO: Gao et al. 2025: a sigmoid gate of temperature τ_pos (A > 0) / τ_neg (A <= 0) instead of a clip; the
# paper's values τ_pos = 1.0, τ_neg = 1.05 (verl's actor defaults too), and its 1/G Σ_i 1/|y_i| Σ_t average:
# seq-mean-token-mean.
register_policy_loss(
    PolicyLoss(
        "sapo",
        sapo_policy_loss,
        None,
        None,
        "seq-mean-token-mean",
        "Gao et al. 2025 (SAPO)",
        "SAPO's soft sigmoid gate",
        dual_clip=False,
        args=(
            Arg(
                "tau_pos",
                float,
                1.0,
                "SAPO: temperature τ of the soft gate σ(τ(ρ-1))·4/τ on tokens of positive advantage",
                _SAPO,
                low=0,
                low_open=True,
            ),
            Arg(
                "tau_neg",
                float,
                1.05,
                "SAPO: temperature τ of the gate on tokens of advantage <= 0 (the paper takes it above "
                "tau_pos: a negative update decays faster)",
                _SAPO,
                low=0,
                low_open=True,
            ),
        ),
    )
)
