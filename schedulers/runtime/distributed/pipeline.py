"""Pipeline parallelism (``pp > 1``) for train and inference nodes: stage modules that pass hidden states.

Design: every node function stays unchanged. Each rank of a pipeline-parallel node runs the node function
on its dp share, like every other layout, with a model cut down to its **stage**; the stages exchange
hidden states point to point inside the model's forward, and gradients inside autograd's backward.

Stage partition (the same as :mod:`rlflow.schedulers.realloc.shards`, so reallocation to and from pipeline
layouts stays the planned, bit-exact one): stage ``s`` of ``pp`` holds decoder layers
``stage_layers(L, pp)[s]``;
the embedding lives on stage 0, the final norm and the head (``lm_head`` or the value/score head) on the
last stage, and a tied head puts the embedding matrix on both. Mesh position ``r`` of the node's devices
is on stage ``r // (dp·tp)``; each stage is a ``(dp, tp)`` mesh sharded by
:func:`~rlflow.schedulers.runtime.distributed.layouts.apply_layout`, and the ranks at the same ``(dp, tp)``
position of every stage form a **pipeline chain** (:meth:`MeshSpec.pp_groups`) that passes activations.

Module surgery (:func:`make_stage`), on the Hugging Face model itself, whose own ``forward`` still runs
(causal mask and rotary embeddings are recomputed from ``attention_mask``/``position_ids`` on every stage):

* the decoder keeps only its stage's layers, under their global indices (:class:`StageLayers`), so
  parameter names are the full model's (``model.layers.5.mlp.up_proj.weight``);
* on stages after the first, ``embed_tokens`` becomes :class:`RecvEmbedding` (receives ``[B,T,H]`` from
  the previous stage; on the last stage of a tied model it also holds the embedding matrix = the head);
* on stages before the last, the final ``norm`` becomes :class:`SendHidden` (sends ``[B,T,H]`` to the next
  stage) and the head becomes :class:`PlaceholderHead`, which returns zeros of the head's output shape
  (logits ``[B,K,V]``, values ``[B,T,1]``). The node function computes metrics and a loss from those
  placeholders: they are discarded (outputs and metrics come from the last stage: :meth:`MeshSpec.leaders`;
  only the last stage's loss is checked for finiteness), but the loss's backward reaches
  :class:`SendHidden`, whose autograd function ignores the gradient it is given and returns the true
  gradient of the hidden state it sent, received from the next stage. On the receiving side, the backward
  of :class:`RecvEmbedding` sends the gradient of the received hidden state back. So ``loss.backward()``
  on every stage runs the pipeline's backward, and ``optimize`` needs no change beyond the hooks below.

Training hooks (:class:`PipelineHooks`): the gradient of a tied embedding is summed between the first and
the last stage (as Megatron-LM does) before clipping; the clipping norm is the global one (squares summed
over the stage's shards, then over the pipeline chain, the tied embedding counted once); and
:meth:`~PipelineHooks.micro_batch_order` gives :func:`rlflow.nodes.train.optimize` the stage's schedule.

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

Messages: each forward of the model has a sequence number (counted by a forward pre-hook on the decoder,
identical on every stage since all stages run the same node function on the same rows); an activation
and its gradient travel as an ``int64`` header (the sequence number) and the payload. Activations
arrive in forward order (checked); gradients are matched by sequence number, not by forward order
(autograd backpropagates a loss with two forwards, DPO's chosen and rejected, in reverse forward
order), and one arriving before its stage asks for it is kept until asked for. Matching needs no p2p
tags (NCCL has none).

Generation (the built-in loop, :func:`rlflow.nodes.generation.generate`, unchanged) runs on pipeline
stages the same way: every stage runs the node function on the same prompts; each forward (the prefill,
then one per decode step) passes the stages in turn, and :func:`generation_scope` makes the last stage
broadcast its logits ``[B,K,V]`` along the chain (the model's forward hook; the other stages receive them
in place of their placeholder logits), so every stage samples the same token from the same logits with
the same generator (the chain shares a dp coordinate, hence the node's seed) and feeds it to the next step.
Each stage keeps the KV cache of its own layers: inside the scope the stage's attention modules use local
cache indices ``0..k-1`` (Hugging Face's cache sizes the causal mask from layer 0's length, which a later
stage does not hold). The stages run one after another within a step (no micro-batch overlap): a step
costs the sum of the stages' steps plus ``pp − 1`` hidden-state transfers and the logits' broadcast, the
price of holding a model that one host's devices cannot (vLLM's engine is not pipelined here:
``rlflow.dataflow.layout_rules``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.realloc.shards import stage_layers
from rlflow.schedulers.runtime.distributed.layouts import (
    DataParallelHooks,
    MeshSpec,
    dist_clip_grad_norm_,
)
from rlflow.schedulers.runtime.distributed.mesh import GroupCache

__all__ = [
    "SCHEDULES",
    "PipelineHooks",
    "PipelineStage",
    "PlaceholderHead",
    "RecvEmbedding",
    "SendHidden",
    "StageLayers",
    "check_pipeline",
    "gather_stage_params",
    "generation_scope",
    "make_stage",
    "schedule_order",
    "stage_of",
    "stage_scope",
    "train_hooks",
    "warmup_forwards",
]

_HEADS = ("lm_head", "value_head")
_STAGE_ATTR = "pipeline_stage"


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


# -- autograd functions -----------------------------------------------------------------------------


class _GradToPrev(torch.autograd.Function):
    """Identity on a received hidden state; its backward sends the gradient to the previous stage."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, stage: PipelineStage, seq: int) -> torch.Tensor:
        ctx.stage, ctx.seq = stage, seq
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.stage.send_grad(grad, ctx.seq)
        return None, None, None


