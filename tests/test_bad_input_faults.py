"""Bad input a new user hit (issue 39): each one line from `rlflow validate` naming the file, model and key,
before any layout rule or plan check reads the config."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rlflow.nodes.agent.env import hung_steps, run_steps
from rlflow.schedulers.cli import main
from rlflow.schedulers.records.checkpoint_check import checkpoint_problem


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
    assert err == f"rlflow validate: error: examples/grpo.yaml: models.actor.config.{key}: {why}"


def test_vocab_smaller_than_tokenizer_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # examples/arith/tokenizer holds 19 tokens (ids 0..18): a 10-row embedding misses ids 10..18
    code, err = _validate(capsys, "models.actor.config.vocab_size=10")
    assert code == 2
    assert err == (
        "rlflow validate: error: examples/grpo.yaml: models.actor.config.vocab_size: 10 is smaller than the "
        "vocabulary of its tokenizer 'examples/arith/tokenizer' (19 tokens): token ids 10..18 would index "
        "past the embedding table"
    )


def test_run_refuses_it_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlflow run` on two devices: the run-level check refuses the vocabulary before the executor (and its
    worker processes) is made."""
    import rlflow.schedulers.runtime.controller as controller

    def no_executor(*args: object, **kwargs: object) -> None:
        raise AssertionError("an executor was made (worker processes started) before the checks refused")

    monkeypatch.setattr(controller, "make_executor", no_executor)
    argv = ["run", "examples/grpo.yaml", "--devices", "2", "plan=auto", f"run.output_dir={tmp_path / 'r'}"]
    assert main([*argv, "models.actor.config.vocab_size=10", "--no-progress"]) == 2
    assert "models.actor.config.vocab_size: 10 is smaller than the vocabulary" in capsys.readouterr().err


def test_corrupt_config_json_names_file_line_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama",\n x')
    code, err = _validate(capsys, "models.actor.config=null", f"models.actor.path={tmp_path}")
    assert code == 2
    assert err == (
        f"rlflow validate: error: examples/grpo.yaml: models.actor.path: {tmp_path}/config.json: not valid "
        "JSON (line 2 column 2: Expecting property name enclosed in double quotes)"
    )
    assert "\n" not in err


def _run(*extra: str) -> int:
    return main(
        [
            "run",
            "examples/grpo.yaml",
            "run.eval_interval=0",
            "run.checkpoint_interval=1",
            "--no-progress",
            *extra,
        ]
    )


def test_truncated_latest_checkpoint_set_aside_and_resumed_from_the_previous(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = f"run.output_dir={tmp_path}"
    assert _run(out, "run.iterations=2") == 0
    state = tmp_path / "checkpoints" / "iter-000002" / "state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # a copy cut short
    capsys.readouterr()
    assert _run(out, "run.iterations=2", "--resume") == 0  # iteration 2 again, from iteration 1
    err = capsys.readouterr().err
    assert (
        f"rlflow: warning: checkpoint of iteration 2 is broken: {state}: unreadable, truncated or corrupt "
        "(File is not a zip file); set aside as iter-000002.broken, resuming from the newest sound one, "
        "iteration 1\n"
    ) in err
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["iter-000001", "iter-000002", "iter-000002.broken", "latest"]
    assert (tmp_path / "checkpoints" / "latest").resolve().name == "iter-000002"
    assert checkpoint_problem(tmp_path / "checkpoints" / "iter-000002") is None  # written again, whole


def test_checkpoint_problem_names_the_file(tmp_path: Path) -> None:
    import struct
    import zipfile

    (tmp_path / "models" / "actor").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "state.pt", "w") as archive:  # stored, not compressed: bytes in place
        archive.writestr("archive/data.pkl", b"x" * 64)
    assert checkpoint_problem(tmp_path) is None
    raw = bytearray((tmp_path / "state.pt").read_bytes())
    at = raw.index(b"x" * 64)
    raw[at] = ord("y")  # one byte flipped inside the member: its CRC no longer matches
    (tmp_path / "state.pt").write_bytes(bytes(raw))
    assert checkpoint_problem(tmp_path) == (
        f"{tmp_path / 'state.pt'}: member 'archive/data.pkl' fails its CRC check (corrupt)"
    )
    raw[at] = ord("x")
    (tmp_path / "state.pt").write_bytes(bytes(raw))
    # a safetensors file: 8-byte header length, the JSON header, then its tensors' bytes (here 0..16)
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
    weights = tmp_path / "models" / "actor" / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 10)  # 6 bytes short
    need = 8 + len(header) + 16
    assert checkpoint_problem(tmp_path) == f"{weights}: truncated ({need - 6} of {need} bytes)"


def test_hung_steps_hold_a_bounded_number_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps that never return within tool_timeout keep their threads (a thread cannot be killed), but at
    most ``max_hung`` of them: later steps start no thread and fail at once, saying why."""
    import rlflow.nodes.agent.env as env_module

    monkeypatch.setattr(env_module, "_HUNG", set())  # other tests' hung steps in this process: not ours
    release = threading.Event()

    def hang() -> str:
        release.wait()
        return "late"

    try:
        for _ in range(5):  # 5 turns of 3 hanging steps each, at most 4 threads left hanging
            before = threading.active_count()
            out = run_steps([hang, hang, hang], timeout=0.05, max_hung=4)
            assert [o.error for o in out] == ["timeout"] * 3
        assert hung_steps() == 6  # 3 + 3 hung, then the bound (4) refused every later turn
        assert threading.active_count() <= before  # the last turn started no thread
        assert out[0].detail == (
            "not run: 6 earlier steps still run past their deadline (max_hung_steps 4; a thread cannot be "
            "killed)"
        )
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while hung_steps() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hung_steps() == 0  # returned: no longer counted, and steps run again
    assert run_steps([lambda: "ok"], timeout=1.0, max_hung=4)[0].step is not None
