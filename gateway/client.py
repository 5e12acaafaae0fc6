"""A typed Python client of the gramserve gateway, sync (`Client`) and asyncio (`AsyncClient`).

    from gateway.client import Client, JsonSchema

    with Client("127.0.0.1:50051") as client:
        out = client.generate("A number:", constraint=JsonSchema(schema, whitespace="compact"))
        out.text, out.finish_reason, out.schema_valid

Constraints are typed values (`JsonSchema`, `JsonObject`, `Regex`, `Ebnf`, `Choice`,
`StructuralTag`); results are frozen dataclasses; every failure the gateway reports is a
`GramserveError` carrying the gRPC status code and, when the server named one, the offending
field. Both clients speak the same protos as `gramserve generate`; nothing here is needed by
the server.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import aio_channel, channel

Whitespace = Literal["bounded", "compact", "any"]
_WHITESPACE = {"bounded": common_pb2.WHITESPACE_BOUNDED, "compact": common_pb2.WHITESPACE_COMPACT,
               "any": common_pb2.WHITESPACE_ANY}
LogprobsMode = Literal["constrained", "unconstrained"]
_LOGPROBS_MODE = {"constrained": common_pb2.LOGPROBS_MODE_CONSTRAINED,
                  "unconstrained": common_pb2.LOGPROBS_MODE_UNCONSTRAINED}
# The gateway's messages start with the field they are about: "sampling.top_p: must be ...".
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")


class GramserveError(Exception):
    """A request the gateway refused or failed: `code` (grpc.StatusCode), `field` (the request
    field the server named, or None) and the server's `message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        match = _FIELD.match(message or "")
        self.code, self.message = code, message
        self.field = match.group(1) if match else None
        super().__init__(f"{code.name}: {message}")

    @classmethod
    def of(cls, exc: grpc.RpcError) -> GramserveError:
        return cls(exc.code(), exc.details() or "")


# ----------------------------------------------------------------------------- constraints


@dataclass(frozen=True)
class JsonSchema:
    """Output must be an instance of `schema` (a dict or JSON text). `strict` refuses schemas
    with keywords the grammar cannot enforce; `fixed_property_order` keeps every object's
    properties in the schema's order (else any order JSON Schema allows)."""

    schema: Mapping[str, Any] | str
    whitespace: Whitespace = "bounded"
    strict: bool = False
    fixed_property_order: bool = False

    def to_proto(self) -> common_pb2.GrammarSpec:
        text = self.schema if isinstance(self.schema, str) else json.dumps(self.schema)
        options = _options(self.whitespace, self.strict)
        options.fixed_property_order = self.fixed_property_order
        return common_pb2.GrammarSpec(json_schema=text, options=options)


@dataclass(frozen=True)
class JsonObject:
    """Output must be some JSON object."""

    whitespace: Whitespace = "bounded"

    def to_proto(self) -> common_pb2.GrammarSpec:
        spec = common_pb2.GrammarSpec(options=_options(self.whitespace))
        spec.json_object.SetInParent()
        return spec


@dataclass(frozen=True)
class Regex:
    """The whole output must match `pattern`."""

    pattern: str

    def to_proto(self) -> common_pb2.GrammarSpec:
        return common_pb2.GrammarSpec(regex=self.pattern)


@dataclass(frozen=True)
class Ebnf:
    """The output must derive from `grammar` (xgrammar's EBNF, start rule `root`)."""

    grammar: str

    def to_proto(self) -> common_pb2.GrammarSpec:
        return common_pb2.GrammarSpec(ebnf=self.grammar)


@dataclass(frozen=True)
class Choice:
    """The output must be exactly one of `options`."""

    options: Sequence[str]

    def to_proto(self) -> common_pb2.GrammarSpec:
        spec = common_pb2.GrammarSpec()
        spec.choice.choices.extend(self.options)
        return spec


@dataclass(frozen=True)
class StructuralTag:
    """An xgrammar structural tag (a dict or JSON text)."""

    tag: Mapping[str, Any] | str

    def to_proto(self) -> common_pb2.GrammarSpec:
        return common_pb2.GrammarSpec(
            structural_tag=self.tag if isinstance(self.tag, str) else json.dumps(self.tag))


Constraint = JsonSchema | JsonObject | Regex | Ebnf | Choice | StructuralTag


