"""A step's accepts as a rank makes them: each row's sampled token into its own matcher.

    PYTHONPATH=$PWD python bench/accept_batch.py --tokenizer .bench/tok150k.json \
        [--family long] [--rows 64] [--batches 100] [--threads auto,4,1]

Every batch puts `--rows` rows at random positions of valid instances of the family's schemas
(as bench/mask_batch.py: the answers of a model that follows the schema), compiled as the
grammar service compiles them (compact whitespace; auto, which takes llguidance here, and
xgrammar forced), and gives each row an allowed next token. Then, per batch, on fresh copies of
the same matchers: the engine's path (`accept_token` one row after another, GIL held), the
call it makes without our wrapper (llguidance `try_consume_tokens`), llguidance's
`consume_token` (which leaves a matcher in an error state where it refuses), and each backend's
batch call (llguidance `LLExecutor.consume_token_par` with each thread count, GIL released;
xgrammar `BatchGrammarMatcher.batch_accept_token`). Printed: µs per batch, mean. On CUDA also
the host cost of one index tensor sent to the device: made per call (pinned, copied) and
written into a staged pinned buffer (the engine's `_IndexStage`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llguidance  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import xgrammar as xgr  # noqa: E402

from bench.mask_batch import positions  # noqa: E402
from bench.schema_verdicts import Judge  # noqa: E402
from gateway.loadgen import load_schemas  # noqa: E402
from grammar_service.backends import LLGuidanceMatcher, default_fill_threads  # noqa: E402
from protos import common_pb2  # noqa: E402


def rows_at(judge: Judge, builds: list, draws: list) -> list[tuple[object, int]]:
    """(matcher at the drawn position, an allowed next token: the lowest id its mask allows)
    per draw; draws at the end of an instance take the stop token."""
    one = torch.zeros((1, judge.words), dtype=torch.int32)
    out = []
    for i, tokens, _ in draws:
        b = builds[i]
        m = judge.ranks[b.backend].new_matcher(b.grammar)
        if not all(m.accept_token(t) for t in tokens):
            raise SystemExit("a valid instance refused")
        m.fill_next_token_bitmask(one, 0)
        words = one[0].numpy().view(np.uint32)
        k = int(np.flatnonzero(words)[0])
        out.append((m, 32 * k + (int(words[k]) & -int(words[k])).bit_length() - 1))
    return out


def calls(ours: list, copies: dict, tokens: list[int], xg: list, executors: dict) -> list:
    """(name, call) per variant of one batch (see the module docstring)."""
    half = len(xg) // 2  # each xgrammar call on its own half: a matcher accepts once
    out = [
        ("llguidance accept_token loop (the engine's)",
         lambda: [m.accept_token(t) for m, t in zip(ours, tokens, strict=True)]),
        ("llguidance try_consume_tokens loop (its call)",
         lambda: [m.try_consume_tokens([t]) for m, t in zip(copies["try"], tokens, strict=True)]),
        ("llguidance consume_token loop",
         lambda: [m.consume_token(t) for m, t in zip(copies["consume"], tokens, strict=True)]),
    ]
    for n, ex in executors.items():
        pairs = list(zip(copies[f"par {n}"], tokens, strict=True))
        out.append((f"llguidance consume_token_par, {n} threads",
                    lambda ex=ex, pairs=pairs: ex.consume_token_par(pairs)))
    return out + [
        ("xgrammar accept_token loop (half the rows)",
         lambda: [m.accept_token(t) for m, t in xg[:half]]),
        ("xgrammar batch_accept_token (the other half)",
         lambda: xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in xg[half:]],
                                                            [t for _, t in xg[half:]])),
    ]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--family", default="long")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--threads", default="auto,4,1",
                        help="LLExecutor threads for consume_token_par (auto: llguidance's default)")
    ns = parser.parse_args(argv)
    from bench.grammars import model_dir
    from grammar_service.vocab import load_vocab

    judge = Judge(load_vocab(model_dir(ns.tokenizer)))
    schemas = [json.loads(s) for s in load_schemas(ns.family)]
    builds = {mode: [judge.build(s, mode, whitespace=common_pb2.WHITESPACE_COMPACT)
                     for s in schemas] for mode in ("gramserve", "xgrammar")}
    if any(not b.ok for bs in builds.values() for b in bs):
        raise SystemExit("a schema does not compile")
    threads = [default_fill_threads() if t == "auto" else int(t) for t in ns.threads.split(",")]
    executors = {t: llguidance.LLExecutor(t) for t in threads}
    rng = random.Random(0)
    spent: dict[str, float] = {}

    def add(name: str, seconds: float) -> None:
        spent[name] = spent.get(name, 0.0) + seconds

    eos, words = judge.vocab.eos_token_ids, judge.words
    for batch in range(-1, ns.batches):  # batch -1 warms up (pools, caches): not counted
        if batch == 0:
            spent.clear()
        draws = positions(judge, schemas, ns.rows, rng)
        llg = rows_at(judge, builds["gramserve"], draws)
        # Every variant on its own copies of the rows' matchers, made the same way, in an
        # order that turns with the batch: whichever call runs first in a batch costs more
        # (by up to 3 µs a row here), so each takes that place as often as the others.
        ours = [LLGuidanceMatcher(m.llmatcher, frozenset(eos), words) for m, _ in llg]
        copies = {name: [m.llmatcher.deep_copy() for m, _ in llg]
                  for name in ["try", "consume"] + [f"par {t}" for t in threads]}
        xg = rows_at(judge, builds["xgrammar"], draws)
        variants = calls(ours, copies, [t for _, t in llg], xg, executors)
        turn = batch % len(variants)
        for name, fn in variants[turn:] + variants[:turn]:
            add(name, timed(fn))
    print(f"{ns.family}: {ns.rows} rows per batch, {ns.batches} batches, µs per batch (mean)")
    for name, seconds in spent.items():
        print(f"  {name:50} {1e6 * seconds / ns.batches:8.1f}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        values = list(range(ns.rows))
        host = torch.empty(ns.rows, dtype=torch.int64, pin_memory=True)
        words = host.numpy()
        dev = torch.empty(ns.rows, dtype=torch.int64, device=device)

        def staged():
            words[:] = values
            dev.copy_(host, non_blocking=True)

        def made():
            torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)

        for name, fn in (("made per call", made), ("staged", staged)):
            torch.cuda.synchronize()
            seconds = timed(lambda fn=fn: [fn() for _ in range(1000)])
            torch.cuda.synchronize()
            print(f"  index tensor to the device, {name:14} {1e3 * seconds:8.1f} µs each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
