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
  ``_partition_param``), in ``param.ds_tensor`` (:func:`partition_range`, :func:`zero_local`); a weight sync
  moves them to and from other layouts piece by piece
  (:mod:`rlflow.schedulers.runtime.distributed.zero_transfer`).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import DeepSpeedSpec
from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks

__all__ = [
    "NodeMPU",
    "ZeroHooks",
    "build_engine",
    "deepspeed_config",
    "destroy_engine",
    "is_zero3",
    "load_zero_params",
    "load_zero_train_state",
    "node_group",
    "partition_range",
    "refresh_master",
    "require_deepspeed",
    "zero_full_params",
    "zero_local",
    "zero_train_state",
]


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
def load_zero_params(module: nn.Module, full: Mapping[str, torch.Tensor], *, partial: bool = False) -> None:
    """Write full tensors into this rank's ZeRO-3 partitions (no collective); call :func:`refresh_master`
    afterwards so the optimizer's master copy follows. With ``partial`` only the parameters in ``full``
    (a LoRA model's adapters), else every one."""
    params: dict[str, Any] = dict(module.named_parameters())  # ZeRO-3 parameters (ds_* attributes)
    for name, local in zero_local(module).items():
        if partial and name not in full:
            continue
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
