"""The gateway's links to the worker groups, and the health monitor that takes groups out and
back. Everything here runs on the gateway's event loop.

Each rank of a group has one channel and one long-lived `Session` stream (worker.proto): the
gateway writes admissions and releases into it; the rank answers every admission, and rank 0
sends one StepUpdate per step with the new tokens of all of this gateway's rows. A `RankLink`
demultiplexes those messages to the waiting requests by tag, so the cost of a running request
is one queue put per step, with no thread and no stream of its own. Health: a group is in
rotation when every rank answers the gRPC health check SERVING and rank 0's Info says
`serving`, with the gateway's vocabulary.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.router import GroupState, Router
from protos import worker_pb2, worker_pb2_grpc
from protos.rpc import aio_channel

log = logging.getLogger(__name__)

_CHECK_TIMEOUT = 2.0
# What a request's queue receives when its rank's stream broke.
BROKEN = object()


class AdmitFailed(Exception):
    """A rank refused an admission (`code` a grpc.StatusCode), or its stream broke."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RankLink:
    """The Session stream to one rank, opened on first use and again after it broke."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, name: str):
        self._stub = stub
        self.name = name
        self._call = None
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._tags = itertools.count(1)
        self._admits: dict[int, asyncio.Future] = {}
        self._rows: dict[int, asyncio.Queue] = {}
        self._abandoned: dict[int, str] = {}  # tag -> request id of admissions given up on

    def _ensure_open(self) -> None:
        # grpc.aio allows one write at a time on a stream: every message goes through one
        # writer task, in order.
        if self._call is None:
            self._call = call = self._stub.Session()
            self._outbox = outbox = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._read(call)),
                           loop.create_task(self._write(call, outbox))]

    async def admit(self, req: worker_pb2.AdmitRequest, rows: asyncio.Queue | None,
                    timeout: float | None) -> tuple[int, int]:
        """Send an admission; return (tag, slot). `rows` (rank 0) receives the request's
        RowUpdates, then nothing, or BROKEN when the stream broke. Raises AdmitFailed."""
        self._ensure_open()
        tag = next(self._tags)
        msg = worker_pb2.AdmitRequest()
        msg.CopyFrom(req)
        msg.tag = tag
        future = asyncio.get_running_loop().create_future()
        self._admits[tag] = future
        if rows is not None:
            self._rows[tag] = rows
        self._outbox.put_nowait(worker_pb2.SessionRequest(admit=msg))
        try:
            result = await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            self._rows.pop(tag, None)
            self._abandoned[tag] = req.request_id  # released if its answer still comes
            raise AdmitFailed(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"{self.name} did not answer the admission in time") from None
        except asyncio.CancelledError:
            # The request was cancelled (client gone, deadline) while its admission was on
            # the way: whatever slot the rank gives it must be released, now or on arrival.
            self._rows.pop(tag, None)
            if future.done() and future.exception() is None and future.result().code == 0:
                self.release(future.result().slot, req.request_id)
            elif not future.done():
                self._abandoned[tag] = req.request_id
            raise
        finally:
            self._admits.pop(tag, None)
        if result.code != 0:
            self._rows.pop(tag, None)
            raise AdmitFailed(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.message)
        return tag, result.slot

    def forget(self, tag: int) -> None:
        """Stop routing a request's rows (it ended)."""
        self._rows.pop(tag, None)

    def release(self, slot: int, request_id: str) -> None:
        """Queue a Release on this rank's stream (fire and forget; never blocks). Without a
        stream there is nothing to do: a rank releases a closed session's requests itself."""
        if self._outbox is not None:
            self._outbox.put_nowait(worker_pb2.SessionRequest(
                release=worker_pb2.ReleaseRequest(slot=slot, request_id=request_id)))

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        try:
            while True:
                await call.write(await outbox.get())
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            log.warning("writing to %s failed: %s", self.name, exc)
            call.cancel()  # the reader sees the end and fails what waits

    async def _read(self, call) -> None:
        try:
            async for event in call:
                if event.HasField("step"):
                    for row in event.step.rows:
                        queue = self._rows.get(row.tag)
                        if queue is not None:
                            queue.put_nowait(row)
                            if row.HasField("finished"):
                                del self._rows[row.tag]
                else:
                    result = event.admitted
                    future = self._admits.get(result.tag)
                    if future is not None and not future.done():
                        future.set_result(result)
                    elif result.tag in self._abandoned:
                        request_id = self._abandoned.pop(result.tag)
                        if result.code == 0:
                            self.release(result.slot, request_id)
            log.warning("stream to %s ended by the rank", self.name)
        except grpc.RpcError as exc:
            log.warning("stream to %s broke: %s", self.name, exc.code().name)
        except asyncio.CancelledError:
            pass
        finally:
            if self._call is call:
                self._call = self._outbox = None
                for task in self._tasks:
                    if task is not asyncio.current_task():
                        task.cancel()
            self._fail_waiting(f"the stream to {self.name} ended")

    def _fail_waiting(self, why: str) -> None:
        # A rank releases a closed session's requests itself: nothing abandoned is left.
        self._abandoned.clear()
        for future in self._admits.values():
            if not future.done():
                future.set_exception(AdmitFailed(grpc.StatusCode.UNAVAILABLE, why))
        rows, self._rows = self._rows, {}
        for queue in rows.values():
            queue.put_nowait(BROKEN)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class GroupClient:
    """Channels, health stubs and Session links for every rank of one group."""

    def __init__(self, state: GroupState, tls_ca: bytes | None,
                 tls_identity: tuple[bytes, bytes] | None = None):
        self.state = state
        self._channels = [aio_channel(a, tls_ca=tls_ca, tls_identity=tls_identity)
                          for a in state.addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self.links = [RankLink(stub, f"{state.name} rank {r}") for r, stub in enumerate(self.stubs)]

    async def check(self, fingerprint: str) -> tuple[bool, str, worker_pb2.WorkerInfo | None]:
        """(healthy, reason, rank 0's Info) from one round of checks on every rank."""
        try:
            answers = await asyncio.gather(*(
                stub.Check(health_pb2.HealthCheckRequest(), timeout=_CHECK_TIMEOUT)
                for stub in self._health))
            for rank, resp in enumerate(answers):
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    return False, f"rank {rank} is not serving", None
            info = await self.stubs[0].Info(worker_pb2.InfoRequest(), timeout=_CHECK_TIMEOUT)
        except grpc.RpcError as exc:
            return False, f"health check failed: {exc.code().name}", None
        if not info.serving:
            return False, "rank 0 says it is not serving", info
        if info.tp_size != len(self.stubs):
            return False, f"configured with {len(self.stubs)} ranks, tp_size is {info.tp_size}", info
        if fingerprint and info.vocab_fingerprint != fingerprint:
            return False, "vocabulary fingerprint differs from the gateway's model", info
        return True, "", info

    def release_all(self, slot: int, request_id: str) -> None:
        """Release (slot, request_id) on every rank; never blocks."""
        for link in self.links:
            link.release(slot, request_id)

    async def close(self) -> None:
        for link in self.links:
            await link.close()
        for c in self._channels:
            await c.close()


class HealthMonitor:
    """A task that checks every group each `interval` seconds (sooner when poked).

    `also` are further checks run in the same round (the grammar service's); `on_checked`
    is awaited after each round, once the router has every group's result."""

    def __init__(self, router: Router, clients: list[GroupClient], fingerprint: str,
                 interval: float, also: Sequence[Callable[[], Awaitable[object]]] = (),
                 on_checked: Callable[[], Awaitable[None]] | None = None):
        self._router = router
        self._clients = clients
        self._fingerprint = fingerprint
        self._interval = interval
        self._also = list(also)
        self._on_checked = on_checked
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.get_running_loop().create_task(self._run())

    def poke(self) -> None:
        """Check again now (a request just saw a group fail)."""
        self._poke.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def check_all(self) -> None:
        """One round of checks (groups and `also` in parallel); updates the router."""
        results, _ = await asyncio.gather(
            asyncio.gather(*(c.check(self._fingerprint) for c in self._clients)),
            asyncio.gather(*(check() for check in self._also)))
        for client, (ok, reason, info) in zip(self._clients, results, strict=True):
            state = client.state
            if ok != state.healthy:
                log.warning("%s (%s) is %s%s", state.name, ",".join(state.addresses),
                            "in rotation" if ok else "out of rotation",
                            f": {reason}" if reason else "")
            self._router.set_health(
                state, ok, reason,
                num_slots=info.num_slots if info is not None else None,
                max_model_len=info.max_model_len if info is not None else None)
        if self._on_checked is not None:
            await self._on_checked()

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._poke.wait(), self._interval)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()
            await self.check_all()
