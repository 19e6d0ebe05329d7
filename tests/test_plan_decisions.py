"""Search by default (issue 36): a decision the graph leaves out is searched, one it writes is pinned, and
the plan file and table say which; a plan file written by ``rlflow plan`` feeds the runtime the same
choices, and one without the record loads as before.

Tier 3 (planner and plan files, no process) through ``rlflow plan`` and ``resolve_plan``; tier 5 (the
runtime on a tiny model, CPU) for a plan file's choice reaching the train step."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rlflow.dataflow.errors import PlanError
from rlflow.dataflow.loader import load_graph, loads_graph
from rlflow.dataflow.node_spec import UNPLANNED
from rlflow.dataflow.plan_spec import Layout, NodePlacement
from rlflow.schedulers.cli import main
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.planner.cluster_files import load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.decisions import decision_lists
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import dump_plan, load_plan
from rlflow.schedulers.planner.search import Searcher
from rlflow.schedulers.runtime.controller import Controller
from tests.graph_helpers import base, dump, put
from tests.harness import CheckpointSpy

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "schedulers/planner/clusters/h100-8x.yaml"
# prompt width and every response at the cap: the data are not read, so the figures are the graph's alone
LENGTHS = ["--prompt-len", "64", "--mean-new-tokens", "4096"]


def _raw(**pins: object) -> dict[str, Any]:
    """A GRPO graph of a 0.1B-parameter Llama (8 layers, hidden 1024) with 4,096-token responses on one
    device, so that a train micro-batch's activations are most of its memory; ``pins``: node.key -> value."""
    raw = put(put(base(), "run.devices", 1), "nodes.train.args", {})
    cfg = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
           "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 32000,
           "max_position_embeddings": 8192}  # fmt: skip
    raw = put(put(raw, "models.actor.config", cfg), "nodes.gen.args.max_new_tokens", 4096)
    for path, value in pins.items():
        raw = put(raw, f"nodes.{path.replace('__', '.')}", value)
    return raw


def _cluster(tmp: Path, memory_bytes: float) -> Path:
    """The h100-8x preset as one device of ``memory_bytes`` (a cluster file)."""
    data = yaml.safe_load(PRESET.read_text())
    data.update(name="h100-1x", devices_per_host=1)
    data["device"]["memory_bytes"] = memory_bytes
    path = tmp / f"cluster-{memory_bytes:.3g}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _plan(tmp: Path, raw: dict[str, Any], cluster: Path, name: str) -> tuple[dict[str, Any], Path]:
    """``rlflow plan`` of ``raw`` on ``cluster``: the plan file read as YAML, and its path."""
    graph, out = tmp / f"{name}.yaml", tmp / f"{name}-plan.yaml"
    graph.write_text(dump(raw))
    argv = ["plan", str(graph), "--cluster", str(cluster), "--out", str(out), *LENGTHS]
    assert main([*argv, "--restarts", "1", "--steps", "50", "--gantt", str(tmp / f"{name}.png")]) == 0
    return yaml.safe_load(out.read_text()), out


def _train_peaks() -> tuple[float, float, float, float]:
    """(peak bytes, seconds) of the train node on one device at its fewest-bytes micro-batch count, without
    and with recompute, as the cost model prices them (the same model `rlflow plan` searches with)."""
    graph = loads_graph(dump(_raw()), source="g.yaml")
    problem = problem_from_graph(graph, prompt_len=64, device_type="cuda", mean_new_tokens=4096)
    cost = CostModel(problem, dataclasses.replace(load_cluster(str(PRESET)), devices_per_host=1))
    node = problem.node("train")
    rows = node.rows // node.mini_batches  # one row per micro-batch: the least memory
    plain, redo = (
        cost.node_cost(node, NodePlacement((0,), Layout(1, 1, 1, rows), recompute=r)) for r in (False, True)
    )
    return plain.memory.peak, plain.time_s, redo.memory.peak, redo.time_s


