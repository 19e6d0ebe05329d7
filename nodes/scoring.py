"""Scoring node functions as a reward outside any node: the held-out evaluation's reward.

A *scoring function* is a registered ``inference`` node function that needs no model, reads
``response_ids`` and ``response_mask`` and outputs exactly ``scores`` ``[B]`` (``code_reward``, the sandboxed
execution reward; ``rule_reward``; a reward service's node). ``run.eval.reward`` may name one instead of a
rule reward: the evaluation then scores its greedy responses with it, its other inputs (``tests``,
``answer``) read from the held-out rows' data fields, its arguments ``run.eval.reward_args``, else those of
the graph's first node running it, else its schema's defaults. A name that is both a scoring function and a
rule reward is the scoring function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlflow.dataflow.args import ArgError
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, NodeFunction
from rlflow.nodes.context import NodeContext

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["GENERATED", "score_with", "scoring_args", "scoring_function", "scoring_mistakes"]

GENERATED = ("response_ids", "response_mask")
"""The inputs a scoring function reads from the generation; its others come from the data set."""


def scoring_function(name: str) -> NodeFunction | None:
    """The scoring node function registered as ``name`` (module docstring), else ``None`` (no node function
    of that name, or one that needs a model, reads no response or outputs more than ``scores``)."""
    if name not in NODE_FUNCTIONS:
        return None
    fn = NODE_FUNCTIONS.get(name)
    scores_only = fn.outputs == ("scores",) and fn.kind == "inference"
    return fn if scores_only and not fn.needs_model and set(GENERATED) <= set(fn.inputs) else None


def scoring_args(graph: Graph, fn: NodeFunction) -> dict[str, Any]:
    """``fn``'s arguments for the evaluation, bound (defaults filled): ``run.eval.reward_args``, else the args
    of the graph's first node running ``fn``, else none given.

    Raises:
        ArgError: an unknown argument or a bad value.
    """
    given = graph.spec.run.eval.get("reward_args")
    if given is None:
        node = next((n for n in graph.nodes.values() if n.function == fn.name), None)
        given = graph.args(node.name) if node is not None else {}
    return fn.bind(dict(given))


def scoring_mistakes(graph: Graph, fn: NodeFunction) -> list[str]:
    """Mistakes of ``run.eval.reward`` naming the scoring function ``fn``: arguments that do not bind or that
    its ``args_check`` refuses (a sandbox that cannot start), and inputs that ``data.fields`` does not map
    (when it maps any), one message each naming file and key."""
    where = f"{graph.spec.source or '<graph>'}: run.eval"
    try:
        args = scoring_args(graph, fn)
    except ArgError as e:
        return [f"{where}.reward_args.{e.key}: {e}"]
    out = fn.args_check(args, f"{where}.reward_args") if fn.args_check is not None else []
    fields = graph.spec.data.fields
    needed = [k for k in fn.inputs if k not in GENERATED and k not in fn.optional_inputs]
    return out + [
        f"{where}.reward: {fn.name} reads '{k}' from the held-out rows, but data.fields maps no key '{k}'"
        for k in needed
        if fields and k not in fields
    ]


def score_with(
    fn: NodeFunction,
    args: dict[str, Any],
    rows: Batch,
    response_ids_BR: torch.Tensor,
    response_mask_BR: torch.Tensor,
    *,
    tokenizer: Any,
    device: torch.device,
) -> tuple[list[float], dict[str, float]]:
    """``fn`` called as the runtime calls a model-free node, on responses ``[B, R]`` to the prompts of
    ``rows`` (one response per row; its data fields give ``fn``'s other inputs): the scores ``[B]`` as
    floats and the call's metrics but the scores' own (``critic/score/*``).

    Raises:
        DataError: ``rows`` lacks an input of ``fn``.
        NodeError: the function's own (e.g. a sandbox that cannot start).
    """
    node = NodeSpec(name="eval_reward", kind=fn.kind, function=fn.name, args=dict(args))
    ctx = NodeContext(node=node, model=None, tokenizer=tokenizer, device=device)
    data = {
        k: rows[k] for k in fn.inputs if k not in GENERATED and (k in rows or k not in fn.optional_inputs)
    }
    batch = Batch({"response_ids": response_ids_BR, "response_mask": response_mask_BR, **data})
    result = fn.fn(ctx, batch, **args)
    own = ("critic/score/", "scores/")  # the scores' mean, max, min: the evaluation reports its own
    metrics = {k: float(v) for k, v in result.metrics.items() if not k.startswith(own)}
    return [float(s) for s in result.outputs["scores"].tolist()], metrics
