"""Parameter reallocation of a GPT-2-small-size model on 4 gloo processes vs a raw gloo broadcast.

Model: a Llama-architecture model of GPT-2-small size (hidden 768, 12 layers, 12 heads, SwiGLU
intermediate 2048, vocabulary 50257 padded to 50304 so it splits over 2 and 4 tensor ranks, tied head:
≈124 M parameters), bf16 weights (≈248 MB). Only the shapes matter (shards are uninitialised memory).
The ``[moe]`` pairs move a Qwen3-MoE model instead (hidden 512, 8 layers of 8 experts of width 512, top-2,
8 heads of 64, vocabulary 32000, untied: ≈92 M parameters, 54 % of them routed experts) between expert
parallel layouts (``e``: the fused expert tensors cut by ep along the expert dim, ``realloc.shards``): each
expert block goes from a holder to the ranks that need it, where the gather path used to broadcast the
whole model (``model MB``, per receiving rank).

For each layout pair (devices 0-3, one process per device, one torch thread each) the bench prints:
  * ``payload MB``: bytes the plan sends (each message counted once; local copies excluded),
  * ``recv MB``: bytes received, summed over receiving ranks; ``model MB``: the whole model's bytes,
  * ``local MB``: bytes of the plan's local copies, summed over ranks,
  * ``msgs``: messages after coalescing; ``realloc s``: median wall time of ``execute_reallocation``
    (barrier to barrier, local copies included),
  * ``raw s``: median time of ONE ``dist.broadcast`` of a ``payload``-byte buffer from the lowest rank to
    all ranks the plan involves (the same processes, the same gloo backend), in the same run, interleaved
    with the reallocation repeats (the order alternates every repeat),
  * ``copy s``: median time of one flat memcpy of each rank's local-copy bytes (all ranks at once),
  * ``ratio [q1-q3]`` = raw s / realloc s per repeat: median and quartiles (≥ 1: the reallocation is as
    fast as moving its payload with one raw broadcast; aim ≥ 0.9); ``+copy`` = (raw s + copy s) /
    realloc s, the same with the local copies in the baseline,
  * ``cpu re/raw``: CPU seconds of one reallocation / one raw broadcast, all threads, summed over ranks
    (medians): on 2 cores shared with other jobs the wall time follows the CPU work.
The load averages at the start and end are printed: the machine is shared, so compare runs only with
their load and repeat.

What bounds it (bench/README.md has the measured table): the reallocation does work the raw broadcast
does not: local copies (each rank's own part of its new shards), staging copies (regions not contiguous in
a shard: column halves of row-parallel o/down; transfers under 1 MiB packed into buckets) and ~100
messages instead of one; on 2 shared cores that CPU work, not the wire, sets the time.
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
MOE_CONFIG = dict(
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=1024,
    moe_intermediate_size=512,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    tie_word_embeddings=False,
)
ALL = (0, 1, 2, 3)
# (label, src layout, src devices, dst layout, dst devices); "[moe]" labels move the MoE model
PAIRS = [
    ("one -> all replicas", "d1t1p1", (0,), "d4t1p1", ALL),
    ("train -> generate", "d1t2p2", ALL, "d4t1p1", ALL),
    ("generate -> train", "d4t1p1", ALL, "d1t2p2", ALL),
    ("tp/dp -> tp/pp", "d2t2p1", ALL, "d1t2p2", ALL),
    ("pp -> tp", "d1t1p2", (0, 1), "d1t2p1", (0, 1)),
    ("disjoint tp2 -> tp2", "d1t2p1", (0, 1), "d1t2p1", (2, 3)),
    ("one -> one", "d1t1p1", (0,), "d1t1p1", (3,)),
    ("[moe] ep4 -> ep2", "d4t1p1e4", ALL, "d4t1p1e2", ALL),
    ("[moe] ep2 -> tp2 (generate)", "d2t1p1e2", (0, 1), "d1t2p1", (0, 1)),
    ("[moe] ep2xpp2 -> dp4", "d2t1p2e2", ALL, "d4t1p1", ALL),
]


def model_shapes() -> dict[str, dict[str, tuple[int, ...]]]:
    """Parameter shapes of the transformers LlamaForCausalLM and Qwen3MoeForCausalLM above, by model key
    (``llama``, ``moe``; meta device: no memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        models = {
            "llama": LlamaForCausalLM(LlamaConfig(**CONFIG)),
            "moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_CONFIG)),
        }
    return {key: {n: tuple(p.shape) for n, p in m.named_parameters()} for key, m in models.items()}


def _time(fn: object) -> tuple[float, float]:
    """(wall seconds barrier to barrier, this process's CPU seconds, all its threads) of ``fn()``."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fn()  # type: ignore[operator]
    c1 = time.process_time()
    dist.barrier()
    return time.perf_counter() - t0, c1 - c0


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def worker(rank: int, rdzv: str, shapes_path: str, reps: int, direct_mb: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=rdzv, rank=rank, world_size=WORLD, timeout=timedelta(seconds=120)
    )
    models = {
        key: {n: tuple(s) for n, s in shapes.items()}
        for key, shapes in json.loads(Path(shapes_path).read_text()).items()
    }
    metas = {
        key: ModelMeta(int(c["num_hidden_layers"]), bool(c["tie_word_embeddings"]))
        for key, c in (("llama", CONFIG), ("moe", MOE_CONFIG))
    }
    dtype = torch.bfloat16
    groups = GroupCache()
    rows = []
    load0 = os.getloadavg()
    for label, s, sd, d, dd in PAIRS:
        key = "moe" if label.startswith("[moe]") else "llama"
        shapes, meta = models[key], metas[key]
        src_l, dst_l = Layout.parse(s), Layout.parse(d)
        plan = plan_reallocation(shapes, meta, sd, src_l, dd, dst_l, dtype_bytes=dtype.itemsize)
        src_sl = param_shards(shapes, meta, sd, src_l).get(rank, {})
        dst_sl = param_shards(shapes, meta, dd, dst_l).get(rank, {})
        src = {n: torch.empty(tuple(x.stop - x.start for x in sl), dtype=dtype) for n, sl in src_sl.items()}
        dst = {n: torch.empty(tuple(x.stop - x.start for x in sl), dtype=dtype) for n, sl in dst_sl.items()}
        kw = dict(dtype=dtype, groups=groups, direct_bytes=int(direct_mb * (1 << 20)))
        payload = sum(t.bytes for t in plan.transfers if not t.is_local)
        local = sum(t.bytes for t in plan.transfers if t.is_local and t.src == rank)
        ranks = sorted({r for t in plan.transfers if not t.is_local for r in (t.src, *t.dsts)})
        buf = torch.empty(payload if rank in ranks else 0, dtype=torch.uint8)
        copy_from, copy_to = torch.empty(local, dtype=torch.uint8), torch.empty(local, dtype=torch.uint8)
        raw_group = groups.get(ranks) if len(ranks) > 1 else None

        def realloc(plan=plan, src=src, dst=dst, kw=kw) -> None:  # type: ignore[no-untyped-def]
            execute_reallocation(plan, rank, src, dst, **kw)

        def raw(ranks=ranks, buf=buf, raw_group=raw_group) -> None:  # type: ignore[no-untyped-def]
            if raw_group is not None and rank in ranks:
                dist.broadcast(buf, src=ranks[0], group=raw_group)

        def copy(copy_from=copy_from, copy_to=copy_to) -> None:  # type: ignore[no-untyped-def]
            copy_to.copy_(copy_from)  # the same bytes as this rank's local copies, one flat memcpy

        realloc()  # warm-up: creates the process groups, touches every buffer
        raw()
        copy()
        t: dict[str, list[float]] = {"re": [], "raw": [], "copy": []}
        cpu: dict[str, list[float]] = {"re": [], "raw": []}
        for i in range(reps):  # interleaved, alternating which goes first
            order = [("re", realloc), ("raw", raw)]
            for key, fn in order if i % 2 == 0 else order[::-1]:
                wall, c = _time(fn)
                t[key].append(wall)
                cpu[key].append(c)
            t["copy"].append(_time(copy)[0])
        n_msgs = len(schedule_messages(plan, dtype, direct_bytes=kw["direct_bytes"]))  # type: ignore[arg-type]
        ratios = [b / a for a, b in zip(t["re"], t["raw"], strict=True)]
        ratios_copy = [(b + c) / a for a, b, c in zip(t["re"], t["raw"], t["copy"], strict=True)]
        cpus = [None] * WORLD
        dist.all_gather_object(cpus, (statistics.median(cpu["re"]), statistics.median(cpu["raw"]), local))
        rows.append(
            dict(name=f"{label}: {s}{list(sd)} -> {d}{list(dd)}", payload=payload, recv=plan.remote_bytes,
                 model=sum(torch.Size(x).numel() for x in shapes.values()) * dtype.itemsize,
                 local=sum(c[2] for c in cpus), msgs=n_msgs, re=statistics.median(t["re"]),
                 raw=statistics.median(t["raw"]), copy=statistics.median(t["copy"]),
                 ratio=_quartiles(ratios), ratio_copy=_quartiles(ratios_copy),
                 cpu_re=sum(c[0] for c in cpus), cpu_raw=sum(c[1] for c in cpus))
        )  # fmt: skip
        del src, dst, buf, copy_from, copy_to
    if rank == 0:
        for key in ("llama", "moe"):
            n_params = sum(torch.Size(s).numel() for s in models[key].values())
            print(f"{key} model: {n_params / 1e6:.1f} M params, bf16 ({2 * n_params / 1e6:.0f} MB)")
        threads = torch.get_num_threads()
        print(f"{WORLD} processes, torch threads {threads} each, reps {reps}, direct {direct_mb} MiB")
        print("load average (1, 5, 15 min) at start {:.2f} {:.2f} {:.2f}, ".format(*load0), end="")
        print("at end {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
        head = ("pair", "payload MB", "recv MB", "model MB", "local MB", "msgs", "realloc s", "raw s",
                "copy s", "ratio [q1-q3]", "+copy", "cpu re/raw")  # fmt: skip
        print("{:<62} {:>10} {:>7} {:>8} {:>8} {:>4} {:>9} {:>6} {:>6} {:>16} {:>5} {:>11}".format(*head))
        for r in rows:
            if r["payload"]:
                q1, med, q3 = r["ratio"]
                ratio = f"{med:.2f} [{q1:.2f}-{q3:.2f}]"
                plus = f"{r['ratio_copy'][1]:.2f}"
            else:
                ratio, plus = "local", "local"  # no payload: local copies only
            cpu = f"{r['cpu_re']:.3f}/{r['cpu_raw']:.3f}"
            secs = f"{r['re']:>9.3f} {r['raw']:>6.3f} {r['copy']:>6.3f}"
            sizes = f"{r['payload'] / 1e6:>10.1f} {r['recv'] / 1e6:>7.1f} {r['model'] / 1e6:>8.1f}"
            print(f"{r['name']:<62} {sizes} {r['local'] / 1e6:>8.1f} {r['msgs']:>4}",
                  f"{secs} {ratio:>16} {plus:>5} {cpu:>11}")  # fmt: skip
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
