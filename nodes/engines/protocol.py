"""What the runtime and the node functions call on a generation engine (``NodeContext.engine``).

:class:`Engine` is the one interface of every engine a generate node can run on: the vLLM engine of one
data-parallel replica (:class:`~rlflow.nodes.engines.vllm_engine.VllmEngine`) and the tensor-parallel
group's view of its one engine (:class:`~rlflow.nodes.engines.tp_group.GroupEngine`, whose calls are
collective over the group). The runtime starts an engine, stores it in the node's context and closes it;
the node function brings it to the model's weights and generates with it.

A weight sync comes in one of two forms, both ending with the sync's checks (digests of the engine's
tensors, an empty prefix cache, the probe on the first reload: :mod:`rlflow.nodes.engines.sync_check`) and
both reported as :class:`SyncStats`:

- :meth:`Engine.sync`: the node function hands the engine the model instance; the engine streams its
  weights in buckets and verifies them.
- :meth:`Engine.begin_sync`, :meth:`Engine.load_unit` per unit, :meth:`Engine.end_sync`: the distributed
  runtime streams the weights unit by unit while its weight sync writes them
  (:mod:`rlflow.schedulers.runtime.distributed.stream_sync`); the engine keeps the stats in
  :attr:`Engine.streamed` until the node function reports them.

Shape legend: N rows (prompts × n), P prompt width, R = ``max_new_tokens``, K probe rows, L probe width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

__all__ = ["Engine", "SyncStats"]


@dataclass(frozen=True)
class SyncStats:
    """One weight load into an engine: ``bytes`` sent (all tensors, full), ``seconds`` of load plus cache
    reset (less their checks), ``verify_seconds`` of every check (digests, prefix cache, probe:
    :mod:`rlflow.nodes.engines.sync_check`), ``probe_gap`` the probe's largest log-prob difference (nats;
    ``None`` when the digests alone verified the load)."""

    bytes: int
    seconds: float
    verify_seconds: float
    probe_gap: float | None


class Engine(Protocol):
    """A running generation engine serving one rank of a generate node.

    Attributes:
        weight_version: the model version (optimizer steps) whose weights the engine serves, verified;
            ``None`` while unverified (before the first sync, or once a load began).
        streamed: the stats of the last streamed sync (:meth:`end_sync`) until the node function reports
            them (it sets this back to ``None``).
        restarts: how many times the engine was restarted in place so far, its processes having died
            (cumulative; :mod:`rlflow.nodes.engines.engine_restart`); ``None`` for an engine that is not
            restarted in place (``run.max_restarts`` 0, a tensor-parallel group's).
    """

    weight_version: int | None
    streamed: SyncStats | None
    restarts: int | None

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
        """Sample ``n`` responses per prompt, as :func:`rlflow.nodes.generation.generate` does; wakes a
        sleeping engine first.

        Args:
            prompt_ids, prompt_mask: ``[B,P]`` left-padded prompts (pads are dropped before submission).
            n, temperature, top_k, top_p, max_new_tokens, greedy: as the built-in loop (temperature 0 or
                ``greedy``: argmax, log-probs of the unprocessed logits).
            stop_token_ids: every id that ends a response (EOS included); the stop token is kept.
            pad_id: written after each row's end.
            generator: draws one seed per row (``None``: torch's global RNG).

        Returns:
            ``(response_ids [N,R] int64, response_mask [N,R] int64, logprobs [N,R] float32)``, right-padded
            (pad id, mask 0, log-prob 0), on ``prompt_ids``' device; rows ``i*n .. i*n+n-1`` belong to
            prompt ``i``.

        Raises:
            NodeError: the engine failed (names the node and model).
        """
        ...

    def sync(self, module: nn.Module, *, model: str, version: int) -> SyncStats:
        """Load ``module``'s weights (this rank's model instance) into the engine and verify them with the
        probe; records ``version`` as :attr:`weight_version`.

        Raises:
            NodeError: the load failed; WeightSyncError: the probe's gap exceeds its tolerance (names the
                node, ``model`` and ``version``).
        """
        ...

    def begin_sync(self) -> None:
        """Start a weight sync whose tensors arrive in units (:meth:`load_unit`), ended by
        :meth:`end_sync`. A failure is kept until :meth:`end_sync`: the collectives that feed the units
        must run to their end on every rank."""
        ...

    def load_unit(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load one unit of full (or tensor-parallel DTensor), Hugging Face-named tensors of any device
        and dtype (converted to the engine's); nothing after a failure."""
        ...

    def end_sync(self, want: torch.Tensor, *, model: str, version: int) -> SyncStats:
        """Finish a streamed sync and verify it against the trainer's probe log-probs ``want`` ``[K,L-1]``;
        keeps the stats in :attr:`streamed` and returns them.

        Raises:
            NodeError: the first failure of the load; WeightSyncError: as :meth:`sync`.
        """
        ...

    def sleep(self) -> None:
        """Free the engine's device memory until its next call (a no-op without sleep mode); the next
        :meth:`generate` or weight sync wakes it.

        Raises:
            NodeError: the engine failed.
        """
        ...

    def close(self) -> None:
        """Stop the engine and release what it holds (idempotent)."""
        ...
