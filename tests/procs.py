"""Child processes for tests: loopback ports, services in their own process groups with logs,
health waits and /metrics readings."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from protos.rpc import check_health

ROOT = Path(__file__).resolve().parent.parent


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# Ports for the tests' servers come from below the kernel's ephemeral range. A port taken
# there (bind to port 0) can be handed out again as the local port of an outgoing connection
# (gloo's between two ranks, a gRPC channel) before the server that was given it binds it:
# "Address already in use", a whole fixture lost. Below the range no connection takes it.
_PORTS = range(10000, min(_ephemeral_start(), 65536))
_given: set[int] = set()


def free_port() -> int:
    """A loopback port free now, never handed out before in this process, and outside the
    ephemeral range when the kernel leaves room below it."""
    if len(_PORTS) < 1000:  # an unusual range: the kernel's choice
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    for _ in range(1000):
        port = random.choice(_PORTS)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError("no free loopback port")


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
    for _ in range(200):
        base = free_port()
        if base + n >= (_PORTS.stop if len(_PORTS) >= 1000 else 65535):
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _given.update(range(base, base + n))
        return base
    raise RuntimeError("no free block of ports")


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
