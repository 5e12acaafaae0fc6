"""Both grammar backends on the default model's vocabulary: compile -> serialise -> deserialise
-> matcher, token by token; the auto choice and its reason; forcing; cache keys; pairing.

Real xgrammar and real llguidance, in this process (the compile pool runs the same code in
its children; tests/test_grammar_service.py covers the service around it).
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from grammar_service.backends import (
    LLGUIDANCE,
    VERSIONS,
    XGRAMMAR,
    BackendError,
    VocabView,
    backend_for,
)
from grammar_service.choice import StrictRefused, compile_spec
from grammar_service.default_model import ensure_default_model
from grammar_service.specs import cache_key, parse_spec
from grammar_service.vocab import load_vocab
from protos import common_pb2
from protos.rpc import InvalidArgument

Opts = common_pb2.GrammarOptions


@pytest.fixture(scope="module")
def vocab():
    return load_vocab(ensure_default_model())


@pytest.fixture(scope="module")
def backends(vocab):
    return VocabView.of(vocab).backends()


@pytest.fixture(scope="module")
def ranks(vocab):
    """The rank's side: backends that only deserialize (as the worker builds them)."""
    return {name: backend_for(vocab, name) for name in (XGRAMMAR, LLGUIDANCE)}


def spec_of(options=None, **kind):
    return parse_spec(common_pb2.GrammarSpec(**kind, options=options))


def schema_spec(schema, **options):
    return spec_of(Opts(**options), json_schema=json.dumps(schema))


def accepts(matcher, vocab, text: str) -> bool:
    """Feed `text` token by token as the model's tokenizer splits it, then EOS."""
    matcher.reset()
    for token in vocab.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(vocab.eos_token_ids[0]) and matcher.is_terminated()


def round_trip(backends, ranks, spec, name):
    """Compile with backend `name` as the service does, then read it back as a rank does."""
    payload = backends[name].serialize(backends[name].compile(spec))
    rank = ranks[name]
    return rank.new_matcher(rank.deserialize(payload))


def valid(schema, instance) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


