"""One vLLM engine per tensor-parallel group of a generate node (layout ``d{dp}t{tp}``, ``tp`` > 1).

The distributed runtime gives every rank of a generate node's tp group a :class:`GroupEngine` in its
``ctx.engine``: an :class:`~rlflow.nodes.engines.protocol.Engine`, as
:class:`~rlflow.nodes.engines.vllm_engine.VllmEngine` is. The group's first rank (tp coordinate 0, the
*leader*) holds the engine: a ``VllmEngine(tensor_parallel_size=tp)`` whose ``tp`` workers run in vLLM's
processes, on CUDA on the group's own GPUs. Every call is collective over the group:

- ``generate``: every rank draws the per-row seeds from the node's generator as the leader does (the
  generators stay in step, so a run resumed from a checkpoint draws the same); the leader generates and
  broadcasts the rows. A failed engine does not leave the others waiting: the leader broadcasts the
  failure instead, and every rank raises a :class:`~rlflow.dataflow.errors.NodeError` naming the node, the
  model and the leader's rank.
- ``sync``: the model instance is tensor parallel (DTensor shards). Its full tensors are gathered bucket by
  bucket (:func:`~rlflow.nodes.engines.weight_transport.weight_buckets`, collective) and the leader sends each
  bucket to the engine (on CUDA as IPC handles from every rank's GPU, merged at the leader), then frees
  it; the probe forward of the sharded module is collective, the leader compares it with the engine and
  broadcasts the gap, and every rank raises the same ``WeightSyncError`` when it is too large.
- ``begin_sync`` / ``load_unit`` / ``end_sync``: the same load, unit by unit as the runtime streams a weight
  sync (:mod:`rlflow.schedulers.runtime.distributed.stream_sync`), verified against the probe log-probs of
  the streamed forward.

Only the leader reports the node's metrics (the runtime's dp leaders), so the bytes and seconds of a sync
are counted once per engine: the full model, sent once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.context import NodeContext
from rlflow.nodes.engines.probe import check_probe_gap, trainer_probe
from rlflow.nodes.engines.protocol import SyncStats
from rlflow.nodes.engines.sizing import engine_sleep_mode
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.engines.vllm_sampling import draw_seeds
from rlflow.nodes.engines.weight_transport import BUCKET_BYTES, ipc_handles, weight_buckets, write_hf_dir

__all__ = ["GroupEngine", "physical_device", "start_group_engine"]


def physical_device() -> str:
    """This process's CUDA device as ``CUDA_VISIBLE_DEVICES`` of its parent names it (an index or UUID)."""
    index = torch.cuda.current_device()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


