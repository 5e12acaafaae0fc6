"""Any property order, as JSON Schema means it, on llguidance.

Both engines fix the order of an object's properties: llguidance's JSON compiler (like
xgrammar's) takes the listed properties in the schema's order, then the unlisted ones. JSON
Schema allows any order, so a valid document whose keys come in another order is refused;
on SchemaStore's test documents that is most of the valid instances refused.

`any_order_grammar` rewrites a JSON schema into an llguidance Lark grammar in which every
object whose keywords it can state exactly takes its properties in any order: an object node
with `type: object` and nothing that constrains objects but `properties`, `required` and
`additionalProperties`. Its members come from one parametric rule (llguidance's
parametric grammars, docs/parametric.md in its repository) whose 64-bit parameter is the
set of listed properties seen: each listed property at most once, the closing brace only
once every required one has come, unlisted names (when the schema allows them) any number
of times, as llguidance's own JSON compiler allows them, with values under
`additionalProperties` (an object with no listed property, a map, when its values hold
objects to reorder). Past 64 listed names, the optional ones no dependency speaks of take
no bit once the bits run out (`_with_bits`): each such name may come more than once, its
value under its own schema every time. Where every name present has a bit
(`additionalProperties: false`), `minProperties` and `maxProperties` are conditions on the
count of bits set (where unlisted names may come, only `minProperties: 1` and
`maxProperties: 1`, which the rule's shape states: no empty object, no comma); names that
require others (`dependentRequired`, or `dependencies` with name lists up to draft 7) are
conditions on the closing brace, and so are names that exclude others (a dependency whose
schema says only that names are absent, `excluded_names`: mutually exclusive properties, in
`dependencies` up to draft 7, `dependentSchemas` after); where the names they speak of are
not listed (and may come), those names take bits too, their values under
`additionalProperties` (an untyped node with such a keyword is an object node as one
listing properties is). `patternProperties` are members without a bit whose key is
llguidance's JSON string with the pattern (embedded), where a name a pattern matches takes
nothing else (`_patterns`: `additionalProperties: false`, no listed name matched, patterns
apart). The rewrite reaches such objects through local `$ref`s, an `allOf` of one schema
(that schema), `anyOf` (a union: the alternation of the branches), `oneOf` whose branches
exclude each other (then no instance matches two, and oneOf is the union), and arrays with
an `items` schema. Two branches exclude each other when their types are apart, or they
share only objects and one requires a name with constants the other's values for that name
exclude (required there or not) or a name the other does not allow (a closed object that
does not list it; a branch's own union taken branch by branch), or (`_apart_parts`) both
have no `type` and only object keywords, so both match every non-object, and are apart on
objects: with two such branches no non-object is an instance, and each is written as its
objects. Keywords beside a union (`type` and the
object keywords) hold in each branch: each branch is written with them, unless they are a
`type` every branch already implies; the same for a `$ref` beside them (the target and
them, as llguidance compiles it in every draft: draft 7 and before would ignore them). An
`allOf` of such objects (nothing in any branch but those four keywords, through `$ref`s)
is one object (`_merge`): each name's value under every branch that speaks of it (its
`properties` entry, else its `additionalProperties`: each branch's own), every branch's
required names required; a name whose branches' types are apart is never allowed. An
`allOf` of arrays (`type`, `items`, `minItems`, `maxItems`) is one array, its items under
every branch's `items` (`_merged_array`). Every other node (strings, numbers, `enum`,
other `allOf`s and `oneOf`s, ...) stays llguidance's JSON compiler's, embedded as `%json
{...}` with the same options, the schema's definitions it refers to carried along. So the grammar enforces what the JSON compiler would, property
order aside, and its warnings (lenient compiles) are the same.

A node without `type` (or with a list holding "object") that lists properties is the
rewritten object or, embedded, the other types with the node's other keywords; the same for
arrays (a list holding "array", or an untyped node with `items`). An embedded
node takes along every target its `$ref`s reach (a definition, the root, any node), under
`$defs`, its references rewritten to them.

What stays fixed: objects inside embedded nodes (under an `allOf` with other keywords, a
`oneOf` not shown apart, `not`, `if`, or next to other `patternProperties`, a
`propertyNames` beside listed names (on a map, one of string keywords is its keys' schema),
`min/maxProperties` above 1 where unlisted names may come or past 64 listed names, schema
`dependencies`, ..., or more than 64 names required or named by dependencies). `None`
(the caller compiles the schema as it is) when no object would change, when the schema uses
what the rewrite does not resolve (a `$ref` that is not a local JSON pointer, `$id` below
the root or anchors where the schema has references), or when the grammar would be much
larger than the schema.

An optional property whose value provably matches nothing (`_impossible`: no type left, or
an object that requires a name it forbids) is never allowed, as llguidance's own compile
of the whole schema leaves it out (an embedded node that matches nothing is an error).

Unlisted names are JSON strings without `\\u` or `\\/` escapes that are not a listed name
written as `json.dumps` writes it; so an unlisted name can never be a listed one spelled
differently.
"""

from __future__ import annotations

import json
import re
from json.encoder import encode_basestring as _quote  # json.dumps(str, ensure_ascii=False)

_WS = r"[\x20\x0A\x0D\x09]"
# A JSON string without \u or \/ escapes: every such string has one spelling.
_KEY_BODY = r'(?:[^"\\\x00-\x1F]|\\["\\bfnrt])*'
_KEY = f'"{_KEY_BODY}"'
MAX_PROPERTIES = 64  # bits of llguidance's rule parameter
_EMBED = re.compile(r"^j[0-9]+: %json (.*)$", re.MULTILINE)
# The values of the JSON types as lexemes (RFC 8259), for nodes that are a bare type: what
# llguidance's JSON compiler accepts for them, and a string may also use any \u escape.
_NUMBER_INT = r"-?(?:0|[1-9][0-9]*)"
_LEAVES = {
    "string": r'/"(?:[^"\\\x00-\x1F]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/',
    "integer": f"/{_NUMBER_INT}/",
    "number": f"/{_NUMBER_INT}(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/",
    "boolean": '"true" | "false"',
    "null": '"null"',
}
# The grammar may be this many times the schema's size (or MIN_BUDGET bytes) before the
# rewrite gives up: embedded nodes carry the definitions they use, once per embedding.
SIZE_FACTOR = 8
MIN_BUDGET = 64 * 1024

# Object keywords the parametric rule states with conditions on its bits (`object`): counts
# of properties and names that require others, where every name present has a bit.
_COUNTED = frozenset({"minProperties", "maxProperties", "dependencies", "dependentRequired",
                      "dependentSchemas"})
