"""Child processes for tests: loopback ports, services in their own process groups with logs,
health waits and /metrics readings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gateway.launcher import free_ports
from protos.rpc import check_health

ROOT = Path(__file__).resolve().parent.parent


_given: set[int] = set()  # never hand a port out twice in one test process


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range (see gateway.launcher)."""
    return free_ports(1, _given)


class Child:
    """A child process in its own process group, its output in a log file."""

    def __init__(self, name: str, args: list[str], log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", *args], stdout=self._log,
                                      stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                      start_new_session=True)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            os.killpg(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.popen.wait()
        self._log.close()

    def tail(self, n: int = 3000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples named `name` on a /metrics page (those with every label in
    `labels`, when given)."""
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    want = [f'{k}="{v}"' for k, v in (labels or {}).items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name) and line[len(name)] in " {"
               and all(w in line for w in want))


def free_block(n: int) -> int:
    """A base port such that base .. base+n-1 are all free (for launchers using port + rank)."""
    return free_ports(n, _given)


def wait_serving(addresses: list[str], children: list[Child], timeout: float = 180.0,
                 **tls) -> None:
    """Wait until every address answers SERVING; raise with the logs if a child died.
    `tls`: check_health's tls_ca / tls_identity."""
    deadline = time.monotonic() + timeout
    pending = list(addresses)
    while pending:
        dead = [c for c in children if not c.alive()]
        if dead:
            raise RuntimeError(f"{dead[0].name} exited early:\n{dead[0].tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not serving: {pending}\n"
                               + "\n".join(c.tail(800) for c in children))
        pending = [a for a in pending if not check_health(a, timeout=1.0, **tls)]
        if pending:
            time.sleep(0.3)


def read_until_up(proc: subprocess.Popen) -> tuple[list[str], str]:
    """Read `gramserve up`'s output up to its "gramserve is up" line; (lines, gateway
    address). Fails the test with the output when `up` exits first."""
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("gramserve is up"):
            break
    assert lines and lines[-1].startswith("gramserve is up"), "".join(lines)
    return lines, lines[-1].split()[-1]
