"""The EMA reference model's soft update, shard by shard (TR-DPO, Gorbatovski et al. 2024, §3)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlflow.schedulers.realloc.regions import ReallocError

__all__ = ["check_ema_shards", "ema_update"]


def check_ema_shards(
    ref_shards: Mapping[str, torch.Tensor], actor_shards: Mapping[str, torch.Tensor]
) -> None:
    """Raise ReallocError unless both mappings have the same parameter names, shapes and dtypes."""
    if set(ref_shards) != set(actor_shards):
        diff = sorted(set(ref_shards) ^ set(actor_shards))
        raise ReallocError(f"EMA: reference and actor shards differ in parameters {diff[:5]}")
    for name, ref in ref_shards.items():
        actor = actor_shards[name]
        if ref.shape != actor.shape or ref.dtype != actor.dtype:
            raise ReallocError(
                f"EMA: {name!r} is {tuple(ref.shape)} {ref.dtype} in the reference but "
                f"{tuple(actor.shape)} {actor.dtype} in the actor; reallocate the actor to the ref layout"
            )


def ema_update(
    ref_shards: Mapping[str, torch.Tensor], actor_shards: Mapping[str, torch.Tensor], eta: float
) -> Mapping[str, torch.Tensor]:
    """In place, per shard: ``ref ← η·actor + (1−η)·ref`` (computed as ``ref.lerp_(actor, η)``; TR-DPO's
    soft update, Gorbatovski et al. 2024, §3). Element-wise, so every layout gives the same bits.

    Both mappings hold this rank's shards in the *same* layout (reallocate the actor into the reference
    model's layout first); ``η`` in [0, 1] is dimensionless (η = 1 copies the actor).

    Raises:
        ReallocError: η outside [0, 1], or parameter names, shapes or dtypes differ.
    """
    if not 0.0 <= eta <= 1.0:
        raise ReallocError(f"EMA rate eta must lie in [0, 1], got {eta}")
    check_ema_shards(ref_shards, actor_shards)
    with torch.no_grad():
        for name, ref in ref_shards.items():
            if eta == 1.0:
                ref.copy_(actor_shards[name])
            else:
                ref.lerp_(actor_shards[name], eta)
    return ref_shards
