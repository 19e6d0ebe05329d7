"""End-to-end runs of the single-process runtime on tiny models (tier 4), resume and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch

from rlflow.dataflow.errors import DataError, GraphError, ModelError, NodeError, PlanError
from rlflow.dataflow.graph import GraphWarning
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import (
    latest_checkpoint,
    read_metrics,
    read_predicted_trace,
    read_status,
    read_trace,
    remove_run_dir,
)
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import CLI

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.yaml"))
SMALL = ["run.checkpoint_interval=0", "run.eval_interval=0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # example graphs name paths relative to the repository root
    torch.set_num_threads(1)


def _controller(
    graph_file: str, tmp: Path, *overrides: str, resume: bool = False, overwrite: bool = False
) -> Controller:
    graph = resolve_plan(load_graph(graph_file, [f"run.output_dir={tmp}", *overrides]), None)
    return Controller(graph, resume=resume, overwrite=overwrite)


def _weights(c: Controller) -> dict[str, torch.Tensor]:
    return {
        f"{m}.{k}": v.detach().clone()
        for m, s in c.executor.models.items()
        for k, v in s.module.state_dict().items()
    }


@pytest.mark.parametrize("graph_file", EXAMPLES)
def test_every_example_runs(graph_file: str, tmp_path: Path) -> None:
    c = _controller(graph_file, tmp_path, "run.iterations=2", *SMALL)
    before = _weights(c)
    result = c.run()
    assert result.iteration == 2
    after = _weights(c)
    trained = {n.model for n in c.graph.nodes.values() if n.kind == "train"}
    for name in trained:  # every trained model moved, every frozen one did not
        assert any(not torch.equal(before[k], after[k]) for k in before if k.startswith(f"{name}."))
    for name in set(c.executor.models) - trained:
        assert all(torch.equal(before[k], after[k]) for k in before if k.startswith(f"{name}."))
    table = read_metrics(tmp_path)
    assert table.num_rows == 2
    for node in c.graph.nodes:
        assert f"timing_s/{node}" in table.column_names
    assert "perf/throughput" in table.column_names
    assert all(v == v for v in table.column("perf/throughput").to_pylist())  # no NaN
    assert read_status(tmp_path)["state"] == "finished"
    # a filter's round side (and the filter) runs once per round of generation
    rounds = table.column("filter/rounds").to_pylist() if c.graph.filter else [1.0, 1.0]
    per_round = len(c.graph.filter.rounds) + 1 if c.graph.filter else 0
    extra = int(sum(r - 1 for r in rounds)) * per_round
    assert read_trace(tmp_path).num_rows == 2 * len(c.graph.nodes) + extra


def test_ppo_metrics_have_standard_names_and_onpolicy_gap_is_zero(tmp_path: Path) -> None:
    c = _controller("examples/ppo.yaml", tmp_path, "run.iterations=1", *SMALL)
    m = c.run().metrics
    for name in (
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/entropy",
        "critic/vf_loss",
        "critic/score/mean",
        "response_length/mean",
        "timing_s/actor_train",
    ):
        assert name in m, name
    # the trainer's first pass reads the same weights the sampler used: log-probs agree
    assert m["rollout/logprob_gap_mean"] < 1e-5


def test_resume_is_exact(tmp_path: Path) -> None:
    """3 iterations == 2 iterations, stop, resume, 1 iteration: same weights, same prompt order."""
    common = ("data.generator.args.train_size=6", "algorithm.batch=2", "run.checkpoint_interval=1")
    full = _controller("examples/ppo.yaml", tmp_path / "a", "run.iterations=3", *common)
    seen_full: list[list[str]] = []
    full.stream.next_batch = _recording(full.stream.next_batch, seen_full)  # type: ignore[method-assign]
    full.run()
    first = _controller("examples/ppo.yaml", tmp_path / "b", "run.iterations=3", *common)
    seen_b: list[list[str]] = []
    first.stream.next_batch = _recording(first.stream.next_batch, seen_b)  # type: ignore[method-assign]
    first.run(iterations=2)  # stop after 2 of the 3 planned iterations (the LR schedule spans 3)
    resumed = _controller("examples/ppo.yaml", tmp_path / "b", "run.iterations=3", *common, resume=True)
    assert resumed.start_iteration == 2
    resumed.stream.next_batch = _recording(resumed.stream.next_batch, seen_b)  # type: ignore[method-assign]
    resumed.run()
    assert seen_b == seen_full
    prompts = [p for batch in seen_full for p in batch]
    assert len(prompts) == len(set(prompts)) == 6  # one epoch: each prompt exactly once
    wa, wb = _weights(full), _weights(resumed)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def _recording(fn, seen: list[list[str]]):  # type: ignore[no-untyped-def]
    """Wrap ``PromptStream.next_batch`` to record each batch's prompts (token ids without padding)."""

    def wrapped(n: int):  # type: ignore[no-untyped-def]
        batch = fn(n)
        rows = zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist(), strict=True)
        seen.append([str([t for t, keep in zip(ids, mask, strict=True) if keep]) for ids, mask in rows])
        return batch

    return wrapped


