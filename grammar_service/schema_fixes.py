"""Rewrites of a JSON schema applied to the text one backend compiles (never to the cache key,
the unenforced-keyword report or the gateway's validation, which use the schema as sent).

xgrammar, length-bounded strings (`fix_schema`): for `{"type": "string", "minLength"/
"maxLength": ...}` without a `pattern`, xgrammar 0.2.9's grammar accepts raw control
characters (a tab, U+000F) inside the string, which is not even valid JSON. Such a string
becomes the equivalent pattern over characters that need no escape,
`^[^"\\\\\\x00-\\x1f]{min,max}$` (xgrammar enforces patterns, and already refuses escapes in
these strings). A bounded repetition costs xgrammar compile time that grows faster than the
bound (measured, 4k vocabulary, one thread: 256 → 20 ms, 512 → 75 ms, 1024 → 0.42 s,
2048 → 1.6 s; 8192 took 42 s on a real schema), so bounds above `MAX_REWRITTEN_LENGTH` are
left as written and `unenforced.find_unenforced` reports the keyword instead. llguidance
enforces length bounds in its lexer and needs none of this.

llguidance, unlisted properties (`forbid_unlisted_properties`): `allow_unlisted_properties`
off (the default) must mean on llguidance what xgrammar's strict_mode means, so an object
schema that lists `properties` and says nothing about other properties gets
`additionalProperties: false`.
"""

from __future__ import annotations

from typing import Any

# Keys whose values are data, not subschemas.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})
# Keys whose values map names (not keywords) to subschemas.
_MAP_KEYS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                       "dependentSchemas"})
_UNESCAPED_CHAR = '[^"\\\\\\x00-\\x1f]'
# The largest minLength / maxLength rewritten into a repetition for xgrammar (see above).
MAX_REWRITTEN_LENGTH = 256
# Next to these, `additionalProperties: false` would refuse properties the schema allows
# (it sees sibling `properties` only), so such nodes are left as they are.
_COMBINED = frozenset({"additionalProperties", "unevaluatedProperties", "patternProperties",
                       "allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas"})


def fix_schema(schema: Any) -> Any:
    """A copy of `schema` with the xgrammar rewrite applied at every depth (no state changed)."""
    return _map(schema, _fix_node)


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
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _MAP_KEYS and isinstance(value, dict):
            out[key] = {name: _map(sub, fix, skip_children_of) for name, sub in value.items()}
        else:
            out[key] = _map(value, fix, skip_children_of, skip=key == skip_children_of)
    return out if skip else fix(out)


def _is_bounded_plain_string(node: dict) -> bool:
    return (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
            and not {"pattern", "format", "enum", "const"} & node.keys())