# Keywords that make a node more than the rewrite states (an object node, an anyOf node, a
# $ref node or an array node keeps only its own). Keywords of other types on a typed node
# do not apply to it and are ignored, as JSON Schema says.
_OBJECT_BLOCKERS = frozenset({
    "enum", "const",
    "unevaluatedProperties",
    "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
    "$recursiveRef", "extends", "disallow",
})
_ARRAY_BLOCKERS = frozenset({
    "enum", "const", "uniqueItems", "contains", "minContains", "maxContains", "prefixItems",
    "additionalItems", "unevaluatedItems", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "$ref", "$dynamicRef", "$recursiveRef", "extends", "disallow",
})
# Every keyword that asserts or applies (so a node with anyOf or $ref and none of these
# else is exactly that union or that reference).
_ASSERTIONS = _OBJECT_BLOCKERS | _ARRAY_BLOCKERS | _COUNTED | frozenset({
    "type", "properties", "required", "additionalProperties", "patternProperties", "items",
    "propertyNames",
    "minItems",
    "maxItems", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
    "maxLength", "minLength", "pattern", "format", "contentEncoding", "contentMediaType",
    "divisibleBy",
})
# Keywords that say nothing about an instance, left out of an embedded node (so that equal
# value schemas with different descriptions are embedded once), and our own options key.
_ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
    "writeOnly", "markdownDescription", "markdownEnumDescriptions", "enumDescriptions",
    "x-guidance", "x-intellij-html-description", "x-taplo", "x-tombi-toml-version",
})
# Keywords whose values are data, not schemas (no $ref inside them is a reference).
_DATA = frozenset({"enum", "const", "default", "examples"})
# Keys whose values map names (never keywords: a property may be called "examples" or
# "$ref") to subschemas (`dependencies`: to subschemas or name lists).
MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                      "dependentSchemas", "dependencies"})
_OBJECT_KEYWORDS = ("type", "properties", "required", "additionalProperties")
_OBJECT_SET = frozenset(_OBJECT_KEYWORDS)
# What `_merge` takes in a node or a branch of its allOf (through references).
_CONJUNCT_KEYWORDS = _OBJECT_SET | {"allOf", "$ref"}
# Assertions whose meaning does not depend on a sibling keyword in any draft (not draft 4's
# boolean exclusiveMinimum, which modifies minimum: a schema holding it is not merged):
# schemas holding only such keywords, none twice, are together one schema holding them all.
_INDEPENDENT = frozenset({
    "type", "enum", "const", "minLength", "maxLength", "pattern", "format", "minimum",
    "maximum", "multipleOf", "minItems", "maxItems", "uniqueItems", "required",
    "minProperties", "maxProperties"})
# What can leave a node no value that `_impossible` looks for: without them, a node matches
# something (or is a leaf that contradicts itself, which llguidance reports).
_NARROWING = frozenset({"$ref", "allOf", "anyOf", "oneOf", "required"})
_NOT_OBJECT = ("array", "string", "number", "boolean", "null")
_ARRAY_KEYWORDS = ("type", "items", "minItems", "maxItems")
# What `_merged_array` takes in a node or a branch of its allOf (through references).
_ARRAY_CONJUNCTS = frozenset(_ARRAY_KEYWORDS) | {"allOf", "$ref"}
_NOT_ARRAY = ("object", "string", "number", "boolean", "null")
_REFERENCE = re.compile(r'"\$(?:ref|dynamicRef|recursiveRef)"\s*:')
_NAME = re.compile(r"\b(?:n\d+_[mr]|[nj]\d+|T\d+)\b")
# Array bounds written out as repetitions up to this many items; larger ones are embedded.
_MAX_ITEMS_WRITTEN = 16


class _Unsupported(Exception):
    """The schema uses something the rewrite does not resolve: compile it as it is."""


def any_order_grammar(schema, x_guidance: dict, whitespace: str | None,
                      text: str | None = None) -> str | None:
    """Lark text for `schema` with any property order (see the module docstring), or None.

    `text`: the schema's JSON text, if the caller has it (saves a dump and most walks).
    `x_guidance`: llguidance's JSON options for the embedded nodes (whitespace, lenient).
    `whitespace`: the regex of the whitespace allowed at each place between tokens
    (`whitespace_regex`; at most one match per place, as llguidance's `whitespace_pattern`),
    None for none (compact JSON). Pure.
    """
    if not isinstance(schema, dict):
        return None
    try:
        lark = _Rewriter(schema, x_guidance, whitespace, text).grammar()
    except (_Unsupported, RecursionError):
        return None
    if lark is not None and not lark.isascii():
        try:
            lark.encode()
        except UnicodeEncodeError:  # a name with a lone surrogate: no UTF-8 spells it
            return None
    return lark


def embedded_schemas(lark: str) -> list[str]:
    """The JSON texts of the nodes an `any_order_grammar` Lark embeds (`%json`), in order:
    each is one line `jN: %json {...}` (JSON text has no raw line break)."""
    return _EMBED.findall(lark)


def requires_keyword(schema: dict) -> str:
    """The keyword of names requiring others in `schema`'s draft: `dependencies` up to draft
    7, `dependentRequired` from 2019-09 (the default, as the output check's); the other is
    no keyword there."""
    draft = schema.get("$schema")
    return "dependencies" if isinstance(draft, str) and re.search(r"draft-0[3-7]/", draft) \
        else "dependentRequired"


def whitespace_regex(mode: str, bound: int) -> str | None:
    """The between-token whitespace regex of a whitespace mode ("compact", "bounded" with
    `bound`, "any"), as llguidance's `whitespace_pattern`; None for compact."""
    if mode == "compact":
        return None
    if mode == "bounded":
        return f"{_WS}{{0,{bound}}}"
    return f"{_WS}+"


