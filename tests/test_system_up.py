"""`gramserve up` starts the whole system, serves a request, and stops without orphans."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from procs import ROOT, read_until_up

from protos.rpc import check_health


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("gateways", [1, 2])
def test_up_starts_serves_and_stops_cleanly_without_orphans(tmp_path, gateways):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "GRAMSERVE_TORCH_THREADS": "1", "GRAMSERVE_COMPILE_WORKERS": "1"}
    up = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "up", "--port", "0", "--http-port", "0",
         "--slots", "2", "--max-model-len", "128", "--gateways", str(gateways)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env, cwd=ROOT, start_new_session=True)
    try:
        _, addr = read_until_up(up)
        metrics_lines = []
        for line in up.stdout:
            if "Ctrl-C" in line:
                break
            metrics_lines.append(line)
        # grammar service, each gateway, 2 ranks; every gateway serves once `up` says so
        gateway_metrics = [m.split()[-1] for m in metrics_lines
                           if "/metrics" in m and "gateway" in m]
        assert sum("/metrics" in m for m in metrics_lines) == 3 + gateways
        assert len(gateway_metrics) == gateways
        for url in gateway_metrics:
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.status == 200
        assert check_health(addr)
        (http,) = [m.split()[-1] for m in metrics_lines if "OpenAI-compatible HTTP" in m]
        with urllib.request.urlopen(http.removesuffix("/v1") + "/health", timeout=10) as r:
            assert r.status == 200
        out = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "generate", "--addr", addr, "--choice", "yes",
             "--choice", "no", "--json", "Answer:"], capture_output=True, text=True, env=env,
            cwd=ROOT, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["text"] in ("yes", "no")
        family = _descendants(up.pid)
        assert len(family) >= 4 + gateways  # grammar service, group launcher, 2 ranks, gateways
        up.send_signal(signal.SIGTERM)
        rest = up.communicate(timeout=60)[0]
        assert up.returncode == 0, rest
        assert "gramserve stopped" in rest
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(_alive, family)):
            time.sleep(0.1)
        assert not [p for p in family if _alive(p)]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
