"""Write examples/arith/tokenizer/: the arithmetic task's character-level Hugging Face tokenizer.

The tokenizer is built by :mod:`rlflow.nodes.tasks.arith_tokenizer` (4 specials + 15 characters = 19 ids).
Loadable offline with ``transformers.AutoTokenizer.from_pretrained("examples/arith/tokenizer")``.

Run: ``python examples/arith/make_tokenizer.py [OUT_DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlflow.nodes.tasks.arith_tokenizer import save_tokenizer


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "tokenizer"
    print(f"wrote {save_tokenizer(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
