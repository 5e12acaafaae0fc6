"""Rewrites of a JSON schema applied to the text one backend compiles (never to the cache key,
the unenforced-keyword report or the gateway's validation, which use the schema as sent).

xgrammar, length-bounded strings (`fix_schema`): for `{"type": "string", "minLength"/
"maxLength": ...}` without a `pattern`, xgrammar 0.2.9's grammar accepts raw control
characters (a tab, U+000F) inside the string, which is not even valid JSON. Such a string
becomes the equivalent pattern over characters that need no escape,
`^[^"\\\\\\x00-\\x1f]{min,max}$` (xgrammar enforces patterns, and already refuses escapes in
these strings). A bounded repetition costs xgrammar compile time that grows faster than the
bound (measured, 4k vocabulary, one thread: 256 → 20 ms, 512 → 75 ms, 1024 → 0.42 s,
2048 → 1.6 s; 8192 took 42 s on a real schema), and it was the mask tail: at a 150k
vocabulary a 0-256 repetition made each mask inside the string cost 153 ms at the median
(bench/mask_tail.py; 0.9 ms without the rewrite), and from a bound of 32 it tripled the
compile. Up to 16 it costs what xgrammar's own bound costs. So bounds above
`MAX_REWRITTEN_LENGTH` are left as written and `unenforced.find_unenforced` reports the
keyword instead. llguidance enforces length bounds in its lexer and needs none of this.

Both backends, integral bounds (`integral_bounds`, part of both fixes below): a bound such
as `maxLength: 2.0` is the integer 2 to JSON Schema; xgrammar ignored it (accepting any
length) and llguidance refused the schema, so such values become integers.

llguidance, date and time formats (`fix_schema_llguidance`): llguidance's `date`,
`time` and `date-time` accept 29 February of any year and a leap second at any minute. Such a
`format` becomes the pattern `FORMAT_PATTERNS` gives (beside any pattern already there, in
an `allOf`, which llguidance intersects): exact leap years, and a leap second only as
23:59:60 in UTC (`Z` or `±00:00`), so the rare leap second written with another offset is
refused rather than an invalid time accepted.

llguidance, names never there (`fix_schema_llguidance`): llguidance does not implement
`not`, and the commonest `not` says that a name (or any of a few) is absent, as in
mutually exclusive properties: `{"not": {"required": ["a"]}}` or `{"not": {"anyOf":
[{"required": ["a"]}, {"required": ["b"]}]}}`. `required` holds for every non-object, so
such a `not` is exactly "an object where these names are never there": the node's `allOf`
gets `{"type": "object", "properties": {"a": false, ...}}` in its place, which llguidance
enforces (and the any-order rewrite reads as object keywords).

llguidance, names that are strings (`fix_schema_llguidance`): a `propertyNames` that says
only that names are strings (`{"type": "string"}`, as schema generators write for every map)
says nothing, and is left out rather than reported unenforced.

llguidance, other types (`fix_schema_llguidance`): a `not` of types alone (`{"not":
{"type": "null"}}`) is the other types, the node's own `type` narrowed to them.

llguidance, a union on one name written with `if` (`fix_schema_llguidance`): llguidance
does not implement `if` / `then` / `else`. Where the node is an object that requires a name
and `if` says only that the name's value is among some scalars (`{"properties": {"p":
{"const": c}}}` or an `enum`, maybe with `"required": ["p"]` and `"type": "object"`), the
conditional is exactly a choice of two: the value among them and `then`, or another value
and `else`. "Another value" is the rest of the node's own `const` or `enum` for the name, or
nothing more where `else` itself pins the name to other values; a side that `then` or
`else` already implies (a `$ref` to an object requiring the name with its own const or
enum, as discriminated unions write it) is that schema alone. The three
keywords become the node's `anyOf` (where it has none, and this is its one conditional: an
`allOf` of unions llguidance refuses or multiplies out), which llguidance enforces and the
any-order rewrite writes side by side. Any other `if` stays and is reported unenforced.

llguidance, names written as patterns (`fix_schema_llguidance`): a `patternProperties`
regex that matches a fixed set of names (`^name$`, `^(a|b)$`: `pattern_names`) is those
names in `properties` (with the `properties` entry, where a name has one, in an `allOf`):
the same schema (`patternProperties` apply to listed names too, and neither kind is
additional), but names a rule's bit can track, so the object takes any order where it
otherwise kept the schema's (appsettings.json lists its sections this way).

llguidance, what it ignores anyway (`without_ignored`): compiled leniently, llguidance
ignores the keywords it does not implement (`LLG_IGNORED`: `not`, `if`/`then`/`else`,
`uniqueItems`, `contains`, `propertyNames`, `unevaluatedProperties`, ...; and `dependencies`
whose value is a schema) and names them in a warning ("Unimplemented keys: [...]"), which is
reported. But the any-order rewrite (grammar_service.property_order) cannot state an object
holding one, so it embedded the object whole, and llguidance fixed its property order: valid
documents with their keys in another order were refused for a keyword that was not enforced
at all. The rewrite now reads the schema without them (what llguidance enforces is the same)
and the compile says, as llguidance would have, which keywords it left out.

options.strict, unlisted properties (`forbid_unlisted_properties`): strict must mean on
llguidance what xgrammar's strict_mode means, so an object schema that lists `properties`
and says nothing about other properties gets `additionalProperties: false`.
"""

