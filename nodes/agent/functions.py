"""The node function ``agent_generate``: multi-turn rollouts with tool calls, a generate-kind node.

Registered through the ``rlflow.node_functions`` entry point like :mod:`rlflow.nodes.functions`. Its
outputs are ``generate``'s (``response_ids``, ``response_mask``, ``logprobs``, ``truncated``,
``weight_version``) plus ``num_turns``, ``tool_calls`` and ``env_rewards`` per row; observation tokens
carry mask 0 and log-prob 0, so every loss, KL and entropy term (all masked by ``response_mask``) skips
them, and GAE/returns carry across them (:func:`rlflow.nodes.rl.gae`). Metrics follow verl's names
(``num_turns/{mean,max}``, ``tool_call_counts/{mean,max}``) plus ``env/error_ratio``; model time and tool
time are reported apart (``timing_s/agent_model/<node>``, ``timing_s/agent_tool/<node>``), and each
turn's environment steps become a ``tool`` row of the run's trace (:attr:`NodeResult.spans`).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from rlflow.dataflow.args import SAMPLING_ARGS, Arg, ArgError, bind_args
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError, RlflowError
from rlflow.dataflow.registry import node_function
from rlflow.nodes.agent.env import env_arg_mistakes, make_env_factory
from rlflow.nodes.agent.loop import ENV_ERRORS, AgentRollout, SampleFn, run_agent
from rlflow.nodes.checks import RUN_CHECKS
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.functions.common import node_model, stop_token_ids
from rlflow.nodes.functions.generate import engine_sync
from rlflow.nodes.generation import generate
from rlflow.nodes.tokenizers import TokenizerInfo

if TYPE_CHECKING:
    from rlflow.dataflow.graph import Graph

__all__ = [
    "AGENT_ARGS",
    "EnvironmentWarning",
    "agent_args_mistakes",
    "agent_generate_node",
    "agent_node_mistakes",
    "check_env_failures",
    "env_factory_of",
    "eval_agent_mistakes",
    "rollout_metrics",
    "rollout_prompts",
]

_SOURCE = "Jin et al. 2025 (Search-R1); Gao et al. 2025 (ASearcher); verl agent loop"

AGENT_ARGS: tuple[Arg, ...] = (
    *SAMPLING_ARGS,
    Arg("greedy", bool, False, "take the argmax (log-probs of the unprocessed logits)"),
    Arg(
        "call_stop_tokens",
        list,
        None,
        "tokens (ids or vocabulary strings) that end a model turn with a tool call: the environment then "
        "steps (e.g. ['</search>']); EOS ends the episode",
        _SOURCE,
        optional=True,
    ),
    Arg(
        "tools",
        list,
        None,
        "tools the built-in tool environment serves (registered names or pkg.mod:fn; a turn ending with "
        "<name> arguments </name> calls one) (null: use env)",
        _SOURCE,
        optional=True,
    ),
    Arg("tool_args", dict, None, "options of each tool, {tool: {option: value}}", optional=True),
    Arg(
        "env",
        str,
        None,
        "an environment class with reset(prompt)/step(turn_text) (registered name or pkg.mod:Cls) "
        "(null: use tools)",
        optional=True,
    ),
    Arg("env_args", dict, None, "keyword arguments of the environment class", optional=True),
    Arg("max_turns", int, 4, "model turns per episode at most", _SOURCE, low=1, what="turns"),
    Arg("max_obs_tokens", int, 64, "observation tokens kept per step (the rest is cut)", low=1),
    Arg(
        "tool_timeout",
        float,
        10.0,
        "seconds an environment step may take; a later answer is dropped for the error observation",
        low=0,
        low_open=True,
    ),
    Arg(
        "error_observation",
        str,
        "<result> error </result>",
        "observation of a step that raised, timed out or returned garbage (the episode continues)",
    ),
    Arg(
        "env_error_warn_ratio",
        float,
        0.5,
        "above this share of a call's environment steps (or starts) failing, a named warning with the node "
        "and the first error (the metric env/error_ratio records every call)",
        low=0,
        high=1,
    ),
    Arg(
        "stop_when_all_env_rows_fail",
        bool,
        True,
        "stop the run (NodeError naming the node and the first error) when every row of a call failed: its "
        "environment did not start, or each step it ran raised, timed out or returned garbage",
    ),
    Arg(
        "max_hung_steps",
        int,
        64,
        "environment steps abandoned past tool_timeout whose threads may still run (a thread cannot be "
        "killed); at this many, new steps fail at once as timeouts until some return",
        low=1,
        what="steps",
    ),
)


class EnvironmentWarning(UserWarning):
    """Many of an ``agent_generate`` call's environment steps failed (``rlflow: warning: ...``)."""


