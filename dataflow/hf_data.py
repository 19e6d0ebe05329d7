"""Data sets the Hugging Face ``datasets`` library loads (``data.dataset``): splits, filters, columns.

:func:`dataset_splits` opens the data set of a :class:`~rlflow.dataflow.data_spec.DatasetSpec` once
(``datasets.load_from_disk`` for a folder written by ``save_to_disk``, ``datasets.load_dataset`` for
anything else: a Hub id, a folder of data files, a builder such as ``json`` with ``data_files``; the
``datasets`` cache and offline mode, ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``, as that library keeps
them), selects the training and held-out splits (the ``datasets`` split syntax: ``train[:90%]``), applies
the declarative ``filter`` and the ``filter_fn`` predicate, checks the columns ``data.fields`` maps, and
returns each split's columns in the data set's order. Field mapping, null checks, tokenization and the
seeded per-epoch order are :mod:`rlflow.dataflow.data`'s, the same as for a ``.jsonl`` file's rows.

``datasets`` is imported inside these functions only, when a graph names ``data.dataset``: its import takes
seconds. Every failure is a :class:`~rlflow.dataflow.errors.DataError` naming the key (``data.dataset.split``,
``data.fields.prompt``); the caller adds the graph file.
"""

from __future__ import annotations

import contextlib
import pkgutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import DataError, did_you_mean
from rlflow.dataflow.fields import show
from rlflow.dataflow.hub import hub_ref

if TYPE_CHECKING:
    from datasets import Dataset

    from rlflow.dataflow.data_spec import DatasetSpec

__all__ = ["SplitColumns", "dataset_splits"]

# When a filter keeps no row: the distinct values of each filtered column named, from the first rows
_SHOWN_VALUES = 5
_HEAD_ROWS = 1000


@dataclass(frozen=True)
class SplitColumns:
    """One split's rows, column-wise (column -> per-row values, in the data set's order), and the words
    that name it in messages (``dataset openai/gsm8k (main), split train``)."""

    columns: dict[str, list[Any]]
    source: str


def dataset_splits(
    spec: DatasetSpec, fields: Mapping[str, str], *, base_dir: str | Path | None = None
) -> tuple[SplitColumns, SplitColumns | None]:
    """The training split (``spec.split``) and the held-out one (``spec.eval_split``, None when not given)
    of ``spec``'s data set, filtered, with the columns ``fields`` (batch key -> column) maps, or every
    column when ``fields`` is empty.

    Args:
        base_dir: where a relative local ``path`` or ``data_files`` entry lies (default: the working
            directory).

    Raises:
        DataError: the data set does not load (a missing folder, a Hub id not in the cache while offline),
            a split does not exist (lists the splits) or has no rows, a mapped or filtered column does not
            exist (lists the columns, with a "did you mean"), ``filter_fn`` does not import or fails, or the
            filters keep no row. Each message starts with the key.
    """
    splits = _open(spec, base_dir)
    train = _split_columns(spec, splits, "split", spec.split, fields)
    held_out = None
    if spec.eval_split is not None:
        held_out = _split_columns(spec, splits, "eval_split", spec.eval_split, fields)
    return train, held_out


def _datasets() -> Any:
    """The ``datasets`` module, imported now (seconds, once per process)."""
    try:
        import datasets
    except ImportError as e:
        raise DataError(
            f"data.dataset needs the Hugging Face datasets library, which does not import ({e}); install "
            "it: pip install 'rlflow[datasets]'"
        ) from e
    return datasets


def _local(path: str, base_dir: str | Path | None) -> Path:
    p = Path(path).expanduser()
    return Path(base_dir) / p if base_dir is not None and not p.is_absolute() else p


def _data_files(files: Any, base_dir: str | Path | None) -> Any:
    """``data_files`` with relative entries under ``base_dir`` (as given when ``base_dir`` is None)."""
    if base_dir is None or files is None:
        return files
    if isinstance(files, Mapping):
        return {split: _data_files(f, base_dir) for split, f in files.items()}
    if isinstance(files, list):
        return [str(_local(f, base_dir)) for f in files]
    return str(_local(files, base_dir))


