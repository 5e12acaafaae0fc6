"""Any property order (grammar_service.property_order) on real llguidance, token by token.

The rewrite must accept exactly what the schema accepts, in any key order: random schemas
(nested objects, arrays, local $refs, anyOf, required, every kind of additionalProperties,
objects llguidance compiles itself beside rewritten ones) with random documents, valid ones
in shuffled key order and invalid ones made from them, with and without whitespace, are
judged by jsonschema and by the compiled grammar, and the two must agree on every document.
Whitespace: the same whitespace as llguidance's own JSON grammar at each bound.
"""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest
import tokenizers

from grammar_service.backends import LLGUIDANCE, XGRAMMAR, BackendError, VocabView
from grammar_service.choice import compile_spec
from grammar_service.default_model import ensure_default_model
from grammar_service.property_order import any_order_grammar, whitespace_regex
from grammar_service.schema_fixes import fix_schema_llguidance
from grammar_service.specs import parse_spec
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
def encode(vocab):
    tok = tokenizers.Tokenizer.from_str(vocab.tokenizer_json())
    return lambda text: tok.encode(text, add_special_tokens=False).ids


def compiled(backends, schema, backend=common_pb2.GRAMMAR_BACKEND_LLGUIDANCE, **options):
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema),
                                             options=Opts(backend=backend, **options)))
    result = compile_spec(spec, backends)
    b = backends[result.backend]
    # the rank's side: the serialised form, read back
    return b, b.deserialize(result.payload)


def accepts(grammar, encode, text: str) -> bool:
    b, g = grammar
    m = b.new_matcher(g)
    return all(m.accept_token(t) for t in encode(text)) and m.accept_token(m.stop_token_ids[0])


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}}},
    "required": ["name", "age"],
    "$defs": {"tag": {"type": "object", "additionalProperties": False,
                      "properties": {"k": {"type": "string"}, "v": {"type": "number"}},
                      "required": ["k", "v"]}},
}


def test_any_order_by_default_and_each_property_at_most_once(backends, encode):
    g = compiled(backends, PERSON)
    for text, ok in [
        ('{"name":"a","age":1}', True),
        ('{"age":1,"name":"a"}', True),
        ('{"tags":[{"v":1,"k":"x"}],"age":1,"name":"a"}', True),
        ('{"other":{"x":[1]},"age":1,"name":"a"}', True),   # unlisted names allowed
        ('{"age":1}', False),                                 # required name missing
        ('{"age":1,"name":"a","age":2}', False),              # a listed name twice
        ('{"age":1,"name":"a","tags":[{"v":1}]}', False),     # nested required
        ('{"age":1,"name":"a","tags":[{"k":"x","v":1,"z":0}]}', False),  # nested false
    ]:
        assert accepts(g, encode, text) is ok, text
        assert jsonschema.validate(json.loads(text), PERSON) is None if ok else True


def test_fixed_property_order_option_and_xgrammar_keep_the_schemas_order(backends, encode):
    swapped = '{"age":1,"name":"a"}'
    for g in (compiled(backends, PERSON, fixed_property_order=True),
              compiled(backends, PERSON, backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR)):
        assert accepts(g, encode, '{"name":"a","age":1}')
        assert not accepts(g, encode, swapped)


def test_a_property_listed_as_false_is_never_allowed(backends, encode):
    for node in ({"type": "object"}, {}):  # typed, and typeless (any other value too)
        schema = {**node, "properties": {"a": {"type": "integer"}, "b": False, "c": True}}
        g = compiled(backends, schema)
        assert accepts(g, encode, '{"c":[1],"a":1,"x":2}')
        assert not accepts(g, encode, '{"a":1,"b":2}')
        assert not accepts(g, encode, '{"b":null}')


def test_strict_forbids_unlisted_names_in_any_order(backends, encode):
    g = compiled(backends, PERSON, strict=True)
    assert accepts(g, encode, '{"age":1,"name":"a"}')
    assert not accepts(g, encode, '{"age":1,"name":"a","other":1}')


def test_names_that_need_escapes_and_regex_characters(backends, encode):
    names = ['a"b', "c\\d", "e/f", "{g}", "h.*", "tab\there", "ünï"]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
              "required": names[:3], "additionalProperties": {"type": "string"}}
    g = compiled(backends, schema)
    doc = {n: i for i, n in enumerate(names)}
    for keys in (names, names[::-1], names[3:] + names[:3]):
        text = json.dumps({k: doc[k] for k in keys}, ensure_ascii=False)
        assert accepts(g, encode, text), text
    # an unlisted name takes additionalProperties; a listed one cannot pose as unlisted
    assert accepts(g, encode, json.dumps({**doc, "zz": "s"}, ensure_ascii=False))
    assert not accepts(g, encode, json.dumps({**doc, "zz": 1}, ensure_ascii=False))
    assert not accepts(g, encode, '{"a\\"b":"s","c\\\\d":1,"e/f":2}')
    assert not accepts(g, encode, '{"a\\"b":1,"c\\\\d":1,"e\\/f":"s"}')  # e/f spelled e\/f


def test_whitespace_is_the_json_compilers_at_each_policy(backends, encode):
    """In schema order, the rewritten grammar and llguidance's JSON grammar accept the same
    whitespace: up to the bound at each place (bounded), none (compact), any (any)."""
    rng = random.Random(7)
    doc = {"name": "a", "age": 1, "tags": [{"k": "x", "v": 2}, {"k": "y", "v": 3}]}
    for options in ({}, {"max_whitespace": 2},
                    {"whitespace": common_pb2.WHITESPACE_COMPACT},
                    {"whitespace": common_pb2.WHITESPACE_ANY}):
        free = compiled(backends, PERSON, **options)
        fixed = compiled(backends, PERSON, fixed_property_order=True, **options)
        for _ in range(25):
            text = _spaced(doc, rng, rng.choice([0, 1, 2, 3, 5]))
            assert accepts(free, encode, text) == accepts(fixed, encode, text), (options, text)


def _spaced(value, rng, most: int) -> str:
    """JSON text with 0..`most` whitespace characters at random places between tokens."""
    def ws():
        return "".join(rng.choice(" \n\t") for _ in range(rng.randint(0, most)))
    if value == {} or value == []:
        return json.dumps(value)[0] + ws() + json.dumps(value)[1]  # one place, not two
    if isinstance(value, dict):
        inner = f"{ws()},{ws()}".join(f"{json.dumps(k)}{ws()}:{ws()}{_spaced(v, rng, most)}"
                                        for k, v in value.items())
        return "{" + ws() + inner + ws() + "}"
    if isinstance(value, list):
        inner = f"{ws()},{ws()}".join(_spaced(v, rng, most) for v in value)
        return "[" + ws() + inner + ws() + "]"
    return json.dumps(value)


def test_lenient_reports_survive_the_rewrite(backends):
    """A keyword llguidance ignores inside a rewritten object is still reported."""
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "format": "no-such-format"}, "b": {"type": "integer"}}}
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
    result = compile_spec(spec, backends)
    assert result.backend == LLGUIDANCE
    assert "properties.a.format" in result.unenforced


def test_the_service_checks_the_embeds_as_llguidance_checks_the_whole_lark():
    """The grammar service checks the JSON schemas an any-order Lark embeds, not the Lark
    (backends._llg_grammar): over every schema of the JSON Schema Test Suite, in each
    whitespace mode, the two checks agree on whether the grammar builds and on its
    warnings, which are what a lenient compile reports."""
    import llguidance

    from bench.conformance import load_cases
    from grammar_service.backends import _llg_grammar

    check = llguidance.LLMatcher.validate_grammar_with_warnings
    schemas = {json.dumps(c.schema, sort_keys=True) for c in load_cases()}
    for value in ({"type": "string", "format": "no-such-format"},  # ignored: a warning
                  {"type": "string", "pattern": "(?=x)y"},  # refused even leniently
                  {"allOf": [{"type": "string"}, {"type": "integer"}]}):  # nothing matches
        schemas.add(json.dumps({"type": "object", "properties": {"a": value, "b": {}},
                                "required": ["a"]}))
    compared = failed = warned = 0
    for text in sorted(schemas):
        for whitespace in (common_pb2.WHITESPACE_BOUNDED, common_pb2.WHITESPACE_COMPACT):
            try:
                spec = parse_spec(common_pb2.GrammarSpec(
                    json_schema=text, options=Opts(whitespace=whitespace)))
                grammar, _, embeds = _llg_grammar(spec, lenient=True)
            except (InvalidArgument, BackendError):  # the schema false, other documents
                continue
            if embeds in (None, grammar):  # not the rewrite's, or nothing embedded
                continue
            whole, parts = check(grammar), check(embeds)
            assert whole[0] == parts[0], (text, whole, parts)
            if not whole[0]:
                assert sorted(whole[1]) == sorted(parts[1]), (text, whole, parts)
            compared, failed, warned = compared + 1, failed + whole[0], warned + bool(whole[1])
    assert compared > 150 and failed >= 2 and warned >= 1, (compared, failed, warned)


