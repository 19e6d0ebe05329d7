"""Tokenizers: loading a Hugging Face tokenizer, the special ids generation and padding need, and the
tokenizer a graph's data set is tokenized with.

Prompts are left-padded and responses right-padded (the batch format of :mod:`rlflow.nodes.forward`), so
every tokenizer rlflow loads pads on the left and must have a pad and an EOS token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import ModelError, RlflowError

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["TokenizerInfo", "data_tokenizer", "load_tokenizer"]


@dataclass(frozen=True)
class TokenizerInfo:
    """The special token ids generation and padding need.

    Attributes:
        pad_id: id written after a row's end (responses right-padded, prompts left-padded).
        eos_id: id that ends a response (kept inside the response mask when generated).
        bos_id: id prepended to prompts by tokenizers that do so, or ``None``.
    """

    pad_id: int
    eos_id: int
    bos_id: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenizerInfo:
        """Read pad/eos/bos ids from a Hugging Face tokenizer.

        Raises:
            ModelError: naming the missing token when the tokenizer has no pad or no EOS token.
        """
        missing = [
            name for name in ("pad_token_id", "eos_token_id") if getattr(tokenizer, name, None) is None
        ]
        if missing:
            where = getattr(tokenizer, "name_or_path", "") or "<tokenizer>"
            raise ModelError(
                f"tokenizer '{where}' has no {' and no '.join(m.removesuffix('_id') for m in missing)}; "
                "rlflow needs both a pad token and an EOS token (set them in the tokenizer's "
                "special_tokens_map / tokenizer_config.json)"
            )
        bos = getattr(tokenizer, "bos_token_id", None)
        return cls(pad_id=int(tokenizer.pad_token_id), eos_id=int(tokenizer.eos_token_id), bos_id=bos)


def load_tokenizer(path: str | Path, *, pad_from_eos: bool = False) -> Any:
    """Load a Hugging Face tokenizer from a local directory (offline).

    Args:
        path: directory written by ``tokenizer.save_pretrained``.
        pad_from_eos: when the tokenizer has no pad token, use its EOS token as pad (GPT-2 style
            tokenizers) instead of raising.

    Returns:
        a ``transformers.PreTrainedTokenizerBase``, with ``padding_side="left"`` (prompts are left-padded).

    Raises:
        ModelError: the directory is missing or unreadable, or the tokenizer lacks a pad or EOS token
            (the message names which).
    """
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"tokenizer directory '{p}' does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable dirs
        raise ModelError(f"cannot load tokenizer from '{p}': {e}") from e
    if tok.pad_token_id is None and pad_from_eos and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    TokenizerInfo.from_tokenizer(tok)  # raises ModelError naming a missing pad/eos token
    tok.padding_side = "left"
    return tok


def data_tokenizer(graph: Graph, tokenizers: Mapping[str, Any]) -> Any:
    """The tokenizer the data set is tokenized with: ``data.tokenizer`` names a model (its tokenizer, from
    ``tokenizers`` (model -> loaded tokenizer) or loaded from the model's directory) or a directory; without
    it, the first loaded tokenizer.

    Raises:
        ModelError: the tokenizer cannot be loaded.
    """
    data = graph.spec.data
    if data.tokenizer is None:
        return next((t for t in tokenizers.values() if t is not None), None)
    if data.tokenizer in tokenizers:
        return tokenizers[data.tokenizer]
    if data.tokenizer in graph.spec.models:  # a model whose tokenizer is not loaded here
        tdir = graph.spec.models[data.tokenizer].tokenizer_dir
        return load_tokenizer(tdir) if tdir is not None else None
    try:
        return load_tokenizer(data.tokenizer)
    except RlflowError:
        raise
    except Exception as e:
        raise ModelError(f"data.tokenizer '{data.tokenizer}': cannot load: {e}") from e
