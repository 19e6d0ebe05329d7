"""Field checks of graph-file values: each raises an error naming the field by its path in the file.

Shared by the section dataclasses (``model_spec``, ``data_spec``, ``node_spec``, ``plan_spec``, ``run_spec``,
``spec``): ``check_int("nodes.actor_gen.batch_size", value, 1)`` raises
``GraphError("nodes.actor_gen.batch_size: must be >= 1, got 0")``; plan fields pass ``err=PlanError``.
Also the words those messages and the graph's use (:func:`a_node`, :func:`plural`, :func:`show`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from rlflow.dataflow.errors import GraphError, did_you_mean

__all__ = [
    "a_node",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "check_name",
    "check_str",
    "check_str_mapping",
    "fail",
    "plural",
    "show",
]

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")


def fail(path: str, msg: str, err: type[Exception] = GraphError) -> None:
    """Raise ``err`` (default :class:`GraphError`) with ``"<path>: <msg>"``."""
    raise err(f"{path}: {msg}")


def show(value: object) -> str:
    """``repr(value)`` for a message, cut to 60 characters (an integer too long to print is named so)."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit string limit
        return "an integer of more than 4300 digits"
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(
    path: str, value: object, minimum: int | None = None, err: type[Exception] = GraphError
) -> None:
    """``value`` is an integer (not a bool) ``>= minimum``; else ``err`` (default :class:`GraphError`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        fail(path, f"expected an integer, got {show(value)}", err)
    assert isinstance(value, int)
    if minimum is not None and value < minimum:
        fail(path, f"must be >= {minimum}, got {value}", err)


def check_float(path: str, value: object, minimum: float | None = None, strict: bool = False) -> None:
    """``value`` is a finite number (not a bool) ``>= minimum`` (``> minimum`` when ``strict``).

    Raises:
        GraphError: naming ``path``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        fail(path, f"expected a number, got {show(value)}")
    assert isinstance(value, int | float)
    if (isinstance(value, int) and abs(value) > 2**1000) or not math.isfinite(value):
        fail(path, f"must be finite, got {value}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        fail(path, f"must be {'>' if strict else '>='} {minimum}, got {value}")


def check_str(path: str, value: object, optional: bool = False) -> None:
    """``value`` is a non-empty string (or ``None`` when ``optional``); else :class:`GraphError`."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value:
        fail(path, f"expected a non-empty string, got {show(value)}")


def check_bool(path: str, value: object) -> None:
    """``value`` is ``true`` or ``false``; else :class:`GraphError`."""
    if not isinstance(value, bool):
        fail(path, f"expected true or false, got {show(value)}")


def check_choice(path: str, value: object, choices: tuple[str, ...]) -> None:
    """``value`` is one of ``choices``; else :class:`GraphError` with the closest one suggested."""
    check_str(path, value)
    if value not in choices:
        fail(path, f"'{value}' is not one of {', '.join(choices)}{did_you_mean(str(value), choices)}")


def a_node(kind: str) -> str:
    """``a generate node`` / ``an inference node``: a node kind with its article, for messages."""
    return f"{'an' if kind[:1] in ('a', 'e', 'i', 'o', 'u') else 'a'} {kind} node"


def plural(n: int, word: str) -> str:
    """``1 prompt``, ``2 prompts``, ``3 mini-batches``: a count with its noun, for messages."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith(("ch", "sh", "s", "x")) else f"{n} {word}s"


def check_name(path: str, value: object) -> None:
    """``value`` is a name of a model, node or key: letters, digits, ``_``, ``-``, ``.``, not starting
    with a digit; else :class:`GraphError`."""
    check_str(path, value)
    assert isinstance(value, str)
    if not _NAME_RE.match(value):
        fail(
            path, f"'{value}' is not a valid name (letters, digits, '_', '-', '.'; not starting with a digit)"
        )


def check_str_mapping(path: str, value: object) -> None:
    """``value`` is a mapping with string keys; else :class:`GraphError`."""
    if not isinstance(value, Mapping):
        fail(path, f"expected a mapping, got {show(value)}")
    assert isinstance(value, Mapping)
    for k in value:
        if not isinstance(k, str):
            fail(path, f"keys must be strings, got {show(k)}")
