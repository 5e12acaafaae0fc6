"""The slot table of one rank and the lockstep rule that keeps every rank's table the same.

Plain Python (no torch, no grpc): gRPC threads call `allocate` / `register` / `request_release`;
the engine thread calls `local_vector` and `apply` around one all-reduce per step.

Invariant I2 lives here. Each step every rank contributes, per slot, the key of the request it
holds an Admit for and whether it wants that slot's running request released. The vector is
all-reduced with MAX, so:
- a slot starts when every rank holds an Admit for the same request (keys agree: max == min,
  obtained as max(k) and max(-k) in one MAX reduction);
- a slot is released as soon as any rank asks (max of the flags).
Every rank applies the same reduced vector, so starts and releases take effect at the same step
everywhere. Requests are identified by (slot, request id): a Release naming an old request never
frees the slot's next tenant.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Three int64 per slot: key, -key, release flag. An absent Admit contributes (-1, +1, 0):
# +1 beats every -key (keys are >= 0), so one missing rank keeps max(-key) > 0.
FIELDS_PER_SLOT = 3
_ABSENT = (-1, 1)


def request_key(request_id: str) -> int:
    """A stable 62-bit non-negative key for a request id (same on every rank)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2


class SlotBusy(Exception):
    """The slot holds another live request."""


class NoFreeSlot(Exception):
    """Every slot of the group is taken."""


class UnknownRequest(Exception):
    """The slot does not hold that request (stale or double release)."""


@dataclass
class Entry:
    """One request's claim on a slot of this rank. `payload` is the engine's request object.

    `on_drop` runs exactly once when the entry leaves the table without finishing on the
    engine (expired, replaced, released before it started): it frees what the payload holds.
    """

    slot: int
    request_id: str
    payload: Any
    created: float = field(default_factory=time.monotonic)
    on_drop: Callable[[Entry, str], None] | None = None
    key: int = -1

    def __post_init__(self):
        self.key = request_key(self.request_id)

    def drop(self, reason: str) -> None:
        callback, self.on_drop = self.on_drop, None
        if callback is not None:
            callback(self, reason)


@dataclass
class StepDecision:
    """What the reduced control vector says for this step."""

    starts: list[Entry]
    releases: list[Entry]


