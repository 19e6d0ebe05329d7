"""A weight sync streamed unit by unit (``schedulers/runtime/distributed/stream_sync.py``), single process.

The units of a model's parameter names (goldens for Llama and GPT-2 names), and :class:`UnitStream` on a
tiny Llama (untied head) and GPT-2 (head tied to the embedding) whose parameters start on ``meta``: the
probe forward driven by the hooks, with ``fill`` copying each unit from a reference model, gives the
reference's logits bit for bit, fills every unit once in order, holds at most the largest unit (the tied
embedding until the head) and ends with every parameter freed. The runtime's streamed sync (reallocation +
engine load per unit) is tested with real engines in ``tests/test_engine_release.py``.
Reproduce: ``python -m pytest -q tests/test_stream_sync.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlflow.dataflow.model_spec import ModelSpec
from rlflow.nodes.models import build_model_from_spec
from rlflow.schedulers.runtime.distributed.stream_sync import UnitStream, move_params, unit_of, weight_units

LLAMA = {
    "model_type": "llama",
    "vocab_size": 19,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "tie_word_embeddings": False,
}
GPT2 = {"model_type": "gpt2", "vocab_size": 19, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 32}


def _model(config: dict[str, object], seed: int) -> nn.Module:
    return build_model_from_spec(ModelSpec(name="m", config=config), seed=seed, name="m").eval()


def test_units_of_llama_and_gpt2_names() -> None:
    assert unit_of("model.layers.11.self_attn.q_proj.weight") == "model.layers.11"
    assert unit_of("model.embed_tokens.weight") == "model.embed_tokens"
    assert unit_of("lm_head.weight") == "lm_head"
    assert unit_of("transformer.h.0.ln_1.bias") == "transformer.h.0"
    assert unit_of("scale") == ""
    names = [k for k, _ in _model(LLAMA, 0).named_parameters()]
    assert [u for u, _ in weight_units(names)] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    # every name in exactly one unit, in named_parameters order
    assert [n for _, group in weight_units(names) for n in group] == names
    gpt2 = [k for k, _ in _model(GPT2, 0).named_parameters()]
    assert [u for u, _ in weight_units(gpt2)] == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
    ]  # the tied head appears once, as the embedding


def _nbytes(params: dict[str, nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params.values())


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama-untied", "gpt2-tied"])
def test_the_probe_forward_fills_each_unit_once_and_holds_one_at_a_time(config: dict[str, object]) -> None:
    ref, target = _model(config, 1), _model(config, 2)
    ids = torch.randint(0, 19, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids, use_cache=False).logits
    source = dict(ref.named_parameters())
    move_params(target.parameters(), torch.device("meta"))
    units = weight_units(k for k, _ in target.named_parameters())
    filled: list[int] = []
    held: list[int] = []

    def fill(k: int, params: dict[str, nn.Parameter]) -> None:
        assert set(params) == set(units[k][1])
        with torch.no_grad():
            for name, p in params.items():
                assert not p.is_meta
                p.copy_(source[name])
        filled.append(k)
        held.append(sum(p.numel() * p.element_size() for p in target.parameters() if not p.is_meta))

    stream = UnitStream(target, units, fill, torch.device("cpu"))
    with stream, torch.no_grad():
        got = target(input_ids=ids, use_cache=False).logits
    stream.finish()
    assert torch.equal(got, want)
    assert filled == list(range(len(units)))
    assert all(p.is_meta for p in target.parameters())
    sizes = [_nbytes(stream.params[k]) for k in range(len(units))]
    assert stream.peak_bytes == max(held) < sum(sizes)
    if config is GPT2:  # the tied embedding stays until the head: it is held with every later unit
        emb = sizes[0]
        assert stream.peak_bytes == emb + max(s for s in sizes[1:])
    else:  # one unit at a time (the hook frees a unit after its module ran, before the next one fills)
        assert stream.peak_bytes == max(sizes)


def test_units_the_forward_does_not_reach_are_filled_by_finish() -> None:
    """A forward that uses only the embedding: ``finish`` fills the other units in order, then frees them."""
    target = _model(LLAMA, 2)
    move_params(target.parameters(), torch.device("meta"))
    units = weight_units(k for k, _ in target.named_parameters())
    filled: list[int] = []
    stream = UnitStream(target, units, lambda k, _p: filled.append(k), torch.device("cpu"))
    with stream, torch.no_grad():
        target.model.embed_tokens(torch.zeros(1, 2, dtype=torch.long))
    assert filled == [0]
    stream.finish()
    assert filled == list(range(len(units)))
    assert all(p.is_meta for p in target.parameters())
