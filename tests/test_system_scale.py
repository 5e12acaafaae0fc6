"""Production sizes on CPU: more slots and streams than any pool or default of the gateway or
the worker. A TP=2 group with 48 slots under 48 concurrent client streams: every rank's health
check answers SERVING in under a second throughout, no request fails, all complete."""

from __future__ import annotations

import threading
import time

import grpc
from conftest import RealSystem
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel

STREAMS = 48


def test_48_streams_on_48_slots_complete_while_health_answers(tmp_path):
    system = RealSystem(tmp_path, tp=2, slots=STREAMS)
    try:
        system.add_gateway("--max-queue", "0")
        system.wait_serving()
        stop = threading.Event()
        slowest = []  # (seconds, address) of every health check

        def probe():
            channels = {a: channel(a) for a in system.ranks}
            try:
                while not stop.is_set():
                    for addr, ch in channels.items():
                        t0 = time.monotonic()
                        try:
                            status = health_pb2_grpc.HealthStub(ch).Check(
                                health_pb2.HealthCheckRequest(), timeout=1.0).status
                        except grpc.RpcError as exc:
                            status = exc.code().name
                        slowest.append((time.monotonic() - t0, addr, status))
                    time.sleep(0.1)
            finally:
                for ch in channels.values():
                    ch.close()

        prober = threading.Thread(target=probe)
        prober.start()
        outcomes: list = [None] * STREAMS
        with channel(system.gateways[0]) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)

            def one(i):
                req = gateway_pb2.GenerateRequest(
                    prompt=f"stream {i} says", sampling=common_pb2.SamplingParams(
                        max_tokens=24, ignore_eos=True, seed=i))
                try:
                    outcomes[i] = list(stub.Generate(req, timeout=240))[-1].final
                except grpc.RpcError as exc:
                    outcomes[i] = exc.code().name

            clients = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
            for t in clients:
                t.start()
            for t in clients:
                t.join()
        stop.set()
        prober.join()
        failed = [o for o in outcomes if isinstance(o, str)]
        assert not failed, failed[:5]
        assert all(o.usage.completion_tokens == 24 for o in outcomes)
        assert {s for _, _, s in slowest} == {health_pb2.HealthCheckResponse.SERVING}
        assert max(t for t, _, _ in slowest) < 1.0
        assert system.wait_slots_free() == [0, 0]
    finally:
        system.stop()
