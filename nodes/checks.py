"""Pre-launch checks of what a graph names in the node layer: each node function's own ``check`` and the
run-level checks of keys that are not nodes (``run.eval.reward``, ``run.eval.agent``).

``rlflow validate`` and the controller (before a run writes anything) call :func:`launch_mistakes`, so
neither knows a node family: a function declares its check at registration
(``@node_function(..., check=...)``), and a plug-in module registers a run-level check in
:data:`RUN_CHECKS` when it is imported. ``RUN_CHECKS`` loads the node-function plug-ins on its first
lookup, so the modules of rlflow's own functions (and any third party's) have registered theirs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rlflow.dataflow.registry import NODE_FUNCTION_PLUGINS, Registry

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["RUN_CHECKS", "RunCheck", "launch_mistakes"]

RunCheck = Callable[["Graph"], list[str]]
"""``check(graph) -> list[str]``: one message per mistake, each naming the file and the key."""

RUN_CHECKS: Registry[RunCheck] = Registry("run-level check", group=NODE_FUNCTION_PLUGINS)
"""Run-level checks keyed by the graph-file key they check (``run.eval.reward``), in registration order."""


def launch_mistakes(graph: Graph) -> list[str]:
    """What a run of ``graph`` would fail on once launched that graph validation does not see (a reward, tool
    or environment that does not resolve, a sandbox that cannot start): every node's function ``check`` and
    ``args_check`` in graph order, then every :data:`RUN_CHECKS` entry. One message per mistake, naming the
    file, node and key; ``[]`` when none."""
    out: list[str] = []
    for name in graph.spec.nodes:
        fn = graph.function(name)
        if fn.check is not None:
            out += fn.check(graph, name)
        if fn.args_check is not None:
            out += fn.args_check(graph.args(name), f"{graph.spec.source or '<graph>'}: nodes.{name}.args")
    for key in RUN_CHECKS:
        out += RUN_CHECKS.get(key)(graph)
    return out
