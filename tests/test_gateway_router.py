"""Routing and the bounded queue, in plain Python on an event loop: least loaded, FIFO,
limits, health, cancellation."""

import asyncio
import time

import pytest

from gateway.router import GroupState, Router
from protos.rpc import DeadlineExceeded, ResourceExhausted, Unavailable


def _router(slots=(2, 2), max_queue=2, healthy=True, **kw):
    groups = [GroupState(index=i, addresses=(f"h:{i}",), num_slots=n, healthy=healthy)
              for i, n in enumerate(slots)]
    return Router(groups, max_queue, **kw), groups


def run(coro):
    return asyncio.run(coro)


async def _until(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def test_least_loaded_group_gets_the_next_request():
    async def main():
        router, _ = _router(slots=(4, 4))
        return [(await router.acquire()).index for _ in range(4)]
    assert run(main()) == [0, 1, 0, 1]


def test_unhealthy_group_gets_no_requests_and_comes_back():
    async def main():
        router, groups = _router()
        router.set_health(groups[0], False, "down")
        assert {(await router.acquire()).index for _ in range(2)} == {1}
        router.set_health(groups[0], True)
        assert (await router.acquire()).index == 0
    run(main())


def test_no_healthy_group_is_unavailable_with_the_reason():
    async def main():
        router, groups = _router(healthy=False)
        for g in groups:
            g.reason = "rank 1 is not serving"
        with pytest.raises(Unavailable, match="rank 1 is not serving"):
            await router.acquire()
    run(main())


def test_queue_beyond_max_queue_is_resource_exhausted():
    async def main():
        router, groups = _router(slots=(1,), max_queue=1)
        await router.acquire()
        waiter = asyncio.create_task(router.acquire(deadline=time.monotonic() + 2))
        await _until(lambda: router.queue_depth == 1)
        with pytest.raises(ResourceExhausted, match="--max-queue 1"):
            await router.acquire()
        router.release(groups[0])
        assert (await asyncio.wait_for(waiter, 2)).index == 0
    run(main())


def test_queued_requests_are_served_in_arrival_order():
    async def main():
        router, groups = _router(slots=(1,), max_queue=300)
        await router.acquire()
        order = []

        async def wait(i):
            await router.acquire(deadline=time.monotonic() + 10)
            order.append(i)
            await asyncio.sleep(0)
            router.release(groups[0])

        tasks = []
        for i in range(256):  # more waiters than any pool or default
            tasks.append(asyncio.create_task(wait(i)))
            await _until(lambda i=i: router.queue_depth == i + 1)
        router.release(groups[0])
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return order
    assert run(main()) == list(range(256))


def test_deadline_expires_while_queued():
    async def main():
        router, _ = _router(slots=(1,))
        await router.acquire()
        with pytest.raises(DeadlineExceeded):
            await router.acquire(deadline=time.monotonic() + 0.1)
        assert router.queue_depth == 0
    run(main())


def test_cancelled_while_queued_leaves_the_queue_and_wakes_the_next():
    async def main():
        router, groups = _router(slots=(1,), max_queue=4)
        await router.acquire()
        first = asyncio.create_task(router.acquire())
        second = asyncio.create_task(router.acquire())
        await _until(lambda: router.queue_depth == 2)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert router.queue_depth == 1
        router.release(groups[0])
        assert (await asyncio.wait_for(second, 2)).index == 0
        assert router.queue_depth == 0
    run(main())


def test_group_that_said_full_is_skipped_until_backoff_or_a_release():
    async def main():
        router, groups = _router(slots=(2, 2), backoff_seconds=30)
        router.mark_full(groups[0])
        assert (await router.acquire()).index == 1
        assert (await router.acquire()).index == 1
        with pytest.raises(DeadlineExceeded):  # group 1 is full, group 0 still backing off
            await router.acquire(deadline=time.monotonic() + 0.1)
        router.release(groups[1])  # frees group 1, not group 0's backoff
        assert (await router.acquire()).index == 1
    run(main())


def test_release_without_a_worker_slot_keeps_the_backoff():
    async def main():
        router, groups = _router(slots=(2,), backoff_seconds=30)
        await router.acquire()
        router.mark_full(groups[0])
        router.release(groups[0], freed_worker_slot=False)
        with pytest.raises(DeadlineExceeded):
            await router.acquire(deadline=time.monotonic() + 0.1)
    run(main())


def test_excluded_group_is_not_used_for_a_retry():
    async def main():
        router, groups = _router()
        assert (await router.acquire(exclude=frozenset({groups[0].incarnation}))).index == 1
        with pytest.raises(Unavailable):
            await router.acquire(exclude=frozenset(g.incarnation for g in groups))
    run(main())


def test_group_that_failed_a_request_takes_it_again_once_restarted():
    async def main():
        router, groups = _router(slots=(2,))
        failed = frozenset({groups[0].incarnation})
        with pytest.raises(Unavailable):
            await router.acquire(exclude=failed)
        router.set_health(groups[0], False, "rank 1 is not serving")
        router.set_health(groups[0], True)  # restarted: a new generation
        assert (await router.acquire(exclude=failed)).index == 0
    run(main())


def test_request_waits_for_a_restarting_group_within_unavailable_wait():
    async def main():
        router, groups = _router(slots=(2,), healthy=False, unavailable_wait=5.0)
        waiter = asyncio.ensure_future(router.acquire(deadline=time.monotonic() + 5))
        await asyncio.sleep(0.2)
        assert not waiter.done() and router.queue_depth == 1
        router.set_health(groups[0], True)
        assert (await asyncio.wait_for(waiter, 2)).index == 0
    run(main())


def test_no_group_back_within_unavailable_wait_is_unavailable_with_the_reason():
    async def main():
        router, groups = _router(slots=(2,), healthy=False, unavailable_wait=0.3)
        groups[0].reason = "health check failed: UNAVAILABLE"
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="after waiting 0.3 s.*health check failed"):
            await router.acquire()
        assert 0.25 < time.monotonic() - t0 < 2
    run(main())


