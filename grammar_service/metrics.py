"""Prometheus metrics of the grammar service. Names are a public interface (dashboards)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Compiles range from ~1 ms (a short regex) to tens of seconds (large real-world schemas).
_COMPILE_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)

FAILURE_REASONS = ("invalid", "timeout", "memory", "crash")


class GrammarMetrics:
    """Every metric the grammar service exports, registered on `registry`."""

    def __init__(self, registry: CollectorRegistry):
        self.compile_seconds = Histogram(
            "gramserve_grammar_compile_seconds",
            "Wall time of one successful compile, by kind and the backend that compiled it.",
            ["kind", "backend"], buckets=_COMPILE_BUCKETS, registry=registry)
        self.cache_hits = Counter(
            "gramserve_grammar_cache_hits_total",
            "Compile or Fetch calls answered without compiling (memory, disk, or a compile "
            "of the same key already running).", registry=registry)
        self.cache_misses = Counter(
            "gramserve_grammar_cache_misses_total",
            "Compile or Fetch calls that started a compile.", registry=registry)
        self.cache_evictions = Counter(
            "gramserve_grammar_cache_evictions_total",
            "Entries dropped from memory to stay under the byte bound.", registry=registry)
        self.cache_bytes = Gauge(
            "gramserve_grammar_cache_bytes",
            "Serialized bytes of the compiled grammars held in memory.", registry=registry)
        self.compile_failures = Counter(
            "gramserve_grammar_compile_failures_total",
            "Specs refused or failed to compile, by reason (invalid, timeout, memory, crash).",
            ["reason"], registry=registry)
        self.failed_compile_seconds = Histogram(
            "gramserve_grammar_failed_compile_seconds",
            "Wall time of one compile that failed, by reason (timeout, memory, crash, "
            "invalid): what a bad spec cost before it was refused.",
            ["reason"], buckets=_COMPILE_BUCKETS, registry=registry)
        self.compiles_in_flight = Gauge(
            "gramserve_grammar_compiles_in_flight", "Compiles running now.", registry=registry)
        for reason in FAILURE_REASONS:
            self.compile_failures.labels(reason)
