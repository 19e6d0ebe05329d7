"""Route replay (R3): record the experts each token was routed to while it was generated, and route the
trainer's forwards the same way.

A mixture-of-experts model's router picks each token's top-``K`` experts from its logits; the sampler and the
trainer compute those logits in different ways (a KV-cached decode step against a full teacher-forced
forward, other batch shapes, other kernels or precision), so a near-tied choice flips between them and the
trainer's log-probs stop being the sampler's. Route replay (Ma et al. 2025, "Stabilizing MoE Reinforcement
Learning by Aligning Training and Inference Routers", arXiv 2510.11370) records the sampler's choice and
forces it in training: the *selection* is replayed, the *weights* of the selected experts are recomputed from
the trainer's own router logits by the model's own recipe (softmax over all experts, gathered at the chosen
ones, renormalised when the model renormalises its top-k), so the router keeps its gradient. For a router
that renormalises its top-k (Mixtral, Qwen3-MoE with ``norm_topk_prob``) that is R3's softmax over the
replayed experts' logits; when sampler and trainer agree the forward is the unforced one exactly.

Routes are recorded for every position the trainer's forward computes: the prompt's tokens as well as the
response's, since a prompt token routed differently changes every later token through attention (vLLM's
``prompt_routed_experts``/``routed_experts`` split them the same way). :data:`NO_ROUTE` marks a position
without a recorded route (padding; the response's last token, which the sampler never fed back): the
trainer's router chooses there, which changes no response log-prob.

Layouts: a tensor-parallel rank holds the whole router (replicated: its input, the attention's output, is
gathered) and forces the same routes as its tp peers; an expert-parallel rank forces them before its
all-to-all dispatch (the dispatch reads the router's output); data-parallel ranks and micro-batches take
their rows' routes (the routes are ``[B, ...]`` inputs, split like the others). A pipeline stage holds some
MoE layers only: :func:`number_routers` stamps every router of the full model with its MoE-layer index
before the model is cut, so a stage forces the recorded ``[.., Y, K]`` routes' entries of its own layers,
and :meth:`RouteReplay.finish` sums the agreement over the stages (``TrainHooks.stage_sum``).

Only the Hugging Face routers in :data:`ROUTERS` are known (their outputs are ``(router_logits, top-k
weights, top-k indices)``); a mixture-of-experts model with another router is refused, never approximated.

Shapes (DESIGN.md): B rows, S prompt tokens, R response tokens, L = S + R, Y the model's MoE layers (in
model order), K experts per token, E experts, T tokens of one model call (its ``[B, L]`` flattened, or the
packed ``N``).
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import ModelError, NodeError
from rlflow.nodes.checks import RUN_CHECKS
from rlflow.nodes.context import TrainHooks

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "NO_ROUTE",
    "PROMPT_ROUTES",
    "RESPONSE_ROUTES",
    "ROUTERS",
    "ROUTER_AGREEMENT",
    "ROUTER_MODEL_TYPES",
    "ROUTES_NEED",
    "RouteRecorder",
    "RouteReplay",
    "RouteShape",
    "moe_routers",
    "number_routers",
    "route_replay_mistakes",
    "route_shape",
]

NO_ROUTE = -1
"""A position without a recorded route: the trainer's router chooses there."""
RESPONSE_ROUTES = "routed_experts"
"""The generate node's output (and the train node's input) of the response's routes ``[B, R, Y, K]``."""
PROMPT_ROUTES = "prompt_routed_experts"
"""The same for the prompt's routes ``[B, S, Y, K]`` (left-padded like ``prompt_ids``)."""
_WIDTH_OF = {PROMPT_ROUTES: "prompt_ids", RESPONSE_ROUTES: "response_ids"}  # routes -> ids of its width
ROUTER_AGREEMENT = "rollout/router_agreement"
"""Metric: the fraction (0 to 1) of recorded token-layer routes whose top-k *set* the trainer's router picks
unforced, over the forwards a train node runs at the sampler's weights (before its first optimizer step)."""


