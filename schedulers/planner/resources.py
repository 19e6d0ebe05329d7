"""Memory per device of a plan, by consumer, and the pre-launch check of it against this machine.

One memory model for the search and the launch: :func:`device_consumers` prices every node with the cost model
(``cost.CostModel.node_cost``: weights, gradients and Adam state of train nodes, activations, generation's KV
cache; formulas and sources in ``memory_cost.py`` and the modules ``cost.py`` names) and adds them up per
device the way the runtime holds them: one copy of a model per *instance* (nodes of a model with the same
devices, dp, tp, pp and sharding share one, as ``runtime.distributed.placement`` builds them), so a frozen
reference is a copy of its own next to the actor's trained copy, plus the largest transient working set among
the nodes on the device (a worker runs one node at a time), plus, for every ``engine: vllm`` node, its engine
on each of its devices (one per data-parallel rank): the engine's memory share (its own copy of the weights,
its workspace and KV pool: the plan's or the node's ``gpu_memory_utilization``), or without one the KV cache
it allocates for the run (``rlflow.nodes.engines.sizing.engine_kv_cache_bytes``, the bytes the engine passes
to vLLM). An ``engine: vllm`` node's own instance of a trained model is transient
(``MemoryBreakdown.replica``: the runtime frees it once the engines hold the weights) unless another node
shares the instance, whose state then holds it. ``Searcher.memory`` sums it; :func:`check_plan_memory`
refuses a plan that does not fit before any process starts (``rlflow validate`` and ``rlflow run``).

Capacity (:func:`local_memory`): on CPU every device is a worker process on this host, so the devices'
sum is compared with the host's available memory (``MemAvailable`` of ``/proc/meminfo``); on CUDA each
device with its GPU's total memory.
"""

from __future__ import annotations

import itertools
import os
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.graph import GraphWarning
from rlflow.dataflow.plan_spec import Layout
from rlflow.schedulers.planner.cluster_files import local_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.host_limits import WORKER_BASE_BYTES
from rlflow.schedulers.planner.memory_cost import MemoryBreakdown
from rlflow.schedulers.planner.plans import NodePlacement, format_devices
from rlflow.schedulers.planner.vllm_cost import engine_start_problem

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "ENGINE_KV_CACHE",
    "ENGINE_WEIGHTS",
    "REPLICA",
    "Consumer",
    "MachineMemory",
    "check_plan_memory",
    "device_consumers",
    "device_totals",
    "engine_device_memory",
    "engine_memory",
    "host_offload",
    "local_memory",
    "node_memory",
]

GIB = 2**30


ENGINE_WEIGHTS = "vLLM engine weights"
ENGINE_KV_CACHE = "vLLM engine KV cache"
REPLICA = "weights until the engine loads them"


@dataclass(frozen=True)
class Consumer:
    """``nbytes`` of one kind (``what``: weights, gradients, optimizer state, activations, KV cache, or
    :data:`ENGINE_WEIGHTS` / :data:`ENGINE_KV_CACHE` followed by `` (<node>)``) that model ``model`` holds
    on one device; ``node`` is the node whose placement sets it."""

    model: str
    what: str
    nbytes: float
    node: str

    def __str__(self) -> str:
        return f"{self.model} {self.what} {self.nbytes / GIB:.2f} GiB"


