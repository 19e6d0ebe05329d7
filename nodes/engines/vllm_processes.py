"""Starting a vLLM engine from this process without leaking its changes, and supervising the processes it
runs in.

Where the engine runs: in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no child process, so
nothing can outlive its owner), or in vLLM's own processes (engine core, plus one worker per TP rank at
tensor parallel > 1). :func:`engine_start_scope` sets vLLM's environment for either and puts back what
vLLM changes in the caller (global RNG states, torch's thread count, the daemon flag); :func:`visible_devices`
shows a tensor-parallel engine's processes their GPUs.

Engine processes are watched twice: a watchdog process, started before the engine, SIGKILLs them if the
owner dies without closing the engine, at any phase (:class:`EngineProcesses`,
:mod:`rlflow.nodes.engines.watchdog`), and :func:`watched_call` turns an engine process that dies
during a call into :class:`EngineDiedError` instead of a wait without end.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from rlflow.dataflow.errors import ProcessLost

__all__ = [
    "LIVENESS_POLL_S",
    "EngineDiedError",
    "EngineProcesses",
    "destroy_in_process_state",
    "engine_start_scope",
    "raise_if_dead",
    "shutdown_engine_core",
    "start_llm",
    "visible_devices",
    "watched_call",
]

LIVENESS_POLL_S = 0.5
"""Seconds between checks that the engine's processes are alive while a call into the engine waits."""


class EngineDiedError(ProcessLost):
    """The engine's processes died while (or before) the engine was called (``cause`` ``"engine"``).

    Attributes:
        pid: the process found dead (``None`` where not known, e.g. after crossing a process boundary).
        status: how it ended (``was killed by SIGKILL``, ``exited with status 1``, ``exited unexpectedly``).
        what: what the engine was doing (``generation``, ``a weight load``, ...).
    """

    def __init__(
        self, message: str, cause: str = "engine", *, pid: int | None = None, status: str = "", what: str = ""
    ) -> None:
        super().__init__(message, cause)
        self.pid, self.status, self.what = pid, status, what


def _environment(in_process: bool, on_cuda: bool) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process:  # a forked engine core would inherit the worker's initialised process group
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if on_cuda and not in_process:  # CUDA IPC handles reach the engine core pickled (weight_transport)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # vLLM's CPU worker otherwise pins OpenMP threads to cores, which in-process would pin the trainer too
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _global_rng_states() -> tuple[Any, ...]:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_global_rng_states(states: tuple[Any, ...]) -> None:
    import random

    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


@contextlib.contextmanager
def engine_start_scope(*, in_process: bool, on_cuda: bool) -> Iterator[None]:
    """Around importing vLLM and constructing a ``vllm.LLM``: sets vLLM's environment variables for an
    engine in this process (``in_process``) or in its own processes. On exit puts back this process's
    global RNG states (an in-process engine seeds random, numpy and torch with its own seed; the run's were
    seeded by the controller), its daemon flag (vLLM's multiprocessing refuses children of a daemonic
    process, which the distributed runtime's workers are) and torch's thread setting (vLLM's CPU worker
    lowers it to 1 and replaces ``torch.set_num_threads`` in-process)."""
    _environment(in_process, on_cuda)
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng_states = _global_rng_states()
    proc_config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    was_daemon = proc_config.get("daemon", False)
    if not in_process:  # the watchdog ties the engine's processes to this one instead
        proc_config["daemon"] = False
    try:
        yield
    finally:
        _set_global_rng_states(rng_states)
        proc_config["daemon"] = was_daemon
        torch.set_num_threads = set_threads
        set_threads(threads)


