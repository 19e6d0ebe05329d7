"""rlflow's methods inside a vLLM worker (``LLM(worker_extension_cls=...)``), called by ``collective_rpc``.

vLLM mixes this class into its worker class, so ``self`` is the vLLM worker (``self.model_runner`` holds
the model). The methods run in whichever process hosts the worker: the caller's process when the engine
runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else vLLM's engine-core process.

Source for the weight reload: vLLM's ``GPUModelRunner.reload_weights`` (``model_executor/model_loader/
reload/inplace.py``): it re-stages every layer's tensors and re-runs the layer's post-load processing, so
it works on CPU where linear weights are repacked into oneDNN handles at start (``model.load_weights``
after start writes into emptied tensors there; see ``shared/PLATFORM-NOTES.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EngineWorkerExtension"]


class EngineWorkerExtension:
    """Weight loading inside a vLLM worker (no state of its own)."""

    model_runner: Any

    def rlflow_load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load full Hugging Face-named tensors into the running model; returns the bytes loaded.

        Every tensor of the model must be given (vLLM reloads layer by layer and re-packs each layer
        from all of its tensors). The caller resets the prefix cache afterwards.
        """
        tensors = [(str(k), v) for k, v in named]
        self.model_runner.reload_weights(weights_iterator=iter(tensors))
        return sum(int(v.numel()) * v.element_size() for _, v in tensors)

    def rlflow_load_packed(
        self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: str, blob: bytes
    ) -> int:
        """:meth:`rlflow_load_weights` for a call from another process: the tensors arrive as one
        contiguous buffer ``blob`` (``names[i]`` of shape ``shapes[i]``, in order, all of ``dtype``, e.g.
        ``float32``), because vLLM's message encoding does not rebuild tensors nested in arguments."""
        flat = torch.frombuffer(bytearray(blob), dtype=getattr(torch, dtype))
        tensors: list[tuple[str, torch.Tensor]] = []
        offset = 0
        for name, shape in zip(names, shapes, strict=True):
            numel = 1
            for d in shape:
                numel *= int(d)
            tensors.append((str(name), flat[offset : offset + numel].view(*[int(d) for d in shape])))
            offset += numel
        return self.rlflow_load_weights(tensors)