def test_names_lark_cannot_spell_raw(backends, encode):
    """Names are the one thing of the user's the rewrite writes itself: a DEL (Lark's
    strings refuse it raw) is escaped; a lone surrogate (no UTF-8 spells it) leaves the
    schema to llguidance's own compile."""
    for name in ("a\x7fb", 'q"u\\x', "c\x01\u2028é/", "a b#~&-(x)[y]{z}|^$.*+?\t%@"):
        schema = {"type": "object", "properties": {name: {"enum": ["v\x7f"]}, "n": {}},
                  "required": [name]}
        assert any_order_grammar(schema, {}, None) is not None, name
        g = compiled(backends, schema)
        body = json.dumps(name, ensure_ascii=False)
        assert accepts(g, encode, '{"n":1,' + body + ':"v\x7f"}'), name
        assert not accepts(g, encode, '{"n":1,' + body + ':"v"}'), name
    lone = {"type": "object", "properties": {"\ud800": {}, "n": {}}}
    assert any_order_grammar(lone, {}, None) is None


def test_what_the_rewrite_leaves_alone():
    ws = whitespace_regex("bounded", 4)
    opts = {"whitespace_flexible": True}
    # nothing to order
    assert any_order_grammar({"type": "string"}, opts, ws) is None
    assert any_order_grammar({"type": "object", "properties": {"a": {}},
                              "additionalProperties": False}, opts, ws) is None
    # objects with constraints beyond the rewrite's stay llguidance's (fixed order)
    for extra in ({"minProperties": 2}, {"patternProperties": {"^x": {}}},
                  {"allOf": [{"required": ["a"], "minProperties": 1}]}):
        schema = {"type": "object", "properties": {"a": {}, "b": {}}, **extra}
        assert any_order_grammar(schema, opts, ws) is None, extra
    # references the rewrite does not resolve
    remote = {"type": "object", "properties": {"a": {"$ref": "other.json#/x"}, "b": {}}}
    assert any_order_grammar(remote, opts, ws) is None
    nested_id = {"type": "object", "properties": {"a": {"$id": "x", "type": "string"},
                                                  "b": {"$ref": "#/properties/a"}}}
    assert any_order_grammar(nested_id, opts, ws) is None
    # without a reference an `$id` resolves nothing (generators put one on every node)
    del nested_id["properties"]["b"]["$ref"]
    assert any_order_grammar(nested_id, opts, ws) is not None
    # an object under an allOf with more than object keywords is embedded; the one beside
    # it is rewritten
    mixed = {"type": "object", "properties": {
        "a": {"allOf": [{"type": "object", "properties": {"x": {}, "y": {}},
                         "maxProperties": 1}, {"required": ["x"]}]}, "b": {}}}
    text = any_order_grammar(mixed, opts, ws)
    assert text is not None and '"allOf"' in text


# ------------------------------------------------------------------ random differential

def _random_schema(rng: random.Random, depth: int, defs: dict, unions: bool = False) -> dict:
    if unions and depth > 0 and rng.random() < 0.3:
        return _random_union(rng, depth, defs)
    roll = rng.random()
    if depth <= 0 or roll < 0.35:
        return rng.choice([
            {"type": "string"}, {"type": "integer"}, {"type": "boolean"},
            {"type": "string", "maxLength": 3}, {"enum": ["x", "y", 1]},
            {"type": "number", "minimum": 0}, {"type": "null"}])
    if roll < 0.5:
        return {"type": "array", "items": _random_schema(rng, depth - 1, defs, unions),
                **({"maxItems": 2} if rng.random() < 0.3 else {})}
    if roll < 0.58 and defs:
        return {"$ref": f"#/$defs/{rng.choice(sorted(defs))}"}
    if roll < 0.66:
        return {"anyOf": [_random_schema(rng, depth - 1, defs, unions) for _ in range(2)]}
    names = rng.sample(["a", "b", "c", "d", "e", "f"], rng.randint(1, 4))
    node = {"type": rng.choice(["object"] * 6 + [["object", "null"], None]),
            "properties": {n: _random_schema(rng, depth - 1, defs, unions) for n in names}}
    if node["type"] is None:  # any type; objects as listed
        del node["type"]
    if rng.random() < 0.7:
        node["required"] = rng.sample(names, rng.randint(0, len(names)))
    if rng.random() < 0.15:
        node["properties"]["g"] = False  # never allowed
    extra = rng.choice([None, False, True, {"type": "integer"}])
    if extra is not None:
        node["additionalProperties"] = extra
    if rng.random() < 0.15:
        # Not rewritten: llguidance's own object (order fixed), beside rewritten ones. Every
        # property required and no other names, so that a document changed by _mutations
        # keeps the schema's order wherever it is still valid.
        node.update(patternProperties={"^z": {"type": "integer"}}, required=names,
                    additionalProperties=False)
    return node


def _random_defs(rng: random.Random, unions: bool = False) -> dict:
    """Two definitions, p and q (q may refer to p)."""
    defs: dict = {}
    for name in ("p", "q"):
        defs[name] = _random_schema(rng, 2, defs, unions)
    return defs


def _random_union(rng: random.Random, depth: int, defs: dict) -> dict:
    """What the rewrite reaches beyond objects, arrays, $ref and anyOf: a oneOf whose
    branches exclude each other (by type, or by a required name's constant), a `type` beside
    a union or a $ref that the branches or the target imply, a type list with "array"."""
    def obj():
        node = _random_schema(rng, depth - 1, defs, True)
        return node if node.get("type") == "object" and "properties" in node else {
            "type": "object", "properties": {"a": node, "b": {"type": "integer"}}}
    roll = rng.random()
    if roll < 0.25:
        return {"oneOf": [obj(), rng.choice([{"type": "string"}, {"type": "array", "items":
                                              _random_schema(rng, depth - 1, defs, True)}])]}
    if roll < 0.5:
        branches = []
        for tag in rng.sample(["p", "q", "r"], 2):
            node = obj()
            node = {**node, "properties": {**node["properties"], "kind": {"const": tag}},
                    "required": [*node.get("required", []), "kind"]}
            branches.append(node)
        return {"oneOf": branches}
    if roll < 0.65:
        return {"type": "object", "anyOf": [obj(), obj()]}
    if roll < 0.8 and any(d.get("type") == "object" for d in defs.values()):
        name = rng.choice(sorted(n for n, d in defs.items() if d.get("type") == "object"))
        return {"$ref": f"#/$defs/{name}", "type": rng.choice(["object", ["object", "null"]])}
    node = {"type": ["array", "null"], "items": _random_schema(rng, depth - 1, defs, True)}
    if rng.random() < 0.3:
        del node["type"]  # any value; arrays of the items
    return node


SCALARS = [{"type": "string"}, {"type": "string", "maxLength": 3}, {"enum": ["x", "y", 1]},
           {"type": "number", "minimum": 0}, {"type": "integer"}, {"type": "boolean"},
           {"type": "null"}, {}, {"anyOf": [{"type": "integer"}, {"type": "null"}]}]


def _random_all_of(rng: random.Random, depth: int, defs: dict) -> dict:
    """An allOf of object schemas: branches listing overlapping names (under scalar schemas
    that may contradict each other: such a name is never allowed), with and without `type`,
    each kind of additionalProperties, references to object definitions, a nested allOf,
    and keywords on the node itself. A name only one branch lists may hold anything."""
    shared = {"a", "b"}

    def branch():
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
        node = {"properties": {
            n: rng.choice(SCALARS) if n in shared else
            _random_all_of(rng, depth - 1, defs) if depth > 1 and rng.random() < 0.2 else
            _random_schema(rng, depth - 1, defs) for n in names}}
        shared.update(names)  # c and d: a second branch gives them scalars too
        if rng.random() < 0.5:
            node["type"] = rng.choice(["object", "object", ["object", "null"]])
        if rng.random() < 0.6:
            node["required"] = rng.sample(names, rng.randint(0, len(names)))
        extra = rng.choice([None, None, False, True, {"type": "integer"}])
        if extra is not None:
            node["additionalProperties"] = extra
        if rng.random() < 0.15:  # an object without that name
            node["not"] = {"required": [rng.choice(["a", "b", "c", "d"])]}
        return node
    parts = [branch() for _ in range(rng.randint(1, 3))]
    objects = sorted(n for n, d in defs.items() if d.get("type") == "object"
                     and "patternProperties" not in d
                     and not d.get("properties", {}).keys() & shared)
    if objects and rng.random() < 0.4:
        ref = {"$ref": f"#/$defs/{rng.choice(objects)}"}
        if rng.random() < 0.5:  # beside object keywords: both apply
            ref = {**branch(), **ref}
        parts.insert(rng.randint(0, len(parts)), ref)
    if rng.random() < 0.2:
        parts.append({"allOf": [branch(), branch()]})
    node = {"allOf": parts}
    if rng.random() < 0.4:
        node["type"] = "object"
    if rng.random() < 0.3:
        node.update(properties={"e": {"type": "string"}}, required=["e"])
    return node


OBJECT_WORDS = {"properties", "required", "additionalProperties"}