# Schemas where xgrammar approximates, with an instance valid and one invalid per schema.
ALL_OF = {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]}
PATTERN_LENGTH = {"type": "object", "properties": {
    "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}, "required": ["code"]}
ONE_OF = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}
NOT = {"type": "integer", "not": {"const": 3}}
LOOKAHEAD = {"type": "string", "pattern": "^(?!x).*$"}

ENFORCED_BY_LLGUIDANCE = {
    "allOf": (ALL_OF, "4", "9"),
    "maxLength_with_pattern": (PATTERN_LENGTH, '{"code": "abc"}', '{"code": "abcd"}'),
}
REFUSED_BY_LLGUIDANCE = {
    "oneOf_overlapping": (ONE_OF, "1.5", "3"),
    "not": (NOT, "4", "3"),
}


@pytest.mark.parametrize("case", list(ENFORCED_BY_LLGUIDANCE))
def test_llguidance_refuses_the_invalid_instance_xgrammar_lets_through(
        backends, ranks, vocab, case):
    schema, good, bad = ENFORCED_BY_LLGUIDANCE[case]
    assert valid(schema, json.loads(good)) and not valid(schema, json.loads(bad))
    spec = schema_spec(schema)
    xgr_matcher = round_trip(backends, ranks, spec, XGRAMMAR)
    llg_matcher = round_trip(backends, ranks, spec, LLGUIDANCE)
    assert accepts(xgr_matcher, vocab, good) and accepts(xgr_matcher, vocab, bad)
    assert accepts(llg_matcher, vocab, good) and not accepts(llg_matcher, vocab, bad)


@pytest.mark.parametrize("case", list(REFUSED_BY_LLGUIDANCE))
def test_llguidance_refuses_a_schema_it_cannot_enforce_that_xgrammar_approximates(
        backends, ranks, vocab, case):
    schema, good, bad = REFUSED_BY_LLGUIDANCE[case]
    assert valid(schema, json.loads(good)) and not valid(schema, json.loads(bad))
    spec = schema_spec(schema)
    with pytest.raises(BackendError) as err:
        backends[LLGUIDANCE].compile(spec)
    assert err.value.backend == LLGUIDANCE
    xgr_matcher = round_trip(backends, ranks, spec, XGRAMMAR)
    assert accepts(xgr_matcher, vocab, good) and accepts(xgr_matcher, vocab, bad)


def test_llguidance_matcher_refusal_leaves_its_state_and_rollback_undoes_eos(
        backends, ranks, vocab):
    m = round_trip(backends, ranks, schema_spec({"type": "integer"}), LLGUIDANCE)
    (digit,) = vocab.encode("7", add_special_tokens=False)
    (quote,) = vocab.encode('"', add_special_tokens=False)
    assert m.accept_token(digit)
    assert not m.accept_token(quote)  # refused, and the matcher is still usable
    assert m.is_completed() and not m.is_terminated()
    assert m.accept_token(vocab.eos_token_ids[0]) and m.is_terminated()
    assert not m.accept_token(digit)  # nothing after a stop token
    m.rollback(1)
    assert not m.is_terminated() and m.accept_token(digit)


def test_llguidance_matcher_reset_leaves_an_error_state(backends, ranks, vocab):
    # An LLMatcher in an error state (a parser limit hit, or a refused token consumed
    # directly) keeps it through its own reset: ours starts again from the grammar.
    m = round_trip(backends, ranks, schema_spec({"type": "integer"}), LLGUIDANCE)
    (quote,) = vocab.encode('"', add_special_tokens=False)
    assert not m.llmatcher.consume_token(quote) and m.llmatcher.is_error()
    assert m.error()
    m.reset()
    assert not m.error()
    assert accepts(m, vocab, "42")


def test_llguidance_tokenizer_matches_the_vocabulary_xgrammar_uses(vocab):
    tok = vocab.llguidance_tokenizer()
    info = vocab.tokenizer_info()
    assert tok.vocab_size == info.vocab_size == vocab.model_vocab_size
    assert set(tok.eos_tokens) == set(vocab.eos_token_ids)
    for token_id in range(vocab.vocab_size):
        raw = vocab.token_bytes(token_id)
        # llguidance marks special tokens with a leading 0xFF byte, so the token that is the
        # byte 0xFF alone reads as special there; 0xFF never occurs in UTF-8 text, so no
        # grammar over text allows it on either backend.
        if token_id not in vocab.special_ids and raw != b"\xff":
            assert tok.decode_bytes([token_id]) == raw, token_id


@pytest.mark.parametrize("schema, text", [
    ({"type": "string", "pattern": "^[a-zA-Z0-9_]+$"}, '"param_1"'),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, '"abcde"'),
    ({"type": "string"}, '"a free string, with punctuation: 42!"'),
    ({"type": "string", "format": "uri"}, '"https://example.com/a_b?c=1"'),
    ({"type": "object", "properties": {"name": {"type": "string"}},
      "additionalProperties": {"type": "integer"}}, '{"name": "x", "names": 3}'),
])
def test_the_identifier_slices_change_no_llguidance_mask(vocab, schema, text):
    # The slices only decide which tokens' trie is walked: every mask along the text equals
    # the one llguidance's general slices give.
    import llguidance

    ours = vocab.llguidance_tokenizer()
    general = ours.with_slices(llguidance.LLTokenizer.general_slices())
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    matchers = [llguidance.LLMatcher(tok, grammar) for tok in (ours, general)]
    words = (vocab.model_vocab_size + 31) // 32
    tokens = vocab.encode(text, add_special_tokens=False)
    for token in tokens:
        masks = [torch.zeros(words, dtype=torch.int32) for _ in matchers]
        for m, mask in zip(matchers, masks, strict=True):
            m.unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        assert torch.equal(*masks)
        assert all(m.consume_token(token) for m in matchers)
    assert all(m.is_accepting() for m in matchers)


@pytest.mark.parametrize("prefix", ["", "ab", "abc"])
def test_llguidance_writes_every_word_of_its_row_in_xgrammars_layout(
        backends, ranks, vocab, prefix):
    # An exact grammar on both backends: the two masks must be the same bits (I4, one kernel).
    spec = spec_of(regex="[a-c]{1,3}x")
    words = (vocab.model_vocab_size + 31) // 32
    rows = {}
    for name in (XGRAMMAR, LLGUIDANCE):
        m = round_trip(backends, ranks, spec, name)
        for token in vocab.encode(prefix, add_special_tokens=False):
            assert m.accept_token(token)
        for stale in (0, -1, 0x5A5A5A5A):
            mask = torch.full((3, words), stale, dtype=torch.int32)
            m.fill_next_token_bitmask(mask, 1)
            rows.setdefault(name, mask[1].clone())
            assert torch.equal(mask[1], rows[name])  # no word kept a stale bit
            assert (mask[0] == stale).all() and (mask[2] == stale).all()
    assert torch.equal(rows[XGRAMMAR], rows[LLGUIDANCE])


