"""Models: config/dir loading, heads, save/load round trip, tied vs untied heads, input helpers."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlflow.dataflow.errors import ModelError
from rlflow.nodes.forward import (
    forward_logits,
    forward_scores,
    forward_values,
    last_token_index,
    response_logits,
    response_scores,
    response_values,
    sequence_inputs,
)
from rlflow.nodes.models import HEAD_META_FILE, HeadModel, build_model, model_head, save_pretrained
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer


def build(**kwargs: Any) -> Any:
    """build_model typed loosely: tests reach into HF attributes."""
    return build_model(**kwargs)


ARITH_TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "arith" / "tokenizer"

LLAMA = {
    "model_type": "llama",
    "vocab_size": 32,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
QWEN2 = {**LLAMA, "model_type": "qwen2"}
GPT2 = {"model_type": "gpt2", "vocab_size": 32, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64}

# Two left-padded prompts (P=4) and right-padded responses (R=3); pad id 0.
PROMPT = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
RESPONSE = torch.tensor([[3, 4, 0], [5, 6, 7]])


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return PROMPT, (PROMPT != 0).long(), RESPONSE, (RESPONSE != 0).long()


def test_sequence_inputs_positions() -> None:
    ids, mask, pos = sequence_inputs(*_batch())
    assert ids.tolist() == [[0, 0, 5, 6, 3, 4, 0], [7, 8, 9, 10, 5, 6, 7]]
    assert mask.tolist() == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]
    # cumsum(mask) - 1 clamped at 0: row 0 cumsum = [0,0,1,2,3,4,4] -> [0,0,0,1,2,3,3]
    assert pos.tolist() == [[0, 0, 0, 1, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6]]
    assert last_token_index(mask).tolist() == [5, 6]


@pytest.mark.parametrize("config", [LLAMA, QWEN2, GPT2], ids=["llama", "qwen2", "gpt2"])
def test_config_init_seeded_and_response_logits(config: dict[str, object]) -> None:
    a = build(config=config, seed=3)
    b = build(config=config, seed=3)
    c = build(config=config, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a.parameters(), c.parameters(), strict=True))
    assert model_head(a) == "lm"
    a.eval()
    full = forward_logits(a, *sequence_inputs(*_batch()))
    assert full.shape == (2, 7, 32)
    resp = response_logits(a, *_batch())
    # response token t is predicted from full position P+t-1 = 3+t
    torch.testing.assert_close(resp, full[:, 3:6], rtol=1e-5, atol=1e-5)


def test_left_padding_does_not_change_logits() -> None:
    model = build(config=LLAMA, seed=0).eval()
    pr, pm, rr, rm = _batch()
    # Row 0 without padding: prompt [5,6], response [3,4]
    short = response_logits(model, pr[:1, 2:], pm[:1, 2:], rr[:1, :2], rm[:1, :2])
    padded = response_logits(model, pr[:1], pm[:1], rr[:1], rm[:1])[:, :2]
    torch.testing.assert_close(padded, short, rtol=1e-5, atol=1e-5)


def test_value_and_score_heads() -> None:
    actor = build(config=LLAMA, seed=0)
    critic = build(init_from=actor, head="value", seed=1)
    assert isinstance(critic, HeadModel) and model_head(critic) == "value"
    # the critic's backbone starts as a copy of the actor's backbone (not shared)
    a_emb: Any = actor.get_input_embeddings().weight
    backbone: Any = critic.backbone
    c_emb: Any = backbone.get_input_embeddings().weight
    assert torch.equal(a_emb, c_emb) and a_emb.data_ptr() != c_emb.data_ptr()
    critic.eval()
    ids, mask, pos = sequence_inputs(*_batch())
    values = forward_values(critic, ids, mask, pos)
    assert values.shape == (2, 7) and values.dtype == torch.float32
    scores = forward_scores(critic, ids, mask, pos)
    # the score is the value at the last real token: positions 5 and 6
    torch.testing.assert_close(scores, torch.stack([values[0, 5], values[1, 6]]))
    torch.testing.assert_close(response_values(critic, *_batch()), values[:, 3:6])
    torch.testing.assert_close(response_scores(critic, *_batch()), scores)
    with pytest.raises(ModelError, match="'value' or 'score' head"):
        forward_values(actor, ids, mask, pos)


def test_head_model_save_and_reload(tmp_path: Path) -> None:
    rm = build(config=GPT2, head="score", seed=0).eval()
    with torch.no_grad():
        rm.value_head.bias.fill_(0.25)
    save_pretrained(rm, None, tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / HEAD_META_FILE).read_text())["head"] == "score"
    again = build(path=tmp_path / "rm", head="score").eval()
    torch.testing.assert_close(response_scores(again, *_batch()), response_scores(rm, *_batch()))
    # a reward-model directory may seed a critic (same head shape)
    critic = build(path=tmp_path / "rm", head="value")
    assert torch.equal(critic.value_head.bias, rm.value_head.bias)
    with pytest.raises(ModelError, match="'score' head"):
        build(path=tmp_path / "rm", head="lm")


def test_lm_head_model_from_lm_dir_gets_fresh_head(tmp_path: Path) -> None:
    lm = build(config=LLAMA, seed=0)
    save_pretrained(lm, None, tmp_path / "lm")
    critic = build(path=tmp_path / "lm", head="value", seed=0)
    for name, p in lm.model.named_parameters():
        assert torch.equal(p, critic.backbone.get_parameter(name)), name


def _two_dim_llama(tied: bool) -> Any:
    cfg = {
        **LLAMA,
        "vocab_size": 3,
        "hidden_size": 2,
        "intermediate_size": 4,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "tie_word_embeddings": tied,
    }
    model = build(config=cfg, seed=0)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]))
        if not tied:
            model.get_output_embeddings().weight.copy_(torch.tensor([[0.5, 0.5], [2.0, 0.0], [0.0, -1.0]]))
    return model


def test_a_save_imports_deepspeed_only_once_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' save unwraps through accelerate, which imports deepspeed (~1.6 CPU s) whenever it is
    installed; rlflow's save skips that check until deepspeed is imported (no model can be wrapped before)."""
    from accelerate.utils import other

    asked: list[bool] = []

    def installed() -> bool:  # deepspeed installed, as accelerate would find it
        asked.append(True)
        return True

    monkeypatch.setattr(other, "is_deepspeed_available", installed)
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    model = _two_dim_llama(tied=True)
    save_pretrained(model, None, tmp_path / "a")
    assert asked == [] and "deepspeed" not in sys.modules
    assert other.is_deepspeed_available is installed  # put back after the save
    # once deepspeed is imported (here a stand-in with its engine class), the wrapper check runs as before
    monkeypatch.setitem(sys.modules, "deepspeed", types.SimpleNamespace(DeepSpeedEngine=type("E", (), {})))
    save_pretrained(model, None, tmp_path / "b")
    assert asked == [True]
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_untied_head_stays_untied_golden(tmp_path: Path) -> None:
    model = _two_dim_llama(tied=False)
    save_pretrained(model, None, tmp_path / "untied")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "untied"))
    h = torch.tensor([1.0, 2.0])
    # head @ h = [0.5*1+0.5*2, 2*1+0*2, 0*1-1*2] = [1.5, 2, -2]; the embedding would give [1, 2, 3]
    with torch.no_grad():
        logits = loaded.get_output_embeddings()(h)
    torch.testing.assert_close(logits, torch.tensor([1.5, 2.0, -2.0]))
    out_w: Any = loaded.get_output_embeddings().weight
    in_w: Any = loaded.get_input_embeddings().weight
    assert out_w.data_ptr() != in_w.data_ptr()
    # rlflow's own loader agrees
    ours = build(path=tmp_path / "untied")
    with torch.no_grad():
        torch.testing.assert_close(ours.get_output_embeddings()(h), torch.tensor([1.5, 2.0, -2.0]))


