"""Container images and the TLS health probe the chart runs in them.

No container engine runs here, so the Dockerfiles are parsed and checked against the project
(entry point, torch pin, copied files, the user the chart runs as). The TLS exec probe is run
for real: a subprocess against a real TLS gRPC server with a CA and certificate made by openssl.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from protos.rpc import create_server, set_serving

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
PROBE = DOCKER / "grpc_health_probe.py"
VALUES = yaml.safe_load((ROOT / "helm" / "gramserve" / "values.yaml").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def final_stage(instrs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last = max(i for i, (word, _) in enumerate(instrs) if word == "FROM")
    return instrs[last:]


def torch_pin() -> str:
    pin = next(d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch"))
    return pin.replace(" ", "")


@pytest.mark.parametrize("name,index", [("cpu.Dockerfile", "/whl/cpu"),
                                        ("cuda.Dockerfile", "/whl/cu")])
def test_helm_image_installs_pinned_torch_variant_then_project(name, index):
    instrs = instructions(DOCKER / name)
    stage = final_stage(instrs)
    runs = [arg for word, arg in stage if word == "RUN"]
    args = {a.split("=")[0]: a.split("=", 1)[1] for w, a in instrs if w == "ARG" and "=" in a}
    assert index in args["TORCH_INDEX"], args
    torch_run = next(i for i, r in enumerate(runs) if "torch==" in r)
    assert "--index-url ${TORCH_INDEX}" in runs[torch_run]
    assert torch_pin() in runs[torch_run].replace(" ", "")
    # The project wheel comes after torch, so pip keeps the chosen torch build.
    project_run = next(i for i, r in enumerate(runs) if "/wheels/*.whl" in r)
    assert project_run > torch_run


@pytest.mark.parametrize("name", ["cpu.Dockerfile", "cuda.Dockerfile"])
def test_helm_image_entrypoint_and_user_match_the_chart(name):
    stage = final_stage(instructions(DOCKER / name))
    entry = [json.loads(a) for w, a in stage if w == "ENTRYPOINT"]
    assert entry == [["gramserve"]]
    module, func = PYPROJECT["project"]["scripts"]["gramserve"].split(":")
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    assert f"def {func}(" in source
    users = [a for w, a in stage if w == "USER"]
    uid = VALUES["podSecurityContext"]["runAsUser"]
    assert users == [f"{uid}:{VALUES['podSecurityContext']['runAsGroup']}"]
    # Every file copied from the build context exists; the probe lands where the chart runs it.
    copies = [a.split() for w, a in stage if w == "COPY" and not a.startswith("--from")]
    for *sources, _dest in copies:
        for src in sources:
            assert (ROOT / src).exists(), src
    assert ["docker/grpc_health_probe.py", "/opt/gramserve/grpc_health_probe.py"] in copies
    chart_helpers = (ROOT / "helm" / "gramserve" / "templates" / "_helpers.tpl").read_text()
    assert '"/opt/gramserve/grpc_health_probe.py"' in chart_helpers


def test_helm_cuda_image_has_triton_build_deps_and_checks_cuda_torch():
    stage = final_stage(instructions(DOCKER / "cuda.Dockerfile"))
    runs = " ".join(a for w, a in stage if w == "RUN")
    for pkg in ("gcc", "python3-dev"):  # Triton compiles its launcher at run time
        assert re.search(rf"\b{pkg}\b", runs), pkg
    assert "torch.version.cuda" in runs
    base = next(a for w, a in instructions(DOCKER / "cuda.Dockerfile") if w == "ARG"
                and a.startswith("CUDA_IMAGE="))
    tag = re.search(r"nvidia/cuda:(\d+)\.(\d+)", base)
    index = next(a for w, a in stage if w == "ARG" and a.startswith("TORCH_INDEX="))
    # The torch wheel's CUDA variant matches the base image's CUDA version.
    assert index.endswith(f"/cu{tag.group(1)}{tag.group(2)}"), (base, index)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA and a server certificate for `demo-gramserve-gateway`, made by openssl."""
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1",
        "-subj", "/CN=gramserve-test-ca")
    run("req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=gateway")
    (d / "san.ext").write_text("subjectAltName=DNS:demo-gramserve-gateway\n")
    run("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "tls.crt", "-days", "1", "-extfile", "san.ext")
    return d


@pytest.fixture
def tls_server(pki):
    server, port, health = create_server(
        [], host="127.0.0.1", port=0,
        tls=((pki / "tls.crt").read_bytes(), (pki / "tls.key").read_bytes()))
    yield port, health
    server.stop(grace=None)


def probe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), "--timeout", "3", *args],
                          capture_output=True, text=True, timeout=30)


def test_helm_tls_probe_passes_for_serving_tls_server(tls_server, pki):
    port, _ = tls_server
    r = probe("--port", str(port), "--tls-ca", str(pki / "ca.crt"),
              "--server-name", "demo-gramserve-gateway")
    assert r.returncode == 0, r.stderr


def test_helm_tls_probe_fails_when_not_serving(tls_server, pki):
    port, health = tls_server
    set_serving(health, [], serving=False)
    r = probe("--port", str(port), "--tls-ca", str(pki / "ca.crt"),
              "--server-name", "demo-gramserve-gateway")
    assert r.returncode == 1 and "NOT_SERVING" in r.stderr


def test_helm_tls_probe_fails_on_wrong_certificate_name_or_plaintext(tls_server, pki):
    port, _ = tls_server
    wrong = probe("--port", str(port), "--tls-ca", str(pki / "ca.crt"),
                  "--server-name", "someone-else")
    assert wrong.returncode == 1, wrong.stderr
    plain = probe("--port", str(port))
    assert plain.returncode == 1, plain.stderr
