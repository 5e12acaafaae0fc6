"""Where the mask tail comes from: one schema feature at a time, xgrammar vs llguidance.

    PYTHONPATH=$PWD python bench/mask_tail.py [--tokenizer .bench/tok150k.json] [--reps N]

For each variant, the grammar is compiled as gramserve compiles it (xgrammar forced, with
gramserve's rewrites and bounded whitespace, or llguidance), then one instance is walked
token by token and the mask before every token is filled into a one-row bitmask, N times;
printed: the mask time p50 / p99 / max in microseconds, and the position of the slowest mask
in the instance text. Variants differ from the baseline in one thing only, so the table says
which feature makes the tail: a length-bounded string (rewritten into a bounded repetition
for xgrammar), its bound, the whitespace policy, a long free string.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.schema_verdicts import Judge, instance_text  # noqa: E402
from protos import common_pb2  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 3


def _obj(string_schema: dict) -> dict:
    return {"type": "object", "properties": {"id": {"type": "integer"},
                                             "text": string_schema},
            "required": ["id", "text"]}


VARIANTS = {
    "free string": (_obj({"type": "string"}), {}),
    "maxLength 256": (_obj({"type": "string", "maxLength": 256}), {}),
    "maxLength 64": (_obj({"type": "string", "maxLength": 64}), {}),
    "maxLength 1000 (not rewritten)": (_obj({"type": "string", "maxLength": 1000}), {}),
    "pattern": (_obj({"type": "string", "pattern": "^[A-Za-z ,.]+$"}), {}),
    "free string, whitespace any": (_obj({"type": "string"}),
                                    {"whitespace": common_pb2.WHITESPACE_ANY}),
    "free string, compact": (_obj({"type": "string"}),
                             {"whitespace": common_pb2.WHITESPACE_COMPACT}),
}


def time_masks(judge: Judge, build, text: str, reps: int) -> tuple[list[float], int, int]:
    """(mask seconds of every position, all reps; position of the slowest; tokens)."""
    tokens = judge.vocab.encode(text, add_special_tokens=False)
    bitmask = torch.zeros((1, judge.words), dtype=torch.int32)
    times, worst, worst_at = [], 0.0, 0
    for _ in range(reps):
        m = build.matcher
        m.reset()
        for i, token in enumerate(tokens):
            start = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            t = time.perf_counter() - start
            times.append(t)
            if t > worst:
                worst, worst_at = t, i
            assert m.accept_token(token)
    return times, worst_at, len(tokens)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=5)
    ns = parser.parse_args(argv)
    from grammar_service.default_model import ensure_default_model
    from grammar_service.vocab import load_vocab

    if ns.tokenizer is not None:
        from bench.grammars import vocab_dir

        model = vocab_dir(ns.tokenizer)
    else:
        model = ensure_default_model()
    judge = Judge(load_vocab(model))
    print(f"vocabulary {judge.vocab.model_vocab_size} tokens, one thread, {ns.reps} walks; "
          "mask p50 / p99 / max us (slowest at token i of n)")
    for name, (schema, options) in VARIANTS.items():
        row = f"{name:<34}"
        for mode in ("xgrammar", "llguidance"):
            build = judge.build(schema, mode, **options)
            if not build.ok:
                row += f"| {mode}: {build.error[:40]:<40}"
                continue
            instance = {"id": 7, "text": TEXT[:60] if "64" in name else TEXT}
            text = (json.dumps(instance, separators=(",", ":")) if "compact" in name
                    else instance_text(instance))
            times, at, n = time_masks(judge, build, text, ns.reps)
            times.sort()
            p = [times[len(times) // 2], times[int(0.99 * len(times))], times[-1]]
            row += (f"| {mode} {' / '.join(f'{1e6 * v:.0f}' for v in p)} "
                    f"(at {at} of {n}) ")
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
