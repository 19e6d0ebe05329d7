"""Models: building, loading and saving Hugging Face causal LMs with an ``lm``, ``value`` or ``score`` head.

A model of rlflow is one of:

- ``lm`` head: a ``transformers`` causal LM (``AutoModelForCausalLM``; Llama, Qwen2, GPT-2 families), used
  as-is so that ``save_pretrained`` / ``from_pretrained`` round-trip and generation can use its KV cache.
- ``value`` head (critic): :class:`HeadModel` = the backbone (``AutoModel``) + a linear head giving one
  value per token (PPO critic, Schulman et al. 2017, "Proximal Policy Optimization Algorithms").
- ``score`` head (reward model): :class:`HeadModel` with the same linear head, read at the last real token
  of each sequence (Ouyang et al. 2022, "Training language models to follow instructions ...").

Every model is called through the uniform forward of :mod:`rlflow.nodes.forward`; tokenizers are loaded by
:mod:`rlflow.nodes.tokenizers`.

Shapes (DESIGN.md): B rows, L sequence tokens (prompt + response), H hidden size.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rlflow.dataflow.errors import ModelError
from rlflow.dataflow.model_spec import ModelSpec, resolve_dtype
from rlflow.nodes import lora as _lora  # noqa: F401  (registers the models.lora check)
from rlflow.nodes import model_config as _model_config  # noqa: F401  (registers the models.config check)

__all__ = [
    "HEADS",
    "HEAD_FILE",
    "HEAD_META_FILE",
    "HeadModel",
    "build_model",
    "build_model_from_spec",
    "hf_config_from_dict",
    "model_head",
    "parse_dtype",
    "save_pretrained",
]

HEADS: tuple[str, ...] = ("lm", "value", "score")
HEAD_FILE = "value_head.safetensors"
HEAD_META_FILE = "rlflow_head.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype, device: str | torch.device | None = None) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` / ``"float16"`` (or a ``torch.dtype``) -> ``torch.dtype``; ``"auto"``
    is resolved for ``device`` (:func:`rlflow.dataflow.model_spec.resolve_dtype`: bfloat16 on CUDA, float32 on
    CPU or when no device is given).

    Raises:
        ModelError: for an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    device_type = torch.device(device).type if device is not None else "cpu"
    name = resolve_dtype(str(dtype).removeprefix("torch."), device_type)
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelError(f"unknown dtype '{dtype}'; use one of auto, float32, bfloat16, float16") from None


@contextlib.contextmanager
def _quiet_hf() -> Iterator[None]:
    """Silence transformers' per-file progress bars (they would break rlflow's own progress bar)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _no_deepspeed_probe() -> Iterator[None]:
    """Skip the DeepSpeed import of a save while DeepSpeed is not imported.

    transformers' ``save_pretrained`` unwraps the model with accelerate's ``extract_model_from_parallel``,
    which imports deepspeed whenever it is installed to test for a ``DeepSpeedEngine`` wrapper: ~1.6 CPU s
    and DeepSpeed's accelerator log line in every process's first checkpoint. A model can only be wrapped
    by DeepSpeed once deepspeed is imported, so until then accelerate's check answers "not installed".
    """
    try:
        from accelerate.utils import other
    except ImportError:  # no accelerate: transformers unwraps by itself, without deepspeed
        other = None
    installed = getattr(other, "is_deepspeed_available", None)
    if installed is None:  # another accelerate: its check left as it is
        yield
        return
    other.is_deepspeed_available = lambda: "deepspeed" in sys.modules and installed()
    try:
        yield
    finally:
        other.is_deepspeed_available = installed


