"""`gramserve bench`: a closed-loop load generator against a gateway.

C streams in flight on one asyncio event loop (grpc.aio), or spread over P processes
(`--processes`), each driving C/P streams and N/P requests, results merged: a Python thread
per stream tops out far below what the service can stream. A fraction R of the requests
carries a JSON schema (from --schema files or a built-in family), the rest are unguided.
Prints throughput, TTFT and inter-token latency percentiles, tokens per delta message,
errors by status, finish reasons and the schema-valid rate.

Request i is the same whatever the process split: its prompt, schema and seed come from a
generator seeded with (--seed, i).

`--http URL` sends the same requests to the gateway's OpenAI-compatible API instead
(streamed `/v1/completions` through the official `openai` SDK, which must be installed; the
schema as `structured_outputs.json`), so the two fronts are measured with one load. There a
delta is a server-sent chunk with text, and tokens/delta is the request's completion tokens
over its chunks.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import itertools
import json
import multiprocessing
import queue
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from gateway.commands import add_connection_args
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import CHANNEL_OPTIONS, AioBearerInterceptor

# Bounded strings and numbers, so that even a random-weight model finishes them.
# GrammarOptions.backend by its lower-case name: auto, xgrammar, llguidance
BACKEND_NAMES = tuple(k.removeprefix("GRAMMAR_BACKEND_").lower()
                      for k in common_pb2.GrammarBackend.keys())

BUILTIN_SCHEMAS = (
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "maxItems": 2, "items": {
                                          "enum": ["a", "b", "c"]}}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]},
                                      "level": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["city", "level"], "additionalProperties": False},
)
# bench/schemas/<family>/*.json in a source checkout (the families are benchmark data).
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "bench" / "schemas"
FAMILIES = ("builtin", "short", "long")
_PROMPTS = ("Describe a person.", "List some tags.", "What is the weather like?",
            "Write a short sentence.", "Give me a record.")
_READY_TIMEOUT_S = 120.0  # for client processes to start and connect


@dataclass
class Outcome:
    """One request as the client saw it. `gaps` are seconds between delta messages that
    carry token ids; `deltas` counts those messages and `delta_tokens` their token ids."""

    status: str
    guided: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    schema_valid: bool | None = None
    deltas: int = 0
    delta_tokens: int = 0
    finish_reason: str = ""

    def arrived(self, start: float, last: float | None) -> float:
        """A message with tokens arrived now: count it and its TTFT or gap; returns now."""
        now = time.monotonic()
        if last is None:
            self.ttft = now - start
        else:
            self.gaps.append(now - last)
        self.deltas += 1
        return now


def bench_parser(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    p.add_argument("--requests", type=int, default=100, help="requests in total")
    p.add_argument("--duration", type=float, default=0.0, metavar="S",
                   help="instead of --requests: start requests for S seconds, then drain")
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="requests sent first and not counted")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--streams-per-connection", type=int, default=8,
                   help="streams per HTTP/2 connection: many connections, as many clients "
                        "would open, spread over gateway processes sharing a port")
    p.add_argument("--processes", type=int, default=1,
                   help="client processes, each driving concurrency/P streams")
    p.add_argument("--structured-ratio", type=float, default=0.5,
                   help="fraction of requests with a JSON schema, in [0, 1]")
    p.add_argument("--schema", action="append", default=[], metavar="FILE",
                   help="JSON schema file (repeat); overrides --schema-family")
    p.add_argument("--schema-family", choices=FAMILIES, default="builtin",
                   help="built-in schema set: builtin (3 small), short (10-40 tokens), "
                        "long (~100 tokens), from bench/schemas/")
    p.add_argument("--backend", default="auto",
                   choices=BACKEND_NAMES,
                   help="grammar backend of the guided requests (GrammarOptions.backend)")
    p.add_argument("--fixed-property-order", action="store_true",
                   help="guided requests keep every object's properties in the schema's order "
                        "(GrammarOptions.fixed_property_order; default: any order)")
    p.add_argument("--schema-prompts", action="store_true",
                   help="guided requests name their schema in the prompt (schema_prompt), as a "
                        "model fine-tuned on the schemas expects (bench/train_json.py)")
    p.add_argument("--unguided-twin", type=int, default=0, metavar="N",
                   help="the same requests without their grammar: drawn as the guided ones "
                        "(prompt, schema prompt, seed), sent with no constraint, ignore_eos and "
                        "max_tokens N (the guided run's mean answer length): the same work, "
                        "less the grammar's cost")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--http", default="", metavar="URL",
                   help="drive the OpenAI-compatible API at URL (http://host:port) instead of "
                        "gRPC (needs the openai package; --backend auto only)")


def schema_prompt(schema: str) -> str:
    """The prompt of a guided request under --schema-prompts: it names the schema (compact
    JSON text) by a short digest."""
    return f"Answer with record {hashlib.sha1(schema.encode()).hexdigest()[:6]}:"


def load_schemas(family: str, files: list[str] | None = None) -> list[str]:
    """The schemas (JSON text) of `files`, else of `family`. Raises ValueError for an unknown
    family or one whose directory is missing (an installed package has no bench/)."""
    if files:
        return [Path(f).read_text() for f in files]
    if family == "builtin":
        return [json.dumps(s) for s in BUILTIN_SCHEMAS]
    if family not in FAMILIES:
        raise ValueError(f"--schema-family must be one of {', '.join(FAMILIES)}")
    paths = sorted((SCHEMA_DIR / family).glob("*.json"))
    if not paths:
        raise ValueError(f"--schema-family {family}: no schemas under {SCHEMA_DIR / family} "
                         "(run from a source checkout, or pass --schema FILE)")
    return [json.dumps(json.loads(p.read_text()), separators=(",", ":")) for p in paths]


def make_request(i: int, ns, schemas: list[str]) -> tuple[gateway_pb2.GenerateRequest, bool]:
    """Request i of the mix: (request, guided). Depends only on (ns.seed, i)."""
    rng = random.Random(ns.seed * 1_000_003 + i)
    guided = rng.random() < ns.structured_ratio
    req = gateway_pb2.GenerateRequest(
        prompt=rng.choice(_PROMPTS),
        sampling=common_pb2.SamplingParams(max_tokens=ns.max_tokens,
                                           temperature=ns.temperature, seed=i % (1 << 64)))
    if guided:
        req.constraint.json_schema = rng.choice(schemas)
        if getattr(ns, "schema_prompts", False):
            req.prompt = schema_prompt(req.constraint.json_schema)
        req.constraint.options.whitespace = common_pb2.WHITESPACE_COMPACT
        req.constraint.options.backend = common_pb2.GrammarBackend.Value(
            f"GRAMMAR_BACKEND_{ns.backend.upper()}")
        req.constraint.options.fixed_property_order = getattr(ns, "fixed_property_order",
                                                              False)
        if getattr(ns, "unguided_twin", 0):
            req.ClearField("constraint")
            req.sampling.max_tokens = ns.unguided_twin
            req.sampling.ignore_eos = True
            guided = False
    return req, guided


async def _one_http(client, model: str, req, guided: bool, timeout: float) -> Outcome:
    """Request `req` through the OpenAI API (streamed /v1/completions)."""
    import openai

    out = Outcome(status="OK", guided=guided)
    extra = {}
    if guided:
        extra["structured_outputs"] = {"json": json.loads(req.constraint.json_schema),
                                       "whitespace": "compact"}
    start = time.monotonic()
    last = None
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.sampling.max_tokens,
            temperature=req.sampling.temperature, seed=req.sampling.seed, stream=True,
            stream_options={"include_usage": True}, extra_body=extra, timeout=timeout)
        async for chunk in stream:
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.text:
                    last = out.arrived(start, last)
                if c.finish_reason:
                    out.finish_reason = c.finish_reason
                    valid = (c.model_extra or {}).get("schema_valid")
                    if valid is not None:
                        out.schema_valid = valid
        out.delta_tokens = out.tokens
    except openai.APIStatusError as exc:
        out.status = f"HTTP_{exc.status_code}"
    except openai.APIError as exc:
        out.status = type(exc).__name__
    return out


async def _one(stub, req, guided: bool, timeout: float) -> Outcome:
    out = Outcome(status="OK", guided=guided)
    start = time.monotonic()
    last = None
    try:
        async for resp in stub.Generate(req, timeout=timeout):
            if resp.HasField("delta"):
                n = len(resp.delta.token_ids)
                if not n:
                    continue
                last = out.arrived(start, last)
                out.delta_tokens += n
            elif resp.HasField("final"):
                out.tokens = resp.final.usage.completion_tokens
                out.finish_reason = common_pb2.FinishReason.Name(resp.final.finish_reason)
                if resp.final.HasField("schema_valid"):
                    out.schema_valid = resp.final.schema_valid
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
    return out


def _channels(ns, streams: int) -> list[grpc.aio.Channel]:
    # A local subchannel pool per channel: separate TCP connections, not one shared one.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    creds = (grpc.ssl_channel_credentials(Path(ns.tls_ca).read_bytes())
             if ns.tls_ca else None)
    n = max(1, -(-streams // ns.streams_per_connection))
    interceptors = [AioBearerInterceptor(ns.token)] if ns.token else None
    return [grpc.aio.secure_channel(ns.addr, creds, options, interceptors=interceptors) if creds
            else grpc.aio.insecure_channel(ns.addr, options, interceptors=interceptors)
            for _ in range(n)]


async def _drive(ns, senders, schemas, indices, streams: int, deadline: float | None,
                 done=None) -> list[Outcome]:
    """Send request `indices` (an iterator) over `streams` streams until it is exhausted or
    `deadline` (monotonic) passes; `done()` is called after each request. `senders` are
    coroutine functions (request, guided, timeout) -> Outcome, used round-robin."""
    results: list[Outcome] = []

    async def stream(k: int):
        send = senders[k % len(senders)]
        for i in indices:
            if deadline is not None and time.monotonic() >= deadline:
                return
            results.append(await send(*make_request(i, ns, schemas), ns.timeout))
            if done is not None:
                done()

    await asyncio.gather(*(stream(k) for k in range(streams)))
    return results


def _indices(ns, part: int, parts: int, warmup: bool):
    """This process's request indices, strided over the processes; warm-up ones negative."""
    if warmup:
        return iter(range(-1 - part, -1 - ns.warmup, -parts))
    return itertools.count(part, parts) if ns.duration > 0 else iter(
        range(part, ns.requests, parts))


