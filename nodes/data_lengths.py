"""Token lengths of a graph's training data as the runtime tokenizes them: the prompt width and the mean
response the planner prices the graph's nodes with (``rlflow.schedulers.planner.graph_problem``).

Measured on the first rows of the training split, tokenized with the data tokenizer
(:func:`rlflow.nodes.tokenizers.data_tokenizer`) into batches as the runtime builds them
(:func:`rlflow.dataflow.data.make_batch`: special tokens, left-padded prompts, EOS after a response).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from rlflow.dataflow.data import Rows, load_splits, make_batch
from rlflow.dataflow.errors import RlflowError
from rlflow.nodes.tokenizers import data_tokenizer

if TYPE_CHECKING:
    from rlflow.dataflow.batch import Batch
    from rlflow.dataflow.graph import Graph

__all__ = ["RESPONSE_KEYS", "DataLengths", "longest_data_rows", "measure_data_lengths"]

RESPONSE_KEYS = ("reference", "response")
PROMPT_ROWS, PROMPT_BATCH = 64, 16  # prompts measured, rows per batch (the padded width is per batch)
RESPONSE_ROWS = 256  # responses measured


@dataclass(frozen=True)
class DataLengths:
    """Token lengths measured on a graph's training data (None: not measured).

    Attributes:
        prompt_len: prompt tokens per row as the nodes see them: the padded width of ``PROMPT_BATCH``-row
            batches of the first ``PROMPT_ROWS`` training prompts, averaged over those batches (at least 1).
            None when the graph tokenizes no ``prompt``.
        response_mean: mean response tokens of the data set's own responses: the first of a ``reference``
            (reference responses beside the prompts of a graph that generates) or ``response`` (SFT data)
            field the graph tokenizes, the mean of its mask's row sums over the first ``RESPONSE_ROWS``
            training rows (EOS included, which a sampler emits too). None when the graph tokenizes neither.
        prompt_mean: mean real (unpadded) prompt tokens of the same ``PROMPT_ROWS`` prompts: their mask's
            row sums (what a packed forward computes of a prompt). None with ``prompt_len``.
        prompt_max: the most real prompt tokens of those prompts (a node's token budget must hold it:
            ``rlflow.nodes.token_budget``). None with ``prompt_len``.
        response_max: the most tokens of the same responses as ``response_mean``. None with it.
    All are None when the data or the tokenizer cannot be read.
    """

    prompt_len: int | None = None
    response_mean: float | None = None
    prompt_mean: float | None = None
    prompt_max: int | None = None
    response_max: int | None = None


def measure_data_lengths(graph: Graph) -> DataLengths:
    """:class:`DataLengths` of ``graph``'s training data, tokenized as the runtime tokenizes it.

    Never raises for unreadable data or tokenizer (a data, model or OS error): the lengths are then None.
    """
    data = graph.spec.data
    tokenized = tuple(data.tokenize or ()) if data is not None else ()
    if data is None or not {"prompt", *RESPONSE_KEYS} & set(tokenized):
        return DataLengths()
    try:
        train, _ = load_splits(data, base_dir=None)
        tokenizer = data_tokenizer(graph, {})
    except (RlflowError, OSError, KeyError):
        return DataLengths()
    prompt_len = prompt_max = response_max = None
    prompt_mean: float | None = None
    batches = _batches(train, tokenizer, "prompt", PROMPT_ROWS, PROMPT_BATCH) if "prompt" in tokenized else []
    if batches:
        widths = [b.tensor("prompt_ids").shape[1] for b in batches]
        prompt_len = max(1, round(sum(widths) / len(widths)))
        real = [float(n) for b in batches for n in b.tensor("prompt_mask").sum(dim=1).tolist()]
        prompt_mean = sum(real) / len(real)
        prompt_max = round(max(real))
    response_mean = None
    for key in RESPONSE_KEYS:
        batches = _batches(train, tokenizer, key, RESPONSE_ROWS, RESPONSE_ROWS) if key in tokenized else None
        if batches:
            lengths = [float(n) for b in batches for n in b.tensor(f"{key}_mask").sum(dim=1).tolist()]
            response_mean = sum(lengths) / len(lengths)
            response_max = round(max(lengths))
            break
    return DataLengths(prompt_len, response_mean, prompt_mean, prompt_max, response_max)


def _batches(train: Rows, tokenizer: Any, key: str, sample: int, batch: int) -> list[Batch] | None:
    """The first ``sample`` rows' ``key`` of ``train`` tokenized with ``tokenizer`` as the runtime does, in
    ``batch``-row batches; None when they cannot be (a missing field, no usable tokenizer)."""
    try:
        rows = train.take(range(min(sample, len(train))))
        keys = (key, "prompt") if key != "prompt" and "prompt" in rows else (key,)  # a chat reply needs it
        return [
            make_batch({k: rows[k][start : start + batch] for k in keys}, tokenizer, (key,))
            for start in range(0, len(rows[key]), batch)
        ]
    except (RlflowError, OSError, KeyError):
        return None


def longest_data_rows(graph: Graph, views: tuple[str, ...]) -> int | None:
    """The most real tokens one row of ``graph``'s training data holds over its sequences ``prompt + v`` for
    every ``v`` in ``views`` (data fields the graph tokenizes: ``response``; DPO's and reward modelling's
    ``chosen`` and ``rejected``, whose row holds both sequences), over the first ``RESPONSE_ROWS`` rows,
    tokenized as the runtime tokenizes them (what :func:`rlflow.nodes.token_budget.row_tokens` counts).

    Never raises for unreadable data or tokenizer: None then.
    """
    data = graph.spec.data
    if data is None or not views:
        return None
    keys = ("prompt", *views)
    try:
        train, _ = load_splits(data, base_dir=None)
        tokenizer = data_tokenizer(graph, {})
        rows = train.take(range(min(RESPONSE_ROWS, len(train))))
        batch = make_batch({k: rows[k] for k in keys}, tokenizer, keys)
    except (RlflowError, OSError, KeyError):
        return None
    prompt = batch.tensor("prompt_mask").long().sum(dim=1)
    total = torch.stack([prompt + batch.tensor(f"{v}_mask").long().sum(dim=1) for v in views]).sum(dim=0)
    return int(total.max()) if len(prompt) else None
