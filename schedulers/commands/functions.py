"""List the registered node functions: kind, inputs, outputs and arguments (types, defaults, meaning).

Generated from each function's registration (``@node_function`` and its argument schema), so it is what
graph validation checks a node against. Plug-ins installed through entry points are listed too.

Example: ``rlflow functions`` (all), ``rlflow functions grpo_actor`` (one)
"""

from __future__ import annotations

import argparse

from rlflow.dataflow.args import describe_args
from rlflow.dataflow.registry import NodeFunction


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="functions to describe (default: all)")


def _params(names: tuple[str, ...], optional: tuple[str, ...]) -> str:
    required = names[: len(names) - len(optional)]
    text = ", ".join(required) or "(none)"
    return text + (f" [optional: {', '.join(optional)}]" if optional else "")


def describe_function(fn: NodeFunction) -> str:
    """The text ``rlflow functions NAME`` prints for ``fn``."""
    model = (
        f"model head {' or '.join(fn.heads)}" if fn.heads else ("any model" if fn.needs_model else "no model")
    )
    lines = [f"{fn.name} ({fn.kind}, {model})", f"  {fn.doc}"]
    lines.append(f"  inputs:  {_params(fn.inputs, fn.optional_inputs)}")
    for extra in fn.arg_inputs:
        when = " or ".join(str(v).lower() if isinstance(v, bool) else str(v) for v in extra.values)
        lines.append(f"    + {extra.name} when {extra.arg} is {when}: {extra.doc}")
    lines.append(f"  outputs: {_params(fn.outputs, fn.optional_outputs)}")
    if fn.group_wise:
        lines.append(f"  group-wise: {fn.group_wise}")
    if fn.args is None:
        lines.append("  args: not declared (checked by name against the function's keyword parameters)")
    else:
        lines.append("  args:")
        lines.extend(f"    {line}" for line in describe_args(fn.args))
    if fn.extra_args:
        lines.append(f"    other names: {fn.extra_args}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from rlflow.dataflow.graph import default_registry

    registry = default_registry()
    names = args.names or registry.names()
    print("\n\n".join(describe_function(registry.get(name)) for name in names))
    return 0
