"""Packed vs padded forward + backward on CPU: which attention backend runs packed sequences faster here.

    python bench/bench_packed.py [--rows 16] [--reps 5] [--threads 1] [--budget 320] [--forward-only]

A tiny Llama (random init, built from a config) runs one batch of rows with mixed lengths (left-padded
prompts of 8..48 tokens, responses ending at varied points, 4..96 tokens) three ways, forward and backward
(``--forward-only``: forward under ``torch.no_grad``, as an inference node):

- ``padded``: ``[B, L]`` with the attention mask (SDPA), what a micro-batch without a token budget runs;
- ``packed sdpa``: the real tokens end to end in ``[1, N]``, ``attention_mask=None`` and ``position_ids``
  restarting per sequence: transformers' ``masking_utils.find_packed_sequence_indices`` turns the positions
  into a block-diagonal causal mask for SDPA (what ``rlflow.nodes.forward.packed_forwards`` runs);
- ``packed flex``: the same with ``attn_implementation="flex_attention"`` (a ``BlockMask`` from the same
  segments; torch 2.13 has no FlexAttention backward on CPU, so it runs only with ``--forward-only``).

Measured 2026-12-05 on this 2-core machine, 1 thread, load average 13-17 (shared), 16 rows, 44% padding:
one micro-batch of the whole batch (no budget), forward + backward: packed SDPA 0.56x the padded speed (its
dense block-diagonal mask makes attention quadratic in all N = 1297 tokens); ``--budget 320`` (5
micro-batches): packed SDPA 1.37x, and forward only 1.25x, flex 0.47x. So rlflow packs token-budget
micro-batches (N <= budget) with SDPA; on an H100 without ``flash_attn`` a whole 32-row batch (17k tokens)
packed was 3-4x slower than padded for the same reason, which FlashAttention-2's varlen kernel avoids.

With ``--budget T`` the rows are first cut into token-budget micro-batches
(:func:`rlflow.nodes.rl.packing.budget_partition`) and every way runs them one after another: ``padded``
then runs each micro-batch cut to its own columns (``trim_padding``), as a node would without packing.

Prints seconds per forward + backward (median of ``--reps`` after one untimed warm-up), each ratio to the
padded forward measured in the same process, the largest difference of the outputs at real tokens, the
share of padding in the padded batch, and the 1-minute load average before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.nodes.forward import sequence_inputs
from rlflow.nodes.rl.packing import budget_partition, pack, packed_layout, unpack


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


def _place(x_bl: torch.Tensor, m_mask: torch.Tensor, full_mask: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, l, V]`` on a micro-batch's cut columns, placed at its rows' real tokens (full width)."""
    out = torch.zeros(*full_mask.shape, x_bl.shape[-1])
    out[full_mask.bool()] = x_bl[m_mask.bool()]
    return out


def _time(fn: Callable[[], torch.Tensor], reps: int) -> tuple[float, torch.Tensor]:
    out = fn()  # warm-up (flex_attention builds its block mask machinery once)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _compare(
    padded: Callable[[], torch.Tensor], packed: Callable[[], torch.Tensor], model: torch.nn.Module, reps: int
) -> dict[str, tuple[float, torch.Tensor]]:
    results = {"padded": _time(padded, reps), "packed sdpa": _time(packed, reps)}
    try:
        model.set_attn_implementation("flex_attention")  # type: ignore[operator]
        results["packed flex"] = _time(packed, reps)
    except Exception as e:  # report why the backend does not run here; the others still count
        print(f"packed flex: does not run here ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    finally:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget", type=int, default=None, help="tokens per micro-batch (default: one)")
    parser.add_argument("--forward-only", action="store_true", help="no backward (an inference node)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    config = LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids, mask, _ = sequence_inputs(*_batch(args.rows, 0))
    lengths = [int(n) for n in mask.sum(dim=1)]
    groups = budget_partition(lengths, args.budget) if args.budget else [list(range(args.rows))]
    micro = []
    for rows in groups:
        m_ids, m_mask = ids[rows], mask[rows]
        used = m_mask.any(dim=0).nonzero().flatten()  # the columns its rows use (left and right padding cut)
        m_ids, m_mask = m_ids[:, used[0] : used[-1] + 1], m_mask[:, used[0] : used[-1] + 1]
        layout = packed_layout(m_mask)
        micro.append((rows, m_ids, m_mask, (m_mask.cumsum(1) - 1).clamp(min=0), layout))

    def padded() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out = torch.zeros(*mask.shape, config.vocab_size)
        for rows, m_ids, m_mask, m_pos, _ in micro:
            logits = model(input_ids=m_ids, attention_mask=m_mask, position_ids=m_pos, use_cache=False).logits
            if not args.forward_only:
                (logits.float() * m_mask[..., None]).sum().backward()
            out[rows] = _place(logits.detach(), m_mask, mask[rows])
        return out

    def packed() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out = torch.zeros(*mask.shape, config.vocab_size)
        for rows, m_ids, m_mask, _, layout in micro:
            ids_n, pos_n = pack(m_ids, layout)[None], layout.position_ids[None]
            logits = model(input_ids=ids_n, attention_mask=None, position_ids=pos_n, use_cache=False).logits
            if not args.forward_only:
                logits.float().sum().backward()
            out[rows] = _place(unpack(logits.detach()[0], layout), m_mask, mask[rows])
        return out

    scope = torch.no_grad() if args.forward_only else contextlib.nullcontext()
    with scope:
        results = _compare(padded, packed, model, args.reps)
    base, ref = results["padded"]
    real = int(mask.sum())
    print(
        f"rows {args.rows}, width L {mask.shape[1]}, real tokens {real}, "
        f"padding {1 - real / mask.numel():.0%}; "
        f"budget {args.budget}: {len(micro)} micro-batches, padded widths "
        f"{[tuple(m[2].shape) for m in micro]}"
    )
    print(
        f"threads {args.threads}; torch {torch.__version__}; "
        f"{'forward' if args.forward_only else 'forward + backward'}"
    )
    for name, (sec, out) in results.items():
        diff = float((out - ref).abs().max())
        print(f"{name:12s} {sec * 1e3:8.1f} ms  ratio to padded {base / sec:5.2f}x  max |diff| {diff:.2e}")
    print(f"load average (1 min): before {load_before:.2f}, after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
