"""The Helm chart renders valid Kubernetes objects that wire the three services together.

Rendering uses Helm's own engine (helm-python-sdk bundles Helm v4 as a library); every object
is validated against the Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown
fields fail). ServiceMonitor is a prometheus-operator CRD with no schema in that package, so
it is checked against SERVICE_MONITOR_SCHEMA below, written from the operator's API reference
for the fields the chart uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

CHART = Path(__file__).resolve().parent.parent / "helm" / "gramserve"
KUBE_VERSION = "1.30"  # oldest version the chart targets with GA native gRPC probes is 1.27
RELEASE, NAMESPACE = "demo", "ml"

SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"]},
                "namespaceSelector": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"matchNames": {"type": "array", "items": {"type": "string"}},
                                   "any": {"type": "boolean"}}},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False, "required": ["port"],
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "relabelings": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"action": {"type": "string"},
                                           "targetLabel": {"type": "string"},
                                           "replacement": {"type": "string"},
                                           "sourceLabels": {"type": "array"}}}}}}},
            },
        },
    },
}

# Value sets the chart must render for; each one is validated object by object.
CASES = {
    "defaults": {},
    "tp1": {"worker": {"tp": 1, "groups": 2}},
    "tp4_three_groups": {"worker": {"tp": 4, "groups": 3}},
    "service_monitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                        "worker": {"tp": 2}},
    "tls": {"tls": {"enabled": True, "secretName": "my-tls"}, "worker": {"tp": 2}},
    "hpa": {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 5}}},
    "cache_pvc_hostpath_model": {"grammarService": {"persistence": {"enabled": True}},
                                 "model": {"source": "hostPath"},
                                 "worker": {"pdb": {"enabled": True, "minAvailable": 1}}},
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart, values: dict) -> list[dict]:
    """Every object the chart renders for `values` (schema-checked by Helm itself)."""
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(out.items()):
        if not path.endswith(".yaml"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def only(objects: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} *{name_suffix}, got {len(found)}"
    return found[0]


def containers(objects: list[dict]) -> list[dict]:
    return [c for o in objects if o["kind"] in ("Deployment", "StatefulSet")
            for c in o["spec"]["template"]["spec"]["containers"]]


def flag(args: list[str], name: str) -> str:
    """The single value of `name` in a container's args (fails if absent or repeated)."""
    hits = [i for i, a in enumerate(args) if a == name]
    assert len(hits) == 1, f"{name} appears {len(hits)} times in {args}"
    return args[hits[0] + 1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_helm_every_rendered_object_passes_kubernetes_schema(chart, case):
    objects = render(chart, CASES[case])
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "StatefulSet", "Service", "ConfigMap"} <= kinds
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
        else:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_helm_lint_reports_no_errors_or_warnings():
    for values in CASES.values():
        report = helm.lint(CHART, values, strict=True)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], report


