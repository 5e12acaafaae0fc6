"""The command lines the chart renders are accepted by the processes' own flag parsers.

The chart and the processes are written apart; this is where they meet. The rendered args
go through the real parsers and config validation (gateway.config, gpu_worker.launch,
gpu_worker.config), so a renamed flag or a broken value fails here, not in a cluster.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from gateway.cli import build_parser
from gateway.config import GatewayConfig, add_gateway_args
from gpu_worker import launch
from gpu_worker.config import WorkerConfig

CHART = Path(__file__).resolve().parent.parent / "helm" / "gramserve"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def pod_args(chart, values: dict) -> dict[str, tuple[dict, list[str]]]:
    """{component: (workload object, container args)} for the rendered chart."""
    out = {}
    for path, text in chart.render(values, name="demo", namespace="ml").items():
        for obj in yaml.safe_load_all(text) if path.endswith(".yaml") else ():
            if obj and obj["kind"] in ("Deployment", "StatefulSet"):
                (c,) = obj["spec"]["template"]["spec"]["containers"]
                out[c["args"][0]] = (obj, c["args"])
    return out


def test_helm_chart_subcommands_exist_in_gramserve_cli(chart):
    choices = next(a for a in build_parser()._actions
                   if isinstance(a, argparse._SubParsersAction)).choices
    assert set(pod_args(chart, {})) == {"gateway", "grammar-service", "worker-group"}
    assert set(pod_args(chart, {})) <= set(choices)


@pytest.mark.parametrize("tp,groups", [(1, 1), (4, 3)])
def test_helm_worker_args_start_tp_ranks_on_one_rendezvous(chart, tp, groups):
    sts, args = pod_args(chart, {"worker": {"tp": tp, "groups": groups}})["worker-group"]
    ns, rest = launch.parse(args[1:])
    assert ns.tp == tp
    ranks = [launch.rank_command(ns, rest, r) for r in range(tp)]
    # Each rank command is `python -m gpu_worker <flags>`: validate the flags as the rank would.
    configs = [WorkerConfig.from_args(cmd[3:]) for cmd in ranks]
    assert [c.rank for c in configs] == list(range(tp))
    assert {c.dist_addr for c in configs} == {"127.0.0.1:29500"}
    assert [c.port for c in configs] == [50060 + r for r in range(tp)]
    assert [c.metrics_port for c in configs] == [9110 + r for r in range(tp)]
    assert {(c.device, c.slots, c.max_model_len, c.model) for c in configs} == {
        ("cuda", 64, 8192, "/models/model")}
    ports = {p["containerPort"]
             for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {c.port for c in configs} | {c.metrics_port for c in configs} == ports


@pytest.mark.parametrize("tp,groups", [(1, 1), (2, 2), (4, 3)])
def test_helm_gateway_groups_parse_to_one_entry_per_worker_pod(chart, tp, groups):
    rendered = pod_args(chart, {"worker": {"tp": tp, "groups": groups}})
    _, args = rendered["gateway"]
    p = argparse.ArgumentParser()
    add_gateway_args(p)
    cfg = GatewayConfig.from_args(p.parse_args(args[1:]))
    sts, _ = rendered["worker-group"]
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert cfg.groups == tuple(
        tuple(f"{name}-{g}.{svc}.ml.svc.cluster.local:{50060 + r}" for r in range(tp))
        for g in range(groups))
    assert (cfg.port, cfg.metrics_port, cfg.max_queue) == (50051, 9100, 256)


def test_helm_tls_args_parse_for_gateway_and_worker(chart):
    rendered = pod_args(chart, {"tls": {"enabled": True}, "worker": {"tp": 2}})
    p = argparse.ArgumentParser()
    add_gateway_args(p)
    gw = p.parse_args(rendered["gateway"][1][1:])
    assert (gw.tls_cert, gw.tls_key, gw.tls_ca) == (
        "/etc/gramserve/tls/tls.crt", "/etc/gramserve/tls/tls.key", "/etc/gramserve/tls/ca.crt")
    ns, rest = launch.parse(rendered["worker-group"][1][1:])
    cfg = WorkerConfig.from_args(launch.rank_command(ns, rest, 1)[3:])
    assert (cfg.tls_cert, cfg.tls_key, cfg.tls_ca) == (
        "/etc/gramserve/tls/tls.crt", "/etc/gramserve/tls/tls.key", "/etc/gramserve/tls/ca.crt")


def test_helm_mutual_tls_tokens_and_bind_flags_parse_for_every_component(chart):
    from grammar_service.config import parse_config

    rendered = pod_args(chart, {"tls": {"enabled": True}, "auth": {"enabled": True},
                                "reflection": False, "worker": {"tp": 2},
                                "gateway": {"clientMaxStreams": 4, "clientMaxQueued": 8}})
    d = "/etc/gramserve/tls"
    p = argparse.ArgumentParser()
    add_gateway_args(p)
    gw_obj, gw_args = rendered["gateway"]
    gw = p.parse_args(gw_args[1:])
    assert (gw.tls_client_cert, gw.tls_client_key) == (f"{d}/tls.crt", f"{d}/tls.key")
    assert (gw.auth_tokens, gw.client_max_streams, gw.client_max_queued) == (
        "/etc/gramserve/auth/tokens", 4, 8)
    assert (gw.metrics_host, gw.reflection, gw.max_prompt_bytes) == ("0.0.0.0", "off", 1048576)
    pod = gw_obj["spec"]["template"]["spec"]
    assert {"name": "auth", "mountPath": "/etc/gramserve/auth", "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    assert any(v["name"] == "auth" and v["secret"]["secretName"] == "gramserve-auth"
               for v in pod["volumes"])
    ns, rest = launch.parse(rendered["worker-group"][1][1:])
    rank = WorkerConfig.from_args(launch.rank_command(ns, rest, 1)[3:])
    assert (rank.tls_client_ca, rank.metrics_host, rank.reflection) == (
        f"{d}/ca.crt", "0.0.0.0", "off")
    grammar_obj, grammar_args = rendered["grammar-service"]
    grammar = parse_config(grammar_args[1:])
    assert (grammar.tls_client_ca, grammar.metrics_host, grammar.reflection) == (
        f"{d}/ca.crt", "0.0.0.0", "off")
    assert grammar.cache_dir_bytes == 8 * 1024**3
    # Probes of servers that require client certificates present the pod's certificate.
    probe = grammar_obj["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["exec"]["command"][-4:] == ["--tls-cert", f"{d}/tls.crt", "--tls-key",
                                             f"{d}/tls.key"]


@pytest.mark.parametrize("drain,sleep", [(None, None), (120, 0), (0, 15)])
def test_helm_gateway_grace_period_covers_prestop_and_drain_timeout(chart, drain, sleep):
    values = {k: v for k, v in (("drainTimeoutSeconds", drain), ("preStopSleepSeconds", sleep))
              if v is not None}
    deployment, args = pod_args(chart, {"gateway": values})["gateway"]
    p = argparse.ArgumentParser()
    add_gateway_args(p)
    cfg = GatewayConfig.from_args(p.parse_args(args[1:]))
    assert cfg.drain_timeout == (30 if drain is None else drain)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    slept = float(command[-1].rsplit("(", 1)[1].rstrip(")"))
    assert slept == (5 if sleep is None else sleep)
    # Kubernetes kills the pod grace seconds after preStop begins: the preStop sleep and the
    # whole drain must fit, with room to close the links afterwards.
    assert pod["terminationGracePeriodSeconds"] >= slept + cfg.drain_timeout + 5


@pytest.mark.parametrize("drain", [None, 120, 0])
def test_helm_worker_grace_period_covers_the_group_drain(chart, drain):
    values = {"tp": 2, **({"drainTimeoutSeconds": drain} if drain is not None else {})}
    sts, args = pod_args(chart, {"worker": values})["worker-group"]
    ns, rest = launch.parse(args[1:])
    expected = 30 if drain is None else drain
    assert ns.drain_timeout == expected
    # Every rank gets the launcher's drain timeout (they drain as one group).
    ranks = [WorkerConfig.from_args(launch.rank_command(ns, rest, r)[3:]) for r in range(2)]
    assert [c.drain_timeout_s for c in ranks] == [expected, expected]
    # The kubelet kills the pod grace seconds after SIGTERM: the drain, the ranks' exit and
    # the launcher's own 15 s wait for them must fit.
    pod = sts["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= expected + 15 + 5