def _options(whitespace: Whitespace, strict: bool = False) -> common_pb2.GrammarOptions:
    if whitespace not in _WHITESPACE:
        raise ValueError(f"whitespace: expected one of {', '.join(_WHITESPACE)}, got {whitespace!r}")
    return common_pb2.GrammarOptions(whitespace=_WHITESPACE[whitespace], strict=strict)


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives (`top`:
    (token id, log-probability) pairs, most likely first), at temperature 1: of the
    distribution the token was drawn from after the grammar's mask (logprobs_mode
    "constrained"), or of the model's before it ("unconstrained")."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]

    @classmethod
    def of(cls, lp: common_pb2.TokenLogprob) -> TokenLogprob:
        return cls(lp.token_id, lp.logprob,
                   tuple(zip(lp.top_token_ids, lp.top_logprobs, strict=True)))


def _logprobs(lps) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob.of(lp) for lp in lps)


@dataclass(frozen=True)
class Delta:
    """New text of a stream (never split inside a UTF-8 character), its token ids, their
    log-probabilities (empty unless asked) and the choice it belongs to (`index`, 0 unless
    n > 1)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0


@dataclass(frozen=True)
class Completion:
    """A finished generation. `finish_reason` is the proto name without its prefix, lower
    case: "stop", "length", "grammar_completed", "stop_string", ... `schema_valid` is None
    unless the constraint was a JSON schema. `logprobs` has one entry per generated token
    when they were asked for; `index` is the choice (0 unless n > 1)."""

    text: str
    finish_reason: str
    message: str
    prompt_tokens: int
    completion_tokens: int
    schema_valid: bool | None
    schema_error: str
    seed: int
    request_id: str
    prompt_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0

    @classmethod
    def of(cls, final: gateway_pb2.Final, index: int = 0) -> Completion:
        name = common_pb2.FinishReason.Name(final.finish_reason)
        return cls(text=final.text, finish_reason=name.removeprefix("FINISH_REASON_").lower(),
                   message=final.message, prompt_tokens=final.usage.prompt_tokens,
                   completion_tokens=final.usage.completion_tokens,
                   schema_valid=final.schema_valid if final.HasField("schema_valid") else None,
                   schema_error=final.schema_error, seed=final.seed,
                   request_id=final.request_id, prompt_token_ids=tuple(final.prompt_token_ids),
                   logprobs=_logprobs(final.logprobs), index=index)


@dataclass(frozen=True)
class Compiled:
    """A constraint the grammar service accepted: its cache key and how it was compiled."""

    key: str
    kind: str
    cached: bool
    compile_seconds: float
    unenforced_keywords: tuple[str, ...]
    backend: str


@dataclass(frozen=True)
class Model:
    """A served model: id, vocabulary size, context length, groups and their TP size."""

    id: str
    vocab_size: int
    max_model_len: int
    groups: int
    tp_size: int


def _request(prompt: str | None, *, messages, prompt_token_ids, tools, constraint, model,
             max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, request_id,
             echo_prompt_token_ids, n, logprobs, top_logprobs,
             logprobs_mode) -> gateway_pb2.GenerateRequest:
    """The GenerateRequest of the keyword arguments (see Client.generate)."""
    forms = [prompt is not None, bool(messages), bool(prompt_token_ids)]
    if sum(forms) != 1:
        raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
    if top_logprobs and not logprobs:
        raise ValueError("top_logprobs needs logprobs=True")
    if logprobs_mode not in _LOGPROBS_MODE:
        raise ValueError(f"logprobs_mode: one of {', '.join(_LOGPROBS_MODE)}, got "
                         f"{logprobs_mode!r}")
    if logprobs_mode != "constrained" and not logprobs:
        raise ValueError(f"logprobs_mode {logprobs_mode!r} needs logprobs=True")
    sampling = common_pb2.SamplingParams(stop=list(stop), ignore_eos=ignore_eos, top_k=top_k,
                                         logprobs=logprobs, top_logprobs=top_logprobs,
                                         logprobs_mode=_LOGPROBS_MODE[logprobs_mode])
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                        ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    req = gateway_pb2.GenerateRequest(
        model=model, sampling=sampling, request_id=request_id, n=n,
        echo_prompt_token_ids=echo_prompt_token_ids,
        constraint=constraint.to_proto() if constraint is not None else None)
    if prompt is not None:
        req.prompt = prompt
    req.prompt_token_ids.extend(prompt_token_ids or ())
    for m in messages or ():
        role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
        req.messages.add(role=role, content=content)
    if tools:
        req.tools_json = json.dumps(list(tools), ensure_ascii=False)
    return req


def _compile_request(constraint: Constraint, model: str) -> gateway_pb2.CompileGrammarRequest:
    return gateway_pb2.CompileGrammarRequest(model=model, constraint=constraint.to_proto())


def _compiled(resp: gateway_pb2.CompileGrammarResponse) -> Compiled:
    return Compiled(key=resp.key, kind=resp.kind, cached=resp.cached,
                    compile_seconds=resp.compile_seconds,
                    unenforced_keywords=tuple(resp.unenforced_keywords), backend=resp.backend)


def _models(resp: gateway_pb2.ListModelsResponse) -> list[Model]:
    return [Model(m.id, m.vocab_size, m.max_model_len, m.groups, m.tp_size) for m in resp.models]


def _event(resp: gateway_pb2.GenerateResponse) -> Delta | Completion:
    if resp.HasField("final"):
        return Completion.of(resp.final, resp.index)
    return Delta(resp.delta.text, tuple(resp.delta.token_ids), _logprobs(resp.delta.logprobs),
                 resp.index)


class _Choices:
    """The completions of a stream's choices as they end, in index order."""

    def __init__(self, n: int):
        self.completions: list[Completion | None] = [None] * max(n, 1)

    @property
    def completion(self) -> Completion | None:
        """Choice 0's completion (the only one unless n > 1); None until it ends."""
        return self.completions[0]

    def _end(self, completion: Completion) -> None:
        self.completions[completion.index] = completion

    def _all(self) -> list[Completion]:
        if any(c is None for c in self.completions):
            raise GramserveError(grpc.StatusCode.INTERNAL, "the stream ended without a final "
                                                           "for every choice")
        return list(self.completions)


