"""DeepSpeed ZeRO-1/2/3 (with and without CPU offload) vs FSDP2 on the same train node, model and batch, and
the reallocation out of ZeRO-3 partitions vs a raw broadcast of the same bytes.

    python bench/bench_zero.py [--dp 2] [--steps 3] [--hidden 512] [--layers 4]

Each configuration runs in its own group of ``--dp`` gloo processes (one thread each), so the peak memory is
its own: an SFT node (``rlflow.nodes.functions.supervised.sft_node``, 2 mini-batches, 2 micro-batches per
rank) on a random Llama (``--hidden``, ``--layers``, vocabulary 4096) through the same ``TrainHooks`` seam the
runtime uses. Printed per configuration: seconds per optimizer step (median of ``--steps`` node calls after
one untimed call, divided by the node's 2 steps), the largest peak RSS over the ranks (``ru_maxrss``, MiB) and
its growth over the process's RSS before the model was built (model, gradients, optimizer states and
buffers), and the ratios to FSDP2. Then, in one more group of ``2·dp`` processes: moving a trained ZeRO-3
model from ranks ``0..dp-1`` to generation replicas on the other ranks with the piece path
(``rlflow.schedulers.runtime.distributed.zero_transfer.move_pieces``, verification included) vs
``dist.broadcast`` of the same bytes from rank 0 to the replica ranks (median of 3). Also the 1-minute load
average before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import resource
import statistics
import time
from typing import Any

import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import DeepSpeedSpec, NodeSpec
from rlflow.schedulers.planner.plans import Layout
from rlflow.schedulers.runtime.distributed.launch import run_group
from rlflow.schedulers.runtime.distributed.rows import shard_rows

ROWS, PROMPT, RESPONSE = 16, 16, 48
CONFIGS: tuple[tuple[str, DeepSpeedSpec | None], ...] = (
    ("fsdp2", None),
    ("zero1", DeepSpeedSpec(zero_stage=1)),
    ("zero2", DeepSpeedSpec(zero_stage=2)),
    ("zero2+opt-offload", DeepSpeedSpec(zero_stage=2, offload_optimizer="cpu")),
    ("zero3", DeepSpeedSpec(zero_stage=3)),
    ("zero3+opt-offload", DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu")),
    ("zero3+opt+param-offload", DeepSpeedSpec(zero_stage=3, offload_optimizer="cpu", offload_param="cpu")),
)


def _config(hidden: int, layers: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 4096,
        "hidden_size": hidden,
        "intermediate_size": hidden * 8 // 3 // 64 * 64,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "max_position_embeddings": PROMPT + RESPONSE,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "eos_token_id": 2,
        "bos_token_id": 1,
    }


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    return Batch(
        {
            "prompt_ids": torch.randint(3, 4096, (ROWS, PROMPT), generator=g),
            "prompt_mask": torch.ones(ROWS, PROMPT, dtype=torch.long),
            "response_ids": torch.randint(3, 4096, (ROWS, RESPONSE), generator=g),
            "response_mask": torch.ones(ROWS, RESPONSE, dtype=torch.long),
        }
    )


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _train_worker(rank: int, world: int, name: str, ds: DeepSpeedSpec | None, cfg: dict, steps: int) -> dict:
    from rlflow.nodes.context import ModelState, NodeContext
    from rlflow.nodes.functions.supervised import sft_node
    from rlflow.nodes.models import build_model
    from rlflow.nodes.train import build_optimizer
    from rlflow.schedulers.runtime.distributed.layouts import DataParallelHooks, MeshSpec, apply_layout
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.zero import ZeroHooks, build_engine, destroy_engine

    base = _rss_mib()
    spec = MeshSpec.of(range(world), Layout(world, 1, 1, 1))
    mesh = GroupCache(timeout_s=600).mesh(spec)
    node = NodeSpec(name="sft", kind="train", function="sft", model="m", mini_batches=2)
    opt = OptimizerSpec(lr=1e-4, grad_clip=1.0)
    model = build_model(config=cfg, seed=1)
    total = 2 * (steps + 1)
    engine = None
    if ds is None:
        module = apply_layout(model, mesh, train=True)
        state = ModelState(name="m", module=module, head="lm")
        state.optimizer, state.scheduler = build_optimizer(module, opt, total)
        hooks: Any = DataParallelHooks(module, mesh["dp"].get_group(), world)
    else:
        engine = build_engine(model, ds, opt, total, mesh["dp"].get_group(), mesh["tp"].get_group())
        state = ModelState(name="m", module=engine.module, head="lm")
        state.optimizer, state.scheduler = engine.optimizer, engine.lr_scheduler
        hooks = ZeroHooks(engine, mesh["dp"].get_group(), world)
    state.optimizer_spec = opt
    ctx = NodeContext(node=node, model=state, micro_batches=2, train_hooks=hooks)
    rows = _batch().index(shard_rows(ROWS, world, 2)[rank])
    times = []
    with hooks:
        for i in range(steps + 1):
            torch.distributed.barrier(mesh["dp"].get_group())
            start = time.perf_counter()
            sft_node(ctx, rows)
            if i:
                times.append((time.perf_counter() - start) / node.mini_batches)
    peak = _rss_mib()
    if engine is not None:
        destroy_engine(engine)
    return {"step_s": statistics.median(times), "peak_mib": peak, "growth_mib": peak - base, "config": name}


def _realloc_worker(rank: int, world: int, cfg: dict, repeats: int) -> dict:
    from rlflow.nodes.models import build_model
    from rlflow.schedulers.runtime.distributed.layouts import MeshSpec
    from rlflow.schedulers.runtime.distributed.mesh import GroupCache
    from rlflow.schedulers.runtime.distributed.placement import Instance
    from rlflow.schedulers.runtime.distributed.sync_routes import holdings
    from rlflow.schedulers.runtime.distributed.weight_sync import model_info, target_shards
    from rlflow.schedulers.runtime.distributed.zero import build_engine, zero_local
    from rlflow.schedulers.runtime.distributed.zero_transfer import move_pieces, plan_pieces

    dp = world // 2
    cache = GroupCache(timeout_s=600)
    src = MeshSpec.of(range(dp), Layout(dp, 1, 1, 1))
    dst = MeshSpec.of(range(dp, world), Layout(dp, 1, 1, 1))
    src_mesh, dst_mesh = cache.mesh(src), cache.mesh(dst)
    everyone = cache.group(tuple(range(world)))
    root_and_targets = (0, *range(dp, world))  # the broadcast: rank 0 -> every replica rank, the same bytes
    bcast = cache.group(root_and_targets)
    model = build_model(config=cfg, seed=1)
    info = model_info(model)
    engine = None
    if src_mesh is not None:
        opt = OptimizerSpec(lr=1e-4)
        engine = build_engine(
            copy.deepcopy(model), DeepSpeedSpec(zero_stage=3), opt, 1, src_mesh["dp"].get_group(),
            src_mesh["tp"].get_group(),
        )  # fmt: skip
    source = Instance("m", src, fsdp=False, zero=DeepSpeedSpec(zero_stage=3))
    pieces = plan_pieces(holdings(info, source), holdings(info, Instance("m", dst, False)), list(info.shapes))
    src_local = zero_local(engine.module) if engine is not None else {}
    dst_local = target_shards(model) if dst_mesh is not None else {}
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = torch.zeros(nbytes // 4)
    ours, raw = [], []
    for _ in range(repeats):
        torch.distributed.barrier(everyone)
        start = time.perf_counter()
        move_pieces(pieces, rank, src_local, dst_local, everyone)
        torch.distributed.barrier(everyone)
        ours.append(time.perf_counter() - start)
        torch.distributed.barrier(everyone)
        start = time.perf_counter()
        if bcast is not None:
            torch.distributed.broadcast(flat, src=0, group=bcast)
        torch.distributed.barrier(everyone)
        raw.append(time.perf_counter() - start)
    return {"pieces_s": statistics.median(ours), "broadcast_s": statistics.median(raw), "model_bytes": nbytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = _config(args.hidden, args.layers)
    load0 = os.getloadavg()[0]
    rows = []
    for name, ds in CONFIGS:
        results = run_group(_train_worker, args.dp, (name, ds, cfg, args.steps), timeout_s=1800)
        rows.append(
            (
                name,
                max(r["step_s"] for r in results),
                max(r["peak_mib"] for r in results),
                max(r["growth_mib"] for r in results),
            )
        )
        print(f"  {name}: done", flush=True)
    base = rows[0]
    print(
        f"\nmodel: hidden {args.hidden}, {args.layers} layers; dp={args.dp}; "
        f"{ROWS} rows x {PROMPT + RESPONSE} tokens"
    )
    print(
        f"{'config':<26}{'s/step':>9}{'peak MiB':>10}{'growth MiB':>12}{'time/FSDP2':>12}{'growth/FSDP2':>14}"
    )
    for name, step, peak, growth in rows:
        print(
            f"{name:<26}{step:>9.3f}{peak:>10.0f}{growth:>12.0f}"
            f"{step / base[1]:>12.2f}{growth / base[3]:>14.2f}"
        )
    r = run_group(_realloc_worker, 2 * args.dp, (cfg, 3), timeout_s=1800)
    pieces, raw = max(x["pieces_s"] for x in r), max(x["broadcast_s"] for x in r)
    mib = r[0]["model_bytes"] / 2**20
    print(
        f"\nZeRO-3 (ranks 0-{args.dp - 1}) -> replicas (ranks {args.dp}-{2 * args.dp - 1}), {mib:.0f} MiB: "
        f"pieces {pieces:.3f} s (verified) vs raw broadcast {raw:.3f} s: ratio {pieces / raw:.2f}"
    )
    print(f"load average (1 min): {load0:.2f} -> {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
