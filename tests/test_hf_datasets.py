"""Data through the Hugging Face ``datasets`` library (``data.dataset``, issue 40): data sets built here
(``save_to_disk`` folders, a ``DatasetDict`` with train/test, JSON data files through the ``json`` builder),
offline with a private cache, run through the single-process runtime as ``examples/sft.yaml`` runs its
``.jsonl`` file: the same rows, field mapping, filters, the seeded order, exact resume, and each bad input
as one error naming the key (and the graph file from ``rlflow validate``/``run``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants
import pytest
import torch
from datasets import Dataset, DatasetDict

from rlflow.dataflow.data import load_splits
from rlflow.dataflow.errors import DataError, GraphError
from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
SFT = "examples/sft.yaml"  # data.train: examples/data/sft.jsonl (48 rows: prompt, response); batch 16
JSONL = [json.loads(line) for line in (ROOT / "examples/data/sft.jsonl").read_text().splitlines()]
# the same rows under other column names, with columns no field maps (a level for the filters)
ROWS = [
    {"question": r["prompt"], "solution": r["response"], "level": i % 3, "id": i} for i, r in enumerate(JSONL)
]
HELD_OUT = [{"question": f"{i}+{i}=", "solution": str(2 * i), "level": 0, "id": 100 + i} for i in range(5)]
MAPPED = ["data.train=null", "data.fields={prompt: question, response: solution}"]
QUIET = ["run.eval_interval=0", "run.checkpoint_interval=0"]


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Repository-relative graph paths; no network and a private ``datasets`` cache, as CI has."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    torch.set_num_threads(1)


def small_first(row: dict[str, Any]) -> bool:
    """A ``filter_fn``: keeps the rows whose question starts with a digit below 5."""
    return row["question"][0] < "5"


def not_a_bool(row: dict[str, Any]) -> Any:
    """A ``filter_fn`` answering a number, refused."""
    return 1


def failing(row: dict[str, Any]) -> bool:
    """A ``filter_fn`` that raises."""
    raise KeyError("answer")


def _saved(tmp: Path) -> str:
    """A folder saved from a single ``Dataset`` (its ``train`` split)."""
    Dataset.from_list(ROWS).save_to_disk(tmp / "saved")
    return str(tmp / "saved")


def _dict(tmp: Path) -> str:
    """A folder saved from a ``DatasetDict`` with ``train`` and ``test`` splits."""
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(HELD_OUT)}).save_to_disk(
        tmp / "dd"
    )
    return str(tmp / "dd")


def _json_files(tmp: Path) -> list[str]:
    """Overrides reading JSON Lines files through the ``json`` builder, split -> file."""
    for name, rows in (("train", ROWS), ("test", HELD_OUT)):
        (tmp / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "data.dataset.path=json",
        f"data.dataset.data_files={{train: {tmp}/train.jsonl, test: {tmp}/test.jsonl}}",
    ]


def _controller(tmp: Path, *overrides: str, resume: bool = False, graph: str = SFT) -> Controller:
    run = f"run.output_dir={tmp / 'run'}"
    return Controller(resolve_plan(load_graph(graph, [run, *overrides]), None), resume=resume)


def _served(c: Controller, batches: int) -> list[list[str]]:
    """The prompts of the next ``batches`` training batches the controller's stream serves."""
    return [c.stream.rows.take(c.stream.next_indices(16))["prompt"] for _ in range(batches)]


@pytest.mark.parametrize("source", ["saved", "dict", "json"])
def test_rows_and_batches_match_the_jsonl_file(source: str, tmp_path: Path) -> None:
    """A data set with the .jsonl file's rows gives the runtime the same rows, order and token batches; the
    field mapping picks the renamed columns and leaves the others out; ``eval_split`` gives held-out rows."""
    ref = _controller(tmp_path / "ref", *QUIET)
    where = {"saved": lambda: [f"data.dataset.path={_saved(tmp_path)}"],
             "dict": lambda: [f"data.dataset.path={_dict(tmp_path)}", "data.dataset.eval_split=test"],
             "json": lambda: [*_json_files(tmp_path), "data.dataset.eval_split=test"]}[source]()  # fmt: skip
    c = _controller(tmp_path / "hf", *MAPPED, *where, *QUIET)
    try:
        assert (
            c.stream.rows.columns
            == ref.stream.rows.columns
            == {
                "prompt": [r["prompt"] for r in JSONL],
                "response": [r["response"] for r in JSONL],
            }
        )
        for _ in range(4):  # across the epoch boundary (48 rows, 16 a batch)
            a, b = c.stream.next_batch(16), ref.stream.next_batch(16)
            for key in ("prompt_ids", "prompt_mask", "response_ids", "response_mask"):
                assert torch.equal(a.tensor(key), b.tensor(key)), key
        if source == "saved":
            assert c.eval_rows is None
        else:
            assert c.eval_rows is not None
            assert c.eval_rows.columns["prompt"] == [r["question"] for r in HELD_OUT]
    finally:
        c.close()
        ref.close()


