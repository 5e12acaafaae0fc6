"""Who compiles next: the wait queue of one compile lane, fair between clients.

Plain Python (no processes, no grpc). A job waits until it is the lane's next pick and a
compile process of the lane is free. The pick: among the clients with jobs waiting, the one
served least recently (so one client's burst of compiles cannot starve another client's
single compile), and among that client's jobs the smallest spec, oldest first on a tie.
A job whose own deadline passes while it waits leaves the queue with DeadlineExceeded; it
never holds a compile process it can no longer use.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from protos.rpc import DeadlineExceeded, Unavailable


@dataclass(eq=False)
class Job:
    """One compile waiting for a process. `deadline` is a time.monotonic() value or None."""

    client: str
    size: int
    deadline: float | None
    seq: int = 0
    arrived: float = field(default_factory=time.monotonic)


class FairQueue:
    """Waiting jobs of one lane and the resource they wait for.

    `take()` returns the resource a job may run on (or None when none is free); `give(r)`
    puts one back. Both run under the queue's lock.
    """

    def __init__(self, take: Callable[[], object | None], give: Callable[[object], None]):
        self._take, self._give = take, give
        self._cond = threading.Condition()
        self._waiting: list[Job] = []
        self._served: dict[str, int] = {}  # client -> turn of its last pick (bounded below)
        self._turns = itertools.count(1)
        self._seq = itertools.count()
        self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._waiting)

    def acquire(self, client: str, size: int, deadline: float | None) -> object:
        """Wait for this job's turn and a free resource; return the resource.

        Raises DeadlineExceeded when `deadline` passes first (the job leaves the queue), and
        Unavailable once the queue is closed.
        """
        job = Job(client, size, deadline, next(self._seq))
        with self._cond:
            self._waiting.append(job)
            try:
                while True:
                    if self._closed:
                        raise Unavailable("the compile pool is shut down")
                    if self._next() is job:
                        resource = self._take()
                        if resource is not None:
                            self._waiting.remove(job)
                            self._served[client] = next(self._turns)
                            self._forget_idle_clients()
                            self._cond.notify_all()  # the next job may be pickable now
                            return resource
                    timeout = None
                    if deadline is not None:
                        timeout = deadline - time.monotonic()
                        if timeout <= 0:
                            raise DeadlineExceeded(
                                f"the compile waited {time.monotonic() - job.arrived:.1f} s "
                                "for a compile process and its deadline passed")
                    self._cond.wait(timeout)
            except BaseException:
                if job in self._waiting:
                    self._waiting.remove(job)
                    self._cond.notify_all()
                raise

    def release(self, resource: object) -> None:
        """Give back a resource taken by `acquire` (or a replacement of it); wakes waiters."""
        with self._cond:
            self._give(resource)
            self._cond.notify_all()

    def update(self, change: Callable[[], None]) -> None:
        """Run `change` (to the resources, e.g. a new one) under the queue's lock; wake
        waiters."""
        with self._cond:
            change()
            self._cond.notify_all()

    def close(self) -> None:
        """Fail every waiting job (and later ones) with Unavailable."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next(self) -> Job | None:
        if not self._waiting:
            return None
        clients = {j.client for j in self._waiting}
        client = min(clients, key=lambda c: self._served.get(c, 0))
        return min((j for j in self._waiting if j.client == client),
                   key=lambda j: (j.size, j.seq))

    def _forget_idle_clients(self) -> None:
        # Only the order among clients with jobs matters; keep the map as small as the queue
        # plus the recently served.
        if len(self._served) > 4 * (len(self._waiting) + 16):
            keep = {j.client for j in self._waiting}
            recent = sorted(self._served.items(), key=lambda kv: kv[1])[-16:]
            self._served = {c: t for c, t in self._served.items() if c in keep}
            self._served.update(recent)
