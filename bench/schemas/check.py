"""Tokens per answer of each schema family under a random sampler, on CPU.

A random-weight model samples almost uniformly from the tokens a grammar allows, so walking
xgrammar's GrammarMatcher with a uniform choice among the allowed ids predicts how long its
guided answers are. The grammars are compiled as the grammar service compiles a JSON schema
with compact whitespace. Counts include the final EOS.

    PYTHONPATH=$PWD python bench/schemas/check.py --tokenizer .bench/tok150k.json

With `--forced`, the bound forced tokens put on steps per output token instead: valid
instances of each family (bench/train_json.py's generator, the answers a model that follows
the schema gives), in the tokenizer's own encoding, stepped through the matcher; a token is
forced where the mask allows it alone. A chain of n forced tokens after a sampled one is fed
as one chunk, so an overlapped step loop (the forward of step k launched before step k-1's
token is on the host) spends sampled + chains steps, and a loop that waited for every token
before each forward would spend sampled steps: the best either could do.

    PYTHONPATH=$PWD python bench/schemas/check.py --tokenizer .bench/tok150k.json --forced
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gateway.loadgen import load_schemas  # noqa: E402

QWEN_MODEL_VOCAB = 151936


def vocab_dir(tokenizer_json: Path, model_vocab: int, out: Path) -> Path:
    """A directory `load_vocab` accepts: the tokenizer, a config naming `model_vocab`."""
    from bench.step import add_tokenizer

    (out / "config.json").write_text(json.dumps({"vocab_size": model_vocab}))
    add_tokenizer(out, tokenizer_json)
    return out


def compile_schema(compiler, schema: str):
    """Compile `schema` as the grammar service does for WHITESPACE_COMPACT (strict)."""
    from grammar_service.schema_fixes import fix_schema

    return compiler.compile_json_schema(json.dumps(fix_schema(json.loads(schema))),
                                        any_whitespace=False, separators=(",", ":"),
                                        strict_mode=True)


def random_walk(compiled, vocab_size: int, rng: random.Random, limit: int) -> int | None:
    """Tokens a uniform sampler takes to finish `compiled` (None past `limit`)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    for n in range(1, limit + 1):
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        assert matcher.accept_token(int(allowed[rng.randrange(len(allowed))]))
        if matcher.is_terminated():
            return n
    return None


def family_counts(model_dir: Path, family: str, samples: int, limit: int = 512,
                  seed: int = 0) -> dict:
    """{"median", "p90", "max", "unfinished", "per_schema": {i: median}} over `samples`
    walks per schema of `family`."""
    import xgrammar as xgr

    from grammar_service.vocab import load_vocab

    vocab = load_vocab(model_dir)
    compiler = xgr.GrammarCompiler(vocab.tokenizer_info())
    rng = random.Random(seed)
    counts, per_schema, unfinished = [], {}, 0
    for i, schema in enumerate(load_schemas(family)):
        compiled = compile_schema(compiler, schema)
        mine = [random_walk(compiled, vocab.model_vocab_size, rng, limit) for _ in range(samples)]
        unfinished += sum(c is None for c in mine)
        mine = [c for c in mine if c is not None]
        per_schema[i] = float(np.median(mine)) if mine else None
        counts += mine
    return {"median": float(np.median(counts)), "p90": float(np.percentile(counts, 90)),
            "max": int(max(counts)), "unfinished": unfinished, "per_schema": per_schema}