from __future__ import annotations

import re
from typing import Any

from grammar_service.property_order import (
    JSON_TYPES,
    MAP_KEYS,
    absent_names,
    excluded_names,
    of_type,
    pointer_target,
    requires_keyword,
    stated_key_schema,
    type_set,
)

# Keys whose values are data, not subschemas.
DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})
# Keywords that say nothing about an instance (beside the one that does, in a `not`).
_NOTES = frozenset({"title", "description", "$comment", "markdownDescription"})
_UNESCAPED_CHAR = '[^"\\\\\\x00-\\x1f]'
# The largest minLength / maxLength rewritten into a repetition for xgrammar (see above).
MAX_REWRITTEN_LENGTH = 16
# Next to these, `additionalProperties: false` would refuse properties the schema allows
# (it sees sibling `properties` only), so such nodes are left as they are.
_COMBINED = frozenset({"additionalProperties", "unevaluatedProperties", "patternProperties",
                       "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas"})


_DIGIT = "[0-9]"  # not \\d: llguidance's \\d is any Unicode digit
_LEAP_YEAR = (f"(?:{_DIGIT}{_DIGIT}(?:0[48]|[2468][048]|[13579][26])"
              "|(?:[02468][048]|[13579][26])00)")
_DATE = (f"(?:{_DIGIT}{{4}}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]{_DIGIT}|3[01])"
         f"|(?:0[469]|11)-(?:0[1-9]|[12]{_DIGIT}|30)|02-(?:0[1-9]|1{_DIGIT}|2[0-8]))"
         f"|{_LEAP_YEAR}-02-29)")
_FRACTION = f"(?:\\.{_DIGIT}+)?"
_TIME = (f"(?:(?:[01]{_DIGIT}|2[0-3]):[0-5]{_DIGIT}:[0-5]{_DIGIT}{_FRACTION}"
         f"(?:[Zz]|[+-](?:[01]{_DIGIT}|2[0-3]):[0-5]{_DIGIT})"
         f"|23:59:60{_FRACTION}(?:[Zz]|[+-]00:00))")
# RFC 3339 full-date, full-time and date-time, as JSON Schema's formats (see above).
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$",
                   "date-time": f"^{_DATE}[Tt]{_TIME}$"}
# Keywords whose value is a count: 2.0 means 2.
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_LLG_FIX_TEXT = re.compile(
    rf'"(?:{"|".join(_COUNTS)})"\s*:\s*-?[0-9]+[.eE]'
    rf'|"format"\s*:\s*"(?:{"|".join(FORMAT_PATTERNS)})"'
    r'|"not"\s*:\s*\{\s*"(?:required|anyOf|type|properties)"'
    r'|"if"\s*:\s*\{'
    r'|"propertyNames"\s*:\s*(?:true|\{\s*\}|\{\s*"type"\s*:\s*"string"\s*\})'
    r'|"\^[^"]*\$"\s*:')  # a name that is an anchored regex: a patternProperties key


def fix_schema(schema: Any) -> Any:
    """A copy of `schema` with the xgrammar rewrites (integral bounds, bounded strings)
    applied at every depth (no state changed)."""
    return _map(schema, lambda node: _fix_node(_integral_node(node)))


def fix_schema_llguidance(schema: Any) -> Any:
    """A copy of `schema` with the llguidance rewrites (integral bounds, names written as
    patterns, exact date and time formats, names never there, unions written with `if`)
    applied at every depth (no state changed)."""
    return _map(schema, lambda node: _conditional_node(_absent_node(_not_type_node(
        _format_node(_named_patterns_node(_integral_node(_names_node(node)))))), schema))


