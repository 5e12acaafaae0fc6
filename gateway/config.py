"""The gateway process's configuration: flags with GRAMSERVE_* env defaults, checked once."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from protos.rpc import env_default


def parse_groups(values: list[str] | str | None) -> tuple[tuple[str, ...], ...]:
    """Parse `r0,r1[;g2r0,g2r1]` (a string or a list of them) into groups of rank addresses.

    Raises ValueError on an empty group or an address without `host:port`.
    """
    if values is None:
        return ()
    if isinstance(values, str):
        values = [values]
    groups = []
    for value in values:
        for part in value.split(";"):
            if not part.strip():
                continue
            ranks = tuple(a.strip() for a in part.split(","))
            for addr in ranks:
                host, sep, port = addr.rpartition(":")
                if not sep or not host or not port.isdigit():
                    raise ValueError(f"--group: {addr!r} is not host:port")
            groups.append(ranks)
    return tuple(groups)


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway process is told at start-up. Checked when built."""

    grammar_service: str
    groups: tuple[tuple[str, ...], ...]
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    # The OpenAI-compatible HTTP front (gateway/openai_api.py): -1 off, 0 a free port. The
    # flag defaults to 8000; a config built in code serves no HTTP unless asked.
    http_port: int = -1
    http_host: str | None = None  # None: the gRPC host
    max_queue: int = 64
    metrics_port: int = -1
    health_interval: float = 2.0
    max_request_bytes: int = 4 * 1024 * 1024
    # Seconds a request waits for a worker group to come back when none is usable (within
    # its deadline); 0 fails it at once with UNAVAILABLE.
    unavailable_wait: float = 0.0
    # Seconds running streams may take to finish after SIGTERM (health is NOT_SERVING and
    # new requests are refused meanwhile).
    drain_timeout: float = 30.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    # Presented to the grammar service and the workers when they require client
    # certificates (mutual TLS); needs tls_ca.
    tls_client_cert: str | None = None
    tls_client_key: str | None = None
    metrics_host: str = "127.0.0.1"
    reflection: bool = True
    # Bearer tokens of the public API (gateway/auth.py): a file of `TOKEN CLIENT` lines or
    # `env:NAME`; None serves without authentication.
    auth_tokens: str | None = None
    client_max_streams: int = 0  # per client identity; 0: no limit
    client_max_queued: int = 0
    max_prompt_bytes: int = 1024 * 1024

    def __post_init__(self):
        if not self.grammar_service:
            raise ValueError("--grammar-service is required")
        if not self.groups:
            raise ValueError("at least one --group is required")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if not -1 <= self.http_port <= 65535:
            raise ValueError(f"--http-port must be -1 (off) or in [0, 65535], got {self.http_port}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.health_interval <= 0:
            raise ValueError(f"--health-interval must be > 0, got {self.health_interval}")
        if self.unavailable_wait < 0:
            raise ValueError(f"--unavailable-wait must be >= 0, got {self.unavailable_wait}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if (self.tls_client_cert is None) != (self.tls_client_key is None):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        if self.tls_client_cert is not None and self.tls_ca is None:
            raise ValueError("--tls-client-cert needs --tls-ca (mutual TLS is TLS first)")
        if self.client_max_streams < 0 or self.client_max_queued < 0:
            raise ValueError("--client-max-streams and --client-max-queued must be >= 0")
        if self.max_prompt_bytes < 1:
            raise ValueError(f"--max-prompt-bytes must be >= 1, got {self.max_prompt_bytes}")
        if self.auth_tokens is not None:
            self.token_table()  # ValueError now rather than at the first request
        for name in ("tls_cert", "tls_key", "tls_ca", "tls_client_cert", "tls_client_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"--{name.replace('_', '-')}: no such file {path!r}")

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> GatewayConfig:
        """Build from the namespace of a parser set up by `add_gateway_args`."""
        return cls(
            grammar_service=ns.grammar_service, groups=parse_groups(ns.group),
            model=ns.model or None, host=ns.host, port=ns.port, http_port=ns.http_port,
            http_host=ns.http_host or None, max_queue=ns.max_queue,
            metrics_port=ns.metrics_port, health_interval=ns.health_interval,
            max_request_bytes=ns.max_request_bytes, unavailable_wait=ns.unavailable_wait,
            drain_timeout=ns.drain_timeout, tls_cert=ns.tls_cert or None,
            tls_key=ns.tls_key or None, tls_ca=ns.tls_ca or None,
            tls_client_cert=ns.tls_client_cert or None, tls_client_key=ns.tls_client_key or None,
            metrics_host=ns.metrics_host, reflection=ns.reflection == "on",
            auth_tokens=ns.auth_tokens or None, client_max_streams=ns.client_max_streams,
            client_max_queued=ns.client_max_queued, max_prompt_bytes=ns.max_prompt_bytes)

    def token_table(self):
        """The bearer-token table (gateway.auth.TokenTable), or None when authentication is
        off. ValueError when it cannot be read or parsed."""
        from gateway.auth import TokenTable

        return TokenTable.load(self.auth_tokens) if self.auth_tokens is not None else None

    def tls_identity(self) -> tuple[bytes, bytes] | None:
        """(certificate chain, private key) PEM presented to the grammar service and workers."""
        if self.tls_client_cert is None:
            return None
        with open(self.tls_client_cert, "rb") as c, open(self.tls_client_key, "rb") as k:
            return c.read(), k.read()

    def tls_pair(self) -> tuple[bytes, bytes] | None:
        """(certificate chain, private key) PEM bytes for the server, or None."""
        if self.tls_cert is None:
            return None
        with open(self.tls_cert, "rb") as c, open(self.tls_key, "rb") as k:
            return c.read(), k.read()

    def ca_bytes(self) -> bytes | None:
        """The CA PEM used to reach the grammar service and the workers, or None."""
        if self.tls_ca is None:
            return None
        with open(self.tls_ca, "rb") as f:
            return f.read()


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The `gramserve gateway` flags; every default comes from GRAMSERVE_<FLAG>."""
    env_groups = env_default("group", None)
    p.add_argument("--host", default=env_default("host", "127.0.0.1"),
                   help="address to listen on (GRAMSERVE_HOST)")
    p.add_argument("--port", type=int, default=env_default("port", 50051),
                   help="gRPC port; 0 picks a free one (GRAMSERVE_PORT)")
    p.add_argument("--http-port", type=int, default=env_default("http_port", 8000),
                   help="OpenAI-compatible HTTP API port; -1 off, 0 a free one "
                        "(GRAMSERVE_HTTP_PORT)")
    p.add_argument("--http-host", default=env_default("http_host", ""),
                   help="HTTP listen address; empty: the same as --host (GRAMSERVE_HTTP_HOST)")
    p.add_argument("--grammar-service", default=env_default("grammar_service", ""),
                   help="grammar service address host:port (GRAMSERVE_GRAMMAR_SERVICE)")
    p.add_argument("--group", action="append", default=[env_groups] if env_groups else None,
                   help="one TP group as rank0addr,rank1addr,...; repeat the flag or separate "
                        "groups with ';' (GRAMSERVE_GROUP)")
    p.add_argument("--model", default=env_default("model", ""),
                   help="model directory (tokenizer); empty: the embedded default model "
                        "(GRAMSERVE_MODEL)")
    p.add_argument("--max-queue", type=int, default=env_default("max_queue", 64),
                   help="requests that may wait for a slot; beyond it RESOURCE_EXHAUSTED "
                        "(GRAMSERVE_MAX_QUEUE)")
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", -1),
                   help="Prometheus /metrics port; -1 off, 0 a free one (GRAMSERVE_METRICS_PORT)")
    p.add_argument("--health-interval", type=float, default=env_default("health_interval", 2.0),
                   help="seconds between worker health checks (GRAMSERVE_HEALTH_INTERVAL)")
    p.add_argument("--max-request-bytes", type=int,
                   default=env_default("max_request_bytes", 4 * 1024 * 1024),
                   help="largest accepted GenerateRequest (GRAMSERVE_MAX_REQUEST_BYTES)")
    p.add_argument("--unavailable-wait", type=float, default=env_default("unavailable_wait", 0.0),
                   help="seconds a request waits for a worker group to come back when none is "
                        "healthy, within its deadline; 0 fails it at once with UNAVAILABLE "
                        "(GRAMSERVE_UNAVAILABLE_WAIT)")
    p.add_argument("--drain-timeout", type=float, default=env_default("drain_timeout", 30.0),
                   help="on SIGTERM: seconds running streams may take to finish while health "
                        "says NOT_SERVING and new requests are refused (GRAMSERVE_DRAIN_TIMEOUT)")
    p.add_argument("--tls-cert", default=env_default("tls_cert", ""),
                   help="server certificate chain PEM (GRAMSERVE_TLS_CERT)")
    p.add_argument("--tls-key", default=env_default("tls_key", ""),
                   help="server private key PEM (GRAMSERVE_TLS_KEY)")
    p.add_argument("--tls-ca", default=env_default("tls_ca", ""),
                   help="CA PEM for connections to the grammar service and workers "
                        "(GRAMSERVE_TLS_CA)")
    p.add_argument("--tls-client-cert", default=env_default("tls_client_cert", ""),
                   help="certificate chain PEM presented to the grammar service and workers "
                        "(mutual TLS) (GRAMSERVE_TLS_CLIENT_CERT)")
    p.add_argument("--tls-client-key", default=env_default("tls_client_key", ""),
                   help="private key PEM of --tls-client-cert (GRAMSERVE_TLS_CLIENT_KEY)")
    p.add_argument("--metrics-host", default=env_default("metrics_host", "127.0.0.1"),
                   help="bind address of /metrics; loopback unless set (GRAMSERVE_METRICS_HOST)")
    p.add_argument("--reflection", default=env_default("reflection", "on"), choices=("on", "off"),
                   help="gRPC server reflection (GRAMSERVE_REFLECTION)")
    p.add_argument("--auth-tokens", default=env_default("auth_tokens", ""),
                   help="bearer tokens of the public API: a file of `TOKEN CLIENT` lines, or "
                        "env:NAME to read them from a variable; empty: no authentication "
                        "(GRAMSERVE_AUTH_TOKENS)")
    p.add_argument("--client-max-streams", type=int,
                   default=env_default("client_max_streams", 0),
                   help="requests one client may run at once; more wait in the queue; 0 no "
                        "limit (GRAMSERVE_CLIENT_MAX_STREAMS)")
    p.add_argument("--client-max-queued", type=int, default=env_default("client_max_queued", 0),
                   help="requests one client may have queued; beyond RESOURCE_EXHAUSTED; 0 no "
                        "limit (GRAMSERVE_CLIENT_MAX_QUEUED)")
    p.add_argument("--max-prompt-bytes", type=int,
                   default=env_default("max_prompt_bytes", 1024 * 1024),
                   help="largest prompt in UTF-8 bytes (prompt text, or chat messages and tools "
                        "together), refused before tokenising (GRAMSERVE_MAX_PROMPT_BYTES)")
