"""Prometheus metrics of the gateway. Names are a public interface (dashboards)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# First tokens on CPU can take seconds (queue + prefill); on GPU tens of milliseconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    """Every metric the gateway exports, registered on `registry`.

    Labels are bounded: `constraint` is a constraint kind (or "none"), `status` a gRPC
    status code name.
    """

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "gramserve_gateway_requests_total", "Generate requests, by constraint kind and status.",
            ["constraint", "status"], registry=registry)
        self.time_to_first_token = Histogram(
            "gramserve_gateway_time_to_first_token_seconds",
            "From the request's arrival to its first token (queue, compile, prefill).",
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram(
            "gramserve_gateway_inter_token_seconds",
            "Time between consecutive token events of one request.",
            buckets=_TOKEN_BUCKETS, registry=registry)
        self.request_seconds = Histogram(
            "gramserve_gateway_request_seconds", "Wall time of a Generate request.",
            buckets=_REQUEST_BUCKETS, registry=registry)
        self.queue_depth = Gauge(
            "gramserve_gateway_queue_depth", "Requests waiting for a slot.", registry=registry)
        self.in_flight = Gauge(
            "gramserve_gateway_in_flight", "Requests holding a slot.", registry=registry)
        self.schema_invalid = Counter(
            "gramserve_gateway_schema_invalid_total",
            "JSON-schema requests whose output failed jsonschema validation.", registry=registry)
        self.grammar_length_finish = Counter(
            "gramserve_gateway_grammar_length_finish_total",
            "Guided requests that ended on max_tokens (the symptom of whitespace loops).",
            registry=registry)
        self.grammar_refs = Counter(
            "gramserve_gateway_grammar_refs_total",
            "Guided requests whose compiled-grammar key the gateway remembered (hit) or asked "
            "the grammar service for (miss).", ["result"], registry=registry)
        self.retries = Counter(
            "gramserve_gateway_retries_total",
            "Requests sent to a group again before their first token, by why: its group "
            "failed (group_failed), was full (group_full) or lost a slot-reuse race between "
            "ranks (slot_race).", ["reason"], registry=registry)
        self.draining = Gauge(
            "gramserve_gateway_draining",
            "1 while the gateway drains (refuses new requests, finishes running ones).",
            registry=registry)
        self.healthy_groups = Gauge(
            "gramserve_gateway_healthy_groups", "Worker groups currently taking requests.",
            registry=registry)
        self.grammar_service_up = Gauge(
            "gramserve_gateway_grammar_service_up",
            "1 while the grammar service answers the gateway's health checks (new grammars "
            "compile), 0 while it does not (only grammars already compiled serve).",
            registry=registry)
