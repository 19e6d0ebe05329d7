"""The rlflow CLI: validate and show (``schedulers/cli.py``, ``schedulers/commands/``)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import rlflow.dataflow.graph
from rlflow.schedulers.cli import COMMANDS, main
from tests.conftest import make_catalogue_registry


@pytest.fixture(autouse=True)
def catalogue(monkeypatch: pytest.MonkeyPatch) -> None:
    """Validate against the contract's catalogue, independent of nodes/functions/."""
    monkeypatch.setattr(rlflow.dataflow.graph, "default_registry", make_catalogue_registry)


def test_validate_examples(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "examples/ppo.yaml", "examples/sft.yaml"]) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == [
        "ok: examples/ppo.yaml (6 nodes, 11 keys)",
        "ok: examples/sft.yaml (1 node, 4 keys)",
    ]
    assert out.err == ""


def test_validate_reports_each_bad_file_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path("examples/sft.yaml").read_text().replace("batch_size: 16", "batch_size: eight"))
    assert main(["validate", str(bad), "examples/sft.yaml"]) == 2
    out = capsys.readouterr()
    assert f"{bad}: nodes.actor_train.batch_size: expected an integer, got 'eight'" in out.err
    assert "ok: examples/sft.yaml" in out.out  # the other file is still checked


def test_validate_overrides_and_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # sft: 16 rows do not divide into 3 mini-batches once overridden.
    assert main(["validate", "examples/sft.yaml", "nodes.actor_train.mini_batches=3"]) == 2
    assert "nodes.actor_train.mini_batches: 16 rows do not divide into 3" in capsys.readouterr().err
    assert main(["validate", "examples/sft.yaml", "data.fields.extra=response"]) == 0  # a key nothing reads
    out = capsys.readouterr()
    assert "warning:" in out.err and "'extra'" in out.err and "ok: examples/sft.yaml" in out.out


def test_cli_shows_graph_warnings_on_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GraphWarning under `rlflow` is one `rlflow: warning:` line on stderr, without Python's file:line
    and source line; `validate` warns of several devices without a plan as `run` does. Outside main,
    warnings stay Python's."""
    from rlflow.dataflow.graph import GraphWarning

    python_show = warnings.showwarning
    out = str(tmp_path / "plan.yaml")
    argv = ["plan", "examples/sft.yaml", "data.fields.extra=col", "--cluster", "cpu-local", "--out", out]
    assert main([*argv, "--steps", "10", "--restarts", "1"]) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "rlflow: warning: examples/sft.yaml: data.fields: key 'extra' is produced by the data set but "
        "never consumed"
    ]
    assert main(["validate", "examples/sft.yaml", "run.devices=2"]) == 0
    text = capsys.readouterr()
    assert "examples/sft.yaml: run.devices: 2 devices but no plan: every node runs on device 0" in text.err
    assert "ok: examples/sft.yaml" in text.out
    assert warnings.showwarning is python_show  # main put Python's display back
    with pytest.warns(GraphWarning, match="library"):
        warnings.warn(GraphWarning("library"), stacklevel=1)


