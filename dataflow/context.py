"""Context length: each model's maximum positions, and the prompt length a graph's generation leaves room for.

A generate node's sequences are ``prompt + max_new_tokens`` tokens long, and a decoder with learned or
rotary position tables of ``max_position_embeddings`` positions cannot go beyond it (Hugging Face models
index positions up to that bound). :func:`check_generation` refuses, at validation, a node whose
``max_new_tokens`` leaves no room for a prompt (or for the declared ``data.max_prompt_tokens``);
:func:`prompt_limit` is the prompt length the data rows are held to (:func:`fitted_splits`, by
``data.overlong``), which ``rlflow validate`` and ``rlflow run`` check before anything starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlflow.dataflow.chat import check_conversations
from rlflow.dataflow.data import Rows, fit_prompts, load_splits
from rlflow.dataflow.errors import GraphError
from rlflow.dataflow.model_configs import spec_model_config

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "check_generation",
    "config_int",
    "fitted_splits",
    "max_positions",
    "model_hf_config",
    "prompt_limit",
]


def model_hf_config(graph: Graph, model: str) -> dict[str, Any] | None:
    """The model's Hugging Face config dict: its ``config``, its ``path``'s ``config.json``, or those of the
    model it is ``init_from``; None when none can be read (missing files are reported elsewhere)
    (:func:`~rlflow.dataflow.model_configs.spec_model_config` of the graph's spec).

    Raises:
        GraphError: a ``config.json`` that is not JSON
            (:func:`~rlflow.dataflow.model_configs.read_config_json`).
    """
    return spec_model_config(graph.spec, model)


def config_int(graph: Graph, model: str, field: str, alias: str | None = None) -> int | None:
    """The positive integer ``field`` (or its GPT-2 style ``alias``) of ``model``'s config; when absent, the
    Hugging Face default of its ``model_type`` (``transformers.AutoConfig.for_model``, e.g. 2048
    ``max_position_embeddings`` or 32000 ``vocab_size`` for llama). None when unknown."""
    config = model_hf_config(graph, model)
    if config is None:
        return None
    value = config.get(field, config.get(alias) if alias else None)
    if value is None:
        try:
            from transformers import AutoConfig  # only for a config that leaves the field out

            value = getattr(AutoConfig.for_model(str(config.get("model_type"))), field, None)
        except (ValueError, KeyError, TypeError):  # an unknown model_type: reported by `validate`
            return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def max_positions(graph: Graph, model: str) -> int | None:
    """``max_position_embeddings`` (tokens) of ``model``'s config (:func:`config_int`). None when unknown."""
    return config_int(graph, model, "max_position_embeddings", "n_positions")


def _generate_nodes(graph: Graph) -> list[tuple[str, str, int, int]]:
    """(node, model, max_new_tokens, model positions) of every generate node whose bound is known."""
    out = []
    for name, node in graph.spec.nodes.items():
        if node.kind != "generate" or node.model is None:
            continue
        new = graph.args(name).get("max_new_tokens")
        positions = max_positions(graph, node.model)
        if isinstance(new, int) and positions is not None:
            out.append((name, node.model, new, positions))
    return out


def check_generation(graph: Graph) -> None:
    """Refuse a generate node whose ``max_new_tokens`` plus the shortest possible prompt (1 token, or
    ``data.max_prompt_tokens`` when declared) exceeds its model's ``max_position_embeddings``.

    Raises:
        GraphError: naming the graph file, the node, ``args.max_new_tokens`` (or ``data.max_prompt_tokens``
            when it alone fills the positions) and the model.
    """
    declared = graph.spec.data.max_prompt_tokens
    prompt = declared or 1
    for name, model, new, positions in _generate_nodes(graph):
        if prompt + new > positions:
            src = f"{graph.spec.source}: " if graph.spec.source else ""
            if declared and declared >= positions:  # no max_new_tokens fits: the prompt bound is the mistake
                raise GraphError(
                    f"{src}data.max_prompt_tokens: {declared} prompt tokens leave no room for node '{name}'s "
                    f"{new} new tokens within the max_position_embeddings={positions} of model '{model}'; "
                    f"lower data.max_prompt_tokens to at most {positions - new}"
                    + (
                        ""
                        if positions - new >= 1
                        else f" (and nodes.{name}.args.max_new_tokens below {positions})"
                    )
                )
            room = f"data.max_prompt_tokens={declared}" if declared else "a prompt of at least 1 token"
            raise GraphError(
                f"{src}nodes.{name}.args.max_new_tokens: {new} new tokens and {room} exceed the "
                f"max_position_embeddings={positions} of model '{model}'; lower max_new_tokens to at most "
                f"{positions - prompt}"
                + (
                    f" or data.max_prompt_tokens to at most {positions - new}"
                    if declared and positions > new
                    else ""
                )
            )


def prompt_limit(graph: Graph) -> tuple[int, str] | None:
    """The most prompt tokens a data row may have, and why: ``data.max_prompt_tokens``, or a generate
    node's model positions minus its ``max_new_tokens`` when smaller. None: no bound."""
    limits: list[tuple[int, str]] = []
    declared = graph.spec.data.max_prompt_tokens
    if declared is not None:
        limits.append((declared, f"data.max_prompt_tokens={declared}"))
    for name, model, new, positions in _generate_nodes(graph):
        limits.append(
            (positions - new, f"model '{model}' has {positions} positions and node '{name}' generates {new}")
        )
    return min(limits) if limits else None


def fitted_splits(graph: Graph, tokenizer: Any) -> tuple[Rows, Rows | None]:
    """The graph's (train, eval) rows with every tokenized prompt held to :func:`prompt_limit`
    (``rlflow.dataflow.data.fit_prompts`` by ``data.overlong``; ``truncate`` keeps the rows, which
    ``make_batch`` then cuts), and every tokenized field given as message lists checked
    (``rlflow.dataflow.chat.check_conversations``).

    Args:
        tokenizer: the data tokenizer (``rlflow.nodes.tokenizers.data_tokenizer``).

    Raises:
        DataError: an over-long prompt under ``data.overlong: error`` (file, row index, length), a malformed
            message list or one the tokenizer has no chat template for, or an unreadable data set.
    """
    train, held_out = load_splits(graph.spec.data, base_dir=None)
    for rows in (train, held_out) if held_out is not None else (train,):
        check_conversations(rows.columns, graph.spec.data.tokenize, tokenizer, rows.source)
    limit = prompt_limit(graph)
    if limit is None or "prompt" not in graph.spec.data.tokenize:
        return train, held_out
    overlong = graph.spec.data.overlong
    train = fit_prompts(train, tokenizer, *limit, overlong)
    if held_out is not None:
        held_out = fit_prompts(held_out, tokenizer, *limit, overlong)
    return train, held_out