@pytest.mark.parametrize("tp,groups", [(1, 1), (2, 2), (4, 3)])
def test_helm_worker_pod_requests_tp_gpus_and_launches_tp_ranks(chart, tp, groups):
    objects = render(chart, {"worker": {"tp": tp, "groups": groups}})
    sts = only(objects, "StatefulSet", "-worker")
    assert sts["spec"]["replicas"] == groups
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == tp
    assert c["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert c["args"][0] == "worker-group"
    assert int(flag(c["args"], "--tp")) == tp
    # One rendezvous address for the whole pod: a single --dist-port, no per-rank override.
    assert flag(c["args"], "--dist-port") == "29500"
    base = int(flag(c["args"], "--port"))
    grpc_ports = sorted(p["containerPort"] for p in c["ports"] if p["name"].startswith("grpc-r"))
    metric_ports = sorted(p["containerPort"] for p in c["ports"] if p["name"].startswith("metrics-r"))
    assert grpc_ports == [base + r for r in range(tp)]
    assert metric_ports == [int(flag(c["args"], "--metrics-port")) + r for r in range(tp)]


@pytest.mark.parametrize("tp,groups", [(1, 1), (2, 2), (4, 3)])
def test_helm_gateway_group_list_matches_statefulset_pods(chart, tp, groups):
    objects = render(chart, {"worker": {"tp": tp, "groups": groups}})
    sts = only(objects, "StatefulSet", "-worker")
    svc = only(objects, "Service", "-worker")
    assert svc["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    base = int(flag(sts["spec"]["template"]["spec"]["containers"][0]["args"], "--port"))
    # StatefulSet pod i is reachable as <sts>-i.<headless svc>.<ns>.svc.<domain>.
    name, headless = sts["metadata"]["name"], svc["metadata"]["name"]
    expected = ";".join(
        ",".join(f"{name}-{g}.{headless}.{NAMESPACE}.svc.cluster.local:{base + r}"
                 for r in range(tp))
        for g in range(groups))
    gw = only(objects, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gw["args"][0] == "gateway"
    assert flag(gw["args"], "--group") == expected
    served = {p["port"] for p in svc["spec"]["ports"] if p["name"].startswith("grpc-r")}
    assert served == {base + r for r in range(tp)}


def test_helm_grammar_service_address_matches_its_service(chart):
    objects = render(chart, {"worker": {"tp": 2}})
    svc = only(objects, "Service", "-grammar")
    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc")
    address = f"{svc['metadata']['name']}:{port}"
    for c in containers(objects):
        if c["args"][0] in ("gateway", "worker-group"):
            assert flag(c["args"], "--grammar-service") == address


@pytest.mark.parametrize("case", ["defaults", "tp4_three_groups", "hpa"])
def test_helm_every_container_has_native_grpc_probes(chart, case):
    for c in containers(render(chart, CASES[case])):
        port = int(flag(c["args"], "--port"))
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["grpc"] == {"port": port}, (c["name"], probe)


def test_helm_tls_wires_secret_to_every_server_and_client(chart):
    objects = render(chart, CASES["tls"])
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        assert {"name": "tls", "secret": {"secretName": "my-tls"}} in pod["volumes"]
        (c,) = pod["containers"]
        args = c["args"]
        assert flag(args, "--tls-cert") == "/etc/gramserve/tls/tls.crt"
        assert flag(args, "--tls-key") == "/etc/gramserve/tls/tls.key"
        # Clients of another service trust the CA; the grammar service dials nobody.
        if args[0] == "grammar-service":
            assert "--tls-ca" not in args
        else:
            assert flag(args, "--tls-ca") == "/etc/gramserve/tls/ca.crt"
        # Kubelet's gRPC probe cannot speak TLS: the exec probe does the same check over TLS.
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            cmd = c[probe]["exec"]["command"]
            assert cmd[:2] == ["python", "/opt/gramserve/grpc_health_probe.py"]
            assert flag(cmd, "--port") == flag(args, "--port")
            assert flag(cmd, "--tls-ca") == "/etc/gramserve/tls/ca.crt"


def test_helm_hpa_owns_gateway_replicas(chart):
    objects = render(chart, CASES["hpa"])
    hpa = only(objects, "HorizontalPodAutoscaler")
    dep = only(objects, "Deployment", "-gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert "replicas" not in dep["spec"]  # else every upgrade would reset the HPA's choice
    assert not [o for o in render(chart, {}) if o["kind"] == "HorizontalPodAutoscaler"]


def test_helm_service_monitors_scrape_every_component_and_rank(chart):
    objects = render(chart, CASES["service_monitor"])
    monitors = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceMonitor"}
    assert len(monitors) == 3
    for sm in monitors.values():
        assert sm["metadata"]["labels"]["release"] == "prom"
        svc = only(objects, "Service", sm["metadata"]["name"].rsplit("-", 1)[1])
        assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        named = {p["name"] for p in svc["spec"]["ports"]}
        assert {e["port"] for e in sm["spec"]["endpoints"]} <= named
    worker = next(sm for n, sm in monitors.items() if n.endswith("-worker"))
    assert [e["port"] for e in worker["spec"]["endpoints"]] == ["metrics-r0", "metrics-r1"]
    assert not [o for o in render(chart, {}) if o["kind"] == "ServiceMonitor"]


def test_helm_pods_run_non_root_with_read_only_root(chart):
    for o in render(chart, CASES["tp4_three_groups"]):
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = o["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert "/tmp" in mounts and mounts["/models"]["readOnly"] is True


def test_helm_model_volume_is_mounted_never_downloaded(chart):
    pvc = render(chart, {})
    host = render(chart, {"model": {"source": "hostPath", "hostPath": {"path": "/data/m"}}})
    for objects, want in ((pvc, "persistentVolumeClaim"), (host, "hostPath")):
        for o in objects:
            if o["kind"] in ("Deployment", "StatefulSet"):
                vol = next(v for v in o["spec"]["template"]["spec"]["volumes"]
                           if v["name"] == "model")
                assert want in vol
                c = o["spec"]["template"]["spec"]["containers"][0]
                assert flag(c["args"], "--model") == "/models/model"


def test_helm_grammar_cache_on_pvc_when_persistence_enabled(chart):
    objects = render(chart, CASES["cache_pvc_hostpath_model"])
    claim = only(objects, "PersistentVolumeClaim")
    dep = only(objects, "Deployment", "-grammar")
    vol = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "cache")
    assert vol["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert flag(c["args"], "--cache-dir") == "/cache"
    assert flag(c["args"], "--cache-bytes") == "1073741824"


def test_helm_dashboard_configmap_carries_the_dashboard_json(chart):
    cm = only(render(chart, {}), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((CHART / "dashboards" / "gramserve.json").read_text())
    assert json.loads(cm["data"]["gramserve.json"]) == shipped


def test_helm_notes_say_how_to_reach_the_gateway(chart):
    notes = chart.render({}, name=RELEASE, namespace=NAMESPACE)["gramserve/templates/NOTES.txt"]
    assert f"port-forward service/{RELEASE}-gramserve-gateway 50051:50051" in notes
    assert f"{RELEASE}-gramserve-gateway.{NAMESPACE}.svc.cluster.local:50051" in notes


@pytest.mark.parametrize("bad,field", [
    ({"worker": {"tp": 0}}, "/worker/tp"),
    ({"worker": {"slots": -1}}, "/worker/slots"),
    ({"worker": {"groups": 0}}, "/worker/groups"),
    ({"gateway": {"port": 70000}}, "/gateway/port"),
    ({"gateway": {"drainTimeoutSeconds": -1}}, "/gateway/drainTimeoutSeconds"),
    ({"worker": {"drainTimeoutSeconds": -1}}, "/worker/drainTimeoutSeconds"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"worker": {"tpp": 2}}, "tpp"),
])
def test_helm_values_schema_rejects_bad_values(chart, bad, field):
    with pytest.raises(helm.HelmValuesError, match=field):
        chart.validate_schema(bad)
    # An install renders through the same schema: the bad value never reaches a manifest.
    with pytest.raises(helm.HelmError):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)
    chart.validate_schema({})


def test_helm_values_yaml_documents_every_key():
    """Each key in values.yaml has a comment right above it, or its parent key has one."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    commented = {i for i in range(1, len(lines)) if lines[i - 1].strip().startswith("#")}
    parents: list[tuple[int, int]] = []  # (indent, line index) of the enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "- ")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while parents and parents[-1][0] >= indent:
            parents.pop()
        if i not in commented and not (parents and parents[-1][1] in commented):
            undocumented.append(f"{i + 1}: {stripped}")
        parents.append((indent, i))
    assert not undocumented, undocumented
