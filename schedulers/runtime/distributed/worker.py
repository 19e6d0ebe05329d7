"""A worker process: its entry points (embedded, Ray, torchrun) and its command loop.

Started by the embedded launcher of :class:`rlflow.schedulers.runtime.distributed.pool.WorkerPool`, or
by torchrun::

    RLFLOW_CONTROLLER=HOST:PORT RLFLOW_AUTHKEY=HEX \\
        torchrun --nnodes N --nproc-per-node P ... -m rlflow.schedulers.runtime.distributed.worker

(``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``/``LOCAL_RANK`` from torchrun; the controller prints
the two ``RLFLOW_*`` values when started with ``launch="external"``).

Protocol: the dataclasses of :mod:`rlflow.schedulers.runtime.distributed.protocol`, pickled over a
``multiprocessing.connection``; :func:`serve` dispatches them with a ``match``. A node's reply is metadata
only (:class:`~rlflow.schedulers.runtime.distributed.protocol.NodeReport`: shapes, dtypes, per-row mask
sums, metrics, times), never its output tensors; a sync's reply is its
:class:`~rlflow.schedulers.runtime.distributed.protocol.SyncReport`.

Batches move worker to worker (:mod:`rlflow.schedulers.runtime.distributed.transfer`): a node's outputs
stay in the :class:`~rlflow.schedulers.runtime.distributed.transfer.RowStore` of its dp leaders; a node
that reads them first gets an ``Xfer`` command on every rank that sends or receives its rows, then its
``RunNode``. When the controller submits several ready nodes together, all their ``Xfer`` commands go out
before their ``RunNode`` commands, so a worker that holds rows for one node and runs another sends first
and does not serialise the two.

No deadlock: each worker executes its commands one at a time in the order received, and the controller
sends every command to all its participants before the next one (one connection per worker keeps the
order), so all workers execute the commands they share in the same global order, the controller's send
order (command ids are reserved at submission, so they need not increase in that order). The
communication of a command — point-to-point transfers (one message per pair, tagged with the command id,
all posted before any is waited for), collectives inside the node on its mesh, a weight sync's broadcasts
on the union of source and target ranks — involves only that command's participants and is matched only
inside that command. So the first-sent unfinished command has every participant either at it or done with
it (everything sent earlier is finished), and it completes; by induction every command does. Nodes on
disjoint meshes with disjoint holders run concurrently; nodes that share a worker, as executor, holder or
receiver, run one after another in send order. A dead peer does not hang anyone: every process group has
the collective timeout, and the controller sees the death first.

What a worker holds and how it handles each command: :class:`~rlflow.schedulers.runtime.distributed.
worker_state.Worker`.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

import torch
import torch.distributed as dist

from rlflow.dataflow.errors import ProcessLost
from rlflow.schedulers.runtime.distributed.launch import no_delay
from rlflow.schedulers.runtime.distributed.parent_watch import exit_with_controller
from rlflow.schedulers.runtime.distributed.protocol import (
    Command,
    DistConfig,
    Done,
    Failed,
    Fetch,
    Free,
    GetState,
    Hello,
    LoadState,
    Pull,
    Put,
    Ready,
    RunNode,
    Setup,
    Stop,
    Stored,
    Sync,
    Xfer,
    recv,
    send,
)
from rlflow.schedulers.runtime.distributed.worker_state import Worker
from rlflow.schedulers.runtime.threads import allowed_cores, apply_threads, choose_threads

__all__ = ["connect_controller", "join_and_serve", "main", "serve", "spawned_main"]


# what a failed command was doing, in its error message (commands that say more set it in serve)
_WHAT: dict[type, str] = {
    Setup: "setup",
    Pull: "pull",
    Free: "free",
    Stored: "stored",
    Fetch: "fetch",
    GetState: "state",
    LoadState: "load_state",
}


def serve(rank: int, conn: Connection) -> None:
    """The command loop of a worker whose default process group is initialised; returns on :class:`Stop`
    (or when the controller is gone), after stopping the worker's generation engines."""
    send(conn, Hello(rank))
    worker: Worker | None = None
    try:
        while True:
            try:
                msg: Command = recv(conn)
            except (EOFError, OSError):  # the controller is gone
                return
            if isinstance(msg, Stop):
                return
            cmd = -1 if isinstance(msg, Setup) else msg.cmd
            what = _WHAT.get(type(msg), type(msg).__name__)
            try:
                if isinstance(msg, Setup):
                    worker = Worker(rank, msg.graph, msg.checkpoint_dir, msg.config)
                    send(conn, Ready(rank))
                    continue
                assert worker is not None, "setup must come first"
                payload: Any = None
                match msg:
                    case RunNode(node=name, iteration=iteration):
                        what = f"node '{name}' (iteration {iteration})"
                        payload = worker.run_node(msg)
                    case Xfer(part=part, keep=keep):
                        what = "moving input rows between workers"
                        worker.transfer(cmd, part, keep)
                    case Put(iteration=iteration, rows=rows):
                        what = f"receiving source rows (iteration {iteration})"
                        worker.put(cmd, iteration, rows)
                    case Pull(items=items):
                        payload = worker.pull(items)
                    case Free(handles=handles):
                        worker.store.free(handles)
                    case Stored():
                        payload = worker.store.handles()
                    case Sync(src=src, dsts=dsts, version=version):
                        what = f"weight sync of model '{worker.view.instances[src].model}'"
                        payload = worker.sync(src, dsts, version)
                    case Fetch(instance=instance, adapters=adapters):
                        payload = worker.fetch(instance, adapters=adapters)
                    case GetState():
                        payload = worker.state()
                    case LoadState(state=state):
                        worker.load_state(state)
                    case _:
                        raise RuntimeError(f"unknown command {msg!r}")
                send(conn, Done(cmd, rank, payload))
            except BaseException as e:
                try:
                    lost = e.cause if isinstance(e, ProcessLost) else None
                    message = f"{type(e).__name__}: {e}"
                    send(conn, Failed(cmd, rank, what, message, traceback.format_exc(), lost))
                except (EOFError, OSError):
                    return
                if isinstance(e, KeyboardInterrupt | SystemExit):
                    return

    finally:
        if worker is not None:  # the engines stop with their worker, whatever ended the loop
            worker.close()