async def _run_part(ns, part: int, parts: int, done=None, ready=None, go=None) -> dict:
    """One process's share: warm up, (tell `ready` and wait for `go`), run the timed part;
    `done()` after each timed request. Returns {"start", "end", "results"}."""
    schemas = load_schemas(ns.schema_family, ns.schema)
    streams = ns.concurrency // parts + (part < ns.concurrency % parts)
    channels, http = [], None
    if ns.http:
        import openai

        http = openai.AsyncOpenAI(base_url=ns.http.rstrip("/") + "/v1", api_key="unused",
                                  max_retries=0)
        model = (await http.models.list()).data[0].id
        senders = [functools.partial(_one_http, http, model)]
    else:
        channels = _channels(ns, streams)
        senders = [functools.partial(_one, gateway_pb2_grpc.GatewayStub(ch))
                   for ch in channels]
    try:
        if ns.warmup:
            await _drive(ns, senders, schemas, _indices(ns, part, parts, True), streams, None)
        if ready is not None:
            ready.put(part)
            started = await asyncio.get_running_loop().run_in_executor(
                None, go.wait, _READY_TIMEOUT_S + ns.timeout * (1 + ns.warmup))
            if not started:
                raise RuntimeError("the other client processes never became ready")
        start = time.monotonic()
        deadline = start + ns.duration if ns.duration > 0 else None
        results = await _drive(ns, senders, schemas, _indices(ns, part, parts, False), streams,
                               deadline, done)
        return {"start": start, "end": time.monotonic(), "results": results}
    finally:
        for ch in channels:
            await ch.close()
        if http is not None:
            await http.close()


