"""`gramserve up`: grammar service, G worker groups and N gateways on loopback, supervised.

With `--gateways N` > 1, N gateway processes share the gRPC and HTTP ports (SO_REUSEPORT:
the kernel spreads client connections over them) and each opens its own Session to every
rank. One gateway's event loop relays about 17k token messages per second on the H200's
host before it saturates a core, so the gateway scales out in processes, as the groups do.

Every child runs in its own process group so a stop reaches the processes it started
too (a worker group launcher's ranks). Once the system is up, `up` supervises it: a child
that exits is reported, what is left of its process group is killed, and it is started
again after an exponential backoff (1 s, 2 s, 4 s ... at most 30 s; back to 1 s once it has
run for a minute). A worker group restarts whole: every rank, on the same gRPC ports (the
gateways know them) and a new rendezvous port. While a group is down the gateways keep it
out of rotation and hold requests that have not produced a token for up to
`--unavailable-wait` seconds; the grammar service restarts on its port, and grammars the
gateways and ranks already hold keep serving meanwhile. A child that dies during start-up
still stops everything (exit 1): a configuration that cannot start is not retried.

SIGTERM (or Ctrl-C) drains, in order: the gateways (health NOT_SERVING, new requests
refused, running streams finish for up to `--drain-timeout` seconds), then the worker
groups, then the grammar service.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from protos.rpc import check_health, env_default

_HOST = "127.0.0.1"


@dataclass(frozen=True)
class UpConfig:
    """Flags of `gramserve up`, checked when built."""

    model: str | None
    tp: int = 2
    groups: int = 1
    gateways: int = 1
    slots: int = 8
    device: str = "cpu"
    port: int = 50051
    http_port: int = 8000
    metrics_port: int = 0
    max_model_len: int = 0
    max_queue: int = 64
    cache_dir: str | None = None
    startup_timeout: float = 600.0
    # Mutual TLS between the gateways, the workers and the grammar service, with a local
    # development CA written into this directory (gateway/dev_tls.py).
    tls_dir: str | None = None
    auth_tokens: str | None = None  # the gateways' --auth-tokens
    client_max_streams: int = 0
    client_max_queued: int = 0
    drain_timeout: float = 30.0
    unavailable_wait: float = 60.0

    def __post_init__(self):
        for name, low in (("tp", 1), ("groups", 1), ("gateways", 1), ("slots", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name} must be >= {low}, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be -1 (off) or in [0, 65535], got {self.http_port}")
        if self.metrics_port < -1:
            raise ValueError("--metrics-port must be -1 (off), 0 (free ports) or a base port")
        if self.max_model_len < 0 or self.max_queue < 0:
            raise ValueError("--max-model-len and --max-queue must be >= 0")
        if self.startup_timeout <= 0:
            raise ValueError("--startup-timeout must be > 0")
        if self.client_max_streams < 0 or self.client_max_queued < 0:
            raise ValueError("--client-max-streams and --client-max-queued must be >= 0")
        if self.auth_tokens is not None:
            from gateway.auth import TokenTable

            TokenTable.load(self.auth_tokens)  # ValueError names the file and line
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.unavailable_wait < 0:
            raise ValueError(f"--unavailable-wait must be >= 0, got {self.unavailable_wait}")


def up_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env_default("model", ""),
                   help="model directory; empty: the embedded default model (GRAMSERVE_MODEL)")
    p.add_argument("--tp", type=int, default=env_default("tp", 2),
                   help="ranks per tensor-parallel group (GRAMSERVE_TP)")
    p.add_argument("--groups", type=int, default=env_default("groups", 1),
                   help="TP groups (model replicas) (GRAMSERVE_GROUPS)")
    p.add_argument("--gateways", type=int, default=env_default("gateways", 1),
                   help="gateway processes sharing the gRPC and HTTP ports (GRAMSERVE_GATEWAYS)")
    p.add_argument("--slots", type=int, default=env_default("slots", 8),
                   help="concurrent requests per group (GRAMSERVE_SLOTS)")
    p.add_argument("--device", default=env_default("device", "cpu"), help="cpu or cuda")
    p.add_argument("--port", type=int, default=env_default("port", 50051),
                   help="gateway port; 0 picks a free one (GRAMSERVE_PORT)")
    p.add_argument("--http-port", type=int, default=env_default("http_port", 8000),
                   help="the gateway's OpenAI-compatible HTTP port; 0 picks a free one, -1 off "
                        "(GRAMSERVE_HTTP_PORT)")
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", 0),
                   help="first metrics port (grammar service, each gateway, then each rank); "
                        "0 free ports, -1 off (GRAMSERVE_METRICS_PORT)")
    p.add_argument("--max-model-len", type=int, default=env_default("max_model_len", 0),
                   help="context length per slot; 0 the worker's default "
                        "(GRAMSERVE_MAX_MODEL_LEN)")
    p.add_argument("--max-queue", type=int, default=env_default("max_queue", 64),
                   help="gateway queue bound (GRAMSERVE_MAX_QUEUE)")
    p.add_argument("--cache-dir", default=env_default("cache_dir", ""),
                   help="grammar cache directory; empty: memory only (GRAMSERVE_CACHE_DIR)")
    p.add_argument("--startup-timeout", type=float, default=env_default("startup_timeout", 600.0),
                   help="seconds to wait for every service to be SERVING")
    p.add_argument("--tls-dir", default=env_default("tls_dir", ""),
                   help="mutual TLS between gateway, workers and grammar service, with a "
                        "development CA and certificate written to (or reused from) this "
                        "directory (GRAMSERVE_TLS_DIR)")
    p.add_argument("--auth-tokens", default=env_default("auth_tokens", ""),
                   help="bearer tokens of the public API: a file of `TOKEN CLIENT` lines or "
                        "env:NAME (GRAMSERVE_AUTH_TOKENS)")
    p.add_argument("--client-max-streams", type=int,
                   default=env_default("client_max_streams", 0),
                   help="requests one client may run at once; 0 no limit")
    p.add_argument("--client-max-queued", type=int, default=env_default("client_max_queued", 0),
                   help="requests one client may have queued; 0 no limit")
    p.add_argument("--drain-timeout", type=float, default=env_default("drain_timeout", 30.0),
                   help="on SIGTERM: seconds the gateways let running streams finish before "
                        "workers and the grammar service stop (GRAMSERVE_DRAIN_TIMEOUT)")
    p.add_argument("--unavailable-wait", type=float,
                   default=env_default("unavailable_wait", 60.0),
                   help="seconds a request waits for a restarting worker group when none is "
                        "healthy, within its deadline (GRAMSERVE_UNAVAILABLE_WAIT)")


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


# Ports the launcher hands out come from below the kernel's ephemeral range. A port found free
# there by binding port 0 can be handed out again as the local port of an outgoing connection
# (gloo's between two ranks, a gRPC channel, a readiness probe) before its server binds it:
# "Address already in use", or a probe of a port nobody listens on yet connecting to itself
# (TCP simultaneous open) and reading back its own request. Below the range no connection
# takes a port.
_PORTS = range(10000, min(_ephemeral_start(), 65536))
# Its own generator: a caller's random.seed() must not make two launches pick the same ports.
_port_rng = random.Random()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((_HOST, port))
        except OSError:
            return False
    return True


def free_ports(n: int, taken: set[int]) -> int:
    """The first of `n` consecutive free loopback ports, none of them in `taken` (which gains
    them), below the kernel's ephemeral range when it leaves room there."""
    below = len(_PORTS) >= 1000
    for _ in range(1000):
        if below:
            base = _port_rng.randrange(_PORTS.start, _PORTS.stop - n)
        else:  # an unusual range: the kernel's choice
            with socket.socket() as s:
                s.bind((_HOST, 0))
                base = s.getsockname()[1]
        ports = range(base, base + n)
        if base + n < 65536 and not taken.intersection(ports) and all(map(_port_free, ports)):
            taken.update(ports)
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


