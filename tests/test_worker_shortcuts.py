"""Forced tokens and accept-first masking change how much work a step does, never a token.

One engine per configuration (both off, each alone, both on), in process, with 48 slots: the
same requests (JSON schemas, a regex, a choice list, EBNF, a forced literal; xgrammar and
llguidance rows; greedy, seeded temperature and top-p sampling; unguided neighbours) give
bit-identical tokens, finishes and logprobs in every configuration, and the counters show that
each mechanism did run. Real model, real backends, the real Triton kernel under the
interpreter. The same comparison over real worker processes at TP=2 is in
tests/test_worker_tp.py.
"""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from constraints import SCHEMAS, is_valid
from engine_harness import EngineHarness

from gpu_worker.control.engine import GRAMMAR_COMPLETED, LENGTH, Request
from grammar_service.backends import LLGUIDANCE, VocabView
from grammar_service.default_model import ensure_default_model
from grammar_service.specs import parse_spec
from protos import common_pb2

CONFIGS = {"off": (False, False), "forced": (True, False), "accept_first": (False, True),
           "both": (True, True)}
EBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-c] | "null"'
EBNF_AS_REGEX = r"\[(?:[a-c]|null)(?:,(?:[a-c]|null))*\]"
# Characters whose pairs are no tokens of the default model's vocabulary, so that after the
# first one the grammar allows one token at a time: a chain of forced tokens.
FORCED_REGEX = r"[a-z]{2}~\^~\^~\^~\^~\^~\^"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def grammars(vocab):
    """(name, kind, arg, make matcher) for every constraint of the test."""
    compiler = xgr.GrammarCompiler(vocab.tokenizer_info(), max_threads=1)
    out = []
    for i, schema in enumerate(SCHEMAS):
        g = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        out.append((f"schema{i}", "json_schema", schema, g))
    out.append(("regex", "regex", r"[a-z]{3}-[0-9]{2}", compiler.compile_regex(r"[a-z]{3}-[0-9]{2}")))
    out.append(("choice", "choice", ["alpha", "beta", "gamma delta"],
                compiler.compile_grammar('root ::= "alpha" | "beta" | "gamma delta"')))
    out.append(("ebnf", "ebnf", EBNF, compiler.compile_grammar(EBNF)))
    out.append(("forced", "regex", FORCED_REGEX, compiler.compile_regex(FORCED_REGEX)))
    llg = VocabView.of(vocab).backends()[LLGUIDANCE]
    opts = common_pb2.GrammarOptions(backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE,
                                     whitespace=common_pb2.WHITESPACE_COMPACT)
    spec = common_pb2.GrammarSpec(json_schema=json.dumps(SCHEMAS[0]), options=opts)
    out.append(("llg-schema0", "json_schema", SCHEMAS[0], llg.compile(parse_spec(spec))))
    spec = common_pb2.GrammarSpec(regex=FORCED_REGEX, options=common_pb2.GrammarOptions(
        backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE))
    out.append(("llg-forced", "regex", FORCED_REGEX, llg.compile(parse_spec(spec))))
    return out, llg


SAMPLINGS = {  # name -> Request fields
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0, "seed": 11},
    "t07": {"temperature": 0.7, "seed": 12},
    "topp": {"temperature": 1.0, "top_p": 0.8, "seed": 13},
    "logprobs": {"temperature": 1.0, "seed": 14, "logprobs": True, "top_logprobs": 3},
}


def requests(vocab, constraints, llg) -> list[Request]:
    reqs = []
    for name, _, _, compiled in constraints:
        for sname, fields in SAMPLINGS.items():
            req = Request(request_id=f"{name}/{sname}", prompt=vocab.encode(f"{name} please"),
                          max_tokens=40, **fields)
            req.matcher = (llg.new_matcher(compiled) if name.startswith("llg")
                           else xgr.GrammarMatcher(compiled))
            reqs.append(req)
    for seed in range(4):
        reqs.append(Request(request_id=f"free/{seed}", prompt=vocab.encode("free text"),
                            max_tokens=24, temperature=1.0, seed=seed))
    # A forced chain cut by max_tokens: it must end exactly there.
    for n in (4, 7):
        req = Request(request_id=f"cut/{n}", prompt=vocab.encode("forced please"), max_tokens=n,
                      temperature=0.0)
        req.matcher = xgr.GrammarMatcher(constraints[-3][3])
        reqs.append(req)
    return reqs


