"""User-facing errors of rlflow, and the "did you mean" suggestion their messages end with.

Every mistake a user can make (a bad graph file, plan, data set, model or node) raises one of these,
with a message naming the file, node and key involved. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

__all__ = [
    "DataError",
    "GraphError",
    "GraphMistakes",
    "HostError",
    "ModelError",
    "NodeError",
    "PlanError",
    "RegistryError",
    "RlflowError",
    "did_you_mean",
]


class RlflowError(Exception):
    """Base of every user-facing rlflow error."""


class GraphError(RlflowError):
    """A graph file or graph structure is invalid (fields, keys, edges, cycles, batch sizes)."""


class GraphMistakes(GraphError):
    """Every mistake the checks before a run found in a graph, not only the first: ``messages``, one per
    mistake, each naming the file and key (``str()`` is them one per line). ``rlflow`` prints one ``error:``
    line per message, as ``rlflow validate`` does for the same checks."""

    def __init__(self, messages: Sequence[str]) -> None:
        super().__init__("\n".join(messages))
        self.messages = tuple(messages)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.messages,))


class PlanError(RlflowError):
    """A plan, layout or cluster description is invalid (devices, degrees, divisibility)."""


class DataError(RlflowError):
    """A data set or field mapping is invalid or unreadable."""


class ModelError(RlflowError):
    """A model or tokenizer cannot be loaded or does not fit its use."""


class NodeError(RlflowError):
    """A node function failed; the message names the node and the cause."""


class ProcessLost(NodeError):
    """A process the run needs died or was lost through no mistake of the run's input: a worker, a vLLM
    engine process, a Ray actor, or a whole Ray node. A restart from the last checkpoint may succeed
    (``run.max_restarts``); every other error stops the run at once.

    Args:
        message: what died, where (node, rank, pid, host) and what the run was doing.
        cause: the kind of process lost, recorded with each restart: ``"worker"``, ``"engine"``,
            ``"ray_actor"`` or ``"ray_node"``.
    """

    CAUSES = ("worker", "engine", "ray_actor", "ray_node")

    def __init__(self, message: str, cause: str = "worker") -> None:
        if cause not in self.CAUSES:
            raise ValueError(f"ProcessLost cause {cause!r}: one of {', '.join(self.CAUSES)}")
        super().__init__(message)
        self.cause = cause

    def __reduce__(self) -> tuple[Any, ...]:  # crosses process boundaries (worker -> controller) whole
        return (type(self), (str(self), self.cause))


class RegistryError(RlflowError):
    """A registry lookup or registration failed (unknown or duplicate name)."""


class HostError(RlflowError):
    """This host refused what a run needs: a port, a path (a file where a directory belongs, no write
    permission, a run directory a live run holds) or disk space."""


def did_you_mean(name: str, choices: Any) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``name``, or ``""``."""
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""
