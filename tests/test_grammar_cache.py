"""The compiled-grammar cache on its own: byte bound, disk files, corruption, single flight."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from grammar_service.cache import GrammarCache
from grammar_service.choice import Compiled
from grammar_service.metrics import GrammarMetrics
from grammar_service.specs import CanonicalSpec, GrammarOptions

SPEC = CanonicalSpec("regex", "a+", GrammarOptions())


def make_cache(capacity=1000, cache_dir=None, disk_bytes=0):
    return GrammarCache(capacity, GrammarMetrics(CollectorRegistry()), cache_dir, disk_bytes)


def compiler(payload: str, calls: list, backend: str = "xgrammar"):
    def compile_fn():
        calls.append(1)
        return Compiled(backend, "a reason", ("not",), payload.encode())
    return compile_fn


def test_lru_evicts_least_recently_used_under_the_byte_bound():
    cache, calls = make_cache(capacity=250), []
    for key in ("k1", "k2"):
        cache.get_or_compile(key, SPEC, compiler("x" * 100, calls))
    cache.get("k1")  # k2 is now the least recently used
    cache.get_or_compile("k3", SPEC, compiler("y" * 100, calls))
    assert cache.get("k2") is None and cache.get("k1") and cache.get("k3")
    assert cache.bytes == 200 and cache.evictions == 1 and len(cache) == 2


def test_entry_larger_than_the_bound_is_returned_but_not_kept():
    cache, calls = make_cache(capacity=10), []
    entry, cached = cache.get_or_compile("big", SPEC, compiler("z" * 50, calls))
    assert entry.payload == b"z" * 50 and not cached and cache.bytes == 0


def test_restart_with_cache_dir_serves_from_disk_without_compiling(tmp_path):
    calls = []
    make_cache(cache_dir=tmp_path).get_or_compile("k", SPEC, compiler("payload", calls))
    entry, cached = make_cache(cache_dir=tmp_path).get_or_compile(
        "k", SPEC, compiler("other", calls))
    assert cached and entry.payload == b"payload" and entry.spec == SPEC and len(calls) == 1


def test_cache_dir_is_bounded_in_bytes_least_recently_used_first_across_restarts(tmp_path):
    calls = []
    one = make_cache(capacity=10_000, cache_dir=tmp_path, disk_bytes=10_000)
    for k in ("a", "b", "c"):
        one.get_or_compile(k, SPEC, compiler(k * 2000, calls))
    file_size = max(p.stat().st_size for p in tmp_path.glob("*.grammar"))
    assert one.disk_bytes == sum(p.stat().st_size for p in tmp_path.glob("*.grammar"))
    bound = 3 * file_size + file_size // 2  # room for three files, not four
    # A restart under that bound: "a" is read back (now the most recent), then "d" arrives.
    two = make_cache(capacity=1, cache_dir=tmp_path, disk_bytes=bound)
    assert two.get("a").payload == b"a" * 2000
    two.get_or_compile("d", SPEC, compiler("d" * 2000, calls))
    assert sorted(p.stem for p in tmp_path.glob("*.grammar")) == ["a", "c", "d"]
    assert two.disk_bytes <= bound and two.file_evictions == 1
    # A smaller bound at the next start trims what the last run left, oldest first.
    d_size = (tmp_path / "d.grammar").stat().st_size
    three = make_cache(capacity=1, cache_dir=tmp_path, disk_bytes=d_size)
    assert [p.stem for p in tmp_path.glob("*.grammar")] == ["d"]
    assert three.get("d").payload == b"d" * 2000 and three.get("c") is None
    # A file larger than the whole bound is never written; its entry still serves.
    entry, _ = three.get_or_compile("huge", SPEC, compiler("h" * 50_000, calls))
    assert entry.payload == b"h" * 50_000 and not (tmp_path / "huge.grammar").exists()


def test_disk_copy_keeps_the_backend_its_reason_and_unenforced_keywords(tmp_path):
    make_cache(cache_dir=tmp_path).get_or_compile("k", SPEC,
                                                  compiler("p", [], backend="llguidance"))
    entry = make_cache(cache_dir=tmp_path).get("k")
    assert (entry.backend, entry.backend_reason, entry.unenforced) == (
        "llguidance", "a reason", ("not",))


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "empty", "wrong_key"])
def test_corrupted_cache_file_is_deleted_and_recompiled_never_served(tmp_path, damage):
    calls = []
    make_cache(cache_dir=tmp_path).get_or_compile("k", SPEC, compiler("good-payload", calls))
    path = tmp_path / "k.grammar"
    data = path.read_bytes()
    if damage == "flip_payload_byte":
        i = data.index(b"good-payload")
        data = data[:i] + b"G" + data[i + 1:]
    elif damage == "truncate":
        data = data[: len(data) - 10]
    elif damage == "empty":
        data = b""
    else:
        path = tmp_path / "other.grammar"
    path.write_bytes(data)
    key = "other" if damage == "wrong_key" else "k"
    fresh = make_cache(cache_dir=tmp_path)
    assert fresh.get(key) is None and not path.exists() and fresh.corrupt_files == 1
    entry, cached = fresh.get_or_compile(key, SPEC, compiler("recompiled", calls))
    assert not cached and entry.payload == b"recompiled"
    assert make_cache(cache_dir=tmp_path).get(key).payload == b"recompiled"


def test_concurrent_identical_requests_compile_once_and_failures_reach_every_waiter():
    cache, calls = make_cache(), []
    gate = threading.Event()

    def slow():
        calls.append(1)
        gate.wait(5)
        raise RuntimeError("boom")

    errors = []

    def call():
        try:
            cache.get_or_compile("k", SPEC, slow)
        except RuntimeError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    gate.set()
    for t in threads:
        t.join(5)
    assert len(calls) == 1 and len(errors) == 8 and cache.get("k") is None
