"""Kill a vLLM engine's processes when the process that owns them dies, even by SIGKILL, at any phase.

In a distributed worker vLLM runs its engine core in child processes (worker → ``VLLM::EngineCore`` →
vLLM's own worker, or one ``VLLM::Worker_TP<i>`` per tensor-parallel rank, which vLLM already stops with
its engine core; the watchdog kills them all). Nothing ties the engine core to the rlflow worker (vLLM's
engine core does not watch the process that started it), so :func:`start_watchdog` starts this module as
a small process of its own (``python -m rlflow.nodes.engines.watchdog OWNER TOKEN``) *before* the engine
starts: it polls its parent (the owner) and, once the owner is gone, SIGKILLs every process whose
environment carries the engine's mark (:data:`MARK` ``=TOKEN``, set in the owner's environment while the
engine starts, so every process vLLM spawns inherits it) and exits; when the engine is closed normally the
owner stops the watchdog. Marking by environment, not by pid, also covers an owner killed while the
engine was still starting (a Ctrl-C or SIGKILL then once left an orphaned ``VLLM::EngineCore``: its pid
was not yet known). Standard library only (it starts in well under a second).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["MARK", "kill_marked", "marked_processes", "start_watchdog"]

POLL_S = 0.5
MARK = "RLFLOW_ENGINE_TOKEN"
"""The environment variable that marks one engine's processes (its value: that engine's token)."""


def marked_processes(token: str) -> list[int]:
    """Pids of this user's running processes whose environment holds ``MARK=token`` (read from
    ``/proc/PID/environ``: the environment each was started with), this process excluded."""
    want = f"{MARK}={token}".encode()
    out: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(int(entry))
        except OSError:  # gone, or another user's
            continue
    return out


def start_watchdog(token: str) -> subprocess.Popen[bytes]:
    """Start the watchdog of the engine marked ``token`` (owner: this process); before the engine starts,
    and before ``MARK`` is set here (the watchdog must not carry the mark itself)."""
    return subprocess.Popen(
        [sys.executable, "-m", "rlflow.nodes.engines.watchdog", str(os.getpid()), token],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C to the owner's process group reaches the owner, which stops us
    )


def kill_marked(token: str) -> None:
    """SIGKILL every process marked ``token`` (:func:`marked_processes`)."""
    for pid in marked_processes(token):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def main(argv: Sequence[str]) -> None:
    """``OWNER TOKEN``: wait until OWNER is gone (this process is re-parented), then SIGKILL every process
    marked TOKEN."""
    owner, token = int(argv[0]), argv[1]
    while os.getppid() == owner:
        time.sleep(POLL_S)
    kill_marked(token)


if __name__ == "__main__":
    main(sys.argv[1:])
