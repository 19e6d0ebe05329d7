"""The run's prompt record, ``<run_dir>/prompts.jsonl``: which data rows each iteration's train step consumed.

One JSON line per finished iteration, written when the iteration completes (beside its metrics)::

    {"iteration": 7, "epoch": 0, "ids": [1412, 87, 1630, ...]}

``ids`` are the prompts' stable ids in the order the train nodes received them, one per group (a prompt and
its ``n`` samples): a row's ``id`` field where the training rows have one (``data.fields``), else its index
in the training split as the run reads it (:attr:`rlflow.dataflow.data.PromptStream.drawn`). ``epoch`` is
the pass over the data the rows came from. A batch never mixes epochs; the rounds of a graph with a filter
node (dynamic sampling) may, and their iteration then has one line per epoch, in train order; there the ids
are those of the groups that passed the filter and were kept, not every prompt the rounds drew. So "every
prompt trained exactly once per epoch, in the same groups as an uninterrupted run" is a comparison of two
such files, across any number of kills and resumes: a resume drops the lines after its checkpoint
(:func:`drop_prompts_after`), as it drops the other records.

Lines are appended (one ``write`` each); a run killed inside one leaves a torn last line, which
:func:`read_prompts` skips with a warning and the next resume removes.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

__all__ = ["PROMPTS_FILE", "append_prompts", "drop_prompts_after", "read_prompts"]

PROMPTS_FILE: Final = "prompts.jsonl"


def append_prompts(run_dir: str | os.PathLike[str], iteration: int, epoch: int, ids: Sequence[Any]) -> Path:
    """Append iteration ``iteration``'s line (``epoch``, the prompts' ``ids`` in train order) to the record.

    Raises:
        TypeError: an id is not JSON-serialisable (an ``id`` field of another type).
    """
    path = Path(run_dir) / PROMPTS_FILE
    line = json.dumps({"iteration": int(iteration), "epoch": int(epoch), "ids": list(ids)}) + "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
    return path


def _lines(path: Path) -> list[tuple[int, dict[str, Any] | None, str]]:
    """``(line number, parsed entry or None when unreadable, text)`` of every non-empty line."""
    out: list[tuple[int, dict[str, Any] | None, str]] = []
    for number, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            entry = json.loads(text)
        except json.JSONDecodeError:
            entry = None
        ok = isinstance(entry, dict) and isinstance(entry.get("iteration"), int)
        out.append((number, entry if ok else None, text))
    return out


def read_prompts(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The record's entries in file order (``[]`` without a record); an unreadable line (a run killed while
    writing it) is skipped with a warning naming the file and line."""
    path = Path(run_dir) / PROMPTS_FILE
    if not path.exists():
        return []
    entries = []
    for number, entry, _ in _lines(path):
        if entry is None:
            warnings.warn(f"{path}:{number}: unreadable prompt-record line skipped", stacklevel=2)
            continue
        entries.append(entry)
    return entries


def drop_prompts_after(run_dir: str | os.PathLike[str], iteration: int) -> None:
    """Keep the lines of iterations up to ``iteration`` (a resume from its checkpoint), dropping later and
    unreadable ones; the file is replaced atomically."""
    path = Path(run_dir) / PROMPTS_FILE
    if not path.exists():
        return
    kept = [text for _, entry, text in _lines(path) if entry is not None and entry["iteration"] <= iteration]
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("".join(t + "\n" for t in kept))
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)
