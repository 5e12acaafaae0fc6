"""The engine of one rank with llguidance matchers beside xgrammar's in the same batch: every
guided row filled through the shared bitmask (I4), every output valid and completed by its
grammar, and the unguided neighbour unchanged. Real model, real backends, the real Triton
kernel under the interpreter."""

from __future__ import annotations

import json

import pytest
from constraints import constraint_mix, is_valid
from engine_harness import EngineHarness

from gpu_worker.control.engine import GRAMMAR_COMPLETED, Request
from grammar_service.backends import LLGUIDANCE, XGRAMMAR, LLGuidanceMatcher, VocabView
from grammar_service.default_model import ensure_default_model
from grammar_service.specs import parse_spec
from protos import common_pb2


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return EngineHarness(ensure_default_model(tmp_path_factory.mktemp("models")), slots=8)


def spec_for(kind, arg, backend) -> common_pb2.GrammarSpec:
    opts = common_pb2.GrammarOptions(backend=backend)
    if kind == "json_schema":
        opts.whitespace = common_pb2.WHITESPACE_COMPACT
        return common_pb2.GrammarSpec(json_schema=json.dumps(arg), options=opts)
    if kind == "regex":
        return common_pb2.GrammarSpec(regex=arg, options=opts)
    return common_pb2.GrammarSpec(choice=common_pb2.ChoiceList(choices=arg), options=opts)


def test_llguidance_and_xgrammar_rows_in_one_batch_all_complete_valid(harness):
    backends = VocabView.of(harness.vocab).backends()
    forced = {XGRAMMAR: common_pb2.GRAMMAR_BACKEND_XGRAMMAR,
              LLGUIDANCE: common_pb2.GRAMMAR_BACKEND_LLGUIDANCE}
    mix = [(i, kind, arg) for i, (kind, arg) in enumerate(constraint_mix()) if kind != "none"]

    def request(rid, seed, matcher=None, prompt="data"):
        req = Request(request_id=rid, prompt=harness.vocab.encode(prompt), max_tokens=48,
                      temperature=1.0, seed=seed)
        req.matcher = matcher
        return req

    alone = harness.run([request("u", 3, prompt="free text")])["u"]
    reqs, expect = [request("u", 3, prompt="free text")], {}
    for name in (LLGUIDANCE, XGRAMMAR):
        backend = backends[name]
        for i, kind, arg in mix[:4] if name == XGRAMMAR else mix:
            compiled = backend.compile(parse_spec(spec_for(kind, arg, forced[name])))
            rid = f"{name}-{i}"
            reqs.append(request(rid, 10 + i, backend.new_matcher(compiled)))
            expect[rid] = (kind, arg)
    assert sum(isinstance(r.matcher, LLGuidanceMatcher) for r in reqs) == len(mix)
    out = harness.run(reqs)
    assert out["u"].tokens == alone.tokens
    for rid, (kind, arg) in expect.items():
        text = harness.vocab.decode(out[rid].tokens)
        assert out[rid].reason == GRAMMAR_COMPLETED, (rid, out[rid])
        assert is_valid(kind, arg, text), (rid, text)
