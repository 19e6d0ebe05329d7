"""Exact asynchronous resume across SIGKILLs (issue 39): interruptible generation with staleness 2.

``examples/grpo.yaml`` with ``staleness: 2`` and ``interrupt_every: 4`` (``max_new_tokens`` 8: two segments
per iteration) runs through the CLI, once uninterrupted (the module's reference) and once killed three times
(SIGKILL of the whole process group) at moments a seeded random choice picks: as soon as a checkpoint
appears, in the middle of the run between two checkpoints, and during a resume's start-up; each time
``--resume`` goes on. The run's prompt record (``prompts.jsonl``: the prompt ids each train step consumed,
per iteration and epoch), its metrics and its final actor weights must equal the reference's bit for bit.

Before the schedule kept its origin across resumes, the resumed run's later segments read other weight
versions (issue 39's repro: iteration ``s + 2``'s second segment, ``s`` the checkpoint), and the weights
differed. One process: the schedule is the executor's, so 2 workers follow it too
(``tests/test_partial_rollouts.py`` resumes a 2-worker run between segments).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.data import PromptStream, Rows, make_batch
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.records.prompt_record import read_prompts
from rlflow.schedulers.records.rundir import RunRecorder, read_metrics
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import CLI
from tests.test_async import TIMED

ROOT = Path(__file__).resolve().parents[1]
ITERATIONS = 8
INTERVAL = 2  # checkpoints after even iterations: a kill after an odd one loses an iteration
ARGS = [
    "examples/grpo.yaml",
    "nodes.actor_gen.staleness=2",
    "nodes.actor_gen.interrupt_every=4",
    f"run.iterations={ITERATIONS}",
    f"run.checkpoint_interval={INTERVAL}",
    "run.eval_interval=0",
    "run.seed=3",
]


@dataclass(frozen=True)
class Finished:
    """What a finished run leaves to compare: its prompt record, metrics per iteration, final actor."""

    prompts: list[dict[str, Any]]
    rows: dict[int, dict[str, Any]]
    actor: dict[str, torch.Tensor]


def _finished(out: Path) -> Finished:
    rows = {
        int(r["iteration"]): {k: v for k, v in r.items() if not k.startswith(TIMED) and v is not None}
        for r in read_metrics(out).to_pylist()
    }
    actor = load_file(out / f"checkpoints/iter-{ITERATIONS:06d}/models/actor/model.safetensors")
    return Finished(read_prompts(out), rows, actor)


def _start(out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """``rlflow run`` of the module's graph into ``out``, in a process group of its own; stderr appended to
    ``<out>.stderr`` (an unread pipe could fill and block the run)."""
    with open(f"{out}.stderr", "ab") as err:
        return subprocess.Popen(
            [*CLI, "run", *ARGS, f"run.output_dir={out}", *extra],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


def _kill_when(proc: subprocess.Popen[bytes], event: Callable[[], bool], what: str) -> None:
    """Poll for ``event`` (a file the run writes), then SIGKILL the run's whole process group."""
    deadline = time.monotonic() + 300
    while not event():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within 300 s"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def _run_to_end(out: Path, *extra: str) -> None:
    proc = _start(out, *extra)
    code = proc.wait(timeout=300)
    assert code == 0, (
        f"rlflow run {' '.join(extra)} exited {code}:\n{Path(f'{out}.stderr').read_text()[-3000:]}"
    )


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


# -- the prompt record ------------------------------------------------------------------------------------
def test_prompt_record_ids_fields_torn_lines_and_drop(tmp_path: Path) -> None:
    # a row's id is its `id` field where the rows have one, else its index in the training split
    rows = Rows({"prompt": ["a", "b", "c", "d", "e"], "id": ["q0", "q1", "q2", "q3", "q4"]}, "t.jsonl")
    stream = PromptStream(rows, seed=0, shuffle=False)
    stream.next_indices(2)
    assert stream.drawn == (0, ["q0", "q1"])
    stream.next_indices(2)
    stream.next_indices(2)  # one row left in epoch 0: dropped, epoch 1 starts
    assert stream.drawn == (1, ["q0", "q1"])
    plain = PromptStream(Rows({"prompt": ["a", "b", "c"]}, "t.jsonl"), seed=0, shuffle=False)
    plain.next_indices(2)
    assert plain.drawn == (0, [0, 1])
    rec = RunRecorder(tmp_path)
    for k in (1, 2, 3):
        rec.log_prompts(k, 0, [k, 10 + k])
    with (tmp_path / "prompts.jsonl").open("a") as f:
        f.write('{"iteration": 4, "ep')  # a run killed inside a line
    with pytest.warns(UserWarning, match=r"prompts.jsonl:4: unreadable prompt-record line skipped"):
        assert [e["iteration"] for e in read_prompts(tmp_path)] == [1, 2, 3]
    rec.drop_after(2)  # a resume from the checkpoint after iteration 2
    assert read_prompts(tmp_path) == [
        {"iteration": 1, "epoch": 0, "ids": [1, 11]},
        {"iteration": 2, "epoch": 0, "ids": [2, 12]},
    ]


