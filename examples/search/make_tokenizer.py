"""Write examples/search/tokenizer/: the search-agent task's word-level Hugging Face tokenizer.

Built by :mod:`rlflow.nodes.tasks.search` (every word the task produces: tags, question words, jobs, names).
Run: ``python examples/search/make_tokenizer.py [OUT_DIR]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlflow.nodes.tasks.search import save_tokenizer


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "tokenizer"
    print(f"wrote {save_tokenizer(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
