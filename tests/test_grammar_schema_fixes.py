"""Schema rewrites: length-bounded JSON strings compile to grammars that refuse raw control
characters (xgrammar 0.2.9 accepts them from the schema as written, which makes invalid JSON),
up to a cap; counts written as 2.0 are integers; llguidance's date and time formats become
exact patterns; a `not` that says names are absent becomes those names forbidden; under
options.strict unlisted properties are forbidden for llguidance as xgrammar's strict mode
does."""

import json
from pathlib import Path

import jsonschema
import pytest
import tokenizers
import xgrammar as xgr

from grammar_service.backends import VocabView
from grammar_service.choice import compile_spec
from grammar_service.default_model import ensure_default_model
from grammar_service.schema_fixes import (
    FORMAT_PATTERNS,
    LLG_IGNORED,
    MAX_REWRITTEN_LENGTH,
    fix_schema,
    fix_schema_llguidance,
    forbid_unlisted_properties,
    llguidance_fix_applies,
    pattern_names,
    without_ignored,
)
from grammar_service.specs import canonical_json, parse_spec
from grammar_service.unenforced import find_unenforced
from grammar_service.vocab import load_vocab
from protos import common_pb2

BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1,
                                                    "maxLength": 6}},
           "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    vocab = load_vocab(ensure_default_model(tmp_path_factory.mktemp("m")))
    return xgr.GrammarCompiler(vocab.tokenizer_info(), max_threads=1)


def _accepts(compiler, schema, text):
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    return xgr.GrammarMatcher(grammar).accept_string(text)


def test_xgrammar_alone_accepts_a_tab_in_a_bounded_string(compiler):
    # The defect the rewrite exists for; when this starts failing, xgrammar fixed it.
    assert _accepts(compiler, BOUNDED, '{"name": "a\tb"}')


def test_rewritten_schema_refuses_control_characters_and_keeps_the_bounds(compiler):
    fixed = fix_schema(BOUNDED)
    assert not _accepts(compiler, fixed, '{"name": "a\tb"}')
    assert not _accepts(compiler, fixed, '{"name": "a\x0fb"}')
    assert _accepts(compiler, fixed, '{"name": "abc"}')
    assert not _accepts(compiler, fixed, '{"name": ""}')
    assert not _accepts(compiler, fixed, '{"name": "abcdefg"}')


def test_rewrite_leaves_patterns_formats_and_data_alone():
    schema = {"type": "object", "properties": {
        "p": {"type": "string", "pattern": "^a+$", "maxLength": 3},
        "f": {"type": "string", "format": "email", "maxLength": 30},
        "e": {"enum": [{"type": "string", "maxLength": 2}]}}}
    assert fix_schema(schema) == schema
    assert BOUNDED["properties"]["name"].get("pattern") is None  # the input is not changed


def test_bounds_above_the_cap_are_not_rewritten_but_reported_unenforced(compiler):
    # A bounded repetition of 8192 turned a 78 ms compile into 42 s: above the cap the
    # schema is compiled as written and the keyword is reported instead.
    long = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1,
                                                   "maxLength": MAX_REWRITTEN_LENGTH + 1}},
            "required": ["s"]}
    assert fix_schema(long) == long
    assert _accepts(compiler, long, '{"s": "a\tb"}')  # what the report is about
    assert find_unenforced(long) == ["properties.s.minLength", "properties.s.maxLength"]
    at_cap = {"type": "string", "maxLength": MAX_REWRITTEN_LENGTH}
    assert "pattern" in fix_schema(at_cap) and find_unenforced(at_cap) == []


