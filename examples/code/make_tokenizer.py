"""Write examples/code/tokenizer/: the code task's character-level Hugging Face tokenizer.

The tokenizer is built by :mod:`rlflow.nodes.tasks.code_tokenizer` (4 specials + 59 characters = 63 ids).
Loadable offline with ``transformers.AutoTokenizer.from_pretrained("examples/code/tokenizer")``.

Run: ``python examples/code/make_tokenizer.py [OUT_DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlflow.nodes.tasks.code_tokenizer import save_tokenizer


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "tokenizer"
    print(f"wrote {save_tokenizer(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
