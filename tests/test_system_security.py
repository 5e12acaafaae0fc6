"""Security, on real processes: bearer tokens on the public API (gRPC and HTTP), per-client
limits, mutual TLS on every internal port, reflection switched off, and nothing listening
beyond loopback. One system (TP=2 over gloo, mutual TLS everywhere inside, tokens on the
gateway) for the module."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import RealSystem
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from procs import ROOT, metric, read_until_up

from gateway.dev_tls import ensure_dev_tls
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel, check_health

TOKEN_A = "alpha-0123456789abcdef0123"
TOKEN_B = "beta-0123456789abcdef01234"


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    d = tmp_path_factory.mktemp("security")
    t = ensure_dev_tls(d / "tls")
    tokens = d / "tokens"
    tokens.write_text(f"{TOKEN_A} client-a\n{TOKEN_B} client-b\n")
    server = ("--tls-cert", str(t.cert), "--tls-key", str(t.key), "--tls-client-ca", str(t.ca))
    identity = (t.cert.read_bytes(), t.key.read_bytes())
    s = RealSystem(d, tp=2, slots=2, grammar_args=(*server, "--reflection", "off"),
                   rank_args=(*server, "--tls-ca", str(t.ca)),
                   tls={"tls_ca": t.ca.read_bytes(), "tls_identity": identity})
    try:
        s.add_gateway("--tls-ca", str(t.ca), "--tls-client-cert", str(t.cert),
                      "--tls-client-key", str(t.key), "--auth-tokens", str(tokens),
                      "--client-max-streams", "1", "--client-max-queued", "1",
                      "--http-port", "0")
        s.wait_serving()
        s.files = t
        yield s
    finally:
        s.stop()


def _generate(addr, token=None, max_tokens=4, **fields):
    with channel(addr, token=token) as ch:
        return list(gateway_pb2_grpc.GatewayStub(ch).Generate(gateway_pb2.GenerateRequest(
            prompt="Hi", sampling=common_pb2.SamplingParams(max_tokens=max_tokens, seed=1),
            **fields), timeout=60))


def _http(url, body=None, token=None):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_public_grpc_api_needs_a_valid_bearer_token(secure):
    gw = secure.gateways[0]
    for token in (None, "wrong-0123456789abcdef"):
        with pytest.raises(grpc.RpcError) as info:
            _generate(gw, token)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
        with channel(gw, token=token) as ch, pytest.raises(grpc.RpcError) as info:
            gateway_pb2_grpc.GatewayStub(ch).ListModels(gateway_pb2.ListModelsRequest(),
                                                        timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with channel(gw) as ch, pytest.raises(grpc.RpcError) as info:  # reflection too
        list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert check_health(gw)  # health checks stay open (load balancers, probes)
    final = _generate(gw, TOKEN_A)[-1].final
    assert final.usage.completion_tokens > 0
    # A guided request: compiled by the grammar service and fetched by both ranks over mTLS.
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
              "additionalProperties": False}
    final = _generate(gw, TOKEN_B, max_tokens=30, constraint=common_pb2.GrammarSpec(
        json_schema=json.dumps(schema)))[-1].final
    assert final.schema_valid, final


def test_public_http_api_answers_401_without_a_valid_token(secure):
    url = secure.http_url(0)
    body = {"model": "gramserve-tiny-llama-v1", "max_tokens": 3,
            "messages": [{"role": "user", "content": "Hi"}]}
    for token in (None, "wrong-0123456789abcdef"):
        status, headers, out = _http(f"{url}/v1/chat/completions", body, token)
        assert status == 401, out
        assert out["error"]["code"] == "invalid_api_key"
        assert headers.get("www-authenticate", headers.get("WWW-Authenticate")) == "Bearer"
        assert _http(f"{url}/v1/models", token=token)[0] == 401
    assert _http(f"{url}/health")[0] == 200
    status, _, out = _http(f"{url}/v1/chat/completions", body, TOKEN_A)
    assert status == 200, out
    assert out["usage"]["completion_tokens"] > 0


def _refused(addr: str, **creds) -> bool:
    return not check_health(addr, timeout=5.0, **creds)


def test_internal_ports_refuse_plaintext_and_foreign_certificates(secure):
    t = secure.files
    ca = t.ca.read_bytes()
    ours = (t.cert.read_bytes(), t.key.read_bytes())
    foreign = (t.other_cert.read_bytes(), t.other_key.read_bytes())
    for addr in (secure.grammar, *secure.ranks):
        assert _refused(addr), f"{addr} answered plaintext"
        assert _refused(addr, tls_ca=ca), f"{addr} answered without a client certificate"
        assert _refused(addr, tls_ca=ca, tls_identity=foreign), \
            f"{addr} answered a certificate of another CA"
        assert check_health(addr, tls_ca=ca, tls_identity=ours)
    with channel(secure.grammar, tls_ca=ca, tls_identity=ours) as ch, \
            pytest.raises(grpc.RpcError) as info:  # --reflection off
        list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_one_client_cannot_take_every_slot_and_queue_place(secure):
    gw, url = secure.gateways[0], secure.gateway_metrics[0]
    with channel(gw, token=TOKEN_A) as ch_a:
        stub_a = gateway_pb2_grpc.GatewayStub(ch_a)
        long = gateway_pb2.GenerateRequest(prompt="Go", sampling=common_pb2.SamplingParams(
            max_tokens=240, ignore_eos=True, seed=2))
        running = stub_a.Generate(long, timeout=60)
        next(running)  # client-a holds one of the two slots: its --client-max-streams
        waiting = stub_a.Generate(long, timeout=60)
        deadline = time.monotonic() + 10
        while metric(url, "gramserve_gateway_queue_depth") < 1:  # queued, though a slot is free
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as info:  # its one queue place is taken
            list(stub_a.Generate(long, timeout=60))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "client-a" in info.value.details() and "retry after" in info.value.details()
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
        # client-b passes client-a's waiter and takes the free slot at once.
        final = _generate(gw, TOKEN_B)[-1].final
        assert final.usage.completion_tokens > 0 and final.timings.queue_seconds < 0.5
        running.cancel()
        waiting.cancel()
    assert not any(secure.wait_slots_free())


def _listening(pid: int) -> list[tuple[str, int]]:
    """(local address, port) of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            host_hex, port_hex = f[1].split(":")
            raw = bytes.fromhex(host_hex)
            if width == 8:
                host = ".".join(str(b) for b in raw[::-1])
            else:  # four little-endian 32-bit words
                words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                host = bytes(b for w in words for b in w).hex()
            out.append((host, int(port_hex, 16)))
    return out