def test_unlisted_properties_are_forbidden_where_that_keeps_the_schemas_meaning():
    schema = {"type": "object", "properties": {
        "plain": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
        "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        "enum": {"enum": [{"properties": {"k": {}}}]}}}
    fixed = forbid_unlisted_properties(schema)
    assert fixed["additionalProperties"] is False
    props = fixed["properties"]
    assert props["plain"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["both"] == schema["properties"]["both"]  # allOf branches list parts only
    assert props["enum"] == schema["properties"]["enum"]  # data, not a schema
    assert "additionalProperties" not in schema  # the input is not changed


def test_counts_written_as_integral_floats_become_integers_for_both_backends():
    schema = {"type": "array", "maxItems": 2.0, "items": {"type": "string", "minLength": 1.0}}
    for fixed in (fix_schema(schema), fix_schema_llguidance(schema)):
        assert fixed["maxItems"] == 2 and isinstance(fixed["maxItems"], int)
        assert fixed["items"].get("minLength", 1) == 1
    assert fix_schema_llguidance({"maxLength": 2.5}) == {"maxLength": 2.5}  # invalid, kept
    assert schema["maxItems"] == 2.0  # the input is not changed


def test_date_and_time_formats_become_patterns_beside_any_pattern_already_there():
    assert fix_schema_llguidance({"type": "string", "format": "date"}) == {
        "type": "string", "pattern": FORMAT_PATTERNS["date"]}
    both = fix_schema_llguidance({"type": "string", "format": "time", "pattern": "^1"})
    assert both == {"type": "string", "pattern": "^1",
                    "allOf": [{"pattern": FORMAT_PATTERNS["time"]}]}
    assert fix_schema_llguidance({"format": "email"}) == {"format": "email"}
    assert fix_schema_llguidance({"enum": [{"format": "date"}]}) == {
        "enum": [{"format": "date"}]}  # data, not a schema


def test_a_not_that_says_names_are_absent_becomes_those_names_forbidden_on_an_object():
    """`{"not": {"required": [a]}}` (or an anyOf of such) holds for an object without the
    names and for no non-object (`required` holds for every non-object): judged like
    jsonschema on llguidance's compile of the fixed schema (it does not implement `not`)."""
    one = {"properties": {"a": {}, "b": {}}, "not": {"required": ["a"]}}
    assert fix_schema_llguidance(one) == {"properties": {"a": {}, "b": {}}, "allOf": [
        {"type": "object", "properties": {"a": False}}]}
    two = {"not": {"anyOf": [{"required": ["a"]}, {"required": ["b"], "description": "x"}]},
           "allOf": [{"type": "object"}]}
    assert fix_schema_llguidance(two) == {"allOf": [
        {"type": "object"}, {"type": "object", "properties": {"a": False, "b": False}}]}
    three = {"not": {"properties": {"a": {}}, "required": ["a"]}}  # (as SchemaStore writes)
    assert fix_schema_llguidance(three) == {"allOf": [
        {"type": "object", "properties": {"a": False}}]}
    for kept in ({"not": {"required": ["a", "b"]}}, {"not": {"type": "integer"}},
                 {"not": {"properties": {"a": {"type": "string"}}, "required": ["a"]}},
                 {"not": {"required": ["a"], "minProperties": 2}}):
        assert fix_schema_llguidance(kept) == kept
    backends = VocabView.of(load_vocab(ensure_default_model())).backends()
    tok = tokenizers.Tokenizer.from_str(load_vocab(ensure_default_model()).tokenizer_json())
    for schema in (one, two, three):
        validator = jsonschema.Draft202012Validator(schema)
        # llguidance's own JSON compile of the fixed schema (the schema's order)
        spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema), options=(
            common_pb2.GrammarOptions(backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE,
                                      fixed_property_order=True))))
        compiled = compile_spec(spec, backends)
        assert not compiled.unenforced
        backend = backends[compiled.backend]
        grammar = backend.deserialize(compiled.payload)
        for doc in ({}, {"b": 1}, {"a": 1}, {"a": 1, "b": 2}, {"c": 3}, "s", 1, None, []):
            m = backend.new_matcher(grammar)
            accepted = all(m.accept_token(t) for t in tok.encode(
                json.dumps(doc), add_special_tokens=False).ids) and m.accept_token(
                m.stop_token_ids[0])
            assert accepted == validator.is_valid(doc), (schema, doc)