def _instance(rng: random.Random, schema, root: dict, fixed: bool = False):
    """A document valid for `schema` most of the time (keys shuffled, except in and under
    objects llguidance compiles itself, whose order is fixed)."""
    if "$ref" in schema:
        target = root["$defs"][schema["$ref"].rsplit("/", 1)[1]]
        if not schema.keys() & OBJECT_WORDS:
            return _instance(rng, target, root, fixed)
        schema = {"allOf": [target, {k: v for k, v in schema.items() if k != "$ref"}]}
    if "allOf" in schema:  # each branch's object, merged (keys shuffled)
        parts = [{k: v for k, v in schema.items() if k != "allOf"}, *schema["allOf"]]
        doc = {}
        for part in parts:
            value = _instance(rng, {"type": "object", **part} if part.keys() <= {"type"}
                              else part, root, fixed)
            if isinstance(value, dict):
                doc.update(value)
        items = list(doc.items())
        rng.shuffle(items)
        return dict(items)
    for word in ("anyOf", "oneOf"):
        if word in schema:
            branch = rng.choice(schema[word])
            own = {k: v for k, v in schema.items() if k != word}
            if own.keys() & OBJECT_WORDS:
                return _instance(rng, {"allOf": [branch, own]}, root, fixed)
            return _instance(rng, branch, root, fixed)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type", "array" if "items" in schema else "object")
    if kind == ["object", "null"]:
        kind = rng.choice(["object", "object", "null"])
    if kind == ["array", "null"]:
        kind = rng.choice(["array", "array", "null"])
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "object":
        required = set(schema.get("required", []))
        fixed = fixed or "patternProperties" in schema
        doc = {n: _instance(rng, s, root, fixed) for n, s in schema.get("properties", {}).items()
               if s is not False and (n in required or rng.random() < 0.6)}
        extra = schema.get("additionalProperties", True)
        if extra is not False and rng.random() < 0.3:
            doc["zz"] = _instance(rng, extra, root, fixed) if isinstance(extra, dict) else 7
        items = list(doc.items())
        if not fixed:
            rng.shuffle(items)
        return dict(items)
    if kind == "array":
        return [_instance(rng, schema["items"], root, fixed)
                for _ in range(rng.randint(0, schema.get("maxItems", 3)))]
    return {"string": "s", "integer": 3, "boolean": True, "number": 1.5, "null": None}[kind]


def test_references_from_embedded_nodes_travel_with_them(backends, encode):
    """A node the rewrite embeds may refer to the root, or to any node: the targets go
    along with it. A typeless node listing properties is an object or any other value."""
    tree = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "alias": {"allOf": [{"$ref": "#/properties/name"}]},
        "children": {"allOf": [{"type": "array", "items": {"$ref": "#"}}]},
        "meta": {"properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}
    assert any_order_grammar(tree, {}, None) is not None
    g = compiled(backends, tree)
    for text, ok in [
        # inside the embedded allOf, llguidance's own objects: the schema's order
        ('{"children":[{"name":"b","children":[]}],"name":"a"}', True),
        ('{"name":"a","children":[{"children":[{"name":"c","alias":"d"}]}]}', False),
        ('{"alias":"x","name":"a"}', True),
        ('{"alias":1,"name":"a"}', False),
        ('{"meta":{"y":1,"x":2},"name":"a"}', True),
        ('{"meta":[1,"s"],"name":"a"}', True),
        ('{"meta":{"y":"s"},"name":"a"}', False),
    ]:
        assert accepts(g, encode, text) is ok, text
        assert jsonschema.Draft202012Validator(tree).is_valid(json.loads(text)) is ok, text


def _mutations(rng: random.Random, doc):
    """Documents near `doc`: a key dropped, a value replaced, a key added."""
    paths = []

    def walk(node, path):
        if isinstance(node, dict):
            paths.append(path)
            for k, v in node.items():
                walk(v, path + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, path + [i])
    walk(doc, [])
    for _ in range(3):
        if not paths:
            return
        mutated = copy.deepcopy(doc)
        target = mutated
        for p in rng.choice(paths):
            target = target[p]
        choice = rng.random()
        if choice < 0.4 and target:
            target.pop(rng.choice(list(target)))
        elif choice < 0.7 and target:
            target[rng.choice(list(target))] = rng.choice(["s", 3, None, [1], {"q": 1}])
        else:
            target[rng.choice("abcdefgz")] = rng.choice(["s", 3, None])
        yield mutated


def _judge_like_jsonschema(g, encode, rng, schema, spaces: int = 0) -> tuple[int, int]:
    """Four random documents of `schema` and their mutations: the grammar `g` accepts each
    exactly when jsonschema (2020-12) says it is valid (with `spaces`, half of them with
    whitespace within that bound at every place). Returns (documents, valid ones)."""
    validator = jsonschema.Draft202012Validator(schema)
    checked = valid_seen = 0
    for _ in range(4):
        doc = _instance(rng, schema, schema)
        for candidate in [doc, *_mutations(rng, doc)]:
            text = json.dumps(candidate)
            valid = validator.is_valid(candidate)
            if spaces and rng.random() < 0.5:
                text = _spaced(candidate, rng, spaces)
            assert accepts(g, encode, text) == valid, (json.dumps(schema), text, valid)
            checked += 1
            valid_seen += valid
    return checked, valid_seen


def test_random_schemas_agree_with_jsonschema_in_any_order(backends, encode):
    rng = random.Random(20261205)
    checked = rewritten = valid_seen = 0
    for _ in range(80):
        defs = _random_defs(rng)
        schema = {**_random_schema(rng, 3, defs), "$defs": defs}
        schema["type"] = "object"
        schema.setdefault("properties", {"a": {"type": "integer"}, "b": {"type": "string"}})
        for key in ("anyOf", "$ref", "enum", "items", "maxItems", "patternProperties"):
            schema.pop(key, None)
        opts = {"whitespace_flexible": True}
        if any_order_grammar(schema, opts, whitespace_regex("bounded", 4)) is not None:
            rewritten += 1
        n, v = _judge_like_jsonschema(compiled(backends, schema), encode, rng, schema, 4)
        checked, valid_seen = checked + n, valid_seen + v
    assert rewritten >= 60 and checked >= 700 and 0.3 < valid_seen / checked < 0.9


def test_unions_and_typed_nodes_agree_with_jsonschema_in_any_order(backends, encode):
    """oneOf with branches apart, typed unions and references, arrays-or-null, at random."""
    rng = random.Random(20261206)
    checked = rewritten = valid_seen = 0
    for _ in range(50):
        defs = _random_defs(rng, unions=True)
        schema = {"type": "object", "$defs": defs, "properties": {
            "a": _random_union(rng, 3, defs), "b": _random_schema(rng, 2, defs, unions=True),
            "c": {"type": "string"}}}
        if any_order_grammar(schema, {}, None) is not None:
            rewritten += 1
        n, v = _judge_like_jsonschema(compiled(backends, schema), encode, rng, schema)
        checked, valid_seen = checked + n, valid_seen + v
    assert rewritten >= 45 and checked >= 500 and 0.3 < valid_seen / checked < 0.9


def test_all_of_objects_agree_with_jsonschema_in_any_order(backends, encode):
    """allOf of object schemas (merged into one object) at random."""
    rng = random.Random(20261207)
    checked = rewritten = valid_seen = unsatisfiable = 0
    for _ in range(50):
        defs = _random_defs(rng)
        schema = {"type": "object", "$defs": defs, "properties": {
            "a": _random_all_of(rng, 3, defs), "b": _random_schema(rng, 2, defs),
            "c": {"type": "string"},
            # a map of objects, and a union beside object keywords
            "m": {"type": "object", "additionalProperties": _random_all_of(rng, 2, defs)},
            "u": {"required": ["k"], "properties": {"k": {"type": "integer"}},
                  "anyOf": [_random_all_of(rng, 2, defs), _random_schema(rng, 2, defs)]}}}
        if rng.random() < 0.3:
            schema = {"$defs": defs, **_random_all_of(rng, 3, defs)}
        if any_order_grammar(schema, {}, None) is not None:
            rewritten += 1
        try:
            g = compiled(backends, schema)
        except BackendError as exc:  # a required name no value satisfies: nothing is valid
            assert "Unsatisfiable" in str(exc), exc
            unsatisfiable += 1
            validator = jsonschema.Draft202012Validator(schema)
            assert not any(validator.is_valid(_instance(rng, schema, schema)) for _ in range(8))
            continue
        n, v = _judge_like_jsonschema(g, encode, rng, schema)
        checked, valid_seen = checked + n, valid_seen + v
    assert unsatisfiable < 15 and rewritten >= 35 and checked >= 500 \
        and 0.12 < valid_seen / checked < 0.9, (rewritten, checked, valid_seen)


def _rewritten(backends, encode, schema, cases, gone: str = "") -> None:
    """`schema` is rewritten (without `gone` in its grammar text: after the fix-ups, as
    the llguidance backend compiles it) and judged like jsonschema."""
    text = any_order_grammar(fix_schema_llguidance(schema), {}, None)
    assert text is not None and (not gone or gone not in text), text
    g = compiled(backends, schema)
    validator = jsonschema.Draft202012Validator(schema)
    for doc, ok in cases:
        assert validator.is_valid(json.loads(doc)) is ok, doc
        assert accepts(g, encode, doc) is ok, doc


ITEM = {"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
        "required": ["k", "v"]}


def test_a_oneof_whose_branches_exclude_each_other_is_their_union(backends, encode):
    by_type = {"oneOf": [ITEM, {"type": "array", "items": {"type": "integer"}}]}
    _rewritten(backends, encode, by_type, [
        ('{"v":1,"k":"a"}', True), ("[1,2]", True), ('{"v":1}', False), ('"s"', False)],
        gone='"oneOf"')
    by_constant = {"oneOf": [
        {"type": "object", "required": ["kind", "x"], "properties": {
            "kind": {"const": "a"}, "x": {"type": "integer"}, "y": {"type": "integer"}}},
        {"type": "object", "required": ["kind"], "properties": {
            "kind": {"$ref": "#/$defs/bc"}, "y": {"type": "string"}, "x": {}}}],
        "$defs": {"bc": {"enum": ["b", "c"]}}}
    _rewritten(backends, encode, by_constant, [
        ('{"x":1,"kind":"a"}', True), ('{"y":"s","kind":"c"}', True),
        ('{"y":1,"x":2,"kind":"a"}', True), ('{"y":1,"kind":"b"}', False),
        ('{"kind":"d"}', False), ('{"x":1}', False)], gone='"oneOf"')


def test_all_of_objects_are_one_object(backends, encode):
    base = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
            "required": ["id"]}
    extended = {"$defs": {"base": base}, "type": "object", "allOf": [
        {"$ref": "#/$defs/base"},
        {"properties": {"tags": {"type": "array", "items": {"type": "string"}},
                        "name": {"maxLength": 2}}, "required": ["tags"]}]}
    _rewritten(backends, encode, extended, [
        ('{"tags":[],"id":1}', True), ('{"name":"ab","tags":["x"],"id":2,"more":null}', True),
        ('{"tags":[]}', False), ('{"id":1}', False), ('{"id":1,"tags":[],"name":"abc"}', False),
        ('{"id":1,"tags":[],"name":3}', False)], gone='"allOf"')
    # additionalProperties is each branch's own: it forbids what the other branches list
    closed = {"allOf": [{"properties": {"a": {}, "c": {}}, "additionalProperties": False},
                        {"properties": {"b": {}, "c": {"type": "integer"}}}]}
    _rewritten(backends, encode, closed, [
        ('{"c":1,"a":1}', True), ('{"b":1}', False), ('{"a":1,"b":2}', False),
        ('{"c":"s"}', False), ('"text"', True), ("[1]", True)], gone='"allOf"')
    # a name whose values the branches' types keep apart is never allowed; untyped, any
    # other value matches
    apart = {"allOf": [{"properties": {"n": {"type": "string"}, "k": {}}},
                       {"properties": {"n": {"type": "integer"}, "j": {}}}]}
    _rewritten(backends, encode, apart, [
        ('{"j":1,"k":1}', True), ('{"n":"s"}', False), ('{"k":2,"n":1}', False),
        ("3", True), ("null", True)], gone='"allOf"')


