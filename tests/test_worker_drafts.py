"""Drafted tokens (gpu_worker.guided.drafts) change how many steps a row takes, never a token.

Engines in process, 48 slots each, the same requests: every shortcut off (mask-first
sampling, the reference), forced tokens and accept-first without drafts, all three, and all
three with fused sampling points (gpu_worker.sampling.kernel.sample_rows). The requests are those of tests/test_worker_shortcuts.py (JSON schemas, a regex, a choice list,
EBNF, a forced literal; xgrammar and llguidance; greedy, seeded temperature, top-p and
logprobs rows; unguided neighbours) plus rows under a permissive regex, which the test
model's random weights mostly follow, so that accept-first holds and drafts get verified:
their prompts repeat, so later rows meet tables filled by earlier ones (and by their own
loops), and some are cut by small max_tokens in the middle of a draft. Real model, real
backends, the real Triton kernel under the interpreter. The TP=2 comparison over real worker
processes is in tests/test_worker_tp.py.
"""

from __future__ import annotations

import random

import pytest
import xgrammar as xgr
from engine_harness import EngineHarness
from test_worker_shortcuts import SAMPLINGS, assert_same_outputs, grammars, requests

from gpu_worker.control.engine import LENGTH, STOP, Request
from gpu_worker.guided.drafts import _BITS, START, DraftTables
from gpu_worker.guided.grammar_cache import GrammarHandle
from grammar_service.backends import LLGUIDANCE, VocabView
from grammar_service.default_model import ensure_default_model
from grammar_service.specs import parse_spec
from protos import common_pb2