def _open(spec: DatasetSpec, base_dir: str | Path | None) -> dict[str, Dataset]:
    """Split name -> rows of the whole data set (a saved single ``Dataset`` is split ``train``)."""
    datasets = _datasets()

    local = _local(spec.path, base_dir)
    if local.is_file():
        raise DataError(
            f"data.dataset.path: '{spec.path}' is a file; name a folder or a data set, or read files through "
            f"a builder (path: json, data_files: {spec.path}), or use data.train for a .jsonl/.parquet file"
        )
    # a path, never a Hub id or a builder: two slashes or more, or a leading / ./ ../ ~
    if not local.exists() and (spec.path.startswith(("/", "./", "../", "~")) or hub_ref(spec.path) is None):
        raise DataError(
            f"data.dataset.path: folder '{spec.path}' does not exist (relative to {Path.cwd()}); name a "
            "folder written by save_to_disk, a folder of data files, a builder with data_files, or a Hub id"
        )
    saved = local.is_dir() and any(
        (local / name).is_file()
        for name in (datasets.config.DATASETDICT_JSON_FILENAME, datasets.config.DATASET_STATE_JSON_FILENAME)
    )
    try:
        if saved:
            for key in ("name", "data_files", "revision"):
                if getattr(spec, key) is not None:  # load_from_disk takes none of them: refused, not ignored
                    raise DataError(
                        f"data.dataset.{key}: '{spec.path}' is a folder written by save_to_disk, which is "
                        f"read as saved; {key} applies to data sets datasets.load_dataset reads"
                    )
            loaded = datasets.load_from_disk(str(local))
        else:
            loaded = datasets.load_dataset(
                str(local) if local.is_dir() else spec.path,
                name=spec.name,
                data_files=_data_files(spec.data_files, base_dir),
                revision=spec.revision,
            )
    except (OSError, ValueError, TypeError, datasets.exceptions.DatasetsError) as e:
        raise DataError(_not_loaded(spec, e, local)) from e
    if isinstance(loaded, datasets.Dataset):
        return {"train": loaded}
    if isinstance(loaded, datasets.DatasetDict):
        return dict(loaded)
    raise DataError(f"data.dataset.path: '{spec.path}' loads as a {type(loaded).__name__}, not a data set")


def _not_loaded(spec: DatasetSpec, error: Exception, local: Path) -> str:
    """The one line saying why ``spec.path`` (the local path ``local``) did not load, and where a data set
    may come from."""
    datasets = _datasets()

    reason = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
    if "/" in spec.path and not local.exists() and hub_ref(spec.path) is not None:
        reason = f"there is no folder {local.absolute()}, so it is read as a Hub id: {reason}"
    where = (
        f"offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE), so a Hub data set must be in the cache "
        f"{datasets.config.HF_DATASETS_CACHE}: load it once where there is network, or save it with "
        "save_to_disk and name that folder"
        if datasets.config.HF_HUB_OFFLINE
        else f"a Hub id is downloaded into the cache {datasets.config.HF_DATASETS_CACHE}"
    )
    return (
        f"data.dataset.path: cannot load data set '{spec.path}': {reason}. path names a folder written by "
        f"save_to_disk, a folder of data files, a builder (json, parquet, csv) with data_files, or a Hub "
        f"data set; {where}"
    )


def _source(spec: DatasetSpec, split: str) -> str:
    return f"dataset {spec.path}{f' ({spec.name})' if spec.name else ''}, split {split}"


def _select(spec: DatasetSpec, splits: dict[str, Dataset], key: str, split: str) -> Dataset:
    """The rows ``split`` (a name, a slice ``train[:10%]``, a sum ``train+test``) names."""
    datasets = _datasets()

    for part in split.split("+"):
        name = part.split("[", 1)[0].strip()
        if name not in splits:
            raise DataError(
                f"data.dataset.{key}: split '{name}' does not exist in dataset {spec.path}"
                f"{did_you_mean(name, splits)}; splits: {', '.join(splits)}"
            )
    if split in splits:
        return splits[split]
    try:
        instructions = datasets.ReadInstruction.from_spec(split).to_absolute(
            {name: len(rows) for name, rows in splits.items()}
        )
    except (ValueError, AssertionError) as e:
        raise DataError(
            f"data.dataset.{key}: '{split}' is not a split ({e}); write e.g. train, train[:1000], "
            "train[90%:], train+test"
        ) from e
    parts = [splits[i.splitname].select(range(i.from_, i.to)) for i in instructions]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _missing_column(key: str, column: str, rows: Dataset, source: str) -> DataError:
    columns = rows.column_names
    return DataError(
        f"{key}: column '{column}' is missing from {source}{did_you_mean(column, columns)}; available "
        f"columns: {', '.join(columns) or '(none)'}"
    )


