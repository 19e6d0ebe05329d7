"""The ``data`` section of a graph file: where prompts come from and which batch keys they produce.

Plain frozen values checked field by field on construction (:class:`GraphError` naming the field's path,
``data.tokenize``); reading the rows is :mod:`rlflow.dataflow.data`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
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

__all__ = ["OVERLONG", "DataSpec", "DatasetSpec", "GeneratorSpec"]

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


def _check_files(path: str, value: object) -> None:
    """``value`` is a non-empty path or glob, or a non-empty list of them."""
    if isinstance(value, list):
        if not value:
            fail(path, "expected a path or glob, or a non-empty list of them; got []")
        for i, item in enumerate(value):
            check_str(f"{path}[{i}]", item)
    else:
        check_str(path, value)


@dataclass(frozen=True)
class DatasetSpec:
    """A data set loaded with the Hugging Face ``datasets`` library (``data.dataset``), in place of
    ``data.train``; read by :mod:`rlflow.dataflow.hf_data`, which imports ``datasets`` only then.

    ``path``: a folder written by ``save_to_disk`` (``datasets.load_from_disk``; a saved ``Dataset`` is its
    ``train`` split, a ``DatasetDict`` has its own splits), else what ``datasets.load_dataset`` takes: a Hub
    id (``openai/gsm8k``, configuration ``name``, at ``revision``), a folder of data files, or a builder
    (``json``, ``parquet``, ``csv``) reading ``data_files`` (a path or glob, a list of them, or split ->
    paths; relative to the working directory). A Hub data set is read from the ``datasets`` cache
    (``HF_DATASETS_CACHE``) and downloaded only online: ``HF_HUB_OFFLINE=1`` or ``HF_DATASETS_OFFLINE=1``
    forbid it, and a data set missing from the cache is then an error naming it.

    ``split`` gives the training rows, ``eval_split`` the held-out rows (``run.eval``; instead of
    ``data.eval``), in the ``datasets`` split syntax: ``train``, ``train[:1000]``, ``train[90%:]``,
    ``train+test``. ``filter`` keeps the rows whose column equals the value, or one of a list of values,
    for every column it names (``{level: [1, 2], lang: en}``); ``filter_fn`` keeps the rows for which a
    function, named by import path (``pkg.module:function``) and called with the row (a dict column ->
    value), returns ``True`` (it must return a bool). Both apply to both splits, before ``data.fields`` maps
    columns to batch keys. The rows keep the data set's order; training visits them as a file's rows, in a
    per-epoch permutation of ``run.seed`` (``data.shuffle``), and a resumed run continues at the
    checkpoint's exact data position. Errors (a data set that does not load, a split or column that does
    not exist, a filter that keeps no row) name the key before anything starts.
    """

    path: str
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    revision: str | None = None
    split: str = "train"
    eval_split: str | None = None
    filter: dict[str, str | int | float | bool | list[str | int | float | bool]] = field(default_factory=dict)
    filter_fn: str | None = None

    def __post_init__(self) -> None:
        check_str("data.dataset.path", self.path)
        check_str("data.dataset.name", self.name, optional=True)
        check_str("data.dataset.revision", self.revision, optional=True)
        check_str("data.dataset.split", self.split)
        check_str("data.dataset.eval_split", self.eval_split, optional=True)
        if isinstance(self.data_files, Mapping):
            check_str_mapping("data.dataset.data_files", self.data_files)
            for split, files in self.data_files.items():
                _check_files(f"data.dataset.data_files.{split}", files)
            object.__setattr__(self, "data_files", dict(self.data_files))
        elif self.data_files is not None:
            _check_files("data.dataset.data_files", self.data_files)
        check_str_mapping("data.dataset.filter", self.filter)
        for column, value in self.filter.items():
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, str | int | float | bool) for v in values):
                fail(
                    f"data.dataset.filter.{column}",
                    f"expected a string, number or true/false, or a non-empty list of them; got "
                    f"{show(value)}",
                )
        object.__setattr__(self, "filter", dict(self.filter))
        check_str("data.dataset.filter_fn", self.filter_fn, optional=True)
        if self.filter_fn is not None and not ("." in self.filter_fn or ":" in self.filter_fn):
            fail(
                "data.dataset.filter_fn",
                f"'{self.filter_fn}' is not an import path: write 'pkg.module:function'",
            )


@dataclass(frozen=True)
class DataSpec:
    """Where prompts (and answers, preferences, ...) come from and which batch keys they produce.

    Exactly one of ``train`` (a .jsonl or .parquet file), ``generator`` and ``dataset`` (a data set the
    Hugging Face ``datasets`` library loads: :class:`DatasetSpec`). ``fields`` maps batch key -> column
    name. Each key in ``tokenize`` produces ``<key>_ids`` / ``<key>_mask`` (``prompt`` left-padded, others
    right-padded with EOS appended) instead of the raw key, using the tokenizer of model ``tokenizer``.
    A tokenized prompt may have at most ``max_prompt_tokens`` tokens (and at most what generation leaves
    of the model's positions, ``rlflow.dataflow.context.prompt_limit``); ``overlong`` says what happens to a
    longer one: ``error`` (default: the run stops before training, naming file, row and length),
    ``truncate`` (its last tokens are kept: cut on the left, as verl's ``truncation: left``) or ``drop``.
    """

    train: str | None = None
    generator: GeneratorSpec | None = None
    dataset: DatasetSpec | None = None
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
        if self.dataset is not None and not isinstance(self.dataset, DatasetSpec):
            fail("data.dataset", f"expected a DatasetSpec, got {show(self.dataset)}")
        if sum(x is not None for x in (self.train, self.generator, self.dataset)) != 1:
            fail(
                "data",
                "give exactly one of 'train' (a .jsonl/.parquet file), 'generator' and 'dataset' (a Hugging "
                "Face data set)",
            )
        if self.dataset is not None and self.dataset.eval_split is not None and self.eval is not None:
            fail("data.eval", "give one held-out split: 'eval' (a file) or 'dataset.eval_split'")
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
