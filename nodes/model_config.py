"""The run-level check ``models.config``: a model config written in the graph file (``models.X.config``) is
one Hugging Face transformers builds as given.

transformers (5.x) checks a config's field types and its architecture's rules when it builds it (a
``StrictDataclass`` error: ``num_experts: 'four'``; that is the model check's, ``models.X: invalid model
config``), but keeps a key it does not know as a plain attribute that nothing reads: ``num_expert: 4`` on
``qwen3_moe`` leaves the model with its default 128 experts, silently. So this check refuses, naming the
file, model and key, a key that is neither a field of the architecture's config class (or of
``PreTrainedConfig``), nor a name its configuration or modeling module reads (``config.head_dim``,
``getattr(config, "head_dim", ...)``), nor one that changes the built config (``rope_theta``, which
transformers moves into ``rope_parameters``), with the closest known key as a suggestion.

A ``path``'s ``config.json`` is not checked: it is the checkpoint's own, often written by another version.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import inspect
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlflow.nodes.checks import RUN_CHECKS

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = ["config_mistakes", "known_config_keys"]


@functools.lru_cache(maxsize=32)
def _config_class(model_type: str) -> Any:
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]
    except KeyError:
        return None


@functools.lru_cache(maxsize=32)
def _module_words(config_cls: Any) -> frozenset[str]:
    """The config attributes the configuration module of ``config_cls`` and its sibling modeling module read
    or set: ``config.X``, ``self.X`` (in the configuration module) and ``getattr(config, "X"``."""
    words: set[str] = set()
    name = config_cls.__module__
    for module_name in (name, name.replace(".configuration_", ".modeling_")):
        try:  # the source text only: importing a modeling module pulls in most of transformers (seconds)
            spec = importlib.util.find_spec(module_name)
            text = Path(spec.origin).read_text() if spec is not None and spec.origin else None
        except (ImportError, OSError, ValueError):
            text = None
        if text is None:
            continue  # a config without a modeling module here: its fields still count
        words |= set(re.findall(r"\bconfig\.(\w+)", text))
        words |= set(re.findall(r"getattr\(\s*\w*config\s*,\s*[\"'](\w+)[\"']", text))
        if module_name == name:
            words |= set(re.findall(r"\bself\.(\w+)", text))
    return frozenset(words)


@functools.lru_cache(maxsize=32)
def known_config_keys(model_type: str) -> frozenset[str] | None:
    """The keys a ``model_type``'s config can usefully hold: its config class's fields and
    ``PreTrainedConfig``'s, the default instance's attributes and the identifiers its configuration and
    modeling modules use. None when transformers has no such ``model_type``."""
    cls = _config_class(model_type)
    if cls is None:
        return None
    from transformers import PreTrainedConfig

    keys = set(inspect.signature(cls.__init__).parameters) | set(
        inspect.signature(PreTrainedConfig.__init__).parameters
    )
    keys |= set(vars(cls())) | set(getattr(cls, "attribute_map", {}))
    return frozenset(keys | _module_words(cls)) - {"self", "kwargs"}


def _changes_the_config(config: dict[str, Any], key: str) -> bool:
    """Whether building ``config`` with ``key`` sets anything else than an attribute named ``key``: a legacy
    key transformers converts (``rope_theta`` into ``rope_parameters``) does, a misspelt one does not."""
    from transformers import AutoConfig

    try:
        with_key = AutoConfig.for_model(**config).to_dict()
        without = AutoConfig.for_model(**{k: v for k, v in config.items() if k != key}).to_dict()
    except Exception:  # the config does not build: _build_error reports it
        return True
    with_key.pop(key, None)
    return with_key != without


def config_mistakes(graph: Graph) -> list[str]:
    """The run-level check (:data:`rlflow.nodes.checks.RUN_CHECKS` ``models.config``) of every model config
    the graph file writes: one message per key transformers refuses or would ignore, naming the file, model
    and key. Configs of an unknown ``model_type`` are left to the checks that build the model."""
    source = graph.spec.source or "<graph>"
    out: list[str] = []
    for name, spec in graph.spec.models.items():
        if not spec.config or "model_type" not in spec.config:
            continue
        config = dict(spec.config)
        known = known_config_keys(str(config["model_type"]))
        if known is None:
            continue
        where = f"{source}: models.{name}.config"
        for key in config:
            if key in known or key == "model_type" or _changes_the_config(config, key):
                continue
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            out.append(
                f"{where}.{key}: not a setting of transformers' {config['model_type']} config (it would be "
                f"ignored and the default used){hint}"
            )
    return out


RUN_CHECKS.register("models.config")(config_mistakes)


def adapter_path_mistakes(graph: Graph) -> list[str]:
    """The run-level check ``models.path``: a model whose ``path`` is a PEFT adapter directory (a LoRA run's
    checkpoint, ``adapter_config.json`` and no ``config.json``) rather than a model; it names the file, model
    and key and how to make a model of it (``rlflow export RUN_DIR --merge``)."""
    from pathlib import Path

    source = graph.spec.source or "<graph>"
    out: list[str] = []
    for name, spec in graph.spec.models.items():
        if spec.path is None:
            continue
        path = Path(spec.path)
        if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
            out.append(
                f"{source}: models.{name}.path: '{spec.path}' holds LoRA adapters only (a PEFT adapter "
                "directory), not a model; merge them into their base first: `rlflow export RUN_DIR --merge "
                "--out DIR`, then give DIR"
            )
    return out


RUN_CHECKS.register("models.path")(adapter_path_mistakes)


def vocab_mistakes(graph: Graph) -> list[str]:
    """The run-level check ``models.vocab_size``: a model whose ``vocab_size`` is smaller than its
    tokenizer's vocabulary (``len(tokenizer)``, added tokens included) would index past its embedding table
    (an IndexError mid-run); one message per model, naming the file, the model's key and the tokenizer.
    Tokenizers that do not load are left to the checks that load them."""
    from rlflow.dataflow.context import config_int
    from rlflow.dataflow.errors import ModelError
    from rlflow.dataflow.model_spec import model_tokenizer
    from rlflow.nodes.tokenizers import load_tokenizer

    source = graph.spec.source or "<graph>"
    out: list[str] = []
    for name, spec in graph.spec.models.items():
        if spec.init_from is not None or spec.base_of is not None:
            continue  # the copy's architecture is its source's: checked there
        directory = model_tokenizer(graph.spec.models, name)
        vocab = config_int(graph, name, "vocab_size")
        if directory is None or vocab is None or not Path(directory).is_dir():
            continue
        try:
            size = len(load_tokenizer(directory, pad_from_eos=True))
        except ModelError:
            continue
        if size > vocab:
            where = f"models.{name}.config.vocab_size" if spec.config else f"models.{name}.path: vocab_size"
            out.append(
                f"{source}: {where}: {vocab} is smaller than the vocabulary of its tokenizer '{directory}' "
                f"({size} tokens): token ids {vocab}..{size - 1} would index past the embedding table"
            )
    return out


RUN_CHECKS.register("models.vocab_size")(vocab_mistakes)
