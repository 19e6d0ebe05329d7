"""DeepSpeed ZeRO train nodes (``engine: deepspeed``): options, layouts, parity, reallocation, runs.

* tier 1 (no process): the graph file's ``deepspeed`` options and their errors (file, node, key), the
  layout rule (tp/pp > 1), the one-line error when DeepSpeed is missing, and the pure piece planner of
  ZeRO-3 reallocation (hand-worked runs and pieces).
* tier 3, one group of 4 gloo processes (started once, for both tests): an SFT, a PPO actor and a PPO
  critic step with ZeRO-1/2/3 on two data-parallel ranks (two engines on disjoint sub-meshes at once: ranks
  0-1 and 2-3) and ZeRO-3 on four, against the single-process step (the FSDP2 parity tolerances of
  ``tests/test_dist_layouts.py``); then ZeRO-3 partitions moved to replicas, tensor-parallel and mixed
  layouts and back, bit-exact, tied and untied.

Skipped where DeepSpeed is not installed, except under CI (``CI=true``), where its absence fails.
"""

from __future__ import annotations

import copy
import importlib.util
import os
from typing import Any

import pytest
import torch

from rlflow.dataflow.errors import GraphError, PlanError
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import DeepSpeedSpec, NodeSpec
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.rows import shard_rows
from rlflow.schedulers.runtime.distributed.zero import partition_range
from rlflow.schedulers.runtime.distributed.zero_transfer import Piece, box_runs, plan_pieces, zero_holdings
from tests.test_dist_layouts import CONFIG, _batch

_CI = os.environ.get("CI", "").lower() in ("1", "true")
HAVE_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = pytest.mark.skipif(
    not HAVE_DS and not _CI, reason="DeepSpeed is not installed (pip install 'rlflow[deepspeed]')"
)


# -- tier 1 -------------------------------------------------------------------------------------------


def test_deepspeed_options_are_checked() -> None:
    assert DeepSpeedSpec().zero_stage == 2
    with pytest.raises(GraphError, match=r"deepspeed.zero_stage: 4 is not one of 1, 2, 3"):
        DeepSpeedSpec(zero_stage=4)
    with pytest.raises(
        GraphError, match=r"deepspeed.offload_param: DeepSpeed offloads parameters with ZeRO stage 3"
    ):
        DeepSpeedSpec(zero_stage=2, offload_param="cpu")
    with pytest.raises(GraphError, match=r"deepspeed.offload_optimizer: 'nvme' is not one of none, cpu"):
        DeepSpeedSpec(offload_optimizer="nvme")
    DeepSpeedSpec(zero_stage=3, offload_param="cpu", offload_optimizer="cpu")
    node = NodeSpec(name="t", kind="train", function="sft", engine="deepspeed")
    assert node.deepspeed == DeepSpeedSpec()
    with pytest.raises(GraphError, match=r"nodes.g.engine: engine 'deepspeed' runs train nodes only"):
        NodeSpec(name="g", kind="generate", function="generate", engine="deepspeed")
    with pytest.raises(GraphError, match=r"nodes.t.deepspeed: DeepSpeed settings need 'engine: deepspeed'"):
        NodeSpec(name="t", kind="train", function="sft", deepspeed=DeepSpeedSpec())


def _ppo(*overrides: str) -> Any:
    from pathlib import Path

    from rlflow.dataflow.loader import load_graph

    root = Path(__file__).resolve().parents[1]
    return load_graph(str(root / "examples/ppo.yaml"), ["run.devices=2", *overrides])


def test_bad_deepspeed_input_names_file_node_and_key() -> None:
    with pytest.raises(
        GraphError, match=r"ppo.yaml: nodes.actor_train.deepspeed.zero_stage: 0 is not one of 1, 2, 3"
    ):
        _ppo("nodes.actor_train.engine=deepspeed", "nodes.actor_train.deepspeed.zero_stage=0")
    with pytest.raises(
        GraphError, match=r"ppo.yaml: nodes.actor_train.deepspeed.offload_param: .*stage 3 only"
    ):
        _ppo("nodes.actor_train.engine=deepspeed", "nodes.actor_train.deepspeed.offload_param=cpu")
    with pytest.raises(
        GraphError, match=r"ppo.yaml: nodes.actor_train.deepspeed.stage: unknown field 'stage'"
    ):
        _ppo("nodes.actor_train.engine=deepspeed", "nodes.actor_train.deepspeed.stage=3")
    plan = [f"plan.{n}.devices=0-1" for n in ("actor_gen", "ref", "critic_values", "critic_train", "reward")]
    plan += [f"plan.{n}.layout=d2t1p1m1" for n in ("actor_gen", "ref", "critic_values", "critic_train")]
    plan += [
        "plan.reward.layout=d2t1p1m1",
        "plan.actor_train.devices=0-1",
        "plan.actor_train.layout=d1t2p1m1",
    ]
    with pytest.raises(
        PlanError, match=r"ppo.yaml: plan.actor_train.layout: DeepSpeed ZeRO trains data parallel only .*tp=2"
    ):
        _ppo("nodes.actor_train.engine=deepspeed", *plan)


