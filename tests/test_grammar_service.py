"""The grammar service over real gRPC on loopback: every kind, the cache, bad specs, isolation.

One server (real compile subprocesses, the embedded default model's vocabulary) is shared
by the module: a spawned compile process costs 1-2 s to start on 2 cores.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client import CollectorRegistry

from grammar_service.backends import backend_for
from grammar_service.client import fetch_grammar
from grammar_service.compile_pool import TEST_HOOKS_ENV
from grammar_service.config import GrammarServiceConfig
from grammar_service.default_model import ensure_default_model
from grammar_service.server import create_server
from grammar_service.vocab import load_vocab
from protos import common_pb2, grammar_pb2, grammar_pb2_grpc, rpc

MAX_SPEC_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def vocab():
    return load_vocab(ensure_default_model())


@pytest.fixture(scope="module")
def served(vocab):
    # The hook variable must be in the environment whenever a compile process is spawned
    # (replacements too), so it stays set for the module.
    old = os.environ.get(TEST_HOOKS_ENV)
    os.environ[TEST_HOOKS_ENV] = "1"
    # One lane of compile processes: the isolation tested here is the general lane's (the
    # short lane and its scheduling: tests/test_grammar_compile_fairness.py).
    config = GrammarServiceConfig(port=0, metrics_port=0, compile_workers=2,
                                  compile_timeout=5.0, compile_memory_mb=512,
                                  compile_short_workers=0, max_spec_bytes=MAX_SPEC_BYTES)
    server, port, service = create_server(config, registry=CollectorRegistry(), vocab=vocab)
    address = f"127.0.0.1:{port}"
    ch = rpc.channel(address)
    yield address, grammar_pb2_grpc.GrammarServiceStub(ch), service
    ch.close()
    server.stop(grace=None)
    service.close()
    if old is None:
        os.environ.pop(TEST_HOOKS_ENV, None)
    else:
        os.environ[TEST_HOOKS_ENV] = old


def compile_(stub, **spec):
    return stub.Compile(grammar_pb2.CompileRequest(spec=common_pb2.GrammarSpec(**spec)),
                        timeout=60)


def matcher_for(stub, vocab, ref):
    """A matcher of the backend the service names, from the fetched grammar (as a rank)."""
    name, payload = fetch_grammar(stub, ref.key, expected_fingerprint=vocab.fingerprint,
                                  timeout=30)
    assert name == ref.backend
    backend = backend_for(vocab, name)
    return backend.new_matcher(backend.deserialize(payload))


def accepts(matcher, vocab, text: str) -> bool:
    """Feed `text` token by token (the model's tokenisation), then EOS; True if all accepted."""
    matcher.reset()
    for token in vocab.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.accept_token(vocab.eos_token_ids[0]) and matcher.is_terminated()


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
TAG = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
    {"type": "const_string", "value": "<n>"},
    {"type": "json_schema", "json_schema": {"type": "integer"}}]}}

