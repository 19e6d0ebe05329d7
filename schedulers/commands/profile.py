"""Measure this host for the cost model (rates, collectives and the runtime's fixed costs) into a profile.

``rlflow profile`` measures a transformer block, the model's calls (alone and in 2-way tensor / FSDP2
layouts), the optimizer, gloo collectives, the controller's dispatch, the runtime's own latencies (a probe
run on two workers) and busy-worker slowdown on this host; every measurement three times, medians kept.

Writes (appends) rows to a Parquet file keyed by hardware and model shape; ``rlflow plan --profile FILE``
then uses measured rates, links and overheads instead of the cluster file's defaults
(measured by ``rlflow.schedulers.profiling``, fitted by ``rlflow.schedulers.planner.calibration``).
Where vLLM is installed it also measures the vLLM engine once (start, prefill, decode steps, weight load:
``ClusterSpec.engine``, which prices ``engine: vllm`` nodes and lets ``plan: auto`` choose an engine for
``engine: auto`` ones); without vLLM it says it skipped the engine, and the planner offers vLLM to no node.
Takes two to three minutes on a 2-core CPU (the engine 30-60 s more); ``--quick`` takes well under one (one
small shape, one round, no collectives among processes, no probe run and no engine, whose start alone
takes 10-20 s: a rough profile for trying the commands out). A model no 2-way tensor-parallel layout can
split (tp = 2 does not divide its vocabulary or heads) is said before anything is measured, in one line: its
FSDP2 calls are measured, its tensor-parallel ones skipped.

Examples: ``rlflow profile --cluster cpu-local`` (the examples' tiny Llama shape, into
``out/profile.parquet``);
``rlflow profile --model runs/arith-sft/checkpoints/latest/models/actor`` (a Hugging Face model directory
or its ``config.json``, e.g. the SFT checkpoint of ``make run``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlflow.schedulers.commands import OUT_DIR


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", default="cpu-local", help="cluster preset or file this host belongs to")
    parser.add_argument(
        "--model", default=None, help="HF config.json, HF model dir, or preset 7b/13b/34b/70b"
    )
    parser.add_argument(
        "--out",
        default=str(OUT_DIR / "profile.parquet"),
        help=f"Parquet file to append to (default {OUT_DIR}/profile.parquet)",
    )
    parser.add_argument("--batch", type=_ints, default=[1, 2, 4], help="batch sizes, e.g. 1,2,4")
    parser.add_argument("--seq", type=_ints, default=[32, 64], help="sequence lengths, e.g. 32,64")
    parser.add_argument("--groups", type=_ints, default=[2], help="collective group sizes (processes)")
    parser.add_argument("--repeats", type=int, default=2, help="calls per measurement, at least")
    parser.add_argument(
        "--rounds", type=int, default=3, help="times every measurement is repeated (median kept)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: a runtime worker's)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a rough profile in well under a minute: --batch 1 --seq 16 --groups 1 --repeats 1 --rounds 1 "
        "(no collectives among processes, no probe run, no vLLM engine); for trying rlflow out, not for "
        "planning",
    )


def run(args: argparse.Namespace) -> int:
    from rlflow.dataflow.errors import PlanError
    from rlflow.nodes.engines.validation import vllm_missing
    from rlflow.schedulers.planner.calibration import apply_profile
    from rlflow.schedulers.planner.cluster_files import load_cluster
    from rlflow.schedulers.planner.shapes import MODEL_PRESETS
    from rlflow.schedulers.profiling.collect import run_profile
    from rlflow.schedulers.profiling.measure import DEFAULT_CONFIG
    from rlflow.schedulers.profiling.model_calls import tp_skipped

    if args.quick:
        args.batch, args.seq, args.groups, args.repeats, args.rounds = [1], [16], [1], 1, 1
    missing = vllm_missing()
    skipped = (
        "--quick (its start alone takes 10-20 s on CPU; profile without --quick to measure it)"
        if args.quick
        else missing
    )
    cluster = load_cluster(args.cluster)
    config = dict(DEFAULT_CONFIG)
    if args.model in MODEL_PRESETS:
        s = MODEL_PRESETS[args.model]
        config = {
            "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "vocab_size": s.vocab_size, "head_dim": s.head_dim,
        }  # fmt: skip
    elif args.model:
        path = Path(args.model)
        path = path / "config.json" if path.is_dir() else path
        try:
            config = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise PlanError(f"--model {args.model}: cannot read an HF config: {err}") from None
    no_tp = tp_skipped(config) if any(n >= 2 for n in args.groups) else None
    if no_tp is not None:  # known before measuring: said now, not after minutes
        print(f"tensor-parallel calls: skipped: {no_tp} (no tp layout runs this model: measuring its FSDP2 "
              f"calls only; tp overheads keep {args.cluster}'s values)", flush=True)  # fmt: skip
    out = run_profile(
        cluster,
        config,
        args.out,
        args.batch,
        args.seq,
        args.groups,
        args.repeats,
        threads=args.threads,
        rounds=args.rounds,
        engine=skipped is None,
    )
    fitted = apply_profile(cluster, out, threads=args.threads)
    e = fitted.efficiency
    print(f"wrote {out}")
    print(
        f"fitted for {cluster.name}: matmul efficiency {e.matmul:.3f} (half at {e.half_tokens:.0f} tokens), "
        f"memory {e.memory:.3f}, link {fitted.intra_host.bandwidth / 1e9:.3f} GB/s, "
        f"latency {fitted.intra_host.latency * 1e6:.1f} µs"
    )
    for (op, n), link in sorted(fitted.collectives.items()):
        print(f"  {op} among {n}: {link.bandwidth / 1e9:.3f} GB/s, {link.latency * 1e6:.1f} µs per step")
    print("  overheads: " + ", ".join(f"{k} {v:.3g}" for k, v in fitted.overheads.__dict__.items()))
    if fitted.slowdowns:
        print("  busy workers: " + ", ".join(f"{n} x{v:.2f}" for n, v in sorted(fitted.slowdowns.items())))
    if no_tp is not None:
        print(f"  tensor-parallel calls: skipped: {no_tp} (no tp layout runs this model; tp overheads keep "
              f"{args.cluster}'s values)")  # fmt: skip
    engine = fitted.engine
    if skipped is not None:
        earlier = "the file's earlier engine rows apply" if engine else "the planner prices it by default"
        print(f"  vLLM engine: skipped: {skipped}; {earlier}")
    if engine is not None:
        print(
            f"  vLLM engine against the roofline: prefill x{engine.prefill_scale:.3g} + "
            f"{engine.prefill_call_s:.3g} s per call, decode + {engine.decode_step_s:.3g} s per step + "
            f"{engine.decode_row_s:.3g} s per row and step; weight load "
            f"{engine.load_bandwidth / 1e9:.3g} GB/s + verify {engine.verify_s:.3g} s; start "
            f"{engine.start_s:.3g} s (once per run)"
        )
    return 0
