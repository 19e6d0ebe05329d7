"""Generation: sampler log-probs vs teacher forcing, greedy, stop tokens, n samples, determinism."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.forward import response_logits
from rlflow.nodes.generation import decode_responses, generate
from rlflow.nodes.models import build_model
from rlflow.nodes.rl.logprobs import label_logprobs
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer


def build(**kwargs: Any) -> Any:
    """build_model typed loosely: tests reach into HF attributes."""
    return build_model(**kwargs)


PAD, EOS = 0, 2
INFO = TokenizerInfo(pad_id=PAD, eos_id=EOS, bos_id=1)
LLAMA = {
    "model_type": "llama",
    "vocab_size": 24,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 24,
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
}

# Three left-padded prompts of lengths 2, 4, 3 (pad 0).
PROMPTS = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]])
MASK = (PROMPTS != 0).long()


def _teacher_forced(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int, **sampling: Any
) -> torch.Tensor:
    p_ids, p_mask = PROMPTS.repeat_interleave(n, 0), MASK.repeat_interleave(n, 0)
    with torch.no_grad():
        logits = response_logits(model.eval(), p_ids, p_mask, ids, mask)
    return label_logprobs(logits, ids, mask, **sampling)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}, {"temperature": 1.3, "top_p": 0.8}]
)
def test_sampler_logprobs_match_teacher_forcing(config: dict[str, Any], sampling: dict[str, Any]) -> None:
    model = build(config=config, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids, mask, logps = generate(model, INFO, PROMPTS, MASK, n=2, max_new_tokens=6, generator=gen, **sampling)
    assert ids.shape == mask.shape == logps.shape == (6, 6)
    assert logps.dtype == torch.float32
    ref = _teacher_forced(model, ids, mask, 2, **sampling)
    torch.testing.assert_close(logps, ref, rtol=0, atol=1e-5)
    assert torch.all(logps[mask.bool()] <= 0) and torch.all(logps[~mask.bool()] == 0)


def test_greedy_is_argmax_and_unprocessed_logprobs() -> None:
    model = build(config=LLAMA, seed=1)
    ids, mask, logps = generate(model, INFO, PROMPTS, MASK, greedy=True, max_new_tokens=5, temperature=0.5)
    with torch.no_grad():
        logits = response_logits(model.eval(), PROMPTS, MASK, ids, mask)
    real = mask.bool()
    assert torch.equal(logits.argmax(-1)[real], ids[real])
    # greedy log-probs are of the unprocessed distribution (temperature 1), whatever temperature says
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(logps[real], ref[real], rtol=0, atol=1e-5)
    # temperature 0 means greedy
    ids0, _, _ = generate(model, INFO, PROMPTS, MASK, temperature=0.0, max_new_tokens=5)
    assert torch.equal(ids0, ids)


def _biased_model(favourite: int) -> Any:
    """A model whose output bias makes ``favourite`` (almost) certain at every step."""
    model = build(config={**LLAMA, "mlp_bias": False}, seed=0)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight.zero_()
        head.bias = torch.nn.Parameter(torch.full((24,), -30.0))
        head.bias[favourite] = 30.0
    return model


def test_stops_at_eos_and_pads_after() -> None:
    model = _biased_model(EOS)
    ids, mask, logps = generate(model, INFO, PROMPTS, MASK, n=2, max_new_tokens=4)
    # every row emits EOS first: it is inside the mask; pad (mask 0, log-prob 0) after
    assert ids[:, 0].tolist() == [EOS] * 6 and mask[:, 0].tolist() == [1] * 6
    assert torch.all(ids[:, 1:] == PAD) and torch.all(mask[:, 1:] == 0) and torch.all(logps[:, 1:] == 0)
    # without padding to max_new_tokens the width is the longest response
    ids2, _, _ = generate(model, INFO, PROMPTS, MASK, max_new_tokens=4, pad_to_max=False)
    assert ids2.shape == (3, 1)


def test_stop_token_and_max_new_tokens() -> None:
    model = _biased_model(7)
    ids, mask, _ = generate(model, INFO, PROMPTS, MASK, max_new_tokens=3)
    assert ids.tolist() == [[7, 7, 7]] * 3 and mask.tolist() == [[1, 1, 1]] * 3  # stopped by the length
    ids, mask, _ = generate(model, INFO, PROMPTS, MASK, max_new_tokens=3, stop_token_ids=[7])
    assert ids.tolist() == [[7, PAD, PAD]] * 3 and mask.tolist() == [[1, 0, 0]] * 3


def test_rows_stop_independently() -> None:
    model = build(config=LLAMA, seed=2)
    gen = torch.Generator().manual_seed(5)
    ids, mask, logps = generate(
        model, INFO, PROMPTS, MASK, n=4, max_new_tokens=8, generator=gen, stop_token_ids=[3, 4, 5, 6]
    )
    lengths = mask.sum(1)
    for row, row_mask, length in zip(ids, mask, lengths, strict=True):
        k = int(length)
        assert torch.all(row_mask[:k] == 1)
        body = row[:k].tolist()
        # only the last real token may be a stop token; everything after is padding
        assert not any(t in (EOS, 3, 4, 5, 6) for t in body[:-1])
        assert k == 8 or body[-1] in (EOS, 3, 4, 5, 6)
        assert torch.all(row[k:] == PAD)
    assert len(set(lengths.tolist())) > 1  # rows ended at different steps in this seeded draw
    torch.testing.assert_close(logps, _teacher_forced(model, ids, mask, 4), rtol=0, atol=1e-5)


@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("sampling", [{"n": 4}, {"n": 1, "top_k": 5}, {"n": 3, "greedy": True}])
def test_compact_loop_gives_the_uncompacted_samples(config: dict[str, Any], sampling: dict[str, Any]) -> None:
    """One prefill per prompt and finished rows out of the decode forwards: the same draws and log-probs."""
    model = build(config=config, seed=2)
    stop = [3, 4, 5, 6]  # rows end at different steps
    out = {}
    for compact in (True, False):
        gen = torch.Generator().manual_seed(5)
        out[compact] = generate(
            model, INFO, PROMPTS, MASK, max_new_tokens=8, generator=gen, stop_token_ids=stop,
            compact=compact, **sampling,
        )  # fmt: skip
    assert len(set(out[True][1].sum(1).tolist())) > 1
    assert torch.equal(out[True][0], out[False][0]) and torch.equal(out[True][1], out[False][1])
    torch.testing.assert_close(out[True][2], out[False][2], rtol=0, atol=1e-6)


def test_n_samples_interleaved_and_seeded() -> None:
    model = build(config=LLAMA, seed=0)
    # prompt i's n samples are rows i*n .. i*n+n-1: compare against generating each prompt alone
    together = generate(model, INFO, PROMPTS, MASK, n=3, max_new_tokens=4, greedy=True)[0]
    for i in range(3):
        alone = generate(
            model,
            INFO,
            PROMPTS[i : i + 1, MASK[i].argmax() :],
            MASK[i : i + 1, MASK[i].argmax() :],
            n=3,
            max_new_tokens=4,
            greedy=True,
        )[0]
        assert torch.equal(together[3 * i : 3 * i + 3], alone)
    a = generate(
        model, INFO, PROMPTS, MASK, n=3, max_new_tokens=4, generator=torch.Generator().manual_seed(9)
    )
    b = generate(
        model, INFO, PROMPTS, MASK, n=3, max_new_tokens=4, generator=torch.Generator().manual_seed(9)
    )
    c = generate(
        model, INFO, PROMPTS, MASK, n=3, max_new_tokens=4, generator=torch.Generator().manual_seed(10)
    )
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])


def test_mode_restored_and_bad_args() -> None:
    model = build(config=LLAMA, seed=0).train()
    generate(model, INFO, PROMPTS, MASK, max_new_tokens=1)
    assert model.training
    with pytest.raises(NodeError, match="temperature"):
        generate(model, INFO, PROMPTS, MASK, temperature=-1.0)
    with pytest.raises(NodeError, match="top_p"):
        generate(model, INFO, PROMPTS, MASK, top_p=0.0)
    with pytest.raises(NodeError, match="n \\(samples"):
        generate(model, INFO, PROMPTS, MASK, n=0)
    ids, _, _ = generate(model, INFO, PROMPTS, MASK, max_new_tokens=0)
    assert ids.shape == (3, 0)


def test_decode_responses_with_arith_tokenizer() -> None:
    tok = load_tokenizer(Path(__file__).resolve().parents[1] / "examples" / "arith" / "tokenizer")
    ids = torch.tensor([[8, 10, 2, 0], [5, 0, 0, 0]])  # "46<eos>", "1"
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert decode_responses(tok, ids, mask) == ["46", "1"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_generate_on_cuda(dtype: str) -> None:
    model = build(config=LLAMA, seed=0, dtype=dtype, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    top_p = 0.9 if dtype == "float32" else None  # bf16 noise could move a token across the nucleus edge
    prompts, mask = PROMPTS.cuda(), MASK.cuda()
    ids, rmask, logps = generate(
        model, INFO, prompts, mask, n=2, max_new_tokens=6, generator=gen, top_p=top_p
    )
    assert ids.device.type == "cuda" and logps.dtype == torch.float32
    with torch.no_grad():
        logits = response_logits(
            model.eval(), prompts.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), ids, rmask
        )
    ref = label_logprobs(logits, ids, rmask, top_p=top_p)
    # fp32 on GPU: kernels differ between cached and full passes; bf16 only roughly agrees
    tol = 1e-4 if dtype == "float32" else 0.1
    torch.testing.assert_close(logps, ref, rtol=0, atol=tol)
