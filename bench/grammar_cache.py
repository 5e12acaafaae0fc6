"""Cold compile vs cached Fetch + deserialize, side by side, through a real grammar service.

    python bench/grammar_cache.py [--model DIR] [--repeats N]
    python bench/grammar_cache.py --schemastore GIT_DIR [--tokenizer tok.json] [--limit N]

Starts the service in-process (real compile subprocesses) on the given model's vocabulary
(default: the embedded default model), compiles each schema once cold (xgrammar forced),
then times Fetch of the cached key plus deserialize, and prints both with their ratio.

With --schemastore (the corpus of bench/grammars.py), every schema is compiled with xgrammar
in this process, one thread, and the two ways a rank can get it are timed side by side:
the serialised form (service: compile + serialize_json; rank: deserialize_json; bytes) and
compiling the spec itself (service: compile; rank: compile). It prints p50/p99/max of each
and what gramserve's rule (XGrammarBackend.serialize) picks for each. Fetch is not timed
there (loopback gRPC moves the bytes in chunks of 1 MB).
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

from grammar_service.backends import XGRAMMAR, backend_for  # noqa: E402
from grammar_service.client import fetch_grammar  # noqa: E402
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


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0


def corpus_main(args) -> int:
    """The --schemastore measurement (see the module docstring)."""
    from bench.grammars import load_corpus, vocab_dir
    from grammar_service.backends import CACHE_SPEEDUP, RANK_SECONDS_PER_BYTE, XGrammarBackend
    from grammar_service.specs import parse_spec

    model = vocab_dir(args.tokenizer) if args.tokenizer else resolve_model(args.model or None)
    vocab = load_vocab(model)
    backend = XGrammarBackend(vocab.tokenizer_info(), threads=1, eager=True)
    corpus = load_corpus(args.schemastore, "HEAD", args.limit, 100_000, 8_000)
    rows = []
    for entry in corpus:
        try:
            spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(entry["schema"])))
            start = time.perf_counter()
            compiled = backend.compile(spec)
            compile_s = time.perf_counter() - start
        except Exception:  # noqa: BLE001 - refused: not part of this comparison
            continue
        if compile_s > args.max_compile:
            continue  # the service's deadline would refuse it
        start = time.perf_counter()
        text = compiled.serialize_json()
        ser_s = time.perf_counter() - start
        start = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(text, vocab.tokenizer_info())
        deser_s = time.perf_counter() - start
        rows.append((entry["name"], compile_s, ser_s, deser_s, len(text),
                     compiled.memory_size_bytes))
    print(f"SchemaStore corpus, xgrammar {XGRAMMAR_VERSION}, vocab {vocab.model_vocab_size} "
          f"tokens, one thread: {len(rows)} schemas compiled within {args.max_compile:.0f} s")

    def line(label, values, unit="ms", scale=1e3):
        print(f"{label:<44}" + " / ".join(f"{scale * _pct(values, p):.1f}" for p in (50, 99, 100))
              + f" {unit}")

    print(f"{'(p50 / p99 / max)':<44}")
    line("compile (rank compiles the spec)", [r[1] for r in rows])
    line("serialize_json (service, after compile)", [r[2] for r in rows])
    line("deserialize_json (rank)", [r[3] for r in rows])
    line("serialised bytes", [r[4] for r in rows], "MB", 1e-6)
    line("compiled grammar in memory", [r[5] for r in rows], "MB", 1e-6)
    line("compile / deserialize (x)", [r[1] / max(r[3], 1e-9) for r in rows], "x", 1)
    def spec_route(r) -> bool:  # XGrammarBackend.serialize's rule
        return any(n * RANK_SECONDS_PER_BYTE * CACHE_SPEEDUP > r[1] for n in (r[5], r[4]))

    inline = [r for r in rows if not spec_route(r)]
    spec_rows = [r for r in rows if spec_route(r)]
    print(f"policy (backends.XGrammarBackend.serialize): the serialised form when deserialising "
          f"is estimated >= {CACHE_SPEEDUP:.0f}x faster than compiling ({len(inline)} schemas), "
          f"else the spec ({len(spec_rows)})")
    line("  serialised: compile / deserialize (x)",
         [r[1] / max(r[3], 1e-9) for r in inline], "x", 1)
    line("  serialised: bytes", [r[4] for r in inline], "MB", 1e-6)
    line("  spec: compile / deserialize (x)", [r[1] / max(r[3], 1e-9) for r in spec_rows],
         "x", 1)
    line("  spec: serialize + deserialize avoided", [r[2] + r[3] for r in spec_rows])
    line("  spec: compile on the rank instead", [r[1] for r in spec_rows])
    if args.rows:
        for r in sorted(rows, key=lambda r: -r[5]):
            print(f"{r[0]:<48} compile {r[1] * 1e3:9.1f} ms  ser {r[2] * 1e3:9.1f} ms  "
                  f"deser {r[3] * 1e3:9.1f} ms  {r[4] / 1e6:8.2f} MB  mem {r[5] / 1e6:8.2f} MB")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--schemastore", default=None, help="SchemaStore git dir: corpus mode")
    p.add_argument("--tokenizer", type=Path, default=None, help="corpus mode's vocabulary")
    p.add_argument("--limit", type=int, default=100, help="corpus mode: schemas")
    p.add_argument("--max-compile", type=float, default=30.0,
                   help="corpus mode: leave out schemas compiling longer (seconds)")
    p.add_argument("--rows", action="store_true", help="corpus mode: one line per schema")
    args = p.parse_args()
    if args.schemastore:
        return corpus_main(args)
    vocab = load_vocab(resolve_model(args.model or None))
    config = GrammarServiceConfig(port=0, compile_workers=1, compile_timeout=600)
    server, port, service = create_server(config, registry=CollectorRegistry(), vocab=vocab)
    rank = backend_for(vocab, XGRAMMAR)
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
                spec = common_pb2.GrammarSpec(json_schema=json.dumps(schema),
                                              options=common_pb2.GrammarOptions(
                                                  backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR))
                start = time.perf_counter()
                ref = stub.Compile(grammar_pb2.CompileRequest(spec=spec), timeout=600)
                cold = time.perf_counter() - start
                times = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    _, payload = fetch_grammar(stub, ref.key, timeout=60)
                    rank.deserialize(payload)  # reads the form back, or compiles the spec
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
