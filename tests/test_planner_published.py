"""The published workloads of bench/bench_planner_published.py: the graphs describe the models and batches
their sources give, and the published placements pass the graph's plan checks."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.auto import with_placements
from rlflow.schedulers.planner.graph_problem import problem_from_graph

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench() -> ModuleType:
    name = "bench_planner_published"
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_published_graphs_match_their_sources() -> None:
    """Parameter counts are the model cards' (Llama-3.1-8B 8,030,261,248; Llama-3-70B 70,553,706,496;
    a value/score head replaces the 128,256 × 8,192 vocabulary head: − 1,050,673,152 + 8,192), in bf16;
    the batches are the recipes' (2,048 samples in 4 optimizer steps; 1,024 rollouts in 8)."""
    grpo = problem_from_graph(load_graph(str(BENCH / "published" / "grpo_llama31_8b.yaml")), prompt_len=256)
    assert {m: (s.num_params, s.dtype_bytes) for m, s in grpo.models.items()} == {
        "actor": (8_030_261_248, 2),
        "ref": (8_030_261_248, 2),
    }
    assert {(n.name, n.rows, n.mini_batches) for n in grpo.nodes} >= {
        ("actor_gen", 2048, 1),
        ("actor_train", 2048, 4),
    }
    assert grpo.node("actor_gen").gen_len == 4096 - 128
    qwen = problem_from_graph(load_graph(str(BENCH / "published" / "grpo_qwen3_32b.yaml")), prompt_len=128)
    # Qwen3-32B: 32,762,123,264 parameters less the 64 layers' QK-norm weights (2 × 128 each)
    assert qwen.models["actor"].num_params == 32_762_123_264 - 64 * 256
    assert qwen.models["actor"].dtype_bytes == 2
    # Qwen3-30B-A3B: the model card's 30.5 B parameters, 3.3 B active (tests/test_planner_moe.py by hand)
    moe = problem_from_graph(load_graph(str(BENCH / "published" / "grpo_qwen3_30b_a3b.yaml")), prompt_len=128)
    actor = moe.models["actor"]
    assert (actor.num_params, actor.active_params) == (30_532_122_624, 3_353_032_704)
    ppo = problem_from_graph(load_graph(str(BENCH / "published" / "ppo_llama3_70b.yaml")), prompt_len=256)
    critic = 70_553_706_496 - 128_256 * 8192 + 8192
    assert {m: s.num_params for m, s in ppo.models.items()} == {
        "actor": 70_553_706_496, "ref": 70_553_706_496, "critic": critic, "reward_model": critic,
    }  # fmt: skip
    assert {n.name: (n.rows, n.mini_batches) for n in ppo.nodes if n.kind == "train"} == {
        "actor_train": (1024, 8),
        "critic_train": (1024, 8),
    }


@pytest.mark.parametrize("index", range(len(_bench().WORKLOADS)))
def test_published_placements_pass_the_plan_checks(index: int) -> None:
    bench = _bench()
    workload = bench.WORKLOADS[index]
    graph, _problem = bench._problem(workload, published=True)
    plan = workload.placement(8 * workload.hosts)
    planned = with_placements(graph, plan)
    assert {name: planned.placement(name) for name in plan} == plan


@pytest.mark.parametrize("path", sorted((BENCH / "published").glob("*.yaml")), ids=lambda p: p.name)
def test_published_graphs_are_written_as_a_user_would(path: Path) -> None:
    """Each graph file's header names its source (a commit and the lines of the published figure), and the
    file pins no decision the published recipe does not configure (the placement's: recompute, reshard,
    a plan); a generate node names the engine the published system generated with."""
    text = path.read_text()
    header = text[: text.index("models:")]
    assert re.search(r"@?\b[0-9a-f]{9,40}\b", header), f"{path.name}: no commit in the header"
    assert re.search(r"lines? \d+", header), f"{path.name}: no line of the source in the header"
    assert not re.search(r"^\s*(recompute|reshard):", text, re.M), f"{path.name} pins a placement decision"
    assert "\nplan:" not in text
    spec = load_graph(str(path)).spec
    assert {n.engine for n in spec.nodes.values() if n.kind == "generate"} == {"vllm"}


def test_fit_and_held_out_rows_are_declared() -> None:
    """At least five published rows; the fit rows and the held-out rows are disjoint and both present."""
    roles = [w.role for w in _bench().WORKLOADS]
    assert len(roles) >= 5 and set(roles) == {"fit", "held-out"} and roles.count("held-out") >= 3