class _Rewriter:
    def __init__(self, schema: dict, x_guidance: dict, whitespace: str | None,
                 text: str | None = None):
        self.root = schema
        self.x_guidance = x_guidance
        self.whitespace = whitespace
        self.rules: dict[str, str] = {}  # name -> its definition
        self.names: dict[str, str] = {}  # JSON pointer -> rule name
        self.embeds: dict[str, str] = {}  # embedded JSON text -> rule name
        self.terminals: dict[str, str] = {}  # terminal body -> name
        self._defs: dict[str, str] = {}  # $ref -> its `_def_text`
        self._known: dict[tuple[str, int], tuple[object, object]] = {}  # `_once`
        self._resolved: dict[str, tuple[object, str]] = {}  # $ref -> `resolve`
        self.objects = 0  # object rules written (the rewrite's point)
        self.requires = requires_keyword(schema)
        # The keys `embed` adds to every embedded node, as JSON text: ',"$schema":...,'
        # '"x-guidance":{...}'.
        tail = {"x-guidance": x_guidance}
        if "$schema" in schema:
            tail = {"$schema": schema["$schema"], **tail}
        self._tail = "," + json.dumps(tail, ensure_ascii=False, separators=(",", ":"))[1:-1]
        text = json.dumps(schema) if text is None else text
        self.budget = max(MIN_BUDGET, SIZE_FACTOR * len(text))
        self.size = 0
        # (where no reference is written, an `$id` or anchor is nothing to resolve against:
        # schema generators put an `$id` on every node)
        if (text.count('"$id"') > ("$id" in schema) or '"$anchor"' in text
                or '"$dynamicAnchor"' in text) and _REFERENCE.search(text):
            _check_ids(schema, top=True)

    def grammar(self) -> str | None:
        start = self.node("#", self.root)
        if not self.objects:
            return None
        # Only what the start rule reaches (a node embedded whole leaves the rules of its
        # parts behind, and llguidance would build them all).
        for body, name in self.terminals.items():
            self.rules[name] = f"{name}: {body}"
        reached, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name not in reached and name in self.rules:
                reached.add(name)
                todo.extend(_NAME.findall(self.rules[name]))
        # Whitespace as llguidance's JSON compiler has it: skipped before any lexeme, at
        # most one match of the pattern at each place (so a bound holds); the embedded
        # nodes skip the same. The lexemes themselves are the JSON compiler's ({, }, [, ],
        # comma, colon, names, values): where a rewritten object and an embedded one are
        # alternatives, the lexer splits the text the same way for both.
        lines = ['%llguidance {"ignore_once": true}', f"start: {start}"]
        if self.whitespace:
            lines.append(f"%ignore /{self.whitespace}/")
        return "\n".join(lines + [r for n, r in self.rules.items() if n in reached]) + "\n"

    # -- nodes

    def node(self, pointer: str, node) -> str:
        """The rule name for the schema `node` found at `pointer`."""
        if pointer in self.names:
            return self.names[pointer]
        if isinstance(node, dict) and (node.keys() & _ASSERTIONS == {"$ref"}
                                       or self._typed_ref(node)):
            target, target_pointer = self.resolve(node["$ref"])
            self.names[pointer] = self.node(target_pointer, target)
            return self.names[pointer]
        if isinstance(node, dict) and node.keys() & _ASSERTIONS == {"allOf"} \
                and isinstance(node["allOf"], list) and len(node["allOf"]) == 1:
            # An allOf of one schema is that schema (as a $ref with a title beside it is
            # written before draft 2019-09)
            self.names[pointer] = self.node(f"{pointer}/allOf/0", node["allOf"][0])
            return self.names[pointer]
        leaf = self.leaf(node)
        if leaf is not None:
            self.names[pointer] = leaf
            return leaf
        name = self.names[pointer] = f"n{len(self.names)}"
        body = self.structured(pointer, node)
        if body is None:
            target = self.embed(node)
            self.names[pointer] = target
            return target
        self._add(name, f"{name}: {body}")
        return name

    def leaf(self, node) -> str | None:
        """A terminal for a node that is just JSON types, or an `enum` / `const` of scalars
        (the most common values: a lexeme costs far less to build than an embedded schema,
        about 0.1 ms each), else None."""
        if not isinstance(node, dict):
            return None
        keys = node.keys() & _ASSERTIONS
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if types is not None and not (isinstance(types, list) and types
                                      and all(t in _LEAVES for t in types)):
            return None
        if keys == {"type"}:
            return self.terminal(" | ".join(_LEAVES[t] for t in dict.fromkeys(types)))
        if keys - {"type"} not in ({"enum"}, {"const"}):
            return None
        values = node["enum"] if "enum" in keys else [node["const"]]
        if not isinstance(values, list) or not all(_scalar(v) for v in values):
            return None
        if types is not None:
            values = [v for v in values if any(of_type(v, t) for t in types)]
        texts = dict.fromkeys(_quote(v) if type(v) is str else json.dumps(v, ensure_ascii=False)
                              for v in values)
        if not texts:
            return None  # nothing allowed: llguidance says so
        return self.terminal(" | ".join(_lark_string(t) for t in texts))

    def structured(self, pointer: str, node) -> str | None:
        """The rule body for `node` when it is (or leads to) an object the rewrite writes,
        else None (the node is embedded whole)."""
        if not isinstance(node, dict):
            return None
        keys = node.keys() & _ASSERTIONS
        union = _union(node, keys)
        if union is not None:
            word, branches, own = union
            if not (isinstance(branches, list) and branches):
                return None
            # Keywords beside the union hold in every branch: each branch is the branch
            # with them (the branch itself where they say nothing more: a `type` that
            # every branch implies).
            within = type_set(node) if own.keys() == {"type"} else None
            if not own or (within is not None
                           and all(self._types(sub) <= within for sub in branches)):
                parts = [(f"{pointer}/{word}/{i}", sub) for i, sub in enumerate(branches)]
            else:
                if word == "anyOf":  # an anyOf within: its branches are the union's
                    branches = self._flat_any(branches)
                parts = [(f"{pointer}/~{word}/{i}", {"allOf": [sub, own]})
                         for i, sub in enumerate(branches)]
            if word == "oneOf":
                parts = self._apart_parts(parts)
                if parts is None:
                    return None  # llguidance's own oneOf: it proves the branches apart or not
            parts = [(at, sub) for at, sub in parts if not self._impossible(sub)]
            # A union; for oneOf exactly that, as no instance matches two branches.
            names = [self.node(at, sub) for at, sub in parts]
            if not parts or (len(parts) == len(branches)
                             and not any(self._is_rule(n) for n in names)):
                # Nothing to reorder: embedded whole (unless branches that match nothing
                # were left out: those may hold what llguidance refuses)
                return None
            return " | ".join(names)
        if _conjunctive(keys):
            # (a $ref beside object keywords: both apply, as llguidance compiles it in every
            # draft)
            return self.all_of(pointer, node)
        kind = node.get("type")
        types = [kind] if isinstance(kind, str) else kind
        for shape, write, marker, blockers, own, not_shape in (
                ("object", self.object, "properties", _OBJECT_BLOCKERS, _OBJECT_KEYWORDS,
                 _NOT_OBJECT),
                ("array", self.array, "items", _ARRAY_BLOCKERS, _ARRAY_KEYWORDS, _NOT_ARRAY)):
            if kind == shape:
                return None if keys & blockers else write(pointer, node)
            if (types is None and (marker in node or (shape == "object" and (
                    self.requires in node or "propertyNames" in node)))) or (
                    isinstance(types, list) and shape in types and len(types) > 1):
                # Objects (arrays) or other types (no `type`, or a list holding the shape):
                # the shape rewritten, the other types embedded with the node's other
                # keywords.
                if keys & blockers:
                    return None
                body = write(pointer, node)
                if body is None:
                    return None
                others = [t for t in types or not_shape if t != shape]
                rest = {k: v for k, v in node.items() if k not in own and not (
                    shape == "object" and (k in _COUNTED or k == "propertyNames"))}
                return f"{body} | {self.embed({**rest, 'type': others})}"
        return None

    def _typed_ref(self, node: dict) -> bool:
        """A `$ref` beside only a `type` that its target's own `type` already implies: the
        node is its target (an intersection from draft 2019-09 on, the target alone before;
        the same when the target implies the type)."""
        if node.keys() & _ASSERTIONS != {"$ref", "type"}:
            return False
        within, target = type_set(node), type_set(self.resolve(node["$ref"])[0])
        return within is not None and target is not None and target <= within

    def _facts(self, node) -> tuple[frozenset, dict, frozenset, bool]:
        """(the JSON types `node` allows, {listed name: the values it allows there, or
        None}, the required names, whether no unlisted name is allowed) as far as its own
        keywords say; through `$ref`s, and an allOf of objects as one (`_merge`)."""
        types = self._types(node)
        node = self._through_refs(node)
        if "object" not in types or not isinstance(node, dict):
            return types, {}, frozenset(), False
        if node.keys() & {"allOf", "$ref"}:
            found = self._merge(node)
            if found is None:
                return types, {}, frozenset(), False
            node = found[0]
        props, required = node.get("properties", {}), node.get("required", [])
        if not (isinstance(props, dict) and isinstance(required, list)):
            return types, {}, frozenset(), False
        named = {k: _values(self._through_refs(v)) for k, v in props.items()}
        named.update((k, []) for k, v in props.items() if v is False)  # never there
        closed = node.get("additionalProperties", True) is False \
            and not node.get("patternProperties")
        return types, named, frozenset(r for r in required if isinstance(r, str)), closed

    def _apart_parts(self, parts: list) -> list | None:
        """The branches of a oneOf ((pointer, node) each) as a union's, when no instance
        matches two of them, else None. Two branches are apart when every alternative of
        one (`_alternatives`) is apart from every alternative of the other (`_apart`). Where
        two branches have no `type` and nothing but object keywords (`_universal`), both
        match every non-object, so no non-object is an instance: then the branches need be
        apart on objects only, and each is written as its objects."""
        alts = [self._alternatives(sub) for _, sub in parts]
        pairs = [(a, b) for i in range(len(parts)) for j in range(i + 1, len(parts))
                 for a in alts[i] for b in alts[j]]
        if sum(self._universal(sub) for _, sub in parts) < 2:
            return parts if all(_apart(a, b) for a, b in pairs) else None
        if not all(_apart_on_objects(a, b) for a, b in pairs):
            return None
        return [(at, sub) if self._types(sub) <= {"object"}
                else (f"{at}/~object", {"allOf": [sub, {"type": "object"}]})
                for at, sub in parts]

    def _flat_any(self, branches: list, depth: int = 0) -> list:
        """An anyOf's branches, each that is itself an anyOf (through `$ref`s) replaced by
        its own branches: the same union."""
        out = []
        for sub in branches:
            target = self._through_refs(sub)
            inner = target.get("anyOf") if isinstance(target, dict) \
                and target.keys() & _ASSERTIONS == {"anyOf"} else None
            if isinstance(inner, list) and inner and depth < 8 and len(out) < MAX_PROPERTIES:
                out.extend(self._flat_any(inner, depth + 1))
            else:
                out.append(sub)
        return out

    def _alternatives(self, node, depth: int = 0) -> list:
        """The `_facts` of each branch of a union `node` (through `$ref`s, unions within
        unions; each branch with the object keywords beside the union, which hold in every
        branch), or `[_facts(node)]`: one of them holds for every instance."""
        target = self._through_refs(node)
        if isinstance(target, dict) and depth < 8:
            union = _union(target, target.keys() & _ASSERTIONS)
            if union is not None and isinstance(union[1], list) \
                    and 0 < len(union[1]) <= MAX_PROPERTIES:
                _, branches, own = union
                return [f for b in branches for f in self._alternatives(
                    {"allOf": [b, own]} if own else b, depth + 1)]
        return [self._facts(node)]

    def _universal(self, node) -> bool:
        """Whether `node` is an object schema without a `type` (nothing but object
        keywords, through `$ref`s and `allOf`s): it matches every value but objects."""
        found = self._merge(node)
        return found is not None and found[1] == _ALL_TYPES

    def _types(self, node, depth: int = 0) -> frozenset:
        """The JSON types `node` may match, as far as its own `type`, `const`/`enum` and
        unions say (a superset: every type where nothing says more)."""
        node = self._through_refs(node)  # (one answer per target)
        if node is False:
            return frozenset()
        if not isinstance(node, dict) or depth > 16:
            return _ALL_TYPES
        return self._once("types", node, lambda: self._own_types(node, depth))

    def _own_types(self, node: dict, depth: int) -> frozenset:
        types = type_set(node) or _ALL_TYPES
        values = _values(node)
        if values is not None:
            types &= frozenset(_kind(v) for v in values)
        for word in ("anyOf", "oneOf", "allOf"):
            branches = node.get(word)
            if not (isinstance(branches, list) and branches):
                continue
            sets = [self._types(b, depth + 1) for b in branches]
            types &= frozenset.intersection(*sets) if word == "allOf" else frozenset.union(*sets)
        return types

    def _once(self, what: str, node, compute):
        """`compute()` for `node`, once per rewrite (keyed by the node's identity; the node
        is held, so its id stays its own)."""
        key = (what, id(node))
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = (node, compute())
        return known[1]

    def _both(self, schemas: list):
        """A schema matching what every one of `schemas` matches (true for none, false when
        their types are apart)."""
        constraints = [s for s in schemas if s is not True and s != {}]
        if len(constraints) > 1 and not frozenset.intersection(
                *(self._types(s) for s in constraints)):
            return False
        if any(s is False for s in constraints):
            return False
        if len(constraints) > 1:
            merged: dict = {}
            for c in constraints:
                if not (isinstance(c, dict) and c.keys() <= _INDEPENDENT
                        and not c.keys() & merged.keys()):
                    return {"allOf": constraints}
                merged.update(c)
            return merged  # keywords that apply each on its own: one schema is all of them
        return constraints[0] if constraints else True

    def _through_refs(self, node):
        for _ in range(16):
            if not (isinstance(node, dict) and node.keys() & _ASSERTIONS == {"$ref"}):
                return node
            node = self.resolve(node["$ref"])[0]
        return {}  # a long chain (or a cycle): nothing known

    def object(self, pointer: str, node: dict) -> str | None:
        props = node.get("properties", {})
        required = node.get("required", [])
        extra = node.get("additionalProperties", True)
        if not (isinstance(props, dict) and isinstance(required, list)
                and all(isinstance(r, str) for r in required)
                and isinstance(extra, (bool, dict))):
            return None
        allowed = {k: v for k, v in props.items() if v is not False and not self._impossible(v)}
        required = list(dict.fromkeys(required))
        if any(r not in allowed and (r in props or extra is False) for r in required):
            return None  # unsatisfiable: llguidance says so
        names = required + [k for k in allowed if k not in required]
        deps = _dependencies(node, self.requires)
        if deps is None:
            return None
        if extra is not False:
            names += _dependency_names(deps, names, props)
        names, bitless = _with_bits(names, required, deps)
        patterns = self._patterns(pointer, node, props, extra)
        if patterns is None or names is None:
            return None
        if not names and not bitless and not patterns and extra is False:
            return None
        # A `propertyNames` that says something: stated as the key of an object whose every
        # name is unlisted (a map); a listed name would have to be checked against it.
        keys = stated_key_schema(node)
        if keys is None:
            return None
        # Names without a bit may come: unlisted ones, ones a pattern matches, listed ones
        # past the bits.
        closed = extra is False and not patterns and not bitless
        counted = _counted(node, deps, names, closed, props)
        if counted is None:
            return None
        low, high, deps = counted
        name = self.names[pointer]
        m, rest = f"{name}_m", f"{name}_r"
        # Closing: every required name there, at least `low` names (one is the rule's shape:
        # no empty object below), each name's needs met; a comma only below `high` names.
        bits = {key: bit for bit, key in enumerate(names)}
        ends = ([f"is_ones([0:{len(required)}])"] if required else []) \
            + ([f"bit_count_ge([0:{len(names)}], {low})"] if low > 1 else []) \
            + [_all(f"bit_{'set' if present else 'clear'}({bits[n]})" for n in others).join(
                (f"or(bit_clear({bits[key]}), ", ")")) for key, others, present in deps]
        done = f" %if {_all(ends)}" if ends else ""
        if closed:  # a comma only while a name is left, and below `high` names
            more = f" %if not(is_ones([0:{len(names)}]))" if high is None \
                else f" %if bit_count_lt([0:{len(names)}], {min(len(names), high)})"
            comma = f'\n    | "," {m}::_{more}'
        else:  # names without a bit come any number of times; with `high` (1), no comma
            comma = f'\n    | "," {m}::_' if high is None else ""
        # One member and no condition (maxProperties 1, nothing required): no bits at all.
        bare = not (done or comma)
        members = []
        for bit, key in enumerate(names + bitless):
            if key in allowed:
                value = self.node(f"{pointer}/properties/{_escape(key)}", allowed[key])
            elif isinstance(extra, dict):
                value = self.node(f"{pointer}/additionalProperties", extra)
            else:
                value = self.embed(True)
            # a name past the bits (`bitless`) comes any number of times, as an unlisted one
            tail = "" if bare else (f" {rest}::set_bit({bit}) %if bit_clear({bit})"
                                    if bit < len(names) else f" {rest}::_")
            members.append(f'{_lark_string(_quote(key))} ":" {value}{tail}')
        if extra is not False:
            value = (self.node(f"{pointer}/additionalProperties", extra)
                     if isinstance(extra, dict) else self.embed(True))
            # not a listed name, nor one listed as `false` (that name is never allowed)
            listed = names + bitless + [k for k in props if k not in allowed]
            # (with no name listed, any JSON string, escapes and all, or the names
            # `propertyNames` allows)
            unlisted = self.embed({"type": "string", **keys}) if keys else self.terminal(
                f"/{_KEY}/ & ~/{_names_regex(listed)}/" if listed else _LEAVES["string"])
            members.append(f'{unlisted} ":" {value}' + ("" if bare else f" {rest}::_"))
            if not names and not keys and not self._is_rule(value):
                return None  # a map of values with nothing to order: embedded whole
        elif len(names) == 1 and not patterns and not self._is_rule(value):
            return None  # one property, nothing to order inside or out: embedded whole
        for key, value in patterns:
            members.append(f'{key} ":" {value}' + ("" if bare else f" {rest}::_"))
        if not names and extra is False and not any(self._is_rule(v) for _, v in patterns):
            return None  # names a pattern matches, values with nothing to order: embedded
        self.objects += len(names) > 1 or not closed
        if bare:
            self._add(m, f"{m}: " + "\n    | ".join(members))
            full = f'"{{" {m} "}}"'
        else:
            self._add(m, f"{m}::_ : " + "\n    | ".join(members))
            self._add(rest, f'{rest}::_ : ""{done}{comma}')
            full = f'"{{" {m}::0x0 "}}"'
        return full if required or low else f'"{{" "}}" | {full}'

    def _patterns(self, pointer: str, node: dict, props: dict, extra) -> list | None:
        """[(key rule, value rule)] of a node's `patternProperties` ([] without them), or None
        where the rewrite cannot state them exactly. A name a pattern matches takes that
        pattern's schema: the key is `_pattern_terminal`'s, else llguidance's JSON string with
        the pattern, embedded. Stated only where such a name takes
        nothing else: `additionalProperties: false` (an unlisted name's terminal cannot
        leave out the names a pattern matches), no listed name matched by a pattern
        (`_may_match`: it would take both schemas), and no name matched by two patterns
        (one pattern, or patterns anchored to literal prefixes apart)."""
        patterns = node.get("patternProperties")
        if patterns is None:
            return []
        if not (isinstance(patterns, dict) and patterns and extra is False
                and all(isinstance(v, (bool, dict)) for v in patterns.values())):
            return None
        if any(_may_match(pattern, name) for pattern in patterns for name in props):
            return None
        if len(patterns) > 1:
            prefixes = [_literal_prefix(pattern) for pattern in patterns]
            if not all(prefixes) or any(a.startswith(b) for a in prefixes for b in prefixes
                                        if a is not b):
                return None
        out = []
        for pattern, sub in patterns.items():
            if sub is False or self._impossible(sub):
                continue  # no name it matches is allowed (additionalProperties is false)
            value = self.node(f"{pointer}/patternProperties/{_escape(pattern)}", sub)
            simple = _pattern_terminal(pattern)
            out.append((self.terminal(simple) if simple is not None
                         else self.embed({"type": "string", "pattern": pattern}), value))
        return out

    def all_of(self, pointer: str, node: dict) -> str | None:
        """An `allOf` of object schemas (`_merge`): the one object they make together is
        written (and the other types every branch allows, embedded); of array schemas
        (`_merged_array`), the one array. Else None (embedded whole)."""
        # A pointer no schema has (an escaped pointer never holds "~a"): the merged node's
        # values are rules of their own.
        inner = f"{pointer}/~allOf"
        found = self._merge(node)
        if found is None:
            array = self._merged_array(node)
            return None if array is None else self.array(inner, array)
        merged, within = found
        self.names[inner] = self.names[pointer]
        others = [t for t in _NOT_OBJECT + ("integer",) if t in within
                  and not (t == "integer" and "number" in within)]
        if self._impossible(merged):  # no object: the other types alone
            return self.embed({"type": others}) if others else None
        body = self.object(inner, merged)
        if body is None or not others:
            return body
        return f"{body} | {self.embed({'type': others})}"

    def _merged_array(self, node) -> dict | None:
        """For a node whose keywords and every branch of its `allOf`s (through `$ref`s) are
        nothing but `type`, `items`, `minItems` and `maxItems`, at least one saying `type:
        array` and none another type: the one array node matching exactly what they all
        match (each item under every branch's `items`, the tightest bounds; as when a
        conditional adds constraints to an array's items). None for any other node."""
        branches = self._conjuncts(node, _ARRAY_CONJUNCTS)
        if branches is None or not any(b.get("type") == "array" for b in branches) \
                or not all(b.get("type", "array") == "array" for b in branches):
            return None
        items = [b["items"] for b in branches if "items" in b]
        lows = [b["minItems"] for b in branches if "minItems" in b]
        highs = [b["maxItems"] for b in branches if "maxItems" in b]
        if not (all(isinstance(i, (bool, dict)) for i in items)
                and all(_count(n) for n in lows + highs)):
            return None
        merged: dict = {"type": "array"}
        if items:
            merged["items"] = items[0] if len(items) == 1 else {"allOf": items}
        if lows:
            merged["minItems"] = max(lows)
        if highs:
            merged["maxItems"] = min(highs)
        return merged

    def _merge(self, node) -> tuple[dict, frozenset] | None:
        """For a node whose keywords and every branch of its `allOf`s (through `$ref`s) are
        nothing but `type`, `properties`, `required` and `additionalProperties`: (the object
        node matching exactly the objects they all match, the types they all allow). An
        object matches them all when each name's value matches each branch's schema for it
        (its `properties` entry, else its `additionalProperties`, each branch on its own),
        and it holds every branch's required names. None for any other node."""
        return self._once("merge", node, lambda: self._merged(node))

    def _merged(self, node) -> tuple[dict, frozenset] | None:
        branches = self._conjuncts(node)
        if branches is None:
            return None
        within = _ALL_TYPES
        for branch in branches:
            types = type_set(branch) if "type" in branch else _ALL_TYPES
            if types is None:
                return None
            within &= types
        if "object" not in within:
            return None  # no object, or a malformed keyword: llguidance says so
        names: dict[str, None] = {}
        for branch in branches:
            names.update(dict.fromkeys(branch.get("properties", {})))
        properties = {key: self._both([branch["properties"][key]
                                       if key in branch.get("properties", {})
                                       else branch.get("additionalProperties", True)
                                       for branch in branches]) for key in names}
        return {"type": "object", "properties": properties,
                "required": [r for branch in branches for r in branch.get("required", [])],
                "additionalProperties": self._both([branch.get("additionalProperties", True)
                                                   for branch in branches])}, within

    def _impossible(self, node, depth: int = 0) -> bool:
        """Whether `node` provably matches nothing: no type is left (`_types`), or it is an
        object (only) that requires a name it forbids, or whose value provably matches
        nothing, or a union whose every branch (with the object keywords beside it) does.
        (A sufficient test: an optional property whose value matches nothing is never
        allowed, as llguidance's own compile leaves it out.)"""
        if isinstance(node, dict) and node.keys() & _ASSERTIONS == {"$ref"}:
            node = self._through_refs(node)  # (one answer per target)
        if not isinstance(node, dict) or not node.keys() & _NARROWING:
            return node is False  # most values: a type and what applies to it
        return self._once("impossible", node,
                          lambda: depth <= 8 and self._proved_impossible(node, depth))

    def _proved_impossible(self, node: dict, depth: int) -> bool:
        if not self._types(node):
            return True
        node = self._through_refs(node)
        if not isinstance(node, dict):
            return False
        keys = node.keys() & _ASSERTIONS
        union = _union(node, keys)
        if union is not None:
            _, branches, own = union
            return isinstance(branches, list) and bool(branches) and all(
                self._impossible({"allOf": [b, own]} if own else b, depth + 1)
                for b in branches)
        if _conjunctive(keys):
            found = self._merge(node)
            if found is None or found[1] != {"object"}:
                return False
            node = found[0]
        elif not keys <= _OBJECT_SET or node.get("type") != "object":
            return False
        props, required = node.get("properties", {}), node.get("required", [])
        extra = node.get("additionalProperties", True)
        if not (isinstance(props, dict) and isinstance(required, list)):
            return False
        return any(not isinstance(name, str) or props.get(name, extra) is False
                   or self._impossible(props.get(name, extra), depth + 1)
                   for name in required)

    def _conjuncts(self, node, allowed=_CONJUNCT_KEYWORDS) -> list[dict] | None:
        """The object keywords (`allowed`) of `node` and of every schema its `allOf`s reach
        (through `$ref`s), one dict per schema, in the schema's order; None when one of them
        holds anything else (or is false, or malformed)."""
        out, todo = [], [node]
        while todo:
            current = todo.pop(0)
            for _ in range(16):
                if not (isinstance(current, dict) and current.keys() & _ASSERTIONS == {"$ref"}):
                    break
                current = self.resolve(current["$ref"])[0]
            if current is True:
                continue
            if not isinstance(current, dict) or len(out) + len(todo) > MAX_PROPERTIES:
                return None
            keys = current.keys() & _ASSERTIONS
            if not keys <= allowed:
                return None
            props = current.get("properties", {})
            required = current.get("required", [])
            if not (isinstance(props, dict) and isinstance(required, list)
                    and all(isinstance(r, str) for r in required)
                    and isinstance(current.get("additionalProperties", True), (bool, dict))):
                return None
            if "allOf" in keys:
                if not (isinstance(current["allOf"], list) and current["allOf"]):
                    return None
                todo.extend(current["allOf"])
            if "$ref" in keys:  # beside other keywords: its target is one more branch
                todo.append({"$ref": current["$ref"]})
            out.append({k: v for k, v in current.items()
                        if k in keys and k not in ("allOf", "$ref")})
        return out

    def array(self, pointer: str, node: dict) -> str | None:
        items = node.get("items", True)
        low, high = node.get("minItems", 0), node.get("maxItems")
        if not isinstance(items, (bool, dict)) or items is False:
            return None
        if not (_count(low) and (high is None or _count(high))):
            return None
        if high is not None and (high > _MAX_ITEMS_WRITTEN or low > high or high == 0):
            return None
        item = self.node(f"{pointer}/items", items)
        if item.startswith("j"):
            return None  # embedded whole
        if high is None:
            more = f' ("," {item})*' if low <= 1 else f' ("," {item}){{{low - 1},}}'
        elif high == 1:
            more = ""
        else:
            more = f' ("," {item}){{{max(low - 1, 0)},{high - 1}}}'
        full = f'"[" {item}{more} "]"'
        return full if low else f'"[" "]" | {full}'

    # -- pieces

    def resolve(self, ref) -> tuple[object, str]:
        """(target node, its pointer) of a local JSON-pointer $ref."""
        known = self._resolved.get(ref) if isinstance(ref, str) else None
        if known is not None:
            return known
        node = pointer_target(self.root, ref)
        if node is None:
            raise _Unsupported(f"$ref {ref!r}")
        self._resolved[ref] = node, ref
        return node, ref

    def embed(self, node) -> str:
        """A rule embedding `node` as llguidance JSON, with the definitions it refers to."""
        if isinstance(node, dict):
            doc = {k: v for k, v in node.items() if k not in _ANNOTATIONS}
        else:
            doc = {} if node is True else {"not": {}}
        text = _dump(doc)
        if '"$ref"' not in text and "$schema" not in doc:
            # What the dump below writes, without a second dump: the same keys appended.
            text = ("{" + self._tail[1:] if text == "{}" else text[:-1] + self._tail) + "}"
            return self._embedded(text)
        if '"$ref"' not in text:  # but "$schema" in doc
            return self._embedded(self._with_tail(doc))
        # Every target the node reaches travels with it under $defs, named by its pointer
        # (`_def_ref`), and every reference is rewritten to it: a target anywhere in the
        # schema (a definition, the root, a property) resolves inside the embedded one.
        refs = _refs(node, self.resolve)
        doc = _with_refs(doc)
        if "$defs" in doc and not isinstance(doc["$defs"], dict):
            raise _Unsupported("$defs is not an object")
        if "$defs" in doc or "$schema" in doc:  # keys the text below would not replace
            defs = doc.setdefault("$defs", {})
            for ref in refs:
                defs["gs" + ref[1:]] = _carried(self.resolve(ref)[0])
            return self._embedded(self._with_tail(doc))
        # The same text as dumping the document with its $defs, each definition dumped once
        # per schema (most embedded nodes of a schema reach the same few definitions).
        defs = ",".join(self._def_text(ref) for ref in refs)
        head = _dump(doc)
        return self._embedded(f'{head[:-1]}{"," if doc else ""}"$defs":{{{defs}}}'
                              f"{self._tail}}}")

    def _with_tail(self, doc: dict) -> str:
        """`doc` dumped with the keys every embedded node carries (the root's $schema, if
        any, replacing the node's; our x-guidance)."""
        if "$schema" in self.root:
            doc["$schema"] = self.root["$schema"]
        doc["x-guidance"] = self.x_guidance
        return _dump(doc)

    def _def_text(self, ref: str) -> str:
        """`"name":definition` of the target of `ref` inside an embedded node's $defs, its
        references rewritten (the same whichever node embeds it)."""
        if ref not in self._defs:
            self._defs[ref] = f"{_dump('gs' + ref[1:])}:{_dump(_carried(self.resolve(ref)[0]))}"
        return self._defs[ref]

    def _embedded(self, text: str) -> str:
        if text not in self.embeds:
            name = self.embeds[text] = f"j{len(self.embeds)}"
            self._add(name, f"{name}: %json {text}")
        return self.embeds[text]

    def terminal(self, body: str) -> str:
        if body not in self.terminals:
            self.terminals[body] = f"T{len(self.terminals)}"
            self.size += len(body)
        return self.terminals[body]

    def _is_rule(self, name: str) -> bool:
        return name.startswith("n")

    def _add(self, name: str, rule: str) -> None:
        self.size += len(rule)
        if self.size > self.budget:
            raise _Unsupported("grammar over its size budget")
        self.rules[name] = rule


