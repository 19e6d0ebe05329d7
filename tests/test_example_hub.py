"""examples/hub/grpo_chat.yaml end to end, CI-sized, offline: a model by Hub id from a local Hugging Face
cache, a ``datasets`` data set of message-list prompts rendered with the tokenizer's chat template, and
TensorBoard logging, all built by examples/hub/make_local_hub.py (its functions, in this process).

One iteration through the controller in one process, from a working directory holding the script's output
at ``out/hub`` (the graph's own relative paths): the id resolves to the cache's snapshot, the generate node
receives the chat-rendered prompt ids, and TensorBoard's event file holds every metric name the run records.
Then the mistakes docs/ecosystem.md shows, each one line from ``rlflow validate`` naming the file and key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from examples.hub import make_local_hub
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import record_batches

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples/hub/grpo_chat.yaml"


@pytest.fixture(scope="module")
def local_hub(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python examples/hub/make_local_hub.py out/hub``, in a temporary working directory."""
    work = tmp_path_factory.mktemp("work")
    out = work / "out" / "hub"
    snapshot = make_local_hub.write_model(out / "hf")
    make_local_hub.write_dataset(out / "arith_chat")
    return {"work": work, "cache": out / "hf", "snapshot": snapshot}


def _chat_prompt(content: str) -> list[int]:
    """The ids the chat template renders ``[{"role": "user", "content": content}]`` to, with the generation
    prompt, derived by hand: <bos>=1, <|user|>=20, each character (digits 0-9 = ids 4-13, + 14, - 15,
    = 17), <eos>=2 ending the turn, <|assistant|>=21 opening the reply."""
    chars = {c: 4 + i for i, c in enumerate("0123456789+-*= ")}
    return [1, 20, *(chars[c] for c in content), 2, 21]


def test_example_runs_offline_from_the_local_hub(
    local_hub: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from datasets import load_from_disk
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(local_hub["work"])
    monkeypatch.setenv("HF_HUB_CACHE", "out/hub/hf")  # as docs/ecosystem.md runs it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    graph = load_graph(EXAMPLE, ["run.iterations=1"])
    actor = graph.spec.models["actor"]
    assert actor.path == actor.tokenizer_dir == str(local_hub["snapshot"])  # absolute, from the cache
    assert Path(actor.path).parent.parent.name == "models--rlflow--arith-chat-tiny"

    rows = load_from_disk("out/hub/arith_chat")["train"]
    rendered = {tuple(_chat_prompt(r["prompt"][0]["content"])) for r in rows}
    assert len(rendered) == len(rows) == 125

    controller = Controller(resolve_plan(graph, None))
    seen = record_batches(controller, monkeypatch)
    try:
        controller.run()
    finally:
        controller.close()

    gen = seen["actor_gen"]
    ids, mask = gen.tensor("prompt_ids").tolist(), gen.tensor("prompt_mask").tolist()
    prompts = [tuple(t for t, keep in zip(r, m, strict=True) if keep) for r, m in zip(ids, mask, strict=True)]
    assert len(prompts) == 8 and set(prompts) <= rendered  # 8 training prompts, as the template renders them

    run_dir = Path("runs/hub-grpo")
    recorded = {name for name in read_metrics(run_dir).column_names if name != "iteration"}
    events = EventAccumulator(str(run_dir / "trackers/tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == recorded
    assert {"critic/score/mean", "val/accuracy", "actor/pg_loss"} <= recorded
    assert [e.step for e in events.Scalars("critic/score/mean")] == [1]
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("models.actor.path=rlflow/absent",
         "models.actor.path: 'rlflow/absent' is not a local directory (relative to {work}), so it is read as "
         "a Hub id; Hub model 'rlflow/absent' (revision main) is not in the Hugging Face cache out/hub/hf"),
        ("models.actor.path=checkpoints/actor",
         "models.actor.path: 'checkpoints/actor' is not a local directory (relative to {work}), so it is "
         "read as a Hub id"),
        ("models.actor.path=./checkpoints/actor",
         "models.actor.path: directory './checkpoints/actor' does not exist"),
        ("data.dataset.path=data/arith_chat",
         "data.dataset.path: cannot load data set 'data/arith_chat': there is no folder "
         "{work}/data/arith_chat, so it is read as a Hub id"),
        ("data.fields.prompt=question",
         "data.fields.prompt: column 'question' is missing from dataset out/hub/arith_chat, split train; "
         "available columns: prompt, answer"),
        (f"models.actor.tokenizer={ROOT}/examples/arith/tokenizer",
         "data.fields.prompt holds message lists, but the data tokenizer '{root}/examples/arith/tokenizer' "
         "(data.tokenizer) has no chat template"),
        ("run.trackers=[tensorbord]",
         "run.trackers: unknown tracker 'tensorbord' (did you mean 'tensorboard'?)"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_naming_file_and_key(
    override: str,
    message: str,
    local_hub: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(local_hub["work"])
    monkeypatch.setenv("HF_HUB_CACHE", "out/hub/hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["validate", str(EXAMPLE), override]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    expected = message.format(work=local_hub["work"], root=ROOT)
    assert err.startswith(f"rlflow validate: error: {EXAMPLE}: ") and expected in err, err
