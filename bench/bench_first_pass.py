"""The train node's π_old first pass, skipped where its result is known (issue 33): ``grpo_actor`` with and
without it, in one process.

The setting of ``bench/bench_grpo_vs_trl.py``'s train node: a random GPT-2-small-size model (124 M, fp32),
``--prompts`` × ``--samples`` rows of 16 prompt and ``--new-tokens`` response tokens (random ids, every row
full length, as the bench's random model never emits EOS), group-normalised advantages of random scores, the
clipped surrogate with a k3 KL loss term (0.04), AdamW at lr 1e-6, grad clip 1, one mini-batch of one
micro-batch (``--mini-batches`` more). Each repetition calls the node function twice from the same weights,
in alternating order: **skip**, rlflow's rule (no first pass where the train forward gives π_old: none with
one mini-batch, the rows after the first with several), and **forced**, the first pass over every row (the
behaviour before issue 33: the trait patched to 1). Prints the wall and CPU seconds (this process) per call
of each (medians) and their forced/skip ratio per repetition, ``perf/first_pass_share``, the largest
parameter difference after the calls, and the 1-minute load average before and after.

Run: ``python bench/bench_first_pass.py`` (``--threads 1 --reps 3`` by default; short).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from typing import Any

import torch

import rlflow.nodes.functions.policy as F
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.context import ModelState, NodeContext
from rlflow.nodes.models import build_model
from rlflow.nodes.train import build_optimizer

GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
        "n_head": 12, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 50256,
        "eos_token_id": 50256, "pad_token_id": 50256}  # fmt: skip
PROMPT_TOKENS = 16


def _batch(rows: int, new_tokens: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50000, (rows, PROMPT_TOKENS + new_tokens), generator=g)
    mask = torch.ones(rows, new_tokens, dtype=torch.long)
    prompt_mask = torch.ones(rows, PROMPT_TOKENS, dtype=torch.long)
    b = Batch({"prompt_ids": ids[:, :PROMPT_TOKENS], "prompt_mask": prompt_mask,
               "response_ids": ids[:, PROMPT_TOKENS:], "response_mask": mask})  # fmt: skip
    b["logprobs"] = torch.full((rows, new_tokens), -10.8)  # about log(1/50257): a random model's
    b["ref_logprobs"] = torch.full((rows, new_tokens), -10.8)
    b["scores"] = torch.rand(rows, generator=g)
    return b


def _call(
    state: ModelState, batch: Batch, group: int, mini_batches: int, forced: bool
) -> tuple[float, float, dict]:
    spec = NodeSpec("actor_train", "train", "grpo_actor", model="actor", mini_batches=mini_batches)
    ctx = NodeContext(node=spec, model=state, group_size=group, micro_batches=1)
    real = F.first_pass_share
    if forced:
        F.first_pass_share = lambda args, m: 1.0  # type: ignore[assignment]
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        result = NODE_FUNCTIONS.get("grpo_actor").fn(ctx, batch, clip_eps=0.2, kl_loss_coef=0.04)
        return time.perf_counter() - t0, time.process_time() - c0, result.metrics
    finally:
        F.first_pass_share = real  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_builtin_functions()
    load0 = os.getloadavg()[0]
    model = build_model(config=GPT2, head="lm", seed=0).float()
    batch = _batch(args.prompts * args.samples, args.new_tokens, 0)
    states: dict[bool, ModelState] = {}
    for forced in (False, True):
        module = copy.deepcopy(model)
        st = ModelState(name="actor", module=module, head="lm", tokenizer=None)
        st.optimizer_spec = OptimizerSpec(lr=1e-6, grad_clip=1.0)
        st.optimizer, st.scheduler = build_optimizer(module, st.optimizer_spec, 100)
        states[forced] = st
    del model  # two copies and their AdamW state are enough (the machine's memory is shared)
    wall: dict[bool, list[float]] = {False: [], True: []}
    cpu: dict[bool, list[float]] = {False: [], True: []}
    metrics: dict[bool, dict[str, Any]] = {}
    for rep in range(args.reps + 1):  # the first repetition warms up (AdamW state, allocator)
        for forced in (rep % 2 == 1, rep % 2 == 0):
            w, c, metrics[forced] = _call(states[forced], batch, args.samples, args.mini_batches, forced)
            if rep:
                wall[forced].append(w)
                cpu[forced].append(c)
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(states[False].module.parameters(), states[True].module.parameters(), strict=True)
    )
    print(f"grpo_actor, {args.prompts}x{args.samples} rows of {PROMPT_TOKENS}+{args.new_tokens} tokens, "
          f"GPT-2 124M fp32, mini_batches {args.mini_batches}, {args.threads} thread(s), "
          f"{args.reps} reps")  # fmt: skip
    for what, t in (("wall s", wall), ("CPU s", cpu)):
        pairs = [f / s for s, f in zip(t[False], t[True], strict=True)]
        print(f"  {what:6}: skip median {statistics.median(t[False]):7.3f}, forced median "
              f"{statistics.median(t[True]):7.3f}; forced/skip per rep "
              f"{', '.join(f'{r:.3f}' for r in pairs)} (median {statistics.median(pairs):.3f})")  # fmt: skip
    print(f"  first_pass_share skip {metrics[False][F.FIRST_PASS_SHARE]}, forced "
          f"{metrics[True][F.FIRST_PASS_SHARE]}; max |weight difference| after {args.reps + 1} steps "
          f"{diff:.2e}")  # fmt: skip
    print(f"  load average (1 min) before {load0:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
