"""Calling a reward service over HTTP: JSON POSTs sent a bounded number at a time, each retried with
exponential backoff and jitter, behind a circuit breaker that a node's calls share; the counts a node reports.

One :class:`ServiceClient` per (node, URL, limits) lives as long as its process (:func:`service_client`), so
its connection pool and its breaker carry over from one iteration to the next. :meth:`ServiceClient.post_all`
sends a list of JSON bodies and returns their replies in order, or raises :class:`ServiceError` once a body's
retry budget is spent (every other body in flight then stops at its next attempt); the node function turns it
into a one-line :class:`~rlflow.dataflow.errors.NodeError` that stops the run (its last checkpoint stays, so
``rlflow run --resume`` continues once the service is back).

Failure reasons (:data:`FAILURE_REASONS`): ``timeout`` (connect or one read past its limit, or the whole
request past its deadline), ``connection`` (refused, reset, closed mid-reply), ``status`` (HTTP 5xx, 408 or
429), all retried; ``rejected`` (any other HTTP 4xx: a wrong path, body or API key; or a 3xx redirect, never
followed) and ``reply`` (over the size cap, not JSON, or not the protocol's shape) are not retried, since
sending the same request again cannot change them.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import tenacity

__all__ = [
    "FAILURE_REASONS",
    "CircuitBreaker",
    "ServiceClient",
    "ServiceError",
    "ServiceFailure",
    "ServiceLimits",
    "ServiceStats",
    "service_client",
]

T = TypeVar("T")

FAILURE_REASONS = ("timeout", "connection", "status", "rejected", "reply")
"""Why one request failed; each is counted in ``reward/service_fail_<reason>``."""
_FAILURE_METRICS = {  # written out whole, so the metric reference lists each
    "timeout": "reward/service_fail_timeout",
    "connection": "reward/service_fail_connection",
    "status": "reward/service_fail_status",
    "rejected": "reward/service_fail_rejected",
    "reply": "reward/service_fail_reply",
}
assert tuple(_FAILURE_METRICS) == FAILURE_REASONS
_RETRIED = frozenset({"timeout", "connection", "status"})
_RETRIED_STATUS = frozenset({408, 429})


class ServiceFailure(Exception):
    """One request failed for ``reason`` (one of :data:`FAILURE_REASONS`); ``detail`` says how."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in FAILURE_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    @property
    def retried(self) -> bool:
        return self.reason in _RETRIED


class ServiceError(Exception):
    """A request's retry budget is spent (or its failure is not retried): one line naming the URL, the
    attempts, the seconds they took and the last failure."""


@dataclass(frozen=True)
class ServiceLimits:
    """How a node calls its service (the node's arguments; their defaults live in the argument schema).

    Attributes:
        connect_timeout_s, read_timeout_s: seconds to open a connection / to wait for each read of a reply.
        request_timeout_s: seconds one attempt may take in all, connecting and reading the whole reply
            included; checked after each read, so an attempt ends at the first read past it (at most
            ``read_timeout_s`` later: a server trickling its reply cannot hold a request longer).
        max_reply_bytes: the largest reply body read (bytes, after content decoding); a larger one fails.
        max_retries: attempts after the first for one request (0: one attempt).
        backoff_s, backoff_max_s: the wait before retry ``k`` (1-based) is drawn uniformly from
            ``[0, min(backoff_max_s, backoff_s · 2^(k-1))]`` ("full jitter", Brooker 2015, AWS Architecture
            Blog, "Exponential Backoff And Jitter"; tenacity's ``wait_random_exponential``).
        concurrency: requests in flight at once.
        breaker_failures: consecutive failed requests (over all of the node's requests) that open the
            circuit breaker; while open, no request is sent for ``breaker_cooldown_s`` seconds.
    """

    connect_timeout_s: float
    read_timeout_s: float
    request_timeout_s: float
    max_reply_bytes: int
    max_retries: int
    backoff_s: float
    backoff_max_s: float
    concurrency: int
    breaker_failures: int
    breaker_cooldown_s: float