def test_deadline_while_waiting_for_a_group_says_which_groups_are_down():
    async def main():
        router, groups = _router(slots=(2,), healthy=False, unavailable_wait=10)
        groups[0].reason = "rank 0 is not serving"
        with pytest.raises(DeadlineExceeded, match="come back.*rank 0 is not serving"):
            await router.acquire(deadline=time.monotonic() + 0.2)
    run(main())


def test_waiter_no_group_can_take_does_not_hold_up_the_queue():
    async def main():
        router, groups = _router(slots=(1, 1), unavailable_wait=10)
        await router.acquire()  # group 0 full
        await router.acquire()  # group 1 full
        # The head waiter failed on group 1 and waits; the next may take group 1's slot.
        head = asyncio.ensure_future(router.acquire(exclude=frozenset({groups[1].incarnation})))
        await asyncio.sleep(0.05)
        nxt = asyncio.ensure_future(router.acquire())
        await asyncio.sleep(0.05)
        router.release(groups[1])
        assert (await asyncio.wait_for(nxt, 2)).index == 1
        assert not head.done()
        router.release(groups[0])
        assert (await asyncio.wait_for(head, 2)).index == 0
    run(main())


def test_on_change_reports_queue_depth_in_flight_and_healthy_groups():
    async def main():
        seen = []
        router, groups = _router(on_change=lambda *a: seen.append(a))
        await router.acquire()
        assert seen[-1] == (0, 1, 2)
        router.set_health(groups[1], False)
        assert seen[-1] == (0, 1, 1)
    run(main())


def test_client_at_its_stream_limit_waits_while_other_clients_pass_it():
    async def main():
        router, groups = _router(slots=(3,), max_queue=8, client_streams=1)
        first = await router.acquire(client="a")
        second = asyncio.ensure_future(router.acquire(client="a"))  # a's limit: queued
        await _until(lambda: router.queue_depth == 1)
        # b is behind a's waiter in the queue yet starts at once: a may not run two.
        assert (await asyncio.wait_for(router.acquire(client="b"), 1.0)) is groups[0]
        assert not second.done()
        router.release(first, client="a")
        assert (await asyncio.wait_for(second, 1.0)) is groups[0]
        assert groups[0].in_use == 2
    run(main())


def test_client_beyond_its_queue_share_is_resource_exhausted_with_a_retry_hint():
    async def main():
        router, _ = _router(slots=(1,), max_queue=8, client_queued=1)
        await router.acquire(client="a")
        waiting = asyncio.ensure_future(router.acquire(client="a"))
        await _until(lambda: router.queue_depth == 1)
        with pytest.raises(ResourceExhausted, match="client a .* queued") as info:
            await router.acquire(client="a")
        assert info.value.retry_after and "retry after" in str(info.value)
        other = asyncio.ensure_future(router.acquire(client="b"))  # b's share is untouched
        await _until(lambda: router.queue_depth == 2)
        waiting.cancel()
        other.cancel()
        await asyncio.gather(waiting, other, return_exceptions=True)
        assert router.queue_depth == 0 and not router._waiting
    run(main())


def test_queue_full_carries_a_retry_hint():
    async def main():
        router, _ = _router(slots=(1,), max_queue=0)
        await router.acquire()
        with pytest.raises(ResourceExhausted) as info:
            await router.acquire()
        assert info.value.retry_after == 1.0
    run(main())


def test_waiters_for_a_down_group_do_not_fill_the_queue_for_requests_a_group_can_take():
    async def main():
        router, groups = _router(slots=(2, 2), max_queue=1, unavailable_wait=10)
        router.set_health(groups[0], False, "restarting")
        # A request that already failed on group 1 waits for group 0 to come back ...
        waiter = asyncio.ensure_future(router.acquire(exclude=frozenset({groups[1].incarnation})))
        await _until(lambda: router.queue_depth == 1)
        # ... and a full queue does not refuse a request that group 1 can take now.
        assert (await router.acquire()).index == 1
        router.set_health(groups[0], True)
        assert (await asyncio.wait_for(waiter, 2)).index == 0
    run(main())


def test_retry_waits_for_the_group_that_just_failed_it_to_be_restarted():
    # The request's retry can come before the health checks mark its group down.
    async def main():
        router, groups = _router(slots=(2,), unavailable_wait=10)
        failed = frozenset({groups[0].incarnation})
        waiter = asyncio.ensure_future(router.acquire(exclude=failed, retry=True))
        await _until(lambda: router.queue_depth == 1)
        router.set_health(groups[0], False, "health check failed: UNAVAILABLE")
        await asyncio.sleep(0.1)
        assert not waiter.done()
        router.set_health(groups[0], True)
        assert (await asyncio.wait_for(waiter, 2)).index == 0
    run(main())
