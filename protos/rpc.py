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
import re
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

    def __init__(self, message: str, *, field: str | None = None,
                 retry_after: float | None = None):
        self.field = field
        # Seconds the caller should wait before trying again: trailing metadata
        # `retry-after` on gRPC, the `Retry-After` header on HTTP.
        self.retry_after = retry_after
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


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


def _retry_metadata(exc: BaseException) -> tuple[tuple[str, str], ...] | None:
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is None:
        return None
    return (("retry-after", f"{max(1, round(retry_after))}"),)


# A source location as C++ libraries (gloo, NCCL, c10) and tracebacks print them:
# `[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534]`, `/usr/lib/x/y.py:12`, ...
_EXT = r"\.(?:cc|cpp|cxx|c|h|hpp|cu|cuh|py|pyx|so)"
_SOURCE_REF = re.compile(
    r"(?<![\w:/.])\[?(?:"
    r"(?:[A-Za-z]:)?[\w.~+-]*(?:[/\\][\w.~+-]+)+" + _EXT + r"(?::\d+)*"  # a path
    r"|[\w~+-]+" + _EXT + r"(?::\d+)+"  # a bare file name with its line
    r")(?![\w.])\]?:?[ \t]*")


def public_message(text: str) -> str:
    """`text` without internal source locations (file paths and `file.cc:123` references
    that libraries put into their exception messages): what a client may read."""
    return _SOURCE_REF.sub("", text).strip() or "internal error"


def _status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status a servicer's exception becomes: its own for a ServiceError, else INTERNAL
    (logged with its traceback). The message never carries internal source paths."""
    if isinstance(exc, ServiceError):
        return exc.code, public_message(str(exc))
    log.exception("unhandled error in rpc")
    return grpc.StatusCode.INTERNAL, public_message(
        f"internal error: {type(exc).__name__}: {exc}")


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    metadata = _retry_metadata(exc)
    if metadata:
        context.set_trailing_metadata(metadata)
    context.abort(*_status(exc))


class _Refused:
    """A request whose bytes were refused while decoding; the handler raises `error`."""

    def __init__(self, error: ServiceError):
        self.error = error


def _checked_deserializer(deserialize):
    """`deserialize` that turns an undecodable request (a string that is not UTF-8) or one
    with two members of a oneof into a _Refused naming the field, instead of the INTERNAL
    status gRPC gives a deserializer's exception."""
    from google.protobuf.message import DecodeError

    from protos import wire

    descriptor = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    if descriptor is None:
        return deserialize

    def parse(data: bytes):
        try:
            request = deserialize(data)
        except DecodeError as exc:
            field = wire.bad_utf8_field(descriptor, data)
            if field:
                return _Refused(InvalidArgument("is not valid UTF-8", field=field))
            return _Refused(InvalidArgument(
                f"not a valid {descriptor.full_name}: {exc}", field="request"))
        conflict = wire.oneof_conflict(descriptor, data)
        if conflict:
            return _Refused(InvalidArgument(conflict))
        return request
    return parse


def _with_checked_request(handler, wrap_unary, wrap_stream):
    """The handler with its request checked while decoding and its behaviour wrapped."""
    if handler.unary_unary:
        return handler._replace(
            request_deserializer=_checked_deserializer(handler.request_deserializer),
            unary_unary=wrap_unary(handler.unary_unary))
    if handler.unary_stream:
        return handler._replace(
            request_deserializer=_checked_deserializer(handler.request_deserializer),
            unary_stream=wrap_stream(handler.unary_stream))
    return handler


class _ErrorMapper(grpc.ServerInterceptor):
    """Turns ServiceError into its status code and any other exception into INTERNAL."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def wrap_unary(fn):
            def call(request, context):
                try:
                    if isinstance(request, _Refused):
                        raise request.error
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
                    if isinstance(request, _Refused):
                        raise request.error
                    yield from fn(request, context)
                except ServiceError as exc:
                    _abort(context, exc)
                except Exception as exc:
                    if context.code() is not None:
                        raise
                    _abort(context, exc)
            return call

        return _with_checked_request(handler, wrap_unary, wrap_stream)


class _AioErrorMapper(grpc.aio.ServerInterceptor):
    """The asyncio twin of _ErrorMapper, for unary-unary and unary-stream handlers."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None

        async def _abort_aio(context, exc):
            metadata = _retry_metadata(exc)
            await context.abort(*_status(exc), trailing_metadata=metadata or ())

        def wrap_unary(fn):
            async def call(request, context):
                try:
                    if isinstance(request, _Refused):
                        raise request.error
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
                    if isinstance(request, _Refused):
                        raise request.error
                    async for item in fn(request, context):
                        yield item
                except ServiceError as exc:
                    await _abort_aio(context, exc)
                except Exception as exc:
                    if context.code() is not None:
                        raise
                    await _abort_aio(context, exc)
            return call

        return _with_checked_request(handler, wrap_unary, wrap_stream)


