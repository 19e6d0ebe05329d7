"""Binding a graph file's names to what they name, before any edge exists.

- model references (:func:`check_references`): ``init_from`` (known, no cycle), ``ema.source`` (known, same
  head, no chain), ``run.eval.model``, ``data.tokenizer`` (a model with a tokenizer), and every inline
  ``config`` naming its ``model_type``;
- each node against its function (:func:`bind_node`): the function and its kind, the node's model and
  head, ``args`` against the function's schema (defaults filled) and the kind of model an argument needs
  (``Arg.model_types``: route replay on a dense model is named before the route inputs it would read),
  ``inputs``/``outputs`` bound to ordered
  ``param -> key`` mappings, and the arg inputs (:class:`~rlflow.dataflow.registry.ArgInput`) its
  arguments turn on.

Errors raise :class:`GraphError` prefixed by the graph file (``spec.source``) and naming the node and key;
:class:`~rlflow.dataflow.graph.Graph` runs these first.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlflow.dataflow.args import SAMPLING_ARGS, ArgError, bind_args
from rlflow.dataflow.errors import GraphError, GraphMistakes, RegistryError, did_you_mean
from rlflow.dataflow.fields import plural
from rlflow.dataflow.model_configs import spec_model_config
from rlflow.dataflow.model_spec import ModelSpec, model_tokenizer
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import ArgInput, NodeFunction, Registry
from rlflow.dataflow.spec import GraphSpec

__all__ = ["BoundNode", "bind_node", "bind_nodes", "check_references"]


@dataclass(frozen=True)
class BoundNode:
    """A node bound to its function.

    Attributes:
        spec: the node with ``inputs``/``outputs`` resolved to ordered ``param -> key`` dicts (an unbound
            optional output maps to ``None``; arg inputs it turns on follow the function's inputs).
        function: the registered function the node runs.
        args: the checked arguments: every declared one, defaults filled from the schema (as written for a
            function without a schema, plus the sampling arguments of a generate node).
        arg_inputs: the arg inputs its ``args`` turn on, in the function's order.
    """

    spec: NodeSpec
    function: NodeFunction
    args: dict[str, Any]
    arg_inputs: tuple[ArgInput, ...]


def check_references(spec: GraphSpec) -> None:
    """Check the models' references to each other and the data's and run's references to models.

    Raises:
        GraphError: an unknown or cyclic ``init_from``, a bad ``ema.source``, a ``config`` without
            ``model_type``, an unknown ``run.eval.model`` or ``data.tokenizer``, or a ``data.tokenizer``
            model without a tokenizer.
    """
    binder = _Binder(spec)
    binder.check_models()
    binder.check_data()


def bind_node(spec: GraphSpec, node: NodeSpec, registry: Registry[NodeFunction]) -> BoundNode:
    """``node`` of ``spec`` bound to its function in ``registry`` (see the module docstring).

    Raises:
        GraphError: an unknown function, a kind that differs from the function's, a missing, unknown,
            frozen (train node) or wrong-headed model, a generate node's model without a tokenizer, a bad
            argument or one its model cannot take (``Arg.model_types``), or inputs/outputs that do not match
            the function's parameters.
    """
    return _Binder(spec).bind(node, registry)


def bind_nodes(spec: GraphSpec, registry: Registry[NodeFunction]) -> dict[str, BoundNode]:
    """Every node of ``spec`` bound (:func:`bind_node`), by name.

    Raises:
        GraphError: one node's mistake, as :func:`bind_node` raises it; :class:`GraphMistakes` where several
            nodes have one (each node's first), so that validate and run name every such node at once.
    """
    bound, mistakes = {}, []
    for name, node in spec.nodes.items():
        try:
            bound[name] = bind_node(spec, node, registry)
        except GraphError as e:
            mistakes.append(e)
    if len(mistakes) == 1:
        raise mistakes[0]
    if mistakes:
        raise GraphMistakes([str(e) for e in mistakes])
    return bound


class _Binder:
    """The checks of one graph spec, with its file name in front of every message."""

    def __init__(self, spec: GraphSpec) -> None:
        self.spec = spec
        self._src = f"{spec.source}: " if spec.source else ""

    def _error(self, msg: str, err: type[Exception] = GraphError) -> Exception:
        return err(self._src + msg)

    def check_models(self) -> None:
        """``init_from``, ``ema.source``, ``run.eval.model`` and every ``config``'s ``model_type``."""
        models = self.spec.models
        for name, m in models.items():
            if m.init_from is not None and m.init_from not in models:
                raise self._error(
                    f"models.{name}.init_from: unknown model '{m.init_from}'"
                    f"{did_you_mean(m.init_from, models)}; models: {', '.join(models)}"
                )
            if m.config is not None:
                mt = m.config.get("model_type")
                if not isinstance(mt, str) or not mt:
                    raise self._error(
                        f"models.{name}.config: needs 'model_type' (a Hugging Face model type such as llama)"
                    )
        for name in models:
            seen = [name]
            cur = models[name].init_from
            while cur is not None:
                if cur in seen:
                    chain = " -> ".join([*seen, cur])
                    raise self._error(f"models.{name}.init_from: models initialise from each other: {chain}")
                seen.append(cur)
                cur = models[cur].init_from

        for name, m in models.items():
            if m.ema is None:
                continue
            src = m.ema.source
            if src not in models:
                raise self._error(
                    f"models.{name}.ema.source: unknown model '{src}'{did_you_mean(src, models)}; "
                    f"models: {', '.join(models)}"
                )
            if models[src].head != m.head:
                raise self._error(
                    f"models.{name}.ema.source: '{name}' has head '{m.head}' but '{src}' has head "
                    f"'{models[src].head}'; an EMA needs the same architecture"
                )
            if models[src].ema is not None:
                raise self._error(
                    f"models.{name}.ema.source: '{src}' itself follows an EMA; chains are not supported"
                )

        self._check_lora(models)

        eval_model = self.spec.run.eval.get("model")
        if eval_model is not None and eval_model not in models:
            raise self._error(
                f"run.eval.model: unknown model {eval_model!r}{did_you_mean(str(eval_model), models)}; "
                f"models: {', '.join(models)}"
            )

    def _check_lora(self, models: Mapping[str, ModelSpec]) -> None:
        """``base_of`` names a LoRA model with the same head; no model copies or follows a base view; a LoRA
        model is trained by some train node and a base view by none."""
        for name, m in models.items():
            if m.base_of is None:
                continue
            p = f"models.{name}.base_of"
            base = models.get(m.base_of)
            if base is None:
                raise self._error(
                    f"{p}: unknown model '{m.base_of}'{did_you_mean(m.base_of, models)}; "
                    f"models: {', '.join(models)}"
                )
            if base.lora is None:
                raise self._error(
                    f"{p}: '{m.base_of}' has no 'lora' section, so it has no base apart from its weights; "
                    f"give models.{m.base_of}.lora, or build '{name}' with init_from: {m.base_of}"
                )
            if base.head != m.head:
                raise self._error(
                    f"{p}: '{name}' has head '{m.head}' but '{m.base_of}' has head '{base.head}'; a base "
                    "view runs the same model"
                )
            if base.head != "lm" and base.lora.train_head is not False:
                raise self._error(
                    f"{p}: the {base.head} head of '{m.base_of}' trains in full (lora.train_head), so "
                    "turning the adapters off would not give its base; set "
                    f"models.{m.base_of}.lora.train_head: false or build '{name}' with init_from: {m.base_of}"
                )
            if m.dtype not in ("auto", base.dtype):
                raise self._error(
                    f"models.{name}.dtype: a base view runs the weights of '{m.base_of}' in their dtype "
                    f"({base.dtype}); remove it"
                )
        for name, m in models.items():
            if m.ema is not None and m.ema.source in models and models[m.ema.source].lora is not None:
                raise self._error(
                    f"models.{name}.ema.source: '{m.ema.source}' trains LoRA adapters on a frozen base; an "
                    "EMA of its merged weights is not supported (follow a fully trained model)"
                )
            for key, src in (("init_from", m.init_from), ("ema.source", m.ema.source if m.ema else None)):
                if src is not None and src in models and models[src].base_of is not None:
                    raise self._error(
                        f"models.{name}.{key}: '{src}' is a base view of '{models[src].base_of}' (no weights "
                        f"of its own); name '{models[src].base_of}' or a model with weights"
                    )
        trained = {n.model for n in self.spec.nodes.values() if n.kind == "train" and n.model is not None}
        for name, m in models.items():  # a base view trained first: the node then leaves its model untrained
            if m.base_of is not None and name in trained:
                raise self._error(
                    f"models.{name}.base_of: a base view is frozen (it is '{m.base_of}' with the adapters "
                    f"off); train '{m.base_of}' instead"
                )
        for name, m in models.items():
            if m.lora is not None and name not in trained:
                raise self._error(
                    f"models.{name}.lora: no train node trains '{name}', so its adapters would stay at their "
                    "initial values; remove 'lora' or add a train node"
                )

    def check_data(self) -> None:
        """``data.tokenizer`` names a model that has a tokenizer."""
        data = self.spec.data
        if data.tokenizer is not None:
            models = self.spec.models
            if data.tokenizer not in models:
                raise self._error(
                    f"data.tokenizer: unknown model '{data.tokenizer}'{did_you_mean(data.tokenizer, models)};"
                    f" models: {', '.join(models)}"
                )
            if model_tokenizer(models, data.tokenizer) is None:
                raise self._error(
                    f"data.tokenizer: model '{data.tokenizer}' has no tokenizer (give models."
                    f"{data.tokenizer}.tokenizer or a path)"
                )

    def bind(self, node: NodeSpec, registry: Registry[NodeFunction]) -> BoundNode:
        """``node`` against its function in ``registry`` (:func:`bind_node`)."""
        p = f"nodes.{node.name}"
        try:
            fn = registry.get(node.function)
        except RegistryError as e:
            raise self._error(f"{p}.function: {e}") from None
        if fn.kind != node.kind:
            raise self._error(
                f"{p}.kind: function '{fn.name}' has kind {fn.kind} but the node's kind is {node.kind}"
            )
        models = self.spec.models
        if fn.needs_model:
            if node.model is None:
                raise self._error(
                    f"{p}.model: function '{fn.name}' runs on a model; name one of: {', '.join(models)}"
                )
            if node.model not in models:
                raise self._error(
                    f"{p}.model: unknown model '{node.model}'{did_you_mean(node.model, models)}; "
                    f"models: {', '.join(models) or '(none)'}"
                )
            model = models[node.model]
            if fn.heads and model.head not in fn.heads:
                raise self._error(
                    f"{p}.model: function '{fn.name}' needs a model with head {' or '.join(fn.heads)}, "
                    f"but model '{model.name}' has head {model.head}"
                )
            if node.kind == "generate" and model_tokenizer(models, model.name) is None:
                raise self._error(
                    f"{p}.model: generate node on model '{model.name}', which has no tokenizer "
                    f"(set models.{model.name}.tokenizer)"
                )
            if node.kind == "train" and not model.trainable:
                raise self._error(
                    f"{p}.model: train node on frozen model '{model.name}' (models.{model.name}.trainable "
                    "is false)"
                )
        elif node.model is not None:
            raise self._error(f"{p}.model: function '{fn.name}' runs without a model; remove 'model'")
        args = self._check_args(node, fn)
        self._check_model_types(node, fn, args)  # before the inputs those arguments would read
        on = tuple(a for a in fn.arg_inputs if a.arg in args and args[a.arg] in a.values)
        inputs = self._bind_inputs(node, fn, args, on)
        outputs = self._bind(node, "outputs", fn.outputs, node.outputs, fn.optional_outputs)
        return BoundNode(dataclasses.replace(node, inputs=inputs, outputs=outputs), fn, args, on)

    def _check_model_types(self, node: NodeSpec, fn: NodeFunction, args: Mapping[str, Any]) -> None:
        """An argument set away from its default that needs a kind of model (:attr:`Arg.model_types`) on a
        model of another ``model_type`` (a config that cannot be read yet is left to the checks that read
        it)."""
        wanted = [a for a in fn.args or () if a.model_types and args.get(a.name) != a.default]
        if not wanted or node.model is None:
            return
        config = spec_model_config(self.spec, node.model)
        kind = None if config is None else config.get("model_type")
        for a in wanted:
            types, what = a.model_types or ((), "")
            if kind is not None and kind not in types:
                raise self._error(
                    f"nodes.{node.name}.args.{a.name}: {_yaml(args[a.name])} needs {what} (model_type "
                    f"{' or '.join(types)}), but model '{node.model}' has model_type '{kind}'; remove "
                    f"args.{a.name} or use such a model"
                )

    def _bind_inputs(
        self, node: NodeSpec, fn: NodeFunction, args: Mapping[str, Any], on: tuple[ArgInput, ...]
    ) -> dict[str, Any]:
        """:meth:`_bind` of ``node``'s inputs, plus the arg inputs (:class:`ArgInput`) its ``args`` ask for
        (``on``): last in a positional list, by name in a mapping; one asked for and not bound, or bound
        and not asked for, is an error naming the input and the argument."""
        if not fn.arg_inputs:
            return self._bind(node, "inputs", fn.inputs, node.inputs, fn.optional_inputs)
        p = f"nodes.{node.name}.inputs"
        off = [a for a in fn.arg_inputs if a not in on]

        def when(a: ArgInput) -> str:
            return f"args.{a.arg} is {' or '.join(map(str, a.values))}"

        def missing(a: ArgInput) -> Exception:
            return self._error(
                f"{p}.{a.name}: args.{a.arg} is {args[a.arg]!r}, which reads input '{a.name}' "
                f"({a.doc}), but the node does not bind it; add it to the node's inputs (last in a list)"
            )

        given = node.inputs
        if isinstance(given, Mapping):
            for a in off:
                if a.name in given:
                    raise self._error(
                        f"{p}.{a.name}: read only when {when(a)}, but {a.arg} is {args.get(a.arg)!r}; remove "
                        f"the input or set args.{a.arg}"
                    )
            for a in on:
                if a.name not in given:
                    raise missing(a)
            rest: tuple[str | None, ...] | Mapping[str, str | None] = {
                k: v for k, v in given.items() if k not in {a.name for a in on}
            }
            extra = {a.name: given[a.name] for a in on}
        else:
            counts = {len(fn.inputs), len(fn.inputs) - len(fn.optional_inputs)}
            k = len(on)
            rest, extra = given, {}
            if k and len(given) - k in counts:
                rest, extra = given[:-k], {a.name: key for a, key in zip(on, given[-k:], strict=True)}
                for name, key in extra.items():  # two arg inputs listed the other way round
                    if key != name and key in extra:
                        order = ", ".join(a.name for a in on)
                        raise self._error(
                            f"{p}.{name}: bound by position to key '{key}', which is input '{key}''s name: "
                            f"list the arg inputs last in the order {order} (or bind them by name)"
                        )
            elif k and len(given) in counts:
                raise missing(on[0])
            elif surplus := (
                0
                if len(given) in counts
                else next((j for j in range(1, len(off) + 1) if len(given) - j in counts), 0)
            ):
                listed = list(given[-surplus:])  # beyond the function's own: arg inputs not asked for
                # the one the extra entry names (a field is usually called as the input), else the first
                a = next((x for x in off if x.name in listed), off[0])
                raise self._error(
                    f"{p}.{a.name}: the node lists {len(given)} inputs, the last "
                    f"({', '.join(map(repr, listed))}) as '{a.name}', read only when {when(a)}, but {a.arg} "
                    f"is {args.get(a.arg)!r}; remove it or set args.{a.arg}"
                )
        note = "; ".join(
            f"{a.name} last, when {when(a)}" if a in on else f"{a.name} only when {when(a)}"
            for a in fn.arg_inputs
        )
        bound = self._bind(node, "inputs", fn.inputs, rest, fn.optional_inputs, note=note)
        return {**bound, **extra}

    def _bind(
        self,
        node: NodeSpec,
        what: str,
        params: tuple[str, ...],
        given: tuple[str | None, ...] | Mapping[str, str | None],
        optional: tuple[str, ...] = (),
        note: str = "",
    ) -> dict[str, Any]:
        """``param -> key`` of a node's inputs or outputs; ``optional`` trailing params are bound all or
        none (unbound: left out of inputs, ``None`` (discarded) in outputs). Outputs may bind a leading
        part of the optional ones (listed in order, or named): the others are discarded. ``note`` ends a
        wrong-count message (the arg inputs)."""
        p = f"nodes.{node.name}.{what}"
        signature = f"{node.function}({', '.join(params)})" if what == "inputs" else ", ".join(params)
        required = params[: len(params) - len(optional)]
        if what == "outputs" and optional:
            if isinstance(given, Mapping) and any(q in given for q in optional):
                named = {**dict.fromkeys(q for q in optional if q not in given), **given}
                return self._bind(node, what, params, named)
            if not isinstance(given, Mapping) and len(required) < len(given) < len(params):
                bound = self._bind(node, what, params[: len(given)], given)
                return {**bound, **dict.fromkeys(params[len(given) :])}
        if optional and (
            (isinstance(given, Mapping) and not any(q in given for q in optional))
            or (not isinstance(given, Mapping) and len(given) == len(required))
        ):
            bound = self._bind(node, what, required, given)
            return bound if what == "inputs" else {**bound, **dict.fromkeys(optional)}
        if isinstance(given, Mapping):
            for param in given:
                if param not in params:
                    raise self._error(
                        f"{p}.{param}: function '{node.function}' has no {what[:-1]} '{param}'"
                        f"{did_you_mean(param, params)}; its {what}: {', '.join(params) or '(none)'}"
                    )
            missing = [q for q in params if q not in given]
            if missing:
                raise self._error(
                    f"{p}: function '{node.function}' {what[:-1]}s {', '.join(missing)} are not bound "
                    f"(its {what}: {', '.join(params)})"
                )
            return {q: given[q] for q in params}
        if len(given) != len(params):
            also = f" (or {len(params) - len(optional)} without the optional {', '.join(optional)})"
            raise self._error(
                f"{p}: function '{node.function}' takes {plural(len(params), what[:-1])} "
                f"({', '.join(params) or 'none'}){also if optional else ''} but the node lists {len(given)}: "
                f"{list(given)}"
                + ("" if what == "inputs" or not params else f" (outputs of {signature})")
                + (f"; plus {note}" if note else "")
            )
        return dict(zip(params, given, strict=True))

    def _check_args(self, node: NodeSpec, fn: NodeFunction) -> dict[str, Any]:
        """``node.args`` checked against ``fn``'s declared arguments (:attr:`NodeFunction.args`), defaults
        filled; what :meth:`Graph.args` returns.

        A function without a schema (a plug-in that predates schemas) is checked by name against its
        keyword parameters (any name when it takes ``**kwargs``), and its ``args`` are returned as written,
        with the sampling arguments (:data:`~rlflow.dataflow.args.SAMPLING_ARGS`) checked and filled for a
        generate node.
        """
        p = f"nodes.{node.name}.args"
        if fn.args is None and node.kind == "generate":
            try:
                sampling = bind_args(SAMPLING_ARGS, node.args, extra=True)
            except ArgError as e:
                raise self._error(f"{p}.{e.key}: {e}") from None
            plain = dataclasses.replace(  # other args
                node, kind="inference", engine="builtin", staleness=0, interrupt_every=0
            )
            return {**self._check_args(plain, fn), **sampling}
        if fn.args is not None:
            try:
                return fn.bind(node.args)
            except ArgError as e:
                who = "" if any(a.name == e.key for a in fn.args) else f"function '{fn.name}' "
                raise self._error(f"{p}.{e.key}: {who}{e}") from None
        try:
            params = inspect.signature(fn.fn).parameters
        except (TypeError, ValueError):  # builtins without a signature: nothing to check
            return dict(node.args)
        allowed = {q for q, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
        if not any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()):
            for arg in node.args:
                if arg not in allowed:
                    raise self._error(
                        f"{p}.{arg}: function '{node.function}' takes no argument '{arg}'"
                        f"{did_you_mean(arg, allowed)}; it takes: {', '.join(sorted(allowed)) or '(none)'}"
                    )
        return dict(node.args)


def _yaml(value: Any) -> str:
    """``value`` as a graph file writes it (``true``, ``null``, ``0.1``)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
