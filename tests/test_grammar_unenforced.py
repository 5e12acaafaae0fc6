"""The table of keywords xgrammar does not enforce, re-proved against the installed xgrammar.

Each entry's example must be judged differently by the JSON Schema (jsonschema library) and
by the grammar xgrammar compiles from it. When an upgrade makes xgrammar enforce a keyword,
its test here fails: drop the entry from grammar_service/unenforced.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from grammar_service.unenforced import (
    ENFORCED_FORMATS,
    TYPE_KEYWORDS,
    TYPELESS_EXAMPLES,
    UNENFORCED,
    find_unenforced,
)

STOP = 256


@pytest.fixture(scope="module")
def compiler():
    # One token per byte: the grammar alone decides, whatever a real tokenizer would split.
    vocab = [bytes([i]) for i in range(256)] + [b"</s>"]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=[STOP])
    return xgr.GrammarCompiler(info, max_threads=1)


def grammar_accepts(compiler, schema, instance, strict_mode: bool = False) -> bool:
    """Whether xgrammar's grammar takes `instance`; strict_mode False is gramserve's default
    (unlisted properties allowed), True its options.strict."""
    grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                           separators=(",", ":"), strict_mode=strict_mode)
    matcher = xgr.GrammarMatcher(grammar)
    text = json.dumps(instance, separators=(",", ":"))
    return matcher.accept_string(text) and matcher.accept_token(STOP) and matcher.is_terminated()


def schema_accepts(schema, instance) -> bool:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER).is_valid(instance)


@pytest.mark.parametrize("entry", UNENFORCED, ids=lambda e: e.keyword)
def test_xgrammar_still_does_not_enforce_keyword(compiler, entry):
    schema, instance = entry.example_schema, entry.example_instance
    assert grammar_accepts(compiler, schema, instance) != schema_accepts(schema, instance)
    assert entry.keyword in find_unenforced(schema)


@pytest.mark.parametrize("keyword", sorted(TYPELESS_EXAMPLES))
def test_xgrammar_ignores_type_keywords_on_a_node_without_type(compiler, keyword):
    schema, bad = TYPELESS_EXAMPLES[keyword]
    assert not schema_accepts(schema, bad) and grammar_accepts(compiler, schema, bad)
    assert find_unenforced(schema)[0] == keyword
    family = next(f for f, kws in TYPE_KEYWORDS.items() if keyword in kws)
    typed = {**schema, "type": "integer" if family == "number" else family}
    if keyword == "required":  # a required property must be listed too (see UNENFORCED)
        typed["properties"] = {"a": {}}
    if keyword != "format":  # ipv4 is among the enforced formats
        assert keyword not in find_unenforced(typed)
        assert not grammar_accepts(compiler, typed, bad, strict_mode=False)


def test_every_type_keyword_has_evidence():
    assert sorted(TYPELESS_EXAMPLES) == sorted(k for ks in TYPE_KEYWORDS.values() for k in ks)


@pytest.mark.parametrize("fmt,bad", [("email", "no-at-sign"), ("date", "2020-13-45x"),
                                      ("ipv4", "999.1"), ("uuid", "x")])
def test_enforced_formats_reject_bad_strings(compiler, fmt, bad):
    assert fmt in ENFORCED_FORMATS
    schema = {"type": "string", "format": fmt}
    assert not grammar_accepts(compiler, schema, bad)
    assert find_unenforced(schema) == []


def test_multiple_of_next_to_a_range_is_not_enforced(compiler):
    assert grammar_accepts(compiler, {"type": "integer", "minimum": 0, "multipleOf": 3}, 4)


def test_enforced_keywords_are_not_reported(compiler):
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "minLength": 2, "maxLength": 3},
        "n": {"type": "integer", "multipleOf": 3},
        "e": {"enum": ["a", "b"]}}, "required": ["s", "n", "e"]}
    assert find_unenforced(schema) == []
    assert not grammar_accepts(compiler, schema, {"s": "a", "n": 3, "e": "a"})
    assert not grammar_accepts(compiler, schema, {"s": "ab", "n": 4, "e": "a"})
    assert grammar_accepts(compiler, schema, {"s": "ab", "n": 6, "e": "b"})


def test_unenforced_paths_name_the_keyword_location():
    schema = {"anyOf": [{"type": "string", "format": "regex"},
                        {"type": "array", "items": {"type": "integer", "not": {"const": 1}},
                         "uniqueItems": True}],
              "$defs": {"d": {"oneOf": [{"type": "integer"}]}}}
    assert find_unenforced(schema) == ["$defs.d.oneOf", "anyOf.0.format",
                                       "anyOf.1.uniqueItems", "anyOf.1.items.not"]
    ranged = {"type": "integer", "minimum": 0, "multipleOf": 3}
    assert find_unenforced(ranged) == ["multipleOf"]
