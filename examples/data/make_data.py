"""Write the small offline data files the DPO, SFT and reward-model examples read.

- ``sft.jsonl``: ``{"prompt": "12+34=", "response": "46"}`` — a 2-digit sum or difference and its answer.
- ``preferences.jsonl``: ``{"prompt": "12+34=", "chosen": "46", "rejected": "47"}`` — the correct answer
  preferred over a wrong one (off by 1-10 or with two digits swapped).

Every character is in the arithmetic tokenizer's vocabulary (digits, ``+ - * =``, space), so
``examples/arith/tokenizer`` encodes them without ``<unk>``. Deterministic (seeded).

Run: ``python examples/data/make_data.py [OUT_DIR] [--rows N]`` (defaults: this folder, 48 rows).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def problem(rng: random.Random) -> tuple[str, int]:
    """A 2-digit ``a+b=`` or ``a-b=`` prompt and its integer answer."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if rng.random() < 0.5:
        return f"{a}+{b}=", a + b
    return f"{a}-{b}=", a - b


def wrong_answer(rng: random.Random, answer: int) -> int:
    """A plausible wrong answer: off by 1-10, or its last two digits swapped when that changes it."""
    digits = str(abs(answer))
    if len(digits) >= 2 and digits[-1] != digits[-2] and rng.random() < 0.3:
        swapped = int(digits[:-2] + digits[-1] + digits[-2])
        return -swapped if answer < 0 else swapped
    return answer + rng.choice([-1, 1]) * rng.randint(1, 10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(Path(__file__).parent), help="output folder")
    parser.add_argument("--rows", type=int, default=48, help="rows per file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    with open(out / "sft.jsonl", "w") as f:
        for _ in range(args.rows):
            prompt, answer = problem(rng)
            f.write(json.dumps({"prompt": prompt, "response": str(answer)}) + "\n")
    with open(out / "preferences.jsonl", "w") as f:
        for _ in range(args.rows):
            prompt, answer = problem(rng)
            rejected = wrong_answer(rng, answer)
            f.write(json.dumps({"prompt": prompt, "chosen": str(answer), "rejected": str(rejected)}) + "\n")


if __name__ == "__main__":
    main()
