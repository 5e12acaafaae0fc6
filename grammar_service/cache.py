"""The compiled-grammar cache: a byte-bounded LRU in memory, optionally backed by a directory.

Entries are the serialized compiled grammar (its backend's form, as bytes) with the spec it
was made from, the backend that made it and why, keyed by `specs.cache_key`. With a
directory, every compile is also written to `<dir>/<key>.grammar` atomically (temp file +
rename) in this layout:

    GRAMSERVE-GRAMMAR 2\n
    <header JSON: key, spec, backend, backend_reason, unenforced, compile_seconds,
     payload_bytes, sha256>\n
    <payload bytes>
    \nEND <sha256 hex of the payload>\n

A file whose header, length, trailer or checksum does not match is deleted and treated as a
miss, never served (the caller recompiles). The directory is bounded too, by `disk_bytes`:
the least recently used files go first; recency survives a restart as file modification
times (a file read back is touched), so a restarted service keeps its hot grammars.
Identical concurrent `get_or_compile` calls run one compile (single flight).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from grammar_service.choice import Compiled
from grammar_service.metrics import GrammarMetrics
from grammar_service.specs import CanonicalSpec

log = logging.getLogger(__name__)

_MAGIC = b"GRAMSERVE-GRAMMAR 2\n"


@dataclass(frozen=True)
class Entry:
    """One compiled grammar: its key, spec, serialized bytes, their sha256, compile time, the
    backend that compiled it, why that one, and the keywords it leaves unenforced."""

    key: str
    spec: CanonicalSpec
    payload: bytes
    sha256: str
    compile_seconds: float
    backend: str
    backend_reason: str = ""
    unenforced: tuple[str, ...] = ()

    @classmethod
    def make(cls, key: str, spec: CanonicalSpec, compiled: Compiled,
             compile_seconds: float) -> Entry:
        payload = compiled.payload
        return cls(key, spec, payload, hashlib.sha256(payload).hexdigest(), compile_seconds,
                   compiled.backend, compiled.reason, tuple(compiled.unenforced))


class GrammarCache:
    """Byte-bounded LRU of Entry, with optional disk backing. Thread-safe.

    capacity_bytes: the most payload bytes held in memory (an entry larger than that is
    still returned to its caller and written to disk, but not kept in memory).
    cache_dir: directory for the disk copy (created), or None. disk_bytes: the most bytes of
    cache files kept in it (0: no bound); files already there count from the start.
    """

    def __init__(self, capacity_bytes: int, metrics: GrammarMetrics,
                 cache_dir: Path | None = None, disk_bytes: int = 0):
        self.capacity_bytes = capacity_bytes
        self.disk_bytes_limit = disk_bytes
        self._metrics = metrics
        self._dir = Path(cache_dir) if cache_dir else None
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._bytes = 0
        self._inflight: dict[str, Future] = {}
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._file_bytes = 0
        self.hits = self.misses = self.evictions = self.corrupt_files = 0
        self.file_evictions = 0
        if self._dir:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._scan_dir()

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the cache files in the directory (0 without one)."""
        return self._file_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Entry | None:
        """The entry from memory, else from disk (then kept in memory); None when absent.

        Marks the entry most recently used. Counts nothing: hits and misses are counted
        by `get_or_compile`, the path that decides whether to compile.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                if key in self._files:
                    self._files.move_to_end(key)
                return entry
        entry = self._read_file(key)
        if entry is not None:
            with self._lock:
                self._insert(entry)
        return entry

    def lookup(self, key: str) -> Entry | None:
        """`get`, counting a hit when found (a miss is counted only where a compile starts)."""
        entry = self.get(key)
        if entry is not None:
            self._count_hit()
        return entry

    def get_or_compile(self, key: str, spec: CanonicalSpec,
                       compile_fn: Callable[[], Compiled]) -> tuple[Entry, bool]:
        """(entry, cached): the cached entry, or the result of one `compile_fn()` call.

        Concurrent calls for the same key wait for the one compile already running and
        count as hits (cached=True). A compile's exception reaches every waiting caller and
        nothing is cached.
        """
        entry = self.get(key)
        if entry is not None:
            self._count_hit()
            return entry, True
        with self._lock:
            future = self._inflight.get(key)
            leader = future is None
            if leader:
                future = self._inflight[key] = Future()
        if not leader:
            entry = future.result()
            self._count_hit()
            return entry, True
        with self._lock:
            self.misses += 1
        self._metrics.cache_misses.inc()
        try:
            start = time.perf_counter()
            compiled = compile_fn()
            entry = Entry.make(key, spec, compiled, time.perf_counter() - start)
            self.put(entry)
            future.set_result(entry)
            return entry, False
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._inflight[key]

    def put(self, entry: Entry) -> None:
        """Keep `entry` in memory (evicting the least recently used) and write it to disk."""
        if self._dir:
            self._write_file(entry)
        with self._lock:
            self._insert(entry)

    def _count_hit(self) -> None:
        with self._lock:
            self.hits += 1
        self._metrics.cache_hits.inc()

    def _insert(self, entry: Entry) -> None:
        # Caller holds the lock.
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self._bytes -= len(old.payload)
        if len(entry.payload) <= self.capacity_bytes:
            self._entries[entry.key] = entry
            self._bytes += len(entry.payload)
        while self._bytes > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= len(evicted.payload)
            self.evictions += 1
            self._metrics.cache_evictions.inc()
        self._metrics.cache_bytes.set(self._bytes)

    def _path(self, key: str) -> Path:
        return self._dir / f"{key}.grammar"

    def _scan_dir(self) -> None:
        """Index the files a previous run left, oldest first; drop its unfinished writes."""
        found = []
        for path in self._dir.iterdir():
            try:
                if path.name.startswith(".tmp-"):
                    path.unlink(missing_ok=True)
                elif path.suffix == ".grammar":
                    st = path.stat()
                    found.append((st.st_mtime, path.stem, st.st_size))
            except OSError:
                continue
        with self._lock:
            for _, key, size in sorted(found):
                self._files[key] = size
                self._file_bytes += size
            self._evict_files()

    def _file_added(self, key: str, size: int) -> None:
        with self._lock:
            self._file_bytes += size - self._files.pop(key, 0)
            self._files[key] = size
            self._evict_files()

    def _file_gone(self, key: str) -> None:
        with self._lock:
            self._file_bytes -= self._files.pop(key, 0)

    def _evict_files(self) -> None:
        # Caller holds the lock.
        while self.disk_bytes_limit and self._file_bytes > self.disk_bytes_limit and self._files:
            key, size = self._files.popitem(last=False)
            self._file_bytes -= size
            self.file_evictions += 1
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError:
                log.exception("cannot delete cache file for %s", key)

    def _write_file(self, entry: Entry) -> None:
        header = json.dumps({"key": entry.key, "spec": entry.spec.to_dict(),
                             "backend": entry.backend, "backend_reason": entry.backend_reason,
                             "unenforced": list(entry.unenforced),
                             "compile_seconds": entry.compile_seconds,
                             "payload_bytes": len(entry.payload), "sha256": entry.sha256})
        head = _MAGIC + header.encode() + b"\n"
        trailer = b"\nEND " + entry.sha256.encode() + b"\n"
        size = len(head) + len(entry.payload) + len(trailer)
        if self.disk_bytes_limit and size > self.disk_bytes_limit:
            return  # would evict everything else and still not fit
        fd, tmp = tempfile.mkstemp(dir=self._dir, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(head + entry.payload)
                f.write(trailer)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(entry.key))
            self._file_added(entry.key, size)
        except OSError:
            # The memory copy still serves; a missing disk copy costs a recompile later.
            log.exception("cannot write cache file for %s", entry.key)
            Path(tmp).unlink(missing_ok=True)

    def _read_file(self, key: str) -> Entry | None:
        if not self._dir:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._file_gone(key)
            return None
        except OSError:
            log.exception("cannot read cache file %s", path)
            return None
        entry = _parse_file(key, data)
        if entry is None:
            log.warning("cache file %s is corrupt or truncated; deleted", path)
            with self._lock:
                self.corrupt_files += 1
            path.unlink(missing_ok=True)
            self._file_gone(key)
            return None
        try:
            os.utime(path)  # recently used: kept longest, across restarts too
        except OSError:
            pass
        self._file_added(key, len(data))
        return entry


def _parse_file(key: str, data: bytes) -> Entry | None:
    """The entry in a cache file's bytes, or None when anything does not check out."""
    if not data.startswith(_MAGIC):
        return None
    rest = data[len(_MAGIC):]
    newline = rest.find(b"\n")
    if newline < 0:
        return None
    try:
        header = json.loads(rest[:newline])
        size, digest = int(header["payload_bytes"]), str(header["sha256"])
        spec = CanonicalSpec.from_dict(header["spec"])
        compile_seconds = float(header["compile_seconds"])
        backend, reason = str(header["backend"]), str(header["backend_reason"])
        unenforced = tuple(str(k) for k in header["unenforced"])
    except (ValueError, KeyError, TypeError):
        return None
    body = rest[newline + 1:]
    payload, trailer = body[:size], body[size:]
    if header.get("key") != key or trailer != b"\nEND " + digest.encode() + b"\n":
        return None
    if hashlib.sha256(payload).hexdigest() != digest:
        return None
    return Entry(key, spec, payload, digest, compile_seconds, backend, reason, unenforced)