def test_references_unions_and_maps_beside_object_keywords(backends, encode):
    schema = {"$defs": {"base": {"type": "object", "properties": {"id": {"type": "integer"}},
                                 "required": ["id"]},
                        "a": {"type": "object", "properties": {"kind": {"const": "a"},
                                                               "x": {"type": "integer"}},
                              "required": ["kind"]},
                        "b": {"type": "object", "properties": {"kind": {"const": "b"}},
                              "required": ["kind"]}},
              "type": "object", "properties": {
        # a $ref beside properties: both apply (as llguidance compiles it in every draft)
        "r": {"$ref": "#/$defs/base", "properties": {"name": {"type": "string"}},
              "required": ["name"]},
        # object keywords beside a oneOf hold in each branch; a string branch cannot match
        "u": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}},
              "oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}, {"type": "string"}]},
        # a map of objects
        "m": {"type": "object", "additionalProperties": {"$ref": "#/$defs/a"}}}}
    _rewritten(backends, encode, schema, [
        ('{"r":{"name":"s","id":1}}', True), ('{"r":{"id":1}}', False),
        ('{"r":{"name":1,"id":1}}', False),
        ('{"u":{"n":1,"kind":"a","x":2}}', True), ('{"u":{"kind":"b","n":2}}', True),
        ('{"u":{"kind":"a"}}', False), ('{"u":"s"}', False), ('{"u":{"kind":"c","n":1}}', False),
        ('{"m":{"k\\u00e9":{"x":1,"kind":"a"},"j":{"kind":"a"}}}', True),
        ('{"m":{"k":{"kind":"b"}}}', False), ('{"m":{}}', True)], gone='"$ref"')


def test_an_optional_property_nothing_matches_is_never_allowed(backends, encode):
    """Its value requires a name no value matches: llguidance's own compile leaves such a
    property out, an embedded node would be an error (and the schema's order fixed)."""
    never = {"allOf": [{"type": "string"}, {"type": "integer"}]}
    schema = {"type": "object", "properties": {"a": {}, "b": {}, "bad": {
        "type": "object", "required": ["x"], "properties": {"x": never, "y": {}}}}}
    _rewritten(backends, encode, schema, [
        ('{"b":1,"a":2}', True), ('{"bad":{"x":1}}', False), ('{"bad":{"y":1}}', False)])


def test_a_name_never_there_and_an_all_of_beside_a_union(backends, encode):
    """`not: {required: [name]}` is an object without the name (and no non-object: the
    llguidance fix-up, grammar_service.schema_fixes); an allOf beside an anyOf holds in
    each branch."""
    content = {"properties": {"name": {"type": "string"}, "args": {"type": "string"}}}
    profile = {"type": "object", "required": ["name"], "allOf": [{"$ref": "#/$defs/content"}],
               "anyOf": [{"properties": {"exe": {"type": "string"}}, "not": {"required": ["cmd"]}},
                         {"properties": {"cmd": {"type": "string"}}, "not": {"required": ["exe"]}}]}
    schema = {"$defs": {"content": content}, "type": "array", "items": profile}
    _rewritten(backends, encode, schema, [
        ('[{"args":"a","name":"n","exe":"e"}]', True), ('[{"cmd":"c","name":"n"}]', True),
        ('[{"name":"n"}]', True), ('[{"cmd":"c","exe":"e","name":"n"}]', False),
        ('[{"args":"a"}]', False), ('[{"name":"n","exe":1}]', False)], gone='"anyOf"')
    never = {"properties": {"x": {"not": {"required": ["a"]}, "properties": {"b": {}, "c": {}}}}}
    _rewritten(backends, encode, never, [
        ('{"x":{"c":1,"b":2}}', True), ('{"x":{"a":1}}', False), ('{"x":"s"}', False),
        ('{"x":{}}', True)], gone='"not"')


def _agrees(g, encode, validator, text: str, context) -> bool:
    """Asserts the grammar `g` accepts the document `text` exactly when `validator` says
    it is valid; returns that validity."""
    valid = validator.is_valid(json.loads(text))
    assert accepts(g, encode, text) == valid, (context, text, valid)
    return valid


def test_counts_and_dependencies_on_the_rules_bits(backends, encode):
    """minProperties / maxProperties where every name present is listed (each has a bit),
    and names that require others (dependencies, dependentRequired), in any order: random
    objects and every subset of their names in a random order, judged like jsonschema."""
    rng = random.Random(20261208)
    checked = valid_seen = 0
    for _ in range(24):
        names = rng.sample(["a", "b", "c", "d", "e"], rng.randint(2, 5))
        node = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
                "additionalProperties": False}
        if rng.random() < 0.5:
            node["required"] = rng.sample(names, rng.randint(0, 1))
        low = rng.randint(0, len(names))
        if rng.random() < 0.7:
            node["minProperties"] = low
        if rng.random() < 0.7:
            node["maxProperties"] = rng.randint(max(low, 1), len(names))
        if rng.random() < 0.7:  # (the other keyword is none in the schema's draft)
            key, *others = rng.sample(names, rng.randint(2, len(names)))
            node[rng.choice(["dependencies", "dependentRequired"])] = {key: others[:2]}
        schema = {"type": "object", "properties": {"x": node, "y": {"type": "string"}}}
        if rng.random() < 0.5:
            schema["$schema"] = "http://json-schema.org/draft-07/schema#"
        text = any_order_grammar(schema, {}, None)
        assert text is not None and "%json {\"type\":\"object\"" not in text, (node, text)
        g = compiled(backends, schema)
        validator = jsonschema.validators.validator_for(
            schema, default=jsonschema.Draft202012Validator)(schema)
        for size in range(len(names) + 1):
            for _ in range(3):
                keys = rng.sample(names, size)
                doc = {"x": {k: 1 for k in keys}, **({"y": "s"} if rng.random() < 0.5 else {})}
                checked += 1
                valid_seen += _agrees(g, encode, validator, json.dumps(doc), node)
    assert checked > 250 and 0.2 < valid_seen / checked < 0.8, (checked, valid_seen)


