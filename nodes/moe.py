"""Mixture-of-experts models: which Hugging Face architectures rlflow runs, their routers' statistics in a
train step (the load-balancing auxiliary loss and the expert load), and the pre-launch check that refuses an
MoE config or argument the runtime cannot honour.

rlflow runs an MoE model through transformers' own modules (``qwen3_moe``, ``mixtral``, ``deepseek_v3``:
:data:`MOE_FAMILIES`); every router of those returns ``(router_logits [T,E], top_k_weights [T,K],
top_k_index [T,K])`` and sits in an MoE block beside its experts. :class:`RouterStats` hooks the routers of a
module during a train node's forwards (:func:`rlflow.nodes.train.optimize` opens it), counts the tokens each
expert receives and, with ``router_aux_loss_coef`` > 0, adds the load-balancing loss's gradient at each MoE
block (the loss is attached to the block's output, as Megatron-LM's ``MoEAuxLossAutoScaler`` does, so it
needs no change to any node function's loss and works on pipeline stages, packed and recomputed forwards).

Shapes (DESIGN.md): T router rows (the tokens a router sees: ``B·L`` padded, ``N`` packed), E experts,
K experts per token, Y MoE layers.
"""

from __future__ import annotations

import contextlib
import importlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlflow.dataflow.args import Arg
from rlflow.dataflow.context import model_hf_config
from rlflow.nodes.checks import RUN_CHECKS

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "AUX_LOSS_ARG",
    "MOE_FAMILIES",
    "MOE_METRICS",
    "MoeFamily",
    "RouterStats",
    "layer_stats",
    "moe_config_problems",
    "moe_family",
    "moe_graph_mistakes",
    "router_stats",
]

MOE_METRICS = ("moe/aux_loss", "moe/expert_load_max", "moe/expert_load_min")
"""The router metrics a train node of an MoE model reports (:meth:`RouterStats.metrics`)."""

AUX_LOSS_ARG = Arg(
    "router_aux_loss_coef",
    float,
    0.0,
    "coefficient of the MoE load-balancing auxiliary loss, per MoE layer E·Σ_e f_e·P_e averaged over the "
    "layers and micro-batches (0: off; an MoE model with a softmax router only)",
    "Fedus et al. 2022 (Switch Transformer), eq. 4; Hugging Face router_aux_loss_coef",
    low=0,
)
"""The train node argument of the load-balancing loss (every train node function declares it)."""


@dataclass(frozen=True)
class MoeFamily:
    """An MoE architecture rlflow runs (a Hugging Face ``model_type``).

    Attributes:
        model_type: Hugging Face's name.
        experts_key, top_k_key: the config keys of E and K.
        routing: how the router scores and picks experts (for messages and docs).
        aux_loss: whether the Switch-style load-balancing loss applies (a softmax router; Hugging Face's
            ``load_balancing_loss_func`` of the architecture's module).
    """

    model_type: str
    experts_key: str
    top_k_key: str
    routing: str
    aux_loss: bool


MOE_FAMILIES: dict[str, MoeFamily] = {
    f.model_type: f
    for f in (
        MoeFamily("qwen3_moe", "num_experts", "num_experts_per_tok", "softmax top-k", True),
        MoeFamily("mixtral", "num_local_experts", "num_experts_per_tok", "softmax top-k, renormalised", True),
        MoeFamily(
            "deepseek_v3",
            "n_routed_experts",
            "num_experts_per_tok",
            "sigmoid scores, group-limited top-k with a bias correction (auxiliary-loss-free balancing)",
            False,
        ),
    )
}
"""The MoE architectures rlflow runs, by ``model_type`` (tests/test_moe.py runs each through node kinds)."""