@pytest.fixture(scope="module")
def results(model_dir):
    out = {}
    for config, (forced, accept_first) in CONFIGS.items():
        harness = EngineHarness(model_dir, slots=48, max_model_len=128, step_tokens=256,
                                forced_tokens=forced, accept_first=accept_first)
        constraints, llg = grammars(harness.vocab)
        reqs = requests(harness.vocab, constraints, llg)
        assert len(reqs) >= 48
        out[config] = (harness.run(reqs), dict(harness.engine.stats), harness, constraints)
    return out


def test_every_configuration_gives_the_tokens_of_mask_first_sampling(results):
    base, _, harness, constraints = results["off"]
    kinds = {name: (kind, arg) for name, kind, arg, _ in constraints}
    for rid, outcome in base.items():
        name = rid.split("/")[0]
        if name in kinds and not rid.startswith("cut/"):
            kind, arg = kinds[name]
            if kind == "ebnf":
                kind, arg = "regex", EBNF_AS_REGEX
            assert outcome.reason == GRAMMAR_COMPLETED, (rid, outcome.reason, outcome.message)
            assert is_valid(kind, arg, harness.vocab.decode(outcome.tokens)), rid
    for config in ("forced", "accept_first", "both"):
        assert_same_outputs(base, results[config][0], config)


def assert_same_outputs(base: dict, outs: dict, config: str) -> None:
    """Every request of `base` has the same tokens, finish reason and logprobs in `outs`.
    Rows skip steps (a forced chain or drafts fed as one chunk; a refused row loses a step),
    so a row's logits come from other batch shapes: logprobs are equal up to the reduction
    order of floating-point sums, as with prefill chunks."""
    assert outs.keys() == base.keys()
    for rid, want in base.items():
        got = outs[rid]
        assert (got.tokens, got.reason) == (want.tokens, want.reason), (config, rid)
        assert len(got.logprobs) == len(want.logprobs), (config, rid)
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a[1] == b[1] and a[0] == pytest.approx(b[0], abs=1e-4), (config, rid)
            assert a[2] == pytest.approx(b[2], abs=1e-4), (config, rid)


def test_each_mechanism_runs_only_where_it_is_on(results):
    off, forced, accept_first, both = (results[c][1] for c in CONFIGS)
    assert off.get("forced_tokens", 0) == 0 and off.get("accept_first", 0) == 0
    assert forced["forced_tokens"] > 0 and forced.get("accept_first", 0) == 0
    assert accept_first["accept_first"] > 0 and accept_first.get("forced_tokens", 0) == 0
    assert both["forced_tokens"] > 0 and both["accept_first"] > 0
    # Forced chains are fed as chunks: fewer rows forwarded for the same tokens.
    assert forced["row_forwards"] < off["row_forwards"]


def test_accept_first_backs_off_when_the_model_ignores_the_grammar(results):
    """The test model's weights are random: nearly every unmasked token is refused. A refusal
    costs its row one step, so rows back off, the engine's refusal average rises, and rows
    admitted later start backed off: they sample (nearly) every token mask-first."""
    outs, stats, harness, constraints = results["accept_first"]
    assert stats["resamples"] >= stats["accept_first"] * 0.8  # the model ignores the grammar
    _, llg = grammars(harness.vocab)
    wave = [r for r in requests(harness.vocab, constraints, llg) if r.matcher is not None]
    before = dict(harness.engine.stats)
    again = harness.run(wave)
    tried = harness.engine.stats["accept_first"] - before["accept_first"]
    tokens = sum(len(again[r.request_id].tokens) for r in wave)
    assert tried <= tokens / 10, (tried, tokens)
    assert all(again[r.request_id].tokens == outs[r.request_id].tokens for r in wave)


def test_top_p_and_logprobs_rows_never_sample_accept_first(model_dir):
    harness = EngineHarness(model_dir, slots=8, forced_tokens=False, accept_first=True)
    constraints, _ = grammars(harness.vocab)
    reqs = []
    for name, _, _, compiled in constraints[:4]:
        for sname in ("topp", "logprobs"):
            req = Request(request_id=f"{name}/{sname}", prompt=harness.vocab.encode(name),
                          max_tokens=30, **SAMPLINGS[sname])
            req.matcher = xgr.GrammarMatcher(compiled)
            reqs.append(req)
    outs = harness.run(reqs)
    assert all(o.reason == GRAMMAR_COMPLETED for o in outs.values())
    assert harness.engine.stats.get("accept_first", 0) == 0


def test_forced_chain_cut_by_max_tokens_ends_exactly_there(results):
    base = results["off"][0]
    for config in ("forced", "both"):
        outs = results[config][0]
        for n in (4, 7):
            got = outs[f"cut/{n}"]
            assert got.reason == LENGTH and len(got.tokens) == n, (config, n, got)
            assert got.tokens == base[f"cut/{n}"].tokens
    # The literal's chain is long enough to cross both cuts.
    full = results["both"][0]["forced/greedy"]
    assert len(full.tokens) > 7