def forced_bound(model_dir: Path, family: str, samples: int, seed: int = 0) -> dict:
    """Forced share, chain lengths and the best steps per output token (overlapped and
    synchronous loop) over `samples` valid instances of `family` (EOS not counted)."""
    import xgrammar as xgr
    from tokenizers import Tokenizer

    from bench.train_json import examples
    from gpu_worker.guided.forced import ForcedScan
    from grammar_service.vocab import load_vocab

    vocab = load_vocab(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    compiler = xgr.GrammarCompiler(vocab.tokenizer_info())
    bitmask = xgr.allocate_token_bitmask(1, vocab.model_vocab_size)
    scan = ForcedScan(vocab.vocab_size, bitmask.shape[1])  # the engine's own test
    compiled, tokens, forced, chains, lengths = {}, 0, 0, 0, {}
    for _, text, schema in examples([family], samples, seed):
        key = json.dumps(schema)
        if key not in compiled:
            compiled[key] = compile_schema(compiler, key)
        matcher = xgr.GrammarMatcher(compiled[key])
        run = 0
        for token in tokenizer.encode(text, add_special_tokens=False).ids:
            matcher.fill_next_token_bitmask(bitmask)
            if scan.single_allowed(bitmask, [0])[0] >= 0:
                forced, run = forced + 1, run + 1
            elif run:
                chains, lengths[run], run = chains + 1, lengths.get(run, 0) + 1, 0
            if not matcher.accept_token(token):
                raise RuntimeError(f"{family}: the grammar refused token {token} of {text!r}")
            tokens += 1
        if run:
            chains, lengths[run] = chains + 1, lengths.get(run, 0) + 1
    sampled = tokens - forced
    return {"tokens": tokens, "forced_share": forced / tokens, "chains": chains,
            "chain_lengths": dict(sorted(lengths.items())),
            "steps_per_token_overlapped": (sampled + chains) / tokens,
            "steps_per_token_synchronous": sampled / tokens}


def _per_family(tokenizer_json: Path, families: list[str], model_vocab: int, measure,
                describe) -> dict:
    """{family: measure(model_dir, family)} over a vocabulary directory of `tokenizer_json`,
    each printed as `describe(result)` with the family's seconds."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = vocab_dir(tokenizer_json, model_vocab, Path(tmp))
        for family in families:
            t0 = time.perf_counter()
            out[family] = measure(model_dir, family)
            print(f"schema family {family}: {describe(out[family])} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


def report(tokenizer_json: Path, families: list[str], samples: int,
           model_vocab: int = QWEN_MODEL_VOCAB) -> dict:
    """Print and return `family_counts` for each family."""
    return _per_family(
        tokenizer_json, families, model_vocab,
        lambda model_dir, family: family_counts(model_dir, family, samples),
        lambda c: (f"tokens per answer median {c['median']:.0f}, p90 {c['p90']:.0f}, max "
                   f"{c['max']}, unfinished {c['unfinished']} ({samples} walks per schema, "
                   f"per-schema medians {c['per_schema']})"))


def report_forced(tokenizer_json: Path, families: list[str], samples: int,
                  model_vocab: int = QWEN_MODEL_VOCAB) -> dict:
    """Print and return `forced_bound` for each family."""
    return _per_family(
        tokenizer_json, families, model_vocab,
        lambda model_dir, family: forced_bound(model_dir, family, samples),
        lambda b: (f"{b['tokens']} tokens of {samples} valid answers, forced share "
                   f"{b['forced_share']:.3f}, {b['chains']} chains (lengths: count "
                   f"{b['chain_lengths']}); best steps per output token: overlapped loop "
                   f"{b['steps_per_token_overlapped']:.3f}, synchronous loop "
                   f"{b['steps_per_token_synchronous']:.3f}"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", type=Path, required=True, help="tokenizer.json")
    p.add_argument("--model-vocab", type=int, default=QWEN_MODEL_VOCAB)
    p.add_argument("--families", default="short,long")
    p.add_argument("--samples", type=int, default=50,
                   help="walks per schema (with --forced: answers per family)")
    p.add_argument("--forced", action="store_true",
                   help="the forced-token bound on steps per output token instead")
    ns = p.parse_args()
    run = report_forced if ns.forced else report
    run(ns.tokenizer, ns.families.split(","), ns.samples, ns.model_vocab)


if __name__ == "__main__":
    main()
