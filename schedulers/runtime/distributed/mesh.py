"""Process groups and device meshes of a plan, created collectively and cached.

``torch.distributed.new_group`` is collective over the whole world: every worker must create the same
groups in the same order, members or not. :class:`GroupCache` does that deterministically (one group per
distinct ordered rank tuple, created on first use, all with the run's collective timeout), and builds each
node's 2-D ``DeviceMesh`` (axes ``("dp", "tp")``) from the cached groups with ``DeviceMesh.from_group``.
A pipeline-parallel node's mesh is, on each rank, the 2-D mesh of its own stage; the groups of its
pipeline chains (and of each chain's first and last stage, for tied embeddings) are created with it, and so
are, for ``ep`` > 1, its expert-parallel and expert-data-parallel groups and each ep group's 1-D ``("ep",)``
mesh (:meth:`GroupCache.experts`, :mod:`rlflow.schedulers.runtime.distributed.experts`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlflow.schedulers.runtime.distributed.experts import ExpertGroups
from rlflow.schedulers.runtime.distributed.layouts import MeshSpec

__all__ = ["GroupCache"]


class GroupCache:
    """Cached process groups (by ordered rank tuple) and device meshes (by :class:`MeshSpec`).

    Args:
        timeout_s: timeout of every collective in the groups created (seconds).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).
    """

    def __init__(self, timeout_s: float, device_type: str = "cpu") -> None:
        self.timeout = timedelta(seconds=timeout_s)
        self.device_type = device_type
        self._groups: dict[tuple[int, ...], Any] = {}
        self._meshes: dict[MeshSpec, Any] = {}
        self._experts: dict[MeshSpec, ExpertGroups | None] = {}

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def group(self, ranks: tuple[int, ...]) -> Any:
        """The group of ``ranks`` (in that order); ``None`` on a non-member. Collective on first use."""
        key = tuple(int(r) for r in ranks)
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), timeout=self.timeout, sort_ranks=False)
        group = self._groups[key]
        return None if self.rank not in key else group

    def mesh(self, spec: MeshSpec) -> Any:
        """The node mesh of ``spec`` (``None`` on a non-member). Collective on first use of its groups.

        With ``pp > 1``: the mesh of this rank's stage (every stage's mesh and every chain's groups are
        created, in order, on every rank).
        """
        if spec in self._meshes:
            return self._meshes[spec]
        if spec.pp > 1:
            stages = [self.mesh(spec.stage(s)) for s in range(spec.pp)]
            for chain in spec.pp_groups():
                self.group(chain)
                self.group((chain[0], chain[-1]))
            self._meshes[spec] = next((m for m in stages if m is not None), None)
            return self._meshes[spec]
        mine_tp: Any = None
        mine_dp: Any = None
        for ranks in spec.tp_groups():
            g = self.group(ranks)
            if g is not None:
                mine_tp = g
        for ranks in spec.dp_groups():
            g = self.group(ranks)
            if g is not None:
                mine_dp = g
        self._experts[spec] = self._expert_groups(spec) if spec.ep > 1 else None
        mesh = None
        if self.rank in spec.devices:
            from torch.distributed.device_mesh import DeviceMesh

            layout = torch.tensor(spec.devices, dtype=torch.int).reshape(spec.dp, spec.tp)
            mesh = DeviceMesh.from_group(
                [mine_dp, mine_tp], self.device_type, mesh=layout, mesh_dim_names=("dp", "tp")
            )
        self._meshes[spec] = mesh
        return mesh

    def experts(self, spec: MeshSpec) -> ExpertGroups | None:
        """This rank's expert-parallel groups in the mesh ``spec`` (``None`` for ``ep = 1`` or on a
        non-member); with ``pp > 1`` those of this rank's stage (each stage's ep and edp groups are its own:
        :meth:`MeshSpec.stage`). Collective on first use (it builds the mesh, :meth:`mesh`)."""
        self.mesh(spec)
        if spec.pp > 1:
            if self.rank not in spec.devices:
                return None
            return self._experts.get(spec.stage(spec.stage_of(self.rank)))
        return self._experts.get(spec)

    def _expert_groups(self, spec: MeshSpec) -> ExpertGroups | None:
        """Create ``spec``'s ep and edp groups (every rank, in order); this rank's, or ``None``."""
        eps, edps = spec.ep_groups()
        mine_ep: tuple[int, ...] | None = None
        mine_edp: tuple[int, ...] | None = None
        for ranks in eps:
            self.group(ranks)
            mine_ep = ranks if self.rank in ranks else mine_ep
        for ranks in edps:
            if len(ranks) > 1:
                self.group(ranks)
            mine_edp = ranks if self.rank in ranks else mine_edp
        if mine_ep is None or mine_edp is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh

        group = self.group(mine_ep)
        ep_mesh = DeviceMesh.from_group(
            group, self.device_type, mesh=torch.tensor(mine_ep, dtype=torch.int), mesh_dim_names=("ep",)
        )
        edp_group = self.group(mine_edp) if len(mine_edp) > 1 else None
        return ExpertGroups(len(mine_ep), mine_ep.index(self.rank), group, ep_mesh, len(mine_edp), edp_group)
