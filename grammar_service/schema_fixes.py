"""Rewrites of a JSON schema that make xgrammar 0.2.9 compile what the schema means.

Length-bounded strings: for `{"type": "string", "minLength"/"maxLength": ...}` without a
`pattern`, xgrammar's grammar accepts raw control characters (a tab, U+000F) inside the string,
which is not even valid JSON. Such a string becomes the equivalent pattern over characters
that need no escape, `^[^"\\\\\\x00-\\x1f]{min,max}$` (xgrammar enforces patterns, and already
refuses escapes in these strings). The rewrite is applied to the text handed to the compiler
only; the cache key, the unenforced-keyword report and the gateway's validation use the schema
the user sent.
"""

from __future__ import annotations

from typing import Any

# Keys whose values are data, not subschemas.
_DATA_KEYS = frozenset({"enum", "const", "default", "examples", "example"})
_UNESCAPED_CHAR = '[^"\\\\\\x00-\\x1f]'


def fix_schema(schema: Any) -> Any:
    """A copy of `schema` with the rewrites above applied at every depth (no state changed)."""
    if isinstance(schema, list):
        return [fix_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYS else fix_schema(v)) for k, v in schema.items()}
    if _is_bounded_plain_string(out):
        low = int(out.get("minLength", 0))
        high = out.get("maxLength")
        out["pattern"] = f"^{_UNESCAPED_CHAR}{{{low},{'' if high is None else int(high)}}}$"
    return out


def _is_bounded_plain_string(node: dict) -> bool:
    return (node.get("type") == "string" and ("minLength" in node or "maxLength" in node)
            and not {"pattern", "format", "enum", "const"} & node.keys())
