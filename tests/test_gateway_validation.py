"""Every bad GenerateRequest field is refused with INVALID_ARGUMENT naming it."""

import json
import math

import pytest

from gateway.validation import (
    Limits,
    check_output_against_schema,
    checked_formats,
    constraint_kind,
    validate_request,
)
from protos import common_pb2, gateway_pb2
from protos.rpc import InvalidArgument

LIMITS = Limits(vocab_size=100, max_request_bytes=2048)


def _req(**kw):
    req = gateway_pb2.GenerateRequest(prompt="hi")
    for k, v in kw.items():
        if k == "sampling":
            req.sampling.CopyFrom(common_pb2.SamplingParams(**v))
        elif k == "constraint":
            req.constraint.CopyFrom(v)
        else:
            setattr(req, k, v)
    return req


BAD = [
    ("no prompt", gateway_pb2.GenerateRequest(), "prompt"),
    ("two prompt kinds", gateway_pb2.GenerateRequest(prompt="a", prompt_token_ids=[1]), "prompt"),
    ("empty prompt", gateway_pb2.GenerateRequest(prompt=""), "prompt"),
    ("token outside vocab", gateway_pb2.GenerateRequest(prompt_token_ids=[1, 100]),
     "prompt_token_ids[1]"),
    ("message without role", gateway_pb2.GenerateRequest(
        messages=[gateway_pb2.ChatMessage(role="", content="x")]), "messages[0].role"),
    ("negative max_tokens", _req(sampling={"max_tokens": -1}), "sampling.max_tokens"),
    ("zero max_tokens", _req(sampling={"max_tokens": 0}), "sampling.max_tokens"),
    ("NaN temperature", _req(sampling={"temperature": math.nan}), "sampling.temperature"),
    ("negative temperature", _req(sampling={"temperature": -0.5}), "sampling.temperature"),
    ("top_p zero", _req(sampling={"top_p": 0.0}), "sampling.top_p"),
    ("top_p above one", _req(sampling={"top_p": 1.5}), "sampling.top_p"),
    ("negative top_k", _req(sampling={"top_k": -2}), "sampling.top_k"),
    ("min_p above one", _req(sampling={"min_p": 2.0}), "sampling.min_p"),
    ("min_tokens above max_tokens", _req(sampling={"max_tokens": 4, "min_tokens": 5}),
     "sampling.min_tokens"),
    ("empty stop string", _req(sampling={"stop": ["ok", ""]}), "sampling.stop[1]"),
    ("too many stop strings", _req(sampling={"stop": [str(i) for i in range(17)]}),
     "sampling.stop"),
    ("stop token outside vocab", _req(sampling={"stop_token_ids": [500]}),
     "sampling.stop_token_ids[0]"),
    ("unknown logprobs mode", _req(sampling={"logprobs": True, "logprobs_mode": 7}),
     "sampling.logprobs_mode"),
    ("unconstrained logprobs mode without logprobs",
     _req(sampling={"logprobs_mode": common_pb2.LOGPROBS_MODE_UNCONSTRAINED}),
     "sampling.logprobs_mode"),
    ("empty choice list", _req(constraint=common_pb2.GrammarSpec(choice=common_pb2.ChoiceList())),
     "constraint.choice"),
    ("duplicate choice", _req(constraint=common_pb2.GrammarSpec(
        choice=common_pb2.ChoiceList(choices=["a", "a"]))), "constraint.choice"),
    ("empty choice", _req(constraint=common_pb2.GrammarSpec(
        choice=common_pb2.ChoiceList(choices=["a", ""]))), "constraint.choice[1]"),
    ("empty regex", _req(constraint=common_pb2.GrammarSpec(regex="")), "constraint.regex"),
    ("oversized request", gateway_pb2.GenerateRequest(prompt="x" * 4096), "request"),
    ("unprintable request id", _req(request_id="a\nb"), "request_id"),
]


@pytest.mark.parametrize("req,field", [(r, f) for _, r, f in BAD], ids=[n for n, _, _ in BAD])
def test_bad_field_is_named(req, field):
    with pytest.raises(InvalidArgument) as info:
        validate_request(req, LIMITS)
    assert info.value.field == field
    assert str(info.value).startswith(field + ":")


def test_good_request_passes_unchanged():
    req = _req(sampling={"max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "stop": ["\n"]},
               constraint=common_pb2.GrammarSpec(regex="[a-z]+"))
    before = req.SerializeToString()
    validate_request(req, LIMITS)
    assert req.SerializeToString() == before


def test_constraint_kind_names_the_oneof():
    assert constraint_kind(common_pb2.GrammarSpec()) == "none"
    spec = common_pb2.GrammarSpec()
    spec.json_object.SetInParent()
    assert constraint_kind(spec) == "json_object"


SCHEMA = json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}},
                     "required": ["n"]})


def test_output_violating_the_schema_is_not_valid():
    valid, why = check_output_against_schema(SCHEMA, '{"n": 9}')
    assert not valid and "n" in why and "5" in why


def test_truncated_output_is_not_valid():
    valid, why = check_output_against_schema(SCHEMA, '{"n": ')
    assert not valid and "not JSON" in why


def test_matching_output_is_valid():
    assert check_output_against_schema(SCHEMA, '{"n": 3}') == (True, "")


@pytest.mark.parametrize("fmt,bad", [
    ("ipv4", "999.1.1.1"), ("ipv6", "1:::2"), ("date", "2023-02-29"), ("date-time", "2023-01-01"),
    ("time", "25:00:00Z"), ("email", "no-at-sign"), ("uuid", "x"), ("uri", "no scheme"),
    ("hostname", "-bad-"), ("duration", "P1"), ("uri-reference", "\\\\x")])
def test_output_check_asserts_the_formats_it_claims(fmt, bad):
    assert fmt in checked_formats()
    schema = json.dumps({"type": "object", "properties": {"v": {"type": "string",
                                                                 "format": fmt}}})
    valid, why = check_output_against_schema(schema, json.dumps({"v": bad}))
    assert not valid and "v" in why, (fmt, why)
