"""The multi-turn rollout loop: model turns batched across rows, environment steps run contained.

Each turn, every row still running is continued by one batched model call (rows finish at different turns;
the finished ones leave the batch); a turn ends at EOS (the episode ends), at a tool-call stop token (the
environment steps: its observation is appended with mask 0 and log-prob 0) or at the row's token budget
(truncated). The response of a row is everything after its prompt: model tokens (mask 1, the sampler's
log-probs) and observation tokens (mask 0, log-prob 0), right-padded to ``max_new_tokens``.

Engine-agnostic: the model call is a :data:`SampleFn` (the built-in decode loop or the vLLM engine, both
taking left-padded contexts and returning right-padded continuations that keep their stop token).

Shape legend: N rows, R = ``max_new_tokens`` response width, A rows running in a turn, L context width.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from rlflow.nodes.agent.env import Environment, EnvStep, StepOutcome, hung_steps, run_steps

__all__ = ["ENV_ERRORS", "AgentRollout", "SampleFn", "run_agent"]

SampleFn = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""``(context_ids [A,L], context_mask [A,L], max_new_tokens) -> (ids, mask, logprobs)`` ``[A,T]``: one
continuation per context (left-padded), right-padded, ending at a stop token (kept) or the limit."""

ENV_ERRORS = ("raised", "timeout", "garbage")
"""Step failures that are the environment's (``invalid``, a turn that calls no known tool, is the model's)."""


@dataclass
class AgentRollout:
    """The rollouts of :func:`run_agent`.

    Attributes:
        response_ids, response_mask, logprobs: ``[N,R]`` int64 / int64 / float32 as ``generate`` returns
            them, observation tokens with mask 0 and log-prob 0.
        truncated: ``[N]`` int64 0/1: the row stopped at its token budget or turn limit, not at EOS or the
            environment's ``done`` (Pardo et al. 2018: a time limit is not the end of the episode).
        num_turns: ``[N]`` int64 model turns (calls of the model that added tokens to the row).
        tool_calls: ``[N]`` int64 tool calls (:attr:`EnvStep.tool_calls` summed; a failed step counts 1).
        env_rewards: ``[N]`` float32 per-turn rewards the environment returned, summed.
        lengths: ``[N]`` int64 response tokens (model and observation).
        errors: step failures by kind (``raised``, ``timeout``, ``garbage``, ``invalid``).
        env_steps: environment steps run.
        setup_errors: rows whose environment failed to start (its constructor or ``reset`` raised or passed
            the step deadline); each of their steps then fails as ``raised``.
        generate_seconds: wall time of the model calls (s). tool_seconds: wall time of the environment
            steps, each turn's concurrent steps counted once (s).
        tool_spans: per turn that stepped the environment, ``(start, end)`` of its steps (wall-clock
            seconds, ``time.time()``), for the run's trace.
        failed_rows: rows whose environment failed: it did not start, or every step it ran raised, timed
            out or returned garbage (a row that never stepped its started environment has not failed).
        first_error: the first environment failure, ``"<kind>: <detail>"`` ("" when none).
        hung_steps: step threads of this process still running past their deadline after the call
            (:func:`rlflow.nodes.agent.env.hung_steps`).
    """

    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    num_turns: torch.Tensor
    tool_calls: torch.Tensor
    env_rewards: torch.Tensor
    lengths: torch.Tensor
    errors: Counter[str] = field(default_factory=Counter)
    env_steps: int = 0
    setup_errors: int = 0
    generate_seconds: float = 0.0
    tool_seconds: float = 0.0
    tool_spans: list[tuple[float, float]] = field(default_factory=list)
    failed_rows: int = 0
    first_error: str = ""
    hung_steps: int = 0


