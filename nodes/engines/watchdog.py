"""Kill a vLLM engine's processes when the process that owns them dies, even by SIGKILL, at any phase.

In a distributed worker vLLM runs its engine core in child processes (worker → ``VLLM::EngineCore`` →
vLLM's own worker, or one ``VLLM::Worker_TP<i>`` per tensor-parallel rank, which vLLM already stops with
its engine core; the watchdog kills them all). Nothing ties the engine core to the rlflow worker (vLLM's
engine core does not watch the process that started it), so a :class:`Watchdog` starts this module as
a small process of its own (``python -m rlflow.nodes.engines.watchdog OWNER TOKEN``) *before* the engine
starts. While the engine starts, every process vLLM spawns inherits the engine's mark (:data:`MARK`
``=TOKEN``, set in the owner's environment meanwhile); the watchdog looks for marked processes every
:data:`POLL_S` seconds and remembers them (a process's ``/proc/PID/environ`` shows the mark until it
renames itself, ``VLLM::EngineCore``, which overwrites that memory), until the owner sends it the engine's
pids on its standard input (:meth:`Watchdog.started`). Once the owner is gone it SIGKILLs those processes,
their descendants and any process still marked, and exits; when the engine is closed normally the owner
stops the watchdog. Watching from before the start covers an owner killed while the engine was still
starting (a Ctrl-C or SIGKILL then once left an orphaned ``VLLM::EngineCore``: its pid was not yet known).
Standard library only (it starts in well under a second).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

__all__ = ["MARK", "POLL_S", "Watchdog", "descendants", "marked_processes"]

POLL_S = 0.5
"""Seconds between the watchdog's checks of its owner (and, while the engine starts, for marked processes)."""
MARK = "RLFLOW_ENGINE_TOKEN"
"""The environment variable that marks one engine's processes (its value: that engine's token)."""


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def marked_processes(token: str) -> list[int]:
    """Pids of this user's processes whose ``/proc/PID/environ`` holds ``MARK=token`` (the environment each
    was started with, until it renames itself), this process excluded."""
    want = f"{MARK}={token}".encode()
    out: list[int] = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if want in f.read().split(b"\0"):
                    out.append(pid)
        except OSError:  # gone, or another user's
            continue
    return out


def descendants(roots: Iterable[int]) -> set[int]:
    """``roots`` and every running process below them (parents read from ``/proc/PID/stat``)."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid ..."
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    out: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.add(pid)
            todo.extend(children.get(pid, ()))
    return out


class Watchdog:
    """The owner's handle on a running watchdog process (:func:`main`) for the engine marked ``token``;
    start it before the engine starts, and before ``MARK`` is set in the owner (it must not carry the mark
    itself)."""

    def __init__(self, token: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlflow.nodes.engines.watchdog", str(os.getpid()), token],
            stdin=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C to the owner's process group reaches the owner, which stops us
        )

    def started(self, pids: Sequence[int]) -> None:
        """Tell the watchdog the engine's processes (it stops looking for marked ones)."""
        assert self.process.stdin is not None
        with contextlib.suppress(OSError):
            self.process.stdin.write((" ".join(map(str, pids)) + "\n").encode())
            self.process.stdin.flush()

    def stop(self) -> None:
        """Stop the watchdog (the engine was closed); idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()


def main(argv: Sequence[str]) -> None:
    """``OWNER TOKEN``: until OWNER is gone (this process is re-parented), remember the processes marked
    TOKEN, until a line of pids arrives on stdin; then SIGKILL those, the ones given, their descendants and
    any still marked."""
    owner, token = int(argv[0]), argv[1]
    seen: set[int] = set()
    looking, reading = True, True
    while os.getppid() == owner:
        if looking:
            seen.update(marked_processes(token))
        if looking and reading:
            ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
            if ready:
                line = sys.stdin.readline()
                reading = bool(line)  # EOF: nothing more will come
                looking = not line
                seen.update(int(p) for p in line.split())
        else:
            time.sleep(POLL_S)
    for pid in descendants(seen | set(marked_processes(token))):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1:])
