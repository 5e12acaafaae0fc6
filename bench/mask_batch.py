"""A step's mask fills as a rank makes them: 64 rows of one schema family, both backends.

    PYTHONPATH=$PWD python bench/mask_batch.py --tokenizer .bench/tok150k.json \
        [--families long,short] [--rows 64] [--batches 200] [--threads auto,4,1]

Each family's schemas (bench/schemas/) are compiled as the grammar service compiles them
(compact whitespace; the backend auto chooses, then xgrammar forced), with the grammar's
default property order. Every batch puts each of `--rows` rows at a random position of a
valid instance of a random schema (bench/train_json.py's generator, the answers of a model
that follows the schema), the same positions for both backends; then the rank's own
MaskFiller fills all the rows at once, in parallel as in the engine, with each thread count.
Printed per family and backend: the batch fill p50 / p90 / p99 / max in ms, the sum of the
rows' one-thread mask times (the work), the speed-up of the threads over that sum, and where
the slowest single masks are (the instance text before them). Ratios are of one run on one
machine. `--schemas 1`: every row of one schema, as an application serving one schema.

llguidance runs twice: as a rank has it (lanes: `LANES_PER_THREAD` templates per fill thread,
grammar_service.backends.LLGuidanceGrammar) and with one template, every matcher a copy of
it (an LLMatcher's `deep_copy` shares its lexer behind one lock: the masks of one grammar
are then computed one at a time, whatever the threads).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.schema_verdicts import Judge  # noqa: E402
from bench.train_json import instance  # noqa: E402
from gateway.loadgen import load_schemas  # noqa: E402
from gpu_worker.guided.masks import MaskFiller  # noqa: E402
from grammar_service.backends import (  # noqa: E402
    LANES_PER_THREAD,
    LLGUIDANCE,
    LLGuidanceBackend,
    LLGuidanceGrammar,
    default_fill_threads,
)
from protos import common_pb2  # noqa: E402


def positions(judge: Judge, schemas: list[dict], rows: int, rng: random.Random):
    """`rows` (schema index, tokens before the mask, text before it) draws."""
    out = []
    for _ in range(rows):
        i = rng.randrange(len(schemas))
        text = json.dumps(instance(schemas[i], rng), separators=(",", ":"))
        tokens = judge.vocab.encode(text, add_special_tokens=False)
        k = rng.randrange(len(tokens) + 1)  # k == len: the mask before the stop token
        out.append((i, tokens[:k], judge.vocab.decode(tokens[max(0, k - 3):k])))
    return out


def fresh(setting: list, draws: list) -> list:
    """New matchers (as a rank makes one per request) at the drawn positions; `setting`: per
    schema, (backend, compiled grammar). Fresh for each measurement: a matcher keeps the mask
    it computed for its state (llguidance), so a second fill would cost nothing."""
    out = []
    for i, tokens, _ in draws:
        backend, grammar = setting[i]
        m = backend.new_matcher(grammar)
        for t in tokens:
            if not m.accept_token(t):
                raise SystemExit("a valid instance refused")
        out.append(m)
    return out


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(p * len(values)))]


def settings(judge: Judge, builds: dict, threads: list) -> dict:
    """(name, fill threads) -> per schema (rank backend, compiled grammar): xgrammar;
    llguidance as a rank has it (`LANES_PER_THREAD` lanes per fill thread); llguidance with
    one lane (every matcher a copy of one template)."""
    out = {}
    for t in threads:
        n = default_fill_threads() if t == "auto" else t
        out[("xgrammar", t)] = [(judge.ranks[b.backend], b.grammar) for b in builds["xgrammar"]]
        for name, lanes in (("llguidance", LANES_PER_THREAD * n), ("llg 1 lane", 1)):
            backend = LLGuidanceBackend(judge.vocab.llguidance_tokenizer(),
                                        judge.vocab.eos_token_ids, lanes=lanes)
            out[(name, t)] = [(backend, LLGuidanceGrammar(b.grammar.grammar))
                              for b in builds["gramserve"]]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--families", default="long,short")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--schemas", type=int, default=0,
                        help="only the first N schemas of each family (1: every row one "
                             "schema, as an application serving one schema; 0: all)")
    parser.add_argument("--threads", default="auto,4,1",
                        help="fill threads of each MaskFiller (auto: the backends' default)")
    ns = parser.parse_args(argv)
    from bench.grammars import model_dir
    from grammar_service.vocab import load_vocab

    judge = Judge(load_vocab(model_dir(ns.tokenizer)))
    vocab = judge.vocab.model_vocab_size
    threads = [t if t == "auto" else int(t) for t in ns.threads.split(",")]
    fillers = {t: MaskFiller(ns.rows, vocab, torch.device("cpu"), t) for t in threads}
    one = torch.zeros((1, judge.words), dtype=torch.int32)
    print(f"vocabulary {vocab} tokens, {ns.rows} rows per batch, {ns.batches} batches, "
          f"{ns.schemas or 'all'} schema(s) per family, "
          f"{os.cpu_count()} cores, fill threads {ns.threads}; batch fill ms p50 / p90 / p99 / max, the rows' "
          "one-thread mask time summed (ms per batch, mean), the threads' speed-up over it")
    rng = random.Random(0)
    for family in ns.families.split(","):
        schemas = [json.loads(s) for s in load_schemas(family)][:ns.schemas or None]
        builds = {}
        for mode in ("gramserve", "xgrammar"):
            builds[mode] = [judge.build(s, mode, whitespace=common_pb2.WHITESPACE_COMPACT)
                            for s in schemas]
            bad = [b.error for b in builds[mode] if not b.ok]
            if bad:
                raise SystemExit(f"{family} {mode}: {bad[0]}")
        if any(b.backend != LLGUIDANCE for b in builds["gramserve"]):
            raise SystemExit(f"{family}: gramserve chose xgrammar for some schema")
        runs = settings(judge, builds, threads)
        stats = {key: [] for key in runs}
        work = collections.defaultdict(list)
        slow = collections.defaultdict(collections.Counter)
        for _ in range(ns.batches):
            draws = positions(judge, schemas, ns.rows, rng)
            for name in ("xgrammar", "llguidance"):
                total = 0.0
                for m, (_, _, before) in zip(fresh(runs[(name, threads[0])], draws), draws,
                                             strict=True):
                    start = time.perf_counter()
                    m.fill_next_token_bitmask(one, 0)
                    spent = time.perf_counter() - start
                    total += spent
                    if spent > 3e-4:
                        slow[name][before] += 1
                work[name].append(total)
            for (name, t), setting in runs.items():
                stats[(name, t)].append(fillers[t].fill(fresh(setting, draws),
                                                        list(range(ns.rows))))
        for (name, t), values in stats.items():
            s = [1e3 * v for v in values]
            mean_work = 1e3 * sum(work["xgrammar" if name == "xgrammar" else "llguidance"]) \
                / len(values)
            print(f"{family:6} {name:10} threads {t!s:>4}: {pct(s, .5):6.2f} / "
                  f"{pct(s, .9):6.2f} / {pct(s, .99):6.2f} / {max(s):6.2f} ms   "
                  f"work {mean_work:6.2f} ms   speed-up {mean_work / (sum(s) / len(s)):4.1f}x")
        for name in ("xgrammar", "llguidance"):
            print(f"       slowest single masks ({name}, > 0.3 ms, text before): "
                  f"{slow[name].most_common(4)}")
        for t in threads:
            x = sum(stats[("xgrammar", t)])
            print(f"{family:6} threads {t}: llguidance ÷ xgrammar batch fill "
                  f"{sum(stats[('llguidance', t)]) / x:.2f}, with one lane "
                  f"{sum(stats[('llg 1 lane', t)]) / x:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
