"""The controller's side of the worker processes: launch, connections, commands and replies.

:class:`WorkerPool` starts ``world`` workers (embedded launcher: multiprocessing spawn, gloo on CPU / NCCL
on GPU, init over ``tcp://127.0.0.1:<free port>``; ``launch="external"``: it listens and waits for
torchrun-started workers, see :mod:`rlflow.schedulers.runtime.distributed.worker`; ``launch="ray"``: one
Ray actor per device, see :mod:`rlflow.schedulers.runtime.distributed.ray_launch`), sends them
:class:`~rlflow.schedulers.runtime.distributed.protocol.Setup`, and then carries commands and replies
(:mod:`rlflow.schedulers.runtime.distributed.protocol`). It knows nothing of nodes or rows.

Commands get increasing ids (:meth:`WorkerPool.reserve`). A command is sent at once (:meth:`send`) or
deferred (:meth:`defer`) until the next :meth:`flush`, which sends the deferred ones in the order they were
deferred; every wait flushes first. Replies land in an inbox keyed ``(rank, cmd)`` (set-up: ``cmd -1``).

Failure handling: a worker that raises sends its traceback; a worker that dies is seen by its process
sentinel (embedded), the closed connection (external) or Ray's report of the actor's end (Ray: the
message names its host and node). Either way the pool stops every worker (SIGKILL:
spawned workers ignore SIGTERM, which a scheduler sends to the whole process group, so that the controller
can save first), and the processes they started (vLLM engine cores), and raises an error naming the worker
rank, what the controller waited for and the error: a worker that raised gives
:class:`~rlflow.dataflow.errors.NodeError` (the input's or the code's fault: a restart would fail the same
way), a worker that died (a signal, an exit, its connection closed) or a lost Ray actor gives
:class:`~rlflow.dataflow.errors.ProcessLost` naming its pid (cause ``worker``, or ``ray_actor``), what a
supervised restart may fix (:mod:`rlflow.schedulers.runtime.restarts`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlflow.dataflow.errors import NodeError, PlanError, ProcessLost
from rlflow.dataflow.graph import Graph
from rlflow.schedulers.runtime.distributed.launch import free_port, no_delay, spawn_group, stop_processes
from rlflow.schedulers.runtime.distributed.protocol import (
    Command,
    DistConfig,
    Done,
    Failed,
    Hello,
    Ready,
    Reply,
    Setup,
    Stop,
    recv,
    send,
)

__all__ = ["WORKER_MODULE", "Key", "WorkerPool", "exit_status", "to_ranks", "worker_error"]

# what torchrun runs for ``launch="external"`` (``python -m``)
WORKER_MODULE = "rlflow.schedulers.runtime.distributed.worker"

Key = tuple[int, int]  # (rank, command id) of a reply; command id -1: set-up


def worker_error(rank: int, what: str, message: str, tb: str = "") -> NodeError:
    """The error of worker ``rank`` failing in ``what``. Its own traceback ``tb`` rides as the error's note
    (``add_note``): a traceback of the error shows it, ``str`` does not, so ``rlflow`` prints one line
    unless ``--debug``."""
    err = NodeError(f"worker rank {rank} failed in {what}: {message}")
    if tb:
        err.add_note(f"--- worker {rank} traceback ---\n{tb.rstrip()}")
    return err


def exit_status(code: int | None) -> str:
    """A process's end as ``multiprocessing`` reports it (``exitcode``: ``-N`` for signal ``N``), in words:
    ``exit code 3``, ``killed by SIGKILL``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class WorkerPool:
    """``world`` worker processes and one connection to each.

    Args:
        graph: the validated graph (sent to every worker in :class:`Setup`).
        world: the number of workers (``run.devices``).
        checkpoint_dir: when resuming, the checkpoint whose weights the workers load.
        config: timeouts and launch settings.

    Raises:
        PlanError: an unknown ``config.launch``.
        NodeError: a worker failed to connect, start or build its models within ``start_timeout_s``
            (every worker is stopped first).
    """

    def __init__(self, graph: Graph, world: int, checkpoint_dir: Path | None, config: DistConfig) -> None:
        self.world = world
        self.config = config
        self.conns: dict[int, mpc.Connection] = {}
        self.procs: list[Any] = []
        self.closed = False
        # bytes through the controller's connections after start-up (pickled messages both ways)
        self.traffic: dict[str, int] = {"sent": 0, "received": 0}
        self._cmd = 0
        self._inbox: dict[Key, Any] = {}
        self._deferred: list[dict[int, Command]] = []  # rank -> message, per command in order
        self._acks: set[Key] = set()  # replies of fire-and-forget commands, dropped on arrival
        self.ray_group: Any = None  # the Ray launcher's actors (RayGroup), else None
        self._started: list[Any] = []  # processes the workers started (engine cores), seen so far
        self._start(graph, checkpoint_dir)

    # -- launch ---------------------------------------------------------------------------------------
    def _start(self, graph: Graph, checkpoint_dir: Path | None) -> None:
        cfg = self.config
        authkey = os.urandom(16)
        listen = cfg.address
        owns_ray = False
        if cfg.launch == "ray":  # connect and check the cluster before anything listens or starts
            from rlflow.schedulers.runtime.distributed.ray_launch import prepare

            owns_ray, host = prepare(self.world, cfg)
            listen = (host, 0)
        listener = mpc.Listener(listen, authkey=authkey)
        self.address = listener.address
        accepted: list[mpc.Connection] = []
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                for _ in range(self.world):
                    accepted.append(no_delay(listener.accept()))
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        if cfg.launch == "spawn":
            self._spawn(authkey)
        elif cfg.launch == "ray":
            from rlflow.schedulers.runtime.distributed.ray_launch import start_workers

            try:
                self.ray_group = start_workers(self.world, self.address, authkey, cfg, owns_ray)
            except BaseException:
                listener.close()
                raise
            self.procs = list(self.ray_group.workers)
        elif cfg.launch == "external":
            host, port = self.address
            print(
                f"rlflow: waiting for {self.world} workers: RLFLOW_CONTROLLER={host}:{port} "
                f"RLFLOW_AUTHKEY={authkey.hex()} torchrun ... -m {WORKER_MODULE}",
                flush=True,
            )
        else:
            raise PlanError(f"unknown launch {cfg.launch!r}; use 'spawn', 'external' or 'ray'")
        deadline = time.monotonic() + cfg.start_timeout_s
        try:
            while len(accepted) < self.world:
                if errors:
                    raise NodeError(f"distributed runtime: accepting workers failed: {errors[0]}")
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    code = self.procs[dead[0]].exitcode
                    how = self._death(dead[0], f"exited during start-up ({exit_status(code)})")
                    raise self._lost(dead[0], "start-up", how)
                if time.monotonic() > deadline:
                    raise NodeError(
                        f"distributed runtime: only {len(accepted)} of {self.world} workers connected "
                        f"within {cfg.start_timeout_s:.0f} s"
                    )
                time.sleep(0.05)
            for conn in accepted:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise NodeError("distributed runtime: a worker connected but did not say hello")
                hello = recv(conn)
                assert isinstance(hello, Hello), hello
                self.conns[hello.rank] = conn
            setup = Setup(graph, checkpoint_dir, cfg)
            for conn in self.conns.values():
                send(conn, setup)
            self.wait({(r, -1) for r in range(self.world)}, deadline, what="start-up (building models)")
            self.traffic = {"sent": 0, "received": 0}
            self._started = started_by(self.procs)  # a worker that dies later orphans them
        except BaseException:
            self.close(force=True)
            raise
        finally:
            listener.close()

    def _spawn(self, authkey: bytes) -> None:
        """Start the workers, all on this host (forked from the fork server or spawned:
        :func:`~rlflow.schedulers.runtime.distributed.launch.worker_start_method`): each with the threads of
        :func:`~rlflow.schedulers.runtime.threads.choose_threads` (this host's allowed cores among the
        ``world`` workers, unless ``config.threads`` or an override is set; printed once) in
        ``OMP_NUM_THREADS``, the OpenMP wait settings, and ``config.env``."""
        from rlflow.schedulers.runtime.distributed.worker import spawned_main

        cfg = self.config
        init = f"tcp://127.0.0.1:{free_port()}"
        pid = os.getpid()  # each worker exits when this process does, at any phase (parent_watch)
        try:
            choice, env = spawn_group(
                self.world,
                spawned_main,
                lambda r, n: (r, self.world, init, self.address, authkey, replace(cfg, threads=n), pid),
                self.procs,
                threads=cfg.threads,
                env=cfg.env,
                name="rlflow-worker",
            )
            print(choice.line("per worker", wait=env), file=sys.stderr, flush=True)
        finally:
            # Workers ignore SIGTERM, so multiprocessing's exit hook (SIGTERM, then join) would wait forever
            # on a pool nobody closed: kill them before it runs (atexit runs the latest registration first).
            atexit.register(self._kill_at_exit)

    # -- sending --------------------------------------------------------------------------------------
    def reserve(self) -> int:
        """A new command id.

        Raises:
            NodeError: the workers are stopped.
        """
        if self.closed:
            raise NodeError("distributed runtime: the workers are stopped")
        self._cmd += 1
        return self._cmd

    def send(self, messages: Mapping[int, Command]) -> None:
        """Send a command now (``messages``: rank -> its message), ahead of the deferred ones."""
        self._deliver(messages)

    def defer(self, messages: Mapping[int, Command]) -> None:
        """Send a command at the next :meth:`flush`, after the commands deferred before it."""
        self._deferred.append(dict(messages))

    def flush(self) -> None:
        """Send the deferred commands (runs and syncs of submitted nodes), before waiting on anything."""
        while self._deferred:
            self._deliver(self._deferred.pop(0))

    def post(self, cmd: int, messages: Mapping[int, Command]) -> None:
        """Send a command now whose replies carry nothing: they are dropped when they arrive (a failure is
        still raised, by whichever wait reads it)."""
        self.send(messages)
        self._acks.update((r, cmd) for r in messages)

    def ask(self, cmd: int, messages: Mapping[int, Command], what: str) -> dict[int, Any]:
        """Send a command after the deferred ones and wait for every rank's reply (``node_timeout_s``);
        rank -> payload.

        Raises:
            NodeError: a worker raised or died, or the timeout passed (every worker stopped).
        """
        self.flush()
        self.send(messages)
        got = self.wait({(r, cmd) for r in messages}, time.monotonic() + self.config.node_timeout_s, what)
        return {r: got[(r, cmd)] for r in messages}

    def _deliver(self, messages: Mapping[int, Command]) -> None:
        for r, msg in messages.items():
            try:
                self.traffic["sent"] += send(self.conns[r], msg)
            except (EOFError, OSError, BrokenPipeError):
                died = self._death(r, "the worker died (its connection closed)")
                self.close(force=True)
                raise self._lost(r, "sending a command", died) from None

    # -- receiving ------------------------------------------------------------------------------------
    def fail(self, rank: int, what: str, message: str, tb: str = "") -> NodeError:
        """Stop every worker; the error to raise (:func:`worker_error`)."""
        self.close(force=True)
        return worker_error(rank, what, message, tb)

    def _lost(self, rank: int, what: str, message: str, tb: str = "") -> ProcessLost:
        """The error of worker ``rank`` lost (died, or its Ray actor ended) while the controller did
        ``what``: :class:`ProcessLost` naming its pid, cause ``ray_actor`` for a Ray actor, else ``worker``
        (call after :meth:`close`). ``tb``: a peer's traceback, as :func:`worker_error`'s note."""
        proc: Any = self.procs[rank] if rank < len(self.procs) else None
        pid = getattr(proc, "pid", None)
        who = f"worker rank {rank}" + (f" (pid {pid})" if pid is not None else "")
        loss = proc.loss() if self.ray_group and proc is not None else None  # Ray: RayWorker.loss
        cause = (loss or "ray_actor") if self.ray_group else "worker"
        err = ProcessLost(f"{who} failed in {what}: {message}", cause)
        if tb:
            err.add_note(f"--- worker traceback ---\n{tb.rstrip()}")
        return err

    def arrived(self, keys: Collection[Key]) -> bool:
        """Every reply ``keys`` is in the inbox."""
        return all(k in self._inbox for k in keys)

    def missing(self, keys: Collection[Key]) -> list[int]:
        """The ranks (sorted) of the replies ``keys`` not in the inbox yet."""
        return sorted(r for r, c in keys if (r, c) not in self._inbox)

    def wait(self, expected: Collection[Key], deadline: float, what: str) -> dict[Key, Any]:
        """Collect replies ``(rank, cmd)`` by ``deadline`` (``time.monotonic``); their payloads.

        Raises:
            NodeError: a worker raised or died, or the deadline passed (every worker stopped).
        """
        self.flush()
        while not self.arrived(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = self.missing(expected)
                raise self.fail(missing[0], what, f"no reply within the timeout (ranks {missing} pending)")
            self.pump(min(left, 1.0), what)
        return {key: self._inbox.pop(key) for key in expected}

    def pump(self, timeout: float, what: str) -> None:
        """Read the replies that arrive within ``timeout`` seconds into the inbox.

        Raises:
            NodeError: a worker reported an error or died (``what``: the controller's current wait).
        """
        conns = {c: r for r, c in self.conns.items()}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        ready = mpc.wait([*conns, *sentinels], timeout=timeout)
        for obj in sorted(ready, key=lambda o: o in sentinels):  # messages before deaths
            if obj in conns:
                rank = conns[obj]
                try:
                    data = obj.recv_bytes()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    died = self._death(rank, "the worker died (its connection closed)")
                    self.close(force=True)
                    raise self._lost(rank, _waiting(what), died) from None
                self.handle(self._unpickle(data))
            elif obj in sentinels:
                rank = sentinels[obj]
                conn = self.conns.get(rank)
                while conn is not None and conn.poll(0):  # drain what it sent before dying
                    try:
                        self.handle(self._unpickle(conn.recv_bytes()))
                    except (EOFError, OSError):
                        break
                code = self.procs[rank].exitcode
                died = self._death(rank, f"the worker process died ({exit_status(code)})")
                self.close(force=True)
                raise self._lost(rank, _waiting(what), died)

    def _death(self, rank: int, plain: str) -> str:
        """How worker ``rank`` ended: ``plain`` for a process of this host; for a Ray actor, Ray's reason
        with its host and node (waiting up to 2 s for Ray's report, which can follow the closed
        connection)."""
        proc: Any = self.procs[rank] if rank < len(self.procs) else None
        if proc is None or not hasattr(proc, "cause"):
            return plain
        if not proc.cause:
            proc.join(2.0)
        return str(proc.cause) or f"{plain} ({proc.where})"

    def _dead_peer(self, rank: int, grace_s: float = 0.5) -> int | None:
        """A worker other than ``rank`` whose process has died, waiting up to ``grace_s`` seconds for one:
        when a worker dies, its peers' collectives fail too, and their reports can arrive first."""
        others = {p.sentinel: r for r, p in enumerate(self.procs) if r != rank}
        ready = mpc.wait(list(others), timeout=grace_s)
        return min((others[s] for s in ready), default=None)

    def _unpickle(self, data: bytes) -> Reply:
        self.traffic["received"] += len(data)
        msg: Reply = pickle.loads(data)
        return msg

    def handle(self, msg: Reply) -> None:
        """File one reply in the inbox (acknowledgements dropped).

        Raises:
            NodeError: the reply is a worker's :class:`Failed`.
        """
        match msg:
            case Ready(rank=rank):
                self._inbox[(rank, -1)] = None
            case Done(cmd=cmd, rank=rank, payload=payload):
                key = (rank, cmd)
                if key in self._acks:
                    self._acks.discard(key)
                else:
                    self._inbox[key] = payload
            case Failed(rank=rank, what=what, message=message, traceback=tb, lost=lost):
                dead = self._dead_peer(rank)
                if dead is not None:  # the root cause: the survivor's error (a broken collective) follows it
                    code = self.procs[dead].exitcode
                    died = self._death(dead, f"the worker process died ({exit_status(code)})")
                    self.close(force=True)
                    then = f"{died}; worker rank {rank} then failed in {what}: {message}"
                    raise self._lost(dead, _waiting(what), then, tb)
                if lost is not None:  # the worker lives; a process it needs (its engine) was lost
                    self.close(force=True)
                    err = ProcessLost(f"worker rank {rank} failed in {what}: {message}", lost)
                    err.add_note(f"--- worker traceback ---\n{tb.rstrip()}")
                    raise err
                raise self.fail(rank, what, message, tb)
            case Hello():
                pass

    # -- shutdown -------------------------------------------------------------------------------------
    def close(self, force: bool = False) -> None:
        """Stop the workers: :class:`Stop` and up to ``grace_s`` seconds to exit (none with ``force``),
        then SIGKILL; then the processes they started (vLLM engine cores, seen at start-up and now), which
        end with their worker (the engine's watchdog) or are killed after ``grace_s`` seconds: none is left
        when this returns."""
        if self.closed:
            return
        self.closed = True
        started = [*self._started, *started_by(self.procs)]
        if not force:
            for conn in self.conns.values():
                with contextlib.suppress(EOFError, OSError):
                    send(conn, Stop())
            deadline = time.monotonic() + self.config.grace_s
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self._kill_at_exit()
        atexit.unregister(self._kill_at_exit)
        if self.ray_group is not None:  # the actors' processes, the placement group (and Ray if ours)
            self.ray_group.close()
        for conn in self.conns.values():
            conn.close()
        reap(started, self.config.grace_s)

    def _kill_at_exit(self) -> None:
        """SIGKILL every worker still alive (SIGTERM would be ignored)."""
        stop_processes(self.procs, grace_s=0.0)


def _waiting(what: str) -> str:
    """Where a worker's death was seen: the controller's current wait, which need not involve that worker."""
    return f"the run (it died while the controller waited for {what})"


def started_by(procs: Iterable[Any]) -> list[Any]:
    """The live descendants (``psutil.Process``) of the worker processes of this host among ``procs``
    (Ray actors are not this process's to reap): the vLLM engine cores and their watchdogs. Empty without
    psutil, which vLLM requires, so there are no engine processes then."""
    try:
        import psutil
    except ImportError:
        return []
    found: list[Any] = []
    for p in procs:
        if hasattr(p, "cause") or getattr(p, "pid", None) is None:  # a Ray actor, or never started
            continue
        with contextlib.suppress(psutil.Error):
            found += psutil.Process(p.pid).children(recursive=True)
    return found


def reap(procs: list[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` seconds for ``procs`` (``psutil.Process``, from :func:`started_by`) to end,
    then SIGKILL those left (psutil checks each is still the process it was, not a reused pid)."""
    if not procs:
        return
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=1.0)


def to_ranks(ranks: Iterable[int], msg: Command) -> dict[int, Command]:
    """The same message for each of ``ranks``."""
    return dict.fromkeys(ranks, msg)
