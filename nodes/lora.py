"""LoRA models: low-rank adapters injected into a model's linear layers with ``peft``, the base view with the
adapters off, and the adapter weights on their own (for checkpoints, syncs and exports).

A LoRA model stays the model class it was (a ``transformers`` causal LM or a
:class:`~rlflow.nodes.models.HeadModel`): ``peft.inject_adapter_in_model`` swaps each targeted ``nn.Linear``
for a ``peft`` LoRA layer in place, so every forward, generation loop and packed call of rlflow runs it
unchanged. A targeted layer computes ``W x + (alpha / rank) · B A x`` (Hu et al. 2022, "LoRA: Low-Rank
Adaptation of Large Language Models", eq. 3); ``W`` (the base) is frozen, ``A [rank, in]`` and
``B [out, rank]`` train. A ``value``/``score`` model carries its adapters in the backbone; its head trains in
full unless ``lora.train_head`` is false.

The adapter weights are named as ``peft`` saves them (``base_model.model.<module>.lora_A.weight``, the
``default`` adapter's name dropped), so an adapter directory written here loads with
``peft.PeftModel.from_pretrained`` on the base model.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rlflow.dataflow.errors import ModelError
from rlflow.dataflow.model_spec import LoraSpec
from rlflow.nodes.checks import RUN_CHECKS

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_FILE",
    "PEFT_PREFIX",
    "adapter_bytes",
    "adapter_state_dict",
    "adapters_disabled",
    "apply_lora",
    "has_adapters",
    "is_adapter_dir",
    "load_adapter",
    "lora_config",
    "lora_mistakes",
    "save_adapter",
    "set_adapter_state",
    "unload_adapters",
    "write_adapter_dir",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
# peft's names for a PeftModel's weights: the tuner (``base_model``) wrapping the model (``model``)
PEFT_PREFIX = "base_model.model."
_HEAD_PREFIX = "value_head."


def lora_config(spec: LoraSpec) -> Any:
    """The ``peft.LoraConfig`` of a graph's ``lora`` section (``r``, ``lora_alpha``, ``lora_dropout``,
    ``target_modules``, ``init_lora_weights``; bias untouched)."""
    from peft import LoraConfig

    targets = spec.target_modules
    options: dict[str, Any] = {  # peft annotates lora_alpha as int and the init as literals; floats work
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": targets if isinstance(targets, str) else list(targets),
        "init_lora_weights": True if spec.init == "default" else spec.init,
        "bias": "none",
    }
    return LoraConfig(**options)


def _target(module: nn.Module) -> nn.Module:
    """Where the adapters live: the backbone of a value/score model, else the causal LM itself."""
    backbone = getattr(module, "backbone", None)
    return backbone if isinstance(backbone, nn.Module) and hasattr(module, "value_head") else module


def _linear_names(module: nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, m in module.named_modules() if isinstance(m, nn.Linear)})


def _inject(target: nn.Module, spec: LoraSpec, where: str) -> None:
    """``peft.inject_adapter_in_model`` of ``spec`` into ``target``, its refusals as :class:`ModelError`."""
    from peft import inject_adapter_in_model
    from peft.tuners.tuners_utils import check_target_module_exists

    if isinstance(spec.target_modules, tuple):  # peft refuses only a list matching nothing at all
        names = [name for name, _ in target.named_modules()]
        single = {t: lora_config(replace(spec, target_modules=(t,))) for t in spec.target_modules}
        unmatched = [t for t, c in single.items() if not any(check_target_module_exists(c, n) for n in names)]
        if unmatched:
            raise ModelError(
                f"{where}.lora.target_modules: {unmatched} match no layer of the model; its linear layers "
                f"are {', '.join(_linear_names(target))}"
            )
    try:
        inject_adapter_in_model(lora_config(spec), target)
    except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
        text = " ".join(str(e).split())
        if "not found" in text or "target modules" in text.lower():
            given = spec.target_modules if isinstance(spec.target_modules, str) else list(spec.target_modules)
            raise ModelError(
                f"{where}.lora.target_modules: {given} match no layer of the model; its linear layers are "
                f"{', '.join(_linear_names(target))}"
            ) from None
        raise ModelError(f"{where}.lora: peft refuses the adapters: {text}") from e


def apply_lora(module: nn.Module, spec: LoraSpec, where: str = "model", seed: int | None = None) -> None:
    """Inject ``spec``'s adapters into ``module`` in place (``peft.inject_adapter_in_model``) and leave only
    the adapters trainable (plus a ``value``/``score`` head unless ``spec.train_head`` is false).

    The adapters start at ``B = 0``, so the model computes exactly what its base did. ``seed`` seeds the
    random ``A`` (on the module's device, without touching the global RNG state), so every process that
    builds the model draws the same adapters; ``None``: the global RNG draws them.

    Raises:
        ModelError: ``target_modules`` matches no module of the model (names the key and the model's linear
            layers), or ``peft`` refuses the configuration.
    """
    target = _target(module)
    cuda = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda) if seed is not None else contextlib.nullcontext():
        if seed is not None:
            torch.manual_seed(seed)
        _inject(target, spec, where)
    if target is not module:
        head = getattr(module, "value_head")  # noqa: B009  (a HeadModel's head; _target checked it)
        head.requires_grad_(spec.train_head is not False)


def lora_mistakes(graph: Graph) -> list[str]:
    """The run-level check ``models.lora`` (:data:`rlflow.nodes.checks.RUN_CHECKS`): a LoRA model whose
    ``target_modules`` match no layer of its architecture, found before anything is built by injecting the
    adapters (as :func:`apply_lora` does) into the model built on the ``meta`` device (shapes only: no
    memory, no weights). One message per model, naming the file, model and key. A model whose config cannot
    be read or built is left to the checks that report that (missing files, ``models.config``, the build)."""
    from rlflow.dataflow.context import model_hf_config

    source = graph.spec.source or "<graph>"
    out: list[str] = []
    if all(m.lora is None for m in graph.spec.models.values()):
        return out  # transformers' model classes take seconds to import: only for a LoRA model
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for name, m in graph.spec.models.items():
        config = model_hf_config(graph, name) if m.lora is not None else None
        if m.lora is None or config is None or "model_type" not in config:
            continue
        config = dict(config)
        try:
            hf_config = AutoConfig.for_model(str(config.pop("model_type")), **config)
            with torch.device("meta"):
                auto = AutoModelForCausalLM if m.head == "lm" else AutoModel  # a value/score model's backbone
                skeleton = auto.from_config(hf_config)
        except Exception:  # transformers refuses the config: reported by the checks named above
            continue
        try:
            with torch.device("meta"):
                _inject(skeleton, m.lora, f"models.{name}")
        except ModelError as e:
            out.append(f"{source}: {e}")
            continue
        widths = {
            layer: min(mod.in_features, mod.out_features)
            for layer, mod in skeleton.named_modules()
            if isinstance(mod, nn.Linear) and layer.endswith(".base_layer")
        }
        narrow = {
            k.removesuffix(".base_layer").rsplit(".", 1)[-1]: w for k, w in widths.items() if w < m.lora.rank
        }
        if narrow:
            out.append(
                f"{source}: models.{name}.lora.rank: {m.lora.rank} is above the smaller side of "
                f"{', '.join(f'{k} ({w})' for k, w in sorted(narrow.items()))}: B A cannot have a rank above "
                "it, the extra rank only costs memory"
            )
    return out


RUN_CHECKS.register("models.lora")(lora_mistakes)


def has_adapters(module: nn.Module) -> bool:
    """Whether ``module`` carries ``peft`` LoRA layers (:func:`apply_lora`)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in module.modules())


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base inside the block: every LoRA layer computes ``W x`` only (peft's
    ``enable_adapters(False)``), on the same weights (no copy). The adapters' ``requires_grad`` flags are
    restored on exit (peft's toggle changes them)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    flags = [(p, p.requires_grad) for layer in layers for p in layer.parameters()]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for p, flag in flags:
            p.requires_grad_(flag)


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The trained weights of a LoRA model, named as ``peft`` saves them (``base_model.model.…lora_A.weight``)
    plus ``value_head.*`` for a value/score model whose head trains; tensors are the live ones (detach and
    copy before changing them). Shapes ``A [rank, in]``, ``B [out, rank]``."""
    from peft import get_peft_model_state_dict

    target = _target(module)
    # never the frozen base weight of a targeted embedding or output layer (peft's "auto" would save it)
    peft_state = get_peft_model_state_dict(target, save_embedding_layers=False)
    state = {PEFT_PREFIX + k: v for k, v in peft_state.items()}
    if target is not module:
        head = getattr(module, "value_head")  # noqa: B009
        if any(p.requires_grad for p in head.parameters()):
            state.update({_HEAD_PREFIX + k: v for k, v in head.state_dict().items()})
    return state


def adapter_bytes(module: nn.Module) -> int:
    """Bytes of :func:`adapter_state_dict`: what an adapter sync or checkpoint moves."""
    return sum(t.numel() * t.element_size() for t in adapter_state_dict(module).values())


def set_adapter_state(module: nn.Module, state: Mapping[str, torch.Tensor], where: str = "model") -> None:
    """Copy :func:`adapter_state_dict`-named tensors into ``module``'s adapters (and head) in place.

    Raises:
        ModelError: a name the model's adapters lack, or one of them missing from ``state``.
    """
    from peft import set_peft_model_state_dict

    target = _target(module)
    expected = set(adapter_state_dict(module))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelError(
            f"{where}: the adapter weights do not fit the model's adapters (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}); were they saved with another lora section?"
        )
    peft_state = {k.removeprefix(PEFT_PREFIX): v for k, v in state.items() if k.startswith(PEFT_PREFIX)}
    with torch.no_grad():
        set_peft_model_state_dict(target, peft_state)
        if target is not module:
            head_state = {
                k.removeprefix(_HEAD_PREFIX): v for k, v in state.items() if k.startswith(_HEAD_PREFIX)
            }
            if head_state:
                getattr(module, "value_head").load_state_dict(head_state)  # noqa: B009


def is_adapter_dir(directory: str | Path) -> bool:
    """Whether ``directory`` holds a PEFT adapter (:func:`save_adapter`), not a whole model."""
    return (Path(directory) / ADAPTER_CONFIG_FILE).is_file()


def save_adapter(
    module: nn.Module, spec: LoraSpec, directory: str | Path, base: str | None = None, tokenizer: Any = None
) -> None:
    """Write ``module``'s adapters as a PEFT adapter directory: ``adapter_config.json`` (``peft.LoraConfig``,
    ``base_model_name_or_path`` = ``base``) and ``adapter_model.safetensors`` (:func:`adapter_state_dict`),
    plus the tokenizer when given. ``peft.PeftModel.from_pretrained(base_model, directory)`` loads it.
    Not atomic: checkpoint writers save to a temporary directory and rename it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = lora_config(spec)
    config.base_model_name_or_path = base
    if not isinstance(spec.target_modules, str):
        config.target_modules = sorted(spec.target_modules)
    write_adapter_dir(out, config, adapter_state_dict(module))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def write_adapter_dir(
    directory: Path, config: Any, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> int:
    """Write ``config`` (a ``peft.LoraConfig``) and the adapter tensors ``state`` (PEFT names) as a PEFT
    adapter directory, on the CPU (in ``dtype`` when given); returns the tensors' bytes as written."""
    directory.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(directory))
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    save_file(tensors, str(directory / ADAPTER_FILE), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


def load_adapter(
    module: nn.Module, directory: str | Path, where: str = "model", spec: LoraSpec | None = None
) -> None:
    """Load :func:`save_adapter`'s weights into ``module``'s adapters (which :func:`apply_lora` injected with
    the same ``lora`` section). With ``spec`` (the graph's ``lora`` section of the model ``where`` names, as
    ``models.<m>``), the directory's rank, alpha and target modules must be the section's: adapters trained
    at another scale ``alpha / rank`` would load into another policy.

    Raises:
        ModelError: no adapter in ``directory``, a rank, alpha or target modules other than ``spec``'s (naming
            the key), or weights that do not fit (:func:`set_adapter_state`).
    """
    path = Path(directory) / ADAPTER_FILE
    if not path.is_file():
        raise ModelError(f"{where}: '{directory}' holds no adapter ({ADAPTER_FILE} is missing)")
    meta = json.loads((Path(directory) / ADAPTER_CONFIG_FILE).read_text())
    if meta.get("peft_type") not in (None, "LORA"):
        raise ModelError(f"{where}: '{directory}' holds a {meta.get('peft_type')} adapter, not LoRA")
    if spec is not None:
        saved_targets = meta.get("target_modules")
        wanted = spec.target_modules if isinstance(spec.target_modules, str) else sorted(spec.target_modules)
        have = saved_targets if isinstance(saved_targets, str) else sorted(saved_targets or ())
        for key, had, now in (
            ("rank", meta.get("r"), spec.rank),
            ("alpha", meta.get("lora_alpha"), spec.alpha),
            ("target_modules", have, wanted),
        ):
            if had != now and not (
                isinstance(had, int | float) and isinstance(now, int | float) and had == now
            ):
                raise ModelError(
                    f"{where}.lora.{key}: the adapters in '{directory}' were trained with {key} {had!r}, the "
                    f"graph says {now!r}; resume with the lora section they were trained with"
                )
    try:
        set_adapter_state(module, load_file(str(path)), where)
    except RuntimeError as e:  # a shape that does not fit: torch's load_state_dict
        raise ModelError(
            f"{where}: the adapters in '{directory}' do not fit the model: {str(e)[:300]}"
        ) from None


def unload_adapters(module: nn.Module, merge: bool, where: str = "model") -> None:
    """Take ``module``'s LoRA layers out in place, as ``peft``'s ``merge_and_unload`` (``merge``) or
    ``unload`` does on a ``PeftModel``: each LoRA layer is replaced by its base layer, after peft's
    ``merge(safe_merge=True)`` has added ``(alpha / rank) · B A`` to the base weight when ``merge``. Without
    ``merge`` the module is its base again. A ``value``/``score`` head is left as it is.

    Raises:
        ModelError: the merged weights hold a NaN or an infinity (peft's safe merge refuses them).
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    target = _target(module)
    layers = [(name, m) for name, m in target.named_modules() if isinstance(m, BaseTunerLayer)]
    for name, layer in layers:
        if merge:
            try:
                layer.merge(safe_merge=True)
            except ValueError as e:
                raise ModelError(f"{where}: merging the adapters of '{name}' failed: {e}") from None
        parent, _, child = name.rpartition(".")
        setattr(target.get_submodule(parent), child, layer.get_base_layer())
    if hasattr(target, "peft_config"):  # what inject_adapter_in_model left on the model
        del target.peft_config
