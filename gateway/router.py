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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.rpc import DeadlineExceeded, ResourceExhausted, Unavailable


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
                 backoff_seconds: float = 0.05, unavailable_wait: float = 0.0,
                 on_change: Callable[[int, int, int], None] | None = None):
        if unavailable_wait < 0:
            raise ValueError(f"unavailable_wait must be >= 0, got {unavailable_wait}")
        self.groups = groups
        self.max_queue = max_queue
        self.backoff_seconds = backoff_seconds
        self.unavailable_wait = unavailable_wait
        # One (wake-up event, exclusions) per waiter, FIFO.
        self._queue: deque[tuple[asyncio.Event, frozenset]] = deque()
        self._on_change = on_change or (lambda *_: None)

    # -- requests -------------------------------------------------------------------------

    async def acquire(self, *, deadline: float | None = None,
                      exclude: frozenset[tuple[int, int]] = frozenset(),
                      retry: bool = False) -> GroupState:
        """Take a slot in the least-loaded healthy group, waiting in FIFO order if needed.

        `deadline` is a time.monotonic() value. `exclude` lists group incarnations
        ((index, generation), see GroupState.incarnation) not to use: they already failed
        this request. `retry` requests (sent back by a worker that was full, or after a
        group failed) skip the queue bound. Counts the slot as in use; give it back with
        `release`. Raises ResourceExhausted (queue full), Unavailable (no usable group, and
        none came back within `unavailable_wait`) or DeadlineExceeded; a cancelled caller
        leaves the queue.
        """
        # Straight to a group unless a waiter could take one now (it goes first); waiters
        # for groups that are down or excluded for them hold up nobody.
        waiting = any(self._pick(other) is not None for other in {e for _, e in self._queue})
        group = None if waiting else self._pick(exclude)
        if group is not None:
            return self._take(group)
        since = time.monotonic()
        self._check_available(exclude, since)
        if len(self._queue) >= self.max_queue and not retry:
            raise ResourceExhausted(
                f"every slot is busy and {len(self._queue)} requests are queued "
                f"(--max-queue {self.max_queue}); retry later")
        entry = (asyncio.Event(), exclude)
        self._queue.append(entry)
        self._changed()
        try:
            return await self._wait(entry, deadline, since)
        finally:
            self._queue.remove(entry)
            self._changed()
            self._wake_all()

    def release(self, group: GroupState, freed_worker_slot: bool = True) -> None:
        """Give back a slot taken with `acquire`; wakes the queue.

        `freed_worker_slot`: the request had held a worker slot, so the group has room
        again even if it had answered RESOURCE_EXHAUSTED.
        """
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

    def _take(self, group: GroupState) -> GroupState:
        group.in_use += 1
        self._changed()
        return group

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

    def _my_turn(self, entry) -> bool:
        """FIFO, except that a waiter no group can take now (its groups are down or
        excluded) does not hold up those behind it."""
        head = self._queue[0]
        if head is entry:
            return True
        if head[1] == entry[1]:  # the common case: the same groups as the head, which goes first
            return False
        blocked = set()  # exclusion sets of waiters ahead that no group can take now
        for ahead in self._queue:
            if ahead is entry:
                return True
            if ahead[1] not in blocked:
                if self._pick(ahead[1]) is not None:
                    return False
                blocked.add(ahead[1])
        return False

    async def _wait(self, entry, deadline, since: float) -> GroupState:
        wake, exclude = entry
        while True:
            wake.clear()
            if self._my_turn(entry):
                group = self._pick(exclude)
                if group is not None:
                    return self._take(group)
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
        for wake, _ in self._queue:
            wake.set()

    def _changed(self) -> None:
        self._on_change(len(self._queue), sum(g.in_use for g in self.groups),
                        sum(1 for g in self.groups if g.healthy))
