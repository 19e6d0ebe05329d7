"""User-facing errors of rlflow, and the "did you mean" suggestion their messages end with.

Every mistake a user can make (a bad graph file, plan, data set, model or node) raises one of these,
with a message naming the file, node and key involved. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations

import difflib
from typing import Any

__all__ = [
    "DataError",
    "GraphError",
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


class PlanError(RlflowError):
    """A plan, layout or cluster description is invalid (devices, degrees, divisibility)."""


class DataError(RlflowError):
    """A data set or field mapping is invalid or unreadable."""


class ModelError(RlflowError):
    """A model or tokenizer cannot be loaded or does not fit its use."""


class NodeError(RlflowError):
    """A node function failed; the message names the node and the cause."""


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
