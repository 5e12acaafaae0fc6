"""The gRPC front of one rank: a process of its own that serves the Worker service and relays
to the rank's engine process over a socket pair.

Why a process: the engine thread is the rank's critical path, and it gives up the GIL around
every CUDA call. In one process, each step woke the gRPC threads of every gateway's Session
stream (build the step's message, send it, wait for the send) and gRPC's polling thread, and
each wake-up handed them the GIL: the engine thread then waited to take it back, about a
fifth of a guided step on an H100. Here the engine thread pickles its step's rows once and
writes them to the socket; protobufs, gRPC's threads and their GIL live in this process.

What crosses the socket (pickled tuples, `Connection.send`):
- front -> engine: ("open", sid), ("admit", sid, AdmitRequest bytes), ("release", slot,
  request_id, call id or 0), ("close", sid), ("info", call id).
- engine -> front: ("admitted", sid, tag, code, message, slot, rank), ("step", step, rows)
  with rows (sid, tag, token ids, logprobs or None, finish tuple or None), ("reply", call
  id, value), ("health", serving, sessions allowed), ("stop", grace seconds).
The engine's side is `gpu_worker.control.server.FrontLink`. This module imports no torch, so
the front starts in a fraction of a second. Either process exits when the other's end of the
socket closes.

    python -m gpu_worker.control.front FD     (started by the rank, never by hand)
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from multiprocessing.connection import Connection

import grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from protos.rpc import (
    InvalidArgument,
    NotFound,
    Unavailable,
    create_server,
    set_serving,
)

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
_CALL_TIMEOUT_S = 30.0


def finished_proto(finish: tuple) -> worker_pb2.Finished:
    """A finish tuple from the engine's side: (reason number, message, code, completion
    tokens, start seconds, first-token seconds, prompt tokens)."""
    reason, message, code, completion, start, first, prompt = finish
    return worker_pb2.Finished(
        reason=reason, message=message, code=code,
        usage=common_pb2.Usage(prompt_tokens=prompt, completion_tokens=completion),
        start_seconds=start, first_token_seconds=first)


def step_update(step: int, rows: list[tuple]) -> worker_pb2.SessionEvent:
    """One session's rows of one step as a message. Rows are added in place (`rows.add`):
    building each RowUpdate apart and copying it into the list took 2.4x the time."""
    event = worker_pb2.SessionEvent()
    update = event.step
    update.step = step
    add = update.rows.add
    for _, tag, tokens, logprobs, finish in rows:
        row = add(tag=tag, token_ids=tokens)
        if logprobs:
            for token, (logprob, top_ids, top_lps) in zip(tokens, logprobs, strict=False):
                row.logprobs.add(token_id=token, logprob=logprob, top_token_ids=top_ids,
                                 top_logprobs=top_lps)
        if finish is not None:
            row.finished.CopyFrom(finished_proto(finish))
    return event


class Link:
    """The front's end of the socket: sends under a lock, one reader thread dispatches."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()
        self.sessions: dict[int, Session] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count(1)
        self.serving = True
        self.health = None
        self.server: grpc.Server | None = None

    def send(self, msg: tuple) -> None:
        try:
            with self._lock:
                self.conn.send(msg)
        except (OSError, ValueError):  # the engine process is gone (this process exits too)
            raise Unavailable("this worker rank's engine process is gone") from None

    def call(self, msg: tuple):
        """Send a request that carries a call id (its last field); wait for the reply."""
        call_id = next(self._ids)
        future: Future = Future()
        self._calls[call_id] = future
        try:
            self.send((*msg, call_id))
            return future.result(_CALL_TIMEOUT_S)
        except FutureTimeout:
            raise Unavailable("the rank's engine process did not answer") from None
        finally:
            self._calls.pop(call_id, None)

    def run(self) -> None:
        """Dispatch the engine's messages until it stops us or its end closes."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                log.warning("the rank's engine process is gone; the front exits")
                self._exit(0.0, 3)
            kind = msg[0]
            if kind == "step":
                step, by_session = msg[1], {}
                for row in msg[2]:
                    by_session.setdefault(row[0], []).append(row)
                for sid, rows in by_session.items():
                    session = self.sessions.get(sid)
                    if session is not None:
                        session.out.put((step, rows))
            elif kind == "admitted":
                _, sid, tag, code, message, slot, rank = msg
                session = self.sessions.get(sid)
                if session is not None:
                    session.out.put(worker_pb2.SessionEvent(admitted=worker_pb2.AdmitResult(
                        tag=tag, code=code, message=message, slot=slot, rank=rank)))
            elif kind == "reply":
                future = self._calls.get(msg[1])
                if future is not None:
                    future.set_result(msg[2])
            elif kind == "health":
                _, serving, sessions = msg
                self.serving = sessions
                set_serving(self.health, [SERVICE_NAME], serving)
            elif kind == "stop":
                self._exit(msg[1], 0)

    def _exit(self, grace: float, code: int) -> None:
        if self.server is not None:
            self.server.stop(grace).wait(grace + 1.0)
        os._exit(code)


class Session:
    """One gateway's Session stream: incoming admissions and releases go to the engine
    process; the engine's rows and admission results for this session come back on `out`."""

    _CLOSE = object()

    def __init__(self, link: Link, sid: int):
        self.link = link
        self.sid = sid
        self.out: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()

    def events(self, context) -> Iterator[worker_pb2.SessionEvent]:
        """The stream's outgoing messages until the session closes."""
        while True:
            try:
                item = self.out.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    return
                continue
            if item is self._CLOSE:
                return
            yield step_update(*item) if isinstance(item, tuple) else item

    def read(self, requests: Iterator[worker_pb2.SessionRequest]) -> None:
        """Forward the gateway's admissions and releases until it closes its side."""
        try:
            for msg in requests:
                if msg.HasField("admit"):
                    self.link.send(("admit", self.sid, msg.admit.SerializeToString()))
                elif msg.HasField("release"):
                    self.link.send(("release", msg.release.slot, msg.release.request_id, 0))
        except (grpc.RpcError, Unavailable):
            pass  # the stream broke (the gateway is gone), or the engine did
        finally:
            self.close()

    def close(self) -> None:
        """The engine releases what this session still holds, on this rank; the stream ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.link.sessions.pop(self.sid, None)
        try:
            self.link.send(("close", self.sid))
        except Unavailable:
            pass  # the engine is gone; so is everything the session held
        self.out.put(self._CLOSE)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Session / Release / Info of one rank, relayed to its engine process."""

    def __init__(self, link: Link):
        self.link = link
        self._sids = itertools.count(1)

    def Session(self, request_iterator, context):
        if not self.link.serving:
            raise Unavailable("this worker rank lost its group and is shutting down")
        session = Session(self.link, next(self._sids))
        self.link.sessions[session.sid] = session
        self.link.send(("open", session.sid))
        context.add_callback(session.close)
        threading.Thread(target=session.read, args=(request_iterator,), daemon=True,
                         name="session-reader").start()
        yield from session.events(context)

    def Release(self, request, context):
        kind, value = self.link.call(("release", request.slot, request.request_id))
        if kind == "slot":
            raise InvalidArgument(value, field="slot")
        if kind == "unknown":
            raise NotFound(value)
        return worker_pb2.ReleaseResponse(was_running=value)

    def Info(self, request, context):
        return worker_pb2.WorkerInfo.FromString(self.link.call(("info",)))


def main(argv: list[str]) -> int:
    """Serve the Worker service for the rank at the other end of socket FD (argv[0])."""
    # Ctrl-C reaches the whole process group: the rank decides when its front stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    cfg = conn.recv()
    logging.basicConfig(level=cfg["log_level"],
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    link = Link(conn)
    try:
        server, port, link.health = create_server(
            [(worker_pb2_grpc.add_WorkerServicer_to_server, WorkerServicer(link), SERVICE_NAME)],
            host=cfg["host"], port=cfg["port"], tls=cfg["tls"], client_ca=cfg["tls_client_ca"],
            reflection=cfg["reflection"])
    except (RuntimeError, ValueError) as exc:
        conn.send(("failed", str(exc)))
        return 2
    link.server = server
    conn.send(("bound", port))
    link.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