def test_filters_keep_the_rows_they_name(tmp_path: Path) -> None:
    path = f"data.dataset.path={_saved(tmp_path)}"
    c = _controller(tmp_path / "a", *MAPPED, path, "data.dataset.filter={level: [0, 2]}", *QUIET)
    kept = [r["question"] for r in ROWS if r["level"] in (0, 2)]
    assert c.stream.rows.columns["prompt"] == kept and len(kept) == 32
    c.close()
    both = [
        path,
        "data.dataset.filter={level: 1}",
        "data.dataset.filter_fn=tests.test_hf_datasets:small_first",
    ]
    small = "nodes.actor_train.batch_size=4"  # fewer rows than one batch of 16 are refused
    c = _controller(tmp_path / "b", *MAPPED, *both, "data.dataset.split=train[:40]", small, *QUIET)
    kept = [r["question"] for r in ROWS[:40] if r["level"] == 1 and r["question"][0] < "5"]
    assert c.stream.rows.columns["prompt"] == kept and 0 < len(kept) < 14
    c.close()


def test_the_seed_orders_the_rows(tmp_path: Path) -> None:
    """Same run.seed, same order; another seed, another order; data.shuffle false: the data set's order."""
    path = f"data.dataset.path={_saved(tmp_path)}"
    orders = []
    for i, extra in enumerate(["run.seed=1", "run.seed=1", "run.seed=2", "data.shuffle=false"]):
        c = _controller(tmp_path / str(i), *MAPPED, path, extra, *QUIET)
        orders.append(_served(c, 3))
        c.close()
    assert orders[0] == orders[1] != orders[2]
    assert sorted(p for b in orders[0] for p in b) == sorted(r["question"] for r in ROWS)  # one epoch
    assert [p for b in orders[3] for p in b] == [r["question"] for r in ROWS]


def _recording(c: Controller, seen: list[list[str]]) -> None:
    """Record the prompts of every training batch ``c`` serves."""
    serve = c.stream.next_batch

    def wrapped(n: int) -> Any:
        batch = serve(n)
        rows = zip(batch["prompt_ids"].tolist(), batch["prompt_mask"].tolist(), strict=True)
        seen.append([str([t for t, keep in zip(ids, mask, strict=True) if keep]) for ids, mask in rows])
        return batch

    c.stream.next_batch = wrapped  # type: ignore[method-assign]