# Restart backoff: the n-th restart in a row waits min(_BACKOFF_MAX, _BACKOFF_BASE * 2**(n-1))
# seconds; a child that ran _STABLE_AFTER seconds before dying starts again from the base.
_BACKOFF_BASE = 1.0
_BACKOFF_MAX = 30.0
_STABLE_AFTER = 60.0


class _Child:
    """One supervised child: how to start it, its process, its restart state."""

    def __init__(self, name: str, kind: str, command: Callable[[], list[str]],
                 addresses: list[str]):
        self.name, self.kind = name, kind
        self.command = command  # called at every start (a group takes a new rendezvous port)
        self.addresses = addresses  # gRPC addresses that answer SERVING once it is up
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.failures = 0  # deaths in a row, for the backoff
        self.restarts = 0
        self.restart_at: float | None = None  # set while dead and waiting for its backoff
        self.announce = False  # restarted, not yet seen serving

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", *self.command()],
                                     start_new_session=True)
        self.started = time.monotonic()


class System:
    """The children of `gramserve up`: start, wait until serving, supervise, drain, stop."""

    def __init__(self, config: UpConfig, out=sys.stdout, err=sys.stderr):
        self.config = config
        self.out, self.err = out, err
        self.children: list[_Child] = []
        self.addresses: dict[str, list[str]] = {}
        self.metrics_urls: list[str] = []
        self.gateway_ready: list[str] = []  # each gateway's /metrics answers once it serves
        self.http_url: str | None = None
        self.stopping = threading.Event()
        self.tls = None  # gateway.dev_tls.DevTls under --tls-dir
        self._taken: set[int] = set()

    def _say(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    def _spawn(self, name: str, kind: str, command: Callable[[], list[str]],
               addresses: list[str]) -> None:
        child = _Child(name, kind, command, addresses)
        child.start()
        self.children.append(child)

    def start(self) -> None:
        """Start every child. Raises RuntimeError when a port cannot be found."""
        from grammar_service.default_model import resolve_model

        c = self.config
        model_dir = str(resolve_model(c.model))  # create the default model once, here
        taken = self._taken
        if c.port and not _port_free(c.port):
            raise RuntimeError(f"--port {c.port} is in use")
        gw_port = c.port or free_ports(1, taken)
        taken.add(gw_port)
        if c.http_port > 0 and not _port_free(c.http_port):
            raise RuntimeError(f"--http-port {c.http_port} is in use")
        http_port = c.http_port if c.http_port != 0 else free_ports(1, taken)
        taken.add(http_port)

        def metrics(n: int, offset: int) -> int:
            if c.metrics_port < 0:
                return -1
            if c.metrics_port == 0:
                return free_ports(n, taken)
            return c.metrics_port + offset

        server_tls, worker_tls, gateway_tls = [], [], []
        if c.tls_dir:
            from gateway.dev_tls import ensure_dev_tls

            self.tls = t = ensure_dev_tls(c.tls_dir)
            server_tls = ["--tls-cert", str(t.cert), "--tls-key", str(t.key),
                          "--tls-client-ca", str(t.ca)]
            worker_tls = [*server_tls, "--tls-ca", str(t.ca)]
            gateway_tls = ["--tls-ca", str(t.ca), "--tls-client-cert", str(t.cert),
                           "--tls-client-key", str(t.key)]
        grammar = f"{_HOST}:{free_ports(1, taken)}"
        g_metrics = metrics(1, 0)
        grammar_args = [
            "grammar_service", "--host", _HOST, "--port", grammar.rsplit(":", 1)[1],
            "--model", model_dir, "--metrics-port", str(g_metrics),
            *(["--cache-dir", c.cache_dir] if c.cache_dir else []), *server_tls]
        self._spawn("grammar-service", "grammar-service", lambda: grammar_args, [grammar])
        self.addresses["grammar-service"] = [grammar]
        self._metrics_url("grammar-service", g_metrics)
        gw_metrics = metrics(c.gateways, 1)
        group_flags = []
        for g in range(c.groups):
            base = free_ports(c.tp, taken)
            w_metrics = metrics(c.tp, 1 + c.gateways + g * c.tp)
            ranks = [f"{_HOST}:{base + r}" for r in range(c.tp)]
            group_args = [
                "gpu_worker.launch", "--tp", str(c.tp), "--host", _HOST, "--port", str(base),
                "--metrics-port", str(w_metrics), "--model", model_dir,
                "--grammar-service", grammar, "--device", c.device, "--slots", str(c.slots),
                # CUDA: group g's ranks on devices g*tp, g*tp+1, ... (shared when fewer)
                "--gpu-offset", str(g * c.tp),
                *(["--max-model-len", str(c.max_model_len)] if c.max_model_len else []),
                *worker_tls]
            self._spawn(f"group{g}", "group", self._with_rendezvous(group_args), ranks)
            self.addresses[f"group{g}"] = ranks
            for r in range(c.tp):
                self._metrics_url(f"group{g} rank {r}", w_metrics + r if w_metrics >= 0 else -1)
            group_flags += ["--group", ",".join(ranks)]
        gateway = f"{_HOST}:{gw_port}"
        for i in range(c.gateways):
            name = "gateway" if c.gateways == 1 else f"gateway{i}"
            port = gw_metrics + i if gw_metrics >= 0 else -1
            gateway_args = [
                "gateway", "--host", _HOST, "--port", str(gw_port), "--grammar-service", grammar,
                *group_flags, "--model", model_dir, "--metrics-port", str(port),
                "--max-queue", str(c.max_queue), "--http-port", str(http_port), *gateway_tls,
                *(["--auth-tokens", c.auth_tokens] if c.auth_tokens else []),
                "--client-max-streams", str(c.client_max_streams),
                "--client-max-queued", str(c.client_max_queued),
                "--drain-timeout", str(c.drain_timeout),
                "--unavailable-wait", str(c.unavailable_wait)]
            self._spawn(name, "gateway", lambda a=gateway_args: a, [gateway])
            self._metrics_url(name, port)
            if c.gateways > 1 and port >= 0:
                self.gateway_ready.append(f"http://{_HOST}:{port}/metrics")
        self.addresses["gateway"] = [gateway]
        if http_port >= 0:
            self.http_url = f"http://{_HOST}:{http_port}/v1"

    def _with_rendezvous(self, args: list[str]) -> Callable[[], list[str]]:
        """A group's command with a rendezvous port of its own, new at every start (the old
        store's port may still be held while its ranks die)."""
        def command() -> list[str]:
            return [*args, "--dist-port", str(free_ports(1, self._taken))]
        return command

    def _metrics_url(self, name: str, port: int) -> None:
        if port >= 0:
            self.metrics_urls.append(f"{name}: http://{_HOST}:{port}/metrics")

    def dead_child(self) -> tuple[str, int] | None:
        """(name, exit status) of a child that exited, or None."""
        for child in self.children:
            if child.proc.poll() is not None:
                return child.name, child.proc.returncode
        return None

    def wait_serving(self) -> None:
        """Block until every server answers SERVING. Raises RuntimeError on a dead child
        or after startup_timeout seconds."""
        deadline = time.monotonic() + self.config.startup_timeout
        pending = [a for addrs in self.addresses.values() for a in addrs] + self.gateway_ready
        while pending:
            dead = self.dead_child()
            if dead:
                raise RuntimeError(f"{dead[0]} exited with status {dead[1]} during start-up")
            if self.stopping.is_set():
                raise RuntimeError("stopped during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not serving after {self.config.startup_timeout:.0f} s: "
                                   + ", ".join(pending))
            pending = [a for a in pending if not (_answers(a) if a.startswith("http://")
                                                  else self._serving(a))]
            if pending:
                time.sleep(0.5)

    def _serving(self, address: str, timeout: float = 1.0) -> bool:
        internal = self.tls is not None and address not in self.addresses["gateway"]
        if not internal:
            return check_health(address, timeout=timeout)
        with open(self.tls.ca, "rb") as ca, open(self.tls.cert, "rb") as c, \
                open(self.tls.key, "rb") as k:
            return check_health(address, timeout=timeout, tls_ca=ca.read(),
                                tls_identity=(c.read(), k.read()))

    def supervise(self, now: float | None = None) -> None:
        """One round of supervision: notice dead children, start those whose backoff ended,
        announce restarted ones once they serve. Never raises for a child's failure."""
        now = time.monotonic() if now is None else now
        for child in self.children:
            if child.restart_at is None and child.proc.poll() is not None:
                # Whatever is left of its process group (a group's other ranks) goes too.
                _signal_group(child.proc, signal.SIGKILL)
                if now - child.started >= _STABLE_AFTER:
                    child.failures = 0
                child.failures += 1
                delay = min(_BACKOFF_MAX, _BACKOFF_BASE * 2 ** (child.failures - 1))
                child.restart_at = now + delay
                child.announce = False
                print(f"gramserve up: {child.name} exited with status {child.proc.returncode}; "
                      f"restarting it in {delay:g} s", file=self.err, flush=True)
            elif child.restart_at is not None and now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                child.start()
                child.announce = True
                self._say(f"gramserve up: {child.name} restarted (restart {child.restarts})")
            elif child.announce and all(self._serving(a, 0.5) for a in child.addresses):
                child.announce = False
                self._say(f"gramserve up: {child.name} is serving again")

    def stop(self) -> None:
        """Drain and stop in dependency order: gateways (they finish running streams for up
        to drain_timeout seconds), then worker groups, then the grammar service; SIGKILL
        whatever is left of any child's process group."""
        c = self.config
        for kind, timeout in (("gateway", c.drain_timeout + 15.0), ("group", 15.0),
                              ("grammar-service", 10.0)):
            procs = [ch.proc for ch in self.children if ch.kind == kind and ch.proc is not None]
            for proc in procs:
                _signal_group(proc, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for child in self.children:
            if child.proc is not None:
                _signal_group(child.proc, signal.SIGKILL)  # also reaches grandchildren
                child.proc.wait()


def _answers(url: str) -> bool:
    """`url` answers 200 within a second."""
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except (OSError, http.client.HTTPException):
        return False


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def up_main(ns: argparse.Namespace) -> int:
    """Run and supervise the whole system until Ctrl-C/SIGTERM, then drain it (exit 0).
    Exit 1 when it cannot start."""
    try:
        config = UpConfig(
            model=ns.model or None, tp=ns.tp, groups=ns.groups, gateways=ns.gateways,
            slots=ns.slots,
            device=ns.device, port=ns.port, http_port=ns.http_port,
            metrics_port=ns.metrics_port,
            max_model_len=ns.max_model_len, max_queue=ns.max_queue,
            cache_dir=ns.cache_dir or None, startup_timeout=ns.startup_timeout,
            tls_dir=ns.tls_dir or None, auth_tokens=ns.auth_tokens or None,
            client_max_streams=ns.client_max_streams, client_max_queued=ns.client_max_queued,
            drain_timeout=ns.drain_timeout, unavailable_wait=ns.unavailable_wait)
    except ValueError as exc:
        print(f"gramserve up: {exc}", file=sys.stderr)
        return 2
    system = System(config)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: system.stopping.set())
    status = 0
    try:
        system.start()
        system.wait_serving()
        system._say(f"gramserve is up: gateway {system.addresses['gateway'][0]}")
        if system.http_url:
            system._say(f"  OpenAI-compatible HTTP API: {system.http_url}")
        for name, addrs in system.addresses.items():
            if name.startswith("group"):
                system._say(f"  {name} ranks: {','.join(addrs)}")
        for url in system.metrics_urls:
            system._say(f"  metrics {url}")
        system._say("Ctrl-C stops everything (after draining running requests).")
        while not system.stopping.wait(0.2):
            system.supervise()
    except RuntimeError as exc:
        print(f"gramserve up: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        system._say("gramserve up: draining (gateways, then workers, then the grammar service)")
        system.stop()
        system._say("gramserve stopped.")
    return status
