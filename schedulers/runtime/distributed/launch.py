"""Start a group of local worker processes on torch.distributed (gloo on CPU, NCCL on GPU).

:func:`run_group` runs one function on ``world`` local processes and returns their results; it is the
embedded launcher's building block and the harness of the multi-process tests. Every wait is bounded:
the group is killed when ``timeout_s`` passes or a process dies or raises.

How a worker starts (:func:`worker_start_method`): on a host without CUDA devices it is forked from
``multiprocessing``'s fork server, which imported torch, rlflow's worker and transformers' model code once
(:data:`FORKSERVER_PRELOAD`), so a worker starts without importing them again (seconds of CPU each; the
process of PyTorch's ``DataLoader`` workers, forked after ``import torch``, with a clean single-threaded
parent); with CUDA it is spawned (a process that forked after CUDA's driver was initialised cannot use
it). Either way the worker runs under the environment a spawned one gets (this process's, plus the
group's variables), set before the target runs: only what the preloaded modules read at import time
comes from the fork server's environment (that of the first group it started). ``RLFLOW_WORKER_START``
(``spawn`` | ``forkserver``) overrides the choice.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from rlflow.dataflow.errors import HostError
from rlflow.schedulers.runtime.distributed.preload import SERVER_MARK, SERVER_SIGNALS
from rlflow.schedulers.runtime.threads import (
    ThreadChoice,
    allowed_cores,
    choose_threads,
    environment,
    worker_env,
)

__all__ = [
    "FORKSERVER_PRELOAD",
    "START_METHODS",
    "WORKER_START_ENV",
    "GroupFailed",
    "free_port",
    "init_worker_process",
    "run_group",
    "spawn_group",
    "stop_processes",
    "worker_start_method",
]

WORKER_START_ENV = "RLFLOW_WORKER_START"
START_METHODS = ("forkserver", "spawn")
# what a forked worker would otherwise import itself: ~2 s of CPU for torch and rlflow, ~2-4 s more for
# transformers' model code (the llama module pulls in the shared modelling code every family uses)
FORKSERVER_PRELOAD = (
    "rlflow.schedulers.runtime.distributed.preload",  # first: the server's own signal dispositions
    "rlflow.schedulers.runtime.distributed.worker",
    "transformers.models.llama.modeling_llama",
)


class GroupFailed(RuntimeError):
    """A process of a :func:`run_group` raised, died or timed out (the message names the rank)."""


def no_delay(conn: Any) -> Any:
    """Turn off Nagle's algorithm on a ``multiprocessing.connection`` TCP connection; returns ``conn``.

    Commands and replies are small messages written back to back; with Nagle's algorithm and the peer's
    delayed ACK each exchange could stall ~40 ms (measured: 40–45 ms gaps between a node's reply and the
    next command on loopback).
    """
    try:
        sock = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError):
        return conn  # not a socket (e.g. a pipe)
    try:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()
    return conn


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_worker_process(
    rank: int, world: int, init_method: str, timeout_s: float, backend: str | None = None, threads: int = 1
) -> None:
    """Set ``threads`` torch/OpenMP threads and join the default process group (timeout ``timeout_s``)."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def _child(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    init_method: str,
    timeout_s: float,
    args: tuple[Any, ...],
    results: Any,
    threads: int,
) -> None:
    import torch.distributed as dist

    try:
        init_worker_process(rank, world, init_method, timeout_s, backend="gloo", threads=threads)
        out = fn(rank, world, *args)
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_start_method(env: Mapping[str, str] | None = None) -> str:
    """How this host's worker processes start: ``RLFLOW_WORKER_START`` in ``env`` (default: this process's
    environment) when set, else ``"spawn"`` where torch sees a CUDA device and ``"forkserver"`` elsewhere.

    Raises:
        HostError: ``RLFLOW_WORKER_START`` holds neither ``spawn`` nor ``forkserver``.
    """
    value = (os.environ if env is None else env).get(WORKER_START_ENV, "").strip()
    if value:
        if value not in START_METHODS:
            raise HostError(f"{WORKER_START_ENV}={value!r}: expected one of {', '.join(START_METHODS)}")
        return value
    import torch

    return "spawn" if torch.cuda.is_available() else "forkserver"


def _context(method: str) -> Any:
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))  # read when the fork server starts
    return ctx