@dataclass(frozen=True)
class RouterRule:
    """How a router class turns its logits into the top-k weights: ``normalise(router)`` says whether the
    gathered softmax probabilities are renormalised to sum to 1 (always in float32, then cast to the dtype
    the router returns)."""

    normalise: Callable[[nn.Module], bool]


ROUTERS: dict[str, RouterRule] = {
    "Qwen3MoeTopKRouter": RouterRule(lambda r: bool(r.norm_topk_prob)),  # transformers qwen3_moe
    "MixtralTopKRouter": RouterRule(lambda r: True),  # transformers mixtral
}
"""Router classes (by name) whose routes can be recorded and replayed, with their weighting recipe."""
ROUTER_MODEL_TYPES = ("qwen3_moe", "mixtral")
"""The ``model_type`` of each Hugging Face family whose router is in :data:`ROUTERS`: ``record_routes`` and
``route_replay`` need one (their :attr:`~rlflow.dataflow.args.Arg.model_types`, checked at graph binding)."""
ROUTES_NEED = (ROUTER_MODEL_TYPES, "a mixture-of-experts model whose router route replay knows")
"""``Arg.model_types`` of ``record_routes`` and ``route_replay``: a dense model has no routes to record or
replay."""


@dataclass(frozen=True)
class RouteShape:
    """``layers`` Y (MoE layers, in model order), ``top_k`` K and ``experts`` E of a model's routers."""

    layers: int
    top_k: int
    experts: int


def _hf_model(model: nn.Module) -> nn.Module:
    return getattr(model, "backbone", model)


def _rule(module: nn.Module) -> RouterRule | None:
    """The :data:`ROUTERS` rule of ``module``'s class or of a class it derives from (FSDP2's ``fully_shard``
    swaps a module's class for a subclass named ``FSDP<name>``); ``None``: not a known router."""
    return next((ROUTERS[c.__name__] for c in type(module).__mro__ if c.__name__ in ROUTERS), None)


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in model order (one per MoE layer).

    Raises:
        ModelError: the model has no router (a dense model: nothing to record or replay), or one of a class
            not in :data:`ROUTERS` (named, with the model type).
    """
    routers = [m for m in model.modules() if _rule(m) is not None]
    unknown = sorted(
        {type(m).__name__ for m in model.modules() if type(m).__name__.endswith("Router")}
        - {type(m).__name__ for m in routers}
    )
    config = getattr(_hf_model(model), "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    if unknown:
        raise ModelError(
            f"route replay: model type '{kind}' routes with {', '.join(unknown)}, which it does not know "
            f"(known: {', '.join(ROUTERS)})"
        )
    if not routers:
        raise ModelError(
            f"route replay: model type '{kind}' has no mixture-of-experts router (known: "
            f"{', '.join(ROUTERS)}); a dense model routes nothing"
        )
    return routers


_LAYER = "route_layer"  # a router's (MoE-layer index in model order, the full model's MoE layers)


def number_routers(model: nn.Module) -> None:
    """Stamp every known router of the *full* ``model`` with its MoE-layer index ``y`` in model order and
    the model's MoE-layer count ``Y`` (a plain attribute: it survives ``copy.deepcopy``, FSDP2 and tensor
    parallel), so that a pipeline stage cut from it afterwards maps its routers to the routes' Y axis
    (:func:`route_layers`). A dense model: nothing to stamp."""
    routers = [m for m in model.modules() if _rule(m) is not None]
    for y, router in enumerate(routers):
        router.__dict__[_LAYER] = (y, len(routers))


def route_layers(routers: list[nn.Module]) -> tuple[list[int], int]:
    """The MoE-layer index (model order) of each of ``routers`` (:func:`moe_routers` of a model, or of a
    pipeline stage cut from a model :func:`number_routers` stamped) and the full model's MoE-layer count Y."""
    stamps: list[tuple[int, int]] = [r.__dict__.get(_LAYER, (-1, 0)) for r in routers]
    if any(y < 0 for y, _ in stamps):  # not stamped: the whole model
        return list(range(len(routers))), len(routers)
    return [y for y, _ in stamps], stamps[0][1]


