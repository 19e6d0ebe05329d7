"""Token-budget micro-batches: a node's ``max_tokens_per_micro_batch`` (the name verl and slime use).

With a budget, :func:`rlflow.nodes.train.optimize` and :func:`rlflow.nodes.train.no_grad_forward` cut each
mini-batch (this data-parallel rank's share of it) into micro-batches by tokens instead of the plan's ``m``:
each holds at most the budget of real tokens (:func:`row_tokens`), rows kept whole, balanced
(:func:`rlflow.nodes.rl.packing.budget_partition`), and its forwards run packed
(:func:`rlflow.nodes.forward.packed_forwards`). Every data-parallel rank runs the same number of them
(FSDP2 and ZeRO-3 gather weights in each forward): the ranks agree on the largest count
(``ctx.train_hooks.global_max``); a rank with fewer rows than that count runs *filler* micro-batches (its
shortest row again, loss multiplied by 0, outputs dropped), so its gradients are unchanged.

:func:`budget_mistakes` is the pre-launch check (``rlflow validate`` and before any run,
:data:`rlflow.nodes.checks.RUN_CHECKS`): a budget below the longest sequence the node can see, or on a node
without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlflow.dataflow.batch import Batch, trim_padding
from rlflow.dataflow.errors import NodeError
from rlflow.nodes.checks import RUN_CHECKS
from rlflow.nodes.context import NodeContext
from rlflow.nodes.rl.masks import RLInputError
from rlflow.nodes.rl.packing import budget_partition

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["BUDGET_KEY", "MicroBatch", "budget_micro_batches", "budget_mistakes", "row_tokens"]

BUDGET_KEY = "max_tokens_per_micro_batch"


@dataclass(frozen=True)
class MicroBatch:
    """One token-budget micro-batch: its rows (cut to the columns they use), their indices in the
    mini-batch, and whether it is a filler (a repeated row run only so every rank runs as many)."""

    batch: Batch
    rows: list[int]
    filler: bool = False


def _seen(mask: torch.Tensor) -> torch.Tensor:
    """Per-row tokens up to the last mask-1 one ``[B]`` (a response's attended span, holes included)."""
    return mask.long().flip(1).cummax(dim=1).values.sum(dim=1)


def row_tokens(batch: Batch) -> list[int]:
    """Real tokens each row's forwards compute: for every sequence view besides the prompt (a key pair
    ``X_ids``/``X_mask``: ``response``, or ``chosen`` and ``rejected``) the prompt's mask-1 tokens plus the
    view's tokens up to its last mask-1 one (what :func:`rlflow.nodes.forward.sequence_inputs` attends);
    the prompt alone when there is no view.

    Raises:
        NodeError: the batch has no ``*_mask`` sequence to count.
    """
    views = [k[: -len("_mask")] for k in batch if k.endswith("_mask") and k != "prompt_mask"]
    views = [v for v in views if f"{v}_ids" in batch]
    if "prompt_mask" not in batch and not views:
        raise NodeError(f"a token budget needs sequences to count; the batch has keys {list(batch)}")
    prompt = torch.zeros(len(batch), dtype=torch.int64)
    if "prompt_mask" in batch:
        prompt = batch.tensor("prompt_mask").long().sum(dim=1).cpu()
    total = prompt * max(1, len(views))  # the prompt once per view (once alone)
    for v in views:
        total = total + _seen(batch.tensor(f"{v}_mask")).cpu()
    return [int(n) for n in total.tolist()]


def budget_micro_batches(ctx: NodeContext, batch: Batch) -> list[MicroBatch]:
    """``batch`` (a mini-batch, this rank's share) cut by ``ctx.node.max_tokens_per_micro_batch``: as many
    micro-batches as the rank with the most needs (``ctx.train_hooks.global_max`` of each rank's first-fit
    decreasing count), each within the budget and cut to its rows' columns (``trim_padding``); fillers when
    this rank has fewer rows than that count.

    Raises:
        NodeError: no budget, a plan's ``m`` > 1 besides it, an empty share, or a row longer than the budget
            (names the node, the key and the row).
    """
    budget = ctx.node.max_tokens_per_micro_batch
    where = f"node '{ctx.node.name}': {BUDGET_KEY}"
    if budget is None:
        raise NodeError(f"{where}: not set")
    if ctx.micro_batches > 1:
        raise NodeError(f"{where}: {budget} tokens and the plan's m={ctx.micro_batches}; the budget sets m")
    if not len(batch):
        raise NodeError(f"{where}: no rows on this rank to cut into micro-batches")
    lengths = row_tokens(batch)
    try:
        parts = budget_partition(lengths, budget)
        count = int(ctx.train_hooks.global_max(len(parts)))
        parts = budget_partition(lengths, budget, min(count, len(lengths)))
    except RLInputError as e:
        raise NodeError(f"{where}: {e}") from e
    shortest = min(range(len(lengths)), key=lambda i: (lengths[i], i))
    out = [MicroBatch(trim_padding(batch.index(rows)), rows) for rows in parts]
    filler = trim_padding(batch.index([shortest]))
    out += [MicroBatch(filler, [shortest], filler=True) for _ in range(count - len(parts))]
    return out


def _response_bound(graph: Graph, name: str) -> tuple[int, str] | None:
    """The most response tokens node ``name`` reads, and from where: ``max_new_tokens`` of the generate
    node producing its ``response_ids``; None when not known."""
    node = graph.node(name)
    key = node.inputs.get("response_ids") if isinstance(node.inputs, dict) else None
    producers = graph.keys()
    if key is None or key not in producers:
        return None
    producer = producers[key]
    if producer == "data" or graph.node(producer).kind != "generate":
        return None
    new = graph.args(producer).get("max_new_tokens")
    return (new, f"nodes.{producer}.args.max_new_tokens={new}") if isinstance(new, int) else None


def _data_views(graph: Graph, name: str) -> tuple[str, ...]:
    """The data fields besides the prompt that node ``name`` reads as sequences (``X`` for every ``X_ids``
    input the data makes: ``response``, or ``chosen`` and ``rejected``)."""
    data = graph.spec.data
    if data is None:
        return ()
    node = graph.node(name)
    keys = list(node.inputs.values()) if isinstance(node.inputs, dict) else list(node.inputs)
    producers = graph.keys()
    tokenized = set(data.tokenize or ())
    found = {
        k.removesuffix("_ids")
        for k in keys
        if isinstance(k, str) and k.endswith("_ids") and producers.get(k) == "data"
        and k.removesuffix("_ids") in tokenized - {"prompt"}
    }  # fmt: skip
    return tuple(sorted(found))


def budget_mistakes(graph: Graph) -> list[str]:
    """Every ``max_tokens_per_micro_batch`` that cannot hold a row: below the longest sequence the node can
    see (the longest real prompt of the training data as the runtime tokenizes it,
    :func:`rlflow.nodes.data_lengths.measure_data_lengths`, plus the feeding generate node's
    ``max_new_tokens``, or the data's longest response), or on a node that calls no model. One message per
    node, naming the file, the node and the key (and the other end: the generate node's key)."""
    budgeted = {n: s for n, s in graph.spec.nodes.items() if s.max_tokens_per_micro_batch is not None}
    if not budgeted:
        return []
    from rlflow.nodes.data_lengths import PROMPT_ROWS, RESPONSE_ROWS, longest_data_rows, measure_data_lengths

    source = graph.spec.source or "<graph>"
    lengths = measure_data_lengths(graph)
    out: list[str] = []
    measured: dict[tuple[str, ...], int | None] = {}
    for name, spec in budgeted.items():
        budget = spec.max_tokens_per_micro_batch
        assert budget is not None
        key = f"{source}: nodes.{name}.{BUDGET_KEY}"
        if spec.model is None:
            out.append(f"{key}: node '{name}' calls no model, so it runs no forward to cut by tokens")
            continue
        views = _data_views(graph, name)
        if views and views not in measured:  # the data read once per set of views, not once per node
            measured[views] = longest_data_rows(graph, views)
        rows = measured.get(views)
        if rows is not None:  # whole data rows: every sequence of the longest one, measured together
            seqs = " + ".join(f"prompt + {v}" for v in views)
            if budget < rows:
                out.append(
                    f"{key}: {budget} tokens is below the longest row node '{name}' can see, {rows} tokens "
                    f"(the longest of the first {RESPONSE_ROWS} data rows, {seqs}); a micro-batch holds "
                    "whole rows"
                )
            continue
        parts: list[tuple[int, str]] = []
        if lengths.prompt_max is not None:
            n = lengths.prompt_max
            parts.append((n, f"the longest of the first {PROMPT_ROWS} training prompts has {n} tokens"))
        response = _response_bound(graph, name)
        if response is None and lengths.response_max is not None:
            n = lengths.response_max
            response = (n, f"the longest of the first {RESPONSE_ROWS} data responses has {n} tokens")
        if response is not None:
            parts.append(response)
        longest = sum(n for n, _ in parts)
        if parts and budget < longest:
            out.append(
                f"{key}: {budget} tokens is below the longest sequence node '{name}' can see, {longest} "
                f"tokens ({' + '.join(why for _, why in parts)}); a micro-batch holds whole rows"
            )
    return out


RUN_CHECKS.register(f"nodes.*.{BUDGET_KEY}")(budget_mistakes)
