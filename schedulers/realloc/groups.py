"""The torch.distributed process groups a reallocation broadcasts in, one per rank set, created once."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from rlflow.schedulers.realloc.planning import ReallocPlan, Transfer

__all__ = ["GroupCache"]


def _group_key(t: Transfer) -> tuple[int, ...]:
    return tuple(sorted({t.src, *t.dsts}))


class GroupCache:
    """torch.distributed process groups keyed by sorted rank tuple, created once and reused.

    ``dist.new_group`` is collective: every rank of the default group must create every group, in the
    same order, even groups it is not in. ``prepare(plan)`` does that for all groups a plan needs, in
    sorted order, so every rank that walks the same plans creates the same groups in the same order; a
    group a previous plan created is reused (at most one group per distinct rank set, e.g. 11 on 4
    ranks). The full world maps to ``dist.group.WORLD``.

    Not offered: ``new_group(use_local_synchronization=True)`` (members only). torch 2.13 names such a
    group by a hash of its ranks *and the caller's count of existing groups*, so members whose group
    histories differ derive different names and hang (reproduced on gloo: ranks 0-1 create {0,1}, then
    {0,1,2} never completes on rank 2). A runtime whose idle ranks cannot call in should pre-create the
    groups of all its plans at start-up with ``prepare``.
    """

    def __init__(self, *, timeout: timedelta | None = None) -> None:
        self.timeout = timeout
        self._groups: dict[tuple[int, ...], Any] = {}

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, ranks: object) -> bool:
        return ranks in self._groups

    @staticmethod
    def groups_for(plan: ReallocPlan) -> list[tuple[int, ...]]:
        """The sorted rank tuples of every broadcast group a plan needs (pure: no process group)."""
        return sorted({_group_key(t) for t in plan.transfers if not t.is_local})

    def get(self, ranks: Iterable[int]) -> Any:
        """The group of ``ranks`` (created on first use; a collective, see the class docstring).

        Returns a ProcessGroup, or ``GroupMember.NON_GROUP_MEMBER`` on a rank outside ``ranks``.
        """
        key = tuple(sorted(set(ranks)))
        group = self._groups.get(key)
        if group is None:
            if key == tuple(range(dist.get_world_size())):
                group = dist.group.WORLD
            else:
                group = dist.new_group(list(key), timeout=self.timeout)
            self._groups[key] = group
        return group

    def prepare(self, plan: ReallocPlan) -> None:
        """Create every group ``plan`` needs, in sorted order (collective: every rank calls it)."""
        for key in self.groups_for(plan):
            self.get(key)

    def destroy(self) -> None:
        """Destroy the cached groups (not WORLD); call on every rank before ``destroy_process_group``."""
        for group in self._groups.values():
            if group is not dist.group.WORLD and group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        self._groups.clear()
