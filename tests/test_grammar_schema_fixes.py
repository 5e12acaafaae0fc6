"""Length-bounded JSON strings compile to grammars that refuse raw control characters (xgrammar
0.2.9 accepts them from the schema as written, which makes invalid JSON)."""

import json

import pytest
import xgrammar as xgr

from grammar_service.default_model import ensure_default_model
from grammar_service.schema_fixes import fix_schema
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
