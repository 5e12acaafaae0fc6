"""Real worker processes for tests: a grammar service and TP groups on loopback, and a client
that drives a group the way the gateway does (Admit on rank 0, the same Admit with the slot
on the other ranks, Release to every rank at the end)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from protos import common_pb2, grammar_pb2, grammar_pb2_grpc, worker_pb2, worker_pb2_grpc
from protos.rpc import channel, check_health

ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (consecutive ones are not needed)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_block(n: int) -> int:
    """A base port such that base .. base+n-1 are free."""
    for _ in range(200):
        base = free_ports(1)[0]
        if base + n >= 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        return base
    raise RuntimeError("no free port block")


class Proc:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.log_path = log_path
        self.log = open(log_path, "wb")
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.popen = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
                                      cwd=ROOT, start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self.log.close()

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")


def wait_serving(addresses: list[str], procs: list[Proc], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(addresses)
    while pending:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"process exited early:\n{p.tail()}")
        pending = [a for a in pending if not check_health(a, timeout=1.0)]
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"not serving: {pending}\n" + "\n".join(p.tail() for p in procs))
        if pending:
            time.sleep(0.3)


def start_grammar_service(model_dir: Path, log_dir: Path) -> tuple[Proc, str]:
    port = free_ports(1)[0]
    proc = Proc([sys.executable, "-m", "grammar_service", "--host", "127.0.0.1", "--port",
                 str(port), "--model", str(model_dir), "--metrics-port", "-1",
                 "--compile-workers", "1"], log_dir / f"grammar-{port}.log")
    addr = f"127.0.0.1:{port}"
    wait_serving([addr], [proc])
    return proc, addr


def start_group(model_dir: Path, grammar_addr: str, log_dir: Path, tp: int = 2, slots: int = 4,
                extra: list[str] = ()) -> tuple[Proc, list[str], list[str]]:
    """Start `python -m gpu_worker.launch` for one group; (proc, rank addrs, metrics URLs)."""
    base = free_block(tp)
    mbase = free_block(tp)
    dist = free_ports(1)[0]
    proc = Proc([sys.executable, "-m", "gpu_worker.launch", "--tp", str(tp), "--port", str(base),
                 "--dist-port", str(dist), "--metrics-port", str(mbase), "--model", str(model_dir),
                 "--grammar-service", grammar_addr, "--device", "cpu", "--slots", str(slots),
                 "--max-model-len", "256", "--torch-threads", "1", *extra],
                log_dir / f"group-{base}.log")
    addrs = [f"127.0.0.1:{base + r}" for r in range(tp)]
    wait_serving(addrs, [proc])
    return proc, addrs, [f"http://127.0.0.1:{mbase + r}/metrics" for r in range(tp)]


def metric(url: str, name: str) -> float:
    """Sum of the samples called `name` on a /metrics page."""
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def compile_spec(grammar_addr: str, kind: str, arg) -> tuple[str, common_pb2.GrammarSpec]:
    opts = common_pb2.GrammarOptions(whitespace=common_pb2.WHITESPACE_COMPACT)
    if kind == "json_schema":
        spec = common_pb2.GrammarSpec(json_schema=json.dumps(arg), options=opts)
    elif kind == "regex":
        spec = common_pb2.GrammarSpec(regex=arg)
    elif kind == "choice":
        spec = common_pb2.GrammarSpec(choice=common_pb2.ChoiceList(choices=arg))
    else:
        raise ValueError(kind)
    with channel(grammar_addr) as ch:
        ref = grammar_pb2_grpc.GrammarServiceStub(ch).Compile(
            grammar_pb2.CompileRequest(spec=spec), timeout=60)
    return ref.key, spec


class GroupClient:
    """Drives one TP group like the gateway does."""

    def __init__(self, addrs: list[str]):
        self.channels = [channel(a) for a in addrs]
        self.stubs = [worker_pb2_grpc.WorkerStub(c) for c in self.channels]
        self.pool = ThreadPoolExecutor(8)

    def close(self):
        for c in self.channels:
            c.close()

    def generate(self, request_id: str, prompt: list[int], timeout: float = 120.0,
                 key: str = "", spec=None, **sampling) -> tuple[list[int], worker_pb2.Finished]:
        req = worker_pb2.AdmitRequest(request_id=request_id, slot=-1, prompt_token_ids=prompt,
                                      sampling=common_pb2.SamplingParams(**sampling),
                                      grammar_key=key, grammar=spec)
        deadline = time.monotonic() + timeout
        while True:  # all slots busy: wait like the gateway's queue does
            stream = self.stubs[0].Admit(req, timeout=timeout)
            try:
                slot = next(stream).admitted.slot
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        try:
            others = [self.pool.submit(lambda s: list(s.Admit(self._with_slot(req, slot),
                                                               timeout=timeout)), stub)
                      for stub in self.stubs[1:]]
            for f in others:
                f.result()
            tokens = []
            for ev in stream:
                if ev.HasField("tokens"):
                    tokens.extend(ev.tokens.token_ids)
                elif ev.HasField("finished"):
                    return tokens, ev.finished
            raise AssertionError("stream ended without finished")
        finally:
            self.release_all(slot, request_id)

    @staticmethod
    def _with_slot(req, slot):
        r = worker_pb2.AdmitRequest()
        r.CopyFrom(req)
        r.slot = slot
        return r

    def release_all(self, slot: int, request_id: str) -> None:
        for stub in self.stubs:
            try:
                stub.Release(worker_pb2.ReleaseRequest(slot=slot, request_id=request_id),
                             timeout=10)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
