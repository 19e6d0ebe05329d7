"""Bad input a new user hit (issue 39): each one line from `rlflow validate` naming the file, model and key,
before any layout rule or plan check reads the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlflow.schedulers.cli import main


def _validate(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str]:
    code = main(["validate", "examples/grpo.yaml", *overrides])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(
    ("override", "key", "why"),
    [
        ("vocab_size=0", "vocab_size", "0 must be a positive integer"),
        # blamed on the plan's layout before ('pp=1 pipeline stages but ... -3 layers')
        ("num_hidden_layers=-3", "num_hidden_layers", "-3 must be a positive integer"),
        ("hidden_size=2.5", "hidden_size", "2.5 must be a positive integer"),
        ("num_key_value_heads=true", "num_key_value_heads", "True must be a positive integer"),
        # examples/grpo.yaml's vocab_size is 19: ids 0..18
        (
            "eos_token_id=19",
            "eos_token_id",
            "token id 19 is outside the vocabulary (vocab_size 19: ids 0..18)",
        ),
    ],
)
def test_config_sizes_refused_naming_the_key(
    capsys: pytest.CaptureFixture[str], override: str, key: str, why: str
) -> None:
    code, err = _validate(capsys, f"models.actor.config.{override}")
    assert code == 2
    assert err == f"error: examples/grpo.yaml: models.actor.config.{key}: {why}"


def test_vocab_smaller_than_tokenizer_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # examples/arith/tokenizer holds 19 tokens (ids 0..18): a 10-row embedding misses ids 10..18
    code, err = _validate(capsys, "models.actor.config.vocab_size=10")
    assert code == 2
    assert err == (
        "error: examples/grpo.yaml: models.actor.config.vocab_size: 10 is smaller than the vocabulary of its "
        "tokenizer 'examples/arith/tokenizer' (19 tokens): token ids 10..18 would index past the embedding "
        "table"
    )


def test_corrupt_config_json_names_file_line_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n x')
    code, err = _validate(capsys, "models.actor.config=null", f"models.actor.path={tmp_path}")
    assert code == 2
    assert err == (
        f"error: examples/grpo.yaml: models.actor.path: {tmp_path}/config.json: not valid JSON "
        "(line 2 column 2: Expecting property name enclosed in double quotes)"
    )
    assert "\n" not in err