def _split_columns(
    spec: DatasetSpec, splits: dict[str, Dataset], key: str, split: str, fields: Mapping[str, str]
) -> SplitColumns:
    source = _source(spec, split)
    rows = _select(spec, splits, key, split)
    for field_key, column in fields.items():
        if column not in rows.column_names:
            raise _missing_column(f"data.fields.{field_key}", column, rows, source)
    if len(rows) == 0:
        raise DataError(f"data.dataset.{key}: {source} has no rows")
    kept = _filtered(spec, rows, source)
    if fields:
        kept = kept.select_columns(sorted(set(fields.values())))
    return SplitColumns(kept.to_dict(), source)


def _filtered(spec: DatasetSpec, rows: Dataset, source: str) -> Dataset:
    """``rows`` kept by ``spec.filter`` (every named column equal to its value or in its list of values)
    and then by ``spec.filter_fn``; a filter that keeps no row is an error."""
    for column in spec.filter:
        if column not in rows.column_names:
            raise _missing_column(f"data.dataset.filter.{column}", column, rows, source)
    with _quiet(_datasets()):
        kept = _kept(spec, rows)
    if len(kept) == 0:
        keys = [k for k in ("filter", "filter_fn") if getattr(spec, k)]
        head = rows.select(range(min(len(rows), _HEAD_ROWS)))
        seen = {c: list(dict.fromkeys(show(v) for v in head[c]))[:_SHOWN_VALUES] for c in spec.filter}
        held = "; ".join(f"column '{c}' holds e.g. {', '.join(values)}" for c, values in seen.items())
        # a YAML 7 never equals a column's '7': say which types differ
        for column, value in spec.filter.items():
            given = {type(v).__name__ for v in (value if isinstance(value, list) else [value])}
            held_types = {type(v).__name__ for v in head[column] if v is not None}
            if held_types and not given & held_types:
                held += (
                    f"; filter.{column} gives {' or '.join(sorted(given))} values, the column holds "
                    f"{' or '.join(sorted(held_types))} values (quote the value in YAML for a string)"
                )
        raise DataError(
            f"data.dataset.{' and '.join(keys)}: keeps no row of {source} ({len(rows)} rows)"
            f"{f'; {held}' if held else ''}"
        )
    return kept


def _kept(spec: DatasetSpec, rows: Dataset) -> Dataset:
    """``rows`` kept by ``spec.filter``, then by ``spec.filter_fn``."""
    kept = rows
    if spec.filter:
        wanted = [v if isinstance(v, list) else [v] for v in spec.filter.values()]

        def matches(*columns: list[Any]) -> list[bool]:
            return [
                all(v in ok for v, ok in zip(row, wanted, strict=True)) for row in zip(*columns, strict=True)
            ]

        kept = kept.filter(matches, batched=True, input_columns=list(spec.filter), keep_in_memory=True)
    if spec.filter_fn is not None and len(kept):
        kept = kept.filter(_predicate(spec.filter_fn), keep_in_memory=True)
    return kept


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """Without ``datasets``' progress bars (a filter over rows in memory draws one per split)."""
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _predicate(path: str) -> Callable[[dict[str, Any]], bool]:
    """The ``filter_fn`` at import path ``path``, wrapped to refuse a non-bool answer and to name itself
    when it raises."""
    try:
        fn = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as e:
        raise DataError(f"data.dataset.filter_fn: cannot import '{path}': {e}") from e
    if not callable(fn):
        raise DataError(f"data.dataset.filter_fn: '{path}' is not callable (got {type(fn).__name__})")

    def keep(row: dict[str, Any]) -> bool:
        try:
            answer = fn(row)
        except Exception as e:  # user code: any failure names the function and the row
            raise DataError(
                f"data.dataset.filter_fn: '{path}' raised {type(e).__name__}: {e} on row {show(row)}"
            ) from e
        if not isinstance(answer, bool):
            raise DataError(
                f"data.dataset.filter_fn: '{path}' must return True or False, got {show(answer)} for row "
                f"{show(row)}"
            )
        return answer

    return keep
