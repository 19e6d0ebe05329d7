"""The TRL sides of ``bench_learning_vs_trl.py``: TRL's trainers from the SFT checkpoint, mirroring the
setting the rlflow graph gives (``bench_learning_vs_trl.setting``: a JSON-able dict), saving the policy every
``eval_interval`` iterations under ``<work>/ckpt/<iteration>`` for the bench's evaluator (``on_trainer``,
where given, is called with the built trainer before it trains: ``bench_shapes_vs_trl.py`` adds its clocks).

Runs in a TRL venv's Python (``bench/setup_trl.sh``): TRL 1.12 for PPO (``trl.experimental.ppo``), the
current TRL for GRPO. The only rlflow import is the reward function itself
(``rlflow.nodes.rewards.resolve_reward``; the venvs see the system site-packages), so both sides score
with the very same function. The training prompts and answers come from ``<work>/train.jsonl``, written by
the bench from the graph's data generator.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["run_trl_grpo", "run_trl_ppo"]


def _train_rows(work: Path) -> list[dict[str, str]]:
    return [json.loads(x) for x in (work / "train.jsonl").read_text().splitlines() if x.strip()]


def _saver(policy: Any, tok: Any, out: Path, steps_per_save: int, steps_per_iteration: int) -> Any:
    """A callback saving ``policy`` (and ``tok``) to ``out/<iteration>`` every ``steps_per_save`` steps."""
    from transformers import TrainerCallback

    class Save(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step % steps_per_save == 0:
                path = out / f"{state.global_step // steps_per_iteration:06d}"
                policy.save_pretrained(str(path))
                tok.save_pretrained(str(path))

    return Save()


def _adamw(s: dict) -> dict[str, Any]:
    return {
        "learning_rate": s["lr"], "adam_beta1": s["betas"][0], "adam_beta2": s["betas"][1],
        "adam_epsilon": s["adam_eps"], "weight_decay": s["weight_decay"],
        "lr_scheduler_type": "constant_with_warmup",
        "use_cpu": True, "bf16": False, "fp16": False, "gradient_checkpointing": False, "report_to": "none",
        "save_strategy": "no", "logging_steps": 1, "disable_tqdm": True,
    }  # fmt: skip


def run_trl_ppo(s: dict, work: Path, seed: int, on_trainer: Callable[[Any], None] | None = None) -> dict:
    """TRL 1.12 ``PPOTrainer`` from the SFT checkpoint; the rule reward as a reward "model" whose score at
    every position is the reward of the decoded response (prompts left-padded to one width, so the
    prompt/response split is one known column)."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from rlflow.nodes.rewards import resolve_reward

    transformers.set_seed(seed)
    reward_fn = resolve_reward(s["reward"])
    tok = AutoTokenizer.from_pretrained(s["sft_actor"])
    rows = _train_rows(work)
    answers = {r["prompt"]: r["answer"] for r in rows}
    ids = [tok(r["prompt"])["input_ids"] for r in rows]
    width = max(map(len, ids))
    dataset = Dataset.from_list([{"input_ids": [tok.pad_token_id] * (width - len(x)) + x} for x in ids])

    class Rule(nn.Module):  # what trl's get_reward reads: getattr(model, base_model_prefix), .score
        base_model_prefix = "backbone"

        def __init__(self) -> None:
            super().__init__()
            self.score = nn.Identity()

        def backbone(self, input_ids: torch.Tensor, **kw: Any) -> Any:
            prompts = tok.batch_decode(input_ids[:, :width], skip_special_tokens=True)
            texts = tok.batch_decode(input_ids[:, width:], skip_special_tokens=True)
            r = torch.tensor([reward_fn(t, answers[p]) for p, t in zip(prompts, texts, strict=True)])
            return transformers.utils.ModelOutput(
                hidden_states=(r[:, None, None].expand(*input_ids.shape, 1),)
            )

    def lm() -> Any:
        return AutoModelForCausalLM.from_pretrained(s["sft_actor"], dtype=torch.float32)

    policy, ref = lm(), lm()
    value = AutoModelForSequenceClassification.from_pretrained(
        s["sft_actor"], num_labels=1, dtype=torch.float32
    )
    samples = s["prompts"] * s["group"]
    config = PPOConfig(
        output_dir=str(work / "trl_out"), seed=seed, num_ppo_epochs=s["epochs"],
        num_mini_batches=s["mini_batches"], per_device_train_batch_size=samples,
        gradient_accumulation_steps=1, local_rollout_forward_batch_size=samples,
        total_episodes=samples * s["iterations"], response_length=s["max_new_tokens"],
        temperature=s["temperature"], stop_token="eos", missing_eos_penalty=None,
        kl_coef=s["kl_coef"], kl_estimator=s["kl_estimator"], gamma=s["gamma"], lam=s["lam"],
        cliprange=s["clip_eps"], cliprange_value=s["value_clip"] or 1e9,
        whiten_rewards=False, num_sample_generations=0,
        warmup_steps=-(-s["warmup_steps"] // (s["mini_batches"] * s["epochs"])), **_adamw(s),
    )  # fmt: skip
    trainer = PPOTrainer(
        args=config, processing_class=tok, model=policy, ref_model=ref, reward_model=Rule(),
        value_model=value, train_dataset=dataset, eval_dataset=dataset.select(range(8)),
    )  # fmt: skip
    if on_trainer is not None:
        on_trainer(trainer)
    trainer.add_callback(_saver(policy, tok, work / "ckpt", s["eval_interval"], 1))
    start = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    return {
        "trl_version": trl.__version__, "wall_s": time.perf_counter() - start,
        "train_reward": [h["objective/scores"] for h in logs], "kl": [h["objective/kl"] for h in logs],
        "log": trainer.state.log_history,
    }  # fmt: skip


def run_trl_grpo(s: dict, work: Path, seed: int, on_trainer: Callable[[Any], None] | None = None) -> dict:
    """The current TRL's ``GRPOTrainer`` from the SFT checkpoint: ``steps_per_generation`` = the graph's
    mini-batches, ``num_iterations`` = its epochs, ``loss_type`` from its aggregation."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rlflow.nodes.rewards import resolve_reward

    reward_fn = resolve_reward(s["reward"])
    tok = AutoTokenizer.from_pretrained(s["sft_actor"])
    dataset = Dataset.from_list(_train_rows(work))

    def reward(completions: list[str], answer: list[str], **kw: Any) -> list[float]:
        return [reward_fn(c, a) for c, a in zip(completions, answer, strict=True)]

    samples = s["prompts"] * s["group"]
    steps = s["mini_batches"] * s["epochs"]
    config = GRPOConfig(
        output_dir=str(work / "trl_out"), seed=seed, per_device_train_batch_size=samples // s["mini_batches"],
        gradient_accumulation_steps=1, steps_per_generation=s["mini_batches"], num_iterations=s["epochs"],
        num_generations=s["group"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        top_p=1.0, top_k=0, beta=s["kl_coef"], epsilon=s["clip_eps"], loss_type=s["loss_type"],
        scale_rewards=s["std"], max_grad_norm=s["grad_clip"] or None, warmup_steps=s["warmup_steps"],
        max_steps=steps * s["iterations"], model_init_kwargs={"dtype": torch.float32}, **_adamw(s),
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=s["sft_actor"], reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tok
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    if on_trainer is not None:
        on_trainer(trainer)
    trainer.add_callback(_saver(policy, tok, work / "ckpt", steps * s["eval_interval"], steps))
    start = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "trl_version": trl.__version__, "wall_s": time.perf_counter() - start,
        "train_reward": [h["reward"] for h in logs], "kl": [h.get("kl") for h in logs],
        "log": trainer.state.log_history,
    }  # fmt: skip