def test_micro_batches_give_the_same_step(tmp_path: Path) -> None:
    """Token-weighted accumulation: m1 and m4 leave the same weights after an SFT step, and report the
    same loss (a micro-batch's loss metric is its own mean, not its share of the mini-batch loss)."""
    results = []
    losses = []
    for m in (1, 4):
        c = _controller(
            "examples/sft.yaml",
            tmp_path / f"m{m}",
            "run.iterations=1",
            *SMALL,
            f"plan={{actor_train: {{devices: '0', layout: d1t1p1m{m}}}}}",
        )
        losses.append(c.run().metrics["actor/nll"])
        results.append(_weights(c))
    for k in results[0]:
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-5, atol=1e-6)
    assert losses[0] > 0.1 and losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_existing_run_needs_resume(tmp_path: Path) -> None:
    _controller("examples/sft.yaml", tmp_path, "run.iterations=1", "run.eval_interval=0").run()
    assert latest_checkpoint(tmp_path) is not None
    with pytest.raises(GraphError, match="--resume"):
        _controller("examples/sft.yaml", tmp_path, "run.iterations=2")


def test_unknown_node_argument_is_rejected_before_building(tmp_path: Path) -> None:
    with pytest.raises(GraphError, match=r"nodes\.actor_train\.args\.clip_epsilon.*did you mean 'clip_eps'"):
        _controller("examples/ppo.yaml", tmp_path, "nodes.actor_train.args.clip_epsilon=0.1")


def _edited(tmp: Path, graph_file: str, old: str, new: str) -> str:
    """A copy of ``graph_file`` in ``tmp`` with ``old`` replaced by ``new`` (paths stay repo-relative)."""
    text = (ROOT / graph_file).read_text()
    assert old in text
    out = tmp / Path(graph_file).name
    out.write_text(text.replace(old, new))
    return str(out)


def test_missing_model_directory(tmp_path: Path) -> None:
    text = (ROOT / "examples/sft.yaml").read_text()
    start = text.index("    config: {")
    end = text.index("}", start) + 1
    graph = tmp_path / "sft.yaml"
    graph.write_text(text[:start] + "    path: no/such/dir" + text[end:])
    with pytest.raises(ModelError, match="no/such/dir"):
        _controller(str(graph), tmp_path / "run")


def test_data_file_without_mapped_field(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "response": "2"}) + "\n")
    graph = _edited(tmp_path, "examples/sft.yaml", "train: examples/data/sft.jsonl", f"train: {data}")
    with pytest.raises(DataError, match=r"field 'prompt'.*'prompt'.*question"):
        _controller(graph, tmp_path / "run")


def _bad_reward(response_text: str, answer: str) -> float:
    raise ValueError("boom")


def test_unknown_reward_is_rejected_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(
        GraphError, match=r"ppo\.yaml: nodes\.reward\.args\.fn: unknown reward function 'arith_exactt'"
    ):
        _controller("examples/ppo.yaml", tmp_path / "run", "nodes.reward.args.fn=arith_exactt")
    assert not (tmp_path / "run").exists()


def test_reward_function_that_raises_names_the_node(tmp_path: Path) -> None:
    c = _controller(
        "examples/ppo.yaml",
        tmp_path,
        "run.iterations=1",
        *SMALL,
        "nodes.reward.args.fn=tests.test_runtime:_bad_reward",
    )
    with pytest.raises(NodeError, match=r"node 'reward'.*boom"):
        c.run()
    assert read_status(tmp_path)["state"] == "failed"


