"""The batch that flows along graph edges.

A :class:`Batch` is an ordered mapping ``key -> value`` where every value has the same number of rows
(``len(batch)``): a ``torch.Tensor`` whose first dim is the batch dim, or a list of per-row Python values
(e.g. answer strings). Sequence layout (B = rows, P = prompt width, R = response width):

- ``prompt_ids`` / ``prompt_mask`` [B, P]: left-padded; ``response_ids`` / ``response_mask`` [B, R]:
  right-padded; per-token response tensors (``logprobs``, ``values``, ...) [B, R]; ``scores`` [B].

A value may also be :class:`RemoteRows`: a reference to rows held by other processes (the distributed
runtime keeps node outputs on its workers). Row selection and repetition work on it without moving the
rows; :meth:`Batch.concat` and :meth:`Batch.tensor` refuse it.

:meth:`Batch.concat` pads sequence tensors of different widths: keys starting with ``prompt`` on the left,
all others on the right, with 0 (masks mark padding, so the pad id never matters).

:func:`trim_padding` cuts a batch (a micro-batch) to the token columns its rows use: the forward of a
micro-batch then costs its own longest prompt and response, not the whole call's (the remove-padding of
verl/OpenRLHF; NeMo RL packs sequences).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch

from rlflow.dataflow.errors import DataError, did_you_mean

__all__ = ["Batch", "RemoteRows", "Value", "padding_side", "trim_padding"]


class RemoteRows(abc.ABC):
    """The rows of one batch key, held by other processes; a batch carries only this reference.

    Subclasses say where the rows are (see :class:`rlflow.schedulers.runtime.distributed.transfer.RowRef`).
    Selecting or repeating rows gives a new reference to the same held rows; nothing moves until a consumer
    reads it.
    """

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of rows."""

    @abc.abstractmethod
    def index(self, rows: Sequence[int]) -> RemoteRows:
        """A reference to rows ``rows`` (positions in this reference, in that order)."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the referenced rows (padded to the common width)."""

    def repeat_interleave(self, n: int) -> RemoteRows:
        """Each row repeated ``n`` times in place (row i becomes rows i*n .. i*n+n-1)."""
        return self.index([i for i in range(len(self)) for _ in range(n)])


Value: TypeAlias = torch.Tensor | list[Any] | RemoteRows


