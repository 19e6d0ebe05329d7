"""Reward services over HTTP: ``http_reward`` (a reward model or any scorer behind rlflow's JSON scoring
protocol) and ``judge_reward`` (an LLM judge behind an OpenAI-compatible server, e.g. ``vllm serve``).

Both decode the node's prompts and responses, send them in requests of ``samples_per_request`` samples
(:mod:`rlflow.nodes.services.http_protocols`) through the node's
:class:`~rlflow.nodes.services.http_client.ServiceClient` (timeouts, retries with backoff and jitter, a
concurrency limit, a circuit breaker), and return ``scores`` ``[B]``. A service that stays down or slow past
its retry budget stops the run with one line naming the node, the URL and the last failure
(:class:`~rlflow.dataflow.errors.NodeError`); ``rlflow run --resume`` continues from the last checkpoint.
A judge reply without a readable score is not a failure of the service: the sample scores ``failure_score``
and counts in ``reward/judge_unparsed_ratio``.
"""

from __future__ import annotations

import os
import re
from typing import Any

import httpx
import torch

from rlflow.dataflow.args import Arg
from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import NodeError
from rlflow.dataflow.registry import node_function
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.functions.common import SEQ
from rlflow.nodes.functions.inference import score_metrics
from rlflow.nodes.generation import decode_responses
from rlflow.nodes.services.http_client import ServiceClient, ServiceError, ServiceLimits, service_client
from rlflow.nodes.services.http_protocols import (
    JUDGE_APIS,
    fill_template,
    judge_bodies,
    judge_score,
    parse_judge_texts,
    parse_scores,
    score_bodies,
    score_pattern_mistakes,
    template_mistakes,
)

__all__ = ["HTTP_REWARD_ARGS", "JUDGE_ARGS", "SERVICE_ARGS", "http_reward_node", "judge_reward_node",
           "service_mistakes"]  # fmt: skip

SERVICE_ARGS = (
    Arg("connect_timeout_s", float, 5.0, "seconds to open a connection to the service", low=0, low_open=True),
    Arg("read_timeout_s", float, 60.0, "seconds to wait for each read of a reply", low=0, low_open=True),
    Arg("request_timeout_s", float, 180.0, "seconds one attempt may take in all (connect and the whole "
        "reply; at least read_timeout_s): a reply still arriving past it is a timeout", low=0, low_open=True),
    Arg("max_reply_bytes", int, 16 * 2**20, "the largest reply read, in bytes; a larger one stops the run",
        low=1),
    Arg("max_retries", int, 5, "attempts after the first for one request before the run stops", low=0),
    Arg("backoff_s", float, 0.5, "seconds: retry k waits a uniform draw in [0, backoff_s * 2^(k-1)] "
        "(capped by backoff_max_s)", "full jitter, Brooker 2015 (AWS Architecture Blog)",
        low=0, low_open=True),
    Arg("backoff_max_s", float, 30.0, "seconds: the cap of one retry's wait", low=0, low_open=True),
    Arg("concurrency", int, 4, "requests in flight at once", low=1),
    Arg("breaker_failures", int, 5, "consecutive failed requests that open the circuit breaker", low=1),
    Arg("breaker_cooldown_s", float, 10.0, "seconds no request is sent once the circuit breaker opens",
        "Nygard, Release It! (2007)", low=0),
    Arg("api_key_env", str, None, "the environment variable holding an API key, sent as 'Authorization: "
        "Bearer <key>' (the key itself is never written into records); null: no key", optional=True),
)  # fmt: skip
"""The arguments of every HTTP reward node: timeouts, retries, concurrency, circuit breaker, API key."""

HTTP_REWARD_ARGS = (
    Arg("url", str, "", "the scoring endpoint, http(s)://host:port/path (required)"),
    Arg("samples_per_request", int, 32, "samples in one request", low=1),
    *SERVICE_ARGS,
)
"""``http_reward``'s arguments."""