class HeadModel(nn.Module):
    """A transformer backbone plus a linear head giving one scalar per token.

    ``head_kind`` is ``"value"`` (critic: :func:`forward_values` gives ``[B,L]``) or ``"score"`` (reward
    model: :func:`forward_scores` reads the value at the last real token, ``[B]``). The head is
    ``value_head: Linear(H, 1)``; parameters are ``backbone.*`` and ``value_head.*``.
    """

    def __init__(self, backbone: nn.Module, head_kind: str) -> None:
        super().__init__()
        if head_kind not in ("value", "score"):
            raise ModelError(f"HeadModel head must be 'value' or 'score', got '{head_kind}'")
        self.backbone = backbone
        self.head_kind = head_kind
        config: Any = backbone.config
        self.config = config
        hidden = int(config.hidden_size)
        param = next(backbone.parameters())
        self.value_head = nn.Linear(hidden, 1, dtype=param.dtype, device=param.device)
        # Small init (as OpenRLHF's critic): initial values near 0 regardless of the backbone scale.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-token scalars ``[B,L]`` in float32."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        # a copy, not a view: FSDP2 hooks the root module's output for the backward's all-gather, and an
        # in-place op on a view of it would skip that hook (torch warns on every forward otherwise)
        return self.value_head(out.last_hidden_state).squeeze(-1).to(torch.float32, copy=True)


def model_head(model: nn.Module) -> str:
    """``"lm"`` for a causal LM, else the :class:`HeadModel`'s ``head_kind`` (``"value"``/``"score"``)."""
    if isinstance(model, HeadModel):
        return model.head_kind
    return "lm"


def _plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            out = OmegaConf.to_container(config, resolve=True)
            assert isinstance(out, dict)
            return {str(k): v for k, v in out.items()}
    except ImportError:  # omegaconf is a dependency; keep models usable without it anyway
        pass
    return copy.deepcopy(dict(config))