@pytest.mark.parametrize("kind, text, ends", [
    ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})},
     '{"a":12}', True),
    ({"json_schema": json.dumps({"type": "array", "items": {"enum": ["x", "yz"]}})},
     '["x","yz"]', True),
    ({"json_schema": json.dumps({"type": "integer", "maximum": 12})}, "12", True),
    ({"json_schema": json.dumps({"type": "number"})}, "1.5", False),  # more digits may come
    ({"regex": "(ab|abc)d?"}, "abcd", True),
    ({"regex": "(ab|abc)d?"}, "abc", False),
    ({"choice": common_pb2.ChoiceList(choices=["yes", "no"])}, "yes", True),
])
def test_llguidance_stopped_means_the_mask_is_the_stop_ids_alone(backends, ranks, vocab,
                                                                  kind, text, ends):
    # The engine ends an output without a mask where the matcher says it is stopped: at every
    # position, stopped must imply a mask of exactly the EOS ids (the reverse need not hold).
    m = round_trip(backends, ranks, spec_of(**kind), LLGUIDANCE)
    words = (vocab.model_vocab_size + 31) // 32
    eos = torch.zeros(words * 32, dtype=torch.bool)
    eos[list(vocab.eos_token_ids)] = True
    mask = torch.zeros((1, words), dtype=torch.int32)
    seen = []
    for token in vocab.encode(text, add_special_tokens=False):
        assert m.accept_token(token)
        m.fill_next_token_bitmask(mask, 0)
        bits = ((mask[0].to(torch.int64)[:, None] >> torch.arange(32)) & 1).flatten().bool()
        seen.append(m.is_stopped())
        if seen[-1]:
            assert torch.equal(bits, eos) and m.is_completed()
    assert seen == [False] * (len(seen) - 1) + [ends]
    assert m.accept_token(vocab.eos_token_ids[0]) and m.is_terminated()


def test_llguidance_matcher_refuses_a_bitmask_of_another_width(backends, ranks, vocab):
    m = round_trip(backends, ranks, spec_of(regex="a"), LLGUIDANCE)
    with pytest.raises(ValueError, match="bitmask"):
        m.fill_next_token_bitmask(torch.zeros((1, 3), dtype=torch.int32), 0)


AUTO_CASES = {
    "schema_llguidance_enforces": (dict(json_schema=json.dumps(ALL_OF)), LLGUIDANCE,
                                   "llguidance enforces every keyword", ()),
    "schema_llguidance_ignores_and_reports": (dict(json_schema=json.dumps(NOT)), LLGUIDANCE,
                                              'but those it reports (Unimplemented keys: '
                                              '["not"])', ("not",)),
    "schema_llguidance_refuses_a_pattern": (dict(json_schema=json.dumps(LOOKAHEAD)),
                                            LLGUIDANCE, "refused even leniently, relaxed: "
                                            "pattern", ("pattern",)),
    "schema_only_xgrammar_enforces": (dict(json_schema=json.dumps(
        {"type": "string", "format": "uri-template"})), XGRAMMAR,
        "Unknown format: uri-template; xgrammar compiles it", ()),
    "schema_overlapping_one_of": (dict(json_schema=json.dumps(ONE_OF)), LLGUIDANCE,
                                  "oneOf not fully supported, falling back to anyOf",
                                  ("oneOf",)),
    "json_object": (dict(json_object=common_pb2.JsonObject()), LLGUIDANCE,
                    "llguidance builds and masks faster", ()),
    "regex": (dict(regex="[0-9]+"), XGRAMMAR, "xgrammar compiles and masks faster", ()),
    "choice": (dict(choice=common_pb2.ChoiceList(choices=["a", "b"])), XGRAMMAR,
               "xgrammar compiles and masks faster", ()),
    "ebnf": (dict(ebnf='root ::= "a"+'), XGRAMMAR, "xgrammar's dialect", ()),
    "structural_tag": (dict(structural_tag=json.dumps({
        "type": "structural_tag", "format": {"type": "const_string", "value": "<x>"}})),
        XGRAMMAR, "xgrammar's format", ()),
    "lark": (dict(lark='start: "a"+'), LLGUIDANCE, "llguidance's format", ()),
}


@pytest.mark.parametrize("case", list(AUTO_CASES))
def test_auto_choice_and_its_reason(backends, ranks, vocab, case):
    kind, backend, reason, unenforced = AUTO_CASES[case]
    compiled = compile_spec(spec_of(**kind), backends)
    assert compiled.backend == backend and compiled.reason.startswith("auto: ")
    assert reason in compiled.reason and compiled.unenforced == unenforced
    ranks[backend].new_matcher(ranks[backend].deserialize(compiled.payload))


