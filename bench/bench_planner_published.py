"""The planner against published RL step times on H100 clusters (issue 18).

Each workload is an rlflow graph in ``bench/published/`` (model shapes from the models' public configs; the
configuration and the published figure, with their sources, in the file's header), planned on the
``h100-8x`` preset (no profile) with ``--hosts`` hosts:

- ``today``: the planner's defaults: every response runs to ``max_new_tokens``;
- ``+ length``: the length model with the published mean response (``rlflow plan --mean-new-tokens``);
- ``+ recompute``: also full activation recomputation in the train nodes, as both published systems run
  (NeMo RL: ``activation_checkpointing: true``; NeMo-Aligner: selective checkpointing);
- ``+ ZeRO-1``: also DeepSpeed ZeRO-1 in the train nodes (Megatron's distributed optimizer partitions the
  optimizer state as stage 1 does); ZeRO runs tensor and pipeline degree 1, so only where the model fits;

Since the runtime cuts every inference and train micro-batch to its rows' longest response
(``nodes/train.py``) and the cost model prices that (``cost.py``: ``+ length`` prices each micro-batch at the
expected longest of its rows), the former ``+ packing`` stand-in (every forward at the mean response) is
gone: ``+ length`` prices what rlflow runs, close to what the packing trainers do for small micro-batches.

For each: the searched plan's predicted seconds per step and, where the published placement is known and
the layout rule accepts it, that placement priced by the cost model (``published placement``), with the
ratio predicted / published and the median absolute error over the rows. No row was used to fit anything:
the presets' rates are the published roofline figures of ``schedulers/planner/clusters/h100-8x.yaml``.

Run: ``python bench/bench_planner_published.py`` (``--budget S``: search seconds per plan, default 20).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.spec import Layout, NodePlacement
from rlflow.schedulers.planner.auto import with_placements
from rlflow.schedulers.planner.cluster import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem, problem_from_graph
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.simulator import simulate
from rlflow.schedulers.planner.zero_cost import ZeroConfig

HERE = Path(__file__).resolve().parent / "published"


def _span(first: int, count: int) -> tuple[int, ...]:
    return tuple(range(first, first + count))


def grpo_8b_placement(_gpus: int) -> dict[str, NodePlacement]:
    """NeMo RL's recipe: vLLM tp 1 on all 16 GPUs, colocated with Megatron training at tp 1, pp 2 (dp 8,
    micro-batch 1: 512 samples / 8 ranks = 64 micro-batches per optimizer step); the reference and the
    policy log-probs on the training layout."""
    every = _span(0, 16)
    train = NodePlacement(every, Layout(dp=8, tp=1, pp=2, micro_batches=64))
    return {
        "actor_gen": NodePlacement(every, Layout(dp=16, tp=1, pp=1, micro_batches=1), engine="vllm"),
        "ref": NodePlacement(every, Layout(dp=8, tp=1, pp=2, micro_batches=128)),
        "actor_train": train,
    }


def ppo_70b_placement(gpus: int) -> dict[str, NodePlacement]:
    """NeMo-Aligner's split: the actor (and reference) on two thirds of the GPUs, the critic (and reward
    model) on the rest; training at tp 8 × pp 4 (Megatron), generation resharded to tp 8 only (TRT-LLM);
    micro-batch 1 for training, ``rollout_micro_batch_size`` 8 for inference."""
    actor, critic = _span(0, gpus * 2 // 3), _span(gpus * 2 // 3, gpus // 3)
    a_dp, c_dp = len(actor) // 32, len(critic) // 32

    def at(devices: tuple[int, ...], dp: int, micro_rows: int) -> NodePlacement:
        return NodePlacement(
            devices, Layout(dp=dp, tp=8, pp=4, micro_batches=max(1, 1024 // (dp * micro_rows)))
        )

    return {
        "actor_gen": NodePlacement(actor, Layout(dp=len(actor) // 8, tp=8, pp=1, micro_batches=1)),
        "ref": at(actor, a_dp, 8),
        "reward": at(critic, c_dp, 8),
        "critic_values": at(critic, c_dp, 8),
        "actor_train": at(actor, a_dp, 1 * 8),  # 8 mini-batches of 128 rows, micro-batch 1
        "critic_train": at(critic, c_dp, 1 * 8),
    }


@dataclass(frozen=True)
class Workload:
    name: str
    graph: str
    hosts: int
    published_s: float
    mean_response: float
    prompt_len: int
    placement: Callable[[int], dict[str, NodePlacement]]


GRPO, PPO = "GRPO Llama-3.1-8B 64x32 (NeMo RL)", "PPO Llama-3-70B x2 1024 (NeMo-Aligner)"
WORKLOADS = [  # name, graph, hosts of 8 H100s, published s/step, published mean response, prompt tokens
    Workload(GRPO, "grpo_llama31_8b.yaml", 2, 92.8, 1019.0, 256, grpo_8b_placement),
    Workload(PPO, "ppo_llama3_70b.yaml", 12, 366.7, 350.7, 256, ppo_70b_placement),
    Workload(PPO, "ppo_llama3_70b.yaml", 24, 190.4, 323.3, 256, ppo_70b_placement),
]


def variants(problem: PlanProblem, mean: float) -> dict[str, PlanProblem]:
    """The problem under today's defaults and with each option added in turn (module docstring)."""

    def edit(change: Callable[[PlanNode], PlanNode]) -> PlanProblem:
        return dataclasses.replace(problem, nodes=tuple(change(n) for n in problem.nodes))

    length = edit(lambda n: dataclasses.replace(n, gen_mean=mean))  # every node's rows: the responses
    recompute = dataclasses.replace(
        length,
        nodes=tuple(dataclasses.replace(n, recompute=True) if n.kind == "train" else n for n in length.nodes),
    )
    zero = dataclasses.replace(
        recompute,
        nodes=tuple(
            dataclasses.replace(n, zero=ZeroConfig(1)) if n.kind == "train" else n for n in recompute.nodes
        ),
    )
    return {
        "today": problem,
        "+ length": length,
        "+ recompute": recompute,
        "+ ZeRO-1": zero,
    }


