"""The public API end to end on real processes: grammar service, 2 worker ranks, gateways.

Every constraint kind, streaming, non-ASCII, chat messages, slot release on cancel and on
an expired deadline (read from both ranks' /metrics), 20+ bad requests, a full queue, and
two gateways sharing one group.
"""

import json
import math
import re
import threading
import time

import grpc
import pytest
from conftest import MAX_MODEL_LEN, metric
from constraints import CHOICES, REGEX, SCHEMAS, is_valid

from grammar_service.default_model import resolve_model
from grammar_service.vocab import load_vocab
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel, check_health

COMPACT = common_pb2.GrammarOptions(whitespace=common_pb2.WHITESPACE_COMPACT)
DONE = (common_pb2.FINISH_REASON_GRAMMAR_COMPLETED, common_pb2.FINISH_REASON_STOP)
STRUCTURAL_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<n>", "end": "</n>",
    "content": {"type": "json_schema", "json_schema": {"enum": [1, 2, 3]}}}}


@pytest.fixture(scope="module")
def stubs(gramserve_system):
    chans = [channel(a) for a in gramserve_system.gateways]
    yield [gateway_pb2_grpc.GatewayStub(c) for c in chans]
    for c in chans:
        c.close()


@pytest.fixture(scope="module")
def stub(stubs):
    return stubs[0]


def generate(stub, timeout=120, **kw):
    """(deltas, final) of one Generate."""
    kw.setdefault("prompt", "Hello")
    sampling = kw.pop("sampling", {})
    sampling.setdefault("max_tokens", 40)
    req = gateway_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling), **kw)
    out = list(stub.Generate(req, timeout=timeout))
    assert out[-1].HasField("final") and all(r.HasField("delta") for r in out[:-1])
    return [r.delta for r in out[:-1]], out[-1].final


def spec(kind, arg):
    if kind == "json_schema":
        return common_pb2.GrammarSpec(json_schema=json.dumps(arg), options=COMPACT)
    if kind == "choice":
        return common_pb2.GrammarSpec(choice=common_pb2.ChoiceList(choices=arg))
    if kind == "json_object":
        return common_pb2.GrammarSpec(json_object=common_pb2.JsonObject(), options=COMPACT)
    if kind == "structural_tag":
        return common_pb2.GrammarSpec(structural_tag=json.dumps(arg))
    return common_pb2.GrammarSpec(**{kind: arg})


@pytest.mark.parametrize("kind,arg,check", [
    ("json_schema", SCHEMAS[0], lambda t: is_valid("json_schema", SCHEMAS[0], t)),
    ("json_schema", SCHEMAS[2], lambda t: is_valid("json_schema", SCHEMAS[2], t)),
    ("regex", REGEX, lambda t: re.fullmatch(REGEX, t) is not None),
    ("choice", CHOICES, lambda t: t in CHOICES),
    ("ebnf", 'root ::= "yes" | "no" | "maybe " [0-9]', lambda t: re.fullmatch(
        r"yes|no|maybe [0-9]", t) is not None),
    ("structural_tag", STRUCTURAL_TAG, lambda t: t in ("<n>1</n>", "<n>2</n>", "<n>3</n>")),
])
def test_every_constraint_kind_produces_a_valid_instance(stub, kind, arg, check):
    for seed in (1, 2):
        deltas, final = generate(stub, constraint=spec(kind, arg),
                                 sampling={"seed": seed, "max_tokens": 64, "temperature": 0.7})
        assert final.finish_reason in DONE, (final.finish_reason, final.message, final.text)
        assert check(final.text), final.text
        assert "".join(d.text for d in deltas) == final.text
        if kind == "json_schema":
            assert final.schema_valid and not final.schema_error
        else:
            assert not final.HasField("schema_valid")


def test_json_object_is_an_object_and_length_finishes_are_counted(gramserve_system, stub):
    url = gramserve_system.gateway_metrics[0]
    before = metric(url, "gramserve_gateway_grammar_length_finish_total")
    lengths = 0
    for seed in (1, 2, 3):
        _, final = generate(stub, constraint=spec("json_object", None),
                            sampling={"seed": seed, "max_tokens": 24})
        assert final.text.startswith("{")
        if final.finish_reason == common_pb2.FINISH_REASON_LENGTH:
            lengths += 1  # the random model wanders inside a string: legal, unfinished
        else:
            assert final.finish_reason in DONE and isinstance(json.loads(final.text), dict)
    assert metric(url, "gramserve_gateway_grammar_length_finish_total") - before == lengths


def test_unguided_stream_concatenates_to_final_text_with_its_token_ids(stub):
    deltas, final = generate(stub, sampling={"seed": 5, "max_tokens": 24, "ignore_eos": True})
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 24 == sum(len(d.token_ids) for d in deltas)
    assert "".join(d.text for d in deltas) == final.text
    assert final.seed == 5 and final.request_id


