"""Request bytes the parser alone would misreport (protos/wire.py): a string that is not
UTF-8 is found by its field path; two members of one oneof are a conflict, not "last wins"."""

from protos import common_pb2, gateway_pb2, wire

D = gateway_pb2.GenerateRequest.DESCRIPTOR


def test_the_string_that_is_not_utf8_is_named_by_its_path():
    req = gateway_pb2.GenerateRequest(messages=[
        gateway_pb2.ChatMessage(role="user", content="fine"),
        gateway_pb2.ChatMessage(role="user", content="bAD")])
    data = req.SerializeToString().replace(b"bAD", b"b\xffD")
    assert wire.bad_utf8_field(D, data) == "messages[1].content"
    data = gateway_pb2.GenerateRequest(prompt="xYz").SerializeToString().replace(b"Y", b"\xc3")
    assert wire.bad_utf8_field(D, data) == "prompt"
    assert wire.bad_utf8_field(D, gateway_pb2.GenerateRequest(prompt="ok").SerializeToString()) \
        is None


def test_two_members_of_a_oneof_are_a_conflict_naming_both():
    a = gateway_pb2.GenerateRequest(prompt="p", constraint=common_pb2.GrammarSpec(regex="a+"))
    b = gateway_pb2.GenerateRequest(constraint=common_pb2.GrammarSpec(json_schema="{}"))
    both = a.SerializeToString() + b.SerializeToString()  # parses, with the last one kept
    assert gateway_pb2.GenerateRequest.FromString(both).constraint.WhichOneof("kind") == \
        "json_schema"
    assert wire.oneof_conflict(D, both) == \
        "constraint: sets both regex and json_schema; set exactly one (kind)"
    assert wire.oneof_conflict(D, a.SerializeToString() + a.SerializeToString()) is None
    seeded = gateway_pb2.GenerateRequest(prompt="p", sampling=common_pb2.SamplingParams(seed=3))
    assert wire.oneof_conflict(D, seeded.SerializeToString()) is None  # proto3 optional