def test_forced_tokens_have_logprob_zero_and_are_the_only_alternative(results):
    outs = results["both"][0]
    for rid in ("forced/logprobs", "llg-forced/logprobs"):
        lps = outs[rid].logprobs
        assert lps and len(lps) == len(outs[rid].tokens)
        forced = [(tok, lp) for tok, lp in zip(outs[rid].tokens, lps, strict=True)
                  if lp[0] == 0.0 and lp[1] == [tok]]
        assert len(forced) >= 6, rid



def test_the_device_flag_of_a_single_allowed_token_agrees_with_the_host_scan():
    """`single_allowed` (on the device, from the step's masked logits) and `ForcedScan` (on
    the host, from the bitmask) say the same for every kind of row: one bit, one bit in the
    sign bit or the partial last word, two bits in one word or in two, none, all, and a bit
    only among the padded ids past the vocabulary."""
    import torch

    from gpu_worker.guided.forced import ForcedScan, single_allowed
    from gpu_worker.guided.mask_reference import apply_token_bitmask_reference_

    vocab, width = 1000, 40  # 1000 = 31 words + 8 bits; 40 words cover 1280 ids
    rows = torch.zeros((9, width), dtype=torch.int32)
    rows[0, 3] = 1 << 7                    # one token: 103
    rows[1, 30] = -(1 << 31)               # one token in the sign bit: 991
    rows[2, 31] = 1 << 7                   # one token in the partial word: 999
    rows[3, 5] = 0b101                     # two tokens, one word
    rows[4, 2], rows[4, 9] = 1, 1          # two tokens, two words
    rows[6] = -1                           # all
    rows[7, 31] = 1 << 9                   # only a padded id (1001): none
    rows[8, 31], rows[8, 0] = (1 << 9) | 1, 1 << 4  # 4 and 992 (+ padded 1001)
    # row 5: nothing allowed
    want = [t >= 0 for t in ForcedScan(vocab, width).single_allowed(rows, list(range(9)))]
    assert want == [True, True, True, False, False, False, False, False, False]
    logits = torch.randn((9, 1024))  # the model's padded vocabulary
    apply_token_bitmask_reference_(logits, rows, vocab_size=vocab)
    assert single_allowed(logits).tolist() == want


def test_a_refused_row_is_sampled_one_sampling_point_later_and_no_row_waits_for_its_fill(
        model_dir, monkeypatch):
    """Random weights: an accept-first row's first unmasked token is refused. The step whose
    commit refuses it samples its neighbours without waiting for its fill (here held back on
    the fill thread until that step is over), and the row is sampled at the next sampling
    point, masked, from its saved logits: the tokens of mask-first sampling. A lone refusal
    leaves the row accept-first (no masked tokens after it)."""
    import threading
    import time

    import gpu_worker.control.engine as engine_mod

    harness = EngineHarness(model_dir, slots=8, forced_tokens=False, accept_first=True)
    engine = harness.engine
    constraints, _ = grammars(harness.vocab)
    compiled = constraints[0][3]
    release = threading.Event()
    held = []

    def prepare(masks, scan, jobs, rounds):  # the refused rows' own job waits for `release`
        if any(engine.runs.get(j.slot) is not None and engine.runs[j.slot].redo is not None
               for j in jobs):
            held.append([j.slot for j in jobs])
            release.wait(30)
        return engine_mod_prepare(masks, scan, jobs, rounds)

    engine_mod_prepare = engine_mod.prepare
    monkeypatch.setattr(engine_mod, "prepare", prepare)

    def request(i):  # rows 0-5 guided, 6-7 free text
        req = Request(request_id=f"r{i}", prompt=harness.vocab.encode(f"row {i}"),
                      max_tokens=12, temperature=1.0, seed=100 + i)
        if i < 6:
            req.matcher = xgr.GrammarMatcher(compiled)
        return req

    reqs = [request(i) for i in range(8)]
    for req in reqs:
        harness.table.allocate(req.request_id, req)
    for _ in range(20):
        start = time.monotonic()
        engine.step()
        if held:
            break
    assert held, "no accept-first token was refused"
    assert time.monotonic() - start < 20  # the step did not wait for the held fill
    refused = [engine.runs[s] for s in held[0]]
    for r in refused:
        assert r.redo is not None and r.pending == 0  # not sampled at this step
        assert r.af_skip == 0  # a lone refusal: no mask-first tokens after it
    assert all(r.pending for r in engine.runs.values() if r.redo is None)  # the others were
    release.set()
    engine.step()
    for r in refused:
        assert engine.runs.get(r.slot) is not r or (r.redo is None and r.pending == 1)
    for _ in range(500):  # to the end: the tokens of mask-first sampling
        if not engine.runs:
            break
        engine.step()
    tokens: dict[str, list[int]] = {}
    for out in harness._outputs:
        tokens.setdefault(out.req.request_id, []).extend(out.tokens)
    plain = EngineHarness(model_dir, slots=8, forced_tokens=False, accept_first=False)
    again = plain.run([request(i) for i in range(8)])
    assert tokens == {rid: outcome.tokens for rid, outcome in again.items()}


