"""Generation tokens/s: the vLLM engine (``engine: vllm``) vs rlflow's built-in decode loop, one run.

Model: a Llama-architecture model of GPT-2-small size (hidden 768, 12 layers, 12 heads of 64, SwiGLU
intermediate 2048, vocabulary 50257, untied head: ≈162 M parameters with the untied head, ≈124 M without
it), random weights, fp32 on the CPU. Both sides sample the same prompts with the same settings (``--prompts``
prompts × ``--n`` samples, up to ``--new-tokens`` tokens, temperature 1; EOS ends a response on both
sides, so each side's rate counts the tokens it actually generated). Each side runs ``--warmup`` untimed
calls, then ``--reps`` timed calls, the two sides alternating; the engine's start (≈10-40 s) is
reported separately and not in its rate.

Prints one line per side (tokens, seconds, tokens/s), the ratio vLLM / built-in, and the 1-minute load
average before and after (the machine is shared: compare ratios, not rates).

Then the weight sync (``--sync-reps`` > 0): ``--sync-reps`` iterations of a GRPO-shaped loop on the same
model and engine, each the engine's generation of the rows above, one AdamW step on them (forward,
backward, optimizer: every weight changes) and the new weights synced twice, once verified each way, in
alternating order (``probe``: the load then the probe, a teacher-forced forward on the trainer and on the
engine, as every sync did before issue 33; ``digest``: the load checked by digests inside the engine and
the empty prefix cache, :mod:`rlflow.nodes.engines.sync_check`). One untimed sync of each kind first (the
first digest-checked reload is also probed). Prints per kind the load and verify seconds per iteration
and their share of an iteration: generation + step + that kind's sync.

Run: ``python bench/bench_generation_vllm.py`` (a few minutes on 2 shared cores);
``--model gpt2`` for the GPT-2 of ``bench/trl_compare.py`` (tied head, the PPO/GRPO benches' model).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from rlflow.dataflow.model_spec import ModelSpec
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.generation import generate
from rlflow.nodes.models import build_model_from_spec
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer

CONFIG = {
    "model_type": "llama",
    "vocab_size": 50257,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
TOKENIZER = "examples/arith/tokenizer"  # pad 0 / EOS 2 are all generation needs; prompts are token ids


def _prompts(count: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, CONFIG["vocab_size"], (count, width), generator=g)
    return ids, torch.ones_like(ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sync-reps", type=int, default=4, help="iterations per sync kind (0: none)")
    ap.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    config = dict(CONFIG)
    if args.model == "gpt2":
        from trl_compare import GPT2_CONFIG

        config = {
            **GPT2_CONFIG,
            "model_type": "gpt2",
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 0,
        }
    model = build_model_from_spec(ModelSpec(name="actor", config=config), seed=0, name="actor").eval()
    params = sum(p.numel() for p in model.parameters())
    tok = load_tokenizer(TOKENIZER)
    info = TokenizerInfo.from_tokenizer(tok)
    ids, mask = _prompts(args.prompts, args.prompt_tokens)
    sampling = {"n": args.n, "temperature": 1.0, "top_k": None, "top_p": None}
    sampling["max_new_tokens"] = args.new_tokens

    def builtin() -> int:
        gen = torch.Generator().manual_seed(1)
        out = generate(model, info, ids, mask, greedy=False, generator=gen, **sampling)  # type: ignore[arg-type]
        return int(out[1].sum())

    t0 = time.perf_counter()
    engine = VllmEngine(model, tok, where="bench", max_rows=args.prompts * args.n)
    start_s = time.perf_counter() - t0

    def vllm() -> int:
        out = engine.generate(
            ids, mask, greedy=False, stop_token_ids=[info.eos_id], pad_id=info.pad_id,
            generator=torch.Generator().manual_seed(1), **sampling,  # type: ignore[arg-type]
        )  # fmt: skip
        return int(out[1].sum())

    sides = {"builtin": builtin, "vllm": vllm}
    tokens = dict.fromkeys(sides, 0)
    secs = dict.fromkeys(sides, 0.0)
    try:
        for fn in sides.values():
            for _ in range(args.warmup):
                fn()
        for _ in range(args.reps):  # interleaved, so both sides see the same background load
            for name, fn in sides.items():
                t = time.perf_counter()
                tokens[name] += fn()
                secs[name] += time.perf_counter() - t
        syncs = _sync_loop(engine, model, ids, mask, info, sampling, args.sync_reps) if args.sync_reps else {}
    finally:
        engine.close()
    rates = {name: tokens[name] / secs[name] for name in sides}
    for name in sides:
        print(f"{name:8s} {tokens[name]:7d} tokens {secs[name]:8.2f} s {rates[name]:9.1f} tokens/s")
    print(
        f"model {params / 1e6:.0f} M params fp32, {args.prompts}x{args.n} rows, {args.prompt_tokens}+"
        f"{args.new_tokens} tokens, {args.threads} threads; vLLM start {start_s:.1f} s"
    )
    print(f"ratio vllm/builtin = {rates['vllm'] / rates['builtin']:.2f}")
    if syncs:  # the iteration apart from its sync (the same for both kinds)
        rest = syncs["probe"]["generate"] + syncs["probe"]["step"]
        print(f"iteration without its sync: {rest:.2f} s (generation + AdamW step)")
    for kind, t in syncs.items():
        it = rest + t["load"] + t["verify"]
        print(
            f"sync {kind:6s} per iteration: load {t['load']:.3f} s, verify {t['verify']:.3f} s; of an "
            f"iteration of {it:.2f} s: load {t['load'] / it:.1%}, verify {t['verify'] / it:.1%}, sync "
            f"{(t['load'] + t['verify']) / it:.1%}"
        )
    print(f"load average (1 min): {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


def _sync_loop(
    engine: VllmEngine,
    model: torch.nn.Module,
    ids: torch.Tensor,
    mask: torch.Tensor,
    info: TokenizerInfo,
    sampling: dict,
    reps: int,
) -> dict[str, dict[str, float]]:
    """``reps`` iterations per sync kind, alternating (module docstring); per kind the mean seconds of
    generation, step, load, verify and the whole iteration."""
    from rlflow.nodes.engines.weight_transport import weight_buckets

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    version = 0

    def step() -> tuple[float, float]:
        t = time.perf_counter()
        resp, rmask, _ = engine.generate(
            ids, mask, greedy=False, stop_token_ids=[info.eos_id], pad_id=info.pad_id,
            generator=torch.Generator().manual_seed(version), **sampling,
        )  # fmt: skip
        gen_s = time.perf_counter() - t
        t = time.perf_counter()
        n = sampling["n"]
        full = torch.cat([ids.repeat_interleave(n, 0), resp], 1)
        full_mask = torch.cat([mask.repeat_interleave(n, 0), rmask], 1)
        model.train()
        loss = model(
            input_ids=full, attention_mask=full_mask, labels=full.masked_fill(full_mask == 0, -100)
        ).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        return gen_s, time.perf_counter() - t

    def sync(kind: str) -> tuple[float, float]:
        nonlocal version
        version += 1
        if kind == "digest":
            stats = engine.sync(model, model="actor", version=version)
            return stats.seconds, stats.verify_seconds
        buckets = weight_buckets(model, engine.bucket_bytes, "cpu", engine.dtype)
        _, load_s = engine.load_buckets(buckets, check=False)
        _, verify_s = engine.verify(model, model="actor", version=version)
        return load_s, verify_s

    kinds = ("probe", "digest")
    step()
    for kind in kinds:  # untimed: the first reload of each kind (the digest's is probed too)
        sync(kind)
    totals = {k: dict.fromkeys(("generate", "step", "load", "verify"), 0.0) for k in kinds}
    for rep in range(reps):
        gen_s, step_s = step()
        # both kinds sync the same new weights, in alternating order (the second finds the first's memory)
        for kind in kinds if rep % 2 == 0 else kinds[::-1]:
            load_s, verify_s = sync(kind)
            for key, value in zip(totals[kind], (gen_s, step_s, load_s, verify_s), strict=True):
                totals[kind][key] += value
    return {k: {key: v / reps for key, v in t.items()} for k, t in totals.items()}


if __name__ == "__main__":
    main()
