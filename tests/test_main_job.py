"""The main job (`make run`): its command line, run CI-sized as the Makefile writes it, and the stage chain
of `rlflow run GRAPH GRAPH ...` (checks before the first stage, the summary table, a dashboard per stage).

Learning is shown by the README's figures and bench/, not asserted here (a threshold would be flaky)."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
import yaml

from rlflow.schedulers.cli import main

ROOT = Path(__file__).resolve().parents[1]
# few iterations and few problems: the chain's code path, not its learning
SMALL = ["run.iterations=2", "run.eval_interval=2", "run.checkpoint_interval=2", "run.eval.size=16",
         "data.generator.args.train_size=512", "--no-progress"]  # fmt: skip


def make_run_argv() -> list[str]:
    """The argv after ``-m rlflow.schedulers.cli`` of the Makefile's ``run`` recipe (its one command)."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index("run: install") + 1
    recipe = [line.strip() for line in lines[start:] if line.startswith("\t")][:1]
    argv = shlex.split(recipe[0])
    assert argv[:3] == ["$(PYTHON)", "-m", "rlflow.schedulers.cli"], recipe
    return argv[3:]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_make_run_chain_ci_sized(workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = make_run_argv()
    assert argv[:3] == ["run", "examples/arith/sft.yaml", "examples/arith/ppo.yaml"]
    assert main([*argv, *SMALL, "--dashboard"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("stage ") :].splitlines()
    assert "held-out accuracy (greedy)" in table[0] and "wall" in table[0]
    # SFT: 2 iterations of 128 rows; PPO: 2 of 256 samples, from the SFT stage's checkpoint
    assert re.match(r"examples/arith/sft.yaml +2 +256 +[\d.]+ -> [\d.]+ \(it 0 -> 2\) +[\dms]+$", table[1]), (
        table
    )
    assert re.match(r"examples/arith/ppo.yaml +2 +512 +[\d.]+ -> [\d.]+ \(it 0 -> 2\) +[\dms]+$", table[2]), (
        table
    )
    for stage in ("arith-sft", "arith-ppo"):
        assert f"dashboard: runs/{stage}/dashboard.html" in out
        assert (workdir / "runs" / stage / "dashboard.html").stat().st_size > 0
    # each evaluation is printed, both stages'
    assert out.count("eval after 0 iterations") == 2 and out.count("eval after 2 iterations") == 2
    # a chain stopped before its second stage: --resume skips the finished stage and starts the other
    shutil.rmtree(workdir / "runs" / "arith-ppo")
    assert main([*argv[:3], "--resume", *SMALL]) == 0
    out = capsys.readouterr().out
    assert (
        re.search(r"examples/arith/sft.yaml +2 +256 .* +-\n", out) and "ppo.yaml           2      512" in out
    ), out


def test_chain_checks_every_stage_before_the_first_starts(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def error(argv: list[str]) -> str:
        assert main(argv) == 2
        return capsys.readouterr().err

    argv = make_run_argv()[:3]
    # a mistake in a later stage stops the chain before the first one writes anything
    bad = workdir / "examples" / "grpo_typo.yaml"
    bad.write_text((workdir / "examples" / "grpo.yaml").read_text().replace("grpo_actor", "grpo_actr"))
    err = error(["run", "examples/sft.yaml", "examples/grpo_typo.yaml", "run.iterations=2"])
    assert "examples/grpo_typo.yaml: nodes.actor_train.function: unknown node function 'grpo_actr'" in err
    assert not (workdir / "runs").exists()
    # overrides go to every stage: a key one stage lacks is that stage's mistake
    err = error([*argv, "nodes.actor_train.batch_size=4", *SMALL])
    assert "examples/arith/sft.yaml: override 'nodes.actor_train.batch_size=4': no node 'actor_train'" in err
    assert "every stage needs its own run directory" in error([*argv, "run.output_dir=runs/x", *SMALL])
    assert "one plan file cannot place 2 graphs" in error([*argv, "--plan", "plan.yaml", *SMALL])
    err = error(["run", "examples/arith/sft.yaml", "examples/arith/sft.yaml", *SMALL])
    assert "run.output_dir 'runs/arith-sft' is also examples/arith/sft.yaml's" in err
    assert not (workdir / "runs").exists()
    # a generator argument's mistake names where the argument lives
    err = error([*argv, "data.generator.args.zero_pad=maybe", *SMALL])
    assert "data.generator.args of generator arith (train): arith: zero_pad must be true or false" in err, err


def test_a_later_stages_model_in_an_earlier_stages_directory_waits_for_its_turn(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage's model ``path`` inside the run directory an earlier stage writes, named ``org/name``-like
    (``runs/arith-sft``: one slash, no such directory yet, so read as a Hub id before the chain starts) is
    not a mistake before the first stage: the first stage runs, and the later one reads the directory."""
    later = workdir / "examples" / "from_sft.yaml"
    raw = yaml.safe_load((workdir / "examples" / "grpo.yaml").read_text())
    raw["models"]["actor"] = {"path": "runs/arith-sft", "tokenizer": "examples/arith/tokenizer"}
    later.write_text(yaml.safe_dump(raw))
    code = main(["run", "examples/arith/sft.yaml", "examples/from_sft.yaml", *SMALL, "run.iterations=1"])
    err = capsys.readouterr().err
    assert (workdir / "runs" / "arith-sft" / "metrics").is_dir(), err  # the first stage ran
    assert code == 2 and "'runs/arith-sft' has no config.json" in err and "Hub id" not in err, err