class CircuitBreaker:
    """Consecutive-failure circuit breaker (Nygard, "Release It!", 2007): ``failures`` failed requests in a
    row open it; while open no request is sent for ``cooldown_s`` seconds; after that requests go again
    (half-open) and the next failure re-opens it at once, the next success closes it.

    Thread-safe; the lock is held only to read or update the state, never during a request (pybreaker, the
    common library, holds its lock for the whole call, which would send one request at a time).
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures, self.cooldown_s, self._clock = failures, cooldown_s, clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until = 0.0
        self.opened = 0  # times it opened, since the client was made

    def wait_s(self) -> float:
        """Seconds until a request may be sent (0: closed, or the cool-down is over)."""
        with self._lock:
            return max(0.0, self._open_until - self._clock())

    def record(self, ok: bool) -> None:
        """Count one request's outcome; opens the breaker on the ``failures``-th failure in a row."""
        with self._lock:
            if ok:
                self._consecutive = 0
                return
            self._consecutive += 1
            if self._consecutive >= self.failures and self._open_until <= self._clock():
                self._open_until = self._clock() + self.cooldown_s
                self.opened += 1


@dataclass
class ServiceStats:
    """What one :meth:`ServiceClient.post_all` did: requests sent (attempts), retries and the seconds waited
    before them (backoff, or the breaker's cool-down where longer), each failure's reason, the seconds of each
    successful request, and the times the breaker opened."""

    requests: int = 0
    retries: int = 0
    wait_s: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)
    breaker_opens: int = 0

    def metrics(self) -> dict[str, float]:
        """``reward/service_requests``, ``reward/service_retries``, ``reward/service_wait_s`` (seconds, summed
        over the retries), ``reward/service_breaker_opens``, ``reward/service_latency_s`` (mean seconds of a
        successful request), ``reward/service_latency_max_s`` and ``reward/service_fail_<reason>`` for every
        reason of :data:`FAILURE_REASONS` (counts)."""
        lat = self.latencies_s
        out = {
            "reward/service_requests": float(self.requests),
            "reward/service_retries": float(self.retries),
            "reward/service_wait_s": self.wait_s,
            "reward/service_breaker_opens": float(self.breaker_opens),
            "reward/service_latency_s": sum(lat) / len(lat) if lat else 0.0,
            "reward/service_latency_max_s": max(lat) if lat else 0.0,
        }
        out |= {name: float(self.failures[reason]) for reason, name in _FAILURE_METRICS.items()}
        return out


