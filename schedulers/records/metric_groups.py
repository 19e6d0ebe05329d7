"""Which curves the dashboard draws together: the run metrics grouped into plots of one unit each.

Every plot holds metrics of one unit and kind only (rewards, KL in nats, losses, fractions in [0, 1],
lengths in tokens, counts per episode, gradient norms, learning rates, weight versions), so no plot mixes
an accuracy with a count on one axis. A metric goes to the first rule of :data:`PLOT_RULES` its name
matches; plots sit in sections (:data:`SECTIONS`: training, DPO and reward model, optimisation,
asynchronous RL, agent rollouts, validation), one dashboard panel each. A loss no rule names goes to
"Other losses"; a validation metric no rule names gets a plot of its own (its unit unknown). Other metrics
(``timing_s/*``, ``perf/*``, ``memory_bytes/*``: the other panels) are not curves.

A plot holds at most :data:`MAX_SERIES` lines (metrics × runs); a larger group is split into numbered
plots ("Validation accuracy (1/2)"), each with whole metrics.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from rlflow.schedulers.records.telemetry import KL_METRICS

__all__ = ["FRACTION", "MAX_SERIES", "PLOT_RULES", "SECTIONS", "Plot", "PlotRule", "curve_plots"]

MAX_SERIES: Final = 6  # lines in one plot, over runs; more are split over several plots
# (key, panel title), in dashboard order
SECTIONS: Final[tuple[tuple[str, str], ...]] = (
    ("training", "Training curves"),
    ("preference", "Preference training (DPO, reward model)"),
    ("optimizer", "Optimisation"),
    ("async", "Asynchronous RL"),
    ("agent", "Agent rollouts"),
    ("validation", "Validation (held-out prompts, greedy)"),
)
FRACTION: Final = "fraction (0-1)"  # the y-axis label of rates, accuracies and ratios


@dataclass(frozen=True)
class PlotRule:
    """Metrics whose whole name matches ``pattern`` (``re.fullmatch``) share the plot ``title`` in
    ``section``, on a y-axis labelled ``unit``."""

    section: str
    title: str
    unit: str
    pattern: str


def _names(*names: str) -> str:
    return "|".join(re.escape(n) for n in names)


# The names are those the node functions and the runtime log (docs: reference/metrics.md).
PLOT_RULES: Final[tuple[PlotRule, ...]] = (
    PlotRule("training", "Reward", "reward (mean per response)",
             _names("critic/score/mean", "critic/rewards/mean")),
    PlotRule("training", "KL to the reference", "nats", _names(*KL_METRICS)),
    PlotRule("training", "Reverse KL to the teacher", "nats per token", _names("actor/reverse_kl")),
    PlotRule("training", "Policy loss", "loss", _names("actor/pg_loss")),
    PlotRule("training", "Value loss", "loss", _names("critic/vf_loss")),
    PlotRule("training", "SFT loss (NLL)", "nats per token", _names("actor/nll")),
    PlotRule("training", "Clip fraction", FRACTION,
             _names("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")),
    PlotRule("training", "Entropy", "nats per token", _names("actor/entropy")),
    PlotRule("training", "Response length", "tokens", _names("response_length/mean", "response_length/max")),
    PlotRule("training", "Truncated responses", FRACTION,
             _names("response_length/clip_ratio", "response_length/truncated_ratio")),
    PlotRule("training", "Over-long penalty (DAPO)", "reward (mean per response)",
             _names("overlong/penalty_mean")),
    PlotRule("training", "Over-long responses penalised or filtered", FRACTION,
             _names("overlong/penalised_frac", "overlong/filtered_frac")),
    PlotRule("training", "SAPO gate", "gradient weight (1 on-policy)", _names("actor/sapo_weight_mean")),
    PlotRule("training", "Dynamic sampling: groups passed", FRACTION, _names("filter/pass_rate")),
    PlotRule("training", "Dynamic sampling: rounds of generation", "rounds per iteration",
             _names("filter/rounds")),
    PlotRule("training", "Dynamic sampling: groups trained on", "groups per iteration",
             _names("filter/groups")),
    PlotRule("preference", "DPO loss", "loss", _names("actor/dpo_loss")),
    PlotRule("preference", "DPO implicit rewards", "β · log-ratio to the reference (nats)",
             _names("actor/rewards/chosen", "actor/rewards/rejected", "actor/rewards/margins")),
    PlotRule("preference", "DPO preference accuracy", FRACTION, _names("actor/rewards/accuracies")),
    PlotRule("preference", "Reward-model loss", "loss", _names("reward/loss")),
    PlotRule("preference", "Reward-model accuracy", FRACTION, _names("reward/accuracy")),
    PlotRule("preference", "Reward-model margin", "score (chosen - rejected)", _names("reward/margin")),
    PlotRule("training", "MoE load-balancing loss", "E · Σ f·P (K when balanced)", _names("moe/aux_loss")),
    PlotRule("training", "MoE expert load", "share of a layer's tokens",
             _names("moe/expert_load_max", "moe/expert_load_min")),
    PlotRule("training", "Other losses", "loss", r"(?!val/)[^/]+/(.*[/_])?loss(_.*)?"),
    PlotRule("optimizer", "Gradient norm", "L2 norm (before clipping)", r"[^/]+/grad_norm"),
    PlotRule("optimizer", "Learning rate", "learning rate", r"[^/]+/lr"),
    PlotRule("async", "Staleness", "weight versions behind",
             _names("async/staleness_mean", "async/staleness_max", "async/token_staleness_mean")),
    PlotRule("async", "Responses at the staleness bound", FRACTION, _names("async/at_bound")),
    PlotRule("async", "Iterations queued for training", "iterations", _names("async/queue_depth")),
    PlotRule("agent", "Turns and tool calls", "count per episode",
             _names("num_turns/mean", "tool_call_counts/mean")),
    PlotRule("agent", "Environment errors", FRACTION, _names("env/error_ratio", "env/invalid_call_ratio")),
    PlotRule("validation", "Validation accuracy", FRACTION, r"val/(.+/)?accuracy"),
    PlotRule("validation", "Validation reward", "reward (mean per response)", r"val/(.+/)?score/mean"),
    PlotRule("validation", "Validation response length", "tokens", r"val/(.+/)?response_length/mean"),
    PlotRule("validation", "Validation turns and tool calls", "count per episode",
             r"val/(.+/)?(num_turns|tool_call_counts)/mean"),
    PlotRule("validation", "Validation environment errors", FRACTION, r"val/(.+/)?env/error_ratio"),
)  # fmt: skip


@dataclass(frozen=True)
class Plot:
    """One plot of a panel: its ``title``, y-axis ``unit`` and the metric ``names`` drawn on it."""

    section: str
    title: str
    unit: str
    names: tuple[str, ...]


def _rule_of(name: str) -> PlotRule | None:
    for rule in PLOT_RULES:
        if re.fullmatch(rule.pattern, name):
            return rule
    if name.startswith("val/"):  # a validation metric of unknown unit: alone on its axis
        return PlotRule("validation", name, "value", re.escape(name))
    return None


def curve_plots(columns: Iterable[str], n_runs: int) -> list[Plot]:
    """The plots of the logged metric ``columns`` (names in order of first appearance), in section and
    rule order, each holding at most :data:`MAX_SERIES` lines when ``n_runs`` runs overlay (one metric
    per plot at least). Metrics no rule plots are left out."""
    found: dict[tuple[str, str, str], list[str]] = {}
    order = {rule.title: i for i, rule in enumerate(PLOT_RULES)}
    for name in columns:
        rule = _rule_of(name)
        if rule is not None and name not in found.setdefault((rule.section, rule.title, rule.unit), []):
            found[(rule.section, rule.title, rule.unit)].append(name)
    sections = [key for key, _ in SECTIONS]
    keys = sorted(found, key=lambda k: (sections.index(k[0]), order.get(k[1], len(order)), k[1]))
    per_plot = max(1, MAX_SERIES // max(1, n_runs))
    plots: list[Plot] = []
    for section, title, unit in keys:
        names = found[(section, title, unit)]
        parts = math.ceil(len(names) / per_plot)
        size = math.ceil(len(names) / parts)  # even parts: 7 names -> 4 + 3, not 6 + 1
        for k in range(parts):
            chunk = tuple(names[k * size : (k + 1) * size])
            shown = title if parts == 1 else f"{title} ({k + 1}/{parts})"
            plots.append(Plot(section, shown, unit, chunk))
    return plots
