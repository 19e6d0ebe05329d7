"""rlflow LoRA GRPO vs TRL's ``GRPOTrainer`` with a PEFT config: samples/s and CPU seconds per sample.

    python bench/bench_lora_vs_trl.py [--size medium|example] [--warmup 1] [--iterations 4] [--threads 1]

One workload on both sides: ``examples/lora/grpo.yaml`` (GRPO on 2-digit arithmetic, 8 prompts x 4 samples,
8 new tokens at temperature 1, the ``arith_exact`` rule reward, 2 mini-batches per iteration, k3 KL loss
0.04 to the base, clip 0.2, AdamW lr 2e-3 with 2 warm-up steps, gradient norm clipped at 1, fp32) with
rank-4 adapters (alpha 8, no dropout) on ``q_proj``/``v_proj``; the reference is the base with the adapters
off on both sides (rlflow ``base_of: actor``; TRL does so for a PEFT model). The model is the example's (or,
``--size medium``, default, the wider one of ``bench_lora.py``: 10.5 M weights) built once from its config
and saved as a Hugging Face directory that both sides load (rlflow: ``models.actor.path``).

- ``rlflow``: the graph through the runtime in one process (``trl_compare.run_rlflow_graph``: the
  controller's ``timing_s/iteration``; CPU time between the iteration marks of its ``live_metrics``);
- ``trl``: TRL's ``GRPOTrainer`` (the TRL venv, ``--trl-python``, default ``/work/venv-trl``: TRL 1.16 with
  peft) with ``peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=[q_proj, v_proj])`` and the graph's
  setting (``bench_learning_vs_trl.setting``: ``steps_per_generation`` = the graph's 2 mini-batches,
  ``loss_type="dapo"``: token mean, ``beta`` 0.04, ``scale_rewards`` = group std); an iteration is one
  generation batch, i.e. 2 optimizer steps; times at TRL's ``on_step_end``.

Each side runs in its own subprocess, one after the other, with ``--threads`` torch/OpenMP threads; the
warm-up iterations are not timed. Printed per side: samples/s (prompt-response pairs per second of timed
iteration), seconds per iteration (median), CPU seconds per sample (user + system of the side's process over
the timed iterations), peak RSS; the ratios rlflow/TRL; the 1-minute load average before and after each
side (the machine is shared: ratios are of one run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trl_compare as tc

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
GRAPH = ROOT / "examples" / "lora" / "grpo.yaml"


def _lora(graph: Any) -> dict[str, Any]:
    spec = graph.spec.models["actor"].lora
    return {
        "r": spec.rank,
        "alpha": spec.alpha,
        "dropout": spec.dropout,
        "targets": list(spec.target_modules),
    }


def prepare(work: Path, size: str, iterations: int) -> tuple[list[str], dict[str, Any]]:
    """Save the base model and the training prompts under ``work``; the rlflow overrides and TRL setting."""
    import torch
    from bench_learning_vs_trl import setting
    from bench_lora import SIZES

    from rlflow.dataflow.data import load_splits
    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.models import save_pretrained
    from rlflow.schedulers.runtime.instances import build_models

    base = work / "base"
    graph = load_graph(GRAPH, [*SIZES[size], "models.actor.lora=null", "models.ref.base_of=null",
                               "models.ref.init_from=actor", "models.ref.trainable=false"])  # fmt: skip
    modules, tokenizers = build_models(graph, torch.device("cpu"), None, ["actor"], move=False)
    save_pretrained(modules["actor"], tokenizers["actor"], base)
    overrides = [*SIZES[size], "models.actor.config=null", f"models.actor.path={base}"]
    overrides += [
        f"run.iterations={iterations}",
        "run.eval_interval=0",
        f"run.checkpoint_interval={iterations}",
    ]
    graph = load_graph(GRAPH, [*overrides, f"run.output_dir={work / 'scratch'}"])
    s = setting(graph, "grpo", str(base), iterations, iterations)
    s["lora"] = _lora(graph)
    s["weights"] = sum(p.numel() for p in modules["actor"].parameters())
    train, _ = load_splits(graph.spec.data)
    (work / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "answer": str(a)}) + "\n"
                for p, a in zip(train.columns["prompt"], train.columns["answer"], strict=True))
    )  # fmt: skip
    return overrides, s


def run_rlflow(job: dict[str, Any]) -> dict[str, Any]:
    warmup, iterations = job["warmup"], job["iterations"]
    run_dir = Path(job["work"]) / "rlflow-run"
    overrides = [*job["overrides"], f"run.output_dir={run_dir}"]
    r = tc.run_rlflow_graph(GRAPH, overrides, run_dir, warmup, iterations)
    return {
        "iteration_s": [row["timing_s/iteration"] for row in r.rows],
        "cpu_s": r.cpu_s,
        "peak_rss_gib": r.peak_rss_gib,
        "nodes_s": r.phase_s,
    }


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlflow.nodes.rewards import resolve_reward

    s, work = job["setting"], Path(job["work"])
    warmup, iterations = job["warmup"], job["iterations"]
    steps = s["mini_batches"] * s["epochs"]  # optimizer steps per iteration (one generation batch)
    reward_fn = resolve_reward(s["reward"])
    tok = AutoTokenizer.from_pretrained(s["sft_actor"])
    rows = [json.loads(x) for x in (work / "train.jsonl").read_text().splitlines() if x.strip()]

    def reward(completions: list[str], answer: list[str], **kw: Any) -> list[float]:
        return [reward_fn(c, a) for c, a in zip(completions, answer, strict=True)]

    samples = s["prompts"] * s["group"]
    lora = s["lora"]
    config = GRPOConfig(
        output_dir=str(work / "trl_out"), seed=1, per_device_train_batch_size=samples // s["mini_batches"],
        gradient_accumulation_steps=1, steps_per_generation=s["mini_batches"], num_iterations=s["epochs"],
        num_generations=s["group"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        top_p=1.0, top_k=0, beta=s["kl_coef"], epsilon=s["clip_eps"], loss_type=s["loss_type"],
        scale_rewards=s["std"], max_grad_norm=s["grad_clip"] or None, warmup_steps=s["warmup_steps"],
        max_steps=steps * (warmup + iterations), model_init_kwargs={"dtype": torch.float32},
        learning_rate=s["lr"], adam_beta1=s["betas"][0], adam_beta2=s["betas"][1], adam_epsilon=s["adam_eps"],
        weight_decay=s["weight_decay"], lr_scheduler_type="constant_with_warmup", use_cpu=True, bf16=False,
        fp16=False, gradient_checkpointing=False, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True,
    )  # fmt: skip
    peft_config = LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["targets"],
        task_type="CAUSAL_LM",
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=s["sft_actor"], reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
        processing_class=tok, peft_config=peft_config,
    )  # fmt: skip
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    clock = tc.trl_step_clock(lambda: None)
    trainer.add_callback(clock)
    trainer.train()
    ends, cpu = clock.clock.ends, clock.clock.cpu  # [train begin, end of step 1, ...]
    marks = [i * steps for i in range(warmup + iterations + 1)]
    return {
        "iteration_s": [ends[marks[i + 1]] - ends[marks[i]] for i in range(warmup, warmup + iterations)],
        "cpu_s": cpu[marks[-1]] - cpu[marks[warmup]],
        "peak_rss_gib": clock.clock.peak_rss_gib,
        "trl_version": trl.__version__,
        "trained_weights": trained,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("example", "medium"), default="medium")
    ap.add_argument("--warmup", type=int, default=1, help="iterations run first, not timed")
    ap.add_argument("--iterations", type=int, default=4, help="timed iterations per side")
    ap.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per side")
    ap.add_argument("--trl-python", default="/work/venv-trl/bin/python", help="a Python with trl and peft")
    ap.add_argument("--job", type=Path, help=argparse.SUPPRESS)  # a side's own process
    args = ap.parse_args()
    if args.job is not None:
        job = json.loads(args.job.read_text())
        result = run_rlflow(job) if job["side"] == "rlflow" else run_trl(job)
        print(tc.RESULT_TAG + json.dumps(result), flush=True)
        return
    total = args.warmup + args.iterations
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        overrides, s = prepare(work, args.size, total)
        env = tc.worker_env(args.threads, BENCH, RLFLOW_NUM_THREADS=str(args.threads))
        for side, python in (("rlflow", sys.executable), ("trl", args.trl_python)):
            job = {"side": side, "work": str(work), "warmup": args.warmup, "iterations": args.iterations}
            job.update(overrides=overrides, setting=s)
            path = work / f"{side}.json"
            path.write_text(json.dumps(job))
            results[side] = tc.run_side(side, [python, __file__, "--job", str(path)], env, ROOT)
    samples = s["prompts"] * s["group"]
    print(
        f"LoRA GRPO, {GRAPH.relative_to(ROOT)} ({args.size}: {s['weights'] / 1e6:.2f} M weights, rank "
        f"{s['lora']['r']} on {', '.join(s['lora']['targets'])}; TRL trains "
        f"{results['trl']['trained_weights']:,} weights), {samples} samples/iteration, "
        f"{args.iterations} timed iterations after {args.warmup}, "
        f"{args.threads} thread(s) per side; TRL {results['trl']['trl_version']}"
    )
    print(
        f"{'side':<8}{'samples/s':>11}{'s/it median':>13}{'CPU s/sample':>14}{'peak RSS GiB':>14}"
        "  load before->after"
    )
    row: dict[str, tuple[float, float, float, float]] = {}
    for side, r in results.items():
        sps = samples * len(r["iteration_s"]) / sum(r["iteration_s"])
        cps = r["cpu_s"] / (samples * len(r["iteration_s"]))
        row[side] = (sps, statistics.median(r["iteration_s"]), cps, r["peak_rss_gib"])
        lb, la = r["loadavg_1min"]
        print(
            f"{side:<8}{sps:>11.2f}{row[side][1]:>13.3f}{cps:>14.4f}{r['peak_rss_gib']:>14.3f}"
            f"  {lb:.1f} -> {la:.1f}"
        )
    rl, tr = row["rlflow"], row["trl"]
    print(
        f"rlflow/TRL: samples/s {rl[0] / tr[0]:.2f}x, CPU s/sample TRL/rlflow {tr[2] / rl[2]:.2f}x, "
        f"peak RSS {rl[3] / tr[3]:.2f}x"
    )
    print(
        "rlflow nodes (s, timed iterations): "
        + ", ".join(f"{k} {v:.2f}" for k, v in results["rlflow"]["nodes_s"].items())
    )
    print(f"finished {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    main()
