"""Validation and canonical form of a grammar spec, and its cache key.

Plain Python (protobuf messages in, a frozen dataclass out): no grpc, torch or xgrammar, so
the gateway can validate at its edge with the same code the grammar service uses.

Canonical text per kind:
- json_schema, structural_tag: the JSON re-serialised without whitespace, keys in their
  given order: xgrammar generates properties in schema order, so `{"a","b"}` and
  `{"b","a"}` are different grammars and must not share a key.
- regex, ebnf, lark: the text as given (whitespace can be significant).
- choice: a JSON list of the choices, sorted (the order does not change the language).
- json_object: empty.
Options are reduced to those that apply to the kind, so an ignored option never changes the
key. Syntax errors in regex, EBNF and Lark are found by the backend in the compile pool, and
so are keywords the chosen backend would not enforce (grammar_service.choice).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

import jsonschema_rs
from jsonschema import FormatChecker
from jsonschema import exceptions as jsonschema_exceptions
from jsonschema import validators as jsonschema_validators

from grammar_service.refs import local_refs
from grammar_service.schema_fixes import DATA_KEYS, MAP_KEYS
from protos import common_pb2
from protos.rpc import InvalidArgument

KINDS = ("json_schema", "regex", "ebnf", "choice", "json_object", "structural_tag", "lark")
JSON_KINDS = ("json_schema", "json_object")

DEFAULT_MAX_WHITESPACE = 4
# A bound beyond this is as good as unbounded for a looping model; ask for WHITESPACE_ANY.
MAX_MAX_WHITESPACE = 64
DEFAULT_MAX_SPEC_BYTES = 1024 * 1024

_WHITESPACE_NAMES = {
    common_pb2.WHITESPACE_BOUNDED: "bounded",
    common_pb2.WHITESPACE_COMPACT: "compact",
    common_pb2.WHITESPACE_ANY: "any",
}
_BACKEND_NAMES = {
    common_pb2.GRAMMAR_BACKEND_AUTO: "auto",
    common_pb2.GRAMMAR_BACKEND_XGRAMMAR: "xgrammar",
    common_pb2.GRAMMAR_BACKEND_LLGUIDANCE: "llguidance",
}
# Kinds a forced backend cannot compile (grammar_service.choice has the auto rule).
_UNSUPPORTED = {"xgrammar": ("lark",), "llguidance": ("structural_tag",)}


@dataclass(frozen=True)
class GrammarOptions:
    """The options that apply to a spec's kind (the others are left at their defaults).

    whitespace: "bounded", "compact" or "any" (JSON kinds; "bounded" otherwise, unused).
    max_whitespace: the bound with "bounded" JSON grammars, else 0.
    strict: json_schema only; forbid properties the schema does not list, everywhere, and
        refuse schemas with keywords the chosen backend does not enforce (OpenAI's strict).
        Off: JSON Schema's meaning, unlisted properties allowed unless the schema says
        `additionalProperties: false`.
    backend: "auto", "xgrammar" or "llguidance" (every kind).
    fixed_order: json_schema only; properties in the schema's order (else any order where
        the grammar can say so: grammar_service.property_order).
    """

    whitespace: str = "bounded"
    max_whitespace: int = 0
    strict: bool = False
    backend: str = "auto"
    fixed_order: bool = False


@dataclass(frozen=True)
class CanonicalSpec:
    """A validated grammar spec in canonical form."""

    kind: str
    text: str
    options: GrammarOptions

    def to_dict(self) -> dict:
        """A JSON-able dict (kind, text, options); the inverse of `from_dict`."""
        return {"kind": self.kind, "text": self.text, "options": vars(self.options).copy()}

    @classmethod
    def from_dict(cls, data: dict) -> CanonicalSpec:
        """Rebuild a spec written by `to_dict`."""
        return cls(data["kind"], data["text"], GrammarOptions(**data["options"]))


def canonical_json(value) -> str:
    """JSON without whitespace, keys in order (order can change the grammar), non-ASCII kept."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def cache_key(spec: CanonicalSpec, vocab_fingerprint: str,
              backend_versions: dict[str, str]) -> str:
    """sha256 hex of the canonical spec, its options (the backend asked for among them), the
    vocabulary, and the version of each backend that can compile it: the forced one, or both
    for "auto" (the choice depends on both). `backend_versions`: {name: version}."""
    asked = spec.options.backend
    used = sorted(backend_versions) if asked == "auto" else [asked]
    material = json.dumps({
        "spec": spec.to_dict(),
        "vocab": vocab_fingerprint,
        "backends": {name: backend_versions[name] for name in used},
    }, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(material.encode()).hexdigest()


def parse_spec(
    spec: common_pb2.GrammarSpec,
    *,
    field: str = "spec",
    max_spec_bytes: int = DEFAULT_MAX_SPEC_BYTES,
) -> CanonicalSpec:
    """Validate `spec` and return its canonical form; no other effect.

    `field` is the name of the spec in the caller's request (the gateway passes
    "constraint"), used as the prefix of every error's field path. Raises InvalidArgument
    naming the offending field: no kind set, text over `max_spec_bytes`, not JSON (with
    line and column), not a valid JSON Schema, an unsupported schema feature, an empty or
    duplicate choice, options that do not apply to the kind, and a forced backend that does
    not compile the kind. (`options.strict` is checked where the backend is chosen.)
    """
    kind = spec.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"no constraint kind set; set one of {', '.join(KINDS)}",
                              field=field)
    _reject_unknown_fields(spec, field)
    _reject_unknown_fields(spec.options, f"{field}.options")
    where = f"{field}.{kind}"
    options = _parse_options(spec.options, kind, f"{field}.options")
    if kind == "json_schema":
        schema = _parse_json(spec.json_schema, where, max_spec_bytes)
        if schema is True:  # the schema every value satisfies
            schema = {}
        schema = _check_schema(schema, where, spec.json_schema)
        return CanonicalSpec(kind, canonical_json(schema), options)
    if kind == "structural_tag":
        tag = _parse_json(spec.structural_tag, where, max_spec_bytes)
        if not isinstance(tag, dict):
            raise InvalidArgument("must be a JSON object", field=where)
        return CanonicalSpec(kind, canonical_json(tag), options)
    if kind in ("regex", "ebnf", "lark"):
        text = getattr(spec, kind)
        _check_size(text, where, max_spec_bytes)
        if not text:
            raise InvalidArgument("is empty", field=where)
        return CanonicalSpec(kind, text, options)
    if kind == "choice":
        choices = _check_choices(list(spec.choice.choices), f"{where}.choices", max_spec_bytes)
        return CanonicalSpec(kind, canonical_json(sorted(choices)), options)
    return CanonicalSpec("json_object", "", options)


