"""Pipeline training (``pp > 1``): the micro-batch schedule of a stage, and its train hooks.

Training hooks (:class:`PipelineHooks`): the gradient of a tied embedding is summed between the first and
the last stage (as Megatron-LM does) before clipping, and with ``ep`` > 1 the stage's expert gradients over
the stage's expert-data-parallel group (each stage's MoE layers dispatch over the stage's own ep group);
the clipping norm is the global one (squares summed over the stage's shards, then over the pipeline
chain, the tied embedding counted once); and :meth:`~PipelineHooks.micro_batch_order` gives
:func:`rlflow.nodes.train.optimize` the stage's schedule.

Schedule: **1F1B** (PipeDream-Flush: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", §2.2.1; Megatron-LM's non-interleaved schedule,
``torch.distributed.pipelining.Schedule1F1B``): stage ``s`` of ``p`` runs ``w = min(p-1-s, m)`` warm-up
forwards, then one forward and one backward in turn, then the remaining backwards
(:func:`schedule_order`). Its bubble is GPipe's, but stage ``s`` holds at most ``min(m, p-s)``
micro-batches' activations instead of ``m``. GPipe (Huang et al. 2019: all forwards, then all backwards)
stays available to :class:`PipelineHooks` (``schedule="gpipe"``) for comparison; both accumulate the same
gradients in the same order (bit-identical weights, tested). Sends do not block the stage (``isend``), so
stage ``s`` forwards micro-batch ``k+1`` while stage ``s+1`` works on ``k``, and backwards flow the same
way; a steady-state forward's activation send is held back until the gradient of the backward that
follows it has arrived, so both ends of a link see its messages in the same order
(:meth:`PipelineStage.hold_sends`), as rendezvous p2p (NCCL) needs. With per-micro-batch stage times
``f_s`` (forward) and ``b_s`` (backward) and ``c`` the time of one activation (or gradient) transfer
between neighbouring stages (``B_micro·T·H·dtype_bytes`` bytes over the link, plus latency; overlapped
with compute after the first micro-batch, so assumed ``c <= max_s f_s``)::

    train mini-batch  T = Σ_s f_s + (m-1)·max_s f_s  +  Σ_s b_s + (m-1)·max_s b_s  +  2·(pp-1)·c
    inference         T = Σ_s f_s + (m-1)·max_s f_s  +  (pp-1)·c

(for balanced stages ``(m+pp-1)·(f+b)`` per mini-batch: bubble fraction ``(pp-1)/(m+pp-1)``). A train node
pays that per mini-batch (``epochs × mini_batches`` flushes, plus the optimizer step of each stage, in
parallel). Stages before the
last also evaluate the node's loss on the placeholder outputs (element-wise work of ``[B,K,V]``, no head
matmul). Memory: stage ``s`` holds at most ``min(m, p-s)`` micro-batches' activations at once (the first
stage the most; :attr:`PipelineHooks.peak_in_flight` counts them). Not done: interleaved virtual stages
(Narayanan et al. 2021, §2.2.2), zero-bubble schedules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlflow.schedulers.runtime.distributed.experts import reduce_expert_grads
from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks, dist_clip_grad_norm_
from rlflow.schedulers.runtime.distributed.pipeline import decoder_of, stage_of

__all__ = ["SCHEDULES", "PipelineHooks", "schedule_order", "train_hooks", "warmup_forwards"]


SCHEDULES = ("1f1b", "gpipe")


def warmup_forwards(stages: int, stage: int, m: int) -> int:
    """Forwards stage ``stage`` of ``stages`` runs before its first backward under 1F1B: ``min(p-1-s, m)``
    (Narayanan et al. 2021, §2.2.1); at most ``min(m, p - s)`` micro-batches' activations are then alive
    at once on it."""
    return min(stages - 1 - stage, m)


def schedule_order(schedule: str, stages: int, stage: int, m: int) -> list[tuple[str, int]]:
    """A pipeline stage's order of one mini-batch's forwards ``("F", k)`` and backwards ``("B", k)``.

    * ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021, §2.2.1, Fig. 4; ``torch.distributed.pipelining.
      Schedule1F1B``): ``w = min(p-1-s, m)`` warm-up forwards, then one forward and one backward in turn
      (``F(w+i) B(i)``), then the remaining backwards. Stage ``s`` holds at most ``min(m, p-s)``
      micro-batches' activations (the first stage ``min(m, p)``); the bubble is GPipe's.
    * ``gpipe`` (Huang et al. 2019): all ``m`` forwards, then all ``m`` backwards (``m`` alive).

    Both run the backwards in increasing ``k``: the same gradients, accumulated in the same order.

    Raises:
        ValueError: an unknown schedule.
    """
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"unknown pipeline schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
    w = warmup_forwards(stages, stage, m)
    steady = [(op, k) for i in range(m - w) for op, k in (("F", w + i), ("B", i))]
    return [("F", k) for k in range(w)] + steady + [("B", k) for k in range(m - w, m)]


class PipelineHooks(DataParallelHooks):
    """:class:`DataParallelHooks` for a pipeline stage (``module`` cut by :func:`make_stage`).

    * the loss normaliser: as :class:`DataParallelHooks` (every stage sees the same rows);
    * :meth:`clip_grad_norm` first sums a tied embedding's gradient between the first and the last stage
      (each holds a copy; both then apply the same update), then clips with the global norm: squares
      summed over the stage's shards, then over the pipeline chain, the tied embedding counted on the
      first stage only;
    * :meth:`micro_batch_order`: the stage's order under ``schedule`` (:func:`schedule_order`; 1F1B by
      default, GPipe for comparison); under 1F1B, :meth:`begin` holds the activation sends of each
      steady-state forward ``F(w+i)`` back until the gradients of ``B(i)`` arrived
      (:meth:`PipelineStage.hold_sends`: the same message order on both ends of every link);
      ``in_flight`` / ``peak_in_flight``: micro-batches forwarded and not yet backpropagated (their
      activations alive), now and at most during the call;
    * :meth:`stage_sum`: a sum over the pipeline chain (each stage's count of its own layers);
    * :meth:`loss_is_finite`: only the last stage's loss is checked; the others compute theirs from
      placeholder outputs (meaningless, and ``-inf`` log-probs under top-p's ties are possible there).

    Raises:
        ValueError: an unknown ``schedule``.
    """

    def __init__(
        self, module: nn.Module, dp_group: Any, dp: int, schedule: str = "1f1b", reshard: bool = True
    ) -> None:
        super().__init__(module, dp_group, dp, reshard)
        stage = stage_of(module)
        assert stage is not None, "PipelineHooks needs a module cut by make_stage"
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r} (known: {', '.join(SCHEDULES)})")
        self.module = module
        self.stage = stage
        self.schedule = schedule
        self.in_flight = 0
        self.peak_in_flight = 0
        self._warmup = 0
        self._first_seq: dict[int, int] = {}
        self._seqs: dict[int, set[int]] = {}  # micro-batch -> the sequence numbers of its forwards

    def micro_batch_order(self, m: int) -> list[tuple[str, int]]:
        st = self.stage
        self._warmup = warmup_forwards(st.stages, st.stage, m) if self.schedule == "1f1b" else m
        self._seqs.clear()
        return schedule_order(self.schedule, st.stages, st.stage, m)

    def begin(self, op: str, k: int) -> None:
        super().begin(op, k)
        st = self.stage
        if op != "F":
            return
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        self._first_seq[k] = st.seq + 1
        if not st.last and k >= self._warmup:  # steady state: F(k) then B(k - w)
            st.hold_sends(self._seqs[k - self._warmup])

    def end(self, op: str, k: int) -> None:
        st = self.stage
        if op == "F":
            self._seqs[k] = set(range(self._first_seq.pop(k), st.seq + 1))
            return
        st.release_sends()  # gradients that never came (a forward not backpropagated on either stage)
        self.in_flight -= 1
        self._seqs.pop(k, None)

    def loss_is_finite(self, loss: torch.Tensor) -> bool:
        return super().loss_is_finite(loss) if self.stage.last else True

    def stage_sum(self, local: torch.Tensor) -> torch.Tensor:
        out = local.detach().clone()
        dist.all_reduce(out, group=self.stage.group)  # the pipeline chain: one rank per stage
        return out

    def clip_grad_norm(self, params: Any, max_norm: float) -> torch.Tensor:
        stage = self.stage
        # the stage's expert gradients (ep > 1): summed over the stage's edp group, divided as FSDP2's
        reduce_expert_grads(self.experts, self._divide)
        uncounted: list[torch.Tensor] = []
        if stage.tied_group is not None:
            emb = decoder_of(self.module).embed_tokens.weight
            _sum_tied_grad(emb, stage.tied_group)
            if stage.last:
                uncounted.append(emb)
        return dist_clip_grad_norm_(params, max_norm, stage_group=stage.group, uncounted=uncounted)


@torch.no_grad()
def _sum_tied_grad(emb: torch.Tensor, group: Any) -> None:
    """All-reduce (sum) the embedding's gradient between the first and the last stage, in place.

    Both copies are laid out alike (same dp/tp position); a vocabulary-parallel embedding's gradient is
    ``Replicate`` while the head's is ``Shard(0)``, so the gradient is first put in the parameter's own
    placements (a local slice, no communication).
    """
    from torch.distributed.tensor import DTensor

    grad = emb.grad
    if grad is None:
        return
    if isinstance(grad, DTensor) and isinstance(emb, DTensor):
        if tuple(grad.placements) != tuple(emb.placements):
            grad = grad.redistribute(emb.device_mesh, emb.placements)
            emb.grad = grad
        dist.all_reduce(grad.to_local(), group=group)  # the local shard's storage
    else:
        dist.all_reduce(grad, group=group)


def train_hooks(
    module: nn.Module, dp_group: Any, dp: int, schedule: str = "1f1b", reshard: bool = True
) -> DataParallelHooks:
    """The training hooks of ``module``: :class:`PipelineHooks` (pipeline ``schedule``) on a pipeline stage,
    else :class:`DataParallelHooks`; ``reshard``: the node's resolved ``reshard`` (``False``: FSDP2 units
    stay gathered through each optimizer step)."""
    if stage_of(module) is not None:
        return PipelineHooks(module, dp_group, dp, schedule, reshard)
    return DataParallelHooks(module, dp_group, dp, reshard)
