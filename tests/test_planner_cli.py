"""Planner input adapter, profile fitting, and the `rlflow plan` / `rlflow profile` commands."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataflow.errors import PlanError
from schedulers.cluster import load_cluster
from schedulers.plan import load_plan
from schedulers.problem import problem_from_graph
from schedulers.profile import apply_profile, hardware_key, profile_block

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_problem_from_graph_ppo() -> None:
    from dataflow.loader import load_graph

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


def test_profile_block_measures_every_op() -> None:
    cfg = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=64
    )
    rows = profile_block(cfg, batch_sizes=(1, 2), seq_lens=(8,), repeats=1)
    assert {r["op"] for r in rows} == {"forward", "backward", "decode", "optimizer"}
    assert all(r["seconds"] > 0 for r in rows)


def test_plan_command_writes_loadable_plan_and_gantt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dataflow.cli import main

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
