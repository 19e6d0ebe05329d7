"""Held-out evaluation with greedy decoding, and the evaluations a resumed run logged before."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlflow.dataflow.args import bind_args
from rlflow.dataflow.context import prompt_limit
from rlflow.dataflow.data import eval_batches
from rlflow.dataflow.graph import Graph
from rlflow.dataflow.registry import NodeFunction
from rlflow.nodes.agent.functions import AGENT_ARGS, env_factory_of, rollout_prompts
from rlflow.nodes.generation import decode_responses, generate
from rlflow.nodes.rewards import RewardFn, resolve_reward, score_texts
from rlflow.nodes.scoring import score_with, scoring_args, scoring_function
from rlflow.nodes.tokenizers import TokenizerInfo
from rlflow.schedulers.records.rundir import read_metrics
from rlflow.schedulers.runtime.executor import Executor

__all__ = ["EvalConfig", "eval_line", "evaluate", "recorded_evals"]


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation with greedy decoding.

    Attributes:
        model: the ``lm`` model that generates.
        reward: rule reward name or dotted path, or a scoring node function's name (``code_reward``:
            :mod:`rlflow.nodes.scoring`); ``None``: only response lengths are reported.
        max_new_tokens: response length limit (tokens).
        batch_size: prompts per generation call.
        size: held-out prompts used (``None``: all).
        accuracy_threshold: a response counts as correct when its score is at least this.
        max_prompt_tokens: longer prompts keep their last that many tokens (``data.overlong: truncate``).
        agent: ``agent_generate`` arguments (checked, defaults filled) when the evaluation runs multi-turn
            tool rollouts (``run.eval.agent``, else the first generate node's when it is an
            ``agent_generate`` node); ``None``: single-turn generation.
        reward_args: a scoring function's arguments, bound (:func:`rlflow.nodes.scoring.scoring_args`), or a
            rule reward's options (``run.eval.reward_args``; ``None``: none).
    """

    model: str
    reward: str | None
    max_new_tokens: int = 16
    batch_size: int = 64
    size: int | None = None
    accuracy_threshold: float = 1.0
    max_prompt_tokens: int | None = None
    agent: dict[str, Any] | None = None
    reward_args: dict[str, Any] | None = None

    @classmethod
    def from_graph(cls, graph: Graph) -> EvalConfig | None:
        """Defaults from the graph: the first generate node's model and ``max_new_tokens`` (else the first
        trained ``lm`` model) and the first scoring node's reward (a ``rule_reward`` node's ``fn``, else the
        node's function: :mod:`rlflow.nodes.scoring`); ``run.eval`` overrides them.

        Raises:
            ArgError: a scoring function's arguments do not bind (the run checks say so first).
        """
        nodes = graph.nodes
        gen = next((n for n in nodes.values() if n.kind == "generate"), None)
        scoring = next((n for n in nodes.values() if scoring_function(n.function) is not None), None)
        lm_train = next(
            (
                n
                for n in nodes.values()
                if n.kind == "train" and n.model and graph.spec.models[n.model].head == "lm"
            ),
            None,
        )
        overrides: dict[str, Any] = dict(graph.spec.run.eval)
        model = overrides.get("model") or (gen.model if gen else (lm_train.model if lm_train else None))
        if model is None:
            return None
        default = None
        if scoring is not None:
            default = (
                graph.args(scoring.name)["fn"] if scoring.function == "rule_reward" else scoring.function
            )
        reward = overrides.get("reward") or default
        scorer = scoring_function(str(reward)) if reward else None
        reward_args = scoring_args(graph, scorer) if scorer else overrides.get("reward_args")
        max_new = overrides.get("max_new_tokens") or (graph.args(gen.name)["max_new_tokens"] if gen else 16)
        agent = overrides.get("agent")
        if agent is not None:
            agent = bind_args(AGENT_ARGS, {"max_new_tokens": int(max_new), **dict(agent)})
        elif gen is not None and gen.function == "agent_generate":
            agent = graph.args(gen.name)
        return cls(
            model=str(model),
            reward=reward,
            max_new_tokens=int(max_new),
            batch_size=int(overrides.get("batch_size", 64)),
            size=overrides.get("size"),
            accuracy_threshold=float(overrides.get("accuracy_threshold", 1.0)),
            max_prompt_tokens=truncation(graph),
            agent=agent,
            reward_args=None if reward_args is None else dict(reward_args),
        )