def connect_controller(address: tuple[str, int], authkey: bytes, timeout_s: float) -> Connection:
    """A connection to the controller at ``address``, retried for ``timeout_s`` seconds (Nagle off)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return no_delay(Client(address, authkey=authkey))
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def spawned_main(
    rank: int,
    world: int,
    init_method: str,
    address: tuple[str, int],
    authkey: bytes,
    config: DistConfig,
    controller_pid: int | None = None,
) -> None:
    """Entry of a worker started by the embedded launcher (multiprocessing spawn).

    The worker ignores SIGINT, SIGTERM and SIGHUP and leads a process group of its own: a Ctrl-C, or a
    scheduler's SIGTERM to the controller's process group, must reach the controller only, which finishes
    the iteration on its workers, saves and stops them (:class:`Stop`, else SIGKILL). A worker whose
    controller dies sees its connection close and exits; before it serves (start-up, rendezvous) it exits
    when process ``controller_pid`` ends (:mod:`~rlflow.schedulers.runtime.distributed.parent_watch`).
    """
    if controller_pid is not None:  # first: a controller killed from here on must not leave this process
        exit_with_controller(controller_pid)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    # A process group of its own: processes the worker starts (a vLLM engine core, which installs its own
    # SIGINT/SIGTERM handlers) then miss a terminal's Ctrl-C too, and keep serving the iteration in flight
    os.setpgid(0, 0)
    join_and_serve(rank, world, init_method, address, authkey, config)


def join_and_serve(
    rank: int, world: int, init_method: str, address: tuple[str, int], authkey: bytes, config: DistConfig
) -> None:
    """Join the process group, then serve the controller at ``address`` until :class:`Stop` (or the
    controller is gone); leaves the process group on the way out. Used by the embedded and Ray launchers."""
    from rlflow.schedulers.runtime.distributed.launch import init_worker_process

    assert config.threads is not None, "the launcher resolves DistConfig.threads for each worker"
    init_worker_process(rank, world, init_method, config.collective_timeout_s, None, config.threads)
    conn = connect_controller(address, authkey, 60.0)
    try:
        serve(rank, conn)
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    """torchrun entry: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and ``RLFLOW_CONTROLLER``
    (``host:port``), ``RLFLOW_AUTHKEY`` (hex) from the environment."""
    from datetime import timedelta

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    host, port = os.environ["RLFLOW_CONTROLLER"].rsplit(":", 1)
    authkey = bytes.fromhex(os.environ["RLFLOW_AUTHKEY"])
    timeout = float(os.environ.get("RLFLOW_COLLECTIVE_TIMEOUT_S", "300"))
    # torchrun's workers on this host share its cores (LOCAL_WORLD_SIZE of them); torchrun itself sets
    # OMP_NUM_THREADS=1 when it is unset and nproc_per_node > 1, which counts as the user's override
    choice = choose_threads(allowed_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")), os.environ)
    apply_threads(choice, None if os.environ.get("LOCAL_RANK", "0") == "0" else "")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout))
    del world
    conn = connect_controller((host, int(port)), authkey, 120.0)
    try:
        serve(rank, conn)
    finally:
        conn.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