def _child(ns, part: int, parts: int, ready, go, counter, out) -> None:
    def done():
        with counter.get_lock():
            counter.value += 1

    try:
        out.put((part, asyncio.run(_run_part(ns, part, parts, done, ready, go))))
    except BaseException as exc:  # reported by the parent, which exits non-zero
        out.put((part, f"{type(exc).__name__}: {exc}"))


def _check(ns) -> None:
    if ns.requests < 1 or ns.concurrency < 1 or not 0 <= ns.structured_ratio <= 1:
        raise ValueError("--requests and --concurrency must be >= 1, --structured-ratio in [0, 1]")
    if ns.duration < 0 or ns.warmup < 0:
        raise ValueError("--duration and --warmup must be >= 0")
    if ns.streams_per_connection < 1:
        raise ValueError("--streams-per-connection must be >= 1")
    if ns.unguided_twin < 0:
        raise ValueError("--unguided-twin must be >= 0")
    if ns.unguided_twin and ns.http:
        raise ValueError("--unguided-twin: the HTTP API run has no ignore_eos; use gRPC")
    if not 1 <= ns.processes <= ns.concurrency:
        raise ValueError("--processes must be in [1, --concurrency]")
    if ns.http:
        if not ns.http.startswith(("http://", "https://")):
            raise ValueError(f"--http: expected http://host:port, got {ns.http!r}")
        if ns.backend != "auto":
            raise ValueError("--backend: the HTTP API has no backend field; use auto with --http")
        try:
            import openai  # noqa: F401
        except ImportError:
            raise ValueError("--http needs the openai package (pip install openai)") from None
    load_schemas(ns.schema_family, ns.schema)


def run_bench(ns: argparse.Namespace) -> dict:
    """Run the load described by `ns`; return the summary dict (see `summarize`).

    Raises ValueError on bad flags and RuntimeError when a client process fails."""
    for name, default in (("schema_family", "builtin"), ("duration", 0.0), ("warmup", 0),
                          ("processes", 1), ("http", "")):
        if not hasattr(ns, name):  # callers that build the Namespace by hand
            setattr(ns, name, default)
    _check(ns)
    bar = None
    if not ns.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=None if ns.duration > 0 else ns.requests, file=sys.stderr, unit="req")
    try:
        if ns.processes == 1:
            parts = [asyncio.run(_run_part(ns, 0, 1, bar.update if bar is not None else None))]
        else:
            parts = _run_processes(ns, bar)
    finally:
        if bar is not None:
            bar.close()
    results = [r for p in parts for r in p["results"]]
    elapsed = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    return summarize(results, elapsed)


