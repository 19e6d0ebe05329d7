"""Environments and tools of multi-turn agent rollouts: plug-ins named in graph files, run contained.

A graph's ``agent_generate`` node names either

- ``tools: [search, ...]``: tool callables ``fn(arguments: str, **options) -> str`` registered in
  :data:`TOOLS` (or dotted paths ``pkg.mod:fn``), served by the built-in :class:`ToolEnv`: a model turn that
  ends with ``<name> arguments </name>`` calls tool ``name``; the observation is
  ``<result> text </result>``; a turn without a call ends the episode; or
- ``env: name``: a class registered in :data:`ENVIRONMENTS` (or a dotted path) with ``reset(prompt)`` and
  ``step(turn_text) -> EnvStep``, made with ``env_args`` as keyword arguments, one instance per row.

Both registries are :class:`rlflow.dataflow.registry.Registry` objects with entry-point groups
(``rlflow.tools``, ``rlflow.environments``), the mechanism of node functions and rewards.

Containment (:func:`run_steps`): each step runs in its own daemon thread, all of a turn's steps at once,
each with a deadline of ``timeout`` seconds. A step that raises, passes its deadline, or returns something
that is not an :class:`EnvStep` with a string observation becomes an *error step* (the configured error
observation, the episode continues) and is counted; nothing a tool does reaches the run. Daemon threads,
not a ``ThreadPoolExecutor``: the executor joins its workers at interpreter exit, so one tool that never
returns would hang the process; an abandoned daemon thread does not. A thread cannot be killed, so the
threads abandoned at their deadline and still running are bounded (:func:`hung_steps`, ``max_hung``): at
the bound a new step starts no thread and fails at once as a timeout, until abandoned ones return.
"""

from __future__ import annotations

import importlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlflow.dataflow.errors import NodeError, RlflowError
from rlflow.dataflow.registry import Registry

__all__ = [
    "ENVIRONMENTS",
    "TOOLS",
    "EnvStep",
    "Environment",
    "StepOutcome",
    "ToolCallError",
    "ToolEnv",
    "ToolFn",
    "ToolGarbageError",
    "env_arg_mistakes",
    "hung_steps",
    "make_env_factory",
    "resolve_tool",
    "run_steps",
]

ToolFn = Callable[..., str]


@dataclass(frozen=True)
class EnvStep:
    """What an environment answers to one model turn.

    Attributes:
        observation: text appended to the context (tokenized, trained with mask 0); ``None``: nothing.
        done: the episode ended (no further model turn).
        reward: a per-turn reward (summed per row into ``env_rewards``).
        tool_calls: tool calls this step made (``ToolEnv``: 1 per call).
    """

    observation: str | None
    done: bool = False
    reward: float = 0.0
    tool_calls: int = 0


class Environment(Protocol):
    """One episode's environment: ``reset`` once with the prompt text, then ``step`` after each model turn
    that ended with a tool-call stop token (``turn_text``: that turn's decoded tokens)."""

    def reset(self, prompt: str) -> None: ...

    def step(self, turn_text: str) -> EnvStep: ...


TOOLS: Registry[ToolFn] = Registry("tool", group="rlflow.tools")
ENVIRONMENTS: Registry[Callable[..., Environment]] = Registry("environment", group="rlflow.environments")


