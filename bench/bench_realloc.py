"""Parameter reallocation of a GPT-2-small-size model on 4 gloo processes vs a raw gloo broadcast.

Model: a Llama-architecture model of GPT-2-small size (hidden 768, 12 layers, 12 heads, SwiGLU
intermediate 2048, vocabulary 50257 padded to 50304 so it splits over 2 and 4 tensor ranks, tied head:
≈124 M parameters), bf16 weights (≈248 MB). Only the shapes matter (shards are uninitialised memory).

For each layout pair (devices 0-3, one process per device) the bench prints:
  * ``payload MB``: bytes the plan sends (each broadcast counted once; local copies excluded),
  * ``recv MB``: bytes received, summed over receiving ranks (``ReallocPlan.remote_bytes``),
  * ``msgs``: broadcasts after coalescing; ``realloc s``: median wall time of ``execute_reallocation``
    (barrier to barrier, local copies included),
  * ``raw s``: median time of ONE ``dist.broadcast`` of a ``payload``-byte buffer from the lowest rank to
    all ranks the plan involves, in the same run, interleaved with the reallocation repeats,
  * ``ratio`` = raw s / realloc s (≥ 1: the reallocation is as fast as moving its payload with one raw
    broadcast; aim ≥ 0.8).

What bounds it (measured 2026-12 on 2 cores shared by 4 processes and other jobs, load ≈ 8; noisy):
  * per-broadcast latency: a plan of this model is ~100 messages (one per weight matrix ≥ 1 MiB, zero-copy
    when contiguous); a 1 MiB broadcast among 4 gloo ranks runs at ≈0.4 GB/s vs ≈0.8 GB/s at 128 MiB, so
    many mid-size messages lose to one big raw broadcast (one -> all: ratio ≈0.55-0.63);
  * copies: regions not contiguous in a shard (column halves of row-parallel o/down, and tensors under
    1 MiB packed into 64 MiB buckets) are staged through a buffer, competing with gloo for the 2 cores;
  * pp -> tp exchanges in both directions on one group, one after the other (the raw baseline is one
    direction): ratio ≈0.35. Disjoint pairs run concurrently, so tp2 -> tp2 on other devices beats one
    raw broadcast among all 4 (ratio > 1).
  Broadcasts are now issued asynchronously (packing overlaps sending): see bench/README.md for the
  measured ratios of both executors.
Run: ``python bench/bench_realloc.py`` (about a minute on 2 shared cores; ``--reps N`` to change repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.realloc.execute import execute_reallocation, schedule_messages
from rlflow.schedulers.realloc.groups import GroupCache
from rlflow.schedulers.realloc.planning import plan_reallocation
from rlflow.schedulers.realloc.shards import ModelMeta, param_shards

WORLD = 4
CONFIG = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    intermediate_size=2048,
    vocab_size=50304,
    tie_word_embeddings=True,
)
ALL = (0, 1, 2, 3)
# (label, src layout, src devices, dst layout, dst devices)
PAIRS = [
    ("one -> all replicas", "d1t1p1", (0,), "d4t1p1", ALL),
    ("train -> generate", "d1t2p2", ALL, "d4t1p1", ALL),
    ("generate -> train", "d4t1p1", ALL, "d1t2p2", ALL),
    ("tp/dp -> tp/pp", "d2t2p1", ALL, "d1t2p2", ALL),
    ("pp -> tp", "d1t1p2", (0, 1), "d1t2p1", (0, 1)),
    ("disjoint tp2 -> tp2", "d1t2p1", (0, 1), "d1t2p1", (2, 3)),
    ("one -> one", "d1t1p1", (0,), "d1t1p1", (3,)),
]


def model_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of the transformers LlamaForCausalLM above (meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _time(fn: object) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    dist.barrier()
    return time.perf_counter() - t0


def worker(rank: int, rdzv: str, shapes_path: str, reps: int, direct_mb: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rdzv, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    shapes = {n: tuple(s) for n, s in json.loads(Path(shapes_path).read_text()).items()}
    meta, dtype = (
        ModelMeta(int(CONFIG["num_hidden_layers"]), bool(CONFIG["tie_word_embeddings"])),
        torch.bfloat16,
    )
    groups = GroupCache()
    rows = []
    for label, s, sd, d, dd in PAIRS:
        src_l, dst_l = Layout.parse(s), Layout.parse(d)
        plan = plan_reallocation(shapes, meta, sd, src_l, dd, dst_l, dtype_bytes=dtype.itemsize)
        src_sl = param_shards(shapes, meta, sd, src_l).get(rank, {})
        dst_sl = param_shards(shapes, meta, dd, dst_l).get(rank, {})
        src = {n: torch.empty(tuple(x.stop - x.start for x in sl), dtype=dtype) for n, sl in src_sl.items()}
        dst = {n: torch.empty(tuple(x.stop - x.start for x in sl), dtype=dtype) for n, sl in dst_sl.items()}
        kw = dict(dtype=dtype, groups=groups, direct_bytes=int(direct_mb * (1 << 20)))
        payload = sum(t.bytes for t in plan.transfers if not t.is_local)
        ranks = sorted({r for t in plan.transfers if not t.is_local for r in (t.src, *t.dsts)})
        buf = torch.empty(payload if rank in ranks else 0, dtype=torch.uint8)
        raw_group = groups.get(ranks) if len(ranks) > 1 else None

        def realloc(plan=plan, src=src, dst=dst, kw=kw) -> None:  # type: ignore[no-untyped-def]
            execute_reallocation(plan, rank, src, dst, **kw)

        def raw(ranks=ranks, buf=buf, raw_group=raw_group) -> None:  # type: ignore[no-untyped-def]
            if raw_group is not None and rank in ranks:
                dist.broadcast(buf, src=ranks[0], group=raw_group)

        realloc()  # warm-up: creates the process groups
        raw()
        t_re, t_raw = [], []
        for _ in range(reps):
            t_re.append(_time(realloc))
            t_raw.append(_time(raw))
        n_msgs = len(schedule_messages(plan, dtype, direct_bytes=kw["direct_bytes"]))  # type: ignore[arg-type]
        rows.append(
            (f"{label}: {s}{list(sd)} -> {d}{list(dd)}", payload, plan.remote_bytes, n_msgs,
             statistics.median(t_re), statistics.median(t_raw))
        )  # fmt: skip
        del src, dst, buf
    if rank == 0:
        n_params = sum(torch.Size(s).numel() for s in shapes.values())
        print(f"model: {n_params / 1e6:.1f} M params, bf16 ({2 * n_params / 1e6:.0f} MB); {WORLD} processes")
        head = ("pair", "payload MB", "recv MB", "msgs", "realloc s", "raw s", "ratio")
        print("{:<58} {:>10} {:>7} {:>4} {:>9} {:>6} {:>5}".format(*head))
        for name, payload, recv, msgs, t_re, t_raw in rows:
            ratio = f"{t_raw / t_re:>5.2f}" if payload else "local"  # no payload: local copies only
            mb = f"{payload / 1e6:>10.1f} {recv / 1e6:>7.1f}"
            print(f"{name:<58} {mb} {msgs:>4} {t_re:>9.3f} {t_raw:>6.3f} {ratio}")
        sys.stdout.flush()
    groups.destroy()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3, help="timed repeats per pair (median reported)")
    parser.add_argument(
        "--direct-mb", type=float, default=1.0, help="transfers of at least this many MiB go unpacked"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds before the whole group is killed")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "RDZV", "SHAPES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        try:
            worker(int(args.worker[0]), args.worker[1], args.worker[2], args.reps, args.direct_mb)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            os._exit(1)
        return
    with tempfile.TemporaryDirectory() as tmp:
        shapes_path = Path(tmp) / "shapes.json"
        shapes_path.write_text(json.dumps(model_shapes()))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        common = ["--reps", str(args.reps), "--direct-mb", str(args.direct_mb)]
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *common,
                    "--worker",
                    str(r),
                    f"file://{tmp}/rdzv",
                    str(shapes_path),
                ],
                env=env,
            )
            for r in range(WORLD)
        ]
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
                time.sleep(1.0)
                break
            time.sleep(0.2)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if any(p.returncode != 0 for p in procs):
            sys.exit(f"bench workers failed: return codes {[p.returncode for p in procs]}")


if __name__ == "__main__":
    main()
