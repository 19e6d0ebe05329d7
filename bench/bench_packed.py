"""Packed vs padded forward + backward on CPU: which attention backend runs packed sequences faster here.

    python bench/bench_packed.py [--rows 16] [--reps 5] [--threads 1]

A tiny Llama (random init, built from a config) runs one batch of rows with mixed lengths (left-padded
prompts of 8..48 tokens, responses ending at varied points, 4..96 tokens) three ways, forward and backward:

- ``padded``: ``[B, L]`` with the attention mask (SDPA), what a micro-batch without a token budget runs;
- ``packed sdpa``: the real tokens end to end in ``[1, N]``, ``attention_mask=None`` and ``position_ids``
  restarting per sequence: transformers' ``masking_utils.find_packed_sequence_indices`` turns the positions
  into a block-diagonal causal mask for SDPA (``rlflow.nodes.forward.packed_forward``);
- ``packed flex``: the same with ``attn_implementation="flex_attention"`` (a ``BlockMask`` from the same
  segments).

Prints seconds per forward + backward (median of ``--reps`` after one untimed warm-up), each ratio to the
padded forward measured in the same process, the largest difference of the outputs at real tokens, the
share of padding in the padded batch, and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.nodes.forward import sequence_inputs
from rlflow.nodes.rl.packing import pack, packed_layout, unpack


def _batch(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, r = 48, 96
    plen = torch.randint(8, s + 1, (rows,), generator=g)
    rlen = torch.randint(4, r + 1, (rows,), generator=g)
    pos_s = torch.arange(s).expand(rows, s)
    pos_r = torch.arange(r).expand(rows, r)
    prompt_mask = (pos_s >= (s - plen)[:, None]).long()
    response_mask = (pos_r < rlen[:, None]).long()
    prompt_ids = torch.randint(3, 512, (rows, s), generator=g) * prompt_mask
    response_ids = torch.randint(3, 512, (rows, r), generator=g) * response_mask
    return prompt_ids, prompt_mask, response_ids, response_mask


def _time(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (flex_attention builds its block mask machinery once)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids, mask, pos = sequence_inputs(*_batch(args.rows, 0))
    layout = packed_layout(mask)
    ids_n, pos_n = pack(ids, layout)[None], layout.position_ids[None]

    def padded() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        (logits.float() * mask[..., None]).sum().backward()
        return logits.detach() * mask[..., None]

    def packed() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids_n, attention_mask=None, position_ids=pos_n, use_cache=False).logits
        logits.float().sum().backward()
        return unpack(logits.detach()[0], layout)

    results: dict[str, tuple[float, torch.Tensor]] = {"padded": _time(padded, args.reps)}
    results["packed sdpa"] = _time(packed, args.reps)
    try:
        model.set_attn_implementation("flex_attention")
        results["packed flex"] = _time(packed, args.reps)
    except Exception as e:  # report why the backend does not run here; the others still count
        print(f"packed flex: does not run here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    finally:
        model.set_attn_implementation("sdpa")
    base, ref = results["padded"]
    real = int(mask.sum())
    print(f"rows {args.rows}, width L {mask.shape[1]}, real tokens {real}, padding {1 - real / mask.numel():.0%}")
    print(f"threads {args.threads}; torch {torch.__version__}")
    for name, (sec, out) in results.items():
        diff = float((out - ref).abs().max())
        print(f"{name:12s} {sec * 1e3:8.1f} ms  ratio to padded {base / sec:5.2f}x  max |diff| {diff:.2e}")
    print(f"load average (1 min): before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