def _causal_lm_class(model_type: str) -> Any:
    """transformers' causal-LM class of ``model_type`` (``None`` when it has none)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def _router_recorder(cls: Any) -> Any:
    """transformers' ``OutputRecorder`` of ``cls``'s router logits (its ``target_class`` is the router), or
    ``None`` for a model class without routers."""
    return (getattr(cls, "_can_record_outputs", None) or {}).get("router_logits")


def _records_routers(cls: Any) -> bool:
    return _router_recorder(cls) is not None


def moe_family(config: Mapping[str, Any] | Any) -> MoeFamily | None:
    """The :class:`MoeFamily` of a Hugging Face config (a dict or a ``PretrainedConfig``); ``None`` for a
    dense model. An MoE ``model_type`` rlflow does not know also gives ``None``: :func:`moe_config_problems`
    refuses it."""
    model_type = str(config.get("model_type", "") if isinstance(config, Mapping) else config.model_type)
    return MOE_FAMILIES.get(model_type)


def _get(config: Mapping[str, Any] | Any, key: str) -> Any:
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def moe_config_problems(config: Mapping[str, Any] | Any) -> list[tuple[str, str]]:
    """What the runtime cannot serve in an MoE config, as ``(config key, reason)`` pairs (``[]`` for a dense
    model or a servable MoE one).

    Refused: an MoE architecture outside :data:`MOE_FAMILIES` (its routing unchecked); E or K not positive or
    K > E; Mixtral's ``router_jitter_noise`` > 0 (transformers applies it in training mode only and rlflow
    trains in eval mode, so it would be silently off); DeepSeek-V3 groups that do not divide the experts, or
    a ``topk_method``/``scoring_func`` other than the one transformers implements (``noaux_tc``, ``sigmoid``).
    """
    model_type = str(_get(config, "model_type") or "")
    family = MOE_FAMILIES.get(model_type)
    if family is None:
        cls = _causal_lm_class(model_type) if model_type else None
        if cls is not None and _records_routers(cls):
            known = ", ".join(MOE_FAMILIES)
            why = f"'{model_type}' is a mixture-of-experts architecture whose routing rlflow has not checked"
            return [("model_type", f"{why} (it runs {known})")]
        return []
    out: list[tuple[str, str]] = []
    experts, top_k = _get(config, family.experts_key), _get(config, family.top_k_key)
    for value in (experts, top_k):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return []  # not a config transformers builds: the model check (models.X) says so
    if experts is not None and experts < 1:
        out.append((family.experts_key, f"{experts} experts (need at least 1)"))
    elif experts is not None and top_k is not None and not 1 <= top_k <= experts:
        out.append((family.top_k_key, f"{top_k} experts per token of {experts} experts (need 1 <= K <= E)"))
    jitter = _get(config, "router_jitter_noise")
    if model_type == "mixtral" and jitter:
        why = "transformers applies it in training mode only and rlflow's trainer runs in eval mode"
        out.append(("router_jitter_noise", f"{jitter}: {why} (no dropout, no jitter); set it to 0"))
    if model_type == "deepseek_v3":
        groups, top_groups = _get(config, "n_group"), _get(config, "topk_group")
        if groups is not None and experts is not None and (int(groups) < 1 or int(experts) % int(groups)):
            out.append(("n_group", f"{groups} expert groups do not divide {experts} experts"))
        elif groups is not None and top_groups is not None and not 1 <= int(top_groups) <= int(groups):
            out.append(
                ("topk_group", f"{top_groups} groups chosen of {groups} (need 1 <= topk_group <= n_group)")
            )
        for key, served in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            given = _get(config, key)
            if given is not None and given != served:
                out.append(
                    (
                        key,
                        f"'{given}': transformers' DeepSeek-V3 routes with {served} only ({family.routing})",
                    )
                )
    return out


def layer_stats(
    logits_TE: torch.Tensor, index_TK: torch.Tensor, real_T: torch.Tensor | None, aux_fn: Any
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """One MoE layer's routing over its real tokens: expert counts ``[E]`` (tokens routed to each expert; a
    token counts once per chosen expert, so the counts add up to K·tokens), the number of real tokens, and the
    load-balancing loss (``None`` without ``aux_fn``).

    The loss is Hugging Face's ``load_balancing_loss_func`` of the layer alone (Fedus et al. 2022, eq. 4, for
    top-K): ``E · Σ_e f_e · P_e`` with ``f_e`` the expert's count over the real tokens (Σ_e f_e = K) and
    ``P_e`` its mean router probability; K when perfectly balanced. Differentiable in ``logits_TE``.
    """
    experts = int(logits_TE.shape[-1])
    if real_T is not None:
        logits_TE, index_TK = logits_TE[real_T], index_TK[real_T]
    tokens = int(logits_TE.shape[0])
    counts = torch.bincount(index_TK.reshape(-1).long(), minlength=experts).double()
    if aux_fn is None or tokens == 0:
        return counts, tokens, None
    return counts, tokens, aux_fn((logits_TE,), experts, int(index_TK.shape[-1]), None)


def _decoder_slots(names: list[str], decoder_layers: Any) -> tuple[list[int], int]:
    """The decoder layer of each router (``...layers.<i>....`` in its module name; a pipeline stage keeps the
    global indices) and the decoder's layer count (the config's ``num_hidden_layers``); routers named
    otherwise are numbered in order among themselves (a whole model, never a stage: a stage is cut from a
    decoder's ``layers``)."""
    found = [re.findall(r"(?:^|\.)layers\.(\d+)(?=\.|$)", n) for n in names]
    slots = [int(f[-1]) for f in found if f]
    fits = isinstance(decoder_layers, int) and decoder_layers > max(slots, default=-1)
    if len(slots) == len(names) and fits:
        return slots, decoder_layers
    return list(range(len(names))), len(names)


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``hidden``; in the backward, ``aux``'s gradient is ``scale`` (so the backward of the
    model's output adds ``scale · ∇aux``). Saves no tensor (activation recomputation replays it unchanged).
    Source: Megatron-LM ``MoEAuxLossAutoScaler``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale, ctx.meta = scale, (aux.shape, aux.dtype, aux.device)
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype, device = ctx.meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


class RouterStats:
    """The routers of one module during a train node's call: expert counts, the load-balancing loss and its
    gradient (see the module docstring). Open with :func:`router_stats`.

    On a pipeline stage (a model cut by ``rlflow.schedulers.runtime.distributed.pipeline.make_stage``, whose
    decoder layers keep their global indices) the stage hooks its own MoE layers only: ``stage_sum`` (a sum
    over the stages, ``TrainHooks.stage_sum``) gives the model's MoE-layer count, so each layer's loss term
    has the weight it has in one process, and :meth:`metrics` sums every stage's counts. Under activation
    recompute a backward reruns a layer's router after later forwards (1F1B; a DPO step's second forward):
    :meth:`recompute_context` gives the rerun its own forward's padding mask, so the loss it recomputes is
    the forward's.

    Attributes:
        coef: ``router_aux_loss_coef`` (0: the loss is measured, not trained on).
        scale: the weight of the current micro-batch's loss term (set by the train loop:
            ``coef / (micro-batches of the rank × data-parallel ranks)``, 0 for a filler micro-batch).
        counting: whether forwards count now (off during backward ops, whose recomputed forwards replay).
        layers: the model's MoE layers Y (every pipeline stage's); ``counts_YE`` and ``tokens_Y`` hold this
            module's (a stage's) layers only.
    """

    def __init__(
        self, module: nn.Module, family: MoeFamily, coef: float, config: Any, stage_sum: Any = None
    ) -> None:
        top = next(m for m in module.modules() if _records_routers(type(m)))
        router_cls = _router_recorder(type(top)).target_class
        self.family, self.coef, self.scale, self.counting = family, float(coef), 0.0, True
        self._aux_fn = None  # the architecture's own (the module's classes may be FSDP2's subclasses)
        if family.aux_loss:
            name = f"transformers.models.{family.model_type}.modeling_{family.model_type}"
            self._aux_fn = importlib.import_module(name).load_balancing_loss_func
        self._mask: torch.Tensor | None = None
        self._device = next(module.parameters()).device
        self._pending: dict[int, torch.Tensor] = {}
        self._recomputing = False  # inside a backward's recomputation (recompute_context)
        names = [n for n, m in module.named_modules() if isinstance(m, router_cls)]
        first: Any = module.get_submodule(names[0]) if names else None  # a stage may hold no MoE layer
        experts = int(first.num_experts if first is not None else _get(config, family.experts_key) or 0)
        self.counts_YE = torch.zeros(len(names), experts, dtype=torch.float64)
        self.tokens_Y = torch.zeros(len(names), dtype=torch.float64)
        self._aux_sum, self._aux_n = 0.0, 0
        # each router's decoder layer (global on a pipeline stage) among the decoder's layers
        self._slot_Y, slots = _decoder_slots(names, _get(config, "num_hidden_layers"))
        moe_L = torch.zeros(slots, dtype=torch.float64)
        moe_L[self._slot_Y] = 1.0
        self._stage_sum = stage_sum or (lambda t: t)
        self._moe_L = self._stage_sum(moe_L.to(self._device)).cpu() > 0  # every stage's MoE layers
        self.layers = int(self._moe_L.sum())
        self._handles = [top.register_forward_pre_hook(self._inputs, with_kwargs=True)]
        for y, name in enumerate(names):
            block = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            self._handles.append(module.get_submodule(name).register_forward_hook(self._router(y, id(block))))
            self._handles.append(block.register_forward_hook(self._block(id(block))))

    def _inputs(self, _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        self._mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None

    def _router(self, y: int, block: int) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            train = self.coef > 0 and torch.is_grad_enabled()
            counting = self.counting and not self._recomputing
            if not (train or counting):
                return  # a recomputation without the loss: nothing to count or add
            logits_TE, index_TK = out[0], out[2]
            real_T = None
            if self._mask is not None:  # in a recomputation: its forward's (recompute_context)
                real_T = self._mask.reshape(-1).bool().to(logits_TE.device)
                assert real_T.numel() == logits_TE.shape[0], "router rows are the model's tokens"
            with contextlib.nullcontext() if train else torch.no_grad():
                counts, tokens, aux = layer_stats(logits_TE, index_TK, real_T, self._aux_fn)
            if train and aux is not None:
                self._pending[block] = aux
            if counting:
                self.counts_YE[y] += counts.cpu()
                self.tokens_Y[y] += tokens
                if aux is not None:
                    self._aux_sum, self._aux_n = self._aux_sum + float(aux.detach()), self._aux_n + 1

        return hook

    def recompute_context(self) -> tuple[Any, Any]:
        """torch ``checkpoint``'s ``context_fn`` for a recomputed decoder layer (:func:`rlflow.nodes.train.
        recompute_activations`), called at the layer's forward: a context for the forward (none) and one for
        its recomputation in the backward, which restores this forward's padding mask and marks the routers'
        calls as recomputed (not counted again), whichever forwards ran in between."""
        mask = self._mask

        @contextlib.contextmanager
        def recomputation() -> Iterator[None]:
            before = self._mask, self._recomputing
            self._mask, self._recomputing = mask, True
            try:
                yield
            finally:
                self._mask, self._recomputing = before

        return contextlib.nullcontext(), recomputation()

    def _block(self, block: int) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> Any:
            aux = self._pending.pop(block, None)
            if aux is None:
                return None
            scale = self.scale / max(1, self.layers)  # the mean over the model's layers (all stages)
            if isinstance(out, tuple):
                return (_AddAuxGrad.apply(out[0], aux, scale), *out[1:])
            return _AddAuxGrad.apply(out, aux, scale)

        return hook

    def metrics(self, all_sum: Any) -> dict[str, float]:
        """``moe/aux_loss``: the load-balancing loss (:func:`layer_stats`, without the coefficient) averaged
        over the MoE layers and the train forwards of the call; ``moe/expert_load_max|min``: the largest and
        smallest fraction of a layer's real tokens routed to one expert, over every MoE layer and expert,
        counted over the whole call (each token counts once per chosen expert: K/E when balanced, 0 for an
        expert no token chose). Both over every data-parallel rank (``all_sum``) and pipeline stage (the
        ``stage_sum`` given at opening): the whole node's values, the same on every rank. A family without a
        load-balancing loss (DeepSeek-V3) reports no ``moe/aux_loss``."""
        slots, experts = int(self._moe_L.numel()), int(self.counts_YE.shape[1])
        counts_LE = torch.zeros(slots, experts, dtype=torch.float64)
        tokens_L = torch.zeros(slots, dtype=torch.float64)
        counts_LE[self._slot_Y], tokens_L[self._slot_Y] = self.counts_YE, self.tokens_Y
        aux = torch.tensor([self._aux_sum, float(self._aux_n)], dtype=torch.float64)
        local = torch.cat([counts_LE.flatten(), tokens_L, aux]).to(self._device)  # NCCL: on the GPU
        summed = self._stage_sum(all_sum(local)).cpu()
        n = counts_LE.numel()
        counts_YE = summed[:n].view_as(counts_LE)[self._moe_L]  # the model's MoE layers, in order
        load_YE = counts_YE / summed[n : n + slots][self._moe_L].clamp(min=1).unsqueeze(1)
        out: dict[str, float] = {}
        if self.layers:
            out = {"moe/expert_load_max": float(load_YE.max()), "moe/expert_load_min": float(load_YE.min())}
        if summed[-1] > 0:
            out["moe/aux_loss"] = float(summed[-2] / summed[-1])
        return out

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@contextlib.contextmanager
def router_stats(module: nn.Module, coef: float = 0.0, stage_sum: Any = None) -> Iterator[RouterStats | None]:
    """While open, a :class:`RouterStats` over ``module``'s routers (``None`` for a dense model: nothing is
    hooked). ``module`` is a causal LM, a :class:`rlflow.nodes.models.HeadModel` or an engine wrapping one
    (FSDP2, a pipeline stage, DeepSpeed's ``module``). ``stage_sum``: the train hooks' sum over pipeline
    stages (:meth:`rlflow.nodes.context.TrainHooks.stage_sum`; ``None``: one stage); every rank of the
    node opens it alike (it sums once here, once in :meth:`RouterStats.metrics`).

    Raises:
        ValueError: ``coef`` > 0 on a dense model or a family without a load-balancing loss (graph checks
            refuse both before a run: :func:`moe_graph_mistakes`).
    """
    inner = getattr(module, "module", module)  # DeepSpeed's engine
    config = getattr(inner, "config", None) or getattr(getattr(inner, "backbone", None), "config", None)
    family = moe_family(config) if config is not None else None
    if family is None or not any(_records_routers(type(m)) for m in inner.modules()):
        if coef > 0:
            raise ValueError("router_aux_loss_coef > 0 needs a mixture-of-experts model")
        yield None
        return
    if coef > 0 and not family.aux_loss:
        raise ValueError(
            f"router_aux_loss_coef > 0: {family.model_type} has no load-balancing loss ({family.routing})"
        )
    stats = RouterStats(inner, family, coef, config, stage_sum)
    try:
        yield stats
    finally:
        stats.close()


def moe_graph_mistakes(graph: Graph) -> list[str]:
    """The run-level check of MoE models (:data:`rlflow.nodes.checks.RUN_CHECKS` ``models.moe``): every model
    config :func:`moe_config_problems` refuses, and every train node whose ``args.router_aux_loss_coef`` > 0
    would do nothing (a dense model) or is undefined (a family without a load-balancing loss). One message per
    mistake naming the file, model or node, and key."""
    source = graph.spec.source or "<graph>"
    out: list[str] = []
    families: dict[str, MoeFamily | None] = {}
    refused: set[str] = set()  # models refused above: their nodes' arguments are not checked again
    for name in graph.spec.models:
        config = model_hf_config(graph, name)
        families[name] = moe_family(config) if config is not None else None
        problems = moe_config_problems(config) if config is not None else []
        if problems:
            refused.add(name)
        if graph.spec.models[name].init_from is not None:
            continue  # a copy of another model: its source's problems are reported once, under its name
        out += [f"{source}: models.{name}.config.{key}: {reason}" for key, reason in problems]
    for name, node in graph.spec.nodes.items():
        coef = (node.args or {}).get(AUX_LOSS_ARG.name)
        if node.kind != "train" or not coef or node.model is None or node.model in refused:
            continue
        family = families.get(node.model)
        key = f"{source}: nodes.{name}.args.{AUX_LOSS_ARG.name}"
        if model_hf_config(graph, node.model) is None:
            continue  # known only once built (a path the check cannot read): router_stats refuses it then
        if family is None:
            out.append(f"{key}: {coef}: model '{node.model}' is not a mixture-of-experts model (no router)")
        elif not family.aux_loss:
            what = f"model '{node.model}' ({family.model_type}) has no load-balancing loss"
            out.append(f"{key}: {coef}: {what} ({family.routing}); set it to 0")
    return out


RUN_CHECKS.register("models.moe")(moe_graph_mistakes)