@pytest.mark.parametrize("schema, fixed", [
    ({"not": {"type": "null"}}, {"type": ["boolean", "object", "array", "number", "string"]}),
    ({"type": ["string", "null"], "not": {"type": "null"}}, {"type": "string"}),
    ({"type": ["integer", "string"], "not": {"type": ["string", "null"]}}, {"type": "integer"}),
    ({"not": {"type": ["number", "string"], "description": "d"}},
     {"type": ["null", "boolean", "object", "array"]}),
    ({"not": {"type": "integer"}}, None),  # non-integral numbers: no list of types
    ({"type": "null", "not": {"type": "null"}}, None),  # nothing left
    ({"not": {"type": "null", "minimum": 1}}, None),
])
def test_a_not_of_types_becomes_the_other_types(schema, fixed):
    """Judged like jsonschema on llguidance through the compile path, nothing reported."""
    assert fix_schema_llguidance(schema) == (schema if fixed is None else fixed)
    if fixed is None:
        return
    backends = VocabView.of(load_vocab(ensure_default_model())).backends()
    tok = tokenizers.Tokenizer.from_str(load_vocab(ensure_default_model()).tokenizer_json())
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
    compiled = compile_spec(spec, backends)
    assert compiled.backend == "llguidance" and not compiled.unenforced, compiled.reason
    backend = backends[compiled.backend]
    grammar = backend.deserialize(compiled.payload)
    validator = jsonschema.Draft202012Validator(schema)
    for doc in (None, True, 0, 1.5, "s", [], {}, {"a": None}):
        m = backend.new_matcher(grammar)
        accepted = all(m.accept_token(t) for t in tok.encode(
            json.dumps(doc), add_special_tokens=False).ids) and m.accept_token(
            m.stop_token_ids[0])
        assert accepted == validator.is_valid(doc), (schema, doc)


# Unions on one name written with `if`: the node is an object requiring the name.
CHART_LIKE = {  # the name's own enum gives "another value" (chart.json's apiVersion)
    "type": "object", "required": ["kind"],
    "properties": {"kind": {"enum": ["a", "b", "c"]}, "x": {"type": "integer"},
                   "y": {"type": "string"}},
    "if": {"properties": {"kind": {"const": "a"}}},
    "then": {"required": ["x"]}, "else": {"properties": {"x": False}}}
UNION_OF_REFS = {  # each side pins the name itself (specmatic.json's version)
    "type": "object", "required": ["v"], "properties": {"v": {"type": "integer"}},
    "allOf": [{"if": {"properties": {"v": {"const": 3}}},
               "then": {"$ref": "#/$defs/V3"}, "else": {"$ref": "#/$defs/V2"}}],
    "$defs": {"V3": {"type": "object", "required": ["v"], "additionalProperties": False,
                     "properties": {"v": {"enum": [3]}, "p": {"type": "string"}}},
              "V2": {"type": "object", "required": ["v", "q"], "additionalProperties": False,
                     "properties": {"v": {"type": "integer", "enum": [2]},
                                    "q": {"type": "boolean"}}}}}
# `then` pins the name to more values than the `if`: it is not that side alone
PINNED_WIDER = {**UNION_OF_REFS, "allOf": [{
    "if": {"properties": {"v": {"const": 3}}}, "then": {"$ref": "#/$defs/V23"},
    "else": {"$ref": "#/$defs/V2"}}], "$defs": {**UNION_OF_REFS["$defs"], "V23": {
        "type": "object", "required": ["v"], "additionalProperties": False,
        "properties": {"v": {"enum": [2, 3]}, "p": {"type": "string"}}}}}
THEN_ONLY = {  # an enum of numbers in the if, no else
    "type": "object", "required": ["t"],
    "properties": {"t": {"enum": [1, 2, 3.0]}, "n": {"type": "integer"}},
    "if": {"type": "object", "required": ["t"], "properties": {"t": {"enum": [1.0, 2]}}},
    "then": {"properties": {"n": {"maximum": 5}}}}