class _AioAuthenticator(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks unless `authenticate(authorization metadata)`
    accepts it (it raises a ServiceError, UNAUTHENTICATED, otherwise)."""

    _OPEN = "/grpc.health.v1.Health/"

    def __init__(self, authenticate: Callable[[str | None], str]):
        self._authenticate = authenticate

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self._OPEN):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            self._authenticate(metadata.get("authorization"))
        except ServiceError as exc:
            error = exc
        else:
            return handler

        async def refuse(request_or_iterator, context):
            await context.abort(*_status(error))

        async def refuse_stream(request_or_iterator, context):
            await context.abort(*_status(error))
            yield  # pragma: no cover  (an async generator, as the handler kind requires)

        if handler.unary_unary:
            return handler._replace(unary_unary=refuse)
        if handler.unary_stream:
            return handler._replace(unary_stream=refuse_stream)
        if handler.stream_unary:
            return handler._replace(stream_unary=refuse)
        return handler._replace(stream_stream=refuse_stream)


async def create_aio_server(
    register: Iterable[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: tuple[bytes, bytes] | None = None,
    client_ca: bytes | None = None,
    reflection: bool = True,
    authenticate: Callable[[str | None], str] | None = None,
) -> tuple[grpc.aio.Server, int, Any]:
    """The asyncio version of `create_server` (no thread pool: one event loop serves every
    stream); returns (server, port, health servicer). Call `await health.set(...)` or
    `set_serving_aio` to change the health status. `authenticate`, when given, is called with
    each call's `authorization` metadata (None when absent) for every method but the health
    service's, and refuses the call by raising a ServiceError (Unauthenticated)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    interceptors = [_AioErrorMapper()]
    if authenticate is not None:
        interceptors.insert(0, _AioAuthenticator(authenticate))
    server = grpc.aio.server(interceptors=interceptors, options=CHANNEL_OPTIONS)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
    for add, servicer, name in register:
        add(servicer, server)
        names.append(name)
    if reflection:
        _enable_reflection(names, server)
    bound = _bind(server, f"{host}:{port}", tls, client_ca)
    await server.start()
    await set_serving_aio(health_servicer, names[1:], True)
    return server, bound, health_servicer


def _enable_reflection(names: list[str], server) -> None:
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)


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
    client_ca: bytes | None = None,
    reflection: bool = True,
) -> tuple[grpc.Server, int, Any]:
    """Build and start a server with health and reflection; return (server, port, health).

    `register` lists (add_XServicer_to_server, servicer, full service name). Port 0 picks a
    free port (tests). `tls` is (cert chain PEM, private key PEM); with `client_ca` too, the
    server requires every client to present a certificate signed by that CA (mutual TLS),
    and refuses plaintext. `reflection` False leaves server reflection off. Every listed service is
    set SERVING in the health service; callers flip it to NOT_SERVING when they lose a
    dependency. Raises RuntimeError when the port cannot be bound.
    """
    # Imported here so that modules needing only env_default or the errors (the worker's
    # benchmarks on a bare GPU machine, say) do not need the health and reflection packages.
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

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
    if reflection:
        _enable_reflection(names, server)
    bound = _bind(server, f"{host}:{port}", tls, client_ca)
    server.start()
    for name in ["", *names[1:]]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, health_servicer


def _bind(server, address: str, tls: tuple[bytes, bytes] | None,
          client_ca: bytes | None = None) -> int:
    """Add the listening port (TLS when `tls` is (cert chain, key); mutual TLS when
    `client_ca` is given too); return the bound port."""
    if client_ca is not None and not tls:
        raise ValueError("a client CA (mutual TLS) needs the server's own certificate and key")
    if tls:
        cert_chain, private_key = tls
        bound = server.add_secure_port(address, grpc.ssl_server_credentials(
            [(private_key, cert_chain)], root_certificates=client_ca,
            require_client_auth=client_ca is not None))
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


