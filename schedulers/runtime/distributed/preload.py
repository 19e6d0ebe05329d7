"""The fork server's first import (:data:`~rlflow.schedulers.runtime.distributed.launch.FORKSERVER_PRELOAD`):
in the fork server, SIGTERM and SIGHUP are ignored.

A signal to the run's process group (``kill -TERM -PGID``, a closed terminal) reaches the fork server too.
Had it died of it, ``multiprocessing`` would report every worker forked from it as dead (exit code 255:
their exit statuses come through the server) while the controller was still stopping the run in order.
The server exits when the process that started it does (its "alive" pipe closes), so ignoring the two
leaves nothing behind; it exits once its modules' atexit handlers have run, without the interpreter's
teardown of its preloaded heap (~1.3 CPU s of garbage collection per run). A forked worker starts with
the dispositions a spawned one would have (:func:`~rlflow.schedulers.runtime.distributed.launch.spawn_group`).

Imported anywhere else this module does nothing: it acts only when :data:`SERVER_MARK` is ``1`` in the
environment, which ``spawn_group`` sets (for the fork server only, not for the workers) while it starts
workers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys

__all__ = ["SERVER_MARK", "SERVER_SIGNALS"]

SERVER_MARK = "RLFLOW_FORK_SERVER"
SERVER_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _exit_without_teardown() -> None:
    """The server's last exit step: the interpreter's teardown of the preloaded heap (torch, transformers,
    rlflow's worker) would garbage-collect it for ~1.3 CPU s after the run has ended; the server writes no
    file and waits for no worker at exit either way, so only its standard streams are flushed first."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


if os.environ.get(SERVER_MARK) == "1":
    for _sig in SERVER_SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)
    # registered first, so it runs after the atexit handlers of every module the server preloads next
    atexit.register(_exit_without_teardown)
