"""Real worker processes for tests: a grammar service and TP groups on loopback, and a client
that drives a group the way the gateway does (Admit on rank 0, the same Admit with the slot
on the other ranks, Release to every rank at the end)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
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
