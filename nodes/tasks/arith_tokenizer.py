"""The arithmetic task's character-level Hugging Face tokenizer, built in code.

One token per character (digits, ``+ - * =``, space) plus the specials ``<pad>`` (0), ``<bos>`` (1),
``<eos>`` (2), ``<unk>`` (3): 19 ids. Encoding a prompt prepends ``<bos>``; decoding joins characters
with no separator. ``examples/arith/tokenizer`` is :func:`save_tokenizer`'s output (written by
``examples/arith/make_tokenizer.py``); the profile's probe builds its own copy with it, so an installed
rlflow needs no checkout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CHARS", "SPECIALS", "build_tokenizer", "save_tokenizer"]

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [*"0123456789", "+", "-", "*", "=", " "]


def build_tokenizer() -> Any:
    """The character-level tokenizer, a ``transformers.PreTrainedTokenizerFast`` (19 ids)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters without spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=512,
    )


def save_tokenizer(out: str | Path) -> Path:
    """Write the tokenizer to directory ``out`` (Hugging Face format, loadable offline with
    ``AutoTokenizer.from_pretrained(out)``); returns ``out`` as a path."""
    out = Path(out)
    build_tokenizer().save_pretrained(str(out))
    # transformers 5 names its fast class TokenizersBackend; the 4.x name loads under both.
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out
