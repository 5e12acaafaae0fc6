"""One Generate request from slot to final message: admit on every rank, relay, release.

Every ending path (finished, stop string, client cancel, deadline, worker error) goes through
`Lease.release`, which sends Release to every rank and gives the router its slot back,
exactly once. The lease is also released from the gRPC done-callback, because a cancelled
stream's generator may never be resumed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from gateway.detokenizer import IncrementalDetokenizer, StopStringFilter
from gateway.router import GroupState, Router
from gateway.workers import GroupClient
from protos import common_pb2, gateway_pb2, worker_pb2
from protos.rpc import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

log = logging.getLogger(__name__)

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def service_error(exc: grpc.RpcError, what: str) -> ServiceError:
    """The ServiceError that carries a backend's status to our caller (UNAVAILABLE if odd)."""
    cls = _ERRORS.get(exc.code(), Unavailable)
    return cls(f"{what}: {exc.details()}" if cls is Unavailable else exc.details())


class _NotStarted(Exception):
    """The request produced no token on this group; it may go to another one."""

    def __init__(self, group_failed: bool):
        self.group_failed = group_failed


class Lease:
    """A router slot and (once admitted) a worker slot; `release` frees both, once."""

    def __init__(self, router: Router, client: GroupClient, request_id: str):
        self._router, self._client, self._request_id = router, client, request_id
        self._lock = threading.Lock()
        self._slot: int | None = None
        self._released = False
        self.call = None  # rank 0's Admit stream, cancelled on release

    def admitted(self, slot: int) -> None:
        with self._lock:
            self._slot = slot

    def release(self) -> None:
        """Release on every rank and return the router slot. Idempotent, thread-safe."""
        with self._lock:
            if self._released:
                return
            self._released = True
            slot = self._slot
        try:
            if slot is not None:
                self._client.release_all(slot, self._request_id)
            if self.call is not None:
                self.call.cancel()
        finally:
            self._router.release(self._client.state, freed_worker_slot=slot is not None)


@dataclass
class Job:
    """A validated request ready to run: what the workers get and what the gateway keeps."""

    admit: worker_pb2.AdmitRequest
    request_id: str  # as the client knows it (the worker's id may carry a suffix)
    kind: str
    stops: list[str]
    include_stop: bool
    schema: str | None
    arrived: float
    compile_seconds: float
    deadline: float | None  # time.monotonic()


