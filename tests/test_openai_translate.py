"""The OpenAI → GenerateRequest translation on its own: no processes, milliseconds."""

import json

import pytest

from gateway import openai_responses as orsp
from gateway import openai_translate as ot
from gateway.validation import Limits, validate_sampling
from protos import common_pb2, gateway_pb2
from protos.rpc import InvalidArgument, ResourceExhausted, Unavailable

HI = [{"role": "user", "content": "Hi"}]
LIMITS = Limits(vocab_size=100)


def chat(**kw):
    return ot.chat_plan({"model": "m", "messages": HI, **kw}, LIMITS)


def test_n_choices_get_consecutive_seeds_and_their_own_requests():
    plan = chat(n=3, seed=7, stop="END", max_completion_tokens=9, temperature=0.5)
    assert [r.sampling.seed for r in plan.requests] == [7, 8, 9]
    assert len({r.request_id for r in plan.requests}) == 3
    for r in plan.requests:
        assert list(r.sampling.stop) == ["END"] and r.sampling.max_tokens == 9
    assert not chat(n=2).requests[0].sampling.HasField("seed")  # the gateway picks one each


def test_strict_json_schema_and_whitespace_map_to_grammar_options():
    (req,) = chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}},
        structured_outputs={"whitespace": "compact"}).requests
    assert json.loads(req.constraint.json_schema) == {"type": "object"}
    assert req.constraint.options.strict
    assert req.constraint.options.whitespace == common_pb2.WHITESPACE_COMPACT


def test_json_schemas_keep_the_schemas_property_order_unless_asked_for_any():
    schema = {"type": "object", "properties": {"a": {}, "b": {}}}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    for kw in (dict(response_format=rf), dict(structured_outputs={"json": schema}),
               dict(tools=tools, tool_choice="required")):
        (req,) = chat(**kw).requests
        assert req.constraint.options.fixed_property_order, kw  # as OpenAI writes keys
        so = {**kw.get("structured_outputs", {}), "property_order": "any"}
        (req,) = chat(**{**kw, "structured_outputs": so}).requests
        assert not req.constraint.options.fixed_property_order, kw
    (req,) = chat(structured_outputs={"regex": "a+"}).requests
    assert not req.constraint.options.fixed_property_order
    for so, message in (({"json": schema, "property_order": "sorted"}, "must be"),
                        ({"regex": "a", "property_order": "any"}, "only to a JSON schema")):
        with pytest.raises(ot.OpenAIError, match=message) as err:
            chat(structured_outputs=so)
        assert err.value.status == 400 and err.value.param == "structured_outputs.property_order"


def test_several_tools_required_is_an_anyof_of_name_and_arguments():
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
             for n in ("a", "b")]
    plan = chat(tools=tools, tool_choice="required")
    schema = json.loads(plan.requests[0].constraint.json_schema)
    assert [b["properties"]["name"]["const"] for b in schema["anyOf"]] == ["a", "b"]
    assert plan.tool == ot.ToolPlan(name=None)
    calls = orsp.tool_calls('{"name":"b","arguments":{"x":1}}', plan.tool, "c1")
    assert calls[0]["function"] == {"name": "b", "arguments": '{"x": 1}'}
    assert chat(tools=tools, tool_choice="none").requests[0].constraint.WhichOneof("kind") is None


@pytest.mark.parametrize("kw,param", [
    (dict(logprobs=True, top_logprobs=30), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(frequency_penalty=1), "frequency_penalty"),
    (dict(logit_bias={"1": 5}), "logit_bias"),
    (dict(n=0), "n"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "structured_outputs"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0]"),
    (dict(stream_options={"include_usage": True}), "stream_options"),
    (dict(logprobs=True, logprobs_mode="raw"), "logprobs_mode"),
    (dict(logprobs=True, logprobs_mode=1), "logprobs_mode"),
    (dict(logprobs_mode="unconstrained"), "logprobs_mode"),  # without logprobs
])
def test_refusals_name_the_openai_field(kw, param):
    with pytest.raises(ot.OpenAIError) as info:
        ot.chat_plan({"model": "m", "messages": HI, **kw}, LIMITS)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("kw,param,words", [
    (dict(top_p=2.0), "top_p", "must be in (0, 1]"),
    (dict(top_p=0), "top_p", "must be in (0, 1]"),
    (dict(temperature=float("nan")), "temperature", "must be finite"),
    (dict(temperature=-1), "temperature", "must be finite and >= 0"),
    (dict(min_p=1.5), "min_p", "must be in [0, 1]"),
    (dict(top_k=-2), "top_k", "must be >= 0"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "must be >= 1"),
    (dict(max_tokens=4, min_tokens=5), "min_tokens", "must be <= max_tokens (4)"),
    (dict(stop=["a"] * 17), "stop", "at most 16 stop strings"),
    (dict(stop=["a", ""]), "stop", "must be 1 to 256 characters"),
    (dict(stop_token_ids=[3, 100]), "stop_token_ids", "outside the vocabulary (size 100)"),
    (dict(max_tokens=2**40), "max_tokens", "out of range"),
])
def test_sampling_is_checked_by_the_grpc_rules_before_any_choice_runs(kw, param, words):
    """The gRPC path's validate_sampling (protos/sampling.py) decides, naming the OpenAI field."""
    with pytest.raises(ot.OpenAIError) as info:
        chat(**kw)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert words in info.value.message and info.value.message.startswith(f"{param}: ")


