"""The GrammarService gRPC server: a thin translation between protos and the cache and pool."""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry

from grammar_service.backends import LLGUIDANCE, VERSIONS, XGRAMMAR, VocabView
from grammar_service.cache import Entry, GrammarCache
from grammar_service.choice import Compiled
from grammar_service.compile_pool import CompilePool
from grammar_service.config import GrammarServiceConfig, parse_config
from grammar_service.metrics import GrammarMetrics
from grammar_service.specs import CanonicalSpec, cache_key, parse_spec
from protos import grammar_pb2, grammar_pb2_grpc, rpc
from protos.rpc import InvalidArgument, NotFound, ServiceError

log = logging.getLogger(__name__)

SERVICE_NAME = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name
XGRAMMAR_VERSION = VERSIONS[XGRAMMAR]
FETCH_CHUNK_BYTES = 1024 * 1024
_KEY = re.compile(r"[0-9a-f]{64}")


class GrammarService(grammar_pb2_grpc.GrammarServiceServicer):
    """Compile, Fetch and Stats over one vocabulary's cache and compile pool.

    Owns `pool` (closed by `close`). `metrics_port` is set by `create_server` when metrics
    are served. Spec errors name fields under `spec` (and `key` for Fetch).
    """

    def __init__(self, cache: GrammarCache, pool: CompilePool, metrics: GrammarMetrics,
                 vocab_fingerprint: str, max_spec_bytes: int):
        self.cache = cache
        self.pool = pool
        self.metrics = metrics
        self.vocab_fingerprint = vocab_fingerprint
        self.max_spec_bytes = max_spec_bytes
        self.metrics_port = -1
        self._in_flight = 0
        self._lock = threading.Lock()

    def Compile(self, request, context):
        spec = self._parse(request.spec)
        entry, cached = self._get_or_compile(cache_key(spec, self.vocab_fingerprint, VERSIONS),
                                             spec, request.client, _deadline(context))
        return grammar_pb2.GrammarRef(
            key=entry.key, kind=spec.kind, compile_seconds=entry.compile_seconds,
            cached=cached, unenforced_keywords=list(entry.unenforced),
            vocab_fingerprint=self.vocab_fingerprint, serialized_bytes=len(entry.payload),
            backend=entry.backend, backend_reason=entry.backend_reason)

    def Fetch(self, request, context):
        if not _KEY.fullmatch(request.key):
            raise InvalidArgument("must be 64 lower-case hex digits (a key from Compile)",
                                  field="key")
        entry = self.cache.lookup(request.key)
        if entry is None:
            if not request.HasField("spec"):
                raise NotFound("not in the cache; send its spec to have it recompiled",
                               field="key")
            spec = self._parse(request.spec)
            key = cache_key(spec, self.vocab_fingerprint, VERSIONS)
            if key != request.key:
                raise InvalidArgument(f"the spec's key is {key}, not this key (another spec, "
                                      "vocabulary or backend version)", field="key")
            entry, _ = self._get_or_compile(key, spec, "", _deadline(context))
        yield from _chunks(entry, self.vocab_fingerprint)

    def Stats(self, request, context):
        return grammar_pb2.GrammarStats(
            entries=len(self.cache), bytes=self.cache.bytes,
            capacity_bytes=self.cache.capacity_bytes, hits=self.cache.hits,
            misses=self.cache.misses, evictions=self.cache.evictions,
            compiles_in_flight=self._in_flight, vocab_fingerprint=self.vocab_fingerprint,
            xgrammar_version=XGRAMMAR_VERSION, llguidance_version=VERSIONS[LLGUIDANCE])

    def close(self) -> None:
        """Stop the compile processes. Compile calls after this fail with UNAVAILABLE."""
        self.pool.close()

    def _parse(self, spec) -> CanonicalSpec:
        try:
            return parse_spec(spec, field="spec", max_spec_bytes=self.max_spec_bytes)
        except InvalidArgument:
            self.metrics.compile_failures.labels("invalid").inc()
            raise

    def _get_or_compile(self, key: str, spec: CanonicalSpec, client: str = "",
                        deadline: float | None = None) -> tuple[Entry, bool]:
        return self.cache.get_or_compile(key, spec,
                                         lambda: self._compile(spec, client, deadline))

    def _compile(self, spec: CanonicalSpec, client: str = "",
                 deadline: float | None = None) -> Compiled:
        with self._lock:
            self._in_flight += 1
        self.metrics.compiles_in_flight.inc()
        try:
            start = time.perf_counter()
            compiled = self.pool.compile(spec, field="spec", client=client, deadline=deadline)
            self.metrics.compile_seconds.labels(spec.kind, compiled.backend).observe(
                time.perf_counter() - start)
            return compiled
        except ServiceError as exc:
            reason = getattr(exc, "reason", None)
            if reason:
                self.metrics.compile_failures.labels(reason).inc()
                self.metrics.failed_compile_seconds.labels(reason).observe(
                    time.perf_counter() - start)
            raise
        finally:
            self.metrics.compiles_in_flight.dec()
            with self._lock:
                self._in_flight -= 1