def _run_processes(ns, bar) -> list[dict]:
    """Start ns.processes clients; once all are connected and warmed up, start them together.
    Every request has its own deadline, so a live client always finishes; a dead one raises."""
    ctx = multiprocessing.get_context("spawn")  # no fork: gRPC's threads do not survive it
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    counter = ctx.Value("i", 0)
    procs = [ctx.Process(target=_child, args=(ns, k, ns.processes, ready, go, counter, out),
                         daemon=True) for k in range(ns.processes)]
    for p in procs:
        p.start()
    parts: dict[int, dict] = {}
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S + ns.timeout * (1 + ns.warmup)
        waiting = set(range(ns.processes))
        while waiting:
            if time.monotonic() > deadline:
                raise RuntimeError("client processes not ready in time")
            try:
                waiting.discard(ready.get(timeout=0.5))
            except queue.Empty:
                _collect(out, parts, procs)
        go.set()
        while len(parts) < ns.processes:
            _collect(out, parts, procs)
            if bar is not None:
                bar.update(counter.value - bar.n)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return [parts[k] for k in sorted(parts)]


def _collect(out, parts: dict, procs) -> None:
    """Take one result from `out` (waiting up to 0.5 s); raise for a failed or dead client."""
    try:
        part, value = out.get(timeout=0.5)
    except queue.Empty:
        for k, p in enumerate(procs):
            if k not in parts and not p.is_alive() and out.empty():
                raise RuntimeError(f"client process {k} exited with status {p.exitcode}") from None
        return
    if isinstance(value, str):
        raise RuntimeError(f"client process {part}: {value}")
    parts[part] = value


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[Outcome], elapsed: float) -> dict:
    """Throughput, latency percentiles (seconds), tokens per delta message, errors by status,
    finish reasons of the successful streams, schema-valid rate."""
    ok = [r for r in results if r.status == "OK"]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != "OK":
            errors[r.status] = errors.get(r.status, 0) + 1
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[r.finish_reason or "NONE"] = reasons.get(r.finish_reason or "NONE", 0) + 1
    checked = [r.schema_valid for r in ok if r.schema_valid is not None]
    deltas = sum(r.deltas for r in ok)
    return {
        "requests": len(results), "ok": len(ok), "seconds": elapsed,
        "requests_per_second": len(ok) / elapsed if elapsed else 0.0,
        "output_tokens_per_second": sum(r.tokens for r in ok) / elapsed if elapsed else 0.0,
        "ttft_seconds": _pct([r.ttft for r in ok if r.ttft]),
        "inter_token_seconds": _pct([g for r in ok for g in r.gaps]),
        "tokens_per_delta": sum(r.delta_tokens for r in ok) / deltas if deltas else 0.0,
        "errors": errors,
        "finish_reasons": reasons,
        "schema_checked": len(checked),
        "schema_valid_rate": (sum(checked) / len(checked)) if checked else None,
    }


def bench_main(ns: argparse.Namespace) -> int:
    """Run `gramserve bench`; exit 1 when any request failed, 2 on bad flags."""
    try:
        summary = run_bench(ns)
    except ValueError as exc:
        print(f"gramserve bench: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"gramserve bench: {exc}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(summary))
    else:
        ms = {k: {p: v * 1000 for p, v in summary[k].items()}
              for k in ("ttft_seconds", "inter_token_seconds")}
        rate = summary["schema_valid_rate"]
        print(f"requests: {summary['ok']}/{summary['requests']} ok in {summary['seconds']:.2f} s")
        print(f"requests/s: {summary['requests_per_second']:.2f}   "
              f"output tokens/s: {summary['output_tokens_per_second']:.1f}   "
              f"tokens/delta: {summary['tokens_per_delta']:.2f}")
        for name, key in (("TTFT", "ttft_seconds"), ("inter-token", "inter_token_seconds")):
            v = ms[key]
            print(f"{name} ms: p50 {v['p50']:.1f}  p90 {v['p90']:.1f}  p99 {v['p99']:.1f}")
        print(f"errors: {summary['errors'] or 'none'}")
        print(f"finish reasons: {summary['finish_reasons'] or 'none'}")
        print("schema-valid rate: "
              + (f"{rate:.3f} of {summary['schema_checked']}" if rate is not None else "n/a"))
    return 1 if summary["errors"] else 0
