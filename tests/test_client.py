"""The typed Python client (sync and asyncio) against the real stack on loopback: every
constraint kind as a typed argument, streams, compile, models, and errors as exceptions
carrying the gRPC status and the field the server named."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from gateway.client import (
    AsyncClient,
    Choice,
    Client,
    Completion,
    Delta,
    Ebnf,
    GramserveError,
    JsonObject,
    JsonSchema,
    Regex,
    StructuralTag,
)

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(gramserve_system):
    with Client(gramserve_system.gateways[0], timeout=120) as c:
        yield c


def test_generate_under_a_json_schema_completes_a_valid_instance(client):
    out = client.generate("A number:", constraint=JsonSchema(SCHEMA, whitespace="compact"),
                          max_tokens=32, seed=1)
    assert isinstance(out, Completion) and out.finish_reason == "grammar_completed"
    assert out.schema_valid is True and 0 <= json.loads(out.text)["n"] <= 9
    assert out.prompt_tokens > 0 and out.completion_tokens > 0 and out.seed == 1


@pytest.mark.parametrize(("constraint", "check"), [
    (Regex("[a-z]{3}"), lambda o: len(o.text) == 3 and o.text.isalpha()),
    (Choice(["red", "green"]), lambda o: o.text in ("red", "green")),
    (Ebnf('root ::= "x" [0-9]'), lambda o: len(o.text) == 2 and o.text[0] == "x"),
    # Random weights write long strings: an object, or a prefix of one cut by max_tokens.
    (JsonObject(whitespace="compact"), lambda o: o.text.startswith("{") and (
        o.finish_reason == "length" or isinstance(json.loads(o.text), dict))),
    (StructuralTag({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<n>", "end": "</n>",
        "content": {"type": "json_schema", "json_schema": {"enum": [1, 2]}}}}),
     lambda o: o.text in ("<n>1</n>", "<n>2</n>")),
])
def test_every_constraint_kind_is_a_typed_argument(client, constraint, check):
    out = client.generate("Go:", constraint=constraint, max_tokens=48, seed=3)
    assert check(out), out
    assert out.finish_reason in ("grammar_completed", "length" if isinstance(
        constraint, JsonObject) else "grammar_completed"), out


def test_stream_deltas_concatenate_to_the_completion(client):
    stream = client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                           temperature=0.0, echo_prompt_token_ids=True)
    deltas = list(stream)
    assert deltas and all(isinstance(d, Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == stream.completion.text
    assert len(stream.completion.prompt_token_ids) == stream.completion.prompt_tokens


def test_compile_and_models(client):
    compiled = client.compile(Regex("[a-z]+"))
    assert compiled.key and compiled.kind == "regex"
    assert client.compile(Regex("[a-z]+")).cached
    (model,) = client.models()
    assert model.id.startswith("gramserve-tiny-llama") and model.vocab_size > 0


def test_errors_carry_the_status_and_the_field(client):
    with pytest.raises(GramserveError) as bad:
        client.generate("x", top_p=1.5)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.value.field == "sampling.top_p"
    with pytest.raises(GramserveError) as bad:
        client.compile(JsonSchema("{not json"))
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and bad.value.field
    with pytest.raises(ValueError, match="exactly one of prompt"):
        client.generate("x", prompt_token_ids=[1])


def test_unknown_model_is_not_found_on_model(gramserve_system):
    with Client(gramserve_system.gateways[0], model="nope") as other:
        with pytest.raises(GramserveError) as missing:
            other.generate("x", max_tokens=1)
    assert missing.value.code == grpc.StatusCode.NOT_FOUND and missing.value.field == "model"


def test_async_client_generates_streams_compiles_and_raises(gramserve_system):
    async def main():
        async with AsyncClient(gramserve_system.gateways[0], timeout=120) as c:
            out = await c.generate("Pick:", constraint=Choice(["yes", "no"]), seed=2)
            stream = c.stream("Count:", constraint=Regex("[0-9]{4}"), seed=5)
            text = "".join([d.text async for d in stream])
            compiled = await c.compile(JsonSchema(SCHEMA))
            models = await c.models()
            with pytest.raises(GramserveError) as bad:
                await c.generate("x", max_tokens=-1)
            pair = await c.generate_n("Pick:", n=2, constraint=Choice(["yes", "no"]), seed=2,
                                      logprobs=True, top_logprobs=1)
            return out, text, stream.completion, compiled, models, bad.value, pair

    out, text, completion, compiled, models, err, pair = asyncio.run(main())
    assert [p.index for p in pair] == [0, 1] and pair[0].text == out.text
    for p in pair:
        _consistent(p, 1)
    assert out.text in ("yes", "no") and out.finish_reason == "grammar_completed"
    assert len(text) == 4 and text.isdigit() and completion.text == text
    assert compiled.kind == "json_schema" and len(models) == 1
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.field == "sampling.max_tokens"


def _consistent(out: Completion, top: int) -> None:
    """One logprob per token; where the chosen token is among the alternatives, the same
    value; alternatives most likely first and never more than asked."""
    assert len(out.logprobs) == out.completion_tokens > 0
    for lp in out.logprobs:
        assert lp.logprob <= 0.0 and len(lp.top) <= top
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for token, value in lp.top:
            if token == lp.token_id:
                assert value == pytest.approx(lp.logprob, abs=1e-5)


def test_logprobs_mode_unconstrained_passes_through_the_grpc_gateway(client):
    """The same tokens; each chosen token's logprob is of the model's distribution before
    the mask, so below its constrained one (the grammar allows 10 of the vocabulary)."""
    def ask(**kw):
        return client.generate("Count:", constraint=Regex("[0-9]{3}"), seed=40,
                               logprobs=True, top_logprobs=2, **kw)

    constrained, unconstrained = ask(), ask(logprobs_mode="unconstrained")
    assert unconstrained.text == constrained.text
    assert [lp.token_id for lp in unconstrained.logprobs] == \
        [lp.token_id for lp in constrained.logprobs]
    _consistent(unconstrained, 2)
    for c, u in zip(constrained.logprobs, unconstrained.logprobs, strict=True):
        assert u.logprob < c.logprob and len(u.top) == 2
    with pytest.raises(ValueError, match="logprobs_mode"):
        client.generate("x", logprobs=True, logprobs_mode="raw")
    with pytest.raises(ValueError, match="needs logprobs"):
        client.generate("x", logprobs_mode="unconstrained")


def test_n_choices_with_logprobs_stream_apart_and_complete_together(client):
    stream = client.stream("Count:", constraint=Regex("[0-9]{3}"), n=3, seed=40,
                           logprobs=True, top_logprobs=2)
    texts, lps = ["", "", ""], [[], [], []]
    for d in stream:
        texts[d.index] += d.text
        lps[d.index] += d.logprobs
    outs = stream.completions
    assert [o.index for o in outs] == [0, 1, 2] and stream.completion is outs[0]
    assert [o.seed for o in outs] == [40, 41, 42]
    for i, out in enumerate(outs):
        assert out.text == texts[i] and len(out.text) == 3 and out.text.isdigit()
        assert list(out.logprobs) == lps[i]
        _consistent(out, 2)
    assert len({o.text for o in outs}) > 1  # three samples, not one copied
    again = client.generate_n("Count:", n=3, constraint=Regex("[0-9]{3}"), seed=40)
    assert [o.text for o in again] == texts and not again[0].logprobs
    with pytest.raises(ValueError, match="generate_n"):
        client.generate("x", n=2)
