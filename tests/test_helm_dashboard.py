"""The Grafana dashboard queries only metrics the code defines, so it cannot drift from them.

Each component's metrics class is built on a fresh CollectorRegistry; the series names a
PromQL query may use are derived from each family's type (a counter family `x` is the
series `x_total`, a histogram `x` is `x_bucket`, `x_sum`, `x_count`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gateway.metrics import GatewayMetrics
from gpu_worker.metrics import WorkerMetrics
from grammar_service.metrics import GrammarMetrics

DASHBOARD = (Path(__file__).resolve().parent.parent / "helm" / "gramserve" / "dashboards"
             / "gramserve.json")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "summary": ("", "_sum", "_count")}
_METRIC = re.compile(r"\bgramserve_[a-z0-9_]+")


def defined_series() -> set[str]:
    """Every series name the three components' metrics classes can export."""
    names = set()
    for cls in (GatewayMetrics, GrammarMetrics, WorkerMetrics):
        registry = CollectorRegistry()
        cls(registry)
        for family in registry.collect():
            names.update(family.name + s for s in _SUFFIXES[family.type])
    return names


def queried_series(dashboard: dict) -> dict[str, set[str]]:
    """Metric names in every query of the dashboard, keyed by panel title."""
    out: dict[str, set[str]] = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            out.setdefault(panel["title"], set()).update(_METRIC.findall(target["expr"]))
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            out.setdefault(f"variable {var['name']}", set()).update(
                _METRIC.findall(query["query"]))
    return out


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_helm_dashboard_queries_only_metrics_the_code_defines(dashboard):
    defined = defined_series()
    queried = queried_series(dashboard)
    missing = {title: sorted(names - defined) for title, names in queried.items()
               if names - defined}
    assert not missing, missing


def test_helm_dashboard_covers_the_required_views(dashboard):
    """Request rate, latency, throughput, capacity, grammar and correctness signals."""
    used = set().union(*queried_series(dashboard).values())
    required = {
        "gramserve_gateway_requests_total",
        "gramserve_gateway_time_to_first_token_seconds_bucket",
        "gramserve_gateway_inter_token_seconds_bucket",
        "gramserve_worker_tokens_total",
        "gramserve_gateway_queue_depth",
        "gramserve_worker_slots_in_use",
        "gramserve_worker_guided_slots",
        "gramserve_worker_mask_fill_seconds_bucket",
        "gramserve_worker_mask_apply_seconds_bucket",
        "gramserve_worker_step_seconds_bucket",
        "gramserve_worker_device_wait_seconds_bucket",
        "gramserve_worker_step_cpu_seconds_bucket",
        "gramserve_grammar_compile_seconds_bucket",
        "gramserve_grammar_cache_hits_total",
        "gramserve_grammar_cache_misses_total",
        "gramserve_worker_grammar_dead_ends_total",
        "gramserve_worker_tp_divergence_total",
        "gramserve_gateway_schema_invalid_total",
    }
    assert required <= used, sorted(required - used)
    for panel in dashboard["panels"]:
        exprs = [t["expr"] for t in panel["targets"]]
        if any("quantile" in e for e in exprs):
            assert {"0.5", "0.99"} <= {q for e in exprs for q in re.findall(r"quantile\(([\d.]+)", e)}


def test_helm_dashboard_is_importable_grafana_json(dashboard):
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            # Every $variable a query uses is defined (Grafana's own $__ names aside).
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= names, (panel["title"], used - names)


def test_helm_dashboard_check_catches_an_undefined_metric(dashboard):
    """The drift check itself fails when a query names a metric no component defines."""
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][0]["targets"][0]["expr"] = "rate(gramserve_gateway_no_such_total[5m])"
    queried = set().union(*queried_series(broken).values())
    assert "gramserve_gateway_no_such_total" in queried - defined_series()
