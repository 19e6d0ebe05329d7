"""Supervised restarts: a run that loses a process it needs resumes from its last checkpoint by itself.

:func:`supervise` runs one attempt of a stage (``rlflow run``'s :mod:`~rlflow.schedulers.commands.stage`:
plan, controller, run) and, when the attempt raises :class:`~rlflow.dataflow.errors.ProcessLost` (a worker,
vLLM engine, Ray actor or Ray node lost through no mistake of the input), starts another one, at most
``run.max_restarts`` times within any ``run.restart_window_s`` seconds. Every other error, and
``ProcessLost`` with ``run.max_restarts: 0``, passes through unchanged: the run stops.

Before a restart the failed attempt has stopped its processes (the controller's failure path and
``close``: the worker pool kills its workers and the processes they started); :func:`before_restart` then
waits for the resources the run needs, bounded by ``run.restart_wait_s``, and gives the graph to restart
with; the new attempt resumes from the newest sound checkpoint as ``--resume`` does, or starts the run
again in its directory when it has none (``Controller(restart=...)``). One line per restart goes to stderr
(:func:`restart_line`); the controller records the restart in ``status.json`` and the first iteration's
metrics (``faults/restarts``, ``faults/iterations_lost``). docs/operations.md is the user's page.
"""

from __future__ import annotations

import datetime as dt
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from rlflow.dataflow.errors import ProcessLost
from rlflow.schedulers.records.checkpoint_check import set_aside_broken
from rlflow.schedulers.records.rundir import latest_checkpoint, read_status

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "Restart",
    "amended",
    "before_restart",
    "ctrl_c_raises",
    "lost_record",
    "restart_line",
    "stop_signals_raise",
    "supervise",
    "warn_if_nothing_to_restart",
]

T = TypeVar("T")


@dataclass(frozen=True)
class Restart:
    """One restart, as ``status.json``'s ``restarts`` list holds it.

    ``time``: when the process was found lost (ISO 8601, UTC); ``cause``: the lost process's kind
    (:attr:`ProcessLost.CAUSES`); ``message``: the error's first line; ``from_iteration``: the last
    iteration finished when it was lost; ``resumed_iteration``: the checkpoint the restart resumes from
    (0: the start, no checkpoint yet).
    """

    time: str
    cause: str
    message: str
    from_iteration: int
    resumed_iteration: int

    @property
    def iterations_lost(self) -> int:
        """Iterations finished after the checkpoint resumed from, done again (``faults/iterations_lost``)."""
        return max(0, self.from_iteration - self.resumed_iteration)

    def record(self) -> dict[str, Any]:
        """The JSON object of ``status.json``'s ``restarts`` list."""
        return asdict(self)


def lost_record(run_dir: str | os.PathLike[str], error: ProcessLost) -> Restart:
    """The restart that ``error`` calls for in ``run_dir``: the newest sound checkpoint (broken newer ones
    set aside, as ``--resume`` does) and the last iteration this process's run finished (its
    ``status.json``; a status another process wrote says nothing of this run: then none lost)."""
    set_aside_broken(run_dir)
    found = latest_checkpoint(run_dir)
    resumed = found[0] if found is not None else 0
    status = read_status(run_dir) or {}
    done = status.get("iteration")
    ours = status.get("pid") == os.getpid()
    lost_at = max(resumed, done) if ours and isinstance(done, int) else resumed
    when = dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    first = (str(error).splitlines() or [type(error).__name__])[0]
    return Restart(when, error.cause, first, lost_at, resumed)


def restart_line(restart: Restart, count: int, allowed: int) -> str:
    """The line ``rlflow run`` prints on stderr for a restart: ``count`` of ``allowed`` in the window, the
    cause, the error's first line, the checkpoint resumed from and the iterations lost."""
    lost = restart.iterations_lost
    where = (
        f"resuming from checkpoint {restart.resumed_iteration}"
        if restart.resumed_iteration
        else "starting again (no checkpoint yet)"
    )
    return (
        f"rlflow: restart {count} of {allowed} ({restart.cause} lost): {restart.message}; {where}, "
        f"{lost} iteration{'' if lost == 1 else 's'} lost"
    )


def before_restart(graph: Graph, error: ProcessLost, deadline: float, address: str | None = None) -> Graph:
    """Wait for the resources a restart needs, until ``deadline`` (``time.monotonic``; from
    ``run.restart_wait_s``), and return the graph to restart with.

    Called once per restart, after the failed attempt stopped its processes, with the graph as loaded
    (before its plan is resolved: a graph returned unchanged keeps the plan the run chose, another one is
    planned again). The embedded and torchrun launchers: the host is the resource, free once the old
    processes are gone, so ``graph`` as it is. The ``ray`` launcher (``address``: ``--address``) waits
    until the Ray cluster's alive nodes hold the plan's devices again
    (:func:`~rlflow.schedulers.runtime.distributed.ray_nodes.wait_for_devices`; not re-planned for fewer:
    a checkpoint's optimizer state is stored per rank of its plan), or, with ``plan: auto`` and no
    checkpoint yet, re-plans for the devices they hold.

    Raises:
        ProcessLost: the resources did not come back by ``deadline``.
        HostError: the Ray cluster cannot be reached.
    """
    if graph.spec.run.launcher == "ray":
        from rlflow.schedulers.runtime.distributed.ray_nodes import wait_for_devices

        resumes = latest_checkpoint(graph.spec.run.output_dir) is not None
        return wait_for_devices(graph, error, deadline, address, checkpoint=resumes)
    return graph


