"""AdamW step time on CPU: the optimizer rlflow builds (torch's fused kernel) vs the default per-parameter
loop and the ``foreach`` variant, on the parameters of a GPT-2-small-size model (124 M).

    python bench/bench_optimizer.py [--steps 3] [--threads 2]

Prints seconds per step for each variant (median of ``--steps`` after one untimed step), the ratios against
the default loop, the largest parameter difference after the timed steps (the same update up to rounding),
and the 1-minute load average before and after. The model is built from a config (random init); gradients
are fixed random tensors, so only the optimizer's own work is timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.nodes.train import build_optimizer


def _time_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    optimizer.step()  # untimed: allocates the state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    config = GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)
    torch.manual_seed(0)
    reference = GPT2LMHeadModel(config)
    grads = {n: torch.randn_like(p) for n, p in reference.named_parameters()}
    n_params = sum(p.numel() for p in reference.parameters())
    spec = OptimizerSpec(lr=1e-4)

    results: dict[str, tuple[float, torch.nn.Module]] = {}
    for name in ("default", "foreach", "rlflow (fused)"):
        model = GPT2LMHeadModel(config)
        model.load_state_dict(reference.state_dict())
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        if name == "rlflow (fused)":
            optimizer, _ = build_optimizer(model, spec, total_steps=100)
        else:
            optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=spec.lr,
                betas=spec.betas,
                eps=spec.eps,
                weight_decay=spec.weight_decay,
                foreach=name == "foreach",
            )
        results[name] = (_time_steps(model, optimizer, args.steps), model)

    base_s, base_model = results["default"]
    print(f"AdamW step, {n_params / 1e6:.0f} M parameters, {args.threads} threads")
    for name, (seconds, model) in results.items():
        diff = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), base_model.parameters(), strict=True)
        )
        print(
            f"  {name:15s} {seconds:7.3f} s/step  {base_s / seconds:5.1f}x default  max |Δparam| {diff:.2e}"
        )
    print(f"load average (1 min): {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
