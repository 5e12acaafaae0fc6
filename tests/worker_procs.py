"""Real worker processes for tests: a grammar service and TP groups on loopback, and a client
that drives a group the way the gateway does (one Session stream per rank: Admit on rank 0,
the same Admit with the slot on the other ranks, Release to every rank at the end)."""

from __future__ import annotations

import collections
import itertools
import json
import queue
import threading
import time
from pathlib import Path

import grpc
from procs import Child, free_block, free_port, metric, wait_serving  # noqa: F401

from protos import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.rpc import channel


def start_grammar_service(model_dir: Path, log_dir: Path) -> tuple[Child, str]:
    port = free_port()
    proc = Child(f"grammar-{port}", ["grammar_service", "--host", "127.0.0.1", "--port",
                                     str(port), "--model", str(model_dir), "--metrics-port", "-1",
                                     "--compile-workers", "1"], log_dir)
    addr = f"127.0.0.1:{port}"
    wait_serving([addr], [proc])
    return proc, addr


def start_group(model_dir: Path, grammar_addr: str, log_dir: Path, tp: int = 2, slots: int = 4,
                extra: list[str] = ()) -> tuple[Child, list[str], list[str]]:
    """Start `python -m gpu_worker.launch` for one group; (proc, rank addrs, metrics URLs)."""
    base = free_block(tp)
    mbase = free_block(tp)
    proc = Child(f"group-{base}", [
        "gpu_worker.launch", "--tp", str(tp), "--port", str(base), "--dist-port", str(free_port()),
        "--metrics-port", str(mbase), "--model", str(model_dir), "--grammar-service", grammar_addr,
        "--device", "cpu", "--slots", str(slots), "--max-model-len", "256", "--torch-threads", "1",
        *extra], log_dir)
    addrs = [f"127.0.0.1:{base + r}" for r in range(tp)]
    wait_serving(addrs, [proc])
    return proc, addrs, [f"http://127.0.0.1:{mbase + r}/metrics" for r in range(tp)]


def compile_spec(grammar_addr: str, kind: str, arg,
                 backend: int = common_pb2.GRAMMAR_BACKEND_AUTO,
                 ) -> tuple[str, common_pb2.GrammarSpec]:
    """Compile one constraint of `constraints.constraint_mix` (on `backend` when one is
    forced); return (key, spec)."""
    return compile_ref(grammar_addr, kind, arg, backend)[:2]


def compile_ref(grammar_addr: str, kind: str, arg,
                backend: int = common_pb2.GRAMMAR_BACKEND_AUTO,
                ) -> tuple[str, common_pb2.GrammarSpec, grammar_pb2.GrammarRef]:
    """As compile_spec, with the service's GrammarRef (which backend compiled it)."""
    opts = common_pb2.GrammarOptions(backend=backend)
    if kind == "json_schema":
        opts.whitespace = common_pb2.WHITESPACE_COMPACT
        spec = common_pb2.GrammarSpec(json_schema=json.dumps(arg), options=opts)
    elif kind == "regex":
        spec = common_pb2.GrammarSpec(regex=arg, options=opts)
    elif kind == "choice":
        spec = common_pb2.GrammarSpec(choice=common_pb2.ChoiceList(choices=arg), options=opts)
    else:
        raise ValueError(kind)
    with channel(grammar_addr) as ch:
        ref = grammar_pb2_grpc.GrammarServiceStub(ch).Compile(
            grammar_pb2.CompileRequest(spec=spec), timeout=60)
    return ref.key, spec, ref