def env_factory_of(args: dict[str, Any], *, disabled: bool = False) -> Any:
    """The per-row environment factory of a node's checked ``args`` (``env``, ``env_args``, ``tools``,
    ``tool_args``; :func:`rlflow.nodes.agent.env.make_env_factory`).

    Raises:
        RlflowError: an environment or tool that does not resolve.
    """
    return make_env_factory(
        args["env"], args["env_args"], args["tools"], args["tool_args"], disabled=disabled
    )


def agent_args_mistakes(args: dict[str, Any], where: str) -> list[str]:
    """One message per mistake in checked ``agent_generate`` arguments that a rollout would fail on, each
    ``"<where>.<key>: <why>"``: no ``call_stop_tokens``, a malformed, unresolvable or doubled (``env`` and
    ``tools``) environment or tool, or bad ``tool_args``."""
    out = []
    if not args["call_stop_tokens"]:
        out.append(
            f"{where}.call_stop_tokens: name the token(s) ending a tool-call turn (e.g. ['</search>'])"
        )
    shape = env_arg_mistakes(args["env"], args["env_args"], args["tools"], args["tool_args"])
    if shape:
        return out + [f"{where}.{key}: {msg}" for key, msg in shape]
    key = "env" if args["env"] is not None else "tools"
    if args["env"] is not None and args["tools"]:
        return [*out, f"{where}.env: name either env or tools, not both"]
    try:
        env_factory_of(args)
    except RlflowError as e:
        if args["tool_args"] and "tool_args" in str(e):
            key = "tool_args"
        out.append(f"{where}.{key}: {e}")
    return out


def agent_node_mistakes(graph: Graph, node: str) -> list[str]:
    """The ``agent_generate`` node's pre-launch check (:func:`agent_args_mistakes` of its ``args``), naming
    the file, node and key."""
    return agent_args_mistakes(graph.args(node), f"{graph.spec.source or '<graph>'}: nodes.{node}.args")


@RUN_CHECKS.register("run.eval.agent")
def eval_agent_mistakes(graph: Graph) -> list[str]:
    """The run-level check of ``run.eval.agent``, the held-out evaluation's ``agent_generate`` arguments:
    they must bind to :data:`AGENT_ARGS` and pass :func:`agent_args_mistakes`."""
    given = graph.spec.run.eval.get("agent")
    if given is None:
        return []
    source = graph.spec.source or "<graph>"
    try:
        if not isinstance(given, dict):
            raise ArgError("agent", f"expected a mapping of agent_generate arguments, got {given!r}")
        args = bind_args(AGENT_ARGS, dict(given))
    except ArgError as e:
        key = "run.eval.agent" if e.key == "agent" else f"run.eval.agent.{e.key}"
        return [f"{source}: {key}: {e}"]
    return agent_args_mistakes(args, f"{source}: run.eval.agent")


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


