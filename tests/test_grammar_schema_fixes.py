"""Schema rewrites: length-bounded JSON strings compile to grammars that refuse raw control
characters (xgrammar 0.2.9 accepts them from the schema as written, which makes invalid JSON),
up to a cap; unlisted properties are forbidden for llguidance as xgrammar's strict mode does."""

import json

import pytest
import xgrammar as xgr

from grammar_service.default_model import ensure_default_model
from grammar_service.schema_fixes import (
    MAX_REWRITTEN_LENGTH,
    fix_schema,
    forbid_unlisted_properties,
)
from grammar_service.unenforced import find_unenforced
from grammar_service.vocab import load_vocab

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