# The JSON types, in the order a `type` list is written ("number" holds "integer").
JSON_TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")
_ALL_TYPES = frozenset(JSON_TYPES)


def type_set(node) -> frozenset | None:
    """The JSON types a node's own `type` allows ("number" holds "integer"), None without
    a well-formed one."""
    kind = node.get("type") if isinstance(node, dict) else None
    kinds = [kind] if isinstance(kind, str) else kind
    if not (isinstance(kinds, list) and kinds and all(k in _ALL_TYPES for k in kinds)):
        return None
    out = frozenset(kinds)
    return out | {"integer"} if "number" in out else out


def pointer_target(root, ref) -> object | None:
    """The node of `root` a local JSON-pointer `$ref` ("#", "#/a/0/b~1c") names; None for
    another kind of reference or a pointer to nothing."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _values(node) -> list | None:
    """The values a node's `const` or `enum` allows, None when it has neither."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        return [node["const"]]
    values = node.get("enum")
    return values if isinstance(values, list) else None


def _kind(value) -> str:
    """A JSON value's type, as `type_set` names it ("integer" for integral numbers)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {str: "string", float: "number", type(None): "null", list: "array",
            dict: "object"}[type(value)]


def _same(a, b) -> bool:
    """JSON equality: numbers by value (1 == 1.0), a boolean only to a boolean."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _apart(a: tuple, b: tuple) -> bool:
    """Whether two branches' `_facts` exclude each other: their types are apart, or they
    share only objects and are apart on objects (`_apart_objects`)."""
    common = a[0] & b[0]
    return not common or (common == {"object"} and _apart_objects(a, b))


