"""Route replay's cost: seconds per GRPO iteration with and without it, on a tiny mixture-of-experts model.

    nice -n 19 python bench/bench_router_replay.py [--iterations 6] [--rounds 2] [--threads 1]

The graph (written below, run in this process by the controller) is GRPO on 2-digit arithmetic with a tiny
Qwen3-MoE actor (random init; 2 layers, hidden 64, 8 experts, top-2; 8 prompts × 4 samples, responses up to
8 tokens; one mini-batch): generate, rule reward, reference log-probs, train. *Replay* turns on
``record_routes`` on the generate node (the routes of every prompt and response token, ``[B, S|R, Y, K]``)
and ``route_replay`` on the train node (the recorded routes bound as its inputs, forced in its forwards);
*plain* is the same graph without both. Each round runs plain then replay (or the other order, alternating,
so that a drift of the shared machine's load falls on both), ``--iterations`` iterations each from the same
seed; the first iteration of each run (model build, first calls) is left out.

Prints the median seconds per iteration (``timing_s/iteration`` of the run's records) and of the generate
and train nodes (``timing_s/<node>``) for each side, the ratio replay/plain, the router agreement and
sampler/trainer gap replay reports, and the 1-minute load average before and after (the machine is shared:
ratios are only comparable within one run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch

from rlflow.dataflow.loader import load_graph
from rlflow.schedulers.planner.auto import resolve_plan
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.controller import Controller

ROOT = Path(__file__).resolve().parents[1]
GRAPH = """
models:
  actor:
    config: {model_type: qwen3_moe, vocab_size: 19, hidden_size: 64, intermediate_size: 128,
             moe_intermediate_size: 64, num_experts: 8, num_experts_per_tok: 2, norm_topk_prob: true,
             num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 2, head_dim: 32,
             max_position_embeddings: 64, bos_token_id: 1, eos_token_id: 2, pad_token_id: 0,
             tie_word_embeddings: false}
    tokenizer: examples/arith/tokenizer
    optimizer: {lr: 1.0e-4}
  ref: {init_from: actor, trainable: false}
data:
  generator: {name: arith, args: {digits: 2, train_size: 512, eval_size: 8, seed: 0}}
  fields: {prompt: prompt, answer: answer}
  tokenize: [prompt]
  tokenizer: actor
nodes:
  actor_gen:
    {model: actor, kind: generate, function: generate, inputs: [prompt_ids, prompt_mask],
     outputs: OUTPUTS, batch_size: 8, batch_unit: prompts,
     args: {n: 4, max_new_tokens: 8, record_routes: RECORD}}
  reward:
    {kind: inference, function: rule_reward, inputs: [response_ids, response_mask, answer],
     outputs: [scores], batch_size: 32, batch_unit: samples}
  ref:
    {model: ref, kind: inference, function: logprobs,
     inputs: [prompt_ids, prompt_mask, response_ids, response_mask], outputs: {logprobs: ref_logprobs},
     batch_size: 8}
  actor_train:
    {model: actor, kind: train, function: grpo_actor,
     inputs: [prompt_ids, prompt_mask, response_ids, response_mask, logprobs, ref_logprobs, scores ROUTES],
     batch_size: 8, args: {route_replay: RECORD}}
run: {iterations: 2, seed: 1, checkpoint_interval: 0, eval_interval: 0, devices: 1}
"""
PLAIN_OUT = "[response_ids, response_mask, logprobs]"
REPLAY_OUT = (
    "{response_ids: response_ids, response_mask: response_mask, logprobs: logprobs, routed_experts: routes, "
    "prompt_routed_experts: prompt_routes}"
)


def _graph_text(replay: bool) -> str:
    return (
        GRAPH.replace("OUTPUTS", REPLAY_OUT if replay else PLAIN_OUT)
        .replace("RECORD", "true" if replay else "false")
        .replace(" ROUTES", ", prompt_routes, routes" if replay else "")
    )


def _run(replay: bool, iterations: int, tmp: Path, tag: str) -> dict[str, list[float]]:
    path = tmp / f"{tag}.yaml"
    path.write_text(_graph_text(replay))
    out = tmp / tag
    graph = load_graph(str(path), [f"run.output_dir={out}", f"run.iterations={iterations}"])
    Controller(resolve_plan(graph, None)).run()
    table = read_metrics(out).to_pydict()
    keys = ["timing_s/iteration", "timing_s/actor_gen", "timing_s/actor_train", "rollout/logprob_gap_max"]
    keys += ["rollout/router_agreement"] if replay else []
    return {k: [float(v) for v in table[k][1:] if v is not None] for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=6, help="iterations per run (the first is left out)")
    ap.add_argument("--rounds", type=int, default=2, help="plain+replay pairs, order alternating")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (RLFLOW_NUM_THREADS)")
    args = ap.parse_args()
    os.environ["RLFLOW_NUM_THREADS"] = str(args.threads)  # the runtime's thread rule reads it
    torch.set_num_threads(args.threads)
    os.chdir(ROOT)  # the tokenizer's path is relative to the repository root
    load_before = os.getloadavg()[0]
    sides: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for replay in (False, True) if r % 2 == 0 else (True, False):
                got = _run(replay, args.iterations, Path(tmp), f"r{r}-{'replay' if replay else 'plain'}")
                for k, v in got.items():
                    sides[replay].setdefault(k, []).extend(v)
    load_after = os.getloadavg()[0]

    def med(replay: bool, key: str) -> float:
        return statistics.median(sides[replay][key])

    print(f"route replay, tiny Qwen3-MoE GRPO (8 prompts x 4, 8 new tokens), {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.iterations - 1} timed iterations per side")  # fmt: skip
    print(f"{'median seconds':<24}{'plain':>10}{'replay':>10}{'ratio':>8}")
    for key, label in (("timing_s/iteration", "per iteration"), ("timing_s/actor_gen", "generate node"),
                       ("timing_s/actor_train", "train node")):  # fmt: skip
        plain, rep = med(False, key), med(True, key)
        print(f"{label:<24}{plain:>10.3f}{rep:>10.3f}{rep / plain:>7.2f}x")
    print(f"replay: router agreement {med(True, 'rollout/router_agreement'):.4f}, sampler/trainer gap max "
          f"{max(sides[True]['rollout/logprob_gap_max']):.2e} nats "
          f"(plain: {max(sides[False]['rollout/logprob_gap_max']):.2e})")  # fmt: skip
    print(f"load average (1 min): {load_before:.1f} before, {load_after:.1f} after")


if __name__ == "__main__":
    main()