def test_forcing_a_backend_overrides_the_rule_and_reports_what_it_leaves_out(backends):
    forced = compile_spec(schema_spec(ALL_OF, backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR),
                          backends)
    assert (forced.backend, forced.unenforced) == (XGRAMMAR, ("allOf",))
    assert forced.reason == ("forced: options.backend is xgrammar; properties in the schema's "
                             "order (xgrammar fixes it)")
    forced = compile_spec(spec_of(Opts(backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE),
                                  regex="[0-9]+"), backends)
    assert forced.backend == LLGUIDANCE
    with pytest.raises(BackendError, match="not"):
        compile_spec(schema_spec(NOT, backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE), backends)


def test_what_llguidance_cannot_enforce_is_reported_and_the_rest_stays_exact(
        backends, ranks, vocab):
    schema = {"type": "object", "properties": {
        "v": ONE_OF, "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "tags": {"type": "array", "items": {"type": "string", "format": "regex"},
                 "uniqueItems": True}},
        "required": ["v", "code"]}
    compiled = compile_spec(schema_spec(schema), backends)
    assert compiled.backend == LLGUIDANCE
    assert sorted(compiled.unenforced) == ["properties.tags.items.format",
                                           "properties.tags.uniqueItems", "properties.v.oneOf"]
    m = ranks[LLGUIDANCE].new_matcher(ranks[LLGUIDANCE].deserialize(compiled.payload))
    assert accepts(m, vocab, '{"v": 1.5, "code": "abc"}')
    assert accepts(m, vocab, '{"v": 3, "code": "abc"}')  # in both branches: the approximation
    assert accepts(m, vocab, '{"v": 3, "code": "abc", "tags": ["a", "a"]}')  # ignored
    assert not accepts(m, vocab, '{"v": 3, "code": "abcd"}')  # maxLength with a pattern: exact
    with pytest.raises(StrictRefused, match="properties.v.oneOf"):
        compile_spec(schema_spec(schema, strict=True), backends)


@pytest.mark.parametrize("warnings,paths", [
    (['Unimplemented keys: ["not", "if"]'], ["if", "properties.a.not"]),
    (["Unknown format: regex"], ["properties.a.format"]),
    (["oneOf not fully supported, falling back to anyOf. This may cause errors."], ["oneOf"]),
    (['Unimplemented keys: ["not"] (12 times)', "Unknown format: regex (3 times)"],
     ["properties.a.format", "properties.a.not"]),
    (['min/maxProperties only supported when all keys listed in "properties" are required'],
     ["properties.b.maxProperties"]),
    (["Something new llguidance says"], None),
    (['Unimplemented keys: ["dependentRequired"]'], None),  # not in the schema: not understood
])
def test_llguidance_warnings_become_reported_paths_or_nothing_is_trusted(warnings, paths):
    from grammar_service.unenforced import llguidance_unenforced

    schema = {"properties": {"a": {"format": "regex", "not": {"const": 1}},
                             "b": {"type": "object", "maxProperties": 2}},
              "oneOf": [{}], "if": {}, "enum": [{"not": 1}]}
    assert llguidance_unenforced(schema, warnings) == paths


def test_what_llguidance_refuses_even_leniently_is_relaxed_reported_and_the_rest_enforced(
        backends, ranks, vocab):
    """A look-around pattern, a look-around patternProperties name and an int64 lower bound:
    llguidance refuses them even when lenient; auto compiles the rest on llguidance (not the
    whole schema on xgrammar) and reports each relaxed keyword. The regexes are widened (the
    look-around removed), so what they allowed is still accepted and the rest of them still
    enforced."""
    schema = {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^(?!x)[a-z]+$"},
        "code": {"type": "string", "pattern": "^[a-z]{2}$"},
        "n": {"type": "integer", "minimum": -2 ** 63, "maximum": 10},
        "meta": {"type": "object", "patternProperties": {"^(?!_)\\w+$": {"type": "integer"}},
                 "additionalProperties": False}},
        # (a `not` of one name is enforced, grammar_service.schema_fixes; of two, reported)
        "required": ["id", "code", "n"], "not": {"required": ["zz", "yy"]}}
    compiled = compile_spec(schema_spec(schema), backends)
    assert compiled.backend == LLGUIDANCE
    assert sorted(compiled.unenforced) == [
        "not", "properties.id.pattern", "properties.meta.patternProperties.^(?!_)\\w+$",
        "properties.n.minimum"]
    m = ranks[LLGUIDANCE].new_matcher(ranks[LLGUIDANCE].deserialize(compiled.payload))
    assert accepts(m, vocab, '{"id": "xa", "code": "ab", "n": -5}')  # look-around removed
    assert not accepts(m, vocab, '{"id": "a1", "code": "ab", "n": -5}')  # the rest: enforced
    assert not accepts(m, vocab, '{"id": "a", "code": "abc", "n": 1}')  # kept pattern: exact
    assert not accepts(m, vocab, '{"id": "a", "code": "ab", "n": 11}')  # kept maximum: exact
    assert not accepts(m, vocab, '{"id": 1, "code": "ab", "n": 1}')  # its type: exact
    # the names the pattern allowed still take its subschema (and no other value)...
    assert accepts(m, vocab, '{"id": "a", "code": "ab", "n": 1, "meta": {"k": 1}}')
    assert not accepts(m, vocab, '{"id": "a", "code": "ab", "n": 1, "meta": {"k": "v"}}')
    # ... and so does a name only the widened pattern allows (reported above)
    assert accepts(m, vocab, '{"id": "a", "code": "ab", "n": 1, "meta": {"_k": 1}}')
    assert not accepts(m, vocab, '{"id": "a", "code": "ab", "n": 1, "meta": {"a-b": 1}}')
    with pytest.raises(StrictRefused, match="properties.id.pattern"):
        compile_spec(schema_spec(schema, strict=True), backends)