def hf_config_from_dict(config: Mapping[str, Any], where: str) -> Any:
    """A Hugging Face config from a graph file's ``models.<m>.config`` mapping (no weights are built).

    Raises:
        ModelError: no or an unknown ``model_type`` (with a suggestion), key/value heads that do not divide
            the attention heads, or a config transformers rejects; ``where`` names the model.
    """
    from transformers import AutoConfig

    cfg = _plain_config(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ModelError(f"{where}: model config has no 'model_type' (e.g. llama, qwen2, gpt2)")
    from transformers import CONFIG_MAPPING

    if str(model_type) not in CONFIG_MAPPING:
        from rlflow.dataflow.errors import did_you_mean

        raise ModelError(
            f"{where}: config.model_type: unknown Hugging Face model type '{model_type}'"
            f"{did_you_mean(str(model_type), list(CONFIG_MAPPING.keys()))}"
        )
    heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and (kv <= 0 or heads % kv):
        raise ModelError(
            f"{where}: config.num_key_value_heads: {kv} must divide num_attention_heads={heads} "
            "(grouped-query attention shares each key/value head among a whole group of query heads)"
        )
    try:
        return AutoConfig.for_model(str(model_type), **cfg)
    except Exception as e:  # transformers' own validators raise huggingface_hub's strict-dataclass errors too
        cause = e.__cause__ if e.__cause__ is not None else e
        raise ModelError(f"{where}: invalid model config (model_type '{model_type}'): {cause}") from e


def _new_backbone_or_lm(hf_config: Any, head: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    if head == "lm":
        return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return HeadModel(AutoModel.from_config(hf_config, dtype=dtype), head)


def _load_dir(path: Path, head: str, dtype: torch.dtype, where: str) -> nn.Module:
    from transformers import AutoModel, AutoModelForCausalLM

    if not path.is_dir():
        raise ModelError(f"{where}: model directory '{path}' does not exist")
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise ModelError(
                f"{where}: '{path}' holds LoRA adapters only, not a model; merge them into their base first "
                "(`rlflow export RUN_DIR --merge --out DIR`) and load DIR"
            )
        raise ModelError(f"{where}: model directory '{path}' has no config.json (not a Hugging Face model)")
    meta_file = path / HEAD_META_FILE
    saved_head = json.loads(meta_file.read_text())["head"] if meta_file.is_file() else "lm"
    if head == "lm" and saved_head != "lm":
        raise ModelError(
            f"{where}: '{path}' holds a model with a '{saved_head}' head (no LM head); it cannot be "
            "loaded with head: lm"
        )
    try:
        if head == "lm":
            return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        backbone = AutoModel.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelError(f"{where}: cannot load model from '{path}': {e}") from e
    model = HeadModel(backbone, head)
    if saved_head != "lm":
        # A reward-model directory may seed a critic and vice versa: the head tensors are the same shape.
        state = load_file(str(path / HEAD_FILE))
        model.value_head.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model


def _copy_from(source: nn.Module, head: str, dtype: torch.dtype, where: str) -> nn.Module:
    src_head = model_head(source)
    if head == "lm":
        if src_head != "lm":
            raise ModelError(f"{where}: cannot init an lm-head model from a model with a '{src_head}' head")
        return copy.deepcopy(source).to(dtype)
    if src_head == "lm":
        base = source.base_model  # type: ignore[union-attr]  # HF PreTrainedModel: the backbone
        assert isinstance(base, nn.Module)
        return HeadModel(copy.deepcopy(base).to(dtype), head)
    assert isinstance(source, HeadModel)
    model = copy.deepcopy(source).to(dtype)
    model.head_kind = head
    return model


def _check_fits_in_memory(hf_config: Any, dtype: torch.dtype, where: str) -> None:
    """Refuse a config whose weights alone exceed this machine's physical memory (instead of being
    killed by the kernel). Estimate: ``12·L·H² + 2·V·H`` parameters (Kaplan et al. 2020, with untied
    embeddings), an upper bound good enough for this check."""
    hidden = int(getattr(hf_config, "hidden_size", 0) or getattr(hf_config, "n_embd", 0) or 0)
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or getattr(hf_config, "n_layer", 0) or 0)
    vocab = int(getattr(hf_config, "vocab_size", 0) or 0)
    nbytes = (12 * layers * hidden * hidden + 2 * vocab * hidden) * torch.empty(
        (), dtype=dtype
    ).element_size()
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    if nbytes > physical:
        raise ModelError(
            f"{where}: the config needs about {nbytes / 2**30:.1f} GiB of weights "
            f"(hidden {hidden}, {layers} layers, vocab {vocab}); this machine has {physical / 2**30:.1f} GiB"
        )


def build_model(
    *,
    path: str | Path | None = None,
    config: Mapping[str, Any] | None = None,
    head: str = "lm",
    dtype: str | torch.dtype = "float32",
    init_from: nn.Module | None = None,
    seed: int | None = None,
    device: str | torch.device | None = None,
    name: str = "model",
    runs_on: str | torch.device | None = None,
) -> nn.Module:
    """Build a model with an ``lm``, ``value`` or ``score`` head.

    Exactly one source of weights is used:

    - ``init_from``: a copy of that model's current weights (e.g. ``ref`` from the initial ``actor``, or a
      critic whose backbone starts from the actor; a new ``value``/``score`` head is initialised);
    - ``path``: a local Hugging Face directory (safetensors). A directory written by :func:`save_pretrained`
      for a ``value``/``score`` model also restores the head; an LM directory gives a fresh head;
    - ``config``: a Hugging Face config dict with a ``model_type`` key (``AutoConfig.for_model``), randomly
      initialised (deterministically when ``seed`` is given).

    Args:
        head: ``lm`` | ``value`` | ``score``.
        dtype: parameter dtype (``float32``, ``bfloat16``, ``float16``, or ``auto``: bfloat16 when the model
            runs on a CUDA device, float32 on CPU; :func:`parse_dtype`).
        seed: seeds the random init (``config`` source and fresh heads) without touching global RNG state.
        device: move the model there (default: stay on CPU).
        name: the model's name in the graph, used in error messages.
        runs_on: the device the model will run on when the caller moves or shards it there later (resolves
            ``dtype: auto``); default ``device``.

    Returns:
        a ``transformers`` causal LM for ``lm``, else a :class:`HeadModel`; in train mode (dropout is
        disabled by the caller via ``model.eval()`` or config ``*_dropout: 0``).

    Raises:
        ModelError: missing/unreadable directory (names the path), bad config, unknown head or dtype, or
            no source of weights given.
    """
    where = f"model '{name}'"
    if head not in HEADS:
        raise ModelError(f"{where}: unknown head '{head}'; use one of {', '.join(HEADS)}")
    if init_from is None and path is None and config is None:
        raise ModelError(f"{where}: give one of 'path', 'config' or 'init_from'")
    if path is not None and config is not None:
        raise ModelError(f"{where}: give either 'path' or 'config', not both")
    torch_dtype = parse_dtype(dtype, runs_on if runs_on is not None else device)
    with torch.random.fork_rng(devices=[]), _quiet_hf():
        if seed is not None:
            torch.manual_seed(seed)
        try:
            if init_from is not None:
                model = _copy_from(init_from, head, torch_dtype, where)
            elif path is not None:
                model = _load_dir(Path(path), head, torch_dtype, where)
            else:
                assert config is not None
                hf_config = hf_config_from_dict(config, where)
                _check_fits_in_memory(hf_config, torch_dtype, where)
                model = _new_backbone_or_lm(hf_config, head, torch_dtype)
        except ModelError:
            raise
        except Exception as e:  # transformers' config validation, allocation failures, ...
            detail = " ".join(str(e).split())[:300] or type(e).__name__
            raise ModelError(f"{where}: cannot build the model: {type(e).__name__}: {detail}") from e
    if device is not None:
        model = model.to(device)
    return model


def build_model_from_spec(
    spec: ModelSpec,
    *,
    init_from: nn.Module | None = None,
    seed: int | None = None,
    device: str | torch.device | None = None,
    name: str = "model",
    runs_on: str | torch.device | None = None,
) -> nn.Module:
    """:func:`build_model` from a graph's ``ModelSpec`` (reads ``path``, ``config``, ``head``, ``dtype``;
    ``auto`` resolved for ``runs_on``, else ``device``).

    ``init_from`` is the already-built model that ``spec.init_from`` names (resolved by the caller).
    When it is given, ``spec.path``/``spec.config`` are ignored (the copy defines the architecture).

    Raises:
        ModelError: as :func:`build_model`.
    """
    return build_model(
        path=None if init_from is not None else spec.path,
        config=None if init_from is not None else spec.config,
        head=spec.head,
        dtype=spec.dtype,
        init_from=init_from,
        seed=seed,
        device=device,
        name=name,
        runs_on=runs_on,
    )


def save_pretrained(model: nn.Module, tokenizer: Any, directory: str | Path) -> None:
    """Write ``model`` (and ``tokenizer`` unless ``None``) to ``directory`` in Hugging Face format.

    ``lm`` models: ``config.json`` + ``model.safetensors`` loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained`` (tied output heads stay tied, untied stay untied).
    ``value``/``score`` models: the backbone the same way (``AutoModel.from_pretrained`` loads it), plus
    ``value_head.safetensors`` and ``rlflow_head.json`` so :func:`build_model` restores the head.
    Writing is not atomic; checkpoint writers save to a temporary directory and rename it.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_hf(), _no_deepspeed_probe():
        _save(model, tokenizer, out)


def _save(model: nn.Module, tokenizer: Any, out: Path) -> None:
    if isinstance(model, HeadModel):
        model.backbone.save_pretrained(str(out))  # type: ignore[operator]
        head_state = {k: v.detach().contiguous().cpu() for k, v in model.value_head.state_dict().items()}
        save_file(head_state, str(out / HEAD_FILE))
        meta = {"head": model.head_kind, "hidden_size": int(model.config.hidden_size), "format": 1}
        (out / HEAD_META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    else:
        model.save_pretrained(str(out))  # type: ignore[operator]
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