def _apart_on_objects(a: tuple, b: tuple) -> bool:
    """Whether no object matches both branches: one matches no object, or
    `_apart_objects`."""
    return "object" not in a[0] or "object" not in b[0] or _apart_objects(a, b)


def _apart_objects(a: tuple, b: tuple) -> bool:
    """Whether no object matches both branches: one requires a name that the other does not
    allow (it takes no unlisted name and does not list it), or whose values there the
    other's values for it exclude (whether the other requires the name or not: where
    present, it holds one of those)."""
    _, named_a, required_a, closed_a = a
    _, named_b, required_b, closed_b = b
    if (closed_a and required_b - named_a.keys()) or (closed_b and required_a - named_b.keys()):
        return True
    return any(named_a[k] is not None and named_b[k] is not None
               and (k in required_a or k in required_b)
               and not any(_same(x, y) for x in named_a[k] for y in named_b[k])
               for k in named_a.keys() & named_b.keys())


def _union(node: dict, keys) -> tuple[str, object, dict] | None:
    """(anyOf or oneOf, its branches, the keywords beside it in the node's order) of a node
    with one union beside nothing but what `_merge` takes; else None."""
    unions = keys & {"anyOf", "oneOf"}
    if len(unions) != 1 or not keys - unions <= _CONJUNCT_KEYWORDS:
        return None
    (word,) = unions
    return word, node[word], {k: v for k, v in node.items() if k in keys and k != word}


