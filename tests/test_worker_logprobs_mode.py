"""Unconstrained logprobs (SamplingParams.logprobs_mode): the model's own distribution before
the grammar's mask, beside the constrained one the token is sampled from.

One in-process engine (forced tokens and accept-first both on), the real model and xgrammar:
the same requests in both modes give the same tokens; unconstrained values equal a log-softmax
of the model's logits recomputed independently by transformers on the prompt and the
generated prefix; a constrained value is never below the unconstrained one; and a row asking
for unconstrained logprobs follows no forced chain (a forced token has no logprob 0.0 of the
model: it samples each one).
"""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr
from constraints import SCHEMAS
from engine_harness import EngineHarness

from gpu_worker.control.engine import GRAMMAR_COMPLETED, Request
from grammar_service.default_model import ensure_default_model
from protos.sampling import CONSTRAINED, UNCONSTRAINED

# After its first two characters the grammar allows one token at a time (a forced chain):
# pairs of these characters are no tokens of the default model's vocabulary.
FORCED_REGEX = r"[a-z]{2}~\^~\^~\^~\^~\^~\^"
TOP = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def harness(model_dir):
    return EngineHarness(model_dir, slots=6, max_model_len=128, forced_tokens=True,
                         accept_first=True)


def _requests(harness, mode: str) -> list[Request]:
    compiler = xgr.GrammarCompiler(harness.vocab.tokenizer_info(), max_threads=1)
    grammars = {"schema": compiler.compile_json_schema(json.dumps(SCHEMAS[0]),
                                                       any_whitespace=False),
                "forced": compiler.compile_regex(FORCED_REGEX), "free": None}
    reqs = []
    for name, grammar in grammars.items():
        req = Request(request_id=name, prompt=harness.vocab.encode(f"{name} please"),
                      max_tokens=30, temperature=1.0, seed=21, logprobs=True,
                      top_logprobs=TOP, logprobs_mode=mode)
        req.matcher = xgr.GrammarMatcher(grammar) if grammar is not None else None
        reqs.append(req)
    return reqs


@pytest.fixture(scope="module")
def runs(harness):
    """mode -> (request id -> Outcome, forced tokens the engine took for them in chains,
    without sampling)."""
    out = {}
    for mode in (CONSTRAINED, UNCONSTRAINED):
        before = harness.engine.stats["chain_tokens"]
        reqs = _requests(harness, mode)
        outs = harness.run(reqs)
        out[mode] = ({r.request_id: outs[r.request_id] for r in reqs},
                     harness.engine.stats["chain_tokens"] - before, reqs)
    return out


@pytest.fixture(scope="module")
def reference(model_dir, harness, runs):
    """request id -> (n, vocab) log-softmax of transformers' logits at each generated position,
    from one forward over the prompt and the generated tokens (CPU, fp32)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vocab = harness.vocab.vocab_size  # ids past it are padding: no tokens
    outs, _, reqs = runs[UNCONSTRAINED]
    ref = {}
    with torch.no_grad():
        for req in reqs:
            tokens = outs[req.request_id].tokens
            ids = torch.tensor([req.prompt + tokens])
            logits = model(ids).logits[0, len(req.prompt) - 1:len(req.prompt) - 1 + len(tokens)]
            ref[req.request_id] = torch.log_softmax(logits[:, :vocab].double(), dim=-1)
    return ref


def test_both_modes_give_the_same_tokens(runs):
    constrained, unconstrained = runs[CONSTRAINED][0], runs[UNCONSTRAINED][0]
    assert constrained.keys() == unconstrained.keys()
    for rid, a in constrained.items():
        b = unconstrained[rid]
        assert (a.tokens, a.reason) == (b.tokens, b.reason), rid
        assert len(a.logprobs) == len(b.logprobs) == len(a.tokens) > 0, rid
    assert constrained["schema"].reason == constrained["forced"].reason == GRAMMAR_COMPLETED


def test_unconstrained_logprobs_are_the_model_log_softmax_before_the_mask(runs, reference):
    outs = runs[UNCONSTRAINED][0]
    for rid, outcome in outs.items():
        ref = reference[rid]
        for i, (token, (lp, top_ids, top_lps)) in enumerate(
                zip(outcome.tokens, outcome.logprobs, strict=True)):
            assert lp == pytest.approx(ref[i, token].item(), abs=1e-4), (rid, i)
            want_v, want_ids = ref[i].topk(TOP)
            assert top_lps == pytest.approx(want_v.tolist(), abs=1e-4), (rid, i)
            assert top_ids == want_ids.tolist(), (rid, i)


def test_constrained_logprob_is_never_below_the_unconstrained_one(runs):
    constrained, unconstrained = runs[CONSTRAINED][0], runs[UNCONSTRAINED][0]
    for rid, a in constrained.items():
        pairs = [(c[0], u[0]) for c, u in zip(a.logprobs, unconstrained[rid].logprobs,
                                              strict=True)]
        assert all(c >= u - 1e-5 for c, u in pairs), rid
        if rid == "free":  # no mask: the same distribution
            assert all(c == pytest.approx(u, abs=1e-5) for c, u in pairs)
        else:  # the grammar allows a small part of the vocabulary: the mass moves to it
            assert all(c > u + 1e-3 for c, u in pairs), rid


def test_unconstrained_rows_sample_forced_tokens_instead_of_taking_chains(runs):
    (constrained, forced_c, _), (unconstrained, forced_u, _) = (runs[CONSTRAINED],
                                                                runs[UNCONSTRAINED])
    assert forced_c >= 6 and forced_u == 0
    # Constrained: a forced token is the only alternative, with logprob 0. Unconstrained:
    # the model's value at that position, never 0.
    tokens = constrained["forced"].tokens
    chain = [i for i, (lp, ids, _) in enumerate(constrained["forced"].logprobs)
             if lp == 0.0 and ids == [tokens[i]]]
    assert len(chain) >= 6
    assert all(unconstrained["forced"].logprobs[i][0] < 0.0 for i in chain)
    assert all(len(unconstrained["forced"].logprobs[i][1]) == TOP for i in chain)