def route_shape(model: nn.Module) -> RouteShape:
    """:class:`RouteShape` of ``model``'s routers, Y counting the full model's MoE layers on a pipeline stage
    (raises :class:`ModelError` as :func:`moe_routers`)."""
    routers = moe_routers(model)
    top_k: Any = routers[0].top_k  # an int attribute of every router in ROUTERS
    experts: Any = routers[0].num_experts
    return RouteShape(route_layers(routers)[1], int(top_k), int(experts))


class RouteRecorder:
    """While open (a context manager), the top-k indices every router of ``model`` picks, one ``[T, Y, K]``
    tensor per model call in call order (:attr:`calls`)."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = moe_routers(model)
        self.shape = route_shape(model)
        if self.shape.layers != len(self.routers):
            raise ModelError(
                f"route recording: this pipeline stage holds {len(self.routers)} of the model's "
                f"{self.shape.layers} MoE layers; routes are recorded on a whole model only (pp = 1)"
            )
        self._per_layer: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list[Any] = []

    def __enter__(self) -> RouteRecorder:
        for y, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(y)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, y: int) -> Callable[..., None]:
        def hook(router: nn.Module, args: Any, output: Any) -> None:
            self._per_layer[y].append(output[2].detach().to(torch.int32))

        return hook

    @property
    def calls(self) -> list[torch.Tensor]:
        """``[T, Y, K]`` int32 per model call."""
        return [torch.stack(layers, dim=1) for layers in zip(*self._per_layer, strict=True)]

    def generation_routes(
        self, prompt_mask: torch.Tensor, response_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routes of one built-in decode loop (:func:`rlflow.nodes.generation.generate`: a prefill over
        the ``[B, S]`` prompts, then one call per sampled token but the last) as ``(prompt [B, S, Y, K],
        response [B, R, Y, K])`` int32, :data:`NO_ROUTE` where a mask is 0 and at each row's last token.

        ``prompt_mask`` ``[B, S]`` (rows repeated ``n`` times as the loop repeats them), ``response_mask``
        ``[B, R]`` as the loop returned it.
        """
        calls = self.calls
        rows, width = int(prompt_mask.shape[0]), int(prompt_mask.shape[1])
        shape = (self.shape.layers, self.shape.top_k)
        device = prompt_mask.device
        prompt = torch.full((rows, width, *shape), NO_ROUTE, dtype=torch.int32, device=device)
        response = torch.full(
            (rows, response_mask.shape[1], *shape), NO_ROUTE, dtype=torch.int32, device=device
        )
        # the loop's decode calls: one per sampled token but the last (the longest response's length);
        # calls past them are an expert-parallel group's lockstep forwards, not this rank's routes
        steps = int(response_mask.sum(dim=1).max()) if rows else 0
        if calls and rows:
            prompt = calls[0].view(rows, width, *shape).to(device)
            if steps > 1:
                response[:, : steps - 1] = torch.stack([c.to(device) for c in calls[1:steps]], dim=1)
        prompt = prompt.masked_fill(prompt_mask[:, :, None, None] == 0, NO_ROUTE)
        return prompt, response.masked_fill(response_mask[:, :, None, None] == 0, NO_ROUTE)