def node_memory(cost: CostModel, plan: Mapping[str, NodePlacement]) -> dict[str, MemoryBreakdown]:
    """Node -> its memory under ``plan`` (``CostModel.node_cost``), where an ``engine: vllm`` node whose
    model instance another node reads too (a built-in generate or inference node, or a train node without
    dp sharding or DeepSpeed, on the same devices and degrees: ``runtime.distributed.placement``'s
    instance) holds its replica resident, as the runtime keeps that instance (``weights``, not
    ``replica``), and a node of a base view (``ModelShape.base_of``: a LoRA model's base with the adapters
    off) placed on the devices and degrees (dp, tp, pp) of a node of its LoRA model (any but a DeepSpeed
    train node, whose module DeepSpeed owns: ``runtime.distributed.placement.PlanView.shares``) holds no
    weights: it runs that instance's module (an ``engine: vllm`` node's instance then stays resident). On
    another mesh it holds a full frozen copy (its own ``weights``).

    Raises:
        PlanError: a layout does not fit its node (``CostModel.node_cost``).
    """
    memory = {node.name: cost.node_cost(node, plan[node.name]).memory for node in cost.problem.nodes}

    def instance(name: str) -> tuple[object, ...] | None:
        node, lay = cost.problem.node(name), plan[name].layout
        if node.model is None or (node.kind == "train" and (lay.dp > 1 or node.zero is not None)):
            return None  # no model, or an instance of its own (FSDP2 or DeepSpeed)
        return (node.model, plan[name].devices, lay.dp, lay.tp, lay.pp)

    readers = defaultdict(set)  # instance -> nodes that read it without a vLLM engine
    for node in cost.problem.nodes:
        key = instance(node.name)
        if key is not None and memory[node.name].engine_weights == 0:
            readers[key].add(node.name)
    for name, mem in memory.items():
        key = instance(name)
        if mem.replica > 0 and key is not None and readers[key]:
            # the whole instance (its shard: the engine's), not the streamed sync's largest unit
            memory[name] = replace(mem, weights=mem.weights + mem.engine_weights, replica=0.0)
    for node in cost.problem.nodes:
        owner = cost.problem.models[node.model].base_of
        if not owner:
            continue
        here = plan[node.name]
        where = (here.devices, here.layout.dp, here.layout.tp, here.layout.pp)
        for other in cost.problem.model_nodes.get(owner, ()):
            there, mem = plan[other], memory[other]
            if cost.problem.node(other).zero is None and where == (
                there.devices,
                there.layout.dp,
                there.layout.tp,
                there.layout.pp,
            ):
                memory[node.name] = replace(memory[node.name], weights=0.0)
                if mem.replica > 0:  # a vLLM node's instance the view runs: kept, not freed after a sync
                    memory[other] = replace(mem, weights=mem.weights + mem.engine_weights, replica=0.0)
                break
    return memory


def device_consumers(cost: CostModel, plan: Mapping[str, NodePlacement]) -> dict[int, list[Consumer]]:
    """Device -> its consumers (bytes) under ``plan`` (node -> placement; every node of ``cost.problem``).

    Per model instance (model, devices, dp, tp, pp, FSDP-sharded: a train node with dp > 1) the state of
    its largest node (weights; a train node adds gradients and optimizer state); per device the transient
    memory (activations + KV cache + an ``engine: vllm`` node's released replica, :func:`node_memory`, +
    a ``reshard: false`` train step's gathered weights and gradients) of the node with the largest; per
    ``engine: vllm`` node, on each of its devices, its engine's weights and KV cache. Consumers of zero
    bytes are left out.

    Raises:
        PlanError: a layout does not fit its node (``CostModel.node_cost``).
    """
    state: dict[tuple[str, tuple[int, ...], int, int, int, bool], tuple[float, str]] = {}
    memory = node_memory(cost, plan)
    transient: dict[int, tuple[float, str]] = {}
    for node in cost.problem.nodes:
        placement = plan[node.name]
        mem = memory[node.name]
        lay = placement.layout
        key = (node.model, placement.devices, lay.dp, lay.tp, lay.pp, node.kind == "train" and lay.dp > 1)
        if mem.state > state.get(key, (-1.0, ""))[0]:
            state[key] = (mem.state, node.name)
        for d in placement.devices:
            if mem.transient > transient.get(d, (-1.0, ""))[0]:
                transient[d] = (mem.transient, node.name)
    out: dict[int, list[Consumer]] = defaultdict(list)
    for node in cost.problem.nodes:  # an engine per data-parallel rank, for the run's life unless it sleeps
        mem = memory[node.name]
        if mem.engine_sleeps:
            continue
        engine = ((ENGINE_WEIGHTS, mem.engine_weights), (ENGINE_KV_CACHE, mem.engine_kv_cache))
        for d in plan[node.name].devices:
            out[d] += [
                Consumer(node.model, f"{what} ({node.name})", b, node.name) for what, b in engine if b > 0
            ]
    for (model, devices, *_), (_, name) in state.items():
        mem = memory[name]
        kept = (("weights", mem.weights), ("gradients", mem.grads), ("optimizer state", mem.optimizer))
        for d in devices:
            out[d] += [Consumer(model, what, b, name) for what, b in kept if b > 0]
    for d, (_, name) in transient.items():
        mem, model = memory[name], cost.problem.node(name).model
        working = (
            ("activations", mem.activations),
            ("KV cache", mem.kv_cache),
            (REPLICA, mem.replica),
            ("gathered weights and gradients", mem.gathered),
            *(
                (
                    (f"{ENGINE_WEIGHTS}, awake", mem.engine_weights),
                    (f"{ENGINE_KV_CACHE}, awake", mem.engine_kv_cache),
                )
                if mem.engine_sleeps
                else ()
            ),
        )
        out[d] += [Consumer(model, f"{what} ({name})", b, name) for what, b in working if b > 0]
    return dict(out)


