"""One Generate request from slot to final message: admit on every rank, relay, release.

Runs on the gateway's event loop. The request's tokens arrive as RowUpdates that the rank-0
link puts on the request's own queue (one put per step, never a thread); each wake-up drains
everything queued, so a slow client gets fewer, larger deltas instead of a backlog.
Every ending path (finished, stop string, client cancel, deadline, worker error) goes through
`Lease.release`, which queues Release to every rank and gives the router its slot back,
exactly once and without awaiting, so it also runs when the handler task is cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from gateway.detokenizer import IncrementalDetokenizer, StopStringFilter
from gateway.router import GroupState, Router
from gateway.workers import BROKEN, AdmitFailed, GroupClient
from protos import common_pb2, gateway_pb2, worker_pb2
from protos.rpc import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)

log = logging.getLogger(__name__)

_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
}
# A rank that answers with one of these has a problem of its own: try another group.
_GROUP_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                   grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# Finished.code of a request that could not run for a reason of the group.
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
# A follower rank refusing rank 0's slot (FAILED_PRECONDITION on field `slot`) is a benign
# race: the slot's previous tenant has not left that rank yet, or the rank already saw this
# admission released. The request never ran; it is admitted again, at most this many times.
_MAX_RACE_RETRIES = 3


def service_error(code: grpc.StatusCode, details: str, what: str) -> ServiceError:
    """The ServiceError that carries a backend's status to our caller (UNAVAILABLE if odd)."""
    cls = _ERRORS.get(code, Unavailable)
    return cls(f"{what}: {details}" if cls is Unavailable else details)


class _NotStarted(Exception):
    """The request produced no token on this group; it may go to another one. `race`: the
    message of a slot-reuse race that refused it (retried a bounded number of times)."""

    def __init__(self, group_failed: bool, race: str = ""):
        self.group_failed = group_failed
        self.race = race


class Lease:
    """A router slot and (once admitted) a worker slot; `release` frees both, once."""

    def __init__(self, router: Router, client: GroupClient, request_id: str, caller: str = ""):
        self._router, self._client, self._request_id = router, client, request_id
        self._caller = caller  # the client identity the router counts the slot against
        self._slot: int | None = None
        self._released = False
        self.tag: int | None = None  # rank 0's tag for the request

    def admitted(self, slot: int) -> None:
        self._slot = slot

    def release(self) -> None:
        """Queue Release on every rank and return the router slot. Idempotent; never
        awaits, so it completes even inside a cancelled task."""
        if self._released:
            return
        self._released = True
        if self.tag is not None:
            self._client.links[0].forget(self.tag)
        if self._slot is not None:
            self._client.release_all(self._slot, self._request_id)
        self._router.release(self._client.state, freed_worker_slot=self._slot is not None,
                             client=self._caller)


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
    echo_prompt: bool = False  # return the prompt ids in the final message
    client: str = ""  # the caller's identity (bearer token), for the per-client limits


