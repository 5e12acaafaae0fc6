"""Faults: a killed grammar service leaves grammars the gateway already compiled serving; a
killed worker rank fails its requests with UNAVAILABLE, the gateway stays up and says why,
and new requests are refused with UNAVAILABLE instead of hanging. Own system: this module
breaks it, in that order."""

import json
import signal
import time

import grpc
import pytest
from conftest import RealSystem
from procs import metric

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel, check_health


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    s = RealSystem(tmp_path_factory.mktemp("failures"), slots=2)
    try:
        s.add_gateway()
        s.wait_serving()
        yield s
    finally:
        s.stop()


def _guided(stub, schema: dict, seed: int):
    return list(stub.Generate(gateway_pb2.GenerateRequest(
        prompt="Give", constraint=common_pb2.GrammarSpec(json_schema=json.dumps(schema)),
        sampling=common_pb2.SamplingParams(max_tokens=40, seed=seed)), timeout=120))


def test_grammars_the_gateway_compiled_keep_serving_while_the_grammar_service_is_down(system):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with channel(system.gateways[0]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        assert _guided(stub, schema, 1)[-1].final.schema_valid
        before = metric(system.gateway_metrics[0], "gramserve_gateway_grammar_refs_total",
                        {"result": "hit"})
        system.children[0].kill(signal.SIGKILL)  # the grammar service
        # The gateway remembers the key; the ranks hold the grammar: no Compile, no Fetch.
        final = _guided(stub, schema, 2)[-1].final
        assert final.schema_valid and final.usage.completion_tokens > 0
        assert metric(system.gateway_metrics[0], "gramserve_gateway_grammar_refs_total",
                      {"result": "hit"}) == before + 1
        with pytest.raises(grpc.RpcError) as info:  # a new schema needs the service
            _guided(stub, {**schema, "title": "new"}, 3)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "grammar service" in info.value.details()


def test_killed_rank_fails_its_requests_with_unavailable_and_gateway_stays_up(system):
    with channel(system.gateways[0]) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        req = gateway_pb2.GenerateRequest(prompt="Go", sampling=common_pb2.SamplingParams(
            max_tokens=240, ignore_eos=True, seed=1))
        call = stub.Generate(req, timeout=120)
        next(call)  # tokens are streaming
        system.rank_procs[1].kill(signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and check_health(system.gateways[0]):
            time.sleep(0.2)
        assert system.children[-1].alive()  # the gateway process
        assert not check_health(system.gateways[0])  # no healthy group: NOT_SERVING
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
        assert models.models[0].groups == 1
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gateway_pb2.GenerateRequest(prompt="again"), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy worker group" in info.value.details()