def device_totals(cost: CostModel, plan: Mapping[str, NodePlacement]) -> dict[int, float]:
    """Device -> bytes under ``plan``: the sum of :func:`device_consumers`' consumers of each device, the
    same floats added in the same order, in the same device order, without building the consumers.

    Devices that lie in the same meshes of ``plan`` hold the same consumers, so each class of them (an
    atom of the meshes' Venn diagram) is summed once: O(nodes² + devices) set work instead of a Python
    loop over every device and consumer (what made the search slow on 1,024 devices).

    Raises:
        PlanError: a layout does not fit its node (``CostModel.node_cost``).
    """
    nodes = cost.problem.nodes
    memory = node_memory(cost, plan)
    state: dict[tuple[str, tuple[int, ...], int, int, int, bool], tuple[float, str]] = {}
    for node in nodes:  # as device_consumers: per model instance the state of its largest node
        placement, mem = plan[node.name], memory[node.name]
        lay = placement.layout
        key = (node.model, placement.devices, lay.dp, lay.tp, lay.pp, node.kind == "train" and lay.dp > 1)
        if mem.state > state.get(key, (-1.0, ""))[0]:
            state[key] = (mem.state, node.name)
    members = {devices: set(devices) for devices in dict.fromkeys(plan[n.name].devices for n in nodes)}
    union = set().union(*members.values())
    atoms = [union] if union else []
    for group in members.values():
        atoms = [part for atom in atoms for part in (atom & group, atom - group) if part]
    total: dict[int, float] = {}
    for atom in atoms:
        d = next(iter(atom))
        values: list[float] = []
        for (
            node
        ) in nodes:  # engines, then instance state, then the largest transient: device_consumers' order
            mem = memory[node.name]
            if d in members[plan[node.name].devices] and not mem.engine_sleeps:
                values += [b for b in (mem.engine_weights, mem.engine_kv_cache) if b > 0]
        for (_model, devices, *_), (_, name) in state.items():
            mem = memory[name]
            if d in members[devices]:
                values += [b for b in (mem.weights, mem.grads, mem.optimizer) if b > 0]
        working: tuple[float, str] = (-1.0, "")
        for node in nodes:
            if d in members[plan[node.name].devices] and memory[node.name].transient > working[0]:
                working = (memory[node.name].transient, node.name)
        mem = memory[working[1]]
        awake = (mem.engine_weights, mem.engine_kv_cache) if mem.engine_sleeps else ()
        values += [b for b in (mem.activations, mem.kv_cache, mem.replica, mem.gathered, *awake) if b > 0]
        total.update(dict.fromkeys(atom, sum(values)))
    order = dict.fromkeys(itertools.chain.from_iterable(plan[n.name].devices for n in nodes))
    return dict(zip(order, map(total.__getitem__, order), strict=True))


def host_offload(cost: CostModel, plan: Mapping[str, NodePlacement]) -> dict[int, float]:
    """Host -> bytes DeepSpeed's CPU offload keeps in its memory under ``plan``: each train node's
    ``MemoryBreakdown.host`` (optimizer state, fp32 gradients, offloaded weights of one rank) for every
    one of its ranks on that host. Hosts without offloaded state are left out."""
    out: dict[int, float] = defaultdict(float)
    for node in cost.problem.nodes:
        mem = cost.node_cost(node, plan[node.name]).memory
        if mem.host > 0:
            for host, ranks in cost.cluster.busy_per_host(plan[node.name].devices).items():
                for _ in range(ranks):  # one addition per rank, as summing over the devices adds them
                    out[host] += mem.host
    return dict(out)


@dataclass(frozen=True)
class MachineMemory:
    """What a plan's devices may use (bytes): ``per_device`` (GPU id -> total memory) on CUDA; on CPU
    ``per_device`` is None and ``host`` (available RAM) bounds all devices together. ``what`` names it."""

    host: float | None
    per_device: Mapping[int, float] | None = None
    what: str = "available host memory"