# The keywords of a `propertyNames` schema the rewrite states (on the names' strings).
_KEY_KEYWORDS = frozenset({"type", "pattern", "minLength", "maxLength", "format", "enum",
                           "const"})


def stated_key_schema(node: dict) -> dict | None:
    """The string keywords of the object node's `propertyNames` that the rewrite states (on
    the keys of a map: no name listed, required, matched by a pattern or spoken of by a
    dependency), {} where it says nothing; None where it says something the rewrite does not
    state (the node is embedded, its `propertyNames` llguidance's: ignored, reported)."""
    keys = key_schema(node.get("propertyNames", True))
    if keys and any(node.get(k) for k in ("properties", "required", "patternProperties",
                                          "dependencies", "dependentRequired",
                                          "dependentSchemas")):
        return None
    return keys


def key_schema(node) -> dict | None:
    """What a `propertyNames` schema says of names, as string keywords: {} where it says
    nothing (`true`, `{}`, `{"type": "string"}`: names are strings), None where it is any
    other schema (`false`, an `anyOf`, ...)."""
    if node is True:
        return {}
    if not isinstance(node, dict):
        return None
    keys = node.keys() & _ASSERTIONS
    if not keys <= _KEY_KEYWORDS or node.get("type", "string") != "string":
        return None
    return {k: node[k] for k in keys if k != "type"}