@pytest.mark.parametrize(
    ("graph", "overrides"),
    [
        ("examples/grpo.yaml", []),
        ("examples/grpo.yaml", ["nodes.actor_gen.staleness=2", "nodes.actor_gen.interrupt_every=4"]),
        ("examples/dapo.yaml", []),  # filter rounds: the groups kept, not every prompt drawn
        ("examples/dapo.yaml", ["nodes.actor_gen.staleness=1"]),
    ],
)
def test_prompt_record_names_the_prompts_each_train_step_received(
    graph: str, overrides: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = load_graph(
        ROOT / graph,
        [*overrides, "run.iterations=2", "run.eval_interval=0", "run.checkpoint_interval=0",
         f"run.output_dir={tmp_path}"],
    )  # fmt: skip
    c = Controller(g)
    trained: list[Batch] = []
    run_node = c.executor.run_node

    def recording(name: str, batch: Batch, *args: Any, **kwargs: Any) -> Any:
        if name == "actor_train":
            trained.append(batch)
        return run_node(name, batch, *args, **kwargs)

    monkeypatch.setattr(c.executor, "run_node", recording)
    try:
        c.run()
        record = read_prompts(tmp_path)
        assert [e["iteration"] for e in record] == [1, 2]
        for entry, batch in zip(record, trained, strict=True):
            # the train step's prompts, pads dropped, are the recorded rows' prompts tokenized
            expected = make_batch(c.stream.rows.take(entry["ids"]), c.stream.tokenizer, ["prompt"])
            got = batch.tensor("prompt_ids")[batch.tensor("prompt_mask").bool().any(-1)]
            step = len(got) // len(entry["ids"])  # per prompt or per sample rows
            for i, row in enumerate(entry["ids"]):
                want = expected.tensor("prompt_ids")[i][expected.tensor("prompt_mask")[i].bool()]
                have = batch.tensor("prompt_ids")[i * step][batch.tensor("prompt_mask")[i * step].bool()]
                assert torch.equal(have, want), (entry["iteration"], row)
    finally:
        c.close()


# -- exact resume through the CLI -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Finished:
    out = tmp_path_factory.mktemp("async-resume") / "reference"
    _run_to_end(out)
    return _finished(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_sigkills_at_random_moments_resume_exactly(reference: Finished, tmp_path: Path) -> None:
    rng = random.Random(39)
    checkpoint = rng.choice(range(INTERVAL, ITERATIONS - 2, INTERVAL))  # kill 1: as it appears
    middle = rng.choice([k for k in range(checkpoint + 1, ITERATIONS) if k % INTERVAL])  # kill 2: after k
    out = tmp_path / "run"
    proc = _start(out)
    _kill_when(proc, (out / f"checkpoints/iter-{checkpoint:06d}").is_dir, f"checkpoint {checkpoint}")
    proc = _start(out, "--resume")
    # iteration `middle` is recorded, the next one runs, no checkpoint holds `middle`: a resume drops it
    _kill_when(proc, (out / f"metrics/iter-{middle:06d}.parquet").exists, f"iteration {middle}'s metrics")
    recorded = [e["iteration"] for e in read_prompts(out)]  # each once, in order (the first resume's drop)
    assert recorded == list(range(1, len(recorded) + 1)) and len(recorded) >= middle
    graph_written = (out / "graph.yaml").stat().st_mtime_ns
    proc = _start(out, "--resume")
    # the resume has loaded its checkpoint and dropped the records after it (graph.yaml is rewritten next)
    _kill_when(
        proc, lambda: (out / "graph.yaml").stat().st_mtime_ns != graph_written, "the resume's start-up"
    )
    _run_to_end(out, "--resume")
    resumed = _finished(out)
    assert resumed.prompts == reference.prompts
    assert len({i for e in resumed.prompts for i in e["ids"]}) == ITERATIONS * 8  # no prompt twice in epoch 0
    assert resumed.rows == reference.rows
    assert resumed.actor.keys() == reference.actor.keys()
    differ = [k for k in reference.actor if not torch.equal(resumed.actor[k], reference.actor[k])]
    assert not differ, f"actor weights differ from the uninterrupted run's: {differ[:3]}"