class _GradFromNext(torch.autograd.Function):
    """Zeros in place of a sent hidden state; its backward returns the gradient the next stage sends."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, stage: PipelineStage, seq: int) -> torch.Tensor:
        ctx.stage, ctx.seq = stage, seq
        return hidden.new_zeros(hidden.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        del grad  # the gradient of the placeholder loss; the true one comes from the next stage
        return ctx.stage.recv_grad(ctx.seq), None, None


class _Placeholder(torch.autograd.Function):
    """Zeros ``[..., features]`` connected to ``x`` (its backward gives ``x`` a zero gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, features: int) -> torch.Tensor:
        ctx.shape = x.shape
        return x.new_zeros((*x.shape[:-1], features))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.new_zeros(()).expand(ctx.shape), None


# -- stage modules ----------------------------------------------------------------------------------


class StageLayers(nn.ModuleList):
    """The decoder layers of one stage, registered under their global layer indices.

    Iterating (or slicing, as the decoder's forward does with ``layers[:num_hidden_layers]``) yields the
    stage's layers in order; parameter names keep the full model's indices.
    """

    def __init__(self, layers: Mapping[int, nn.Module]) -> None:
        super().__init__()
        for index, layer in sorted(layers.items()):
            self.add_module(str(index), layer)

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            indices = [int(k) for k in self._modules]
            wanted = set(range(max(indices) + 1)[idx]) if indices else set()
            return [m for k, m in self._modules.items() if int(k) in wanted]
        return self._modules[str(int(idx))]


class RecvEmbedding(nn.Module):
    """Stands in for ``embed_tokens`` on stages after the first: returns the hidden state ``[B,T,H]``
    received from the previous stage (``input_ids [B,T]`` give its shape).

    Args:
        stage: this rank's pipeline stage.
        hidden_size: ``H``.
        dtype: the hidden state's dtype (the model's).
        weight: the embedding matrix ``[V,H]`` on the last stage of a tied model (it is the head), else
            ``None`` (no parameter).
    """

    def __init__(
        self, stage: PipelineStage, hidden_size: int, dtype: torch.dtype, weight: nn.Parameter | None
    ) -> None:
        super().__init__()
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        if weight is not None:
            self.weight = weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        st = self.stage
        hidden = st.recv_activation(st.seq, (*input_ids.shape, self.hidden_size), self.dtype)
        if not torch.is_grad_enabled():
            return hidden
        hidden.requires_grad_(True)
        out: torch.Tensor = _GradToPrev.apply(hidden, st, st.seq)
        return out