def _rows(key: str, value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise DataError(f"batch key '{key}': a tensor needs a batch dim, got a 0-dim tensor")
        return int(value.shape[0])
    if isinstance(value, list | RemoteRows):
        return len(value)
    raise DataError(
        f"batch key '{key}': expected a torch.Tensor or a list (or RemoteRows), got {type(value).__name__}"
    )


def padding_side(key: str) -> Literal["left", "right"]:
    """Which side of a batch key's token dim (dim 1) holds the padding: ``"left"`` for prompt keys
    (``prompt_ids``, ``prompt_mask``, ...: prompts end where generation starts), ``"right"`` for the rest.

    ``key`` is the batch key as bound in the graph (a node's output key), not a function's parameter name:
    the one rule for every place that pads, concatenates or reassembles rows.
    """
    return "left" if key.startswith("prompt") else "right"


def _used_columns(mask: torch.Tensor, left: bool) -> int:
    """Columns of ``mask`` ``[B, W]`` from the first (``left``: leading padding) or up to the last column
    any row marks 1; at least 1 (a forward needs a prompt token; an all-padding response keeps one column)."""
    used = (mask != 0).any(dim=0)
    if not bool(used.any()):
        return min(1, int(mask.shape[1]))
    idx = torch.nonzero(used).flatten()
    return int(mask.shape[1]) - int(idx[0]) if left else int(idx[-1]) + 1


def trim_padding(
    batch: Batch, prompt_mask: str = "prompt_mask", response_mask: str = "response_mask"
) -> Batch:
    """``batch`` cut to the token columns its rows use (values shared, not copied).

    Prompt side: the leading columns where every row's ``prompt_mask`` is 0 go, from every left-padded
    tensor key (:func:`padding_side`) of the prompt's width ``P``. Response side: the trailing columns after
    the last column where any row's ``response_mask`` is 1 go, from every right-padded tensor key of the
    response's width ``R`` (the layout's per-token response tensors: ids, mask, log-probs, values,
    advantages, ...). A mask-0 span *inside* a response (a tool's observation before later trained tokens)
    is kept: only columns after each row's last mask-1 token go, which the forward never attends to
    (:func:`rlflow.nodes.forward.sequence_inputs`). Other keys (per-row values, other widths) are unchanged;
    a batch without a mask key is not cut on that side. Each side keeps at least one column.

    Cutting is exact for a causal forward: the dropped columns are padding that no real token attends to,
    and positions count real tokens only, so every real position sees the same inputs.
    """
    out = Batch()
    out._data = dict(batch._data)
    for mask_key, left in ((prompt_mask, True), (response_mask, False)):
        mask = batch.get(mask_key)
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            continue
        width = int(mask.shape[1])
        keep = _used_columns(mask, left)
        if keep == width:
            continue
        for key, value in batch._data.items():
            if (
                isinstance(value, torch.Tensor)
                and value.dim() >= 2
                and int(value.shape[1]) == width
                and (padding_side(key) == "left") == left
            ):
                out._data[key] = value[:, width - keep :] if left else value[:, :keep]
    return out


class Batch:
    """Ordered mapping of keys to row-aligned values (tensors with batch dim 0, or lists).

    Raises:
        DataError: when a value's row count differs from the batch's, a value has an unsupported type,
            a key is missing, or a split/concat is impossible.
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, Value] | None = None, **kwargs: Value) -> None:
        self._data: dict[str, Value] = {}
        for key, value in {**dict(data or {}), **kwargs}.items():
            self[key] = value

    # -- mapping protocol -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of rows (0 for a batch without keys)."""
        for key, value in self._data.items():
            return _rows(key, value)
        return 0

    def __getitem__(self, key: str) -> Value:
        try:
            return self._data[key]
        except KeyError:
            raise DataError(
                f"batch has no key '{key}'{did_you_mean(key, self._data)}; keys: {', '.join(self._data)}"
            ) from None

    def tensor(self, key: str) -> torch.Tensor:
        """The tensor under ``key``.

        Raises:
            DataError: no such key, or the key holds a per-row list instead of a tensor.
        """
        value = self[key]
        if not isinstance(value, torch.Tensor):
            raise DataError(f"batch key '{key}' holds a {type(value).__name__}, not a tensor")
        return value

    def list_of(self, key: str) -> list[Any]:
        """The per-row list under ``key``.

        Raises:
            DataError: no such key, or the key holds a tensor or remote rows instead of a list.
        """
        value = self[key]
        if not isinstance(value, list):
            raise DataError(f"batch key '{key}' holds a {type(value).__name__}, not a list")
        return value

    def __setitem__(self, key: str, value: Value) -> None:
        if not isinstance(key, str):
            raise DataError(f"batch keys must be strings, got {key!r}")
        rows = _rows(key, value)
        if self._data and not (len(self._data) == 1 and key in self._data) and rows != len(self):
            first = next(iter(self._data))
            raise DataError(f"batch key '{key}' has {rows} rows but '{first}' has {len(self)}")
        self._data[key] = value

    def __delitem__(self, key: str) -> None:
        self[key]  # raises DataError with a suggestion
        del self._data[key]

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def keys(self) -> list[str]:
        """Keys in insertion order."""
        return list(self._data)

    def values(self) -> list[Value]:
        return list(self._data.values())

    def items(self) -> list[tuple[str, Value]]:
        return list(self._data.items())

    def get(self, key: str, default: Any = None) -> Any:
        return self._data.get(key, default)

    def pop(self, key: str) -> Value:
        value = self[key]
        del self._data[key]
        return value

    def __repr__(self) -> str:
        parts = []
        for key, value in self._data.items():
            if isinstance(value, torch.Tensor):
                parts.append(f"{key}: {tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}")
            elif isinstance(value, RemoteRows):
                parts.append(f"{key}: remote[{len(value)}]")
            else:
                parts.append(f"{key}: list[{len(value)}]")
        return f"Batch(rows={len(self)}, {{{', '.join(parts)}}})"

    # -- row operations ---------------------------------------------------------------------------
    def select(self, keys: Iterable[str]) -> Batch:
        """A new batch holding only ``keys`` (in that order); values are shared, not copied."""
        return Batch({key: self[key] for key in keys})

    def index(self, idx: torch.Tensor | Sequence[int]) -> Batch:
        """Rows ``idx`` (a 1-D int tensor or list of ints; a bool tensor selects by mask)."""
        if isinstance(idx, torch.Tensor):
            if idx.dtype == torch.bool:
                idx = idx.nonzero().flatten()
            positions = [int(i) for i in idx.tolist()]
            tidx = idx.long()
        else:
            positions = [int(i) for i in idx]
            tidx = torch.tensor(positions, dtype=torch.long)
        rows = len(self)
        bad = [i for i in positions if not -rows <= i < rows]
        if bad:
            raise DataError(f"batch index {bad[0]} out of range for {rows} rows")
        out = Batch()
        for key, value in self._data.items():
            if isinstance(value, torch.Tensor):
                out._data[key] = value.index_select(0, tidx.to(value.device))
            elif isinstance(value, RemoteRows):
                out._data[key] = value.index([i % rows for i in positions])
            else:
                out._data[key] = [value[i] for i in positions]
        return out

    def split(self, n: int) -> list[Batch]:
        """``n`` equal consecutive chunks of rows.

        Raises:
            DataError: if ``n`` < 1 or the row count is not divisible by ``n``.
        """
        rows = len(self)
        if n < 1 or rows % n:
            raise DataError(f"cannot split a batch of {rows} rows into {n} equal parts")
        size = rows // n
        return [self.index(list(range(i * size, (i + 1) * size))) for i in range(n)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of ``batches`` one after another. All batches must hold the same keys.

        Tensors whose dim 1 widths differ are padded with 0 to the widest: on the left for keys starting
        with ``prompt`` (left-padded prompts), on the right otherwise. Other dims must match.
        """
        if not batches:
            raise DataError("cannot concatenate an empty list of batches")
        keys = batches[0].keys()
        for b in batches[1:]:
            if set(b.keys()) != set(keys):
                raise DataError(f"cannot concatenate batches without the same keys: {keys} and {b.keys()}")
        out = Batch()
        for key in keys:
            values = [b._data[key] for b in batches]
            if all(isinstance(v, torch.Tensor) for v in values):
                tensors: list[torch.Tensor] = [v for v in values if isinstance(v, torch.Tensor)]
                out._data[key] = torch.cat(_pad_to_common_width(key, tensors), dim=0)
            elif all(isinstance(v, list) for v in values):
                out._data[key] = [x for v in values if isinstance(v, list) for x in v]
            elif any(isinstance(v, RemoteRows) for v in values):
                raise DataError(f"batch key '{key}': cannot concatenate rows held by other processes")
            else:
                raise DataError(f"batch key '{key}' mixes tensors and lists across batches")
        return out

    def repeat_interleave(self, n: int) -> Batch:
        """Each row repeated ``n`` times in place (row i becomes rows i*n .. i*n+n-1): per-prompt keys
        expanded to the ``n`` samples of each prompt."""
        if n < 1:
            raise DataError(f"repeat_interleave needs n >= 1, got {n}")
        out = Batch()
        for key, value in self._data.items():
            if isinstance(value, torch.Tensor):
                out._data[key] = value.repeat_interleave(n, dim=0)
            elif isinstance(value, RemoteRows):
                out._data[key] = value.repeat_interleave(n)
            else:
                out._data[key] = [x for x in value for _ in range(n)]
        return out

    def update(self, other: Mapping[str, Value] | Batch) -> None:
        """Add or replace keys from ``other`` (row counts must match)."""
        items = other.items()
        for key, value in items:
            self[key] = value

    def to(self, device: torch.device | str) -> Batch:
        """A batch with every tensor moved to ``device`` (lists and remote rows are shared)."""
        out = Batch()
        for key, value in self._data.items():
            out._data[key] = value.to(device) if isinstance(value, torch.Tensor) else value
        return out


def _pad_to_common_width(key: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    if all(t.shape[1:] == tensors[0].shape[1:] for t in tensors):
        return tensors
    if any(t.dim() < 2 for t in tensors) or any(t.shape[2:] != tensors[0].shape[2:] for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise DataError(f"cannot concatenate batch key '{key}': shapes {shapes} differ beyond dim 1")
    width = max(int(t.shape[1]) for t in tensors)
    left = padding_side(key) == "left"
    padded = []
    for t in tensors:
        extra = width - int(t.shape[1])
        if extra:
            pad_shape = (t.shape[0], extra, *t.shape[2:])
            pad = torch.zeros(pad_shape, dtype=t.dtype, device=t.device)
            t = torch.cat([pad, t] if left else [t, pad], dim=1)
        padded.append(t)
    return padded
