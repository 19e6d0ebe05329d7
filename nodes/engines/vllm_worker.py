"""rlflow's methods inside a vLLM worker (``LLM(worker_extension_cls=...)``), called by ``collective_rpc``.

vLLM mixes this class into its worker class, so ``self`` is the vLLM worker (``self.model_runner`` holds
the model). The methods run in whichever process hosts the worker: the caller's process when the engine
runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), else vLLM's engine-core process.

With tensor parallel (``tensor_parallel_size`` > 1) every TP worker of the engine runs each call and
receives the same full tensors; each worker's ``weight_loader`` keeps its own shard.

Source for the weight reload: vLLM's ``GPUModelRunner.reload_weights`` (``model_executor/model_loader/
reload/inplace.py``): it re-stages every layer's tensors and re-runs the layer's post-load processing, so
it works on CPU where linear weights are repacked into oneDNN handles at start (``model.load_weights``
after start writes into emptied tensors there; see ``shared/PLATFORM-NOTES.md``). ``reload_weights`` does
it in one call from one iterator; rlflow streams the weights in buckets across calls, so it splits the same
steps (``initialize_layerwise_reload`` once, ``model.load_weights`` per bucket, ``finalize_layerwise_reload``
at the end): a layer is re-processed as soon as all of its tensors have arrived, whichever bucket they
came in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EngineWorkerExtension"]


class EngineWorkerExtension:
    """Weight loading inside a vLLM worker (no state of its own)."""

    model_runner: Any

    def rlflow_reload_begin(self) -> None:
        """Start a bucketed reload: each layer waits for all its tensors (``initialize_layerwise_reload``)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model_runner.get_model())

    def rlflow_load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of full Hugging Face-named tensors (between :meth:`rlflow_reload_begin` and
        :meth:`rlflow_reload_end`); returns the bytes loaded."""
        tensors = [(str(k), v) for k, v in named]
        self.model_runner.get_model().load_weights(iter(tensors))
        return sum(int(v.numel()) * v.element_size() for _, v in tensors)

    def rlflow_reload_end(self) -> None:
        """Finish a bucketed reload (``finalize_layerwise_reload``: layers not yet re-processed, attention)
        and drop state derived from the old weights, as ``GPUModelRunner.reload_weights`` does. Every
        tensor of the model must have been sent (a layer missing some keeps its old weights). The caller
        resets the prefix cache afterwards."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()

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
