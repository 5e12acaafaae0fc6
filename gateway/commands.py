"""`gramserve generate`, `gramserve compile` and `gramserve health`: command-line clients of a gateway."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.health import CAPABILITIES
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel, check_health, env_default

# Statuses that mean "the server refused this request" (exit 2) rather than "it failed".
REJECTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE,
            grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED}
_WHITESPACE = {"bounded": common_pb2.WHITESPACE_BOUNDED, "compact": common_pb2.WHITESPACE_COMPACT,
               "any": common_pb2.WHITESPACE_ANY}


def add_connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", default=env_default("addr", "127.0.0.1:50051"),
                   help="gateway address host:port (GRAMSERVE_ADDR)")
    p.add_argument("--tls-ca", default=env_default("tls_ca", ""),
                   help="CA PEM to reach a TLS gateway (GRAMSERVE_TLS_CA)")
    p.add_argument("--timeout", type=float, default=env_default("timeout", 300.0),
                   help="deadline of each request in seconds (GRAMSERVE_TIMEOUT)")
    p.add_argument("--token", default=env_default("token", ""),
                   help="bearer token for a gateway started with --auth-tokens "
                        "(GRAMSERVE_TOKEN)")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", metavar="FILE", help="JSON Schema file")
    g.add_argument("--regex", metavar="R", help="regular expression for the whole output")
    g.add_argument("--ebnf", metavar="FILE", help="EBNF grammar file (start rule `root`)")
    g.add_argument("--choice", action="append", metavar="S", help="one allowed output (repeat)")
    g.add_argument("--json-object", action="store_true", help="any JSON object")
    g.add_argument("--structural-tag", metavar="FILE", help="xgrammar structural tag JSON file")
    p.add_argument("--whitespace", choices=sorted(_WHITESPACE), default="bounded",
                   help="whitespace between JSON tokens (default bounded)")
    p.add_argument("--strict", action="store_true",
                   help="refuse schemas with keywords the grammar does not enforce")
    p.add_argument("--fixed-property-order", action="store_true",
                   help="JSON schema: properties in the schema's order (default: any order)")


# Largest constraint file read (the gateway refuses larger requests anyway); a bound also
# keeps `--json-schema /dev/zero` from reading forever.
MAX_FILE_BYTES = 4 * 1024 * 1024


def read_arg_file(path: str, flag: str) -> str:
    """The UTF-8 text of the file a flag names. ValueError naming the flag when it cannot be
    read, is larger than MAX_FILE_BYTES or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{flag}: {path} is larger than {MAX_FILE_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{flag}: {path} is not UTF-8 ({exc.reason} at byte {exc.start})") \
            from None


def constraint_from_args(ns: argparse.Namespace) -> common_pb2.GrammarSpec:
    """The GrammarSpec the constraint flags describe (no kind set when none was given).
    ValueError naming the flag when a file cannot be read."""
    spec = common_pb2.GrammarSpec(options=common_pb2.GrammarOptions(
        whitespace=_WHITESPACE[ns.whitespace], strict=ns.strict,
        fixed_property_order=ns.fixed_property_order))
    if ns.json_schema:
        spec.json_schema = read_arg_file(ns.json_schema, "--json-schema")
    elif ns.regex is not None:
        spec.regex = ns.regex
    elif ns.ebnf:
        spec.ebnf = read_arg_file(ns.ebnf, "--ebnf")
    elif ns.choice:
        spec.choice.choices.extend(ns.choice)
    elif ns.json_object:
        spec.json_object.SetInParent()
    elif ns.structural_tag:
        spec.structural_tag = read_arg_file(ns.structural_tag, "--structural-tag")
    return spec


def _stub(ns) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayStub]:
    ca = Path(ns.tls_ca).read_bytes() if ns.tls_ca else None
    ch = channel(ns.addr, tls_ca=ca, token=ns.token or None)
    return ch, gateway_pb2_grpc.GatewayStub(ch)


def _fail(exc: grpc.RpcError) -> int:
    print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
    return 2 if exc.code() in REJECTED else 1


def generate_parser(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    add_constraint_args(p)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeat)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true",
                   help="print the final result as one JSON object (with the prompt's token ids)")
    p.add_argument("--messages", metavar="FILE",
                   help='chat messages instead of a prompt: a JSON file [{"role", "content"}, ...] '
                        "rendered by the model's chat template ('-' reads stdin)")
    p.add_argument("--tools", metavar="FILE",
                   help="with --messages: a JSON file of tool definitions for the chat template")
    p.add_argument("prompt", nargs="?", help="prompt text (or --messages)")


