"""Seconds of the collectives a node issues: ``n`` collectives of one kind over a group, and the tensor-
parallel collectives of one forward pass.

Notation and units: ``cost.py``.

  * Collectives: ring model ``steps · latency + volume · bytes / bandwidth`` (``cluster.ring_shape``;
    Thakur, Rabenseifner & Gropp 2005), with the link (bandwidth, latency) that ``rlflow profile`` fitted
    for that collective and group size (``ClusterSpec.collective_time``; Hockney's α-β model, 1994).
    ``n`` collectives of ``X`` bytes in total cost ``n · T(0) + (T(X) − T(0))``.
  * Tensor-parallel comm, counted from what the runtime's DTensor plan (``runtime.distributed.layouts``:
    column-parallel q/k/v/gate/up, row-parallel o/down, vocabulary-parallel embedding and head) issues on
    torch 2.13 per micro-batch (measured with the torch profiler): forward ``2·Lₛ + 1`` all-reduces of
    ``b·S·H·w`` (o/down outputs — Megatron-LM's two per layer, Shoeybi et al. 2019 — plus the masked
    embedding lookup) and, for an ``lm`` head, one all-gather of the ``b·S·V·w`` logits; backward
    ``5·Lₛ`` more all-reduces (the input gradient of each column-parallel projection) plus one for the
    ``lm`` head's input. A train node adds one all-reduce per optimizer step for the gradient norm.
  * CPU oversubscription of a collective: a group of ``g`` ranks, profiled with ``g`` busy, issued by a
    node whose mesh runs ``n`` busy workers on a host is slower by ``slowdown(n) / slowdown(g)``
    (``cost.py``, "CPU oversubscription").
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = ["collectives_time", "param_tensors", "tp_forward_time", "tp_modules"]


def collectives_time(
    cluster: ClusterSpec,
    op: str,
    count: float,
    total_bytes: float,
    group: tuple[int, ...],
    slow: float | None = None,
) -> float:
    """Seconds of ``count`` collectives ``op`` moving ``total_bytes`` together among ``group`` on
    ``cluster``: ``count · T(0) + T(total) − T(0)`` (``T`` is affine in bytes; 0 for ``count <= 0`` or a
    group of one). ``slow``: the oversubscription of the node issuing them, relative to the group's own
    (the profile measured the group with its ranks busy)."""
    if count <= 0 or len(group) <= 1:
        return 0.0
    fixed = cluster.collective_time(op, 0.0, group)
    seconds = count * fixed + cluster.collective_time(op, total_bytes, group) - fixed
    return seconds if slow is None else seconds * slow / cluster.mesh_slowdown(group)


def param_tensors(shape: ModelShape) -> tuple[int, int]:
    """(parameter tensors per decoder layer, tensors outside the layers) in HF Llama naming."""
    names = replace(shape, num_hidden_layers=1).param_shapes()
    per_layer = sum(1 for n in names if ".layers." in n)
    return per_layer, len(names) - per_layer


def tp_modules(shape: ModelShape, layers: int, t: int) -> int:
    """Tensor-parallel modules one forward through ``layers`` layers calls (0 for ``t`` = 1): 7 projections
    per layer, the vocabulary-parallel embedding and, for an ``lm`` head, the head
    (``runtime.distributed.layouts.tp_plan``)."""
    if t == 1:
        return 0
    return 7 * layers + 1 + (1 if shape.head == "lm" else 0)


def tp_forward_time(
    cluster: ClusterSpec,
    shape: ModelShape,
    layers: int,
    rows: float,
    seq: float,
    group: tuple[int, ...],
    slow: float,
    logits: float | None = None,
) -> float:
    """Seconds of the tensor-parallel collectives of one forward over ``rows × seq`` tokens through
    ``layers`` layers among ``group``: ``2·layers + 1`` all-reduces of the activations plus, for an ``lm``
    head, the all-gather of the logits of ``logits`` positions per row (default all ``seq``; generation
    keeps the last one)."""
    w = shape.dtype_bytes
    act = rows * seq * shape.hidden_size * w
    seconds = collectives_time(cluster, "all_reduce", 2 * layers + 1, (2 * layers + 1) * act, group, slow)
    if shape.head == "lm":
        positions = seq if logits is None else logits
        seconds += collectives_time(
            cluster, "all_gather", 1, rows * positions * shape.vocab_size * w, group, slow
        )
    return seconds