def _deadline(context) -> float | None:
    """The call's deadline as a time.monotonic() value (None: the caller set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def _chunks(entry: Entry, vocab_fingerprint: str):
    payload = entry.payload
    for start in range(0, max(len(payload), 1), FETCH_CHUNK_BYTES):
        chunk = grammar_pb2.GrammarChunk(data=payload[start:start + FETCH_CHUNK_BYTES])
        if start == 0:
            chunk.total_bytes = len(payload)
            chunk.vocab_fingerprint = vocab_fingerprint
            chunk.sha256 = entry.sha256
            chunk.backend = entry.backend
        yield chunk


def create_server(config: GrammarServiceConfig, *, registry: CollectorRegistry | None = None,
                  vocab=None) -> tuple[grpc.Server, int, GrammarService]:
    """Load the vocabulary, start the compile pool and the server; return (server, port, service).

    `vocab` (a grammar_service.vocab.Vocab) overrides loading `config.model`; `registry`
    defaults to a fresh CollectorRegistry. Serves /metrics when config.metrics_port >= 0.
    Raises ValueError for a bad model directory, RuntimeError when the port cannot be bound.
    """
    if vocab is None:
        from grammar_service.default_model import resolve_model
        from grammar_service.vocab import load_vocab

        vocab = load_vocab(resolve_model(config.model or None))
    registry = registry if registry is not None else CollectorRegistry()
    metrics = GrammarMetrics(registry)
    rpc.register_build_info(registry, "grammar-service", xgrammar=XGRAMMAR_VERSION,
                            llguidance=VERSIONS[LLGUIDANCE])
    pool = CompilePool(VocabView.of(vocab),
                       workers=config.compile_workers, timeout_s=config.compile_timeout,
                       memory_mb=config.compile_memory_mb, threads=config.compile_threads,
                       short_workers=config.compile_short_workers,
                       short_seconds=config.compile_short_seconds,
                       short_memory_mb=config.compile_short_memory_mb,
                       memory_budget_mb=config.compile_memory_budget_mb)
    cache = GrammarCache(config.cache_bytes, metrics,
                         Path(config.cache_dir) if config.cache_dir else None,
                         disk_bytes=config.cache_dir_bytes)
    service = GrammarService(cache, pool, metrics, vocab.fingerprint, config.max_spec_bytes)
    tls = None
    if config.tls_cert:
        tls = (Path(config.tls_cert).read_bytes(), Path(config.tls_key).read_bytes())
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    try:
        server, port, health = rpc.create_server(
            [(grammar_pb2_grpc.add_GrammarServiceServicer_to_server, service, SERVICE_NAME)],
            host=config.host, port=config.port, tls=tls, client_ca=client_ca,
            reflection=config.reflection == "on")
        _, service.metrics_port = rpc.start_metrics_server(config.metrics_port, registry,
                                                           host=config.metrics_host)
    except BaseException:
        pool.close()
        raise
    service.health = health
    return server, port, service


def main(argv: list[str] | None = None) -> int:
    """Run the grammar service until SIGTERM/SIGINT, then drain; return the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_config(argv)
        server, port, service = create_server(config)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"gramserve grammar-service: {exc}", file=sys.stderr)
        return 2
    stopping = threading.Event()

    def drain(signum, frame):
        if stopping.is_set():
            return
        stopping.set()
        log.info("draining (signal %d)", signum)
        rpc.set_serving(service.health, [SERVICE_NAME], False)
        server.stop(grace=config.drain_seconds)

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    log.info("grammar service ready on %s:%d (metrics port %d, vocab %s, xgrammar %s, "
             "llguidance %s)", config.host, port, service.metrics_port,
             service.vocab_fingerprint[:12], XGRAMMAR_VERSION, VERSIONS[LLGUIDANCE])
    server.wait_for_termination()
    service.close()
    log.info("stopped")
    return 0

