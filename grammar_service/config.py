"""Configuration of one grammar-service process: flags with GRAMSERVE_* env defaults."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from grammar_service.specs import DEFAULT_MAX_SPEC_BYTES
from protos.rpc import env_default


@dataclass(frozen=True)
class GrammarServiceConfig:
    """Everything a grammar-service process is started with. Checked when built.

    model: checkpoint directory; "" is the embedded default model. cache_dir: "" keeps the
    cache in memory only. metrics_port: -1 off, 0 any free port. compile_memory_mb: address
    space a compile process may add to its start-up size (0: no cap). Raises ValueError
    naming the bad flag.
    """

    host: str = "127.0.0.1"
    port: int = 50052
    model: str = ""
    cache_dir: str = ""
    cache_bytes: int = 512 * 1024 * 1024
    cache_dir_bytes: int = 4 * 1024 * 1024 * 1024
    metrics_port: int = -1
    compile_workers: int = 2
    compile_threads: int = 1
    compile_timeout: float = 30.0
    compile_memory_mb: int = 4096
    compile_short_workers: int = 1
    compile_short_seconds: float = 1.0
    compile_short_memory_mb: int = 1024
    compile_memory_budget_mb: int = 0
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    metrics_host: str = "127.0.0.1"
    reflection: str = "on"
    drain_seconds: float = 5.0

    def __post_init__(self):
        checks = [
            (0 <= self.port <= 65535, "--port must be in [0, 65535]"),
            (-1 <= self.metrics_port <= 65535, "--metrics-port must be -1 (off) or a port"),
            (self.cache_bytes >= 0, "--cache-bytes must be >= 0"),
            (self.cache_dir_bytes >= 0, "--cache-dir-bytes must be >= 0"),
            (self.compile_workers >= 1, "--compile-workers must be >= 1"),
            (self.compile_threads >= 1, "--compile-threads must be >= 1"),
            (self.compile_timeout > 0, "--compile-timeout must be > 0"),
            (self.compile_memory_mb >= 0, "--compile-memory-mb must be >= 0"),
            (self.compile_short_workers >= 0, "--compile-short-workers must be >= 0"),
            (self.compile_short_seconds > 0, "--compile-short-seconds must be > 0"),
            (self.compile_short_memory_mb > 0, "--compile-short-memory-mb must be > 0"),
            (self.compile_memory_budget_mb >= 0, "--compile-memory-budget-mb must be >= 0"),
            (self.max_spec_bytes >= 1, "--max-spec-bytes must be >= 1"),
            (bool(self.tls_cert) == bool(self.tls_key),
             "--tls-cert and --tls-key must be given together"),
            (self.drain_seconds >= 0, "--drain-seconds must be >= 0"),
            (not self.tls_client_ca or bool(self.tls_cert),
             "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)"),
            (self.reflection in ("on", "off"), "--reflection must be on or off"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def parse_config(argv: list[str] | None = None) -> GrammarServiceConfig:
    """Build the config from `argv` (None: sys.argv); each flag defaults to GRAMSERVE_<FLAG>.

    Exits (argparse) on a malformed flag; raises ValueError on a value out of range.
    """
    d = GrammarServiceConfig()
    p = argparse.ArgumentParser(prog="gramserve grammar-service",
                                description="Compile and cache grammars for gramserve.")
    p.add_argument("--host", default=env_default("host", d.host))
    p.add_argument("--port", type=int, default=env_default("port", d.port))
    p.add_argument("--model", default=env_default("model", d.model),
                   help="model directory (Hugging Face layout); empty: the default model")
    p.add_argument("--cache-dir", default=env_default("cache_dir", d.cache_dir),
                   help="directory that keeps compiled grammars across restarts")
    p.add_argument("--cache-bytes", type=int, default=env_default("cache_bytes", d.cache_bytes),
                   help="bound on the in-memory cache, in serialized bytes")
    p.add_argument("--cache-dir-bytes", type=int,
                   default=env_default("cache_dir_bytes", d.cache_dir_bytes),
                   help="bound on the files in --cache-dir, least recently used deleted "
                        "first; 0: no bound")
    p.add_argument("--metrics-port", type=int,
                   default=env_default("metrics_port", d.metrics_port),
                   help="Prometheus /metrics port; -1 off, 0 any free port")
    p.add_argument("--compile-workers", type=int,
                   default=env_default("compile_workers", d.compile_workers))
    p.add_argument("--compile-threads", type=int,
                   default=env_default("compile_threads", d.compile_threads),
                   help="xgrammar threads per compile")
    p.add_argument("--compile-timeout", type=float,
                   default=env_default("compile_timeout", d.compile_timeout),
                   help="per-compile deadline, seconds")
    p.add_argument("--compile-memory-mb", type=int,
                   default=env_default("compile_memory_mb", d.compile_memory_mb),
                   help="memory a compile may use beyond its process's start-up size; 0: no cap")
    p.add_argument("--compile-short-workers", type=int,
                   default=env_default("compile_short_workers", d.compile_short_workers),
                   help="processes every compile tries first, for --compile-short-seconds "
                        "under --compile-short-memory-mb; one that needs more moves to the "
                        "--compile-workers processes, so short compiles never wait for long "
                        "ones (0: one lane)")
    p.add_argument("--compile-short-seconds", type=float,
                   default=env_default("compile_short_seconds", d.compile_short_seconds))
    p.add_argument("--compile-short-memory-mb", type=int,
                   default=env_default("compile_short_memory_mb", d.compile_short_memory_mb))
    p.add_argument("--compile-memory-budget-mb", type=int,
                   default=env_default("compile_memory_budget_mb", d.compile_memory_budget_mb),
                   help="bound on the memory caps of the compiles running at once; 0: every "
                        "process at its cap")
    p.add_argument("--max-spec-bytes", type=int,
                   default=env_default("max_spec_bytes", d.max_spec_bytes))
    p.add_argument("--tls-cert", default=env_default("tls_cert", d.tls_cert))
    p.add_argument("--tls-key", default=env_default("tls_key", d.tls_key))
    p.add_argument("--tls-client-ca", default=env_default("tls_client_ca", d.tls_client_ca),
                   help="CA PEM client certificates must be signed by: mutual TLS, plaintext "
                        "and other certificates refused")
    p.add_argument("--metrics-host", default=env_default("metrics_host", d.metrics_host),
                   help="bind address of /metrics (loopback unless set)")
    p.add_argument("--reflection", default=env_default("reflection", d.reflection),
                   choices=("on", "off"), help="gRPC server reflection")
    p.add_argument("--drain-seconds", type=float,
                   default=env_default("drain_seconds", d.drain_seconds),
                   help="grace for running calls on SIGTERM")
    args = p.parse_args(argv)
    return GrammarServiceConfig(**{k: v for k, v in vars(args).items()})