@node_function(
    "agent_generate",
    "generate",
    inputs=("prompt_ids", "prompt_mask"),
    outputs=(
        "response_ids",
        "response_mask",
        "logprobs",
        "truncated",
        "weight_version",
        "num_turns",
        "tool_calls",
        "env_rewards",
    ),
    optional_outputs=("truncated", "weight_version", "num_turns", "tool_calls", "env_rewards"),
    heads=("lm",),
    args=AGENT_ARGS,
    check=agent_node_mistakes,
)
def agent_generate_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    n: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    max_new_tokens: int,
    greedy: bool,
    call_stop_tokens: list[Any] | None,
    tools: list[str] | None,
    tool_args: dict[str, Any] | None,
    env: str | None,
    env_args: dict[str, Any] | None,
    max_turns: int,
    max_obs_tokens: int,
    tool_timeout: float,
    error_observation: str,
    env_error_warn_ratio: float,
    stop_when_all_env_rows_fail: bool,
    max_hung_steps: int,
) -> NodeResult:
    """Multi-turn rollouts with tool calls (``P`` prompts in, ``B = P·n`` rows out): ``generate``'s outputs
    ``[B,R]``/``[B]`` plus ``num_turns``, ``tool_calls`` (int64) and ``env_rewards`` (float32) ``[B]``.

    ``R = max_new_tokens`` counts model and observation tokens together. ``engine: vllm`` samples each turn
    with the runtime's vLLM engine (brought to the model's weights first, as ``generate``); the built-in
    decode loop otherwise.

    Raises:
        NodeError: no ``call_stop_tokens``, an environment/tool that does not resolve, engine failures, or
            (``stop_when_all_env_rows_fail``) every row's environment failed (:func:`check_env_failures`).

    Warns:
        EnvironmentWarning: more than ``env_error_warn_ratio`` of the call's environment steps or starts
            failed.
    """
    module = node_model(ctx)
    assert ctx.model is not None
    tokenizer = ctx.model.tokenizer
    if tokenizer is None:
        raise NodeError(f"node '{ctx.node.name}': agent_generate needs the model's tokenizer")
    if not call_stop_tokens:
        raise NodeError(f"node '{ctx.node.name}': args.call_stop_tokens names no token")
    info = TokenizerInfo.from_tokenizer(tokenizer)
    call_stop = stop_token_ids(ctx, call_stop_tokens)
    try:
        make_env = env_factory_of({"env": env, "env_args": env_args, "tools": tools, "tool_args": tool_args})
    except RlflowError as e:
        raise NodeError(f"node '{ctx.node.name}': {e}") from e
    metrics: dict[str, float] = {}
    stops = sorted({info.eos_id, *call_stop})
    if ctx.node.engine == "vllm":
        if ctx.engine is None:
            raise NodeError(f"node '{ctx.node.name}': engine vllm was not started by the runtime")
        metrics.update(engine_sync(ctx))
        engine = ctx.engine

        def sample(ids: torch.Tensor, mask: torch.Tensor, limit: int) -> Any:
            return engine.generate(
                ids, mask, n=1, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=limit,
                greedy=greedy, stop_token_ids=stops, pad_id=info.pad_id, generator=ctx.generator,
            )  # fmt: skip
    else:
        module.eval()

        def sample(ids: torch.Tensor, mask: torch.Tensor, limit: int) -> Any:
            return generate(
                module, info, ids, mask, n=1, temperature=temperature, top_p=top_p, top_k=top_k,
                max_new_tokens=limit, greedy=greedy, stop_token_ids=call_stop, generator=ctx.generator,
                pad_to_max=False,
            )  # fmt: skip

    rollout = rollout_prompts(
        sample, make_env, tokenizer, info, batch, n=n, call_stop=call_stop, max_new_tokens=max_new_tokens,
        max_turns=max_turns, max_obs_tokens=max_obs_tokens, tool_timeout=tool_timeout,
        error_observation=error_observation, max_hung_steps=max_hung_steps,
        device=batch.tensor("prompt_ids").device,
    )  # fmt: skip
    metrics.update(rollout_metrics(rollout, max_new_tokens, ctx.node.name))
    check_env_failures(rollout, ctx.node.name, env_error_warn_ratio, stop_when_all_env_rows_fail)
    metrics["rollout/weight_version"] = float(ctx.model.version)
    ids = rollout.response_ids
    version = torch.full((ids.shape[0],), ctx.model.version, dtype=torch.long, device=ids.device)
    outputs = {
        "response_ids": ids,
        "response_mask": rollout.response_mask,
        "logprobs": rollout.logprobs,
        "truncated": rollout.truncated,
        "weight_version": version,
        "num_turns": rollout.num_turns,
        "tool_calls": rollout.tool_calls,
        "env_rewards": rollout.env_rewards,
    }
    tokens = int(batch.tensor("prompt_mask").sum()) * n + int((ids != info.pad_id).sum())
    spans = [("tool", t0, t1) for t0, t1 in rollout.tool_spans]  # the trace shows tool time apart
    return NodeResult(outputs, metrics, tokens, spans)


