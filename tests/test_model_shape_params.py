"""The planner's model shape counts the parameters Hugging Face builds (issue 14 follow-up, bug 1): an
explicit ``head_dim`` that differs from hidden / heads widens q and o (Gemma, Qwen3-style configs), grouped
-query attention narrows k and v, and a tied head is stored once. Each config is built on the meta device
(no memory) and its ``sum(p.numel())`` compared with ``ModelShape.num_params`` and ``param_shapes``.

Reproduce: ``python -m pytest -q tests/test_model_shape_params.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.planner.shapes import ModelShape

BASE = {"vocab_size": 19, "intermediate_size": 128, "num_hidden_layers": 2}
CONFIGS = {
    "llama mha": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4},
    "llama head_dim wider": {
        "model_type": "llama", "hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8,
        "head_dim": 4096,
    },
    "llama head_dim narrower, gqa": {
        "model_type": "llama", "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
        "head_dim": 8,
    },
    "llama gqa tied": {
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
    "llama head_dim null": {
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": None,
    },
    "mistral gqa head_dim": {
        "model_type": "mistral", "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 40, "tie_word_embeddings": False,
    },
}  # fmt: skip


def _hf_params(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k != "model_type"}
    with torch.device("meta"):  # shapes only: no memory for the 3 B-parameter config
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_planner_counts_hf_parameters(name: str) -> None:
    config = {**BASE, **CONFIGS[name]}
    real = _hf_params(config)
    shape = ModelShape.from_config(config)
    assert shape.num_params == sum(torch.Size(s).numel() for s in real.values())
    assert shape.param_shapes() == real  # same names (tied: no lm_head.weight) and shapes


def test_head_dim_in_shape_key() -> None:
    """Profiles are keyed by the shape: a non-default head dim is part of the key and read back."""
    plain = ModelShape.from_config({**BASE, **CONFIGS["llama mha"]})
    assert plain.key() == "h64-i128-l2-a4-kv4-v19"  # unchanged for existing profiles
    wide = ModelShape.from_config({**BASE, **CONFIGS["llama head_dim wider"]})
    assert wide.key().endswith("-d4096")
    assert ModelShape.from_key(wide.key()) == wide
    assert ModelShape.from_key(plain.key()) == plain


def test_gpt2_is_not_sized() -> None:
    """The planner models Llama-style decoders; a gpt2 config (``n_embd``, ``n_layer``) is not sized, so the
    memory check skips it rather than pricing a wrong shape; the error names the key."""
    with pytest.raises(PlanError, match=r"config\.n_embd: model_type 'gpt2'"):
        ModelShape.from_config(
            {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 19}
        )
