"""A small valid graph (GRPO-shaped, 4 prompts × 2 samples, 8 devices) for graph tests to mutate."""

from __future__ import annotations

import copy
from typing import Any

import yaml

SEQ = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]

BASE: dict[str, Any] = {
    "models": {
        "actor": {
            "config": {"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 4,
                       "num_hidden_layers": 2},
            "tokenizer": "examples/arith/tokenizer",  # a directory: a name like 'tok' would be a Hub id
        },
        "ref": {"init_from": "actor", "trainable": False},
    },
    "data": {
        "generator": {"name": "arith", "args": {"digits": 2}},
        "fields": {"prompt": "question", "answer": "answer"},
        "tokenize": ["prompt"],
        "tokenizer": "actor",
    },
    "algorithm": {"n": 2, "prompts": 4},
    "nodes": {
        "gen": {
            "model": "actor", "kind": "generate", "function": "generate",
            "inputs": ["prompt_ids", "prompt_mask"], "outputs": ["response_ids", "response_mask", "logprobs"],
            "batch_size": "${algorithm.prompts}", "args": {"n": "${algorithm.n}"},
        },
        "reward": {
            "kind": "inference", "function": "rule_reward",
            "inputs": ["response_ids", "response_mask", "answer"],
            "outputs": ["scores"], "batch_size": 8, "batch_unit": "samples", "args": {"fn": "arith_exact"},
        },
        "ref": {
            "model": "ref", "kind": "inference", "function": "logprobs", "inputs": SEQ,
            "outputs": {"logprobs": "ref_logprobs"}, "batch_size": 4,
        },
        "train": {
            "model": "actor", "kind": "train", "function": "grpo_actor",
            "inputs": [*SEQ, "logprobs", "ref_logprobs", "scores"], "batch_size": 4, "args": {"lr": 1.0e-5},
        },
    },
    "run": {"iterations": 2, "devices": 8},
}  # fmt: skip


def base() -> dict[str, Any]:
    """A deep copy of :data:`BASE`."""
    return copy.deepcopy(BASE)


def put(raw: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set ``raw[a][b]... = value`` for dotted ``path``; the value ``DELETE`` removes the key."""
    *head, last = path.split(".")
    d = raw
    for k in head:
        d = d.setdefault(k, {})
    if value is DELETE:
        del d[last]
    else:
        d[last] = value
    return raw


DELETE = object()


def dump(raw: dict[str, Any]) -> str:
    """YAML text of ``raw``."""
    return yaml.safe_dump(raw, sort_keys=False)