def test_every_port_listens_on_loopback_only(secure):
    loopback = {"127.0.0.1", "0" * 30 + "01", "0" * 20 + "ffff7f000001"}
    seen = 0
    for child in secure.children:
        for host, port in _listening(child.popen.pid):
            seen += 1
            assert host in loopback, f"{child.name} listens on {host}:{port}"
    # gRPC, metrics, the rendezvous store (rank 0) and gloo's pairs were all looked at.
    assert seen >= 2 + 2 + 2 + 1 + 2


def test_up_with_tls_dir_and_tokens_serves_over_mutual_tls(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} client-a\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "GRAMSERVE_TORCH_THREADS": "1", "GRAMSERVE_COMPILE_WORKERS": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "up", "--tp", "1", "--port", "0",
         "--http-port", "-1", "--metrics-port", "-1", "--slots", "2", "--max-model-len", "128",
         "--tls-dir", str(tmp_path / "tls"), "--auth-tokens", str(tokens)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
        start_new_session=True)
    try:
        _, addr = read_until_up(up)
        assert {p.name for p in (tmp_path / "tls").iterdir()} >= {"ca.crt", "tls.crt", "tls.key"}
        assert oct((tmp_path / "tls" / "tls.key").stat().st_mode)[-3:] == "600"
        cmd = [sys.executable, "-m", "gateway.cli", "generate", "--addr", addr, "--choice", "yes",
               "--choice", "no", "--json", "Answer:"]
        out = subprocess.run([*cmd, "--token", TOKEN_A], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["text"] in ("yes", "no")
        refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(60)
