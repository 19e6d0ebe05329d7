"""Data sets: JSONL/Parquet files, registered generators or Hugging Face data sets, field mapping,
tokenization, prompt streams.

A data set is a :class:`Rows` table (batch key -> per-row values) read from a ``.jsonl``/``.parquet`` file
with pyarrow, produced by a generator registered in :data:`DATA_GENERATORS` or loaded with the ``datasets``
library (``data.dataset``: :mod:`rlflow.dataflow.hf_data`), after the graph file's field mapping (batch
key -> column). :func:`make_batch` turns rows into a
:class:`~rlflow.dataflow.batch.Batch`, tokenizing per the batch contract: key ``prompt`` ->
``prompt_ids``/``prompt_mask`` left-padded (the tokenizer's special tokens, e.g. BOS, added); any other
tokenized key ``k`` -> ``k_ids``/``k_mask`` right-padded with EOS appended (no BOS). A tokenized key whose
values are message lists is rendered with the tokenizer's chat template instead (:mod:`rlflow.dataflow.chat`:
the prompt with the generation prompt, a reply as the tokens after it, masked to the assistant's tokens).
Untokenized keys stay per-row Python lists (e.g. answers).

:class:`PromptStream` serves training batches: epoch ``e`` visits the rows in a permutation derived from
``(seed, e)`` only; batches are consecutive slices of it; a final partial slice is dropped (the stream
moves to the next epoch), so every row is used at most once per epoch and exactly once when the batch
size divides the row count. Its ``state_dict()`` (epoch, position) makes resumption exact.
:func:`eval_batches` walks a held-out split in file order, keeping the last partial batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlflow.dataflow.batch import Batch, padding_side
from rlflow.dataflow.chat import continuation_ids, is_conversation_column, prompt_ids
from rlflow.dataflow.errors import DataError, did_you_mean
from rlflow.dataflow.hf_data import dataset_splits
from rlflow.dataflow.registry import Registry

__all__ = [
    "DATA_GENERATORS",
    "DataGenerator",
    "PromptStream",
    "Rows",
    "epoch_permutation",
    "eval_batches",
    "fit_prompts",
    "load_builtin_generators",
    "load_rows",
    "load_splits",
    "make_batch",
    "map_fields",
    "read_table",
]

DataGenerator = Callable[..., list[dict[str, Any]]]
"""``fn(split: str, **args) -> list of row dicts``; ``split`` is ``"train"`` or ``"eval"`` (disjoint)."""

DATA_GENERATORS: Registry[DataGenerator] = Registry("data generator", group="rlflow.data_generators")
"""Data generators by name; plug-ins (rlflow's tasks included) come from the ``rlflow.data_generators``
entry-point group (see :mod:`rlflow.dataflow.registry`)."""


def load_builtin_generators() -> None:
    """Load the data-generator plug-ins (rlflow's tasks included) into ``DATA_GENERATORS``."""
    DATA_GENERATORS.load_plugins()


@dataclass(frozen=True)
class Rows:
    """A column table after field mapping: batch key -> per-row values (all columns the same length).

    ``source`` names the file or generator in error messages.
    """

    columns: dict[str, list[Any]]
    source: str

    def __post_init__(self) -> None:
        lengths = {k: len(v) for k, v in self.columns.items()}
        if len(set(lengths.values())) > 1:
            raise DataError(f"data '{self.source}': columns have different lengths {lengths}")

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def take(self, idx: Sequence[int]) -> dict[str, list[Any]]:
        """The rows at ``idx`` (in that order), column-wise."""
        return {k: [v[i] for i in idx] for k, v in self.columns.items()}


# --------------------------------------------------------------------------------------------------
# Reading


def read_table(path: str | Path) -> dict[str, list[Any]]:
    """Read a ``.jsonl`` (one JSON object per line) or ``.parquet`` file into columns, with pyarrow.

    Raises:
        DataError: missing file, unsupported suffix or unreadable content (names the file).
    """
    import pyarrow as pa

    p = Path(path)
    if not p.is_file():
        raise DataError(f"data file '{p}' does not exist")
    try:
        if p.suffix == ".jsonl":
            import pyarrow.json as pa_json

            table: pa.Table = pa_json.read_json(str(p))
        elif p.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(str(p))
        else:
            raise DataError(f"data file '{p}': unsupported format '{p.suffix}'; use .jsonl or .parquet")
    except pa.ArrowException as e:  # ArrowInvalid and friends: malformed content
        raise DataError(f"data file '{p}' cannot be read: {e}") from e
    return {name: table.column(name).to_pylist() for name in table.column_names}


def map_fields(columns: Mapping[str, list[Any]], fields: Mapping[str, str], source: str) -> Rows:
    """Apply a field mapping (batch key -> column name); an empty mapping keeps every column as is.

    Raises:
        DataError: a mapped column is absent (names the source, the batch key and the column, and lists
            the available columns) or null in some row (names the first such row).
    """
    if not fields:
        return Rows({k: list(v) for k, v in columns.items()}, source)
    out: dict[str, list[Any]] = {}
    for key, column in fields.items():
        if column not in columns:
            raise DataError(
                f"data '{source}': field '{key}' maps to column '{column}', which is missing"
                f"{did_you_mean(column, columns)}; available columns: {', '.join(columns) or '(none)'}"
            )
        values = list(columns[column])
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:  # checked for every row now, not when training reaches the row
            raise DataError(
                f"data '{source}': field '{key}' (column '{column}') is missing or null in "
                f"{len(missing)} row(s), first at row {missing[0]}"
            )
        out[key] = values
    return Rows(out, source)


def load_rows(
    path: str | Path | None = None,
    *,
    generator: str | None = None,
    generator_args: Mapping[str, Any] | None = None,
    split: str = "train",
    fields: Mapping[str, str] | None = None,
    base_dir: str | Path | None = None,
) -> Rows:
    """Rows of one split from a file (``path``, relative to ``base_dir`` when not absolute) or a generator.

    Raises:
        DataError: unreadable file, missing mapped field, an empty data set, or a failing generator.
        RegistryError: an unknown generator name (with a "did you mean").
    """
    if (path is None) == (generator is None):
        raise DataError("give exactly one of a data file path and a generator name")
    if path is not None:
        p = Path(path)
        if base_dir is not None and not p.is_absolute():
            p = Path(base_dir) / p
        columns = read_table(p)
        source = str(p)
    else:
        assert generator is not None
        load_builtin_generators()
        fn = DATA_GENERATORS.get(generator)
        source = f"generator {generator} ({split})"
        try:
            records = fn(split, **dict(generator_args or {}))
        except TypeError as e:
            raise DataError(
                f"data.generator.args of {source}: bad arguments {dict(generator_args or {})}: {e}"
            ) from e
        except DataError as e:  # the generator's own check of an argument: say where the argument lives
            raise DataError(f"data.generator.args of {source}: {e}") from e
        columns = {k: [r.get(k) for r in records] for k in (records[0] if records else {})}
    rows = map_fields(columns, fields or {}, source)
    if len(rows) == 0:
        raise DataError(f"data '{source}' has no rows")
    return rows


def load_splits(data_spec: Any, *, base_dir: str | Path | None = None) -> tuple[Rows, Rows | None]:
    """``(train, eval or None)`` rows for a graph ``DataSpec`` (``train``/``generator``/``dataset``/``eval``/
    ``fields``).

    The eval split is the ``eval`` file when given, else the generator's ``eval`` split or the data set's
    ``eval_split`` (:func:`rlflow.dataflow.hf_data.dataset_splits`), else None.
    """
    fields = dict(getattr(data_spec, "fields", {}) or {})
    gen = getattr(data_spec, "generator", None)
    dataset = getattr(data_spec, "dataset", None)
    held_out: Rows | None = None
    if gen is not None:
        args = dict(gen.args)
        train = load_rows(generator=gen.name, generator_args=args, split="train", fields=fields)
    elif dataset is not None:
        split, held = dataset_splits(dataset, fields, base_dir=base_dir)
        train = map_fields(split.columns, fields, split.source)
        held_out = None if held is None else map_fields(held.columns, fields, held.source)
    else:
        train = load_rows(data_spec.train, fields=fields, base_dir=base_dir)
    eval_path = getattr(data_spec, "eval", None)
    if eval_path is not None:
        held_out = load_rows(eval_path, fields=fields, base_dir=base_dir, split="eval")
    elif gen is not None:
        held_out = load_rows(generator=gen.name, generator_args=args, split="eval", fields=fields)
    return train, held_out


# --------------------------------------------------------------------------------------------------
# Tokenization


def _token_ids(tokenizer: Any, texts: list[Any], key: str, add_special_tokens: bool) -> list[list[int]]:
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
    if bad:
        raise DataError(
            f"batch key '{key}': tokenized fields need text (or, as a conversation, a list of "
            f"{{role, content}} messages); row {bad[0]} holds {texts[bad[0]]!r}"
        )
    encoded = tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [list(map(int, ids)) for ids in encoded]


def _prompt_ids(tokenizer: Any, values: list[Any]) -> list[list[int]]:
    """Prompt ids: message lists rendered with the chat template (:mod:`rlflow.dataflow.chat`), text
    tokenized with the tokenizer's special tokens."""
    if is_conversation_column(values, "prompt"):
        return prompt_ids(tokenizer, values)
    return _token_ids(tokenizer, values, "prompt", add_special_tokens=True)


def _pad(seqs: list[list[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if not s:
            continue
        cols = slice(width - len(s), width) if left else slice(0, len(s))
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def make_batch(
    columns: Mapping[str, list[Any]],
    tokenizer: Any = None,
    tokenize: Sequence[str] = (),
    max_prompt_tokens: int | None = None,
) -> Batch:
    """A :class:`Batch` from column-wise rows.

    Args:
        columns: batch key -> per-row values.
        tokenizer: a Hugging Face tokenizer with ``pad_token_id`` and ``eos_token_id`` (needed when
            ``tokenize`` is not empty).
        tokenize: keys to tokenize. ``prompt`` -> ``prompt_ids``/``prompt_mask`` ``[B,P]`` int64, left-padded,
            special tokens added; another key ``k`` -> ``k_ids``/``k_mask`` ``[B,L]`` int64, right-padded,
            EOS appended, no special tokens. Other keys stay lists. A key holding message lists is
            rendered with the chat template (:mod:`rlflow.dataflow.chat`): ``prompt`` with the generation
            prompt; another key as the reply after the row's ``prompt`` messages, its mask 1 on the
            assistant's tokens only (no EOS appended: the template's end-of-turn tokens end it).
        max_prompt_tokens: keep only the last that many tokens of a longer prompt (``data.overlong:
            truncate``; :func:`fit_prompts` checks or drops rows otherwise).

    Raises:
        DataError: a tokenized key is missing or holds non-strings, a prompt tokenizes to nothing, the
            tokenizer lacks a pad/EOS token, or message lists are malformed or meet no chat template.
    """
    out: dict[str, torch.Tensor | list[Any]] = {}
    missing = [k for k in tokenize if k not in columns]
    if missing:
        raise DataError(f"cannot tokenize '{missing[0]}': no such data field; fields: {', '.join(columns)}")
    pad_id = eos_id = 0
    if tokenize:
        if tokenizer is None:
            raise DataError(f"tokenizing {list(tokenize)} needs a tokenizer")
        pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
        if pad is None or eos is None:
            raise DataError("the data tokenizer needs a pad token and an EOS token")
        pad_id, eos_id = int(pad), int(eos)
    for key, values in columns.items():
        if key not in tokenize:
            out[key] = list(values)
            continue
        turns = None  # a message-list reply's mask: 1 on the assistant's tokens only
        if key == "prompt":
            seqs = _prompt_ids(tokenizer, list(values))
            empty = [i for i, s in enumerate(seqs) if not s]
            if empty:
                raise DataError(f"prompt of row {empty[0]} ({values[empty[0]]!r}) tokenizes to no tokens")
            if max_prompt_tokens is not None:
                seqs = [q[-max_prompt_tokens:] for q in seqs]
        elif is_conversation_column(list(values), key):
            seqs, turns = continuation_ids(tokenizer, columns.get("prompt"), list(values), key)
        else:
            seqs = [[*s, eos_id] for s in _token_ids(tokenizer, list(values), key, False)]
        left = padding_side(f"{key}_ids") == "left"
        out[f"{key}_ids"], out[f"{key}_mask"] = _pad(seqs, pad_id, left=left)
        if turns is not None:
            out[f"{key}_mask"] = _pad(turns, 0, left=left)[0]
    return Batch(out)


def fit_prompts(rows: Rows, tokenizer: Any, limit: int, why: str, overlong: str = "error") -> Rows:
    """Hold every prompt of ``rows`` to ``limit`` tokens (as :func:`make_batch` tokenizes them, special
    tokens included), by ``data.overlong``: ``error`` refuses the first longer row, ``drop`` leaves the
    longer rows out, ``truncate`` keeps them (:func:`make_batch` cuts them to their last ``limit`` tokens).

    Args:
        why: where the limit comes from, for the message (``data.max_prompt_tokens=N`` or the model).

    Raises:
        DataError: a longer row under ``error`` (names the data file, the row index and its length), or
            no row left under ``drop``.
    """
    if "prompt" not in rows.columns or overlong == "truncate":
        return rows
    seqs = _prompt_ids(tokenizer, list(rows.columns["prompt"]))
    long = [i for i, q in enumerate(seqs) if len(q) > limit]
    if not long:
        return rows
    if overlong == "error":
        i = long[0]
        raise DataError(
            f"data '{rows.source}': row {i}: the prompt has {len(seqs[i])} tokens, more than {limit} "
            f"({why}); {len(long)} row(s) are that long. Shorten them, or set data.overlong: truncate "
            "(keep the last tokens) or drop"
        )
    keep = [i for i in range(len(rows)) if len(seqs[i]) <= limit]
    if not keep:
        raise DataError(f"data '{rows.source}': every prompt has more than {limit} tokens ({why})")
    return Rows(rows.take(keep), rows.source)


# --------------------------------------------------------------------------------------------------
# Streams


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The order rows ``0..n-1`` are visited in epoch ``epoch``: a function of ``(seed, epoch)`` only.

    The generator seed is the first 8 bytes of ``sha256(f"{seed}:{epoch}")`` so that nearby
    ``(seed, epoch)`` pairs give unrelated permutations. ``shuffle=False`` gives ``0..n-1``.
    """
    if not shuffle:
        return list(range(n))
    digest = hashlib.sha256(f"{seed}:{epoch}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return [int(i) for i in torch.randperm(n, generator=gen)]


class PromptStream:
    """Training batches over a data set, in seeded per-epoch order, resumable exactly.

    Epoch ``e`` visits rows in :func:`epoch_permutation` ``(seed, e)``; ``next_batch(n)`` returns the next
    ``n`` rows of it. When fewer than ``n`` rows remain in the epoch they are dropped and the batch comes
    from the start of epoch ``e+1`` (no batch mixes epochs; every row is used at most once per epoch).

    Args:
        rows: the training rows (after field mapping).
        seed: shuffling seed (the run's seed).
        shuffle: visit rows in file order when False.
        tokenizer, tokenize, max_prompt_tokens: as :func:`make_batch`.
    """

    def __init__(
        self,
        rows: Rows,
        *,
        seed: int = 0,
        shuffle: bool = True,
        tokenizer: Any = None,
        tokenize: Sequence[str] = (),
        max_prompt_tokens: int | None = None,
    ) -> None:
        if len(rows) == 0:
            raise DataError(f"data '{rows.source}' has no rows")
        self.rows = rows
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.tokenizer = tokenizer
        self.tokenize = tuple(tokenize)
        self.max_prompt_tokens = max_prompt_tokens
        self.epoch = 0
        self.position = 0
        self._order: list[int] | None = None
        # (epoch, row ids) of the last batch drawn: what the run's prompt record writes
        self.drawn: tuple[int, list[Any]] = (0, [])

    def __len__(self) -> int:
        return len(self.rows)

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = epoch_permutation(len(self.rows), self.seed, self.epoch, self.shuffle)
        return self._order

    def next_indices(self, n: int) -> list[int]:
        """Row indices of the next batch of ``n`` rows (advances the stream). :attr:`drawn` becomes their
        epoch and stable ids: a row's ``id`` field where the rows have one (``data.fields``), else its
        index in the training split.

        Raises:
            DataError: ``n`` < 1 or larger than the data set.
        """
        if n < 1 or n > len(self.rows):
            raise DataError(
                f"data '{self.rows.source}': batch of {n} rows impossible with {len(self.rows)} rows"
            )
        if self.position + n > len(self.rows):  # drop the partial tail, start the next epoch
            self.epoch += 1
            self.position = 0
            self._order = None
        idx = self._epoch_order()[self.position : self.position + n]
        self.position += n
        ids = self.rows.columns.get("id")
        self.drawn = (self.epoch, [ids[i] if ids is not None else i for i in idx])
        return idx

    def next_batch(self, n: int) -> Batch:
        """The next ``n`` rows as a :class:`Batch` (tokenized per :func:`make_batch`)."""
        rows = self.rows.take(self.next_indices(n))
        return make_batch(rows, self.tokenizer, self.tokenize, self.max_prompt_tokens)

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "rows"}``: where the stream stands (JSON-serialisable)."""
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "rows": len(self.rows)}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume from :meth:`state_dict`; the next batch is the one the saved stream would have served.

        Raises:
            DataError: the saved stream had a different seed or number of rows (the order would differ).
        """
        if int(state.get("seed", self.seed)) != self.seed or int(state.get("rows", len(self))) != len(self):
            raise DataError(
                f"data '{self.rows.source}': checkpoint data position was saved for seed "
                f"{state.get('seed')} and {state.get('rows')} rows, but this run has seed {self.seed} "
                f"and {len(self)} rows"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None


def eval_batches(
    rows: Rows,
    batch_size: int,
    *,
    tokenizer: Any = None,
    tokenize: Sequence[str] = (),
    max_prompt_tokens: int | None = None,
) -> Iterator[Batch]:
    """Held-out batches in file order; the last one may be smaller. Each row appears exactly once.
    ``tokenizer``, ``tokenize``, ``max_prompt_tokens``: as :func:`make_batch`."""
    if batch_size < 1:
        raise DataError(f"eval batch size must be >= 1, got {batch_size}")
    for start in range(0, len(rows), batch_size):
        idx = list(range(start, min(start + batch_size, len(rows))))
        yield make_batch(rows.take(idx), tokenizer, tokenize, max_prompt_tokens)
