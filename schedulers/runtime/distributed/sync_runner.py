"""This rank's part of a weight sync (the ``Sync`` command): copying a train node's new weights from its
model instance to the model's other instances, on the route chosen at start-up
(:mod:`~rlflow.schedulers.runtime.distributed.sync_routes`).

Three paths: the ZeRO path moves pieces of flat runs between ZeRO-3 partitions and layout shards
(:func:`~rlflow.schedulers.runtime.distributed.zero_transfer.move_pieces`); the planned reallocation moves
shards to shards (:func:`rlflow.schedulers.realloc.execute.execute_reallocation`, verified region by region),
and into an instance only vLLM engines read it streams unit by unit into the engines
(:mod:`~rlflow.schedulers.runtime.distributed.stream_sync`); the gather path broadcasts the full weights
from the source mesh's first rank. A target that follows the source as an EMA blends them into its own.
Between two instances of a LoRA model every path moves the adapters alone (``SyncRoutes.info``), into a
vLLM node's instance too: it stays resident, never streamed, and the node loads the adapters from it.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from rlflow.schedulers.realloc.ema import ema_update
from rlflow.schedulers.realloc.execute import execute_reallocation
from rlflow.schedulers.realloc.planning import ReallocPlan, Transfer
from rlflow.schedulers.realloc.verify import verify_reallocation, weights_checksum
from rlflow.schedulers.runtime.distributed.hosted import Hosted
from rlflow.schedulers.runtime.distributed.protocol import SyncReport, TargetReport
from rlflow.schedulers.runtime.distributed.replicas import Replicas
from rlflow.schedulers.runtime.distributed.stream_sync import UnitStream, move_params, weight_units
from rlflow.schedulers.runtime.distributed.sync_routes import SyncRoutes
from rlflow.schedulers.runtime.distributed.weight_sync import (
    expected_boxes,
    load_full_params,
    plan_bytes_of,
    source_shards,
    target_shards,
)
from rlflow.schedulers.runtime.distributed.zero import load_zero_params, refresh_master, zero_local
from rlflow.schedulers.runtime.distributed.zero_transfer import move_pieces

__all__ = ["SyncRunner"]

_log = logging.getLogger("rlflow.realloc")


class SyncRunner:
    """Runs this rank's part of every weight sync.

    Args:
        hosted: this rank's instances, engines and contexts.
        routing: the route of every sync.
        replicas: the released replicas (a released target is allocated again, or streamed into).

    Attributes:
        count: the reallocations (planned or ZeRO path) this rank took part in.
    """

    def __init__(self, hosted: Hosted, routing: SyncRoutes, replicas: Replicas) -> None:
        self.hosted = hosted
        self.routing = routing
        self.replicas = replicas
        self.rank = hosted.rank
        self.view = hosted.view
        self.device = hosted.device
        self.groups = hosted.groups
        self.count = 0

    def sync(self, src: int, dsts: tuple[int, ...], version: int) -> SyncReport:
        """Copy instance ``src``'s weights to every instance in ``dsts`` (collective on their ranks).

        Per target, the ZeRO path's pieces, or the planned reallocation where the route allows it
        (:class:`~rlflow.schedulers.runtime.distributed.sync_routes.SyncRoutes`; shard-to-shard transfers
        of :mod:`rlflow.schedulers.realloc.execute`, verified region by region), else the gather path:
        all-gather the full parameters inside the source mesh, broadcast them from its first rank to the
        target mesh, each target rank slices its shard. A target whose model follows the source as an
        EMA then blends the received weights into its previous ones
        (:func:`rlflow.schedulers.realloc.ema.ema_update`).

        Returns:
            this rank's report: start and end (wall-clock seconds, ``time.time``), its bytes sent +
            received, and per target instance its path, the bytes of the whole sync (summed over
            receivers) and this rank's target checksum (:class:`TargetReport`).

        Raises:
            ChecksumError: a target region differs from its source region after the reallocation.
        """
        start = time.time()
        source = self.view.instances[src]
        in_source = self.rank in source.mesh.devices
        routes = [self.routing.routes[(src, d)] for d in dsts]
        for dst, route in zip(dsts, routes, strict=True):
            # a released target is allocated again to be written (a streamed one a unit at a time)
            if not self.replicas.streams(route, dst):
                self.replicas.materialise(dst)
                if dst in self.replicas.releasable:
                    self.replicas.peaks[dst] = self.replicas.resident_bytes(dst)
        shards: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}
        # the gather path's flat buffers: the parameters a sync moves (every one, or a LoRA model's
        # adapters: SyncRoutes.info), in named_parameters order, one buffer per such set
        flats: dict[tuple[str, ...], torch.Tensor] = {}
        gathers = [d for d, r in zip(dsts, routes, strict=True) if r.plan is None and r.pieces is None]
        if in_source and gathers:
            params = self.hosted.full_params(src)  # on the source's first rank at least (the broadcast root)
            if params:
                for d in gathers:
                    names = tuple(self.routing.info(src, d).shapes)
                    if names not in flats:
                        flats[names] = torch.cat([params[k].reshape(-1).to(self.device) for k in names])
            del params
        targets: dict[int, TargetReport] = {}
        nbytes_here = 0  # this rank's bytes sent + received
        for dst, route in zip(dsts, routes, strict=True):
            target = self.view.instances[dst]
            in_target = self.rank in target.mesh.devices
            info = self.routing.info(src, dst)
            names_shapes = [(k, torch.Size(shape)) for k, shape in info.shapes.items()]
            flat = flats.get(tuple(info.shapes))
            if route.pieces is not None:
                remote = sum((p.stop - p.start) * info.dtype_bytes for p in route.pieces if p.src != p.dst)
                targets[dst] = TargetReport("zero", remote)
                if self.rank not in route.verify_ranks:
                    continue
                checksum, moved_here = move_pieces(
                    route.pieces,
                    self.rank,
                    self._local(src, source=True) if in_source else {},
                    self._local(dst, source=False) if in_target else {},
                    self.groups.group(route.verify_ranks),
                )
                nbytes_here += moved_here
                self.count += 1
                if in_target:
                    if dst in self.hosted.engines:
                        refresh_master(self.hosted.engines[dst])
                    targets[dst] = TargetReport("zero", remote, checksum)
                    self.hosted.instances[dst].version = version
                    _log.info(
                        "ZeRO reallocation of '%s' v%d: instance %d -> %d, rank %d checksum %s",
                        target.model, version, src, dst, self.rank, checksum,
                    )  # fmt: skip
                continue
            if route.plan is not None:
                plan = route.plan
                targets[dst] = TargetReport("plan", plan.remote_bytes)
                if self.rank not in route.verify_ranks:
                    continue
                if self.replicas.streams(route, dst):
                    checksum, moved_here = self._stream_sync(src, dst, plan, route.verify_ranks, version)
                    nbytes_here += moved_here
                    self.count += 1
                    if in_target:
                        targets[dst] = TargetReport("plan", plan.remote_bytes, checksum)
                    continue
                names = tuple(info.shapes)
                if in_source and names not in shards:  # every parameter, or a LoRA model's adapters
                    shards[names] = source_shards(
                        self.hosted.instances[src].module, gather_dp=source.fsdp, names=names
                    )
                src_shards = shards[names] if in_source else {}
                dst_all = target_shards(self.hosted.instances[dst].module) if in_target else {}
                dst_shards = {k: v for k, v in dst_all.items() if k in info.shapes}  # an adapter sync's
                before = self._before_ema(dst) if in_target else None
                src_off = expected_boxes(info, source.mesh, self.rank) if in_source else None
                dst_off = expected_boxes(info, target.mesh, self.rank) if in_target else None
                execute_reallocation(
                    plan,
                    self.rank,
                    src_shards,
                    dst_shards,
                    dtype=info.dtypes,
                    groups=self.routing.realloc_groups,
                    src_offsets=src_off,
                    dst_offsets=dst_off,
                )
                checksum = verify_reallocation(
                    plan,
                    self.rank,
                    src_shards,
                    dst_shards,
                    src_offsets=src_off,
                    dst_offsets=dst_off,
                    group=self.groups.group(route.verify_ranks),
                )
                nbytes_here += plan_bytes_of(plan, self.rank)
                self.count += 1
                if in_target:
                    if dst in self.hosted.engines:
                        refresh_master(self.hosted.engines[dst])
                    ema_checksum = self._blend_ema(dst, before) or checksum
                    targets[dst] = TargetReport("plan", plan.remote_bytes, ema_checksum)
                    self.hosted.instances[dst].version = version
                    _log.info(
                        "reallocation of '%s' v%d: instance %d -> %d, rank %d checksum %s",
                        target.model, version, src, dst, self.rank, checksum,
                    )  # fmt: skip
                continue
            ranks = self.view.sync_ranks(src, dst)
            if self.rank not in ranks:
                targets[dst] = TargetReport("gather")
                continue
            numel = sum(int(torch.Size(s).numel()) for _, s in names_shapes)
            dtype = next(iter(info.dtypes.values()))  # rlflow models have one dtype
            buf = flat if flat is not None else torch.empty(numel, dtype=dtype, device=self.device)
            nbytes = numel * buf.element_size()
            moved = nbytes * (len(ranks) - 1)
            targets[dst] = TargetReport("gather", moved)
            if len(ranks) > 1:
                dist.broadcast(buf, src=ranks[0], group=self.groups.group(ranks))
                nbytes_here += nbytes * (len(ranks) - 1 if self.rank == ranks[0] else 1)
            if in_target:
                full: dict[str, torch.Tensor] = {}
                offset = 0
                for k, shape in names_shapes:
                    n = int(torch.Size(shape).numel())
                    full[k] = buf[offset : offset + n].view(shape)
                    offset += n
                before = self._before_ema(dst)
                partial = len(full) < len(self.routing.infos[src].shapes)  # an adapter sync
                if target.zero3:
                    load_zero_params(self.hosted.instances[dst].module, full, partial=partial)
                else:
                    load_full_params(self.hosted.instances[dst].module, full, partial=partial)
                if dst in self.hosted.engines:
                    refresh_master(self.hosted.engines[dst])
                self.hosted.instances[dst].version = version
                written = target_shards(self.hosted.instances[dst].module)
                checksum = self._blend_ema(dst, before) or weights_checksum(
                    {k: v for k, v in written.items() if k in info.shapes}
                )
                targets[dst] = TargetReport("gather", moved, checksum)
        return SyncReport(start, time.time(), nbytes_here, targets)

    def _stream_sync(
        self, src: int, dst: int, plan: ReallocPlan, ranks: tuple[int, ...], version: int
    ) -> tuple[str, int]:
        """Run the planned reallocation ``src -> dst`` unit by unit and stream each unit into ``dst``'s
        engines (:mod:`~rlflow.schedulers.runtime.distributed.stream_sync`; every rank of the route,
        ``ranks``, calls it). A target rank drives the units from the engines' probe forward and ends with
        the engines verified at ``version`` and the instance's parameters freed (``Replicas.released``); a
        source rank outside the target walks the units in order.

        Returns:
            this rank's checksum of the target (BLAKE2b over the units' checksums; "" off the target) and
            its bytes sent + received.

        Raises:
            ChecksumError: a unit's target region differs from its source region; NodeError,
                WeightSyncError: an engine failed to load or does not serve the weights (after every unit
                has moved, so no rank is left waiting).
        """
        import hashlib

        from rlflow.nodes.engines.probe import trainer_probe

        source, target = self.view.instances[src], self.view.instances[dst]
        in_source, in_target = self.rank in source.mesh.devices, self.rank in target.mesh.devices
        info = self.routing.info(src, dst)  # every weight: a LoRA model's instance is never streamed
        units = weight_units(info.shapes)
        unit_of_param = {name: k for k, (_, names) in enumerate(units) for name in names}
        per_unit: list[list[Transfer]] = [[] for _ in units]
        for t in plan.transfers:  # one pass: each unit's sub-plan, in the plan's order
            per_unit[unit_of_param[t.param]].append(t)
        subplans = [ReallocPlan(tuple(ts)) for ts in per_unit]
        src_module = self.hosted.instances[src].module if in_source else None
        src_off = expected_boxes(info, source.mesh, self.rank) if in_source else None
        dst_off = expected_boxes(info, target.mesh, self.rank) if in_target else None
        group = self.groups.group(ranks)
        realloc_groups = self.routing.realloc_groups
        engines = (
            [e for n in self.replicas.engine_only[dst] if (e := self.hosted.contexts[n].engine) is not None]
            if in_target
            else []
        )
        module = self.hosted.instances[dst].module if in_target else None
        aliases = list(module.named_parameters(remove_duplicate=False)) if module is not None else []
        names_of: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}  # parameter -> every name it goes by
        for alias, p in aliases:
            names_of.setdefault(id(p), []).append((alias, p))
        sums: list[str] = []

        def fill(k: int, params: dict[str, torch.nn.Parameter]) -> None:
            names = units[k][1]
            src_shards = (
                source_shards(src_module, gather_dp=source.fsdp, names=names)
                if src_module is not None
                else {}
            )
            dst_shards = target_shards(params)
            execute_reallocation(
                subplans[k], self.rank, src_shards, dst_shards, dtype=info.dtypes, groups=realloc_groups,
                src_offsets=src_off, dst_offsets=dst_off,
            )  # fmt: skip
            checksum = verify_reallocation(
                subplans[k], self.rank, src_shards, dst_shards, src_offsets=src_off, dst_offsets=dst_off,
                group=group,
            )  # fmt: skip
            sums.append(checksum)
            del src_shards  # an FSDP2 source's re-gathered unit
            # a tied head's name too: the engine re-packs the head only when it receives it (weight_buckets)
            named = [pair for p in params.values() for pair in names_of[id(p)]]
            for engine in engines:
                engine.load_unit(named)

        if not in_target:
            for k in range(len(units)):
                fill(k, {})
            return "", plan_bytes_of(plan, self.rank)
        assert module is not None
        state = self.hosted.instances[dst]
        if dst not in self.replicas.released:  # held since start-up: freed first, one unit at a time is held
            move_params(module.parameters(), torch.device("meta"))
        for engine in engines:
            engine.begin_sync()
        param_names = {k for k, _ in aliases}
        buffers = [(k, v) for k, v in module.state_dict().items() if k not in param_names]
        for engine in engines:  # persistent buffers (resident): one unit before the parameters
            if buffers:
                engine.load_unit(buffers)
        stream = UnitStream(module, units, fill, self.device)
        with stream:
            want = trainer_probe(module, self.device)
        stream.finish()
        self.replicas.released.add(dst)
        self.replicas.peaks[dst] = stream.peak_bytes
        for engine in engines:
            engine.end_sync(want, model=target.model, version=version)
        state.version = version
        checksum = hashlib.blake2b("".join(sums).encode(), digest_size=16).hexdigest()
        _log.info(
            "streamed reallocation of '%s' v%d: instance %d -> %d, rank %d, %d units, peak %d bytes, "
            "checksum %s",
            target.model, version, src, dst, self.rank, len(units), stream.peak_bytes, checksum,
        )  # fmt: skip
        return checksum, plan_bytes_of(plan, self.rank)

    def _before_ema(self, dst: int) -> dict[str, torch.Tensor] | None:
        """A copy of an EMA target's local shards before the source's weights overwrite them."""
        if dst not in self.view.ema:
            return None
        return {k: v.clone() for k, v in target_shards(self.hosted.instances[dst].module).items()}

    def _blend_ema(self, dst: int, before: dict[str, torch.Tensor] | None) -> str | None:
        """Blend an EMA target: its shards hold the source's weights, ``before`` its own; the checksum."""
        if before is None:
            return None
        now = target_shards(self.hosted.instances[dst].module)
        ema_update(before, now, self.view.ema[dst])
        for k, v in before.items():
            now[k].copy_(v)
        return weights_checksum(now)

    def _local(self, instance: int, *, source: bool) -> dict[str, torch.Tensor]:
        """This rank's local storages of ``instance`` for the ZeRO path (flat runs' storages)."""
        inst = self.view.instances[instance]
        module = self.hosted.instances[instance].module
        if inst.zero3:
            return zero_local(module)
        if source:
            return source_shards(module, gather_dp=inst.fsdp)
        return target_shards(module)
