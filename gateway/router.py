"""Admission control: which worker group gets a request, and the bounded wait for a slot.

Plain Python and asyncio (no grpc, no torch). Free slots are tracked from this gateway's own
bookkeeping plus each group's Info; other gateways may share a group, so a group that
answers RESOURCE_EXHAUSTED is treated as full until one of our requests leaves it or
`backoff_seconds` pass.

Groups fail and come back (a supervisor restarts a group whose rank died). Each return to
rotation starts a new `generation` of the group; a request that failed on a group excludes
that group's generation only, so it may run on the same group once it has been restarted.
When no group is usable a request waits up to `unavailable_wait` seconds (within its
deadline) for one to come back, then fails with UNAVAILABLE naming every group's reason.

Per-client limits (a client is the identity its bearer token names, gateway/auth.py; "" when
authentication is off): at most `client_streams` requests of one client hold slots at once
(more wait in the queue, and other clients' requests pass them), and at most `client_queued`
of them wait; beyond that RESOURCE_EXHAUSTED with a retry hint. 0 means no limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.rpc import DeadlineExceeded, ResourceExhausted, Unavailable

# Seconds a refused client is told to wait before retrying (RESOURCE_EXHAUSTED).
RETRY_AFTER_SECONDS = 1.0


@dataclass(eq=False)
class _Waiter:
    """One queued request: its client, the group incarnations it excludes, its wake-up."""

    client: str
    exclude: frozenset = frozenset()
    wake: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class GroupState:
    """What the router knows about one TP group. Mutated only under the router's lock."""

    index: int
    addresses: tuple[str, ...]
    num_slots: int = 0
    healthy: bool = False
    in_use: int = 0
    full_until: float = 0.0
    reason: str = "not checked yet"
    max_model_len: int = 0
    generation: int = 0  # +1 each time the group comes (back) into rotation
    info: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"group{self.index}"

    @property
    def incarnation(self) -> tuple[int, int]:
        """(index, generation): what a failed request excludes."""
        return self.index, self.generation

    def has_room(self, now: float) -> bool:
        return self.healthy and self.in_use < self.num_slots and now >= self.full_until