@dataclass
class _Progress:
    text: list[str]
    tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class Runner:
    """Runs Jobs over the groups; shared by every request of a gateway."""

    def __init__(self, router: Router, clients: list[GroupClient],
                 token_bytes: Callable[[int], bytes], metrics, poke_health: Callable[[], None],
                 check_schema: Callable[[str, str], tuple[bool, str]]):
        self._router = router
        self._clients = {c.state.index: c for c in clients}
        self._token_bytes = token_bytes
        self._metrics = metrics
        self._poke_health = poke_health
        self._check_schema = check_schema

    def run(self, job: Job, context: grpc.ServicerContext) -> Iterator[gateway_pb2.GenerateResponse]:
        """Yield the request's deltas and final message; raise ServiceError on failure."""
        current: list[Lease] = []
        context.add_callback(lambda: current and current[-1].release())
        exclude: set[int] = set()
        retry = False
        while True:
            group = self._router.acquire(deadline=job.deadline, is_active=context.is_active,
                                         exclude=frozenset(exclude), retry=retry)
            queued = time.monotonic() - job.arrived
            lease = Lease(self._router, self._clients[group.index], job.admit.request_id)
            current.append(lease)
            try:
                yield from self._run_on(group, lease, job, context, queued)
                return
            except _NotStarted as exc:
                retry = True
                if exc.group_failed:
                    exclude.add(group.index)
            finally:
                lease.release()

    def _timeout(self, job: Job) -> float | None:
        if job.deadline is None:
            return None
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("the deadline expired")
        return left

    def _group_failed(self, group: GroupState, why: str) -> None:
        # The health monitor decides whether the group leaves rotation (a request-level
        # error can be transient); this request does not use the group again.
        log.warning("%s failed a request: %s", group.name, why)
        self._poke_health()

    def _start(self, group, lease, job, context):
        """Admit on rank 0, then on every other rank; return rank 0's event stream."""
        client = self._clients[group.index]
        call = client.stubs[0].Admit(job.admit, timeout=self._timeout(job))
        lease.call = call
        try:
            first = next(call)
        except grpc.RpcError as exc:
            self._raise_before_start(group, exc, context, "admit on rank 0")
        except StopIteration:
            self._group_failed(group, "rank 0 ended the Admit stream at once")
            raise _NotStarted(group_failed=True) from None
        if first.WhichOneof("event") != "admitted":
            raise Unavailable(f"rank 0 of {group.name} answered Admit without a slot")
        lease.admitted(first.admitted.slot)
        follower = worker_pb2.AdmitRequest()
        follower.CopyFrom(job.admit)
        follower.slot = first.admitted.slot
        try:
            client.admit_followers(follower, self._timeout(job))
        except grpc.RpcError as exc:
            self._raise_before_start(group, exc, context, "admit on a follower rank")
        return call

    def _raise_before_start(self, group, exc: grpc.RpcError, context, what: str):
        code = exc.code()
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._router.mark_full(group)  # another gateway holds its slots: wait our turn
            raise _NotStarted(group_failed=False)
        if not context.is_active():
            raise Cancelled("the client cancelled the request")
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            self._group_failed(group, f"{what} failed: {code.name}")
            raise _NotStarted(group_failed=True)
        raise service_error(exc, what)

    def _run_on(self, group, lease, job, context, queued):
        call = self._start(group, lease, job, context)
        detok = IncrementalDetokenizer(self._token_bytes)
        stop = StopStringFilter(job.stops, job.include_stop)
        progress = _Progress(text=[])
        try:
            for event in call:
                kind = event.WhichOneof("event")
                if kind == "tokens":
                    delta = self._on_tokens(event.tokens.token_ids, detok, stop, progress)
                    if delta is not None:
                        yield delta
                    if stop.stopped:
                        lease.release()
                        yield self._final(job, progress, queued, detok, stop,
                                          common_pb2.FINISH_REASON_STOP_STRING, "", None)
                        return
                elif kind == "finished":
                    fin = event.finished
                    if fin.reason == common_pb2.FINISH_REASON_ERROR_INTERNAL:
                        healthy, why, _ = self._clients[group.index].check("")
                        if not healthy:
                            self._router.set_health(group, False, why)
                            self._group_failed(group, why)
                            raise Unavailable(f"{group.name} failed during the request: "
                                              f"{fin.message or why}")
                    yield from self._tail(job, progress, queued, detok, stop, fin)
                    return
        except grpc.RpcError as exc:
            self._raise_mid_stream(group, exc, context, progress)
        self._group_failed(group, "rank 0 ended a stream without a finish")
        if progress.tokens == 0:
            raise _NotStarted(group_failed=True)
        raise Unavailable(f"{group.name} ended the request's stream without finishing it")

    def _raise_mid_stream(self, group, exc: grpc.RpcError, context, progress):
        code = exc.code()
        if not context.is_active():
            raise Cancelled("the client cancelled the request")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise DeadlineExceeded("the deadline expired during generation")
        self._group_failed(group, f"stream broke: {code.name}")
        if progress.tokens == 0:
            raise _NotStarted(group_failed=True)
        raise Unavailable(f"{group.name} failed after {progress.tokens} tokens were streamed "
                          f"({code.name}: {exc.details()}); not retried")

    def _on_tokens(self, ids, detok, stop, progress) -> gateway_pb2.GenerateResponse | None:
        now = time.monotonic()
        if progress.first_token_at is None:
            progress.first_token_at = now
        else:
            self._metrics.inter_token.observe(now - progress.last_token_at)
        progress.last_token_at = now
        progress.tokens += len(ids)
        text = stop.push(detok.push(ids))
        progress.text.append(text)
        if not text and not ids:
            return None
        return gateway_pb2.GenerateResponse(delta=gateway_pb2.Delta(text=text, token_ids=ids))

    def _tail(self, job, progress, queued, detok, stop, fin):
        rest = stop.push(detok.flush())
        rest += stop.flush()
        if rest:
            progress.text.append(rest)
            yield gateway_pb2.GenerateResponse(delta=gateway_pb2.Delta(text=rest))
        reason = fin.reason
        if stop.stopped:
            reason = common_pb2.FINISH_REASON_STOP_STRING
        yield self._final(job, progress, queued, detok, stop, reason, fin.message, fin.usage)

    def _final(self, job, progress, queued, detok, stop, reason, message, usage):
        text = "".join(progress.text)
        now = time.monotonic()
        if progress.first_token_at is not None:
            self._metrics.time_to_first_token.observe(progress.first_token_at - job.arrived)
        if job.kind != "none" and reason == common_pb2.FINISH_REASON_LENGTH:
            self._metrics.grammar_length_finish.inc()
        final = gateway_pb2.Final(
            finish_reason=reason, message=message, text=text,
            request_id=job.request_id, seed=job.admit.sampling.seed,
            usage=common_pb2.Usage(prompt_tokens=len(job.admit.prompt_token_ids),
                                   completion_tokens=progress.tokens),
            timings=gateway_pb2.Timings(
                queue_seconds=queued, compile_seconds=job.compile_seconds,
                time_to_first_token_seconds=(progress.first_token_at - job.arrived
                                             if progress.first_token_at else 0.0),
                total_seconds=now - job.arrived))
        if usage is not None and usage.completion_tokens:
            final.usage.CopyFrom(usage)
        if job.schema is not None:
            valid, why = self._check_schema(job.schema, text)
            final.schema_valid = valid
            final.schema_error = why
            if not valid:
                self._metrics.schema_invalid.inc()
        return gateway_pb2.GenerateResponse(final=final)