@dataclass
class _Progress:
    text: list[str]
    logprobs: list = field(default_factory=list)  # common_pb2.TokenLogprob, when asked
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

    async def run(self, job: Job) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Yield the request's deltas and final message; raise ServiceError on failure.

        A request that produced no token is tried again: on another group (or the same
        group once restarted) when its group failed, on any group after a full group or a
        slot-reuse race (at most `_MAX_RACE_RETRIES` of those), always within its deadline.
        """
        exclude: set[tuple[int, int]] = set()
        retry = False
        races = 0
        base_id = job.admit.request_id
        for attempt in itertools.count():
            if races:  # give the lagging rank a moment to apply the release it is behind on
                await asyncio.sleep(min(0.05 * 2 ** races, self._timeout(job) or 1.0))
            group = await self._router.acquire(deadline=job.deadline,
                                               exclude=frozenset(exclude), retry=retry,
                                               client=job.client)
            queued = time.monotonic() - job.arrived
            # A fresh worker id per attempt: ranks remember released (slot, id) pairs, so a
            # retry under the old id could be refused as already released.
            job.admit.request_id = base_id if attempt == 0 else f"{base_id}.{attempt}"
            lease = Lease(self._router, self._clients[group.index], job.admit.request_id,
                          job.client)
            try:
                async for response in self._run_on(group, lease, job, queued):
                    yield response
                return
            except _NotStarted as exc:
                retry = True
                self._metrics.retries.labels(
                    "slot_race" if exc.race else "group_failed" if exc.group_failed
                    else "group_full").inc()
                if exc.group_failed:
                    exclude.add(group.incarnation)
                if exc.race:
                    races += 1
                    if races > _MAX_RACE_RETRIES:
                        raise FailedPrecondition(
                            f"{exc.race} (still after {_MAX_RACE_RETRIES} retries)") from None
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

    async def _start(self, group: GroupState, lease: Lease, job: Job,
                     rows: asyncio.Queue) -> None:
        """Admit on rank 0 (which picks the slot), then on every other rank."""
        client = self._clients[group.index]
        try:
            lease.tag, slot = await client.links[0].admit(job.admit, rows, self._timeout(job))
        except AdmitFailed as exc:
            self._refused(group, exc, "admit on rank 0")
        lease.admitted(slot)
        if len(client.links) == 1:
            return
        follower = worker_pb2.AdmitRequest()
        follower.CopyFrom(job.admit)
        follower.slot = slot
        results = await asyncio.gather(
            *(link.admit(follower, None, self._timeout(job)) for link in client.links[1:]),
            return_exceptions=True)
        for result in results:
            if isinstance(result, AdmitFailed):
                self._refused(group, result, "admit on a follower rank")
            elif isinstance(result, BaseException):
                raise result

    def _refused(self, group: GroupState, exc: AdmitFailed, what: str):
        if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self._router.mark_full(group)  # another gateway holds its slots: wait our turn
            raise _NotStarted(group_failed=False)
        if (exc.code == grpc.StatusCode.FAILED_PRECONDITION and what.endswith("follower rank")
                and exc.message.startswith("slot:")):
            log.info("%s: slot-reuse race (%s); admitting again", group.name, exc.message)
            raise _NotStarted(group_failed=False, race=f"{what} refused: {exc.message}")
        if exc.code in _GROUP_FAILURES:
            self._group_failed(group, f"{what} failed: {exc.code.name}: {exc.message}")
            raise _NotStarted(group_failed=True)
        raise service_error(exc.code, exc.message, what)

    async def _run_on(self, group, lease, job, queued):
        rows: asyncio.Queue = asyncio.Queue()
        await self._start(group, lease, job, rows)
        detok = IncrementalDetokenizer(self._token_bytes)
        stop = StopStringFilter(job.stops, job.include_stop)
        progress = _Progress(text=[])
        while True:
            try:
                first = await asyncio.wait_for(rows.get(), self._timeout(job))
            except asyncio.TimeoutError:
                raise DeadlineExceeded("the deadline expired during generation") from None
            batch = [first]
            while not rows.empty():  # drain: one delta for everything that is here
                batch.append(rows.get_nowait())
            ids: list[int] = []
            lps: list = []
            fin = None
            broken = False
            for row in batch:
                if row is BROKEN:
                    broken = True
                    break
                ids.extend(row.token_ids)
                lps.extend(row.logprobs)
                if row.HasField("finished"):
                    fin = row.finished
                    break
            if ids:
                delta = self._on_tokens(ids, lps, detok, stop, progress)
                if delta is not None:
                    yield delta
                if stop.stopped:
                    lease.release()
                    yield self._final(job, progress, queued, common_pb2.FINISH_REASON_STOP_STRING,
                                      "", None)
                    return
            if broken:
                self._group_failed(group, "rank 0's stream broke")
                if progress.tokens == 0:
                    raise _NotStarted(group_failed=True)
                raise Unavailable(f"{group.name} failed after {progress.tokens} tokens were "
                                  "streamed: its rank 0 stopped answering (the stream to it "
                                  "broke); not retried, since tokens were already sent")
            if fin is not None:
                if fin.code == _UNAVAILABLE:
                    self._group_failed(group, fin.message)
                    if progress.tokens == 0:
                        raise _NotStarted(group_failed=True)
                    raise Unavailable(f"{group.name} failed after {progress.tokens} tokens "
                                      f"were streamed: a rank of the group failed "
                                      f"({fin.message}); not retried, since tokens were "
                                      "already sent")
                for response in self._tail(job, progress, queued, detok, stop, fin):
                    yield response
                return

    def _on_tokens(self, ids, lps, detok, stop,
                   progress) -> gateway_pb2.GenerateResponse | None:
        now = time.monotonic()
        if progress.first_token_at is None:
            progress.first_token_at = now
        else:
            self._metrics.inter_token.observe(now - progress.last_token_at)
        progress.last_token_at = now
        progress.tokens += len(ids)
        text = stop.push(detok.push(ids))
        progress.text.append(text)
        progress.logprobs.extend(lps)
        return gateway_pb2.GenerateResponse(delta=gateway_pb2.Delta(text=text, token_ids=ids,
                                                                    logprobs=lps))

    def _tail(self, job, progress, queued, detok, stop, fin):
        rest = stop.push(detok.flush())
        rest += stop.flush()
        if rest:
            progress.text.append(rest)
            yield gateway_pb2.GenerateResponse(delta=gateway_pb2.Delta(text=rest))
        reason = fin.reason
        if stop.stopped:
            reason = common_pb2.FINISH_REASON_STOP_STRING
        yield self._final(job, progress, queued, reason, fin.message, fin.usage)

    def _final(self, job, progress, queued, reason, message, usage):
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
        final.logprobs.extend(progress.logprobs)
        if job.echo_prompt:
            final.prompt_token_ids.extend(job.admit.prompt_token_ids)
        if job.schema is not None:
            valid, why = self._check_schema(job.schema, text)
            final.schema_valid = valid
            final.schema_error = why
            if not valid:
                self._metrics.schema_invalid.inc()
        return gateway_pb2.GenerateResponse(final=final)