def absent_names(node) -> list[str] | None:
    """The names of a `not` that says "an object without these": `{"required": [name]}`
    (beside `properties` that say nothing of values), or an `anyOf` of such (each name
    alone), else None."""
    if not isinstance(node, dict):
        return None
    branches = node.get("anyOf") if node.keys() & _ASSERTIONS == {"anyOf"} else [node]
    if not isinstance(branches, list) or not branches:
        return None
    names = []
    for branch in branches:
        # (a `properties` of schemas every value matches says nothing: `{"a": {}}`)
        required = branch.get("required") if isinstance(branch, dict) and (
            branch.keys() & _ASSERTIONS == {"required"}
            or (branch.keys() & _ASSERTIONS == {"required", "properties"}
                and isinstance(branch["properties"], dict)
                and all(v in ({}, True) for v in branch["properties"].values()))) else None
        if not (isinstance(required, list) and len(required) == 1
                and isinstance(required[0], str)):
            return None
        names.append(required[0])
    return names


def excluded_names(node) -> list[str] | None:
    """The names a dependency's schema (applied to an object that has the dependency's
    name) says are absent, where it says nothing else: `not` of `absent_names`' forms,
    `properties` that are all `false` (what schema_fixes makes of such a `not`), `type:
    object`, and an `allOf` of such; None for any other schema."""
    if not isinstance(node, dict):
        return None
    keys = node.keys() & _ASSERTIONS
    names: dict[str, None] = {}
    for key in keys:
        value = node[key]
        if key == "type" and value == "object":
            continue
        if key == "not":
            found = absent_names(value)
        elif key == "properties":
            found = list(value) if isinstance(value, dict) and value \
                and all(v is False for v in value.values()) else None
        elif key == "allOf" and isinstance(value, list) and value:
            found = []
            for branch in value:
                sub = excluded_names(branch)
                found = None if sub is None or found is None else found + sub
        else:
            found = None
        if found is None:
            return None
        names.update(dict.fromkeys(found))
    return list(names) or None


def _dependencies(node: dict, requires: str) -> list[tuple[str, list[str], bool]] | None:
    """A node's dependencies as (name, names, present): the names `name` requires
    (`requires`' name lists), or those it says are absent (schemas of `excluded_names`' forms
    in `dependencies` up to draft 7, `dependentSchemas` after); None where one is any other
    schema or malformed."""
    out = []
    keywords = [requires] + (["dependentSchemas"] if requires == "dependentRequired" else [])
    for keyword in keywords:
        found = node.get(keyword, {})
        if not isinstance(found, dict):
            return None
        for key, value in found.items():
            if isinstance(value, list) and all(isinstance(n, str) for n in value) \
                    and keyword == requires:
                out.append((key, value, True))
            elif (names := excluded_names(value)) is not None:
                out.append((key, names, False))
            else:
                return None
    return out


def _dependency_names(deps: list, names: list[str], listed) -> list[str]:
    """The names a node's dependencies (`_dependencies`) speak of, beyond the `names`
    given bits and not `listed` in `properties`: each takes a bit too (its value is what
    `additionalProperties` allows, as for an unlisted name), so that the closing brace can
    check them."""
    more: dict[str, None] = {}
    for key, others, _ in deps:
        if others:
            more.update(dict.fromkeys(n for n in (key, *others)
                                      if n not in names and n not in listed))
    return list(more)


def _with_bits(names: list[str], required: list[str], deps: list) -> tuple:
    """(the names that take a bit of the rule's parameter, in `names`' order: the required
    ones first; the listed names past them), or (None, []) when more than
    MAX_PROPERTIES names must have one. Every name has a bit where they fit; past that, the
    required names and those a dependency speaks of keep theirs, then the others in order
    until the bits run out, and the rest take none: each may come any number of times, as
    an unlisted name may (JSON Schema sees the last of a repeated name, and every one of
    them holds its schema here), so an object no longer needs its listed order past 64
    names."""
    if len(names) <= MAX_PROPERTIES:
        return names, []
    must = set(required) | {n for key, others, _ in deps for n in (key, *others)}
    room = MAX_PROPERTIES - sum(n in must for n in names)
    if room < 0:
        return None, []
    keep = must | set([n for n in names if n not in must][:room])
    return [n for n in names if n in keep], [n for n in names if n not in keep]