def _reject_unknown_fields(message, field: str) -> None:
    # A field this build does not know (a newer client's option) must not be dropped
    # silently: the caller would get a grammar without what it asked for.
    from google.protobuf import unknown_fields

    numbers = sorted({f.field_number for f in unknown_fields.UnknownFieldSet(message)})
    if numbers:
        raise InvalidArgument(f"unknown field number(s) {numbers}; this server does not "
                              "support them", field=field)


def _parse_options(opts: common_pb2.GrammarOptions, kind: str, field: str) -> GrammarOptions:
    if opts.backend not in _BACKEND_NAMES:
        raise InvalidArgument(f"unknown backend {opts.backend}", field=f"{field}.backend")
    backend = _BACKEND_NAMES[opts.backend]
    if kind in _UNSUPPORTED.get(backend, ()):
        raise InvalidArgument(f"{backend} does not compile {kind}; use GRAMMAR_BACKEND_AUTO",
                              field=f"{field}.backend")
    if opts.whitespace not in _WHITESPACE_NAMES:
        raise InvalidArgument(f"unknown whitespace policy {opts.whitespace}",
                              field=f"{field}.whitespace")
    whitespace = _WHITESPACE_NAMES[opts.whitespace]
    if kind not in JSON_KINDS:
        if opts.whitespace != common_pb2.WHITESPACE_BOUNDED or opts.max_whitespace:
            raise InvalidArgument(f"whitespace options apply only to {' and '.join(JSON_KINDS)}, "
                                  f"not {kind}", field=f"{field}.whitespace")
    if kind != "json_schema":
        for name in ("strict", "fixed_property_order"):
            if getattr(opts, name):
                raise InvalidArgument(f"applies only to json_schema, not {kind}",
                                      field=f"{field}.{name}")
    if kind not in JSON_KINDS:
        return GrammarOptions(backend=backend)
    max_ws = 0
    if whitespace == "bounded":
        max_ws = opts.max_whitespace or DEFAULT_MAX_WHITESPACE
        if max_ws > MAX_MAX_WHITESPACE:
            raise InvalidArgument(
                f"{opts.max_whitespace} is over the limit of {MAX_MAX_WHITESPACE}; use "
                "WHITESPACE_ANY for unbounded whitespace", field=f"{field}.max_whitespace")
    elif opts.max_whitespace:
        raise InvalidArgument("applies only with WHITESPACE_BOUNDED",
                              field=f"{field}.max_whitespace")
    return GrammarOptions(whitespace, max_ws, opts.strict, backend, opts.fixed_property_order)


