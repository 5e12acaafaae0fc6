"""JSON Schema keywords a backend compiles without enforcing, and the walks that find them.

The table is xgrammar's. llguidance refuses what it cannot enforce, or, compiled leniently,
says in its warnings what it ignored or approximated; `llguidance_unenforced` turns those
warnings into the same kind of report (see grammar_service.choice).

Each entry of UNENFORCED carries its evidence: a schema using the keyword and an instance on
which xgrammar's compiled grammar and the schema disagree (the schema rejects it and the
grammar accepts it, or the other way round). tests/test_grammar_unenforced.py compiles every
example with real xgrammar, so an upgrade that starts enforcing a keyword fails a test and
the entry can be dropped. Keywords found enforced when this table was made (so absent here):
minLength/maxLength without a pattern (up to the rewrite cap of schema_fixes), minimum/maximum and their exclusive forms,
multipleOf (integer, on type integer, no range), enum, const, propertyNames, min/maxProperties, min/maxItems, prefixItems,
anyOf, additionalProperties, unevaluatedProperties/Items, local $ref, and the formats in
ENFORCED_FORMATS, each on a node that names its `type` (see TYPE_KEYWORDS).

Reported paths: the keyword's location from the schema root, joined by dots, array indices
as numbers: `not`, `properties.name.minLength`, `anyOf.1.format`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from grammar_service.schema_fixes import bounded_length_is_rewritten

# Format values xgrammar 0.2.9 turns into a grammar; any other value is accepted as a string.
ENFORCED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "uri", "uri-reference", "uri-template",
    "ipv4", "ipv6", "hostname", "uuid", "json-pointer", "relative-json-pointer",
})


def _always(node: dict) -> bool:
    return True


def _length_unenforced(node: dict) -> bool:
    # Next to a pattern xgrammar drops the bound. Without one it enforces the bound but lets
    # raw control characters into the string, which schema_fixes rewrites away only up to
    # MAX_REWRITTEN_LENGTH (a longer repetition explodes the compile).
    if "pattern" in node:
        return True
    return (node.get("type") == "string" and not {"format", "enum", "const"} & node.keys()
            and not bounded_length_is_rewritten(node))


def _unknown_format(node: dict) -> bool:
    return node.get("format") not in ENFORCED_FORMATS


_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _multiple_not_plain_integer(node: dict) -> bool:
    # Enforced only as an integer on type integer with no range next to it (a range drops it).
    value = node.get("multipleOf")
    plain = isinstance(value, int) and node.get("type") == "integer"
    return not plain or any(k in node for k in _RANGE)


# Beside a $ref, these say nothing about the instance.
_NOT_ASSERTIONS = frozenset({"$ref", "$defs", "definitions", "$schema", "$id", "$anchor",
                             "$comment", "title", "description", "default", "examples"})


def _ref_with_siblings(node: dict) -> bool:
    return bool(node.keys() - _NOT_ASSERTIONS)


def _lookaround(node: dict) -> bool:
    pattern = node.get("pattern")
    return isinstance(pattern, str) and any(a in pattern for a in ("(?=", "(?!", "(?<"))


def _requires_unlisted(node: dict) -> bool:
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    return any(name not in listed for name in required)


def _escaped_property_name(node: dict) -> bool:
    names = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    return any(c in '"\\' or c < " " for name in names for c in name)


@dataclass(frozen=True)
class Unenforced:
    """One keyword xgrammar does not enforce, when `applies(schema_node)`, with evidence."""

    keyword: str
    applies: Callable[[dict], bool]
    example_schema: dict
    example_instance: object
    why: str


_INT_OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
_INT_ARRAY = {"type": "array", "items": {"type": "integer"}}

UNENFORCED: tuple[Unenforced, ...] = (
    Unenforced("not", _always,
               {"type": "integer", "not": {"const": 3}}, 3, "ignored"),
    Unenforced("oneOf", _always,
               {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, 3,
               "treated as anyOf"),
    Unenforced("allOf", _always,
               {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 5}]},
               9, "approximated"),
    Unenforced("minLength", _length_unenforced,
               {"type": "string", "pattern": "^[a-z]+$", "minLength": 5}, "ab",
               "dropped next to a pattern; above schema_fixes.MAX_REWRITTEN_LENGTH raw "
               "control characters are accepted"),
    Unenforced("maxLength", _length_unenforced,
               {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, "abcde",
               "dropped next to a pattern; above schema_fixes.MAX_REWRITTEN_LENGTH raw "
               "control characters are accepted"),
    Unenforced("format", _unknown_format,
               {"type": "string", "format": "regex"}, "((",
               "values outside ENFORCED_FORMATS accept any string"),
    Unenforced("dependencies", _always,
               {**_INT_OBJ, "$schema": "http://json-schema.org/draft-07/schema#",
                "dependencies": {"a": ["b"]}}, {"a": 1}, "ignored (draft-07 keyword)"),
    Unenforced("dependentRequired", _always,
               {**_INT_OBJ, "dependentRequired": {"a": ["b"]}}, {"a": 1}, "ignored"),
    Unenforced("dependentSchemas", _always,
               {**_INT_OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, "ignored"),
    Unenforced("if", _always,
               {**_INT_OBJ, "if": {"properties": {"a": {"const": 1}}},
                "then": {"required": ["b"]}}, {"a": 1}, "if/then/else ignored"),
    Unenforced("uniqueItems", _always,
               {**_INT_ARRAY, "uniqueItems": True}, [1, 1], "ignored"),
    Unenforced("contains", _always,
               {**_INT_ARRAY, "contains": {"const": 5}}, [1, 2], "ignored"),
    Unenforced("minContains", _always,
               {**_INT_ARRAY, "contains": {"const": 5}, "minContains": 2}, [1, 2], "ignored"),
    Unenforced("maxContains", _always,
               {**_INT_ARRAY, "contains": {"const": 5}, "maxContains": 1}, [5, 5], "ignored"),
    Unenforced("multipleOf", _multiple_not_plain_integer,
               {"type": "number", "multipleOf": 0.5}, 0.3,
               "enforced only as an integer on type integer without minimum/maximum"),
    Unenforced("patternProperties", _always,
               {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, {"xa": 1},
               "ignored: matching properties are refused as unlisted"),
    Unenforced("required", _requires_unlisted,
               {"type": "object", "required": ["a"]}, {},
               "a required property missing from `properties` is refused with unlisted "
               "properties forbidden, and not required with them allowed"),
    Unenforced("properties", _escaped_property_name,
               {"properties": {'foo"bar': {"type": "number"}}}, {'foo"bar': "1"},
               "a property name that needs a JSON escape is never matched: refused with "
               "unlisted properties forbidden, taken with any value with them allowed"),
    Unenforced("pattern", _lookaround,
               {"type": "string", "pattern": "^(?!x).*$"}, "xa",
               "lookahead and lookbehind assertions are ignored"),
    Unenforced("$ref", _ref_with_siblings,
               {"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "maximum": 5}, 9,
               "keywords beside a $ref are ignored (the referenced schema alone applies)"),
)

# Keywords that constrain one instance type. On a node that names no `type` and has no
# keyword xgrammar infers one from (_INFERS), xgrammar 0.2.9 compiles "any JSON value" and
# ignores them: {"maxLength": 1} accepts "abc". Each has its evidence in TYPELESS_EXAMPLES.
TYPE_KEYWORDS = {
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "array": ("minItems", "maxItems"),
    "object": ("required", "minProperties", "maxProperties", "propertyNames"),
}
_INFERS = {"object": ("properties", "additionalProperties", "patternProperties"),
           "array": ("items", "prefixItems")}
_FAMILY = {keyword: family for family, keywords in TYPE_KEYWORDS.items() for keyword in keywords}
TYPELESS_EXAMPLES = {
    "minLength": ({"minLength": 3}, "a"), "maxLength": ({"maxLength": 1}, "abc"),
    "pattern": ({"pattern": "^a$"}, "b"), "format": ({"format": "ipv4"}, "x"),
    "minimum": ({"minimum": 3}, 1), "maximum": ({"maximum": 3}, 9),
    "exclusiveMinimum": ({"exclusiveMinimum": 3}, 3),
    "exclusiveMaximum": ({"exclusiveMaximum": 3}, 3), "multipleOf": ({"multipleOf": 2}, 3),
    "minItems": ({"minItems": 2}, [1]), "maxItems": ({"maxItems": 1}, [1, 2]),
    "required": ({"required": ["a"]}, {}), "minProperties": ({"minProperties": 1}, {}),
    "maxProperties": ({"maxProperties": 0}, {"a": 1}),
    "propertyNames": ({"propertyNames": {"maxLength": 1}}, {"ab": 1}),
}


def _typeless(node: dict, keyword: str) -> bool:
    family = _FAMILY.get(keyword)
    if family is None or "type" in node:
        return False
    return not any(k in node for k in _INFERS.get(family, ()))

_BY_KEYWORD = {entry.keyword: entry for entry in UNENFORCED}
# Keywords xgrammar ignores wherever they stand: a schema using one anywhere is approximated
# on xgrammar too, which its walk would only confirm.
ALWAYS_UNENFORCED = frozenset(e.keyword for e in UNENFORCED if e.applies is _always)

# Keywords whose value is one subschema / a map of subschemas / a list of subschemas.
_ONE = ("not", "if", "then", "else", "contains", "additionalProperties", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems", "items")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def find_unenforced(schema) -> list[str]:
    """Paths of the keywords in `schema` that xgrammar would not enforce, in walk order.

    Pure; `schema` is the parsed JSON. Unknown shapes are skipped (validated elsewhere).
    """
    return list(_walk(schema, ""))


def _walk(node, path: str) -> Iterator[str]:
    if not isinstance(node, dict):
        return
    for keyword in node:
        entry = _BY_KEYWORD.get(keyword)
        if (entry is not None and entry.applies(node)) or _typeless(node, keyword):
            yield _join(path, keyword)
    for keyword in _ONE:
        if isinstance(node.get(keyword), dict):
            yield from _walk(node[keyword], _join(path, keyword))
    for keyword in _MAP:
        if isinstance(node.get(keyword), dict):
            for name, sub in node[keyword].items():
                yield from _walk(sub, _join(path, f"{keyword}.{name}"))
    for keyword in _LIST:
        if isinstance(node.get(keyword), list):
            for i, sub in enumerate(node[keyword]):
                yield from _walk(sub, _join(path, f"{keyword}.{i}"))
    if isinstance(node.get("dependencies"), dict):
        for name, sub in node["dependencies"].items():
            yield from _walk(sub, _join(path, f"dependencies.{name}"))


def _join(path: str, part: str) -> str:
    return f"{path}.{part}" if path else part


# llguidance's lenient warnings (1.9.1) and the keywords they name; any other warning makes
# `llguidance_unenforced` give up, so nothing llguidance relaxed goes unreported.
# A warning said N times ends with " (N times)".
_LLG_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*)\](?: \(\d+ times\))?')
_LLG_FORMAT = re.compile(r"Unknown format: (.+?)(?: \(\d+ times\))?")
_LLG_ONE_OF = "oneOf not fully supported, falling back to anyOf"
# Said once for any object where it ignores the bounds: every such bound is reported.
_LLG_PROPERTY_COUNT = "min/maxProperties only supported when all keys listed in"


def llguidance_unenforced(schema, warnings) -> list[str] | None:
    """Paths in `schema` of the keywords llguidance's lenient `warnings` say it did not
    enforce (every occurrence of a named keyword, every `format` with a named value), or
    None when a warning is not one of the known kinds (then the grammar must not be used).
    Pure."""
    keywords: set[str] = set()
    formats: set[str] = set()
    for warning in warnings:
        if (m := _LLG_UNIMPLEMENTED.fullmatch(warning)) is not None:
            try:
                keywords.update(json.loads(f"[{m.group(1)}]"))
            except ValueError:
                return None
        elif (m := _LLG_FORMAT.fullmatch(warning)) is not None:
            formats.add(m.group(1))
        elif warning.startswith(_LLG_ONE_OF):
            keywords.add("oneOf")
        elif warning.startswith(_LLG_PROPERTY_COUNT):
            keywords.update(("minProperties", "maxProperties"))
        else:
            return None
    if not (keywords or formats):
        return []  # no warning: nothing to look for, no walk
    paths = list(_walk_keywords(schema, "", keywords, formats))
    return paths if paths or not (keywords or formats) else None


def _walk_keywords(node, path: str, keywords: set[str], formats: set[str]) -> Iterator[str]:
    if not isinstance(node, dict):
        return
    for keyword in node:
        if keyword in keywords or (keyword == "format" and node[keyword] in formats):
            yield _join(path, keyword)
    for keyword, value in node.items():
        if keyword in ("enum", "const", "default", "examples"):
            continue
        if isinstance(value, dict):
            if keyword in _MAP or keyword == "dependencies":
                for name, sub in value.items():
                    yield from _walk_keywords(sub, _join(path, f"{keyword}.{name}"), keywords,
                                              formats)
            else:
                yield from _walk_keywords(value, _join(path, keyword), keywords, formats)
        elif isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _walk_keywords(sub, _join(path, f"{keyword}.{i}"), keywords, formats)


# What llguidance (1.9.1) refuses even when lenient, and gramserve relaxes in the schema it
# compiles (reporting the keyword unenforced) rather than falling back to xgrammar for the whole
# schema: a regex its engine cannot parse (look-around, back-references) as a `pattern` or a
# `patternProperties` name, and an integer lower bound at or below -2**63 (its integer-range
# regex overflows there; such bounds are int64's, written by schema generators). A regex is
# replaced by `superset_regex`'s (what it matches, and more) where llguidance parses that, and
# dropped otherwise; a bound is dropped. Either way the compiled schema accepts at least what
# the keyword allowed: a `pattern` dropped allows any string, and a `patternProperties` name
# widened lets more names take its subschema. (A name dropped would send the names it matched
# to `additionalProperties`, which is usually `false`: valid objects refused.)
_LLG_REGEX_ERROR = "regex parse error"
_LLG_INT_RANGE = "Failed to generate regex for integer range"
_LOWER_BOUNDS = ("minimum", "exclusiveMinimum")
# What a back-reference is widened to: any text.
_ANY_TEXT = "(?:[\\s\\S]*)"


def superset_regex(regex: str) -> str | None:
    """`regex` without the constructs llguidance's engine cannot parse, so that it matches
    every string `regex` matches (searched, as JSON Schema does) and possibly more: look-around
    groups are removed (an assertion only ever takes matches away), back-references (`\\1`,
    `\\k<name>`, `(?P=name)`) match any text. None when there is nothing to remove, the
    text is malformed (an unbalanced group) or an assertion is quantified."""
    out: list[str] = []
    i, n, changed = 0, len(regex), False
    in_class = False
    while i < n:
        c = regex[i]
        if c == "\\" and i + 1 < n:
            nxt = regex[i + 1]
            if not in_class and nxt.isdigit() and nxt != "0":
                j = i + 1
                while j < n and regex[j].isdigit():
                    j += 1
                out.append(_ANY_TEXT)
                i, changed = j, True
                continue
            if not in_class and nxt == "k" and i + 2 < n and regex[i + 2] in "<{'":
                close = regex.find({"<": ">", "{": "}", "'": "'"}[regex[i + 2]], i + 3)
                if close < 0:
                    return None
                out.append(_ANY_TEXT)
                i, changed = close + 1, True
                continue
            out.append(regex[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            out.append(c)
            # a "]" (or "^]") right after the bracket is a member, not the end
            j = i + 1
            if j < n and regex[j] == "^":
                out.append("^")
                j += 1
            if j < n and regex[j] == "]":
                out.append("]")
                j += 1
            i = j
            continue
        if regex.startswith(("(?=", "(?!", "(?<=", "(?<!"), i):
            end = _group_end(regex, i)
            if end is None or regex[end:end + 1] in ("*", "+", "?", "{"):
                return None  # a quantified assertion: removing it would move the quantifier
            i, changed = end, True
            continue
        if regex.startswith("(?P=", i):
            close = regex.find(")", i)
            if close < 0:
                return None
            out.append(_ANY_TEXT)
            i, changed = close + 1, True
            continue
        out.append(c)
        i += 1
    return "".join(out) if changed else None


def _group_end(regex: str, start: int) -> int | None:
    """The index after the group opening at `start` (escapes and classes skipped); None when
    it never closes."""
    depth, i, n, in_class = 0, start, len(regex), False
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if regex.startswith("^]", i + 1) or regex.startswith("]", i + 1):
                i = regex.index("]", i + 1) + 1
                continue
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def llguidance_relaxed(schema, error: str) -> tuple[dict, list[str]] | None:
    """`schema` with the keywords llguidance's lenient compile `error` is about relaxed (see
    above), and their paths, for the caller to compile and report; None when the error is of
    another kind or names nothing found. Pure: `schema` is not changed."""
    if _LLG_REGEX_ERROR in error:
        from llguidance import LLMatcher

        def unparsable(regex) -> bool:
            return isinstance(regex, str) and _LLG_REGEX_ERROR in LLMatcher.validate_grammar(
                LLMatcher.grammar_from_regex(regex))

        def wider(regex: str) -> str | None:
            relaxed = superset_regex(regex)
            return relaxed if relaxed is not None and not unparsable(relaxed) else None

        def refused(keyword: str, value):
            return keyword == "pattern" and unparsable(value) and (wider(value) or _DROP)

        def refused_name(keyword: str, name: str):
            return keyword == "patternProperties" and unparsable(name) and (wider(name) or _DROP)
    elif _LLG_INT_RANGE in error:
        def refused(keyword: str, value):
            return (keyword in _LOWER_BOUNDS and isinstance(value, int | float)
                    and not isinstance(value, bool) and float(value) <= -2.0 ** 63) and _DROP

        def refused_name(keyword: str, name: str):
            return False
    else:
        return None
    paths: list[str] = []
    relaxed = _without(schema, "", refused, refused_name, paths)
    return (relaxed, paths) if paths else None


# `_without`'s callbacks: falsy keeps the keyword or name, _DROP drops it, a string replaces
# the value (a keyword's) or the name (a map entry's).
_DROP = object()


def _without(node, path: str, drop: Callable[[str, object], object],
             drop_name: Callable[[str, str], object], paths: list[str]):
    """A copy of `node` with the keywords `drop` picks and the map entries `drop_name` picks
    dropped or replaced (see `_DROP`), their paths appended to `paths` (the walk of
    `_walk_keywords`). A replaced name that is already in its map is dropped instead."""
    if isinstance(node, list):
        return [_without(sub, _join(path, str(i)), drop, drop_name, paths)
                for i, sub in enumerate(node)]
    if not isinstance(node, dict):
        return node
    out = {}
    for keyword, value in node.items():
        verdict = drop(keyword, value)
        if verdict:
            paths.append(_join(path, keyword))
            if verdict is not _DROP:
                out[keyword] = verdict
        elif keyword in ("enum", "const", "default", "examples") or not isinstance(
                value, dict | list):
            out[keyword] = value
        elif isinstance(value, dict) and (keyword in _MAP or keyword == "dependencies"):
            out[keyword] = {}
            renamed = {}
            for name, sub in value.items():
                where = _join(path, f"{keyword}.{name}")
                verdict = drop_name(keyword, name)
                if verdict:
                    paths.append(where)
                    if verdict is not _DROP and verdict not in value:
                        renamed[verdict] = _without(sub, where, drop, drop_name, paths)
                else:
                    out[keyword][name] = _without(sub, where, drop, drop_name, paths)
            for name, sub in renamed.items():
                out[keyword].setdefault(name, sub)
        else:
            out[keyword] = _without(value, _join(path, keyword), drop, drop_name, paths)
    return out
