"""Several choices of one request (`n` > 1), running concurrently through the one request
path (`GatewayServicer.generate`), their events on one queue.

Both APIs use it: the gRPC `Generate` with `n`, and the OpenAI API's `n`. Each choice is its
own request (its own slot and matcher, I1); with a seed, choice i uses seed + i.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protos import gateway_pb2

MAX_N = 16


def choice_requests(request: gateway_pb2.GenerateRequest, n: int) -> list:
    """`n` copies of `request` with n = 1, choice i's seed (when one is set) seed + i."""
    out = []
    for i in range(n):
        r = gateway_pb2.GenerateRequest()
        r.CopyFrom(request)
        r.n = 1
        if request.sampling.HasField("seed"):
            r.sampling.seed = (request.sampling.seed + i) % 2**64
        out.append(r)
    return out


class Fanout:
    """The choices' events, in arrival order, as (index, GenerateResponse or Exception).

    Each choice's generator is drained by its own task from the start, so a choice waiting
    for a slot never waits on another choice that is not being read.
    """

    def __init__(self, servicer, requests: list, timeout: float | None, client: str = ""):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.create_task(self._pump(i, servicer, r, timeout, client))
                       for i, r in enumerate(requests)]

    async def _pump(self, i: int, servicer, request, timeout, client) -> None:
        try:
            async for event in servicer.generate(request, timeout, client=client):
                self._queue.put_nowait((i, event))
        except Exception as exc:  # the reader decides what the request's answer is
            self._queue.put_nowait((i, exc))

    async def next(self) -> tuple[int, gateway_pb2.GenerateResponse | Exception]:
        return await self._queue.get()

    async def close(self) -> None:
        """Cancel every choice still running (their slots are released) and wait."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def merged(servicer, requests: list, timeout: float | None,
                 client: str = "") -> AsyncIterator[gateway_pb2.GenerateResponse]:
    """Every choice's events with `index` set, until each has sent its Final; the first
    failure of any choice is raised (the others are cancelled, their slots released).
    `client` is the caller's identity, as GatewayServicer.generate takes it."""
    fan = Fanout(servicer, requests, timeout, client)
    left = len(requests)
    try:
        while left:
            i, event = await fan.next()
            if isinstance(event, Exception):
                raise event
            event.index = i
            if event.HasField("final"):
                left -= 1
            yield event
    finally:
        await fan.close()
