"""The ``run`` section of a graph file: iterations, seed, records, checkpoints, evaluation, launcher,
experiment trackers, supervised restarts.

Plain frozen values checked field by field on construction (:class:`GraphError` naming the field's path,
``run.iterations``; ``run.devices``: :class:`PlanError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow.dataflow.errors import PlanError, did_you_mean
from rlflow.dataflow.fields import (
    check_choice,
    check_float,
    check_int,
    check_str,
    check_str_mapping,
    fail,
    show,
)
from rlflow.dataflow.plan_spec import MAX_DEVICES

__all__ = ["EVAL_KEYS", "LAUNCHERS", "RunSpec"]

# Held-out evaluation settings (greedy decoding): the generating model, the reward (a rule reward, or a
# scoring node function such as code_reward) and its arguments, the response limit in tokens, prompts per
# generation call, how many held-out prompts, and the score that counts as correct; ``agent``: evaluate
# with multi-turn tool rollouts (``agent_generate``'s arguments: tools, env, call_stop_tokens, max_turns,
# ...), with and without the tool.
EVAL_KEYS: tuple[str, ...] = (
    "model",
    "reward",
    "reward_args",
    "max_new_tokens",
    "batch_size",
    "size",
    "accuracy_threshold",
    "agent",
)


# how the workers of a multi-device plan start (``run.launcher``)
LAUNCHERS = ("embedded", "ray", "torchrun")


@dataclass(frozen=True)
class RunSpec:
    """Run settings: ``iterations`` of the whole graph, RNG ``seed``, ``output_dir`` for records,
    checkpoint/eval every ``*_interval`` iterations (0 = never), how many checkpoints to keep (0 = all),
    the number of ``devices`` (ids 0..n-1), ``eval`` settings for the held-out evaluation
    (keys in :data:`EVAL_KEYS`; ``model``, if given, must name a model), and the ``launcher`` that starts
    the workers of a multi-device plan (one of :data:`LAUNCHERS`: ``embedded`` processes on this host,
    ``ray`` actors on a Ray cluster, ``torchrun`` workers started by the user).

    ``trackers``: the experiment trackers that also receive the run's metrics (step = iteration), graph
    and plan, each started and closed with the run, a resumed run continuing the same tracker run:
    ``tensorboard``, ``wandb``, ``mlflow`` or a plug-in's (their names and libraries are checked before a
    run starts). ``project`` names the W&B project and the MLflow experiment, ``experiment`` the W&B and
    MLflow run (default: the run directory's name).

    Supervised restarts (docs/operations.md): when a process the run needs is lost
    (:class:`~rlflow.dataflow.errors.ProcessLost`), the run resumes by itself from its last checkpoint, at
    most ``max_restarts`` times within any ``restart_window_s`` seconds (0: no restart, the run stops); a
    restart waits at most ``restart_wait_s`` seconds for the resources it needs (a lost Ray node)."""

    iterations: int = 1
    seed: int = 0
    output_dir: str = "runs/rlflow"
    checkpoint_interval: int = 0
    eval_interval: int = 0
    devices: int = 1
    keep_checkpoints: int = 2
    eval: dict[str, Any] = field(default_factory=dict)
    launcher: str = "embedded"
    trackers: tuple[str, ...] = ()
    project: str = "rlflow"
    experiment: str | None = None
    max_restarts: int = 0
    restart_window_s: float = 3600.0
    restart_wait_s: float = 300.0

    def __post_init__(self) -> None:
        check_int("run.iterations", self.iterations, 1)
        check_choice("run.launcher", self.launcher, LAUNCHERS)
        check_int("run.seed", self.seed, 0)
        if self.seed >= 2**63:
            fail("run.seed", f"must be < 2**63, got {self.seed}")
        check_str("run.output_dir", self.output_dir)
        check_int("run.checkpoint_interval", self.checkpoint_interval, 0)
        check_int("run.eval_interval", self.eval_interval, 0)
        check_int("run.keep_checkpoints", self.keep_checkpoints, 0)
        check_str_mapping("run.eval", self.eval)
        for key in self.eval:
            if key not in EVAL_KEYS:
                fail(
                    f"run.eval.{key}",
                    f"unknown field{did_you_mean(key, EVAL_KEYS)}; fields: {', '.join(EVAL_KEYS)}",
                )
        if "reward_args" in self.eval:
            check_str_mapping("run.eval.reward_args", self.eval["reward_args"])
        object.__setattr__(self, "eval", dict(self.eval))
        if isinstance(self.trackers, str) or not isinstance(self.trackers, Sequence):
            fail(
                "run.trackers", f"expected a list of tracker names ([tensorboard]), got {show(self.trackers)}"
            )
        for i, name in enumerate(self.trackers):
            check_str(f"run.trackers[{i}]", name)
            if name in self.trackers[:i]:
                fail("run.trackers", f"'{name}' is listed twice")
        object.__setattr__(self, "trackers", tuple(self.trackers))
        check_str("run.project", self.project)
        check_str("run.experiment", self.experiment, optional=True)
        check_int("run.max_restarts", self.max_restarts, 0)
        check_float("run.restart_window_s", self.restart_window_s, 0.0, strict=True)
        check_float("run.restart_wait_s", self.restart_wait_s, 0.0)
        check_int("run.devices", self.devices, 1, PlanError)
        if self.devices > MAX_DEVICES:
            fail(
                "run.devices",
                f"{self.devices} devices is more than rlflow supports ({MAX_DEVICES})",
                PlanError,
            )