class SendHidden(nn.Module):
    """Stands in for the final ``norm`` on stages before the last: sends the hidden state ``[B,T,H]`` to
    the next stage and returns a stand-in of the same shape (zeros; the hidden state itself without grad).
    """

    def __init__(self, stage: PipelineStage) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        st = self.stage
        grad = torch.is_grad_enabled() and hidden.requires_grad
        st.send_activation(hidden, st.seq, grad=grad)
        if not grad:
            return hidden  # only its shape matters to the placeholder head
        out: torch.Tensor = _GradFromNext.apply(hidden, st, st.seq)
        return out


class PlaceholderHead(nn.Module):
    """Stands in for the head on stages before the last: zeros ``[..., out_features]`` in the input's
    dtype (logits ``[B,K,V]`` for ``lm_head``, ``[B,T,1]`` for a value/score head)."""

    def __init__(self, out_features: int) -> None:
        super().__init__()
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            out: torch.Tensor = _Placeholder.apply(x, self.out_features)
            return out
        return x.new_zeros((*x.shape[:-1], self.out_features))


# -- building a stage -------------------------------------------------------------------------------


def _decoder(model: nn.Module) -> Any:
    """The Llama-style decoder (``embed_tokens``, ``layers``, ``norm``) of a causal LM or HeadModel."""
    from rlflow.nodes.models import HeadModel

    inner = model.backbone if isinstance(model, HeadModel) else getattr(model, "model", None)
    needed = (("embed_tokens", nn.Module), ("layers", nn.ModuleList), ("norm", nn.Module))
    if inner is None or not all(isinstance(getattr(inner, a, None), t) for a, t in needed):
        return None
    return inner


def _head_name(model: nn.Module) -> str | None:
    return next((h for h in _HEADS if isinstance(getattr(model, h, None), nn.Module)), None)


def _tied(model: nn.Module, decoder: Any) -> bool:
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    return weight is not None and weight is getattr(decoder.embed_tokens, "weight", None)


def check_pipeline(model: nn.Module, pp: int, where: str = "model") -> None:
    """Check that ``model`` can be cut into ``pp`` pipeline stages.

    Raises:
        PlanError: the model is not a Llama-style decoder (``embed_tokens``, ``layers``, ``norm``) with an
            ``lm_head`` or a value/score head, or has fewer layers than stages.
    """
    if pp == 1:
        return
    decoder = _decoder(model)
    if decoder is None or _head_name(model) is None:
        raise PlanError(
            f"{where}: pipeline parallel needs a Llama-style decoder (embed_tokens, layers, norm) and an "
            f"lm_head or value head ({type(model).__name__} has none)"
        )
    try:
        stage_layers(len(decoder.layers), pp)
    except PlanError as e:
        raise PlanError(f"{where}: pipeline degree pp={pp}: {e}") from None


def make_stage(model: nn.Module, spec: MeshSpec, rank: int, groups: GroupCache) -> nn.Module:
    """Cut ``model`` (full weights) in place down to ``rank``'s stage of ``spec`` (see the module docs).

    Call before :func:`~rlflow.schedulers.runtime.distributed.layouts.apply_layout` (which then shards the
    stage on the stage's mesh). ``groups.mesh(spec)`` must have run on every rank (it creates the chains'
    groups).

    Returns:
        the same module, holding only its stage's parameters; :func:`stage_of` gives its stage.

    Raises:
        PlanError: see :func:`check_pipeline`.
    """
    check_pipeline(model, spec.pp)
    decoder = _decoder(model)
    head = _head_name(model)
    assert decoder is not None and head is not None
    s = spec.stage_of(rank)
    chain = spec.pp_groups()[spec.devices.index(rank) % (spec.dp * spec.tp)]
    tied = _tied(model, decoder)
    ends = (chain[0], chain[-1])
    device = next(model.parameters()).device
    stage = PipelineStage(
        s,
        spec.pp,
        chain,
        groups.group(chain),
        groups.group(ends) if tied and s in (0, spec.pp - 1) else None,
        device,
    )
    layers = stage_layers(len(decoder.layers), spec.pp)[s]
    decoder.layers = StageLayers({i: decoder.layers[i] for i in layers})
    emb = decoder.embed_tokens
    if not stage.first:
        weight = emb.weight if tied and stage.last else None
        decoder.embed_tokens = RecvEmbedding(stage, int(emb.weight.shape[1]), emb.weight.dtype, weight)
    if not stage.last:
        decoder.norm = SendHidden(stage)
        out_features = int(getattr(model, head).weight.shape[0])
        setattr(model, head, PlaceholderHead(out_features))
    decoder.register_forward_pre_hook(lambda *_: stage.begin())
    model.register_forward_hook(stage.share_logits)
    model.__dict__[_STAGE_ATTR] = stage  # a plain attribute (nn.Module's setattr wants tensors/modules)
    return model


