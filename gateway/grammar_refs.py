"""The gateway's memory of compiled grammars: constraint -> the grammar service's GrammarRef.

A guided request needs the key its grammar is cached under (the workers fetch and pin it by
that key). The key is a pure function of the constraint, the vocabulary and the backend
versions, none of which change while a gateway runs, so once the grammar service has
compiled a constraint the gateway reuses its answer: a repeated schema costs no Compile
round trip (on the H200 that round trip plus the service's validation was most of a short
answer's time to first token), and grammars the workers already hold keep serving while the
grammar service is down. A worker that no longer holds a key fetches it, and the grammar
service recompiles an evicted key from the spec the Admit carries, so a stale entry here is
never wrong, only a miss elsewhere.

Plain Python: bounded by entries and by the bytes of the constraints it holds.
"""

from __future__ import annotations

from collections import OrderedDict


class GrammarRefs:
    """An LRU of serialized constraint -> GrammarRef (any object), bounded by `max_entries`
    and `max_bytes` (the sum of the serialized constraints' sizes). Not thread-safe: the
    gateway's event loop is its only user."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20):
        if max_entries < 0 or max_bytes < 0:
            raise ValueError("max_entries and max_bytes must be >= 0")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._refs: OrderedDict[bytes, object] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, constraint: bytes):
        """The GrammarRef remembered for `constraint`, or None; a hit becomes the newest."""
        ref = self._refs.get(constraint)
        if ref is None:
            self.misses += 1
            return None
        self._refs.move_to_end(constraint)
        self.hits += 1
        return ref

    def put(self, constraint: bytes, ref) -> None:
        """Remember `ref` for `constraint`, evicting the oldest entries past the bounds (a
        constraint larger than max_bytes is not kept)."""
        if len(constraint) > self.max_bytes or self.max_entries == 0:
            return
        if constraint in self._refs:
            self._bytes -= len(constraint)
            del self._refs[constraint]
        self._refs[constraint] = ref
        self._bytes += len(constraint)
        while len(self._refs) > self.max_entries or self._bytes > self.max_bytes:
            old, _ = self._refs.popitem(last=False)
            self._bytes -= len(old)

    def __len__(self) -> int:
        return len(self._refs)
