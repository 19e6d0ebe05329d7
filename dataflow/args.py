"""Argument schemas of node functions: what a graph node may write under ``args:``.

A node function declares each argument it accepts as an :class:`Arg` when it registers
(``@node_function(..., args=(Arg("clip_eps", float, 0.2, "PPO clip range ε", low=0, low_open=True), ...))``).
Graph validation (:class:`rlflow.dataflow.graph.Graph`) checks every node's ``args`` (after overrides and
interpolation) against the schema before anything runs, and the registered function receives the bound
values (:func:`bind_args`): every declared argument present, typed, defaults filled from the schema — the one
place a default is written. ``rlflow functions`` prints the schemas.

Types: ``int``, ``float`` (an int is accepted and converted; NaN and ±inf are rejected), ``bool``, ``str``,
``list`` and ``dict``. ``optional=True`` also accepts ``None`` (YAML ``null``), whose meaning the ``doc``
states. Ranges (``low``/``high``, open or closed) apply to numbers; ``choices`` to any type.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlflow.dataflow.errors import GraphError, did_you_mean

__all__ = [
    "ENABLE_SLEEP_MODE",
    "GPU_MEMORY_UTILIZATION",
    "SAMPLES_PER_PROMPT",
    "SAMPLING_ARGS",
    "TOP_K",
    "TOP_P",
    "Arg",
    "ArgError",
    "bind_args",
    "describe_args",
]

_TYPES: tuple[type, ...] = (int, float, bool, str, list, dict)


class ArgError(GraphError):
    """A node argument is unknown, of the wrong type, or outside its declared range or choices.

    ``key`` is the argument's name; the message does not name the file or node (the caller prefixes them).
    """

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(float(x))


@dataclass(frozen=True)
class Arg:
    """One argument of a node function.

    Attributes:
        name: the key under ``args:`` in a graph file.
        type: ``int``, ``float``, ``bool``, ``str``, ``list`` or ``dict``.
        default: the value used when a graph file omits the argument (checked against the schema).
        doc: one-line meaning, with units.
        source: the paper or reference of the argument's role or default ("" if none applies).
        choices: allowed values (empty: any value of ``type``).
        low, high: numeric bounds (``None``: unbounded); ``low_open``/``high_open`` exclude the bound.
        optional: ``None`` is allowed (``doc`` says what it means).
        what: a noun used in messages ("new tokens" -> "new tokens must be a positive integer").
        hint: appended to a range message, e.g. ``"(0: greedy)"``.
        needs: ``(other, values)``: a value other than the default is read only when argument ``other``
            is one of ``values``; otherwise :func:`bind_args` rejects it (it would be silently ignored).
        excludes: ``(other, values, why)``: a value other than the default cannot combine with argument
            ``other`` being one of ``values`` (the two would apply one thing twice, or contradict each
            other: ``why``); :func:`bind_args` rejects the pair.
        model_types: ``(types, what)``: a value other than the default needs a model whose Hugging Face
            config's ``model_type`` is one of ``types`` (``what``: what such a model has, for messages, e.g.
            "a mixture-of-experts router route replay knows"); graph binding refuses it on another model
            before the node's inputs are bound (:func:`rlflow.dataflow.binding.bind_node`), so the model's
            kind is named first, not the inputs the argument would read. A model whose config cannot be
            read yet (a path not written yet) is not refused here.
    """

    name: str
    type: type
    default: Any
    doc: str
    source: str = ""
    choices: tuple[Any, ...] = ()
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    optional: bool = False
    what: str = ""
    hint: str = ""
    needs: tuple[str, tuple[Any, ...]] | None = None
    excludes: tuple[str, tuple[Any, ...], str] | None = None
    model_types: tuple[tuple[str, ...], str] | None = None

    def __post_init__(self) -> None:
        if self.type not in _TYPES:
            raise TypeError(f"argument '{self.name}': type must be one of {_TYPES}, got {self.type!r}")
        if not self.doc:
            raise TypeError(f"argument '{self.name}': needs a one-line doc")
        try:
            self.check(self.default)
        except ArgError as e:
            raise TypeError(
                f"argument '{self.name}': default {self.default!r} fails its own schema: {e}"
            ) from None

    # -- description ----------------------------------------------------------------------------------
    def type_text(self) -> str:
        """``float``, ``str``, ``int | None``, ..."""
        return self.type.__name__ + (" | None" if self.optional else "")

    def range_text(self) -> str:
        """The allowed values in words: ``one of ppo, gspo``, ``in (0, 1]``, ``>= 0``, or ``""``."""
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        lo, hi = self.low, self.high
        if lo is not None and hi is not None:
            return f"in {'(' if self.low_open else '['}{_num(lo)}, {_num(hi)}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"{'>' if self.low_open else '>='} {_num(lo)}"
        if hi is not None:
            return f"{'<' if self.high_open else '<='} {_num(hi)}"
        return ""

    # -- checking -------------------------------------------------------------------------------------
    def _fail(self, message: str, value: Any) -> ArgError:
        return ArgError(self.name, f"{self.what + ' ' if self.what else ''}{message}, got {value!r}")

    def check(self, value: Any) -> Any:
        """``value`` checked and converted (int -> float for a float argument, tuple -> list).

        Raises:
            ArgError: wrong type, not finite, outside the range or choices (with "did you mean").
        """
        original = value
        if value is None:
            if self.optional:
                return None
            raise self._fail(f"must be a {self.type.__name__} (null is not allowed)", value)
        if self.type is bool:
            if not isinstance(value, bool):
                raise self._fail("must be true or false", value)
        elif self.type is int:
            positive = self.low == 1 and not self.low_open and self.high is None
            if isinstance(value, bool) or not isinstance(value, int):
                raise self._fail("must be a positive integer" if positive else "must be an integer", value)
            if positive and value < 1:
                raise self._fail("must be a positive integer", value)
        elif self.type is float:
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise self._fail("must be a finite number", value)
            value = float(value)
        elif self.type is list:
            if not isinstance(value, list | tuple):
                raise self._fail("must be a list", value)
            value = list(value)
        elif not isinstance(value, self.type):
            raise self._fail(f"must be a {self.type.__name__}", value)
        if self.choices and value not in self.choices:
            raise ArgError(
                self.name, f"unknown value {value!r}{self._suggest(value)}; choices: {self.range_text()[7:]}"
            )
        if self.type in (int, float) and not self._in_range(value):
            hint = f" {self.hint}" if self.hint else ""
            raise self._fail(f"must be {self.range_text()}{hint}", original)
        return value

    def _suggest(self, value: Any) -> str:
        folded = [c for c in self.choices if str(c).lower() == str(value).lower()]
        if folded:
            return f" (did you mean '{folded[0]}'?)"
        return did_you_mean(str(value), self.choices)

    def _in_range(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))


def bind_args(schema: Sequence[Arg], given: Mapping[str, Any], extra: bool = False) -> dict[str, Any]:
    """Every argument of ``schema``: the checked value from ``given``, else the schema's default.

    ``extra``: names outside the schema pass through unchecked (a function that forwards options, e.g. a
    reward function's); otherwise they are rejected.

    Raises:
        ArgError: an unknown name (with "did you mean" and the accepted names) or a bad value.
    """
    names = [a.name for a in schema]
    out: dict[str, Any] = {}
    for key in given:
        if key not in names and not extra:
            raise ArgError(
                key,
                f"takes no argument '{key}'{did_you_mean(key, names)}; it takes: "
                f"{', '.join(sorted(names)) or '(none)'}",
            )
    for arg in schema:
        out[arg.name] = arg.check(given[arg.name]) if arg.name in given else copy.deepcopy(arg.default)
    for arg in schema:
        if arg.needs is not None and out[arg.name] != arg.default and out[arg.needs[0]] not in arg.needs[1]:
            other, values = arg.needs
            raise ArgError(
                arg.name,
                f"is read only when {other} is {' or '.join(map(str, values))}, but {other} is "
                f"{out[other]!r}; remove it or set {other}",
            )
        if (
            arg.excludes is not None
            and out[arg.name] != arg.default
            and out[arg.excludes[0]] in arg.excludes[1]
        ):
            other, _, why = arg.excludes
            raise ArgError(
                arg.name, f"cannot be combined with {other} {out[other]!r}: {why}; remove one of them"
            )
    out.update({k: v for k, v in given.items() if k not in names})
    return out


SAMPLES_PER_PROMPT = Arg(
    "n", int, 1, "samples per prompt (the group size of GRPO/RLOO)", low=1, what="samples per prompt"
)
"""``args.n`` of a generate node: graph validation reads it (group sizes, batch sizes)."""
TOP_K = Arg(
    "top_k",
    int,
    None,
    "keep the k largest logits (null: off)",
    "Fan et al. 2018",
    low=1,
    optional=True,
    what="top-k",
)
TOP_P = Arg(
    "top_p",
    float,
    None,
    "nucleus: keep the smallest set of tokens with mass >= p (null: off)",
    "Holtzman et al. 2020",
    low=0,
    high=1,
    low_open=True,
    optional=True,
)
GPU_MEMORY_UTILIZATION = Arg(
    "gpu_memory_utilization",
    float,
    None,
    "share of its device's memory the vLLM engine takes for weights, activation workspace and KV cache; it "
    "admits as many rows as the KV cache holds and batches the rest continuously (null: a KV cache sized "
    "for every row of a call at full context); engine vllm only",
    "vLLM's gpu_memory_utilization; Kwon et al. 2023 (PagedAttention)",
    low=0,
    high=1,
    low_open=True,
    optional=True,
)
"""``args.gpu_memory_utilization`` of a generate node run by vLLM (``rlflow.nodes.engines.sizing``); the
planner reads it (``PlanNode.gpu_memory_utilization``), the engine validation refuses it for ``engine:
builtin``."""
ENABLE_SLEEP_MODE = Arg(
    "enable_sleep_mode",
    bool,
    False,
    "between its calls the vLLM engine sleeps: its weights go to host memory and its KV cache is freed, "
    "so the nodes colocated with it get the device's memory; CUDA only; engine vllm only",
    "vLLM's enable_sleep_mode, LLM.sleep(level=1)",
)
"""``args.enable_sleep_mode`` of a generate node run by vLLM: the runtime reads it when it starts the engine
(``rlflow.nodes.engines.engine_restart.start_engine``); the planner prices the engine's memory as the node's
working memory instead of resident (``PlanNode.sleep_mode``); the engine validation refuses it for
``engine: builtin`` and off CUDA."""
SAMPLING_ARGS: tuple[Arg, ...] = (
    SAMPLES_PER_PROMPT,
    Arg("temperature", float, 1.0, "softmax temperature of sampling", low=0, hint="(0: greedy)"),
    TOP_K,
    TOP_P,
    Arg(
        "max_new_tokens",
        int,
        16,
        "response length limit (tokens); a response reaching it without a stop token is truncated",
        low=1,
        what="new tokens",
    ),
)
"""The sampling arguments of a generate node. Graph validation checks them for every generate node, also
one whose function declares no schema, and the planner and the evaluation read them (``n``,
``max_new_tokens``); generate functions declare them with these definitions."""


def describe_args(schema: Sequence[Arg]) -> list[str]:
    """One line per argument: name, type, default, allowed values, meaning, source (``rlflow functions``)."""
    if not schema:
        return ["(none)"]
    width = max(len(a.name) for a in schema)
    lines = []
    for a in schema:
        allowed = a.range_text()
        needs = f"; read only when {a.needs[0]} is {' or '.join(map(str, a.needs[1]))}" if a.needs else ""
        if a.excludes:
            needs += f"; not with {a.excludes[0]} {' or '.join(map(str, a.excludes[1]))}"
        if a.model_types:
            needs += f"; model_type {' or '.join(a.model_types[0])} only"
        lines.append(
            f"{a.name:<{width}}  {a.type_text()}, default {_show(a.default)}"
            f"{', ' + allowed if allowed else ''}: {a.doc}{needs}{f' [{a.source}]' if a.source else ''}"
        )
    return lines


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
