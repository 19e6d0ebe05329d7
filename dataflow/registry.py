"""Name-keyed registries (node functions, reward functions, ...).

``Registry[T]`` maps names to objects, rejects duplicate names and answers unknown names with a
"did you mean" suggestion. ``NODE_FUNCTIONS`` holds the functions graph nodes run; builtins live in
``nodes.functions`` and register themselves on import (``load_builtin_functions``).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dataflow.errors import RegistryError

__all__ = [
    "NODE_FUNCTIONS",
    "NODE_KINDS",
    "NodeFunction",
    "Registry",
    "did_you_mean",
    "load_builtin_functions",
    "node_function",
]

T = TypeVar("T")

NODE_KINDS: tuple[str, ...] = ("generate", "inference", "train")


def did_you_mean(name: str, choices: Any) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``name``, or ``""``."""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Registry(Generic[T]):
    """Objects keyed by unique name.

    Raises:
        RegistryError: on a duplicate registration, or on ``get`` of an unknown name (with the closest
            registered name suggested).
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self._items: dict[str, T] = {}

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
        try:
            return self._items[name]
        except (KeyError, TypeError):
            raise RegistryError(
                f"unknown {self.what} '{name}'{did_you_mean(name, self._items)}; "
                f"known: {', '.join(sorted(self._items)) or '(none)'}"
            ) from None

    def names(self) -> list[str]:
        """Registered names in registration order."""
        return list(self._items)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}, {self.names()!r})"


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
    """

    name: str
    kind: str
    fn: Callable[..., Any]
    doc: str = ""
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    needs_model: bool = True
    heads: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in NODE_KINDS:
            raise RegistryError(
                f"node function '{self.name}': kind '{self.kind}' is not one of {', '.join(NODE_KINDS)}"
                f"{did_you_mean(self.kind, NODE_KINDS)}"
            )


NODE_FUNCTIONS: Registry[NodeFunction] = Registry("node function")


def node_function(
    name: str,
    kind: str,
    *,
    inputs: tuple[str, ...] | list[str] = (),
    outputs: tuple[str, ...] | list[str] = (),
    needs_model: bool = True,
    heads: tuple[str, ...] | list[str] = (),
    doc: str | None = None,
    registry: Registry[NodeFunction] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator registering ``fn`` as a :class:`NodeFunction` in ``NODE_FUNCTIONS`` (or ``registry``).

    The decorated function is returned unchanged. ``doc`` defaults to the first line of its docstring.
    """

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        text = doc if doc is not None else ((fn.__doc__ or "").strip().splitlines() or [""])[0]
        reg = NODE_FUNCTIONS if registry is None else registry
        reg.add(
            name,
            NodeFunction(
                name=name,
                kind=kind,
                fn=fn,
                doc=text,
                inputs=tuple(inputs),
                outputs=tuple(outputs),
                needs_model=needs_model,
                heads=tuple(heads),
            ),
        )
        return fn

    return deco


def load_builtin_functions() -> None:
    """Import ``nodes.functions`` so the builtin node functions register (absent module is fine)."""
    try:
        importlib.import_module("nodes.functions")
    except ModuleNotFoundError as e:
        if e.name not in ("nodes.functions", "nodes"):
            raise
