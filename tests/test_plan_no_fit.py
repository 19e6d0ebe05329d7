"""``rlflow plan``'s refusal of a node that fits nowhere (``planner/no_fit.py``) names only changes that fit:
on an activation-bound train node it says recompute was already on, suggests no more hosts (activations
do not shard over data-parallel ranks) and suggests the largest ``max_new_tokens`` that fits, which,
applied, plans."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlflow.schedulers.cli import main
from tests.graph_helpers import base, dump, put

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "schedulers/planner/clusters/h100-8x.yaml"


def _plan(tmp: Path, tokens: int, *extra: str) -> int:
    """``rlflow plan`` of a GRPO graph of a 0.1B-parameter Llama (8 layers, hidden 1024; built-in
    generation) with responses of ``tokens`` on one 8 GB device per host (the h100-8x preset's rates)."""
    cfg = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
           "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000,
           "max_position_embeddings": 131072}  # fmt: skip
    raw: dict[str, Any] = put(put(base(), "nodes.train.args", {}), "models.actor.config", cfg)
    raw = put(put(raw, "nodes.gen.engine", "builtin"), "nodes.gen.args.max_new_tokens", tokens)
    (tmp / "g.yaml").write_text(dump(raw))
    data = yaml.safe_load(PRESET.read_text())
    data.update(name="tiny", devices_per_host=1)
    data["device"]["memory_bytes"] = 8e9
    (tmp / "c.yaml").write_text(yaml.safe_dump(data))
    argv = ["plan", str(tmp / "g.yaml"), "--cluster", str(tmp / "c.yaml"), "--out", str(tmp / "p.yaml")]
    argv += ["--prompt-len", "64", "--restarts", "1", "--steps", "50", "--gantt", str(tmp / "p.png")]
    return main([*argv, *extra])


def test_an_activation_bound_refusal_suggests_a_length_that_plans_and_no_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(ROOT)
    # 35,000-token responses: one row's activations (recompute on) are more than a device holds, on any
    # number of hosts: 8 hosts are refused too
    assert _plan(tmp_path, 35000, "--hosts", "8") == 2
    capsys.readouterr()
    assert _plan(tmp_path, 35000, "--hosts", "1") == 2
    message = capsys.readouterr().err
    assert "node 'train'" in message and "with activation recomputation" in message
    assert "--hosts" not in message and "more devices" not in message
    assert not re.search(r"\. [a-z]", message.replace("e.g. ", ""))  # every sentence starts upper-case
    found = re.search(r"nodes\.gen\.args\.max_new_tokens: (\d+)\)", message)
    assert found is not None, message
    tokens = int(found.group(1))
    assert 0 < tokens < 35000
    # applied, it plans; one token more is refused (the largest that fits)
    assert _plan(tmp_path, tokens, "--hosts", "1") == 0
    assert _plan(tmp_path, tokens + 1, "--hosts", "1") == 2
