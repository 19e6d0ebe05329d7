"""What the runtime itself costs on this host, read from the trace of a real run (``Controller`` +
``DistExecutor``, two worker processes) of a tiny GRPO-shaped probe graph: the latency from a node's
dependency ending to the node starting (``runtime_gap``), the controller's own time per iteration
(``runtime_iteration``), the start skew of a replicated node (``runtime_skew``) and whole nodes as a
worker runs them (``runtime_generate``, ``runtime_inference``, ``runtime_train``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from rlflow.schedulers.profiling.measure import DEFAULT_CONFIG, one_layer, profile_row

__all__ = ["profile_runtime"]


def _probe_graph(config: dict[str, Any], out: Path, iterations: int, tokenizer: Path) -> dict[str, Any]:
    """A GRPO-shaped graph of the one-layer model of ``config`` on two devices: 8 prompts × 2 samples,
    8 new tokens; generation, a reward model and training on device 0, reference log-probs replicated
    on devices 0 and 1 (dp = 2, submitted first while both are free).
    A real run of it measures the runtime (its latencies, its nodes as a worker runs them)."""
    model = {
        "model_type": "llama", **one_layer(config), "max_position_embeddings": 128,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    seq = ["prompt_ids", "prompt_mask", "response_ids", "response_mask"]
    one = {"layout": "d1t1p1m1"}
    return {
        "models": {
            # float32 on every device, as the profile's other probes (its fits price 4-byte weights)
            "actor": {
                "config": model,
                "tokenizer": str(tokenizer),
                "optimizer": {"lr": 1.0e-4},
                "dtype": "float32",
            },
            "ref": {"init_from": "actor", "trainable": False, "dtype": "float32"},
            "rm": {"init_from": "actor", "trainable": False, "head": "score", "dtype": "float32"},
        },
        "data": {
            "generator": {
                "name": "arith",
                "args": {"digits": 2, "train_size": 256, "eval_size": 8, "seed": 0},
            },
            "fields": {"prompt": "prompt"},
            "tokenize": ["prompt"],
            "tokenizer": "actor",
        },
        "nodes": {
            "actor_gen": {
                "model": "actor", "kind": "generate", "function": "generate", "inputs": seq[:2],
                "outputs": ["response_ids", "response_mask", "logprobs"], "batch_size": 8,
                "args": {"n": 2, "max_new_tokens": 8},
            },
            "ref": {
                "model": "ref", "kind": "inference", "function": "logprobs", "inputs": seq,
                "outputs": {"logprobs": "ref_logprobs"}, "batch_size": 8,
            },
            "rm": {"model": "rm", "kind": "inference", "function": "rm_score", "inputs": seq,
                   "outputs": ["scores"], "batch_size": 8},
            "actor_train": {
                "model": "actor", "kind": "train", "function": "grpo_actor",
                "inputs": [*seq, "logprobs", "ref_logprobs", "scores"], "batch_size": 8, "mini_batches": 2,
            },
        },
        "plan": {
            "actor_gen": {"devices": 0, **one}, "ref": {"devices": "0-1", "layout": "d2t1p1m1"},
            "rm": {"devices": 0, **one},
            "actor_train": {"devices": 0, **one},
        },
        "run": {"iterations": iterations, "seed": 0, "output_dir": str(out), "checkpoint_interval": 0,
                "eval_interval": 0, "devices": 2},
    }  # fmt: skip


def profile_runtime(
    config: dict[str, Any] | None = None, iterations: int = 8, warmup: int = 2
) -> list[dict[str, Any]]:
    """The runtime measured by a real run (``Controller`` + ``DistExecutor``, two worker processes) of a
    probe graph of the one-layer model of ``config`` (:func:`_probe_graph`), read from its trace:

      * ``runtime_gap``: per single-device node whose worker last ran one of its dependencies, seconds
        from that dependency's end to the node's start (the reply, the controller's bookkeeping and
        submission, the transfer and run commands): the dispatch the simulator puts before each node;
      * ``runtime_iteration``: per iteration, ``timing_s/iteration`` minus the span from its first node's
        start to its last node's end (the next batch, the source rows, the trace and metrics);
      * ``runtime_skew``: per run of the replicated node, how much later each further rank started than
        the first;
      * ``runtime_generate`` / ``runtime_inference`` / ``runtime_train``: the span of each node on one
        device (``batch`` rows, ``seq`` prompt and ``count`` generated tokens, ``steps`` optimizer
        steps, ``first_pass``, ``model`` the probe model's shape key and ``head``): whole nodes as a
        worker runs them, cooled by the other nodes between them, which ``node_s``, ``decode_s`` and
        ``step_s`` are calibrated on
        (the model-call rows time the same calls hot, in a loop).

    """
    import yaml

    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.tasks.arith_tokenizer import save_tokenizer
    from rlflow.schedulers.planner.graph_problem import problem_from_graph
    from rlflow.schedulers.records.rundir import read_metrics, read_trace
    from rlflow.schedulers.runtime.controller import Controller

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp, "run")
        tokenizer = save_tokenizer(Path(tmp, "tokenizer"))
        graph_file = Path(tmp, "probe.yaml")
        spec = _probe_graph(dict(config or DEFAULT_CONFIG), run_dir, warmup + iterations, tokenizer)
        graph_file.write_text(yaml.safe_dump(spec))
        graph = load_graph(str(graph_file))
        controller = Controller(graph, run_dir=run_dir, progress=False)
        try:
            controller.run()
        finally:
            controller.close()
        trace = [r for r in read_trace(run_dir).to_pylist() if r["iteration"] > warmup]
        metrics = {r["iteration"]: r for r in read_metrics(run_dir).to_pylist()}
        problem = problem_from_graph(graph)  # the prompt length measured on its data
    timed = {n.name: n for n in problem.nodes if len(graph.placement(n.name).devices) == 1}
    rows: list[dict[str, Any]] = []
    for it in sorted({r["iteration"] for r in trace}):
        rows_of: dict[str, list[dict[str, Any]]] = {}
        for r in trace:
            if r["iteration"] == it and r["kind"] == "node":
                rows_of.setdefault(r["node"], []).append(r)
        start = {n: min(r["start_s"] for r in rs) for n, rs in rows_of.items()}
        end = {n: max(r["end_s"] for r in rs) for n, rs in rows_of.items()}
        devices = {n: {r["device"] for r in rs} for n, rs in rows_of.items()}
        for name, rs in rows_of.items():
            if len(rs) > 1:  # a replicated node: how much later each further rank started
                rows.append(
                    profile_row("runtime_skew", (max(r["start_s"] for r in rs) - start[name]) / (len(rs) - 1))
                )
                continue
            if name in timed:
                node = timed[name]
                shape = problem.models[node.model]
                rows.append(
                    profile_row(f"runtime_{node.kind}", end[name] - start[name], batch=node.rows,
                         seq=node.prompt_len, count=node.gen_len, steps=node.epochs * node.mini_batches,
                         first_pass=node.first_pass, model=shape.key(), head=shape.head)
                )  # fmt: skip
            # the latency from a dependency's end to this node's start, when the worker went from the one
            # straight to the other (not queued behind another node)
            before = [n for n in rows_of if devices[n] & devices[name] and end[n] <= start[name]]
            last = max(before, key=lambda n: end[n], default=None)
            if last in graph.dependencies(name) and len(rows_of[last]) == 1:
                rows.append(profile_row("runtime_gap", start[name] - end[last]))
        busy = max(end.values()) - min(start.values())
        rows.append(
            profile_row("runtime_iteration", max(0.0, float(metrics[it]["timing_s/iteration"]) - busy))
        )
    return rows
