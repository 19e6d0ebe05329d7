"""Kill a vLLM engine's processes when the process that owns them dies, even by SIGKILL.

In a distributed worker vLLM runs its engine core in child processes (worker → ``VLLM::EngineCore`` →
vLLM's own worker, or one ``VLLM::Worker_TP<i>`` per tensor-parallel rank, which vLLM already stops with
its engine core; the watchdog kills them all). Nothing ties the engine core to the
rlflow worker, so :func:`start_watchdog` starts this module as a small process of its own
(``python -m rlflow.nodes.engines.watchdog OWNER PID...``): it polls its parent (the owner) and, once the
owner is gone, SIGKILLs the listed processes and exits; when the engine is closed normally the owner
stops the watchdog. Standard library only (it starts in well under a second).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["engine_processes", "start_watchdog"]

POLL_S = 0.5


def engine_processes(owner: int) -> list[int]:
    """Pids of the vLLM processes below ``owner`` (its ``VLLM::`` children and all their descendants)."""
    import psutil

    out: list[int] = []
    for child in psutil.Process(owner).children():
        try:
            if child.name().startswith("VLLM") or "VLLM::" in " ".join(child.cmdline()):
                out.append(child.pid)
                out.extend(p.pid for p in child.children(recursive=True))
        except psutil.Error:
            continue
    return out


def start_watchdog(pids: Sequence[int]) -> subprocess.Popen[bytes] | None:
    """Start the watchdog for ``pids`` (owner: this process); ``None`` when there is nothing to watch."""
    if not pids:
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "rlflow.nodes.engines.watchdog", str(os.getpid()), *map(str, pids)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the owner's process group reaches the owner, which stops us
    )


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def main(argv: Sequence[str]) -> None:
    """``OWNER PID...``: wait until OWNER is gone (this process is re-parented), then SIGKILL every PID."""
    owner, pids = int(argv[0]), [int(a) for a in argv[1:]]
    while os.getppid() == owner:
        time.sleep(POLL_S)
    _kill(pids)


if __name__ == "__main__":
    main(sys.argv[1:])