def test_objects_past_64_names(backends, encode):
    """Past 64 listed names the required ones and those a dependency speaks of keep a bit,
    then the others in order until the bits run out; the rest may come in any order and
    more than once (each time under its schema). Random objects of 70-90 names, documents
    of random subsets in random order with a wrong value or a missing name now and then,
    judged like jsonschema."""
    rng = random.Random(20261209)
    checked = valid_seen = 0
    for _ in range(6):
        names = [f"p{i}" for i in range(rng.randint(70, 90))]
        node = {"type": "object", "properties": {
            n: {"type": rng.choice(["integer", "string"])} for n in names}}
        node["required"] = rng.sample(names, rng.randint(0, 3))
        extra = rng.choice([False, True, {"type": "integer"}])
        if extra is not True:
            node["additionalProperties"] = extra
        key, *others = rng.sample(names[40:], 3)
        node["dependentRequired"] = {key: others}
        schema = {"type": "object", "properties": {"x": node}}
        text = any_order_grammar(schema, {}, None)
        assert text is not None and "%json {\"type\":\"object\"" not in text, node
        g = compiled(backends, schema)
        validator = jsonschema.Draft202012Validator(schema)
        values = {"integer": 1, "string": "s"}
        for _ in range(24):
            keys = rng.sample(names, rng.randint(0, 12)) + node["required"] * (rng.random() < .7)
            keys += [key] * (rng.random() < 0.3) + others * (rng.random() < 0.5)
            body = {k: values[node["properties"][k]["type"]] for k in dict.fromkeys(keys)}
            if body and rng.random() < 0.2:  # a wrong value
                wrong = rng.choice(list(body))
                body[wrong] = {"s": 1, 1: "s"}[body[wrong]]
            if rng.random() < 0.2:
                body["unlisted"] = 2
            items = list(body.items())
            rng.shuffle(items)
            checked += 1
            valid_seen += _agrees(g, encode, validator, json.dumps({"x": dict(items)}), node)
    assert checked > 100 and 0.2 < valid_seen / checked < 0.8, (checked, valid_seen)
    # the names past the bits may repeat; a name with a bit may not
    node = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(70)}}
    g = compiled(backends, node)
    assert accepts(g, encode, '{"p69": 1, "p0": 2, "p69": 3}')
    assert not accepts(g, encode, '{"p69": 1, "p69": "s"}')
    assert not accepts(g, encode, '{"p0": 1, "p69": 1, "p0": 3}')
    # counts past the bits cannot be stated: the schema's own order then
    assert any_order_grammar({**node, "minProperties": 2}, {}, None) is None


def _agree_on_subsets(backends, encode, schema, node, rng, pool, with_y=False):
    """Documents {"x": {name: 1, ...}} of up to four names of `pool` (and, with `with_y`,
    sometimes "y"), each judged by `schema` compiled and by jsonschema (`_agrees`): (how
    many, how many valid)."""
    g = compiled(backends, schema)
    validator = jsonschema.validators.validator_for(schema)(schema)
    checked = valid_seen = 0
    for size in range(5):
        for _ in range(3):
            doc = {"x": dict.fromkeys(rng.sample(pool, size), 1)}
            if with_y and rng.random() < 0.5:
                doc["y"] = "s"
            checked += 1
            valid_seen += _agrees(g, encode, validator, json.dumps(doc), node)
    return checked, valid_seen


def test_dependencies_on_names_not_listed(backends, encode):
    """Names that require others, or are required, without a `properties` entry (unlisted
    names, with additionalProperties' values, or an untyped node with the keyword alone):
    each takes a bit, so the closing brace checks them, in any order; random schemas and
    documents of listed and unlisted names, judged like jsonschema."""
    rng = random.Random(20261207)
    checked = valid_seen = 0
    for _ in range(24):
        listed = rng.sample(["a", "b"], rng.randint(0, 2))
        node = {"properties": {n: {"type": "integer"} for n in listed}} if listed else {}
        if listed or rng.random() < 0.5:
            node["type"] = "object"
        if rng.random() < 0.5:
            node["additionalProperties"] = rng.choice([{"type": "integer"}, True])
        key, *needed = rng.sample(["a", "b", "u", "v", "w"], rng.randint(2, 3))
        draft7 = rng.random() < 0.5
        node["dependencies" if draft7 else "dependentRequired"] = {key: needed}
        schema = {"type": "object", "properties": {"x": node, "y": {"type": "string"}}}
        if draft7:
            schema["$schema"] = "http://json-schema.org/draft-07/schema#"
        text = any_order_grammar(schema, {}, None)
        assert text is not None and "%json {\"dependen" not in text, (node, text)
        n, valid = _agree_on_subsets(backends, encode, schema, node, rng,
                                     ["a", "b", "u", "v", "w", "z"], with_y=True)
        checked += n
        valid_seen += valid
    assert checked > 300 and 0.2 < valid_seen / checked < 0.8, (checked, valid_seen)


EXCLUDING = [  # dependency schemas that say names are absent, as schemas write them
    lambda names: {"not": {"required": names[:1]}},
    lambda names: {"not": {"anyOf": [{"required": [n]} for n in names]}},
    lambda names: {"allOf": [{"not": {"required": [n]}} for n in names]},
    lambda names: {"properties": dict.fromkeys(names, False)},
]


def test_dependencies_that_exclude_names(backends, encode):
    """A dependency whose schema says names are absent (mutually exclusive properties:
    draft 7's `dependencies`, `dependentSchemas` after it), beside name lists, listed names
    and unlisted ones: stated on the rule's bits, nothing reported, in any order; random
    schemas and documents judged like jsonschema."""
    rng = random.Random(20261209)
    checked = valid_seen = 0
    for _ in range(24):
        listed = rng.sample(["a", "b", "c", "d"], rng.randint(2, 4))
        node = {"type": "object", "properties": {n: {"type": "integer"} for n in listed}}
        if rng.random() < 0.4:
            node["additionalProperties"] = rng.choice([False, {"type": "integer"}])
        draft7 = rng.random() < 0.5
        deps = {}
        for key in rng.sample(["a", "b", "c", "u"], 2):
            others = rng.sample([n for n in ["a", "b", "c", "d", "u", "v"] if n != key], 2)
            deps[key] = rng.choice(EXCLUDING)(others)
        if draft7 and rng.random() < 0.5:
            deps["d"] = ["a"]
        node["dependencies" if draft7 else "dependentSchemas"] = deps
        schema = {"type": "object", "properties": {"x": node, "y": {"type": "string"}}}
        if draft7:
            schema["$schema"] = "http://json-schema.org/draft-07/schema#"
        spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
        compiled_spec = compile_spec(spec, backends)
        assert compiled_spec.unenforced == (), (node, compiled_spec.unenforced)
        n, valid = _agree_on_subsets(backends, encode, schema, node, rng,
                                     ["a", "b", "c", "d", "u", "v"])
        checked += n
        valid_seen += valid
    assert checked > 300 and 0.2 < valid_seen / checked < 0.8, (checked, valid_seen)


@pytest.mark.parametrize("names", [
    {"pattern": "^[a-z][a-z0-9_]*$"}, {"minLength": 2, "maxLength": 3},
    {"type": "string", "enum": ["ab", "c", "d\"e"]}, {"pattern": "^x-", "maxLength": 4},
])
def test_property_names_of_a_map(backends, encode, names):
    """`propertyNames` of string keywords on a map (no listed name): the keys are strings
    that schema allows, enforced (nothing reported), judged like jsonschema; an untyped
    node too. A `propertyNames` that says only that names are strings is no keyword."""
    keys = ["ab", "c", "d\"e", "x-1", "x-long", "A1", "a_1", "abc", "9z", "é"]
    for node in ({"type": "object", "propertyNames": names,
                  "additionalProperties": {"type": "integer"}}, {"propertyNames": names}):
        schema = {"type": "object", "properties": {"m": node}}
        spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
        result = compile_spec(spec, backends)
        assert result.backend == LLGUIDANCE and result.unenforced == (), (node, result.reason)
        g = compiled(backends, schema, common_pb2.GRAMMAR_BACKEND_AUTO)
        validator = jsonschema.Draft202012Validator(schema)
        valid_seen = 0
        for key in keys:
            for other in ("ab", "x-1"):
                doc = {"m": {key: 1, other: 2}}
                valid_seen += _agrees(g, encode, validator, json.dumps(doc), node)
        assert 0 < valid_seen < 2 * len(keys), (node, valid_seen)


def test_property_names_that_say_names_are_strings_are_no_keyword(backends):
    schema = {"type": "object", "properties": {"env": {
        "type": "object", "propertyNames": {"type": "string"},
        "additionalProperties": {"type": "string"}}}}
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
    result = compile_spec(spec, backends)
    # (not handed to xgrammar, which fixes the order, for a keyword that says nothing)
    assert result.backend == LLGUIDANCE and result.unenforced == (), result.reason


