"""The ``data`` section of a graph file: where prompts come from and which batch keys they produce.

Plain frozen values checked field by field on construction (:class:`GraphError` naming the field's path,
``data.tokenize``); reading the rows is :mod:`rlflow.dataflow.data`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlflow.dataflow.errors import did_you_mean
from rlflow.dataflow.fields import (
    check_bool,
    check_choice,
    check_int,
    check_name,
    check_str,
    check_str_mapping,
    fail,
    show,
)

__all__ = ["OVERLONG", "DataSpec", "GeneratorSpec"]

OVERLONG = ("error", "truncate", "drop")
"""What ``data.overlong`` may say about a prompt longer than the limit."""


@dataclass(frozen=True)
class GeneratorSpec:
    """A registered data generator (``name``) and its keyword arguments."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_str("data.generator.name", self.name)
        check_str_mapping("data.generator.args", self.args)
        object.__setattr__(self, "args", dict(self.args))


@dataclass(frozen=True)
class DataSpec:
    """Where prompts (and answers, preferences, ...) come from and which batch keys they produce.

    Exactly one of ``train`` (a .jsonl or .parquet file) and ``generator``. ``fields`` maps batch key ->
    column name. Each key in ``tokenize`` produces ``<key>_ids`` / ``<key>_mask`` (``prompt`` left-padded,
    others right-padded with EOS appended) instead of the raw key, using the tokenizer of model ``tokenizer``.
    A tokenized prompt may have at most ``max_prompt_tokens`` tokens (and at most what generation leaves
    of the model's positions, ``rlflow.dataflow.context.prompt_limit``); ``overlong`` says what happens to a
    longer one: ``error`` (default: the run stops before training, naming file, row and length),
    ``truncate`` (its last tokens are kept: cut on the left, as verl's ``truncation: left``) or ``drop``.
    """

    train: str | None = None
    generator: GeneratorSpec | None = None
    eval: str | None = None
    fields: dict[str, str] = field(default_factory=dict)
    tokenize: tuple[str, ...] = ()
    tokenizer: str | None = None
    shuffle: bool = True
    max_prompt_tokens: int | None = None
    overlong: str = "error"

    def __post_init__(self) -> None:
        check_str("data.train", self.train, optional=True)
        check_str("data.eval", self.eval, optional=True)
        if self.generator is not None and not isinstance(self.generator, GeneratorSpec):
            fail("data.generator", f"expected a GeneratorSpec, got {show(self.generator)}")
        if (self.train is None) == (self.generator is None):
            fail("data", "give exactly one of 'train' (a .jsonl/.parquet file) and 'generator'")
        if self.train is not None and not self.train.endswith((".jsonl", ".parquet")):
            fail("data.train", f"'{self.train}' must be a .jsonl or .parquet file")
        check_str_mapping("data.fields", self.fields)
        for key, column in self.fields.items():
            check_name("data.fields", key)
            check_str(f"data.fields.{key}", column)
        object.__setattr__(self, "fields", dict(self.fields))
        if isinstance(self.tokenize, str) or not isinstance(self.tokenize, tuple | list):
            fail("data.tokenize", f"expected a list of field keys, got {show(self.tokenize)}")
        for key in self.tokenize:
            check_str("data.tokenize", key)
            if key not in self.fields:
                fail(
                    "data.tokenize",
                    f"'{key}' is not a key of data.fields{did_you_mean(key, self.fields)}; "
                    f"fields: {', '.join(self.fields) or '(none)'}",
                )
        if len(set(self.tokenize)) != len(self.tokenize):
            fail("data.tokenize", f"lists a key twice: {list(self.tokenize)}")
        object.__setattr__(self, "tokenize", tuple(self.tokenize))
        check_str("data.tokenizer", self.tokenizer, optional=True)
        if self.tokenize and self.tokenizer is None:
            fail("data.tokenizer", "data.tokenize needs 'tokenizer': the model whose tokenizer to use")
        check_bool("data.shuffle", self.shuffle)
        if self.max_prompt_tokens is not None:
            check_int("data.max_prompt_tokens", self.max_prompt_tokens, 1)
        check_choice("data.overlong", self.overlong, OVERLONG)
        produced: dict[str, str] = {}
        for key in self.fields:
            for out in (f"{key}_ids", f"{key}_mask") if key in self.tokenize else (key,):
                if out in produced:
                    fail("data.fields", f"keys '{produced[out]}' and '{key}' both produce batch key '{out}'")
                produced[out] = key

    def batch_keys(self) -> dict[str, str]:
        """Batch keys the data set produces -> the field key they come from."""
        out: dict[str, str] = {}
        for key in self.fields:
            if key in self.tokenize:
                out[f"{key}_ids"] = key
                out[f"{key}_mask"] = key
            else:
                out[key] = key
        return out
