"""Flags, GRAMSERVE_* defaults and configuration checks of the gateway and the command."""

import argparse
import json

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from gateway import cli, commands, launcher, loadgen
from gateway.config import GatewayConfig, add_gateway_args, parse_groups
from gateway.metrics import GatewayMetrics


def _gateway_ns(argv):
    p = argparse.ArgumentParser()
    add_gateway_args(p)
    return p.parse_args(argv)


def test_groups_parse_from_repeated_flags_and_semicolons():
    assert parse_groups(["a:1,a:2;b:1,b:2", "c:1"]) == (("a:1", "a:2"), ("b:1", "b:2"), ("c:1",))


def test_group_address_without_port_is_refused():
    with pytest.raises(ValueError, match="'a' is not host:port"):
        parse_groups("a")


def test_gateway_flags_take_env_defaults(monkeypatch):
    monkeypatch.setenv("GRAMSERVE_MAX_QUEUE", "7")
    monkeypatch.setenv("GRAMSERVE_GROUP", "h:1,h:2")
    monkeypatch.setenv("GRAMSERVE_GRAMMAR_SERVICE", "g:9")
    cfg = GatewayConfig.from_args(_gateway_ns([]))
    assert cfg.max_queue == 7 and cfg.groups == (("h:1", "h:2"),) and cfg.grammar_service == "g:9"


def test_flag_overrides_env_default(monkeypatch):
    monkeypatch.setenv("GRAMSERVE_MAX_QUEUE", "7")
    ns = _gateway_ns(["--max-queue", "3", "--group", "h:1", "--grammar-service", "g:1"])
    assert GatewayConfig.from_args(ns).max_queue == 3


@pytest.mark.parametrize("argv,message", [
    (["--group", "h:1"], "--grammar-service"),
    (["--grammar-service", "g:1"], "--group"),
    (["--grammar-service", "g:1", "--group", "h:1", "--max-queue", "-1"], "--max-queue"),
    (["--grammar-service", "g:1", "--group", "h:1", "--health-interval", "0"], "--health-interval"),
    (["--grammar-service", "g:1", "--group", "h:1", "--tls-cert", "/nonexistent"], "--tls-cert"),
])
def test_bad_gateway_config_is_refused_with_the_flag_named(argv, message):
    with pytest.raises(ValueError, match=message):
        GatewayConfig.from_args(_gateway_ns(argv))


def test_gateway_command_with_bad_flags_exits_2(capsys):
    assert cli.main(["gateway", "--group", "h:1"]) == 2
    assert "--grammar-service" in capsys.readouterr().out


