"""One rank's place in a pipeline chain (``pp > 1``), and the point-to-point traffic of its activations.

The ranks at the same ``(dp, tp)`` position of every stage of a pipeline-parallel node form a **pipeline
chain** (:meth:`MeshSpec.pp_groups`); :class:`PipelineStage` is one rank's view of its chain: which stage
it is, its neighbours, and the messages it sends and receives through the chain's process group (the stage
modules of :mod:`rlflow.schedulers.runtime.distributed.pipeline` call it inside the model's forward and
autograd's backward).

Messages: each forward of the model has a sequence number (counted by a forward pre-hook on the decoder,
identical on every stage since all stages run the same node function on the same rows); an activation
and its gradient travel as an ``int64`` header (the sequence number) and the payload. Activations
arrive in forward order (checked); gradients are matched by sequence number, not by forward order
(autograd backpropagates a loss with two forwards, DPO's chosen and rejected, in reverse forward
order), and one arriving before its stage asks for it is kept until asked for. Matching needs no p2p
tags (NCCL has none).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["PipelineStage"]


class PipelineStage:
    """One rank's place in a pipeline chain, and the point-to-point traffic of its activations.

    Args:
        stage: this rank's stage (``pp_rank``), ``0 <= stage < stages``.
        stages: the pipeline degree ``pp``.
        chain: the global ranks of this rank's pipeline chain, one per stage.
        group: the chain's process group (all p2p goes through it).
        tied_group: the group of the chain's first and last rank when this stage holds a tied embedding
            (the first or the last stage of a tied model), else ``None``.
        device: where received tensors are allocated.
    """

    def __init__(
        self,
        stage: int,
        stages: int,
        chain: tuple[int, ...],
        group: Any,
        tied_group: Any,
        device: torch.device,
    ) -> None:
        self.stage = stage
        self.stages = stages
        self.chain = chain
        self.group = group
        self.tied_group = tied_group
        self.device = device
        self.seq = 0  # forwards of the model so far (the message header)
        self._sends: list[tuple[Any, torch.Tensor]] = []  # isend works and the buffers they read
        self._expect: dict[int, tuple[torch.Size, torch.dtype]] = {}  # seq -> sent activation's shape
        self._inbox: dict[int, torch.Tensor] = {}  # gradients received before they were asked for
        self._held: list[tuple[torch.Tensor, int]] = []  # activations whose send waits for gradients
        self._gate: set[int] = set()  # forwards whose gradients must arrive before the held sends go
        self.generating = False  # inside generation_scope: the last stage's logits go to every stage

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def prev(self) -> int:
        return self.chain[self.stage - 1]

    @property
    def next(self) -> int:
        return self.chain[self.stage + 1]

    def begin(self) -> None:
        """A forward of the model starts (the decoder's forward pre-hook)."""
        self.seq += 1

    def _send(self, tensor: torch.Tensor, dst: int, seq: int) -> None:
        header = torch.tensor([seq], dtype=torch.int64, device=self.device)
        payload = tensor.detach().contiguous()
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        for t in (header, payload):  # non-blocking: a stage never waits for its successor to receive
            self._sends.append((dist.isend(t, dst=dst, group=self.group), t))

    def _recv(self, src: int, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, src=src, group=self.group)
        return buf

    def send_activation(self, hidden: torch.Tensor, seq: int, *, grad: bool) -> None:
        """Send forward ``seq``'s hidden state to the next stage (held back while :meth:`hold_sends` is in
        force); ``grad``: its gradient will come back."""
        if self._gate:
            self._held.append((hidden.detach(), seq))
        else:
            self._send(hidden, self.next, seq)
        if grad:
            self._expect[seq] = (hidden.shape, hidden.dtype)

    def hold_sends(self, until: set[int]) -> None:
        """Hold the activation sends of the coming forwards back until the gradients of forwards ``until``
        (those still expected) have arrived, or :meth:`release_sends`.

        1F1B's steady state (stage ``s`` forwards micro-batch ``k + w_s`` then backpropagates ``k``, while
        stage ``s + 1`` backpropagates ``k`` and only then forwards ``k + w_s``) so puts the messages over
        the link in the same order on both of its ends: gradients of ``k``, then activations of
        ``k + w_s``. With rendezvous point-to-point (NCCL: a send completes when the peer posts its
        receive, and a pair's sends and receives share one stream) the other order deadlocks.
        """
        self._gate = {q for q in until if q in self._expect and q not in self._inbox}

    def release_sends(self) -> None:
        """Send the held activations, in forward order, and stop holding."""
        self._gate.clear()
        held, self._held = self._held, []
        for hidden, seq in held:
            self._send(hidden, self.next, seq)

    def recv_activation(self, seq: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The hidden state ``[B,T,H]`` of forward ``seq`` from the previous stage.

        Raises:
            RuntimeError: the previous stage sent another forward's hidden state (the stages diverged).
        """
        got = int(self._recv(self.prev, (1,), torch.int64).item())
        if got != seq:
            raise RuntimeError(
                f"pipeline stage {self.stage}: expected the hidden state of forward {seq} from rank "
                f"{self.prev}, got forward {got} (the stages ran different forwards)"
            )
        return self._recv(self.prev, shape, dtype)

    def send_grad(self, grad: torch.Tensor, seq: int) -> None:
        """Send the gradient of forward ``seq``'s received hidden state to the previous stage."""
        self._send(grad, self.prev, seq)

    def recv_grad(self, seq: int) -> torch.Tensor:
        """The gradient of the hidden state this stage sent in forward ``seq``, from the next stage.

        Raises:
            RuntimeError: a gradient arrived for a forward that expects none (the stages diverged).
        """
        while seq not in self._inbox:
            got = int(self._recv(self.next, (1,), torch.int64).item())
            if got not in self._expect or got in self._inbox:
                raise RuntimeError(
                    f"pipeline stage {self.stage}: rank {self.next} sent a gradient for forward {got}, "
                    "which expects none (the stages ran different forwards)"
                )
            shape, dtype = self._expect[got]
            self._inbox[got] = self._recv(self.next, shape, dtype)
            if self._gate:
                self._gate.discard(got)
                if not self._gate:
                    self.release_sends()
        self._expect.pop(seq, None)
        return self._inbox.pop(seq)

    def share_logits(self, _module: nn.Module, _args: Any, out: Any) -> None:
        """The model's forward hook: while generating, the last stage broadcasts its logits ``[B,K,V]`` along
        the chain and every other stage receives them into its placeholder logits (in place)."""
        logits = getattr(out, "logits", None)
        if self.generating and isinstance(logits, torch.Tensor):
            dist.broadcast(logits, src=self.chain[-1], group=self.group)

    def finish(self) -> None:
        """Wait for this stage's sends (end of a node). Forwards whose output was never backpropagated
        expect no gradient: the next stage did not backpropagate them either.

        Raises:
            RuntimeError: a received gradient was never used (the stages diverged).
        """
        self.release_sends()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._expect.clear()
        if self._inbox:
            unused = sorted(self._inbox)
            self._inbox.clear()
            raise RuntimeError(f"pipeline stage {self.stage}: gradients of forwards {unused} were not used")

    def reset(self) -> None:
        """Forget pending traffic without waiting (after a failed node)."""
        self._sends.clear()
        self._expect.clear()
        self._inbox.clear()
        self._held.clear()
        self._gate.clear()
