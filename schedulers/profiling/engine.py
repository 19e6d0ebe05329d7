"""What the vLLM engine costs on this host: ``VllmEngine`` serving the one-layer model once in a spawned
process: its start (``engine_start``), prefill (``engine_prefill``), decode steps (``engine_decode``) and
loading and verifying a weight version (``engine_load``, ``engine_verify``)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from rlflow.schedulers.planner.call_cost import forward_flops
from rlflow.schedulers.planner.shapes import ModelShape
from rlflow.schedulers.profiling.measure import (
    DEFAULT_CONFIG,
    median_rounds,
    one_layer,
    profile_row,
    time_call,
    worker_threads,
)

__all__ = ["ENGINE_DECODE_STEPS", "profile_engine"]

ENGINE_DECODE_STEPS = 8  # decode steps timed beyond the first token (engine_decode)


def _engine_rows(
    config: dict[str, Any],
    batch_sizes: Sequence[int],
    seq_lens: Sequence[int],
    repeats: int,
    threads: int,
    rounds: int,
) -> list[dict[str, Any]]:
    """:func:`profile_engine`'s measurements, in the process that calls it (an in-process engine)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from rlflow.nodes.engines.vllm_engine import VllmEngine
    from rlflow.nodes.models import build_model
    from rlflow.nodes.tasks.arith_tokenizer import save_tokenizer
    from rlflow.nodes.tokenizers import load_tokenizer

    torch.set_num_threads(threads)
    steps = ENGINE_DECODE_STEPS
    cfg = {
        "model_type": "llama", **one_layer(config), "max_position_embeddings": max(seq_lens) + steps + 8,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    }  # fmt: skip
    model = build_model(config=cfg, head="lm", dtype="float32", seed=0, name="profile").eval()
    shape = ModelShape.from_config(cfg, dtype="float32")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = load_tokenizer(save_tokenizer(Path(tmp, "tokenizer")))
        t0 = time.perf_counter()
        engine = VllmEngine(
            model, tokenizer, where="rlflow profile (model 'profile')", max_rows=max(batch_sizes), seed=0,
            in_process=True,
        )  # fmt: skip
        rows.append(profile_row("engine_start", time.perf_counter() - t0))
        try:
            gen = torch.Generator().manual_seed(0)
            # ids the tokenizer knows (vLLM checks prompts against it), past the special tokens
            high = min(len(tokenizer), shape.vocab_size)

            def call(b: int, seq: int, tokens: int) -> None:
                """``b`` prompts of ``seq`` tokens, ``tokens`` generated each, as the node submits them (one
                request per row, sampled, per-token log-probs); the prefix cache emptied first so each
                call computes its prefill as new prompts do."""
                ids = torch.randint(4, high, (b, seq), generator=gen).tolist()
                params = [
                    SamplingParams(n=1, temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0,
                                   seed=i, detokenize=False, skip_special_tokens=False)
                    for i in range(b)
                ]  # fmt: skip
                engine.llm.reset_prefix_cache()
                engine.llm.generate([TokensPrompt(prompt_token_ids=r) for r in ids], params, use_tqdm=False)

            def measure(version: int) -> list[dict[str, Any]]:
                out, first = [], {}
                for b in batch_sizes:
                    for seq in seq_lens:
                        first[(b, seq)] = time_call(partial(call, b, seq, 1), repeats)
                        out.append(
                            profile_row("engine_prefill", first[(b, seq)], batch=b, seq=seq, count=1,
                                 flops=forward_flops(shape, b, seq))
                        )  # fmt: skip
                seq = min(seq_lens)
                for b in batch_sizes:
                    more = time_call(partial(call, b, seq, 1 + steps), repeats)
                    per_step = max(more - first[(b, seq)], 1e-9) / steps
                    out.append(profile_row("engine_decode", per_step, batch=b, seq=seq, count=steps))
                stats = engine.sync(model, model="profile", version=version)
                out.append(profile_row("engine_load", stats.seconds, bytes=stats.bytes))
                return [*out, profile_row("engine_verify", stats.verify_seconds)]

            engine.sync(model, model="profile", version=1)  # warm-up: the first load costs ~10x more
            rows += median_rounds([measure(version) for version in range(2, 2 + max(1, rounds))])
        finally:
            engine.close()
    return rows


def profile_engine(
    config: dict[str, Any] | None = None,
    batch_sizes: Sequence[int] = (1, 2, 4),
    seq_lens: Sequence[int] = (32, 64),
    repeats: int = 2,
    threads: int | None = None,
    rounds: int = 3,
) -> list[dict[str, Any]]:
    """The vLLM engine (``rlflow.nodes.engines.vllm_engine.VllmEngine``, in-process, fp32) serving the
    one-layer model of ``config``, started once in a spawned process (vLLM keeps an in-process engine's
    state in its globals and resets torch's threads: this process stays as it was) with ``threads`` torch
    threads (default: a runtime worker's); the calls below are measured ``rounds`` times one after another
    and each row keeps its median (as :func:`run_profile`'s rounds). Rows (seconds):

      * ``engine_start``: starting the engine (writing the weights, vLLM's start, the first probe);
      * ``engine_prefill`` per ``batch`` × ``seq``: one generated token after ``batch`` fresh prompts of
        ``seq`` tokens (``flops``: their forward FLOPs);
      * ``engine_decode`` per ``batch`` (shortest ``seq``): seconds per decode step, from ``count`` =
        :data:`ENGINE_DECODE_STEPS` further tokens;
      * ``engine_load`` / ``engine_verify``: loading a full weight version (``bytes``) and its probe
        (``VllmEngine.sync``), after one unmeasured load.

    Raises:
        NodeError: vLLM is missing or the engine fails to start (the caller checks ``vllm_missing`` first).
    """
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    threads = worker_threads() if threads is None else threads
    args = (dict(config or DEFAULT_CONFIG), list(batch_sizes), list(seq_lens), repeats, threads, rounds)
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_engine_rows, *args).result()
