"""rlflow-best's plan for ``bench_shapes_vs_trl.py``: the overrides that make a graph run at rlflow's best on
this host (``plan=auto`` planned once on a ``rlflow profile`` of the host, or a hand-written split plan), and
the token budget's default."""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import trl_compare as tc

ROOT = Path(__file__).resolve().parent.parent
BEST = [
    "plan=auto",
    "run.devices=2",
    f"nodes.{tc.GENERATE_NODE}.engine=auto",
    f"nodes.{tc.GENERATE_NODE}.staleness=1",
]
"""rlflow-best's overrides before its plan: ``plan=auto`` over 2 devices, the engine chosen by the planner,
asynchronous generation (η = 1)."""


def default_token_budget(budget: int | None) -> int:
    """``--token-budget`` as given, else 2048 where CUDA is present and 0 (off) on CPU: there PyTorch's SDPA
    computes the packed micro-batch's dense N×N block-diagonal mask, which costs more than the padding it
    removes at this bench's sizes (measured: bench/README.md, "Where the real-shaped gap went")."""
    if budget is not None:
        return budget
    import torch

    return 2048 if torch.cuda.is_available() else 0


def budget_overrides(graph_path: Path, overrides: list[str], budget: int) -> list[str]:
    """``max_tokens_per_micro_batch=budget`` on every train and inference node with a model."""
    from rlflow.dataflow.loader import load_graph

    if budget <= 0:
        return []
    graph = load_graph(graph_path, overrides)
    return [
        f"nodes.{n}.max_tokens_per_micro_batch={budget}"
        for n, node in graph.nodes.items()
        if node.kind in ("train", "inference") and node.model is not None
    ]


def split_plan(graph_path: Path, overrides: list[str], engine: str) -> list[str]:
    """A hand-written 2-device plan as overrides (``bench_async.py``'s): training, and the no-grad forwards
    of a trained model (PPO's critic values, which need its training of the iteration before), on device 1;
    generation (with ``engine``), frozen models' forwards and rule rewards on device 0."""
    from rlflow.dataflow.loader import load_graph

    graph = load_graph(graph_path, overrides)
    trained = {node.model for node in graph.nodes.values() if node.kind == "train"}
    out = []
    for name, node in graph.nodes.items():
        device = 1 if node.kind == "train" or (node.model in trained and node.kind != "generate") else 0
        out += [f"plan.{name}.devices={device}", f"plan.{name}.layout=d1t1p1m1"]
        if node.kind == "generate":
            out.append(f"plan.{name}.engine={engine}")
    return out


def plan_overrides(graph: Any) -> list[str]:
    """A resolved plan as overrides: every node's devices and layout, a generate node's engine."""
    out = []
    for name, node in graph.nodes.items():
        where = graph.placement(name)
        lay = where.layout
        out += [
            f"plan.{name}.devices={','.join(map(str, where.devices))}",
            f"plan.{name}.layout=d{lay.dp}t{lay.tp}p{lay.pp}m{lay.micro_batches}",
        ]
        if node.kind == "generate":
            engine = where.engine or (node.engine if node.engine != "auto" else "builtin")
            out.append(f"plan.{name}.engine={engine}")
    return out


def host_profile(args: argparse.Namespace, graph: Any) -> Path | None:
    """The profile ``plan=auto`` plans rlflow-best with, as a user is told to (``rlflow profile`` of this host
    for the graph's model, measured once per model and ``--best-threads`` and kept under ``--out``), or
    ``--best-profile``'s file; ``None`` with ``--best-profile none`` or where the planner cannot price the
    model (the fixed workload's GPT-2: the split plan then)."""
    from rlflow.dataflow.context import model_hf_config

    if args.best_profile == "none":
        return None
    if args.best_profile != "auto":
        return Path(args.best_profile)
    config = model_hf_config(graph, graph.node(tc.GENERATE_NODE).model)
    if config is None or config.get("model_type") == "gpt2":
        return None
    digest = hashlib.sha256(json.dumps(dict(config), sort_keys=True, default=str).encode()).hexdigest()[:12]
    path = args.out / f"profile-{digest}-{args.best_threads}t.parquet"
    if not path.exists():
        model = args.out / f"profile-{digest}.json"
        model.write_text(json.dumps(dict(config), default=str))
        print(f"[bench] rlflow profile of this host for the model ({path.name}; 2-3 min) ...", flush=True)
        cmd = [sys.executable, "-m", "rlflow.schedulers.cli", "profile", "--cluster", "cpu-local", "--model",
               str(model), "--threads", str(args.best_threads), "--out", str(path)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return path


def best_overrides(args: argparse.Namespace, graph_path: Path, base: list[str]) -> tuple[list[str], str]:
    """rlflow-best's overrides (the same in every round) and how its plan was chosen: ``plan=auto`` resolved
    once here and written out as a plan, unless the planner puts every node on one device or fails (then,
    as with ``--best-plan split``, :func:`split_plan`)."""
    from rlflow.dataflow.errors import RlflowError
    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan

    best = [o for o in BEST if o != "plan=auto"]
    budget = budget_overrides(graph_path, base, default_token_budget(args.token_budget))
    how = "split plan (--best-plan split)"
    if args.best_plan == "auto":
        try:
            graph = load_graph(graph_path, [*base, *BEST, *budget, *args.best_set])
            profile = host_profile(args, graph)
            graph = resolve_plan(graph, None, profile=profile)
            if len({d for n in graph.nodes for d in graph.placement(n).devices}) > 1:
                how = f"plan=auto, {'profile ' + str(profile) if profile else 'no profile'}"
                return [*best, *plan_overrides(graph), *budget, *args.best_set], how
            how = "split plan: plan=auto put every node on one device"
        except RlflowError as e:
            how = f"split plan: plan=auto failed ({e})"
    return [*best, *split_plan(graph_path, [*base, *best], args.best_engine), *budget, *args.best_set], how