def test_generate_constraint_flags_build_the_spec(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object"}')
    p = argparse.ArgumentParser()
    commands.generate_parser(p)
    spec = commands.constraint_from_args(p.parse_args(["--json-schema", str(schema), "x"]))
    assert spec.json_schema == '{"type": "object"}'
    spec = commands.constraint_from_args(p.parse_args(["--choice", "a", "--choice", "b", "x"]))
    assert list(spec.choice.choices) == ["a", "b"]
    spec = commands.constraint_from_args(p.parse_args(["--whitespace", "compact", "--json-object", "x"]))
    assert spec.WhichOneof("kind") == "json_object" and spec.options.whitespace == 1
    with pytest.raises(SystemExit):
        p.parse_args(["--regex", "a", "--json-object", "x"])


@pytest.mark.parametrize("argv,message", [
    (["generate", "--json-schema", "/no/such.json", "hi"], "--json-schema: cannot read"),
    (["generate", "--seed", "-1", "hi"], "--seed: -1 is out of range"),
    (["compile", "--json-schema", "/dev/zero"], "--json-schema: /dev/zero is larger than"),
    (["generate", "--ebnf", "BINARY", "hi"], "--ebnf: BINARY is not UTF-8"),
])
def test_bad_client_flags_end_with_a_message_naming_the_flag(argv, message, capsys, tmp_path):
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\xff\xfe\x00")
    argv = [str(binary) if a == "BINARY" else a for a in argv]
    assert cli.main([*argv, "--addr", "127.0.0.1:1", "--timeout", "2"]) == 2
    assert message.replace("BINARY", str(binary)) in capsys.readouterr().err


def test_generate_against_nothing_listening_exits_1(capsys):
    assert cli.main(["generate", "--addr", "127.0.0.1:1", "--timeout", "2", "hi"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_health_of_nothing_listening_exits_1():
    assert cli.main(["health", "--addr", "127.0.0.1:1", "--timeout", "0.5"]) == 1


def test_up_config_checks_its_flags():
    with pytest.raises(ValueError, match="--tp"):
        launcher.UpConfig(model=None, tp=0)
    with pytest.raises(ValueError, match="--device"):
        launcher.UpConfig(model=None, device="tpu")


def test_up_defaults_on_cpu_are_one_group_of_two_ranks_with_8_slots():
    p = argparse.ArgumentParser()
    launcher.up_parser(p)
    ns = p.parse_args([])
    assert (ns.tp, ns.groups, ns.slots, ns.port, ns.device) == (2, 1, 8, 50051, "cpu")


def test_free_ports_are_consecutive_and_not_reused():
    taken = set()
    a = launcher.free_ports(3, taken)
    b = launcher.free_ports(2, taken)
    assert taken >= {a, a + 1, a + 2, b, b + 1} and len(taken) == 5


def test_free_ports_lie_below_the_ephemeral_range():
    # A port from the ephemeral range can meanwhile become an outgoing connection's local
    # port; a readiness probe of it then connects to itself. CI lost a whole `gramserve up`
    # to that: the /metrics probe read back its own "GET /metrics" as the status line.
    start = launcher._ephemeral_start()
    if len(launcher._PORTS) < 1000:
        pytest.skip(f"this kernel's ephemeral range starts at {start}: no room below it")
    taken: set[int] = set()
    for _ in range(200):
        base = launcher.free_ports(4, taken)
        assert 10000 <= base and base + 4 <= start
    assert len(taken) == 800


def test_a_probe_that_reads_no_http_status_line_is_not_ready():
    # A listener that echoes the request back, as a self-connected probe would read it.
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def echo():
        conn, _ = srv.accept()
        with conn:
            conn.sendall(conn.recv(4096))

    threading.Thread(target=echo, daemon=True).start()
    try:
        assert launcher._answers(f"http://127.0.0.1:{srv.getsockname()[1]}/metrics") is False
    finally:
        srv.close()


def test_bench_summary_reports_percentiles_errors_and_schema_rate():
    results = [loadgen.Outcome("OK", True, ttft=0.1 * i, gaps=[0.01] * 3, tokens=4,
                               schema_valid=i % 2 == 0) for i in range(1, 11)]
    results.append(loadgen.Outcome("RESOURCE_EXHAUSTED", False))
    s = loadgen.summarize(results, elapsed=2.0)
    assert s["ok"] == 10 and s["errors"] == {"RESOURCE_EXHAUSTED": 1}
    assert s["requests_per_second"] == 5.0 and s["output_tokens_per_second"] == 20.0
    assert s["ttft_seconds"]["p50"] == pytest.approx(0.55)
    assert s["schema_valid_rate"] == 0.5
    json.dumps(s)


def test_gateway_metric_names_are_the_documented_ones():
    registry = CollectorRegistry()
    m = GatewayMetrics(registry)
    m.requests.labels("json_schema", "OK").inc()
    text = generate_latest(registry).decode()
    for name in ("gramserve_gateway_requests_total", "gramserve_gateway_time_to_first_token_seconds",
                 "gramserve_gateway_inter_token_seconds", "gramserve_gateway_request_seconds",
                 "gramserve_gateway_queue_depth", "gramserve_gateway_in_flight",
                 "gramserve_gateway_schema_invalid_total",
                 "gramserve_gateway_grammar_length_finish_total"):
        assert name in text
    assert 'gramserve_gateway_requests_total{constraint="json_schema",status="OK"} 1.0' in text
