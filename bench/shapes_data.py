"""The real-shaped workload of ``bench_shapes_vs_trl.py``: mixed-length arithmetic, an SFT model that answers
and stops at EOS, and the length distributions it produces.

- :func:`mixed_rows`: ``a op b =`` problems whose operands have a uniformly drawn number of digits
  (1 to ``max_digits`` each, independently; ``op`` uniform over ``+ - *``; no zero padding; ``-`` never
  negative), so prompts are of mixed length and answers have 1 to ``2 · max_digits`` digits.
- :func:`sft_actor`: ``examples/arith/sft.yaml`` (its model, tokenizer and optimizer) trained on those rows
  for a few hundred iterations through the runtime, cached under the bench's output directory by its
  settings: a model that writes an answer of about the right number of digits and then EOS.
- :func:`length_shape`: prompt and response token lengths (responses sampled from that model at temperature
  1 with transformers' ``generate``, up to and including EOS) and the padding share of a row-padded batch.

Imports rlflow (project Python only).
"""

from __future__ import annotations

import hashlib
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SFT_GRAPH = ROOT / "examples" / "arith" / "sft.yaml"

__all__ = ["length_shape", "mixed_rows", "sft_actor", "shape_lines", "write_rows"]


def mixed_rows(count: int, seed: int, max_digits: int) -> list[dict[str, str]]:
    """``count`` distinct problems ``{"prompt": "a+b=", "answer": "c", "demonstration": "c"}``; each
    operand's digit count is drawn uniformly from 1..``max_digits``, then the operand uniformly among the
    numbers of that many digits (0-9 for one digit)."""
    from rlflow.nodes.tasks.arith import solve

    rng = random.Random(seed)

    def operand() -> int:
        d = rng.randint(1, max_digits)
        return rng.randrange(0 if d == 1 else 10 ** (d - 1), 10**d)

    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < count:
        a, op, b = operand(), rng.choice("+-*"), operand()
        if op == "-" and a < b:
            a, b = b, a
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = str(solve(a, op, b))
        rows.append({"prompt": prompt, "answer": answer, "demonstration": answer})
    return rows


def write_rows(path: Path, rows: list[dict[str, str]]) -> Path:
    """``rows`` as JSONL at ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_actor(out: Path, iterations: int, max_digits: int, seed: int, extra: list[str]) -> Path:
    """The SFT actor (a Hugging Face model directory with its tokenizer): ``examples/arith/sft.yaml`` on
    :func:`mixed_rows` (8,000 training, 256 held-out problems), ``iterations`` iterations, ``extra``
    overrides last; trained once per settings (``out/sft-<digest>``) in a subprocess."""
    key = json.dumps([iterations, max_digits, seed, extra])
    run = out / f"sft-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
    actor = run / "checkpoints" / "latest" / "models" / "actor"
    if actor.is_dir():
        print(f"[bench] SFT checkpoint (cached): {actor}", flush=True)
        return actor
    rows = mixed_rows(8256, seed, max_digits)
    data = out / "data"
    write_rows(data / "sft_eval.jsonl", rows[:256])
    write_rows(data / "sft_train.jsonl", rows[256:])
    overrides = [
        "data.generator=null", f"data.train={data / 'sft_train.jsonl'}",
        f"data.eval={data / 'sft_eval.jsonl'}",
        f"run.output_dir={run}", f"run.iterations={iterations}", f"run.checkpoint_interval={iterations}",
        "run.eval_interval=0", f"run.seed={seed}", "run.eval.max_new_tokens=" + str(2 * max_digits + 1),
        *extra,
    ]  # fmt: skip
    cmd = ["rlflow", "run", str(SFT_GRAPH), *overrides, "--overwrite", "--no-progress", "--no-dashboard"]
    print(f"[bench] SFT ({iterations} iterations): {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    (run / "settings.json").write_text(key)
    return actor


def _stats(xs: list[int]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "mean": statistics.fmean(s),
        "p50": s[len(s) // 2],
        "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
        "max": s[-1],
    }


def length_shape(
    actor: Path, prompts: list[str], rows_per_batch: int, max_new_tokens: int, seed: int
) -> dict[str, Any]:
    """Token lengths of ``prompts`` (BOS included) and of one sampled response each from ``actor``
    (temperature 1, up to ``max_new_tokens``, EOS included), their mean/p50/p90/max, the share of responses
    cut at ``max_new_tokens``, and the padding share of a ``[rows_per_batch, longest prompt + longest
    response]`` batch (what a row-padded batch computes that no sequence needs), mean over the batches of
    ``prompts`` in order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(actor))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(actor), dtype=torch.float32).eval()
    plen: list[int] = []
    rlen: list[int] = []
    for i in range(0, len(prompts), 256):
        enc = tok(prompts[i : i + 256], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        plen += enc["attention_mask"].sum(1).tolist()
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            ends = [j for j, t in enumerate(row) if t == tok.eos_token_id]
            rlen.append(ends[0] + 1 if ends else len(row))
    pads = []
    for i in range(0, len(prompts) - rows_per_batch + 1, rows_per_batch):
        p, r = plen[i : i + rows_per_batch], rlen[i : i + rows_per_batch]
        pads.append(1 - (sum(p) + sum(r)) / (rows_per_batch * (max(p) + max(r))))
    return {
        "prompt": _stats(plen),
        "response": _stats(rlen),
        "truncated": sum(x >= max_new_tokens for x in rlen) / len(rlen),
        "padding": statistics.fmean(pads) if pads else float("nan"),
        "rows_per_batch": rows_per_batch,
        "samples": len(rlen),
    }


def shape_lines(name: str, shape: dict[str, Any]) -> list[str]:
    """The printed lines of a :func:`length_shape` result."""
    out = [f"{name}: length distribution over {shape['samples']} sampled rows (tokens)"]
    for what in ("prompt", "response"):
        s = shape[what]
        out.append(
            f"  {what:<8} mean {s['mean']:5.1f}  p50 {s['p50']:>3}  p90 {s['p90']:>3}  max {s['max']:>3}"
        )
    out.append(
        f"  responses cut at max_new_tokens: {shape['truncated']:.1%}; padding share of a row-padded "
        f"batch of {shape['rows_per_batch']} rows: {shape['padding']:.1%}"
    )
    return out


if __name__ == "__main__":  # quick look: python bench/shapes_data.py OUT_DIR
    out_dir = Path(sys.argv[1])
    act = sft_actor(out_dir, 300, 4, 0, [])
    rows = mixed_rows(512, 1, 4)
    print(
        "\n".join(shape_lines("mixed arithmetic", length_shape(act, [r["prompt"] for r in rows], 256, 10, 0)))
    )
