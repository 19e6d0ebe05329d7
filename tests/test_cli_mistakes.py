"""How ``rlflow validate``, ``run``, ``plan`` and ``profile`` report a user's mistakes (fresh-user trial
findings): every mistake, in the order that names the real problem first, one format for every command, before
any process starts or anything is measured.

Each test goes through the CLI (``rlflow.schedulers.cli.main``) with the real node functions; none starts a
process (every refusal comes before the workers).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlflow.dataflow.errors import RlflowError
from rlflow.schedulers.cli import main

ROOT = Path(__file__).resolve().parent.parent
GRPO = "examples/grpo.yaml"  # tiny Llama (dense): no router
PPO = "examples/arith/ppo.yaml"  # starts from the SFT stage's checkpoint


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("node", "arg", "model"),
    [("actor_train", "route_replay", "actor"), ("actor_gen", "record_routes", "actor"),
     ("ref", "route_replay", "ref")],
)  # fmt: skip
def test_route_replay_on_a_dense_model_names_the_model_before_the_route_inputs(
    node: str, arg: str, model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A dense model has no routes to record or replay: one line saying so, naming the node's argument and
    the model's type (before: validate asked to bind the route inputs first, and after binding them said the
    model had no router; record_routes printed the unbound outputs and the router as two lines). The ref
    node's model is the actor's copy (init_from): its type comes from the actor's config."""
    assert main(["validate", GRPO, f"nodes.{node}.args.{arg}=true"]) == 2
    assert _errors(capsys) == [
        f"rlflow validate: error: {GRPO}: nodes.{node}.args.{arg}: true needs a mixture-of-experts model "
        f"whose router route replay knows (model_type qwen3_moe or mixtral), but model '{model}' has "
        f"model_type 'llama'; remove args.{arg} or use such a model"
    ]


def test_run_reports_every_mistake_validate_reports_in_the_same_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rlflow run`` stopped at the first of the run checks' mistakes where ``validate`` printed all of
    them, and the two prefixed them differently (``error:`` against ``rlflow run: error:``): now both print
    every one as ``rlflow <command>: error: FILE: KEY: ...``, the run before making its run directory."""
    items = ["nodes.actor_train.args.router_aux_loss_coef=0.1", "nodes.reward.args.fn=arith_exactt"]
    assert main(["validate", GRPO, *items]) == 2
    checked = _errors(capsys)
    out = tmp_path / "run"
    assert main(["run", GRPO, *items, f"run.output_dir={out}", "--no-progress"]) == 2
    ran = _errors(capsys)
    assert [line.removeprefix("rlflow validate: ") for line in checked] == [
        line.removeprefix("rlflow run: ") for line in ran
    ]
    assert [line.split(": ")[:4] for line in ran] == [
        ["rlflow run", "error", GRPO, "nodes.reward.args.fn"],
        ["rlflow run", "error", GRPO, "nodes.actor_train.args.router_aux_loss_coef"],
    ]
    assert not out.exists()


def test_every_node_that_does_not_bind_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two nodes' misspelt arguments (fresh-user trial: validate and run named only the first node's): one
    line per node, from validate and from run, before the run directory is made."""
    items = ["nodes.actor_gen.args.max_new_token=8", "nodes.actor_train.args.clip_epz=0.2"]
    out = tmp_path / "run"
    for command in (["validate"], ["run", f"run.output_dir={out}", "--no-progress"]):
        assert main([command[0], GRPO, *items, *command[1:]]) == 2
        lines = _errors(capsys)
        assert [line.split(": ")[:4] for line in lines] == [
            [f"rlflow {command[0]}", "error", GRPO, "nodes.actor_gen.args.max_new_token"],
            [f"rlflow {command[0]}", "error", GRPO, "nodes.actor_train.args.clip_epz"],
        ]
        assert "did you mean 'max_new_tokens'" in lines[0] and "did you mean 'clip_eps'" in lines[1]
    assert not out.exists()


