"""The worker's grammar cache against a real gRPC GrammarService on loopback.

The servicer below is a small stand-in written for these tests: it compiles specs with real
xgrammar or llguidance against the default model's vocabulary and streams them in small
chunks, and it can be told to lie (wrong fingerprint, corrupt payload, another backend's
payload) or to hold a fetch open.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import xgrammar as xgr
from prometheus_client import CollectorRegistry

from gpu_worker.guided.grammar_cache import WorkerGrammarCache
from gpu_worker.guided.masks import MaskFiller
from gpu_worker.metrics import WorkerMetrics
from grammar_service.backends import LLGuidanceMatcher, backend_for
from grammar_service.default_model import ensure_default_model
from grammar_service.specs import parse_spec
from grammar_service.vocab import Vocab, load_vocab
from protos import common_pb2, grammar_pb2, grammar_pb2_grpc
from protos.rpc import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
    create_server,
)

CHUNK = 1024  # small, so every grammar arrives in several chunks
SCHEMA = json.dumps({"type": "object",
                     "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False})


class TinyGrammarService(grammar_pb2_grpc.GrammarServiceServicer):
    """Fetch only: serves stored payloads; compiles a regex/json_schema spec for an unknown key."""

    def __init__(self, vocab: Vocab):
        self.compiler = xgr.GrammarCompiler(vocab.tokenizer_info(), max_threads=1)
        self.llguidance = backend_for(vocab, "llguidance")
        self.fingerprint = vocab.fingerprint
        # key -> payload, fingerprint, sha, backend named in the first chunk ("" = not named)
        self.store: dict[str, tuple[bytes, str, str, str]] = {}
        self.fetches = 0
        self.gate: threading.Event | None = None  # when set, Fetch waits for it

    def compile(self, spec: common_pb2.GrammarSpec) -> bytes:
        kind = spec.WhichOneof("kind")
        if kind == "regex":
            return self.compiler.compile_regex(spec.regex).serialize_json().encode()
        if kind == "json_schema":
            return self.compiler.compile_json_schema(spec.json_schema).serialize_json().encode()
        raise InvalidArgument(f"unsupported here: {kind}", field="spec")

    def add(self, key: str, spec: common_pb2.GrammarSpec, *, fingerprint: str | None = None,
            payload: bytes | None = None, sha: str | None = None, backend: str = "") -> int:
        """Store `spec` compiled by `backend` ("" or "xgrammar": xgrammar, named as "" in the
        chunk, as an older service does), or `payload` as given, named as `backend`."""
        if payload is None:
            payload = self.compile_llguidance(spec) if backend == "llguidance" \
                else self.compile(spec)
        self.store[key] = (payload, fingerprint or self.fingerprint,
                           sha or hashlib.sha256(payload).hexdigest(), backend)
        return len(payload)

    def compile_llguidance(self, spec: common_pb2.GrammarSpec) -> bytes:
        return self.llguidance.serialize(self.llguidance.compile(parse_spec(spec)))

    def Fetch(self, request, context):
        self.fetches += 1
        if self.gate is not None:
            self.gate.wait(10)
        if request.key not in self.store:
            if not request.HasField("spec"):
                raise NotFound(f"unknown grammar key {request.key!r}", field="key")
            self.add(request.key, request.spec)
        payload, fingerprint, sha, backend = self.store[request.key]
        for offset in range(0, len(payload), CHUNK):
            first = offset == 0
            yield grammar_pb2.GrammarChunk(
                data=payload[offset:offset + CHUNK], total_bytes=len(payload) if first else 0,
                vocab_fingerprint=fingerprint if first else "", sha256=sha if first else "",
                backend=backend if first else "")


def regex(pattern: str) -> common_pb2.GrammarSpec:
    return common_pb2.GrammarSpec(regex=pattern)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def vocab(model_dir) -> Vocab:
    return load_vocab(model_dir)


@pytest.fixture
def service(vocab):
    servicer = TinyGrammarService(vocab)
    name = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name
    server, port, _ = create_server(
        [(grammar_pb2_grpc.add_GrammarServiceServicer_to_server, servicer, name)], port=0)
    servicer.addr = f"127.0.0.1:{port}"
    servicer.server = server
    yield servicer
    if servicer.gate is not None:
        servicer.gate.set()
    server.stop(None)


@pytest.fixture
def metrics() -> WorkerMetrics:
    return WorkerMetrics(CollectorRegistry())


def _cache(service, vocab, metrics=None, capacity=1 << 30) -> WorkerGrammarCache:
    return WorkerGrammarCache(service.addr, vocab, capacity, metrics=metrics, fetch_timeout_s=10)


def test_miss_fetches_once_then_hits_locally_with_counters(service, vocab, metrics):
    size = service.add("k1", regex("[a-z]+"))
    assert size > 2 * CHUNK  # the payload really is reassembled from several chunks
    cache = _cache(service, vocab, metrics)
    first = cache.acquire("k1", None)
    second = cache.acquire("k1", None)
    assert second is first and first.nbytes == size and service.fetches == 1
    assert metrics.grammar_cache_misses._value.get() == 1
    assert metrics.grammar_cache_hits._value.get() == 1
    assert metrics.grammar_cache_bytes._value.get() == size
    assert cache.stats() == {"entries": 1, "bytes": size, "pinned": 1}
    cache.release(first)
    cache.release(second)
    assert cache.stats() == {"entries": 1, "bytes": size, "pinned": 0}
    with pytest.raises(ValueError, match="not pinned"):
        cache.release(first)  # a double release is a bug, reported loudly


def test_matcher_from_handle_accepts_a_valid_instance_and_each_is_new(service, vocab):
    service.add("schema", common_pb2.GrammarSpec(json_schema=SCHEMA))
    handle = _cache(service, vocab).acquire("schema", None)
    used, fresh = handle.new_matcher(), handle.new_matcher()
    assert used is not fresh
    for token in vocab.encode('{"name": "Zoë", "age": 7}', add_special_tokens=False):
        assert used.accept_token(token)
    assert used.accept_token(vocab.eos_token_ids[0]) and used.is_terminated()
    # The other matcher is untouched by the first one's progress (I1).
    assert not fresh.is_terminated()
    assert not fresh.accept_string('{"age": 7}')  # "name" is required first
    assert handle.new_matcher().accept_string('{"name"')


def test_unknown_key_is_not_found_but_a_spec_lets_the_service_recompile(service, vocab):
    cache = _cache(service, vocab)
    with pytest.raises(NotFound, match="unknown grammar key"):
        cache.acquire("missing", None)
    handle = cache.acquire("missing", regex("ab+c"))
    assert handle.new_matcher().accept_string("abbbc")
    with pytest.raises(InvalidArgument, match="grammar_key"):
        cache.acquire("", None)


def test_fingerprint_mismatch_is_failed_precondition_and_pins_nothing(service, vocab, metrics):
    service.add("other-vocab", regex("x+"), fingerprint="0" * 64)
    cache = _cache(service, vocab, metrics)
    with pytest.raises(FailedPrecondition, match="compiled for vocabulary 0000"):
        cache.acquire("other-vocab", None)
    assert cache.stats() == {"entries": 0, "bytes": 0, "pinned": 0}
    assert metrics.grammar_cache_misses._value.get() == 0


def test_grammar_of_another_vocab_behind_a_right_fingerprint_is_refused(service, vocab,
                                                                        model_dir, tmp_path):
    # Same tokens, wider model vocabulary: xgrammar's own metadata check must catch it.
    other_dir = shutil.copytree(model_dir, tmp_path / "wider")
    config = json.loads((other_dir / "config.json").read_text())
    (other_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    other = xgr.GrammarCompiler(load_vocab(other_dir).tokenizer_info(), max_threads=1)
    payload = other.compile_regex("y+").serialize_json().encode()
    service.add("lying", regex("y+"), payload=payload)
    with pytest.raises(FailedPrecondition, match="does not deserialize"):
        _cache(service, vocab).acquire("lying", None)


def test_corrupt_payload_is_unavailable(service, vocab):
    service.add("corrupt", regex("z+"), sha="f" * 64)
    cache = _cache(service, vocab)
    with pytest.raises(Unavailable, match="sha256"):
        cache.acquire("corrupt", None)
    assert cache.stats()["entries"] == 0


def test_pinned_entries_survive_eviction_pressure(service, vocab, metrics):
    size_a = service.add("a", regex("[a-z]{1,5}q"))
    service.add("b", regex("[a-z]{1,5}r"))
    cache = _cache(service, vocab, metrics, capacity=size_a // 2)  # smaller than any grammar
    a = cache.acquire("a", None)
    b = cache.acquire("b", None)
    assert cache.stats()["entries"] == 2 and cache.stats()["pinned"] == 2  # soft bound
    assert a.new_matcher().accept_string("abcq") and b.new_matcher().accept_string("xr")
    cache.release(a)
    assert cache.stats()["entries"] == 1  # a went as soon as it was unpinned; b stays
    assert cache.acquire("b", None) is b
    cache.release(b)
    cache.release(b)
    assert cache.stats() == {"entries": 0, "bytes": 0, "pinned": 0}
    assert metrics.grammar_cache_bytes._value.get() == 0


def test_unpinned_entries_are_evicted_least_recently_used_first(service, vocab):
    sizes = {k: service.add(k, regex(f"[a-z]{{1,5}}{k}")) for k in "abcd"}
    capacity = max(sizes["a"] + sizes["b"] + sizes["c"], sizes["a"] + sizes["c"] + sizes["d"])
    cache = _cache(service, vocab, capacity=capacity)
    for key in "abc":
        cache.release(cache.acquire(key, None))
    cache.release(cache.acquire("a", None))  # a is now the most recently used
    d = cache.acquire("d", None)
    assert cache.stats() == {"entries": 3, "bytes": sizes["a"] + sizes["c"] + sizes["d"],
                             "pinned": 1}
    fetches = service.fetches
    for key in "acd":
        cache.release(cache.acquire(key, None))  # still cached: no fetch
    assert service.fetches == fetches
    cache.release(d)
    cache.release(cache.acquire("b", None))  # b was the one evicted
    assert service.fetches == fetches + 1


def test_service_down_misses_are_unavailable_and_hits_still_work(service, vocab):
    service.add("kept", regex("ok+"))
    service.add("never", regex("no+"))
    cache = _cache(service, vocab)
    cache.release(cache.acquire("kept", None))
    service.server.stop(None)
    with pytest.raises(Unavailable, match="UNAVAILABLE"):
        cache.acquire("never", None)
    handle = cache.acquire("kept", None)
    assert handle.new_matcher().accept_string("okkk")
    cache.release(handle)


def test_no_service_address_means_misses_are_unavailable(vocab):
    cache = WorkerGrammarCache(None, vocab, 1 << 20)
    with pytest.raises(Unavailable, match="no grammar service address"):
        cache.acquire("k", regex("a"))
    with pytest.raises(ValueError, match="capacity_bytes"):
        WorkerGrammarCache(None, vocab, 0)


def test_the_ranks_fill_threads_set_llguidances_lanes(vocab):
    from grammar_service.backends import LANES_PER_THREAD

    assert WorkerGrammarCache(None, vocab, 1 << 20, fill_threads=3)._backend(
        "k", "llguidance").lanes == 3 * LANES_PER_THREAD


def _acquire_concurrently(cache, service, key, spec, n):
    service.gate = threading.Event()
    results: list = [None] * n

    def run(i):
        try:
            results[i] = cache.acquire(key, spec)
        except Exception as exc:  # collected and asserted by the caller
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    # Hold the one fetch open until every other acquirer is waiting on it.
    while not (key in cache._flights and cache._flights[key].waiters == n - 1):
        assert time.monotonic() < deadline, "acquirers never queued on the fetch"
        time.sleep(0.005)
    service.gate.set()
    for t in threads:
        t.join(10)
    return results


def test_concurrent_acquires_of_a_missing_key_fetch_once(service, vocab, metrics):
    service.add("shared", regex("[0-9]+"))
    cache = _cache(service, vocab, metrics)
    handles = _acquire_concurrently(cache, service, "shared", None, 6)
    assert service.fetches == 1
    assert all(h is handles[0] for h in handles)
    assert metrics.grammar_cache_misses._value.get() == 1
    assert metrics.grammar_cache_hits._value.get() == 5
    assert cache.stats()["pinned"] == 1
    for h in handles:
        cache.release(h)
    with pytest.raises(ValueError):
        cache.release(handles[0])  # exactly six pins were taken


def test_concurrent_acquires_share_one_failure(service, vocab):
    cache = _cache(service, vocab)
    errors = _acquire_concurrently(cache, service, "nobody", None, 4)
    assert service.fetches == 1
    assert all(isinstance(e, NotFound) for e in errors)
    assert cache.stats() == {"entries": 0, "bytes": 0, "pinned": 0}


BOUNDED = json.dumps({"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
    "required": ["code"]})


def _accepts(matcher, vocab, text: str) -> bool:
    matcher.reset()
    return all(matcher.accept_token(t) for t in vocab.encode(text, add_special_tokens=False)) \
        and matcher.accept_token(vocab.eos_token_ids[0]) and matcher.is_terminated()


def test_llguidance_grammar_gives_llguidance_matchers_that_enforce_it(service, vocab):
    service.add("llg", common_pb2.GrammarSpec(json_schema=BOUNDED), backend="llguidance")
    cache = _cache(service, vocab)
    handle = cache.acquire("llg", None, backend="llguidance")
    assert handle.backend_name == "llguidance"
    first, second = handle.new_matcher(), handle.new_matcher()
    assert isinstance(first, LLGuidanceMatcher) and first is not second
    assert _accepts(first, vocab, '{"code": "abc"}')
    assert not _accepts(second, vocab, '{"code": "abcd"}')  # maxLength next to a pattern
    assert cache.acquire("llg", None) is handle  # a hit, with no backend expectation


@pytest.mark.parametrize("n_llg", [2, 6], ids=["llguidance-per-row", "llguidance-batched"])
def test_llguidance_and_xgrammar_matchers_fill_rows_of_the_shared_bitmask(service, vocab, n_llg):
    service.add("llg", common_pb2.GrammarSpec(json_schema=BOUNDED), backend="llguidance")
    service.add("xgr", common_pb2.GrammarSpec(json_schema=SCHEMA))
    cache = _cache(service, vocab)
    llg, xg = cache.acquire("llg", None), cache.acquire("xgr", None)
    n = 8 + n_llg
    rows = n + 2
    masks = MaskFiller(rows, vocab.model_vocab_size, torch.device("cpu"), fill_threads=2)
    masks.host.fill_(0x5A5A5A5A)  # stale bits everywhere: every filled row must be rewritten
    # Eight xgrammar rows take xgrammar's batch path; llguidance rows fill one by one (2) or
    # through llguidance's executor (6).
    matchers = [xg.new_matcher() for _ in range(8)] + [llg.new_matcher() for _ in range(n_llg)]
    for token in vocab.encode('{"code": "a', add_special_tokens=False):
        assert matchers[-1].accept_token(token)
    slots = list(range(rows))[::-1]  # slots out of order; the last two are never filled
    slots = slots[2:] + slots[:2]
    masks.fill(matchers, slots[:n])
    for m, slot in zip(matchers, slots[:n], strict=True):
        expected = torch.zeros((1, masks.width), dtype=torch.int32)
        m.fill_next_token_bitmask(expected, 0)
        assert torch.equal(masks.host[slot], expected[0])
    assert not torch.equal(masks.host[slots[8]], masks.host[slots[n - 1]])  # two states
    for slot in slots[n:]:  # rows not handed to fill are untouched
        assert (masks.host[slot] == 0x5A5A5A5A).all()


def test_grammar_never_pairs_with_the_other_backends_matcher(service, vocab, metrics):
    service.add("llg", regex("[a-z]+"), backend="llguidance")
    service.add("xgr", regex("[a-z]+"))
    # An xgrammar payload named as llguidance's, and the other way round.
    service.add("xgr-as-llg", regex("[0-9]+"), payload=service.compile(regex("[0-9]+")),
                backend="llguidance")
    service.add("llg-as-xgr", regex("[0-9]+"), backend="xgrammar",
                payload=service.compile_llguidance(regex("[0-9]+")))
    cache = _cache(service, vocab, metrics)
    for key in ("xgr-as-llg", "llg-as-xgr"):
        with pytest.raises(FailedPrecondition, match="does not deserialize"):
            cache.acquire(key, None)
    # The caller expects one backend and the grammar is the other's: refused, nothing pinned.
    with pytest.raises(FailedPrecondition, match="compiled by llguidance, not xgrammar"):
        cache.acquire("llg", None, backend="xgrammar")
    handle = cache.acquire("xgr", None)
    with pytest.raises(FailedPrecondition, match="compiled by xgrammar, not llguidance"):
        cache.acquire("xgr", None, backend="llguidance")
    assert cache.stats()["pinned"] == 1
    cache.release(handle)
    llg = backend_for(vocab, "llguidance")
    with pytest.raises(ValueError, match="llguidance cannot make a matcher from CompiledGrammar"):
        llg.new_matcher(handle.compiled)
    with pytest.raises(InvalidArgument, match="unknown backend"):
        cache.acquire("xgr", None, backend="outlines")


def test_an_xgrammar_spec_payload_is_compiled_on_the_rank_and_counted_at_its_size(
        service, vocab, metrics):
    # The service sends the spec when compiling is cheaper than moving the compiled form.
    xgrammar = backend_for(vocab, "xgrammar")
    proto = common_pb2.GrammarSpec(json_schema=SCHEMA)
    spec = parse_spec(proto)
    payload = xgrammar.serialize(xgrammar.compile(spec), spec, compile_seconds=1e-6)
    service.add("by-spec", proto, payload=payload, backend="xgrammar")
    handle = _cache(service, vocab, metrics).acquire("by-spec", None)
    assert handle.backend_name == "xgrammar"
    assert handle.nbytes == handle.compiled.memory_size_bytes > len(payload)
    matcher = handle.new_matcher()
    assert matcher.accept_string('{"name": "a", "age": 1}')
    assert not handle.new_matcher().accept_string('{"age"')
