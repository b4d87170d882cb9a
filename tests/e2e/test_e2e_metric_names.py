"""The metric names autoscalers and routers read, on a live stack: after real requests over
HTTP, /metrics (the HTTP port and --metrics-port alike) has vLLM's queue, batch, KV, latency
series with the served model's ``model_name``, and every series the Grafana dashboard and
the KEDA ScaledObject under deploy/examples query."""

from __future__ import annotations

import httpx2 as httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.test_deploy_examples import _dashboard_queries, _keda_queries, promql_selectors
from tests.e2e.stack import ThreadStack

pytestmark = pytest.mark.slow

ROUTER_SERIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:inter_token_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
)
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}


def _scrape(url: str) -> tuple[dict[tuple[str, str], float], set[str]]:
    """(series name, model_name) -> value, and every series name the endpoint declares."""
    values: dict[tuple[str, str], float] = {}
    declared: set[str] = set()
    for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        declared.update([family.name + s for s in _SUFFIXES.get(family.type, ())] or [family.name])
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                assert "model_name" in sample.labels, sample
                values[(sample.name, sample.labels["model_name"])] = sample.value
    return values, declared


def test_router_series_carry_the_model_name_and_the_examples_query_live_series(stack: ThreadStack, model: str) -> None:
    running = stack.running
    assert running is not None and running.server.metrics_port
    root = stack.http_url
    for _ in range(2):  # a second request so the first's tokens have a gap to measure
        reply = httpx.post(
            f"{root}/v1/completions",
            json={"model": model, "prompt": "Generate JSON for schema user:\n", "max_tokens": 12, "ignore_eos": True},
            timeout=300,
        )
        assert reply.status_code == 200, reply.text
    for url in (f"{root}/metrics", f"http://127.0.0.1:{running.server.metrics_port}/metrics"):
        values, declared = _scrape(url)
        for name in ROUTER_SERIES:
            assert (name, model) in values, (url, name)
        assert values[("vllm:inter_token_latency_seconds_count", model)] >= 1
        assert values[("vllm:request_queue_time_seconds_count", model)] >= 2
        assert 0.0 <= values[("vllm:kv_cache_usage_perc", model)] <= 1.0
        missing = {n for q in (*_dashboard_queries(), *_keda_queries()) for n, _ in promql_selectors(q)} - declared
        assert not missing, (url, sorted(missing))