def test_not_empty_and_at_most_one_where_unlisted_names_may_come(backends, encode):
    """minProperties 1 and maxProperties 1 beside unlisted names (which have no bit): the
    rule's shape states them (no empty object; no comma), listed and unlisted names alike,
    in any order: random objects and documents of listed and unlisted names, judged like
    jsonschema."""
    rng = random.Random(20261206)
    checked = valid_seen = 0
    for _ in range(24):
        names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 4))
        node = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
        if rng.random() < 0.5:
            node["additionalProperties"] = rng.choice([{"type": "integer"}, {"type": "string"},
                                                       True])
        if rng.random() < 0.3:
            node["required"] = rng.sample(names, 1)
        low, high = rng.choice([(1, None), (0, 1), (1, 1), (1, 1)])
        if low:
            node["minProperties"] = low
        if high is not None:
            node["maxProperties"] = high
        schema = {"type": "object", "properties": {"x": node, "y": {"type": "string"}}}
        text = any_order_grammar(schema, {}, None)
        assert text is not None and '%json {"type":"object","properties"' not in text, \
            (node, text)
        g = compiled(backends, schema)
        validator = jsonschema.Draft202012Validator(schema)
        pool = names + ["u", "v"]
        for size in range(4):
            for _ in range(3):
                keys = rng.sample(pool, size)
                doc = {"x": {k: 1 if k in names or rng.random() < 0.5 else "s" for k in keys}}
                if rng.random() < 0.5:
                    doc["y"] = "s"
                checked += 1
                valid_seen += _agrees(g, encode, validator, json.dumps(doc), node)
    assert checked > 250 and 0.2 < valid_seen / checked < 0.8, (checked, valid_seen)


def test_pattern_properties_in_any_order(backends, encode):
    """Names a pattern matches take the pattern's schema, listed names theirs, in any order,
    where nothing else takes them (`additionalProperties: false`, no listed name matched,
    patterns apart by their literal prefixes): random objects and documents of listed
    names, names each pattern matches and names none does, judged like jsonschema."""
    rng = random.Random(20261209)
    values = [{"type": "integer"}, {"type": "string"}, {"enum": ["p", "q"]},
              {"type": "object", "properties": {"k": {"type": "integer"}, "l": {}},
               "required": ["k"]}]
    checked = valid_seen = 0
    for _ in range(20):
        names = rng.sample(["a", "b", "c"], rng.randint(1, 3))
        node = {"type": "object", "properties": {n: rng.choice(values) for n in names},
                "additionalProperties": False}
        prefixes = rng.sample(["x-", "de_", "body"], rng.randint(1, 2))
        node["patternProperties"] = {
            # (the first three as Lark terminals, the last embedded with the pattern)
            f"^{p}" + rng.choice(["", "[a-z]+$", "[0-9]", "(?:a|7)"]): rng.choice(values + [True])
            for p in prefixes}
        if names and rng.random() < 0.4:
            node["required"] = rng.sample(names, 1)
        if rng.random() < 0.3:
            node["maxProperties" if rng.random() < 0.5 else "minProperties"] = 1
        schema = {"type": "object", "properties": {"x": node, "y": {"type": "string"}}}
        text = any_order_grammar(schema, {}, None)
        assert text is not None and '"patternProperties"' not in text, (node, text)
        g = compiled(backends, schema)
        validator = jsonschema.Draft202012Validator(schema)
        pool = names + [p + rng.choice(["a", "z", "7", "a7"]) for p in prefixes for _ in (0, 1)]
        samples = [1, 1, "p", "p", "s", {"k": 1}, {"l": 1}, None]
        for size in range(5):
            for _ in range(4):
                keys = rng.sample(pool, min(size, len(pool))) + (["zz"] if rng.random() < 0.1
                                                                    else [])
                doc = {"x": {k: _fitting(node, k) if rng.random() < 0.8 else rng.choice(samples)
                             for k in keys}}
                if rng.random() < 0.5:
                    doc["y"] = "s"
                text = json.dumps(doc)
                if '"x-' in text and rng.random() < 0.2:
                    # The same name with a \u escape: llguidance's JSON strings take \u only
                    # for what must be escaped (its own compile refuses it too): stricter.
                    escaped = text.replace('"x-', '"\\u0078-')
                    assert not accepts(g, encode, escaped), (node, escaped)
                checked += 1
                valid_seen += _agrees(g, encode, validator, text, node)
    assert checked > 300 and 0.15 < valid_seen / checked < 0.8, (checked, valid_seen)


def _fitting(node: dict, name: str):
    """A value for `name` in an object `node` of test_pattern_properties_in_any_order that
    its schema takes when the name is allowed."""
    sub = node["properties"].get(name)
    if sub is None:
        sub = next((v for k, v in node["patternProperties"].items()
                    if name.startswith(k[1:].split("[")[0])), True)
    return {"integer": 1, "string": "s", "object": {"k": 1}}.get(
        sub.get("type") if isinstance(sub, dict) else None,
        "p" if isinstance(sub, dict) and "enum" in sub else None)


def test_pattern_properties_the_rewrite_leaves_to_llguidance():
    """Where a name could take a pattern's schema and another's, the object stays
    llguidance's: unlisted names allowed beside patterns, a listed name a pattern matches,
    patterns not shown apart."""
    for extra in ({"patternProperties": {"^x": {}}},
                  {"patternProperties": {"^x": {}}, "additionalProperties": True},
                  {"patternProperties": {"^a": {}}, "additionalProperties": False},
                  {"patternProperties": {"^x": {}, "^xy": {}}, "additionalProperties": False},
                  {"patternProperties": {"x": {}, "^y": {}}, "additionalProperties": False}):
        schema = {"type": "object", "properties": {"x": {
            "type": "object", "properties": {"a": {}, "b": {}}, **extra},
            "y": {"type": "object", "properties": {"p": {}, "q": {}}}}}
        text = any_order_grammar(schema, {}, None)
        assert text is not None and '"patternProperties"' in text, (extra, text)


def test_counts_where_unlisted_names_may_come_stay_llguidances():
    for extra in ({"minProperties": 2}, {"maxProperties": 2, "additionalProperties": True},
                  {"maxProperties": 1, "required": ["a", "b"]},
                  {"dependentRequired": {"a": {"required": ["b"]}}}):
        schema = {"type": "object", "properties": {"x": {
            "type": "object", "properties": {"a": {}, "b": {}}, **extra},
            "y": {"type": "object", "properties": {"p": {}, "q": {}}}}}
        text = any_order_grammar(schema, {}, None)
        assert text is not None and '{"type":"object","properties":{"a"' in text, (extra, text)


def test_an_all_of_with_other_keywords_stays_llguidances():
    for branch in ({"minProperties": 1}, {"if": {"required": ["a"]}, "then": {}},
                   {"properties": {"a": {}}, "patternProperties": {"^x": {}}}):
        schema = {"type": "object", "allOf": [
            {"properties": {"a": {"type": "integer"}, "b": {}}, "required": ["a"]}, branch]}
        text = any_order_grammar({"type": "object", "properties": {
            "x": schema, "y": {"type": "object", "properties": {"p": {}, "q": {}}}}}, {}, None)
        assert text is not None and '"allOf":[{"properties":{"a"' in text, text


def test_a_oneof_apart_by_a_name_one_branch_requires(backends, encode):
    """One branch requires `mode` with its values, the other only restricts `mode` where it
    is there (or forbids it): no object matches both. The object keywords beside the oneOf
    hold in each branch."""
    shared = {"properties": {"name": {"type": "string"}, "every": {"type": "integer"}}}
    schema = {"type": "object", "required": ["name"], "oneOf": [
        {"allOf": [shared], "required": ["every"],
         "properties": {"mode": {"enum": ["Scheduled"]}}},
        {"allOf": [shared], "required": ["mode"],
         "properties": {"mode": {"enum": ["Continuous", "OnDemand"]}}}]}
    _rewritten(backends, encode, schema, [
        ('{"every":1,"name":"a"}', True), ('{"mode":"Scheduled","every":1,"name":"a"}', True),
        ('{"mode":"OnDemand","name":"a"}', True), ('{"name":"a","every":2,"mode":"OnDemand"}', True),
        ('{"every":1}', False), ('{"name":"a"}', False), ('{"mode":"Scheduled","name":"a"}', False)],
        gone='"oneOf"')
    forbidden = {"oneOf": [{"type": "object", "required": ["k"], "properties": {"k": {"const": 1},
                                                                               "a": {}}},
                           {"type": "object", "properties": {"k": False, "b": {}}}]}
    _rewritten(backends, encode, forbidden, [
        ('{"a":1,"k":1}', True), ('{"b":1}', True), ('{"k":1,"b":1}', True), ('{"k":2}', False)],
        gone='"oneOf"')


