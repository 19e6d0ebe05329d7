"""Simulator: disjoint meshes overlap, overlapping meshes serialise, version edges add reallocations."""

from __future__ import annotations

from schedulers.cluster import load_cluster
from schedulers.cost import CostModel
from schedulers.plan import Layout, NodePlacement
from schedulers.problem import ModelShape, PlanNode, PlanProblem
from schedulers.simulator import simulate

CFG = dict(hidden_size=8, intermediate_size=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=16)
SHAPE = ModelShape.from_config({**CFG, "num_hidden_layers": 2})


def two_readers() -> CostModel:
    problem = PlanProblem(
        {"a": SHAPE, "b": SHAPE},
        (PlanNode("x", "a", "inference", 8, 4, 4), PlanNode("y", "b", "inference", 8, 4, 4)),
    )
    return CostModel(problem, load_cluster("cpu-local", hosts=2))


def test_disjoint_meshes_overlap_and_shared_meshes_serialise() -> None:
    cm = two_readers()
    one = Layout(1, 1, 1)
    par = simulate(cm, {"x": NodePlacement((0,), one), "y": NodePlacement((1,), one)}, iterations=2)
    ser = simulate(cm, {"x": NodePlacement((0,), one), "y": NodePlacement((0,), one)}, iterations=2)
    t = cm.node_cost("x", NodePlacement((0,), one)).time_s
    ev = {(e.iteration, e.node): e for e in par.events}
    assert ev[(0, "x")].start_s == ev[(0, "y")].start_s == 0.0
    assert par.iteration_s == t  # per-iteration period of two overlapping nodes
    es = {(e.iteration, e.node): e for e in ser.events}
    assert es[(0, "y")].start_s == es[(0, "x")].end_s
    assert ser.iteration_s == 2 * t
    assert len(par.iteration_ends) == 2


def test_data_and_version_edges() -> None:
    problem = PlanProblem(
        {"actor": SHAPE},
        (
            PlanNode("gen", "actor", "generate", 8, 4, 4),
            PlanNode("train", "actor", "train", 8, 4, 4),
        ),
        data_edges=(("gen", "train", "response_ids", 256),),
        version_edges=(("train", "gen"),),
    )
    cm = CostModel(problem, load_cluster("cpu-local", hosts=2))
    plan = {
        "gen": NodePlacement((2, 3), Layout(2, 1, 1)),
        "train": NodePlacement((0, 1), Layout(1, 2, 1)),
    }
    tl = simulate(cm, plan, iterations=3)
    by = {(e.iteration, e.node, e.kind): e for e in tl.events}
    # data: train waits for gen plus the edge transfer between hosts
    move = by[(0, "gen->train", "data_transfer")]
    assert move.start_s == by[(0, "gen", "node")].end_s and by[(0, "train", "node")].start_s >= move.end_s
    # version: no reallocation in iteration 0, one before each later gen, after the previous train
    assert (0, "train->gen", "reallocation") not in by
    realloc = by[(1, "train->gen", "reallocation")]
    assert realloc.start_s >= by[(0, "train", "node")].end_s
    assert set(realloc.devices) == {0, 1, 2, 3}
    assert by[(1, "gen", "node")].start_s >= realloc.end_s
    assert [e.kind for e in tl.events].count("reallocation") == 2
    rows = tl.to_rows()
    assert {"iteration", "node", "device", "start_s", "end_s", "kind", "predicted_s"} <= set(rows[0])
