"""``DistExecutor``: the :class:`~schedulers.runtime.executor.Executor` protocol over worker processes.

The controller process starts ``run.devices`` workers (embedded launcher: multiprocessing spawn, gloo on
CPU / NCCL on GPU, init over ``tcp://127.0.0.1:<free port>``; or ``launch="external"``: it listens and
waits for torchrun-started workers, see :mod:`schedulers.runtime.dist.worker`). Each worker builds the
model instances of the nodes placed on it in their layouts (:mod:`schedulers.runtime.dist.placement`).

Per node the controller cuts the batch into the node's dp shares (:mod:`schedulers.runtime.dist.rows`),
sends each mesh rank its share with the command, and gathers the dp leaders' outputs back in row order
(a leader is the tp-rank-0 rank of the last pipeline stage of its dp group: with ``pp > 1`` only the last
stage computes the head, see :mod:`schedulers.runtime.dist.pipeline`).
Metrics: the dp leaders' values are combined (``*/max`` max, ``*/min`` min, otherwise the mean over dp
ranks; train-step metrics such as ``grad_norm`` and ``lr`` are identical on every rank); tokens are summed.
After a train node, a weight sync to the model's other instances is submitted at once (version edges).

Limitations (documented, not hidden): batches travel through the controller (not worker to worker); rows
are split equally, not balanced by tokens; batch-wide statistics inside a node function (e.g. PPO's
advantage whitening) are computed per dp share; generation is not pipelined; ``state_dict`` holds each
rank's optimizer shards, so resuming needs the same plan; the controller keeps a full CPU copy of every
model (the *mirror*) for evaluation and checkpoint writing, refreshed from the workers when read.

Failure handling: a worker that raises sends its traceback; a worker that dies is seen by its process
sentinel (embedded) or the closed connection (external). Either way the controller stops every worker
(SIGTERM, then SIGKILL after ``grace_s``) and raises :class:`~dataflow.errors.NodeError` naming the worker
rank, the node and the error. Every wait has a timeout (``DistConfig``); process groups have a collective
timeout, so a worker blocked on a dead peer fails too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dataflow.batch import Batch
from dataflow.errors import NodeError, PlanError
from dataflow.graph import Graph
from nodes.context import ModelState, NodeResult
from nodes.models import save_pretrained
from schedulers.runtime.dist.launch import free_port, stop_processes
from schedulers.runtime.dist.layouts import check_tensor_parallel
from schedulers.runtime.dist.pipeline import check_pipeline
from schedulers.runtime.dist.placement import PlanView
from schedulers.runtime.dist.rows import gather_rows, shard_rows
from schedulers.runtime.dist.worker import recv, send
from schedulers.runtime.executor import Finished, LocalExecutor

__all__ = ["DistConfig", "DistExecutor", "Pending"]

_log = logging.getLogger("rlflow.realloc")


@dataclass(frozen=True)
class DistConfig:
    """Timeouts (seconds) and process settings of a :class:`DistExecutor`.

    Attributes:
        start_timeout_s: workers must connect and finish building their models within this.
        node_timeout_s: the longest one command (node, sync, fetch) may take.
        collective_timeout_s: timeout of every process group's collectives on the workers.
        grace_s: after SIGTERM, seconds before SIGKILL when stopping workers.
        threads: torch/OpenMP threads per worker.
        launch: ``"spawn"`` (embedded launcher) or ``"external"`` (wait for torchrun-started workers).
        address: controller listen address for ``external`` (host, port); port 0 picks a free one.
        realloc: weight syncs use the planned reallocation where the layouts allow it (``"auto"``) or
            always the gather path (``"gather"``: all-gather in the source mesh, then broadcast).
    """

    start_timeout_s: float = 300.0
    node_timeout_s: float = 3600.0
    collective_timeout_s: float = 300.0
    grace_s: float = 2.0
    threads: int = 1
    launch: str = "spawn"
    address: tuple[str, int] = ("127.0.0.1", 0)
    env: dict[str, str] = field(default_factory=dict)
    realloc: str = "auto"

    def __post_init__(self) -> None:
        if self.realloc not in ("auto", "gather"):
            raise PlanError(f"DistConfig.realloc must be 'auto' or 'gather', got {self.realloc!r}")


@dataclass
class Pending:
    """A submitted node: its command ids per rank, and how to put its outputs together."""

    name: str
    iteration: int
    cmd: int
    ranks: tuple[int, ...]
    leaders: tuple[int, ...]
    shares: list[list[int]]
    sync_cmd: int | None = None
    sync_ranks: tuple[int, ...] = ()
    submitted: float = field(default_factory=time.monotonic)

    def replies(self) -> set[tuple[int, int]]:
        """Every ``(rank, cmd)`` reply this node (and its weight sync) waits for."""
        keys = {(r, self.cmd) for r in self.ranks}
        if self.sync_cmd is not None:
            keys |= {(r, self.sync_cmd) for r in self.sync_ranks}
        return keys


class _FreshModels(Mapping[str, ModelState]):
    """``executor.models``: the mirror's models, refreshed from the workers when read (evaluation)."""

    def __init__(self, owner: DistExecutor) -> None:
        self.owner = owner

    def __getitem__(self, name: str) -> ModelState:
        self.owner.refresh(name)
        return self.owner.mirror.models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.owner.mirror.models)

    def __len__(self) -> int:
        return len(self.owner.mirror.models)