def supervise(
    attempt: Callable[[Graph, Restart | None], T],
    graph: Graph,
    *,
    abandon: type[BaseException],
    clock: Callable[[], float] = time.monotonic,
    wait: Callable[[Graph, ProcessLost, float], Graph] = before_restart,
) -> T:
    """``attempt(graph, None)``, restarted after a :class:`ProcessLost` as ``graph.spec.run`` allows;
    what the successful attempt returned.

    ``attempt(graph, restart)`` runs the stage once on ``graph`` (as loaded) and stops every process it
    started before it raises; ``restart`` is ``None`` for the first attempt, else the :class:`Restart`
    this attempt is (the controller resumes from ``restart.resumed_iteration`` and records it).
    ``abandon``: the exception a stop signal raises during a restart's wait (``RunAbandoned``; Ctrl-C
    raises ``KeyboardInterrupt``). ``clock``/``wait``: seconds for the window, and :func:`before_restart`.

    Raises:
        ProcessLost: lost with ``run.max_restarts: 0`` (unchanged), or once more than ``run.max_restarts``
            restarts would fall within ``run.restart_window_s`` seconds (the count named).
        Exception: any other error of an attempt, unchanged (never restarted).
    """
    run = graph.spec.run
    times: list[float] = []  # when each restart of this call began (clock)
    restart: Restart | None = None
    while True:
        try:
            return attempt(graph, restart)
        except ProcessLost as err:
            if run.max_restarts == 0:
                raise
            now = clock()
            recent = [t for t in times if now - t < run.restart_window_s]
            if len(recent) >= run.max_restarts:
                raise _exhausted(err, len(recent), run.max_restarts, run.restart_window_s) from err
            restart = lost_record(run.output_dir, err)
            why = f"while waiting to restart after: {restart.message}"
            with stop_signals_raise(abandon, why):
                graph = wait(graph, err, now + run.restart_wait_s)
            times = [*recent, now]
            print(restart_line(restart, len(times), run.max_restarts), file=sys.stderr, flush=True)


def _exhausted(err: ProcessLost, count: int, allowed: int, window_s: float) -> ProcessLost:
    """``err`` again, its first line saying no restart is left."""
    return amended(
        err,
        f"not restarted: {count} restart{'' if count == 1 else 's'} within the last {window_s:g} s already "
        f"(run.max_restarts={allowed}, run.restart_window_s={window_s:g})",
    )


def amended(err: ProcessLost, more: str) -> ProcessLost:
    """``err`` again (its cause, and its notes, such as a worker's traceback, kept), ``"; " + more`` at the
    end of its first line."""
    first, sep, rest = str(err).partition("\n")
    again = ProcessLost(f"{first}; {more}{sep}{rest}", err.cause)
    for note in getattr(err, "__notes__", ()):
        again.add_note(note)
    return again


def warn_if_nothing_to_restart(graph: Graph) -> None:
    """Warn (:class:`~rlflow.dataflow.graph.GraphWarning`, naming file and key) when ``run.max_restarts`` > 0
    but the resolved plan runs in the ``rlflow run`` process alone (one device, every node there, at most
    one vLLM engine, which then runs in this process too): no worker or engine process exists to be lost
    and restarted, and a crash of this process needs ``--resume`` by hand. Call after the plan is
    resolved."""
    import warnings

    from rlflow.dataflow.graph import GraphWarning
    from rlflow.nodes.engines.validation import engine_nodes
    from rlflow.schedulers.runtime.choose_executor import is_trivial_plan

    restarts = graph.spec.run.max_restarts
    if restarts > 0 and is_trivial_plan(graph) and len(engine_nodes(graph)) <= 1:
        warnings.warn(
            f"{graph.spec.source or '<graph>'}: run.max_restarts: {restarts}, but the plan runs in this "
            "process alone (one device; a vLLM engine, if any, in this process too): there is no worker or "
            "engine process to lose and restart (a plan over several devices has them, e.g. --devices 2 "
            "with plan: auto)",
            GraphWarning,
            stacklevel=2,
        )


@contextmanager
def ctrl_c_raises() -> Iterator[None]:
    """Within, SIGINT raises ``KeyboardInterrupt`` even where this process inherited it ignored (a shell's
    background job, ``nohup``, some CI runners): ``rlflow run`` stops on a Ctrl-C at any phase, its
    start-up and a restart's wait included, not only once the run loop handles it. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous is None else previous)


@contextmanager
def stop_signals_raise(abandon: type[BaseException], why: str) -> Iterator[None]:
    """SIGTERM and SIGHUP within raise ``abandon(signum, why)`` (the controller's ``RunAbandoned``) instead
    of killing this process silently, so that what is starting is stopped (the worker pool's start-up
    stops every worker it started) and the run ends with one line and exit code 128 + the signal. Ctrl-C
    already raises ``KeyboardInterrupt``. Main thread only (elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_stop(signum: int, frame: FrameType | None) -> None:
        raise abandon(signum, why)

    previous = {s: signal.signal(s, on_stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
