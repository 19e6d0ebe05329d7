"""DeepSpeed ZeRO train nodes (``engine: deepspeed``) on a node's own data-parallel mesh.

A train node with ``engine: deepspeed`` keeps its model instance in a DeepSpeed engine (Rajbhandari et al.
2020, "ZeRO"; Ren et al. 2021, "ZeRO-Offload") instead of FSDP2:

* **Groups.** DeepSpeed's parallel groups default to the whole world; rlflow passes a model-parallel unit
  (:class:`NodeMPU`) whose data-parallel group is the node's ``dp`` group and whose model-parallel group is
  its (single-rank) ``tp`` group, both from the worker's :class:`GroupCache`, so the engine runs on the
  node's sub-mesh while other nodes (FSDP2, DTensor, other DeepSpeed nodes) run on other ranks.
* **Same maths.** The node function, loss, token-weighted normaliser (:class:`ZeroHooks.global_count`, an
  all-reduce over the node's dp group), micro-batch accumulation, gradient clipping (DeepSpeed's
  ``gradient_clipping``: ``g · min(1, c / (‖g‖ + 1e-6))`` over the partitioned gradients, as torch's
  ``clip_grad_norm_``) and learning-rate schedule (rlflow's ``LambdaLR``, stepped by the engine) are the
  FSDP2 path's: :func:`rlflow.nodes.train.optimize` drives both through
  :class:`rlflow.nodes.context.TrainHooks`. DeepSpeed averages gradients over dp; rlflow's losses are
  normalised by the global count, so :meth:`ZeroHooks.backward` scales each loss by ``dp`` (exact for a
  power-of-two dp) to get the sum, as FSDP2's divide factor 1 does.
* **CPU.** DeepSpeed's CPU accelerator with gloo; torch's AdamW (rlflow's optimizer, passed as DeepSpeed's
  client optimizer: no C++ Adam build); ``memory_efficient_linear`` off for stage 3 (DeepSpeed otherwise
  replaces ``torch.nn.functional.linear`` process-wide, for every other model in the worker too).
* **ZeRO-3 partitions.** Stage 3 keeps, on dp rank ``i`` of ``d``, the flat elements
  ``[i·s, min((i+1)·s, n))`` of every parameter of ``n`` elements (``s = ceil(n / d)``, DeepSpeed's
  ``_partition_param``), in ``param.ds_tensor``. :func:`zero_holdings` describes them, and any other layout's
  ``param_shards`` boxes, as contiguous flat runs; :func:`plan_pieces` cuts every run a target rank needs
  into pieces each held contiguously by one source rank (the target itself first), so a weight sync moves
  each rank's partition straight to where it is needed (one message per source/target pair, no gather
  of the whole model anywhere), and :func:`move_pieces` checks every piece by digest on both sides.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import itertools
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.dataflow.spec import DeepSpeedSpec, OptimizerSpec
from rlflow.schedulers.realloc.shards import Slice
from rlflow.schedulers.realloc.verify import ChecksumError, weights_checksum
from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks

__all__ = [
    "Holdings",
    "NodeMPU",
    "Piece",
    "ZeroHooks",
    "box_holdings",
    "box_runs",
    "build_engine",
    "deepspeed_config",
    "destroy_engine",
    "is_zero3",
    "load_zero_params",
    "load_zero_train_state",
    "move_pieces",
    "node_group",
    "partition_range",
    "plan_pieces",
    "refresh_master",
    "require_deepspeed",
    "zero_full_params",
    "zero_holdings",
    "zero_local",
    "zero_train_state",
]

_log = logging.getLogger("rlflow.realloc")
_TAG = 0x5A30  # point-to-point tag of a ZeRO-3 weight sync's messages


def require_deepspeed() -> Any:
    """Import DeepSpeed (``DS_BUILD_OPS=0`` builds: no op is compiled at import).

    Raises:
        ImportError: one line naming the extra to install.
    """
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # its CPU accelerator, without the detection warning
    try:
        import deepspeed
    except ImportError:
        raise ImportError("engine: deepspeed needs DeepSpeed: pip install 'rlflow[deepspeed]'") from None
    # The CPU communication backend JIT-compiles a shared-memory all-reduce (20-30 s, a C++ toolchain) that
    # only DeepSpeed's inference kernels call; rlflow's collectives are gloo's. DeepSpeed keeps one
    # compatibility table per process for such edits.
    if not torch.cuda.is_available():
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    from deepspeed.runtime.zero import partitioned_param_coordinator

    partitioned_param_coordinator.assert_ints_same_as_other_ranks = _same_on_node
    return deepspeed


# The dp group of the ZeRO node running in this process (set around its calls: ZeroHooks, node_group).
_NODE_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("rlflow_zero_node_group", default=None)


@contextlib.contextmanager
def node_group(group: Any) -> Iterator[None]:
    """Around a call into a ZeRO-3 module: the group :func:`_same_on_node` checks on."""
    token = _NODE_GROUP.set(group)
    try:
        yield
    finally:
        _NODE_GROUP.reset(token)


def _same_on_node(ints: list[int]) -> None:
    """DeepSpeed's check that ZeRO-3 recorded the same module and parameter order on every rank, on the
    node's dp group: DeepSpeed 0.19 broadcasts it from world rank 0 (``zero/utils.py``), which ranks outside
    the node never join. Outside a node's call (no group set) there is nothing to compare with.

    Raises:
        RuntimeError: the ranks recorded different orders.
    """
    group = _NODE_GROUP.get()
    if group is None:
        return
    lists: list[Any] = [None] * int(dist.get_world_size(group))
    dist.all_gather_object(lists, list(ints), group=group)
    if any(other != lists[0] for other in lists):
        raise RuntimeError(f"ZeRO-3 ranks recorded different module orders: {lists}")


def deepspeed_config(spec: DeepSpeedSpec, optimizer: OptimizerSpec, dtype: torch.dtype) -> dict[str, Any]:
    """The DeepSpeed config of a node: ZeRO ``stage``, offload devices, gradient clipping, precision.

    One micro-batch per engine step as DeepSpeed counts them (``gradient_accumulation_steps: 1``): rlflow
    accumulates its own micro-batches and marks the boundary (:meth:`ZeroHooks.backward`). A bfloat16/float16
    model trains with DeepSpeed's fp32 master weights (its ``bf16``/``fp16`` modes).
    """
    # a rigid checkpoint: each rank saves and loads its own partition (load_zero_train_state)
    zero: dict[str, Any] = {"stage": spec.zero_stage, "elastic_checkpoint": False}
    if spec.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": spec.offload_optimizer, "pin_memory": False}
    if spec.offload_param != "none":
        zero["offload_param"] = {"device": spec.offload_param, "pin_memory": False}
    if spec.zero_stage == 3:
        # DeepSpeed otherwise patches torch.nn.functional.linear for the whole process
        zero["memory_efficient_linear"] = False
        # every parameter partitioned (the default keeps those under 1e5 elements whole on every rank)
        zero["stage3_param_persistence_threshold"] = 0
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": float(optimizer.grad_clip),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW as the client optimizer
        "zero_force_ds_cpu_optimizer": False,  # ... also with optimizer offload (no C++ CPU Adam build)
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
    elif dtype == torch.float16:
        config["fp16"] = {"enabled": True, "loss_scale": 0}
    return config


class NodeMPU:
    """DeepSpeed's model-parallel unit for one node: its data-parallel group and its single-rank model
    (tensor) parallel group, so the engine's collectives stay on the node's ranks."""

    def __init__(self, dp_group: Any, tp_group: Any) -> None:
        self.dp_group = dp_group
        self.tp_group = tp_group

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return int(dist.get_world_size(self.dp_group))

    def get_data_parallel_rank(self) -> int:
        return int(dist.get_rank(self.dp_group))

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def build_engine(
    module: nn.Module,
    spec: DeepSpeedSpec,
    optimizer_spec: OptimizerSpec,
    total_steps: int,
    dp_group: Any,
    tp_group: Any,
) -> Any:
    """Wrap ``module`` (full weights, identical on every dp rank) in a DeepSpeed engine on the node's groups.

    rlflow's AdamW and learning-rate schedule (:func:`rlflow.nodes.train.build_optimizer`) are the engine's
    client optimizer and scheduler. Collective over ``dp_group`` only (no group is created).

    Returns:
        the engine: ``engine.module`` (stage 3: partitioned in place), ``engine.optimizer`` (the ZeRO
        optimizer), ``engine.lr_scheduler``.

    Raises:
        ImportError: DeepSpeed is not installed (naming the extra).
    """
    deepspeed = require_deepspeed()
    from rlflow.nodes.train import build_optimizer

    optimizer, scheduler = build_optimizer(module, optimizer_spec, total_steps)
    # DeepSpeed's launcher check; the device is the worker's (its current CUDA device, or the CPU)
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))
    dtype = next(module.parameters()).dtype
    with _quiet(), _barriers_on(deepspeed, dp_group), node_group(dp_group):
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(spec, optimizer_spec, dtype),
            mpu=NodeMPU(dp_group, tp_group),
            dist_init_required=False,
        )
    return engine


def destroy_engine(engine: Any) -> None:
    """Release a DeepSpeed engine's hooks and buffers (teardown: errors of an engine whose process group is
    already gone are ignored; nothing is left to release then)."""
    with contextlib.suppress(Exception):
        engine.destroy()


def zero_train_state(state: Any, engine: Any, stage: int, dp: int) -> dict[str, Any]:
    """A DeepSpeed instance's train state for checkpoints: the weight version and LR schedule as the FSDP2
    path saves them (``optimizer`` is ``None``: torch's AdamW cannot read ZeRO partitions), plus under
    ``zero`` this rank's ZeRO optimizer state (its partition of the Adam moments and fp32 master weights)
    with the stage and dp degree it was written under."""
    return {
        "version": state.version,
        "optimizer": None,
        "scheduler": engine.lr_scheduler.state_dict(),
        "zero": {"stage": stage, "dp": dp, "optimizer": engine.optimizer.state_dict()},
    }


def load_zero_train_state(state: Any, engine: Any, stage: int, dp: int, saved: Mapping[str, Any]) -> bool:
    """Restore a saved train state into a DeepSpeed instance whose module already holds the checkpoint's
    weights: the weight version and LR schedule always; the ZeRO optimizer state when it was written by the
    same stage on the same dp degree (each rank reads its own partition), else the Adam moments start from
    zero (a different stage, or a checkpoint of the FSDP2 path) and the master weights from the loaded
    weights. Returns whether the optimizer state was restored."""
    state.version = int(saved["version"])
    if saved.get("scheduler") is not None:
        engine.lr_scheduler.load_state_dict(saved["scheduler"])
    zero = saved.get("zero")
    if zero is not None and int(zero["stage"]) == stage and int(zero["dp"]) == dp:
        # DeepSpeed indexes the list by dp rank and, for a rigid (not elastic) checkpoint, reads only its own
        # entry: the Adam moments and the fp32 master partition (exact also for a bf16 model)
        engine.optimizer.load_state_dict(
            [zero["optimizer"]] * dp, load_optimizer_states=True, load_from_fp32_weights=True
        )
        return True
    refresh_master(engine)
    return False


@contextlib.contextmanager
def _barriers_on(deepspeed: Any, group: Any) -> Iterator[None]:
    """While the engine is set up, a DeepSpeed barrier without a group waits on the node's ``group``.

    DeepSpeed 0.19's ZeRO-3 set-up calls ``dist.barrier()`` on the whole world three times
    (``stage3.py``: fp16 and fp32 partitions, optimizer states); ranks outside the node never join it, so an
    engine on a sub-mesh would wait forever.
    """
    comm = deepspeed.comm
    world_barrier = comm.barrier

    def barrier(group_: Any = None, *args: Any, **kwargs: Any) -> Any:
        return world_barrier(group if group_ is None else group_, *args, **kwargs)

    comm.barrier = barrier
    try:
        yield
    finally:
        comm.barrier = world_barrier


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DeepSpeed logs its whole config at INFO on every rank; keep warnings only."""
    logger = logging.getLogger("DeepSpeed")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class ZeroHooks(DataParallelHooks):
    """:class:`rlflow.nodes.context.TrainHooks` of a DeepSpeed node: the dp all-reduces of
    :class:`DataParallelHooks` (batch statistics, the loss normaliser), DeepSpeed's backward and step.

    * :meth:`backward` marks the gradient-accumulation boundary at the mini-batch's last micro-batch (where
      ZeRO reduces) and back-propagates ``dp · loss`` through the engine (DeepSpeed averages over dp; rlflow's
      normaliser already counts the whole global mini-batch, so the sum is wanted).
    * :meth:`step` is ``engine.step()``: DeepSpeed computes the global norm over the partitions, clips
      (``gradient_clipping``), skips the update when the norm is not finite, steps the optimizer and the LR
      schedule and clears the gradients; returns that norm (``inf`` when the update was skipped).
    """

    def __init__(self, engine: Any, dp_group: Any, dp: int) -> None:
        super().__init__(engine.module, dp_group, dp)
        self.engine = engine
        self._scope = contextlib.ExitStack()

    def __enter__(self) -> ZeroHooks:
        super().__enter__()
        self._scope.enter_context(node_group(self.dp_group))
        return self

    def __exit__(self, *exc: object) -> None:
        self._scope.close()
        super().__exit__(*exc)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(bool(last))
        self.engine.backward(loss * self.dp if self.dp > 1 else loss, scale_wrt_gas=False)
        # what engine.forward does first (rlflow calls engine.module directly): ZeRO-3 then counts this
        # micro-batch, so the next one accumulates into the partitioned gradients instead of replacing them
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    def step(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        max_norm: float,
    ) -> torch.Tensor:
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        if not self.engine.was_step_applied() or norm is None:
            return torch.tensor(float("inf"))
        return torch.as_tensor(float(norm), dtype=torch.float32)


# -- ZeRO-3 partitions --------------------------------------------------------------------------------


def is_zero3(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (DeepSpeed's ``ds_tensor``)."""
    return any(hasattr(p, "ds_tensor") for p in module.parameters())


def partition_range(numel: int, dp: int, dp_rank: int) -> tuple[int, int]:
    """The flat elements ``[start, stop)`` of an ``numel``-element parameter that ZeRO-3 keeps on dp rank
    ``dp_rank`` of ``dp`` (DeepSpeed's ``_partition_param``: ``ceil(numel / dp)`` per rank, last padded)."""
    size = -(-numel // dp)
    return min(numel, dp_rank * size), min(numel, (dp_rank + 1) * size)


def zero_local(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's ZeRO-3 partitions: name -> the flat real elements of ``param.ds_tensor`` (padding cut;
    shares storage, so writing them writes the partition)."""
    out: dict[str, torch.Tensor] = {}
    p: Any  # a ZeRO-3 parameter: DeepSpeed's ds_* attributes
    for name, p in module.named_parameters():
        part = p.ds_tensor.data.view(-1)
        dp = int(dist.get_world_size(p.ds_process_group))
        start, stop = partition_range(int(p.ds_numel), dp, int(dist.get_rank(p.ds_process_group)))
        out[name] = part[: stop - start]
    return out


@torch.no_grad()
def zero_full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor, gathered from the ZeRO-3 partitions (collective on the node's dp
    group, one parameter at a time; copies, in ``named_parameters`` order)."""
    deepspeed = require_deepspeed()
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            out[name] = p.data.detach().clone()
    return out


@torch.no_grad()
def load_zero_params(module: nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Write full tensors into this rank's ZeRO-3 partitions (no collective); call :func:`refresh_master`
    afterwards so the optimizer's master copy follows."""
    params: dict[str, Any] = dict(module.named_parameters())  # ZeRO-3 parameters (ds_* attributes)
    for name, local in zero_local(module).items():
        p = params[name]
        dp = int(dist.get_world_size(p.ds_process_group))
        start, stop = partition_range(int(p.ds_numel), dp, int(dist.get_rank(p.ds_process_group)))
        local.copy_(full[name].reshape(-1)[start:stop].to(local.dtype))


def refresh_master(engine: Any) -> None:
    """After the module's weights were overwritten (a weight sync into a ZeRO instance, a loaded checkpoint),
    copy them into the ZeRO optimizer's fp32 master partitions (DeepSpeed's ``refresh_fp32_params``), else
    its next step would write the old weights back."""
    refresh = getattr(engine.optimizer, "refresh_fp32_params", None)
    if refresh is not None:
        refresh()


# -- moving ZeRO-3 partitions to other layouts (and back) -------------------------------------------

Run = tuple[int, int, int]  # (flat start, flat stop) of the full tensor, and the local flat offset of start


def box_runs(shape: Sequence[int], box: Slice) -> list[Run]:
    """The contiguous flat runs of the full row-major tensor ``shape`` that a local shard ``box`` holds, with
    their offsets in the shard's own (row-major, contiguous) storage, in order.

    The trailing dims the box spans whole merge into each run, so a dim-0 block is one run and a dim-1 block
    of a matrix is one run per row.
    """
    dims = [int(n) for n in shape]
    if not dims:
        return [(0, 1, 0)]
    k = len(dims) - 1
    while k > 0 and box[k].start == 0 and box[k].stop == dims[k]:
        k -= 1
    inner = 1
    for n in dims[k + 1 :]:
        inner *= n
    strides = [1] * len(dims)
    for i in range(len(dims) - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1]
    width = (box[k].stop - box[k].start) * inner
    runs: list[Run] = []
    local = 0
    for idx in itertools.product(*(range(box[i].start, box[i].stop) for i in range(k))):
        start = sum(i * s for i, s in zip(idx, strides, strict=False)) + box[k].start * strides[k]
        runs.append((start, start + width, local))
        local += width
    return [r for r in runs if r[1] > r[0]]


# rank -> parameter -> runs it holds
Holdings = dict[int, dict[str, list[Run]]]


def zero_holdings(shapes: Mapping[str, Sequence[int]], devices: Sequence[int]) -> Holdings:
    """What each rank of a ZeRO-3 mesh (dp ranks ``devices``) holds: one run per parameter."""
    out: Holdings = {}
    for i, rank in enumerate(devices):
        out[int(rank)] = {}
        for name, shape in shapes.items():
            n = 1
            for d in shape:
                n *= int(d)
            start, stop = partition_range(n, len(devices), i)
            if stop > start:
                out[int(rank)][name] = [(start, stop, 0)]
    return out


def box_holdings(shapes: Mapping[str, Sequence[int]], boxes: Mapping[int, Mapping[str, Slice]]) -> Holdings:
    """What each rank of another layout holds: its ``param_shards`` boxes as runs (:func:`box_runs`)."""
    return {
        int(rank): {name: box_runs(shapes[name], box) for name, box in per.items()}
        for rank, per in boxes.items()
    }


@dataclass(frozen=True)
class Piece:
    """One contiguous run of a parameter moved from ``src`` to ``dst``: full-tensor flat elements
    ``[start, stop)``, at ``src_offset`` in the source's local storage and ``dst_offset`` in the target's."""

    param: str
    src: int
    dst: int
    start: int
    stop: int
    src_offset: int
    dst_offset: int


def plan_pieces(source: Holdings, target: Holdings, params: Sequence[str]) -> list[Piece]:
    """Cut every run a target rank holds into pieces each held whole by one source rank.

    Sources are tried in order: the target rank itself (a local copy), then the others by distance from it in
    rank order (spreading the sends of replicated sources); every element of every target run is covered
    exactly once. Pure: every rank computes the same list (order: parameter, target rank, start).

    Raises:
        ValueError: an element a target needs is held by no source rank.
    """
    ranks = sorted(source)
    pieces: list[Piece] = []
    for name in params:
        for dst in sorted(target):
            for t_start, t_stop, t_off in target[dst].get(name, []):
                order = sorted(ranks, key=functools.partial(_preference, dst, max(ranks) + 1))
                todo = [(t_start, t_stop)]
                for src in order:
                    if not todo:
                        break
                    left: list[tuple[int, int]] = []
                    for a, b in todo:
                        for s_start, s_stop, s_off in source[src].get(name, []):
                            lo, hi = max(a, s_start), min(b, s_stop)
                            if lo < hi:
                                pieces.append(
                                    Piece(name, src, dst, lo, hi, s_off + lo - s_start, t_off + lo - t_start)
                                )
                        left += _uncovered(a, b, source[src].get(name, []))
                    todo = left
                if todo:
                    raise ValueError(f"no source rank holds elements {todo[0]} of {name!r}")
    pieces.sort(key=lambda p: (params.index(p.param), p.dst, p.start))
    return pieces


def _preference(dst: int, n: int, src: int) -> tuple[bool, int]:
    """Source order for target ``dst``: itself first, then by distance after it in rank order (mod ``n``)."""
    return src != dst, (src - dst) % n


def _uncovered(a: int, b: int, runs: Sequence[Run]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    pos = a
    for s, e, _ in sorted(runs):
        if e <= pos or s >= b:
            continue
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < b:
        out.append((pos, b))
    return out


def _digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().data, digest_size=16).hexdigest()


@torch.no_grad()
def move_pieces(
    pieces: Sequence[Piece],
    rank: int,
    src_local: Mapping[str, torch.Tensor],
    dst_local: Mapping[str, torch.Tensor],
    group: Any,
) -> tuple[str, int]:
    """Move this rank's pieces (one point-to-point message per source/target pair, local copies where a
    rank holds both) and verify every piece by BLAKE2b digest on both sides.

    Args:
        pieces: :func:`plan_pieces`' list (identical on every rank).
        rank: this rank.
        src_local, dst_local: this rank's source / target local storages by parameter, flattened
            (contiguous views: the target's are written in place); ``{}`` off that side.
        group: the process group of every rank of both sides (the digests' ``all_gather_object``); all of
            them call this.

    Returns:
        ``(checksum, bytes)``: ``weights_checksum`` of this rank's target storages ("" off the target) and
        the bytes this rank sent plus received.

    Raises:
        ChecksumError: naming the parameter, elements and ranks of every mismatching piece (first 5).
    """
    src_flat = {k: v.reshape(-1) for k, v in src_local.items()}
    dst_flat = {k: v.reshape(-1) for k, v in dst_local.items()}
    sends: dict[int, list[Piece]] = {}
    recvs: dict[int, list[Piece]] = {}
    for p in pieces:
        if p.src == rank and p.dst == rank:
            n = p.stop - p.start
            dst_flat[p.param][p.dst_offset : p.dst_offset + n].copy_(
                src_flat[p.param][p.src_offset : p.src_offset + n]
            )
        elif p.src == rank:
            sends.setdefault(p.dst, []).append(p)
        elif p.dst == rank:
            recvs.setdefault(p.src, []).append(p)
    nbytes = 0
    works: list[Any] = []
    buffers: dict[int, torch.Tensor] = {}
    for dst, items in sorted(sends.items()):
        buf = torch.cat([src_flat[p.param][p.src_offset : p.src_offset + p.stop - p.start] for p in items])
        works.append(dist.isend(buf, dst, tag=_TAG))
        buffers[-1 - dst] = buf  # kept alive until sent
        nbytes += buf.numel() * buf.element_size()
    for src, items in sorted(recvs.items()):
        like = dst_flat[items[0].param]
        buf = torch.empty(sum(p.stop - p.start for p in items), dtype=like.dtype, device=like.device)
        works.append(dist.irecv(buf, src, tag=_TAG))
        buffers[src] = buf
        nbytes += buf.numel() * buf.element_size()
    for w in works:
        if w is not None:
            w.wait()
    for src, items in sorted(recvs.items()):
        buf, pos = buffers[src], 0
        for p in items:
            n = p.stop - p.start
            dst_flat[p.param][p.dst_offset : p.dst_offset + n].copy_(buf[pos : pos + n])
            pos += n
    # verification: every piece digested where it came from and where it landed
    mine: dict[int, tuple[str, str]] = {}
    for i, p in enumerate(pieces):
        n = p.stop - p.start
        s = _digest(src_flat[p.param][p.src_offset : p.src_offset + n]) if p.src == rank else ""
        d = _digest(dst_flat[p.param][p.dst_offset : p.dst_offset + n]) if p.dst == rank else ""
        if s or d:
            mine[i] = (s, d)
    gathered: list[Any] = [None] * int(dist.get_world_size(group))
    dist.all_gather_object(gathered, mine, group=group)
    src_d: dict[int, str] = {}
    dst_d: dict[int, str] = {}
    for part in gathered:
        for i, (s, d) in part.items():
            if s:
                src_d[i] = s
            if d:
                dst_d[i] = d
    bad = [
        f"{p.param}[{p.start}:{p.stop}] rank {p.src} -> rank {p.dst}"
        for i, p in enumerate(pieces)
        if src_d.get(i) is None or src_d.get(i) != dst_d.get(i)
    ]
    if bad:
        more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
        raise ChecksumError(
            f"ZeRO reallocation checksum mismatch in {len(bad)} piece(s): " + "; ".join(bad[:5]) + more
        )
    return (weights_checksum(dict(dst_local)) if dst_local else ""), nbytes
