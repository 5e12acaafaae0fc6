"""References within a schema (grammar_service.refs): `$ref`s through `$id`s, anchors and
relative URIs become pointers from the root, identifiers below the root are dropped, and what
names another document is still refused, naming the field. Then through gramserve's compile
path on real matchers (both backends, token by token) against jsonschema's verdicts."""

import copy
import json

import jsonschema
import pytest

from bench.schema_verdicts import LLGUIDANCE, XGRAMMAR, Judge
from grammar_service.default_model import ensure_default_model
from grammar_service.refs import local_refs
from grammar_service.specs import parse_spec
from grammar_service.vocab import load_vocab
from protos import common_pb2
from protos.rpc import InvalidArgument

D7 = "http://json-schema.org/draft-07/schema#"
D4 = "http://json-schema.org/draft-04/schema#"

# (schema, {node path: the pointer its $ref must become})
REWRITES = {
    "relative $id": (
        {"$id": "http://example.com/root.json", "properties": {"a": {"$ref": "item.json"}},
         "$defs": {"item": {"$id": "item.json", "type": "integer"}}},
        {("properties", "a"): "#/$defs/item"}),
    "pointer inside an embedded resource": (
        {"properties": {"a": {"$ref": "http://x.test/t.json#/$defs/leaf"}},
         "$defs": {"tree": {"$id": "http://x.test/t.json",
                            "$defs": {"leaf": {"type": "string"}}}}},
        {("properties", "a"): "#/$defs/tree/$defs/leaf"}),
    "nearest parent's base": (
        {"$id": "http://example.com/a.json",
         "$defs": {"x": {"$id": "http://example.com/b/c.json",
                         "$defs": {"y": {"$id": "d.json", "type": "number"}}}},
         "allOf": [{"$ref": "http://example.com/b/d.json"}]},
        {("allOf", "0"): "#/$defs/x/$defs/y"}),
    "urn base and anchor": (
        {"$id": "urn:uuid:deadbeef-1234-ff00-00ff-4321feebdaed",
         "properties": {"foo": {"$ref": "#something"}},
         "$defs": {"bar": {"$anchor": "something", "type": "string"}}},
        {("properties", "foo"): "#/$defs/bar"}),
    "draft 7 plain-name $id": (
        {"$schema": D7, "properties": {"a": {"$ref": "#leaf"}},
         "definitions": {"leaf": {"$id": "#leaf", "type": "boolean"}}},
        {("properties", "a"): "#/definitions/leaf"}),
    "draft 4 id": (
        {"$schema": D4, "id": "http://example.com/r.json",
         "properties": {"a": {"$ref": "n.json"}},
         "definitions": {"n": {"id": "n.json", "type": "null"}}},
        {("properties", "a"): "#/definitions/n"}),
    "pointer escapes": (
        {"$id": "http://example.com/r.json", "properties": {"a": {"$ref": "s.json"}},
         "$defs": {"a/b~c d": {"$id": "s.json", "type": "string"}}},
        {("properties", "a"): "#/$defs/a~1b~0c%20d"}),
    "property names that are keywords": (
        {"properties": {"enum": {"$ref": "e.json"}, "$ref": {"type": "string"}},
         "$defs": {"e": {"$id": "e.json", "const": 1}}},
        {("properties", "enum"): "#/$defs/e"}),
}


def _at(node, path):
    for key in path:
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def _ids_below_root(node, top=True):
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("$anchor", "$dynamicAnchor") or (key in ("$id", "id") and not top
                                                      and isinstance(value, str)):
                found.append(key)
            if key not in ("enum", "const", "default", "examples"):
                found += _ids_below_root(value, False)
    elif isinstance(node, list):
        for value in node:
            found += _ids_below_root(value, False)
    return found


@pytest.mark.parametrize("name", list(REWRITES))
def test_references_become_pointers_from_the_root(name):
    schema, expected = REWRITES[name]
    before = copy.deepcopy(schema)
    out = local_refs(schema)
    assert schema == before  # the input is not changed
    for path, pointer in expected.items():
        assert _at(out, path)["$ref"] == pointer
    assert _ids_below_root(out) == []


