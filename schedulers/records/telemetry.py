"""Live Prometheus metrics of a running controller (prometheus-client).

Every :class:`LiveMetrics` owns its own ``CollectorRegistry`` (never the process-global one), so several
runs or tests can live in one process. The HTTP endpoint binds to 127.0.0.1 unless a host is given.

Exposed metrics (Prometheus conventions: ``rlflow_`` prefix, unit suffixes):

==========================================  =========  =========================================
name                                        type       source
==========================================  =========  =========================================
rlflow_node_seconds{node}                   histogram  trace rows of kind ``node`` (end_s - start_s)
rlflow_tokens_total                         counter    ``perf/total_num_tokens``, else throughput x
                                                       ``timing_s/iteration``, else trace tokens
rlflow_samples_total                        counter    ``perf/num_samples``, else samples_per_s x
                                                       ``timing_s/iteration``
rlflow_throughput_tokens_per_second         gauge      ``perf/throughput``
rlflow_throughput_samples_per_second        gauge      ``perf/samples_per_s``
rlflow_iteration_seconds                    gauge      ``timing_s/iteration``
rlflow_reallocation_bytes_total             counter    trace rows of kind ``reallocation``
rlflow_reallocation_seconds                 histogram  trace rows of kind ``reallocation``
rlflow_data_transfer_bytes_total            counter    trace rows of kind ``data_transfer``
rlflow_worker_memory_bytes{worker}          gauge      metrics ``memory_bytes/<worker>``
rlflow_iteration                            gauge      the iteration index
rlflow_reward                               gauge      ``critic/score/mean``
rlflow_kl                                   gauge      first of ``actor/kl``, ``critic/kl``,
                                                       ``actor/kl_loss``, ``actor/ppo_kl``
==========================================  =========  =========================================
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rlflow.schedulers.records.rundir import TraceRow

__all__ = ["KL_METRICS", "METRIC_NAMES", "REWARD_METRIC", "LiveMetrics", "progress_fields"]

REWARD_METRIC: Final = "critic/score/mean"
# KL to the reference policy first; the PPO old/new-policy KL only when nothing else is logged.
KL_METRICS: Final[tuple[str, ...]] = (
    "actor/reward_kl",
    "actor/kl",
    "critic/kl",
    "actor/kl_loss",
    "actor/ppo_kl",
)
MEMORY_PREFIX: Final = "memory_bytes/"

# Node times range from milliseconds (tiny CPU tests) to tens of minutes (large generation).
_SECONDS_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                           600.0, 1800.0, math.inf)  # fmt: skip

METRIC_NAMES: Final[tuple[str, ...]] = (
    "rlflow_node_seconds",
    "rlflow_tokens_total",
    "rlflow_samples_total",
    "rlflow_throughput_tokens_per_second",
    "rlflow_throughput_samples_per_second",
    "rlflow_iteration_seconds",
    "rlflow_reallocation_bytes_total",
    "rlflow_reallocation_seconds",
    "rlflow_data_transfer_bytes_total",
    "rlflow_worker_memory_bytes",
    "rlflow_iteration",
    "rlflow_reward",
    "rlflow_kl",
)


def _finite(value: object) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def progress_fields(metrics: Mapping[str, float]) -> dict[str, str]:
    """Short fields for a progress bar (``tqdm.set_postfix``): ``s/iter`` (the iteration's own time,
    ``timing_s/iteration``: evaluation and checkpoints excluded, as ``rlflow runs`` shows it), reward, KL,
    throughput and, in an asynchronous run, the staleness (``stale``, with ``@bound`` when every sample sat
    at the bound: training paces the run), and with a filter node its pass rate and rounds (``pass``);
    metrics that were not logged are left out."""
    fields: dict[str, str] = {}
    seconds = _finite(metrics.get("timing_s/iteration"))
    if seconds is not None:
        fields["s/iter"] = f"{seconds:.4g}"
    reward = _finite(metrics.get(REWARD_METRIC))
    if reward is not None:
        fields["reward"] = f"{reward:.4g}"
    kl = next((v for n in KL_METRICS if (v := _finite(metrics.get(n))) is not None), None)
    if kl is not None:
        fields["kl"] = f"{kl:.3g}"
    tok_s = _finite(metrics.get("perf/throughput"))
    if tok_s is not None:
        fields["tok/s"] = f"{tok_s:.4g}"
    stale = _finite(metrics.get("async/staleness_mean"))
    if stale is not None:
        fields["stale"] = f"{stale:.3g}" + ("@bound" if metrics.get("async/at_bound") == 1.0 else "")
    passed, rounds = _finite(metrics.get("filter/pass_rate")), _finite(metrics.get("filter/rounds"))
    if passed is not None and rounds is not None:  # a filter node's rounds (dynamic sampling)
        fields["pass"] = f"{passed:.2g}/{rounds:g} rounds"
    return fields


class LiveMetrics:
    """Prometheus metrics of one run, served over HTTP while the run is live.

    Args:
        port: TCP port; 0 picks a free one (read it back from :attr:`port` / :attr:`url`).
        host: address to bind; 127.0.0.1 by default, anything else is the caller's explicit choice.
        serve: start the HTTP server (``False`` keeps only the registry, e.g. for ``generate_latest``).

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1", *, serve: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.host = host
        reg = self.registry
        self.node_seconds = Histogram(
            "rlflow_node_seconds", "Wall seconds of one node execution on one worker.", ["node"],
            buckets=_SECONDS_BUCKETS, registry=reg,
        )  # fmt: skip
        self.tokens = Counter("rlflow_tokens_total", "Tokens processed.", registry=reg)
        self.samples = Counter("rlflow_samples_total", "Samples (responses) processed.", registry=reg)
        self.tokens_per_second = Gauge(
            "rlflow_throughput_tokens_per_second", "Tokens per second of the last iteration.", registry=reg
        )
        self.samples_per_second = Gauge(
            "rlflow_throughput_samples_per_second", "Samples per second of the last iteration.", registry=reg
        )
        self.iteration_seconds = Gauge(
            "rlflow_iteration_seconds", "Wall seconds of the last iteration.", registry=reg
        )
        self.reallocation_bytes = Counter(
            "rlflow_reallocation_bytes_total", "Bytes moved by weight reallocations.", registry=reg
        )
        self.reallocation_seconds = Histogram(
            "rlflow_reallocation_seconds", "Wall seconds of one reallocation on one worker.",
            buckets=_SECONDS_BUCKETS, registry=reg,
        )  # fmt: skip
        self.data_transfer_bytes = Counter(
            "rlflow_data_transfer_bytes_total", "Bytes of batch data moved between nodes.", registry=reg
        )
        self.worker_memory = Gauge(
            "rlflow_worker_memory_bytes",
            "Peak device memory per worker (CPU: peak RSS).",
            ["worker"],
            registry=reg,
        )
        self.iteration = Gauge("rlflow_iteration", "Index of the last finished iteration.", registry=reg)
        self.reward = Gauge("rlflow_reward", f"Mean reward ({REWARD_METRIC}).", registry=reg)
        self.kl = Gauge(
            "rlflow_kl",
            "KL of the policy (see rlflow.schedulers.records.telemetry.KL_METRICS).",
            registry=reg,
        )
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None
        if serve:
            server, thread = start_http_server(port, addr=host, registry=reg)
            self._server, self._thread = server, thread
            self.port = int(server.server_port)

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics`` of the endpoint, ``None`` when not serving."""
        if self.port is None:
            return None
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def set_worker_memory(self, worker: int | str, nbytes: float) -> None:
        """Set the memory gauge of one worker (bytes)."""
        self.worker_memory.labels(worker=str(worker)).set(float(nbytes))

    def observe_iteration(
        self, iteration: int, metrics: Mapping[str, float], trace: Iterable[TraceRow] = ()
    ) -> None:
        """Update every metric from what the controller records for one finished iteration.

        Args:
            iteration: the iteration index.
            metrics: the iteration's metrics (standard names; see the module table).
            trace: the iteration's trace rows (all workers).
        """
        rows = list(trace)
        with self._lock:
            self.iteration.set(iteration)
            for row in rows:
                seconds = row.end_s - row.start_s
                if row.kind == "node":
                    self.node_seconds.labels(node=row.node).observe(seconds)
                elif row.kind == "reallocation":
                    self.reallocation_seconds.observe(seconds)
                    self.reallocation_bytes.inc(row.bytes_moved)
                elif row.kind == "data_transfer":
                    self.data_transfer_bytes.inc(row.bytes_moved)

            iter_s = _finite(metrics.get("timing_s/iteration"))
            tok_s = _finite(metrics.get("perf/throughput"))
            smp_s = _finite(metrics.get("perf/samples_per_s"))
            if iter_s is not None:
                self.iteration_seconds.set(iter_s)
            if tok_s is not None:
                self.tokens_per_second.set(tok_s)
            if smp_s is not None:
                self.samples_per_second.set(smp_s)

            tokens = _finite(metrics.get("perf/total_num_tokens"))
            if tokens is None and tok_s is not None and iter_s is not None:
                tokens = tok_s * iter_s
            if tokens is None:
                tokens = float(sum(r.tokens for r in rows if r.kind == "node"))
            self.tokens.inc(max(tokens, 0.0))
            samples = _finite(metrics.get("perf/num_samples"))
            if samples is None and smp_s is not None and iter_s is not None:
                samples = smp_s * iter_s
            if samples is not None:
                self.samples.inc(max(samples, 0.0))

            reward = _finite(metrics.get(REWARD_METRIC))
            if reward is not None:
                self.reward.set(reward)
            for name in KL_METRICS:
                kl = _finite(metrics.get(name))
                if kl is not None:
                    self.kl.set(kl)
                    break
            for name, value in metrics.items():
                if name.startswith(MEMORY_PREFIX) and (nbytes := _finite(value)) is not None:
                    self.worker_memory.labels(worker=name[len(MEMORY_PREFIX) :]).set(nbytes)

    def close(self) -> None:
        """Stop the HTTP server (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> LiveMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