@contextlib.contextmanager
def visible_devices(devices: Sequence[str] | None) -> Iterator[None]:
    """Within: ``CUDA_VISIBLE_DEVICES`` is ``devices`` (entries of this process's own, one per TP worker
    of an engine being started), so that the processes spawned meanwhile see those GPUs only; restored on
    exit. ``None``: unchanged."""
    if devices is None:
        yield
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    try:
        yield
    finally:
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def start_llm(
    directory: str,
    args: Mapping[str, Any],
    *,
    in_process: bool,
    on_cuda: bool,
    tp: int,
    devices: Sequence[str] | None,
) -> tuple[Any, EngineProcesses | None]:
    """A ``vllm.LLM`` serving the Hugging Face directory ``directory`` (model and tokenizer) with vLLM's
    engine arguments ``args`` and ``tensor_parallel_size`` ``tp``, started within :func:`engine_start_scope`
    (the spawned processes on the GPUs ``devices``, one per TP worker: :func:`visible_devices`), with
    rlflow's worker extension (:class:`~rlflow.nodes.engines.vllm_worker.EngineWorkerExtension`) on its
    workers. At tp > 1 vLLM's ``mp`` executor runs one process per TP worker; an engine in other processes
    on CUDA receives weights through vLLM's weight-transfer API (IPC backend, initialised here).

    An engine in vLLM's processes is watched from before it starts (:class:`EngineProcesses`): if this
    process dies at any phase, even mid-start, the watchdog kills every process the engine started; if the
    start fails or is interrupted here (an exception, a Ctrl-C), they are killed before this raises.

    Returns:
        ``(llm, processes)``; ``processes`` is ``None`` in-process.
    """
    ipc: dict[str, Any] = {}
    if on_cuda and not in_process:
        ipc["weight_transfer_config"] = {"backend": "ipc"}
    executor: dict[str, Any] = {"distributed_executor_backend": "mp"} if tp > 1 else {}
    procs = None if in_process else EngineProcesses()
    try:
        with engine_start_scope(in_process=in_process, on_cuda=on_cuda), procs or contextlib.nullcontext():
            from vllm import LLM

            with visible_devices(devices if on_cuda else None):
                llm = LLM(
                    model=directory,
                    tokenizer=directory,
                    tensor_parallel_size=tp,
                    worker_extension_cls="rlflow.nodes.engines.vllm_worker.EngineWorkerExtension",
                    **args,
                    **executor,
                    **ipc,
                )
        if procs is not None:
            procs.found()
        if ipc:
            llm.collective_rpc("init_weight_transfer_engine", args=({"packed": False},))
    except BaseException:
        if procs is not None:
            procs.stop(timeout_s=0.0)
        raise
    return llm, procs