def test_seed_is_chosen_and_reported_when_missing_and_reproduces(stub):
    _, first = generate(stub, sampling={"max_tokens": 16})
    assert first.seed != 0
    _, again = generate(stub, sampling={"max_tokens": 16, "seed": first.seed})
    assert again.text == first.text


def test_n_choices_are_separate_requests_with_consecutive_seeds_and_logprobs(stub):
    req = gateway_pb2.GenerateRequest(
        prompt="Hello", n=3, constraint=spec("json_schema", SCHEMAS[0]),
        sampling=common_pb2.SamplingParams(max_tokens=40, seed=11, logprobs=True,
                                           top_logprobs=2))
    out = list(stub.Generate(req, timeout=120))
    finals = {r.index: r.final for r in out if r.HasField("final")}
    assert sorted(finals) == [0, 1, 2] and out[-1].HasField("final")
    for i, final in finals.items():  # each choice is the request alone with seed 11 + i
        deltas = [r.delta for r in out if r.HasField("delta") and r.index == i]
        assert "".join(d.text for d in deltas) == final.text and final.schema_valid
        assert [lp.token_id for lp in final.logprobs] == [t for d in deltas for t in d.token_ids]
        assert all(lp.logprob <= 0 and len(lp.top_token_ids) <= 2 for lp in final.logprobs)
        _, alone = generate(stub, constraint=spec("json_schema", SCHEMAS[0]),
                            sampling={"max_tokens": 40, "seed": 11 + i})
        assert alone.text == final.text and alone.seed == 11 + i
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(gateway_pb2.GenerateRequest(prompt="x", n=17), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, sampling={"top_logprobs": 3})
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.top_logprobs" in info.value.details()


def test_non_ascii_text_round_trips(stub):
    text = "Zoë → 日本語 🙂"
    deltas, final = generate(stub, constraint=common_pb2.GrammarSpec(
        choice=common_pb2.ChoiceList(choices=[text, "plain"])), prompt="Ünïcödé ✓ 中文",
        sampling={"seed": 3, "temperature": 0.0})
    assert final.text in (text, "plain")
    greedy = final.text
    deltas, final = generate(stub, constraint=common_pb2.GrammarSpec(regex=re.escape(text)))
    assert final.text == text and "".join(d.text for d in deltas) == text
    assert all("\ufffd" not in d.text for d in deltas)
    assert greedy


def test_chat_messages_use_the_template(stub):
    vocab = load_vocab(resolve_model(None))
    msgs = [gateway_pb2.ChatMessage(role="system", content="be brief"),
            gateway_pb2.ChatMessage(role="user", content="hi")]
    _, final = generate(stub, prompt=None, messages=msgs, sampling={"max_tokens": 8})
    rendered = vocab.tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in rendered
    assert final.usage.prompt_tokens == len(vocab.encode(rendered, add_special_tokens=False))


def test_stop_string_ends_generation_and_is_not_emitted(stub):
    # A constraint whose only output contains the stop string in the middle.
    deltas, final = generate(stub, constraint=common_pb2.GrammarSpec(regex="abc;def"),
                             sampling={"stop": [";"]})
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert final.text == "abc" == "".join(d.text for d in deltas)


def test_stop_string_inside_a_forced_chain_ends_exactly_there(stub):
    # After two letters the grammar allows one token at a time (no pair of these characters
    # is a token): the ranks take the rest as a forced chain, the stop string cuts it.
    deltas, final = generate(stub, constraint=common_pb2.GrammarSpec(
        regex=r"[a-z]{2}~\^~\^;~\^~\^"), sampling={"stop": [";"], "temperature": 0.0})
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert final.text == "".join(d.text for d in deltas)
    assert final.text.endswith("~^~^") and len(final.text) == 6


def test_list_models_and_compile_grammar(stub):
    (model,) = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models
    assert model.max_model_len == MAX_MODEL_LEN and model.tp_size == 2 and model.groups == 1
    req = gateway_pb2.CompileGrammarRequest(constraint=spec("regex", "[0-9]+"))
    first = stub.CompileGrammar(req, timeout=60)
    second = stub.CompileGrammar(req, timeout=60)
    assert first.key == second.key and first.kind == "regex" and second.cached


def _slow_request(**kw):
    return gateway_pb2.GenerateRequest(prompt="Go on", **kw, sampling=common_pb2.SamplingParams(
        max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, seed=1))


def test_cancel_mid_stream_frees_the_slot_on_both_ranks(gramserve_system, stub):
    call = stub.Generate(_slow_request(), timeout=120)
    next(call)
    assert gramserve_system.slots_in_use() == [1, 1]
    call.cancel()
    assert gramserve_system.wait_slots_free() == [0, 0]


