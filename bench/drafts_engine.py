"""Drafts in the engine alone, on this machine's device: the same requests with and without.

    PYTHONPATH=$PWD python bench/drafts_engine.py [--device cpu] [--rows 96] [--draft-tokens 2]

One engine in process (the embedded default model, tests/engine_harness.py, 48 slots), rows
under a permissive regex that its random weights mostly follow (accept-first holds, so drafts
run), greedy, four prompts repeated: a warm-up wave fills the draft tables, then `--rows` rows
are timed, once with `--draft-tokens 0` and once with the setting, interleaved twice. Prints
steps, seconds, the ratios and whether the tokens were the same. On CPU a forward's cost grows
with every token it feeds, so drafts trade fewer steps for more work per step; this is the
measurement behind `--draft-tokens`' CPU default (0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def run(draft_tokens: int, rows: int, device: str) -> tuple[float, int, dict]:
    os.environ["GRAMSERVE_TEST_DEVICE"] = device
    import xgrammar as xgr
    from engine_harness import EngineHarness

    from gpu_worker.control.engine import Request
    from gpu_worker.guided.grammar_cache import GrammarHandle
    from grammar_service.default_model import ensure_default_model

    harness = EngineHarness(ensure_default_model(Path.home() / ".cache" / "gramserve" / "models"),
                            slots=48, max_model_len=256, step_tokens=256,
                            draft_tokens=draft_tokens)
    compiled = xgr.GrammarCompiler(harness.vocab.tokenizer_info(),
                                   max_threads=1).compile_regex(r"[^\n]{0,400}")

    def wave(tag: str, n: int) -> list[Request]:
        out = []
        for i in range(n):
            req = Request(request_id=f"{tag}{i}", prompt=harness.vocab.encode(f"loop {i % 4}"),
                          max_tokens=120, temperature=0.0)
            req.matcher = xgr.GrammarMatcher(compiled)
            req.grammar = GrammarHandle("permissive", None, None, 0)
            out.append(req)
        return out

    harness.run(wave("warm", 48))
    steps = harness.engine.step_index
    t0 = time.perf_counter()
    outs = harness.run(wave("timed", rows))
    seconds = time.perf_counter() - t0
    return seconds, harness.engine.step_index - steps, {k: v.tokens for k, v in outs.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=96)
    p.add_argument("--draft-tokens", type=int, default=2)
    ns = p.parse_args()
    print(f"device {ns.device}, {ns.rows} rows of up to 120 tokens, 48 slots; "
          f"drafts {ns.draft_tokens} against 0, interleaved")
    print("| round | drafts | tokens | steps | seconds | µs per token |")
    print("|---|---|---|---|---|---|")
    ratios, same = [], True
    for rnd in (1, 2):
        got = {}
        for d in (0, ns.draft_tokens) if rnd == 1 else (ns.draft_tokens, 0):
            seconds, steps, tokens = run(d, ns.rows, ns.device)
            n = sum(map(len, tokens.values()))
            got[d] = (seconds, steps, tokens)
            print(f"| {rnd} | {d} | {n} | {steps} | {seconds:.2f} | {seconds / n * 1e6:.0f} |",
                  flush=True)
        same &= got[0][2] == got[ns.draft_tokens][2]
        ratios.append((got[ns.draft_tokens][1] / got[0][1], got[ns.draft_tokens][0] / got[0][0]))
    for rnd, (steps, seconds) in enumerate(ratios, 1):
        print(f"round {rnd}: drafts ÷ none: steps {steps:.2f}, seconds {seconds:.2f}")
    print(f"same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