class EngineProcesses:
    """The processes of one engine in vLLM's processes (engine core, TP workers, their children): those
    this process starts while the engine starts, marked by a token in their environment
    (:data:`rlflow.nodes.engines.watchdog.MARK`), watched by a
    :class:`~rlflow.nodes.engines.watchdog.Watchdog` from before the engine starts.

    Use: ``with procs:`` around the engine's start (the mark is set in this process's environment within,
    so every process vLLM spawns inherits it), :meth:`found` once it started, :meth:`stop` after its
    shutdown.

    The engine's shared memory (vLLM's message queues between its engine core and workers, their
    semaphores: files in ``/dev/shm`` its processes map) outlives a killed engine, and even a closed one
    (vLLM 0.32 on CPU force-kills its worker on shutdown, leaving a ~160 MiB segment each time): :meth:`stop`
    unlinks what the engine's processes mapped once they are gone.

    Attributes:
        token: the mark's value (random, one per engine start).
        pids: the engine's processes once started (:meth:`found`; ``[]`` before).
        watchdog: the watchdog.
        shared: the ``/dev/shm`` names its processes were seen to map.
    """

    def __init__(self) -> None:
        import multiprocessing.resource_tracker
        import uuid

        from rlflow.nodes.engines.watchdog import Watchdog

        self.token = uuid.uuid4().hex
        self.pids: list[int] = []
        self.shared: set[str] = set()
        # multiprocessing's resource tracker outlives any one engine: started unmarked, before the mark
        multiprocessing.resource_tracker.ensure_running()
        self.watchdog = Watchdog(self.token)
        self._saved: str | None = None
        self._before: set[int] = set()
        self._found = False

    def __enter__(self) -> EngineProcesses:
        from rlflow.nodes.engines.watchdog import MARK

        self._before = set(_children())
        self._saved = os.environ.get(MARK)
        os.environ[MARK] = self.token
        return self

    def __exit__(self, *exc: object) -> None:
        from rlflow.nodes.engines.watchdog import MARK

        if self._saved is None:
            os.environ.pop(MARK, None)
        else:
            os.environ[MARK] = self._saved

    def _started(self) -> list[int]:
        """This process's children started since :meth:`__enter__` (the watchdog aside), every process
        below them, and any process still marked."""
        from rlflow.nodes.engines.watchdog import descendants, marked_processes

        new = set(_children()) - self._before - {self.watchdog.process.pid}
        return sorted(descendants(new | set(marked_processes(self.token))))

    def found(self) -> list[int]:
        """Record (and return) the engine's running processes; the watchdog is told them."""
        self.pids, self._found = self._started(), True
        self.shared |= _mapped_shm(self.pids)
        self.watchdog.started(self.pids)
        return self.pids

    def stop(self, timeout_s: float = 10.0) -> None:
        """After the engine's shutdown: wait up to ``timeout_s`` seconds for its processes (:attr:`pids`;
        a start that failed: those started so far) to exit, SIGKILL those left and wait for them (this
        process's children among them reaped), stop the watchdog, and unlink the engine's shared memory.
        Idempotent."""
        import psutil

        # once found, the engine's own: children started later are other engines', other tools'
        pids = set(self.pids) if self._found else set(self._started())
        self.shared |= _mapped_shm(pids)
        procs = []
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        alive = _wait_exited(procs, timeout_s)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait_exited(alive, 5.0)
        self.watchdog.stop()
        _unlink_shm(self.shared - _mapped_shm([os.getpid()]))
        self.shared = set()


def _wait_exited(procs: list[Any], timeout_s: float) -> list[Any]:
    """Wait up to ``timeout_s`` seconds for the ``psutil.Process`` es ``procs`` to exit (this process's
    children among them reaped); return those still running. An exited process its parent has not reaped
    yet (a zombie: a killed TP worker re-parented to an init that reaps about once a second, or never in a
    container whose first process reaps nothing) runs nothing: it counts as exited."""
    import time

    import psutil

    def running(p: Any) -> bool:
        try:
            return bool(p.status() != psutil.STATUS_ZOMBIE)
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    left = list(procs)
    while True:
        _, left = psutil.wait_procs(left, timeout=0.05)
        left = [p for p in left if running(p)]
        if not left or time.monotonic() >= deadline:
            return left


def _children() -> list[int]:
    """This process's child processes' pids."""
    import psutil

    return [p.pid for p in psutil.Process().children()]


def _mapped_shm(pids: Iterable[int]) -> set[str]:
    """The names of the ``/dev/shm`` files the processes ``pids`` map (``/proc/PID/maps``). A named semaphore
    (multiprocessing's ``sem.mp-*``) is mapped under the temporary name glibc's ``sem_open`` created it with
    before linking it to its own name: it is found by its inode."""
    out: set[str] = set()
    inodes: set[int] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find("/dev/shm/")
                    if at >= 0:
                        out.add(line[at + len("/dev/shm/") :].split()[0])
                        inodes.add(int(line.split()[4]))
        except OSError:  # gone
            continue
    if inodes:
        with contextlib.suppress(OSError), os.scandir("/dev/shm") as entries:
            out |= {e.name for e in entries if e.name.startswith("sem.") and e.inode() in inodes}
    return out