def test_zero_on_one_rank_of_several_devices_is_a_named_warning() -> None:
    """ZeRO partitions over data-parallel ranks: on dp = 1 of a 2-device run, without offload, it shards
    nothing — a GraphWarning naming the node (a fresh user saw ZeRO-3 put on one rank silently)."""
    import warnings

    from rlflow.dataflow.graph import GraphWarning

    nodes = ("actor_gen", "ref", "critic_values", "critic_train", "reward", "actor_train")
    plan = [f"plan.{n}.devices=0-1" for n in nodes if n != "actor_train"]
    plan += [f"plan.{n}.layout=d2t1p1m1" for n in nodes if n != "actor_train"]
    zero3 = (
        "nodes.actor_train.engine=deepspeed",
        "nodes.actor_train.deepspeed.zero_stage=3",
        "run.devices=2",
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _ppo(*zero3, *plan, "plan.actor_train.devices=[1]", "plan.actor_train.layout=d1t1p1m1")
    hits = [
        str(w.message)
        for w in seen
        if issubclass(w.category, GraphWarning) and "shards nothing" in str(w.message)
    ]
    assert hits and "plan.actor_train" in hits[0] and "ZeRO stage 3" in hits[0], hits
    for extra in (
        ["plan.actor_train.devices=0-1", "plan.actor_train.layout=d2t1p1m1"],  # sharded over 2 ranks
        [
            "plan.actor_train.devices=[1]",
            "plan.actor_train.layout=d1t1p1m1",
            "nodes.actor_train.deepspeed.offload_optimizer=cpu",
        ],  # one rank, but offloading
    ):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _ppo(*zero3, *plan, *extra)
        assert not [w for w in seen if "shards nothing" in str(w.message)], extra


def test_missing_deepspeed_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlflow.nodes.engines import validation

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "deepspeed" else real(n, *a))
    graph = _ppo("nodes.actor_train.engine=deepspeed")
    with pytest.raises(GraphError) as e:
        validation.check_engines(graph)
    msg = str(e.value)
    assert "\n" not in msg and "nodes.actor_train.engine: deepspeed" in msg
    assert "pip install 'rlflow[deepspeed]'" in msg and msg.startswith(str(graph.spec.source))


