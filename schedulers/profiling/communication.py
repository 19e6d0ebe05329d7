"""What moving work between processes costs on this host: gloo collectives among ``n`` spawned workers
and, in the same workers, how much slower ``n`` busy workers run (``parallel``); the controller → worker
round trip of a command over the runtime's pipe protocol (``dispatch``); hashing weights as the weight
sync verifies them (``digest``). Seconds per call."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlflow.schedulers.planner.cluster import COLLECTIVES
from rlflow.schedulers.profiling.measure import (
    DEFAULT_CONFIG,
    one_layer,
    profile_row,
    time_call,
    time_collective,
)

__all__ = ["profile_collectives", "profile_digest", "profile_dispatch"]


# ---- collectives ------------------------------------------------------------------------------------


def _busy_loop(seconds: float = 0.5, threads: int = 1, config: dict[str, Any] | None = None) -> float:
    """Mean seconds per train step (forward, backward, AdamW) of the one-layer model of ``config``
    (default :data:`DEFAULT_CONFIG`) on 4 rows of 16 tokens and ``threads`` torch threads, run for
    ``seconds`` (the ``parallel`` rows). Node-like work: a matmul loop alone fits in cache and showed
    4 busy processes on 2 cores x2.1 where model steps showed x2.4-3.3."""
    from rlflow.nodes.models import build_model

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg = {"model_type": "llama", **one_layer(config or DEFAULT_CONFIG)}
        model = build_model(config=cfg, head="lm", dtype="float32", seed=0, name="profile")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(1, int(cfg["vocab_size"]), (4, 16), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            model(input_ids=ids).logits.float().log_softmax(-1).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            calls += 1
        return (time.perf_counter() - t0) / calls
    finally:
        torch.set_num_threads(before)


def _all_gather(out: torch.Tensor, part: torch.Tensor) -> object:
    import torch.distributed as dist

    # torch >= 2.13 names it all_gather_single (the older name warns on every call)
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(out, part)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> object:
    import torch.distributed as dist

    return getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, full)


def _collective_worker(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    repeats: int,
    threads: int,
    out_dir: str,
    config: dict[str, Any] | None = None,
) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        lines = []
        for op in COLLECTIVES:
            for nbytes in sizes:
                numel = max(world, nbytes // 4 // world * world)  # full tensor, divisible by the group
                full = torch.zeros(numel, dtype=torch.float32)
                part = torch.zeros(numel // world, dtype=torch.float32)
                fn: Callable[[], object] = {
                    "all_reduce": partial(dist.all_reduce, full),
                    "all_gather": partial(_all_gather, full, part),
                    "reduce_scatter": partial(_reduce_scatter, part, full),
                    "broadcast": partial(dist.broadcast, full, 0),
                }[op]
                dist.barrier()
                lines.append(f"{op} {numel * 4} {time_collective(fn, repeats)}")
        dist.barrier()  # then every rank busy at once: the slowdown of `world` busy workers
        per_unit = torch.tensor([_busy_loop(threads=threads, config=config)], dtype=torch.float64)
        dist.all_reduce(per_unit)
        lines.append(f"parallel 0 {float(per_unit) / world}")
        if rank == 0:
            Path(out_dir, f"collectives-{world}.txt").write_text("\n".join(lines))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def profile_collectives(
    group_sizes: Sequence[int],
    sizes_bytes: Sequence[int] = (4096, 64 << 10, 1 << 20, 4 << 20),
    repeats: int = 10,
    threads: int = 1,
    config: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Seconds of each gloo collective (``cluster.COLLECTIVES``) among ``n`` local processes for each size
    (bytes of the full tensor), one row per (collective, n, size); and ``parallel`` rows: seconds per
    unit of node-like work (:func:`_busy_loop` of ``config``) in one spawned process alone and in all ``n``
    at once (mean over them), so ``seconds(n) / seconds(1)`` is how much slower ``n`` busy workers run on this
    host, other tenants of its cores included (``ClusterSpec.slowdown``)."""
    import torch.multiprocessing as mp

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        # the busy loop alone runs in a spawned worker too: this process's state (allocator, imports)
        # made it slower here than in a worker, i.e. slowdowns below 1
        for n in (1, *sorted({n for n in group_sizes if n >= 2})):
            args = (n, _free_port(), list(sizes_bytes) if n > 1 else [], repeats, threads, tmp, config)
            mp.spawn(_collective_worker, args=args, nprocs=n)
            for line in Path(tmp, f"collectives-{n}.txt").read_text().splitlines():
                op, nbytes, seconds = line.split()
                rows.append(profile_row(op, float(seconds), group_size=n, bytes=int(nbytes)))
    return rows


# ---- dispatch -----------------------------------------------------------------------------------------


def _echo_worker(address: tuple[str, int], authkey: bytes) -> None:
    """A stand-in worker: answers every ``run`` command with its batch as the outputs, like a node."""
    from multiprocessing.connection import Client

    from rlflow.schedulers.runtime.distributed.protocol import recv, send

    torch.set_num_threads(1)
    conn = Client(address, authkey=authkey)
    try:
        while True:
            msg = recv(conn)
            if msg[0] == "stop":
                return
            _, cmd, _name, _iteration, batch = msg
            payload = {"outputs": batch, "metrics": {}, "tokens": 0, "version": 0, "start": 0.0, "end": 0.0}
            send(conn, ("done", cmd, 0, payload))
    finally:
        conn.close()


def profile_dispatch(
    sizes_bytes: Sequence[int] = (0, 64 << 10, 1 << 20), repeats: int = 20
) -> list[dict[str, Any]]:
    """Seconds of a controller → worker → controller round trip of a ``run`` command carrying a batch of
    ``bytes`` (an int64 tensor; 0: an empty batch) that the worker sends back as its outputs, over the
    runtime's protocol (pickled messages on a ``multiprocessing.connection`` pipe). The controller writes
    its trace once per iteration, not per node: that is in the runtime probe's ``runtime_iteration``."""
    import multiprocessing as mp
    from multiprocessing.connection import Listener

    from rlflow.dataflow.batch import Batch
    from rlflow.schedulers.runtime.distributed.protocol import recv, send

    authkey = os.urandom(16)
    rows: list[dict[str, Any]] = []
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        proc = mp.get_context("spawn").Process(target=_echo_worker, args=(listener.address, authkey))
        proc.start()
        try:
            conn = listener.accept()
            for nbytes in sizes_bytes:
                batch = Batch({"ids": torch.zeros(nbytes // 8, dtype=torch.int64)}) if nbytes else Batch()

                def trip(batch: Batch = batch) -> None:
                    send(conn, ("run", 0, "profile", 0, batch))
                    recv(conn)

                rows.append(profile_row("dispatch", time_call(trip, repeats), bytes=int(nbytes)))
            send(conn, ("stop",))
            conn.close()
        finally:
            proc.join(10.0)
            if proc.is_alive():
                proc.kill()
    return rows


# ---- weight hashing -----------------------------------------------------------------------------------


def profile_digest(nbytes: int = 16 << 20, repeats: int = 3) -> list[dict[str, Any]]:
    """Seconds of ``realloc.verify.weights_checksum`` over ``nbytes`` of float32 weights."""
    from rlflow.schedulers.realloc.verify import weights_checksum

    weights = {"w": torch.zeros(nbytes // 4, dtype=torch.float32)}
    return [profile_row("digest", time_call(lambda: weights_checksum(weights), repeats), bytes=nbytes)]
