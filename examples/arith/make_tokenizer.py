"""Write examples/arith/tokenizer/: a character-level Hugging Face tokenizer for the arithmetic task.

One token per character (digits, ``+ - * =``, space) plus the specials ``<pad>`` (0), ``<bos>`` (1),
``<eos>`` (2), ``<unk>`` (3). Encoding a prompt prepends ``<bos>``; decoding joins characters with no
separator. Loadable offline with ``transformers.AutoTokenizer.from_pretrained("examples/arith/tokenizer")``.

Run: ``python examples/arith/make_tokenizer.py [OUT_DIR]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [*"0123456789", "+", "-", "*", "=", " "]


def build_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer (vocabulary: 4 specials + 15 characters = 19 ids)."""
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


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent / "tokenizer"
    build_tokenizer().save_pretrained(str(out))
    # transformers 5 names its fast class TokenizersBackend; the 4.x name loads under both.
    config_file = out / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
