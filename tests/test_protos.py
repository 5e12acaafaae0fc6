"""The generated modules in protos/ match the .proto files (regenerate with
`python -m protos.generate`)."""

import subprocess
import sys
from pathlib import Path

from protos import common_pb2, gateway_pb2, grammar_pb2, worker_pb2

ROOT = Path(__file__).resolve().parent.parent


def test_generated_modules_are_not_stale():
    result = subprocess.run([sys.executable, "-m", "protos.generate", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_service_is_in_package_gramserve_v1():
    names = {m.DESCRIPTOR.package for m in (common_pb2, gateway_pb2, grammar_pb2, worker_pb2)}
    assert names == {"gramserve.v1"}
    assert set(gateway_pb2.DESCRIPTOR.services_by_name) == {"Gateway"}
    assert set(grammar_pb2.DESCRIPTOR.services_by_name) == {"GrammarService"}
    assert set(worker_pb2.DESCRIPTOR.services_by_name) == {"Worker"}