def test_accepted_sampling_is_what_validate_sampling_accepts():
    (req,) = chat(temperature=0, top_p=0.5, top_k=-1, min_p=0.1, max_tokens=7, min_tokens=7,
                  stop_token_ids=[99], ignore_eos=True, seed=2**64 - 1).requests
    s = validate_sampling(req.sampling, LIMITS)
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens, s.min_tokens) == (0, 0.5, 0, 7, 7)
    assert s.stop_token_ids == {99} and s.ignore_eos and s.seed == 2**64 - 1
    assert chat(temperature=2).requests[0].sampling.temperature == 2
    with pytest.raises(ot.OpenAIError) as info:  # OpenAI's bound, above the gRPC API's
        chat(temperature=2.5)
    assert info.value.param == "temperature"
    with pytest.raises(ot.OpenAIError) as info:
        chat(seed=2**64)
    assert info.value.param == "seed"
    plan = chat(n=2, seed=2**64 - 1)  # the seeds of the choices wrap around the uint64
    assert [r.sampling.seed for r in plan.requests] == [2**64 - 1, 0]


def test_logprobs_mode_maps_to_sampling_params_and_defaults_to_constrained():
    def mode(**kw):
        return chat(**kw).requests[0].sampling.logprobs_mode

    assert mode(logprobs=True) == common_pb2.LOGPROBS_MODE_CONSTRAINED
    assert mode(logprobs=True, logprobs_mode="constrained") == common_pb2.LOGPROBS_MODE_CONSTRAINED
    assert mode(logprobs=True, top_logprobs=2, logprobs_mode="unconstrained") == \
        common_pb2.LOGPROBS_MODE_UNCONSTRAINED
    assert mode(logprobs_mode="constrained") == common_pb2.LOGPROBS_MODE_CONSTRAINED  # harmless
    (req,) = ot.completion_plan({"model": "m", "prompt": "x", "logprobs": 0,
                                 "logprobs_mode": "unconstrained"}, LIMITS).requests
    assert validate_sampling(req.sampling, LIMITS).logprobs_mode == "unconstrained"


def test_errors_of_the_shared_path_name_the_openai_field():
    plan = chat(max_completion_tokens=5, response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "object"}}})
    err = orsp.from_service_error(InvalidArgument("must be >= 1", field="sampling.max_tokens"), plan)
    assert (err.status, err.param) == (400, "max_completion_tokens")
    err = orsp.from_service_error(InvalidArgument("spec.json_schema: bad at a.b"), plan)
    assert err.param == "response_format.json_schema.schema" and "bad at a.b" in err.message
    assert orsp.from_service_error(ResourceExhausted("full"), plan).status == 429
    err = orsp.from_service_error(Unavailable("no healthy worker group (x)"), plan)
    assert (err.status, err.code) == (503, "no_healthy_group")


def test_completions_fan_out_over_prompts_and_count_each_prompt_once():
    plan = ot.completion_plan({"model": "m", "prompt": ["a", [1, 2]], "n": 2}, LIMITS)
    assert plan.prompt_of == [0, 0, 1, 1]
    assert plan.requests[2].prompt_token_ids == [1, 2] and plan.requests[0].prompt == "a"
    finals = [gateway_pb2.Final(usage=common_pb2.Usage(prompt_tokens=p, completion_tokens=3))
              for p in (4, 4, 2, 2)]
    assert orsp.usage(plan, finals) == {"prompt_tokens": 6, "completion_tokens": 12,
                                      "total_tokens": 18}