def local_memory() -> MachineMemory | None:
    """This machine's memory: each visible GPU's total memory on CUDA, else ``MemAvailable`` from
    ``/proc/meminfo`` (Linux; else available pages × page size). None when it cannot be read."""
    import torch  # lazily: the rest of the planner is torch-free

    if torch.cuda.is_available():
        total = {
            i: float(torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())
        }
        return MachineMemory(None, total, "GPU memory")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return MachineMemory(float(line.split()[1]) * 1024)  # the file counts kiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return MachineMemory(float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")))
    except (ValueError, OSError, AttributeError):
        return None


def engine_device_memory(devices: int) -> float:
    """Bytes of one device as the planner and :func:`check_plan_memory` assume it on this host
    (``cluster_files.local_cluster``'s device): what a vLLM engine's ``gpu_memory_utilization`` takes a
    share of on CPU (``rlflow.nodes.engines.sizing.reserved_kv_cache_bytes``)."""
    return float(local_cluster(max(1, devices)).device.memory_bytes)


def engine_memory(graph: Graph, node: str) -> tuple[float | None, float | None]:
    """``(gpu_memory_utilization, device_memory)`` of ``node``'s vLLM engines (``start_engine``'s
    arguments): the plan's share (``NodePlacement.gpu_memory_utilization``, the planner's choice,
    ``engine_share``), else the node's ``args.gpu_memory_utilization``, and, with one,
    :func:`engine_device_memory` for the run's devices; ``(None, None)`` without (the default pool,
    ``rlflow.nodes.engines.sizing.engine_kv_cache_bytes``)."""
    planned = graph.placement(node).gpu_memory_utilization if graph.spec.plan != "auto" else None
    fraction = planned if planned is not None else graph.args(node).get("gpu_memory_utilization")
    if fraction is None:
        return None, None
    return float(fraction), engine_device_memory(graph.spec.run.devices)


def _placements(graph: Graph) -> dict[str, NodePlacement] | None:
    """The graph's placements; ``plan: auto`` on one device is the trivial plan, on several unknown (None)
    until the planner runs."""
    if graph.spec.plan == "auto":
        if graph.spec.run.devices > 1:
            return None
        return {name: NodePlacement((0,), Layout()) for name in graph.spec.nodes}
    return {name: graph.placement(name) for name in graph.spec.nodes}