class SlotTable:
    """Slots of one rank: pending Admits, running requests, release requests.

    Rank 0 allocates slots (`allocate`); other ranks `register` the slot rank 0 chose.
    Thread-safe. Raises NoFreeSlot, SlotBusy, UnknownRequest for callers to map to statuses.
    """

    def __init__(self, num_slots: int, *, is_rank0: bool, admit_timeout_s: float,
                 busy_wait_s: float = 0.5, tombstones: int = 4096,
                 on_expire: Callable[[int], None] | None = None):
        """`on_expire(n)` is told how many pending Admits one step expired (a metric)."""
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self._on_expire = on_expire
        self.is_rank0 = is_rank0
        self.admit_timeout_s = admit_timeout_s
        self.busy_wait_s = busy_wait_s
        self._pending: list[Entry | None] = [None] * num_slots
        self._running: list[Entry | None] = [None] * num_slots
        self._release: list[bool] = [False] * num_slots
        self._tombstones: OrderedDict[tuple[int, str], None] = OrderedDict()
        self._max_tombstones = tombstones
        self._cond = threading.Condition()
        self._changed = False
        # True between local_vector and apply: the entries this rank proposed must not change
        # under the all-reduce, so gRPC-side mutations wait (for about one collective).
        self._frozen = False

    # ---- gRPC side -------------------------------------------------------------------------

    def allocate(self, request_id: str, payload: Any, on_drop=None) -> Entry:
        """Rank 0: claim the lowest free slot for a new request; raises NoFreeSlot."""
        assert self.is_rank0
        with self._cond:
            self._wait_unfrozen()
            for slot in range(self.num_slots):
                if self._pending[slot] is None and self._running[slot] is None:
                    entry = Entry(slot, request_id, payload, on_drop=on_drop)
                    self._pending[slot] = entry
                    self._notify()
                    return entry
        raise NoFreeSlot(f"all {self.num_slots} slots are in use")

    def register(self, slot: int, request_id: str, payload: Any, on_drop=None) -> Entry:
        """Other ranks: hold the Admit for `slot` until every rank has it.

        A slot still running its previous tenant is waited for up to busy_wait_s (its release
        may be one step away on this rank); then SlotBusy. A pending Admit of another request
        is replaced (it can only be stale: rank 0 hands a slot to one request at a time). A
        request already released here is refused with UnknownRequest.
        """
        assert not self.is_rank0
        self._check_slot(slot)
        deadline = time.monotonic() + self.busy_wait_s
        with self._cond:
            self._wait_unfrozen()
            if (slot, request_id) in self._tombstones:
                raise UnknownRequest(f"request {request_id!r} was already released")
            while self._running[slot] is not None and self._running[slot].request_id != request_id:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SlotBusy(f"slot {slot} is running request "
                                   f"{self._running[slot].request_id!r}")
                self._cond.wait(left)
                self._wait_unfrozen()
            if self._running[slot] is not None:
                raise SlotBusy(f"slot {slot} is already running request {request_id!r}")
            old = self._pending[slot]
            entry = Entry(slot, request_id, payload, on_drop=on_drop)
            self._pending[slot] = entry
            self._notify()
        if old is not None:
            old.drop("replaced")
        return entry

    def request_release(self, slot: int, request_id: str) -> bool:
        """Release `request_id` from `slot` on every rank; True when it was running.

        A running request is released at the next step on every rank; a pending one is dropped
        here. Raises UnknownRequest when the slot holds neither (stale or double release).
        """
        self._check_slot(slot)
        dropped = None
        with self._cond:
            self._wait_unfrozen()
            self._remember(slot, request_id)
            running, pending = self._running[slot], self._pending[slot]
            if running is not None and running.request_id == request_id:
                self._release[slot] = True
                self._notify()
                return True
            if pending is not None and pending.request_id == request_id:
                dropped, self._pending[slot] = pending, None
                self._notify()
        if dropped is None:
            raise UnknownRequest(f"slot {slot} does not hold request {request_id!r}")
        dropped.drop("released")
        return False

    def wait_for_change(self, timeout: float) -> bool:
        """Block up to `timeout` until a call changed the table (idle engine), or `poke`;
        True when something did."""
        with self._cond:
            if not self._changed:
                self._cond.wait(timeout)
            changed, self._changed = self._changed, False
            return changed

    def poke(self) -> None:
        """Wake an engine waiting in `wait_for_change` (a drain asked, say)."""
        with self._cond:
            self._notify()

    def snapshot(self) -> list[tuple[str, Entry | None]]:
        """Per slot: ("free" | "pending" | "running", entry)."""
        with self._cond:
            out = []
            for slot in range(self.num_slots):
                if self._running[slot] is not None:
                    out.append(("running", self._running[slot]))
                elif self._pending[slot] is not None:
                    out.append(("pending", self._pending[slot]))
                else:
                    out.append(("free", None))
            return out

    def in_use(self) -> int:
        with self._cond:
            return sum(1 for s in range(self.num_slots)
                       if self._running[s] is not None or self._pending[s] is not None)

    # ---- engine side -----------------------------------------------------------------------

    def local_vector(self, now: float | None = None) -> list[int]:
        """This rank's control contribution for the step; expires stale pending Admits."""
        now = time.monotonic() if now is None else now
        expired = []
        vec = []
        with self._cond:
            self._frozen = True
            for slot in range(self.num_slots):
                entry = self._pending[slot]
                if entry is not None and now - entry.created > self.admit_timeout_s:
                    expired.append(entry)
                    self._pending[slot] = entry = None
                vec.extend((entry.key, -entry.key) if entry is not None else _ABSENT)
                vec.append(1 if self._release[slot] else 0)
        for entry in expired:
            entry.drop("expired")
        if expired and self._on_expire is not None:
            self._on_expire(len(expired))
        return vec

    def apply(self, reduced: list[int], admit: bool = True) -> StepDecision:
        """Apply the all-reduced (MAX) control vector: the same decision on every rank.
        With `admit` False (a draining group: the same on every rank) no pending request
        starts; releases apply as always."""
        assert len(reduced) == FIELDS_PER_SLOT * self.num_slots
        starts, releases = [], []
        with self._cond:
            for slot in range(self.num_slots):
                max_key, max_neg_key, release = reduced[3 * slot: 3 * slot + 3]
                running = self._running[slot]
                if release and running is not None:
                    releases.append(running)
                    self._end(slot, running)
                elif release:
                    self._release[slot] = False
                if admit and max_key >= 0 and max_key == -max_neg_key:
                    entry = self._pending[slot]
                    # Every rank holds an Admit with this key, ours included.
                    assert entry is not None and entry.key == max_key, "lockstep broken"
                    assert self._running[slot] is None, "start on a running slot"
                    self._pending[slot] = None
                    self._running[slot] = entry
                    starts.append(entry)
            self._frozen = False
            self._cond.notify_all()
        return StepDecision(starts, releases)

    def abort_step(self) -> None:
        """The all-reduce failed: let gRPC-side calls proceed again."""
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    def finish(self, entry: Entry) -> None:
        """The engine ended a running request (same step on every rank)."""
        with self._cond:
            if self._running[entry.slot] is entry:
                self._end(entry.slot, entry)
                self._cond.notify_all()

    def drain(self) -> list[Entry]:
        """Remove every entry (shutdown); return the running ones. Pending ones are dropped."""
        with self._cond:
            running = [e for e in self._running if e is not None]
            pending = [e for e in self._pending if e is not None]
            self._running = [None] * self.num_slots
            self._pending = [None] * self.num_slots
            self._release = [False] * self.num_slots
            self._frozen = False
            self._cond.notify_all()
        for entry in pending:
            entry.drop("shutdown")
        return running

    # ---- internals -------------------------------------------------------------------------

    def _end(self, slot: int, entry: Entry) -> None:
        self._running[slot] = None
        self._release[slot] = False
        self._remember(slot, entry.request_id)

    def _remember(self, slot: int, request_id: str) -> None:
        self._tombstones[(slot, request_id)] = None
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)

    def _wait_unfrozen(self) -> None:
        while self._frozen:
            self._cond.wait()

    def _notify(self) -> None:
        self._changed = True
        self._cond.notify_all()

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} is out of range [0, {self.num_slots})")