def check_env_failures(r: AgentRollout, node: str, warn_ratio: float, stop_when_all_fail: bool) -> None:
    """Make an ``agent_generate`` call's environment failures loud: a rollout whose failed share (failed
    steps / steps, or failed starts / rows, the larger) is above ``warn_ratio`` warns, naming the node, the
    share and the first error; one whose every row failed (``AgentRollout.failed_rows``) stops.

    Raises:
        NodeError: every row failed and ``stop_when_all_fail``.

    Warns:
        EnvironmentWarning: the failed share is above ``warn_ratio``.
    """
    rows = int(r.truncated.numel())
    failed_steps = sum(r.errors[k] for k in ENV_ERRORS)
    share = max(failed_steps / max(1, r.env_steps), r.setup_errors / max(1, rows))
    hung = f"; {r.hung_steps} step threads still run past their deadline" if r.hung_steps else ""
    if stop_when_all_fail and rows and r.failed_rows == rows:
        raise NodeError(
            f"node '{node}': the environment failed on every row of the call ({rows} rows; first error: "
            f"{r.first_error}){hung}; fix the environment, or set args.stop_when_all_env_rows_fail: false to "
            "train on the error observations"
        )
    if share > warn_ratio:
        warnings.warn(
            EnvironmentWarning(
                f"node '{node}': {share:.0%} of the environment's steps failed in this call (above "
                f"args.env_error_warn_ratio {warn_ratio:g}; first error: {r.first_error}){hung}"
            ),
            stacklevel=2,
        )


def rollout_prompts(
    sample: SampleFn,
    make_env: Any,
    tokenizer: Any,
    info: TokenizerInfo,
    batch: Batch,
    *,
    n: int,
    call_stop: list[int],
    max_new_tokens: int,
    max_turns: int,
    max_obs_tokens: int,
    tool_timeout: float,
    error_observation: str,
    device: torch.device,
    max_hung_steps: int | None = None,
) -> AgentRollout:
    """:func:`rlflow.nodes.agent.loop.run_agent` over a batch's left-padded prompts, ``n`` rows per prompt
    (rows ``i*n .. i*n+n-1`` belong to prompt ``i``)."""
    prompts: list[list[int]] = []
    for ids, mask in zip(batch.tensor("prompt_ids").cpu(), batch.tensor("prompt_mask").cpu(), strict=True):
        prompts += [ids[mask.bool()].tolist()] * n
    texts = [str(t) for t in tokenizer.batch_decode(prompts, skip_special_tokens=True)]
    return run_agent(
        sample,
        make_env,
        prompts,
        texts,
        tokenize=lambda text: _tokenize(tokenizer, text),
        decode=lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
        pad_id=info.pad_id,
        eos_id=info.eos_id,
        call_stop_ids=call_stop,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        max_obs_tokens=max_obs_tokens,
        step_timeout=tool_timeout,
        error_observation=error_observation,
        max_hung_steps=max_hung_steps,
        device=device,
    )


def rollout_metrics(r: AgentRollout, max_new_tokens: int, node: str) -> dict[str, float]:
    """The rollout's metrics: response lengths (all tokens), ``num_turns/*``, ``tool_call_counts/*``,
    ``env/error_ratio`` (failed environment steps / steps: raised, timed out or garbage),
    ``env/invalid_call_ratio`` (turns calling no known tool / steps), ``env/<kind>_count``,
    ``env/setup_error_count`` (rows whose environment failed to start), ``env/hung_steps`` (step threads
    still running past their deadline, :func:`rlflow.nodes.agent.env.hung_steps`),
    ``timing_s/agent_model/<node>`` and ``timing_s/agent_tool/<node>`` (s)."""
    lengths = r.lengths.float()
    steps = max(1, r.env_steps)
    out = {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float((r.lengths >= max_new_tokens).float().mean()),
        "response_length/truncated_ratio": float(r.truncated.float().mean()),
        "response_length/trained_tokens/mean": float(r.response_mask.sum(1).float().mean()),
        "num_turns/mean": float(r.num_turns.float().mean()),
        "num_turns/max": float(r.num_turns.max()),
        "tool_call_counts/mean": float(r.tool_calls.float().mean()),
        "tool_call_counts/max": float(r.tool_calls.max()),
        "env/error_ratio": sum(r.errors[k] for k in ENV_ERRORS) / steps,
        "env/invalid_call_ratio": r.errors["invalid"] / steps,
        "env/reward/mean": float(r.env_rewards.mean()),
        "env/setup_error_count": float(r.setup_errors),
        "env/hung_steps": float(r.hung_steps),
        f"timing_s/agent_model/{node}": r.generate_seconds,
        f"timing_s/agent_tool/{node}": r.tool_seconds,
    }
    for kind in (*ENV_ERRORS, "invalid"):
        out[f"env/{kind}_count"] = float(r.errors[kind])
    return out