KINDS = {
    "json_schema": (dict(json_schema=json.dumps(PERSON)),
                    '{"name": "Al", "age": 31}', '{"name": 31}'),
    "regex": (dict(regex=r"[a-z]+@[a-z]+\.com"), "bob@mail.com", "bob@mail.org"),
    "ebnf": (dict(ebnf='root ::= "yes" | "no" | "n" [0-9]+'), "n42", "maybe"),
    "choice": (dict(choice=common_pb2.ChoiceList(choices=["red", "green", "blue"])),
               "green", "gray"),
    "json_object": (dict(json_object=common_pb2.JsonObject()), '{"k": [1, 2]}', "[1, 2]"),
    "structural_tag": (dict(structural_tag=json.dumps(TAG)), "<n>17", "<n>x"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_compiles_and_fetched_grammar_enforces_it(served, vocab, kind):
    _, stub, _ = served
    spec, valid, invalid = KINDS[kind]
    ref = compile_(stub, **spec)
    assert ref.kind == kind and len(ref.key) == 64
    assert ref.vocab_fingerprint == vocab.fingerprint and ref.serialized_bytes > 0
    matcher = matcher_for(stub, vocab, ref)
    assert accepts(matcher, vocab, valid)
    assert not accepts(matcher, vocab, invalid)


def test_second_compile_is_a_cache_hit_with_the_same_key(served):
    _, stub, _ = served
    spec = dict(regex="hit-[0-9]{3}")
    first, second = compile_(stub, **spec), compile_(stub, **spec)
    assert not first.cached and second.cached
    assert first.key == second.key and second.compile_seconds == first.compile_seconds


def test_whitespace_variants_share_a_key_but_property_order_does_not(served, vocab):
    _, stub, _ = served
    a = compile_(stub, json_schema='{"type": "object",\n "properties": {"x": {"type": "integer"}}}')
    b = compile_(stub, json_schema='{"type":"object","properties":{"x":{"type":"integer"}}}')
    assert a.key == b.key and b.cached
    # xgrammar generates properties in schema order: reordering them is another grammar.
    swapped = {**PERSON, "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
    c = compile_(stub, json_schema=json.dumps(swapped))
    assert c.key != compile_(stub, **KINDS["json_schema"][0]).key
    assert accepts(matcher_for(stub, vocab, c), vocab, '{"age": 31, "name": "Al"}')


def test_eight_concurrent_identical_compiles_compile_once(served):
    _, stub, service = served
    before = service.cache.misses
    spec = dict(json_schema=json.dumps({**PERSON, "title": "single-flight"}))
    with ThreadPoolExecutor(8) as ex:
        refs = list(ex.map(lambda _: compile_(stub, **spec), range(8)))
    assert service.cache.misses - before == 1
    assert len({r.key for r in refs}) == 1
    assert sum(not r.cached for r in refs) == 1


def test_whitespace_is_bounded_by_default_none_when_compact_any_when_asked(served, vocab):
    _, stub, _ = served
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]})
    W = common_pb2.GrammarOptions
    bounded = matcher_for(stub, vocab, compile_(stub, json_schema=schema))
    compact = matcher_for(stub, vocab, compile_(
        stub, json_schema=schema, options=W(whitespace=common_pb2.WHITESPACE_COMPACT)))
    anyws = matcher_for(stub, vocab, compile_(
        stub, json_schema=schema, options=W(whitespace=common_pb2.WHITESPACE_ANY)))
    assert accepts(bounded, vocab, '{"a": 1}')
    assert not accepts(bounded, vocab, '{"a":' + " " * 5 + "1}")
    assert accepts(compact, vocab, '{"a":1}') and not accepts(compact, vocab, '{"a": 1}')
    assert accepts(anyws, vocab, '{"a":' + " " * 40 + "1}")


def test_unenforced_keywords_are_reported_and_strict_refuses_them(served):
    _, stub, _ = served
    schema = json.dumps({"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3},
        "n": {"type": "integer", "not": {"const": 0}}}})
    ref = compile_(stub, json_schema=schema)
    # llguidance ignores `not` (reported) and enforces minLength beside the pattern
    assert ref.backend == "llguidance" and list(ref.unenforced_keywords) == ["properties.n.not"]
    forced = compile_(stub, json_schema=schema, options=common_pb2.GrammarOptions(
        backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR))
    assert list(forced.unenforced_keywords) == ["properties.name.minLength", "properties.n.not"]
    with pytest.raises(grpc.RpcError) as err:
        compile_(stub, json_schema=schema, options=common_pb2.GrammarOptions(strict=True))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "properties.n.not" in err.value.details()
    strict_ok = compile_(stub, json_schema=json.dumps(PERSON),
                         options=common_pb2.GrammarOptions(strict=True))
    assert list(strict_ok.unenforced_keywords) == []


def test_compile_reports_the_backend_and_why_and_a_forced_backend_has_its_own_key(
        served, vocab):
    _, stub, _ = served
    # A pattern next to a length bound: xgrammar drops the bound, so auto picks llguidance.
    schema = json.dumps({**PERSON, "title": "backend-choice", "properties": {
        **PERSON["properties"], "name": {"type": "string", "pattern": "^[A-Z][a-z]*$",
                                         "maxLength": 8}}})
    auto = compile_(stub, json_schema=schema)
    forced = compile_(stub, json_schema=schema, options=common_pb2.GrammarOptions(
        backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR))
    assert (auto.backend, forced.backend) == ("llguidance", "xgrammar")
    assert list(forced.unenforced_keywords) == ["properties.name.maxLength"]
    assert auto.backend_reason.startswith("auto: ") and "forced" in forced.backend_reason
    assert auto.key != forced.key
    for ref in (auto, forced):
        assert accepts(matcher_for(stub, vocab, ref), vocab, '{"name": "Al", "age": 31}')
    stats = stub.Stats(grammar_pb2.StatsRequest(), timeout=10)
    assert stats.llguidance_version == importlib.metadata.version("llguidance")


def _unknown_field_spec():
    spec = common_pb2.GrammarSpec(regex="a")
    spec.MergeFromString(b"\x98\x06\x01")  # field 99, varint 1: from a newer client
    return spec


