"""The vLLM engine on CUDA (the ``vllm`` package): marked ``gpu``, skipped without CUDA or vLLM.

``scripts/gpu-check.sh`` runs these with every other ``gpu`` test and a short PPO run with vLLM generation.
The same checks as the CPU tests, on ``cuda:0``: greedy equals the built-in loop, sampled log-probs equal
the trainer's processed log-probs, a synced engine serves the new weights (probe-verified) and a
corrupted sync is caught, both with the engine in this process and in vLLM's engine-core process (weights
through vLLM's weight-transfer API, CUDA IPC backend).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "model_type": "llama",
    "vocab_size": 19,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "engine-core-process"])
def test_engine_on_cuda(in_process: bool) -> None:
    """In-process the engine's worker gets the trainer's CUDA tensors themselves; with its engine core in
    another process (as in a distributed worker) syncs go through vLLM's weight-transfer API (CUDA IPC)."""
    pytest.importorskip("vllm")
    from rlflow.dataflow.model_spec import ModelSpec
    from rlflow.nodes import rl
    from rlflow.nodes.engines.probe import WeightSyncError
    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.forward import response_logits
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import build_model_from_spec
    from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer

    model = build_model_from_spec(ModelSpec(name="actor", config=CONFIG), seed=0, name="actor").cuda().eval()
    tok = load_tokenizer(ROOT / "examples/arith/tokenizer")
    info = TokenizerInfo.from_tokenizer(tok)
    ids = torch.tensor([[1, 5, 6, 7, 8], [0, 0, 1, 9, 4]], device="cuda")
    mask = (torch.arange(5, device="cuda")[None] >= torch.tensor([[0], [2]], device="cuda")).long()
    engine = VllmEngine(
        model, tok, where="node 'actor_gen' (model 'actor')", max_rows=16, in_process=in_process
    )
    try:
        kw = {"top_k": None, "top_p": None, "max_new_tokens": 10, "stop_token_ids": [2], "pad_id": 0}
        got = engine.generate(ids, mask, n=2, temperature=1.0, greedy=True, **kw)  # type: ignore[arg-type]
        want = generate(model, info, ids, mask, n=2, max_new_tokens=10, greedy=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        gen = torch.Generator(device="cuda").manual_seed(0)
        resp, rmask, lp = engine.generate(ids, mask, n=4, temperature=0.7, greedy=False, generator=gen, **kw)  # type: ignore[arg-type]
        with torch.no_grad():
            logits = response_logits(
                model, ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0), resp, rmask
            )
        want_lp = rl.label_logprobs(logits.float(), resp, rmask, 0.7, None, None)
        assert float(((lp - want_lp).abs() * rmask).max()) < 1e-3
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        stats = engine.sync(model, model="actor", version=1)
        assert stats.probe_gap < 1e-3
        after = engine.generate(ids, mask, n=1, temperature=1.0, greedy=True, **kw)  # type: ignore[arg-type]
        assert torch.equal(after[0], generate(model, info, ids, mask, max_new_tokens=10, greedy=True)[0])
        state = dict(model.state_dict())
        state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"] + 1e-2
        engine.load_weights(list(state.items()))
        with pytest.raises(WeightSyncError, match="weight version 2"):
            engine.verify(model, model="actor", version=2)
    finally:
        engine.close()


def test_gpu_memory_utilization_reaches_the_cuda_engine() -> None:
    """On CUDA ``gpu_memory_utilization`` goes to vLLM as such (no ``kv_cache_memory_bytes``): vLLM sizes the
    KV cache from the share of the GPU after its weights and activation workspace, more than the row-sized
    cache of the same engine without it."""
    pytest.importorskip("vllm")
    from rlflow.dataflow.model_spec import ModelSpec
    from rlflow.nodes.engines.sizing import engine_kv_cache_bytes
    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.models import build_model_from_spec
    from rlflow.nodes.tokenizers import load_tokenizer

    model = build_model_from_spec(ModelSpec(name="actor", config=CONFIG), seed=0, name="actor").cuda().eval()
    tok = load_tokenizer(ROOT / "examples/arith/tokenizer")
    engine = VllmEngine(model, tok, where="node 'actor_gen' (model 'actor')", max_rows=16,
                        gpu_memory_utilization=0.3)  # fmt: skip
    try:
        cache = engine.llm.llm_engine.vllm_config.cache_config
        assert cache.gpu_memory_utilization == 0.3 and cache.kv_cache_memory_bytes is None
        per_token = 2 * 2 * 2 * 64 * 4  # 2 · layers · kv heads · head_dim · fp32 bytes
        assert cache.num_gpu_blocks * cache.block_size * per_token > engine_kv_cache_bytes(CONFIG, 4, 16)
    finally:
        engine.close()


def test_sleep_mode_frees_the_engine_memory_between_calls() -> None:
    """``enable_sleep_mode``: after :meth:`VllmEngine.sleep` the GPU has the engine's KV cache and weights
    back (free memory grows by at least the KV share), the next call wakes it and generates as before, and
    a weight sync into a sleeping engine wakes it and serves the new weights (probe-verified)."""
    pytest.importorskip("vllm")
    from rlflow.dataflow.model_spec import ModelSpec
    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.generation import generate
    from rlflow.nodes.models import build_model_from_spec
    from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer

    model = build_model_from_spec(ModelSpec(name="actor", config=CONFIG), seed=0, name="actor").cuda().eval()
    tok = load_tokenizer(ROOT / "examples/arith/tokenizer")
    info = TokenizerInfo.from_tokenizer(tok)
    ids = torch.tensor([[1, 5, 6, 7, 8], [0, 0, 1, 9, 4]], device="cuda")
    mask = (torch.arange(5, device="cuda")[None] >= torch.tensor([[0], [2]], device="cuda")).long()
    engine = VllmEngine(model, tok, where="node 'actor_gen' (model 'actor')", max_rows=16,
                        gpu_memory_utilization=0.3, sleep_mode=True, in_process=False)  # fmt: skip
    try:
        kw = {"top_k": None, "top_p": None, "max_new_tokens": 10, "stop_token_ids": [2], "pad_id": 0}
        first = engine.generate(ids, mask, n=1, temperature=1.0, greedy=True, **kw)  # type: ignore[arg-type]
        awake_free = torch.cuda.mem_get_info()[0]
        engine.sleep()
        assert engine.asleep
        freed = torch.cuda.mem_get_info()[0] - awake_free
        assert freed > 0.2 * torch.cuda.mem_get_info()[1]  # most of the 0.3 share comes back
        again = engine.generate(ids, mask, n=1, temperature=1.0, greedy=True, **kw)  # type: ignore[arg-type]
        assert not engine.asleep and torch.equal(again[0], first[0])
        engine.sleep()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        assert engine.sync(model, model="actor", version=1).probe_gap < 1e-3
        after = engine.generate(ids, mask, n=1, temperature=1.0, greedy=True, **kw)  # type: ignore[arg-type]
        assert torch.equal(after[0], generate(model, info, ids, mask, max_new_tokens=10, greedy=True)[0])
    finally:
        engine.close()