JUDGE_ARGS = (
    Arg("url", str, "", "the OpenAI-compatible API's base URL, e.g. http://127.0.0.1:8000/v1 (required)"),
    Arg("model", str, "", "the served model's name, as the server lists it under /v1/models (required)"),
    Arg("api", str, "chat", "chat: POST <url>/chat/completions, one sample a request; completions: POST "
        "<url>/completions, samples_per_request prompts a request", choices=JUDGE_APIS),
    Arg("samples_per_request", int, 16, "prompts in one /completions request", low=1,
        needs=("api", ("completions",))),
    Arg("template", str, "Rate the response to the prompt from 0 to 10. Prompt: {prompt} Reference answer: "
        "{answer} Response: {response} Reply with 'Score: <0-10>'.",
        "the judge's prompt; {prompt}, {response} and {answer} are filled in (literal braces doubled)"),
    Arg("score_pattern", str, r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)",
        "regular expression whose group 1, at its first match in the reply, is the score"),
    Arg("failure_score", float, 0.0, "the score of a reply without a readable score"),
    Arg("max_tokens", int, 32, "tokens the judge may generate per reply", low=1),
    Arg("temperature", float, 0.0, "the judge's sampling temperature (0: greedy)", low=0),
    *SERVICE_ARGS,
)  # fmt: skip
"""``judge_reward``'s arguments."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _url_mistakes(url: str) -> list[str]:
    if not url:
        return ["is required (the service's http:// or https:// URL)"]
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as e:
        return [f"{url!r} is not a URL ({e})"]
    if parsed.userinfo:  # the URL is not echoed: it holds the secret
        return [
            "holds credentials (user:password@host), which would be written into the run's graph.yaml "
            "and its error lines; name an environment variable holding the key in api_key_env instead"
        ]
    if parsed.scheme not in ("http", "https") or not parsed.host:
        return [f"{url!r} is not an http:// or https:// URL with a host"]
    if parsed.port is not None and not 1 <= parsed.port <= 65535:
        return [f"{url!r} has port {parsed.port}, outside 1..65535"]
    return []


def service_mistakes(args: dict[str, Any], where: str) -> list[str]:
    """The pre-launch check of the bound arguments of ``http_reward`` and ``judge_reward`` (a node's, or the
    held-out evaluation's ``run.eval.reward_args``): the URL's syntax (an http(s) scheme, a host, a port in
    1..65535, no credentials), a judge's model, template and score pattern, ``request_timeout_s >=
    read_timeout_s``, ``backoff_max_s >= backoff_s``, and that ``api_key_env`` names a set environment
    variable. One message per mistake, starting with ``where`` (the file and key prefix)."""
    out = [f"{where}.url: {m}" for m in _url_mistakes(str(args["url"]))]
    if args["request_timeout_s"] < args["read_timeout_s"]:
        out.append(
            f"{where}.request_timeout_s: {args['request_timeout_s']:g} is below read_timeout_s "
            f"{args['read_timeout_s']:g} (it bounds the whole request, each read included)"
        )
    if args["backoff_max_s"] < args["backoff_s"]:
        out.append(
            f"{where}.backoff_max_s: {args['backoff_max_s']:g} is below backoff_s {args['backoff_s']:g}"
        )
    env = args["api_key_env"]
    if env is not None and not _ENV_NAME.fullmatch(env):
        out.append(f"{where}.api_key_env: {env!r} is not an environment variable's name")
    elif env is not None and not os.environ.get(env):
        out.append(f"{where}.api_key_env: the environment variable {env} is not set")
    if "model" in args:  # a judge
        if not args["model"]:
            out.append(f"{where}.model: is required (the served model's name)")
        out += [f"{where}.template: {m}" for m in template_mistakes(str(args["template"]))]
        out += [f"{where}.score_pattern: {m}" for m in score_pattern_mistakes(str(args["score_pattern"]))]
    return out


def _client(ctx: NodeContext, url: str, limits: ServiceLimits, env: str | None) -> ServiceClient:
    headers = {}
    if env is not None:
        key = os.environ.get(env)
        if not key:
            raise NodeError(
                f"node '{ctx.node.name}': args.api_key_env: the environment variable {env} is not set"
            )
        headers["Authorization"] = f"Bearer {key}"
    return service_client(ctx.node.name, url, limits, headers)


def _texts(ctx: NodeContext, batch: Batch) -> tuple[list[str], list[str], list[str] | None]:
    """Decoded prompts and responses ``[B]`` and the answers (``None`` when the node binds no ``answer``)."""
    if ctx.tokenizer is None:
        raise NodeError(f"node '{ctx.node.name}': {ctx.node.function} needs a tokenizer to decode text")
    prompts = decode_responses(ctx.tokenizer, batch.tensor("prompt_ids"), batch.tensor("prompt_mask"))
    responses = decode_responses(ctx.tokenizer, batch.tensor("response_ids"), batch.tensor("response_mask"))
    answers = [str(a) for a in batch.list_of("answer")] if "answer" in batch else None
    return prompts, responses, answers


def _result(batch: Batch, scores: list[float], metrics: dict[str, float]) -> NodeResult:
    t = torch.tensor(scores, dtype=torch.float32)
    return NodeResult(
        {"scores": t}, metrics | score_metrics("scores", t), int(batch.tensor("response_mask").sum())
    )


_INPUTS = (*SEQ, "answer")


@node_function(
    "http_reward",
    "inference",
    inputs=_INPUTS,
    outputs=("scores",),
    optional_inputs=("answer",),
    needs_model=False,
    args=HTTP_REWARD_ARGS,
    args_check=service_mistakes,
)
def http_reward_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    url: str,
    samples_per_request: int,
    connect_timeout_s: float,
    read_timeout_s: float,
    request_timeout_s: float,
    max_reply_bytes: int,
    max_retries: int,
    backoff_s: float,
    backoff_max_s: float,
    concurrency: int,
    breaker_failures: int,
    breaker_cooldown_s: float,
    api_key_env: str | None,
) -> NodeResult:
    """Scores ``[B]`` from a service speaking the JSON scoring protocol (POST prompts, responses, answers;
    reply ``{"scores": [...]}``), in requests of ``samples_per_request`` samples.

    Raises:
        NodeError: the service failed past its retry budget, rejected a request (HTTP 4xx, a 3xx redirect)
            or replied in another shape or over ``max_reply_bytes``; one line naming the node, the URL and
            the last failure.
    """
    prompts, responses, answers = _texts(ctx, batch)
    bodies = score_bodies(prompts, responses, answers, samples_per_request)
    limits = ServiceLimits(
        connect_timeout_s, read_timeout_s, request_timeout_s, max_reply_bytes, max_retries, backoff_s,
        backoff_max_s, concurrency, breaker_failures, breaker_cooldown_s,
    )  # fmt: skip
    client = _client(ctx, url, limits, api_key_env)
    try:
        parts, stats = client.post_all([(b, parse_scores(len(b["responses"]))) for b in bodies])
    except ServiceError as e:
        raise NodeError(f"node '{ctx.node.name}': reward service {e}") from None
    return _result(batch, [s for part in parts for s in part], stats.metrics())


@node_function(
    "judge_reward",
    "inference",
    inputs=_INPUTS,
    outputs=("scores",),
    optional_inputs=("answer",),
    needs_model=False,
    args=JUDGE_ARGS,
    args_check=service_mistakes,
)
def judge_reward_node(
    ctx: NodeContext,
    batch: Batch,
    *,
    url: str,
    model: str,
    api: str,
    samples_per_request: int,
    template: str,
    score_pattern: str,
    failure_score: float,
    max_tokens: int,
    temperature: float,
    connect_timeout_s: float,
    read_timeout_s: float,
    request_timeout_s: float,
    max_reply_bytes: int,
    max_retries: int,
    backoff_s: float,
    backoff_max_s: float,
    concurrency: int,
    breaker_failures: int,
    breaker_cooldown_s: float,
    api_key_env: str | None,
) -> NodeResult:
    """Scores ``[B]`` from an LLM judge behind an OpenAI-compatible server: each sample's ``template`` filled
    with its prompt, response and answer, the score read from the reply by ``score_pattern``; a reply
    without one scores ``failure_score`` (``reward/judge_unparsed_ratio``).

    Raises:
        NodeError: the server failed past its retry budget, rejected a request (HTTP 4xx, a 3xx redirect)
            or replied with something that is not an OpenAI completion or over ``max_reply_bytes``; one
            line naming the node, URL and last failure.
    """
    prompts, responses, answers = _texts(ctx, batch)
    texts = [
        fill_template(template, p, r, a)
        for p, r, a in zip(prompts, responses, answers or [""] * len(responses), strict=True)
    ]
    bodies = judge_bodies(
        api, model, texts, max_tokens=max_tokens, temperature=temperature, per_request=samples_per_request
    )
    endpoint = url.rstrip("/") + ("/chat/completions" if api == "chat" else "/completions")
    limits = ServiceLimits(
        connect_timeout_s, read_timeout_s, request_timeout_s, max_reply_bytes, max_retries, backoff_s,
        backoff_max_s, concurrency, breaker_failures, breaker_cooldown_s,
    )  # fmt: skip
    client = _client(ctx, endpoint, limits, api_key_env)
    sizes = [1 if api == "chat" else len(b["prompt"]) for b in bodies]
    try:
        parts, stats = client.post_all(
            [(b, parse_judge_texts(api, n)) for b, n in zip(bodies, sizes, strict=True)]
        )
    except ServiceError as e:
        raise NodeError(f"node '{ctx.node.name}': judge {e}") from None
    read = [judge_score(text, score_pattern) for part in parts for text in part]
    unparsed = sum(v is None for v in read)
    metrics = stats.metrics() | {
        "reward/judge_parsed_ratio": (len(read) - unparsed) / len(read) if read else 0.0,
        "reward/judge_unparsed_ratio": unparsed / len(read) if read else 0.0,
    }
    return _result(batch, [failure_score if v is None else v for v in read], metrics)
