"""References within the document, as pointers from its root.

A JSON schema may name its parts by URI: an `$id` below the root makes that subschema a
resource of its own (a `$ref` of "node", "urn:uuid:...", "http://example.com/b/d.json"
resolves to it, and "#/..." inside it is a pointer from it, not from the document's root),
an anchor names one place (`$anchor`, `$dynamicAnchor`, draft 6/7's `"$id": "#name"`), and
a relative `$ref` resolves against the nearest `$id` above it. Neither backend resolves all
of that (xgrammar reads `#/...` from the document's root; llguidance refuses relative and
URN references), and `grammar_service.specs` refused every `$ref` that was not "#...".

`local_refs` rewrites every `$ref` that names a place in the document itself into a JSON
pointer from its root (`#/$defs/node/properties/a`), then drops the identifiers below the
root (no reference depends on them any more, and a backend would resolve "#/..." against
them). A reference to a document that is not this one is left as it is (the spec is
refused as before: nothing is fetched).

Dialects: draft 4 names resources with `id`, later drafts with `$id`; up to draft 7 the
siblings of a `$ref` are ignored, so an `$id` beside a `$ref` changes nothing.
"""

from __future__ import annotations

import re
from urllib.parse import quote, urldefrag, urljoin, urlsplit

from grammar_service.schema_fixes import DATA_KEYS, MAP_KEYS

# A base for documents without a root `$id` (relative references resolve against it).
_DOCUMENT = "https://gramserve.invalid/schema.json"
_PLAIN_NAME = re.compile(r"#[A-Za-z][-A-Za-z0-9.:_]*")
_OLD_DRAFTS = re.compile(r"draft-0[3-7]/")
_ANCHORS = ("$anchor", "$dynamicAnchor")
# In a schema's text: a `$ref` that is no pointer from the root, and an identifier.
_NOT_POINTER = re.compile(r'"\$ref"\s*:\s*"(?!#/|#")')
_IDENTIFIER = re.compile(r'"\$(?:id|anchor|dynamicAnchor)"\s*:')


def local_refs(schema, text: str | None = None):
    """`schema` with every in-document `$ref` a pointer from its root and no identifier
    below the root; `schema` itself (not a copy) when there is nothing to rewrite. `text`,
    the JSON `schema` was read from, lets the common case skip the walk: every `$ref` a
    pointer already and no identifier but the root's."""
    if not isinstance(schema, dict):
        return schema
    dialect = schema.get("$schema")
    old = isinstance(dialect, str) and bool(_OLD_DRAFTS.search(dialect))
    id_key = "id" if isinstance(dialect, str) and re.search(r"draft-0[34]/", dialect) \
        else "$id"
    if text is not None and id_key == "$id" and not _NOT_POINTER.search(text) \
            and len(_IDENTIFIER.findall(text)) <= isinstance(schema.get("$id"), str):
        return schema
    resources: dict[str, tuple[str, ...]] = {}
    anchors: dict[str, tuple[str, ...]] = {}
    refs: list[tuple[tuple[str, ...], str, str]] = []  # (node's path, base, $ref)
    nested_ids = False
    stack: list[tuple[object, tuple[str, ...], str]] = [(schema, (), _DOCUMENT)]
    while stack:
        node, path, base = stack.pop()
        if isinstance(node, list):
            stack.extend((v, (*path, str(i)), base) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        if path and path[-1] in MAP_KEYS and _is_map(path):
            stack.extend((v, (*path, k), base) for k, v in node.items())
            continue
        ident = node.get(id_key)
        if isinstance(ident, str) and not (old and "$ref" in node):
            if path:
                nested_ids = True
            if old and _PLAIN_NAME.fullmatch(ident):
                anchors[_join(base, ident)] = path
            elif not ident.startswith("#"):
                base = urldefrag(_join(base, ident))[0]
                resources.setdefault(base, path)
        if not path:
            resources.setdefault(base, path)
            resources.setdefault(_DOCUMENT, path)
        for key in _ANCHORS:
            if isinstance(node.get(key), str):
                nested_ids = True
                anchors[_join(base, "#" + node[key])] = path
        if isinstance(node.get("$ref"), str):
            refs.append((path, base, node["$ref"]))
        for key, value in node.items():
            if key not in DATA_KEYS and isinstance(value, dict | list):
                stack.append((value, (*path, key), base))
    rewrites = {}
    for path, base, ref in refs:
        target = _pointer(_join(base, ref), resources, anchors)
        if target is not None and target != ref:
            rewrites[path] = target
    if not rewrites and not nested_ids:
        return schema
    return _rewritten(schema, (), rewrites, id_key)


def _is_map(path: tuple[str, ...]) -> bool:
    """Whether the node at `path` (whose last key is in MAP_KEYS) is a map of names: not when
    that key is itself a name in a map ("properties": {"properties": {...}})."""
    n = 1
    while n < len(path) and path[-1 - n] in MAP_KEYS:
        n += 1
    return n % 2 == 1


def _join(base: str, ref: str) -> str:
    """`ref` resolved against `base` (URNs too, which urljoin leaves alone)."""
    if ref.startswith("#"):
        return urldefrag(base)[0] + ref
    if urlsplit(ref).scheme:
        return ref
    return urljoin(base, ref)


def _pointer(uri: str, resources: dict, anchors: dict) -> str | None:
    """The root pointer ("#/...") of the place `uri` names in the document, or None."""
    if uri in anchors:
        return "#" + _encode(anchors[uri])
    resource, fragment = urldefrag(uri)
    if resource not in resources:
        return None
    if fragment and not fragment.startswith("/"):
        return None  # an anchor this document does not define
    return "#" + _encode(resources[resource]) + fragment


def _encode(path: tuple[str, ...]) -> str:
    return "".join("/" + quote(p.replace("~", "~0").replace("/", "~1"), safe="$-_.!*'()+,;=@:~")
                   for p in path)


def _rewritten(node, path: tuple[str, ...], rewrites: dict, id_key: str):
    """A copy of `node` with the `$ref`s of `rewrites` ({node path: pointer}) replaced and
    the identifiers below the root left out."""
    if isinstance(node, list):
        return [_rewritten(v, (*path, str(i)), rewrites, id_key) for i, v in enumerate(node)]
    if not isinstance(node, dict):
        return node
    if path and path[-1] in MAP_KEYS and _is_map(path):
        return {k: _rewritten(v, (*path, k), rewrites, id_key) for k, v in node.items()}
    out = {}
    for key, value in node.items():
        if path and (key in _ANCHORS or key == id_key) and isinstance(value, str):
            continue
        if key == "$ref" and path in rewrites:
            out[key] = rewrites[path]
        elif key in DATA_KEYS:
            out[key] = value
        else:
            out[key] = _rewritten(value, (*path, key), rewrites, id_key)
    return out
