"""A killed worker rank: its requests fail with UNAVAILABLE, the gateway stays up and says
why, and new requests are refused with UNAVAILABLE instead of hanging. Own system: this
module breaks it."""

import signal
import time

import grpc
import pytest
from conftest import RealSystem

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
