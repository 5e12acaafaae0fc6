"""Routing and the bounded queue, in plain Python: least loaded, FIFO, limits, health."""

import threading
import time

import pytest

from gateway.router import GroupState, Router
from protos.rpc import Cancelled, DeadlineExceeded, ResourceExhausted, Unavailable


def _router(slots=(2, 2), max_queue=2, healthy=True, **kw):
    groups = [GroupState(index=i, addresses=(f"h:{i}",), num_slots=n, healthy=healthy)
              for i, n in enumerate(slots)]
    return Router(groups, max_queue, **kw), groups


def test_least_loaded_group_gets_the_next_request():
    router, groups = _router(slots=(4, 4))
    picks = [router.acquire().index for _ in range(4)]
    assert picks == [0, 1, 0, 1]


def test_unhealthy_group_gets_no_requests_and_comes_back():
    router, groups = _router()
    router.set_health(groups[0], False, "down")
    assert {router.acquire().index for _ in range(2)} == {1}
    router.set_health(groups[0], True)
    assert router.acquire().index == 0


def test_no_healthy_group_is_unavailable_with_the_reason():
    router, groups = _router(healthy=False)
    for g in groups:
        g.reason = "rank 1 is not serving"
    with pytest.raises(Unavailable, match="rank 1 is not serving"):
        router.acquire()


def test_queue_beyond_max_queue_is_resource_exhausted():
    router, _ = _router(slots=(1,), max_queue=1)
    router.acquire()
    waiter = threading.Thread(target=lambda: router.acquire(deadline=time.monotonic() + 2))
    waiter.start()
    while router.queue_depth == 0:
        time.sleep(0.01)
    with pytest.raises(ResourceExhausted, match="--max-queue 1"):
        router.acquire()
    router.release(router.groups[0])
    waiter.join(2)
    assert not waiter.is_alive()


def test_queued_requests_are_served_in_arrival_order():
    router, groups = _router(slots=(1,), max_queue=8)
    router.acquire()
    order = []

    def wait(i):
        router.acquire(deadline=time.monotonic() + 5)
        order.append(i)
        router.release(groups[0])

    threads = []
    for i in range(4):
        t = threading.Thread(target=wait, args=(i,))
        t.start()
        threads.append(t)
        while router.queue_depth < i + 1:
            time.sleep(0.005)
    router.release(groups[0])
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3]


def test_deadline_expires_while_queued():
    router, _ = _router(slots=(1,))
    router.acquire()
    with pytest.raises(DeadlineExceeded):
        router.acquire(deadline=time.monotonic() + 0.1)
    assert router.queue_depth == 0


def test_cancelled_while_queued_leaves_the_queue():
    router, _ = _router(slots=(1,))
    router.acquire()
    with pytest.raises(Cancelled):
        router.acquire(is_active=lambda: False)
    assert router.queue_depth == 0


def test_group_that_said_full_is_skipped_until_backoff_or_a_release():
    router, groups = _router(slots=(2, 2), backoff_seconds=30)
    router.mark_full(groups[0])
    assert router.acquire().index == 1
    assert router.acquire().index == 1
    with pytest.raises(DeadlineExceeded):  # group 1 is full, group 0 still backing off
        router.acquire(deadline=time.monotonic() + 0.1)
    router.release(groups[1])  # frees group 1, not group 0's backoff
    assert router.acquire().index == 1


def test_release_without_a_worker_slot_keeps_the_backoff():
    router, groups = _router(slots=(2,), backoff_seconds=30)
    router.acquire()
    router.mark_full(groups[0])
    router.release(groups[0], freed_worker_slot=False)
    with pytest.raises(DeadlineExceeded):
        router.acquire(deadline=time.monotonic() + 0.1)


def test_excluded_group_is_not_used_for_a_retry():
    router, groups = _router()
    assert router.acquire(exclude=frozenset({0})).index == 1
    with pytest.raises(Unavailable):
        router.acquire(exclude=frozenset({0, 1}))


def test_on_change_reports_queue_depth_in_flight_and_healthy_groups():
    seen = []
    router, groups = _router(on_change=lambda *a: seen.append(a))
    router.acquire()
    assert seen[-1] == (0, 1, 2)
    router.set_health(groups[1], False)
    assert seen[-1] == (0, 1, 1)
