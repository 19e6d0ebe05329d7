"""Weight sync by planned reallocation in the DistExecutor (tier 3, CPU gloo workers).

After a train step the other instances of the model hold the trained weights bit for bit (``torch.equal``)
and the sync took the plan path (:mod:`rlflow.schedulers.realloc.execute`), which the executor's counters and
the reported bytes (equal to the plan's remote bytes) show:

* 2 workers, untied head: actor ``d1t2p1`` (TP DTensors) -> generation replicas ``d2t1p1``; critic
  ``d2t1p1`` trained with FSDP2 (re-gathered over dp before the plan) -> ``d2t1p1`` replicas; then a
  replica mismatch in a sync report stops the run with a NodeError.
* 4 workers, tied head: actor ``d1t2p1`` on 0-1 -> ``d4t1p1`` on 0-3 (ranks 2-3 only receive); critic
  ``d2t2p1`` (FSDP2 over TP, ``_StridedShard``) -> ``d2t1p1`` replicas on 2-3.

Also a check on 2 processes that DTensor local shards (ColwiseParallel, RowwiseParallel, vocabulary-parallel
embedding, FSDP2 re-gathered over dp) are exactly the boxes of ``param_shards``, tied and untied; the
4-process layouts (FSDP2 over TP) are checked by the workers at start-up (the plan path is used only if
every rank's boxes match, which the 4-worker test asserts through the path counters).
Every wait is bounded (executor timeouts, pytest-timeout, ``run_group``'s timeout).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from rlflow.dataflow.errors import NodeError
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.realloc.planning import plan_reallocation
from rlflow.schedulers.runtime.choose_executor import make_executor
from rlflow.schedulers.runtime.distributed.dist_executor import DistExecutor
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.protocol import SyncReport, TargetReport
from rlflow.schedulers.runtime.distributed.weight_sync import model_info
from tests.test_dist_executor import FAST, PLAN_2, _graph, _in_repo, _seq_batch  # noqa: F401 (fixture)
from tests.test_dist_layouts import CONFIG  # the same tiny Llama (its tie flag is set per case)

PLAN_4 = """
plan:
  actor_gen: {devices: 0-3, layout: d4t1p1m1}
  reward: {devices: 3, layout: d1t1p1m1}
  ref: {devices: 0-1, layout: d1t2p1m1}
  critic_values: {devices: 2-3, layout: d2t1p1m1}
  actor_train: {devices: 0-1, layout: d1t2p1m1}
  critic_train: {devices: 0-3, layout: d2t2p1m1}
