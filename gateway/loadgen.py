"""`gramserve bench`: a closed-loop load generator against a gateway.

C client threads send N requests in total; a fraction R carries a JSON schema (from
--schema files, or built-in ones), the rest are unguided. Prints throughput, TTFT and
inter-token latency percentiles, errors by status and the schema-valid rate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from gateway.client import add_connection_args
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel

# Bounded strings and numbers, so that even a random-weight model finishes them.
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
_PROMPTS = ("Describe a person.", "List some tags.", "What is the weather like?",
            "Write a short sentence.", "Give me a record.")


@dataclass
class Outcome:
    status: str
    guided: bool
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    schema_valid: bool | None = None


def bench_parser(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    p.add_argument("--requests", type=int, default=100, help="requests in total")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--structured-ratio", type=float, default=0.5,
                   help="fraction of requests with a JSON schema, in [0, 1]")
    p.add_argument("--schema", action="append", default=[], metavar="FILE",
                   help="JSON schema file (repeat); default: built-in schemas")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _request(i: int, rng: random.Random, schemas: list[str], ratio: float, ns):
    guided = rng.random() < ratio
    req = gateway_pb2.GenerateRequest(
        prompt=rng.choice(_PROMPTS),
        sampling=common_pb2.SamplingParams(max_tokens=ns.max_tokens,
                                           temperature=ns.temperature, seed=i))
    if guided:
        req.constraint.json_schema = rng.choice(schemas)
        req.constraint.options.whitespace = common_pb2.WHITESPACE_COMPACT
    return req, guided


def _one(stub, req, guided: bool, timeout: float) -> Outcome:
    start = time.monotonic()
    last = None
    out = Outcome(status="OK", guided=guided)
    try:
        for resp in stub.Generate(req, timeout=timeout):
            now = time.monotonic()
            if resp.HasField("delta") and resp.delta.token_ids:
                if last is None:
                    out.ttft = now - start
                else:
                    out.gaps.append(now - last)
                last = now
            elif resp.HasField("final"):
                out.tokens = resp.final.usage.completion_tokens
                if resp.final.HasField("schema_valid"):
                    out.schema_valid = resp.final.schema_valid
    except grpc.RpcError as exc:
        out.status = exc.code().name
    return out


def run_bench(ns: argparse.Namespace) -> dict:
    """Run the load described by `ns`; return the summary dict (see `summarize`)."""
    if ns.requests < 1 or ns.concurrency < 1 or not 0 <= ns.structured_ratio <= 1:
        raise ValueError("--requests and --concurrency must be >= 1, --structured-ratio in [0, 1]")
    schemas = ([Path(f).read_text() for f in ns.schema] if ns.schema
               else [json.dumps(s) for s in BUILTIN_SCHEMAS])
    rng = random.Random(ns.seed)
    work = [_request(i, rng, schemas, ns.structured_ratio, ns) for i in range(ns.requests)]
    ca = Path(ns.tls_ca).read_bytes() if ns.tls_ca else None
    ch = channel(ns.addr, tls_ca=ca)
    stub = gateway_pb2_grpc.GatewayStub(ch)
    results: list[Outcome] = []
    lock = threading.Lock()
    counter = itertools.count()
    bar = None
    if not ns.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=ns.requests, file=sys.stderr, unit="req")

    def client():
        while (i := next(counter)) < len(work):
            res = _one(stub, *work[i], ns.timeout)
            with lock:
                results.append(res)
                if bar is not None:
                    bar.update(1)

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(ns.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    if bar is not None:
        bar.close()
    ch.close()
    return summarize(results, elapsed)


def _pct(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(np.asarray(values), [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[Outcome], elapsed: float) -> dict:
    """Throughput, latency percentiles (seconds), errors by status, schema-valid rate."""
    ok = [r for r in results if r.status == "OK"]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != "OK":
            errors[r.status] = errors.get(r.status, 0) + 1
    checked = [r.schema_valid for r in ok if r.schema_valid is not None]
    return {
        "requests": len(results), "ok": len(ok), "seconds": elapsed,
        "requests_per_second": len(ok) / elapsed if elapsed else 0.0,
        "output_tokens_per_second": sum(r.tokens for r in ok) / elapsed if elapsed else 0.0,
        "ttft_seconds": _pct([r.ttft for r in ok if r.ttft]),
        "inter_token_seconds": _pct([g for r in ok for g in r.gaps]),
        "errors": errors,
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
    if ns.json:
        print(json.dumps(summary))
    else:
        ms = {k: {p: v * 1000 for p, v in summary[k].items()}
              for k in ("ttft_seconds", "inter_token_seconds")}
        rate = summary["schema_valid_rate"]
        print(f"requests: {summary['ok']}/{summary['requests']} ok in {summary['seconds']:.2f} s")
        print(f"requests/s: {summary['requests_per_second']:.2f}   "
              f"output tokens/s: {summary['output_tokens_per_second']:.1f}")
        for name, key in (("TTFT", "ttft_seconds"), ("inter-token", "inter_token_seconds")):
            v = ms[key]
            print(f"{name} ms: p50 {v['p50']:.1f}  p90 {v['p90']:.1f}  p99 {v['p99']:.1f}")
        print(f"errors: {summary['errors'] or 'none'}")
        print("schema-valid rate: "
              + (f"{rate:.3f} of {summary['schema_checked']}" if rate is not None else "n/a"))
    return 1 if summary["errors"] else 0