def _forced_rows(vocab, n):
    """n xgrammar matchers of FORCED_REGEX just past its two free letters: from there on the
    grammar allows one token at a time (12 forced tokens, then the end)."""
    compiled = xgr.GrammarCompiler(vocab.tokenizer_info(), max_threads=1).compile_regex(
        FORCED_REGEX)
    rows = []
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled)
        for token in vocab.encode("ab")[1:]:  # past the BOS
            assert m.accept_token(token)
        rows.append(m)
    return rows


def test_chain_rounds_run_only_where_they_pay(model_dir):
    """`prepare` follows a chain within one job only while `ChainRounds` says a round pays:
    enough rows of the batch took a forced token, weighted by how often one went on. Where
    it does not, each row takes one forced token and no fill after it (its next fill joins
    the next batch), and the next job's scan tells the policy that the chain went on. The
    tokens taken are the same either way: only how many one job takes changes."""
    import torch

    from gpu_worker.guided.forced import ChainRounds, ForcedScan, RowJob, prepare
    from gpu_worker.guided.masks import MaskFiller
    from grammar_service.vocab import load_vocab

    vocab = load_vocab(model_dir)
    rows = 48
    # The bitmask is as wide as the model's vocabulary (padded ids included), as on a rank.
    filler = MaskFiller(rows, vocab.tokenizer_info().vocab_size, torch.device("cpu"),
                        fill_threads=1)
    scan = ForcedScan(vocab.vocab_size, filler.width)

    def jobs(matchers, chained=(), budget=100):
        return [RowJob(m, slot, budget if m is not None else 0, frozenset(vocab.eos_token_ids),
                       after_forced=slot in chained) for slot, m in enumerate(matchers)]

    other = xgr.GrammarCompiler(vocab.tokenizer_info(), max_threads=1).compile_regex("[a-z]+")

    def batch(chaining):
        ms = _forced_rows(vocab, chaining) + [xgr.GrammarMatcher(other)
                                              for _ in range(rows - chaining)]
        return ms, jobs(ms)

    # No policy (or a free round): every chain is followed to its end in one job.
    ms, js = batch(2)
    _, fills, extra = prepare(filler, scan, js)
    assert [len(j.chain) for j in js[:2]] == [12, 12] and extra == 12
    assert all(not j.chain for j in js[2:]) and fills == rows + 2 * 12
    whole = js[0].chain
    # 2 of 48 rows chaining, a round costing 1/16 of a step: 2 * 1.0 < 3, no round.
    policy = ChainRounds(1 / 16)
    ms, js = batch(2)
    _, fills, extra = prepare(filler, scan, js, policy)
    assert [len(j.chain) for j in js[:2]] == [1, 1] and extra == 0 and fills == rows
    assert not js[0].filled and js[2].filled and policy.goes_on == 1.0
    # The next job of those rows (fills them first) sees their chains go on: observed.
    taken = [js[0].chain[0]]
    for _ in range(11):
        nxt = jobs(ms, chained={0, 1})
        prepare(filler, scan, nxt, policy)
        assert len(nxt[0].chain) == 1
        taken += nxt[0].chain
    assert taken == whole and policy.goes_on == 1.0
    nxt = jobs(ms, chained={0, 1})  # past the last forced token: the chain ended
    prepare(filler, scan, nxt, policy)
    assert not nxt[0].chain and policy.goes_on < 1.0
    # 8 of 48 rows chaining: 8 * goes_on >= 3, rounds follow the chains at once.
    policy = ChainRounds(1 / 16)
    ms, js = batch(8)
    _, fills, extra = prepare(filler, scan, js, policy)
    assert all(j.chain == whole for j in js[:8]) and extra == 12
    # A policy that has seen chains stop after one token stops paying for rounds.
    for _ in range(64):
        policy.observe(False)
    ms, js = batch(8)
    _, _, extra = prepare(filler, scan, js, policy)
    assert all(len(j.chain) == 1 for j in js[:8]) and extra == 0
    assert ChainRounds(0.0).worth(1, 1000)  # a free round always runs