def test_a_graph_that_pins_nothing_searches_every_decision_and_recomputes_where_memory_needs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing pinned: the plan file lists every decision that applies as searched (the generate node's
    engine and micro-batches, the train node's micro-batches and recompute) and none pinned. On a device
    between the train node's least memory with and without recompute, the search turns recompute on, which
    the fixed default (off, ``UNPLANNED``) would not fit; the plan file feeds that choice to the runtime."""
    monkeypatch.chdir(ROOT)
    plain_peak, plain_s, redo_peak, redo_s = _train_peaks()
    assert redo_peak < plain_peak and redo_s > plain_s  # recompute: less memory, one more forward
    usable = yaml.safe_load(PRESET.read_text())["usable_memory_fraction"]
    # capacity halfway between the two peaks (the other models' bytes are under 1 % of the gap)
    tight = _cluster(tmp_path, (plain_peak + redo_peak) / 2 / usable)
    data, out = _plan(tmp_path, _raw(), tight, "free")
    assert UNPLANNED["recompute"] is False and data["train"]["recompute"] is True
    assert data["train"]["searched"] == ["micro_batches", "recompute"] and data["train"]["pinned"] == []
    # the engine is searched; a vLLM engine batches its own requests and takes a memory share instead
    builtin = data["gen"]["engine"] == "builtin"
    gen = ["micro_batches", "engine"] if builtin else ["engine", "gpu_memory_utilization"]
    assert data["gen"]["searched"] == gen and data["gen"]["pinned"] == []
    assert data["ref"]["searched"] == ["micro_batches"] and data["ref"]["pinned"] == []
    # round trip: the file loads back (records and all) and resolves to the same choices for the runtime
    planned = resolve_plan(loads_graph(dump(_raw()), source="g.yaml"), out)
    assert planned.run_node("train").recompute is True
    assert planned.placement("train") == load_plan(out)["train"]
    assert planned.run_node("gen").engine == data["gen"]["engine"]


def test_a_pinned_decision_is_kept_where_another_is_cheaper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With memory to spare recompute only costs time: a graph that leaves it out gets it off, one that
    writes ``recompute: true`` keeps it on, and each plan file says which it was (searched / pinned)."""
    monkeypatch.chdir(ROOT)
    roomy = _cluster(tmp_path, 85.52e9)
    free, _ = _plan(tmp_path, _raw(), roomy, "free")
    assert free["train"]["recompute"] is False and "recompute" in free["train"]["searched"]
    pinned, out = _plan(tmp_path, _raw(train__recompute=True, gen__engine="builtin"), roomy, "pinned")
    assert pinned["train"]["pinned"] == ["recompute"] and pinned["train"]["searched"] == ["micro_batches"]
    assert pinned["gen"]["pinned"] == ["engine"] and "engine" not in pinned["gen"]
    table = capsys.readouterr().out.splitlines()
    row = next(line for line in reversed(table) if line.startswith("train "))  # the second plan's table
    assert "recompute" in row and row.endswith("micro_batches  recompute")  # columns: searched, pinned
    planned = resolve_plan(
        loads_graph(dump(_raw(train__recompute=True, gen__engine="builtin")), source="g.yaml"), out
    )
    assert planned.run_node("train").recompute is True and planned.run_node("gen").engine == "builtin"


def test_plan_files_without_the_record_load_as_before_and_a_bad_record_is_named(tmp_path: Path) -> None:
    plan = {"train": NodePlacement((0, 1), Layout(2, 1, 1, 2), recompute=True, reshard=False)}
    graph = loads_graph(dump(put(_raw(), "run.devices", 2)), source="g.yaml")
    problem = problem_from_graph(graph, prompt_len=64, device_type="cuda", mean_new_tokens=4096)
    record = decision_lists(problem, plan)
    assert record == {"train": {"searched": ["micro_batches", "recompute", "reshard"], "pinned": []}}
    new, old = tmp_path / "new.yaml", tmp_path / "old.yaml"
    new.write_text(dump_plan(plan, "by rlflow plan", record))
    old.write_text(dump_plan(plan))
    assert "searched: [micro_batches, recompute, reshard], pinned: []" in new.read_text()
    assert "searched" not in old.read_text() and load_plan(new) == load_plan(old) == plan
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {devices: 0-1, layout: d2t1p1m2, searched: [recompte]}\n")
    with pytest.raises(PlanError, match=r"bad\.yaml: plan\.train\.searched: 'recompte' is not a decision .*"
                       r"did you mean 'recompute'"):  # fmt: skip
        load_plan(bad)


def test_left_out_decisions_run_the_unplanned_values_without_a_plan() -> None:
    """No plan, or a plan that names none: the values of ``UNPLANNED`` (builtin, no recompute, reshard);
    written values run as written."""
    graph = loads_graph(dump(put(_raw(), "run.devices", 1)), source="g.yaml")
    spec = graph.spec.nodes
    assert (spec["gen"].engine, spec["train"].recompute, spec["train"].reshard) == ("auto", "auto", "auto")
    assert (spec["ref"].engine, spec["ref"].recompute, spec["ref"].reshard) == ("builtin", False, True)
    assert graph.run_node("gen").engine == UNPLANNED["engine"] == "builtin"
    assert graph.run_node("train").recompute is UNPLANNED["recompute"] is False
    assert graph.run_node("train").reshard is UNPLANNED["reshard"] is True
    assert "recompute" not in graph.spec.to_dict()["nodes"]["train"]  # left out reads back as left out
    pinned = loads_graph(dump(_raw(train__recompute=False)), source="g.yaml")
    assert pinned.spec.to_dict()["nodes"]["train"]["recompute"] is False


def test_a_plan_files_searched_choice_reaches_the_train_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """examples/sft.yaml leaves recompute out: a plan file (with its record) that turns it on makes the train
    step recompute; without a plan it does not."""
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)
    small = ["run.checkpoint_interval=0", "run.eval_interval=0", "run.iterations=1"]
    assert load_graph("examples/sft.yaml").spec.nodes["actor_train"].recompute == "auto"
    plan = tmp_path / "plan.yaml"
    placement = NodePlacement((0,), Layout(), recompute=True)
    plan.write_text(dump_plan({"actor_train": placement}, "", {"actor_train": {"searched": ["recompute"]}}))
    spy = CheckpointSpy(monkeypatch)
    for plan_file, out, recomputes in ((plan, "planned", True), (None, "plain", False)):
        spy.calls = 0
        graph = resolve_plan(
            load_graph("examples/sft.yaml", [f"run.output_dir={tmp_path / out}", *small]), plan_file
        )
        Controller(graph).run()
        assert (spy.calls > 0) is recomputes


