"""Weight synchronisation between layouts of one model (version edges): the gather-and-broadcast fallback.

:func:`full_params` all-gathers a (possibly TP- and FSDP-sharded) module's parameters inside its mesh;
:func:`load_full_params` writes full tensors into another layout's shards (each rank slices the part its
DTensor placement holds). The worker broadcasts the flat full parameters from the source mesh's first rank
to each target mesh (:meth:`rlflow.schedulers.runtime.distributed.worker.Worker.sync`).

This is the fallback path. ``Worker.sync`` uses the planned shard-to-shard reallocation
(:mod:`rlflow.schedulers.runtime.distributed.weight_sync`, no full-model gather) whenever the layouts allow it, and this
path only when the target is FSDP2-sharded or a rank's shards do not match ``param_shards``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["full_params", "load_full_params", "local_slices"]


@torch.no_grad()
def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor (name -> tensor), gathered over its mesh where it is a DTensor.

    Collective on the module's mesh: every rank of the mesh must call it (same parameter order).
    Tied parameters appear once (``named_parameters`` order).
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    return out


def local_slices(p: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the full tensor that this rank's local shard of DTensor ``p`` holds (full for plain)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def load_full_params(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into ``module``'s parameters (each rank writes its own shard); no collective.

    Raises:
        KeyError: a parameter of ``module`` is missing from ``full``.
    """
    from torch.distributed.tensor import DTensor

    for name, p in module.named_parameters():
        src = full[name]
        if isinstance(p, DTensor):
            local = p.to_local()
            local.copy_(src[local_slices(p)].to(local.device, local.dtype))
        else:
            p.copy_(src.to(p.device, p.dtype))
