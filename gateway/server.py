"""The Gateway gRPC service: validate, tokenise, compile, route, relay. Thin over `Runner`.

The whole gateway runs on one asyncio event loop (grpc.aio): every client stream is a task,
not a thread, and the worker groups are reached over one Session stream per rank
(gateway/workers.py). `create_server(config)` starts that loop on its own thread and builds
everything on it (worker links, health monitor, gRPC server); `main(argv)` is
`gramserve gateway`. The OpenAI-compatible HTTP API (gateway/openai_api.py) is a uvicorn
task on the same loop, over `GatewayServicer.generate`, the path gRPC's Generate takes.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import secrets
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from gateway import auth
from gateway.chat import chat_prompt_ids, parse_tools
from gateway.choices import MAX_N, choice_requests, merged
from gateway.config import GatewayConfig, add_gateway_args
from gateway.generation import Job, Runner, service_error
from gateway.grammar_refs import GrammarRefs
from gateway.health import Readiness
from gateway.metrics import GatewayMetrics
from gateway.openai_api import create_app, start_http, stop_http
from gateway.router import GroupState, Router
from gateway.validation import (
    Limits,
    check_output_against_schema,
    constraint_kind,
    prompt_bytes,
    validate_constraint,
    validate_request,
)
from gateway.workers import GroupClient, HealthMonitor
from grammar_service.default_model import resolve_model
from grammar_service.vocab import Vocab, load_vocab
from protos import gateway_pb2, gateway_pb2_grpc, grammar_pb2, grammar_pb2_grpc, worker_pb2
from protos.rpc import (
    InvalidArgument,
    NotFound,
    ServiceError,
    Unauthenticated,
    Unavailable,
    aio_channel,
    create_aio_server,
    register_build_info,
    start_metrics_server,
)

log = logging.getLogger(__name__)

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
_GRAMMAR_SERVICE = grammar_pb2.DESCRIPTOR.services_by_name["GrammarService"].full_name
_COMPILE_TIMEOUT = 120.0
_GRAMMAR_CHECK_TIMEOUT = 2.0
# Seconds a compile waits for the grammar service's channel to connect (the channel backs
# off at most 1 s between attempts: protos.rpc).
_GRAMMAR_CONNECT_WAIT = 2.0
# Prompts longer than this (UTF-8 bytes) are tokenised on a thread, off the event loop.
_INLINE_TOKENIZE_BYTES = 4096
_TOKENIZE_THREADS = 2
_SPEC_FIELD = re.compile(r"(?<![\w.])spec(?=[.:\[])")


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Translates the public API into Jobs for the Runner; owns the grammar-service client."""

    def __init__(self, config: GatewayConfig, vocab: Vocab, model_id: str, router: Router,
                 runner: Runner, metrics: GatewayMetrics):
        self._config = config
        self._vocab = vocab
        self._model_id = model_id
        self._router = router
        self._runner = runner
        self._metrics = metrics
        self._limits = Limits(vocab_size=vocab.vocab_size,
                              max_request_bytes=config.max_request_bytes,
                              max_prompt_bytes=config.max_prompt_bytes)
        self._tokens = config.token_table()
        self._grammar_channel = aio_channel(config.grammar_service, tls_ca=config.ca_bytes(),
                                            tls_identity=config.tls_identity())
        self._grammar = grammar_pb2_grpc.GrammarServiceStub(self._grammar_channel)
        self._grammar_health = health_pb2_grpc.HealthStub(self._grammar_channel)
        self.grammar_service_up = False  # until the first check_grammar_service
        self._refs = GrammarRefs()
        self._tokenize_pool = ThreadPoolExecutor(_TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self.draining = False
        self._active = 0  # generate() calls running
        self._idle = asyncio.Event()
        self._idle.set()

    # -- rpcs -----------------------------------------------------------------------------

    async def Generate(self, request, context):
        arrived = time.monotonic()
        if not 0 <= request.n <= MAX_N:
            raise InvalidArgument(f"must be 1 to {MAX_N} (0 means 1), got {request.n}",
                                  field="n")
        client = self.authenticate(_authorization(context))
        if request.n > 1:
            choices = choice_requests(request, request.n)
            async for response in merged(self, choices, context.time_remaining(), client):
                yield response
            return
        async for response in self.generate(request, context.time_remaining(), arrived,
                                            client):
            yield response

    async def CompileGrammar(self, request, context):
        self._check_draining()
        self._check_model(request.model)
        if constraint_kind(request.constraint) == "none":
            raise InvalidArgument("no constraint kind is set", field="constraint")
        validate_constraint(request.constraint)
        ref = await self._compile(request.constraint, context.time_remaining(),
                                  self.authenticate(_authorization(context)))
        return gateway_pb2.CompileGrammarResponse(
            key=ref.key, kind=ref.kind, cached=ref.cached, compile_seconds=ref.compile_seconds,
            unenforced_keywords=list(ref.unenforced_keywords), backend=ref.backend,
            backend_reason=ref.backend_reason)

    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[self.model_info()])

    # -- the API both fronts share (gRPC above, HTTP in gateway/openai_api.py) ----------------

    def authenticate(self, authorization: str | None) -> str:
        """The client identity of an `authorization` value (gRPC metadata or HTTP header):
        the name its bearer token maps to, or "" when authentication is off. Raises
        Unauthenticated without a valid token."""
        if self._tokens is None:
            return ""
        try:
            return self._tokens.authenticate(authorization)
        except auth.Unauthenticated as exc:
            raise Unauthenticated(str(exc)) from None

    async def generate(self, request: gateway_pb2.GenerateRequest, remaining: float | None,
                       arrived: float | None = None,
                       client: str = "") -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Validate, tokenise, compile and run one request: its deltas, then its final.

        `remaining` is the caller's deadline in seconds from `arrived` (None: no deadline).
        `client` is the caller's identity (`authenticate`), for the per-client limits.
        Raises ServiceError (InvalidArgument naming the field, NotFound for another model,
        ResourceExhausted, Unavailable, DeadlineExceeded); counts the request's metrics.
        """
        arrived = time.monotonic() if arrived is None else arrived
        kind = constraint_kind(request.constraint)
        status = "CANCELLED"  # unless the stream ends otherwise (a cancelled task is one)
        self._active += 1
        self._idle.clear()
        try:
            self._check_draining()
            job = await self._job(request, arrived, kind, remaining, client)
            async for response in self._runner.run(job):
                yield response
            status = "OK"
        except ServiceError as exc:
            status = exc.code.name
            raise
        except asyncio.CancelledError:
            raise
        except Exception:
            status = "INTERNAL"
            raise
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()
            self._metrics.requests.labels(kind, status).inc()
            self._metrics.request_seconds.observe(time.monotonic() - arrived)

    def model_info(self) -> gateway_pb2.ModelInfo:
        """The one served model: id, vocabulary, context length (0 until a group reports)."""
        groups = self._router.groups
        known = [g.max_model_len for g in groups if g.max_model_len]
        return gateway_pb2.ModelInfo(
            id=self._model_id, vocab_size=self._vocab.vocab_size,
            max_model_len=min(known) if known else 0, groups=len(groups),
            tp_size=len(groups[0].addresses))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (the OpenAI API's logprob tokens)."""
        return self._vocab.token_bytes(token_id)

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (its tool-call format serves tool_choice "auto")."""
        return self._vocab.chat_template

    @property
    def limits(self) -> Limits:
        """The bounds every request is validated against (the HTTP translation's too)."""
        return self._limits

    def readiness(self) -> Readiness:
        """What the gateway can do now (gateway/health.py): generate, compile, and why."""
        return Readiness(draining=self.draining,
                         healthy_groups=len(self._router.healthy_groups()),
                         groups=len(self._router.groups),
                         grammar_service_up=self.grammar_service_up,
                         cached_grammars=len(self._refs))

    async def check_grammar_service(self) -> bool:
        """Ask the grammar service's health service whether it serves; remember and export
        the answer (`grammar_service_up`). Never raises: no answer is False."""
        try:
            resp = await self._grammar_health.Check(
                health_pb2.HealthCheckRequest(service=_GRAMMAR_SERVICE),
                timeout=_GRAMMAR_CHECK_TIMEOUT)
            up = resp.status == health_pb2.HealthCheckResponse.SERVING
            why = "" if up else "it says NOT_SERVING"
        except grpc.RpcError as exc:
            up, why = False, f"health check failed: {exc.code().name}"
        if up != self.grammar_service_up:
            log.warning("grammar service %s is %s", self._config.grammar_service,
                        "serving: new grammars compile" if up else
                        f"unavailable ({why}): only grammars already compiled serve")
        self.grammar_service_up = up
        self._metrics.grammar_service_up.set(int(up))
        return up

    def start_drain(self) -> None:
        """Refuse new requests (UNAVAILABLE) from now on; running ones go on."""
        self.draining = True
        self._metrics.draining.set(1)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every running request to end; True if they did."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    @property
    def active(self) -> int:
        """Requests running now."""
        return self._active

    async def close(self) -> None:
        await self._grammar_channel.close()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- steps ----------------------------------------------------------------------------

    def _check_draining(self) -> None:
        if self.draining:
            raise Unavailable("this gateway is shutting down (draining its running requests); "
                              "send the request to another gateway replica or retry")

    async def _job(self, request, arrived: float, kind: str, remaining: float | None,
                   client: str = "") -> Job:
        validate_request(request, self._limits)  # bounds the prompt's bytes first
        self._check_model(request.model)
        if prompt_bytes(request) > _INLINE_TOKENIZE_BYTES:
            prompt_ids = await self._tokenize_off_loop(request)
        else:
            prompt_ids = self._tokenize(request)
        self._check_length(prompt_ids)
        sampling = type(request.sampling)()
        sampling.CopyFrom(request.sampling)
        if not sampling.HasField("seed"):
            sampling.seed = secrets.randbits(63)
        stops, include_stop = list(sampling.stop), sampling.include_stop_str_in_output
        del sampling.stop[:]  # stop strings are the gateway's; the worker ignores them
        deadline = arrived + remaining if remaining is not None else None
        # Workers tag slots with the request id, so it must be unique across every client and
        # gateway sharing a group: a client's own id gets a suffix (the client sees its id).
        request_id = request.request_id or uuid.uuid4().hex
        worker_id = f"{request_id}#{uuid.uuid4().hex[:12]}" if request.request_id else request_id
        admit = worker_pb2.AdmitRequest(
            request_id=worker_id, slot=-1,
            prompt_token_ids=prompt_ids, sampling=sampling)
        compile_seconds = 0.0
        if kind != "none":
            t0 = time.monotonic()
            ref = await self._compiled(request.constraint, remaining, client)
            compile_seconds = ref.compile_seconds if ref.cached else time.monotonic() - t0
            admit.grammar_key = ref.key
            admit.grammar_backend = ref.backend
            admit.grammar.CopyFrom(request.constraint)
        return Job(admit=admit, request_id=request_id, kind=kind, stops=stops,
                   include_stop=include_stop, client=client,
                   schema=request.constraint.json_schema if kind == "json_schema" else None,
                   arrived=arrived, compile_seconds=compile_seconds, deadline=deadline,
                   echo_prompt=request.echo_prompt_token_ids)

    def _check_model(self, model: str) -> None:
        if model and model != self._model_id:
            raise NotFound(f"unknown model {model!r}; this gateway serves {self._model_id!r}",
                           field="model")

    async def _tokenize_off_loop(self, request) -> list[int]:
        """Tokenise a long prompt on the tokeniser threads: the event loop keeps serving
        every other request meanwhile (the Rust tokenizer releases the GIL), and at most
        `_TOKENIZE_THREADS` long prompts tokenise at once."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self._tokenize, request)

    def _tokenize(self, request) -> list[int]:
        if request.prompt_token_ids:
            return list(request.prompt_token_ids)
        if request.messages:
            return chat_prompt_ids(self._vocab, request.messages, parse_tools(request.tools_json))
        return self._vocab.encode(request.prompt, add_special_tokens=True)

    def _check_length(self, prompt_ids: list[int]) -> None:
        known = [g.max_model_len for g in self._router.groups if g.max_model_len]
        if known and len(prompt_ids) >= min(known):
            raise InvalidArgument(
                f"the prompt is {len(prompt_ids)} tokens; the context holds {min(known)} "
                "(prompt plus at least one generated token)", field="prompt")

    async def _compiled(self, spec, remaining: float | None,
                        client: str = "") -> grammar_pb2.GrammarRef:
        """The GrammarRef of `spec`: remembered (no round trip), or compiled and remembered."""
        blob = spec.SerializeToString(deterministic=True)
        ref = self._refs.get(blob)
        self._metrics.grammar_refs.labels("hit" if ref is not None else "miss").inc()
        if ref is None:
            ref = await self._compile(spec, remaining, client)
            remembered = grammar_pb2.GrammarRef()
            remembered.CopyFrom(ref)
            remembered.cached = True
            self._refs.put(blob, remembered)
        return ref

    async def _compile(self, spec, remaining: float | None,
                       client: str = "") -> grammar_pb2.GrammarRef:
        timeout = _COMPILE_TIMEOUT if remaining is None else min(remaining, _COMPILE_TIMEOUT)
        if self._grammar_channel.get_state() != grpc.ChannelConnectivity.READY:
            # Not connected (never yet, or backing off after a failed attempt such as a health
            # check made before the service listened): give it a moment to connect rather
            # than failing at once. A service that is down still fails within that moment.
            try:
                await asyncio.wait_for(self._grammar_channel.channel_ready(),
                                       min(timeout, _GRAMMAR_CONNECT_WAIT))
            except asyncio.TimeoutError:
                pass
        try:
            return await self._grammar.Compile(
                grammar_pb2.CompileRequest(spec=spec, client=client), timeout=timeout)
        except grpc.RpcError as exc:
            # The grammar service names its own request's field (`spec.json_schema`); our
            # caller sent it as `constraint`.
            details = _SPEC_FIELD.sub("constraint", exc.details() or "")
            raise service_error(exc.code(), details, "grammar service") from None


def _authorization(context) -> str | None:
    """The `authorization` metadata of a call, or None."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


@dataclass
class Gateway:
    """A running gateway: its event loop thread, bound port and the parts to stop."""

    port: int
    metrics_port: int
    http_port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    _parts: dict = field(default_factory=dict)

    def drain(self, timeout: float) -> bool:
        """Graceful drain, before `stop`: health NOT_SERVING (load balancers move away), new
        requests refused with UNAVAILABLE, running streams go on for up to `timeout`
        seconds. True when every running request finished in time."""
        if not self.thread.is_alive():
            return True
        return asyncio.run_coroutine_threadsafe(self._drain(timeout), self.loop).result(
            timeout + 30)

    async def _drain(self, timeout: float) -> bool:
        servicer = self._parts["servicer"]
        servicer.start_drain()
        await self._parts["update_health"]()
        return await servicer.wait_idle(timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Stop taking requests, let running ones finish for `grace` seconds, close links."""
        if not self.thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._stop(grace), self.loop).result(grace + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if self._parts.get("metrics_server") is not None:
            self._parts["metrics_server"].shutdown()

    async def _stop(self, grace: float) -> None:
        p = self._parts
        if p.get("http") is not None:
            await stop_http(*p["http"], grace)
        await p["server"].stop(grace)
        await p["monitor"].stop()
        await p["servicer"].close()
        for c in p["clients"]:
            await c.close()


async def _build(config: GatewayConfig, registry: CollectorRegistry, gateway: Gateway) -> None:
    metrics = GatewayMetrics(registry)
    register_build_info(registry, "gateway")
    model_dir = resolve_model(config.model)
    vocab = load_vocab(model_dir)
    states = [GroupState(index=i, addresses=g) for i, g in enumerate(config.groups)]
    health_ref: list = []
    published: dict[str, bool] = {}  # health service name -> SERVING, as last set
    servicer_ref: list = []

    def wanted() -> dict[str, bool]:
        # "" and the Gateway service: SERVING while some group is healthy, and never again
        # once a drain began (= the generate capability); each capability under its name.
        readiness = servicer_ref[0].readiness()
        return {"": readiness.generate, SERVICE_NAME: readiness.generate,
                **readiness.serving()}

    health_lock = asyncio.Lock()  # one update at a time: a stale one never lands last

    async def update_health() -> None:
        if not health_ref:
            return
        async with health_lock:
            changed = {k: v for k, v in wanted().items() if published.get(k) != v}
            published.update(changed)
            for name, up in changed.items():
                await health_ref[0].set(name, health_pb2.HealthCheckResponse.SERVING if up
                                        else health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_change(queue_depth: int, in_flight: int, healthy: int) -> None:
        metrics.queue_depth.set(queue_depth)
        metrics.in_flight.set(in_flight)
        metrics.healthy_groups.set(healthy)
        if health_ref and any(published.get(k) != v for k, v in wanted().items()):
            asyncio.get_running_loop().create_task(update_health())

    router = Router(states, config.max_queue, client_streams=config.client_max_streams,
                    client_queued=config.client_max_queued, unavailable_wait=config.unavailable_wait,
                    on_change=on_change)
    clients = [GroupClient(s, config.ca_bytes(), config.tls_identity()) for s in states]
    # The same rounds check the grammar service (the servicer exists before they start).
    monitor = HealthMonitor(router, clients, vocab.fingerprint, config.health_interval,
                            also=[lambda: servicer_ref[0].check_grammar_service()],
                            on_checked=update_health)
    runner = Runner(router, clients, vocab.token_bytes, metrics, monitor.poke,
                    check_output_against_schema)
    # A model named by Hugging Face repo id is served under that id, not its snapshot's hash.
    model_id = config.model if config.model and model_dir.parent.name == "snapshots" \
        else Path(model_dir).name
    servicer = GatewayServicer(config, vocab, model_id, router, runner, metrics)
    servicer_ref.append(servicer)
    if config.http_port >= 0:  # bound before gRPC health can say SERVING
        app = create_app(servicer, config.max_request_bytes)
        http_server, http_task, gateway.http_port = await start_http(
            app, config.http_host or config.host, config.http_port)
        gateway._parts["http"] = (http_server, http_task)
    # Groups are checked before the port is bound: a gateway sharing its port with others
    # (`up --gateways`) takes connections only once it knows its groups.
    await monitor.start()
    server, port, health = await create_aio_server(
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, SERVICE_NAME)],
        host=config.host, port=config.port, tls=config.tls_pair(),
        reflection=config.reflection,
        authenticate=servicer.authenticate if config.auth_tokens is not None else None)
    health_ref.append(health)
    await update_health()
    gateway.port = port
    gateway._parts.update(server=server, monitor=monitor, servicer=servicer, clients=clients,
                          update_health=update_health)


def create_server(config: GatewayConfig, registry: CollectorRegistry | None = None) -> Gateway:
    """Load the vocabulary, connect to the groups, and start serving on config.host:port.

    The gateway runs on an event loop of its own thread; this call returns once it serves.
    Group and grammar-service health are checked once before returning and then every
    `health_interval` seconds; the gateway's health ("" and the Gateway service) is SERVING
    while at least one group is, and each capability (gateway/health.py) has its own. With
    `config.http_port >= 0` the OpenAI-compatible HTTP API serves on the same loop
    (`Gateway.http_port` is its bound port). Raises ValueError for a bad model directory,
    RuntimeError when a port cannot be bound.
    """
    registry = registry if registry is not None else CollectorRegistry()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="gateway-loop", daemon=True)
    thread.start()
    gateway = Gateway(port=0, metrics_port=-1, http_port=-1, loop=loop, thread=thread)
    try:
        asyncio.run_coroutine_threadsafe(_build(config, registry, gateway), loop).result()
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        raise
    metrics_server, gateway.metrics_port = start_metrics_server(config.metrics_port, registry,
                                                                host=config.metrics_host)
    gateway._parts["metrics_server"] = metrics_server
    return gateway


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gramserve gateway", description=__doc__.splitlines()[0])
    add_gateway_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the gateway until SIGTERM/SIGINT; returns the exit status (2 on bad flags)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = GatewayConfig.from_args(args)
    except ValueError as exc:
        print(f"gramserve gateway: {exc}", flush=True)
        return 2
    gw = create_server(config)
    print(f"gateway listening on {config.host}:{gw.port}"
          + (f", OpenAI-compatible HTTP on http://{config.http_host or config.host}:"
             f"{gw.http_port}/v1" if gw.http_port >= 0 else "")
          + (f", metrics on :{gw.metrics_port}/metrics" if gw.metrics_port >= 0 else ""),
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    running = gw._parts["servicer"].active
    print(f"gateway draining: NOT_SERVING, refusing new requests, {running} running "
          f"(up to {config.drain_timeout:g} s)", flush=True)
    finished = gw.drain(config.drain_timeout)
    if not finished:
        print(f"gateway: {gw._parts['servicer'].active} requests still running after the "
              f"drain timeout; cancelling them", flush=True)
    gw.stop(0)
    print("gateway stopped", flush=True)
    return 0