def published_seconds(
    graph: Graph, problem: PlanProblem, searcher: Searcher, plan: dict[str, NodePlacement]
) -> str:
    """The published placement priced (seconds per step; its memory noted when a device is over its usable
    memory), or why it cannot be: a layout the graph's plan checks (the layout rule) reject."""
    try:
        with_placements(graph, plan)
        memory = searcher.memory(plan)
        limit = searcher.cluster.device.memory_bytes * searcher.cluster.usable_memory_fraction
        over = max(memory.values()) / limit
        seconds = simulate(CostModel(problem, searcher.cluster), plan).iteration_s
    except (PlanError, GraphError, KeyError, ValueError, ZeroDivisionError) as err:
        return f"n/a ({str(err)[:60]})"
    note = f" (memory {over:.1f}x of usable)" if over > 1 else ""
    return f"{seconds:.1f}{note}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", type=float, default=20.0, help="search seconds per plan")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    header = ("workload", "GPUs", "variant", "published s", "searched s", "ratio", "published placement s",
              "ratio", "plan s", "searched layouts (gen, train)")  # fmt: skip
    print(" | ".join(header))
    errors: dict[str, list[float]] = {}
    placed_errors: dict[str, list[float]] = {}
    for w in WORKLOADS:
        graph = load_graph(str(HERE / w.graph), [f"run.devices={8 * w.hosts}"])
        cluster = load_cluster("h100-8x", hosts=w.hosts)
        base = problem_from_graph(graph, prompt_len=w.prompt_len, device_type="cuda")
        for name, problem in variants(base, w.mean_response).items():
            t0 = time.perf_counter()
            try:
                searcher = Searcher(problem, cluster)
                result = searcher.search(seed=args.seed, restarts=2, steps=400, time_budget_s=args.budget)
                searched = result.iteration_s
                shown = f"{searched:.1f}"
                ratio = f"{searched / w.published_s:.2f}"
                errors.setdefault(name, []).append(abs(searched / w.published_s - 1))
                layouts = ", ".join(
                    f"{n.name} {result.plan[n.name].layout}"
                    + (f" {n.engine_of(result.plan[n.name].engine)}" if n.kind == "generate" else "")
                    for n in problem.nodes
                    if n.kind != "inference"
                )
            except PlanError as err:
                shown, ratio, layouts = f"infeasible ({str(err)[:50]})", "-", "-"
                searcher = None
            placed = (
                published_seconds(graph, problem, searcher, w.placement(cluster.num_devices))
                if searcher is not None
                else "n/a (the search found no feasible plan)"
            )
            try:
                placed_s = float(placed.split()[0])
                placed_ratio = f"{placed_s / w.published_s:.2f}"
                placed_errors.setdefault(name, []).append(abs(placed_s / w.published_s - 1))
            except ValueError:
                placed_ratio = "-"
            cells = (w.name, str(cluster.num_devices), name, f"{w.published_s:.1f}", shown, ratio, placed)
            seconds = f"{time.perf_counter() - t0:.0f}"
            print(" | ".join((*cells, placed_ratio, seconds, layouts)), flush=True)
    for name, errs in errors.items():
        placed = placed_errors.get(name, [])
        print(
            f"median |error| {name}: searched {statistics.median(errs):.0%} over {len(errs)} rows"
            + (f"; published placement {statistics.median(placed):.0%} over {len(placed)}" if placed else "")
        )
    if not errors:
        print("no feasible row")


if __name__ == "__main__":
    main()
