"""Discrete-event simulator: replays iterations of a plan as the runtime runs them and predicts a timeline.

Model of execution (what the controller and its workers do):

  * Iterations run one after another: the controller starts iteration ``i + 1`` once every node of
    iteration ``i`` (weight syncs included) has finished, ``Overheads.iteration_s`` later (its own
    work per iteration).
  * Within an iteration a node is *submitted* as soon as its dependencies are done: data edges (the
    producer finished and the edge's bytes crossed to the consumer's mesh, ``kind="data_transfer"``
    events; transfers use links, not the devices' compute) and, for a train node, the same-iteration
    readers of its model (they read the old version). Ties are submitted in the problem's order.
  * Every device runs what was submitted to it in submission order (a FIFO per worker); a task starts
    when it is first in line on all of its devices. Nodes on disjoint meshes therefore overlap, nodes
    on overlapping meshes serialise. ``overlap=False`` replays the serial controller instead: one node
    (and its weight sync) at a time, in execution order.
  * A node's task lasts its dispatch (controller round trip) plus its span on its devices
    (``CostModel.node_cost``). A train node's weight sync (``TransferCost.sync_time``) is submitted with it
    as a ``kind="reallocation"`` task on the union of its mesh and the meshes of the model's other
    instances, named after the model as in the runtime's trace.
  * CPU oversubscription (``cores_per_host``): tasks that run at the same time on one host share its
    cores (processor sharing). A task alone on its devices runs at the speed its own cost already
    assumes; with others it runs ``slowdown(own busy workers) / slowdown(all busy workers on the host)``
    as fast (``ClusterSpec.slowdown``; on several hosts, the most loaded one).

The iteration time is the distance between the ends of the last two simulated iterations (the makespan
of one iteration, every iteration being alike).

Asynchronous RL (a generate node with ``staleness`` η >= 1): the iteration barrier goes, and the replay
follows the runtime's version schedule (:mod:`rlflow.schedulers.runtime.version_schedule`). Generation of
iteration ``k`` waits for the train node (and weight sync) of iteration ``k - 1 - η``; every other reader of a
trained model for that of ``k - 1``; a train node for the whole of iteration ``k - 1``; and the generation of
iteration ``k + η`` is submitted before the weight sync of iteration ``k``, which is sent on its own once that
train step has finished (so on the generation devices it queues behind the generation pipeline's nodes
already submitted, as on the workers). In the steady state an iteration then takes
the slower of the generation pipeline and the training pipeline, plus the weight sync, instead of their
sum. Enough iterations are replayed (at least ``3 η + 3``) to reach that steady state, and the period is
measured before the last ``η``: the weight sync of iteration ``k`` waits behind the generation of iteration
``k + η``, which the replay's last ``η`` iterations lack (measured there, a generation-bound plan would be
credited the training pipeline's period). Interruptible generation (``PlanNode.segments`` > 1) is
replayed as its segments, each a command (its own round trip) lasting its own call's seconds
(``NodeCost.segment_s``, ``segment_cost.py``), segment ``j`` of iteration ``k`` waiting for the weights of
iteration ``min(k - 1, k - 1 - η + j)`` (so the segments reading ``k - 1`` wait for that training). Only
where the
runtime can overlap: a generate node placed on devices it shares with a train node it reads from runs one
after the other with it (a worker runs one command at a time; ``validate`` warns), so its replay takes
η = 0 (:func:`overlapping_stale`) and a plan where every such node shares devices replays the
synchronous loop. A filter's round side (``PlanProblem.round_side``, each node priced ``PlanNode.rounds``
times) is replayed as the runtime's generation stage: all of it submitted with the generation of its
iteration, after the stage of the iteration before, and the weight sync of iteration ``k`` waits for the
end of the stage of ``k + η`` (rounds of one iteration read one version).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.plans import NodePlacement

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "Event",
    "Timeline",
    "async_depth",
    "draw_gantt",
    "gantt_figure",
    "node_spans",
    "overlapping_stale",
    "simulate",
    "staleness_depth",
    "version_pairs",
]


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
    """Predicted events of ``iterations`` iterations; ``iteration_s`` is the steady-state period.

    ``drain``: the trailing iterations whose ends the end of the replay moves (under the asynchronous
    schedule the last ``η`` iterations have no later generation to wait behind), left out of
    ``iteration_s``."""

    events: tuple[Event, ...]
    iteration_ends: tuple[float, ...]
    drain: int = 0

    @property
    def makespan_s(self) -> float:
        return self.iteration_ends[-1] if self.iteration_ends else 0.0

    @property
    def iteration_s(self) -> float:
        ends = self.iteration_ends[: len(self.iteration_ends) - self.drain]
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


@dataclass
class _Task:
    """One task of the replay: a node or a weight sync; ``deps`` are (task index, delay after its end)."""

    iteration: int
    name: str
    kind: str
    devices: tuple[int, ...]
    duration: float
    deps: list[tuple[int, float]]
    lead: float = 0.0  # seconds of the controller's dispatch at the start (not the workers' span)


def _tasks(
    cost: CostModel, plan: Mapping[str, NodePlacement], iterations: int, overlap: bool
) -> tuple[list[_Task], list[tuple[int, int, str, int, float]]]:
    """Tasks in submission priority order, and the data edges (consumer task, producer task, name,
    bytes, transfer seconds) that cross meshes."""
    problem = cost.problem
    readers_of: dict[str, list[str]] = defaultdict(list)
    for trainer, reader in version_pairs(cost):
        readers_of[trainer].append(reader)
    edge_bytes: dict[tuple[str, str], int] = defaultdict(int)
    for src, dst, _key, nbytes in problem.data_edges:
        edge_bytes[(src, dst)] += nbytes
    inputs: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for (src, dst), nbytes in edge_bytes.items():
        inputs[dst].append((src, nbytes))
    tasks: list[_Task] = []
    moves: list[tuple[int, int, str, int, float]] = []
    previous: list[int] = []
    barrier = cost.cluster.overheads.iteration_s
    for it in range(iterations):
        first = len(tasks)
        index: dict[str, int] = {}
        for node in problem.nodes:
            name, here = node.name, plan[node.name]
            deps = [(j, barrier) for j in previous]  # the controller's iteration barrier
            if not overlap and len(tasks) > first:
                deps.append((len(tasks) - 1, 0.0))
            for src, nbytes in inputs[name]:
                if src in index:  # the dataset (and device-less nodes) are available at once
                    move = cost.transfers.edge_time(nbytes, plan[src], here)
                    deps.append((index[src], move))
                    if move > 0:
                        moves.append((len(tasks), index[src], f"{src}->{name}", nbytes, move))
            deps += [(index[r], 0.0) for r in readers_of.get(name, ()) if r in index]
            nc = cost.node_cost(node, here)
            index[name] = len(tasks)
            calls = max(1, len(nc.segment_s))  # interruptible generation: a round trip per segment
            seconds = nc.dispatch_s + nc.time_s + (calls - 1) * cost.cluster.overheads.dispatch_s
            tasks.append(_Task(it, name, "node", here.devices, seconds, deps, nc.dispatch_s))
            if node.kind == "train":
                seconds = cost.transfers.sync_time(name, plan)
                if seconds > 0:  # submitted with the train node, so it runs right after it
                    targets = cost.transfers.sync_targets(name, plan)
                    union = tuple(sorted(set(here.devices).union(*(p.devices for p, _ in targets))))
                    tasks.append(_Task(it, node.model, "reallocation", union, seconds, list(deps)))
        previous = list(range(first, len(tasks)))
    return tasks, moves


def _async_tasks(
    cost: CostModel, plan: Mapping[str, NodePlacement], iterations: int, shared: set[str]
) -> tuple[list[_Task], list[tuple[int, int, str, int, float]]]:
    """:func:`_tasks` under the asynchronous version schedule (module docstring): tasks in the runtime's
    submission priority (generation of iteration ``k + η`` before the rest of iteration ``k``). The
    generate nodes in ``shared`` (on their train node's devices: :func:`overlapping_stale`) are replayed
    with η = 0."""
    problem = cost.problem
    readers_of: dict[str, list[str]] = defaultdict(list)
    trainers_of: dict[str, list[str]] = defaultdict(list)
    for trainer, reader in version_pairs(cost):
        readers_of[trainer].append(reader)
        trainers_of[reader].append(trainer)
    edge_bytes: dict[tuple[str, str], int] = defaultdict(int)
    for src, dst, _key, nbytes in problem.data_edges:
        edge_bytes[(src, dst)] += nbytes
    inputs: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for (src, dst), nbytes in edge_bytes.items():
        inputs[dst].append((src, nbytes))
    rank = {node.name: i for i, node in enumerate(problem.nodes)}
    eta = {
        node.name: node.staleness if node.kind == "generate" and node.name not in shared else 0
        for node in problem.nodes
    }
    # a filter's round side: one stage, ahead by its generate nodes' η; the train nodes whose sync waits
    stage = [node.name for node in problem.nodes if node.name in problem.round_side]
    lag = max((eta[n] for n in stage), default=0)
    ahead = {n: lag if n in stage else eta[n] for n in rank}
    held = {t for g in stage if eta[g] for t in trainers_of.get(g, ())}
    order = sorted(
        ((it, node) for it in range(iterations) for node in problem.nodes),
        key=lambda p: (p[0] - ahead[p[1].name], 0 if p[1].kind == "generate" else 1, rank[p[1].name]),
    )
    barrier = cost.cluster.overheads.iteration_s
    tasks: list[_Task] = []
    moves: list[tuple[int, int, str, int, float]] = []
    index: dict[tuple[int, str], int] = {}
    syncs: dict[tuple[int, str], int] = {}
    of_iteration: dict[int, list[int]] = defaultdict(list)
    later: list[tuple[int, int, str]] = []  # (task, iteration, train node): the weights the task reads
    for it, node in order:
        name, here = node.name, plan[node.name]
        deps: list[tuple[int, float]] = []
        for src, nbytes in inputs[name]:
            if (it, src) in index:  # the dataset (and device-less nodes) are available at once
                move = cost.transfers.edge_time(nbytes, plan[src], here)
                deps.append((index[(it, src)], move))
                if move > 0:
                    moves.append((len(tasks), index[(it, src)], f"{src}->{name}", nbytes, move))
        nc = cost.node_cost(node, here)
        # interruptible generation: one call per segment, segment j reading one version more (up to k - 1)
        segments = node.segments if eta[name] else 1
        first = it - 1 - eta[name]  # the iteration whose trained weights this call (segment 0) reads
        for j in range(segments):
            seg_deps = list(deps)
            # -1: the initial weights, which the first segments of the first iterations read
            reads = min(it - 1, max(-1, first) + j) if segments > 1 else first
            if reads >= 0:  # resolved below: a later segment may read a train step not replayed yet
                later.extend((len(tasks), reads, t) for t in trainers_of.get(name, ()))
            if node.kind == "train":
                seg_deps += [(index[(it, r)], 0.0) for r in readers_of.get(name, ()) if (it, r) in index]
                seg_deps += [(i, barrier) for i in of_iteration.get(it - 1, ())]
            if name in stage:  # after the stage of the iteration before (its rounds drew their prompts first)
                seg_deps += [(index[(it - 1, n)], 0.0) for n in stage if (it - 1, n) in index]
            # segment j is sent once its weights exist, after segment j - 1 was (same devices: FIFO)
            i = len(tasks)
            index[(it, name)] = i
            of_iteration[it].append(i)
            # each segment a command of its own: its round trip and its own call (``segment_cost.py``),
            # the batch's bytes with the last; replayed as one task (no overlap credited), every round trip
            calls, fixed = max(1, len(nc.segment_s)), cost.cluster.overheads.dispatch_s
            if len(nc.segment_s) == segments:
                trip = nc.dispatch_s if j == segments - 1 else min(fixed, nc.dispatch_s)
                seconds = trip + nc.segment_s[j]
            else:
                trip = nc.dispatch_s
                seconds = (nc.dispatch_s + nc.time_s + (calls - 1) * fixed) / segments
            tasks.append(_Task(it, name, "node", here.devices, seconds, seg_deps, trip))
        if node.kind == "train":
            seconds = cost.transfers.sync_time(name, plan)
            if seconds > 0:  # sent on its own once the train step is done (the runtime's split sync)
                targets = cost.transfers.sync_targets(name, plan)
                union = tuple(sorted(set(here.devices).union(*(p.devices for p, _ in targets))))
                syncs[(it, name)] = len(tasks)
                of_iteration[it].append(len(tasks))
                # the stage reading the weights it overwrites ends first
                ends = [(index[(it + lag, n)], 0.0) for n in stage if name in held and (it + lag, n) in index]
                tasks.append(_Task(it, node.model, "reallocation", union, seconds, [(i, 0.0), *ends]))
    for i, reads, t in later:  # the train step (and its weight sync) of the weights read
        tasks[i].deps.append((index[(reads, t)], 0.0))
        if (reads, t) in syncs:
            tasks[i].deps.append((syncs[(reads, t)], 0.0))
    return tasks, moves


def _cells(tasks: list[_Task]) -> list[list[int]]:
    """Per task, the cells its devices fall in: the atoms of the Venn diagram of the tasks' meshes.

    Every task holds all of a cell's devices or none, so the devices of a cell see the same tasks in the
    same order: one FIFO per cell replays exactly what one FIFO per device does, in O(cells) instead of
    O(devices) per step (1,024 devices take a few dozen cells)."""
    meshes = {devices: set(devices) for devices in dict.fromkeys(t.devices for t in tasks)}
    union = set().union(*meshes.values())
    atoms = [union] if union else []
    for group in meshes.values():
        atoms = [part for atom in atoms for part in (atom & group, atom - group) if part]
    first = [min(atom) for atom in atoms]  # one device names its cell
    of_mesh = {devices: [a for a, d in enumerate(first) if d in group] for devices, group in meshes.items()}
    return [of_mesh[t.devices] for t in tasks]


def _replay(tasks: list[_Task], cost: CostModel) -> tuple[list[float], list[float]]:
    """Start and end seconds of every task: FIFO per device in submission order (per cell of devices that
    share their tasks, :func:`_cells`), processor sharing of each host's cores among the tasks running on
    it."""
    cluster = cost.cluster
    n = len(tasks)
    cells = _cells(tasks)
    waiting = [len(t.deps) for t in tasks]
    dependents: list[list[tuple[int, float]]] = [[] for _ in tasks]
    for i, task in enumerate(tasks):
        for j, delay in task.deps:
            dependents[j].append((i, delay))
    submit = [0.0] * n
    start = [math.nan] * n
    end = [math.nan] * n
    pending = {i for i in range(n) if waiting[i] == 0}  # dependencies done, not yet submitted
    queues: dict[int, list[tuple[float, int]]] = defaultdict(list)  # cell -> submitted, unfinished
    running: dict[int, list[float]] = {}  # task -> [time of last rate change, work left, rate]
    own = [cluster.mesh_slowdown(t.devices) for t in tasks]
    shared = cluster.cores_per_host is not None
    now = 0.0
    done = 0
    while done < n:
        for i in sorted(i for i in pending if submit[i] <= now):
            pending.discard(i)
            for d in cells[i]:
                queues[d].append((submit[i], i))
        for i in sorted({min(q)[1] for q in queues.values() if q}):
            if i not in running and all(min(queues[d])[1] == i for d in cells[i]):
                start[i] = now
                running[i] = [now, tasks[i].duration, 1.0]
        if shared and running:
            load: dict[int, int] = defaultdict(int)
            for i in running:
                for host, busy in cluster.busy_per_host(tasks[i].devices).items():
                    load[host] += busy
            for i, state in running.items():
                hosts = cluster.busy_per_host(tasks[i].devices)
                rate = min(1.0, own[i] / max(cluster.slowdown(load[h]) for h in hosts))
                if rate != state[2]:
                    state[1] -= (now - state[0]) * state[2]
                    state[0], state[2] = now, rate
        finish = {i: s[0] + s[1] / s[2] for i, s in running.items()}
        upcoming = [submit[i] for i in pending if submit[i] > now]
        if not finish and not upcoming:
            raise AssertionError("simulator: tasks wait on each other")  # FIFO order cannot deadlock
        now = min([*finish.values(), *upcoming])
        for i in [i for i, t in finish.items() if t <= now]:
            end[i] = finish[i]
            del running[i]
            done += 1
            for d in cells[i]:
                queues[d].remove((submit[i], i))
            for k, delay in dependents[i]:
                waiting[k] -= 1
                submit[k] = max(submit[k], end[i] + delay)
                if waiting[k] == 0:
                    pending.add(k)
    return start, end


def staleness_depth(cost: CostModel) -> int:
    """The largest ``staleness`` of the problem's generate nodes (0: a synchronous graph)."""
    return max((n.staleness for n in cost.problem.nodes if n.kind == "generate"), default=0)


def overlapping_stale(cost: CostModel, plan: Mapping[str, NodePlacement]) -> dict[str, str]:
    """Generate nodes with ``staleness`` >= 1 whose devices in ``plan`` meet those of a train node they read
    from -> that train node. Such a pair cannot overlap in the runtime (each worker runs its commands one
    at a time; validation warns the same), so the replay gives them no asynchronous credit."""
    trainers_of: dict[str, list[str]] = defaultdict(list)
    for trainer, reader in version_pairs(cost):
        trainers_of[reader].append(trainer)
    out: dict[str, str] = {}
    for node in cost.problem.nodes:
        if node.kind != "generate" or not node.staleness:
            continue
        devices = set(plan[node.name].devices)
        for t in trainers_of.get(node.name, ()):
            if devices & set(plan[t].devices):
                out[node.name] = t
                break
    return out


def async_depth(cost: CostModel, plan: Mapping[str, NodePlacement]) -> int:
    """The largest ``staleness`` the replay of ``plan`` credits: that of the generate nodes placed on
    devices disjoint from their train nodes' (0: ``plan`` runs as the synchronous loop does)."""
    shared = overlapping_stale(cost, plan)
    return max(
        (n.staleness for n in cost.problem.nodes if n.kind == "generate" and n.name not in shared), default=0
    )


def simulate(
    cost: CostModel,
    plan: Mapping[str, NodePlacement],
    iterations: int = 2,
    *,
    overlap: bool = True,
    synchronous: bool = False,
) -> Timeline:
    """Replay ``iterations`` iterations of ``plan`` (node -> placement) under ``cost``.

    Args:
        overlap: nodes on disjoint meshes run at the same time, as the controller runs them; ``False``
            replays one node at a time (the serial sum of the tasks, without sharing).
        synchronous: replay the synchronous loop even when a generate node has ``staleness`` >= 1 (the
            comparison ``rlflow plan`` prints); otherwise such a graph replays the asynchronous version
            schedule, over at least ``3 η + 3`` iterations, for the generate nodes ``plan`` puts on
            devices disjoint from their train nodes' (:func:`async_depth`; module docstring).

    Raises:
        PlanError: a node of the problem has no placement, or a layout does not fit (from the cost model).
    """
    for node in cost.problem.nodes:
        if node.name not in plan:
            raise PlanError(f"plan has no placement for node {node.name!r}")
    depth = 0 if synchronous or not overlap else async_depth(cost, plan)
    if depth:
        iterations = max(iterations, 3 * depth + 3)
        tasks, moves = _async_tasks(cost, plan, iterations, set(overlapping_stale(cost, plan)))
    else:
        tasks, moves = _tasks(cost, plan, iterations, overlap)
    start, end = _replay(tasks, cost)
    events = []
    for i, t in enumerate(tasks):  # a node's event is its span on the workers, after the dispatch
        stretch = (end[i] - start[i]) / t.duration if t.duration > 0 else 1.0
        events.append(Event(t.iteration, t.name, t.devices, start[i] + t.lead * stretch, end[i], t.kind))
    for consumer, producer, name, nbytes, move in moves:
        t = tasks[consumer]
        done = end[producer]
        events.append(Event(t.iteration, name, t.devices, done, done + move, "data_transfer", nbytes))
    ends = [max(end[i] for i, t in enumerate(tasks) if t.iteration == it) for it in range(iterations)]
    return Timeline(tuple(events), tuple(ends), drain=depth)


def node_spans(cost: CostModel, timeline: Timeline, iteration: int = -1) -> dict[str, float]:
    """Node -> its predicted span on its workers in ``iteration`` (default the last simulated): from its
    start to its end, or to the end of the weight sync after a train node — what the runtime records as
    ``timing_s/<node>`` (sharing of the cores with overlapping nodes included)."""
    its = sorted({ev.iteration for ev in timeline.events})
    it = its[iteration] if iteration < 0 else iteration
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    for ev in timeline.events:
        if ev.iteration == it and ev.kind == "node":
            start[ev.node], end[ev.node] = ev.start_s, ev.end_s
    for ev in timeline.events:
        train = cost.problem.train_node(ev.node) if ev.kind == "reallocation" else None
        if ev.iteration == it and train in end:
            end[train] = max(end[train], ev.end_s)
    return {name: end[name] - start[name] for name in start}


def gantt_figure(timeline: Timeline, num_devices: int, title: str = "") -> Figure:
    """The predicted timeline as a Gantt chart: one row per device (integer ticks, one per device), a bar
    per node execution in the node's colour (:func:`rlflow.schedulers.records.colours.node_colours`, the
    dashboard's), reallocations dark grey, odd iterations hatched."""
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from rlflow.schedulers.records.colours import SPECIAL_COLOURS, node_colours

    names = sorted({ev.node for ev in timeline.events if ev.kind == "node"})
    color = node_colours(names)
    realloc = SPECIAL_COLOURS["reallocation"]
    fig = Figure(figsize=(12, 1.0 + 0.3 * num_devices))
    ax = fig.add_subplot()
    # the bars of an event (one per device, 0.8 high as barh's) as one collection: a patch per bar took
    # 20 s to draw on 1,024 devices
    for ev in timeline.events:
        if ev.kind == "data_transfer":
            continue
        c = color[ev.node] if ev.kind == "node" else realloc
        hatch = "//" if ev.kind == "reallocation" or ev.iteration % 2 else None
        x0, x1 = ev.start_s, ev.end_s
        bars = [((x0, d - 0.4), (x1, d - 0.4), (x1, d + 0.4), (x0, d + 0.4)) for d in ev.devices]
        ax.add_collection(PolyCollection(bars, facecolors=c, edgecolors="white", hatch=hatch))
    ends = [ev.end_s for ev in timeline.events if ev.kind != "data_transfer"]
    ax.set_xlim(0.0, 1.05 * max(ends, default=1.0) or 1.0)
    handles = [Patch(color=color[n], label=n) for n in names] + [Patch(color=realloc, label="reallocation")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set_xlabel("predicted time (s); hatched = odd iterations")
    ax.set_ylabel("device")
    # One tick per device index, never fractions (matplotlib's default locator puts 3.6 ... 4.4 on one row).
    ax.set_yticks(range(num_devices))
    ax.set_ylim(num_devices - 0.5, -0.5)  # device 0 on top
    ax.set_title(title or f"predicted timeline, iteration {timeline.iteration_s:.3g} s")
    fig.tight_layout()
    return fig


def draw_gantt(timeline: Timeline, path: str | Path, num_devices: int, title: str = "") -> None:
    """Draw :func:`gantt_figure` to a PNG file."""
    gantt_figure(timeline, num_devices, title).savefig(str(path), dpi=100)
