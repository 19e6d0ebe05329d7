"""What a node function receives and returns.

A node function is registered with :func:`rlflow.dataflow.registry.node_function` and called by the runtime as
``fn(ctx, batch, **args) -> NodeResult``: ``batch`` holds the node's inputs under their *canonical*
parameter names (the graph's key binding is undone by the runtime), ``args`` are the node's ``args`` from
the graph file. The returned ``outputs`` use canonical output names too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.nodes.engines.protocol import Engine
from rlflow.nodes.tokenizers import TokenizerInfo

__all__ = ["ModelState", "NodeContext", "NodeResult", "TrainHooks"]


@dataclass
class ModelState:
    """One model's weights and training state on one worker.

    Attributes:
        name: the model's name in the graph (``actor``, ``critic``, ...).
        module: the ``torch.nn.Module`` (a transformers causal LM or a
            :class:`rlflow.nodes.models.HeadModel`).
        head: ``lm`` | ``value`` | ``score``.
        tokenizer: Hugging Face tokenizer or ``None``.
        optimizer, scheduler: AdamW and its LR schedule for trainable models, else ``None``.
        optimizer_spec: the graph's optimizer settings (grad clip lives there).
        version: number of optimizer steps applied to ``module`` (weights version, for version edges).
        base_of: the LoRA model whose ``module`` this state shares, run with the adapters off
            (``models.<m>.base_of``: a reference without a copy), else ``None``.
    """

    name: str
    module: nn.Module
    head: str
    tokenizer: Any = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    optimizer_spec: OptimizerSpec | None = None
    version: int = 0
    base_of: str | None = None

    def calling(self) -> contextlib.AbstractContextManager[None]:
        """The context a node call on this model runs in: the adapters disabled for a base view
        (:func:`rlflow.nodes.lora.adapters_disabled`), else nothing."""
        if self.base_of is None:
            return contextlib.nullcontext()
        from rlflow.nodes.lora import adapters_disabled

        return adapters_disabled(self.module)

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo.from_tokenizer(self.tokenizer)

    def train_state(self) -> dict[str, Any]:
        """Weight version, optimizer and scheduler state, for checkpoints (tensors stay where they are)."""
        return {
            "version": self.version,
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler else None,
        }

    def load_train_state(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`train_state` (the module must already hold the matching weights)."""
        self.version = int(saved["version"])
        if self.optimizer is not None and saved["optimizer"] is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        if self.scheduler is not None and saved["scheduler"] is not None:
            self.scheduler.load_state_dict(saved["scheduler"])


