"""Live Prometheus metrics (schedulers/records/telemetry.py) and the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rlflow.schedulers.records.rundir import TraceRow
from rlflow.schedulers.records.telemetry import METRIC_NAMES, LiveMetrics, progress_fields

GRAFANA = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "rlflow-dashboard.json"


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Sample name + sorted labels -> value, from the live endpoint."""
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


ITER1_METRICS = {
    "timing_s/iteration": 2.5,
    "perf/throughput": 600.0,
    "perf/samples_per_s": 6.4,
    "critic/score/mean": 0.75,
    "actor/ppo_kl": 0.3,
    "actor/kl": 0.02,
    "memory_bytes/0": 1.5e9,
    "memory_bytes/1": 2.5e9,
}
ITER1_TRACE = [
    TraceRow(1, "actor_gen", 0, 0, 0.0, 1.0, 512, 0, 0.9, "node"),
    TraceRow(1, "actor_gen", 1, 1, 0.0, 0.8, 512, 0, 0.9, "node"),
    TraceRow(1, "actor_train", 0, 0, 1.2, 2.4, 512, 0, None, "node"),
    TraceRow(1, "actor", 0, 0, 1.0, 1.2, 0, 4096, None, "reallocation"),
    TraceRow(1, "actor", 1, 1, 1.0, 1.1, 0, 4096, None, "reallocation"),
    TraceRow(1, "actor_gen", 0, 0, 2.4, 2.5, 0, 1000, None, "data_transfer"),
]


def test_live_endpoint_values() -> None:
    with LiveMetrics(port=0) as live:
        assert live.url is not None and live.port and live.port > 0
        assert live.url == f"http://127.0.0.1:{live.port}/metrics"
        live.observe_iteration(1, ITER1_METRICS, ITER1_TRACE)
        # Second iteration without a token count: counters accumulate, gauges take the last value.
        live.observe_iteration(2, {"timing_s/iteration": 2.0, "perf/throughput": 500.0, "actor/ppo_kl": 0.1})
        s = _scrape(live.url)
    node = (("node", "actor_gen"),)
    assert s[("rlflow_node_seconds_count", node)] == 2
    assert s[("rlflow_node_seconds_sum", node)] == pytest.approx(1.8)  # 1.0 + 0.8
    # 0.8 s falls in the 1.0 bucket, not the 0.5 one.
    assert s[("rlflow_node_seconds_bucket", (("le", "0.5"), *node))] == 0
    assert s[("rlflow_node_seconds_bucket", (("le", "1.0"), *node))] == 2
    assert s[("rlflow_node_seconds_count", (("node", "actor_train"),))] == 1
    # tokens = throughput x iteration seconds: 600 * 2.5 + 500 * 2.0 = 1500 + 1000.
    assert s[("rlflow_tokens_total", ())] == pytest.approx(2500.0)
    assert s[("rlflow_samples_total", ())] == pytest.approx(16.0)  # 6.4 * 2.5; iteration 2 logged none
    assert s[("rlflow_throughput_tokens_per_second", ())] == 500.0
    assert s[("rlflow_throughput_samples_per_second", ())] == pytest.approx(6.4)
    assert s[("rlflow_iteration_seconds", ())] == 2.0
    assert s[("rlflow_reallocation_bytes_total", ())] == 8192
    assert s[("rlflow_reallocation_seconds_count", ())] == 2
    assert s[("rlflow_reallocation_seconds_sum", ())] == pytest.approx(0.3)
    assert s[("rlflow_data_transfer_bytes_total", ())] == 1000
    assert s[("rlflow_worker_memory_bytes", (("worker", "0"),))] == 1.5e9
    assert s[("rlflow_worker_memory_bytes", (("worker", "1"),))] == 2.5e9
    assert s[("rlflow_iteration", ())] == 2
    assert s[("rlflow_reward", ())] == 0.75
    # Iteration 1 had actor/kl (preferred over actor/ppo_kl); iteration 2 only ppo_kl.
    assert s[("rlflow_kl", ())] == pytest.approx(0.1)


def test_kl_prefers_reference_kl() -> None:
    live = LiveMetrics(serve=False)
    live.observe_iteration(1, {"actor/ppo_kl": 0.3, "actor/kl": 0.02})
    assert live.kl._value.get() == pytest.approx(0.02)
    assert live.url is None
    live.close()


def test_tokens_fall_back_to_trace_and_nan_is_ignored() -> None:
    live = LiveMetrics(serve=False)
    live.observe_iteration(1, {"critic/score/mean": float("nan")}, ITER1_TRACE)
    assert live.tokens._value.get() == 1536  # three node rows of 512 tokens
    assert live.reward._value.get() == 0.0  # NaN never set


def test_separate_registries_ports_and_close() -> None:
    a, b = LiveMetrics(), LiveMetrics()
    try:
        assert a.port != b.port
        assert a.registry is not b.registry
        a.observe_iteration(7, {})
        assert _scrape(a.url or "")[("rlflow_iteration", ())] == 7
        assert _scrape(b.url or "")[("rlflow_iteration", ())] == 0
        assert a._server is not None and a._server.server_address[0] == "127.0.0.1"
    finally:
        a.close()
        b.close()
    a.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(a.url or "", timeout=2)


def test_grafana_dashboard_references_only_exposed_metrics() -> None:
    dashboard = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    referenced = {name for e in exprs for name in re.findall(r"\brlflow_[a-z_]+", e)}
    live = LiveMetrics(serve=False)
    live.observe_iteration(1, ITER1_METRICS, ITER1_TRACE)  # so labelled metrics have samples
    exposed = {s.name for family in live.registry.collect() for s in family.samples}
    assert referenced, "the dashboard queries no rlflow metric"
    assert referenced <= exposed, f"unknown metrics in the Grafana dashboard: {referenced - exposed}"
    # And every live metric is on some panel.
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in referenced}
    assert set(METRIC_NAMES) <= families, set(METRIC_NAMES) - families
    assert {p["id"] for p in dashboard["panels"]} == set(range(1, len(dashboard["panels"]) + 1))


def test_progress_fields() -> None:
    assert progress_fields(ITER1_METRICS) == {"s/iter": "2.5", "reward": "0.75", "kl": "0.02", "tok/s": "600"}
    assert progress_fields({"actor/ppo_kl": float("nan")}) == {}


def _child_peak(queue: Any) -> None:
    import torch

    from rlflow.schedulers.runtime.devices import peak_memory_bytes

    queue.put(peak_memory_bytes(torch.device("cpu")))


@pytest.mark.slow
def test_a_spawned_worker_reports_its_own_peak_memory_not_its_parents() -> None:
    """``memory_bytes/<rank>`` on CPU: a spawned process's peak resident memory is its own (``VmHWM``), not
    the peak its parent had reached when it spawned it (``ru_maxrss`` survives ``exec``: fresh-user finding,
    every rank reported the controller's figure to the byte)."""
    import multiprocessing as mp

    import torch

    from rlflow.schedulers.runtime.devices import peak_memory_bytes

    ballast = torch.ones(600 * 2**20, dtype=torch.uint8)  # 600 MiB touched in the parent
    parent = peak_memory_bytes(torch.device("cpu"))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_peak, args=(queue,))
    child.start()
    peak = queue.get(timeout=120)
    child.join(timeout=60)
    del ballast
    assert parent > 600 * 2**20 and 0 < peak < parent - 400 * 2**20, (parent, peak)