class GroupEngine:
    """A tp group's view of its one vLLM engine (every rank of the group holds one).

    Args:
        engine: the engine on the leader; ``None`` on the other ranks.
        group: the tp group's process group; ``ranks``: its global ranks, leader first.
        where: ``node 'x' (model 'y')`` for error messages.
        bucket_bytes: bytes per bucket of a weight sync (the same on every rank).
        on_cuda, dtype: where the model lives and its dtype (the gathered tensors'), as the leader's engine.
    """

    def __init__(
        self,
        engine: VllmEngine | None,
        group: Any,
        ranks: Sequence[int],
        *,
        where: str,
        bucket_bytes: int,
        on_cuda: bool,
        dtype: torch.dtype,
    ) -> None:
        self.engine = engine
        self.group = group
        self.ranks = tuple(int(r) for r in ranks)
        self.leader = self.ranks[0]
        # by rank, not by holding an engine: a leader whose engine failed to start still sends the error
        self.is_leader = dist.get_rank() == self.leader
        self.where = where
        self.bucket_bytes = int(bucket_bytes)
        self.on_cuda = on_cuda
        self.dtype = dtype
        self.weight_version: int | None = None  # the same on every rank (set by collective calls only)
        self.restarts: int | None = None  # not restarted in place (a collective restart: not built)
        self.streamed: SyncStats | None = None  # the last streamed sync's stats, until the node reports them
        self._stream: dict[str, Any] = {}

    # -- collective status ----------------------------------------------------------------------------
    def _share(self, value: Any) -> Any:
        """The leader's ``value`` on every rank (``broadcast_object_list`` over the tp group)."""
        box = [value if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def _text(self, error: Exception) -> str:
        """One line for a failure of the leader's engine (a NodeError already names the node and model)."""
        if isinstance(error, NodeError):
            return str(error)
        return f"{self.where}: the vLLM engine failed: {type(error).__name__}: {' '.join(str(error).split())}"

    def _follower_error(self, what: str, error: str) -> NodeError:
        return NodeError(
            f"{self.where}: the vLLM engine of this tensor-parallel group (on rank {self.leader}) failed "
            f"during {what}: {error}"
        )

    # -- generation -----------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        n: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        max_new_tokens: int,
        greedy: bool,
        stop_token_ids: Sequence[int],
        pad_id: int,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`VllmEngine.generate` on the leader, its rows on every rank (same shapes and meaning).

        Every rank passes the same prompts (its dp shard) and draws ``B·n`` seeds from ``generator``.

        Raises:
            NodeError: on the leader its engine's error; on the others one naming the node, model, the
                leader's rank and that error.
        """
        error: Exception | None = None
        payload: Any = None
        if self.engine is not None:
            try:
                out = self.engine.generate(
                    prompt_ids, prompt_mask, n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                    max_new_tokens=max_new_tokens, greedy=greedy, stop_token_ids=stop_token_ids,
                    pad_id=pad_id, generator=generator,
                )  # fmt: skip
                payload = ("ok", tuple(t.cpu() for t in out))
            except Exception as e:  # any failure is broadcast: the others must not wait for rows
                error, payload = e, ("error", self._text(e))
        else:
            draw_seeds(prompt_ids.shape[0] * n, generator)  # in step with the leader's draws
        status, value = self._share(payload)
        if error is not None:
            raise error
        if status != "ok":
            raise self._follower_error("generation", value)
        ids, mask, lp = value
        dev = prompt_ids.device
        return ids.to(dev), mask.to(dev), lp.to(dev)

    # -- weights --------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.on_cuda else torch.device("cpu")

    def begin_sync(self) -> None:
        """Start a weight sync whose tensors arrive in units (:meth:`load_unit`, collective), ended by
        :meth:`end_sync` (collective). The leader's failures are kept until :meth:`end_sync`, so that every
        rank goes on gathering (no rank waits in a collective)."""
        self.weight_version = None
        self._stream = {"start": time.perf_counter(), "bytes": 0, "error": None}
        if self.engine is not None:
            try:
                self.engine.begin_load()
            except Exception as e:
                self._stream["error"] = self._text(e)

    def load_unit(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """One unit of Hugging Face-named tensors, given on every rank of the group in step (collective):
        a DTensor (tp shard) is gathered to its full tensor (``full_tensor``), converted to the engine's
        device and dtype, and the leader loads the unit as one bucket; on CUDA as IPC handles from every
        rank's GPU, merged at the leader (each rank keeps its tensors until the engine has read them)."""
        from torch.distributed.tensor import DTensor

        device = self._device()
        bucket = [
            (
                k,
                (v.full_tensor() if isinstance(v, DTensor) else v)
                .detach()
                .to(device, self.dtype)
                .contiguous(),
            )
            for k, v in named
        ]
        handles = None
        if self.on_cuda:  # each rank's full tensors on its own GPU; merged at the leader
            mine = ipc_handles(bucket)
            gathered: list[Any] | None = [None] * len(self.ranks) if self.is_leader else None
            torch.cuda.synchronize()
            dist.gather_object(mine, gathered, dst=self.leader, group=self.group)
            if gathered is not None:
                handles = [{k: v for per in gathered for k, v in per[i].items()} for i in range(len(mine))]
        if self.engine is not None and self._stream["error"] is None:
            try:
                self._stream["bytes"] += self.engine.load_bucket(bucket, handles)
            except Exception as e:
                self._stream["error"] = self._text(e)
        if self.on_cuda:  # the others keep their tensors until the engine has read them
            self._share(None)

    def _end_load(self) -> tuple[int, float]:
        """The leader ends its load; every rank raises its first failure (collective). Returns the bytes
        (the leader's; 0 elsewhere) and seconds since :meth:`begin_sync`."""
        stream, self._stream = self._stream, {}
        if self.engine is not None and stream["error"] is None:
            try:
                self.engine.end_load()
            except Exception as e:
                stream["error"] = self._text(e)
        error = self._share(stream["error"])
        if error is not None:
            if self.is_leader:
                raise NodeError(error)
            raise self._follower_error("a weight load", error)
        return stream["bytes"], time.perf_counter() - stream["start"]

    def end_sync(self, want: torch.Tensor, *, model: str, version: int) -> SyncStats:
        """Finish a streamed sync and verify it against the trainer's probe log-probs ``want`` ``[K,L-1]``
        (every rank's, from the streamed forward); collective. Keeps the stats for :attr:`streamed`.

        Raises:
            NodeError, WeightSyncError: as :meth:`sync`.
        """
        nbytes, seconds = self._end_load()
        start = time.perf_counter()
        gap = self._compare(want, model=model, version=version)
        self.streamed = SyncStats(nbytes, seconds, time.perf_counter() - start, gap)
        return self.streamed

    def verify(self, module: nn.Module, *, model: str, version: int) -> tuple[float, float]:
        """The probe on every rank: the sharded module's forward (collective), the engine's log-probs on the
        leader, the gap broadcast. Returns ``(gap in nats, seconds)``; records ``version``.

        Raises:
            rlflow.nodes.engines.probe.WeightSyncError: on every rank, naming the node, model and
                version, when the gap exceeds the tolerance; NodeError: the leader's engine failed (every
                rank).
        """
        start = time.perf_counter()
        gap = self._compare(trainer_probe(module), model=model, version=version)
        return gap, time.perf_counter() - start

    def _compare(self, want: torch.Tensor, *, model: str, version: int) -> float:
        """The leader's engine probe against ``want``, the gap broadcast and checked on every rank."""
        payload: Any = None
        error: Exception | None = None
        if self.engine is not None:
            try:
                payload = ("ok", float((self.engine.probe_logprobs() - want).abs().max()))
            except Exception as e:  # any failure is broadcast: the others must not wait for rows
                error, payload = e, ("error", self._text(e))
        status, value = self._share(payload)
        if error is not None:
            raise error
        if status != "ok":
            raise self._follower_error("the weight probe", value)
        gap = float(value)
        check_probe_gap(self.where, gap, model=model, version=version)
        self.weight_version = version
        return gap

    def sync(self, module: nn.Module, *, model: str, version: int) -> SyncStats:
        """Stream ``module``'s weights into the engine in buckets of :attr:`bucket_bytes`, then
        :meth:`verify` (collective).

        Returns:
            on the leader the bytes sent (the full model, once), load and verify seconds and the gap; the
            other ranks return their own seconds and 0 bytes (the runtime reports the leader's metrics).

        Raises:
            NodeError: the leader's engine failed to load (every rank); WeightSyncError: as :meth:`verify`.
        """
        self.begin_sync()
        for bucket in weight_buckets(module, self.bucket_bytes, self._device(), self.dtype):
            self.load_unit(bucket)
            del bucket
        nbytes, seconds = self._end_load()
        gap, verify_s = self.verify(module, model=model, version=version)
        return SyncStats(nbytes, seconds, verify_s, gap)

    def sleep(self) -> None:
        """Put the leader's engine to sleep (:meth:`VllmEngine.sleep`; not collective: its next call, which
        is, wakes it)."""
        if self.engine is not None:
            self.engine.sleep()

    def close(self) -> None:
        """Stop the leader's engine (idempotent; not collective)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def start_group_engine(
    ctx: NodeContext,
    group: Any,
    ranks: Sequence[int],
    *,
    max_rows: int,
    seed: int,
    gpu_memory_utilization: float | None = None,
    device_memory: float | None = None,
    max_model_len: int | None = None,
    bucket_bytes: int = BUCKET_BYTES,
) -> GroupEngine:
    """Start the tp group's engine (collective over ``ranks``, leader first: every rank of the group calls
    it): each rank reports its physical GPU (CUDA), every rank gathers the full weights bucket by bucket
    and the leader writes them (:func:`write_hf_dir`), the leader alone starts a
    ``VllmEngine(tensor_parallel_size=len(ranks))`` on them and broadcasts whether it started, then the
    group verifies it.

    Raises:
        NodeError: on every rank when the group's ranks are not on one host (vLLM's ``mp`` executor starts
            its TP workers on the leader's host; naming each rank's host), when the leader's engine cannot
            start or does not serve the weights (the others name the leader's rank); a started engine is
            closed first.
    """
    import socket

    if ctx.model is None:
        raise NodeError(f"node '{ctx.node.name}': engine vllm needs a model")
    state = ctx.model
    where = f"node '{ctx.node.name}' (model '{state.name}')"
    hosts: list[Any] = [None] * len(ranks)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        spread = ", ".join(f"rank {r} on {h}" for r, h in zip(ranks, hosts, strict=True))
        raise NodeError(
            f"{where}: the vLLM engine at tensor parallel {len(ranks)} needs its tp group on one host (vLLM "
            f"starts its TP workers on the leader's host); the group spans hosts: {spread}"
        )
    bucket = int(bucket_bytes)
    module = state.module
    on_cuda = next(module.parameters()).device.type == "cuda"
    dtype = next(module.parameters()).dtype
    leader = dist.get_rank() == ranks[0]
    devices: list[Any] | None = None
    if on_cuda:
        devices = [None] * len(ranks)
        dist.all_gather_object(devices, physical_device(), group=group)
    # the full weights, gathered by every rank, written by the leader, before the leader alone starts
    weights_dir = tempfile.mkdtemp(prefix="rlflow-vllm-") if leader else None
    write_hf_dir(module, state.tokenizer, weights_dir, bucket)
    engine: VllmEngine | None = None
    error: str | None = None
    if leader:
        try:
            engine = VllmEngine(
                module, state.tokenizer, where=where, max_rows=max_rows, seed=seed % 2**31,
                gpu_memory_utilization=gpu_memory_utilization, device_memory=device_memory,
                max_model_len=max_model_len, tensor_parallel_size=len(ranks), devices=devices,
                bucket_bytes=bucket,
                weights_dir=weights_dir, sleep_mode=engine_sleep_mode(ctx.node.args),
            )  # fmt: skip
        except Exception as e:  # any failure reaches the group, which would otherwise wait in the verify
            error = str(e) if isinstance(e, NodeError) else f"{where}: the vLLM engine failed to start: {e!r}"
            shutil.rmtree(str(weights_dir), ignore_errors=True)  # a start that failed early leaves it
    out = GroupEngine(engine, group, ranks, where=where, bucket_bytes=bucket, on_cuda=on_cuda, dtype=dtype)
    error = out._share(error)
    if error is not None:
        out.close()
        raise NodeError(error) if leader else out._follower_error("its start", error)
    try:
        out.verify(module, model=state.name, version=state.version)
    except BaseException:
        out.close()
        raise
    return out
