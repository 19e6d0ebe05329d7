"""Discrete-event simulator: replays iterations of a plan and predicts a timeline.

Model of execution (what the runtime's controller does): tasks are issued in a fixed priority order —
iteration by iteration, nodes in the problem's execution order — and every device runs its tasks in that
order (a FIFO queue per device). A task starts when (a) all devices of its mesh are free and (b) its
dependencies are done:

  * data edges: the producer (same iteration) finished and the edge's bytes crossed to the consumer's
    mesh (``kind="data_transfer"`` events; transfers use links, not the devices' compute, so they do
    not occupy devices);
  * version edges: a node reading a trained model in iteration i > 0 waits for the train node of
    iteration i − 1; if its placement differs from the train node's, a ``kind="reallocation"`` task on
    the union of both meshes moves the weights first (after the reader's previous call released its
    copy); a train node also waits for the same-iteration readers of its model (they read the old
    version).

Nodes on disjoint meshes therefore overlap, nodes on overlapping meshes serialise. The steady-state
iteration time is the distance between the ends of the last two simulated iterations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dataflow.errors import PlanError
from schedulers.cost import CostModel
from schedulers.plan import NodePlacement

__all__ = ["Event", "Timeline", "draw_gantt", "simulate", "version_pairs"]


@dataclass(frozen=True)
class Event:
    """One predicted task: ``kind`` is ``node``, ``reallocation`` or ``data_transfer``; times in seconds."""

    iteration: int
    node: str
    devices: tuple[int, ...]
    start_s: float
    end_s: float
    kind: str
    bytes_moved: int = 0


@dataclass(frozen=True)
class Timeline:
    """Predicted events of ``iterations`` iterations; ``iteration_s`` is the steady-state period."""

    events: tuple[Event, ...]
    iteration_ends: tuple[float, ...]

    @property
    def makespan_s(self) -> float:
        return self.iteration_ends[-1] if self.iteration_ends else 0.0

    @property
    def iteration_s(self) -> float:
        ends = self.iteration_ends
        if len(ends) >= 2:
            return ends[-1] - ends[-2]
        return self.makespan_s

    def to_rows(self) -> list[dict[str, object]]:
        """One row per (event, device) with the run-directory trace columns (``predicted_s`` set)."""
        rows: list[dict[str, object]] = []
        for ev in self.events:
            for dev in ev.devices:
                rows.append(
                    {
                        "iteration": ev.iteration,
                        "node": ev.node,
                        "worker": dev,
                        "device": dev,
                        "start_s": ev.start_s,
                        "end_s": ev.end_s,
                        "tokens": 0,
                        "bytes_moved": ev.bytes_moved,
                        "predicted_s": ev.end_s - ev.start_s,
                        "kind": ev.kind,
                    }
                )
        return rows

    def write_parquet(self, path: str | Path) -> None:
        """Write ``predicted_trace.parquet`` (same columns as a run's trace)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(self.to_rows()), str(path))


def version_pairs(cost: CostModel) -> list[tuple[str, str]]:
    """(train node, reader node) pairs: the problem's version edges plus every other node of a trained
    model (so no reader sees a stale version)."""
    problem = cost.problem
    pairs = list(problem.version_edges)
    for model, names in problem.model_nodes.items():
        train = problem.train_node(model)
        if train is None:
            continue
        for other in names:
            if other != train and (train, other) not in pairs:
                pairs.append((train, other))
    return pairs


def simulate(cost: CostModel, plan: Mapping[str, NodePlacement], iterations: int = 2) -> Timeline:
    """Replay ``iterations`` iterations of ``plan`` (node -> placement) under ``cost``.

    Raises:
        PlanError: a node of the problem has no placement, or a layout does not fit (from the cost model).
    """
    problem = cost.problem
    for node in problem.nodes:
        if node.name not in plan:
            raise PlanError(f"plan has no placement for node {node.name!r}")
    pairs = version_pairs(cost)
    readers_of: dict[str, list[str]] = defaultdict(list)
    train_of: dict[str, str] = {}
    for trainer, reader in pairs:
        readers_of[trainer].append(reader)
        train_of[reader] = trainer
    edge_bytes: dict[tuple[str, str], int] = defaultdict(int)
    for src, dst, _key, nbytes in problem.data_edges:
        edge_bytes[(src, dst)] += nbytes
    inputs: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for (src, dst), nbytes in edge_bytes.items():
        inputs[dst].append((src, nbytes))
    placed = {n.name for n in problem.nodes}

    free: dict[int, float] = defaultdict(float)
    end: dict[tuple[int, str], float] = {}
    events: list[Event] = []
    ends: list[float] = []

    def occupy(devices: tuple[int, ...], ready: float, duration: float) -> tuple[float, float]:
        start = max([ready, *(free[d] for d in devices)])
        finish = start + duration
        for d in devices:
            free[d] = finish
        return start, finish

    for it in range(iterations):
        for node in problem.nodes:
            name = node.name
            here = plan[name]
            ready = 0.0
            for src, nbytes in inputs[name]:
                if src not in placed:
                    continue  # dataset or a device-less node: available at once
                done = end[(it, src)]
                move = cost.edge_time(nbytes, plan[src], here)
                if move > 0:
                    events.append(
                        Event(it, f"{src}->{name}", here.devices, done, done + move, "data_transfer", nbytes)
                    )
                ready = max(ready, done + move)
            for reader in readers_of.get(name, ()):
                if (it, reader) in end:  # the train node waits for readers of the old version
                    ready = max(ready, end[(it, reader)])
            train = train_of.get(name)
            if it > 0 and train is not None:
                ready = max(ready, end[(it - 1, train)])
                seconds = cost.realloc_time(problem.node(name).model, plan[train], here)
                if seconds > 0:
                    union = tuple(sorted(set(plan[train].devices) | set(here.devices)))
                    r_start, r_end = occupy(union, max(ready, end[(it - 1, name)]), seconds)
                    events.append(Event(it, f"{train}->{name}", union, r_start, r_end, "reallocation"))
                    ready = r_end
            if it > 0:
                ready = max(ready, end[(it - 1, name)])
            start, finish = occupy(here.devices, ready, cost.node_cost(node, here).time_s)
            end[(it, name)] = finish
            events.append(Event(it, name, here.devices, start, finish, "node"))
        ends.append(max(end[(it, n.name)] for n in problem.nodes))
    return Timeline(tuple(events), tuple(ends))


def draw_gantt(timeline: Timeline, path: str | Path, num_devices: int, title: str = "") -> None:
    """Draw the predicted timeline as a Gantt chart, one row per device, to a PNG file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({ev.node for ev in timeline.events if ev.kind == "node"})
    cmap = plt.get_cmap("tab10")
    color = {n: cmap(i % 10) for i, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.3 * num_devices))
    for ev in timeline.events:
        if ev.kind == "data_transfer":
            continue
        c = color.get(ev.node, (0.5, 0.5, 0.5, 1.0)) if ev.kind == "node" else (0.2, 0.2, 0.2, 1.0)
        hatch = "//" if ev.kind == "reallocation" or ev.iteration % 2 else None
        for dev in ev.devices:
            ax.barh(dev, ev.end_s - ev.start_s, left=ev.start_s, color=c, edgecolor="white", hatch=hatch)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[n]) for n in names]
    handles.append(plt.Rectangle((0, 0), 1, 1, color=(0.2, 0.2, 0.2, 1.0)))
    ax.legend(handles, [*names, "reallocation"], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlabel("predicted time (s); hatched = odd iterations")
    ax.set_ylabel("device")
    ax.invert_yaxis()
    ax.set_title(title or f"predicted timeline, iteration {timeline.iteration_s:.3g} s")
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
