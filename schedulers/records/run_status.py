"""What status displays (``rlflow runs``, the dashboard's table) say of a run's ``status.json`` beyond its
state: the supervised restarts it records (:mod:`rlflow.schedulers.runtime.restarts`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["restart_count", "with_restarts"]


def restart_count(status: Mapping[str, Any] | None) -> int:
    """How many supervised restarts a run's status (``status.json`` as a dict; None: none) records."""
    restarts = (status or {}).get("restarts")
    return len(restarts) if isinstance(restarts, list) else 0


def with_restarts(state: str, restarts: int) -> str:
    """A run's state as status displays show it: ``"finished, restarted 2×"`` after ``restarts``
    supervised restarts, else ``state``."""
    return f"{state}, restarted {restarts}×" if restarts else state