@pytest.mark.parametrize("regex, wider", [
    ("^(?!@@)[\\w@]+$", "^[\\w@]+$"),
    ("^(?<=x)y(?<!z)$", "^y$"),
    ("(?=(a|b))c", "c"),
    ("(a)\\1", "(a)(?:[\\s\\S]*)"),
    ("(?P<n>a)(?P=n)b", "(?P<n>a)(?:[\\s\\S]*)b"),
    ("(?<n>a)\\k<n>", "(?<n>a)(?:[\\s\\S]*)"),
    ("[]a(?=b)]c(?=d)", "[]a(?=b)]c"),  # inside a class, "(?=" is three characters
    ("[(?=]x", None), ("\\(?=a)", None), ("abc", None), ("(?=a", None),
    ("x(?=a){2}", None), ("x(?!a)*", None),  # quantified: x{2} would not match "xa"
])
def test_superset_regex_removes_what_llguidance_cannot_parse(regex, wider):
    from grammar_service.unenforced import superset_regex

    assert superset_regex(regex) == wider


def test_superset_regex_matches_everything_the_regex_matches():
    """Searched as JSON Schema searches (re.search), every string the regex matches is
    matched by its widened form, on strings chosen to hit each construct."""
    import re

    from grammar_service.unenforced import superset_regex

    regexes = ["^(?!@@)[\\w@]+$", "^(?=.*[0-9])[a-z0-9]{3,}$", "(?<![a-z])id(?!_)",
               "^(ab|cd)\\1$", "^(?P<q>['\"]).*(?P=q)$", "x(?=y)", "^(?!(?:a|b)$).+"]
    strings = ["", "a", "b", "ab", "abab", "abcd", "cdcd", "@@x", "@x", "x_y", "id", "xid",
               "id_", "a1b", "abc", "'q'", "'q\"", "xy", "xz", "a b", "0", "aa"]
    for regex in regexes:
        wide = re.compile(superset_regex(regex))
        for text in strings:
            if re.search(regex, text):
                assert wide.search(text), (regex, text)


def test_llguidance_relaxed_leaves_other_errors_and_the_schema_alone():
    from grammar_service.unenforced import llguidance_relaxed

    schema = {"properties": {"a": {"pattern": "(a)\\1"}, "pattern": {"minimum": -2 ** 63}},
              "enum": [{"pattern": "(?=x)"}]}
    before = json.dumps(schema)
    relaxed, paths = llguidance_relaxed(schema, "regex parse error:\n    (a)\\1")
    assert paths == ["properties.a.pattern"]
    assert relaxed["properties"]["a"]["pattern"] == "(a)(?:[\\s\\S]*)"  # widened
    assert relaxed["enum"] == schema["enum"] and json.dumps(schema) == before
    assert llguidance_relaxed(schema, "Failed to generate regex for integer range: min=..."
                              )[1] == ["properties.pattern.minimum"]
    assert llguidance_relaxed(schema, "Unimplemented keys: [\"not\"]") is None
    assert llguidance_relaxed({"pattern": "^a$"}, "regex parse error: x") is None


def test_strict_refuses_only_what_no_backend_enforces(backends):
    assert compile_spec(schema_spec(ALL_OF, strict=True), backends).backend == LLGUIDANCE
    with pytest.raises(StrictRefused, match="not"):
        compile_spec(schema_spec(NOT, strict=True), backends)
    with pytest.raises(StrictRefused, match="allOf"):
        compile_spec(schema_spec(ALL_OF, strict=True,
                                 backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR), backends)