def _searched(**pins: object) -> tuple[float, NodePlacement, NodePlacement, Searcher]:
    """(predicted seconds, train placement, gen placement, searcher) of the searched plan of ``_raw`` with
    8 samples per prompt (32 rows), a vLLM engine (no memory share pinned) and ``pins``, on one 10 GB
    device."""
    raw = put(put(_raw(gen__engine="vllm", **pins), "algorithm.n", 8), "nodes.reward.batch_size", 32)
    problem = problem_from_graph(
        loads_graph(dump(raw), source="g.yaml"), prompt_len=64, device_type="cuda", mean_new_tokens=4096
    )
    preset = load_cluster(str(PRESET))
    device = dataclasses.replace(preset.device, memory_bytes=10e9)
    searcher = Searcher(problem, dataclasses.replace(preset, devices_per_host=1, device=device))
    result = searcher.search(seed=0, restarts=1, steps=50)
    return result.iteration_s, result.plan["train"], result.plan["gen"], searcher


def test_the_search_recomputes_to_free_memory_for_a_colocated_engines_pool() -> None:
    """Recompute is slower alone (one more forward) and the train node fits without it on a 10 GB device
    beside the engine; but the bytes it frees go to the colocated vLLM engine's planned share, a larger KV
    pool and a faster rollout. The search must keep the slower-alone variant among its candidates (the
    three fastest train placements alone are all without recompute) and flip to it: it chooses recompute,
    no slower than the plan with recompute pinned on and faster than the one with it pinned off (which
    fits, with a smaller share)."""
    free_s, train, gen, searcher = _searched()
    on_s, _, _, _ = _searched(train__recompute=True)
    off_s, _, off_gen, _ = _searched(train__recompute=False)
    assert train.recompute is True
    node = searcher.problem.node("train")
    alone = [
        searcher.cost.node_cost(node, dataclasses.replace(train, recompute=r)).time_s for r in (False, True)
    ]
    assert alone[0] < alone[1]  # slower alone
    assert free_s <= on_s < off_s
    assert gen.gpu_memory_utilization is not None and off_gen.gpu_memory_utilization is not None
    assert gen.gpu_memory_utilization > off_gen.gpu_memory_utilization
