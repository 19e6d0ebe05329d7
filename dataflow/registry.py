"""Name-keyed registries (node functions, reward functions, data generators, ...) and their plug-ins.

``Registry[T]`` maps names to objects, rejects duplicate names and answers unknown names with a
"did you mean" suggestion. ``NODE_FUNCTIONS`` holds the functions graph nodes run.

Plug-ins: a registry with an entry-point ``group`` loads, on its first lookup, every module that an
installed distribution declares in that group (``importlib.metadata`` entry points); importing the module
registers its objects through the decorators. rlflow's own node functions, rewards and data generators
arrive this way (``pyproject.toml``), so this floor never names the floors above it; a third-party
package plugs in the same way::

    [project.entry-points."rlflow.node_functions"]
    my_functions = "my_package.node_functions"   # a module using @node_function(...)

Groups: :data:`NODE_FUNCTION_PLUGINS`, ``rlflow.rewards``, ``rlflow.data_generators``, ``rlflow.tools`` and
``rlflow.environments`` (agent rollouts, ``rlflow.nodes.agent.env``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rlflow.dataflow.args import Arg, ArgError, bind_args
from rlflow.dataflow.errors import RegistryError, did_you_mean

if TYPE_CHECKING:
    from rlflow.dataflow.filtering import FilterRule

__all__ = [
    "NODE_FUNCTIONS",
    "NODE_FUNCTION_PLUGINS",
    "NODE_KINDS",
    "ArgInput",
    "NodeFunction",
    "Registry",
    "load_builtin_functions",
    "node_function",
]

T = TypeVar("T")

NODE_KINDS: tuple[str, ...] = ("generate", "inference", "train")


class Registry(Generic[T]):
    """Objects keyed by unique name, optionally filled by the plug-ins of an entry-point ``group``.

    Lookups (``get``, ``in``, ``names``, iteration, ``len``) first load the group's plug-ins, once.

    Raises:
        RegistryError: on a duplicate registration, on ``get`` of an unknown name (with the closest
            registered name suggested), or when a plug-in module fails to import (naming the entry
            point and its distribution).
    """

    def __init__(self, what: str, group: str | None = None) -> None:
        self.what = what
        self.group = group
        self._items: dict[str, T] = {}
        self._plugins_loaded = group is None

    def load_plugins(self) -> None:
        """Import every module declared in this registry's entry-point group (once; no group: nothing)."""
        if self._plugins_loaded:
            return
        self._plugins_loaded = True  # set first: a plug-in module may look names up while registering
        assert self.group is not None
        for ep in importlib.metadata.entry_points(group=self.group):
            try:
                ep.load()
            except Exception as e:
                self._plugins_loaded = False
                dist = ep.dist.name if ep.dist is not None else "?"
                raise RegistryError(
                    f"{self.what} plug-in '{ep.name}' = '{ep.value}' (entry point group '{self.group}' of "
                    f"distribution '{dist}') failed to load: {type(e).__name__}: {e}"
                ) from e

    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name``; returns ``obj``."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.what} name must be a non-empty string, got {name!r}")
        if name in self._items:
            raise RegistryError(f"duplicate {self.what} '{name}': already registered")
        self._items[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""

        def deco(obj: T) -> T:
            return self.add(name, obj)

        return deco

    def get(self, name: str) -> T:
        """The object registered as ``name``."""
        self.load_plugins()
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise RegistryError(
                f"unknown {self.what} '{name}'{did_you_mean(name, self._items)}; "
                f"known: {', '.join(sorted(self._items)) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        """Registered names in registration order."""
        self.load_plugins()
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        self.load_plugins()
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        self.load_plugins()
        return iter(list(self._items))

    def __len__(self) -> int:
        self.load_plugins()
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {list(self._items)!r})"


@dataclass(frozen=True)
class ArgInput:
    """An input a node binds exactly when one of its arguments asks for it.

    Attributes:
        name: the canonical input parameter (``prox_logprobs``); not one of the function's ``inputs``.
        arg: the argument that turns it on (``decoupled_loss``).
        values: the values of ``arg`` that read the input (``(True,)``); with any other value, binding the
            input is an error (it would be silently ignored).
        doc: what the input holds and where it comes from, for messages and ``rlflow functions``.
        own_forward: the key must come from an inference node calling the consumer's model: a forward pass
            of the weights the consumer (a train node) is about to update (e.g. the proximal policy's
            log-probs of decoupled PPO).
    """

    name: str
    arg: str
    values: tuple[Any, ...]
    doc: str
    own_forward: bool = False


@dataclass(frozen=True)
class NodeFunction:
    """A function a graph node runs.

    Attributes:
        name: registry name used in graph files (``function: generate``).
        kind: ``generate`` | ``inference`` | ``train``; must match the node's kind.
        fn: the implementation (signature defined by the runtime in ``nodes``).
        doc: one-line description.
        inputs: canonical input parameter names, in positional order.
        outputs: canonical output parameter names, in positional order.
        needs_model: whether the node must name a model.
        heads: model heads the function accepts (``lm``, ``value``, ``score``); empty = any.
        group_wise: for a function whose statistics are computed within each group of ``n`` samples of
            one prompt (GRPO's, RLOO's baseline), why (with the source); ``None`` otherwise. Validation
            then demands groups of at least 2 samples and mini-batches of whole groups.
        args: the declared arguments (:class:`~rlflow.dataflow.args.Arg`); ``fn`` then receives every one
            of them checked and with defaults filled. ``None``: undeclared (a plug-in that predates
            schemas): graph validation checks names against ``fn``'s keyword parameters only.
        extra_args: why names outside ``args`` are accepted and forwarded unchecked (e.g. a reward
            function's options); ``None``: they are rejected.
        optional_inputs: trailing ``inputs`` a node may leave unbound (a positional list may stop before
            them, a mapping may omit them); they are bound all together or not at all, and an unbound one
            is absent from the batch the function gets.
        optional_outputs: trailing ``outputs`` a node may leave unbound (discarded).
        arg_inputs: inputs bound after all ``inputs`` (last in a positional list, or by name) exactly when
            an argument asks for them (:class:`ArgInput`); graph validation rejects a node whose
            arguments ask for one it does not bind, or that binds one its arguments do not read.
        check: the function's own pre-launch check, ``check(graph, node_name) -> list[str]``: mistakes a
            node calling it would fail on at run time (an unresolvable reward, tool or environment), each a
            message naming the file, node and key; run by ``rlflow validate`` and before a run starts, so
            the runtime and CLI never branch on a function's name. ``None``: nothing beyond the schema.
        args_check: a pre-launch check of the bound arguments alone, ``args_check(args, where) ->
            list[str]`` (``where``: the key prefix the messages start with, e.g. ``"g.yaml: nodes.n.args"``):
            what the arguments name that cannot be had on this host (a sandbox); run for every node calling
            the function and for the held-out evaluation's reward (``run.eval.reward_args``), which has no
            node. ``None``: none.
        first_pass: ``first_pass(args, mini_batches) -> float`` from the node's bound arguments and its
            ``mini_batches``: the share of a call's rows (0 to 1) over which it runs a no-grad forward of
            its own model before the train step (a PPO-style trainer recomputing the old policy's log-probs
            where its train forward does not give them); the planner prices it from this. ``None``: never.
        filters: ``filters(args) -> FilterRule`` from the node's bound arguments: the function keeps prompt
            groups by a predicate, and the runtime refills its batch with rounds of generation
            (:mod:`rlflow.dataflow.filtering`; raises ``ArgError`` for arguments the rule refuses).
            ``None``: not a filter.
    """

    name: str
    kind: str
    fn: Callable[..., Any]
    doc: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    needs_model: bool = True
    heads: tuple[str, ...] = field(default=())
    group_wise: str | None = None
    args: tuple[Arg, ...] | None = None
    extra_args: str | None = None
    optional_inputs: tuple[str, ...] = ()
    optional_outputs: tuple[str, ...] = ()
    arg_inputs: tuple[ArgInput, ...] = ()
    check: Callable[[Any, str], list[str]] | None = None
    args_check: Callable[[dict[str, Any], str], list[str]] | None = None
    first_pass: Callable[[dict[str, Any], int], float] | None = None
    filters: Callable[[dict[str, Any]], FilterRule] | None = None

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise RegistryError(
                f"node function '{self.name}': kind '{self.kind}' is not one of {', '.join(NODE_KINDS)}"
                f"{did_you_mean(self.kind, NODE_KINDS)}"
            )
        for what, params, optional in (
            ("inputs", self.inputs, self.optional_inputs),
            ("outputs", self.outputs, self.optional_outputs),
        ):
            if optional and params[len(params) - len(optional) :] != optional:
                raise RegistryError(
                    f"node function '{self.name}': optional {what} {list(optional)} must be the last {what}"
                )
        names = [a.name for a in self.args or ()]
        if len(set(names)) != len(names):
            raise RegistryError(f"node function '{self.name}': an argument is declared twice: {names}")
        for extra in self.arg_inputs:
            if extra.name in self.inputs:
                raise RegistryError(
                    f"node function '{self.name}': arg input '{extra.name}' is also one of its inputs"
                )
            if self.args is not None and extra.arg not in names:
                raise RegistryError(
                    f"node function '{self.name}': arg input '{extra.name}' depends on '{extra.arg}', "
                    "which is not one of its arguments"
                )

    def bind(self, given: dict[str, Any]) -> dict[str, Any]:
        """``given`` (a node's ``args``) checked against :attr:`args`, defaults filled.

        Raises:
            ArgError: an unknown argument or a bad value (names the argument, not the file or node).
        """
        return bind_args(self.args or (), given, extra=self.extra_args is not None)


NODE_FUNCTION_PLUGINS = "rlflow.node_functions"
"""Entry-point group of modules that register node functions (``@node_function``)."""

NODE_FUNCTIONS: Registry[NodeFunction] = Registry("node function", group=NODE_FUNCTION_PLUGINS)


def node_function(
    name: str,
    kind: str,
    *,
    inputs: tuple[str, ...] | list[str] = (),
    outputs: tuple[str, ...] | list[str] = (),
    needs_model: bool = True,
    heads: tuple[str, ...] | list[str] = (),
    group_wise: str | None = None,
    args: tuple[Arg, ...] | list[Arg] | None = None,
    extra_args: str | None = None,
    optional_inputs: tuple[str, ...] | list[str] = (),
    optional_outputs: tuple[str, ...] | list[str] = (),
    arg_inputs: tuple[ArgInput, ...] | list[ArgInput] = (),
    check: Callable[[Any, str], list[str]] | None = None,
    args_check: Callable[[dict[str, Any], str], list[str]] | None = None,
    first_pass: Callable[[dict[str, Any], int], float] | None = None,
    filters: Callable[[dict[str, Any]], FilterRule] | None = None,
    doc: str | None = None,
    registry: Registry[NodeFunction] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``fn`` as a :class:`NodeFunction` in ``NODE_FUNCTIONS`` (or ``registry``).

    ``doc`` defaults to the first line of the function's docstring; the other keywords are the
    :class:`NodeFunction` attributes of the same names. Without ``args`` the function is registered and
    returned unchanged. With ``args``, the decorator registers and returns a wrapper (``functools.wraps``:
    same name, so it pickles by reference) that binds a node's arguments first (:meth:`NodeFunction.bind`):
    the function receives every declared argument, checked and typed (declare them keyword-only without
    defaults: the schema's default is the only one); a bad value raises
    :class:`~rlflow.dataflow.args.ArgError` naming the function.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        text = doc if doc is not None else ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        reg = NODE_FUNCTIONS if registry is None else registry
        entry = NodeFunction(
            name=name,
            kind=kind,
            fn=fn,
            doc=text,
            inputs=tuple(inputs),
            outputs=tuple(outputs),
            needs_model=needs_model,
            heads=tuple(heads),
            group_wise=group_wise,
            args=None if args is None else tuple(args),
            extra_args=extra_args,
            optional_inputs=tuple(optional_inputs),
            optional_outputs=tuple(optional_outputs),
            arg_inputs=tuple(arg_inputs),
            check=check,
            args_check=args_check,
            first_pass=first_pass,
            filters=filters,
        )
        if args is not None:

            @functools.wraps(fn)
            def bound(ctx: Any, batch: Any, **given: Any) -> Any:
                try:
                    values = entry.bind(given)
                except ArgError as e:
                    raise ArgError(e.key, f"node function '{name}': args.{e.key}: {e}") from None
                return fn(ctx, batch, **values)

            entry = dataclasses.replace(entry, fn=bound)
        reg.add(name, entry)
        return entry.fn

    return deco


def load_builtin_functions() -> None:
    """Load the node-function plug-ins (rlflow's own functions included) into ``NODE_FUNCTIONS``."""
    NODE_FUNCTIONS.load_plugins()