@pytest.fixture
def arith_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding the arithmetic chain's graph files and tokenizer, and no run yet."""
    skip = shutil.ignore_patterns("*.py")
    shutil.copytree(ROOT / "examples/arith", tmp_path / "examples/arith", ignore=skip)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_missing_checkpoint_names_the_key_and_the_stage_that_writes_it(
    arith_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rlflow plan`` on the PPO stage before its SFT stage ran named only the model's path ("model 'actor':
    cannot read .../config.json"); ``plan``, ``run`` and ``validate`` now name the file, the key, the run
    directory the checkpoint belongs to, the graph file whose run writes it, and the command that runs the
    two in order. In that chain the PPO stage's check waits for its turn."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.commands.run import check_stage

    missing = (
        f"{PPO}: models.actor.path: directory 'runs/arith-sft/checkpoints/latest/models/actor' does not "
        f"exist (relative to {arith_copy}); it is a checkpoint of run directory 'runs/arith-sft', which "
        "examples/arith/sft.yaml writes (its run.output_dir): run that stage first, or the two in order: "
        f"`rlflow run examples/arith/sft.yaml {PPO}`"
    )
    assert main(["plan", PPO, "--out", "out/plan.yaml"]) == 2
    assert _errors(capsys) == [f"rlflow plan: error: {missing}"]
    assert main(["run", PPO, "--no-progress"]) == 2
    assert _errors(capsys) == [f"rlflow run: error: {missing}"]
    assert sorted(p.name for p in arith_copy.iterdir()) == ["examples"]  # no run directory, no plan file
    check_stage(load_graph(PPO), (Path("runs/arith-sft"),))  # after sft.yaml in one `rlflow run`: no mistake
    (arith_copy / "runs/arith-sft").mkdir(parents=True)  # the SFT run began but wrote no checkpoint
    assert main(["validate", PPO]) == 2
    [line] = _errors(capsys)
    assert line.endswith(
        "it is a checkpoint of run directory 'runs/arith-sft', which holds no such checkpoint yet (did that "
        "run stop before writing it? `rlflow runs runs/arith-sft` shows how far it got)"
    )


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("nodes.actor_train.inputs.x=foo",
         "nodes.actor_train.inputs is a list in the file (of 7 items), and an override sets a list whole, "
         "not an item or a key below it: give the whole list, nodes.actor_train.inputs=[...]"),
        ("nodes.actor_train.inputs={x: foo}",
         "nodes.actor_train.inputs is a list in the file and the override gives a mapping: give a list, "
         "nodes.actor_train.inputs=[...]"),
        ("models.actor.optimizer=[1]",
         "models.actor.optimizer is a mapping in the file and the override gives a list: a list cannot be "
         "merged over a mapping; set its keys (models.actor.optimizer.NAME=value), or write the list in the "
         "file"),
    ],
)  # fmt: skip
def test_an_override_that_cannot_be_merged_is_named(
    item: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mapping over a list (or the reverse) printed omegaconf's "Cannot merge incompatible container
    types" after every override given; now the one that failed and what the file holds there."""
    assert main(["validate", GRPO, "run.iterations=3", item]) == 2
    assert _errors(capsys) == [f"rlflow validate: error: {GRPO}: override '{item}': {why}"]


def test_profile_says_tp_is_skipped_before_measuring(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model tensor parallelism cannot split (vocab 19: the arithmetic example's) was said to skip its tp
    calls only in the summary, after minutes of measuring; the line now comes before the first
    measurement."""
    import rlflow.schedulers.profiling.collect as profiling

    said: list[str] = []

    class Measuring(RlflowError):
        """Stops the command where the measuring would begin."""

    def measure(*args: object, **kwargs: object) -> Path:
        said.append(capsys.readouterr().out)
        raise Measuring("stopped where the measuring begins")

    monkeypatch.setattr(profiling, "run_profile", measure)
    config = {"model_type": "llama", "vocab_size": 19, "hidden_size": 64, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["profile", "--model", str(tmp_path), "--out", str(tmp_path / "p.parquet")]) == 2
    assert said == [
        "tensor-parallel calls: skipped: tp=2 does not divide vocab_size=19 (no tp layout runs this model: "
        "measuring its FSDP2 calls only; tp overheads keep cpu-local's values)\n"
    ]
