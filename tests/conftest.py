"""Process management for the system tests: the real services as child processes on loopback.

`RealSystem` starts a grammar service, one TP group of real worker ranks (one process per
rank, so a test can kill one) and one or more gateways; `gramserve_system` is one such
system shared by the system-test modules of a session (start-up is slow on 2 cores).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

# Triton runs the kernel on CPU tensors only through its interpreter, chosen before the first
# import of triton anywhere in the test process.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
from procs import Child, free_port, metric, wait_serving  # noqa: E402, F401

MAX_MODEL_LEN = 256


class RealSystem:
    """Grammar service + one group of `tp` worker ranks + gateways, all real processes."""

    def __init__(self, log_dir: Path, tp: int = 2, slots: int = 8, model: str | None = None,
                 grammar_args: tuple[str, ...] = (), rank_args: tuple[str, ...] = (),
                 tls: dict | None = None, max_model_len: int = MAX_MODEL_LEN):
        """`grammar_args` and `rank_args` are extra flags; `tls` ({"tls_ca", "tls_identity"}
        for protos.rpc.check_health) reaches internal servers that require mutual TLS."""
        self.log_dir = log_dir
        self.tls = tls or {}
        self.children: list[Child] = []
        self._model = ("--model", model) if model else ()  # default: the embedded model
        self.grammar = f"127.0.0.1:{free_port()}"
        self._spawn("grammar", ["grammar_service", "--host", "127.0.0.1",
                                "--port", self.grammar.rsplit(":", 1)[1],
                                "--metrics-port", "-1", "--compile-workers", "1", *self._model,
                                *grammar_args])
        dist = free_port()
        self.ranks, self.rank_metrics, self.rank_procs = [], [], []
        for r in range(tp):
            port, mport = free_port(), free_port()
            self.ranks.append(f"127.0.0.1:{port}")
            self.rank_metrics.append(f"http://127.0.0.1:{mport}/metrics")
            self.rank_procs.append(self._spawn(f"rank{r}", [
                "gpu_worker", "--rank", str(r), "--tp", str(tp),
                "--dist-addr", f"127.0.0.1:{dist}", "--host", "127.0.0.1", "--port", str(port),
                "--metrics-port", str(mport), "--grammar-service", self.grammar,
                "--device", "cpu", "--slots", str(slots), "--max-model-len", str(max_model_len),
                "--torch-threads", "1", *self._model, *rank_args]))
        self.gateways: list[str] = []
        self.gateway_metrics: list[str] = []

    def _spawn(self, name: str, args: list[str]) -> Child:
        child = Child(name, args, self.log_dir)
        self.children.append(child)
        return child

    def add_gateway(self, *extra: str, group: list[str] | None = None) -> str:
        """Start a gateway on the group (not waited for); return its address.

        No HTTP API unless `extra` has --http-port (then `http_url` finds its address);
        `group` points it at other rank addresses.
        """
        addr = f"127.0.0.1:{free_port()}"
        mport = free_port()
        http = () if "--http-port" in extra else ("--http-port", "-1")
        self._spawn(f"gateway{len(self.gateways)}", [
            "gateway", "--host", "127.0.0.1", "--port", addr.rsplit(":", 1)[1],
            "--grammar-service", self.grammar, "--group", ",".join(group or self.ranks),
            "--metrics-port", str(mport), "--health-interval", "0.5", *http, *self._model,
            *extra])
        self.gateways.append(addr)
        self.gateway_metrics.append(f"http://127.0.0.1:{mport}/metrics")
        return addr

    def http_url(self, gateway: int, timeout: float = 120.0) -> str:
        """The base URL (`http://host:port`) a gateway printed for its HTTP API."""
        child = next(c for c in self.children if c.name == f"gateway{gateway}")
        deadline = time.monotonic() + timeout
        while True:
            m = re.search(r"OpenAI-compatible HTTP on (http://\S+?)/v1", child.tail(100_000))
            if m:
                return m.group(1)
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"gateway{gateway} has no HTTP API:\n{child.tail()}")
            time.sleep(0.2)

    def wait_serving(self, timeout: float = 180.0) -> None:
        wait_serving([self.grammar, *self.ranks], self.children, timeout, **self.tls)
        wait_serving(self.gateways, self.children, timeout)

    def slots_in_use(self) -> list[float]:
        return [metric(url, "gramserve_worker_slots_in_use") for url in self.rank_metrics]

    def wait_slots_free(self, timeout: float = 15.0) -> list[float]:
        """Poll both ranks until no slot is in use; return the last reading."""
        deadline = time.monotonic() + timeout
        while True:
            used = self.slots_in_use()
            if not any(used) or time.monotonic() > deadline:
                return used
            time.sleep(0.1)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()


@pytest.fixture(scope="session")
def gramserve_system(tmp_path_factory):
    """One real system for the session: grammar service, 2 ranks, two gateways on the
    group (the second with --max-queue 0)."""
    system = RealSystem(tmp_path_factory.mktemp("system"))
    try:
        system.add_gateway()
        system.add_gateway("--max-queue", "0")
        system.wait_serving()
        yield system
    finally:
        system.stop()