@pytest.mark.parametrize("kind,backend", [
    (dict(lark='start: "a"'), common_pb2.GRAMMAR_BACKEND_XGRAMMAR),
    (dict(structural_tag='{"type": "structural_tag"}'), common_pb2.GRAMMAR_BACKEND_LLGUIDANCE),
])
def test_a_forced_backend_that_cannot_compile_the_kind_is_invalid_argument(kind, backend):
    with pytest.raises(InvalidArgument, match="spec.options.backend"):
        spec_of(Opts(backend=backend), **kind)


def test_cache_key_differs_by_backend_and_depends_only_on_versions_that_can_compile_it():
    keys = {b: cache_key(schema_spec(ALL_OF, backend=b), "v", VERSIONS)
            for b in (common_pb2.GRAMMAR_BACKEND_AUTO, common_pb2.GRAMMAR_BACKEND_XGRAMMAR,
                      common_pb2.GRAMMAR_BACKEND_LLGUIDANCE)}
    assert len(set(keys.values())) == 3
    newer_llg = {**VERSIONS, LLGUIDANCE: "99.0"}
    for backend, changes in [(common_pb2.GRAMMAR_BACKEND_AUTO, True),
                             (common_pb2.GRAMMAR_BACKEND_XGRAMMAR, False),
                             (common_pb2.GRAMMAR_BACKEND_LLGUIDANCE, True)]:
        other = cache_key(schema_spec(ALL_OF, backend=backend), "v", newer_llg)
        assert (other != keys[backend]) == changes


def test_payloads_and_compiled_grammars_only_pair_with_their_backend(backends, ranks):
    spec = spec_of(regex="[a-z]+")
    compiled = {n: backends[n].compile(spec) for n in backends}
    payloads = {n: backends[n].serialize(compiled[n]) for n in backends}
    for name, other in ((XGRAMMAR, LLGUIDANCE), (LLGUIDANCE, XGRAMMAR)):
        with pytest.raises(BackendError):
            ranks[name].deserialize(payloads[other])
        with pytest.raises(BackendError, match=f"{name} cannot make a matcher"):
            ranks[name].new_matcher(compiled[other])


def test_an_xgrammar_grammar_cheaper_to_compile_than_to_move_travels_as_its_spec(
        backends, ranks, vocab):
    spec = schema_spec({"type": "object", "properties": {"n": {"type": "integer"}}},
                       backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR)
    compiled = backends[XGRAMMAR].compile(spec)
    serialised = backends[XGRAMMAR].serialize(compiled, spec, compile_seconds=3600.0)
    as_spec = backends[XGRAMMAR].serialize(compiled, spec, compile_seconds=1e-6)
    assert serialised == backends[XGRAMMAR].serialize(compiled)  # worth fetching: the form
    assert len(as_spec) < 1000 < len(serialised)
    for payload in (serialised, as_spec):
        m = ranks[XGRAMMAR].new_matcher(ranks[XGRAMMAR].deserialize(payload))
        assert accepts(m, vocab, '{"n": 12}') and not accepts(m, vocab, '{"n": "x"}')
    with pytest.raises(BackendError):
        ranks[LLGUIDANCE].deserialize(as_spec)
    # The service's path: a small grammar on a small vocabulary compiles in milliseconds,
    # faster than its serialised form could be read back, so its spec travels.
    assert compile_spec(spec, backends).payload.startswith(b'{"format":"gramserve-xgrammar-spec')


def test_llguidance_bounds_long_strings_without_the_rewrite_and_xgrammar_reports_them(
        backends, ranks, vocab):
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8192}},
              "required": ["s"]}
    auto = compile_spec(schema_spec(schema), backends)
    assert auto.backend == LLGUIDANCE and auto.unenforced == ()
    m = ranks[LLGUIDANCE].new_matcher(ranks[LLGUIDANCE].deserialize(auto.payload))
    assert accepts(m, vocab, '{"s": "hello"}') and not accepts(m, vocab, '{"s": "a\tb"}')
    forced = compile_spec(schema_spec(schema, backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR),
                          backends)
    assert forced.unenforced == ("properties.s.maxLength",)