class RouteReplay:
    """One node call's route replay: hooks on its model's routers that force the routes :meth:`arm` sets,
    and the tally of :data:`ROUTER_AGREEMENT`. Build it with :meth:`start`; :meth:`finish` removes the hooks
    (they also fall silent when the object is gone, e.g. after an error) and returns the metric.

    Activation recompute (a backward rerunning its micro-batch's checkpointed layers, routers included):
    each router's first call after an :meth:`arm` is a forward, and with grad enabled its forced routes are
    queued; a further call before the next :meth:`arm` is a backward's recomputation, which takes the
    oldest queued routes. Backwards run in the order of their forwards under every schedule
    (``TrainHooks.micro_batch_order``), so a recomputation forces its own micro-batch's routes even where
    later forwards came between (a pipeline's 1F1B)."""

    def __init__(self, node: str, model: nn.Module, version: Callable[[], int]) -> None:
        self.node = node
        self.routers = moe_routers(model)
        self.shape = route_shape(model)
        self.rules = [rule for r in self.routers if (rule := _rule(r)) is not None]
        self.layers = route_layers(self.routers)[0]  # each router's index on the routes' Y axis
        self._version, self._start = version, version()
        self._armed: torch.Tensor | None = None
        self._calls = [0] * len(self.routers)  # per router: calls since the last arm
        self._queued: list[collections.deque[torch.Tensor]] = [collections.deque() for _ in self.routers]
        self.agree = 0
        self.total = 0
        ref = weakref.ref(self)

        def hook(y: int) -> Callable[..., Any]:
            def fn(router: nn.Module, args: Any, output: Any) -> Any:
                replay = ref()
                return None if replay is None else replay._route(y, router, output)

            return fn

        self._handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]

    @classmethod
    def start(cls, ctx: Any, batch: Batch) -> RouteReplay:
        """The replay of node ``ctx.node`` (a train node, or a ``logprobs`` inference node) over ``batch``
        (its :data:`PROMPT_ROUTES` and :data:`RESPONSE_ROUTES` inputs), checked against the model before any
        forward.

        Raises:
            NodeError: an input is missing, not an integer tensor, not ``[B, S|R, Y, K]`` for this batch's
                rows and widths and the model's Y MoE layers and top-K, or names an expert outside
                ``[0, E)`` (names the node, the input and the model; an input as wide as the other one's
                ids is named as the routes bound the other way round); or the model has no known router.
        """
        state = ctx.model
        name = f"node '{ctx.node.name}'"
        try:
            replay = cls(ctx.node.name, state.module, lambda: int(state.version))
        except ModelError as e:
            raise NodeError(f"{name} (model '{state.name}'): route_replay: {e}") from None
        s = replay.shape
        widths = {k: int(batch.tensor(ref).shape[1]) for k, ref in _WIDTH_OF.items() if ref in batch}
        for key, ref in _WIDTH_OF.items():
            if key not in batch:
                replay.finish()
                raise NodeError(f"{name}: route_replay reads input '{key}', not in the batch")
            routes = batch.tensor(key)
            want = (*batch.tensor(ref).shape[:2], s.layers, s.top_k)
            bad = ""
            if routes.is_floating_point() or routes.is_complex() or tuple(routes.shape) != want:
                bad = f"is {routes.dtype} {list(routes.shape)}, expected integer {list(want)}"
            elif routes.numel() and (int(routes.max()) >= s.experts or int(routes.min()) < NO_ROUTE):
                bad = f"names experts in [{int(routes.min())}, {int(routes.max())}], outside [0, {s.experts})"
            if bad:
                replay.finish()
                axis = "S" if key == PROMPT_ROUTES else "R"
                other = RESPONSE_ROUTES if key == PROMPT_ROUTES else PROMPT_ROUTES
                width = int(routes.shape[1]) if routes.dim() > 1 else -1
                hint = "were the routes recorded on another model?"
                if routes.dim() == 4 and tuple(routes.shape[2:]) == want[2:] and width == widths.get(other):
                    hint = (
                        f"its width {width} is the {'response' if axis == 'S' else 'prompt'}'s, not the "
                        f"{'prompt' if axis == 'S' else 'response'}'s {want[1]}: are {PROMPT_ROUTES} and "
                        f"{RESPONSE_ROUTES} bound the other way round?"
                    )
                raise NodeError(
                    f"{name}: input '{key}' {bad}: model '{state.name}' has {s.layers} MoE layers, top-"
                    f"{s.top_k} of {s.experts} experts ([B, {axis}, Y, K] with {NO_ROUTE} where nothing was "
                    f"recorded); {hint}"
                )
        return replay

    def routes(self, batch: Batch) -> torch.Tensor:
        """``[B, L, Y, K]``: a (micro-)batch's prompt routes followed by its response routes, the positions of
        :func:`rlflow.nodes.forward.sequence_inputs`."""
        return torch.cat([batch.tensor(PROMPT_ROUTES), batch.tensor(RESPONSE_ROUTES)], dim=1)

    def arm(self, routes_TYK: torch.Tensor) -> None:
        """Force ``routes_TYK`` (``[T, Y, K]``, :data:`NO_ROUTE`: unforced) in the next model calls of T
        tokens, until the next :meth:`arm`."""
        self._armed = routes_TYK.long()
        self._calls = [0] * len(self.routers)

    def _route(self, i: int, router: nn.Module, output: Any) -> Any:
        """The output of router ``i`` (of :attr:`routers`) with the armed routes of its MoE layer forced."""
        if self._armed is None:
            return None
        logits, scores, own = output
        y = self.layers[i]
        self._calls[i] += 1
        forward = self._calls[i] == 1  # else a backward's recomputation of a queued forward
        if forward and torch.is_grad_enabled():
            self._queued[i].append(self._armed)
        if not forward and not self._queued[i]:  # internal: every recomputation follows a queued forward
            raise ModelError(f"node '{self.node}': MoE layer {y}'s router ran again without routes armed")
        armed = self._armed if forward else self._queued[i].popleft()
        force = armed[:, y].to(own.device)
        if force.shape != own.shape:
            raise ModelError(
                f"node '{self.node}': route replay armed {force.shape[0]} tokens, but MoE layer {y}'s router "
                f"routes {own.shape[0]}"
            )
        has = force[:, 0] >= 0
        if forward and self._version() == self._start:
            same = (own.sort(dim=-1).values == force.sort(dim=-1).values).all(dim=-1) & has
            self.agree += int(same.sum())
            self.total += int(has.sum())
        idx = torch.where(has[:, None], force, own)
        weights = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
        if self.rules[i].normalise(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, torch.where(has[:, None], weights.to(scores.dtype), scores), idx

    def finish(self, hooks: TrainHooks | None = None) -> dict[str, float]:
        """Remove the hooks; ``{ROUTER_AGREEMENT: agree/total}`` (``{}`` when no recorded route was
        forced at the sampler's weights). ``hooks``: the train node's :class:`TrainHooks`, whose
        ``all_sum`` and ``stage_sum`` add the counts of every data-parallel share and pipeline stage, so
        that every rank reports the whole batch's and model's agreement (a collective: every rank of the
        node calls it); ``None``: this rank's counts."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._armed = None
        self._queued = [collections.deque() for _ in self.routers]
        agree, total = float(self.agree), float(self.total)
        if hooks is not None:
            counts = hooks.stage_sum(hooks.all_sum(torch.tensor([agree, total], dtype=torch.float64)))
            agree, total = float(counts[0]), float(counts[1])
        return {ROUTER_AGREEMENT: agree / total} if total else {}


def route_replay_mistakes(graph: Graph) -> list[str]:
    """The run-level check of route replay (:data:`rlflow.nodes.checks.RUN_CHECKS` ``nodes.route_replay``):
    a generate node with ``record_routes`` and ``interrupt_every``, on a pipeline-parallel layout, or leaving
    an output of the routes unbound (``record_routes`` on the vLLM engine is the engine check's:
    :func:`rlflow.nodes.engines.validation.vllm_problem`, which a searched engine also obeys); a node
    binding those outputs without ``record_routes``; a node with ``route_replay`` whose route inputs are
    bound to the other route output (prompt and response routes swapped) or to no route output, or
    (:func:`_replay_mistakes`) beside a decoupled loss whose π_prox node does not replay. A model without a
    known router is refused before this, at graph binding (:data:`ROUTES_NEED`). One message per mistake
    naming file, node and key."""
    source = graph.spec.source or "<graph>"
    out: list[str] = []
    for name, node in graph.spec.nodes.items():
        args = graph.args(name)
        p = f"{source}: nodes.{name}"
        bound = node.outputs if isinstance(node.outputs, dict) else {}
        outputs = [k for k in (RESPONSE_ROUTES, PROMPT_ROUTES) if bound.get(k) is not None]
        record = args.get("record_routes") is True
        if outputs and not record:
            out.append(
                f"{p}.outputs.{outputs[0]}: bound, but args.record_routes is not true (nothing would be "
                "recorded); set it or remove the output"
            )
        if record:  # on the vLLM engine: refused by engines.validation.vllm_problem, once
            if node.interrupt_every:
                out.append(
                    f"{p}.args.record_routes: routes are recorded in one generation call, not across "
                    "interrupt_every segments (their tokens route under other weights); remove one"
                )
            if graph.spec.plan != "auto" and graph.placement(name).layout.pp > 1:
                out.append(
                    f"{p}.args.record_routes: the plan's layout has pp={graph.placement(name).layout.pp}; "
                    "routes are recorded on a whole model (a pipeline stage holds part of the MoE layers); "
                    "use pp = 1 for this generate node"
                )
            missing = [k for k in (RESPONSE_ROUTES, PROMPT_ROUTES) if k not in outputs]
            if missing:
                out.append(
                    f"{p}.outputs: args.record_routes is true but {' and '.join(missing)} "
                    f"{'are' if len(missing) > 1 else 'is'} not bound (the "
                    "recorded routes would be discarded); bind both outputs"
                )
        if args.get("route_replay") is True:
            out += _route_input_mistakes(graph, name, p)
            out += _replay_mistakes(graph, name, args, f"{p}.args.route_replay")
    return out


_WHAT = {PROMPT_ROUTES: "the prompt's routes [B,S,Y,K]", RESPONSE_ROUTES: "the response's routes [B,R,Y,K]"}


def _route_input_mistakes(graph: Graph, node: str, p: str) -> list[str]:
    """Node ``node``'s route inputs each bound to the key of a generate node's output of the same name: one
    bound to the other route output (the two swapped, in the node's inputs or in the producer's outputs)
    or to an output that holds no routes is named, with the output it reads."""
    inputs = graph.node(node).inputs
    out = []
    for param in (PROMPT_ROUTES, RESPONSE_ROUTES):
        key = inputs.get(param) if isinstance(inputs, dict) else None
        if key is None or (producer := graph.producer(key)) == "data":
            continue
        made = graph.node(producer).outputs
        output = next((o for o, k in made.items() if k == key), None) if isinstance(made, dict) else None
        if output == param or output is None:
            continue
        held = _WHAT.get(output, "no routes")
        fix = (
            f"bind it to the key of output {param} of node '{producer}' (were {PROMPT_ROUTES} and "
            f"{RESPONSE_ROUTES} swapped?)"
            if output in _WHAT
            else f"bind it to the key of a generate node's output {param} (args.record_routes)"
        )
        out.append(
            f"{p}.inputs.{param}: bound to key '{key}', output {output} of node '{producer}' ({held}), but "
            f"{param} reads {_WHAT[param]}; {fix}"
        )
    return out


def _replay_mistakes(graph: Graph, node: str, args: dict[str, Any], where: str) -> list[str]:
    """A train node's ``route_replay`` with a decoupled loss whose π_prox node (an inference node) does not
    replay too."""
    out = []
    if args.get("decoupled_loss") is True:
        inputs = graph.node(node).inputs
        key = inputs.get("prox_logprobs") if isinstance(inputs, dict) else None
        prox = graph.producer(key) if key is not None else "data"
        if prox == "data" or graph.args(prox).get("route_replay") is not True:
            src, fix = (f"node '{prox}'", f"set nodes.{prox}.args.route_replay: true")
            if prox == "data":
                src, fix = "the data", "turn one off"
            out.append(
                f"{where}: decoupled_loss reads π_prox from {src}, whose forward does not replay the routes: "
                f"the loss would mix replayed and free routing; {fix}"
            )
    return out


RUN_CHECKS.register("nodes.route_replay")(route_replay_mistakes)
