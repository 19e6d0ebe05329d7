"""Broken checkpoints of a run directory: found before a resume reads them, set aside, and named.

Checkpoints are written atomically (``RunRecorder.checkpoint``: a temp directory renamed into place), so a
run killed while saving leaves the previous one whole; a file damaged afterwards (a disk or a copy that
truncated it) is not. :func:`checkpoint_problem` checks what a resume reads: ``state.pt`` (a zip archive,
``torch.save``'s format: its directory, then every member's CRC) and each ``models/**/*.safetensors`` (its
header's tensors must end inside the file). :func:`set_aside_broken` moves every broken checkpoint newer than
the newest sound one to ``iter-XXXXXX.broken`` (no longer listed, nor ``latest``: a resume, and every resume
after it, starts from the sound one) with a :class:`CheckpointWarning` naming the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import struct
import warnings
import zipfile
from pathlib import Path

from rlflow.schedulers.records.rundir import CHECKPOINTS_DIR, list_checkpoints

__all__ = ["BROKEN_SUFFIX", "CheckpointWarning", "checkpoint_problem", "set_aside_broken"]

BROKEN_SUFFIX = ".broken"


class CheckpointWarning(UserWarning):
    """A checkpoint a resume would have read is broken and was set aside (``rlflow: warning: ...``)."""


def _safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (8-byte header length, JSON header, then the tensors'
    bytes up to the largest ``data_offsets`` end), or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{path}: {size} bytes, shorter than a safetensors header"
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            return f"{path}: truncated ({size} bytes; its header alone needs {8 + n})"
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            return f"{path}: unreadable safetensors header ({err})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"{path}: truncated ({size} of {need} bytes)"
    return None


def checkpoint_problem(path: Path) -> str | None:
    """What is wrong with checkpoint directory ``path``, naming the file; None when it is sound.

    Reads ``state.pt`` whole (each member's CRC) and each safetensors file's header (not its tensors)."""
    state = path / "state.pt"
    if not state.is_file():
        return f"{state}: missing"
    try:
        with zipfile.ZipFile(state) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{state}: unreadable, truncated or corrupt ({err})"
    if bad is not None:
        return f"{state}: member '{bad}' fails its CRC check (corrupt)"
    for weights in sorted((path / "models").rglob("*.safetensors")):
        why = _safetensors_problem(weights)
        if why is not None:
            return why
    return None


def set_aside_broken(run_dir: str | os.PathLike[str]) -> list[str]:
    """Check the run directory's checkpoints from the newest down to the first sound one; move each broken
    one to ``iter-XXXXXX.broken``, point ``checkpoints/latest`` at the sound one (removed when none is left),
    and warn (:class:`CheckpointWarning`). Returns the warnings' messages (``[]``: the newest is sound).
    Call it holding the run directory's lock."""
    found = list_checkpoints(run_dir)
    messages: list[str] = []
    while found:
        iteration, path = found[-1]
        why = checkpoint_problem(path)
        if why is None:
            break
        found.pop()
        aside = path.with_name(path.name + BROKEN_SUFFIX)
        n = 1
        while aside.exists():
            aside, n = path.with_name(f"{path.name}{BROKEN_SUFFIX}.{n}"), n + 1
        os.replace(path, aside)
        then = (
            f"resuming from the newest sound one, iteration {found[-1][0]}"
            if found
            else "no sound one is left"
        )
        message = f"checkpoint of iteration {iteration} is broken: {why}; set aside as {aside.name}, {then}"
        messages.append(message)
        warnings.warn(CheckpointWarning(message), stacklevel=2)
    if messages:
        latest = Path(run_dir) / CHECKPOINTS_DIR / "latest"
        latest.unlink(missing_ok=True)
        if found:
            os.symlink(found[-1][1].name, latest)
    return messages