def test_tied_head_stays_tied(tmp_path: Path) -> None:
    model = _two_dim_llama(tied=True)
    save_pretrained(model, None, tmp_path / "tied")
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "tied"))
    out_w: Any = loaded.get_output_embeddings().weight
    in_w: Any = loaded.get_input_embeddings().weight
    assert out_w.data_ptr() == in_w.data_ptr()
    # embedding @ h = [1*1+0*2, 0*1+1*2, 1*1+1*2] = [1, 2, 3]
    with torch.no_grad():
        logits = loaded.get_output_embeddings()(torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(logits, torch.tensor([1.0, 2.0, 3.0]))


def test_init_from_copies_weights_and_dtype() -> None:
    actor = build(config=GPT2, seed=0)
    ref = build(init_from=actor, dtype="bfloat16")
    assert model_head(ref) == "lm" and next(ref.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        next(actor.parameters()).add_(1.0)  # training the actor must not move the ref
    assert not torch.equal(next(actor.parameters()).bfloat16(), next(ref.parameters()))
    # GPT-2 ties its head: the copy keeps the tie
    assert ref.get_output_embeddings().weight.data_ptr() == ref.get_input_embeddings().weight.data_ptr()


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="nowhere"):
        build(path=tmp_path / "nowhere", name="actor")
    with pytest.raises(ModelError, match=r"model 'critic'.*model_type"):
        build(config={"hidden_size": 8}, name="critic")
    with pytest.raises(ModelError, match="unknown head"):
        build(config=LLAMA, head="policy")
    with pytest.raises(ModelError, match="dtype"):
        build(config=LLAMA, dtype="float8")
    with pytest.raises(ModelError, match="'path', 'config' or 'init_from'"):
        build()


def test_load_tokenizer(tmp_path: Path) -> None:
    tok = load_tokenizer(ARITH_TOKENIZER)
    info = TokenizerInfo.from_tokenizer(tok)
    assert (info.pad_id, info.bos_id, info.eos_id) == (0, 1, 2)
    assert tok.padding_side == "left"
    with pytest.raises(ModelError, match="tokenizer directory"):
        load_tokenizer(tmp_path / "missing")
    tok.pad_token = None
    tok.save_pretrained(str(tmp_path / "nopad"))
    with pytest.raises(ModelError, match="no pad"):
        load_tokenizer(tmp_path / "nopad")
    assert load_tokenizer(tmp_path / "nopad", pad_from_eos=True).pad_token_id == 2


def test_save_with_tokenizer_loads_back(tmp_path: Path) -> None:
    model = build(config={**LLAMA, "vocab_size": 19}, seed=0)
    save_pretrained(model, load_tokenizer(ARITH_TOKENIZER), tmp_path / "ckpt")
    tok = load_tokenizer(tmp_path / "ckpt")
    assert tok.eos_token_id == 2
    loaded = build(path=tmp_path / "ckpt")
    for (n1, p1), (_, p2) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(p1, p2), n1
