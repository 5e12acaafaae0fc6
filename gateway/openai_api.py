"""The OpenAI-compatible HTTP API, served on the gateway's own event loop.

`POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`, `GET /health`
(liveness) and `GET /ready` (what works now, gateway/health.py: 200 "ready" or "degraded",
503 "unavailable" while no worker group is healthy or the gateway drains). Each request is
translated (gateway/openai_translate.py, and back by gateway/openai_responses.py) into one GenerateRequest per choice and run through
`GatewayServicer.generate`, the path the gRPC API takes: same validation, tokenisation,
compilation, queue, slots and metrics. There is no second request runner.

Why FastAPI on uvicorn: both are maintained, asyncio-native and run as a task on an event
loop we already own (`uvicorn.Server.serve()` on the gateway loop beside grpc.aio, so an HTTP
request costs no thread and reaches the Runner without crossing loops); Starlette's
StreamingResponse gives server-sent events and cancels the handler when the client goes
away, which releases the slots like a cancelled gRPC stream. Bodies are parsed by hand rather
than by pydantic models so every error names OpenAI's own field (`param`).

n > 1 runs n requests concurrently (each its own slot and matcher; seeds seed, seed+1, ...).
A streamed response starts once every choice has produced its first event, so a request the
gateway refuses (400/404/429/503/504) gets its HTTP status; a failure after that arrives as an
`{"error": ...}` event before `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from gateway import openai_responses as orsp
from gateway import openai_translate as ot
from gateway.choices import Fanout
from gateway.tool_calls import Call, ToolCallParser
from protos import gateway_pb2
from protos.rpc import ServiceError, public_message

log = logging.getLogger(__name__)


def _error_response(err: ot.OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _as_openai(exc: BaseException, plan: ot.Plan | None) -> ot.OpenAIError:
    if isinstance(exc, ot.OpenAIError):
        return exc
    if isinstance(exc, ServiceError):
        return orsp.from_service_error(exc, plan)
    log.error("unhandled error in an HTTP request", exc_info=exc)
    return ot.OpenAIError(500, public_message(f"internal error: {type(exc).__name__}: {exc}"),
                          type="server_error", code="internal_error")


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(fan: Fanout, n: int) -> list[gateway_pb2.Final]:
    finals: list = [None] * n
    left = n
    while left:
        i, event = await fan.next()
        if isinstance(event, Exception):
            raise event
        if event.HasField("final"):
            orsp.check_final(event.final)
            finals[i] = event.final
            left -= 1
    return finals


class _ChatStream:
    """chat.completion.chunk objects for the events of every choice."""

    object = "chat.completion.chunk"

    def __init__(self, plan: ot.Plan, model: str, created: int, token_bytes):
        self.plan, self.model, self.created = plan, model, created
        self.token_bytes = token_bytes
        self.finals: list = [None] * len(plan.requests)
        self._started = [False] * len(plan.requests)
        self._offsets = [0] * len(plan.requests)  # text so far per choice (legacy offsets)
        auto = plan.tool is not None and plan.tool.format is not None
        # tool_choice "auto": each choice's text split into content and calls as it arrives
        self._parsers = [ToolCallParser(plan.tool.format, plan.tool.schemas.keys())
                         for _ in plan.requests] if auto else None
        self._calls: list[list[Call]] = [[] for _ in plan.requests]

    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.plan.id, "object": self.object, "created": self.created,
               "model": self.model, "choices": choices}
        if self.plan.include_usage:
            out["usage"] = usage
        return out

    def _call_id(self, i: int) -> str:
        return orsp.call_id(self.plan, i)

    def events(self, i: int, event: gateway_pb2.GenerateResponse) -> list[dict]:
        if self._parsers is not None:
            return self._auto_events(i, event)
        tool = self.plan.tool
        out = []
        if not self._started[i]:
            self._started[i] = True
            first: dict = {"role": "assistant", "content": "" if tool is None else None}
            if tool is not None and tool.name is not None:
                first["tool_calls"] = [{"index": 0, "id": self._call_id(i), "type": "function",
                                        "function": {"name": tool.name, "arguments": ""}}]
            out.append(self.chunk([self._choice(i, first)]))
        if event.HasField("delta"):
            text = event.delta.text
            lps = orsp.chat_logprobs(self.plan, i, event.delta.logprobs, self.token_bytes)
            if (text or lps) and tool is None:
                out.append(self.chunk([self._choice(i, {"content": text}, logprobs=lps)]))
            elif text and tool.name is not None:
                out.append(self.chunk([self._choice(i, {"tool_calls": [
                    {"index": 0, "function": {"arguments": text}}]})]))
            return out
        final = event.final
        orsp.check_final(final)
        self.finals[i] = final
        calls = orsp.tool_calls(final.text, tool, self._call_id(i))
        if tool is not None and tool.name is None:  # the whole call, once it is known
            delta = {"tool_calls": [{"index": 0, **c} for c in calls]} if calls \
                else {"content": final.text}
            out.append(self.chunk([self._choice(i, delta)]))
        out.append(self.chunk([self._choice(i, {}, orsp.finish_reason(final, calls),
                                            **orsp.schema_fields(final))]))
        return out

    def _auto_events(self, i: int, event: gateway_pb2.GenerateResponse) -> list[dict]:
        """tool_choice "auto": content deltas as text arrives, each call whole once parsed."""
        out = []
        if not self._started[i]:
            self._started[i] = True
            out.append(self.chunk([self._choice(i, {"role": "assistant", "content": ""})]))
        if event.HasField("delta"):
            items = self._parsers[i].feed(event.delta.text)
            lps = orsp.chat_logprobs(self.plan, i, event.delta.logprobs, self.token_bytes)
            if lps and not items:
                items = [""]
        else:
            orsp.check_final(event.final)
            items, lps = self._parsers[i].close(), None
        for item in items:
            if isinstance(item, Call):
                k = len(self._calls[i])
                self._calls[i].append(item)
                delta = {"tool_calls": [{"index": k,
                                         **orsp.call_object(self.plan, i, k, item)}]}
            else:
                delta = {"content": item}
            out.append(self.chunk([self._choice(i, delta, logprobs=lps)]))
            lps = None  # a delta's logprobs go with its first chunk
        if event.HasField("final"):
            final = self.finals[i] = event.final
            calls = self._calls[i]
            out.append(self.chunk([self._choice(
                i, {}, orsp.finish_reason(final, calls),
                **orsp.calls_schema_fields(self.plan.tool, calls))]))
        return out

    def _choice(self, i: int, delta: dict, finish: str | None = None, logprobs=None,
                **extra) -> dict:
        return {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                **extra}


class _CompletionStream(_ChatStream):
    """text_completion chunks (the same stream shape as the legacy API's)."""

    object = "text_completion"

    def events(self, i: int, event: gateway_pb2.GenerateResponse) -> list[dict]:
        if event.HasField("delta"):
            text = event.delta.text
            lps = orsp.completion_logprobs(self.plan, i, event.delta.logprobs, self.token_bytes,
                                           self._offsets[i])
            self._offsets[i] += len(text)
            if not text and not lps:
                return []
            return [self.chunk([{"index": i, "text": text, "logprobs": lps,
                                 "finish_reason": None}])]
        final = event.final
        orsp.check_final(final)
        self.finals[i] = final
        return [self.chunk([{"index": i, "text": "", "logprobs": None,
                             "finish_reason": orsp.finish_reason(final, None),
                             **orsp.schema_fields(final)}])]


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream_body(fan: Fanout, writer: _ChatStream, buffered: list) -> AsyncIterator[str]:
    try:
        try:
            for i, event in buffered:
                for chunk in writer.events(i, event):
                    yield _sse(chunk)
            while None in writer.finals:
                i, event = await fan.next()
                if isinstance(event, Exception):
                    raise event
                for chunk in writer.events(i, event):
                    yield _sse(chunk)
            if writer.plan.include_usage:
                yield _sse(writer.chunk([], orsp.usage(writer.plan, writer.finals)))
        except Exception as exc:
            yield _sse(_as_openai(exc, writer.plan).body())
        yield "data: [DONE]\n\n"
    finally:
        await fan.close()


def create_app(servicer, max_request_bytes: int = 4 * 1024 * 1024) -> FastAPI:
    """The FastAPI application over a GatewayServicer (its `authenticate`, `generate`,
    `model_info`, `readiness`, `limits`). `/v1/*` takes `Authorization: Bearer TOKEN` when the
    gateway has tokens (401 without a valid one); `/health` and `/ready` stay open for probes."""
    app = FastAPI(title="gramserve", description="OpenAI-compatible API of gramserve",
                  docs_url=None, redoc_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        return _error_response(ot.OpenAIError(exc.status_code, str(exc.detail),
                                              code="not_found" if exc.status_code == 404 else None))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        # 200 while generation works, also "degraded" (grammar service down: unguided
        # requests and grammars already compiled still serve); 503 when it does not.
        readiness = servicer.readiness()
        return JSONResponse(readiness.as_dict(), status_code=200 if readiness.generate else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            servicer.authenticate(request.headers.get("authorization"))
        except ServiceError as exc:
            return _error_response(_as_openai(exc, None))
        info = servicer.model_info()
        return {"object": "list", "data": [{
            "id": info.id, "object": "model", "created": 0, "owned_by": "gramserve",
            "max_model_len": info.max_model_len, "vocab_size": info.vocab_size}]}

    async def run(request: Request, translate, writer_cls, choice) -> object:
        plan = None
        try:
            client = servicer.authenticate(request.headers.get("authorization"))
            raw = await request.body()
            if len(raw) > max_request_bytes:
                raise ot.bad(None, f"the request body is {len(raw)} bytes; the limit is "
                                   f"{max_request_bytes}")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise ot.bad(None, f"the request body is not JSON: {exc}") from None
            plan = translate(body, servicer.limits)
            model = servicer.model_info().id
            fan = Fanout(servicer, plan.requests, plan.timeout, client)
        except Exception as exc:
            return _error_response(_as_openai(exc, plan))
        created = int(time.time())
        n = len(plan.requests)
        if plan.stream:
            buffered, seen = [], set()
            try:
                while len(seen) < n:  # every choice admitted and producing: headers now
                    i, event = await fan.next()
                    if isinstance(event, Exception):
                        raise event
                    if event.HasField("final"):
                        orsp.check_final(event.final)
                    seen.add(i)
                    buffered.append((i, event))
            except BaseException as exc:
                await fan.close()
                if isinstance(exc, Exception):
                    return _error_response(_as_openai(exc, plan))
                raise
            return StreamingResponse(
                _stream_body(fan, writer_cls(plan, model, created, servicer.token_bytes),
                             buffered),
                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        work = asyncio.ensure_future(_collect(fan, n))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: free the slots, answer no one
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return Response(status_code=499)
            finals = work.result()
        except Exception as exc:
            return _error_response(_as_openai(exc, plan))
        finally:
            work.cancel()
            gone.cancel()
            await fan.close()
        return {"id": plan.id, "object": choice[0], "created": created, "model": model,
                "choices": [choice[1](plan, i, f, servicer.token_bytes)
                            for i, f in enumerate(finals)],
                "usage": orsp.usage(plan, finals)}

    def chat_plan(body, limits):
        return ot.chat_plan(body, limits, servicer.chat_template)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, chat_plan, _ChatStream, ("chat.completion", orsp.chat_choice))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, ot.completion_plan, _CompletionStream,
                         ("text_completion", orsp.completion_choice))

    return app


async def start_http(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Serve `app` on the running loop at host:port (0: a free port).

    Returns (server, its task, the bound port). The socket is bound here, so a port in use
    raises RuntimeError instead of ending the process (uvicorn's own bind exits).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Like gRPC's own listener: several gateway processes may share the port (`up --gateways`).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"--http-port {port}: cannot bind {host}:{port}: {exc}") from None
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5, ws="none")
    server = uvicorn.Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the HTTP server stopped during start-up")
        await asyncio.sleep(0.01)
    return server, task, bound


async def stop_http(server: uvicorn.Server, task: asyncio.Task, grace: float) -> None:
    """Stop accepting, let running requests finish for up to `grace` seconds."""
    server.config.timeout_graceful_shutdown = grace
    server.should_exit = True
    try:
        await asyncio.wait_for(task, grace + 5)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        task.cancel()