def _prompt_fields(ns: argparse.Namespace) -> dict:
    """The GenerateRequest prompt fields of the flags; ValueError when they do not fit."""
    if (ns.messages is None) == (ns.prompt is None):
        raise ValueError("give either a prompt or --messages")
    if ns.messages is None:
        if ns.tools:
            raise ValueError("--tools needs --messages")
        return {"prompt": ns.prompt}
    raw = sys.stdin.read() if ns.messages == "-" else read_arg_file(ns.messages, "--messages")
    messages = json.loads(raw)
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in messages):
        raise ValueError('--messages: expected a JSON array of {"role": str, "content": str}')
    out = {"messages": [gateway_pb2.ChatMessage(role=m["role"], content=m["content"])
                        for m in messages]}
    if ns.tools:
        out["tools_json"] = read_arg_file(ns.tools, "--tools")
    return out


def generate_main(ns: argparse.Namespace) -> int:
    """Stream one generation to stdout. 0 ok, 2 rejected, 1 other failures."""
    sampling = common_pb2.SamplingParams(stop=ns.stop, ignore_eos=ns.ignore_eos)
    try:
        for name in ("max_tokens", "temperature", "top_p", "seed"):
            value = getattr(ns, name)
            if value is None:
                continue
            try:
                setattr(sampling, name, value)
            except (ValueError, TypeError):
                raise ValueError(f"--{name.replace('_', '-')}: {value} is out of range"
                                 + (" (a seed is in [0, 2**64))" if name == "seed" else "")
                                 ) from None
        fields = _prompt_fields(ns)
        constraint = constraint_from_args(ns)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    req = gateway_pb2.GenerateRequest(sampling=sampling, constraint=constraint,
                                      echo_prompt_token_ids=ns.json, **fields)
    ch, stub = _stub(ns)
    final = None
    try:
        for resp in stub.Generate(req, timeout=ns.timeout):
            if resp.HasField("final"):
                final = resp.final
            elif not ns.json:
                sys.stdout.write(resp.delta.text)
                sys.stdout.flush()
    except grpc.RpcError as exc:
        return _fail(exc)
    finally:
        ch.close()
    if final is None:
        print("error: the stream ended without a final message", file=sys.stderr)
        return 1
    reason = common_pb2.FinishReason.Name(final.finish_reason)
    if ns.json:
        out = {"text": final.text, "finish_reason": reason,
               "usage": {"prompt_tokens": final.usage.prompt_tokens,
                         "completion_tokens": final.usage.completion_tokens},
               "schema_valid": final.schema_valid if final.HasField("schema_valid") else None,
               "seed": final.seed, "request_id": final.request_id,
               "prompt_token_ids": list(final.prompt_token_ids)}
        if final.schema_error:
            out["schema_error"] = final.schema_error
        print(json.dumps(out))
    else:
        print()
    if "ERROR" in reason:
        print(f"error: {reason}: {final.message}", file=sys.stderr)
        return 1
    return 0


def compile_parser(p: argparse.ArgumentParser) -> None:
    add_connection_args(p)
    add_constraint_args(p)
    p.add_argument("--json", action="store_true", help="print key, kind, cached, compile_ms")


def compile_main(ns: argparse.Namespace) -> int:
    """Check and compile a constraint; print its key. 0 ok, 2 invalid, 1 other failures."""
    try:
        req = gateway_pb2.CompileGrammarRequest(constraint=constraint_from_args(ns))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ch, stub = _stub(ns)
    try:
        resp = stub.CompileGrammar(req, timeout=ns.timeout)
    except grpc.RpcError as exc:
        return _fail(exc)
    finally:
        ch.close()
    if ns.json:
        print(json.dumps({"key": resp.key, "kind": resp.kind, "cached": resp.cached,
                          "compile_ms": round(resp.compile_seconds * 1000, 3),
                          "unenforced_keywords": list(resp.unenforced_keywords),
                          "backend": resp.backend, "backend_reason": resp.backend_reason}))
    else:
        print(resp.key)
    return 0


def health_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--addr", action="append", default=None,
                   help="address to check (repeat); default GRAMSERVE_ADDR or 127.0.0.1:50051")
    p.add_argument("--timeout", type=float, default=2.0)


def _capabilities(addr: str, timeout: float) -> dict[str, bool]:
    """A gateway's capabilities (gateway/health.py) -> SERVING; empty for a server that does
    not report them (a worker, the grammar service) or does not answer."""
    out = {}
    with channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for short, name in CAPABILITIES.items():
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=timeout)
            except grpc.RpcError:
                return {}
            out[short] = resp.status == health_pb2.HealthCheckResponse.SERVING
    return out


def health_main(ns: argparse.Namespace) -> int:
    """Exit 0 when every address answers SERVING; print one line per address, with a
    gateway's capabilities (a gateway whose grammar service is down still serves: exit 0,
    `compile NOT SERVING`)."""
    addrs = ns.addr or [env_default("addr", "127.0.0.1:50051")]
    ok = True
    for addr in addrs:
        serving = check_health(addr, timeout=ns.timeout)
        ok &= serving
        caps = _capabilities(addr, ns.timeout)
        detail = ", ".join(f"{k} {'SERVING' if v else 'NOT SERVING'}" for k, v in caps.items())
        print(f"{addr}: {'SERVING' if serving else 'NOT SERVING'}"
              + (f" ({detail})" if detail else ""))
    return 0 if ok else 1