def test_validate_reports_missing_local_files(capsys: pytest.CaptureFixture[str]) -> None:
    """Model/tokenizer directories and data files must exist; each missing one is named by its key."""
    args = ["validate", "examples/sft.yaml", "models.actor.tokenizer=no/such/tok", "data.eval=no/eval.jsonl"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "examples/sft.yaml: models.actor.tokenizer: directory 'no/such/tok' does not exist" in err
    assert "examples/sft.yaml: data.eval: file 'no/eval.jsonl' does not exist" in err


def test_validate_reports_what_run_would_reject(capsys: pytest.CaptureFixture[str]) -> None:
    """Model configs transformers rejects, grouped-query heads that do not divide, an unknown generator,
    and a tensor degree that does not divide the vocabulary: all reported by validate, by key."""
    args = [
        "validate",
        "examples/ppo.yaml",
        "models.actor.config.model_type=lama",
        "data.generator.name=arth",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "models.actor: config.model_type: unknown Hugging Face model type 'lama' (did you mean 'llama'?)"
        in err
    )
    assert "data.generator.name: unknown data generator 'arth' (did you mean 'arith'?)" in err
    assert main(["validate", "examples/ppo.yaml", "models.actor.config.num_key_value_heads=3"]) == 2
    assert "config.num_key_value_heads: 3 must divide num_attention_heads=4" in capsys.readouterr().err
    # transformers' own config validators (a strict-dataclass error, not a ValueError) become a clear error
    assert main(["validate", "examples/ppo.yaml", "models.actor.config.hidden_size=65"]) == 2
    err = capsys.readouterr().err
    assert "models.actor: invalid model config" in err and "hidden size (65)" in err
    assert "Traceback" not in err
    # sampling arguments and rule-reward names are checked before anything runs
    for arg, fragment in (
        (
            "nodes.actor_gen.args.temperature=-1",
            "nodes.actor_gen.args.temperature: must be >= 0 (0: greedy), got -1",
        ),
        (
            "nodes.actor_gen.args.max_new_tokens=0",
            "args.max_new_tokens: new tokens must be a positive integer, got 0",
        ),
        ("nodes.actor_gen.args.top_p=1.5", "nodes.actor_gen.args.top_p: must be in (0, 1], got 1.5"),
        (
            "nodes.actor_gen.args.temperature=.nan",
            "nodes.actor_gen.args.temperature: must be a finite number",
        ),
        (
            "nodes.reward.args.fn=arith_exactt",
            "nodes.reward.args.fn: unknown reward function 'arith_exactt' (did",
        ),
    ):
        assert main(["validate", "examples/ppo.yaml", arg]) == 2
        assert fragment in capsys.readouterr().err, arg
    tp2 = "plan={actor_train: {devices: '0-1', layout: d1t2p1m1}}"
    assert main(["validate", "examples/sft.yaml", "run.devices=2", tp2]) == 2
    assert "tp=2 does not divide model 'actor' vocab_size=19" in capsys.readouterr().err


def test_run_devices_zero_is_refused_not_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rlflow run --devices 0`` sets ``run.devices=0``, which the graph refuses before anything starts
    (it was dropped as falsy and the file's device count used: fresh-user finding)."""
    out = tmp_path / "run"
    assert main(["run", "examples/sft.yaml", "--devices", "0", f"run.output_dir={out}"]) == 2
    assert "run.devices: must be >= 1, got 0" in capsys.readouterr().err
    assert not out.exists()


def test_plan_overrides_with_a_plan_file_are_refused_not_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--plan FILE`` replaces the graph's whole plan, so a ``plan.<node>...`` override beside it would be
    silently dropped (fresh-user finding: the file's layout ran); it is refused, naming both."""
    plan = tmp_path / "plan.yaml"
    plan.write_text("actor: {devices: 0, layout: d1t1p1m1}\n")
    out = tmp_path / "run"
    for override in ("plan.actor.layout=d1t1p4m1", "plan=auto"):
        argv = ["run", "examples/sft.yaml", "--plan", str(plan), override, f"run.output_dir={out}"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{override}: --plan {plan} replaces the graph's whole plan" in err, err
    assert not out.exists()


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", "nope.yaml"]) == 2
    assert "nope.yaml: no such graph file" in capsys.readouterr().err


def test_show_prints_order_and_writes_drawings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = tmp_path / "out" / "ppo"
    assert main(["show", "examples/ppo.yaml", "--out", str(prefix)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith(" 1. actor_gen: generate generate @ actor")
    assert "in:  prompt_ids <- data, prompt_mask <- data" in lines[2]
    assert "actor_train -> actor_gen (model actor)" in out
    for ext in (".png", ".svg", ".dot"):
        path = prefix.with_name("ppo" + ext)
        assert path.exists() and path.stat().st_size > 0, ext
    assert prefix.with_name("ppo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in prefix.with_name("ppo.svg").read_text()
    dot = prefix.with_name("ppo.dot").read_text()
    assert '"actor_gen" -> "reward" [label="response_ids\\nresponse_mask", style=solid]' in dot
    assert '"actor_train" -> "actor_gen" [label="version (actor)", style=dashed' in dot


def test_show_no_draw_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "examples/grpo.yaml", "--no-draw"]) == 0
    assert "wrote" not in capsys.readouterr().out
    assert main(["show", "examples/grpo.yaml", "examples/sft.yaml"]) == 2
    assert "exactly one graph file" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], ["validate", "--help"], ["show", "--help"]])
def test_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "usage: rlflow" in capsys.readouterr().out


def test_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as info:
        main(["validate"])
    assert info.value.code == 2


@pytest.mark.slow
def test_module_entry_point() -> None:
    assert set(COMMANDS) >= {"validate", "show"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlflow.schedulers.cli", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "validate" in proc.stdout and "show" in proc.stdout


def test_a_graph_path_that_is_not_a_regular_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A FIFO would block the read forever and a directory gives the OS's error: both are refused before
    opening (issue 14 follow-up, bug 6). The FIFO read runs in a thread so a regression fails, not hangs."""
    import threading

    fifo = tmp_path / "graph.yaml"
    os.mkfifo(fifo)
    codes: list[int] = []
    reader = threading.Thread(target=lambda: codes.append(main(["validate", str(fifo)])), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():  # unblock the reader: open the FIFO's write end and close it at once
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=30)
        pytest.fail("rlflow validate blocked reading a FIFO")
    assert codes == [2]
    assert f"{fifo}: is not a regular file" in capsys.readouterr().err
    assert main(["validate", str(tmp_path)]) == 2
    assert f"{tmp_path}: is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["", "null", "~"])
def test_an_empty_output_dir_is_an_error(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``run.output_dir=`` (what ``run.output_dir=''`` is after the shell) parses as null: an error naming
    the key, not a silent fallback to the default directory."""
    assert main(["validate", "examples/sft.yaml", f"run.output_dir={value}"]) == 2
    assert (
        "examples/sft.yaml: run.output_dir: expected a non-empty string, got null" in capsys.readouterr().err
    )


@pytest.mark.slow
def test_the_command_exits_even_while_an_abandoned_thread_still_runs() -> None:
    """A stop signal abandons an iteration whose reward call never returns (a service trickling its reply,
    sandboxes waiting out their limits): once the command is done, the process exits with its status after
    STUCK_THREADS_GRACE_S, naming the thread, instead of waiting for it at interpreter shutdown forever."""
    program = (
        "import threading, time\n"
        "import rlflow.schedulers.cli as cli\n"
        "threading.Thread(target=time.sleep, args=(3600,), name='reward-call', daemon=False).start()\n"
        "cli.main = lambda argv=None: 143\n"
        "cli.entry()\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143
    assert "rlflow: 1 thread(s) still running after 5 s (reward-call): exiting without waiting" in done.stderr
    quick = "import rlflow.schedulers.cli as cli\ncli.main = lambda argv=None: 2\ncli.entry()\n"
    done = subprocess.run([sys.executable, "-c", quick], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "")