INVALID = grpc.StatusCode.INVALID_ARGUMENT
Opts = common_pb2.GrammarOptions
Choices = common_pb2.ChoiceList
BAD_SPECS = {
    "no_kind": (common_pb2.GrammarSpec(), "spec: no constraint kind"),
    "schema_not_json": (dict(json_schema='{"type": "object",\n "x": }'),
                        "spec.json_schema: not valid JSON: Expecting value at line 2 column"),
    "schema_invalid_type": (dict(json_schema='{"type": "strin"}'),
                            "spec.json_schema: not a valid JSON Schema at type"),
    "schema_not_object": (dict(json_schema="[1, 2]"), "spec.json_schema: must be a JSON object"),
    "schema_remote_ref": (dict(json_schema='{"$ref": "https://example.com/s.json"}'),
                          "spec.json_schema: unsupported schema feature at (root): $ref "
                          "'https://example.com/s.json' names no place in this schema"),
    "schema_unknown_anchor": (dict(json_schema='{"properties": {"a": {"$ref": "#nope"}}}'),
                              "spec.json_schema: unsupported schema feature at properties.a: "
                              "$ref '#nope' names no place"),
    "schema_false": (dict(json_schema="false"), "spec.json_schema: is false, the schema no "
                     "value satisfies: there is nothing to generate"),
    "schema_bad_min_length": (dict(json_schema='{"type": "string", "minLength": -1}'),
                              "spec.json_schema: not a valid JSON Schema at minLength"),
    "regex_unclosed": (dict(regex="a(b"), "spec.regex: xgrammar cannot compile it: Regex "
                       "parsing error at position 4: The parenthesis is not closed"),
    "regex_empty": (dict(regex=""), "spec.regex: is empty"),
    "regex_bad_range": (dict(regex="a{3,1}"), "spec.regex: xgrammar cannot compile it"),
    "ebnf_syntax": (dict(ebnf='root ::= "a" |'), "spec.ebnf: xgrammar cannot compile it: "
                    "EBNF parser error at line 1, column 15"),
    "ebnf_undefined_rule": (dict(ebnf="root ::= item"), 'Rule "item" is not defined'),
    "ebnf_no_root": (dict(ebnf='start ::= "a"'), 'root rule with name "root" is not found'),
    "choice_empty": (dict(choice=Choices()), "spec.choice.choices: is empty"),
    "choice_duplicate": (dict(choice=Choices(choices=["a", "b", "a"])),
                         "spec.choice.choices[2]: duplicates spec.choice.choices[0]"),
    "choice_empty_string": (dict(choice=Choices(choices=["a", ""])),
                            "spec.choice.choices[1]: is an empty string"),
    "over_size_limit": (dict(regex="a" * (MAX_SPEC_BYTES + 1)),
                        f"spec.regex: is {MAX_SPEC_BYTES + 1} bytes, over the limit"),
    "max_whitespace_too_large": (dict(json_object=common_pb2.JsonObject(),
                                      options=Opts(max_whitespace=1000)),
                                 "spec.options.max_whitespace: 1000 is over the limit"),
    "whitespace_on_regex": (dict(regex="a", options=Opts(whitespace=common_pb2.WHITESPACE_ANY)),
                            "spec.options.whitespace: whitespace options apply only to"),
    "whitespace_unknown_value": (dict(json_object=common_pb2.JsonObject(),
                                      options=Opts(whitespace=7)),
                                 "spec.options.whitespace: unknown whitespace policy 7"),
    "strict_on_ebnf": (dict(ebnf='root ::= "a"', options=Opts(strict=True)),
                       "spec.options.strict: applies only to json_schema"),
    "structural_tag_bad_type": (
        dict(structural_tag='{"type": "structural_tag", "format": {"type": "bogus"}}'),
        "spec.structural_tag: xgrammar cannot compile it: Invalid structural tag error: "
        "Format type not recognized: bogus"),
    "structural_tag_not_json": (dict(structural_tag="<tag>"),
                                "spec.structural_tag: not valid JSON"),
    "unknown_field": (_unknown_field_spec(), "spec: unknown field number(s) [99]"),
}


@pytest.mark.parametrize("name", list(BAD_SPECS))
def test_bad_spec_is_invalid_argument_naming_the_problem(served, name):
    address, stub, _ = served
    spec, message = BAD_SPECS[name]
    if isinstance(spec, dict):
        spec = common_pb2.GrammarSpec(**spec)
    with pytest.raises(grpc.RpcError) as err:
        stub.Compile(grammar_pb2.CompileRequest(spec=spec), timeout=60)
    assert err.value.code() == INVALID, err.value.details()
    assert message in err.value.details()
    assert rpc.check_health(address)


