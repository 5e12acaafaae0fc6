"""Each rank's local cache of compiled grammars, fetched from the grammar service by key.

A rank builds its matchers from its own copy of the compiled grammar (I1): the compiled
grammar is immutable and shared between the slots that use it, while every slot gets a new
matcher from `GrammarHandle.new_matcher()`. An entry in use is pinned and never evicted from
under a slot; only unpinned entries are evicted, least recently used first.

Each grammar belongs to one backend (xgrammar or llguidance, grammar_service.backends), named
by the service with the payload; the handle makes matchers of that backend only, and a
payload that does not read as its named backend's, or a backend other than the one the
caller expects, is refused (FailedPrecondition).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from grammar_service.backends import BACKENDS, XGRAMMAR, BackendError, backend_for
from grammar_service.vocab import Vocab
from protos import common_pb2, grammar_pb2, grammar_pb2_grpc
from protos.rpc import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    channel,
)

# How the grammar service's status codes reach the worker's own callers.
_STATUS_ERRORS: dict[grpc.StatusCode, type[ServiceError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


class GrammarHandle:
    """A pinned compiled grammar. Give it back with `WorkerGrammarCache.release` exactly once.

    `backend` is the backend object that read it; `backend_name` its name."""

    __slots__ = ("key", "backend", "compiled", "nbytes", "_stops")

    def __init__(self, key: str, backend, compiled, nbytes: int):
        self.key = key
        self.backend = backend
        self.compiled = compiled
        # what the cache's capacity counts: the serialized form's size, or the compiled
        # grammar's in memory when larger
        self.nbytes = nbytes
        self._stops = None

    def stop_ids(self, matcher) -> frozenset[int]:
        """The stop token ids of the grammar's matchers made without options (`matcher` is
        one), read once: xgrammar's come as a container that is slow to iterate, on the
        engine's thread at every start."""
        if self._stops is None:
            self._stops = frozenset(int(t) for t in matcher.stop_token_ids)
        return self._stops

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def new_matcher(self, **options):
        """A new matcher of the grammar's backend at its start on every call, never shared (I1).

        xgrammar: an xgrammar.GrammarMatcher; `options` go to it (override_stop_tokens=None,
        terminate_without_stop_token=False, max_rollback_tokens=-1 by default).
        llguidance: a grammar_service.backends.LLGuidanceMatcher (no options).
        """
        return self.backend.new_matcher(self.compiled, **options)


@dataclass
class _Entry:
    handle: GrammarHandle
    pins: int


@dataclass
class _Flight:
    """One fetch in progress; acquirers of the same key wait on it instead of fetching."""

    done: threading.Event = field(default_factory=threading.Event)
    waiters: int = 0
    handle: GrammarHandle | None = None
    error: ServiceError | None = None


