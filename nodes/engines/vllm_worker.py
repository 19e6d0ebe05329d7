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

import ctypes
import os
import signal
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EngineWorkerExtension"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class EngineWorkerExtension:
    """Weight loading and process hygiene inside a vLLM worker (no state of its own)."""

    model_runner: Any

    def rlflow_load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load full Hugging Face-named tensors into the running model; returns the bytes loaded.

        Every tensor of the model must be given (vLLM reloads layer by layer and re-packs each layer
        from all of its tensors). The caller resets the prefix cache afterwards.
        """
        tensors = [(str(k), v) for k, v in named]
        self.model_runner.reload_weights(weights_iterator=iter(tensors))
        return sum(int(v.numel()) * v.element_size() for _, v in tensors)

    def rlflow_die_with(self, parent_pid: int) -> bool:
        """Have this process killed (SIGKILL) when its parent dies, so a SIGKILLed owner leaves no orphan.

        Only for an engine-core process started by vLLM (multiprocessing mode); linux only (prctl).
        Returns whether the watch is armed.
        """
        if os.getpid() == parent_pid or not hasattr(os, "getppid"):
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
        if os.getppid() != parent_pid:  # the parent died before the watch was armed
            os.kill(os.getpid(), signal.SIGKILL)
        return True
