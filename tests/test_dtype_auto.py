"""``models.<m>.dtype: auto`` (the default): bfloat16 on a CUDA device, float32 on CPU, in the runtime's build
and in the planner's prices."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import ModelSpec, resolve_dtype
from rlflow.nodes.models import build_model, build_model_from_spec
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.runtime.executor import LocalExecutor

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LLAMA = {
    "model_type": "llama", "vocab_size": 19, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "max_position_embeddings": 32,
}  # fmt: skip


def _dtype(module: torch.nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


def test_spec_defaults_to_auto_and_rejects_junk_naming_the_key() -> None:
    assert ModelSpec("actor", config=dict(LLAMA)).dtype == "auto"
    for name in ("auto", "float32", "bfloat16"):
        assert ModelSpec("actor", config=dict(LLAMA), dtype=name).dtype == name
    assert ModelSpec("actor", config=dict(LLAMA), dtype="float16", trainable=False).dtype == "float16"
    with pytest.raises(GraphError, match=r"models\.actor\.dtype") as info:
        ModelSpec("actor", config=dict(LLAMA), dtype="bf32")
    assert "auto" in str(info.value)
    assert [resolve_dtype("auto", d) for d in ("cuda", "cpu")] == ["bfloat16", "float32"]
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("float32", "cuda") == "float32"


def test_problem_prices_auto_by_device_type() -> None:
    graph = load_graph(str(EXAMPLES / "grpo.yaml"))  # no dtype given: auto
    cpu, cuda = problem_from_graph(graph), problem_from_graph(graph, device_type="cuda")
    assert {s.dtype_bytes for s in cpu.models.values()} == {4}
    assert {s.dtype_bytes for s in cuda.models.values()} == {2}
    explicit = load_graph(str(EXAMPLES / "grpo.yaml"), ["models.actor.dtype=float32"])
    assert problem_from_graph(explicit, device_type="cuda").models["actor"].dtype_bytes == 4


def test_cpu_build_of_auto_is_float32() -> None:
    assert _dtype(build_model(config=LLAMA, dtype="auto", seed=0)) == torch.float32
    spec = ModelSpec("actor", config=dict(LLAMA))
    assert _dtype(build_model_from_spec(spec, seed=0, device="cpu")) == torch.float32
    # the device it will run on decides, even when it is built on the CPU first (the runtime's workers)
    assert _dtype(build_model_from_spec(spec, seed=0, runs_on="cuda")) == torch.bfloat16
    assert _dtype(build_model(config=LLAMA, dtype="float32", seed=0, runs_on="cuda")) == torch.float32


def test_the_local_runtime_builds_auto_models_for_its_device() -> None:
    graph = load_graph(str(EXAMPLES / "grpo.yaml"))
    executor = LocalExecutor(graph, device=torch.device("cpu"))
    try:
        assert {name: _dtype(s.module) for name, s in executor.models.items()} == {
            "actor": torch.float32,
            "ref": torch.float32,
        }
    finally:
        executor.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_is_bfloat16_on_cuda() -> None:
    model = build_model(config=LLAMA, dtype="auto", seed=0, device="cuda")
    assert _dtype(model) == torch.bfloat16 and next(model.parameters()).is_cuda
    graph = load_graph(str(EXAMPLES / "grpo.yaml"))
    executor = LocalExecutor(graph, device=torch.device("cuda"))
    try:
        assert {_dtype(s.module) for s in executor.models.values()} == {torch.bfloat16}
    finally:
        executor.close()


def test_float16_is_refused_for_a_trainable_model() -> None:
    """Training in float16 without loss scaling reaches NaN within a few steps (fresh-user finding); the
    graph says so before anything runs. A frozen float16 model stays allowed."""
    with pytest.raises(GraphError, match=r"models\.actor\.dtype: float16 training overflows"):
        load_graph(str(EXAMPLES / "sft.yaml"), ["models.actor.dtype=float16"])
    load_graph(str(EXAMPLES / "ppo.yaml"), ["models.ref.dtype=float16"])
