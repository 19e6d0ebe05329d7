"""A model config written in the graph file is checked as transformers would build it (nodes/model_config.py,
the run-level check ``models.config``): a misspelt key, which transformers keeps as an attribute nothing reads
(the model silently takes the default), is refused naming file, model and key; keys transformers reads or
converts are not. Mistakes in the MoE fields name the field that is wrong and never end in a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.dataflow.errors import PlanError
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.architectures import read_architecture

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _validate(capsys: pytest.CaptureFixture[str], graph: str, *overrides: str) -> tuple[int, str]:
    code = main(["validate", graph, *overrides])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(
    ("graph", "override", "message"),
    [
        (
            "examples/moe/grpo.yaml",
            "models.actor.config.num_expert=4",
            "examples/moe/grpo.yaml: models.actor.config.num_expert: not a setting of transformers' "
            "qwen3_moe config (it would be ignored and the default used); did you mean 'num_experts'?",
        ),
        (
            "examples/grpo.yaml",
            "models.actor.config.num_hidden_layer=3",
            "models.actor.config.num_hidden_layer: not a setting of transformers' llama config",
        ),
        (  # Mixtral's experts are intermediate_size wide (its num_experts maps onto num_local_experts)
            "examples/moe/grpo.yaml",
            "models.actor.config.model_type=mixtral",
            "models.actor.config.moe_intermediate_size: not a setting of transformers' mixtral config",
        ),
        (  # a key of Mixtral's config is nothing to Qwen3-MoE's
            "examples/moe/grpo.yaml",
            "models.actor.config.router_jitter_noise=0.1",
            "models.actor.config.router_jitter_noise: not a setting of transformers' qwen3_moe config",
        ),
    ],
)
def test_a_key_transformers_would_ignore_is_refused(
    graph: str, override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _validate(capsys, graph, override)
    assert code != 0 and message in out, out
    assert "Traceback" not in out


def test_keys_transformers_reads_or_converts_pass(capsys: pytest.CaptureFixture[str]) -> None:
    """head_dim (read by Qwen3-MoE's modeling code with getattr, not a config field) and rope_theta (moved
    into rope_parameters when the config is built) are real settings."""
    code, out = _validate(
        capsys,
        "examples/moe/grpo.yaml",
        "models.actor.config.head_dim=32",
        "models.actor.config.rope_theta=5e5",
    )
    assert code == 0, out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "models.actor.config.num_experts=-4",
            "models.actor.config.num_experts: -4 experts (need at least 1)",
        ),
        (
            "models.actor.config.num_experts=four",
            "models.actor: invalid model config (model_type 'qwen3_moe'): Field 'num_experts' expected int",
        ),
        (
            "models.actor.config.num_experts_per_tok=8",
            "models.actor.config.num_experts_per_tok: 8 experts per token of 4 experts (need 1 <= K <= E)",
        ),
    ],
)
def test_moe_field_mistakes_name_the_wrong_field(
    override: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _validate(capsys, "examples/moe/grpo.yaml", override)
    assert code != 0 and message in out, out
    assert "Traceback" not in out


def test_the_planner_refuses_a_field_that_is_no_number() -> None:
    config = {"model_type": "qwen3_moe", "num_experts": "four", "num_experts_per_tok": 2}
    with pytest.raises(PlanError, match=r"config: a field is not a number the planner can read"):
        read_architecture(config)
