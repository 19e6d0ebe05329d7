"""Word-level Hugging Face tokenizers built in code, for the tasks shipped with rlflow (no model hub).

A task lists its vocabulary (specials ``<pad>``, ``<bos>``, ``<eos>``, ``<unk>`` among it); encoding a
prompt prepends ``<bos>``; padding is on the left (generation appends to the right).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["save_tokenizer_dir", "word_level_tokenizer"]


def word_level_tokenizer(words: list[str], *, per_character: bool) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` with one id per entry of ``words`` (in order).

    ``per_character``: every character is a token and decoding joins them with no separator (the arithmetic
    task); otherwise words split at whitespace and decoding joins them with spaces.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    if per_character:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tok.decoder = decoders.Fuse()
    else:
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
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


def save_tokenizer_dir(tokenizer: Any, out: str | Path) -> Path:
    """Write ``tokenizer`` to directory ``out`` (Hugging Face format, loadable offline with
    ``AutoTokenizer.from_pretrained(out)``); returns ``out`` as a path."""
    out = Path(out)
    tokenizer.save_pretrained(str(out))
    # transformers 5 names its fast class TokenizersBackend; the 4.x name loads under both.
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out