def test_partition_ranges_and_runs_by_hand() -> None:
    # 10 elements over 4 ranks: ceil(10/4) = 3 each, the last holds 1
    assert [partition_range(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert partition_range(3, 4, 3) == (3, 3)  # an empty partition (padding only)
    # a 4x6 matrix: rows 2-3 are one run; columns 3-5 are one run per row
    assert box_runs((4, 6), (slice(2, 4), slice(0, 6))) == [(12, 24, 0)]
    assert box_runs((4, 6), (slice(0, 4), slice(3, 6))) == [(3, 6, 0), (9, 12, 3), (15, 18, 6), (21, 24, 9)]
    assert box_runs((5,), (slice(0, 5),)) == [(0, 5, 0)]


def test_pieces_from_partitions_to_a_column_block_by_hand() -> None:
    # a 4x6 matrix, ZeRO-3 over ranks 0,1 (elements 0-11 and 12-23) -> rank 2 holds columns 3-5
    source = zero_holdings({"w": (4, 6)}, (0, 1))
    target = {2: {"w": box_runs((4, 6), (slice(0, 4), slice(3, 6)))}}
    pieces = plan_pieces(source, target, ["w"])
    assert pieces == [
        Piece("w", 0, 2, 3, 6, 3, 0),
        Piece("w", 0, 2, 9, 12, 9, 3),
        Piece("w", 1, 2, 15, 18, 3, 6),
        Piece("w", 1, 2, 21, 24, 9, 9),
    ]
    # back: a replica on rank 0 and rank 1 each -> ZeRO-3 over ranks 0,1: local copies only
    back = plan_pieces({0: {"w": [(0, 24, 0)]}, 1: {"w": [(0, 24, 0)]}}, source, ["w"])
    assert back == [Piece("w", 0, 0, 0, 12, 0, 0), Piece("w", 1, 1, 12, 24, 12, 0)]
    with pytest.raises(ValueError, match="no source rank holds"):
        plan_pieces({0: {"w": [(0, 5, 0)]}}, source, ["w"])


# -- tier 3 -------------------------------------------------------------------------------------------

STAGES = (1, 2, 3)


def _ctx(node: NodeSpec, module: torch.nn.Module, head: str, steps: int = 4) -> Any:
    from rlflow.nodes.context import ModelState, NodeContext
    from rlflow.nodes.train import build_optimizer

    state = ModelState(name="m", module=module, head=head)
    spec = OptimizerSpec(lr=1e-4, grad_clip=0.5, weight_decay=0.01)
    state.optimizer, state.scheduler = build_optimizer(module, spec, steps)
    state.optimizer_spec = spec
    return NodeContext(node=node, model=state, micro_batches=2)


def _zero_ctx(node: NodeSpec, module: torch.nn.Module, head: str, stage: int, mesh: Any, dp: int) -> Any:
    from rlflow.nodes.context import ModelState, NodeContext
    from rlflow.schedulers.runtime.distributed.zero import ZeroHooks, build_engine

    spec = OptimizerSpec(lr=1e-4, grad_clip=0.5, weight_decay=0.01)
    dp_group = mesh["dp"].get_group()
    engine = build_engine(module, DeepSpeedSpec(zero_stage=stage), spec, 4, dp_group, mesh["tp"].get_group())
    state = ModelState(name="m", module=engine.module, head=head)
    state.optimizer, state.scheduler, state.optimizer_spec = engine.optimizer, engine.lr_scheduler, spec
    ctx = NodeContext(node=node, model=state, micro_batches=2)
    ctx.train_hooks = ZeroHooks(engine, dp_group, dp)
    return ctx, engine


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    from rlflow.schedulers.runtime.distributed.zero import is_zero3, zero_full_params

    if is_zero3(module):
        return zero_full_params(module)
    return {k: p.detach().clone() for k, p in module.named_parameters()}


def _parity_worker(rank: int, world: int) -> dict[str, float]:
    from rlflow.nodes.functions.policy import ppo_actor, ppo_critic
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache

    torch.manual_seed(0)
    lm = build_model(config=CONFIG, seed=1)
    critic = build_model(config=CONFIG, head="value", seed=2)
    batch = _batch(8)
    cases = (
        (
            NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2),
            sft_node,
            lm,
            "lm",
            {},
        ),
        (
            NodeSpec(name="ppo", kind="train", function="ppo_actor", model="m", mini_batches=2),
            ppo_actor,
            lm,
            "lm",
            {"whiten_advantages": True},
        ),
        (
            NodeSpec(name="critic", kind="train", function="ppo_critic", model="m", mini_batches=2),
            ppo_critic,
            critic,
            "value",
            {},
        ),
    )
    ref: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    for node, fn, model, head, args in cases:
        m = copy.deepcopy(model)
        metrics = fn(_ctx(node, m, head), batch, **args).metrics
        prefix = "critic" if head == "value" else "actor"
        ref[node.name] = (metrics[f"{prefix}/grad_norm"], _full(m))

    cache = GroupCache(timeout_s=220)
    # dp 2 on ranks 0-1 and, at the same time, on ranks 2-3 (two engines on disjoint sub-meshes)
    pair = MeshSpec.of((0, 1), Layout(2, 1, 1, 1)), MeshSpec.of((2, 3), Layout(2, 1, 1, 1))
    meshes = [cache.mesh(s) for s in pair]
    spec, mesh = next((s, m) for s, m in zip(pair, meshes, strict=True) if m is not None)
    four = MeshSpec.of(range(4), Layout(4, 1, 1, 1))
    mesh4 = cache.mesh(four)
    diffs: dict[str, float] = {}
    runs = [(stage, spec, mesh, 2) for stage in STAGES] + [(3, four, mesh4, 4)]
    for stage, s, m, dp in runs:
        dp_rank, _ = s.coords(rank)
        for node, fn, model, head, args in cases:
            if dp == 4 and node.name != "sft":
                continue
            ctx, engine = _zero_ctx(node, copy.deepcopy(model), head, stage, m, dp)
            rows = batch.index(shard_rows(len(batch), dp, node.mini_batches)[dp_rank])
            with ctx.train_hooks:
                metrics = fn(ctx, rows, **args).metrics
            prefix = "critic" if head == "value" else "actor"
            tag = f"z{stage}d{dp}/{node.name}"
            ref_norm, ref_w = ref[node.name]
            diffs[f"{tag}_gradnorm"] = abs(metrics[f"{prefix}/grad_norm"] / ref_norm - 1.0)
            got = _full(engine.module)
            assert got.keys() == ref_w.keys(), (got.keys(), ref_w.keys())
            diffs[f"{tag}_weights"] = max(float((got[k] - ref_w[k]).abs().max()) for k in got)
            before = dict(model.named_parameters())
            diffs[f"{tag}_moved"] = max(float((got[k] - before[k]).abs().max()) for k in got)
            engine.destroy()
    return diffs


def _group_worker(rank: int, world: int) -> dict[str, Any]:
    """The parity checks, then the reallocation checks, on the same 4 processes: each part's result, or the
    traceback of what it raised (so that each test reports its own part)."""
    import traceback

    out: dict[str, Any] = {}
    for name, part in (("parity", _parity_worker), ("realloc", _realloc_worker)):
        try:
            out[name] = part(rank, world)
        except Exception:
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def group_results() -> dict[str, list[Any]]:
    """``{"parity": [result of rank r], "realloc": [...]}``: one group of 4 gloo processes for both tests."""
    results = run_group(_group_worker, 4, timeout_s=460, collective_timeout_s=220)
    return {name: [r[name] for r in results] for name in ("parity", "realloc")}


def _part(results: dict[str, list[Any]], name: str) -> list[Any]:
    """The part's per-rank results; fails with a rank's traceback where that rank's part raised."""
    for rank, value in enumerate(results[name]):
        assert not isinstance(value, str), f"rank {rank} raised in the {name} part:\n{value}"
    return results[name]


@pytest.mark.xdist_group("zero_group")
@pytest.mark.slow
@needs_ds
@pytest.mark.timeout(480)  # the first of the group's two tests starts it
def test_zero_parity_with_the_single_process_step(group_results: dict[str, list[Any]]) -> None:
    results = _part(group_results, "parity")
    print({k: f"{v:.1e}" for k, v in results[0].items()})
    for rank, diffs in enumerate(results):
        assert len(diffs) == 3 * 3 * 3 + 3
        for key, value in diffs.items():
            if key.endswith("_moved"):
                assert value > 1e-4, f"rank {rank} {key}: the step did not change the weights"
            elif key.endswith("_weights"):
                assert value < 1e-6, f"rank {rank} {key}: {value}"
            else:
                assert value < 1e-5, f"rank {rank} {key}: {value}"


# ZeRO-3 on ranks 0-1 -> each target layout (devices, layout): replicas on other ranks, replicas over all
# ranks (local copies where a rank holds both), tensor parallel on other ranks and on the same ranks, and
# tensor parallel with dp replicas; then back from a tensor-parallel layout into the partitions.
TARGETS = (
    ((2, 3), Layout(2, 1, 1, 1)),
    ((0, 1, 2, 3), Layout(4, 1, 1, 1)),
    ((2, 3), Layout(1, 2, 1, 1)),
    ((0, 1), Layout(1, 2, 1, 1)),
    ((0, 1, 2, 3), Layout(2, 2, 1, 1)),
)


def _realloc_worker(rank: int, world: int) -> dict[str, Any]:
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.realloc.verify import weights_checksum
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.placement import Instance
    from rlflow.schedulers.runtime.distributed.sync_routes import holdings
    from rlflow.schedulers.runtime.distributed.weight_sync import (
        full_params,
        model_info,
        source_shards,
        target_shards,
    )
    from rlflow.schedulers.runtime.distributed.zero import refresh_master, zero_full_params, zero_local
    from rlflow.schedulers.runtime.distributed.zero_transfer import move_pieces, plan_pieces

    cache = GroupCache(timeout_s=300)
    src_spec = MeshSpec.of((0, 1), Layout(2, 1, 1, 1))
    src_mesh = cache.mesh(src_spec)
    targets = [MeshSpec.of(d, lay) for d, lay in TARGETS]
    t_meshes = [cache.mesh(s) for s in targets]
    everyone = cache.group((0, 1, 2, 3))
    out: dict[str, Any] = {}
    for tied in (False, True):
        lm = build_model(config={**CONFIG, "tie_word_embeddings": tied}, seed=3)
        info = model_info(lm)
        source = Instance("m", src_spec, fsdp=False, zero=DeepSpeedSpec(zero_stage=3))
        engine = None
        if src_mesh is not None:  # one SFT step, so the partitions differ from the targets' initial weights
            node = NodeSpec(name="sft", kind="train", function="sft", model="m")
            ctx, engine = _zero_ctx(node, copy.deepcopy(lm), "lm", 3, src_mesh, 2)
            with ctx.train_hooks:
                sft_node(ctx, _batch(4).index(shard_rows(4, 2)[src_spec.coords(rank)[0]]))
            trained = zero_full_params(engine.module)
        for spec, mesh in zip(targets, t_meshes, strict=True):
            tag = f"{'tied' if tied else 'untied'}/{spec.devices}/{spec.layout}"
            target = Instance("m", spec, fsdp=False)
            module = apply_layout(copy.deepcopy(lm), mesh, train=False) if mesh is not None else None
            pieces = plan_pieces(holdings(info, source), holdings(info, target), list(info.shapes))
            src_local = zero_local(engine.module) if engine is not None else {}
            dst_local = target_shards(module) if module is not None else {}
            checksum, _ = move_pieces(pieces, rank, src_local, dst_local, everyone)
            remote = sum(p.stop - p.start for p in pieces if p.src != p.dst)
            out[f"{tag}/remote_elements"] = remote
            if engine is not None and rank == 0:
                out[f"{tag}/source"] = weights_checksum(trained)
            if module is not None:  # gathered over the target's mesh (collective there); a digest of names,
                out[f"{tag}/got"] = weights_checksum(full_params(module))  # dtypes, shapes and bytes
                out[f"{tag}/checksum"] = checksum
            if spec == targets[2]:  # back: change the TP copy on 2-3, move it into the partitions on 0-1
                if module is not None:
                    for t in target_shards(module).values():
                        t.add_(0.5)
                back = plan_pieces(holdings(info, target), holdings(info, source), list(info.shapes))
                src_back = source_shards(module, gather_dp=False) if module is not None else {}
                move_pieces(
                    back, rank, src_back, zero_local(engine.module) if engine is not None else {}, everyone
                )
                if engine is not None:
                    refresh_master(engine)
                    now = zero_full_params(engine.module)
                    out[f"{tag}/back"] = weights_checksum(now)
                    master = torch.cat([g.reshape(-1) for g in engine.optimizer.fp32_partitioned_groups_flat])
                    parts = torch.cat([g.reshape(-1) for g in engine.optimizer.fp16_partitioned_groups_flat])
                    out[f"{tag}/master_follows"] = torch.equal(master, parts)
                    trained = now
                elif module is not None:
                    out[f"{tag}/sent_back"] = weights_checksum(full_params(module))
        if engine is not None:
            out[f"{'tied' if tied else 'untied'}/trained"] = weights_checksum(trained)
            out[f"{'tied' if tied else 'untied'}/names"] = sorted(trained)
            out[f"{'tied' if tied else 'untied'}/numel"] = sum(v.numel() for v in trained.values())
            engine.destroy()
    return out


@pytest.mark.xdist_group("zero_group")
@pytest.mark.slow
@needs_ds
@pytest.mark.timeout(480)
def test_zero3_partitions_to_every_layout_and_back_bit_exact(group_results: dict[str, list[Any]]) -> None:
    results = _part(group_results, "realloc")
    for tied in ("untied", "tied"):
        assert results[0][f"{tied}/trained"] == results[1][f"{tied}/trained"]
        assert ("lm_head.weight" in results[0][f"{tied}/names"]) != (tied == "tied")  # tied: one parameter
        for devices, layout in TARGETS:
            tag = f"{tied}/{tuple(devices)}/{layout}"
            for r in devices:  # bit-exact: digests of every name, dtype, shape and byte
                assert results[r][f"{tag}/got"] == results[0][f"{tag}/source"], f"rank {r} {tag}"
            if layout.tp == 1:  # replicas: the same bytes, so the same checksum
                assert len({results[r][f"{tag}/checksum"] for r in devices}) == 1
            # local copies where a rank holds both sides: fewer elements over links than a full broadcast
            n = results[0][f"{tied}/numel"]
            assert 0 < results[0][f"{tag}/remote_elements"] <= n * len(devices)
        # back: the TP copy (+0.5) is now in the partitions, and the optimizer's master copy follows it
        tp_tag = f"{tied}/(2, 3)/{Layout(1, 2, 1, 1)}"
        assert results[0][f"{tp_tag}/back"] == results[2][f"{tp_tag}/sent_back"]
        assert results[0][f"{tp_tag}/master_follows"] and results[1][f"{tp_tag}/master_follows"]


# -- a PPO run: the actor trained by ZeRO-3 on workers 0-1, generating on worker 2 ---------------------

RUN_PLAN = {
    "actor_gen": ("2", "d1t1p1m1"),
    "reward": ("2", "d1t1p1m1"),
    "ref": ("2", "d1t1p1m1"),
    "critic_values": ("2", "d1t1p1m1"),
    "actor_train": ("0-1", "d2t1p1m1"),
    "critic_train": ("0-1", "d2t1p1m1"),  # FSDP2, next to the DeepSpeed actor
}


def _run_controller(out: Any, *overrides: str, resume: bool = False) -> Any:
    from pathlib import Path

    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.runtime.controller import Controller

    root = Path(__file__).resolve().parents[1]
    plan = [
        f"plan.{n}.{k}={v}" for n, (d, lay) in RUN_PLAN.items() for k, v in (("devices", d), ("layout", lay))
    ]
    common = [
        f"run.output_dir={out}",
        "run.devices=3",
        "run.eval_interval=0",
        "run.checkpoint_interval=1",
        "data.generator.args.train_size=32",
        "nodes.actor_train.engine=deepspeed",
        "nodes.actor_train.deepspeed.zero_stage=3",
    ]
    graph = load_graph(str(root / "examples/ppo.yaml"), [*common, *plan, *overrides])
    return Controller(graph, resume=resume)


@pytest.mark.slow
@needs_ds
@pytest.mark.timeout(420)
def test_ppo_run_with_a_zero3_actor_resumes_exactly(tmp_path: Any) -> None:
    """2 iterations (a checkpoint after each) == resumed from the checkpoint after iteration 1 (the run
    directory as a run stopped there leaves it), 1 iteration: the actor (ZeRO-3 partitions on workers 0-1,
    reallocated piece by piece to the generation replica on worker 2 and checksummed each iteration) and the
    critic (FSDP2) end with the same weights and the same iteration-2 metrics."""
    from rlflow.schedulers.records.rundir import read_metrics
    from tests.harness import stopped_copy

    def metrics(out: Any) -> dict[int, dict[str, float]]:
        return {int(r["iteration"]): r for r in read_metrics(out).to_pylist()}

    def weights(c: Any) -> dict[str, torch.Tensor]:
        return {
            f"{m}.{k}": v.detach().clone()
            for m, s in c.executor.models.items()
            for k, v in s.module.state_dict().items()
        }

    full = _run_controller(tmp_path / "a", "run.iterations=2")
    try:
        full.run()
        ex = full.executor
        assert ex.realloc_counts.get("zero", 0) == 2 and ex.realloc_counts["gather"] == 0
        record = next(r for r in ex.realloc_log if r["model"] == "actor")
        assert record["path"] == "zero" and record["bytes"] > 0
        assert set(record["checksums"]) == {2}  # the generation replica's digest
        w_full = weights(full)
    finally:
        full.close()
    m = metrics(tmp_path / "a")
    assert all(m[it]["realloc/checksum_ok"] == 1.0 for it in m)
    # the trainer's first pass reads the weights the sampler used: the reallocation was exact
    assert m[2]["rollout/logprob_gap_mean"] < 1e-5

    resumed = _run_controller(
        stopped_copy(tmp_path / "a", 1, tmp_path / "b"), "run.iterations=2", resume=True
    )
    try:
        assert resumed.start_iteration == 1
        resumed.run()
        w_res = weights(resumed)
    finally:
        resumed.close()
    mb = metrics(tmp_path / "b")
    for key in ("actor/pg_loss", "critic/vf_loss", "actor/grad_norm", "critic/score/mean"):
        assert mb[2][key] == pytest.approx(m[2][key], rel=1e-6, abs=1e-7), key
    assert w_full.keys() == w_res.keys()
    for k in w_full:
        assert torch.equal(w_full[k], w_res[k]), k
