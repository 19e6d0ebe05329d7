"""The Ray launcher against the embedded launcher: command round trips, per-node dispatch, iteration time.

Part 1 — one command's round trip, controller -> worker -> controller, with a node's typical command (a
``RunNode`` of 8 rows' per-row lists) and its ``Done`` reply, to 1 and to 4 workers at once (a node's mesh):

* ``socket``: rlflow's protocol (pickled dataclasses over a ``multiprocessing.connection``, Nagle off) to a
  Ray actor that serves it in a loop, as the Ray launcher's workers do;
* ``ray call``: the same command as a Ray actor method call (``actor.handle.remote(cmd)``, ``ray.get``),
  the alternative the launcher could have used.

Part 2 — the PPO example on the 4-worker plan of ``bench_dist_ppo.py``, embedded launcher vs Ray launcher
(same seed and plan): mean iteration time after one warm-up iteration, and per node the start lag (submitted
to the first worker's start) and the reply lag (the last worker's end to the result at the controller).

    python bench/bench_ray.py [--round-trips 2000] [--iterations 4] [--batch 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_dist_ppo import PLAN_4  # the same 4-worker plan (python puts bench/ on sys.path)

ROOT = Path(__file__).resolve().parents[1]


class Echo:
    """A worker stand-in: answers a command with ``Done`` over a socket loop or as a method call."""

    def __init__(self) -> None:
        import rlflow.schedulers.runtime.distributed.protocol  # noqa: F401  (registers the wire codes)

    def handle(self, cmd: Any) -> Any:
        from rlflow.schedulers.runtime.distributed.protocol import Done

        return Done(cmd.cmd, 0, None)

    def serve_socket(self, address: tuple[str, int], authkey: bytes) -> None:
        from rlflow.schedulers.runtime.distributed.protocol import Done, Stop, recv, send
        from rlflow.schedulers.runtime.distributed.worker import connect_controller

        conn = connect_controller(address, authkey, 30.0)
        while True:
            msg = recv(conn)
            if isinstance(msg, Stop):
                break
            send(conn, Done(msg.cmd, 0, None))
        conn.close()


def _command(cmd: int) -> Any:
    from rlflow.dataflow.batch import Batch
    from rlflow.schedulers.runtime.distributed.protocol import RunNode

    local = Batch({"answer": [str(i) for i in range(8)]})
    return RunNode(cmd, "reward", 1, local, ["response_ids", "answer"], None, 7)


def round_trips(n: int, fanout: int) -> dict[str, float]:
    """Median and p90 microseconds per command to ``fanout`` workers, socket vs Ray call."""
    import multiprocessing.connection as mpc

    import ray

    from rlflow.schedulers.runtime.distributed.launch import no_delay
    from rlflow.schedulers.runtime.distributed.protocol import Stop, recv, send

    remote = ray.remote(num_cpus=0)(Echo)
    callers = [remote.remote() for _ in range(fanout)]
    servers = [remote.remote() for _ in range(fanout)]
    ray.get([a.handle.remote(_command(0)) for a in callers])  # started and warm
    authkey = os.urandom(16)
    listener = mpc.Listener((ray.util.get_node_ip_address(), 0), authkey=authkey)
    refs = [s.serve_socket.remote(listener.address, authkey) for s in servers]
    conns = [no_delay(listener.accept()) for _ in servers]
    out: dict[str, float] = {}
    for label in ("socket", "ray call"):
        times = []
        for i in range(n):
            msg = _command(i)
            t0 = time.perf_counter()
            if label == "socket":
                for c in conns:
                    send(c, msg)
                for c in conns:
                    recv(c)
            else:
                ray.get([a.handle.remote(msg) for a in callers])
            times.append(time.perf_counter() - t0)
        times = times[n // 10 :]  # warm-up
        out[f"{label} median"] = statistics.median(times) * 1e6
        out[f"{label} p90"] = statistics.quantiles(times, n=10)[-1] * 1e6
    for c in conns:
        send(c, Stop())
    ray.get(refs)
    listener.close()
    for a in callers + servers:
        ray.kill(a)
    return out


def run_ppo(launch: str, iterations: int, batch: int) -> tuple[float, dict[str, tuple[float, float]]]:
    """Mean iteration seconds (after a warm-up iteration) and per node the mean start lag (submitted to the
    first worker's start: the command's way out, plus any wait behind earlier commands on its workers) and
    reply lag (the last worker's end to the controller holding the result: the way back), seconds."""
    import rlflow.schedulers.runtime.controller as controller_mod
    from rlflow.dataflow.loader import loads_graph
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller
    from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor

    seen: dict[str, list[tuple[float, float]]] = {}  # node -> (start lag, reply lag) per execution
    submitted: dict[int, float] = {}
    real_submit, real_collect = DistExecutor.submit, DistExecutor.collect

    def submit(self: DistExecutor, *args: Any, **kwargs: Any) -> Any:
        t = time.time()
        pending = real_submit(self, *args, **kwargs)
        submitted[id(pending)] = t
        return pending

    def collect(self: DistExecutor, pending: Any) -> Any:
        result = real_collect(self, pending)
        if not pending.sync_only and pending.iteration > 1 and id(pending) in submitted:
            start, end = self.timings[pending.name]
            sync = self.sync_timings.get(pending.name, {}) if pending.sync_cmd is not None else {}
            end = max([end, *(t[1] for t in sync.values())])
            lags = seen.setdefault(pending.name, [])
            lags.append((start - submitted[id(pending)], time.time() - end))
        return result

    DistExecutor.submit, DistExecutor.collect = submit, collect  # type: ignore[method-assign]
    real_make = controller_mod.make_executor
    controller_mod.make_executor = lambda g, checkpoint_dir=None, **c: real_make(  # type: ignore[assignment]
        g, checkpoint_dir, **{**c, "launch": launch}
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [
                "run.devices=4",
                f"run.iterations={iterations + 1}",
                f"run.output_dir={tmp}/run",
                "run.eval_interval=0",
                "run.checkpoint_interval=0",
                f"algorithm.batch={batch}",
                "models.actor.config.vocab_size=20",
            ]
            text = (ROOT / "examples/ppo.yaml").read_text() + PLAN_4
            c = Controller(loads_graph(text, "examples/ppo.yaml", overrides))
            try:
                c.run()
            finally:
                c.close()
            rows = [r for r in read_metrics(Path(tmp) / "run").to_pylist() if r["iteration"] >= 2]
    finally:
        DistExecutor.submit, DistExecutor.collect = real_submit, real_collect  # type: ignore[method-assign]
        controller_mod.make_executor = real_make
    iteration = statistics.mean(float(r["timing_s/iteration"]) for r in rows)
    return iteration, {
        k: (statistics.mean(a for a, _ in v), statistics.mean(b for _, b in v)) for k, v in seen.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--round-trips", type=int, default=2000)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        print(f"command round trip (µs), {args.round_trips} commands, RunNode of 8 rows -> Done")
        print(f"{'workers':<9}{'socket med':>12}{'p90':>9}{'ray call med':>14}{'p90':>9}{'ratio':>8}")
        for fanout in (1, 4):
            r = round_trips(args.round_trips, fanout)
            ratio = r["ray call median"] / r["socket median"]
            print(
                f"{fanout:<9}{r['socket median']:>12.0f}{r['socket p90']:>9.0f}{r['ray call median']:>14.0f}"
                f"{r['ray call p90']:>9.0f}{ratio:>8.2f}"
            )
        embedded = run_ppo("spawn", args.iterations, args.batch)
        on_ray = run_ppo("ray", args.iterations, args.batch)
    finally:
        ray.shutdown()
    print(f"\nPPO, 4 workers, batch {args.batch}, mean of {args.iterations} iterations after 1 warm-up")
    print(f"{'':<16}{'embedded':>10}{'ray':>10}{'ray/embedded':>14}")
    print(f"{'iteration (s)':<16}{embedded[0]:>10.3f}{on_ray[0]:>10.3f}{on_ray[0] / embedded[0]:>14.2f}")
    print("per node (ms): start lag = submitted -> first worker start (includes waiting behind earlier")
    print("commands on its workers); reply lag = last worker end -> result at the controller")
    print(f"{'node':<16}{'start: emb':>11}{'ray':>9}{'reply: emb':>12}{'ray':>9}{'ratio':>7}")
    for name, (s_emb, r_emb) in embedded[1].items():
        s_ray, r_ray = on_ray[1].get(name, (float("nan"), float("nan")))
        ratio = r_ray / r_emb if r_emb > 0 else float("nan")
        print(
            f"{name:<16}{s_emb * 1e3:>11.2f}{s_ray * 1e3:>9.2f}{r_emb * 1e3:>12.2f}{r_ray * 1e3:>9.2f}"
            f"{ratio:>7.2f}"
        )


if __name__ == "__main__":
    main()
