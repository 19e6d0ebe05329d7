"""Predicates on prompt groups: which groups a filter node keeps (DAPO's dynamic sampling).

Shapes: ``P`` prompts, ``G`` samples per prompt (a group), ``B = P·G`` rows, group ``i`` being rows
``i·G .. i·G + G − 1``.

A predicate maps a metric per row, laid out ``[P, G]``, and the filter node's arguments to a keep flag per
group ``[P]`` (bool). They live in :data:`GROUP_PREDICATES`, keyed by the name a graph file writes under the
filter node's ``args.predicates`` (``rlflow.nodes.functions.filters``); a group is kept when every listed
predicate keeps it. A third party registers one with ``@GROUP_PREDICATES.register(name)`` on a
:class:`GroupPredicate` from a module of its node-function plug-in.

- ``reward_spread``: the group's values are not all equal (``max > min``; the same groups as verl's DAPO
  recipe, ``std > 0``, without a float's rounding in a mean). A group whose rewards all equal has every
  GRPO advantage 0, so it adds no gradient (Yu et al. 2025, DAPO, arXiv 2503.14476, §3.2: drop the groups
  of accuracy 0 or 1). Needs groups of 2 samples at least.
- ``mean_between``: the group's mean lies strictly between ``min_mean`` and ``max_mean`` (each ``None``:
  no bound): for a 0/1 reward, ``0 < mean < 1`` is the paper's "accuracy neither 0 nor 1"; other bounds keep
  prompts of a chosen difficulty.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.dataflow.registry import Registry

__all__ = ["GROUP_PREDICATES", "GroupPredicate", "keep_groups"]


@dataclass(frozen=True)
class GroupPredicate:
    """One predicate on prompt groups.

    Attributes:
        fn: ``fn(values_PG, args) -> keep_P``: ``values_PG`` ``[P, G]`` float, ``args`` the filter node's
            bound arguments; a bool tensor ``[P]``.
        doc: one line: which groups it keeps.
        min_group: the smallest group size it is defined on (validation refuses smaller groups).
        args: the filter arguments it reads (other predicates leave them at their defaults).
        source: the paper or reference.
    """

    fn: Callable[[torch.Tensor, Mapping[str, Any]], torch.Tensor]
    doc: str
    min_group: int = 1
    args: tuple[str, ...] = ()
    source: str = ""


GROUP_PREDICATES: Registry[GroupPredicate] = Registry("group predicate")
"""Predicate name -> :class:`GroupPredicate` (``reward_spread``, ``mean_between``)."""


def _spread(values_PG: torch.Tensor, args: Mapping[str, Any]) -> torch.Tensor:
    return values_PG.amax(dim=1) > values_PG.amin(dim=1)


def _mean_between(values_PG: torch.Tensor, args: Mapping[str, Any]) -> torch.Tensor:
    mean_P = values_PG.mean(dim=1)
    keep_P = torch.ones_like(mean_P, dtype=torch.bool)
    if args.get("min_mean") is not None:
        keep_P &= mean_P > float(args["min_mean"])
    if args.get("max_mean") is not None:
        keep_P &= mean_P < float(args["max_mean"])
    return keep_P


GROUP_PREDICATES.add(
    "reward_spread",
    GroupPredicate(
        _spread,
        "the group's values are not all equal (max > min: a GRPO group with a gradient)",
        min_group=2,
        source="Yu et al. 2025 (DAPO), §3.2 dynamic sampling",
    ),
)
GROUP_PREDICATES.add(
    "mean_between",
    GroupPredicate(
        _mean_between,
        "the group's mean lies strictly between min_mean and max_mean (null: no bound)",
        args=("min_mean", "max_mean"),
        source="Yu et al. 2025 (DAPO), §3.2: 0 < accuracy < 1",
    ),
)


def keep_groups(
    values_B: torch.Tensor, group: int, predicates: list[str], args: Mapping[str, Any]
) -> torch.Tensor:
    """The keep flag ``[P]`` of each group of ``values_B`` ``[B]`` (``B = P·group``): kept when every one of
    ``predicates`` (names in :data:`GROUP_PREDICATES`) keeps it.

    Golden: values ``[1, 0, 1, 1, 0, 0]`` in groups of 2 (``[[1, 0], [1, 1], [0, 0]]``) keep
    ``[True, False, False]`` under ``reward_spread``; means ``[0.5, 1, 0]`` keep the same under
    ``mean_between`` with ``min_mean 0``, ``max_mean 1``.

    Raises:
        RegistryError: an unknown predicate (graph validation refuses one first).
        ValueError: ``B`` is not a multiple of ``group``.
    """
    rows = int(values_B.shape[0])
    if group < 1 or rows % group:
        raise ValueError(f"{rows} rows are not whole groups of {group} samples")
    values_PG = values_B.detach().float().cpu().reshape(rows // group, group)
    keep_P = torch.ones(rows // group, dtype=torch.bool)
    for name in predicates:
        keep_P &= GROUP_PREDICATES.get(name).fn(values_PG, args).bool()
    return keep_P