def test_unlisted_properties_are_allowed_by_default_and_forbidden_by_strict_on_both_backends(
        backends, ranks, vocab):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed = {**schema, "additionalProperties": False}
    extra = '{"a": 1, "b": 2}'
    for strict in (False, True):
        for name in (XGRAMMAR, LLGUIDANCE):
            m = round_trip(backends, ranks, schema_spec(schema, strict=strict), name)
            assert accepts(m, vocab, '{"a": 1}')
            assert accepts(m, vocab, extra) == (not strict), (name, strict)
            m = round_trip(backends, ranks, schema_spec(closed, strict=strict), name)
            assert not accepts(m, vocab, extra), (name, strict)


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 6}, {"type": "string", "pattern": "^a.*b$"},
    {"type": "string", "minLength": 1, "maxLength": 8192}])
def test_json_escapes_are_accepted_inside_bounded_and_pattern_strings_by_default(
        backends, ranks, vocab, schema):
    # llguidance enforces bounds and patterns on the decoded string; xgrammar refuses escapes
    # in such strings, so the default path must not choose it for them.
    compiled = compile_spec(schema_spec(schema), backends)
    assert compiled.backend == LLGUIDANCE
    rank = ranks[LLGUIDANCE]
    m = rank.new_matcher(rank.deserialize(compiled.payload))
    for text in ('"a\\"b"', '"a\\\\b"', '"a\\tb"'):
        assert valid(schema, json.loads(text)) and accepts(m, vocab, text), text
    assert not accepts(m, vocab, '"a\tb"')  # a raw control character is not JSON


@pytest.mark.parametrize("fmt,good,bad", [
    ("date", "2024-02-29", "2023-02-29"), ("date", "2000-02-29", "1900-02-29"),
    ("time", "23:59:60Z", "22:59:60Z"), ("date-time", "2024-02-29T10:00:00Z",
                                          "2021-02-29T10:00:00Z")])
def test_llguidance_checks_leap_days_and_leap_seconds_of_date_and_time_formats(
        backends, ranks, vocab, fmt, good, bad):
    schema = {"type": "string", "format": fmt}
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    assert not checker.conforms(bad, fmt)  # (jsonschema refuses every leap second)
    compiled = compile_spec(schema_spec(schema), backends)
    assert compiled.backend == LLGUIDANCE
    m = ranks[LLGUIDANCE].new_matcher(ranks[LLGUIDANCE].deserialize(compiled.payload))
    assert accepts(m, vocab, json.dumps(good)) and not accepts(m, vocab, json.dumps(bad))


@pytest.mark.parametrize("whitespace,text,ok", [
    (common_pb2.WHITESPACE_BOUNDED, '{"a":    1}', True),
    (common_pb2.WHITESPACE_BOUNDED, '{"a":     1}', False),
    (common_pb2.WHITESPACE_COMPACT, '{"a": 1}', False),
    (common_pb2.WHITESPACE_COMPACT, '{"a":1}', True),
    (common_pb2.WHITESPACE_ANY, '{"a":' + " " * 40 + "1}", True),
])
def test_whitespace_options_mean_the_same_on_llguidance(backends, ranks, vocab, whitespace,
                                                         text, ok):
    spec = schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}},
                       whitespace=whitespace)
    for name in (XGRAMMAR, LLGUIDANCE):
        assert accepts(round_trip(backends, ranks, spec, name), vocab, text) == ok, name


@pytest.mark.parametrize("schema", [
    {"properties": {"default": {"type": "string", "pattern": "("}}},  # a property named default
    {"patternProperties": {"(": {"type": "integer"}}},
    {"$defs": {"a": {"$ref": "#/$defs/a b"}}},
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"items": [{"minLength": -1}]},
    {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"x": {"pattern": "["}}},
])
def test_the_fast_meta_check_refuses_what_jsonschema_refuses(schema):
    """A schema the fast meta-validation accepts, jsonschema's full check accepts too: every
    invalid one here reaches the full check, whose error names where."""
    from jsonschema import validators

    from grammar_service.specs import _meta_valid_fast

    cls = validators.validator_for(schema, default=validators.Draft202012Validator)
    with pytest.raises(Exception):  # noqa: B017 - jsonschema's SchemaError
        cls.check_schema(schema)
    assert not _meta_valid_fast(schema, cls)
    with pytest.raises(InvalidArgument, match="not a valid JSON Schema at"):
        parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))


def test_the_fast_meta_check_accepts_the_conformance_suite_schemas_jsonschema_accepts():
    """On every schema of the JSON Schema Test Suite copy (draft 2020-12 and 7), the fast
    check never accepts what jsonschema's full check refuses."""
    from jsonschema import validators

    from grammar_service.specs import _meta_checker, _meta_valid_fast

    root = Path(__file__).parent / "data" / "json_schema_test_suite"
    checked = 0
    for path in sorted(root.rglob("*.json")):
        groups = json.loads(path.read_text())
        if not isinstance(groups, list):
            continue
        for group in groups:
            schema = group.get("schema") if isinstance(group, dict) else None
            if not isinstance(schema, dict):
                continue
            cls = validators.validator_for(schema, default=validators.Draft202012Validator)
            if _meta_valid_fast(schema, cls):
                # raises if the fast check was wrong
                cls.check_schema(schema, format_checker=_meta_checker(cls))
                checked += 1
    assert checked > 400