def _check_size(text: str, field: str, max_spec_bytes: int) -> None:
    size = len(text.encode())
    if size > max_spec_bytes:
        raise InvalidArgument(f"is {size} bytes, over the limit of {max_spec_bytes}", field=field)


def _parse_json(text: str, field: str, max_spec_bytes: int):
    _check_size(text, field, max_spec_bytes)
    if not text.strip():
        raise InvalidArgument("is empty; expected JSON", field=field)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"not valid JSON: {exc.msg} at line {exc.lineno} column "
                              f"{exc.colno}", field=field) from None
    except RecursionError:
        raise InvalidArgument("not usable JSON: nested too deeply", field=field) from None


def _check_schema(schema, field: str, text: str | None = None) -> dict:
    """`schema` checked against its meta-schema, its references within the document made
    pointers from its root (grammar_service.refs); raises InvalidArgument naming the
    field."""
    if schema is False:
        raise InvalidArgument("is false, the schema no value satisfies: there is nothing to "
                              "generate", field=field)
    if not isinstance(schema, dict):
        raise InvalidArgument("must be a JSON object or true (a schema)", field=field)
    cls = jsonschema_validators.validator_for(
        schema, default=jsonschema_validators.Draft202012Validator)
    try:
        if not _meta_valid_fast(schema, cls):
            cls.check_schema(schema, format_checker=_meta_checker(cls))
    except jsonschema_exceptions.SchemaError as exc:
        path = ".".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidArgument(f"not a valid JSON Schema at {path}: {exc.message}",
                              field=field) from None
    except RecursionError:
        raise InvalidArgument("not usable: schema nested too deeply", field=field) from None
    schema = local_refs(schema, text)
    found = _nonlocal_ref(schema)
    if found is not None:
        ref, path = found
        where = ".".join(reversed(path)) or "(root)"
        raise InvalidArgument(f"unsupported schema feature at {where}: $ref {ref!r} names "
                              "no place in this schema (other documents are not fetched)",
                              field=field)
    return schema


# The values the meta-schemas (draft 4 to 2020-12) give a `format`, which jsonschema-rs's
# meta-validation does not check: keyword -> format, and keywords whose names are formatted.
_META_FORMATS = {"pattern": "regex", "$ref": "uri-reference", "$id": "uri-reference",
                 "$dynamicRef": "uri-reference", "$recursiveRef": "uri-reference",
                 "$schema": "uri"}