class DistExecutor:
    """All nodes of ``graph`` on ``run.devices`` worker processes, each in its planned mesh and layout.

    Args:
        graph: the validated graph with a manual plan.
        checkpoint_dir: when resuming, a checkpoint whose ``models/<name>`` replace the initial weights.
        config: timeouts and launch settings.

    Raises:
        PlanError: before any process starts: devices outside ``run.devices``, a tensor degree that does
            not divide the model, a pipeline degree the model cannot be cut into, dp shares that split
            sample groups (a generate node with pp > 1 is rejected by the graph's plan validation).
        NodeError: a worker failed to start or build its models.
    """

    def __init__(
        self, graph: Graph, checkpoint_dir: Path | None = None, config: DistConfig | None = None
    ) -> None:
        self.graph = graph
        self.config = config or DistConfig()
        self.view = PlanView.of(graph)
        self.world = self.view.world
        trivial = Graph.from_spec(dataclasses.replace(graph.spec, plan={}), graph.registry)
        self.mirror = LocalExecutor(trivial, device=torch.device("cpu"), checkpoint_dir=checkpoint_dir)
        for inst in self.view.instances:
            where = f"model '{inst.model}' (layout {inst.mesh.layout})"
            check_tensor_parallel(self.mirror.models[inst.model].module, inst.mesh.tp, where)
            check_pipeline(self.mirror.models[inst.model].module, inst.mesh.pp, where)
        self.device = torch.device("cpu")
        self._versions: dict[str, int] = {m: 0 for m in graph.spec.models}
        self._mirror_versions: dict[str, int] = dict(self._versions)
        self._cmd = 0
        self._inbox: dict[tuple[int, int], Any] = {}
        self._conns: dict[int, mpc.Connection] = {}
        self._procs: list[Any] = []
        self._closed = False
        self.timings: dict[str, tuple[float, float]] = {}
        # node -> rank -> (start, end) wall-clock seconds (time.time) of its last execution on each worker
        self.worker_timings: dict[str, dict[int, tuple[float, float]]] = {}
        # train node -> rank -> (sync_start, sync_end, bytes sent + received) of the weight sync after its
        # last execution (wall-clock seconds; the controller records them as "reallocation" trace rows)
        self.sync_timings: dict[str, dict[int, tuple[float, float, int]]] = {}
        # weight syncs per path ("plan": planned reallocation, "gather": the gather path), by target
        self.realloc_counts: dict[str, int] = {"plan": 0, "gather": 0}
        # one record per target instance and sync: model, version, instance, path, bytes, per-rank checksums
        self.realloc_log: list[dict[str, Any]] = []
        self._start(checkpoint_dir)

    # -- launch ---------------------------------------------------------------------------------------
    def _start(self, checkpoint_dir: Path | None) -> None:
        cfg = self.config
        authkey = os.urandom(16)
        address = cfg.address
        listener = mpc.Listener(address, authkey=authkey)
        self.address = listener.address
        options = {
            "collective_timeout_s": cfg.collective_timeout_s,
            "threads": cfg.threads,
            "realloc": cfg.realloc,
        }
        accepted: list[mpc.Connection] = []
        errors: list[BaseException] = []

        def accept() -> None:
            try:
                for _ in range(self.world):
                    accepted.append(listener.accept())
            except BaseException as e:
                errors.append(e)

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        if cfg.launch == "spawn":
            from schedulers.runtime.dist.worker import spawned_main

            ctx = mp.get_context("spawn")
            init = f"tcp://127.0.0.1:{free_port()}"
            env_before = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", *cfg.env)}
            os.environ["OMP_NUM_THREADS"] = str(cfg.threads)
            os.environ.update(cfg.env)
            try:
                for rank in range(self.world):
                    p = ctx.Process(
                        target=spawned_main,
                        args=(rank, self.world, init, self.address, authkey, options),
                        daemon=True,
                        name=f"rlflow-worker-{rank}",
                    )
                    p.start()
                    self._procs.append(p)
            finally:
                for k, v in env_before.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        elif cfg.launch == "external":
            host, port = self.address
            print(
                f"rlflow: waiting for {self.world} workers: RLFLOW_CONTROLLER={host}:{port} "
                f"RLFLOW_AUTHKEY={authkey.hex()} torchrun ... -m schedulers.runtime.dist.worker",
                flush=True,
            )
        else:
            raise PlanError(f"unknown launch {cfg.launch!r}; use 'spawn' or 'external'")
        deadline = time.monotonic() + cfg.start_timeout_s
        try:
            while len(accepted) < self.world:
                if errors:
                    raise NodeError(f"distributed runtime: accepting workers failed: {errors[0]}")
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead:
                    code = self._procs[dead[0]].exitcode
                    raise NodeError(f"worker rank {dead[0]} exited during start-up (exit code {code})")
                if time.monotonic() > deadline:
                    raise NodeError(
                        f"distributed runtime: only {len(accepted)} of {self.world} workers connected "
                        f"within {cfg.start_timeout_s:.0f} s"
                    )
                time.sleep(0.05)
            for conn in accepted:
                if not conn.poll(max(0.0, deadline - time.monotonic())):
                    raise NodeError("distributed runtime: a worker connected but did not say hello")
                kind, rank = recv(conn)
                assert kind == "hello"
                self._conns[int(rank)] = conn
            for conn in self._conns.values():
                send(conn, ("setup", self.graph, checkpoint_dir, options))
            self._wait({(r, -1) for r in range(self.world)}, deadline, what="start-up (building models)")
        except BaseException:
            self.close(force=True)
            raise
        finally:
            listener.close()

    # -- waiting --------------------------------------------------------------------------------------
    def _fail(self, rank: int, what: str, message: str, tb: str = "") -> NodeError:
        self.close(force=True)
        detail = f"\n--- worker {rank} traceback ---\n{tb.rstrip()}" if tb else ""
        return NodeError(f"worker rank {rank} failed in {what}: {message}{detail}")

    def _wait(self, expected: set[tuple[int, int]], deadline: float, what: str) -> dict[tuple[int, int], Any]:
        """Collect replies ``(rank, cmd)`` (``cmd -1``: set-up ``ready``); NodeError on any failure."""
        while not expected <= self._inbox.keys():
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(r for r, c in expected - self._inbox.keys())
                raise self._fail(missing[0], what, f"no reply within the timeout (ranks {missing} pending)")
            self._pump(min(left, 1.0), what)
        return {key: self._inbox.pop(key) for key in expected}

    def _pump(self, timeout: float, what: str) -> None:
        """Read the messages that arrive within ``timeout`` seconds into the inbox; a dead worker raises."""
        conns = {c: r for r, c in self._conns.items()}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        ready = mpc.wait([*conns, *sentinels], timeout=timeout)
        for obj in sorted(ready, key=lambda o: o in sentinels):  # messages before deaths
            if obj in conns:
                rank = conns[obj]
                try:
                    msg = recv(obj)  # type: ignore[arg-type]
                except (EOFError, OSError):
                    raise self._fail(rank, what, "the worker died (its connection closed)") from None
                self._handle(msg)
            elif obj in sentinels:
                rank = sentinels[obj]
                conn = self._conns.get(rank)
                while conn is not None and conn.poll(0):  # drain what it sent before dying
                    try:
                        self._handle(recv(conn))
                    except (EOFError, OSError):
                        break
                code = self._procs[rank].exitcode
                raise self._fail(rank, what, f"the worker process died (exit code {code})")

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "ready":
            self._inbox[(int(msg[1]), -1)] = None
        elif kind == "done":
            _, cmd, rank, payload = msg
            self._inbox[(int(rank), int(cmd))] = payload
        elif kind == "error":
            _, _cmd, rank, what, message, tb = msg
            raise self._fail(int(rank), str(what), str(message), str(tb))

    def _send(self, ranks: Sequence[int], make: Any) -> int:
        if self._closed:
            raise NodeError("distributed runtime: the workers are stopped")
        self._cmd += 1
        for r in ranks:
            try:
                send(self._conns[r], make(r, self._cmd))
            except (EOFError, OSError, BrokenPipeError):
                raise self._fail(r, "sending a command", "the worker died (its connection closed)") from None
        return self._cmd

    # -- running --------------------------------------------------------------------------------------
    def submit(self, name: str, batch: Batch, iteration: int) -> Pending:
        """Send node ``name`` to its mesh (and, after a train node, the weight sync); does not wait."""
        node = self.graph.node(name)
        spec = self.view.meshes[name]
        mini = node.mini_batches if node.kind == "train" else 1
        shares = shard_rows(len(batch), spec.dp, mini) if spec.dp > 1 else [list(range(len(batch)))]
        parts = [batch.index(s) if spec.dp > 1 else batch for s in shares]

        def make(rank: int, cmd: int) -> tuple[Any, ...]:
            dp_rank, _ = spec.coords(rank)
            return ("run", cmd, name, iteration, parts[dp_rank])

        cmd = self._send(spec.devices, make)
        pending = Pending(name, iteration, cmd, spec.devices, tuple(spec.leaders()), shares)
        targets = self.view.sync_targets.get(name, ())
        if targets:
            src = self.view.node_instance[name]
            ranks = sorted(set(spec.devices).union(*(self.view.instances[t].mesh.devices for t in targets)))
            version = self._versions[node.model or ""] + node.epochs * node.mini_batches
            pending.sync_cmd = self._send(ranks, lambda r, c: ("sync", c, src, tuple(targets), version))
            pending.sync_ranks = tuple(ranks)
        return pending

    def collect(self, pending: Pending) -> NodeResult:
        """Wait for a submitted node (and its weight sync); its outputs in row order, metrics, tokens."""
        deadline = time.monotonic() + self.config.node_timeout_s
        what = f"node '{pending.name}' (iteration {pending.iteration})"
        got = self._wait({(r, pending.cmd) for r in pending.ranks}, deadline, what)
        payloads = [got[(r, pending.cmd)] for r in pending.leaders]
        sync_metrics: dict[str, float] = {}
        if pending.sync_cmd is not None:
            synced = self._wait(
                {(r, pending.sync_cmd) for r in pending.sync_ranks}, deadline, f"weight sync after {what}"
            )
            reports = {r: synced[(r, pending.sync_cmd)] for r in pending.sync_ranks}
            version = int(payloads[0]["version"]) if isinstance(payloads[0], dict) else 0
            sync_metrics = self._record_sync(pending.name, version, reports)
        self.worker_timings[pending.name] = {
            r: (float(got[(r, pending.cmd)]["start"]), float(got[(r, pending.cmd)]["end"]))
            for r in pending.ranks
            if isinstance(got[(r, pending.cmd)], dict)
        }
        self.timings[pending.name] = (
            min(p["start"] for p in payloads),
            max(p["end"] for p in payloads),
        )
        node = self.graph.node(pending.name)
        if node.model is not None and node.kind == "train":
            self._versions[node.model] = int(payloads[0]["version"])
        outputs = gather_rows([p["outputs"] for p in payloads], pending.shares)
        return NodeResult(
            outputs=dict(outputs.items()),
            metrics={**_combine_metrics([p["metrics"] for p in payloads]), **sync_metrics},
            tokens=sum(int(p["tokens"]) for p in payloads),
        )

    def _record_sync(self, name: str, version: int, reports: Mapping[int, Any]) -> dict[str, float]:
        """Record the weight sync after train node ``name`` from its workers' reports; its metrics.

        Checks the target checksums: the ranks of a target instance that hold the same shard (its dp
        replicas) must report the same checksum. Metrics: ``realloc/bytes`` (bytes moved over links,
        summed over receivers and targets), ``realloc/seconds`` (first start to last end over the workers),
        ``realloc/checksum_ok`` (1.0; a mismatch raises instead).

        Raises:
            NodeError: replicas of a target disagree (every worker is stopped first).
        """
        model = self.graph.node(name).model or name
        self.sync_timings[name] = {
            r: (float(p["sync_start"]), float(p["sync_end"]), int(p["bytes"])) for r, p in reports.items()
        }
        moved = 0
        for dst in self.view.sync_targets.get(name, ()):
            target = self.view.instances[dst]
            entries = {r: p["targets"][dst] for r, p in reports.items() if dst in p["targets"]}
            path = str(next(iter(entries.values()))["path"])
            dst_bytes = max(int(e.get("moved", 0)) for e in entries.values())  # known where it ran
            moved += dst_bytes
            self.realloc_counts[path] = self.realloc_counts.get(path, 0) + 1
            checksums = {r: e["checksum"] for r, e in entries.items() if r in target.mesh.devices}
            if not target.fsdp:  # replicas: same (pp rank, tp rank), same shard, same bytes
                by_shard: dict[tuple[int, int], set[str]] = {}
                for r, c in checksums.items():
                    by_shard.setdefault(target.mesh.shard_key(r), set()).add(str(c))
                bad = [t for t, cs in by_shard.items() if len(cs) > 1]
                if bad:
                    rank = min(r for r in checksums if target.mesh.shard_key(r) == bad[0])
                    raise self._fail(
                        rank,
                        f"weight sync after node '{name}'",
                        f"reallocation checksum mismatch: the dp replicas of (pp rank, tp rank) {bad[0]} of "
                        f"model '{model}' (instance {dst}) hold different weights: {sorted(by_shard[bad[0]])}",
                    )
            record = {
                "node": name,
                "model": target.model,
                "version": version,
                "instance": dst,
                "path": path,
                "bytes": dst_bytes,
                "checksums": dict(sorted(checksums.items())),
            }
            self.realloc_log.append(record)
            _log.info("reallocation %s", record)
        starts = [t[0] for t in self.sync_timings[name].values()]
        ends = [t[1] for t in self.sync_timings[name].values()]
        return {
            "realloc/bytes": float(moved),
            "realloc/seconds": float(max(ends) - min(starts)) if starts else 0.0,
            "realloc/checksum_ok": 1.0,
        }

    def run_node(self, name: str, batch: Batch, iteration: int) -> NodeResult:
        """Run node ``name`` on its mesh (the :class:`Executor` protocol).

        Raises:
            NodeError: a worker raised or died (names the worker rank, node and error); every worker is
                stopped first.
        """
        return self.collect(self.submit(name, batch, iteration))

    def wait_any(self, pendings: Sequence[Pending]) -> tuple[Pending, Finished]:
        """Block until one of ``pendings`` (and its weight sync) has finished; the earliest submitted wins
        a tie. Its result, and its span on the workers (first start to last end, sync included).

        Raises:
            NodeError: a worker raised or died, or a node passed ``node_timeout_s`` (all workers stopped).
        """
        while True:
            for p in pendings:
                if p.replies() <= self._inbox.keys():
                    result = self.collect(p)
                    start, end = self.timings[p.name]
                    sync = self.sync_timings.get(p.name, {}) if p.sync_cmd is not None else {}
                    end = max([end, *(t[1] for t in sync.values())])
                    return p, Finished(p.name, result, start, end)
            oldest = min(pendings, key=lambda p: p.submitted)
            left = oldest.submitted + self.config.node_timeout_s - time.monotonic()
            what = f"node '{oldest.name}' (iteration {oldest.iteration})"
            if left <= 0:
                missing = sorted(r for r, _ in oldest.replies() - self._inbox.keys())
                raise self._fail(missing[0], what, f"no reply within the timeout (ranks {missing} pending)")
            self._pump(min(left, 1.0), what)

    # -- models and state -----------------------------------------------------------------------------
    @property
    def models(self) -> Mapping[str, ModelState]:
        """Full CPU copies of the models (the mirror), refreshed from the workers when read."""
        return _FreshModels(self)

    @property
    def data_tokenizer(self) -> Any:
        """The tokenizer the data set is tokenized with."""
        return self.mirror.data_tokenizer

    def fetch(self, model: str, instance: int | None = None) -> dict[str, torch.Tensor]:
        """The current full parameters of ``model`` (from ``instance``, default its primary instance,
        gathered on that instance's mesh)."""
        inst = self.view.primary(model) if instance is None else instance
        ranks = self.view.instances[inst].mesh.devices
        cmd = self._send(ranks, lambda r, c: ("fetch", c, inst))
        got = self._wait(
            {(r, cmd) for r in ranks}, time.monotonic() + self.config.node_timeout_s, f"fetch of '{model}'"
        )
        out = got[(ranks[0], cmd)]
        assert isinstance(out, dict)
        return out

    def refresh(self, model: str) -> None:
        """Copy ``model``'s current weights into the mirror if they changed since the last refresh."""
        if self._mirror_versions.get(model) == self._versions.get(model):
            return
        full = self.fetch(model)
        module = self.mirror.models[model].module
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(full[name])
        self.mirror.models[model].version = self._versions[model]
        self._mirror_versions[model] = self._versions[model]

    def save_models(self, directory: Path) -> None:
        """Every model in Hugging Face format under ``directory/<name>`` (gathered from the workers)."""
        for name in self.mirror.models:
            self.refresh(name)
            s = self.mirror.models[name]
            save_pretrained(s.module, s.tokenizer, directory / name)

    def state_dict(self) -> dict[str, Any]:
        """Weight versions and every worker's optimizer/scheduler shards and node generators."""
        cmd = self._send(range(self.world), lambda r, c: ("state", c))
        got = self._wait(
            {(r, cmd) for r in range(self.world)}, time.monotonic() + self.config.node_timeout_s, "state"
        )
        return {
            "versions": dict(self._versions),
            "workers": {r: got[(r, cmd)] for r in range(self.world)},
            "plan": {n: (m.devices, m.dp, m.tp, m.pp) for n, m in self.view.meshes.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (same plan; the workers already hold the checkpoint's weights).

        Raises:
            PlanError: the checkpoint was written under another plan.
        """
        plan = {n: (m.devices, m.dp, m.tp, m.pp) for n, m in self.view.meshes.items()}
        if state.get("plan") != plan:
            raise PlanError("the checkpoint's executor state was written under another plan; resume with it")
        self._versions.update(state["versions"])
        self._mirror_versions = {m: -1 for m in self._versions}
        workers = state["workers"]
        cmd = self._send(range(self.world), lambda r, c: ("load_state", c, workers[r]))
        self._wait(
            {(r, cmd) for r in range(self.world)}, time.monotonic() + self.config.node_timeout_s, "load state"
        )

    # -- shutdown -------------------------------------------------------------------------------------
    def close(self, force: bool = False) -> None:
        """Stop the workers: ``stop`` and a short join (or at once with ``force``), then SIGTERM/SIGKILL."""
        if self._closed:
            return
        self._closed = True
        if not force:
            for conn in self._conns.values():
                with contextlib.suppress(EOFError, OSError):
                    send(conn, ("stop",))
            deadline = time.monotonic() + 5.0
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        stop_processes(self._procs, self.config.grace_s)
        for conn in self._conns.values():
            conn.close()

    def __enter__(self) -> DistExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close(force=True)
        except Exception:
            pass


def _combine_metrics(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The dp ranks' metrics: ``*/max`` max, ``*/min`` min, anything else the mean."""
    out: dict[str, float] = {}
    for key in parts[0]:
        values = [float(p[key]) for p in parts if key in p]
        if key.endswith("/max"):
            out[key] = max(values)
        elif key.endswith("/min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out
