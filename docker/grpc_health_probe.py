"""grpc.health.v1 check over TLS, for Kubernetes exec probes.

Kubelet's native gRPC probe dials plaintext only, so when the chart turns TLS on it runs this
instead: `python grpc_health_probe.py --port P --tls-ca CA [--server-name NAME]`, with
`--tls-cert CERT --tls-key KEY` for a server that requires client certificates (mutual TLS).
Exit status: 0 when the server answers SERVING, 1 when it answers anything else or cannot be
reached, 2 on bad arguments. Uses only grpcio and grpcio-health-checking, so it runs in every
gramserve image without importing the project.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(port: int, ca_pem: bytes | None, server_name: str, service: str, timeout: float,
          host: str = "127.0.0.1", identity: tuple[bytes, bytes] | None = None) -> bool:
    """True when the server on host:port answers SERVING for `service` ("" = overall).

    With `ca_pem` the channel is TLS, trusting only that CA and verifying the certificate
    against `server_name` (the probe dials the pod's own address, which the certificate
    does not name), presenting `identity` (certificate chain PEM, key PEM) when given.
    Never raises for an unreachable or failing server: returns False.
    """
    target = f"{host}:{port}"
    if ca_pem is None:
        ch = grpc.insecure_channel(target)
    else:
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        cert, key = identity if identity else (None, None)
        creds = grpc.ssl_channel_credentials(ca_pem, private_key=key, certificate_chain=cert)
        ch = grpc.secure_channel(target, creds, options)
    with ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"{target}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return False
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{target}: {status}", file=sys.stderr)
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run one check, return the exit status (0 serving, 1 not)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True, help="gRPC port on this pod")
    p.add_argument("--host", default="127.0.0.1", help="address to dial (default 127.0.0.1)")
    p.add_argument("--tls-ca", default=None, help="CA bundle PEM; omit for plaintext")
    p.add_argument("--server-name", default="",
                   help="name the server certificate must carry (default: the dialled host)")
    p.add_argument("--tls-cert", default=None, help="client certificate PEM (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="client private key PEM (mutual TLS)")
    p.add_argument("--service", default="", help="health service name (default: overall)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds (default 5)")
    args = p.parse_args(argv)
    ca = None
    if args.tls_ca:
        with open(args.tls_ca, "rb") as f:
            ca = f.read()
    identity = None
    if args.tls_cert and args.tls_key:
        with open(args.tls_cert, "rb") as c, open(args.tls_key, "rb") as k:
            identity = (c.read(), k.read())
    return 0 if check(args.port, ca, args.server_name, args.service, args.timeout, args.host,
                      identity) else 1


if __name__ == "__main__":
    sys.exit(main())