class Router:
    """Least-loaded routing over healthy groups with a bounded FIFO wait queue.

    Runs on the gateway's event loop (every method is called from it; none blocks).
    `on_change(queue_depth, in_flight, healthy_groups)` is called whenever one of those
    numbers may have changed, for the metrics gauges.
    """

    def __init__(self, groups: list[GroupState], max_queue: int, *,
                 backoff_seconds: float = 0.05, client_streams: int = 0,
                 client_queued: int = 0, unavailable_wait: float = 0.0,
                 on_change: Callable[[int, int, int], None] | None = None):
        if unavailable_wait < 0:
            raise ValueError(f"unavailable_wait must be >= 0, got {unavailable_wait}")
        self.groups = groups
        self.max_queue = max_queue
        self.backoff_seconds = backoff_seconds
        self.client_streams = client_streams
        self.client_queued = client_queued
        self.unavailable_wait = unavailable_wait
        self._queue: deque[_Waiter] = deque()  # FIFO
        self._running: dict[str, int] = {}  # client -> router slots held
        self._waiting: dict[str, int] = {}  # client -> requests queued
        self._on_change = on_change or (lambda *_: None)

    # -- requests -------------------------------------------------------------------------

    async def acquire(self, *, deadline: float | None = None,
                      exclude: frozenset[tuple[int, int]] = frozenset(), retry: bool = False,
                      client: str = "") -> GroupState:
        """Take a slot in the least-loaded healthy group, waiting in FIFO order if needed.

        `deadline` is a time.monotonic() value. `exclude` lists group incarnations
        ((index, generation), see GroupState.incarnation) not to use: they already failed
        this request. `retry` requests (sent back by a worker that was full, or after a
        group failed) skip the queue bounds. `client` is the caller's identity for the
        per-client limits. Counts the slot as in use; give it back with `release` (same
        client). Raises ResourceExhausted (queue full, or this client's share of it, with a
        retry hint), Unavailable (no usable group, and none came back within
        `unavailable_wait`) or DeadlineExceeded; a cancelled caller leaves the queue.
        """
        # Straight to a group unless a waiter could take one now (it goes first); waiters
        # for groups that are down or excluded for them, or over their client's limit, hold
        # up nobody.
        if self._next_waiter() is None and self._under_stream_limit(client):
            group = self._pick(exclude)
            if group is not None:
                return self._take(group, client)
        since = time.monotonic()
        self._check_available(exclude, since)
        if not retry:
            self._check_queue_room(client)
        waiter = _Waiter(client, exclude)
        self._queue.append(waiter)
        self._waiting[client] = self._waiting.get(client, 0) + 1
        self._changed()
        try:
            return await self._wait(waiter, deadline, since)
        finally:
            self._queue.remove(waiter)
            self._count(self._waiting, client, -1)
            self._changed()
            self._wake_all()

    def release(self, group: GroupState, freed_worker_slot: bool = True,
                client: str = "") -> None:
        """Give back a slot taken with `acquire` by `client`; wakes the queue.

        `freed_worker_slot`: the request had held a worker slot, so the group has room
        again even if it had answered RESOURCE_EXHAUSTED.
        """
        self._count(self._running, client, -1)
        group.in_use -= 1
        if freed_worker_slot:
            group.full_until = 0.0
        self._changed()
        self._wake_all()

    def mark_full(self, group: GroupState) -> None:
        """The group's rank 0 said it has no free slot (another gateway took it)."""
        group.full_until = time.monotonic() + self.backoff_seconds

    # -- health ---------------------------------------------------------------------------

    def set_health(self, group: GroupState, healthy: bool, reason: str = "", *,
                   num_slots: int | None = None, max_model_len: int | None = None) -> None:
        """Take a group out of (or put it back into) rotation; wakes the queue. Coming back
        starts a new generation of the group."""
        if healthy and not group.healthy:
            group.generation += 1
        group.healthy = healthy
        group.reason = reason
        if num_slots is not None:
            group.num_slots = num_slots
        if max_model_len is not None:
            group.max_model_len = max_model_len
        self._changed()
        self._wake_all()

    def healthy_groups(self) -> list[GroupState]:
        return [g for g in self.groups if g.healthy]

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    # -- internals ------------------------------------------------------------------------

    def _pick(self, exclude: frozenset[tuple[int, int]]) -> GroupState | None:
        now = time.monotonic()
        candidates = [g for g in self.groups
                      if g.incarnation not in exclude and g.has_room(now)]
        if not candidates:
            return None
        return min(candidates, key=lambda g: (g.in_use / g.num_slots, g.in_use, g.index))

    def _take(self, group: GroupState, client: str) -> GroupState:
        group.in_use += 1
        self._count(self._running, client, 1)
        self._changed()
        return group

    @staticmethod
    def _count(counts: dict[str, int], client: str, delta: int) -> None:
        counts[client] = counts.get(client, 0) + delta
        if counts[client] <= 0:  # bounded by the clients with requests in the gateway
            del counts[client]

    def _under_stream_limit(self, client: str) -> bool:
        return not self.client_streams or self._running.get(client, 0) < self.client_streams

    def _next_waiter(self) -> _Waiter | None:
        """The first waiter that may start now: its client under its stream limit and a
        group with room that it does not exclude (FIFO among those)."""
        usable: dict[frozenset, bool] = {}
        for waiter in self._queue:
            if not self._under_stream_limit(waiter.client):
                continue
            ok = usable.get(waiter.exclude)
            if ok is None:
                ok = usable[waiter.exclude] = self._pick(waiter.exclude) is not None
            if ok:
                return waiter
        return None

    def _my_turn(self, waiter: _Waiter) -> bool:
        head = self._queue[0]
        if head is not waiter and head.exclude == waiter.exclude \
                and self._under_stream_limit(head.client):
            return False  # the common case, in O(1): the head goes first
        return self._next_waiter() is waiter

    def _check_queue_room(self, client: str) -> None:
        hint = f"; retry after {RETRY_AFTER_SECONDS:g} s"
        if len(self._queue) >= self.max_queue:
            raise ResourceExhausted(
                f"every slot is busy and {len(self._queue)} requests are queued "
                f"(--max-queue {self.max_queue}){hint}", retry_after=RETRY_AFTER_SECONDS)
        if self.client_queued and self._waiting.get(client, 0) >= self.client_queued:
            raise ResourceExhausted(
                f"client {client or '(anonymous)'} has {self._running.get(client, 0)} requests "
                f"running and {self._waiting[client]} queued (--client-max-queued "
                f"{self.client_queued}){hint}", retry_after=RETRY_AFTER_SECONDS)

    def _check_available(self, exclude: frozenset[tuple[int, int]], since: float) -> None:
        """Raise Unavailable unless a usable group is healthy, or the request has waited
        less than `unavailable_wait` for one: a group that is down may come back, and one
        that just failed this request may be about to go down and be restarted."""
        if any(g.healthy and g.incarnation not in exclude for g in self.groups):
            return
        if time.monotonic() - since < self.unavailable_wait:
            return
        bad = "; ".join(f"{g.name}: {g.reason if not g.healthy else 'failed this request'}"
                        for g in self.groups)
        waited = f" after waiting {self.unavailable_wait:g} s for one to come back" \
            if self.unavailable_wait else ""
        raise Unavailable(f"no healthy worker group{waited} ({bad})")

    async def _wait(self, waiter: _Waiter, deadline, since: float) -> GroupState:
        wake, exclude = waiter.wake, waiter.exclude
        while True:
            wake.clear()
            if self._my_turn(waiter):
                group = self._pick(exclude)
                if group is not None:
                    return self._take(group, waiter.client)
            self._check_available(exclude, since)
            # Woken by releases and health changes; the short timeout covers backoffs ending.
            timeout = self.backoff_seconds
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    if not any(g.healthy and g.incarnation not in exclude for g in self.groups):
                        raise DeadlineExceeded(
                            "the deadline expired while waiting for a worker group to come "
                            "back (" + "; ".join(f"{g.name}: {g.reason}" for g in self.groups
                                                 if not g.healthy) + ")")
                    raise DeadlineExceeded("the deadline expired while queued for a slot")
                timeout = min(timeout, left)
            try:
                await asyncio.wait_for(wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def _wake_all(self) -> None:
        for waiter in self._queue:
            waiter.wake.set()

    def _changed(self) -> None:
        self._on_change(len(self._queue), sum(g.in_use for g in self.groups),
                        sum(1 for g in self.groups if g.healthy))