def test_a_union_written_with_if_becomes_the_anyof_of_its_two_sides():
    assert fix_schema_llguidance(CHART_LIKE) == {
        **{k: v for k, v in CHART_LIKE.items() if k not in ("if", "then", "else")},
        "anyOf": [{"allOf": [{"properties": {"kind": {"enum": ["a"]}}}, {"required": ["x"]}]},
                  {"allOf": [{"properties": {"kind": {"enum": ["b", "c"]}}},
                             {"properties": {"x": False}}]}]}
    assert fix_schema_llguidance(PINNED_WIDER)["anyOf"] == [
        {"allOf": [{"properties": {"v": {"enum": [3]}}}, {"$ref": "#/$defs/V23"}]},
        {"$ref": "#/$defs/V2"}]
    fixed = fix_schema_llguidance(UNION_OF_REFS)
    assert "allOf" not in fixed and fixed["anyOf"] == [{"$ref": "#/$defs/V3"},
                                                     {"$ref": "#/$defs/V2"}]
    assert fix_schema_llguidance(THEN_ONLY)["anyOf"] == [
        {"allOf": [{"properties": {"t": {"enum": [1.0, 2]}}}, THEN_ONLY["then"]]},
        {"properties": {"t": {"enum": [3.0]}}}]  # no else: the value's case alone; 3.0 is 3
    kept = [
        {**CHART_LIKE, "type": ["object", "null"]},   # not only objects
        {**CHART_LIKE, "required": []},                # the name may be absent
        {**CHART_LIKE, "properties": {"kind": {"type": "string"}}},  # a string complement
        {**CHART_LIKE, "anyOf": [{"required": ["y"]}, {"required": ["x"]}]},  # its own union
        {**CHART_LIKE, "allOf": [{"if": {"properties": {"kind": {"const": "b"}}},
                                  "then": {"required": ["y"]}}]},  # two conditionals
        {**CHART_LIKE, "if": {"properties": {"kind": {"const": "a"}}, "minProperties": 2}},
        {**CHART_LIKE, "if": {"properties": {"kind": {"const": "a"}, "x": {"const": 1}}}},
        {**CHART_LIKE, "if": {"properties": {"kind": {"enum": [["a"]]}}}},  # not a scalar
        {**CHART_LIKE, "if": {"properties": {"kind": {"const": "a"}}, "required": ["x"]}},
    ]
    for schema in kept:
        assert fix_schema_llguidance(schema) == schema


@pytest.mark.parametrize("schema", [CHART_LIKE, UNION_OF_REFS, PINNED_WIDER, THEN_ONLY])
def test_a_union_written_with_if_is_enforced_exactly_in_any_property_order(schema):
    """llguidance ignores if / then / else: after the fix nothing is reported unenforced, and
    documents (every key order) are accepted exactly where jsonschema says they are valid."""
    import itertools
    import random

    vocab = load_vocab(ensure_default_model())
    backends = VocabView.of(vocab).backends()
    tok = tokenizers.Tokenizer.from_str(vocab.tokenizer_json())
    compiled = compile_spec(parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema))),
                            backends)
    assert compiled.backend == "llguidance" and not compiled.unenforced, compiled.reason
    assert "any order" in compiled.reason
    backend = backends[compiled.backend]
    grammar = backend.deserialize(compiled.payload)
    validator = jsonschema.Draft202012Validator(schema)
    name = schema["required"][0]
    values = ["a", "b", "c", "d", 1, 2, 3, 3.5, True, None]
    others = {"x": [1, "s"], "y": ["z"], "p": ["s", 1], "q": [True], "n": [4, 9], "w": [0]}
    rng = random.Random(7)
    seen = {True: 0, False: 0}
    for value in values:
        for picks in itertools.product(*([None, *vs] for vs in others.values())):
            doc = {name: value} | {k: v for k, v in zip(others, picks, strict=True)
                                   if v is not None}
            if len(doc) > 3:
                continue
            items = list(doc.items())
            rng.shuffle(items)
            m = backend.new_matcher(grammar)
            accepted = all(m.accept_token(t) for t in tok.encode(
                json.dumps(dict(items)), add_special_tokens=False).ids) and m.accept_token(
                m.stop_token_ids[0])
            valid = validator.is_valid(doc)
            seen[valid] += 1
            assert accepted == valid, (doc, valid)
    assert min(seen.values()) >= 3, seen  # both verdicts seen (every valid one of UNION_OF_REFS)


