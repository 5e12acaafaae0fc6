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

options.strict, unlisted properties (`forbid_unlisted_properties`): strict must mean on
llguidance what xgrammar's strict_mode means, so an object schema that lists `properties`
and says nothing about other properties gets `additionalProperties: false`.
"""

from __future__ import annotations

import re
from typing import Any

# Keys whose values are data, not subschemas.
DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})
# Keys whose values map names (not keywords) to subschemas.
MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                       "dependentSchemas"})
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
    r'|"not"\s*:\s*\{\s*"(?:required|anyOf)"')


def fix_schema(schema: Any) -> Any:
    """A copy of `schema` with the xgrammar rewrites (integral bounds, bounded strings)
    applied at every depth (no state changed)."""
    return _map(schema, lambda node: _fix_node(_integral_node(node)))


def fix_schema_llguidance(schema: Any) -> Any:
    """A copy of `schema` with the llguidance rewrites (integral bounds, exact date and time
    formats, names never there) applied at every depth (no state changed)."""
    return _map(schema, lambda node: _absent_node(_format_node(_integral_node(node))))


def llguidance_fix_applies(text: str) -> bool:
    """Whether `fix_schema_llguidance` can change the schema whose JSON `text` this is
    (json.dumps output): only a count written with a fraction or exponent, or a date or time
    format, can. False spares the walk, which copies every node."""
    return _LLG_FIX_TEXT.search(text) is not None


def _integral_node(node: dict) -> dict:
    for key in _COUNTS:
        value = node.get(key)
        if isinstance(value, float) and value.is_integer() and value >= 0:
            node[key] = int(value)
    return node


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


def _absent_node(node: dict) -> dict:
    names = _absent_names(node.get("not"))
    if names is None:
        return node
    del node["not"]
    all_of = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    node["allOf"] = [*all_of, {"type": "object", "properties": dict.fromkeys(names, False)}]
    return node


def _absent_names(node) -> list[str] | None:
    """The names of a `not` that says "an object without these": `{"required": [name]}`,
    or an `anyOf` of such (each name alone), else None."""
    if not isinstance(node, dict):
        return None
    branches = node.get("anyOf") if node.keys() - _NOTES == {"anyOf"} else [node]
    if not isinstance(branches, list) or not branches:
        return None
    names = []
    for branch in branches:
        required = branch.get("required") if isinstance(branch, dict) \
            and branch.keys() - _NOTES == {"required"} else None
        if not (isinstance(required, list) and len(required) == 1
                and isinstance(required[0], str)):
            return None
        names.append(required[0])
    return names


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