def _in_environment(
    env: dict[str, str], ignored: tuple[int, ...], target: Callable[..., Any], *args: Any
) -> Any:
    """A forked worker's entry: the environment and the dispositions of SIGTERM/SIGHUP (``ignored``: those
    the starting process ignores, which a spawned process inherits) a spawned one would have started with,
    then ``target``."""
    os.environ.clear()
    os.environ.update(env)
    for sig in SERVER_SIGNALS:  # the fork server ignores them (preload.py)
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    return target(*args)


def stop_processes(procs: list[Any], grace_s: float = 2.0) -> None:
    """Terminate (SIGTERM), then kill (SIGKILL) after ``grace_s`` seconds, every process still alive."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def spawn_group(
    world: int,
    target: Callable[..., Any],
    args_of: Callable[[int, int], tuple[Any, ...]],
    procs: list[Any],
    *,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    name: str | None = None,
) -> tuple[ThreadChoice, dict[str, str]]:
    """Start ``world`` daemon processes on this host (:func:`worker_start_method`), rank ``r`` running
    ``target(*args_of(r, n_threads))``, each appended to ``procs`` as it starts (so a caller can stop the
    ones started when a later start fails); the choice of threads and the environment they started with.

    Threads: :func:`~rlflow.schedulers.runtime.threads.choose_threads` of this host's allowed cores among
    the ``world`` processes (``threads``: a caller's fixed number; else the ``RLFLOW_NUM_THREADS``/
    ``OMP_NUM_THREADS`` override); the processes start with ``OMP_NUM_THREADS``, the OpenMP wait settings
    (:func:`~rlflow.schedulers.runtime.threads.worker_env`) and ``env`` in their environment (this
    process's is restored afterwards). ``name``: processes are named ``{name}-{rank}``.
    """
    choice = choose_threads(allowed_cores(), world, os.environ, threads)
    child_env = {**worker_env(choice, os.environ), **(env or {})}
    method = worker_start_method()
    ctx = _context(method)
    with environment(child_env):
        full = dict(os.environ)  # what a spawned process would inherit
        ignored = tuple(s for s in SERVER_SIGNALS if signal.getsignal(s) == signal.SIG_IGN)
        # the fork server, if this start launches it, ignores the run's group signals (preload.py)
        server = {SERVER_MARK: "1"} if method == "forkserver" else {}
        with environment(server):
            for r in range(world):
                args = args_of(r, choice.threads)
                p = ctx.Process(
                    target=target if method == "spawn" else _in_environment,
                    args=args if method == "spawn" else (full, ignored, target, *args),
                    daemon=True,
                    name=None if name is None else f"{name}-{r}",
                )
                p.start()
                procs.append(p)
    return choice, child_env


def run_group(
    fn: Callable[..., Any],
    world: int,
    args: tuple[Any, ...] = (),
    *,
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` local gloo processes; return results by rank.

    ``fn`` must be importable (module-level) and its result picklable. Each process uses the threads of
    :func:`~rlflow.schedulers.runtime.threads.choose_threads` (this host's allowed cores among the ``world``
    processes, or the ``RLFLOW_NUM_THREADS``/``OMP_NUM_THREADS`` override), with the OpenMP wait settings of
    :func:`~rlflow.schedulers.runtime.threads.worker_env` in its environment.

    Raises:
        GroupFailed: a process raised (with its traceback), died, or the group ran past ``timeout_s``.
    """
    results = _context(worker_start_method()).Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs: list[Any] = []
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    ok_all = False
    try:
        spawn_group(
            world, _child, lambda r, n: (fn, r, world, init, collective_timeout_s, args, results, n), procs
        )
        while len(out) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GroupFailed(f"process group of {world} ran past {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(0.5, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in out]
                if dead:
                    time.sleep(0.2)  # a result may still be in flight
                    if results.empty():
                        code = procs[dead[0]].exitcode
                        raise GroupFailed(f"rank {dead[0]} died (exit code {code})") from None
                continue
            if not ok:
                raise GroupFailed(f"rank {rank} raised:\n{value}")
            out[rank] = value
        ok_all = True
    finally:
        if ok_all:  # let them leave the process group cleanly
            for p in procs:
                p.join(max(0.0, min(5.0, deadline - time.monotonic())))
        stop_processes(procs)
    return [out[r] for r in range(world)]
