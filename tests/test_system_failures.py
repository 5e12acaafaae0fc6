"""Faults: a killed grammar service leaves grammars the gateway already compiled serving, and
the gateway's health says so (compile NOT_SERVING, generate SERVING, /ready "degraded"); a
killed worker rank fails its requests with UNAVAILABLE, the gateway stays up and says why,
and new requests are refused with UNAVAILABLE instead of hanging. Own system: this module
breaks it, in that order."""

import json
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from conftest import RealSystem
from procs import metric

from gateway import cli
from gateway.health import COMPILE, GENERATE
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel, check_health


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    s = RealSystem(tmp_path_factory.mktemp("failures"), slots=2)
    try:
        s.add_gateway("--http-port", "0")
        s.wait_serving()
        yield s
    finally:
        s.stop()


def _guided(stub, schema: dict, seed: int):
    return list(stub.Generate(gateway_pb2.GenerateRequest(
        prompt="Give", constraint=common_pb2.GrammarSpec(json_schema=json.dumps(schema)),
        sampling=common_pb2.SamplingParams(max_tokens=40, seed=seed)), timeout=120))


def _ready(system) -> tuple[int, dict]:
    """(HTTP status, JSON body) of the gateway's GET /ready."""
    try:
        with urllib.request.urlopen(system.http_url(0) + "/ready", timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_grammars_the_gateway_compiled_keep_serving_while_the_grammar_service_is_down(
        system, capsys):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    gateway, up_metric = system.gateways[0], "gramserve_gateway_grammar_service_up"
    deadline = time.monotonic() + 10  # the gateway may have started before the service
    while time.monotonic() < deadline and not check_health(gateway, service=COMPILE):
        time.sleep(0.1)
    assert check_health(gateway, service=GENERATE) and check_health(gateway, service=COMPILE)
    status, body = _ready(system)
    assert status == 200 and body["status"] == "ready" and body["compile"], body
    assert body["healthy_groups"] == body["groups"] == 1
    assert metric(system.gateway_metrics[0], up_metric) == 1
    with channel(gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        assert _guided(stub, schema, 1)[-1].final.schema_valid
        before = metric(system.gateway_metrics[0], "gramserve_gateway_grammar_refs_total",
                        {"result": "hit"})
        system.children[0].kill(signal.SIGKILL)  # the grammar service
        # The next health rounds (every 0.5 s) see it gone: compile NOT_SERVING, generate
        # and the overall status still SERVING.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and check_health(gateway, service=COMPILE):
            time.sleep(0.1)
        assert not check_health(gateway, service=COMPILE)
        assert check_health(gateway, service=GENERATE) and check_health(gateway)
        status, body = _ready(system)
        assert status == 200, body
        assert body["status"] == "degraded" and body["generate"] and not body["compile"], body
        assert body["grammar_service"] == "unavailable" and body["cached_grammars"] >= 1
        assert metric(system.gateway_metrics[0], up_metric) == 0
        assert cli.main(["health", "--addr", gateway]) == 0  # degraded still serves
        assert capsys.readouterr().out.strip() == \
            f"{gateway}: SERVING (generate SERVING, compile NOT SERVING)"
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
        assert not check_health(system.gateways[0], service=GENERATE)
        status, body = _ready(system)
        assert status == 503 and body["status"] == "unavailable", body
        assert body["healthy_groups"] == 0 and not body["generate"]
        models = stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
        assert models.models[0].groups == 1
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gateway_pb2.GenerateRequest(prompt="again"), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no healthy worker group" in info.value.details()