def truncation(graph: Graph) -> int | None:
    """The prompt tokens kept under ``data.overlong: truncate`` (``rlflow.dataflow.context.prompt_limit``);
    None otherwise (``error`` and ``drop`` leave no over-long row: ``rlflow.dataflow.data.fit_prompts``)."""
    limit = prompt_limit(graph)
    return limit[0] if limit is not None and graph.spec.data.overlong == "truncate" else None


@torch.no_grad()
def evaluate(executor: Executor[Any], cfg: EvalConfig | None, rows: Any) -> dict[str, float]:
    """Greedy decoding of ``cfg.model`` on the held-out ``rows`` (a data set split; ``None``: no
    evaluation): ``val/response_length/mean`` (tokens), and with a reward ``val/score/mean`` and
    ``val/accuracy`` (the fraction of responses scoring at least ``cfg.accuracy_threshold``).

    Raises:
        GraphError: the reward does not resolve (the controller checks it before any training).
    """
    if cfg is None or rows is None:
        return {}
    state = executor.models[cfg.model]
    with state.calling():  # a base view (models.<m>.base_of): its LoRA model with the adapters off
        tokenizer = state.tokenizer or executor.data_tokenizer
        info = TokenizerInfo.from_tokenizer(tokenizer)
        scorer = scoring_function(cfg.reward) if cfg.reward else None
        reward = resolve_reward(cfg.reward, **(cfg.reward_args or {})) if cfg.reward and not scorer else None
        if cfg.size is not None and cfg.size < len(rows):
            rows = type(rows)(columns=rows.take(list(range(cfg.size))), source=rows.source)
        scores = _Scores()
        lengths: list[float] = []
        state.module.eval()
        batches = eval_batches(
            rows,
            cfg.batch_size,
            tokenizer=tokenizer,
            tokenize=("prompt",),
            max_prompt_tokens=cfg.max_prompt_tokens,
        )
        if cfg.agent is not None:
            return _evaluate_agent(
                cfg, cfg.agent, state.module, tokenizer, info, (scorer, reward), list(batches), executor
            )
        for batch in batches:
            batch = batch.to(executor.device)
            ids, mask, _ = generate(
                state.module,
                info,
                batch.tensor("prompt_ids"),
                batch.tensor("prompt_mask"),
                greedy=True,
                max_new_tokens=cfg.max_new_tokens,
            )
            lengths.extend(mask.sum(-1).float().tolist())
            scores.add(*_score_batch(cfg, (scorer, reward), tokenizer, batch, ids, mask, executor.device))
        out = {"val/response_length/mean": sum(lengths) / max(1, len(lengths))}
        return out | scores.summary("val/", cfg.accuracy_threshold)


@dataclass
class _Scores:
    """Held-out scores so far, and the scoring function's other metrics summed weighted by rows."""

    values: list[float] = field(default_factory=list)
    metric_sums: dict[str, float] = field(default_factory=dict)

    def add(self, values: list[float], metrics: dict[str, float]) -> None:
        self.values += values
        for k, v in metrics.items():
            self.metric_sums[k] = self.metric_sums.get(k, 0.0) + v * len(values)

    def summary(self, prefix: str, threshold: float) -> dict[str, float]:
        """``<prefix>score/mean``, ``<prefix>accuracy`` (the share scoring at least ``threshold``) and the
        row-weighted mean of each metric (``val/reward/code_pass_ratio``); nothing without a score."""
        n = len(self.values)
        if not n:
            return {}
        out = {f"{prefix}{k}": v / n for k, v in self.metric_sums.items()}
        out[f"{prefix}score/mean"] = sum(self.values) / n
        out[f"{prefix}accuracy"] = sum(s >= threshold for s in self.values) / n
        return out


def _score_batch(
    cfg: EvalConfig,
    rewards: tuple[NodeFunction | None, RewardFn | None],
    tokenizer: Any,
    batch: Any,
    ids: torch.Tensor,
    mask: torch.Tensor,
    device: torch.device,
) -> tuple[list[float], dict[str, float]]:
    """One held-out batch's scores and metrics: the scoring function's call on the responses ``[B, R]``,
    else the rule reward on their text against ``answer`` (none without an ``answer`` field)."""
    scorer, reward = rewards
    if scorer is not None:
        assert cfg.reward_args is not None
        return score_with(scorer, cfg.reward_args, batch, ids, mask, tokenizer=tokenizer, device=device)
    if reward is None or "answer" not in batch:
        return [], {}
    texts = decode_responses(tokenizer, ids, mask)
    return score_texts(reward, texts, [str(a) for a in batch.list_of("answer")], name=cfg.reward), {}


