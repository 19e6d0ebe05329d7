"""The code task's character-level Hugging Face tokenizer, built in code.

One token per character of one-line Python programs: digits, lower-case letters, the operators and
punctuation ``()[]{}+-*/%=<>!:,.'"_#`` and space, plus the specials ``<pad>`` (0), ``<bos>`` (1), ``<eos>``
(2), ``<unk>`` (3): 63 ids. No newline: the task's programs are one line (``print((int(input())+2)*3)``), and
the per-character split does not match it. Encoding a prompt prepends ``<bos>``; decoding joins characters
with no separator. ``examples/code/tokenizer`` is :func:`save_tokenizer`'s output (written by
``examples/code/make_tokenizer.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlflow.nodes.tasks.hf_tokenizer import save_tokenizer_dir, word_level_tokenizer

__all__ = ["CHARS", "SPECIALS", "build_tokenizer", "save_tokenizer"]

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [*"0123456789", *"abcdefghijklmnopqrstuvwxyz", *"()[]{}+-*/%=<>!:,.'\"_#", " "]


def build_tokenizer() -> Any:
    """The character-level tokenizer, a ``transformers.PreTrainedTokenizerFast`` (63 ids)."""
    return word_level_tokenizer(SPECIALS + CHARS, per_character=True)


def save_tokenizer(out: str | Path) -> Path:
    """Write the tokenizer to directory ``out`` (Hugging Face format, loadable offline with
    ``AutoTokenizer.from_pretrained(out)``); returns ``out`` as a path."""
    return save_tokenizer_dir(build_tokenizer(), out)
