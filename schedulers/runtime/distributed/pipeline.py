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
  on every stage runs the pipeline's backward, and ``optimize`` needs no change beyond the train hooks.

A stage's point-to-point traffic is :mod:`rlflow.schedulers.runtime.distributed.pipeline_stage`; training on
stages (the 1F1B schedule, the train hooks) is :mod:`rlflow.schedulers.runtime.distributed.pipeline_schedule`.

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
from rlflow.nodes.moe_routes import number_routers
from rlflow.schedulers.realloc.shards import stage_layers
from rlflow.schedulers.runtime.distributed.layouts import MeshSpec
from rlflow.schedulers.runtime.distributed.mesh import GroupCache
from rlflow.schedulers.runtime.distributed.pipeline_stage import PipelineStage

__all__ = [
    "STAGE_ATTR",
    "PlaceholderHead",
    "RecvEmbedding",
    "SendHidden",
    "StageLayers",
    "check_pipeline",
    "decoder_of",
    "gather_stage_params",
    "generation_scope",
    "make_stage",
    "stage_of",
    "stage_scope",
]

_HEADS = ("lm_head", "value_head")
STAGE_ATTR = "pipeline_stage"  # the attribute of a module cut by make_stage that holds its PipelineStage


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


def decoder_of(model: nn.Module) -> Any:
    """The Llama-style decoder (``embed_tokens``, ``layers``, ``norm``) of a causal LM or HeadModel;
    ``None`` for a model without one."""
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
    decoder = decoder_of(model)
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
    number_routers(model)  # route replay: a stage's routers keep their MoE-layer index in the full model
    decoder = decoder_of(model)
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
    model.__dict__[STAGE_ATTR] = stage  # a plain attribute (nn.Module's setattr wants tensors/modules)
    return model


def stage_of(module: nn.Module) -> PipelineStage | None:
    """The pipeline stage of a module cut by :func:`make_stage`, else ``None``."""
    stage = getattr(module, STAGE_ATTR, None)
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
    decoder = decoder_of(module) if stage is not None and module is not None else None
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