def test_patterns_are_ecma_262(backends, ranks, vocab):
    """A `pattern` is an ECMA-262 regex: named groups `(?<name>...)`, which Python's `re`
    refuses, are valid (a SchemaStore schema was refused as invalid) and enforced; Python's
    `(?P<name>...)` stays accepted (both engines read it); a regex neither reads is refused,
    naming where."""
    spec = schema_spec({"type": "object", "required": ["d"], "properties": {
        "d": {"type": "string", "pattern": "^(?<year>[0-9]{4})-(?<month>[0-9]{2})$"}}})
    m = round_trip(backends, ranks, spec, LLGUIDANCE)
    assert accepts(m, vocab, '{"d": "2024-05"}')
    assert not accepts(m, vocab, '{"d": "2024-5"}')
    schema_spec({"pattern": "^(?P<y>a)$"})
    with pytest.raises(InvalidArgument, match="not a valid JSON Schema at properties.x.pattern"):
        schema_spec({"properties": {"x": {"pattern": "(?<y>a"}}})


def _lanes(vocab, lanes: int):
    """An llguidance rank backend with `lanes` lanes, and a fresh grammar of its own."""
    from grammar_service.backends import LLGuidanceBackend, LLGuidanceGrammar

    spec = schema_spec({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["name", "n"]})
    text = VocabView.of(vocab).backends()[LLGUIDANCE].compile(spec).grammar
    backend = LLGuidanceBackend(vocab.llguidance_tokenizer(), vocab.eos_token_ids, lanes=lanes)
    return backend, LLGuidanceGrammar(text)


def test_llguidance_lanes_grow_only_with_live_matchers_up_to_the_lane_count(vocab):
    # Copies of one LLMatcher share its lexer behind a lock (their masks are computed one at
    # a time): a grammar gets another template only where every lane has a live matcher, up
    # to the backend's lane count; requests one after the other share one.
    import gc

    backend, grammar = _lanes(vocab, 3)
    for _ in range(5):
        backend.new_matcher(grammar)
        gc.collect()
    assert [live for _, live in grammar.lanes] == [0]
    live = [backend.new_matcher(grammar) for _ in range(7)]
    assert sorted(n for _, n in grammar.lanes) == [2, 2, 3]
    assert len({id(m._template) for m in live}) == 3
    del live
    gc.collect()
    assert [n for _, n in grammar.lanes] == [0, 0, 0]
    slow, grammar = _lanes(vocab, 3)
    slow.lane_build_max_s = 0.0  # a grammar too slow to build keeps one lane
    held = [slow.new_matcher(grammar) for _ in range(4)]
    assert len(grammar.lanes) == 1 and grammar.lanes[0][1] == len(held)
    with pytest.raises(ValueError, match="lanes"):
        _lanes(vocab, 0)


def test_llguidance_lanes_fill_the_masks_each_row_gets_alone(vocab):
    # Rows of one grammar on different lanes, filled in one parallel batch as a rank fills
    # them, get exactly the masks a lone matcher of the grammar gets (I4).
    from gpu_worker.guided.masks import MaskFiller

    backend, grammar = _lanes(vocab, 4)
    texts = ['{"name": "', '{"name": "ab', '{"name": "abcdef', '{"name": "a", "n": 1',
             '{"n": 2, "name": "', '{', '{"name": "x"', '{"n": 3']
    rows = [backend.new_matcher(grammar) for _ in texts]
    for m, text in zip(rows, texts, strict=True):
        for token in vocab.encode(text, add_special_tokens=False):
            assert m.accept_token(token)
    assert len(grammar.lanes) == 4
    filler = MaskFiller(len(rows), vocab.model_vocab_size, torch.device("cpu"), 4)
    filler.fill(rows, list(range(len(rows))))
    one, alone = _lanes(vocab, 1)
    words = (vocab.model_vocab_size + 31) // 32
    for i, text in enumerate(texts):
        m = one.new_matcher(alone)
        for token in vocab.encode(text, add_special_tokens=False):
            assert m.accept_token(token)
        mask = torch.zeros((1, words), dtype=torch.int32)
        m.fill_next_token_bitmask(mask, 0)
        assert torch.equal(filler.host[i], mask[0]), text