def llguidance_fix_applies(text: str) -> bool:
    """Whether `fix_schema_llguidance` can change the schema whose JSON `text` this is
    (json.dumps output): only a count written with a fraction or exponent, a date or time
    format, a `not` of required names, an `if` or an anchored `patternProperties` regex can.
    False spares the walk, which copies every node."""
    return _LLG_FIX_TEXT.search(text) is not None


# Keywords llguidance 1.9.1 knows but does not implement (its json/schema.rs IMPLEMENTED list
# against the drafts' keywords): a lenient compile ignores each, warning "Unimplemented keys".
# `dependencies` and `dependentRequired` are not here: the any-order rewrite states their
# name lists (`dependencies` loses only its schema entries, `dependentSchemas`'s form).
LLG_IGNORED = frozenset({
    "not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
    "propertyNames", "dependentSchemas", "unevaluatedProperties", "unevaluatedItems"})
_LLG_IGNORED_TEXT = re.compile(
    rf'"(?:{"|".join(sorted(LLG_IGNORED))}|dependencies)"\s*:')


def without_ignored(schema: Any, text: str) -> tuple[Any, tuple[str, ...]]:
    """(`schema` without what llguidance's lenient compile ignores, the keywords left out):
    every `LLG_IGNORED` keyword of every subschema, and `dependencies`, but what the rewrite
    states: up to draft 7 the name lists of `dependencies` and its schemas that say names are
    absent (`excluded_names`), after it such schemas of `dependentSchemas`; a
    `propertyNames` of string keywords on a map (`stated_key_schema`).
    `text`: the schema's JSON, which spares the walk (and the copy) when no such keyword is
    in it.
    Compiled leniently the result enforces what `schema` does on llguidance; the caller
    reports the keywords (as llguidance's warning would)."""
    if _LLG_IGNORED_TEXT.search(text) is None:
        return schema, ()
    dropped: set[str] = set()
    # `dependencies` holds name lists the rewrite states where it is that draft's keyword
    lists = isinstance(schema, dict) and requires_keyword(schema) == "dependencies"

    def drop(node: dict) -> dict:
        for key in node.keys() & LLG_IGNORED:
            if key == "dependentSchemas" and not lists:
                keep(node, key, lambda v: excluded_names(v) is not None)
            elif key == "propertyNames" and stated_key_schema(node):
                pass  # the names' string keywords: the rewrite states them on a map's keys
            else:
                del node[key]
                dropped.add(key)
        if "dependencies" in node:
            keep(node, "dependencies", lambda v: lists and (
                isinstance(v, list) or excluded_names(v) is not None))
        return node

    def keep(node: dict, key: str, stated) -> None:
        # The entries the rewrite states (name lists, names excluded) stay; others go.
        entries = node[key]
        kept = {k: v for k, v in entries.items() if stated(v)} \
            if isinstance(entries, dict) else {}
        if kept != entries:
            dropped.add(key)
        if kept:
            node[key] = kept
        else:
            del node[key]

    out = _map(schema, drop)
    return out, tuple(sorted(dropped))


def _integral_node(node: dict) -> dict:
    for key in _COUNTS:
        value = node.get(key)
        if isinstance(value, float) and value.is_integer() and value >= 0:
            node[key] = int(value)
    return node


def _named_patterns_node(node: dict) -> dict:
    patterns, props = node.get("patternProperties"), node.get("properties", {})
    if not (isinstance(patterns, dict) and patterns and isinstance(props, dict)):
        return node
    named = {pattern: names for pattern in patterns
             if (names := pattern_names(pattern)) is not None}
    if not named:
        return node
    props = node["properties"] = dict(props)
    for pattern, names in named.items():
        sub = patterns.pop(pattern)
        for name in names:
            props[name] = {"allOf": [props[name], sub]} if name in props else sub
    if not patterns:
        del node["patternProperties"]
    return node


# Characters with a meaning in a regex (outside a class).
_REGEX_META = frozenset("\\^$.|?*+()[]{}")


