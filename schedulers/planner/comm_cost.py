"""Seconds of the collectives a node issues: ``n`` collectives of one kind over a group, and the tensor-
parallel collectives of one forward pass.

Notation and units: ``cost.py``.

  * Collectives: ring model ``steps · latency + volume · bytes / bandwidth`` (``cluster.ring_shape``;
    Thakur, Rabenseifner & Gropp 2005), with the link (bandwidth, latency) that ``rlflow profile`` fitted
    for that collective and group size (``ClusterSpec.collective_time``; Hockney's α-β model, 1994), plus
    on an analytic link (a cluster file's) its ``collective_latency`` once per call, NCCL's base latency
    (NVIDIA/nccl ``src/graph/tuning.cc``; the GPU presets' 6.6 µs, sourced there). ``n`` collectives of
    ``X`` bytes in total cost ``n · T(0) + (T(X) − T(0))``: ``n`` base latencies. The expert all-to-all
    and pipeline sends below are point-to-point (no base latency: NCCL's tuning model is for collectives).
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
  * Expert-parallel all-to-all (:func:`moe_all_to_all_bytes`, :func:`moe_all_to_all_time`): with a
    mixture-of-experts layer's ``E`` experts split over ``ep`` ranks, each rank sends every one of its
    ``n`` tokens' ``K`` routed copies (``n·K·H·w`` bytes) to the rank holding that expert (dispatch) and
    gets the expert outputs back the same way (combine): two all-to-alls per MoE layer per micro-batch
    forward, two more backward (GShard, Lepikhin et al. 2021, §2.2 and §3.2; DeepSpeed-MoE, Rajbhandari
    et al. 2022, §5.3). Under uniform routing a copy goes to each rank with probability ``1/ep``, so
    ``(ep − 1)/ep`` of the bytes leave the rank. Time: the pairwise-exchange all-to-all, ``ep − 1``
    steps each sending ``1/ep`` of the buffer, ``(ep − 1)·α + (ep − 1)/ep · X / β`` (Thakur,
    Rabenseifner & Gropp 2005, §3.3, the long-message algorithm), on the group's link (``ClusterSpec.link``:
    intra-host, or the inter-host link when the group spans hosts) at the link efficiency.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlflow.schedulers.planner.cluster import ClusterSpec
    from rlflow.schedulers.planner.shapes import ModelShape

__all__ = [
    "collectives_time",
    "moe_all_to_all_bytes",
    "moe_all_to_all_time",
    "param_tensors",
    "tp_forward_time",
    "tp_modules",
]


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


@functools.lru_cache(maxsize=64)
def param_tensors(shape: ModelShape) -> tuple[float, int]:
    """(parameter tensors per decoder layer, averaged over the layers; tensors outside the layers) in the
    architecture's HF naming (``ModelShape.param_shapes``: a sparse layer's experts are two fused
    tensors)."""
    names = shape.param_shapes()
    in_layers = sum(1 for n in names if ".layers." in n)
    return in_layers / shape.num_hidden_layers, len(names) - in_layers


def moe_all_to_all_bytes(shape: ModelShape, tokens: float, ep: int) -> tuple[float, float]:
    """``(sent, off_rank)``: bytes one rank's dispatch all-to-all moves in one mixture-of-experts layer
    for ``tokens`` tokens at expert-parallel degree ``ep`` (module docstring): ``sent = tokens · K · H · w``
    (every routed copy of a token's hidden state), ``off_rank = sent · (ep − 1)/ep`` (uniform routing).
    The combine all-to-all moves the same bytes back. 0 for a dense model.

    Raises:
        ValueError: ``ep < 1``.
    """
    if ep < 1:
        raise ValueError(f"expert-parallel degree must be >= 1, got {ep}")
    if not shape.is_moe:
        return 0.0, 0.0
    sent = tokens * shape.experts_per_token * shape.hidden_size * shape.dtype_bytes
    return sent, sent * (ep - 1) / ep


def moe_all_to_all_time(
    cluster: ClusterSpec,
    shape: ModelShape,
    tokens: float,
    group: tuple[int, ...],
    backward: bool = False,
    slow: float | None = None,
) -> float:
    """Seconds of the expert-parallel all-to-alls of ONE mixture-of-experts layer for one micro-batch of
    ``tokens`` tokens per rank among the ``ep = len(group)`` ranks ``group``: dispatch and combine
    (``backward``: their two gradients too), each ``(ep − 1)·latency + off_rank / (bandwidth · link
    efficiency)`` (module docstring; :func:`moe_all_to_all_bytes`). Multiply by the stage's sparse layers
    (``ModelShape.moe_layers``) for a pass. 0 for ``ep = 1`` or a dense model. ``slow``: the issuing
    node's oversubscription, relative to the group's own (:func:`collectives_time`)."""
    ep = len(group)
    _, off = moe_all_to_all_bytes(shape, tokens, max(ep, 1))
    if ep <= 1 or not shape.is_moe:
        return 0.0
    link = cluster.link(group)
    one = (ep - 1) * link.latency + off / (link.bandwidth * cluster.efficiency.link)
    seconds = (4 if backward else 2) * one
    return seconds if slow is None else seconds * slow / cluster.mesh_slowdown(group)


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
