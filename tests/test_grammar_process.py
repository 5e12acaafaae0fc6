"""`python -m grammar_service` as a real process: flags, restart from --cache-dir, SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from protos import common_pb2, grammar_pb2, grammar_pb2_grpc, rpc

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"grammar service ready on [\d.]+:(\d+) \(metrics port (-?\d+)")


def start(cache_dir: Path, log: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAMSERVE_COMPILE_WORKERS": "1"}
    out = open(log, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "grammar_service", "--port", "0", "--metrics-port", "0",
         "--cache-dir", str(cache_dir)], stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = READY.search(log.read_text(errors="replace"))
        if match:
            return proc, int(match.group(1)), int(match.group(2))
        assert proc.poll() is None, log.read_text()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"not ready: {log.read_text()}")


def misses(metrics_port: int) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    line = next(x for x in body.decode().splitlines()
                if x.startswith("gramserve_grammar_cache_misses_total "))
    return float(line.split()[1])


def test_restart_with_cache_dir_serves_from_disk_and_sigterm_drains(tmp_path):
    spec = common_pb2.GrammarSpec(json_schema='{"type": "object", "properties": '
                                              '{"id": {"type": "integer"}}}')
    refs = []
    for run in range(2):
        proc, port, metrics_port = start(tmp_path / "cache", tmp_path / f"run{run}.log")
        try:
            assert rpc.check_health(f"127.0.0.1:{port}")
            with rpc.channel(f"127.0.0.1:{port}") as ch:
                stub = grammar_pb2_grpc.GrammarServiceStub(ch)
                refs.append(stub.Compile(grammar_pb2.CompileRequest(spec=spec), timeout=60))
            assert misses(metrics_port) == (1 if run == 0 else 0)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
    assert not refs[0].cached and refs[1].cached and refs[0].key == refs[1].key
    assert "stopped" in (tmp_path / "run1.log").read_text()