def _counted(node: dict, found: list, names: list[str], closed: bool, listed) -> tuple | None:
    """(minProperties, maxProperties or None, [(name, the names it requires or excludes,
    whether required)]) of an object node whose listed `names` each have a bit, from its
    dependencies `found` by `_dependencies` (each with only names that may be there); None
    when they cannot be stated: counts where unlisted names may come (they have no bit) but
    "not empty" and "at most one" (the rule's shape states those), a name required by
    another that has no bit, more names required than allowed."""
    low, high = node.get("minProperties", 0), node.get("maxProperties")
    if not (_count(low) and (high is None or _count(high))) or (high is not None and high < 1):
        return None
    if closed and low > len(names):
        return None
    if not closed and (low > 1 or high not in (None, 1)):
        return None
    if high is not None and len(set(node.get("required", ()))) > high:
        return None  # unsatisfiable: llguidance says so

    def never(name: str) -> bool:  # never there: a name without a bit that cannot come
        return closed or name in listed

    deps = []
    for key, others, present in found:
        if key not in names:
            if not never(key):
                return None  # it may come unlisted, without a bit
            continue
        if present and not all(n in names for n in others):
            return None  # a name that cannot be there or be counted
        if not present:
            if any(n not in names and not never(n) for n in others):
                return None
            others = [n for n in others if n in names]
        if others:
            deps.append((key, others, present))
    return low, high, deps


def _may_match(pattern: str, name: str) -> bool:
    """Whether the ECMA-262 regex `pattern` may match somewhere in `name`: Python's `re`,
    with ASCII and with Unicode classes, matching more where the two differ (`.`, `$`
    before a final newline); a pattern `re` cannot read may match."""
    try:
        return any(re.search(pattern, name, flags) for flags in (re.ASCII, 0))
    except (re.error, RecursionError, OverflowError):
        return True


# Characters a pattern's literal prefix is read from (none is special in a regex).
_LITERAL = r"[A-Za-z0-9_-]*"
# An anchored pattern of a literal prefix and at most one ASCII class: `^x-`,
# `^headline_[a-zA-Z0-9_]+`, `^[a-z]*$`.
_SIMPLE_PATTERN = re.compile(
    rf"\^({_LITERAL})(?:\[((?:[a-z]-[a-z]|[A-Z]-[A-Z]|[0-9]-[0-9]|[A-Za-z0-9_])+-?)\]"
    r"([+*]?))?(\$?)")


def _pattern_terminal(pattern: str) -> str | None:
    """A Lark terminal for the names a simple pattern (`_SIMPLE_PATTERN`) matches, as JSON
    strings: the prefix and the class's characters as they are (none needs an escape), the
    rest of the name (where the pattern is not anchored at its end) as unlisted names are
    written (`_KEY`). None for other patterns (embedded as llguidance's JSON string with the pattern). Its lexer
    states repeat where the embed's do not, so masks inside such names are computed in bulk
    (SchemaStore's ninjs: 6 masks over 300 µs in a document against 2)."""
    found = _SIMPLE_PATTERN.fullmatch(pattern)
    if found is None:
        return None
    prefix, chars, repeat, end = found.groups()
    body = prefix + (f"[{chars}]{repeat}" if chars is not None else "")
    return f'/"{body}{"" if end else _KEY_BODY}"/'


def _literal_prefix(pattern: str) -> str:
    """The literal text every match of an anchored pattern (`^abc...`, no alternation)
    begins with; "" for none."""
    if not pattern.startswith("^") or _alternation(pattern):
        return ""
    found = re.match(_LITERAL, pattern[1:]).group()
    # a quantifier after the prefix's last character makes that character optional
    rest = pattern[1 + len(found):]
    return found[:-1] if rest[:1] in ("?", "*", "{") else found


def _alternation(pattern: str) -> bool:
    """Whether a regex has a `|` outside every group and class (or is not well nested)."""
    depth, in_class, escaped = 0, False, False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
        elif char in "()":
            depth += 1 if char == "(" else -1
            if depth < 0:
                return True
        elif char == "|" and depth == 0:
            return True
    return depth != 0 or in_class


def _all(conditions) -> str:
    """The parametric conditions, all of them (`and` takes two)."""
    conditions = list(conditions)
    out = conditions[-1]
    for condition in reversed(conditions[:-1]):
        out = f"and({condition}, {out})"
    return out


def _conjunctive(keys) -> bool:
    """Whether a node with these keywords is for `_merge` (an `allOf`, or a `$ref` beside
    object keywords)."""
    return "allOf" in keys or ("$ref" in keys and keys <= _CONJUNCT_KEYWORDS)


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, bool, int, float))


def of_type(value, kind: str) -> bool:
    """Whether a scalar JSON value is of JSON Schema type `kind`."""
    own = _kind(value)
    return own == kind or (kind == "number" and own == "integer")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _lark_string(text: str) -> str:
    """A Lark string literal matching `text` exactly (Lark's strings are JSON's, less a
    raw DEL)."""
    return _quote(text).replace("\x7f", "\\u007f")


def _names_regex(names: list[str]) -> str:
    """A regex (inside /.../) matching exactly the listed names as JSON strings."""
    quoted = (re.escape(_quote(n)) for n in names)
    return "(?:" + "|".join(quoted).replace("/", "\\/") + ")"


def _refs(node, resolve) -> list[str]:
    """Every $ref reachable from `node`, following local ones (each target once)."""
    seen: list[str] = []
    stack = [(node, False)]  # (value, whether its keys are names: a property named "$ref")
    while stack:
        current, names = stack.pop()
        if isinstance(current, dict):
            for key, value in current.items():
                if names:
                    stack.append((value, False))
                elif key == "$ref" and isinstance(value, str):
                    if value not in seen:
                        seen.append(value)
                        stack.append((resolve(value)[0], False))
                elif key not in _DATA:
                    stack.append((value, key in MAP_KEYS))
        elif isinstance(current, list):
            stack.extend((value, False) for value in current)
    return seen


def _def_ref(ref: str) -> str:
    """Where an embedded node's $defs hold the target of the local `ref`."""
    return "#/$defs/" + _escape("gs" + ref[1:])


def _with_refs(node, names: bool = False):
    """A copy of `node` with each local `$ref` pointing into the embedded node's $defs
    (`_def_ref`; data left alone; `names`: the keys of `node` are names, as in `properties`).
    Every local reference a node reaches travels with it (`_refs`), so each one is
    rewritten."""
    if isinstance(node, dict):
        if names:
            return {k: _with_refs(v) for k, v in node.items()}
        return {k: (_def_ref(v) if k == "$ref" and isinstance(v, str) and _local(v)
                    else v if k in _DATA else _with_refs(v, k in MAP_KEYS))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_with_refs(v) for v in node]
    return node


def _carried(node):
    """A target as it travels under an embedded node's $defs: `_with_refs`, without the
    root's `$id` (a base URI there, against which llguidance would resolve the rewritten
    references, failing; `$id`s below the root are refused)."""
    out = _with_refs(node)
    if isinstance(out, dict):
        out.pop("$id", None)
    return out


def _local(ref: str) -> bool:
    return ref == "#" or ref.startswith("#/")


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _check_ids(node, top: bool) -> None:
    """Refuse nested `$id`s and anchors: references would resolve against them."""
    stack = [(node, top)]
    while stack:
        current, is_top = stack.pop()
        if isinstance(current, dict):
            if (not is_top and isinstance(current.get("$id"), str)) or \
                    "$anchor" in current or "$dynamicAnchor" in current:
                raise _Unsupported("$id or anchor below the root")
            stack.extend((v, False) for k, v in current.items() if k not in _DATA)
        elif isinstance(current, list):
            stack.extend((v, False) for v in current)