"""


def _expected_bytes(ex: DistExecutor, train: str) -> int:
    """Remote bytes of the plans of the sync after ``train`` (computed here, without a process group)."""
    view = ex.view
    src = view.instances[view.node_instance[train]]
    info = model_info(ex.mirror.models[src.model].module)
    total = 0
    for dst in view.sync_targets[train]:
        t = view.instances[dst]
        plan = plan_reallocation(
            info.shapes,
            info.meta,
            src.mesh.devices,
            Layout(src.mesh.dp, src.mesh.tp, 1, 1),
            t.mesh.devices,
            Layout(t.mesh.dp, t.mesh.tp, 1, 1),
            dtype_bytes=info.dtype_bytes,
        )
        total += plan.remote_bytes
    return total


def _check_train_and_sync(ex: DistExecutor, train: str, gen: str, model: str, remote: bool) -> None:
    """Train once; the target equals the trained instance; metrics, timings and the record of the sync.
    ``remote``: the plan moves bytes over links (else it is local copies only)."""
    iteration = 1
    before = ex.fetch(model, ex.view.node_instance[gen])
    result = ex.run_node(train, _seq_batch(8, seed=iteration), iteration)
    trained = ex.fetch(model, ex.view.node_instance[train])
    synced = ex.fetch(model, ex.view.node_instance[gen])
    assert trained.keys() == synced.keys()
    assert all(torch.equal(trained[k], synced[k]) for k in trained), f"{model}: {train} -> {gen} differs"
    assert any(not torch.equal(before[k], synced[k]) for k in before), f"{model}: the step changed nothing"
    m = result.metrics
    assert m["realloc/checksum_ok"] == 1.0
    assert m["realloc/bytes"] == float(_expected_bytes(ex, train))
    assert (m["realloc/bytes"] > 0) == remote
    assert 0.0 < m["realloc/seconds"] < 60.0
    timings = ex.sync_timings[train]
    ranks = set(ex.view.meshes[train].devices) | set(ex.view.meshes[gen].devices)
    assert set(timings) == ranks
    assert all(t0 <= t1 for t0, t1, _ in timings.values())
    assert (sum(b for _, _, b in timings.values()) > 0) == remote
    record = ex.realloc_log[-1]
    assert record["path"] == "plan" and record["model"] == model
    assert all(isinstance(c, str) and len(c) == 32 for c in record["checksums"].values())


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_plan_path_bit_exact_on_2_workers_untied() -> None:
    ex = make_executor(_graph(PLAN_2, 2), None, **FAST)
    assert isinstance(ex, DistExecutor)
    try:
        assert not ex.mirror.models["actor"].module.config.tie_word_embeddings
        _check_train_and_sync(ex, "actor_train", "actor_gen", "actor", remote=True)
        # FSDP2 source, same ranks: re-gathered over dp, then local copies only
        _check_train_and_sync(ex, "critic_train", "critic_values", "critic", remote=False)
        assert ex.realloc_counts == {"plan": 2, "gather": 0}
        # replicas that report different checksums stop the run with a NodeError naming the model
        gen = ex.view.node_instance["actor_gen"]
        bad = {
            rank: SyncReport(0.0, 1.0, 0, {gen: TargetReport("plan", 1, checksum)})
            for rank, checksum in ((0, "a"), (1, "b"))
        }
        with pytest.raises(NodeError, match=r"checksum mismatch.*model 'actor'"):
            ex.syncs.record("actor_train", 2, bad)
        assert not any(p.is_alive() for p in ex.pool.procs)
    finally:
        ex.close(force=True)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_plan_path_bit_exact_on_4_workers_tied() -> None:
    g = _graph(PLAN_4, 4, "models.actor.config.tie_word_embeddings=true")
    ex = make_executor(g, None, **FAST)
    assert isinstance(ex, DistExecutor)
    try:
        actor = ex.mirror.models["actor"].module
        assert actor.lm_head.weight is actor.get_input_embeddings().weight
        _check_train_and_sync(ex, "actor_train", "actor_gen", "actor", remote=True)
        _check_train_and_sync(ex, "critic_train", "critic_values", "critic", remote=True)  # FSDP2 over TP
        assert ex.realloc_counts == {"plan": 2, "gather": 0}
        assert "lm_head.weight" not in ex.fetch("actor", ex.view.node_instance["actor_gen"])  # still tied
    finally:
        ex.close(force=True)


# -- DTensor local shards are the param_shards boxes ---------------------------------------------------


def _boxes_worker(rank: int, world: int) -> list[str]:
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.weight_sync import (
        boxes_match,
        expected_boxes,
        local_boxes,
        source_shards,
    )

    cache = GroupCache(timeout_s=60)
    problems: list[str] = []
    for tied in (False, True):
        full = build_model(config={**CONFIG, "tie_word_embeddings": tied}, seed=3)
        info = model_info(full)
        params = {k: p.detach() for k, p in full.named_parameters()}
        for dp, tp, train in ((1, 2, False), (1, 2, True), (2, 1, True)):
            spec = MeshSpec.of(range(dp * tp), Layout(dp, tp, 1, 1))
            mesh = cache.mesh(spec)
            if mesh is None:
                continue
            module = apply_layout(copy.deepcopy(full), mesh, train=train)
            want = expected_boxes(info, spec, rank)
            tag = f"tied={tied} d{dp}t{tp} train={train} rank {rank}"
            why = boxes_match(local_boxes(module, gather_dp=train), want)
            if why:
                problems.append(f"{tag}: {why}")
            for name, shard in source_shards(module, gather_dp=train).items():
                if not torch.equal(shard, params[name][want[name]]):
                    problems.append(f"{tag}: {name} local shard is not full[param_shards box]")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_dtensor_shards_are_param_shards_boxes() -> None:
    results: list[Any] = run_group(_boxes_worker, 2, timeout_s=100)
    assert results == [[], []], results
