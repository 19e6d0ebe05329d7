"""Interruptible generation priced call by call: the segments of a generate node with ``interrupt_every``.

A generate node with ``interrupt_every: S`` tokens and ``staleness`` η >= 1 (partial rollouts,
``rlflow.nodes.partial``; the version schedule, ``rlflow.schedulers.runtime.version_schedule``) runs one
iteration as ``J = ⌈G / S⌉`` calls (``G`` its ``max_new_tokens``), one per segment, each a command of its
own. What the runtime does in segment ``j`` (``nodes.functions.generate._generate_segment``) and how it is
priced:

  * It resubmits every row still going after ``j·S`` tokens as a new prompt: its prompt and its tokens so
    far, ``P + j·S`` tokens wide, left-padded; the KV cache of the older weights is not reused, so the
    segment's prefill computes all of them again under the weights it reads (AReaL's recomputed
    interrupted rollouts). Segment 0 samples each of the ``n`` rows of a prompt as its own row
    (``PartialRollout.start``): no prompt is prefilled once for its samples.
  * Those rows are the ``e^{−λ·j·S}`` share of the node's (``lengths.survival``), each sampling at most
    ``S_j = min(S, G − j·S)`` tokens; the exponential length model being memoryless, a segment is a call
    of its own mean (``lengths.segment_mean``) capped at ``S_j``, and it lasts until its longest row ends
    or fills it: ``∫_{jS}^{jS+S_j} P(max > x) dx`` steps (``lengths.window_longest``), the prefill giving
    the first. Summed over the segments the steps are the uninterrupted call's; the rows running at each
    token are the same rows; what interruption adds is ``J − 1`` prefills of the longer prompts, the fixed
    costs of ``J`` calls, and on vLLM the end of each call's continuous batching: an engine whose queue
    empties runs the call's last rows alone up to the segment's end, every segment.
  * The built-in loop splits a segment's rows into the layout's ``m`` micro-batches only when they divide
    by ``m`` (``nodes.functions.generate._builtin_generate``); the rows still going after segment 0 are a
    random count, which divides by ``m`` about once in ``m``, so segments after the first are priced as one
    micro-batch of the rank's rows (segment 0: the layout's ``m``).
  * A vLLM engine loads each weight version once (the segments that read one version run one after
    another: the version schedule's rule 4), as many loads per iteration as without interruption.
  * Every segment is a command: the controller's fixed round trip (``Overheads.dispatch_s``; the batch's
    bytes once) and the node's per-call cost (``Overheads.node_s``) are paid ``J`` times; the simulator
    replays each segment for its own seconds (``NodeCost.segment_s``).

Shape legend: none (scalars: tokens, rows, seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlflow.schedulers.planner.lengths import (
    capped_exponential_rate,
    compacted_decode_s,
    survival,
    window_longest,
)

if TYPE_CHECKING:
    from rlflow.schedulers.planner.problem import PlanNode

__all__ = ["Segment", "SegmentWork", "builtin_segments", "interrupted", "segment_warnings", "segments_of"]


@dataclass(frozen=True)
class Segment:
    """One segment call of an interrupted generate node on one data-parallel rank.

    Attributes:
        lo, hi: the tokens of the response it samples, ``(j·S, min((j+1)·S, G)]``.
        alive: the share of the node's rows still going at ``lo`` (``lengths.survival``; 1 for segment 0).
        runs: the probability that some row of the node's is still going at ``lo`` (its call samples).
        calls: the built-in loop's micro-batches of the segment (module docstring).
        rows: rows per micro-batch counted at the iteration's start (the rows still going are ``alive`` of
            them), so that ``lengths.window_longest`` and ``lengths.compacted_decode_s`` take them as the
            uninterrupted call's.
    """

    lo: float
    hi: float
    alive: float
    runs: float
    calls: int
    rows: float


def interrupted(node: PlanNode) -> bool:
    """Whether ``node`` samples its responses in segments (``interrupt_every`` below ``max_new_tokens``)."""
    return node.kind == "generate" and node.interrupt_every > 0 and node.segments > 1


def segments_of(node: PlanNode, rows_per_rank: float, micro_batches: int = 1) -> list[Segment]:
    """The :class:`Segment` s of one iteration of ``node`` (``interrupt_every`` tokens each, the last to
    ``gen_len``) for a rank of ``rows_per_rank`` rows on ``micro_batches`` micro-batches (module docstring:
    segment 0 on them, later ones on one).

    Raises:
        ValueError: ``node`` is not interrupted (:func:`interrupted`).
    """
    if not interrupted(node):
        raise ValueError(f"node {node.name!r} is not interrupted (interrupt_every, segments > 1)")
    every, cap, mean = node.interrupt_every, node.gen_len, node.response_mean
    out = []
    for j in range(node.segments):
        lo = float(j * every)
        alive = 1.0 if j == 0 else survival(mean, cap, lo)
        runs = 1.0 if j == 0 else -math.expm1(node.rows * math.log1p(-alive)) if alive < 1.0 else 1.0
        calls = micro_batches if j == 0 else 1
        out.append(Segment(lo, min(lo + every, float(cap)), alive, runs, calls, rows_per_rank / calls))
    return out


@dataclass(frozen=True)
class SegmentWork:
    """What one segment call of the built-in loop costs a rank (:func:`builtin_segments`): seconds of its
    prefill forwards (compute, tensor-parallel collectives, pipeline sends), seconds of its decode steps,
    the steps (tokens after the prefill's; each step's pipeline sends are the caller's), and its
    micro-batch calls that sample (``Segment.calls`` × ``Segment.runs``)."""

    prefill_s: float
    prefill_tp_s: float
    prefill_pp_s: float
    decode_s: float
    steps: float
    calls: float


def builtin_segments(
    node: PlanNode,
    rows_per_rank: float,
    micro_batches: int,
    replicas: int,
    step_s: Callable[[float, float], float],
    prefill_s: Callable[[float, float], tuple[float, float, float]],
    group: int = 1,
) -> list[SegmentWork]:
    """:class:`SegmentWork` of each segment of interrupted generate node ``node`` on the built-in loop
    (module docstring), for a rank of ``rows_per_rank`` rows on ``micro_batches`` micro-batches among
    ``replicas`` data-parallel ranks (the node ends with the slowest: each segment's steps are the
    longest of every replica's last call, ``lengths.slowest_replica_steps``' rule per window).
    ``step_s(live, s)``: seconds of a decode step of ``live`` rows at ``s`` tokens into the response;
    ``prefill_s(rows, width)``: ``(compute, tp, pp)`` seconds of one prefill forward of ``rows`` rows of
    ``width`` tokens. A compacting loop (``PlanNode.compact``) steps the live rows
    (``lengths.compacted_decode_s`` over the segment's window), else every row of the call. ``group``: the
    ranks decoding in lockstep (an expert-parallel group, ``expert_cost.py``): each call but the last lasts
    the longest of the group's rows."""
    mean, cap = node.response_mean, node.gen_len
    compacting = node.compact and capped_exponential_rate(mean, cap) > 0
    out = []
    for seg in segments_of(node, rows_per_rank, micro_batches):
        live, width = seg.rows * seg.alive, node.prompt_len + seg.lo
        compute, tp, pp = prefill_s(live, width) if live > 0 else (0.0, 0.0, 0.0)
        first = seg.lo + 1  # the prefill gives the segment's first token
        each = window_longest(mean, cap, group * seg.rows, first, seg.hi) if seg.calls > 1 else 0.0
        steps = (seg.calls - 1) * each + window_longest(mean, cap, replicas * seg.rows, first, seg.hi)
        if compacting:
            one = compacted_decode_s(mean, cap, seg.rows, group * seg.rows, step_s, seg.lo, seg.hi)
            last = compacted_decode_s(mean, cap, seg.rows, replicas * seg.rows, step_s, seg.lo, seg.hi)
            decode = (seg.calls - 1) * one + last
        else:  # every row of the call kept till its longest ends, at the segment's mean context
            decode = steps * step_s(live, (seg.lo + seg.hi) / 2)
        calls = seg.calls * seg.runs
        out.append(SegmentWork(seg.calls * compute, seg.calls * tp, seg.calls * pp, decode, steps, calls))
    return out


def segment_warnings(nodes: Iterable[PlanNode]) -> list[str]:
    """What the segment pricing cannot price faithfully, one line per node: an interrupted node that may
    run on vLLM with more than ``staleness + 1`` segments has segments ``η + 1 .. J − 1`` reading the
    version the segment before them read (the version schedule caps a segment's version at ``k − 1``), so
    no weight load resets the engine's prefix cache between them and vLLM may reuse the blocks of the
    earlier segment's prompt and tokens; their prefill is priced in full."""
    out = []
    for node in nodes:
        if not interrupted(node) or "vllm" not in node.engines or node.segments <= node.staleness + 1:
            continue
        eta, count = node.staleness, node.segments
        out.append(
            f"nodes.{node.name}.interrupt_every: {node.interrupt_every} tokens make {count} segments, more "
            f"than staleness {eta} + 1: segments {eta + 1} to {count - 1} read the version the segment "
            "before them read, so on vLLM the prefix cache may hold their prompts' earlier tokens (no "
            "weight load between them resets it); the planner prices their prefill in full"
        )
    return out