_META_NAME_FORMATS = {"patternProperties": "regex", "$vocabulary": "uri"}


# A `regex` in a schema is ECMA-262's (named groups `(?<name>...)`, `\\k<name>`), which
# Python's `re`, jsonschema's regex check, refuses: jsonschema-rs's check reads ECMA-262.
# Either one taking it will do (both backends' engines read Python's `(?P<name>...)` too).
_ECMA_REGEX = jsonschema_rs.validator_for({"format": "regex"}, validate_formats=True)
_META_CHECKERS: dict = {}


def _meta_checker(cls) -> FormatChecker:
    """`cls`'s format checker, its regex check taking ECMA-262 too."""
    checker = _META_CHECKERS.get(cls)
    if checker is None:
        checker = FormatChecker(list(cls.FORMAT_CHECKER.checkers))
        checker.checks("regex")(_is_regex)
        _META_CHECKERS[cls] = checker
    return checker


def _is_regex(value) -> bool:
    if not isinstance(value, str) or _ECMA_REGEX.is_valid(value):
        return True
    try:
        re.compile(value)
    except (re.error, RecursionError, OverflowError, ValueError):
        return False
    return True


def _meta_valid_fast(schema: dict, cls) -> bool:
    """True when `schema` is valid against its meta-schema, found fast: jsonschema-rs checks
    the structure (SchemaStore's schemas: 9 ms for 138, against 1.5 s for jsonschema, whose
    2020-12 `$dynamicRef`s dominate a compile), and jsonschema's own format checker the values
    the meta-schemas give a format (`_META_FORMATS`; checking more than those only costs
    time). False sends the schema to jsonschema's `check_schema`, which has the last word and
    writes the error."""
    try:
        if not jsonschema_rs.meta.is_valid(schema):
            return False
    except Exception:  # noqa: BLE001 - an unknown $schema, nesting: the full check decides
        return False
    checker = _meta_checker(cls)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for keyword, value in node.items():
            if keyword in DATA_KEYS:
                continue
            fmt = _META_FORMATS.get(keyword)
            if fmt is not None and isinstance(value, str) and not checker.conforms(value, fmt):
                return False
            fmt = _META_NAME_FORMATS.get(keyword)
            if fmt is not None and isinstance(value, dict) and not all(
                    checker.conforms(name, fmt) for name in value):
                return False
            if keyword in MAP_KEYS and isinstance(value, dict):
                stack.extend(value.values())  # names are not keywords: "enum" may be one
            elif isinstance(value, dict | list):
                stack.append(value)
    return True


def _nonlocal_ref(node) -> tuple[str, list[str]] | None:
    """The first `$ref` that is not a pointer from the root ("#" or "#/..."), with its path,
    innermost key first; None when all are. Run after `local_refs`, which made every one
    that names a place in the schema such a pointer: the others name another document (not
    fetched) or an anchor the schema does not define. The path is built only for the one
    found."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref != "#" and not ref.startswith("#/"):
            return ref, []
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return None
    for key, value in items:
        if isinstance(value, dict | list):
            found = _nonlocal_ref(value)
            if found is not None:
                found[1].append(str(key))
                return found
    return None


def _check_choices(choices: list[str], field: str, max_spec_bytes: int) -> list[str]:
    if not choices:
        raise InvalidArgument("is empty; give at least one choice", field=field)
    _check_size("".join(choices), field, max_spec_bytes)
    first: dict[str, int] = {}
    for i, choice in enumerate(choices):
        if not choice:
            raise InvalidArgument("is an empty string", field=f"{field}[{i}]")
        if choice in first:
            raise InvalidArgument(f"duplicates {field}[{first[choice]}] ({choice!r})",
                                  field=f"{field}[{i}]")
        first[choice] = i
    return choices