def stage_of(module: nn.Module) -> PipelineStage | None:
    """The pipeline stage of a module cut by :func:`make_stage`, else ``None``."""
    stage = getattr(module, _STAGE_ATTR, None)
    return stage if isinstance(stage, PipelineStage) else None


@contextlib.contextmanager
def stage_scope(module: nn.Module | None) -> Iterator[None]:
    """Around one node call: on a pipeline stage, wait for its sends at the end (see
    :meth:`PipelineStage.finish`); forget them if the call raised."""
    stage = stage_of(module) if module is not None else None
    try:
        yield
    except BaseException:
        if stage is not None:
            stage.reset()
        raise
    if stage is not None:
        stage.finish()


@contextlib.contextmanager
def generation_scope(module: nn.Module | None) -> Iterator[None]:
    """Around a generate node's call on a pipeline stage (see the module docstring): the last stage's logits
    are shared along the chain, and the stage's attention modules use local KV-cache indices ``0..k-1``
    (restored after). Nothing happens off a pipeline stage.

    Raises:
        PlanError: the model mixes attention types across layers (``config.layer_types``, e.g. sliding and
            full): the cache types its layers by index, which local indices would mismatch.
    """
    stage = stage_of(module) if module is not None else None
    decoder = _decoder(module) if stage is not None and module is not None else None
    if stage is None or decoder is None:
        yield
        return
    kinds = set(getattr(getattr(module, "config", None), "layer_types", None) or ())
    if len(kinds) > 1:
        raise PlanError(
            f"generation on pipeline stages needs one attention type in every layer; the model mixes "
            f"{sorted(kinds)} (config.layer_types): use pp=1 for its generate node"
        )
    relabelled: list[tuple[Any, int]] = []  # (attention module, its global index)
    for local, layer in enumerate(decoder.layers):  # the stage's layers, in order
        for sub in layer.modules():
            index = getattr(sub, "layer_idx", None)
            if isinstance(index, int) and not isinstance(index, bool):
                relabelled.append((sub, index))
                cast(Any, sub).layer_idx = local
    stage.generating = True
    try:
        yield
    finally:
        stage.generating = False
        for sub, index in relabelled:
            sub.layer_idx = index


# -- training ---------------------------------------------------------------------------------------


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

    def clip_grad_norm(self, params: Any, max_norm: float) -> torch.Tensor:
        stage = self.stage
        uncounted: list[torch.Tensor] = []
        if stage.tied_group is not None:
            emb = _decoder(self.module).embed_tokens.weight
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


# -- full parameters --------------------------------------------------------------------------------


def gather_stage_params(
    params: Mapping[str, torch.Tensor], spec: MeshSpec, rank: int, groups: GroupCache
) -> dict[str, torch.Tensor]:
    """Every stage's full parameters merged on the mesh's first rank (collective on the first chain).

    Args:
        params: this rank's stage parameters, full tensors (``weight_sync.full_params`` on the stage mesh).

    Returns:
        name -> CPU tensor of the whole model on ``spec.devices[0]``; ``{}`` on every other rank. A tied
        embedding (held by the first and the last stage, equal) appears once.
    """
    chain = spec.pp_groups()[0]
    if rank not in chain:
        return {}
    local = {k: v.detach().to("cpu") for k, v in params.items()}
    parts: list[Any] | None = [None] * len(chain) if rank == chain[0] else None
    dist.gather_object(local, parts, dst=chain[0], group=groups.group(chain))
    if parts is None:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged
