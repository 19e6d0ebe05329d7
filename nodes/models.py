"""Models: Hugging Face causal LMs with an ``lm``, ``value`` or ``score`` head, and their tokenizers.

A model of rlflow is one of:

- ``lm`` head: a ``transformers`` causal LM (``AutoModelForCausalLM``; Llama, Qwen2, GPT-2 families), used
  as-is so that ``save_pretrained`` / ``from_pretrained`` round-trip and generation can use its KV cache.
- ``value`` head (critic): :class:`HeadModel` = the backbone (``AutoModel``) + a linear head giving one
  value per token (PPO critic, Schulman et al. 2017, "Proximal Policy Optimization Algorithms").
- ``score`` head (reward model): :class:`HeadModel` with the same linear head, read at the last real token
  of each sequence (Ouyang et al. 2022, "Training language models to follow instructions ...").

Every model is called through the uniform functions :func:`forward_logits`, :func:`forward_values`,
:func:`forward_scores`, and over the batch format (``prompt_ids`` left-padded, ``response_ids``
right-padded) through :func:`sequence_inputs`, :func:`response_logits`, :func:`response_values`,
:func:`response_scores`.

Shape legend: B batch rows, P prompt width, R response width, T = P + R full width, V vocabulary size,
H hidden size.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rlflow.dataflow.errors import ModelError, RlflowError
from rlflow.dataflow.spec import resolve_dtype

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "HEADS",
    "HEAD_FILE",
    "HEAD_META_FILE",
    "HeadModel",
    "TokenizerInfo",
    "build_model",
    "build_model_from_spec",
    "data_tokenizer",
    "forward_logits",
    "forward_scores",
    "forward_values",
    "hf_config_from_dict",
    "last_token_index",
    "load_tokenizer",
    "model_head",
    "parse_dtype",
    "response_logits",
    "response_scores",
    "response_values",
    "save_pretrained",
    "sequence_inputs",
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
    is resolved for ``device`` (:func:`rlflow.dataflow.spec.resolve_dtype`: bfloat16 on CUDA, float32 on
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


# --------------------------------------------------------------------------------------------------
# Tokenizers


@dataclass(frozen=True)
class TokenizerInfo:
    """The special token ids generation and padding need.

    Attributes:
        pad_id: id written after a row's end (responses right-padded, prompts left-padded).
        eos_id: id that ends a response (kept inside the response mask when generated).
        bos_id: id prepended to prompts by tokenizers that do so, or ``None``.
    """

    pad_id: int
    eos_id: int
    bos_id: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenizerInfo:
        """Read pad/eos/bos ids from a Hugging Face tokenizer.

        Raises:
            ModelError: naming the missing token when the tokenizer has no pad or no EOS token.
        """
        missing = [
            name for name in ("pad_token_id", "eos_token_id") if getattr(tokenizer, name, None) is None
        ]
        if missing:
            where = getattr(tokenizer, "name_or_path", "") or "<tokenizer>"
            raise ModelError(
                f"tokenizer '{where}' has no {' and no '.join(m.removesuffix('_id') for m in missing)}; "
                "rlflow needs both a pad token and an EOS token (set them in the tokenizer's "
                "special_tokens_map / tokenizer_config.json)"
            )
        bos = getattr(tokenizer, "bos_token_id", None)
        return cls(pad_id=int(tokenizer.pad_token_id), eos_id=int(tokenizer.eos_token_id), bos_id=bos)


def load_tokenizer(path: str | Path, *, pad_from_eos: bool = False) -> Any:
    """Load a Hugging Face tokenizer from a local directory (offline).

    Args:
        path: directory written by ``tokenizer.save_pretrained``.
        pad_from_eos: when the tokenizer has no pad token, use its EOS token as pad (GPT-2 style
            tokenizers) instead of raising.

    Returns:
        a ``transformers.PreTrainedTokenizerBase``, with ``padding_side="left"`` (prompts are left-padded).

    Raises:
        ModelError: the directory is missing or unreadable, or the tokenizer lacks a pad or EOS token
            (the message names which).
    """
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"tokenizer directory '{p}' does not exist")
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError/... for unreadable dirs
        raise ModelError(f"cannot load tokenizer from '{p}': {e}") from e
    if tok.pad_token_id is None and pad_from_eos and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    TokenizerInfo.from_tokenizer(tok)  # raises ModelError naming a missing pad/eos token
    tok.padding_side = "left"
    return tok


# --------------------------------------------------------------------------------------------------
# Models


class HeadModel(nn.Module):
    """A transformer backbone plus a linear head giving one scalar per token.

    ``head_kind`` is ``"value"`` (critic: :func:`forward_values` gives ``[B,T]``) or ``"score"`` (reward
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
        """Per-token scalars ``[B,T]`` in float32."""
        out = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        return self.value_head(out.last_hidden_state).squeeze(-1).float()


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
        from rlflow.dataflow.registry import did_you_mean

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
    spec: Any,
    *,
    init_from: nn.Module | None = None,
    seed: int | None = None,
    device: str | torch.device | None = None,
    name: str = "model",
    runs_on: str | torch.device | None = None,
) -> nn.Module:
    """:func:`build_model` from a graph ``ModelSpec`` (reads ``path``, ``config``, ``head``, ``dtype``;
    ``auto`` resolved for ``runs_on``, else ``device``).

    ``init_from`` is the already-built model that ``spec.init_from`` names (resolved by the caller).
    When it is given, ``spec.path``/``spec.config`` are ignored (the copy defines the architecture).
    """
    return build_model(
        path=None if init_from is not None else getattr(spec, "path", None),
        config=None if init_from is not None else getattr(spec, "config", None),
        head=getattr(spec, "head", "lm") or "lm",
        dtype=getattr(spec, "dtype", "auto") or "auto",
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
    with _quiet_hf():
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


# --------------------------------------------------------------------------------------------------
# Uniform forward


def sequence_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-sequence inputs from the batch format.

    Args:
        prompt_ids, prompt_mask: ``[B,P]`` left-padded.
        response_ids, response_mask: ``[B,R]`` right-padded.

    Returns:
        ``(input_ids [B,T], attention_mask [B,T], position_ids [B,T])`` with ``T = P + R``,
        ``position_ids = cumsum(attention_mask) - 1`` clamped at 0 (so the first real token is position 0
        however much left padding there is). A mask-0 span *inside* a response (a tool's observation in a
        multi-turn rollout: context the sampler saw, never trained) is attended to: the response's attention
        mask is 1 up to each row's last mask-1 token, so the forward sees what the sampler saw.
    """
    input_ids = torch.cat([prompt_ids, response_ids], dim=1).long()
    seen = response_mask.long().flip(1).cummax(dim=1).values.flip(1)  # holes before the last token filled
    attention_mask = torch.cat([prompt_mask.long(), seen], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def forward_logits(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token logits of an ``lm`` model.

    Args:
        input_ids, attention_mask, position_ids: ``[B,T]``.
        keep: optional 1-D positions ``[K]`` to compute logits for (saves the ``[B,T,V]`` projection).

    Returns:
        logits ``[B,T,V]`` (or ``[B,K,V]``) in the model's dtype; position ``i`` predicts token ``i+1``.
    """
    kwargs: dict[str, Any] = {}
    if keep is not None:
        kwargs["logits_to_keep"] = keep
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        **kwargs,
    )
    return out.logits