def pattern_names(pattern: str) -> list[str] | None:
    """The names an anchored regex of literal alternatives matches (`^name$`,
    `^(a|b)$`, `^(?:a|b)$`; escaped punctuation is literal), or None for any other regex."""
    if not (pattern.startswith("^") and pattern.endswith("$")) or pattern.endswith("\\$"):
        return None
    body = pattern[1:-1]
    if body.startswith("(?:") and body.endswith(")"):
        parts = body[3:-1].split("|")
    elif body.startswith("(") and body.endswith(")") and not body.startswith("(?"):
        parts = body[1:-1].split("|")
    else:  # (`^a|b$` is "starts with a, or ends with b": no split outside a group)
        parts = [body]
    names = []
    for part in parts:
        name, i = [], 0
        while i < len(part):
            c = part[i]
            if c == "\\" and i + 1 < len(part) and not part[i + 1].isalnum() \
                    and part[i + 1] != "|":
                name.append(part[i + 1])
                i += 2
            elif c in _REGEX_META:
                return None
            else:
                name.append(c)
                i += 1
        names.append("".join(name))
    return names


def _format_node(node: dict) -> dict:
    pattern = FORMAT_PATTERNS.get(node.get("format")) if isinstance(node.get("format"), str) \
        else None
    if pattern is None:
        return node
    del node["format"]
    if "pattern" not in node:
        node["pattern"] = pattern
    else:
        all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
        node["allOf"] = [*all_of, {"pattern": pattern}]
    return node


def _names_node(node: dict) -> dict:
    """A `propertyNames` that says nothing (names are strings: `{"type": "string"}`, `{}`,
    `true`) left out: llguidance would report it unenforced."""
    if node.get("propertyNames") in (True, {}, {"type": "string"}):
        del node["propertyNames"]
    return node


def _not_type_node(node: dict) -> dict:
    """A `not` of types alone becomes the other types (`{"not": {"type": "null"}}`: any
    non-null value), the node's own `type` narrowed to them; left where the complement is
    no list of types (integers without the other numbers: `not` of `integer` alone) or
    nothing remains."""
    sub = node.get("not")
    if not (isinstance(sub, dict) and sub.keys() - _NOTES == {"type"}):
        return node
    excluded = type_set(sub)
    own = type_set(node) if "type" in node else frozenset(JSON_TYPES)
    if excluded is None or own is None or ("integer" in excluded
                                           and "number" not in excluded):
        return node
    kept = [t for t in JSON_TYPES if t in own and t not in excluded
            and not (t == "integer" and "number" in own)]
    if not kept:
        return node  # nothing is left: llguidance says so
    del node["not"]
    node["type"] = kept[0] if len(kept) == 1 else kept
    return node


def _absent_node(node: dict) -> dict:
    names = absent_names(node.get("not"))
    if names is None:
        return node
    del node["not"]
    all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    node["allOf"] = [*all_of, {"type": "object", "properties": dict.fromkeys(names, False)}]
    return node


def _conditional_node(node: dict, root: Any) -> dict:
    """`if` / `then` / `else` on a name the object node requires, in the node or in a branch
    of its `allOf` that holds nothing else, as the node's `anyOf` of its two sides (see
    above), where it is the node's one conditional and the node has no `anyOf`; else the node
    as it is. `root` resolves local references."""
    if node.get("type") != "object" or not isinstance(node.get("required"), list) \
            or "anyOf" in node:
        return node
    all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    bare = [b for b in all_of if isinstance(b, dict) and "if" in b
            and b.keys() - _NOTES <= {"if", "then", "else"}]
    holders = ([node] if "if" in node else []) + bare
    if len(holders) != 1:
        # None, or several (an allOf of unions, which llguidance refuses or multiplies out):
        # left to llguidance, which ignores them and says so.
        return node
    sides = _sides(holders[0], node, root)
    if sides is None:
        return node
    out = {k: v for k, v in node.items() if k not in ("if", "then", "else", "allOf")}
    kept = [b for b in all_of if b is not holders[0]]
    if kept:
        out["allOf"] = kept
    out["anyOf"] = sides  # the node's own union: the any-order rewrite writes each side
    return out            # with the node's keywords


def _sides(holder: dict, node: dict, root: Any) -> list | None:
    """The two sides of `holder`'s `if` / `then` / `else` on a name the object `node`
    requires, or None (see above)."""
    shape = _discriminator(holder.get("if")) if {"then", "else"} & holder.keys() else None
    if shape is None or shape[0] not in node["required"]:
        return None
    name, values = shape
    then, other = holder.get("then", True), holder.get("else", True)
    sides = []
    for schema, among, keep in ((then, values, lambda pinned: pinned <= values.keys()),
                                (other, _others(node, name, values),
                                 lambda pinned: not pinned & values.keys())):
        pinned = _pinned(schema, root, name)
        if pinned is not None and keep(pinned):
            sides.append(schema)
        elif among is None:
            return None  # "another value" would be a complement: left to llguidance
        elif among:
            case = {"properties": {name: {"enum": list(among.values())}}}
            sides.append(case if schema is True else {"allOf": [case, schema]})
    return sides