def test_a_oneof_of_closed_objects_apart_by_their_names(backends, encode):
    """Closed objects (no unlisted name) each requiring a name the others do not list, as
    test trees and discriminated configs write them: no object matches two, so the oneOf is
    their union (it was llguidance's own, approximated as anyOf and in the schema's
    order). Both open (each takes the other's name as an unlisted one): not apart."""
    def case(name, extra):
        return {"type": "object", "additionalProperties": False, "required": [name],
                "properties": {name: {"type": "string"}, "id": {"type": "string"},
                               extra: {"type": "integer"}}}
    schema = {"type": "array", "items": {"oneOf": [
        case("test-case", "timeout"), case("test-fixture", "depth"),
        {"$ref": "#/$defs/seq"}]},
        "$defs": {"seq": case("test-sequence", "repeat")}}
    _rewritten(backends, encode, schema, [
        ('[{"id":"x","test-case":"a"}]', True), ('[{"depth":1,"test-fixture":"f"}]', True),
        ('[{"repeat":2,"id":"i","test-sequence":"s"}]', True),
        ('[{"test-case":"a","test-fixture":"f"}]', False), ('[{"id":"x"}]', False),
        ('[{"test-case":"a","depth":1}]', False)], gone='"oneOf"')
    # an open branch whose own union requires one of two names the closed one lacks
    partial = {"type": "object", "required": ["specs"],
               "properties": {"specs": {"type": "array"}, "host": {"type": "string"},
                              "port": {"type": "integer"}},
               "anyOf": [{"required": ["host"]}, {"required": ["port"]}]}
    full = {"type": "object", "additionalProperties": False, "required": ["url", "specs"],
            "properties": {"url": {"type": "string"}, "specs": {"type": "array"}}}
    _rewritten(backends, encode, {"oneOf": [{"type": "string"}, full, partial]}, [
        ('{"specs":[],"url":"u"}', True), ('{"port":1,"specs":[],"url":"u"}', True),
        ('{"specs":[],"host":"h"}', True), ('{"specs":[]}', False), ('"s"', True),
        ('{"url":"u","specs":[],"extra":1}', False)], gone='"oneOf"')
    both_open = {"oneOf": [{**case("a", "x"), "additionalProperties": True},
                           {"type": "object", "required": ["b"]}]}
    root = {"type": "object", "properties": {"p": both_open, "q": {"type": "integer"}}}
    assert '"oneOf"' in any_order_grammar(root, {}, None)  # embedded: llguidance's own


def test_names_that_are_keywords_inside_embedded_nodes(backends, encode):
    """A property called "examples" (or "default", "enum") is a name, not data: the
    references below it travel with the embedded node (llguidance refused the grammar, and
    the whole schema fell back to the schema's order)."""
    schema = {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "string"},
        "data": {"type": "object", "patternProperties": {"^x": {}}, "properties": {
            "examples": {"$ref": "#/$defs/list"}, "default": {"$ref": "#/$defs/list"}}}},
        "$defs": {"list": {"type": "array", "items": {"type": "integer"}}}}
    g = compiled(backends, schema)
    for text, ok in [('{"b":"x","a":"y","data":{"examples":[1]}}', True),
                     ('{"data":{"examples":["s"]},"a":"y"}', False),
                     ('{"data":{"default":["s"],"examples":[1]}}', False),
                     ('{"data":{"examples":[1],"default":[2]},"b":"x"}', True)]:
        assert accepts(g, encode, text) is ok, text
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) is ok, text


def test_an_all_of_of_one_schema_is_that_schema(backends, encode):
    """`{"title": ..., "allOf": [{"$ref": ...}]}` (how a reference took a title before
    draft 2019-09) is its target, written in any order, here an object with a union."""
    option = {"type": "object", "properties": {"name": {"type": "string"}, "kind": {},
                                               "value": {}},
              "anyOf": [{"properties": {"kind": {"const": "s"}, "value": {"type": "string"}}},
                        {"properties": {"kind": {"const": "n"}, "value": {"type": "number"}}}]}
    schema = {"type": "array", "items": {"title": "an option",
                                         "allOf": [{"$ref": "#/$defs/option"}]},
              "$defs": {"option": option}}
    _rewritten(backends, encode, schema, [
        ('[{"value":"v","other":1,"name":"a"}]', True), ('[{"value":2,"kind":"n"}]', True),
        ('[{"value":2,"kind":"s"}]', False), ('[{"name":3}]', False)], gone='"allOf"')


def test_an_all_of_of_arrays_is_one_array(backends, encode):
    """A union written with `if` on one name (the version of a chart) whose other side
    narrows an array's items: each side's array is one array, items under both `items`
    (one object, any order), the tightest bounds."""
    deps = {"type": "array", "maxItems": 3, "items": {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": {"type": "string"}, "alias": {"type": "string"},
                       "after": {"type": "array", "items": {"type": "string"}}}}}
    schema = {"type": "object", "required": ["v"], "additionalProperties": False,
              "properties": {"v": {"enum": [2, 3]}, "deps": deps},
              "if": {"properties": {"v": {"const": 3}}},
              "else": {"properties": {"deps": {"type": "array", "minItems": 1, "items": {
                  "properties": {"after": False}}}}}}
    _rewritten(backends, encode, schema, [
        ('{"deps":[{"alias":"a","name":"b"}],"v":2}', True),
        ('{"deps":[{"after":["x"],"name":"b"}],"v":3}', True),
        ('{"deps":[{"after":["x"],"name":"b"}],"v":2}', False),
        ('{"deps":[],"v":2}', False), ('{"deps":[],"v":3}', True),
        ('{"deps":[{"name":"a"},{"name":"b"},{"name":"c"},{"name":"d"}],"v":3}', False)],
        gone='"minItems"')  # embedded, the array would carry its keywords


def test_a_oneof_of_untyped_objects(backends, encode):
    """Branches without `type` (object keywords only) match every non-object: two of them
    in a oneOf leave no non-object an instance, so the union is the branches' objects, apart
    by a required constant (a branch with more than object keywords too); nested in an
    outer oneOf beside typed branches (each apart from every branch of the inner one). One
    such branch alone keeps its non-objects."""
    def kind(tag, **more):
        return {"properties": {"type": {"const": tag}, "name": {"type": "string"}, **more},
                "required": ["type", "name"], "additionalProperties": False}
    schema = {"$defs": {
        "line": kind("Line", max={"type": "integer"}), "area": kind("Area"),
        # more than object keywords: apart from the others on objects all the same
        "custom": {**kind("Custom", a={}, b={}), "minProperties": 3},
        "inputs": {"oneOf": [{"$ref": "#/$defs/line"}, {"$ref": "#/$defs/area"},
                             {"$ref": "#/$defs/custom"}]},
        "item": {"type": "object", "properties": {"type": {"type": "string"}},
                 "required": ["type"]},
        "set": {"allOf": [{"$ref": "#/$defs/item"}, {"type": "object", "properties": {
            "type": {"const": "Set"}, "items": {"type": "array", "items": {
                "$ref": "#/$defs/items"}}}, "additionalProperties": False}]},
        "items": {"oneOf": [{"$ref": "#/$defs/inputs"}, {"$ref": "#/$defs/set"}]}},
        "type": "array", "items": {"$ref": "#/$defs/items"}}
    _rewritten(backends, encode, schema, [
        ('[{"name":"a","type":"Line","max":3}]', True), ('[{"type":"Area","name":"b"}]', True),
        ('[{"items":[{"name":"c","type":"Area"}],"type":"Set"}]', True),
        ('[{"type":"Area","name":"b","max":1}]', False), ('["Line"]', False), ("[3]", False),
        ('[{"type":"Set","items":["x"]}]', False), ('[{"type":"Other","name":"d"}]', False),
        ('[{"type":"Custom","name":"n","a":1}]', True),  # embedded: its order
        ('[{"type":"Custom","name":"n","c":2}]', False), ('[{"type":"Custom","name":"n"}]', False)],
        gone='"oneOf"')
    one = {"oneOf": [kind("Line"), {"type": "object", "properties": {"type": {"const": "X"},
                                                                     "y": {}},
                                    "required": ["type"]}]}
    _rewritten(backends, encode, one, [
        ('{"name":"a","type":"Line"}', True), ('{"y":1,"type":"X"}', True), ('"s"', True),
        ("[1]", True), ('{"type":"Line"}', False)], gone='"oneOf"')


def test_a_oneof_not_shown_apart_stays_llguidances():
    two = {"type": "object", "properties": {"k": {}, "q": {}}}
    assert any_order_grammar({"oneOf": [ITEM, two]}, {}, None) is None
    # JSON equality: 1 and 1.0 are one value, true and 1 two
    def tagged(a, b):
        return {"oneOf": [{"type": "object", "required": ["n"],
                           "properties": {"n": {"const": a}, "x": {}, "y": {}}},
                          {"type": "object", "required": ["n"],
                           "properties": {"n": {"const": b}, "x": {}, "y": {}}}]}
    assert any_order_grammar(tagged(1, 1.0), {}, None) is None
    assert any_order_grammar(tagged(True, 1), {}, None) is not None
    assert any_order_grammar(tagged([1, {"a": 2}], [1, {"a": 2.0}]), {}, None) is None
    # a name one branch does not require: both may match without it
    loose = {"oneOf": [{"type": "object", "properties": {"n": {"const": 1}, "x": {}}},
                       {"type": "object", "properties": {"n": {"const": 2}, "y": {}}}]}
    assert any_order_grammar(loose, {}, None) is None