def _evaluate_agent(
    cfg: EvalConfig,
    args: dict[str, Any],
    module: Any,
    tokenizer: Any,
    info: TokenizerInfo,
    rewards: tuple[NodeFunction | None, RewardFn | None],
    batches: list[Any],
    executor: Executor[Any],
) -> dict[str, float]:
    """Greedy multi-turn tool rollouts (:func:`rlflow.nodes.agent.functions.rollout_prompts`) with the
    tools, and again with every tool call answered by an empty result (``val/no_tool/*``: the same model
    without the knowledge the tool gives). Reports ``val/accuracy``, ``val/score/mean``,
    ``val/num_turns/mean``, ``val/tool_call_counts/mean``, ``val/env/error_ratio`` and the ``no_tool``
    counterparts."""
    call_stop = [
        int(t) if isinstance(t, int) else int(tokenizer.convert_tokens_to_ids(str(t)))
        for t in args.get("call_stop_tokens") or ()
    ]
    out: dict[str, float] = {}
    for prefix, disabled in (("val/", False), ("val/no_tool/", True)):
        if disabled and args.get("env") is not None:
            continue  # a custom environment has no tool-less mode
        make_env = env_factory_of(args, disabled=disabled)
        scores = _Scores()
        turns: list[float] = []
        calls: list[float] = []
        errors, steps = 0, 0
        for batch in batches:
            batch = batch.to(executor.device)

            def sample(ids: torch.Tensor, mask: torch.Tensor, limit: int) -> Any:
                return generate(
                    module, info, ids, mask, greedy=True, max_new_tokens=limit, stop_token_ids=call_stop,
                    pad_to_max=False,
                )  # fmt: skip

            r = rollout_prompts(
                sample, make_env, tokenizer, info, batch, n=1, call_stop=call_stop,
                max_new_tokens=int(args["max_new_tokens"]), max_turns=int(args["max_turns"]),
                max_obs_tokens=int(args["max_obs_tokens"]), tool_timeout=float(args["tool_timeout"]),
                error_observation=str(args["error_observation"]), device=executor.device,
            )  # fmt: skip
            turns += r.num_turns.float().tolist()
            calls += r.tool_calls.float().tolist()
            errors += sum(r.errors[k] for k in ("raised", "timeout", "garbage"))
            steps += r.env_steps
            scores.add(
                *_score_batch(
                    cfg, rewards, tokenizer, batch, r.response_ids, r.response_mask, executor.device
                )
            )
        out[f"{prefix}num_turns/mean"] = sum(turns) / max(1, len(turns))
        out[f"{prefix}tool_call_counts/mean"] = sum(calls) / max(1, len(calls))
        out[f"{prefix}env/error_ratio"] = errors / max(1, steps)
        out |= scores.summary(prefix, cfg.accuracy_threshold)
    return out


def eval_line(iteration: int, values: dict[str, float]) -> str:
    """One evaluation as ``rlflow run`` prints it, as it happens and again in the end-of-run list:
    ``eval after N iterations: name=value, ...`` (names sorted, 4 significant digits)."""
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(values.items()))
    return f"eval after {iteration} iterations: {shown}"


def recorded_evals(run_dir: Path, start_iteration: int) -> dict[int, dict[str, float]]:
    """Evaluations logged up to ``start_iteration`` (a resumed run's history; none for a fresh run):
    iteration -> the ``val/*`` metrics it logged, read back from the run directory."""
    if not start_iteration:
        return {}
    table = read_metrics(run_dir)
    names = [n for n in table.column_names if n.startswith("val/")]
    evals: dict[int, dict[str, float]] = {}
    for row in table.select(["iteration", *names]).to_pylist():
        iteration = int(row.pop("iteration"))
        found = {k: float(v) for k, v in row.items() if v is not None and v == v}  # v == v: not NaN
        if found and iteration <= start_iteration:
            evals[iteration] = found
    return evals