def check_plan_memory(graph: Graph, memory: MachineMemory | None = None, top: int = 4) -> None:
    """Refuse a graph whose plan does not fit this machine's memory, before any process starts.

    Prices the plan with the planner's memory model (:func:`device_consumers`, the problem of
    ``problem_from_graph``) and compares each device's bytes with its GPU's memory (CUDA), or the sum
    over all devices, plus each worker process's own memory (``host_limits.WORKER_BASE_BYTES``, on more
    than one device), with the host's available memory (CPU). Skipped when the plan is still ``auto`` on
    several devices, and, with a :class:`GraphWarning` saying why, when the planner cannot size a model
    (an architecture it does not price, e.g. GPT-2).

    Args:
        memory: the machine's memory (default :func:`local_memory`; tests pass their own).
        top: consumers named per device in the message.

    Raises:
        PlanError: ``<file>: nodes.<node>.args.gpu_memory_utilization: ...`` when a vLLM engine's share of
            its device cannot hold what it needs to start (``vllm_cost.engine_start_problem``); else
            one line naming the graph file, the device (or host), the bytes needed and there and,
            when ``engine: vllm`` nodes take part, each one's node, model and engine bytes (KV cache +
            weights); then one line per device with its ``top`` biggest consumers (model, what, GiB).
    """
    plan = _placements(graph)
    memory = local_memory() if memory is None else memory
    if plan is None or memory is None:
        return
    cluster = local_cluster(max(1, graph.spec.run.devices))
    try:  # `dtype: auto` sized as the runtime builds it on this machine's devices
        problem = problem_from_graph(graph, device_type=cluster.device_type)
    except (PlanError, GraphError) as err:  # a model the planner cannot size: nothing to check it with
        warnings.warn(f"{err}; the memory check before launch is skipped", GraphWarning, stacklevel=2)
        return
    cost = CostModel(problem, cluster)
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    for node in problem.nodes:  # an engine that cannot start: its own key, before the plan's total
        if node.kind == "generate" and node.engine_of(plan[node.name].engine) == "vllm":
            lay = plan[node.name].layout
            share = plan[node.name].gpu_memory_utilization
            why = engine_start_problem(cluster, node, problem.models[node.model], lay.dp, lay.tp, share)
            if why is not None:
                key = f"plan.{node.name}" if share is not None else f"nodes.{node.name}.args"
                raise PlanError(f"{src}{key}.gpu_memory_utilization: {why}")
    usage = device_consumers(cost, plan)
    total = {d: sum(c.nbytes for c in cs) for d, cs in usage.items()}
    offloaded = sum(host_offload(cost, plan).values())  # CPU offload: in this host's memory too
    if memory.per_device is not None:
        over = [d for d in sorted(total) if total[d] > memory.per_device.get(d, float("inf"))]
        if not over:
            return
        worst = max(over, key=lambda d: total[d] - memory.per_device[d])  # type: ignore[index]
        head = (
            f"{src}the plan needs {total[worst] / GIB:.2f} GiB on device {worst}, more than its "
            f"{memory.per_device[worst] / GIB:.2f} GiB of {memory.what}{_engines(usage[worst])}"
        )
        shown = over
    else:
        assert memory.host is not None
        # on CPU each device is a worker process, whose own memory comes on top (one process: in-process)
        workers = graph.spec.run.devices if graph.spec.run.devices > 1 else 0
        need = sum(total.values()) + offloaded + workers * WORKER_BASE_BYTES
        if need <= memory.host:
            return
        devices = format_devices(tuple(sorted(total)))
        if workers:
            devices += f"; {workers} worker processes of {WORKER_BASE_BYTES / GIB:.2f} GiB each included"
        engines = _engines(c for cs in usage.values() for c in cs)
        head = (
            f"{src}the plan needs {need / GIB:.2f} GiB on this host (devices {devices}), more than its "
            f"{memory.host / GIB:.2f} GiB of {memory.what}{engines}"
        )
        shown = sorted(total, key=lambda d: -total[d])
    lines = [head + "; biggest consumers:"]
    for d in shown[:4]:
        biggest = sorted(usage[d], key=lambda c: -c.nbytes)[:top]
        lines.append(f"  device {d} ({total[d] / GIB:.2f} GiB): " + ", ".join(map(str, biggest)))
    if len(shown) > 4:
        lines.append(f"  ... and {len(shown) - 4} more devices")
    advice = "use smaller models, a plan over more devices, or a bfloat16 dtype"
    if "vLLM engine" in head:
        advice += (
            "; a vLLM engine without a memory share keeps a KV cache for the rows it generates per call (up "
            "to 256) at its full context (data.max_prompt_tokens + args.max_new_tokens, at most the model's "
            "max_position_embeddings): set the node's "
            "args.gpu_memory_utilization, or plan it (plan: auto, rlflow plan), to bound it"
        )
    lines.append(f"  ({advice})")
    raise PlanError("\n".join(lines))


def _engines(consumers: Iterable[Consumer]) -> str:
    """``, of which the vLLM engine of node 'x' (model 'y') needs ...`` for the vLLM engines among
    ``consumers`` (per node, the largest first: its bytes, KV cache and weights); "" without one."""
    per_node: dict[str, list[Consumer]] = defaultdict(list)
    for c in consumers:
        if c.what.startswith((ENGINE_WEIGHTS, ENGINE_KV_CACHE)):
            per_node[c.node].append(c)
    parts = []
    for node, cs in sorted(per_node.items(), key=lambda item: -sum(c.nbytes for c in item[1])):
        kv = sum(c.nbytes for c in cs if c.what.startswith(ENGINE_KV_CACHE))
        weights = sum(c.nbytes for c in cs if c.what.startswith(ENGINE_WEIGHTS))
        ranks = sum(1 for c in cs if c.what.startswith(ENGINE_KV_CACHE))
        engines = "the vLLM engine" if ranks == 1 else f"the {ranks} vLLM engines"
        parts.append(
            f"{engines} of node '{node}' (model '{cs[0].model}') {'needs' if ranks == 1 else 'need'} "
            f"{(kv + weights) / GIB:.2f} GiB (KV cache {kv / GIB:.2f} GiB + weights "
            f"{weights / GIB:.2f} GiB)"
        )
    return ", of which " + "; ".join(parts) if parts else ""
