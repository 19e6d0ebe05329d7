"""Context length (issue 14, item 4): ``max_new_tokens`` against the model's ``max_position_embeddings`` at
validation, and over-long prompts in the data: an error naming the data file, row and length, or dropped /
truncated by ``data.overlong``.

Reproduce: ``python -m pytest -q tests/test_context_length.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlflow.dataflow.context import fitted_splits, max_positions, prompt_limit
from rlflow.dataflow.data import PromptStream
from rlflow.dataflow.errors import DataError, GraphError
from rlflow.dataflow.loader import load_graph
from rlflow.nodes.tokenizers import data_tokenizer
from rlflow.schedulers.cli import main
from rlflow.schedulers.runtime.evaluation import truncation

GRPO = "examples/grpo.yaml"  # actor: max_position_embeddings 64; actor_gen: max_new_tokens 8


def test_max_new_tokens_beyond_positions_is_a_graph_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(GraphError) as err:
        load_graph(GRPO, ["nodes.actor_gen.args.max_new_tokens=1000"])
    msg = str(err.value)
    assert msg.startswith("examples/grpo.yaml: nodes.actor_gen.args.max_new_tokens: 1000 new tokens")
    assert "max_position_embeddings=64 of model 'actor'" in msg and "at most 63" in msg
    assert main(["validate", GRPO, "nodes.actor_gen.args.max_new_tokens=1000"]) == 2
    assert "nodes.actor_gen.args.max_new_tokens" in capsys.readouterr().err
    # a declared prompt length counts: 60 + 8 > 64
    with pytest.raises(
        GraphError,
        match=r"8 new tokens and data\.max_prompt_tokens=60 exceed.*at most 4 or "
        r"data\.max_prompt_tokens to at most 56$",
    ):
        load_graph(GRPO, ["data.max_prompt_tokens=60"])
    # a prompt bound that fills the positions alone is the key named, with a bound that fits (not a negative)
    with pytest.raises(GraphError) as err:
        load_graph(GRPO, ["data.max_prompt_tokens=100"])
    assert str(err.value).startswith(
        "examples/grpo.yaml: data.max_prompt_tokens: 100 prompt tokens leave no room"
    )
    assert str(err.value).endswith("lower data.max_prompt_tokens to at most 56")
    load_graph(GRPO, ["nodes.actor_gen.args.max_new_tokens=63"])  # exactly fills the context


def test_absent_positions_take_the_hugging_face_default() -> None:
    graph = load_graph(GRPO, ["models.actor.config.max_position_embeddings=null"])
    assert max_positions(graph, "actor") == 2048  # LlamaConfig's default
    assert max_positions(graph, "ref") == 2048  # ref: init_from actor
    with pytest.raises(GraphError, match="max_position_embeddings=2048"):
        load_graph(
            GRPO,
            ["models.actor.config.max_position_embeddings=null", "nodes.actor_gen.args.max_new_tokens=3000"],
        )


def _data(tmp_path: Path, prompts: list[str]) -> list[str]:
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return ["data.generator=null", f"data.train={path}"]


# The arith tokenizer gives one token per character, plus BOS: "12+34=" is 7 tokens, "1" * 400 is 401.
PROMPTS = ["12+34="] * 9 + ["1" * 400] + ["56-7="] * 6


def test_overlong_row_is_an_error_naming_file_row_and_length(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    over = _data(tmp_path, PROMPTS)
    graph = load_graph(GRPO, over)
    assert prompt_limit(graph) == (56, "model 'actor' has 64 positions and node 'actor_gen' generates 8")
    with pytest.raises(DataError) as err:
        fitted_splits(graph, data_tokenizer(graph, {}))
    assert f"data '{tmp_path / 'd.jsonl'}': row 9: the prompt has 401 tokens, more than 56" in str(err.value)
    assert main(["validate", GRPO, *over]) == 2
    assert "row 9: the prompt has 401 tokens" in capsys.readouterr().err
    # a declared max prompt length: "12+34=" (7 tokens) is over 6
    assert main(["validate", GRPO, *over, "data.max_prompt_tokens=6"]) == 2
    assert "row 0: the prompt has 7 tokens, more than 6 (data.max_prompt_tokens=6)" in capsys.readouterr().err


def test_run_stops_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = ["run", GRPO, *_data(tmp_path, PROMPTS), f"run.output_dir={out}", "--no-progress"]
    assert main(argv) == 2
    assert "row 9: the prompt has 401 tokens" in capsys.readouterr().err
    assert not out.exists()


def test_overlong_drop_and_truncate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    over = _data(tmp_path, PROMPTS)
    dropped = load_graph(GRPO, [*over, "data.overlong=drop"])
    train, _ = fitted_splits(dropped, data_tokenizer(dropped, {}))
    assert len(train) == 15 and "1" * 400 not in train.columns["prompt"]
    assert main(["validate", GRPO, *over, "data.overlong=drop"]) == 0

    cut = load_graph(GRPO, [*over, "data.overlong=truncate"])
    tokenizer = data_tokenizer(cut, {})
    train, _ = fitted_splits(cut, tokenizer)
    assert len(train) == 16 and truncation(cut) == 56
    stream = PromptStream(
        train, shuffle=False, tokenizer=tokenizer, tokenize=("prompt",), max_prompt_tokens=56
    )
    stream.next_batch(8)
    ids = stream.next_batch(8).tensor("prompt_ids")  # rows 8..15: the 401-token prompt is row 9
    assert ids.shape[1] == 56 and ids[1].tolist() == ids[1, -1:].tolist() * 56  # its last 56 tokens: "1"s
    assert main(["validate", GRPO, *over, "data.overlong=truncate"]) == 0
    with pytest.raises(GraphError, match=r"data\.overlong: 'cut' is not one of error, truncate, drop"):
        load_graph(GRPO, [*over, "data.overlong=cut"])