# ----------------------------------------------------------------------------- sync


class Stream(_Choices):
    """The deltas of one generation, iterated; `completion` is set once the stream ends
    (with n > 1 the choices' deltas interleave, each with its `index`, and `completions`
    holds every choice's). `cancel()` stops it (the gateway releases the slots)."""

    def __init__(self, call, n: int = 1):
        super().__init__(n)
        self._call = call

    def __iter__(self) -> Iterator[Delta]:
        try:
            for resp in self._call:
                event = _event(resp)
                if isinstance(event, Completion):
                    self._end(event)
                else:
                    yield event
        except grpc.RpcError as exc:
            raise GramserveError.of(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    """A blocking client of one gateway (`address` host:port; `tls_ca` PEM bytes for TLS;
    `token` the bearer token when the gateway requires one). `timeout` is each call's
    deadline in seconds. Use as a context manager or call close()."""

    def __init__(self, address: str = "127.0.0.1:50051", *, tls_ca: bytes | None = None,
                 timeout: float = 300.0, model: str = "", token: str | None = None):
        self._channel = channel(address, tls_ca=tls_ca, token=token)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.timeout, self.model = timeout, model

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def stream(self, prompt: str | None = None, *,
               messages: Sequence[Mapping[str, str] | tuple[str, str]] | None = None,
               prompt_token_ids: Sequence[int] | None = None,
               tools: Sequence[Mapping[str, Any]] | None = None,
               constraint: Constraint | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None, top_k: int = 0,
               seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False,
               request_id: str = "", echo_prompt_token_ids: bool = False, n: int = 1,
               logprobs: bool = False, top_logprobs: int = 0,
               logprobs_mode: LogprobsMode = "constrained") -> Stream:
        """Start a generation and return its Stream of deltas. Exactly one prompt form:
        `prompt` text, chat `messages` ({"role", "content"} dicts or (role, content) pairs,
        rendered by the model's chat template with `tools`) or `prompt_token_ids`.
        `constraint` None means unguided. `n` choices run concurrently, each its own
        request (with a `seed`, choice i uses seed + i). `logprobs` returns each token's
        log-probability, with the `top_logprobs` (0-20) most likely alternatives, of the
        distribution the token was sampled from, after the grammar's mask (`logprobs_mode`
        "constrained", the default) or of the model's before the mask ("unconstrained"; the
        same tokens). Raises ValueError for a bad combination here and GramserveError (while
        iterating) for anything the gateway refuses."""
        req = _request(prompt, messages=messages, prompt_token_ids=prompt_token_ids,
                       tools=tools, constraint=constraint, model=self.model,
                       max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                       top_k=top_k, seed=seed, stop=stop, ignore_eos=ignore_eos,
                       request_id=request_id, echo_prompt_token_ids=echo_prompt_token_ids,
                       n=n, logprobs=logprobs, top_logprobs=top_logprobs,
                       logprobs_mode=logprobs_mode)
        return Stream(self._stub.Generate(req, timeout=self.timeout), n)

    def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """Generate to the end and return the Completion; same arguments as `stream` (n = 1;
        `generate_n` for more). Raises GramserveError."""
        return self.generate_n(prompt, **{**kwargs, "n": _one(kwargs)})[0]

    def generate_n(self, prompt: str | None = None, n: int = 1, **kwargs) -> list[Completion]:
        """Generate `n` choices to the end; their Completions in index order. Same arguments
        as `stream`. Raises GramserveError."""
        stream = self.stream(prompt, n=n, **kwargs)
        for _ in stream:
            pass
        return stream._all()

    def compile(self, constraint: Constraint) -> Compiled:
        """Check and compile `constraint` without generating. Raises GramserveError
        (INVALID_ARGUMENT naming the field for a bad grammar)."""
        try:
            return _compiled(self._stub.CompileGrammar(_compile_request(constraint, self.model),
                                                       timeout=self.timeout))
        except grpc.RpcError as exc:
            raise GramserveError.of(exc) from None

    def models(self) -> list[Model]:
        """The models the gateway serves. Raises GramserveError."""
        try:
            return _models(self._stub.ListModels(gateway_pb2.ListModelsRequest(),
                                                 timeout=self.timeout))
        except grpc.RpcError as exc:
            raise GramserveError.of(exc) from None


# ----------------------------------------------------------------------------- asyncio


class AsyncStream(_Choices):
    """The asyncio Stream: `async for delta in stream`, then `stream.completion` (and
    `stream.completions` with n > 1)."""

    def __init__(self, call, n: int = 1):
        super().__init__(n)
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            async for resp in self._call:
                event = _event(resp)
                if isinstance(event, Completion):
                    self._end(event)
                else:
                    yield event
        except grpc.RpcError as exc:
            raise GramserveError.of(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class AsyncClient:
    """The asyncio client: the same methods as `Client`, as coroutines (`stream` returns an
    AsyncStream at once). Create and use it inside one event loop; `await close()`."""

    def __init__(self, address: str = "127.0.0.1:50051", *, tls_ca: bytes | None = None,
                 timeout: float = 300.0, model: str = "", token: str | None = None):
        self._channel = aio_channel(address, tls_ca=tls_ca, token=token)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self.timeout, self.model = timeout, model

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def stream(self, prompt: str | None = None, **kwargs) -> AsyncStream:
        """Start a generation; arguments as Client.stream."""
        unknown = set(kwargs) - set(_DEFAULTS)
        if unknown:
            raise TypeError(f"stream() got unexpected keyword argument(s) {sorted(unknown)}")
        args = {**_DEFAULTS, **kwargs}
        req = _request(prompt, model=self.model, **args)
        return AsyncStream(self._stub.Generate(req, timeout=self.timeout), args["n"])

    async def generate(self, prompt: str | None = None, **kwargs) -> Completion:
        """Generate to the end; arguments as Client.stream (n = 1). Raises GramserveError."""
        return (await self.generate_n(prompt, **{**kwargs, "n": _one(kwargs)}))[0]

    async def generate_n(self, prompt: str | None = None, n: int = 1,
                         **kwargs) -> list[Completion]:
        """As Client.generate_n."""
        stream = self.stream(prompt, n=n, **kwargs)
        async for _ in stream:
            pass
        return stream._all()

    async def compile(self, constraint: Constraint) -> Compiled:
        """As Client.compile."""
        try:
            return _compiled(await self._stub.CompileGrammar(
                _compile_request(constraint, self.model), timeout=self.timeout))
        except grpc.RpcError as exc:
            raise GramserveError.of(exc) from None

    async def models(self) -> list[Model]:
        """As Client.models."""
        try:
            return _models(await self._stub.ListModels(gateway_pb2.ListModelsRequest(),
                                                       timeout=self.timeout))
        except grpc.RpcError as exc:
            raise GramserveError.of(exc) from None


_DEFAULTS: dict[str, Any] = dict(
    messages=None, prompt_token_ids=None, tools=None, constraint=None, max_tokens=None,
    temperature=None, top_p=None, top_k=0, seed=None, stop=(), ignore_eos=False,
    request_id="", echo_prompt_token_ids=False, n=1, logprobs=False, top_logprobs=0,
    logprobs_mode="constrained")


def _one(kwargs: dict) -> int:
    if kwargs.get("n", 1) != 1:
        raise ValueError("n: generate returns one Completion; use generate_n for n > 1")
    return 1
