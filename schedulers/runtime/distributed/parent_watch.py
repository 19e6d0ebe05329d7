"""A worker of the embedded launcher ends when its controller does, at any phase of its life.

Once serving, a worker sees its connection to the controller close and returns. Before that (forked or
spawned, importing, in the process group's rendezvous, connecting) it has no connection to watch: a
controller killed then (SIGKILL, the out-of-memory killer) left its workers blocked in the rendezvous until
its timeout. :func:`exit_with_controller`, the first thing a worker does, covers those phases twice:

- the kernel's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``, Linux): the worker's parent is
  the controller (spawned) or the fork server (forked), which exits as soon as the controller does (its
  "alive" pipe closes), so the worker gets SIGKILL then;
- a daemon thread that checks every ``poll_s`` seconds that the controller's process still runs (not gone,
  not a zombie), for the moment before the signal was armed and for systems without ``prctl``; it ends the
  process with :data:`ORPHAN_EXIT_CODE`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from pathlib import Path

__all__ = ["ORPHAN_EXIT_CODE", "controller_alive", "exit_with_controller"]

ORPHAN_EXIT_CODE = 75
"""Exit status of a worker that found its controller gone (``EX_TEMPFAIL``)."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def controller_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is not a zombie (a killed process its parent has not yet
    reaped still answers ``kill(pid, 0)``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's: not ours to judge
        return True
    with contextlib.suppress(OSError, IndexError):
        # /proc/PID/stat: "pid (comm) state ...": the state follows the last ')'
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    return True


def _arm_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def exit_with_controller(controller_pid: int, poll_s: float = 0.5) -> threading.Thread:
    """Arm the parent-death signal and start the watch on ``controller_pid`` (module docstring); returns
    the watching thread (a daemon: it never keeps the worker alive). Exits at once when the controller is
    already gone."""
    _arm_parent_death_signal()

    def watch() -> None:
        while controller_alive(controller_pid):
            time.sleep(poll_s)
        os._exit(ORPHAN_EXIT_CODE)  # no clean-up to wait for: the controller that would collect it is gone

    if not controller_alive(controller_pid):
        os._exit(ORPHAN_EXIT_CODE)
    thread = threading.Thread(target=watch, name="rlflow-controller-watch", daemon=True)
    thread.start()
    return thread
