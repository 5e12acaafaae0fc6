"""The compile lanes' wait queue (grammar_service/compile_queue.py) in plain Python threads:
fair between clients, smallest spec first, deadlines respected while waiting."""

import threading
import time

import pytest

from grammar_service.compile_queue import FairQueue
from protos.rpc import DeadlineExceeded


def _queue(n: int):
    free = list(range(n))
    return FairQueue(lambda: free.pop() if free else None, free.append)


def _start(q, order, name, client, size, deadline=None):
    def run():
        try:
            r = q.acquire(client, size, deadline)
        except DeadlineExceeded:
            order.append((name, "expired"))
            return
        order.append(name)
        q.release(r)
    t = threading.Thread(target=run)
    t.start()
    return t


def _until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_burst_from_one_client_does_not_starve_another_client():
    q, order = _queue(1), []
    held = q.acquire("bursty", 1, None)
    threads = [_start(q, order, f"bursty-{i}", "bursty", 1) for i in range(3)]
    _until(lambda: len(q) == 3)
    threads.append(_start(q, order, "other", "other", 1))
    _until(lambda: len(q) == 4)
    q.release(held)
    for t in threads:
        t.join(5)
    assert order[0] == "other" and sorted(order[1:]) == ["bursty-0", "bursty-1", "bursty-2"]


def test_smaller_specs_of_a_client_go_first():
    q, order = _queue(1), []
    held = q.acquire("c", 1, None)
    threads = []
    for name, size in (("large", 50_000), ("small", 10), ("medium", 900)):
        threads.append(_start(q, order, name, "c", size))
        _until(lambda count=len(threads): len(q) == count)  # noqa: B008
    q.release(held)
    for t in threads:
        t.join(5)
    assert order == ["small", "medium", "large"]


def test_a_job_whose_deadline_passes_while_waiting_leaves_the_queue():
    q = _queue(1)
    held = q.acquire("c", 1, None)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="deadline passed"):
        q.acquire("d", 1, time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 1.0 and len(q) == 0
    q.release(held)
    assert q.acquire("e", 1, time.monotonic() + 1) == 0  # the resource is free again


def test_closing_fails_the_waiting_jobs():
    from protos.rpc import Unavailable

    q = _queue(1)
    q.acquire("c", 1, None)
    errors = []

    def wait():
        try:
            q.acquire("d", 1, None)
        except Unavailable as exc:
            errors.append(exc)
    t = threading.Thread(target=wait)
    t.start()
    _until(lambda: len(q) == 1)
    q.close()
    t.join(5)
    assert len(errors) == 1 and len(q) == 0
