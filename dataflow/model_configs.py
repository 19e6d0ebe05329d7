"""Each model's Hugging Face config as the graph file gives it, read once and checked before anything else.

A config is a model's ``config`` mapping, or the ``config.json`` of its ``path`` directory. Graph loading
(:func:`check_model_configs`) refuses, before any layout or plan rule reads them, the sizes a model cannot
have (transformers only warns about some: ``vocab_size: 0`` builds, then indexing fails at run time) and a
``config.json`` that is not JSON (:func:`read_config_json`: the file, the line and column, the graph's key).
The tokenizer's own vocabulary against ``vocab_size`` is a run-level check (it needs the tokenizer loaded:
:func:`rlflow.nodes.model_config.vocab_mistakes`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.dataflow.errors import GraphError

if TYPE_CHECKING:
    from rlflow.dataflow.spec import GraphSpec

__all__ = [
    "SIZE_FIELDS",
    "SPECIAL_TOKEN_FIELDS",
    "check_model_configs",
    "read_config_json",
    "size_mistake",
    "spec_model_config",
]

SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    # GPT-2 style names of the same sizes
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
)
"""Config fields that count something (tokens, units, layers, heads, positions): positive integers where
present (``null`` leaves a field to its architecture's default, e.g. ``head_dim``)."""

SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""Token ids a config names: each (or each entry of a list) an id inside ``vocab_size``."""


def read_config_json(path: str | Path, key: str, source: str | None) -> dict[str, Any] | None:
    """The dict in ``path`` (a ``config.json``); None when the file does not exist or cannot be read
    (missing files are reported by ``validate``'s file check).

    Raises:
        GraphError: the file is not a JSON object, naming the graph file ``source``, the graph's ``key``
            (``models.actor.path``), the file, and the JSON error's line and column.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return None
    src = f"{source}: " if source else ""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise GraphError(
            f"{src}{key}: {path}: not valid JSON (line {err.lineno} column {err.colno}: {err.msg})"
        ) from None
    if not isinstance(data, dict):
        raise GraphError(
            f"{src}{key}: {path}: expected a JSON object (a model config), got {type(data).__name__}"
        )
    return data


def spec_model_config(spec: GraphSpec, model: str) -> dict[str, Any] | None:
    """``model``'s Hugging Face config dict as ``spec`` gives it: its ``config``, its ``path``'s
    ``config.json``, or those of the model it is ``init_from``; None when none can be read (missing files
    are reported elsewhere).

    Raises:
        GraphError: a ``config.json`` that is not JSON (:func:`read_config_json`).
    """
    models, seen = spec.models, set()
    while model in models and model not in seen:
        seen.add(model)
        m = models[model]
        if m.config:
            return dict(m.config)
        if m.path is not None:
            return read_config_json(Path(m.path) / "config.json", f"models.{model}.path", spec.source)
        model = str(m.init_from)
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def size_mistake(config: dict[str, Any]) -> tuple[str, str] | None:
    """The first size field of ``config`` that is not a positive integer, or the first special token id
    outside ``vocab_size``: ``(field, why)``; None when every one present is sound."""
    for field in SIZE_FIELDS:
        value = config.get(field)
        if value is not None and (not _is_int(value) or value <= 0):
            return field, f"{value!r} must be a positive integer"
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return None
    for field in SPECIAL_TOKEN_FIELDS:
        value = config.get(field)
        for tok in value if isinstance(value, list) else [value]:
            if isinstance(tok, int) and not isinstance(tok, bool) and not 0 <= tok < vocab:
                return (
                    field,
                    f"token id {tok} is outside the vocabulary (vocab_size {vocab}: ids 0..{vocab - 1})",
                )
    return None


def check_model_configs(spec: GraphSpec) -> None:
    """Read every model's config (its ``config``, or its ``path``'s ``config.json`` where the file exists)
    and check its sizes (:func:`size_mistake`).

    Raises:
        GraphError: naming the graph file and ``models.<m>.config.<field>`` (or ``models.<m>.path`` and the
            file), for a size that is not a positive integer, a special token id outside the vocabulary,
            or a ``config.json`` that is not JSON.
    """
    src = f"{spec.source}: " if spec.source else ""
    for name, model in spec.models.items():
        if model.config:
            config: dict[str, Any] | None = dict(model.config)
            where = f"models.{name}.config"
        elif model.path is not None:
            file = Path(model.path) / "config.json"
            config = read_config_json(file, f"models.{name}.path", spec.source)
            where = f"models.{name}.path: {file}:"
        else:
            continue
        wrong = size_mistake(config) if config is not None else None
        if wrong is not None:
            sep = " " if where.endswith(":") else "."
            raise GraphError(f"{src}{where}{sep}{wrong[0]}: {wrong[1]}")
