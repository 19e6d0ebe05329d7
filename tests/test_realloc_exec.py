"""Executing reallocation plans: pure schedule/EMA/checksum tests, and bit-exact 4-process gloo runs (tier 3).

The multi-process test launches 4 copies of this file as workers (``--worker``; rendezvous through a
``file://`` init method in a temporary folder, collectives time out after 60 s, the whole group is killed
after ``GROUP_TIMEOUT_S``). All cases run inside that one group to pay the start-up once: the 7 × 7 layout
matrix on devices 0-3 with the meshes overlapping (both start at device 0) and shifted (the target mesh is
the last devices, reversed), tied and untied heads, float32 and bfloat16, small buckets (packed, direct,
non-contiguous paths, a staging ring smaller than what is in flight), a rank in neither mesh, and a
corrupted target shard that ``verify_reallocation`` must catch. Workers record failures instead of
raising, so one wrong case does not leave the others waiting in a collective.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.realloc.ema import ema_update
from rlflow.schedulers.realloc.execute import execute_reallocation, issue_order, schedule_messages
from rlflow.schedulers.realloc.groups import GroupCache
from rlflow.schedulers.realloc.planning import plan_reallocation
from rlflow.schedulers.realloc.regions import ReallocError
from rlflow.schedulers.realloc.shards import ModelMeta, Slice, param_shards
from rlflow.schedulers.realloc.verify import ChecksumError, verify_reallocation, weights_checksum

WORLD = 4
GROUP_TIMEOUT_S = 150
LAYOUTS = ["d1t1p1", "d2t1p1", "d1t2p1", "d1t1p2", "d2t2p1", "d1t2p2", "d4t1p1"]
# vocab 32, hidden 16, 4 heads (2 kv heads: kv dim 8), intermediate 32: every split dim divides by 2 and 4.
TINY = dict(vocab_size=32, hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32)
MODELS = {"untied": (3, False), "tied": (4, True)}  # name -> (layers, tied head)

Shapes = dict[str, tuple[int, ...]]


def llama_shapes(layers: int, tied: bool) -> Shapes:
    """Parameter shapes of a tiny transformers LlamaForCausalLM (built on the meta device)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**TINY, num_hidden_layers=layers, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def full_weights(shapes: Shapes, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Deterministic full tensors: parameter i (in shape-dict order) is randn with seed 1000 + i."""
    gen = torch.Generator()
    out = {}
    for i, (name, shape) in enumerate(shapes.items()):
        gen.manual_seed(1000 + i)
        out[name] = torch.randn(shape, generator=gen).to(dtype)
    return out


def shard(full: dict[str, torch.Tensor], slices: dict[str, Slice]) -> dict[str, torch.Tensor]:
    return {name: full[name][sl].clone() for name, sl in slices.items()}


# ------------------------------------------------------------------------------------------------------
# pure tests (no process group)

SHAPES_TINY: Shapes = {
    "model.embed_tokens.weight": (32, 16),
    **{
        f"model.layers.{i}.{k}": s
        for i in range(2)
        for k, s in {
            "input_layernorm.weight": (16,),
            "self_attn.q_proj.weight": (16, 16),
            "self_attn.k_proj.weight": (8, 16),
            "self_attn.v_proj.weight": (8, 16),
            "self_attn.o_proj.weight": (16, 16),
            "post_attention_layernorm.weight": (16,),
            "mlp.gate_proj.weight": (32, 16),
            "mlp.up_proj.weight": (32, 16),
            "mlp.down_proj.weight": (16, 32),
        }.items()
    },
    "model.norm.weight": (16,),
    "lm_head.weight": (32, 16),
}


def test_schedule_coalesces_per_pair_aligned_and_deterministic() -> None:
    meta = ModelMeta(2)
    plan = plan_reallocation(
        SHAPES_TINY, meta, (0, 1), Layout.parse("d1t2p1"), (2, 3), Layout.parse("d2t1p1")
    )
    msgs = schedule_messages(plan, torch.float32)
    assert msgs == schedule_messages(plan, torch.float32)
    remote = [t for t in plan.transfers if not t.is_local]
    # every remote transfer appears in exactly one message, whose (src, dsts) it shares
    assert sorted(id(t) for m in msgs for t in m.transfers) == sorted(id(t) for t in remote)
    assert all(t.src == m.src and t.dsts == m.dsts for m in msgs for t in m.transfers)
    # default 64 MiB buckets: one message per (src, dsts) pair
    assert len(msgs) == len({(t.src, t.dsts) for t in remote})
    assert [(m.src, m.dsts) for m in msgs] == sorted((m.src, m.dsts) for m in msgs)
    for m in msgs:
        assert all(off % 16 == 0 for off in m.offsets)
        ends = [off + t.bytes * 2 for t, off in zip(m.transfers, m.offsets, strict=True)]  # plan: 2 B/elem
        assert m.nbytes == ends[-1] and all(e <= o for e, o in zip(ends, m.offsets[1:], strict=False))
    # small buckets: no message over the bucket unless it is a single (direct) transfer
    small = schedule_messages(plan, torch.float32, bucket_bytes=300, direct_bytes=200)
    assert all(m.nbytes <= 300 or m.direct for m in small)
    assert all(m.direct for m in small if any(t.bytes * 2 >= 200 for t in m.transfers))


def test_issue_order_is_round_robin_over_pairs() -> None:
    # pp -> tp on (0, 1): both directions; rank 0's k-th message goes right before rank 1's k-th
    meta = ModelMeta(2)
    plan = plan_reallocation(
        SHAPES_TINY, meta, (0, 1), Layout.parse("d1t1p2"), (0, 1), Layout.parse("d1t2p1")
    )
    msgs = schedule_messages(plan, torch.float32, bucket_bytes=300, direct_bytes=200)
    order = issue_order(msgs)
    assert sorted(order) == list(range(len(msgs)))
    pairs = [(msgs[i].src, msgs[i].dsts) for i in order]
    assert len(set(pairs)) == 2
    n = min(pairs.count(p) for p in set(pairs))
    assert pairs[: 2 * n] == [(0, (1,)), (1, (0,))] * n
    for p in set(pairs):  # each pair keeps its own order
        assert [i for i in order if (msgs[i].src, msgs[i].dsts) == p] == sorted(
            i for i in range(len(msgs)) if (msgs[i].src, msgs[i].dsts) == p
        )


def test_local_only_plan_needs_no_process_group() -> None:
    # d2t1p1 on (0, 1) -> d2t1p1 on (0, 1): every rank copies locally; run ranks 0 and 1 in this process.
    meta, lay = ModelMeta(2), Layout.parse("d2t1p1")
    full = full_weights(SHAPES_TINY, torch.float32)
    src = param_shards(SHAPES_TINY, meta, (0, 1), lay)
    dst = param_shards(SHAPES_TINY, meta, (1, 0), Layout.parse("d1t1p2"))
    plan = plan_reallocation(SHAPES_TINY, meta, (0, 1), lay, (1, 0), Layout.parse("d1t1p2"))
    assert all(t.is_local for t in plan.transfers)
    for rank in (0, 1):
        template = {n: tuple(s.stop - s.start for s in sl) for n, sl in dst[rank].items()}
        out = execute_reallocation(plan, rank, shard(full, src[rank]), template)
        assert set(out) == set(dst[rank])
        assert all(torch.equal(out[n], full[n][sl]) for n, sl in dst[rank].items())
        assert verify_reallocation(plan, rank, shard(full, src[rank]), out) == weights_checksum(out)


def test_missing_shard_and_wrong_dtype_raise_before_communication() -> None:
    meta, lay = ModelMeta(2), Layout.parse("d1t1p1")
    plan = plan_reallocation(SHAPES_TINY, meta, (0,), lay, (0,), lay)
    full = full_weights(SHAPES_TINY, torch.float32)
    template = {n: s for n, s in SHAPES_TINY.items()}
    with pytest.raises(ReallocError, match="no source shard"):
        execute_reallocation(plan, 0, {}, template)
    with pytest.raises(ReallocError, match="bfloat16"):
        execute_reallocation(plan, 0, full, template, dtype=torch.bfloat16)
    with pytest.raises(ReallocError, match="writes 0 of"):
        execute_reallocation(plan, 0, full, {**template, "extra.weight": (4,)})


def test_weights_checksum_is_bitwise() -> None:
    a = {"x": torch.zeros(4), "y": torch.ones(2, 3)}
    b = {"y": torch.ones(2, 3), "x": torch.zeros(4)}
    assert weights_checksum(a) == weights_checksum(b)  # order of the mapping does not matter
    b["x"][0] = -0.0  # equal as floats, different bits
    assert weights_checksum(a) != weights_checksum(b)
    assert weights_checksum({"x": torch.zeros(4)}) != weights_checksum({"x": torch.zeros(2, 2)})


def test_ema_update_golden_and_errors() -> None:
    ref = {"w": torch.tensor([0.0, 1.0, 2.0])}
    actor = {"w": torch.tensor([4.0, 1.0, -2.0])}
    ema_update(ref, actor, 0.25)  # 0.25·actor + 0.75·ref = [1, 1, 1]
    assert torch.allclose(ref["w"], torch.tensor([1.0, 1.0, 1.0]))
    ema_update(ref, actor, 1.0)
    assert torch.equal(ref["w"], actor["w"])
    with pytest.raises(ReallocError, match="eta"):
        ema_update(ref, actor, 1.5)
    with pytest.raises(ReallocError, match="reallocate"):
        ema_update(ref, {"w": torch.zeros(2)}, 0.5)


# ------------------------------------------------------------------------------------------------------
# the 4-process group


def cases() -> list[dict[str, Any]]:
    """Every (model, src mesh, src layout, dst mesh, dst layout, dtype, buckets) case; same on all ranks."""
    out: list[dict[str, Any]] = []
    for model in MODELS:
        for i, s in enumerate(LAYOUTS):
            for j, d in enumerate(LAYOUTS):
                n, m = Layout.parse(s).size, Layout.parse(d).size
                small = (i + j) % 2 == 1  # half the cases with tiny buckets: packed + direct paths
                for place, dst_devs in (
                    ("overlap", tuple(range(m))),
                    ("shifted", tuple(range(WORLD - m, WORLD))[::-1]),
                ):
                    out.append(
                        dict(model=model, src=s, dst=d, src_devs=tuple(range(n)), dst_devs=dst_devs,
                             dtype="float32", small=small, place=place)
                    )  # fmt: skip
    extra = [  # disjoint meshes, a rank in neither mesh, bf16, permuted meshes
        ("untied", "d1t2p1", (0, 1), "d1t1p2", (2, 3), "bfloat16"),
        ("tied", "d1t1p2", (0, 1), "d1t2p1", (3, 2), "bfloat16"),
        ("tied", "d2t1p1", (0, 1), "d1t2p1", (2, 3), "float32"),
        ("untied", "d1t1p1", (0,), "d1t2p1", (1, 2), "float32"),  # rank 3 in neither
        ("tied", "d1t2p1", (2, 3), "d1t1p1", (0,), "bfloat16"),  # rank 1 in neither
        ("untied", "d1t2p2", (3, 1, 2, 0), "d2t2p1", (0, 2, 1, 3), "bfloat16"),
    ]
    for model, s, sd, d, dd, dt in extra:
        out.append(
            dict(model=model, src=s, dst=d, src_devs=sd, dst_devs=dd, dtype=dt, small=True, place="extra")
        )
    return out


def _run_case(
    case: dict[str, Any], rank: int, shapes: dict[str, Shapes], cache: GroupCache, corrupt: bool = False
) -> tuple[str | None, str]:
    """Run one case on this rank; returns (failure message or None, checksum)."""
    layers, tied = MODELS[case["model"]]
    sh, meta, dtype = shapes[case["model"]], ModelMeta(layers, tied), getattr(torch, case["dtype"])
    src_l, dst_l = Layout.parse(case["src"]), Layout.parse(case["dst"])
    src_devs, dst_devs = tuple(case["src_devs"]), tuple(case["dst_devs"])
    full = full_weights(sh, dtype)
    src_sl = param_shards(sh, meta, src_devs, src_l).get(rank, {})
    dst_sl = param_shards(sh, meta, dst_devs, dst_l).get(rank, {})
    plan = plan_reallocation(sh, meta, src_devs, src_l, dst_devs, dst_l, dtype_bytes=dtype.itemsize)
    src = shard(full, src_sl)
    template = {n: tuple(s.stop - s.start for s in sl) for n, sl in dst_sl.items()}
    # small: tiny buckets (packed, direct and non-contiguous paths) and a staging ring of 512 bytes, so
    # staged messages wait for older ones to free their bytes while others are in flight
    kw: dict[str, Any] = dict(bucket_bytes=256, direct_bytes=128, staging_bytes=512) if case["small"] else {}
    out = execute_reallocation(plan, rank, src, template, dtype=dtype, groups=cache, **kw)
    name = f"{case['model']} {case['src']}{src_devs} -> {case['dst']}{dst_devs} {case['dtype']}"
    if set(out) != set(dst_sl):
        return f"{name}: rank {rank} got {sorted(set(out) ^ set(dst_sl))[:3]} wrong", ""
    for n, sl in dst_sl.items():
        if out[n].dtype != dtype or not torch.equal(out[n], full[n][sl]):
            return f"{name}: rank {rank} {n} differs", ""
    if corrupt and out:
        first = sorted(out)[0]
        out[first].view(-1)[0] += 1
    checksum = verify_reallocation(plan, rank, src, out)
    if checksum != weights_checksum(shard(full, dst_sl)) and not corrupt:
        return f"{name}: rank {rank} checksum differs", checksum
    return None, checksum


def worker(rank: int, rdzv: str, shapes_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=rdzv, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    shapes = {
        k: {n: tuple(s) for n, s in v.items()} for k, v in json.loads(Path(shapes_path).read_text()).items()
    }
    cache = GroupCache()
    failures: list[str] = []
    t0 = time.perf_counter()
    all_cases = cases()
    for case in all_cases:
        failure, _ = _run_case(case, rank, shapes, cache)
        if failure:
            failures.append(failure)
    matrix_s = time.perf_counter() - t0
    torch.distributed.barrier()
    # a corrupted target shard (rank 2 flips one element) must be caught on every rank
    mesh = (0, 1, 2, 3)
    corrupt_case = dict(model="untied", src="d1t2p2", dst="d2t2p1", src_devs=mesh, dst_devs=mesh,
                        dtype="float32", small=False, place="corrupt")  # fmt: skip
    caught = ""
    try:
        _run_case(corrupt_case, rank, shapes, cache, corrupt=rank == 2)
    except ChecksumError as err:
        caught = str(err)
    seconds = time.perf_counter() - t0
    torch.distributed.barrier()
    cache.destroy()
    torch.distributed.destroy_process_group()
    result = dict(
        rank=rank, cases=len(all_cases), failures=failures, caught=caught, seconds=seconds, matrix_s=matrix_s
    )
    Path(out_path).write_text(json.dumps(result))


def launch(tmp_path: Path) -> list[dict[str, Any]]:
    """Start WORLD workers of this file, kill them all if one fails or the group overruns; their results."""
    shapes = {name: llama_shapes(layers, tied) for name, (layers, tied) in MODELS.items()}
    shapes_path = tmp_path / "shapes.json"
    shapes_path.write_text(json.dumps(shapes))
    rdzv = f"file://{tmp_path / 'rdzv'}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for rank in range(WORLD):
        log = open(tmp_path / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            str(rank),
            rdzv,
            str(shapes_path),
            str(tmp_path / f"r{rank}.json"),
        ]
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    deadline = time.monotonic() + GROUP_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                time.sleep(1.0)  # let the others print their error
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    if any(p.returncode != 0 for p in procs):
        tails = "\n".join(
            f"--- rank {r}\n" + (tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(WORLD)
        )
        pytest.fail(f"workers failed (returncodes {[p.returncode for p in procs]}):\n{tails}")
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(WORLD)]


def test_tiny_llama_shapes_match_the_planner_model_shape() -> None:
    from rlflow.schedulers.planner.shapes import ModelShape

    for layers, tied in MODELS.values():
        cfg = {**TINY, "num_hidden_layers": layers, "tie_word_embeddings": tied}
        assert llama_shapes(layers, tied) == ModelShape.from_config(cfg).param_shapes()


@pytest.mark.slow
def test_reallocation_matrix_bit_exact_on_4_gloo_processes(tmp_path: Path) -> None:
    results = launch(tmp_path)
    n_cases = len(cases())
    assert n_cases >= 2 * 49 * 2
    for res in results:
        assert res["cases"] == n_cases
        assert res["failures"] == [], res["failures"][:10]
        # every rank raised ChecksumError for the flipped element on rank 2
        assert "rank 2" in res["caught"] and "mismatch" in res["caught"], res
    print(f"{n_cases} cases in {max(r['matrix_s'] for r in results):.1f} s per rank")


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs=4, metavar=("RANK", "RDZV", "SHAPES", "OUT"), required=True)
    args = parser.parse_args()
    rank, rdzv, shapes_path, out_path = args.worker
    try:
        worker(int(rank), rdzv, shapes_path, out_path)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    _main()
