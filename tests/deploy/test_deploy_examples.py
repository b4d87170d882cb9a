"""The Grafana dashboard and KEDA ScaledObject under deploy/examples query series the
orchestrator exports, with labels those series carry.

The names come from the server's own registry (``OrchestratorMetrics``, as
``create_server`` builds it), not a hand list: renaming a series or dropping a label
fails here. tests/e2e/test_e2e_metric_names.py checks the same queries against a live
``/metrics`` after real requests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from specmask.orchestrator.metrics import OrchestratorMetrics

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
DASHBOARD = EXAMPLES / "grafana-dashboard.json"
SCALED_OBJECT = EXAMPLES / "keda-scaledobject.yaml"

# Labels Prometheus adds to every scraped series from the target (not the exporter's).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "service", "container", "endpoint"})
# PromQL words that look like names: aggregations and modifiers (functions are followed by "(").
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}
    | {"sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values"}
    | {"inf", "nan", "le"}
)
_IDENT = r"[A-Za-z_:][A-Za-z0-9_:]*"
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created")}


def exported_series() -> dict[str, frozenset[str]]:
    """Every series name the orchestrator's registry exposes -> its label names (plus ``le``
    on histogram buckets)."""
    registry = OrchestratorMetrics(model_name="m").registry
    # A labelled family with no child yet has no samples to read its labels from: they are
    # the collector's. prometheus_client has no public lookup from a name to its collector.
    collectors = registry._names_to_collectors
    out: dict[str, frozenset[str]] = {}
    for family in registry.collect():
        labels = frozenset(collectors[family.name]._labelnames)
        for name in [family.name + s for s in _SUFFIXES.get(family.type, ())] or [family.name]:
            out[name] = labels | ({"le"} if name.endswith("_bucket") else frozenset())
    return out


def promql_selectors(expr: str) -> list[tuple[str, frozenset[str]]]:
    """(metric name, label names it matches on) of every vector selector in a PromQL
    expression: identifiers that are not keywords, functions (followed by "("), grouping
    labels, durations or strings."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals hold no names
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations, Grafana's $__ vars
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\boffset\s+\S+", " ", text)
    out = []
    for m in re.finditer(rf"(?<![\w:$.])({_IDENT})\s*(\{{[^}}]*\}})?|\{{[^}}]*\}}", text):
        name, matchers = m.group(1), m.group(2)
        if name is None or name in _KEYWORDS or (matchers is None and text[m.end() :].lstrip().startswith("(")):
            continue
        labels = frozenset(re.findall(rf"({_IDENT})\s*(?:=~|!~|!=|=)", matchers or ""))
        out.append((name, labels))
    return out


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(rf"label_values\(({_IDENT}),\s*({_IDENT})\)", var["definition"])
            assert m, f"dashboard variable {var['name']}: not label_values(metric, label)"
            queries.append(f'{m.group(1)}{{{m.group(2)}=~".*"}}')
    return queries


def _keda_queries() -> list[str]:
    docs = [d for d in yaml.safe_load_all(SCALED_OBJECT.read_text()) if d]
    assert [d["kind"] for d in docs] == ["ScaledObject"]
    triggers: list[dict[str, Any]] = docs[0]["spec"]["triggers"]
    assert triggers and all(t["type"] == "prometheus" for t in triggers)
    return [t["metadata"]["query"] for t in triggers]


def _check(query: str, exported: dict[str, frozenset[str]]) -> list[str]:
    selectors = promql_selectors(query)
    assert selectors, f"no metric found in {query!r}"
    problems = []
    for name, labels in selectors:
        if name not in exported:
            problems.append(f"{query!r}: {name} is not exported")
        elif unknown := labels - exported[name] - TARGET_LABELS:
            problems.append(f"{query!r}: {name} has no label {sorted(unknown)}")
    return problems


@pytest.mark.parametrize("source", ["dashboard", "keda"])
def test_every_query_names_exported_series_and_labels(source: str) -> None:
    queries = _dashboard_queries() if source == "dashboard" else _keda_queries()
    exported = exported_series()
    problems = [p for q in queries for p in _check(q, exported)]
    assert not problems, "\n".join(problems)


def test_the_dashboard_reads_the_names_routers_and_autoscalers_read() -> None:
    names = {n for q in _dashboard_queries() for n, _ in promql_selectors(q)}
    for wanted in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert wanted in names
    assert any(n.startswith("vllm:inter_token_latency_seconds") for n in names)
    assert any(n.startswith("vllm:request_queue_time_seconds") for n in names)


def test_the_check_catches_a_wrong_name_or_label() -> None:
    """The checker itself: a renamed series, a label the series lacks, a query with no metric."""
    exported = exported_series()
    assert exported["vllm:num_requests_waiting"] == {"model_name"}
    assert "le" in exported["vllm:inter_token_latency_seconds_bucket"]
    assert _check('sum(vllm:num_requests_waiting{model_name="x", pod=~"a.*"})', exported) == []
    assert _check("sum(vllm:num_requests_queued)", exported) == [
        "'sum(vllm:num_requests_queued)': vllm:num_requests_queued is not exported"
    ]
    assert "has no label ['engine']" in _check('vllm:num_requests_running{engine="0"}', exported)[0]
    assert "has no label ['worker']" in _check('rate(vllm:generation_tokens_total{worker="0"}[5m])', exported)[0]
    with pytest.raises(AssertionError, match="no metric"):
        _check("sum(rate(foo()[5m]))", exported)
    # Durations, grouping labels, numbers, strings and functions are not names.
    q = (
        "histogram_quantile(0.9, sum by (le, model_name) (rate(vllm:e2e_request_latency_seconds_bucket"
        '{model_name=~"a|b", le!="+Inf"}[$__rate_interval] offset 1h))) > 2e-1 and on(model_name) up'
    )
    assert promql_selectors(q) == [
        ("vllm:e2e_request_latency_seconds_bucket", frozenset({"model_name", "le"})),
        ("up", frozenset()),
    ]