class ServiceClient:
    """POSTs JSON bodies to one URL under :class:`ServiceLimits` (see the module docstring).

    ``headers`` go with every request (an ``Authorization`` header read from the environment by the caller;
    never logged: messages name the URL only).
    """

    def __init__(self, url: str, limits: ServiceLimits, headers: dict[str, str] | None = None) -> None:
        self.url, self.limits = url, limits
        timeout = httpx.Timeout(
            limits.read_timeout_s, connect=limits.connect_timeout_s, pool=limits.connect_timeout_s
        )
        pool = httpx.Limits(max_connections=limits.concurrency, max_keepalive_connections=limits.concurrency)
        self._http = httpx.Client(timeout=timeout, limits=pool, headers=headers or {})
        self.breaker = CircuitBreaker(limits.breaker_failures, limits.breaker_cooldown_s)
        self._stats_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def post_all(
        self, requests: Sequence[tuple[dict[str, Any], Callable[[Any], T]]]
    ) -> tuple[list[T], ServiceStats]:
        """``[parse(reply JSON) for body, parse in requests]`` in order, at most ``concurrency`` requests in
        flight; each ``parse`` raises :class:`ServiceFailure` ``("reply", why)`` for a reply of another shape.

        Raises:
            ServiceError: a body's retry budget is spent or its failure is not retried (the first such
                body's error; the others stop before their next attempt).
        """
        stats = ServiceStats()
        stop = threading.Event()
        opened_before = self.breaker.opened
        workers = max(1, min(self.limits.concurrency, len(requests)))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rlflow-reward-service") as pool:
            futures = [pool.submit(self._post_one, body, parse, stats, stop) for body, parse in requests]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                stop.set()  # the others stop before their next attempt
        stats.breaker_opens = self.breaker.opened - opened_before
        if failed:
            error = failed[0].exception()
            assert error is not None
            raise error
        return [f.result() for f in futures], stats

    def _post_one(
        self, body: dict[str, Any], parse: Callable[[Any], T], stats: ServiceStats, stop: threading.Event
    ) -> T:
        lim = self.limits
        started = time.monotonic()

        def attempt() -> T:
            # a breaker opened by another request: wait out its cool-down before sending
            while (wait := self.breaker.wait_s()) > 0 and not stop.is_set():
                stop.wait(wait)
            if stop.is_set():
                raise ServiceFailure("connection", "stopped: another request of this call failed")
            t0 = time.monotonic()
            with self._stats_lock:
                stats.requests += 1
            try:
                value = self._request(body, parse)
            except ServiceFailure as e:
                self.breaker.record(False)
                with self._stats_lock:
                    stats.failures[e.reason] += 1
                raise
            self.breaker.record(True)
            with self._stats_lock:
                stats.latencies_s.append(time.monotonic() - t0)
            return value

        def before_sleep(state: tenacity.RetryCallState) -> None:
            with self._stats_lock:
                stats.retries += 1
                stats.wait_s += state.next_action.sleep if state.next_action else 0.0

        def sleep(seconds: float) -> None:
            stop.wait(seconds)  # cut short when another request of this call failed

        backoff = tenacity.wait_random_exponential(multiplier=lim.backoff_s, max=lim.backoff_max_s)
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(lim.max_retries + 1) | tenacity.stop_when_event_set(stop),
            wait=lambda state: max(backoff(state), self.breaker.wait_s()),
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, ServiceFailure) and e.retried),
            sleep=sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except ServiceFailure as e:
            n = retrying.statistics.get("attempt_number", 1)
            raise ServiceError(
                f"{self.url}: {'gave up after' if e.retried else 'not retried after'} "
                f"{n} attempt{'s' if n != 1 else ''} in {time.monotonic() - started:.1f} s; "
                f"last failure: {e}"
            ) from e

    def _request(self, body: dict[str, Any], parse: Callable[[Any], T]) -> T:
        try:
            status, headers, raw = self._receive(body)
        except httpx.TimeoutException as e:
            raise ServiceFailure("timeout", f"{type(e).__name__} ({_one_line(e)})") from e
        except httpx.TransportError as e:
            raise ServiceFailure("connection", f"{type(e).__name__} ({_one_line(e)})") from e
        text = raw.decode("utf-8", errors="replace")
        if 300 <= status < 400:  # never followed: the URL to write in the graph is the Location
            where = headers.get("location")
            raise ServiceFailure("rejected", f"HTTP {status} redirect to {where or '(no Location header)'}")
        if status >= 400:
            retried = status >= 500 or status in _RETRIED_STATUS
            raise ServiceFailure(
                "status" if retried else "rejected", f"HTTP {status} {_one_line(text)[:200]!r}"
            )
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise ServiceFailure("reply", f"not JSON: {_one_line(text)[:200]!r}") from e
        return parse(data)

    def _receive(self, body: dict[str, Any]) -> tuple[int, httpx.Headers, bytes]:
        """One POST's status, headers and body, read chunk by chunk against the attempt's deadline
        (``request_timeout_s``) and the size cap (``max_reply_bytes``)."""
        lim = self.limits
        deadline = time.monotonic() + lim.request_timeout_s
        with self._http.stream("POST", self.url, json=body) as reply:
            declared = reply.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > lim.max_reply_bytes:
                raise ServiceFailure(
                    "reply",
                    f"{int(declared)} bytes (Content-Length), over max_reply_bytes ({lim.max_reply_bytes})",
                )
            chunks: list[bytes] = []
            size = 0
            for chunk in reply.iter_bytes():
                size += len(chunk)
                if size > lim.max_reply_bytes:
                    raise ServiceFailure(
                        "reply", f"more than max_reply_bytes ({lim.max_reply_bytes}): {size} bytes read"
                    )
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    of = f" of {declared}" if declared.isdigit() else ""
                    detail = (
                        f"past request_timeout_s ({lim.request_timeout_s:g} s) with {size}{of} bytes read"
                    )
                    raise ServiceFailure("timeout", detail)
            return reply.status_code, reply.headers, b"".join(chunks)


def _one_line(x: object) -> str:
    return " ".join(str(x).split())


_CLIENTS: dict[tuple[str, str, ServiceLimits, tuple[tuple[str, str], ...]], ServiceClient] = {}
_CLIENTS_LOCK = threading.Lock()


def service_client(
    node: str, url: str, limits: ServiceLimits, headers: dict[str, str] | None = None
) -> ServiceClient:
    """The process's :class:`ServiceClient` of node ``node`` for ``url`` and ``limits`` (made on first use,
    so that its connections and its breaker's state carry over between the node's calls)."""
    key = (node, url, limits, tuple(sorted((headers or {}).items())))
    with _CLIENTS_LOCK:
        if key not in _CLIENTS:
            _CLIENTS[key] = ServiceClient(url, limits, headers)
        return _CLIENTS[key]