def test_resume_continues_at_the_exact_data_position(tmp_path: Path) -> None:
    """3 iterations == 1, stop, resume, 2 more: the same batches (resumed mid-epoch, then into the next:
    40 rows, 16 a batch, the last 8 of an epoch left out) and the same weights."""
    common = [*MAPPED, f"data.dataset.path={_saved(tmp_path)}", "data.dataset.split=train[:40]",
              "run.iterations=3", "run.eval_interval=0"]  # fmt: skip
    full = _controller(tmp_path / "a", *common, "run.checkpoint_interval=0")
    seen_full: list[list[str]] = []
    _recording(full, seen_full)
    full.run()
    first = _controller(tmp_path / "b", *common, "run.checkpoint_interval=1")
    seen: list[list[str]] = []
    _recording(first, seen)
    first.run(iterations=1)
    resumed = _controller(tmp_path / "b", *common, "run.checkpoint_interval=1", resume=True)
    assert resumed.start_iteration == 1
    _recording(resumed, seen)
    resumed.run()
    assert seen == seen_full and len(seen) == 3
    assert len({p for b in seen[:2] for p in b}) == 32  # epoch 0: two batches of distinct rows
    for model in full.executor.models:
        a = full.executor.models[model].module.state_dict()
        b = resumed.executor.models[model].module.state_dict()
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.dataset.path=/no/such/folder"],
         r"data\.dataset\.path: folder '/no/such/folder' does not exist"),
        (["data.dataset.path=no/such/folder"],  # two slashes: a path, not a Hub id
         r"data\.dataset\.path: folder 'no/such/folder' does not exist"),
        (["data.dataset.path=nobody/no-such-set"],
         r"data\.dataset\.path: cannot load data set 'nobody/no-such-set': .*offline .* in the cache"),
        (["@dict", "data.dataset.split=tset"],
         r"data\.dataset\.split: split 'tset' does not exist in .* \(did you mean 'test'\?\); "
         r"splits: train, test"),
        (["@dict", "data.dataset.eval_split=valid"],
         r"data\.dataset\.eval_split: split 'valid' does not exist .*; splits: train, test"),
        (["@saved", "data.fields.prompt=questoin"],
         r"data\.fields\.prompt: column 'questoin' is missing from dataset .*, split train \(did you mean "
         r"'question'\?\); available columns: question, solution, level, id"),
        (["@saved", "data.dataset.filter={levle: 1}"],
         r"data\.dataset\.filter\.levle: column 'levle' is missing .*did you mean 'level'"),
        (["@saved", "data.dataset.filter={level: 7}"],
         r"data\.dataset\.filter: keeps no row of dataset .*, split train \(48 rows\); column 'level' holds "
         r"e\.g\. 0, 1, 2"),
        (["@saved", "data.dataset.filter={id: '0'}"],  # a string never equals the int column's 0
         r"data\.dataset\.filter: keeps no row .*; filter\.id gives str values, the column holds int values"),
        (["@saved", "data.dataset.filter_fn=tests.test_hf_datasets:nothing"],
         r"data\.dataset\.filter_fn: cannot import 'tests\.test_hf_datasets:nothing'"),
        (["@saved", "data.dataset.filter_fn=tests.test_hf_datasets:not_a_bool"],
         r"data\.dataset\.filter_fn: .*not_a_bool' must return True or False, got 1"),
        (["@saved", "data.dataset.filter_fn=tests.test_hf_datasets:failing"],
         r"data\.dataset\.filter_fn: .*failing' raised KeyError: 'answer' on row"),
        (["@saved", "data.dataset.name=main"], r"data\.dataset\.name: .* written by save_to_disk"),
        (["@saved", "data.dataset.split=train[:oops]"],
         r"data\.dataset\.split: 'train\[:oops\]' is not a split"),
    ],
)  # fmt: skip
def test_bad_data_is_one_error_naming_the_key(
    overrides: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    made = {"@saved": lambda: _saved(tmp_path), "@dict": lambda: _dict(tmp_path)}
    items = [f"data.dataset.path={made[o]()}" if o in made else o for o in overrides]
    with pytest.raises(DataError, match=message):
        _controller(tmp_path, *MAPPED, *items)
    assert not (tmp_path / "run").exists()
    # rlflow validate names the graph file and the key, in one line
    capsys.readouterr()
    assert main(["validate", SFT, *MAPPED, *items]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and re.match(rf"rlflow validate: error: {SFT}: {message}", errors[0]), errors


def test_without_the_datasets_library_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = load_graph(SFT, [*MAPPED, f"data.dataset.path={_saved(tmp_path)}"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    with pytest.raises(
        DataError, match=r"data\.dataset needs the Hugging Face datasets library.*rlflow\[datasets\]"
    ):
        load_splits(graph.spec.data)


def test_run_stops_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    argv = ["run", SFT, *MAPPED, f"data.dataset.path={_saved(tmp_path)}", "data.fields.prompt=prompt"]
    assert main([*argv, f"run.output_dir={out}", "--no-progress"]) == 2
    assert f"{SFT}: data.fields.prompt: column 'prompt' is missing" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.dataset.path=x"], r"data: give exactly one of 'train' .*, 'generator' and 'dataset'"),
        ([*MAPPED, "data.dataset.paht=x"],
         r"data\.dataset\.paht: unknown field 'paht' \(did you mean 'path'\?\)"),
        ([*MAPPED, "data.dataset.split=test"], r"data\.dataset: missing required field 'path'"),
        ([*MAPPED, "data.dataset.path=x", "data.dataset.filter={level: {a: 1}}"],
         r"data\.dataset\.filter\.level: expected a string, number or true/false, or a non-empty list"),
        ([*MAPPED, "data.dataset.path=x", "data.dataset.filter_fn=nodots"],
         r"data\.dataset\.filter_fn: 'nodots' is not an import path"),
        ([*MAPPED, "data.dataset.path=x", "data.dataset.eval_split=test", "data.eval=e.jsonl"],
         r"data\.eval: give one held-out split"),
        ([*MAPPED, "data.dataset.path=x", "data.dataset.data_files=[]"],
         r"data\.dataset\.data_files: expected a path"),
    ],
)  # fmt: skip
def test_bad_data_dataset_keys_are_graph_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(GraphError, match=rf"^{SFT}: {message}"):
        load_graph(SFT, overrides)


def test_the_graph_file_round_trips(tmp_path: Path) -> None:
    """The run's graph.yaml holds data.dataset and loads back to the same spec; a graph without one writes
    no ``dataset`` key (checkpoint fingerprints of earlier runs stay as they were)."""
    keys = [f"data.dataset.path={_dict(tmp_path)}", "data.dataset.eval_split=test[:2]",
            "data.dataset.filter={level: [0, 1]}",
            "data.dataset.filter_fn=tests.test_hf_datasets:small_first"]  # fmt: skip
    graph = load_graph(SFT, [*MAPPED, *keys])
    written = tmp_path / "graph.yaml"
    written.write_text(graph.to_yaml())
    assert load_graph(str(written)).spec.data == graph.spec.data
    assert "dataset" not in load_graph(SFT).to_yaml().split("nodes:")[0]
