"""gRPC plumbing shared by every gramserve server and client.

- `ServiceError` and its subclasses: raise them from domain code; one interceptor maps them
  to gRPC status codes, so servicers stay thin translators.
- `create_server`: a grpc.Server with the standard health service and server reflection.
- `env_default`: `GRAMSERVE_*` environment variables as command-line flag defaults.
- `start_metrics_server`: Prometheus `/metrics` over HTTP for one registry.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc

log = logging.getLogger(__name__)

# gRPC's default 4 MiB is too small for large prompts; compiled grammars are streamed.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Clients reconnect to a restarted server within about a second: gRPC's default backoff
# grows to two minutes, which would keep a restarted worker group or grammar service out of
# use long after it serves again.
_CLIENT_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class ServiceError(Exception):
    """An error a caller caused or must handle, carried to the client as a gRPC status."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a servicer's exception becomes: its own for a ServiceError, else INTERNAL
    (logged with its traceback)."""
    if isinstance(exc, ServiceError):
        return exc.code, str(exc)
    log.exception("unhandled error in rpc")
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    context.abort(*_status(exc))


class _ErrorMapper(grpc.ServerInterceptor):
    """Turns ServiceError into its status code and any other exception into INTERNAL."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def wrap_unary(fn):
            def call(request, context):
                try:
                    return fn(request, context)
                except ServiceError as exc:
                    _abort(context, exc)
                except Exception as exc:
                    if context.code() is not None:  # already aborted by the servicer
                        raise
                    _abort(context, exc)
            return call

        def wrap_stream(fn):
            def call(request, context):
                try:
                    yield from fn(request, context)
                except ServiceError as exc:
                    _abort(context, exc)
                except Exception as exc:
                    if context.code() is not None:
                        raise
                    _abort(context, exc)
            return call

        if handler.unary_unary:
            return handler._replace(unary_unary=wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=wrap_stream(handler.unary_stream))
        return handler


class _AioErrorMapper(grpc.aio.ServerInterceptor):
    """The asyncio twin of _ErrorMapper, for unary-unary and unary-stream handlers."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        async def _abort_aio(context, exc):
            await context.abort(*_status(exc))

        def wrap_unary(fn):
            async def call(request, context):
                try:
                    return await fn(request, context)
                except ServiceError as exc:
                    await _abort_aio(context, exc)
                except Exception as exc:
                    if context.code() is not None:
                        raise
                    await _abort_aio(context, exc)
            return call

        def wrap_stream(fn):
            async def call(request, context):
                try:
                    async for item in fn(request, context):
                        yield item
                except ServiceError as exc:
                    await _abort_aio(context, exc)
                except Exception as exc:
                    if context.code() is not None:
                        raise
                    await _abort_aio(context, exc)
            return call

        if handler.unary_unary:
            return handler._replace(unary_unary=wrap_unary(handler.unary_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=wrap_stream(handler.unary_stream))
        return handler


async def create_aio_server(
    register: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.aio.Server, int, Any]:
    """The asyncio version of `create_server` (no thread pool: one event loop serves every
    stream); returns (server, port, health servicer). Call `await health.set(...)` or
    `set_serving_aio` to change the health status."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server(interceptors=[_AioErrorMapper()], options=CHANNEL_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    bound = _bind(server, f"{host}:{port}", tls)
    await server.start()
    await set_serving_aio(health_servicer, names[1:], True)
    return server, bound, health_servicer


async def set_serving_aio(health_servicer, names: Iterable[str], serving: bool) -> None:
    """`set_serving` for the asyncio health servicer."""
    from grpc_health.v1 import health_pb2

    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *names]:
        await health_servicer.set(name, status)


def create_server(
    register: Iterable[tuple[Callable[[Any, grpc.Server], None], Any, str]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    tls: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.Server, int, Any]:
    """Build and start a server with health and reflection; return (server, port, health).

    `register` lists (add_XServicer_to_server, servicer, full service name). Port 0 picks a
    free port (tests). `tls` is (cert chain PEM, private key PEM). Every listed service is
    set SERVING in the health service; callers flip it to NOT_SERVING when they lose a
    dependency. Raises RuntimeError when the port cannot be bound.
    """
    # Imported here so that modules needing only env_default or the errors (the worker's
    # benchmarks on a bare GPU machine, say) do not need the health and reflection packages.
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[_ErrorMapper()],
        options=CHANNEL_OPTIONS,
    )
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    bound = _bind(server, f"{host}:{port}", tls)
    server.start()
    for name in ["", *names[1:]]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def _bind(server, address: str, tls: tuple[bytes, bytes] | None) -> int:
    """Add the listening port (TLS when `tls` is (cert chain, key)); return the bound port."""
    if tls:
        cert_chain, private_key = tls
        bound = server.add_secure_port(
            address, grpc.ssl_server_credentials([(private_key, cert_chain)]))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot bind {address}")
    return bound


def set_serving(health_servicer, names: Iterable[str], serving: bool) -> None:
    """Set the overall status and each named service SERVING or NOT_SERVING."""
    from grpc_health.v1 import health_pb2

    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *names]:
        health_servicer.set(name, status)


def channel(address: str, *, tls_ca: bytes | None = None) -> grpc.Channel:
    """A client channel with gramserve's message limits (TLS when a CA PEM is given)."""
    if tls_ca is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), _CLIENT_OPTIONS)
    return grpc.insecure_channel(address, _CLIENT_OPTIONS)


def aio_channel(address: str, *, tls_ca: bytes | None = None) -> grpc.aio.Channel:
    """An asyncio client channel with gramserve's message limits (TLS when a CA is given)."""
    if tls_ca is not None:
        return grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(tls_ca),
                                       _CLIENT_OPTIONS)
    return grpc.aio.insecure_channel(address, _CLIENT_OPTIONS)


def check_health(address: str, timeout: float = 2.0, service: str = "") -> bool:
    """True when the server at `address` answers SERVING for `service` ("" = overall)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def env_default(name: str, default: Any) -> Any:
    """The value of GRAMSERVE_<NAME> (upper-cased, '-' → '_') or `default`.

    Returned as a string when set; argparse converts it with the flag's `type`.
    """
    return os.environ.get("GRAMSERVE_" + name.upper().replace("-", "_"), default)


def start_metrics_server(port: int, registry, host: str = "0.0.0.0"):
    """Serve `/metrics` for `registry` on `port` (0 picks one); return (server, port).

    A port of -1 disables metrics and returns (None, -1).
    """
    if port < 0:
        return None, -1
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