def test_expired_deadline_frees_the_slot_on_both_ranks(gramserve_system, stub):
    with pytest.raises(grpc.RpcError) as info:
        for _ in stub.Generate(_slow_request(), timeout=1.0):
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert gramserve_system.wait_slots_free() == [0, 0]


INVALID = grpc.StatusCode.INVALID_ARGUMENT
BAD_REQUESTS = [
    ("schema not JSON", dict(constraint=common_pb2.GrammarSpec(json_schema="{nope")),
     INVALID, "json_schema"),
    ("schema not a JSON Schema", dict(constraint=spec("json_schema", {"type": 5})),
     INVALID, "json_schema"),
    ("bad regex", dict(constraint=spec("regex", "([a-z")), INVALID, "regex"),
    ("bad ebnf", dict(constraint=spec("ebnf", "root ::= (")), INVALID, "ebnf"),
    ("structural tag not an object", dict(constraint=spec("structural_tag", [1])),
     INVALID, "structural_tag"),
    ("empty choice", dict(constraint=common_pb2.GrammarSpec(choice=common_pb2.ChoiceList())),
     INVALID, "constraint.choice"),
    ("duplicate choice", dict(constraint=spec("choice", ["a", "a"])), INVALID, "duplicate"),
    ("both prompt kinds", dict(prompt="a", prompt_token_ids=[5]), INVALID, "prompt"),
    ("no prompt", dict(prompt=None), INVALID, "prompt"),
    ("negative max_tokens", dict(sampling={"max_tokens": -3}), INVALID, "sampling.max_tokens"),
    ("NaN temperature", dict(sampling={"temperature": math.nan}), INVALID,
     "sampling.temperature"),
    ("top_p zero", dict(sampling={"top_p": 0.0}), INVALID, "sampling.top_p"),
    ("top_p above one", dict(sampling={"top_p": 1.01}), INVALID, "sampling.top_p"),
    ("negative top_k", dict(sampling={"top_k": -1}), INVALID, "sampling.top_k"),
    ("min_p out of range", dict(sampling={"min_p": -0.1}), INVALID, "sampling.min_p"),
    ("prompt longer than the context", dict(prompt=None, prompt_token_ids=[65] * MAX_MODEL_LEN),
     INVALID, "prompt"),
    ("token id outside the vocabulary", dict(prompt=None, prompt_token_ids=[10**6]),
     INVALID, "prompt_token_ids[0]"),
    ("unknown model", dict(model="no-such-model"), grpc.StatusCode.NOT_FOUND, "no-such-model"),
    ("oversized request", dict(prompt="x" * (5 * 1024 * 1024)), INVALID, "request"),
    ("empty stop string", dict(sampling={"stop": [""]}), INVALID, "sampling.stop[0]"),
    ("min_tokens above max_tokens", dict(sampling={"max_tokens": 2, "min_tokens": 3}),
     INVALID, "sampling.min_tokens"),
    ("message without role", dict(prompt=None, messages=[gateway_pb2.ChatMessage(content="x")]),
     INVALID, "messages[0].role"),
    ("stop token outside the vocabulary", dict(sampling={"stop_token_ids": [10**6]}),
     INVALID, "sampling.stop_token_ids[0]"),
]


def test_bad_requests_get_the_right_status_and_name_the_problem(gramserve_system, stub):
    for name, kw, code, needle in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, **kw)
        assert info.value.code() == code, (name, info.value.details())
        assert needle in info.value.details(), (name, info.value.details())
    with pytest.raises(grpc.RpcError) as info:
        stub.CompileGrammar(gateway_pb2.CompileGrammarRequest(), timeout=10)
    assert info.value.code() == INVALID and "constraint" in info.value.details()
    assert all(check_health(a) for a in gramserve_system.gateways)
    assert gramserve_system.slots_in_use() == [0, 0]
    _, final = generate(stub, constraint=spec("choice", CHOICES))
    assert final.text in CHOICES


def test_full_queue_is_resource_exhausted_and_gateways_share_the_group(gramserve_system, stubs):
    first, no_queue = stubs  # the second gateway runs with --max-queue 0
    hold = [no_queue.Generate(_slow_request(request_id=f"hold-{i}"), timeout=120)
            for i in range(8)]
    for call in hold:
        next(call)  # all 8 slots of the group are taken through the second gateway
    assert gramserve_system.slots_in_use() == [8, 8]
    with pytest.raises(grpc.RpcError) as info:
        generate(no_queue)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    result = {}
    # The first gateway sees a full group (RESOURCE_EXHAUSTED from rank 0) and waits.
    waiter = threading.Thread(target=lambda: result.update(final=generate(first)[1]))
    waiter.start()
    time.sleep(1.0)
    assert "final" not in result
    for call in hold:
        call.cancel()
    waiter.join(60)
    assert result["final"].finish_reason in (*DONE, common_pb2.FINISH_REASON_LENGTH)
    assert gramserve_system.wait_slots_free() == [0, 0]
