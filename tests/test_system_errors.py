"""Errors a client can cause, and hostile but valid load, on the shared real system: every
refusal names the public field with the right status; huge prompts are refused before they
are tokenised and never hold up other requests; the whole 64-bit seed reaches the sampler;
the metrics pages follow Prometheus conventions."""

import threading
import time
import urllib.request

import grpc
import pytest

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel

GENERATE = "/" + gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name + "/Generate"


@pytest.fixture(scope="module")
def stub(gramserve_system):
    with channel(gramserve_system.gateways[0]) as ch:
        yield gateway_pb2_grpc.GatewayStub(ch)


def _refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _generate(stub, **fields):
    fields.setdefault("sampling", common_pb2.SamplingParams(max_tokens=4, seed=1))
    return list(stub.Generate(gateway_pb2.GenerateRequest(**fields), timeout=120))


def test_compile_errors_name_the_public_field(stub):
    bad = common_pb2.GrammarSpec(json_schema='{"type": "object", "x": }')
    for call in (lambda: _generate(stub, prompt="x", constraint=bad),
                 lambda: stub.CompileGrammar(gateway_pb2.CompileGrammarRequest(constraint=bad),
                                             timeout=60)):
        err = _refusal(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("constraint.json_schema: not valid JSON"), err.details()
        assert "spec." not in err.details()


def test_a_string_that_is_not_utf8_is_invalid_argument_naming_it(gramserve_system):
    raw = gateway_pb2.GenerateRequest(prompt="aXb").SerializeToString().replace(b"X", b"\xff")
    with channel(gramserve_system.gateways[0]) as ch:
        call = ch.unary_stream(GENERATE, response_deserializer=gateway_pb2.GenerateResponse.FromString)
        err = _refusal(lambda: list(call(raw, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "prompt: is not valid UTF-8"


def test_two_grammar_kinds_at_once_are_refused_not_last_wins(gramserve_system):
    one = gateway_pb2.GenerateRequest(prompt="x", constraint=common_pb2.GrammarSpec(regex="a+"))
    other = gateway_pb2.GenerateRequest(constraint=common_pb2.GrammarSpec(choice=common_pb2.ChoiceList(
        choices=["b"])))
    raw = one.SerializeToString() + other.SerializeToString()
    with channel(gramserve_system.gateways[0]) as ch:
        call = ch.unary_stream(GENERATE, response_deserializer=gateway_pb2.GenerateResponse.FromString)
        err = _refusal(lambda: list(call(raw, timeout=30)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "constraint: sets both regex and choice; set exactly one (kind)"


def test_the_top_bit_of_the_seed_reaches_the_sampler(stub):
    def text(seed):
        final = _generate(stub, prompt="Once", sampling=common_pb2.SamplingParams(
            max_tokens=12, seed=seed, temperature=1.0, ignore_eos=True))[-1].final
        assert final.seed == seed
        return final.text

    low = 12345
    assert text(low) == text(low)  # deterministic
    assert text(low) != text(low + 2**63)
    assert text(2**64 - 1) != text(2**63 - 1)


def test_a_prompt_over_the_byte_bound_is_refused_before_tokenising(stub):
    huge = "word " * 700_000  # 3.5 MB: under --max-request-bytes, over --max-prompt-bytes
    t0 = time.monotonic()
    err = _refusal(lambda: _generate(stub, prompt=huge))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("prompt: is 3500000 bytes of UTF-8; the limit is 1048576")
    err = _refusal(lambda: _generate(stub, messages=[
        gateway_pb2.ChatMessage(role="user", content=huge)]))
    assert err.details().startswith("messages: is 3500004 bytes")
    assert time.monotonic() - t0 < 5.0  # tokenising it would take seconds on this CPU


def test_large_prompts_being_tokenised_do_not_hold_up_a_small_request(stub):
    def small() -> float:
        t0 = time.monotonic()
        assert _generate(stub, prompt="hi", sampling=common_pb2.SamplingParams(
            max_tokens=1, seed=1))[-1].final.usage.completion_tokens == 1
        return time.monotonic() - t0

    alone = min(small() for _ in range(3))
    big = "Lorem ipsum dolor sit amet, 12345 consectetur. " * 21_000  # ~1 MB, under the bound
    errors: list = []

    def send():
        try:  # tokenised in full, then refused: far longer than the context
            _generate(stub, prompt=big)
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the three are being tokenised now
    during = small()
    for t in threads:
        t.join(120)
    assert len(errors) == 3 and all(
        e.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens; the context holds" in e.details()
        for e in errors), [e.details() for e in errors]
    assert during < alone + 1.5, (alone, during)


def _page(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


def test_metrics_pages_carry_build_info_and_rank_and_no_created_series(gramserve_system):
    gateway = _page(gramserve_system.gateway_metrics[0])
    assert 'gramserve_build_info{component="gateway"' in gateway
    for rank, url in enumerate(gramserve_system.rank_metrics):
        page = _page(url)
        assert 'component="worker"' in page and f'rank="{rank}"' in page
        samples = [line for line in page.splitlines() if line.startswith("gramserve_worker_")]
        assert samples and all(f'rank="{rank}"' in line for line in samples)
        assert "gramserve_worker_admit_expired_total" in page
        assert "gramserve_worker_nonfinite_logits_total" in page
    for page in (gateway, *map(_page, gramserve_system.rank_metrics)):
        assert "_created" not in page
        names = {line.split("{")[0].split(" ")[0] for line in page.splitlines()
                 if line.startswith("gramserve_")}
        # Base units only: seconds and bytes, never milliseconds or megabytes.
        assert not [n for n in names if any(u in n for u in ("_ms", "_millis", "_mb", "_kb"))]