class TrainHooks:
    """How a train node combines data-parallel ranks (:func:`rlflow.nodes.train.optimize` and the batch-wide
    statistics of the node functions call these).

    The default is a single process: sums and counts are local and the gradient norm is torch's. A
    distributed runtime passes a subclass that all-reduces over its data-parallel group (each rank holds
    a share of the node's batch) and computes the global norm of sharded gradients.

    A train step runs its micro-batches in the order :meth:`micro_batch_order` gives (one after another by
    default); a pipeline stage overrides it with its pipeline schedule and uses :meth:`begin` and :meth:`end`
    around each forward and backward to time its point-to-point traffic.
    """

    def micro_batch_order(self, m: int) -> list[tuple[str, int]]:
        """The order of one mini-batch's forwards ``("F", k)`` (forward and loss of micro-batch ``k``) and
        backwards ``("B", k)``, ``0 <= k < m``: each ``("B", k)`` after its ``("F", k)``, backwards in
        increasing ``k`` (so every order accumulates the same gradients in the same summation order).

        The default: ``F0 B0 F1 B1 ...`` (plain gradient accumulation, one micro-batch's activations alive).
        """
        return [(op, k) for k in range(m) for op in ("F", "B")]

    def begin(self, op: str, k: int) -> None:
        """Called before op ``op`` (``"F"`` or ``"B"``) of micro-batch ``k`` of :meth:`micro_batch_order`."""

    def end(self, op: str, k: int) -> None:
        """Called after op ``op`` of micro-batch ``k`` (after :meth:`backward` for ``"B"``)."""

    def all_sum(self, local: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``local`` over the shares of the node's batch (the identity here).

        Batch-wide statistics (advantage whitening, batch std of rewards) pass their partial sums
        through it, so every share sees the statistics of the whole batch. Every rank must call it the
        same number of times with the same shape.
        """
        return local

    def stage_sum(self, local: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``local`` over the pipeline stages holding one copy of the model (the
        identity here and without pipeline parallelism): counts each stage takes of its own layers (route
        replay's agreement, :mod:`rlflow.nodes.moe_routes`). Every rank calls it alike."""
        return local

    def global_count(self, local: float) -> float:
        """The loss normaliser of the whole global mini-batch (tokens or rows) from this rank's count."""
        return local

    def global_max(self, local: int) -> int:
        """The largest ``local`` over the shares of the node's batch (the identity here): the micro-batch
        count every data-parallel rank runs under a token budget (:mod:`rlflow.nodes.token_budget`)."""
        return local

    def loss_is_finite(self, loss: torch.Tensor) -> bool:
        """Whether a micro-batch's loss is finite (``optimize`` raises when it is not)."""
        return bool(torch.isfinite(loss))

    def clip_grad_norm(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip gradients to ``max_norm`` in place; returns the total 2-norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Backpropagate one micro-batch's loss into the accumulated gradients.

        ``last``: this is the mini-batch's last micro-batch (the gradient-accumulation boundary, where an
        engine such as DeepSpeed ZeRO reduces the gradients over its data-parallel ranks).
        """
        loss.backward()

    def step(
        self,
        params: Sequence[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        max_norm: float,
    ) -> torch.Tensor:
        """Clip the accumulated gradients to ``max_norm`` (:meth:`clip_grad_norm`), then, unless their norm is
        not finite, apply one optimizer step and one scheduler step; clears the gradients before returning.

        Returns:
            the total 2-norm of the gradients before clipping (non-finite: no step was applied).
        """
        norm = self.clip_grad_norm(params, max_norm)
        if torch.isfinite(norm):
            optimizer.step()
            scheduler.step()
        return norm


@dataclass
class NodeContext:
    """Everything a node function may read besides its inputs.

    Attributes:
        node: the node's spec (name, kind, mini_batches, epochs, args; ``engine: auto`` resolved by the plan).
        model: the model the node calls, or ``None`` for model-free functions (rule rewards).
        group_size: samples per prompt of this node's rows (GRPO/RLOO groups are consecutive rows).
        micro_batches: micro-batches per mini-batch (the layout's ``m``).
        device: torch device the node runs on.
        generator: the node's random source (sampling); its state is checkpointed.
        tokenizer: a tokenizer for decoding text (the model's, or the data set's for model-free nodes).
        iteration: current iteration (0-based).
        train_hooks: how train steps combine data-parallel ranks (single process by default).
        mini_batch_rows: rows of each of this rank's mini-batches when a data-parallel runtime split the
            batch unevenly (balanced by tokens); ``None``: ``node.mini_batches`` equal parts.
        engine: the generation engine serving this rank of a generate node with ``engine: vllm`` (an
            :class:`rlflow.nodes.engines.protocol.Engine`, started and closed by the runtime);
            ``None`` for the built-in loop.
        segment: ``(j, segments)`` while the runtime runs segment ``j`` of an interruptible generate node
            (``interrupt_every``; :mod:`rlflow.nodes.partial`); ``None``: the whole call at once.
        partial: iteration -> the :class:`rlflow.nodes.partial.PartialRollout` between its segments
            (checkpointed by the runtime).
        keep_going: a generate node's lockstep over its expert-parallel group (``ep`` > 1, set by the
            runtime): ``keep_going(done_here) -> any rank of the group not done``, one collective per call,
            which the built-in loop calls once per micro-batch and decode step
            (:func:`rlflow.nodes.generation.generate`); ``None``: this rank decodes on its own.
    """

    node: NodeSpec
    model: ModelState | None
    group_size: int = 1
    micro_batches: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    generator: torch.Generator | None = None
    tokenizer: Any = None
    iteration: int = 0
    train_hooks: TrainHooks = field(default_factory=TrainHooks)
    mini_batch_rows: tuple[int, ...] | None = None
    engine: Engine | None = None
    segment: tuple[int, int] | None = None
    partial: dict[int, Any] = field(default_factory=dict)
    keep_going: Callable[[bool], bool] | None = None


@dataclass
class NodeResult:
    """What a node function returns.

    Attributes:
        outputs: canonical output name -> tensor ``[rows, ...]`` or per-row list.
        metrics: metric name -> value, already prefixed by the function (``actor/pg_loss``).
        tokens: tokens processed (prompt + response tokens of real positions), for throughput.
        spans: phases inside the call that the run's trace shows apart, as ``(kind, start, end)`` with
            wall-clock seconds (``time.time()``), e.g. ``("tool", t0, t1)`` while an agent's environment
            steps ran; the runtime records each as a trace row of that kind on the worker that ran the node.
    """

    outputs: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tokens: int = 0
    spans: list[tuple[str, float, float]] = field(default_factory=list)

    def output_batch(self) -> Batch:
        return Batch(self.outputs)