def _credentials(tls_ca: bytes, identity: tuple[bytes, bytes] | None):
    cert_chain, private_key = identity if identity else (None, None)
    return grpc.ssl_channel_credentials(root_certificates=tls_ca, private_key=private_key,
                                        certificate_chain=cert_chain)


def _bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call of a blocking channel."""

    def __init__(self, token: str):
        self._metadata = _bearer(token)

    def _details(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self._metadata))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


class AioBearerInterceptor(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Adds `authorization: Bearer TOKEN` to every call of an asyncio channel."""

    def __init__(self, token: str):
        self._metadata = _bearer(token)

    def _details(self, details):
        return details._replace(metadata=grpc.aio.Metadata(
            *(details.metadata or ()), *self._metadata))

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


def channel(address: str, *, tls_ca: bytes | None = None,
            tls_identity: tuple[bytes, bytes] | None = None,
            token: str | None = None) -> grpc.Channel:
    """A client channel with gramserve's message limits: TLS when a CA PEM is given,
    presenting `tls_identity` (certificate chain PEM, private key PEM) to a server that
    requires client certificates (mutual TLS); `token` is sent as a bearer token."""
    if tls_ca is not None:
        ch = grpc.secure_channel(address, _credentials(tls_ca, tls_identity), _CLIENT_OPTIONS)
    else:
        ch = grpc.insecure_channel(address, _CLIENT_OPTIONS)
    return grpc.intercept_channel(ch, BearerInterceptor(token)) if token else ch


def aio_channel(address: str, *, tls_ca: bytes | None = None,
                tls_identity: tuple[bytes, bytes] | None = None,
                token: str | None = None) -> grpc.aio.Channel:
    """An asyncio client channel; arguments as `channel`."""
    interceptors = [AioBearerInterceptor(token)] if token else None
    if tls_ca is not None:
        return grpc.aio.secure_channel(address, _credentials(tls_ca, tls_identity),
                                       _CLIENT_OPTIONS, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, _CLIENT_OPTIONS, interceptors=interceptors)


def check_health(address: str, timeout: float = 2.0, service: str = "", *,
                 tls_ca: bytes | None = None,
                 tls_identity: tuple[bytes, bytes] | None = None) -> bool:
    """True when the server at `address` answers SERVING for `service` ("" = overall)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel(address, tls_ca=tls_ca, tls_identity=tls_identity) as ch:
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


class ConstantLabels:
    """A view of a registry that adds the same labels to every sample (a worker's `rank`:
    the ranks of a group share a pod, so the scrape target alone does not tell them apart)."""

    def __init__(self, registry, **labels: str):
        self._registry = registry
        self._labels = labels

    def collect(self):
        from prometheus_client.metrics_core import Metric

        for family in self._registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self._labels, **s.labels})
                           for s in family.samples]
            yield out

    def restricted_registry(self, names):
        return ConstantLabels(self._registry.restricted_registry(names), **self._labels)


def register_build_info(registry, component: str, **versions: str) -> None:
    """`gramserve_build_info{component, version, python, ...versions} 1` on `registry`: which
    build a process runs, for dashboards and alerts on mixed versions."""
    import platform
    from importlib import metadata

    from prometheus_client import Gauge

    try:
        version = metadata.version("gramserve")
    except metadata.PackageNotFoundError:
        version = "unknown"
    labels = {"component": component, "version": version,
              "python": platform.python_version(), **versions}
    Gauge("gramserve_build_info", "The running build: gramserve and library versions.",
          list(labels), registry=registry).labels(**labels).set(1)


def start_metrics_server(port: int, registry, host: str = "127.0.0.1"):
    """Serve `/metrics` for `registry` on host:`port` (0 picks one); return (server, port).
    Loopback unless a host is given: metrics say a lot about the traffic.

    A port of -1 disables metrics and returns (None, -1).
    """
    if port < 0:
        return None, -1
    from prometheus_client import disable_created_metrics, start_http_server

    disable_created_metrics()  # `_created` series double the series count for nothing

    server, thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
