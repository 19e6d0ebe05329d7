"""A generate node's sampling arguments against its model and the algorithm, checked when the graph is built.

- :func:`check_stop_tokens`: every integer in ``args.stop_tokens`` is a token id of the model, i.e. in
  ``0 .. vocab_size - 1`` (``vocab_size`` of the model's config, :func:`rlflow.dataflow.context.config_int`).
  An id outside it can never be sampled: the built-in loop would never match it and vLLM accepts it
  silently, so responses would run to ``max_new_tokens``. When the config is unknown here only negative ids
  are refused; the node checks the built model's vocabulary when it resolves its stop tokens
  (``rlflow.nodes.functions``).
- :func:`greedy_group_warnings`: greedy decoding (``greedy: true`` or ``temperature: 0``) with ``n`` > 1
  samples per prompt makes the ``n`` responses to a prompt identical, so group-relative advantages (GRPO,
  Shao et al. 2024; RLOO, Ahmadian et al. 2024: each reward minus its group's mean) are all zero.

Both hold for either engine (``builtin`` or ``vllm``); ``rlflow validate`` and ``rlflow run`` see them
through :class:`~rlflow.dataflow.graph.Graph`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlflow.dataflow.context import config_int
from rlflow.dataflow.errors import GraphError

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["check_stop_tokens", "greedy_group_warnings"]


def _generate_args(graph: Graph) -> list[tuple[str, str | None, dict[str, Any]]]:
    """(node, model, checked args) of every generate node."""
    return [
        (name, node.model, graph.args(name))
        for name, node in graph.spec.nodes.items()
        if node.kind == "generate"
    ]


def check_stop_tokens(graph: Graph) -> None:
    """Refuse a generate node's ``args.stop_tokens`` entry that is not a token of its model: an id below 0
    or at least the model's ``vocab_size``, or an entry neither an integer id nor a vocabulary string.

    Raises:
        GraphError: naming the graph file, the node, ``args.stop_tokens``, the entry and the model's
            vocabulary size.
    """
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    for name, model, args in _generate_args(graph):
        for key in ("stop_tokens", "call_stop_tokens"):  # call_stop_tokens: agent_generate's tool calls
            _check_ids(src, name, model, key, args.get(key), graph)


def _check_ids(src: str, name: str, model: str | None, key: str, stops: Any, graph: Graph) -> None:
    if not isinstance(stops, list):
        return
    where = f"{src}nodes.{name}.args.{key}"
    vocab = config_int(graph, model, "vocab_size") if model is not None else None
    for tok in stops:
        if isinstance(tok, str):
            continue  # a vocabulary string: resolved (and checked) with the tokenizer by the node
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise GraphError(f"{where}: {tok!r} is neither a token id (an integer) nor a vocabulary string")
        if tok < 0:
            raise GraphError(f"{where}: stop token id {tok} is negative; token ids start at 0")
        if vocab is not None and tok >= vocab:
            raise GraphError(
                f"{where}: stop token id {tok} is outside the vocabulary of model '{model}' "
                f"(vocab_size {vocab}: ids 0..{vocab - 1}); it can never be generated, so it would "
                "never end a response"
            )


def greedy_group_warnings(graph: Graph) -> list[str]:
    """One message per generate node that decodes greedily (``greedy: true`` or ``temperature: 0``) with
    ``n`` > 1 samples per prompt, naming the graph file, the node and both keys."""
    src = f"{graph.spec.source}: " if graph.spec.source else ""
    out = []
    for name, _, args in _generate_args(graph):
        n = args.get("n")
        if not isinstance(n, int) or n <= 1:
            continue
        if args.get("greedy") is True:
            key, setting = "greedy", "greedy: true"
        elif args.get("temperature") == 0:
            key, setting = "temperature", "temperature: 0"
        else:
            continue
        out.append(
            f"{src}nodes.{name}.args.{key}: greedy decoding ({setting}) with nodes.{name}.args.n: {n} "
            f"samples per prompt makes the {n} responses to a prompt identical, so group-relative advantages "
            "(GRPO, RLOO) are all zero and the policy gets no gradient from them; sample (temperature > 0) "
            "or set n: 1"
        )
    return out