def test_a_type_its_branches_or_target_imply(backends, encode):
    schema = {"$defs": {"o": ITEM}, "type": "object", "required": ["r"], "properties": {
        "r": {"$ref": "#/$defs/o", "type": ["object", "null"]},
        "u": {"type": "object", "anyOf": [
            {"$ref": "#/$defs/o"},
            {"type": "object", "properties": {"w": {"type": "null"}, "z": {}},
             "required": ["w"], "additionalProperties": False}]}}}
    _rewritten(backends, encode, schema, [
        ('{"r":{"v":1,"k":"a"}}', True), ('{"u":{"z":1,"w":null},"r":{"v":2,"k":"b"}}', True),
        ('{"u":{"v":3,"k":"c"},"r":{"v":2,"k":"b"}}', True), ('{"r":{"k":"a"}}', False),
        ('{"u":{"w":1},"r":{"v":2,"k":"b"}}', False), ('{"r":null}', False)], gone='"$ref"')
    # a type the target does not imply: the node is both (an array and ITEM: nothing; an
    # object and anything: llguidance's, nothing to order)
    for node in ({"$ref": "#/$defs/o", "type": "array"}, {"$ref": "#/$defs/any", "type": "object"}):
        schema = {"$defs": {"o": ITEM, "any": {}}, "properties": {"x": node}}
        text = any_order_grammar(schema, {}, None)
        assert text is None or '"$ref"' in text, (node, text)
    # a type its branches do not imply: each branch with the type
    _rewritten(backends, encode, {"properties": {"x": {
        "type": "object", "anyOf": [{"properties": {"a": {}, "b": {"type": "integer"}}}]}}}, [
        ('{"x":{"b":1,"a":"s"}}', True), ('{"x":"s"}', False), ('{"x":{"b":"s"}}', False)],
        gone='"anyOf"')


def test_arrays_or_other_types(backends, encode):
    schema = {"type": "object", "properties": {
        "list": {"type": ["array", "null"], "items": ITEM, "maxItems": 2},
        "any": {"items": ITEM}}}
    _rewritten(backends, encode, schema, [
        ('{"list":null}', True), ('{"list":[{"v":1,"k":"a"},{"k":"b","v":2}]}', True),
        ('{"list":[{"v":1,"k":"a"},{"k":"b","v":2},{"k":"c","v":3}]}', False),
        ('{"list":"s"}', False), ('{"any":"s","list":[]}', True),
        ('{"any":[{"v":1,"k":"a"}]}', True), ('{"any":[{"v":1}]}', False)])


def test_xgrammar_unaffected(backends, encode):
    g = compiled(backends, PERSON, backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR)
    assert g[0].name == XGRAMMAR
    assert accepts(g, encode, '{"name":"a","age":1}')


def test_a_rewrite_llguidance_refuses_falls_back_to_the_schemas_own_grammar(backends, encode):
    """An optional property whose schema nothing satisfies: llguidance's compile of the whole
    schema leaves the property out, the embedded node alone is an error; the schema still
    compiles on llguidance, in the schema's order."""
    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"},
        "never": {"type": "string", "minLength": 3, "maxLength": 1}}}
    g = compiled(backends, schema, backend=common_pb2.GRAMMAR_BACKEND_AUTO)
    assert g[0].name == LLGUIDANCE
    assert accepts(g, encode, '{"a":1,"b":2}')
    assert not accepts(g, encode, '{"a":1,"never":"x"}')


def test_compile_grammar_says_which_order_the_grammar_takes(backends):
    def reason(schema, **options):
        spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema),
                                                 options=Opts(**options)))
        return compile_spec(spec, backends).reason
    assert reason(PERSON).endswith("properties in any order (where the rewrite applies: "
                                   "README, JSON Schema semantics)")
    assert reason(PERSON, fixed_property_order=True).endswith("(options.fixed_property_order)")
    assert reason(PERSON, backend=common_pb2.GRAMMAR_BACKEND_XGRAMMAR).endswith(
        "(xgrammar fixes it)")
    assert reason({"type": "object", "properties": {"a": {}, "b": {}},
                   "patternProperties": {"^x": {}}}).endswith(
        "(no object the rewrite can reorder)")


# ------------------------------------------------- what llguidance ignores, order free

IGNORED = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "properties": {
        "kind": {"enum": ["a", "b"]},
        "size": {"type": "integer"},
        "unit": {"type": "string"},
        "tags": {"type": "array", "uniqueItems": True, "contains": {"type": "object"},
                 "items": {"type": "object", "additionalProperties": False,
                           "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
                           "required": ["k", "v"]}},
        "meta": {"type": "object", "propertyNames": {"maxLength": 3},
                 "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                 "not": {"properties": {"x": {"const": 0}}}},
    },
    "required": ["kind"],
    "additionalProperties": False,
    "if": {"properties": {"size": {"minimum": 10}}}, "then": {"required": ["unit"]},
    "else": {"properties": {"unit": {"maxLength": 2}}},
    # a name list (stated on the rule's bits, enforced) beside a schema (ignored)
    "dependencies": {"unit": ["size"], "tags": {"required": ["meta"]}},
}


def test_what_llguidance_ignores_leaves_the_order_free(backends, encode):
    """Keywords llguidance does not implement (a lenient compile ignores them and says so) no
    longer keep their objects in the schema's order: the grammar enforces what llguidance
    enforced, in any order, and reports the same keywords."""
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(IGNORED)))
    result = compile_spec(spec, backends)
    assert result.backend == LLGUIDANCE and "properties in any order" in result.reason
    assert set(result.unenforced) == {
        "if", "then", "else", "dependencies", "properties.tags.uniqueItems",
        "properties.tags.contains", "properties.meta.propertyNames", "properties.meta.not"}
    auto = common_pb2.GRAMMAR_BACKEND_AUTO  # lenient: a forced llguidance refuses them
    g = compiled(backends, IGNORED, auto)
    # keys in any order, at every depth
    assert accepts(g, encode, '{"unit": "cm", "size": 3, "kind": "a", "tags": '
                              '[{"v": 1, "k": "q"}, {"v": 1, "k": "q"}], "meta": {"y": 1, '
                              '"x": 0, "long_name": 5}}')
    # what stays enforced: enums, types, required, closed objects, the name list
    for text in ('{"kind": "c"}', '{"size": 3}', '{"kind": "a", "size": "3"}',
                 '{"kind": "a", "other": 1}', '{"kind": "a", "tags": [{"k": "q"}]}',
                 '{"kind": "a", "unit": "cm"}', '{"kind": "a", "meta": {"x": "1"}}'):
        assert not accepts(g, encode, text), text
    # the ignored keywords, as llguidance's own compile ignores them
    assert accepts(g, encode, '{"kind": "b", "size": 20, "tags": []}')
    # as llguidance's own lenient compile (schema order) decides, on documents in order
    own = compiled(backends, IGNORED, auto, fixed_property_order=True)
    rng = random.Random(7)
    for _ in range(60):
        doc = {"kind": rng.choice(["a", "b", "c"])}
        for key, value in (("size", rng.choice([1, 20, "x"])), ("unit", rng.choice(["cm", 3])),
                           ("tags", rng.choice([[], [{"k": "q", "v": 1}], [1]])),
                           ("meta", {"x": rng.choice([0, 1])})):
            if rng.random() < 0.5:
                doc[key] = value
        text = json.dumps(doc)
        # (the name list is ours: llguidance ignores all of `dependencies`)
        needs = "unit" not in doc or "size" in doc
        assert accepts(g, encode, text) == (accepts(own, encode, text) and needs), text


def _in_any_order(backends, schema):
    """`schema` compiled as a rank has it, after checking that CompileGrammar says its
    properties come in any order."""
    spec = parse_spec(common_pb2.GrammarSpec(json_schema=json.dumps(schema)))
    assert "properties in any order" in compile_spec(spec, backends).reason
    return compiled(backends, schema)


def test_the_root_carried_by_an_embedded_node(backends, encode):
    """A node embedded whole that refers to the root carries it under its $defs without the
    root's `$id` (llguidance would resolve the rewritten references against that URL and
    fail, and the whole schema fell back to the schema's order)."""
    schema = {"$id": "https://example.com/tree.json", "type": "object",
              "properties": {"name": {"type": "string"}, "size": {"type": "integer"},
                             # more items than the rewrite writes out: embedded whole
                             "kids": {"type": "array", "items": {"$ref": "#"},
                                      "maxItems": 40}},
              "required": ["name"]}
    g = _in_any_order(backends, schema)
    assert accepts(g, encode, '{"size": 1, "name": "a", "kids": [{"name": "b"}]}')
    assert not accepts(g, encode, '{"size": 1, "name": "a", "kids": [{}]}')
    assert not accepts(g, encode, '{"size": 1, "kids": [{"name": "b"}]}')


def test_ids_on_every_node_without_references(backends, encode):
    """Schema generators put an `$id` on every node ("#/properties/a"); with no reference to
    resolve against them they change nothing, and the objects take any order."""
    schema = {"$schema": "http://json-schema.org/draft-07/schema#",
              "$id": "https://example.com/gen.json", "type": "object", "required": ["a"],
              "properties": {
                  "a": {"$id": "#/properties/a", "type": "string"},
                  "b": {"$id": "#/properties/b", "type": "object",
                        "properties": {"x": {"$id": "#/properties/b/properties/x",
                                             "type": "integer"},
                                       "y": {"$id": "#/properties/b/properties/y",
                                             "type": "array", "maxItems": 40,
                                             "items": {"$id": "#/properties/b/y/items"}}}}}}
    g = _in_any_order(backends, schema)
    assert accepts(g, encode, '{"b": {"y": [1], "x": 2}, "a": "s"}')
    assert not accepts(g, encode, '{"b": {"x": "2"}, "a": "s"}')
    assert not accepts(g, encode, '{"b": {}}')
