"""`gramserve bench`'s load generator: the summary it prints and the load it sends."""

from __future__ import annotations

import argparse
import json
from concurrent import futures

import grpc
import pytest

from gateway import loadgen
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc


def _ns(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    loadgen.bench_parser(p)
    ns = p.parse_args(["--no-progress"])
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_summary_counts_tokens_per_delta_and_finish_reasons():
    results = [loadgen.Outcome("OK", True, ttft=0.1, gaps=[0.02] * 3, tokens=8, deltas=4,
                               delta_tokens=8, finish_reason="FINISH_REASON_GRAMMAR_COMPLETED",
                               schema_valid=True),
               loadgen.Outcome("OK", False, ttft=0.3, gaps=[0.01], tokens=2, deltas=2,
                               delta_tokens=2, finish_reason="FINISH_REASON_LENGTH"),
               loadgen.Outcome("UNAVAILABLE", False, deltas=9, delta_tokens=90)]
    s = loadgen.summarize(results, elapsed=2.0)
    assert (s["requests"], s["ok"], s["errors"]) == (3, 2, {"UNAVAILABLE": 1})
    assert s["output_tokens_per_second"] == 5.0 and s["requests_per_second"] == 1.0
    assert s["tokens_per_delta"] == pytest.approx(10 / 6)  # failed streams are not counted
    assert s["finish_reasons"] == {"FINISH_REASON_GRAMMAR_COMPLETED": 1,
                                   "FINISH_REASON_LENGTH": 1}
    assert s["inter_token_seconds"]["p50"] == pytest.approx(0.02)
    assert (s["schema_checked"], s["schema_valid_rate"]) == (1, 1.0)
    json.dumps(s)


def test_summary_of_nothing_is_zeros_not_an_error():
    s = loadgen.summarize([], elapsed=0.0)
    assert s["ok"] == 0 and s["tokens_per_delta"] == 0.0 and s["schema_valid_rate"] is None
    assert s["ttft_seconds"] == {"p50": 0.0, "p90": 0.0, "p99": 0.0}


@pytest.mark.parametrize("family", ["builtin", "short", "long"])
def test_schema_families_are_bounded_json_schemas(family):
    schemas = [json.loads(s) for s in loadgen.load_schemas(family)]
    assert len(schemas) >= 3
    for s in schemas:
        assert s["type"] == "object" and s["additionalProperties"] is False


def test_unknown_schema_family_is_a_flag_error():
    with pytest.raises(ValueError, match="--schema-family"):
        loadgen.load_schemas("medium")


def test_request_mix_does_not_depend_on_the_process_split():
    ns = _ns(structured_ratio=0.5, seed=3)
    schemas = loadgen.load_schemas("short")
    one = [loadgen.make_request(i, ns, schemas) for i in range(20)]
    assert one == [loadgen.make_request(i, ns, schemas) for i in range(20)]
    assert 0 < sum(g for _, g in one) < 20
    ns.requests = 10
    split = sorted(i for k in range(3) for i in loadgen._indices(ns, k, 3, warmup=False))
    assert split == list(range(10))
    ns.warmup = 5
    warm = sorted(i for k in range(2) for i in loadgen._indices(ns, k, 2, warmup=True))
    assert warm == [-5, -4, -3, -2, -1]  # warm-up requests never reuse timed indices


def test_unguided_twin_is_the_guided_request_without_its_grammar():
    ns = _ns(structured_ratio=1.0, seed=5, schema_prompts=True, max_tokens=128)
    schemas = loadgen.load_schemas("short")
    guided = [loadgen.make_request(i, ns, schemas) for i in range(48)]
    ns.unguided_twin = 17
    twins = [loadgen.make_request(i, ns, schemas) for i in range(48)]
    for (g, was_guided), (t, twin_guided) in zip(guided, twins, strict=True):
        assert was_guided and not twin_guided
        assert not t.HasField("constraint") and g.HasField("constraint")
        assert t.prompt == g.prompt == loadgen.schema_prompt(g.constraint.json_schema)
        assert t.sampling.seed == g.sampling.seed
        assert (t.sampling.max_tokens, t.sampling.ignore_eos) == (17, True)
        assert (g.sampling.max_tokens, g.sampling.ignore_eos) == (128, False)
    assert len({t.prompt for t, _ in twins}) > 1  # the schemas' prompts, not one


class _FakeGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams max_tokens tokens two per delta; guided requests end GRAMMAR_COMPLETED."""

    def Generate(self, request, context):
        n = request.sampling.max_tokens
        for i in range(0, n, 2):
            ids = list(range(i, min(i + 2, n)))
            yield gateway_pb2.GenerateResponse(delta=gateway_pb2.Delta(text="ab", token_ids=ids))
        guided = request.constraint.HasField("json_schema")
        final = gateway_pb2.Final(
            finish_reason=(common_pb2.FINISH_REASON_GRAMMAR_COMPLETED if guided
                           else common_pb2.FINISH_REASON_LENGTH),
            usage=common_pb2.Usage(completion_tokens=n))
        if guided:
            final.schema_valid = True
        yield gateway_pb2.GenerateResponse(final=final)


@pytest.fixture
def fake_gateway():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    gateway_pb2_grpc.add_GatewayServicer_to_server(_FakeGateway(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("processes", [1, 2])
def test_bench_against_a_streaming_server_counts_every_request(fake_gateway, processes):
    ns = _ns(addr=fake_gateway, requests=24, concurrency=6, processes=processes, warmup=4,
             structured_ratio=0.5, max_tokens=8, timeout=30.0)
    s = loadgen.run_bench(ns)
    assert (s["requests"], s["ok"], s["errors"]) == (24, 24, {})
    assert s["tokens_per_delta"] == 2.0
    assert sum(s["finish_reasons"].values()) == 24 and s["schema_valid_rate"] == 1.0
    assert s["output_tokens_per_second"] == pytest.approx(24 * 8 / s["seconds"])


def test_bench_duration_mode_stops_starting_requests(fake_gateway):
    ns = _ns(addr=fake_gateway, duration=0.5, concurrency=4, max_tokens=4, timeout=30.0)
    s = loadgen.run_bench(ns)
    assert s["ok"] > 4 and s["errors"] == {} and s["seconds"] < 5


def test_bench_exit_status_is_1_when_the_server_is_gone(capsys):
    ns = _ns(addr="127.0.0.1:1", requests=2, concurrency=2, timeout=2.0, json=True)
    assert loadgen.bench_main(ns) == 1
    assert json.loads(capsys.readouterr().out)["errors"] == {"UNAVAILABLE": 2}


@pytest.mark.parametrize("kw,words", [
    (dict(http="localhost:8000"), "--http"),
    (dict(http="http://127.0.0.1:8000", backend="xgrammar"), "--backend"),
    (dict(http="http://127.0.0.1:8000", unguided_twin=16), "--unguided-twin"),
    (dict(unguided_twin=-1), "--unguided-twin"),
])
def test_http_mode_flag_errors_name_the_flag(kw, words):
    with pytest.raises(ValueError, match=words):
        loadgen.run_bench(_ns(no_progress=True, **kw))
