"""Released replicas: a model instance that only vLLM engines read gives its parameters up while its
engines hold the weights, and gets them back (or has them streamed unit by unit) for the next weight sync.

Which instances may be released is decided from the plan alone, so every rank answers the same
(:func:`engine_only`); whether a sync rewrites every element of this rank's target tensors
(:func:`rewrites_all`) decides whether released storage may be allocated again uninitialised.
``DistConfig.release_replicas`` turns the release off (the instances stay resident).
"""

from __future__ import annotations

import torch

from rlflow.dataflow.graph import Graph
from rlflow.schedulers.runtime.distributed.hosted import Hosted
from rlflow.schedulers.runtime.distributed.placement import PlanView
from rlflow.schedulers.runtime.distributed.stream_sync import local_bytes, move_params
from rlflow.schedulers.runtime.distributed.weight_sync import Route, target_shards

__all__ = ["Replicas", "engine_only", "rewrites_all"]


def engine_only(graph: Graph, view: PlanView, i: int) -> tuple[str, ...]:
    """The nodes of instance ``i`` if only vLLM engines read it (no built-in generate, inference or train
    node), it is not an EMA follower, a DeepSpeed instance or the model's primary instance (the controller
    fetches that one), a weight sync writes it, it is not sharded over dp (FSDP2, ZeRO-3), no base view
    runs on it (:attr:`PlanView.shares`) and its model has no LoRA adapters (an adapter sync writes the
    adapters alone into the resident base, and the engines load them from it, proved by the probe's
    forward on it: ``rlflow.nodes.engines.lora_sync``); else ``()``.
    From the plan alone, so every rank answers the same for any instance."""
    from rlflow.nodes.engines.validation import engine_nodes

    engines = set(engine_nodes(graph))
    synced = {k for targets in view.sync_targets.values() for k in targets}
    names = tuple(n for n, k in view.node_instance.items() if k == i)
    inst = view.instances[i]
    if (
        not names
        or any(n not in engines for n in names)
        or i in view.ema
        or inst.zero is not None
        or i not in synced
        or i == view.primary(inst.model)
        or inst.sharded
        or i in view.shares.values()
        or graph.spec.models[inst.model].lora is not None
    ):
        return ()
    return names


def rewrites_all(rank: int, route: Route, params: dict[str, torch.Tensor]) -> bool:
    """Whether a sync on ``route`` writes every element of rank ``rank``'s target tensors ``params``: the
    gather path copies whole tensors; the ZeRO path's pieces and the planned reallocation's regions
    (disjoint by construction) must add up to each tensor's elements."""
    written: dict[str, int] = dict.fromkeys(params, 0)
    if route.pieces is not None:
        for piece in route.pieces:
            if piece.dst == rank and piece.param in written:
                written[piece.param] += piece.stop - piece.start
    elif route.plan is not None:
        for t in route.plan.transfers:
            if rank in t.dsts and t.param in written:
                written[t.param] += int(torch.Size([s.stop - s.start for s in t.slices]).numel())
    else:
        return True
    return all(written[k] == v.numel() for k, v in params.items())


class Replicas:
    """The released replicas of one rank.

    Args:
        hosted: this rank's instances and node contexts (their engines).
        routes: every sync route (:class:`~rlflow.schedulers.runtime.distributed.sync_routes.SyncRoutes`).
        enabled: ``DistConfig.release_replicas``.

    Attributes:
        engine_only: instance -> :func:`engine_only` (every instance of the plan).
        releasable: instance -> its vLLM engine nodes, for every instance hosted here that may be
            released (empty when not ``enabled``).
        peaks: instance -> the most bytes of it held here during the last sync (or since start-up).
        released: the instances whose parameters are on the ``meta`` device now.
    """

    def __init__(self, hosted: Hosted, routes: dict[tuple[int, int], Route], enabled: bool) -> None:
        self.hosted = hosted
        self.routes = routes
        self.enabled = enabled
        view = hosted.view
        self.engine_only = {i: engine_only(hosted.graph, view, i) for i in range(len(view.instances))}
        self.releasable = self._releasable() if enabled else {}
        self.peaks: dict[int, int] = {}
        self.released: set[int] = set()

    def _releasable(self) -> dict[int, tuple[str, ...]]:
        """Instance -> its vLLM engine nodes, for every instance hosted here whose parameters may be freed
        while its engines hold the weights (:func:`engine_only`) and every sync into it rewrites every
        element on this rank (:func:`rewrites_all`). At tp > 1 its parameters are DTensors whose local
        shards are freed; the tp group's engine sync gathers the full tensors from those shards and its
        probe forward runs on them before the release."""
        out: dict[int, tuple[str, ...]] = {}
        for i, state in self.hosted.instances.items():
            names = self.engine_only[i]
            if not names or state.optimizer is not None:
                continue
            params = target_shards(state.module)
            routes = [r for (src, dst), r in self.routes.items() if dst == i]
            if all(rewrites_all(self.hosted.rank, r, params) for r in routes):
                out[i] = names
        return out

    def streams(self, route: Route, dst: int) -> bool:
        """Whether a sync into ``dst`` on ``route`` is streamed unit by unit into its engines
        (:mod:`~rlflow.schedulers.runtime.distributed.stream_sync`): the planned reallocation into an
        instance that only engines read, with replicas released (``DistConfig.release_replicas``). The same
        answer on every rank of the route."""
        return self.enabled and route.plan is not None and bool(self.engine_only[dst])

    def release(self) -> None:
        """Free the parameters of every releasable instance whose engines all hold its current version
        (each node's engine loaded and verified it); the parameters keep their shapes and dtypes on the
        ``meta`` device, so the module can be allocated again (:meth:`materialise`). Buffers stay."""
        contexts = self.hosted.contexts
        for i, names in self.releasable.items():
            state = self.hosted.instances[i]
            if i in self.released or any(
                (e := contexts[n].engine) is None or e.weight_version != state.version for n in names
            ):
                continue
            move_params(state.module.parameters(), torch.device("meta"))
            self.released.add(i)

    def materialise(self, instance: int) -> None:
        """Allocate a released instance's parameters on the device again (uninitialised: the weight sync
        that follows rewrites every element, :func:`rewrites_all`)."""
        if instance not in self.released:
            return
        move_params(self.hosted.instances[instance].module.parameters(), self.hosted.device)
        self.released.discard(instance)

    def resident_bytes(self, instance: int) -> int:
        """Bytes of the parameters' storage of ``instance`` on this rank (0 once released; a DTensor's
        local shard)."""
        return sum(local_bytes(p) for p in self.hosted.instances[instance].module.parameters())
