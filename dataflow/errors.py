"""User-facing errors of rlflow.

Every mistake a user can make (a bad graph file, plan, data set, model or node) raises one of these,
with a message naming the file, node and key involved. ``assert`` is kept for internal invariants only.
"""

from __future__ import annotations

__all__ = [
    "DataError",
    "GraphError",
    "HostError",
    "ModelError",
    "NodeError",
    "PlanError",
    "RegistryError",
    "RlflowError",
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