def _unlink_shm(names: Iterable[str]) -> None:
    """Unlink the ``/dev/shm`` files ``names`` left by a stopped engine, and take multiprocessing's among them
    off this process's resource tracker, which the engine's processes share (registered there, each would
    be reported leaked and unlinked again at exit)."""
    from multiprocessing import resource_tracker

    for name in names:
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:  # already gone (a clean shutdown unlinks its own)
            continue
        if name.startswith("psm_"):
            tracked = (f"/{name}", "shared_memory")
        elif name.startswith("sem.mp-"):
            tracked = (f"/{name.removeprefix('sem.')}", "semaphore")
        else:
            continue
        resource_tracker.register(*tracked)  # then unregister: never a name the tracker does not hold
        resource_tracker.unregister(*tracked)


def _exit_status(pid: int) -> str:
    """How a child process that exited ended (``was killed by SIGKILL``, ``exited with status 1``), read
    without reaping it (``waitid`` with ``WNOWAIT``: vLLM joins its own processes); ``exited unexpectedly``
    when it is not this process's child or was already reaped."""
    import signal

    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "exited unexpectedly"
    if info is None:
        return "exited unexpectedly"
    if info.si_code == os.CLD_EXITED:
        return f"exited with status {info.si_status}"
    try:
        return f"was killed by {signal.Signals(info.si_status).name}"
    except ValueError:
        return f"was killed by signal {info.si_status}"


def raise_if_dead(where: str, pids: Sequence[int], what: str) -> None:
    """Raise :class:`EngineDiedError` naming ``where`` (node and model), the process, its exit status and
    ``what`` the engine was doing, if one of the engine's processes ``pids`` has exited (or is a zombie)."""
    import psutil

    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                continue
        except psutil.NoSuchProcess:
            pass
        status = _exit_status(pid)
        raise EngineDiedError(
            # no "--resume" advice here: the run's error says where it continues from (commands/stage.py)
            f"{where}: the vLLM engine's process {pid} {status} during {what}; the engine is gone (its "
            "error, if any, is in the log above)",
            pid=pid,
            status=status,
            what=what,
        )


def watched_call(
    where: str, pids: Sequence[int], what: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)``, a call into the engine; with engine processes (``pids``) while watching
    them, because vLLM 0.32's synchronous client waits without a timeout for a reply that a dead engine
    core never sends (its liveness monitor shuts the client down but wakes no waiter).

    Raises:
        EngineDiedError: within :data:`LIVENESS_POLL_S` of an engine process exiting during the call
            (:func:`raise_if_dead`; the call's thread is abandoned: the engine is unusable and the run
            stops).
    """
    if not pids:
        return fn(*args, **kwargs)
    raise_if_dead(where, pids, what)
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=call, name="rlflow-vllm-call", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(LIVENESS_POLL_S)
        if thread.is_alive():
            raise_if_dead(where, pids, what)
    if "error" in box:
        raise_if_dead(where, pids, what)  # a dead engine explains the failure better than vLLM's error
        raise box["error"]
    return box["value"]


def shutdown_engine_core(llm: Any) -> None:
    """Stop a ``vllm.LLM``'s engine core and, in vLLM's processes, the whole process tree at once (SIGKILL:
    the engine holds nothing to keep; its weights are the trainer's copy). vLLM's graceful stop waited
    for its TP workers' own teardown (a garbage collection and process-group teardown of a process about
    to be discarded) up to its 5 s grace, then killed them anyway: about 7 s and 1-2 CPU seconds per close
    on 2 loaded cores (measured with vllm-cpu 0.32), at every run's end and every engine restart. vLLM's
    warnings about killing them are not shown: the kill is this function's, not a fault. A failed engine
    has nothing to stop; in-process engines have no process to kill."""
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.setLevel(logging.ERROR)
    try:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown(timeout=0.0)
    finally:
        vllm_logger.setLevel(level)


def destroy_in_process_state() -> None:
    """Tear down the model-parallel groups and distributed environment an in-process engine set up in this
    process (nothing when vLLM never initialised them: a failed start)."""
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:
        pass