def _discriminator(cond) -> tuple[str, dict] | None:
    """(name, {value key: value}) of an `if` that says only that one name's value is among
    some scalars (requiring the name and saying `type: object` or not); else None."""
    if not isinstance(cond, dict) or not cond.keys() - _NOTES <= {"properties", "required",
                                                                  "type"}:
        return None
    props = cond.get("properties")
    if not isinstance(props, dict) or len(props) != 1 or cond.get("type", "object") != "object":
        return None
    (name, sub), = props.items()
    values = _scalars(sub)
    if values is None or cond.get("required", [name]) != [name]:
        return None
    return name, values


def _scalars(schema) -> dict | None:
    """{value key: value} of a schema that is a `const` or `enum` of scalars (with notes or a
    `type` beside it, which must hold for every value), else None."""
    if not isinstance(schema, dict):
        return None
    keys = schema.keys() - _NOTES - {"type"}
    if keys == {"const"}:
        items = [schema["const"]]
    elif keys == {"enum"} and isinstance(schema["enum"], list) and schema["enum"]:
        items = schema["enum"]
    else:
        return None
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return None
    out = {}
    for value in items:
        key = _value_key(value)
        if key is None or (types and not any(of_type(value, t) for t in types)):
            return None
        out[key] = value
    return out


def _value_key(value) -> tuple | None:
    """A key equal for JSON-equal scalars (1 and 1.0; never true and 1); None otherwise."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, (int, float)):
        return ("number", float(value))
    return None


def _others(node: dict, name: str, values: dict) -> dict | None:
    """{value key: value} the name may take beside `values`, from the node's own const or
    enum for it; None where the node does not list its values."""
    own = node.get("properties", {}).get(name) if isinstance(node.get("properties"),
                                                              dict) else None
    listed = _scalars(own)
    return None if listed is None else {k: v for k, v in listed.items() if k not in values}


def _pinned(schema, root, name: str) -> set | None:
    """The value keys an object schema (through local `$ref`s) allows for `name`, which it
    requires, where it says so with a const or enum (and `type: object`); else None."""
    for _ in range(8):
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            break
        schema = pointer_target(root, schema["$ref"])
    if not isinstance(schema, dict) or schema.get("type") != "object" \
            or name not in (schema.get("required") or ()) \
            or not isinstance(schema.get("properties"), dict):
        return None
    values = _scalars(schema["properties"].get(name))
    return None if values is None else set(values)


def forbid_unlisted_properties(schema: Any) -> Any:
    """A copy of `schema` where object schemas that list `properties` and say nothing else
    about properties (see _COMBINED) forbid unlisted ones; direct branches of `allOf` are
    left alone (each branch lists only part of the properties). No state changed."""
    return _map(schema, _forbid_node, skip_children_of="allOf")


def bounded_length_is_rewritten(node: dict) -> bool:
    """Whether `fix_schema` rewrites this string schema (its bounds are at most the cap)."""
    if not _is_bounded_plain_string(node):
        return False
    return all(_small(node.get(k, 0)) for k in ("minLength", "maxLength"))


def _small(value) -> bool:
    return isinstance(value, int) and value <= MAX_REWRITTEN_LENGTH


def _fix_node(node: dict) -> dict:
    if bounded_length_is_rewritten(node):
        low = int(node.get("minLength", 0))
        high = node.get("maxLength")
        node["pattern"] = f"^{_UNESCAPED_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return node


def _forbid_node(node: dict) -> dict:
    if isinstance(node.get("properties"), dict) and not _COMBINED & node.keys():
        node["additionalProperties"] = False
    return node


def _map(schema: Any, fix, skip_children_of: str | None = None, skip: bool = False) -> Any:
    """Apply `fix` to every subschema, bottom up, on a copy; data values are copied as is.
    Branches of `skip_children_of` are copied with `fix` applied below them, not to them."""
    if isinstance(schema, list):
        return [_map(item, fix, skip_children_of, skip) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in DATA_KEYS:
            out[key] = value
        elif key in MAP_KEYS and isinstance(value, dict):
            out[key] = {name: _map(sub, fix, skip_children_of) for name, sub in value.items()}
        else:
            out[key] = _map(value, fix, skip_children_of, skip=key == skip_children_of)
    return out if skip else fix(out)


def _is_bounded_plain_string(node: dict) -> bool:
    return (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
            and not {"pattern", "format", "enum", "const"} & node.keys())
