"""Constraints used across the worker and system tests: each has a finite language short enough
for the default model to complete within the tests' max_tokens, and a validity check."""

from __future__ import annotations

import json
import re

import jsonschema

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object",
     "properties": {"ok": {"type": "boolean"},
                    "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "color"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 1, "maxItems": 4},
]
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["alpha", "beta", "gamma delta"]


def is_valid(kind: str, arg, text: str) -> bool:
    """Whether `text` is an instance of the constraint (kind, arg)."""
    if kind == "json_schema":
        try:
            jsonschema.validate(json.loads(text), arg)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(arg, text) is not None
    if kind == "choice":
        return text in arg
    if kind == "none":
        return True
    raise ValueError(kind)


def constraint_mix() -> list[tuple[str, object]]:
    """Three JSON schemas, a regex, a choice list and an unguided entry."""
    return [("json_schema", s) for s in SCHEMAS] + [("regex", REGEX), ("choice", CHOICES),
                                                    ("none", None)]