def _left_pad(
    seqs: Sequence[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


class _NoEnvironment:
    """The environment of a row whose own failed to start: every step raises (contained, counted)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def reset(self, prompt: str) -> None:
        pass

    def step(self, turn_text: str) -> EnvStep:
        raise RuntimeError(f"the environment failed to start: {self.reason}")


def _start_envs(
    make_env: Callable[[], Environment], prompt_texts: Sequence[str], timeout: float, max_hung: int | None
) -> tuple[list[Environment], list[StepOutcome]]:
    """One environment per row, made and ``reset`` concurrently with the step deadline (a constructor or
    reset that raises or hangs is contained like a step: the row gets :class:`_NoEnvironment`); returns the
    environments and each row's start outcome (``step`` None: it failed)."""
    made: list[Environment | None] = [None] * len(prompt_texts)

    def start(i: int, text: str) -> EnvStep:
        env = make_env()
        env.reset(text)
        made[i] = env
        return EnvStep("")

    calls = [functools.partial(start, i, t) for i, t in enumerate(prompt_texts)]
    outcomes = run_steps(calls, timeout, max_hung)
    envs: list[Environment] = []
    for i, res in enumerate(outcomes):
        env = made[i]
        envs.append(env if res.step is not None and env is not None else _NoEnvironment(res.detail))
    return envs, outcomes


def run_agent(
    sample: SampleFn,
    make_env: Callable[[], Environment],
    prompts: Sequence[list[int]],
    prompt_texts: Sequence[str],
    *,
    tokenize: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    pad_id: int,
    eos_id: int,
    call_stop_ids: Sequence[int],
    max_new_tokens: int,
    max_turns: int,
    max_obs_tokens: int,
    step_timeout: float,
    error_observation: str,
    max_hung_steps: int | None = None,
    device: torch.device | None = None,
) -> AgentRollout:
    """Run one episode per prompt, model turns batched across the rows still running.

    Args:
        sample: the model call (:data:`SampleFn`); its stop tokens must be EOS and ``call_stop_ids``.
        make_env: a fresh environment per row (``reset`` with the row's prompt text).
        prompts: token ids of each row's prompt (no padding); ``prompt_texts`` their texts.
        tokenize: observation text -> token ids (no special tokens); ``decode``: a turn's ids -> text.
        call_stop_ids: ids that end a turn with a tool call (the environment then steps).
        max_new_tokens: the response budget R per row, model and observation tokens together.
        max_turns: model turns per row at most; a row whose last allowed turn calls a tool is truncated
            without running it.
        max_obs_tokens: observation tokens kept per step (the rest is cut).
        step_timeout: seconds each environment step may take (:func:`rlflow.nodes.agent.env.run_steps`).
        error_observation: the observation of a failed step (the episode continues).
        max_hung_steps: step threads abandoned past their deadline that may still run before new steps
            fail at once (:func:`rlflow.nodes.agent.env.run_steps`; None: no bound).
        device: where the returned tensors live (default: CPU).

    Returns:
        :class:`AgentRollout`.
    """
    device = device or torch.device("cpu")
    rows = len(prompts)
    stops = set(call_stop_ids)
    envs, starts = _start_envs(make_env, prompt_texts, step_timeout, max_hung_steps)
    setup_failures = sum(1 for res in starts if res.step is None)
    first = next((res for res in starts if res.step is None), None)
    first_error = f"starting the environment: {first.error}: {first.detail}" if first is not None else ""
    stepped, failed_steps = [0] * rows, [0] * rows
    toks: list[list[int]] = [[] for _ in range(rows)]
    masks: list[list[int]] = [[] for _ in range(rows)]
    lps: list[list[float]] = [[] for _ in range(rows)]
    turns, calls, truncated = [0] * rows, [0] * rows, [0] * rows
    rewards = [0.0] * rows
    running = list(range(rows))
    empty = torch.empty(0)
    out = AgentRollout(empty, empty, empty, empty, empty, empty, empty, empty)
    out.setup_errors = setup_failures
    error_ids = tokenize(error_observation)
    for turn in range(max_turns):
        if not running:
            break
        budget = {i: max_new_tokens - len(toks[i]) for i in running}
        ctx_ids, ctx_mask = _left_pad([list(prompts[i]) + toks[i] for i in running], pad_id, device)
        t0 = time.perf_counter()
        ids, mask, lp = sample(ctx_ids, ctx_mask, max(budget.values()))
        out.generate_seconds += time.perf_counter() - t0
        ids, mask, lp = ids.cpu(), mask.cpu(), lp.cpu()
        stepping: list[int] = []
        for a, i in enumerate(running):
            n = min(int(mask[a].sum()), budget[i])  # the continuation is contiguous from 0
            new = ids[a, :n].tolist()
            toks[i] += new
            masks[i] += [1] * n
            lps[i] += lp[a, :n].tolist()
            turns[i] += 1
            last = new[-1] if new else None
            if last == eos_id:
                continue  # the episode ended
            if last in stops and turn < max_turns - 1 and len(toks[i]) < max_new_tokens:
                stepping.append(i)
            else:  # budget or turn limit reached mid-episode (a call at the last turn is not run)
                truncated[i] = 1
        results: list[StepOutcome] = []
        if stepping:
            turn_texts = [decode(toks[i][len(toks[i]) - _turn_len(masks[i]) :]) for i in stepping]
            t0, wall0 = time.perf_counter(), time.time()
            results = run_steps(
                [functools.partial(envs[i].step, text) for i, text in zip(stepping, turn_texts, strict=True)],
                step_timeout,
                max_hung_steps,
            )
            out.tool_seconds += time.perf_counter() - t0
            out.tool_spans.append((wall0, max(wall0, time.time())))
            out.env_steps += len(stepping)
        next_running = []
        for i, res in zip(stepping, results, strict=True):
            stepped[i] += 1
            if res.step is None:
                out.errors[res.error] += 1
                if res.error in ENV_ERRORS:
                    failed_steps[i] += 1
                    first_error = first_error or f"{res.error}: {res.detail}"
                obs_ids, done, calls_i = error_ids, False, 1
            else:
                step = res.step
                obs_ids = tokenize(step.observation) if step.observation else []
                done, calls_i = step.done, step.tool_calls
                rewards[i] += float(step.reward)
            calls[i] += calls_i
            room = max_new_tokens - len(toks[i])
            obs_ids = obs_ids[: min(max_obs_tokens, room)]
            toks[i] += obs_ids
            masks[i] += [0] * len(obs_ids)
            lps[i] += [0.0] * len(obs_ids)
            if done:
                continue  # terminal: the last turn is the observation
            if len(toks[i]) >= max_new_tokens:
                truncated[i] = 1
                continue
            next_running.append(i)
        running = next_running
    for i in running:  # the turn limit stopped them after an observation
        truncated[i] = 1
    out.failed_rows = sum(
        1 for i in range(rows) if starts[i].step is None or (stepped[i] and failed_steps[i] == stepped[i])
    )
    out.first_error, out.hung_steps = first_error, hung_steps()
    out.response_ids = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long)
    out.response_mask = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    out.logprobs = torch.zeros((rows, max_new_tokens), dtype=torch.float32)
    for i in range(rows):
        n = len(toks[i])
        if n:
            out.response_ids[i, :n] = torch.tensor(toks[i])
            out.response_mask[i, :n] = torch.tensor(masks[i])
            out.logprobs[i, :n] = torch.tensor(lps[i])
    out.truncated = torch.tensor(truncated, dtype=torch.long)
    out.num_turns = torch.tensor(turns, dtype=torch.long)
    out.tool_calls = torch.tensor(calls, dtype=torch.long)
    out.env_rewards = torch.tensor(rewards, dtype=torch.float32)
    out.lengths = torch.tensor([len(t) for t in toks], dtype=torch.long)
    for name in ("response_ids", "response_mask", "logprobs", "truncated", "num_turns", "tool_calls"):
        setattr(out, name, getattr(out, name).to(device))
    out.env_rewards, out.lengths = out.env_rewards.to(device), out.lengths.to(device)
    return out


def _turn_len(mask: list[int]) -> int:
    """Length of the trailing run of mask-1 tokens (the last model turn)."""
    n = 0
    for m in reversed(mask):
        if not m:
            break
        n += 1
    return n