class WorkerGrammarCache:
    """Compiled grammars of one rank, bounded by serialized bytes (a soft bound: pinned entries
    stay even when they alone exceed it). Thread-safe.

    `grammar_service_addr` None means no service: every miss raises Unavailable. `metrics`
    is an object with `grammar_cache_hits`, `grammar_cache_misses` (counters) and
    `grammar_cache_bytes` (gauge), e.g. WorkerMetrics, or None. Raises ValueError for a
    capacity or timeout that is not positive. `fill_threads`: the rank's mask-fill threads
    (llguidance grammars keep lanes for them, grammar_service.backends.LLGuidanceGrammar;
    None: llguidance's default).
    """

    def __init__(self, grammar_service_addr: str | None, vocab: Vocab, capacity_bytes: int,
                 metrics=None, fetch_timeout_s: float = 60.0, tls_ca: bytes | None = None,
                 tls_identity: tuple[bytes, bytes] | None = None,
                 fill_threads: int | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes: must be > 0, got {capacity_bytes}")
        if fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s: must be > 0, got {fetch_timeout_s}")
        self._vocab = vocab
        self._fill_threads = fill_threads
        self._capacity = capacity_bytes
        self._metrics = metrics
        self._timeout = fetch_timeout_s
        self._addr = grammar_service_addr
        self._channel = channel(grammar_service_addr, tls_ca=tls_ca,
                                tls_identity=tls_identity) if grammar_service_addr else None
        self._stub = grammar_pb2_grpc.GrammarServiceStub(self._channel) if self._channel else None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # oldest use first
        self._flights: dict[str, _Flight] = {}
        self._bytes = 0
        self._backends: dict[str, object] = {}

    def acquire(self, key: str, spec: common_pb2.GrammarSpec | None,
                backend: str | None = None) -> GrammarHandle:
        """Pin the compiled grammar of `key` and return its handle.

        A local hit pins at once. A miss fetches from the grammar service (with `spec`, so the
        service can recompile an evicted key), checks the payload's size, sha256 and
        vocabulary fingerprint, deserializes it with the backend the service names, against
        this rank's vocabulary, and inserts it; concurrent acquires of the same missing key
        share one fetch (the waiters count as hits). `backend`, when given (the GrammarRef's),
        must be the grammar's. Raises InvalidArgument (empty key), NotFound (unknown key, no
        spec), FailedPrecondition (compiled for another vocabulary or another backend, or a
        payload its backend does not read), Unavailable (service down or a corrupt payload),
        DeadlineExceeded, or the service's own error. A failed acquire pins nothing.
        """
        if not key:
            raise InvalidArgument("must not be empty", field="grammar_key")
        if backend is not None and backend not in BACKENDS:
            raise InvalidArgument(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}",
                                  field="backend")
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                _check_backend(key, entry.handle.backend_name, backend)
                entry.pins += 1
                self._entries.move_to_end(key)
                self._count("grammar_cache_hits")
                return entry.handle
            flight = self._flights.get(key)
            leader = flight is None
            if leader:
                flight = self._flights[key] = _Flight()
            else:
                flight.waiters += 1
        handle = self._lead(key, spec, flight) if leader else self._wait(flight)
        try:
            _check_backend(key, handle.backend_name, backend)
        except FailedPrecondition:
            self.release(handle)
            raise
        return handle

    def _wait(self, flight: _Flight) -> GrammarHandle:
        flight.done.wait()
        if flight.error is not None:
            raise type(flight.error)(str(flight.error))
        self._count("grammar_cache_hits")
        return flight.handle  # the leader pinned it once for every waiter

    def _lead(self, key: str, spec: common_pb2.GrammarSpec | None, flight: _Flight) -> GrammarHandle:
        try:
            name, payload = self._fetch(key, spec)
            backend = self._backend(key, name)
            compiled = self._deserialize(key, backend, payload)
            # A payload can be much smaller than what it builds (an xgrammar spec payload).
            nbytes = max(len(payload), getattr(compiled, "memory_size_bytes", 0))
            handle = GrammarHandle(key, backend, compiled, nbytes)
        except ServiceError as exc:
            with self._lock:
                del self._flights[key]
                flight.error = exc
            flight.done.set()
            raise
        except BaseException:
            with self._lock:
                del self._flights[key]
                flight.error = Unavailable(f"fetching grammar {key!r} failed")
            flight.done.set()
            raise
        with self._lock:
            del self._flights[key]
            self._entries[key] = _Entry(handle, pins=1 + flight.waiters)
            self._bytes += handle.nbytes
            self._count("grammar_cache_misses")
            self._evict()
            flight.handle = handle
        flight.done.set()
        return handle

    def release(self, handle: GrammarHandle) -> None:
        """Unpin `handle`; then evict unpinned entries, least recently used first, until the
        cache is within capacity. Raises ValueError when `handle` is not pinned here (a
        double release)."""
        with self._lock:
            entry = self._entries.get(handle.key)
            if entry is None or entry.handle is not handle or entry.pins <= 0:
                raise ValueError(f"grammar {handle.key!r} is not pinned in this cache")
            entry.pins -= 1
            self._entries.move_to_end(handle.key)  # its last use was just now
            self._evict()

    def stats(self) -> dict[str, int]:
        """{"entries", "bytes", "pinned"}: cached grammars, their serialized bytes, and how
        many of them are pinned."""
        with self._lock:
            pinned = sum(1 for e in self._entries.values() if e.pins > 0)
            return {"entries": len(self._entries), "bytes": self._bytes, "pinned": pinned}

    def close(self) -> None:
        """Close the channel to the grammar service; cached grammars stay usable."""
        if self._channel is not None:
            self._channel.close()

    # ------------------------------------------------------------------ internals

    def _evict(self) -> None:
        """Drop unpinned entries, oldest use first, while over capacity. Caller holds the lock."""
        for key in [k for k, e in self._entries.items() if e.pins == 0]:
            if self._bytes <= self._capacity:
                break
            self._bytes -= self._entries.pop(key).handle.nbytes
        if self._metrics is not None:
            self._metrics.grammar_cache_bytes.set(self._bytes)

    def _count(self, name: str) -> None:
        if self._metrics is not None:
            getattr(self._metrics, name).inc()

    def _backend(self, key: str, name: str):
        """This rank's backend object called `name`, built on first use."""
        if name not in BACKENDS:
            raise FailedPrecondition(f"grammar {key!r} is for backend {name!r}, which this "
                                     f"worker does not have ({', '.join(BACKENDS)})",
                                     field="grammar_key")
        with self._lock:
            backend = self._backends.get(name)
            if backend is None:
                backend = self._backends[name] = backend_for(self._vocab, name, self._fill_threads)
            return backend

    def _fetch(self, key: str, spec: common_pb2.GrammarSpec | None) -> tuple[str, bytes]:
        """(backend name, checked serialized grammar) of `key` from the grammar service."""
        if self._stub is None:
            raise Unavailable(f"grammar {key!r} is not cached on this rank and no grammar "
                              "service address is configured")
        request = grammar_pb2.FetchRequest(key=key)
        if spec is not None:
            request.spec.CopyFrom(spec)
        call = self._stub.Fetch(request, timeout=self._timeout)
        # The deadline again, from this side: a Fetch started as the service went away (its
        # connection closing with GOAWAY) was seen waiting past grpc's own deadline.
        watchdog = threading.Timer(self._timeout + 1.0, call.cancel)
        watchdog.daemon = True
        watchdog.start()
        try:
            return self._read_chunks(key, call)
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code == grpc.StatusCode.CANCELLED and not watchdog.is_alive():
                code, details = grpc.StatusCode.UNAVAILABLE, f"no answer in {self._timeout} s"
            error = _STATUS_ERRORS.get(code, Unavailable)
            raise error(f"grammar service ({self._addr}) on Fetch({key!r}): "
                        f"{code.name}: {details}") from None
        finally:
            watchdog.cancel()
            call.cancel()  # no-op when the stream ended; stops it when we refuse a chunk

    def _read_chunks(self, key: str, call) -> tuple[str, bytes]:
        buf = bytearray()
        total = sha = None
        backend = XGRAMMAR
        for chunk in call:
            if total is None:
                total, sha = chunk.total_bytes, chunk.sha256
                backend = chunk.backend or XGRAMMAR  # a service older than the field
                if chunk.vocab_fingerprint != self._vocab.fingerprint:
                    raise FailedPrecondition(
                        f"grammar {key!r} was compiled for vocabulary "
                        f"{chunk.vocab_fingerprint[:16] or '(none)'}…, this model's is "
                        f"{self._vocab.fingerprint[:16]}…", field="grammar_key")
            buf += chunk.data
            if len(buf) > total:
                raise Unavailable(f"grammar service sent more than the announced {total} bytes "
                                  f"for grammar {key!r}")
        if total is None or len(buf) != total:
            raise Unavailable(f"grammar service sent {len(buf)} of {total or 0} bytes for "
                              f"grammar {key!r}")
        if hashlib.sha256(buf).hexdigest() != sha:
            raise Unavailable(f"grammar service sent a corrupt grammar {key!r} (sha256 mismatch)")
        return backend, bytes(buf)

    def _deserialize(self, key: str, backend, payload: bytes):
        try:
            return backend.deserialize(payload)
        except BackendError as exc:
            raise FailedPrecondition(
                f"grammar {key!r} does not deserialize as a {backend.name} grammar against "
                f"this model's vocabulary: {exc}", field="grammar_key") from None


def _check_backend(key: str, actual: str, expected: str | None) -> None:
    """Refuse to hand a grammar to a caller that expects the other backend's matcher."""
    if expected is not None and actual != expected:
        raise FailedPrecondition(f"grammar {key!r} was compiled by {actual}, not {expected}",
                                 field="backend")
