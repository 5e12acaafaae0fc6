"""Cold compile vs cached Fetch + deserialize, side by side, through a real grammar service.

    python bench/grammar_cache.py [--model DIR] [--repeats N]

Starts the service in-process (real compile subprocesses) on the given model's vocabulary
(default: the embedded default model), compiles each schema once cold, then times Fetch of
the cached key plus CompiledGrammar.deserialize_json, and prints both with their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import xgrammar as xgr  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from grammar_service.client import fetch_serialized  # noqa: E402
from grammar_service.config import GrammarServiceConfig  # noqa: E402
from grammar_service.default_model import resolve_model  # noqa: E402
from grammar_service.server import XGRAMMAR_VERSION, create_server  # noqa: E402
from grammar_service.vocab import load_vocab  # noqa: E402
from protos import common_pb2, grammar_pb2, grammar_pb2_grpc, rpc  # noqa: E402


def large_schema(n_props: int) -> dict:
    """n_props properties cycling through strings, enums, arrays and nested objects."""
    props = {}
    for i in range(n_props):
        kind = i % 4
        if kind == 0:
            props[f"s{i}"] = {"type": "string", "maxLength": 40}
        elif kind == 1:
            props[f"e{i}"] = {"enum": [f"v{i}_{j}" for j in range(6)]}
        elif kind == 2:
            props[f"a{i}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 8}
        else:
            props[f"o{i}"] = {"type": "object", "properties": {
                "x": {"type": "number"}, "y": {"type": "boolean"},
                "z": {"type": "array", "items": {"type": "string"}}}, "required": ["x"]}
    return {"type": "object", "properties": props, "required": list(props)[: n_props // 2]}


SCHEMAS = {
    "small (2 props)": {"type": "object", "properties": {"name": {"type": "string"},
                                                         "age": {"type": "integer"}}},
    "medium (20 props)": large_schema(20),
    "large (200 props)": large_schema(200),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    vocab = load_vocab(resolve_model(args.model or None))
    config = GrammarServiceConfig(port=0, compile_workers=1, compile_timeout=600)
    server, port, service = create_server(config, registry=CollectorRegistry(), vocab=vocab)
    info = vocab.tokenizer_info()
    print(f"vocab {vocab.model_vocab_size} tokens ({vocab.model_dir.name}), xgrammar "
          f"{XGRAMMAR_VERSION}, pool of 1 process, {args.repeats} cached repeats (median)")
    print(f"{'schema':<20}{'bytes':>10}{'cold compile ms':>18}{'fetch+deser ms':>17}{'ratio':>8}")
    try:
        with rpc.channel(f"127.0.0.1:{port}") as ch:
            stub = grammar_pb2_grpc.GrammarServiceStub(ch)
            # Warm the pool process so the first schema's compile excludes start-up.
            stub.Compile(grammar_pb2.CompileRequest(spec=common_pb2.GrammarSpec(regex="w")),
                         timeout=600)
            for name, schema in SCHEMAS.items():
                spec = common_pb2.GrammarSpec(json_schema=json.dumps(schema))
                start = time.perf_counter()
                ref = stub.Compile(grammar_pb2.CompileRequest(spec=spec), timeout=600)
                cold = time.perf_counter() - start
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    text = fetch_serialized(stub, ref.key, timeout=60)
                    xgr.CompiledGrammar.deserialize_json(text, info)
                    times.append(time.perf_counter() - start)
                warm = statistics.median(times)
                print(f"{name:<20}{ref.serialized_bytes:>10}{cold * 1e3:>18.1f}"
                      f"{warm * 1e3:>17.1f}{cold / warm:>7.1f}x")
    finally:
        server.stop(grace=None)
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