class AdmitError(Exception):
    """An AdmitResult with a non-OK code."""

    def __init__(self, result: worker_pb2.AdmitResult):
        self.code = _CODES[result.code]
        self.details = result.message
        super().__init__(f"{self.code.name}: {result.message}")


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class RankSession:
    """A synchronous Session stream to one rank, as the gateway keeps one (tests only)."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub):
        self._q: queue.Queue = queue.Queue()
        self._call = stub.Session(iter(self._q.get, None), wait_for_ready=True)
        self._cond = threading.Condition()
        self._results: dict[int, worker_pb2.AdmitResult] = {}
        self.rows: dict[int, list[worker_pb2.RowUpdate]] = collections.defaultdict(list)
        self.updates = 0  # StepUpdate messages received
        self.error: grpc.RpcError | None = None
        self._tags = itertools.count(1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        try:
            for ev in self._call:
                with self._cond:
                    if ev.HasField("admitted"):
                        self._results[ev.admitted.tag] = ev.admitted
                    else:
                        self.updates += 1
                        for row in ev.step.rows:
                            self.rows[row.tag].append(row)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            with self._cond:
                self.error = exc
                self._cond.notify_all()

    def admit(self, req: worker_pb2.AdmitRequest, timeout: float = 60.0) -> tuple[int, int]:
        """Send an admission; return (tag, slot) or raise AdmitError."""
        msg = worker_pb2.AdmitRequest()
        msg.CopyFrom(req)
        msg.tag = next(self._tags)
        self._q.put(worker_pb2.SessionRequest(admit=msg))
        result = self._wait(lambda: self._results.get(msg.tag), timeout)
        if result.code != 0:
            raise AdmitError(result)
        return msg.tag, result.slot

    def release(self, slot: int, request_id: str) -> None:
        self._q.put(worker_pb2.SessionRequest(
            release=worker_pb2.ReleaseRequest(slot=slot, request_id=request_id)))

    def finished(self, tag: int, timeout: float = 120.0) -> tuple[list[int], worker_pb2.Finished]:
        """Wait for the request's last row; return (tokens, Finished)."""
        def done():
            rows = self.rows.get(tag, [])
            return rows if rows and rows[-1].HasField("finished") else None
        rows = self._wait(done, timeout)
        return [t for r in rows for t in r.token_ids], rows[-1].finished

    def tokens(self, tag: int) -> list[int]:
        with self._cond:
            return [t for r in self.rows.get(tag, []) for t in r.token_ids]

    def wait_tokens(self, tag: int, n: int, timeout: float = 60.0) -> None:
        self._wait(lambda: len([t for r in self.rows.get(tag, []) for t in r.token_ids]) >= n
                   or None, timeout)

    def _wait(self, ready, timeout: float):
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = ready()
                if value is not None:
                    return value
                if self.error is not None:
                    raise self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no answer from the rank")
                self._cond.wait(left)

    def close(self) -> None:
        self._q.put(None)
        self._call.cancel()


class GroupClient:
    """Drives one TP group like the gateway does: one Session per rank."""

    def __init__(self, addrs: list[str]):
        self.channels = [channel(a) for a in addrs]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.sessions = [RankSession(s) for s in self.stubs]

    def close(self):
        for s in self.sessions:
            s.close()
        for c in self.channels:
            c.close()

    def admit_all(self, req: worker_pb2.AdmitRequest, timeout: float = 120.0) -> tuple[int, int]:
        """Admit on rank 0 (waiting while every slot is busy), then on every other rank with
        rank 0's slot; return (rank 0's tag, slot)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                tag, slot = self.sessions[0].admit(req, timeout)
                break
            except AdmitError as exc:
                if exc.code != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        try:
            for s in self.sessions[1:]:
                s.admit(self._with_slot(req, slot), timeout)
        except BaseException:
            self.release_all(slot, req.request_id)
            raise
        return tag, slot

    def generate(self, request_id: str, prompt: list[int], timeout: float = 120.0,
                 key: str = "", spec=None, **sampling) -> tuple[list[int], worker_pb2.Finished]:
        req = worker_pb2.AdmitRequest(request_id=request_id, slot=-1, prompt_token_ids=prompt,
                                      sampling=common_pb2.SamplingParams(**sampling),
                                      grammar_key=key, grammar=spec)
        tag, slot = self.admit_all(req, timeout)
        try:
            return self.sessions[0].finished(tag, timeout)
        finally:
            self.release_all(slot, request_id)

    @staticmethod
    def _with_slot(req, slot):
        r = worker_pb2.AdmitRequest()
        r.CopyFrom(req)
        r.slot = slot
        return r

    def release_all(self, slot: int, request_id: str) -> None:
        for s in self.sessions:
            s.release(slot, request_id)
