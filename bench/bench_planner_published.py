"""The planner against published RL step times on H100 clusters (issues 18 and 36).

Each workload is an rlflow graph in ``bench/published/`` written as a user would write it from the published
table and recipe: the models, the batch, the generation caps, the engine and the engine's settings the
recipe sets (each with its source — repository, commit, file and line — in the file's header or beside
it), and nothing the recipe does not configure: no placement, no ``recompute``/``reshard`` (left out, so
searched), no engine memory share where the published system configured none. Each is planned on the
``h100-8x`` preset (no profile) with the published number of hosts and the published mean response length
(``rlflow plan --mean-new-tokens``).

For each row: the searched plan's predicted seconds per step and the published placement priced by the cost
model (``published placement``: the published degrees, micro-batch sizes, colocation and recomputation,
written as an rlflow plan and checked by the graph's plan checks), each with the ratio predicted / published,
the ratios by GPU count of every published table with rows at several scales (the check that the error has
no trend with scale), and the median absolute error over the rows of each role.

Fit and held-out rows. The ``fit`` rows — GRPO Llama-3.1-8B on-policy (NeMo RL) and PPO Llama-3-70B on 96 GPUs
(NeMo-Aligner): one generation-bound and one training-bound workload of two systems; and the mixture of
experts GRPO Qwen3-30B-A3B on-policy (NeMo RL) — are the only rows anything may be tuned on; ``--fit`` fits
the preset's ``efficiency.matmul`` (the fraction of peak FLOP/s a training or prefill matmul reaches) and
``efficiency.memory`` (the fraction of HBM bandwidth a decode step streams at) to them: it prices their
published placements over a grid of the two numbers and prints the pair with the least squared log error, then
reports every row under it. The other rows are ``held-out``: one-step off-policy runs, a 32B model at two
scales, the 70B PPO table at 192, 384 and 768 GPUs, and Qwen3-30B-A3B one and eight steps off-policy (the
latter at 192 GPUs, NeMo RL v0.6); issues 18's and 36's acceptance figure is their median error (the MoE
rows also apart: issue 34's). The preset itself keeps its sourced figures.

Where rlflow cannot run the published placement as written, the nearest placement it runs is priced and the
row says so: TRT-LLM at tensor parallel 8 (NeMo-Aligner) is priced as the built-in decode loop at the same
degrees without its eager kernel-launch cost (TRT-LLM captures its decode steps in CUDA graphs;
``Workload.captured``), the graph loaded with the built-in engine for that placement only; the searched plan
runs the file's ``engine: vllm`` (rlflow's engine that captures its decode steps). NeMo RL's vLLM
placements, tensor parallel included, are priced as rlflow's vLLM engine runs them; Megatron's expert
parallelism (ep 8) as rlflow's ep 8 (``expert_cost.py``), at pp 1 where ep runs, and the layouts rlflow's
layout rule refuses (GRPO groups split over data-parallel ranks, tensor parallel above the KV heads) at the
nearest it runs (each row's note).

In-flight weight updates. NeMo RL's asynchronous MoE recipes (both Qwen3-30B-A3B off-policy rows) set
``grpo.async_grpo.in_flight_weight_updates: true`` with ``vllm_cfg.async_engine: true``: at each weight
update the responses being generated continue under the new weights (``nemo_rl/algorithms/async_utils/
trajectory_collector.py``, ``prepare_for_refit``, at ``aea463dd2``; the 1-step-off recipe at ``9dbd9adc9``
sets it too). rlflow's counterpart is interruptible generation (``interrupt_every``: responses
interrupted every ``S`` tokens and continued under newer weights), so each such row is also priced with
``interrupt_every`` (``Workload.in_flight``), ``S`` following from the recipe (:func:`in_flight_every`):
the tokens one running response decodes between two weight updates. One update per step; in a step the
engines decode the step's ``samples × mean response`` tokens; over ``k`` engines (the recipe's generation
GPUs over its vLLM tensor degree) of ``c`` running sequences each, ``S = samples · mean / (k · c)``, with
``c`` the sequences an engine holds at once: its KV pool at the recipe's ``gpu_memory_utilization`` and
tensor degree (``vllm_cost.engine_kv``, rlflow's sizing of that engine) over ``P + μ`` tokens each, below
vLLM's ``max_num_seqs`` (1,024 on an H100: vLLM 0.32 ``EngineArgs._set_default_max_num_seqs_and_batched_
tokens_args``; the recipes set none). No step time enters it. The row keeps its role; the medians are
printed both ways.

Run: ``python bench/bench_planner_published.py`` (``--budget S``: search seconds per plan, default 35, the
search running ``rlflow plan``'s defaults, 4 annealing chains of 1,500 steps; ``--fit``: refit the two
preset numbers on the fit rows and print them; ``--rows fit|held-out|all``; ``--only TEXT``: the rows
whose name contains it; ``--no-search``: the published placements only).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.graph import Graph, GraphWarning
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.schedulers.planner.auto import with_placements
from rlflow.schedulers.planner.cluster import ClusterSpec
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.problem import PlanProblem
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.planner.simulator import simulate
from rlflow.schedulers.planner.vllm_cost import engine_kv, engine_kv_per_token

HERE = Path(__file__).resolve().parent / "published"
Placement = Callable[[int], dict[str, NodePlacement]]


def _span(first: int, count: int) -> tuple[int, ...]:
    return tuple(range(first, first + count))


def _grpo_placement(
    gen_tp: int,
    train_tp: int,
    train_pp: int,
    recompute: bool,
    split: bool,
    logprob_rows: int | None = None,
    engine: str = "vllm",
    ep: int = 1,
    gen_gpus: int | None = None,
) -> Placement:
    """NeMo RL's GRPO recipes: vLLM at ``gen_tp`` (one replica per ``gen_tp`` GPUs), Megatron training at
    ``train_tp`` × ``train_pp`` with micro-batch 1 (512 samples per optimizer step over the dp ranks;
    Megatron's distributed optimizer gathers the weights and reduce-scatters the gradients once per step:
    ``reshard: false``), the reference log-probs on the training layout at micro-batch ``logprob_rows``
    (default 2 at train tp 1, as the 8B recipe, else 1: ``logprob_batch_size`` is the train micro-batch).
    ``split`` (one step off-policy): generation on the first half of the GPUs, training on the other half;
    else everything on every GPU (colocated); ``gen_gpus``: the GPUs of generation when split (default
    half). ``engine``: the generation engine rlflow prices it on; ``ep``: Megatron's expert-parallel degree
    of the training layout (and of the reference log-probs on it)."""

    def place(gpus: int) -> dict[str, NodePlacement]:
        k = gen_gpus or gpus // 2
        gen = _span(0, k) if split else _span(0, gpus)
        train = _span(k, gpus - k) if split else _span(0, gpus)
        dp = len(train) // (train_tp * train_pp)
        rows = logprob_rows or (2 if train_tp == 1 else 1)
        return {
            "actor_gen": NodePlacement(gen, Layout(len(gen) // gen_tp, gen_tp, 1, 1), engine=engine),
            "ref": NodePlacement(train, Layout(dp, train_tp, train_pp, 2048 // dp // rows, ep)),
            "actor_train": NodePlacement(
                train, Layout(dp, train_tp, train_pp, 512 // dp, ep), recompute=recompute, reshard=False
            ),
        }

    return place


def ppo_70b_placement(rollout_rows: int = 8) -> Placement:
    """NeMo-Aligner's split: the actor (and reference) on two thirds of the GPUs, the critic (and reward
    model) on the rest; training at tp 8 × pp 4 (Megatron), generation resharded to tp 8 only (TRT-LLM,
    priced as a graph-captured loop: ``Workload.captured``); micro-batch 1 for training,
    ``rollout_micro_batch_size`` ``rollout_rows`` for inference and for generation (each data-parallel rank
    generates its rollouts that many at a time: NVIDIA/NeMo-Aligner@af2b3bd9, ``nemo_aligner/algorithms/
    ppo.py`` lines 301-304, ``examples/nlp/gpt/conf/gpt_ppo_actor.yaml`` line 139: 8; 16 on 64 + 32 nodes,
    ``docs/user-guide/rlhf.rst`` line 433); selective (not full) activation checkpointing, so
    ``recompute: false``; Megatron's distributed optimizer, so ``reshard: false``."""

    def place(gpus: int) -> dict[str, NodePlacement]:
        actor, critic = _span(0, gpus * 2 // 3), _span(gpus * 2 // 3, gpus // 3)
        a_dp, c_dp = len(actor) // 32, len(critic) // 32

        def at(devices: tuple[int, ...], dp: int, micro_rows: int, train: bool = False) -> NodePlacement:
            layout = Layout(dp=dp, tp=8, pp=4, micro_batches=max(1, 1024 // (dp * micro_rows)))
            return NodePlacement(
                devices, layout, recompute=False if train else None, reshard=False if train else None
            )

        gen_dp = len(actor) // 8
        return {
            "actor_gen": NodePlacement(
                actor, Layout(dp=gen_dp, tp=8, pp=1, micro_batches=max(1, 1024 // gen_dp // rollout_rows))
            ),
            "ref": at(actor, a_dp, rollout_rows),
            "reward": at(critic, c_dp, rollout_rows),
            "critic_values": at(critic, c_dp, rollout_rows),
            "actor_train": at(actor, a_dp, 1 * 8, train=True),  # 8 mini-batches of 128 rows, micro-batch 1
            "critic_train": at(critic, c_dp, 1 * 8, train=True),
        }

    return place


@dataclass(frozen=True)
class Workload:
    """One published step time: ``name``, the graph file and its overrides, hosts of 8 H100s, published
    seconds per step and mean response tokens, prompt tokens, the published placement, the row's role
    (``fit`` or ``held-out``) and the published ``table`` it comes from (rows of one table at several GPU
    counts: the ratios by GPU count are printed per table). ``captured``: the published generation ran on
    an engine rlflow does not run that captures its decode steps in CUDA graphs (TRT-LLM), so its placement
    is priced as the built-in loop at those degrees (the graph loaded with ``nodes.actor_gen.engine=
    builtin`` for that placement only) without the eager loop's kernel-launch cost
    (``Overheads.launch_layer_s`` 0). ``in_flight``: the recipe updates the engines' weights in flight
    (module docstring), so the row is priced a second time with ``interrupt_every``
    (:func:`in_flight_every`)."""

    name: str
    graph: str
    overrides: tuple[str, ...]
    hosts: int
    published_s: float
    mean_response: float
    prompt_len: int
    placement: Placement
    role: str
    table: str
    note: str = ""
    captured: bool = False
    in_flight: bool = False


def _prompt(tokens_per_s_per_gpu: float, gpus: int, step_s: float, samples: int, mean: float) -> int:
    """Prompt tokens per sample from NeMo RL's published throughput: its tokens/s/GPU counts every trained
    token (prompt + response) of the step's samples."""
    return round(tokens_per_s_per_gpu * gpus * step_s / samples - mean)


def _off(steps: int) -> tuple[str, ...]:
    """NeMo RL's async recipes: ``steps`` steps off-policy, vLLM at gpu_memory_utilization 0.8 on GPUs of
    its own, awake (the recipes' ``vllm_cfg`` and ``colocated.enabled: false``)."""
    return (
        f"nodes.actor_gen.staleness={steps}",
        "nodes.actor_gen.args.gpu_memory_utilization=0.8",
        "nodes.actor_gen.args.enable_sleep_mode=false",
    )


ASYNC = _off(1)
TRT = "TRT-LLM tp 8 priced as a graph-captured loop"
# Qwen3-30B-A3B (mixture of experts): Megatron's expert parallel 8 as rlflow's ep 8, which runs without
# pipeline stages (layout_rules), so the 1-step-off row trains at pp 1 (published pp 2), dp 16; on-policy
# dp 32 (16 rows per rank) would split GRPO's groups of 32, which rlflow keeps on one rank, so that row
# trains at tp 2, dp 16 (published tp 1)
MOE = "ep 8"
NEMO_RL = "NeMo RL v0.5 H100 BF16"
NEMO_RL6 = "NeMo RL v0.6 H100 BF16"
ALIGNER = "NeMo-Aligner PPO 70B + 70B, TRT-LLM"
PPO = "ppo_llama3_70b.yaml"
WORKLOADS = [
    Workload("GRPO Llama-3.1-8B on-policy (NeMo RL)", "grpo_llama31_8b.yaml", (), 2, 92.8, 1019.0,
             _prompt(1581, 16, 92.8, 2048, 1019), _grpo_placement(1, 1, 2, True, False), "fit", NEMO_RL),
    Workload("PPO Llama-3-70B x2 (NeMo-Aligner)", PPO, (), 12, 366.7, 350.7, 256, ppo_70b_placement(),
             "fit", ALIGNER, TRT, captured=True),
    Workload("GRPO Llama-3.1-8B 1-step off (NeMo RL)", "grpo_llama31_8b.yaml", ASYNC, 2, 64.8, 1123.0,
             _prompt(2478, 16, 64.8, 2048, 1123), _grpo_placement(1, 1, 1, True, True), "held-out",
             NEMO_RL),
    Workload("GRPO Qwen3-32B on-policy (NeMo RL)", "grpo_qwen3_32b.yaml", (), 4, 376.0, 3251.0,
             _prompt(571, 32, 376.0, 2048, 3251), _grpo_placement(4, 4, 4, False, False), "held-out",
             NEMO_RL),
    Workload("GRPO Qwen3-32B 1-step off (NeMo RL)", "grpo_qwen3_32b.yaml", ASYNC, 8, 200.0, 3252.0,
             _prompt(538, 64, 200.0, 2048, 3252), _grpo_placement(4, 4, 4, False, True), "held-out",
             NEMO_RL),
    Workload("PPO Llama-3-70B x2 (NeMo-Aligner)", PPO, (), 24, 190.4, 323.3, 256, ppo_70b_placement(),
             "held-out", ALIGNER, TRT, captured=True),
    Workload("PPO Llama-3-70B x2 (NeMo-Aligner)", PPO, (), 48, 108.0, 331.7, 256, ppo_70b_placement(),
             "held-out", ALIGNER, TRT, captured=True),
    Workload("PPO Llama-3-70B x2 (NeMo-Aligner)", PPO, (), 96, 56.9, 334.0, 256, ppo_70b_placement(16),
             "held-out", ALIGNER, TRT + "; rollouts 16 at a time", captured=True),
    Workload("GRPO Qwen3-30B-A3B on-policy (NeMo RL)", "grpo_qwen3_30b_a3b.yaml", (), 4, 198.0, 3196.0,
             _prompt(1066, 32, 198.0, 2048, 3196), _grpo_placement(2, 2, 1, False, False, 1, ep=8),
             "fit", NEMO_RL, MOE + "; tp 2 (dp 32 splits groups)"),
    Workload("GRPO Qwen3-30B-A3B 1-step off (NeMo RL)", "grpo_qwen3_30b_a3b.yaml", ASYNC, 4, 154.0,
             3201.0, _prompt(1391, 32, 154.0, 2048, 3201), _grpo_placement(2, 1, 1, False, True, 1, ep=8),
             "held-out", NEMO_RL, MOE + "; pp 1 (ep at pp 1)", in_flight=True),
    Workload("GRPO Qwen3-30B-A3B 8-step off (NeMo RL)", "grpo_qwen3_30b_a3b.yaml", _off(8), 24, 34.5,
             3206.0, _prompt(1025, 192, 34.5, 2048, 3206),
             _grpo_placement(2, 1, 8, False, True, 1, gen_gpus=64), "held-out", NEMO_RL6,
             "pp 8, no ep (dp 128 splits groups; ep runs at pp 1); one iteration's rows per engine call "
             "(NeMo RL streams 8 steps' rows with in-flight weight updates)", in_flight=True),
]  # fmt: skip


def _problem(w: Workload, published: bool = False) -> tuple[Graph, PlanProblem]:
    """``w``'s graph and planner problem; ``published``: as its published placement is priced (a
    ``captured`` row's generate node on the built-in loop)."""
    engine = ("nodes.actor_gen.engine=builtin",) if published and w.captured else ()
    with warnings.catch_warnings():  # about the file's own placeholder plan, which every row replaces
        warnings.simplefilter("ignore", GraphWarning)
        graph = load_graph(str(HERE / w.graph), [f"run.devices={8 * w.hosts}", *w.overrides, *engine])
    problem = problem_from_graph(
        graph, prompt_len=w.prompt_len, device_type="cuda", mean_new_tokens=w.mean_response
    )
    return graph, problem


VLLM_H100_MAX_NUM_SEQS = 1024  # vLLM 0.32's default on a GPU of >= 70 GiB but an A100 (module docstring)


def in_flight_every(w: Workload, cluster: ClusterSpec) -> int:
    """``interrupt_every`` of an ``in_flight`` row (module docstring): ``samples · mean / (k · c)`` tokens,
    ``k`` the published placement's engines, ``c`` the sequences one of them holds at once (its KV pool at
    the recipe's share and tensor degree over ``P + μ`` tokens each, at most vLLM's ``max_num_seqs``)."""
    _graph, problem = _problem(w, published=True)
    gen, node = w.placement(8 * w.hosts)["actor_gen"], problem.node("actor_gen")
    shape, engines, tp = problem.models[node.model], gen.layout.dp, gen.layout.tp
    _memory, pool, _rows = engine_kv(cluster, node, shape, engines, tp, gen.gpu_memory_utilization)
    per_sequence = engine_kv_per_token(shape, tp) * (node.prompt_len + node.response_mean)
    running = min(float(VLLM_H100_MAX_NUM_SEQS), pool / per_sequence)
    return round(node.rows * node.response_mean / (engines * running))


def _placed(graph: Graph, problem: PlanProblem, plan: dict[str, NodePlacement]) -> dict[str, NodePlacement]:
    """``plan`` checked by the graph's plan checks (the runtime's layout rule), for every planned node.

    Raises:
        PlanError, GraphError: the checks reject the placement.
    """
    placed = with_placements(graph, plan)
    return {n.name: placed.placement(n.name) for n in problem.nodes}


def _as_published(w: Workload, cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` for pricing ``w``'s published placement: without kernel-launch cost where the published
    generation is graph-captured on an engine rlflow does not run (``Workload.captured``)."""
    if not w.captured:
        return cluster
    return dataclasses.replace(cluster, overheads=dataclasses.replace(cluster.overheads, launch_layer_s=0.0))


def published_seconds(
    graph: Graph, problem: PlanProblem, cluster: ClusterSpec, plan: dict[str, NodePlacement]
) -> tuple[float, float]:
    """The published placement priced: (seconds per step, its peak memory over the usable memory).

    Raises:
        PlanError, GraphError: the graph's plan checks reject the placement.
    """
    full = _placed(graph, problem, plan)
    searcher = Searcher(problem, cluster)
    over = max(searcher.memory(full).values()) / searcher.capacity
    return simulate(CostModel(problem, cluster), full).iteration_s, over


def fit(cluster: ClusterSpec) -> tuple[float, float]:
    """``(matmul, memory)`` efficiencies minimising the squared log error of the fit rows' published
    placements (module docstring), on a grid of 0.05 steps."""
    rows = []
    for w in (w for w in WORKLOADS if w.role == "fit"):
        graph, problem = _problem(w, published=True)
        rows.append((w, problem, _placed(graph, problem, w.placement(8 * w.hosts))))
    best: tuple[float, float, float] = (math.inf, 0.0, 0.0)
    grid = [round(0.1 + 0.05 * i, 2) for i in range(17)]  # 0.10 .. 0.90
    for matmul, memory in itertools.product(grid, grid):
        eff = dataclasses.replace(cluster.efficiency, matmul=matmul, memory=memory)
        err = 0.0
        for w, problem, plan in rows:
            c = _as_published(w, dataclasses.replace(cluster, hosts=w.hosts, efficiency=eff))
            err += math.log(simulate(CostModel(problem, c), plan).iteration_s / w.published_s) ** 2
        best = min(best, (err, matmul, memory))
    return best[1], best[2]


def _searched(problem: PlanProblem, cluster: ClusterSpec, seed: int, budget: float) -> tuple[float, str]:
    """The searched plan's seconds per step and its generate and train layouts (``rlflow plan``'s search).

    Raises:
        PlanError: no plan fits.
    """
    result = Searcher(problem, cluster).search(seed=seed, restarts=4, steps=1500, time_budget_s=budget)
    layouts = []
    for n in problem.nodes:
        if n.kind == "inference":
            continue
        at = result.plan[n.name]
        text = f"{n.name} {at.layout}"
        if n.kind == "generate":
            text += f" {n.engine_of(at.engine)}"
        elif n.recompute_of(at.recompute):
            text += " recompute"
        if n.kind == "train" and not n.reshard_of(at.reshard):
            text += " no-reshard"
        layouts.append(text)
    return result.iteration_s, ", ".join(layouts)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=float, default=35.0, help="search seconds per plan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fit", action="store_true", help="refit the preset's two efficiencies on the fit rows"
    )
    parser.add_argument("--rows", choices=("fit", "held-out", "all"), default="all")
    parser.add_argument("--only", default="", help="rows whose name contains this text")
    parser.add_argument(
        "--no-search", action="store_true", help="price the published placements only (seconds)"
    )
    args = parser.parse_args()
    base = load_cluster("h100-8x")
    if args.fit:
        t0 = time.perf_counter()
        matmul, memory = fit(base)
        preset = f"preset: {base.efficiency.matmul}, {base.efficiency.memory}"
        print(f"fitted on the fit rows ({time.perf_counter() - t0:.0f} s): efficiency.matmul {matmul}, "
              f"efficiency.memory {memory} ({preset})")  # fmt: skip
        base = dataclasses.replace(
            base, efficiency=dataclasses.replace(base.efficiency, matmul=matmul, memory=memory)
        )
    header = ("workload", "GPUs", "role", "published s", "searched s", "ratio", "published placement s",
              "ratio", "plan s", "searched plan (generate, train)")  # fmt: skip
    print(" | ".join(header))
    errors: dict[tuple[str, str], list[float]] = {}
    by_gpus: dict[tuple[str, str], list[tuple[int, str, float]]] = {}  # (table, what) -> (GPUs, role, ratio)
    variants = []
    for w in WORKLOADS:  # an in-flight row also as interrupt_every (module docstring): a second line
        variants.append((w, ""))
        if w.in_flight:
            every = in_flight_every(w, dataclasses.replace(base, hosts=w.hosts))
            extra = (*w.overrides, f"nodes.actor_gen.interrupt_every={every}")
            variants.append((dataclasses.replace(w, overrides=extra), f"interrupt_every {every}"))
    for w, variant in variants:
        if (args.rows != "all" and w.role != args.rows) or args.only not in w.name:
            continue
        graph, problem = _problem(w)
        cluster = dataclasses.replace(base, hosts=w.hosts)
        gpus = cluster.num_devices
        # the mixture-of-experts rows' errors also apart (issue 34's acceptance figure)
        moe = any(s.is_moe for s in problem.models.values())
        roles: tuple[str, ...] = (w.role, f"{w.role} MoE" if moe else f"{w.role} dense")
        if w.in_flight:  # the in-flight rows' medians both ways; the main medians keep the one-call rows
            ways = f"{w.role} MoE in flight, " + ("as interrupt_every" if variant else "as one call")
            roles = (ways,) if variant else (*roles, ways)
        t0 = time.perf_counter()
        searched, ratio, layouts = "-", "-", "-"
        if not args.no_search:
            try:
                seconds, layouts = _searched(problem, cluster, args.seed, args.budget)
                searched, ratio = f"{seconds:.1f}", f"{seconds / w.published_s:.2f}"
                for role in roles:
                    errors.setdefault((role, "searched"), []).append(abs(seconds / w.published_s - 1))
                if not variant:  # the table's ratios by GPU count: its rows as published
                    by_gpus.setdefault((w.table, "searched"), []).append(
                        (gpus, w.role, seconds / w.published_s)
                    )
            except PlanError as err:
                searched = f"infeasible ({str(err)[:60]})"
        plan_s = time.perf_counter() - t0
        try:
            graph, problem = _problem(w, published=True)
            seconds, over = published_seconds(graph, problem, _as_published(w, cluster), w.placement(gpus))
            placed = f"{seconds:.1f}" + (f" (memory {over:.1f}x of usable)" if over > 1 else "")
            placed_ratio = f"{seconds / w.published_s:.2f}"
            for role in roles:
                errors.setdefault((role, "published placement"), []).append(abs(seconds / w.published_s - 1))
            by_gpus.setdefault(
                (w.table, "published placement" + (" in flight" if variant else "")), []
            ).append((gpus, w.role, seconds / w.published_s))
        except (PlanError, GraphError) as err:
            placed, placed_ratio = f"n/a ({str(err)[:70]})", "-"
        if w.note:
            placed += f" [{w.note}]"
        name = w.name + (f", {variant}" if variant else "")
        cells = (name, str(gpus), w.role, f"{w.published_s:.1f}", searched, ratio, placed, placed_ratio,
                 f"{plan_s:.0f}", layouts)  # fmt: skip
        print(" | ".join(cells), flush=True)
    print("predicted / published by GPU count, per published table:")
    for (table, what), rows in sorted(by_gpus.items()):
        fit_mark = {"fit": " (fit)", "held-out": ""}
        cells = ", ".join(f"{g} {r:.2f}{fit_mark[role]}" for g, role, r in sorted(rows))
        print(f"  {table}, {what}: {cells}")
    for (role, what), errs in sorted(errors.items()):
        print(f"median |error| {role} rows, {what}: {statistics.median(errs):.0%} over {len(errs)} rows")


if __name__ == "__main__":
    main()
