"""The fork server's first import (:data:`~rlflow.schedulers.runtime.distributed.launch.FORKSERVER_PRELOAD`):
in the fork server, SIGTERM and SIGHUP are ignored.

A signal to the run's process group (``kill -TERM -PGID``, a closed terminal) reaches the fork server too.
Had it died of it, ``multiprocessing`` would report every worker forked from it as dead (exit code 255:
their exit statuses come through the server) while the controller was still stopping the run in order.
The server exits when the process that started it does (its "alive" pipe closes), so ignoring the two
leaves nothing behind. A forked worker starts with the dispositions a spawned one would have
(:func:`~rlflow.schedulers.runtime.distributed.launch.spawn_group`).

Imported anywhere else this module does nothing: it acts only when :data:`SERVER_MARK` is ``1`` in the
environment, which ``spawn_group`` sets (for the fork server only, not for the workers) while it starts
workers.
"""

from __future__ import annotations

import os
import signal

__all__ = ["SERVER_MARK", "SERVER_SIGNALS"]

SERVER_MARK = "RLFLOW_FORK_SERVER"
SERVER_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

if os.environ.get(SERVER_MARK) == "1":
    for _sig in SERVER_SIGNALS:
        signal.signal(_sig, signal.SIG_IGN)