def test_the_text_check_skips_the_llguidance_fix_only_where_it_changes_nothing():
    # Every schema of the JSON Schema Test Suite and those above: where the text check says
    # no, the fix gives the schema back unchanged; the fixes above are all found.
    suite = Path(__file__).parent / "data" / "json_schema_test_suite"
    schemas = [case["schema"] for path in sorted(suite.glob("*/*.json"))
               for case in json.loads(path.read_text())]
    changed = [{"type": "array", "maxItems": 2.0}, {"items": {"minLength": 1e0}},
               {"type": "string", "format": "date"}, {"anyOf": [{"format": "date-time"}]},
               {"properties": {"t": {"type": "string", "format": "time", "pattern": "^1"}}},
               {"items": {"not": {"required": ["a"]}}}, CHART_LIKE, UNION_OF_REFS]
    for schema in changed:
        assert llguidance_fix_applies(canonical_json(schema))
        assert canonical_json(fix_schema_llguidance(schema)) != canonical_json(schema)
    skipped = 0
    for schema in schemas + [BOUNDED, {"format": "email"}, {"enum": [2.0]}]:
        if not llguidance_fix_applies(canonical_json(schema)):
            skipped += 1
            assert canonical_json(fix_schema_llguidance(schema)) == canonical_json(schema)
    assert skipped > len(schemas) * 0.9


@pytest.mark.parametrize("fmt,text,ok", [
    ("date", "2024-02-29", True), ("date", "2023-02-29", False), ("date", "2000-02-29", True),
    ("date", "2100-02-29", False), ("date", "2023-04-31", False), ("date", "2023-12-31", True),
    ("date", "2023-1-01", False), ("date", "\u09ea023-01-01", False),
    ("time", "23:59:60Z", True), ("time", "23:59:60+00:00", True), ("time", "12:59:60Z", False),
    ("time", "08:30:06.283185Z", True), ("time", "08:30:06", False), ("time", "24:00:00Z", False),
    ("date-time", "1963-06-19T08:30:06.28123+01:00", True),
    ("date-time", "1963-06-19t08:30:06z", True), ("date-time", "1963-06-19 08:30:06Z", False),
])
def test_format_patterns_match_rfc3339_with_leap_days_and_utc_leap_seconds(fmt, text, ok):
    import re

    text = text.encode().decode("unicode_escape")
    assert (re.fullmatch(FORMAT_PATTERNS[fmt], text) is not None) == ok


# ----------------------------------------------- what llguidance's lenient compile ignores


def test_llguidance_ignores_each_keyword_left_out():
    """`LLG_IGNORED` is what llguidance itself does not implement: compiled leniently, each
    keyword is named in an "Unimplemented keys" warning (an upgrade that implements one fails
    here, and the keyword must then stay in the schema it compiles)."""
    import llguidance

    vocab = load_vocab(ensure_default_model())
    tok = VocabView.of(vocab).backends()["llguidance"].tokenizer
    values = {"not": {"type": "null"}, "if": {"required": ["a"]}, "then": {"required": ["b"]},
              "else": {"required": ["c"]}, "uniqueItems": True, "contains": {"type": "integer"},
              "minContains": 1, "maxContains": 2, "propertyNames": {"maxLength": 2},
              "dependentSchemas": {"a": {"required": ["b"]}},
              "unevaluatedProperties": False, "unevaluatedItems": False}
    assert values.keys() == LLG_IGNORED
    for keyword, value in values.items():
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", keyword: value}
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"lenient": True})
        failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        assert not failed and any("Unimplemented keys" in w and f'"{keyword}"' in w
                                  for w in warnings), (keyword, warnings)