def _import(path: str, what: str) -> Any:
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise NodeError(f"{what} '{path}': write a dotted path as 'pkg.mod:name' or 'pkg.mod.name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise NodeError(f"{what} '{path}': cannot import module '{module_name}': {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise NodeError(f"{what} '{path}': module '{module_name}' has no '{attr}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise NodeError(f"{what} '{path}' is not callable (got {type(obj).__name__})")
    return obj


def _lookup(registry: Registry[Any], name: str, what: str) -> Any:
    if name in registry:
        return registry.get(name)
    if ":" in name or "." in name:
        return _import(name, what)
    registry.get(name)  # raises RegistryError with a "did you mean"
    raise AssertionError("unreachable")


def resolve_tool(name: str) -> ToolFn:
    """The tool registered as ``name`` in :data:`TOOLS`, or the callable at dotted path ``name``.

    Raises:
        RegistryError: an unknown name (with a "did you mean").
        NodeError: a dotted path that does not import or is not callable.
    """
    fn: ToolFn = _lookup(TOOLS, name, "tool")
    return fn


_CALL_RE = re.compile(r"<(\w+)>\s*(.*?)\s*</\1>\s*$", re.DOTALL)


@dataclass
class ToolEnv:
    """The built-in environment of ``tools:``: a turn ending with ``<name> arguments </name>`` calls tool
    ``name`` with ``arguments`` (stripped text); the observation is ``<result> answer </result>``.

    A turn without a well-formed call of a known tool is the model's ``invalid`` call (:func:`run_steps`
    through :class:`ToolCallError`: the error observation); a tool result that is not a string is the
    tool's ``garbage`` (:class:`ToolGarbageError`). ``disabled``: every call is answered with an empty
    result (``<result> </result>``) without running the tool: the same model and prompts with the
    knowledge the tool would give withheld (the "without the tool" baseline).
    """

    tools: dict[str, ToolFn]
    disabled: bool = False
    open_tag: str = "<result>"
    close_tag: str = "</result>"

    def reset(self, prompt: str) -> None:
        return None

    def observe(self, text: str) -> str:
        """``text`` wrapped in the result tags (one space either side)."""
        return f"{self.open_tag} {text} {self.close_tag}" if text else f"{self.open_tag} {self.close_tag}"

    def step(self, turn_text: str) -> EnvStep:
        m = _CALL_RE.search(turn_text)
        if m is None or m.group(1) not in self.tools:
            raise ToolCallError(f"no call of a known tool ({', '.join(self.tools)}) at the end of the turn")
        if self.disabled:
            return EnvStep(self.observe(""), tool_calls=1)
        answer = self.tools[m.group(1)](m.group(2))
        if not isinstance(answer, str):
            raise ToolGarbageError(f"tool '{m.group(1)}' returned {type(answer).__name__}, not str")
        return EnvStep(self.observe(answer), tool_calls=1)


class ToolCallError(RlflowError):
    """A model turn that is not a call of a known tool (the model's mistake)."""


class ToolGarbageError(RlflowError):
    """A tool returned something that is not text (the tool's failure)."""


def env_arg_mistakes(env: Any, env_args: Any, tools: Any, tool_args: Any) -> list[tuple[str, str]]:
    """``(key, message)`` per malformed environment argument: ``tools`` not a list of distinct non-empty
    names, ``tool_args`` not ``{tool: {option: value}}``, ``env_args`` not a mapping or given without
    ``env``. Names that do not resolve are :func:`make_env_factory`'s to report."""
    out: list[tuple[str, str]] = []
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, str) and t for t in tools):
            out.append(("tools", f"expected a list of tool names (strings), got {tools!r}"))
        elif len(set(tools)) != len(tools):
            out.append(("tools", f"names a tool twice: {list(tools)}"))
    if tool_args is not None:
        if not isinstance(tool_args, dict):
            out.append(("tool_args", f"expected {{tool: {{option: value}}}}, got {tool_args!r}"))
        else:
            for name, opts in tool_args.items():
                if not isinstance(opts, dict):
                    out.append((f"tool_args.{name}", f"expected a mapping of options, got {opts!r}"))
    if env_args is not None:
        if env is None:
            out.append(("env_args", "applies to 'env' (an environment class); this node uses tools"))
        elif not isinstance(env_args, dict):
            out.append(("env_args", f"expected a mapping of keyword arguments, got {env_args!r}"))
    return out


def make_env_factory(
    env: str | None,
    env_args: dict[str, Any] | None,
    tools: Sequence[str] | None,
    tool_args: dict[str, dict[str, Any]] | None,
    *,
    disabled: bool = False,
) -> Callable[[], Environment]:
    """A function making one fresh environment per row: ``env`` (with ``env_args``) or a :class:`ToolEnv`
    over ``tools`` (each bound to its ``tool_args[name]`` options; a dotted path's tool is called by, and
    its options may be keyed by, its last name: ``pkg.mod:lookup`` -> ``<lookup> ... </lookup>``).

    Raises:
        RegistryError: an unknown environment or tool name.
        NodeError: neither or both of ``env`` and ``tools``, options for a tool not in ``tools``, a dotted
            path that does not import, or ``disabled`` with a custom environment.
    """
    mistakes = env_arg_mistakes(env, env_args, tools, tool_args)
    if mistakes:
        raise NodeError("; ".join(f"{key}: {msg}" for key, msg in mistakes))
    if (env is None) == (not tools):
        raise NodeError("name exactly one of 'env' (an environment class) and 'tools' (a list of tools)")
    if env is not None:
        if disabled:
            raise NodeError("the tool-less baseline needs 'tools' (a custom environment cannot be disabled)")
        cls = _lookup(ENVIRONMENTS, env, "environment")
        kwargs = dict(env_args or {})
        return lambda: cls(**kwargs)
    short = {name: name.rpartition(":")[2].rpartition(".")[2] for name in tools or ()}  # the call's tag
    extra = sorted(set(tool_args or {}) - set(short) - set(short.values()))
    if extra:
        raise NodeError(f"tool_args names {extra}, which are not in tools {list(tools or ())}")
    bound: dict[str, ToolFn] = {}
    for name, tag in short.items():
        given = tool_args or {}
        fn, opts = resolve_tool(name), dict(given.get(name) or given.get(tag) or {})
        bound[tag] = _bind(fn, opts)
    return lambda: ToolEnv(bound, disabled=disabled)


def _bind(fn: ToolFn, opts: dict[str, Any]) -> ToolFn:
    if not opts:
        return fn
    return lambda arguments: fn(arguments, **opts)


@dataclass
class StepOutcome:
    """One row's step result after containment.

    Attributes:
        step: the environment's answer, or ``None`` when the step failed (see ``error``).
        error: ``""`` (ok); the environment's failures ``raised``, ``timeout``, ``garbage`` (not an
            ``EnvStep`` or str, a non-str observation, a non-finite reward); or the model's ``invalid``
            (:class:`ToolCallError`: no call of a known tool); ``detail`` says what.
        seconds: wall time of the step (the deadline for a timeout).
    """

    step: EnvStep | None
    error: str = ""
    detail: str = ""
    seconds: float = 0.0


@dataclass(eq=False)  # identity: held in the set of hung slots
class _Slot:
    done: threading.Event = field(default_factory=threading.Event)
    value: Any = None
    exc: BaseException | None = None
    seconds: float = 0.0


def _checked(value: Any) -> tuple[EnvStep | None, str, str]:
    if isinstance(value, str):  # a plain string is an observation that continues the episode
        return EnvStep(value), "", ""
    if not isinstance(value, EnvStep):
        return None, "garbage", f"returned {type(value).__name__}, not an EnvStep or str"
    if value.observation is not None and not isinstance(value.observation, str):
        return None, "garbage", f"observation is {type(value.observation).__name__}, not str"
    if not isinstance(value.done, bool) or not isinstance(value.reward, int | float):
        return None, "garbage", f"done {value.done!r} / reward {value.reward!r} are not bool / number"
    if value.reward != value.reward or value.reward in (float("inf"), float("-inf")):
        return None, "garbage", f"reward {value.reward} is not finite"
    return value, "", ""


_HUNG: set[_Slot] = set()  # steps abandoned at their deadline whose threads may still run
_HUNG_LOCK = threading.Lock()


def hung_steps() -> int:
    """Step threads of this process abandoned at their deadline by :func:`run_steps` and still running."""
    with _HUNG_LOCK:
        _HUNG.difference_update([s for s in _HUNG if s.done.is_set()])
        return len(_HUNG)


def run_steps(
    calls: Sequence[Callable[[], Any]], timeout: float, max_hung: int | None = None
) -> list[StepOutcome]:
    """Run ``calls`` concurrently (one daemon thread each), each with a deadline of ``timeout`` seconds from
    the start; returns one :class:`StepOutcome` per call, in order, never raising for a call's failure.

    A call still running at its deadline is abandoned (its thread keeps running as a daemon; its result is
    dropped); this returns at most ``timeout`` seconds after it started. With ``max_hung`` abandoned
    threads still running (:func:`hung_steps`), no call starts: each fails at once as a ``timeout`` saying
    so; the threads of this process's steps are thus at most ``max_hung`` plus one call's.
    """
    if max_hung is not None:
        hung = hung_steps()
        if hung >= max_hung:
            why = (
                f"not run: {hung} earlier steps still run past their deadline (max_hung_steps {max_hung}; a "
                "thread cannot be killed)"
            )
            return [StepOutcome(None, "timeout", why, 0.0) for _ in calls]
    slots = [_Slot() for _ in calls]

    def work(call: Callable[[], Any], slot: _Slot) -> None:
        t0 = time.perf_counter()
        try:
            slot.value = call()
        except BaseException as e:  # contained: a tool's failure is the sample's, not the run's
            slot.exc = e
        slot.seconds = time.perf_counter() - t0
        slot.done.set()

    start = time.monotonic()
    for call, slot in zip(calls, slots, strict=True):
        threading.Thread(target=work, args=(call, slot), daemon=True, name="rlflow-env-step").start()
    out = []
    for slot in slots:
        if not slot.done.wait(max(0.0, start + timeout - time.monotonic())):
            with _HUNG_LOCK:
                _HUNG.add(slot)
            out.append(StepOutcome(None, "timeout", f"no answer within {timeout:g} s", timeout))
        elif slot.exc is not None:
            kind = (
                "invalid"
                if isinstance(slot.exc, ToolCallError)
                else "garbage"
                if isinstance(slot.exc, ToolGarbageError)
                else "raised"
            )
            out.append(StepOutcome(None, kind, f"{type(slot.exc).__name__}: {slot.exc}", slot.seconds))
        else:
            step, error, detail = _checked(slot.value)
            out.append(StepOutcome(step, error, detail, slot.seconds))
    return out
