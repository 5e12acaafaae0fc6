"""Checks on a GenerateRequest at the edge: every problem names its field.

Deeper grammar checks (is the schema valid JSON Schema, does the regex parse) belong to the
grammar service, which names `constraint.<...>` fields the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import common_pb2, gateway_pb2
from protos.rpc import InvalidArgument
from protos.sampling import Sampling


@dataclass(frozen=True)
class Limits:
    """Bounds a request must respect (from the served model and the gateway config)."""

    vocab_size: int
    max_request_bytes: int = 4 * 1024 * 1024
    max_prompt_bytes: int = 1024 * 1024
    max_request_id_chars: int = 128
    max_messages: int = 1024


def constraint_kind(spec: common_pb2.GrammarSpec) -> str:
    """The constraint's kind ("json_schema", "regex", ...) or "none" when unguided."""
    return spec.WhichOneof("kind") or "none"


def prompt_bytes(req: gateway_pb2.GenerateRequest) -> int:
    """UTF-8 bytes of what will be tokenised: the prompt text, or every chat message's role
    and content plus the tools JSON."""
    if req.HasField("prompt"):
        return len(req.prompt.encode())
    return (sum(len(m.role.encode()) + len(m.content.encode()) for m in req.messages)
            + len(req.tools_json.encode()))


def validate_request(req: gateway_pb2.GenerateRequest, limits: Limits) -> None:
    """Raise InvalidArgument naming the first bad field of `req`; no effect otherwise."""
    size = req.ByteSize()
    if size > limits.max_request_bytes:
        raise InvalidArgument(
            f"the request is {size} bytes; the limit is {limits.max_request_bytes}",
            field="request")
    if len(req.request_id) > limits.max_request_id_chars or not req.request_id.isprintable():
        raise InvalidArgument(
            f"must be printable and at most {limits.max_request_id_chars} characters",
            field="request_id")
    _validate_prompt(req, limits)
    validate_sampling(req.sampling, limits)
    validate_constraint(req.constraint)


def _validate_prompt(req: gateway_pb2.GenerateRequest, limits: Limits) -> None:
    forms = [name for name, present in (
        ("prompt", req.HasField("prompt")),
        ("prompt_token_ids", len(req.prompt_token_ids) > 0),
        ("messages", len(req.messages) > 0)) if present]
    if len(forms) != 1:
        what = "none was given" if not forms else f"got {' and '.join(forms)}"
        raise InvalidArgument(
            f"exactly one of prompt, prompt_token_ids or messages is required; {what}",
            field="prompt")
    if forms[0] == "prompt" and not req.prompt:
        raise InvalidArgument("must not be empty", field="prompt")
    size = prompt_bytes(req)
    if size > limits.max_prompt_bytes:
        raise InvalidArgument(
            f"is {size} bytes of UTF-8; the limit is {limits.max_prompt_bytes} "
            "(--max-prompt-bytes), checked before tokenising",
            field="prompt" if forms[0] == "prompt" else "messages")
    for i, tok in enumerate(req.prompt_token_ids):
        if tok >= limits.vocab_size:
            raise InvalidArgument(
                f"token id {tok} is outside the vocabulary (size {limits.vocab_size})",
                field=f"prompt_token_ids[{i}]")
    if req.tools_json and not req.messages:
        raise InvalidArgument("only with `messages` (tools are rendered by the chat template)",
                              field="tools_json")
    if len(req.messages) > limits.max_messages:
        raise InvalidArgument(f"at most {limits.max_messages} messages", field="messages")
    for i, msg in enumerate(req.messages):
        if not msg.role:
            raise InvalidArgument("must not be empty", field=f"messages[{i}].role")


def validate_sampling(s: common_pb2.SamplingParams, limits: Limits) -> Sampling:
    """The request's typed sampling; InvalidArgument names the first bad `sampling.*` field
    (the same rules the worker applies to its Admit: protos/sampling.py)."""
    return Sampling.from_proto(s, vocab_size=limits.vocab_size)


def validate_constraint(spec: common_pb2.GrammarSpec) -> None:
    """Shallow checks of `constraint`; the grammar service does the rest."""
    kind = spec.WhichOneof("kind")
    if kind in ("json_schema", "regex", "ebnf", "structural_tag") and not getattr(spec, kind):
        raise InvalidArgument("must not be empty", field=f"constraint.{kind}")
    if kind == "choice":
        choices = list(spec.choice.choices)
        if not choices:
            raise InvalidArgument("needs at least one choice", field="constraint.choice")
        for i, c in enumerate(choices):
            if not c:
                raise InvalidArgument("must not be empty", field=f"constraint.choice[{i}]")
        if len(set(choices)) != len(choices):
            dup = next(c for c in choices if choices.count(c) > 1)
            raise InvalidArgument(f"duplicate choice {dup!r}", field="constraint.choice")
    if spec.options.whitespace not in common_pb2.Whitespace.values():
        raise InvalidArgument(f"unknown value {spec.options.whitespace}",
                              field="constraint.options.whitespace")


def checked_formats() -> frozenset[str]:
    """The `format` values the output check asserts (those with jsonschema's checkers
    installed: `jsonschema[format-nongpl]` adds uri, hostname, duration and others)."""
    import jsonschema

    return frozenset(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers)


def check_output_against_schema(schema_text: str, text: str) -> tuple[bool, str]:
    """(valid, why not) for generated `text` against the user's JSON schema (jsonschema).

    The compiled grammar can be looser than the schema, so this is the final word on
    `schema_valid`. `format` is asserted (whatever the draft says) for every format the
    validator's FormatChecker claims (`CHECKED_FORMATS`), so a format an engine lets through
    does not pass silently; other format values are not checked. Never raises.
    """
    import json

    import jsonschema

    try:
        instance = json.loads(text)
    except ValueError as exc:
        return False, f"output is not JSON: {exc}"
    try:
        schema = json.loads(schema_text)
        cls = jsonschema.validators.validator_for(schema)
        validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    except Exception as exc:  # a schema jsonschema cannot handle is not a valid output
        return False, f"schema could not be checked: {exc}"
    if error is None:
        return True, ""
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return False, f"at {where}: {error.message}"