def test_fetch_rejects_bad_unknown_and_mismatched_keys(served):
    _, stub, _ = served
    cases = [
        (grammar_pb2.FetchRequest(key="xyz"), INVALID, "key: must be 64"),
        (grammar_pb2.FetchRequest(key="0" * 64), grpc.StatusCode.NOT_FOUND, "key: not in the"),
        (grammar_pb2.FetchRequest(key="0" * 64, spec=common_pb2.GrammarSpec(regex="q")),
         INVALID, "key: the spec's key is"),
    ]
    for request, code, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Fetch(request, timeout=30))
        assert err.value.code() == code and message in err.value.details()


def test_fetch_recompiles_an_evicted_key_from_its_spec(served, vocab):
    _, stub, service = served
    spec = common_pb2.GrammarSpec(regex="evict-me-[0-9]")
    ref = stub.Compile(grammar_pb2.CompileRequest(spec=spec), timeout=60)
    with service.cache._lock:  # simulate eviction of exactly this entry
        entry = service.cache._entries.pop(ref.key)
        service.cache._bytes -= len(entry.payload)
    name, payload = fetch_grammar(stub, ref.key, spec=spec, timeout=60)
    assert backend_for(vocab, name).deserialize(payload)  # the form, or the spec compiled


HOOK_FAILURES = {
    "crash": ("__gramserve_test_crash__", grpc.StatusCode.INTERNAL, "killed by SIGSEGV"),
    "timeout": ("__gramserve_test_hang__", grpc.StatusCode.DEADLINE_EXCEEDED,
                "ran past the deadline of 5 s"),
    "memory": ("__gramserve_test_memory__", grpc.StatusCode.RESOURCE_EXHAUSTED,
               "ran past the memory cap"),
}


@pytest.mark.parametrize("reason", list(HOOK_FAILURES))
def test_crash_hang_or_memory_blowup_fails_one_compile_and_service_keeps_serving(
        served, vocab, reason):
    address, stub, service = served
    pattern, code, message = HOOK_FAILURES[reason]
    failures = service.metrics.compile_failures.labels(reason)
    before = failures._value.get()
    timed = service.metrics.failed_compile_seconds.labels(reason)
    observed = sum(b.get() for b in timed._buckets)
    with pytest.raises(grpc.RpcError) as err:
        compile_(stub, regex=pattern)
    assert err.value.code() == code and message in err.value.details()
    assert failures._value.get() == before + 1
    assert sum(b.get() for b in timed._buckets) == observed + 1  # how long it cost, too
    assert rpc.check_health(address)
    # Both pool processes (the replacement included) still compile.
    refs = [compile_(stub, regex=f"after-{reason}-{i}") for i in range(3)]
    assert all(not r.cached for r in refs)
    assert accepts(matcher_for(stub, vocab, refs[0]), vocab, f"after-{reason}-0")


def test_metrics_are_served_over_http_and_move(served):
    _, stub, service = served

    def scrape() -> dict[str, float]:
        url = f"http://127.0.0.1:{service.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in body.splitlines() if line.startswith("gramserve_")}

    before = scrape()
    compile_(stub, regex="metrics-[a-z]")
    compile_(stub, regex="metrics-[a-z]")
    with pytest.raises(grpc.RpcError):
        compile_(stub, regex="")
    after = scrape()
    assert after["gramserve_grammar_cache_misses_total"] == \
        before["gramserve_grammar_cache_misses_total"] + 1
    assert after["gramserve_grammar_cache_hits_total"] >= \
        before["gramserve_grammar_cache_hits_total"] + 1
    kind = 'gramserve_grammar_compile_seconds_count{backend="xgrammar",kind="regex"}'
    assert after[kind] == before.get(kind, 0) + 1
    invalid = 'gramserve_grammar_compile_failures_total{reason="invalid"}'
    assert after[invalid] == before[invalid] + 1
    assert after["gramserve_grammar_cache_bytes"] > 0
    assert after["gramserve_grammar_compiles_in_flight"] == 0
    assert not [k for k in after if "_created" in k]
    assert any(k.startswith('gramserve_build_info{component="grammar-service"') for k in after)
    stats = stub.Stats(grammar_pb2.StatsRequest(), timeout=10)
    assert stats.misses == service.cache.misses and stats.entries == len(service.cache)
    assert stats.xgrammar_version == importlib.metadata.version("xgrammar")