PERMISSIVE = r"[^\n]{0,400}"
# (forced tokens, accept-first, draft tokens, fused sampling points; None: the device's
# default, off on the CPU, on with GRAMSERVE_TEST_DEVICE=cuda)
CONFIGS = {"off": (False, False, 0, False), "no_drafts": (True, True, 0, None),
           "drafts": (True, True, 2, None), "fused": (True, True, 2, True)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def permissive(vocab):
    """The permissive regex compiled by each backend: (name, compiled, new matcher)."""
    compiled = xgr.GrammarCompiler(vocab.tokenizer_info(), max_threads=1).compile_regex(
        PERMISSIVE)
    llg = VocabView.of(vocab).backends()[LLGUIDANCE]
    spec = common_pb2.GrammarSpec(regex=PERMISSIVE, options=common_pb2.GrammarOptions(
        backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE))
    llg_compiled = llg.compile(parse_spec(spec))
    return [("perm-xgr", lambda: xgr.GrammarMatcher(compiled)),
            ("perm-llg", lambda: llg.new_matcher(llg_compiled))]


def keyed(req: Request, key: str) -> Request:
    """The request with a grammar handle named `key`, as a rank's grammar cache gives it (the
    draft tables are per grammar key)."""
    req.grammar = GrammarHandle(key, None, None, 0)
    return req


def draft_requests(vocab, constraints, llg) -> list[Request]:
    """Permissive rows (some cut short by max_tokens), the shortcut test's requests, then the
    permissive rows' prompts again: the second wave starts once slots free up, with tables
    filled by the first."""
    def wave(tag: str) -> list[Request]:
        reqs = []
        for name, matcher in permissive(vocab):
            for i in range(12):
                sampling = SAMPLINGS["greedy"] if i % 2 == 0 else {"temperature": 1.0, "seed": i}
                req = Request(request_id=f"{name}/{tag}{i}", prompt=vocab.encode(f"loop {i % 3}"),
                              max_tokens=3 + i if i < 6 else 48, **sampling)
                req.matcher = matcher()
                reqs.append(keyed(req, name))
        return reqs
    reqs = wave("a")
    for req in requests(vocab, constraints, llg):
        if req.matcher is not None:
            keyed(req, req.request_id.split("/")[0])
        reqs.append(req)
    return reqs + wave("b")


@pytest.fixture(scope="module")
def results(model_dir):
    out = {}
    for config, (forced, accept_first, drafts, fused) in CONFIGS.items():
        harness = EngineHarness(model_dir, slots=48, max_model_len=128, step_tokens=256,
                                forced_tokens=forced, accept_first=accept_first,
                                draft_tokens=drafts, fused_sampling=fused)
        constraints, llg = grammars(harness.vocab)
        reqs = draft_requests(harness.vocab, constraints, llg)
        assert len(reqs) >= 48
        out[config] = (harness.run(reqs), dict(harness.engine.stats))
    return out


def test_drafts_give_the_tokens_of_mask_first_sampling(results):
    for config in ("no_drafts", "drafts"):
        assert_same_outputs(results["off"][0], results[config][0], config)


def test_fused_sampling_points_give_the_tokens_of_the_op_by_op_path(results):
    """Every shortcut and drafts on, sampling points fused (gpu_worker.sampling.kernel, under
    the interpreter here: its noise equals the PyTorch path's on the CPU) wherever the rows
    allow it: the tokens, finishes and logprobs of mask-first sampling op by op. Points with
    top-p or logprobs rows run op by op, so both paths ran, with redo rows and drafts."""
    assert_same_outputs(results["off"][0], results["fused"][0], "fused")
    stats = results["fused"][1]
    assert 0 < stats["fused_points"] < stats["sampling_points"], stats
    assert stats["resamples"] > 0 and stats["draft_accepted"] > 0, stats
    assert results["off"][1].get("fused_points", 0) == 0


def test_drafts_are_verified_kept_and_cut_and_save_steps(results):
    stats, plain = results["drafts"][1], results["no_drafts"][1]
    assert plain.get("drafted", 0) == 0 and results["off"][1].get("drafted", 0) == 0
    assert stats["drafted"] > 20, stats
    # Some agree with the model (each saves a step), some do not (cut where they differ).
    assert 0 < stats["draft_accepted"] < stats["drafted"], stats
    assert stats["row_forwards"] < plain["row_forwards"], (stats, plain)


def test_a_draft_cut_by_max_tokens_ends_exactly_there(results):
    base = results["off"][0]
    outs = results["drafts"][0]
    cut = 0
    for name in ("perm-xgr", "perm-llg"):
        for rid in (f"{name}/{tag}{i}" for tag in "ab" for i in range(6)):
            got = outs[rid]
            assert got.tokens == base[rid].tokens, rid
            if got.reason == LENGTH:
                assert len(got.tokens) == 3 + int(rid[-1]), rid
                cut += 1
    assert cut >= 12


def test_top_p_and_logprobs_rows_never_draft(model_dir):
    """The same permissive rows draft when sampled with temperature only, never with top-p or
    logprobs (mask-first: their distribution depends on the mask)."""
    def run(samplings):
        harness = EngineHarness(model_dir, slots=4, forced_tokens=True, accept_first=True,
                                draft_tokens=2)
        reqs = []
        for name, matcher in permissive(harness.vocab):
            for n, sname in enumerate(samplings * 2):
                req = Request(request_id=f"{name}/{sname}/{n}",
                              prompt=harness.vocab.encode("loop 0"), max_tokens=30,
                              **SAMPLINGS[sname])
                req.matcher = matcher()
                reqs.append(keyed(req, name))
        harness.run(reqs)
        return harness.engine.stats
    assert run(["topp", "logprobs"]).get("drafted", 0) == 0
    assert run(["greedy", "t1"])["drafted"] > 0


def test_draft_tables_guess_from_the_longest_context_seen():
    t = DraftTables(order=3)
    assert t.propose("g", [1, 2], 3) == []
    t.observe("g", [1, 2, 3, 4, 5], 0)
    assert t.propose("g", [9, 1, 2], 3) == [3, 4, 5]
    assert t.propose("g", [4], 2) == [5]       # nothing followed 5
    t.observe("g", [7, 2, 8], 0)               # after (2,) now 8; after (1, 2) still 3
    assert t.propose("g", [1, 2], 1) == [3]
    assert t.propose("g", [6, 2], 1) == [8]
    assert t.propose("other", [1, 2], 3) == []
    t.observe("g", [1, 2, 3, 4, 5, 6], 5)      # only the new token: after (3, 4, 5) comes 6
    assert t.propose("g", [3, 4, 5], 1) == [6]
    assert t.propose("g", [1, 2, 3], 4) == [4, 5, 6]


def test_draft_tables_guess_as_the_longest_match_rule_says():
    """`propose` (written out per context length) against the rule read plainly: per guess,
    the token after the longest context of up to `order` tokens seen, the output read as if
    it began with START; random outputs over a small alphabet, so contexts recur."""
    def reference(t, key, tokens, n):
        seen = t._tables.get(key)
        if not seen:
            return []
        context = [START, *tokens][-t.order:]
        out = []
        while len(out) < n:
            found = None
            for k in range(1, len(context) + 1):
                packed = sum(tok << (i * _BITS) for i, tok in enumerate(reversed(context[-k:])))
                if packed not in seen[k - 1]:
                    break
                found = seen[k - 1][packed]
            if found is None:
                break
            out.append(found)
            context = (context + [found])[-t.order:]
        return out

    rng = random.Random(7)
    for order in (1, 2, 3, 4):
        t = DraftTables(order=order)
        for _ in range(40):
            t.observe("g", [rng.randrange(6) for _ in range(rng.randrange(1, 30))], 0)
        for _ in range(400):
            tokens = [rng.randrange(6) for _ in range(rng.randrange(0, 8))]
            n = rng.randrange(1, 5)
            assert t.propose("g", tokens, n) == reference(t, "g", tokens, n), (order, tokens)


def test_draft_tables_forget_the_same_way_on_every_rank():
    def fill(t):
        for g in range(5):
            t.observe(f"g{g}", list(range(g, g + 40)), 0)
        t.observe("g1", [100, 101], 0)
        return [t.propose(f"g{g}", [g, g + 1], 3) for g in range(5)]
    a, b = DraftTables(max_grammars=3, max_entries=50), DraftTables(max_grammars=3, max_entries=50)
    assert fill(a) == fill(b)
    guesses = fill(DraftTables(max_grammars=3, max_entries=50))
    assert guesses[0] == [] and guesses[1] == []   # g0 and g1's first table dropped (LRU)
    assert guesses[4] == [6, 7, 8]
    t = DraftTables(order=2, max_entries=10)
    t.observe("g", list(range(20)), 0)             # 37 contexts: past the limit
    t.observe("g", [50, 51], 0)                    # starts again empty
    assert t.propose("g", [50], 1) == [51] and t.propose("g", [3], 1) == []


def test_stop_ids_and_releases_end_drafted_rows_exactly(model_dir, results):
    """Permissive rows given a stop id that their answer reaches (its token at position 6),
    and rows released mid-answer, beside rows that run on, 48 slots, drafts on against every
    shortcut off: a stop id ends the row at its first occurrence whatever the step delivered
    around it; a released row's tokens are a prefix of the same row's answer (a step with
    drafts may deliver a few more before the release lands); every slot is free at the end
    and the other rows' tokens are the same."""
    answers = results["off"][0]
    outs = {}
    for config in ("off", "drafts"):
        forced, accept_first, drafts, fused = CONFIGS[config]
        harness = EngineHarness(model_dir, slots=48, max_model_len=128, step_tokens=256,
                                forced_tokens=forced, accept_first=accept_first,
                                draft_tokens=drafts, fused_sampling=fused)
        reqs, release = [], {}
        for wave in ("a", "b"):
            for name, matcher in permissive(harness.vocab):
                for i in range(6, 12):
                    answer = answers[f"{name}/{wave}{i}"].tokens
                    sampling = SAMPLINGS["greedy"] if i % 2 == 0 else {"temperature": 1.0,
                                                                       "seed": i}
                    kind = ("stop", "release", "run")[i % 3]
                    req = Request(request_id=f"{name}/{wave}{i}/{kind}",
                                  prompt=harness.vocab.encode(f"loop {i % 3}"), max_tokens=48,
                                  stop_token_ids=frozenset({answer[6]} if kind == "stop" else ()),
                                  **sampling)
                    req.matcher = matcher()
                    reqs.append(keyed(req, name))
                    if kind == "release":
                        release[req.request_id] = 9
            reqs += [keyed(r, "pad") for r in draft_requests(harness.vocab, *grammars(
                harness.vocab))[:24] if wave == "a"]
        outs[config] = harness.run(reqs, release_after=release)
        assert harness.table.in_use() == 0 and not harness.engine.runs
    off, on = outs["off"], outs["drafts"]
    assert off.keys() == on.keys()
    for rid, want in off.items():
        got = on[rid]
        if rid.endswith("/release"):
            short, long = sorted((got.tokens, want.tokens), key=len)
            assert long[:len(short)] == short and len(short) >= 9, rid
            continue
        assert (got.tokens, got.reason) == (want.tokens, want.reason), rid
        if rid.endswith("/stop"):
            answer = answers[rid.rsplit("/", 1)[0]].tokens
            first = answer.index(answer[6])
            assert got.reason == STOP and got.tokens == answer[:first], rid


def test_drafts_default_to_the_device():
    """--draft-tokens -1 (the default) is 2 on CUDA and 0 on CPU; a number is taken as given;
    a bad value names the flag."""
    from gpu_worker.config import DRAFT_TOKENS_CUDA, WorkerConfig, draft_tokens_on, parser

    assert parser().parse_args([]).draft_tokens == -1
    assert draft_tokens_on(-1, "cuda") == DRAFT_TOKENS_CUDA == 2
    assert draft_tokens_on(-1, "cpu") == 0
    assert draft_tokens_on(3, "cpu") == 3 and draft_tokens_on(0, "cuda") == 0
    ns = vars(parser().parse_args(["--draft-tokens", "9"]))
    with pytest.raises(ValueError, match="--draft-tokens"):
        WorkerConfig(**ns)