def test_nothing_to_rewrite_returns_the_schema_itself():
    schema = {"$id": "http://example.com/r.json", "properties": {"a": {"$ref": "#/$defs/a"}},
              "$defs": {"a": {"type": "integer", "enum": [{"$id": "data", "$ref": "x"}]}}}
    assert local_refs(schema) is schema


def test_draft7_id_beside_a_ref_changes_no_base():
    # Up to draft 7 a $ref's siblings are ignored: its $id too.
    schema = {"$schema": D7, "$id": "http://example.com/r.json",
              "definitions": {"n": {"$id": "n.json", "type": "null"},
                              "w": {"$id": "http://other.test/", "$ref": "n.json"}}}
    assert local_refs(schema)["definitions"]["w"]["$ref"] == "#/definitions/n"


@pytest.mark.parametrize("schema, where, ref", [
    ({"$ref": "https://example.com/other.json"}, "(root)", "https://example.com/other.json"),
    ({"$id": "http://example.com/r.json", "properties": {"a": {"$ref": "missing.json"}}},
     "properties.a", "missing.json"),
    ({"properties": {"a": {"$ref": "#nope"}}}, "properties.a", "#nope"),
])
def test_a_reference_to_another_document_is_refused_naming_the_field(schema, where, ref):
    with pytest.raises(InvalidArgument) as err:
        parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
    assert str(err.value).startswith(
        f"spec.json_schema: unsupported schema feature at {where}: $ref {ref!r} names no place")


def test_boolean_root_schemas():
    assert parse_spec(common_pb2.GrammarSpec(json_schema="true")).text == "{}"
    with pytest.raises(InvalidArgument, match="spec.json_schema: is false"):
        parse_spec(common_pb2.GrammarSpec(json_schema="false"))


# Differential: through the compile path and token-by-token matchers, both backends, the
# verdicts of jsonschema (2020-12 / draft 7, as each schema says).
RECURSIVE = {"$id": "http://example.com/tree", "type": "object", "required": ["value"],
             "properties": {"value": {"type": "integer"},
                            "children": {"type": "array", "items": {"$ref": "node"}}},
             "additionalProperties": False,
             "$defs": {"node": {"$id": "http://example.com/node",
                                "$ref": "http://example.com/tree"}}}
SCOPED = {"$id": "http://example.com/ref-and-id1/base.json", "$ref": "int.json",
          "$defs": {"bigint": {"$id": "int.json", "type": "integer", "maximum": 10},
                    "smallint": {"$id": "/ref-and-id2/int.json", "type": "integer",
                                 "maximum": 2}}}
ANCHORED = {"$schema": D7, "type": "object", "additionalProperties": False,
            "properties": {"kind": {"$ref": "#kind"}, "n": {"$ref": "#/definitions/n"}},
            "definitions": {"k": {"$id": "#kind", "enum": ["a", "b"]},
                            "n": {"type": "integer", "minimum": 0}}}
CASES = [
    (RECURSIVE, [{"value": 1}, {"value": 1, "children": [{"value": 2, "children": []}]},
                 {"value": 1, "children": [{"value": "x"}]}, {"value": 1, "children": [{}]},
                 {"children": []}]),
    (SCOPED, [5, 10, 11, 2, "5"]),
    (ANCHORED, [{"kind": "a", "n": 3}, {"kind": "b", "n": 0}, {"kind": "c"}, {"n": -1},
                {"kind": "a", "x": 1}]),
]


@pytest.fixture(scope="module")
def judge():
    return Judge(load_vocab(ensure_default_model()))


@pytest.mark.parametrize("mode", [LLGUIDANCE, XGRAMMAR, "gramserve"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_resolved_references_enforce_what_jsonschema_says(judge, mode, case):
    schema, instances = CASES[case]
    build = judge.build(schema, mode)
    assert build.ok, build.error
    validator = jsonschema.validators.validator_for(schema)(schema)
    for instance in instances:
        valid = validator.is_valid(instance)
        verdict = judge.verdict(build, instance, valid)
        assert verdict == "pass" or (verdict == "invalid_reported" and build.unenforced), \
            (instance, valid, verdict)
