"""The names vLLM's loader reads for a model's tensors, where they are not the ones transformers holds.

transformers 5 converts some checkpoints as it loads them (its ``conversion_mapping``): Mixtral's
per-expert tensors ``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` (``[I, H]``, ``[I, H]``, ``[H, I]``)
become the fused ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (w1 then w3 along dim 1) and
``mlp.experts.down_proj`` ``[E, H, I]``, and the router ``block_sparse_moe.gate`` becomes ``mlp.gate``.
vLLM 0.32's Mixtral loader (``MixtralModel.load_weights``, its expert mapping ``ckpt_names=("w1", "w2",
"w3")``) reads only the original names. :class:`CheckpointNames` maps a bucket of rlflow's tensors to the
original names with transformers' own reverse of that conversion (``revert_weight_conversion``, what
``save_pretrained`` writes): every output is a slice of one input tensor, values unchanged (bit-exact; the
engine's digests compare them as loaded, :class:`~rlflow.nodes.engines.vllm_worker.ReloadCheck`). A fused
tensor is always whole within one bucket, so each bucket maps on its own.

Shapes: ``E`` experts, ``H`` hidden, ``I`` an expert's intermediate width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["VLLM_CHECKPOINT_NAMES", "CheckpointNames", "checkpoint_names"]

VLLM_CHECKPOINT_NAMES = frozenset({"mixtral"})
"""``model_type``s whose tensors vLLM 0.32 loads only under the original checkpoint's names (above); the
others (``qwen3_moe``: vLLM reads the fused ``experts.gate_up_proj`` itself) go under transformers' names."""


class CheckpointNames:
    """Maps Hugging Face-named tensors as transformers 5 holds them to the original checkpoint's names and
    tensors (module docstring), for one model ``config`` (a ``PretrainedConfig``).

    transformers finds the conversion by the model's classes, so a copy of the model is built on the meta
    device (no memory) to ask it.
    """

    def __init__(self, config: Any) -> None:
        from transformers import AutoModelForCausalLM

        self.model_type = str(config.model_type)
        with torch.device("meta"):
            self._model = AutoModelForCausalLM.from_config(config)

    def __call__(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``tensors`` (whole tensors, transformers' names) under the checkpoint's names: the fused expert
        tensors as per-expert slices (contiguous views, no copy), the others renamed or as they are."""
        from transformers.core_model_loading import revert_weight_conversion

        out: Mapping[str, torch.Tensor] = revert_weight_conversion(self._model, dict(tensors))
        return [(name, t.contiguous()) for name, t in out.items()]


def checkpoint_names(module: nn.Module) -> CheckpointNames | None:
    """The name mapping ``module``'s tensors need on their way into vLLM (:data:`VLLM_CHECKPOINT_NAMES`),
    ``None`` when vLLM reads transformers' names."""
    config: Any = getattr(module, "config", None)
    if config is None or getattr(config, "model_type", None) not in VLLM_CHECKPOINT_NAMES:
        return None
    return CheckpointNames(config)