def test_without_ignored_leaves_names_data_and_name_lists():
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"if": {"type": "string", "not": {"const": "x"}},
                             "not": {"uniqueItems": True, "items": {}}},
              "required": ["if", "not"], "default": {"not": 1},
              "dependencies": {"if": ["not"], "not": {"required": ["q"]}},
              "if": {"required": ["a"]}, "then": {"required": ["b"]}}
    out, dropped = without_ignored(schema, json.dumps(schema))
    assert dropped == ("dependencies", "if", "not", "then", "uniqueItems")
    assert out == {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                   "properties": {"if": {"type": "string"}, "not": {"items": {}}},
                   "required": ["if", "not"], "default": {"not": 1},
                   "dependencies": {"if": ["not"]}}
    assert schema["properties"]["if"]["not"] == {"const": "x"}  # a copy: the input unchanged
    # after draft 7 `dependencies` is no keyword: llguidance ignores all of it
    later = {**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert "dependencies" not in without_ignored(later, json.dumps(later))[0]
    # nothing to leave out: the schema itself, no walk
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert without_ignored(plain, json.dumps(plain)) == (plain, ())


# ------------------------------------------------------------- names written as patterns


def test_pattern_names_reads_only_anchored_literal_alternatives():
    assert pattern_names("^WebOptimizer$") == ["WebOptimizer"]
    assert pattern_names("^(cdn|Cdn)$") == ["cdn", "Cdn"]
    assert pattern_names("^(?:a|b\\.c)$") == ["a", "b.c"]
    assert pattern_names("^\\$ref$") == ["$ref"]
    for pattern in ("^a|b$", "^a.b$", "a$", "^a", "^(a|b)(c)$", "^a\\d$", "^(?i)a$",
                    "^(a)|(b)$", "^a\\$", "^[ab]$", "^a+$"):
        assert pattern_names(pattern) is None, pattern


def test_names_written_as_patterns_are_listed_names_in_any_order(tmp_path_factory):
    """Literal patterns become listed names (an allOf with a listed name's own schema);
    other patterns and additionalProperties keep their meaning; against jsonschema on every
    document of up to three keys from the names involved, keys in both orders."""
    import itertools
    import random

    schema = {"type": "object", "additionalProperties": False,
              "properties": {"cdn": {"type": "object", "properties": {"url": {"type": "string"}}},
                             "n": {"type": "integer"}},
              "patternProperties": {"^(cdn|Cdn)$": {"required": ["url"]},
                                    "^Pwa$": {"type": "boolean"},
                                    "^x-": {"type": "string"}}}
    fixed = fix_schema_llguidance(schema)
    assert set(fixed["patternProperties"]) == {"^x-"}
    assert fixed["properties"]["Pwa"] == {"type": "boolean"}
    assert fixed["properties"]["cdn"] == {"allOf": [schema["properties"]["cdn"],
                                                    {"required": ["url"]}]}
    vocab = load_vocab(ensure_default_model(tmp_path_factory.mktemp("m")))
    backends = VocabView.of(vocab).backends()
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
    compiled = compile_spec(spec, backends)
    assert "properties in any order" in compiled.reason
    b = backends[compiled.backend]
    grammar = b.deserialize(compiled.payload)
    tok = tokenizers.Tokenizer.from_str(vocab.tokenizer_json())
    values = {"cdn": [{"url": "u"}, {}], "Cdn": [{"url": "u"}, 1], "Pwa": [True, "s"],
              "n": [1], "x-a": ["s", 1], "other": [1]}
    validator = jsonschema.Draft202012Validator(schema)
    rng, checked = random.Random(5), 0
    for size in range(4):
        for keys in itertools.combinations(values, size):
            doc = {k: rng.choice(values[k]) for k in keys}
            for order in (list(doc), list(reversed(doc))):
                text = json.dumps({k: doc[k] for k in order})
                m = b.new_matcher(grammar)
                ids = tok.encode(text, add_special_tokens=False).ids
                ok = all(m.accept_token(t) for t in ids) and m.accept_token(m.stop_token_ids[0])
                assert ok == validator.is_valid(doc), text
                checked += 1
    assert checked > 60
