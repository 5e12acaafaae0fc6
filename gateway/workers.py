"""gRPC clients of the worker groups, and the health monitor that takes groups out and back.

Each rank of a group has one long-lived channel. Health: a group is in rotation when every
rank answers the gRPC health check SERVING and rank 0's Info says `serving`, with the
gateway's vocabulary.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.router import GroupState, Router
from protos import worker_pb2, worker_pb2_grpc
from protos.rpc import channel

log = logging.getLogger(__name__)

_CHECK_TIMEOUT = 2.0
_RELEASE_TIMEOUT = 5.0


class GroupClient:
    """Stubs for every rank of one group, and the calls that fan out to all of them."""

    def __init__(self, state: GroupState, tls_ca: bytes | None, pool: futures.Executor):
        self.state = state
        self._channels = [channel(a, tls_ca=tls_ca) for a in state.addresses]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._pool = pool

    def check(self, fingerprint: str) -> tuple[bool, str, worker_pb2.WorkerInfo | None]:
        """(healthy, reason, rank 0's Info) from one round of checks on every rank."""
        try:
            for rank, stub in enumerate(self._health):
                resp = stub.Check(health_pb2.HealthCheckRequest(), timeout=_CHECK_TIMEOUT)
                if resp.status != health_pb2.HealthCheckResponse.SERVING:
                    return False, f"rank {rank} is not serving", None
            info = self.stubs[0].Info(worker_pb2.InfoRequest(), timeout=_CHECK_TIMEOUT)
        except grpc.RpcError as exc:
            return False, f"health check failed: {exc.code().name}", None
        if not info.serving:
            return False, "rank 0 says it is not serving", info
        if info.tp_size != len(self.stubs):
            return False, f"configured with {len(self.stubs)} ranks, tp_size is {info.tp_size}", info
        if fingerprint and info.vocab_fingerprint != fingerprint:
            return False, "vocabulary fingerprint differs from the gateway's model", info
        return True, "", info

    def admit_followers(self, req: worker_pb2.AdmitRequest, timeout: float | None) -> None:
        """Send `req` (with the slot rank 0 chose) to ranks 1..N-1 in parallel.

        Raises the first grpc.RpcError a rank answered with.
        """
        def admit(stub):
            for _ in stub.Admit(req, timeout=timeout):
                pass

        jobs = [self._pool.submit(admit, stub) for stub in self.stubs[1:]]
        errors = [j.exception() for j in jobs]
        for err in errors:
            if err is not None:
                raise err

    def release_all(self, slot: int, request_id: str) -> None:
        """Release (slot, request_id) on every rank; NOT_FOUND and dead ranks are fine here."""
        req = worker_pb2.ReleaseRequest(slot=slot, request_id=request_id)
        calls = [stub.Release.future(req, timeout=_RELEASE_TIMEOUT) for stub in self.stubs]
        for rank, call in enumerate(calls):
            try:
                call.result()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    log.info("release of slot %d on %s rank %d: %s", slot, self.state.name,
                             rank, exc.code().name)

    def close(self) -> None:
        for c in self._channels:
            c.close()


class HealthMonitor:
    """A thread that checks every group each `interval` seconds (sooner when poked)."""

    def __init__(self, router: Router, clients: list[GroupClient], fingerprint: str,
                 interval: float):
        self._router = router
        self._clients = clients
        self._fingerprint = fingerprint
        self._interval = interval
        self._poke = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)

    def start(self) -> None:
        self.check_all()
        self._thread.start()

    def poke(self) -> None:
        """Check again now (a request just saw a group fail)."""
        self._poke.set()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        self._thread.join(timeout=5)

    def check_all(self) -> None:
        """One round of checks; updates the router."""
        for client in self._clients:
            ok, reason, info = client.check(self._fingerprint)
            state = client.state
            if ok != state.healthy:
                log.warning("%s (%s) is %s%s", state.name, ",".join(state.addresses),
                            "in rotation" if ok else "out of rotation",
                            f": {reason}" if reason else "")
            self._router.set_health(
                state, ok, reason,
                num_slots=info.num_slots if info is not None else None,
                max_model_len=info.max_model_len if info is not None else None)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self._interval)
            self._poke.clear()
            if not self._stop.is_set():
                self.check_all()