@pytest.mark.slow
def test_killed_run_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    """SIGKILL mid-run loses at most the iteration in flight; --resume continues from the checkpoint."""
    run_dir = tmp_path / "run"
    base = [
        *CLI,
        "run",
        "examples/sft.yaml",
        f"run.output_dir={run_dir}",
    ]
    base += ["run.checkpoint_interval=2", "run.eval_interval=0", "--no-progress"]
    proc = subprocess.Popen(
        [*base, "run.iterations=500"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (latest_checkpoint(run_dir) or (0, None))[0] < 2:
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    found = latest_checkpoint(run_dir)
    assert found is not None and found[0] >= 2
    done = subprocess.run(
        [*base, f"run.iterations={found[0] + 1}", "--resume"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert read_status(run_dir)["state"] == "finished"
    assert read_metrics(run_dir).column("iteration").to_pylist()[-1] == found[0] + 1


@pytest.mark.slow
def test_ctrl_c_saves_and_stops(tmp_path: Path) -> None:
    """SIGINT: the iteration in flight finishes, a checkpoint is written, exit status 130, resumable."""
    run_dir = tmp_path / "run"
    cmd = [
        *CLI,
        "run",
        "examples/sft.yaml",
        f"run.output_dir={run_dir}",
    ]
    cmd += ["run.iterations=100000", "run.checkpoint_interval=0", "run.eval_interval=0", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((run_dir / "metrics").glob("iter-*"))) < 2:
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    found = latest_checkpoint(run_dir)
    assert found is not None
    assert found[0] == read_metrics(run_dir).column("iteration").to_pylist()[-1]
    assert "resume" in err
    status = read_status(run_dir)
    assert status is not None and (status["state"], status["iteration"]) == ("interrupted", found[0])


def test_tokenizer_without_eos_is_rejected_before_training(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    shutil.copytree(ROOT / "examples/arith/tokenizer", tok)
    config = json.loads((tok / "tokenizer_config.json").read_text())
    del config["eos_token"]
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    graph = _edited(tmp_path, "examples/ppo.yaml", "tokenizer: examples/arith/tokenizer", f"tokenizer: {tok}")
    with pytest.raises(ModelError, match=r"(?i)eos"):
        _controller(graph, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics").exists()  # nothing written before the error


def test_overwrite_refuses_foreign_files_and_checks_before_deleting(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _controller("examples/sft.yaml", run_dir, "run.iterations=1", "run.eval_interval=0").run()
    # a bad tokenizer fails before anything is deleted
    graph = _edited(tmp_path, "examples/sft.yaml", "tokenizer: examples/arith/tokenizer", "tokenizer: no/tok")
    with pytest.raises(ModelError):
        Controller(resolve_plan(load_graph(graph, [f"run.output_dir={run_dir}"]), None), overwrite=True)
    assert latest_checkpoint(run_dir) is not None
    # a file the run did not write protects the directory
    (run_dir / "notes.txt").write_text("mine")
    with pytest.raises(GraphError, match=r"notes\.txt.*not deleting"):
        _controller("examples/sft.yaml", run_dir, "run.iterations=1", "run.eval_interval=0", overwrite=True)
    assert (run_dir / "notes.txt").read_text() == "mine"
    (run_dir / "notes.txt").unlink()
    c = _controller("examples/sft.yaml", run_dir, "run.iterations=1", "run.eval_interval=0", overwrite=True)
    assert latest_checkpoint(run_dir) is None  # replaced, then rewritten by this run
    c.run()


def test_overwrite_refuses_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _controller("examples/sft.yaml", tmp_path, "run.iterations=1", "run.eval_interval=0").run()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="working directory"):
        remove_run_dir(".")
    assert (tmp_path / "status.json").is_file()


def test_resume_with_another_graph_is_rejected(tmp_path: Path) -> None:
    _controller("examples/grpo.yaml", tmp_path, "run.iterations=1", "run.eval_interval=0").run()
    with pytest.raises(GraphError, match="different graph") as info:
        _controller("examples/ppo.yaml", tmp_path, "run.iterations=2", resume=True)
    # the message names what differs: dotted keys, checkpoint -> this graph
    msg = str(info.value)
    assert "models.critic: added" in msg, msg
    assert "nodes.actor_train: ['train', 'grpo_actor', 'actor'] -> ['train', 'ppo_actor', 'actor']" in msg, (
        msg
    )
    assert "nodes.critic_train: (none) -> ['train', 'ppo_critic', 'critic']" in msg and "{" not in msg, msg


def test_resume_checks_the_architecture_and_reports_changed_settings(tmp_path: Path) -> None:
    _controller("examples/grpo.yaml", tmp_path, "run.iterations=1", "run.eval_interval=0").run()
    wider = ("models.actor.config.hidden_size=32", "models.actor.config.head_dim=8")
    with pytest.raises(GraphError, match=r"different graph.*models\.actor\.config\.hidden_size: 64 -> 32"):
        _controller("examples/grpo.yaml", tmp_path, "run.iterations=2", *wider, resume=True)
    with pytest.warns(GraphWarning, match=r"settings changed.*algorithm\.kl_coef: 0\.04 -> 0\.5"):
        _controller("examples/grpo.yaml", tmp_path, "run.iterations=2", "algorithm.kl_coef=0.5", resume=True)


def test_a_run_saved_in_float32_resumes_under_dtype_auto_on_cpu(tmp_path: Path) -> None:
    """Checkpoints written when ``float32`` was the default dtype resume now that ``auto`` is: on a CPU host
    ``auto`` builds float32, the same weights; bfloat16 would not be."""
    _controller(
        "examples/sft.yaml", tmp_path, "run.iterations=1", "run.eval_interval=0", "models.actor.dtype=float32"
    ).run()
    assert _controller(
        "examples/sft.yaml", tmp_path, "run.iterations=2", "run.eval_interval=0", resume=True
    ).run()
    with pytest.raises(GraphError, match=r"models\.actor\.dtype: 'float32' -> 'bfloat16'"):
        bf16 = "models.actor.dtype=bfloat16"
        _controller(
            "examples/sft.yaml", tmp_path, "run.iterations=3", "run.eval_interval=0", bf16, resume=True
        )


def test_plan_file_from_the_planner_runs(tmp_path: Path) -> None:
    """`rlflow plan` places model nodes only; `run --plan` adds model-free nodes on device 0; a model node
    left out is an error naming it."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        "".join(
            f"{n}: {{devices: '0', layout: d1t1p1m1}}\n"
            for n in ("actor_gen", "ref", "critic_values", "actor_train", "critic_train")
        )
    )
    graph = resolve_plan(load_graph("examples/ppo.yaml", [f"run.output_dir={tmp_path}/run"]), plan)
    assert graph.placement("reward").devices == (0,)
    plan.write_text(plan.read_text().replace("critic_train: {devices: '0', layout: d1t1p1m1}\n", ""))
    with pytest.raises(PlanError, match="no placement for node critic_train;") as info:
        resolve_plan(load_graph("examples/ppo.yaml", [f"run.output_dir={tmp_path}/run"]), plan)
    assert str(info.value).startswith(f"{plan}: plan"), info.value  # the plan file is named, not the graph


def test_several_devices_without_a_plan_warn(tmp_path: Path) -> None:
    """No plan on run.devices > 1 runs every node on device 0: `run` says so (not with --plan FILE)."""
    graph = load_graph("examples/sft.yaml", ["run.devices=2"])
    with pytest.warns(GraphWarning) as record:
        assert resolve_plan(graph, None) is graph
    assert [str(w.message) for w in record] == [
        "examples/sft.yaml: run.devices: 2 devices but no plan: every node runs on device 0 "
        "(write `plan: auto` or pass --plan FILE)"
    ]
    plan = tmp_path / "plan.yaml"
    plan.write_text("actor_train: {devices: '0-1', layout: d2t1p1m1}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphWarning)
        assert resolve_plan(graph, plan).placement("actor_train").devices == (0, 1)
        resolve_plan(load_graph("examples/sft.yaml"), None)  # one device: nothing to say


def test_resume_prints_the_accuracy_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rlflow.schedulers.cli import main

    base = ["run", "examples/grpo.yaml", f"run.output_dir={tmp_path}", "run.eval_interval=1",
            "run.eval.size=8", "run.checkpoint_interval=1", "--no-progress"]  # fmt: skip
    assert main([*base, "run.iterations=1"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy (greedy)" in out and re.search(r"[\d.]+ -> [\d.]+ \(it 0 -> 1\)", out), out
    assert main([*base, "run.iterations=2", "--resume"]) == 0
    out = capsys.readouterr().out
    # the resumed run's summary spans the whole run: from the evaluation before iteration 1 to the last
    assert re.search(r"examples/grpo.yaml +2 +64 +[\d.]+ -> [\d.]+ \(it 0 -> 2\)", out), out
    # each evaluation printed once, when it happens: the resumed run prints its own
    assert "eval after 0 iterations" not in out and "eval after 2 iterations" in out


def test_resuming_a_finished_run_has_nothing_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlflow.schedulers.cli import main

    base = ["run", "examples/sft.yaml", f"run.output_dir={tmp_path}", "run.iterations=1", "--no-progress"]
    assert main(base) == 0
    capsys.readouterr()
    assert main([*base, "--resume"]) == 0
    out = capsys.readouterr()
    assert out.err == (
        f"rlflow: run {tmp_path} already finished 1 of 1 iterations; nothing to do (raise run.iterations to "
        "continue)\n"
    ), out.err
    assert read_metrics(tmp_path).column("iteration").to_pylist() == [1]
    assert read_status(tmp_path)["state"] == "finished"


def test_run_records_the_planners_prediction(tmp_path: Path) -> None:
    from rlflow.schedulers.cli import main

    assert (
        main(["run", "examples/sft.yaml", f"run.output_dir={tmp_path}", "run.iterations=1", "--no-progress"])
        == 0
    )
    predicted = read_predicted_trace(tmp_path)
    assert predicted is not None and "actor_train" in predicted.column("node").to_pylist()
    trace = read_trace(tmp_path).to_pydict()
    assert trace["predicted_s"][trace["node"].index("actor_train")] > 0


def test_progress_in_a_log_is_a_line_per_interval(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With stderr not a terminal (a log, CI) progress is plain lines, the last at the final iteration."""
    from rlflow.schedulers.cli import main

    args = [
        "run",
        "examples/sft.yaml",
        f"run.output_dir={tmp_path}",
        "run.iterations=2",
        "run.eval_interval=0",
    ]
    assert main(args) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "iteration" in line]
    assert (
        lines
        and lines[-1].startswith("rlflow: iteration 2/2 (")
        and "s/it wall, eval and checkpoints included)" in lines[-1]
    ), lines


def test_ready_nodes_are_submitted_together(tmp_path: Path) -> None:
    """The controller submits every node whose dependencies have finished before it waits, so nodes on
    disjoint meshes can run at the same time: in PPO, reward/ref/critic_values after actor_gen, then the
    two train nodes together."""
    c = _controller("examples/ppo.yaml", tmp_path, "run.iterations=1", *SMALL)
    events: list[tuple[str, ...]] = []
    submit, wait_any = c.executor.submit, c.executor.wait_any

    def recording_submit(name: str, batch: object, iteration: int) -> object:
        events.append(("submit", name))
        return submit(name, batch, iteration)  # type: ignore[arg-type]

    def recording_wait_any(tickets: list[object]) -> object:
        ticket, done = wait_any(tickets)  # type: ignore[arg-type]
        events.append(("done", done.name))
        return ticket, done

    c.executor.submit = recording_submit  # type: ignore[method-assign]
    c.executor.wait_any = recording_wait_any  # type: ignore[method-assign]
    c.run()
    c.close()
    assert events == [
        ("submit", "actor_gen"),
        ("done", "actor_gen"),
        ("submit", "reward"),
        ("submit", "ref"),
        ("submit", "critic_values"),
        ("done", "reward"),
        ("done", "ref"),
        ("done", "critic_values"),
        ("submit", "actor_train"),
        ("submit", "critic_train"),
        ("done", "actor_train"),
        ("done", "critic_train"),
    ]


def test_reference_follows_the_actor_as_an_ema(tmp_path: Path) -> None:
    """``models.ref.ema``: after the actor's train node, ref ← lerp(ref, actor, η), bit for bit, and ref's
    next call reads it (TR-DPO soft update)."""
    c = _controller("examples/ppo.yaml", tmp_path, "run.iterations=2", *SMALL, "models.ref.ema.source=actor",
                    "models.ref.ema.eta=0.25")  # fmt: skip
    models = c.executor.models
    ref0 = {k: v.detach().clone() for k, v in models["ref"].module.named_parameters()}
    c.run(iterations=1)
    actor1 = dict(models["actor"].module.named_parameters())
    ref1 = dict(models["ref"].module.named_parameters())
    for k, r0 in ref0.items():
        assert torch.equal(ref1[k].detach(), torch.lerp(r0, actor1[k].detach(), 0.25)), k
    assert any(not torch.equal(ref1[k], r0) for k, r0 in ref0.items())
    c.close()


def test_resuming_a_distributed_checkpoint_in_one_process_names_its_plan(tmp_path: Path) -> None:
    c = _controller("examples/sft.yaml", tmp_path, "run.iterations=1", *SMALL)
    state = {"workers": {0: {}, 1: {}}, "plan": {"actor_train": ((0, 1), 2, 1, 1)}}
    with pytest.raises(PlanError, match=r"2 workers \(actor_train devices \[0, 1\] d2t1p1\).*same --devices"):
        c.executor.load_state_dict(state)
    c.close()