def forward_values(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Per-token scalars ``[B,T]`` (float32) of a ``value``/``score`` :class:`HeadModel`.

    Raises:
        ModelError: the model has an ``lm`` head.
    """
    if not isinstance(model, HeadModel):
        raise ModelError("forward_values needs a model with a 'value' or 'score' head, got an 'lm' model")
    return model(input_ids, attention_mask, position_ids)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index ``[B]`` of the last position with ``attention_mask == 1`` (0 for an all-padding row)."""
    t = attention_mask.shape[1]
    positions = torch.arange(t, device=attention_mask.device).expand_as(attention_mask)
    return torch.where(attention_mask.bool(), positions, torch.zeros_like(positions)).amax(dim=1)


def forward_scores(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Sequence scores ``[B]`` (float32): the head's output at each row's last real token.

    Raises:
        ModelError: the model has an ``lm`` head.
    """
    values = forward_values(model, input_ids, attention_mask, position_ids)
    idx = last_token_index(attention_mask)
    return values.gather(1, idx[:, None]).squeeze(1)


def _check_prompt_width(prompt_ids: torch.Tensor) -> int:
    p = int(prompt_ids.shape[1])
    if p < 1:
        raise ValueError("prompt_ids needs >= 1 column: the last prompt token predicts response token 0")
    return p


def response_logits(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[B,R,V]`` predicting each response token (row ``t`` comes from position ``P+t-1``).

    Only the ``R`` needed positions go through the output projection.
    """
    p = _check_prompt_width(prompt_ids)
    r = int(response_ids.shape[1])
    input_ids, attention_mask, position_ids = sequence_inputs(
        prompt_ids, prompt_mask, response_ids, response_mask
    )
    keep = torch.arange(p - 1, p + r - 1, device=input_ids.device)
    return forward_logits(model, input_ids, attention_mask, position_ids, keep=keep)


def response_values(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    with_next: bool = False,
) -> torch.Tensor:
    """Critic values ``[B,R]`` (float32): value ``t`` is read at position ``P+t-1``.

    That is the state *before* response token ``t`` is emitted, the same position whose logits give its
    log-prob (the PPO convention of OpenRLHF/TRL: ``V(s_t)`` for action ``a_t``). ``with_next``: ``[B,R+1]``,
    entry ``t`` read at ``P+t-1`` for ``t = 0..R``, so entry ``n_b`` (``n_b`` = index after row b's last
    token) is the value of the state after the last token, V(s_T), which GAE bootstraps from when a
    response was truncated (Pardo et al. 2018).
    """
    p = _check_prompt_width(prompt_ids)
    r = int(response_ids.shape[1]) + int(with_next)
    values = forward_values(model, *sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask))
    return values[:, p - 1 : p + r - 1]


def response_scores(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Reward-model scores ``[B]`` (float32) of prompt + response, read at the last real token."""
    return forward_scores(model, *sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask))


def data_tokenizer(graph: Graph, tokenizers: Mapping[str, Any]) -> Any:
    """The tokenizer the data set is tokenized with: ``data.tokenizer`` names a model (its tokenizer, from
    ``tokenizers`` (model -> loaded tokenizer) or loaded from the model's directory) or a directory; without
    it, the first loaded tokenizer.

    Raises:
        ModelError: the tokenizer cannot be loaded.
    """
    data = graph.spec.data
    if data.tokenizer is None:
        return next((t for t in tokenizers.values() if t is not None), None)
    if data.tokenizer in tokenizers:
        return tokenizers[data.tokenizer]
    if data.tokenizer in graph.spec.models:  # a model whose tokenizer is not loaded here
        tdir = graph.spec.models[data.tokenizer].tokenizer_dir
        return load_tokenizer(tdir) if tdir is not None else None
    try:
        return load_tokenizer(data.tokenizer)
    except RlflowError:
        raise
    except Exception as e:
        raise ModelError(f"data.tokenizer '{data.tokenizer}': cannot load: {e}") from e
