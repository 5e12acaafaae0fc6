"""Faults under `gramserve up` (real processes, CPU, TP=2, two groups): a killed rank's group
is restarted while the other group serves, a killed grammar service is restarted while
grammars already compiled keep serving, requests wait for restarting groups when none is
left, and SIGTERM drains running streams before anything stops. One `up` stack for the
module; the drain test ends it."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from procs import ROOT, metric

from gateway.health import COMPILE, GENERATE
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc
from protos.rpc import channel, check_health


class UpStack:
    """`gramserve up` as a child process; its output read on a thread."""

    def __init__(self, *flags: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "GRAMSERVE_TORCH_THREADS": "1", "GRAMSERVE_COMPILE_WORKERS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "up", "--port", "0", "--http-port", "-1",
             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            cwd=ROOT, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wait_line(r"Ctrl-C", timeout=400)
        text = "".join(self.lines)
        self.gateway = re.search(r"gramserve is up: gateway (\S+)", text).group(1)
        self.groups = {m.group(1): m.group(2).split(",")
                       for m in re.finditer(r"(group\d+) ranks: (\S+)", text)}
        self.metrics = {m.group(1): m.group(2)
                        for m in re.finditer(r"metrics (.+?): (http://\S+)", text)}

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_line(self, pattern: str, timeout: float, start: int = 0) -> float:
        """Wait for an output line (from line `start` on) matching `pattern`; its time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(re.search(pattern, line) for line in self.lines[start:]):
                return time.monotonic()
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(self.lines[-60:]))

    def pid_of(self, address: str, module: str) -> int:
        """The pid of the `python -m <module> ... --port P` child serving `address`."""
        port = address.rsplit(":", 1)[1]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv]
            if module in args and "--port" in args and args[args.index("--port") + 1] == port:
                return int(entry.name)
        raise AssertionError(f"no {module} process on {address}")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        # Children live in their own sessions; the drain test leaves none, a failure might.
        for addrs in self.groups.values():
            for a in addrs:
                try:
                    os.kill(self.pid_of(a, "gpu_worker"), signal.SIGKILL)
                except (AssertionError, ProcessLookupError):
                    pass


@pytest.fixture(scope="module")
def up():
    stack = UpStack("--groups", "2", "--tp", "2", "--slots", "2", "--max-model-len", "128",
                    "--drain-timeout", "60")
    try:
        yield stack
    finally:
        stack.kill()


def _stub(up):
    return gateway_pb2_grpc.GatewayStub(channel(up.gateway))


def _request(max_tokens: int, seed: int = 1, **kw) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(prompt="Go", sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, seed=seed), **kw)


def _schema_request(schema: dict, seed: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        prompt="Give", constraint=common_pb2.GrammarSpec(json_schema=json.dumps(schema)),
        sampling=common_pb2.SamplingParams(max_tokens=24, seed=seed))


def test_killed_grammar_service_is_restarted_while_compiled_grammars_keep_serving(up):
    stub = _stub(up)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    assert list(stub.Generate(_schema_request(schema, 1), timeout=120))[-1].final.schema_valid
    mark = len(up.lines)
    os.kill(up.pid_of(_grammar_address(up), "grammar_service"), signal.SIGKILL)
    up.wait_line(r"grammar-service exited with status -9; restarting", 10, mark)
    # The gateway remembers the key and the ranks hold the grammar: it keeps serving.
    final = list(stub.Generate(_schema_request(schema, 2), timeout=120))[-1].final
    assert final.schema_valid and final.usage.completion_tokens > 0
    # A new grammar needs the service: refused while it is down (or served once it is back).
    new = {**schema, "title": "new"}
    try:
        list(stub.Generate(_schema_request(new, 3), timeout=120))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
        assert "grammar service" in exc.details()
    back = up.wait_line(r"grammar-service is serving again", 120, mark)
    # The gateway's next health rounds (every 2 s) see it back: compile SERVING again.
    while not check_health(up.gateway, service=COMPILE):
        assert time.monotonic() - back < 10, "compile not SERVING after the service returned"
        time.sleep(0.2)
    assert check_health(up.gateway, service=GENERATE)
    while True:  # the gateway reconnects within about a second of the service's return
        try:
            final = list(stub.Generate(_schema_request(new, 4), timeout=120))[-1].final
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc.details()
            assert time.monotonic() - back < 5, exc.details()
            time.sleep(0.2)
    assert final.schema_valid  # compiled by the restarted service


def _grammar_address(up) -> str:
    """The grammar service's gRPC address, from a gateway's command line."""
    pid = up.pid_of(up.gateway, "gateway")
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return args[args.index("--grammar-service") + 1]


def test_killed_rank_fails_only_its_streams_and_its_group_is_restarted(up):
    stub = _stub(up)
    running = stub.Generate(_request(120), timeout=120)
    next(running)  # tokens stream from one of the groups
    busy = [g for g in up.groups
            if metric(up.metrics[f"{g} rank 0"], "gramserve_worker_slots_in_use") > 0]
    assert len(busy) == 1
    victim, other = busy[0], next(g for g in up.groups if g != busy[0])
    mark = len(up.lines)
    killed_at = time.monotonic()
    os.kill(up.pid_of(up.groups[victim][1], "gpu_worker"), signal.SIGKILL)

    # Not-yet-started requests, sent right after the kill, all succeed (on the other group,
    # or retried there when they had been admitted to the dying one).
    with ThreadPoolExecutor(4) as pool:
        later = [pool.submit(lambda s: list(stub.Generate(_request(4, seed=s), timeout=60)), s)
                 for s in range(4)]
        with pytest.raises(grpc.RpcError) as info:
            for _ in running:
                pass
        failed_after = time.monotonic() - killed_at
        finals = [f.result()[-1].final for f in later]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "rank" in info.value.details() and "not retried" in info.value.details()
    assert failed_after < 2.0, failed_after
    assert all(f.usage.completion_tokens == 4 for f in finals)
    assert metric(up.metrics[f"{other} rank 0"], "gramserve_worker_releases_total") >= 4

    up.wait_line(rf"{victim} exited with status \S+; restarting it in 1 s", 15, mark)
    back_at = up.wait_line(rf"{victim} is serving again", 60, mark)
    assert back_at - killed_at < 60
    gateway_metrics = up.metrics["gateway"]
    deadline = time.monotonic() + 20
    while metric(gateway_metrics, "gramserve_gateway_healthy_groups") < 2:
        assert time.monotonic() < deadline, "the restarted group never came back into rotation"
        time.sleep(0.2)
    # Enough concurrent requests that both groups take some: the restarted group serves.
    served = metric(up.metrics[f"{victim} rank 0"], "gramserve_worker_releases_total")
    with ThreadPoolExecutor(4) as pool:
        finals = [r[-1].final for r in pool.map(
            lambda s: list(stub.Generate(_request(12, seed=s), timeout=60)), range(4))]
    assert all(f.usage.completion_tokens == 12 for f in finals)
    assert metric(up.metrics[f"{victim} rank 0"], "gramserve_worker_releases_total") > served


def test_requests_wait_for_a_restart_when_every_group_is_down(up):
    stub = _stub(up)
    mark = len(up.lines)
    killed_at = time.monotonic()
    for g in up.groups:
        os.kill(up.pid_of(up.groups[g][1], "gpu_worker"), signal.SIGKILL)
    for g in up.groups:
        up.wait_line(rf"{g} exited with status", 15, mark)
    # No group serves now; within their deadline, requests wait for the restarts (`up`
    # gives the gateway --unavailable-wait 60) instead of failing.
    with ThreadPoolExecutor(2) as pool:
        finals = [r[-1].final for r in pool.map(
            lambda s: list(stub.Generate(_request(4, seed=s), timeout=90)), range(2))]
    assert all(f.usage.completion_tokens == 4 for f in finals)
    assert all(f.timings.queue_seconds > 1.0 for f in finals)  # they did wait
    assert time.monotonic() - killed_at < 90


def test_sigterm_drains_running_streams_before_anything_stops(up):
    stub = _stub(up)
    calls = [stub.Generate(_request(80, seed=s), timeout=120) for s in range(4)]
    for call in calls:
        next(call)  # every stream has produced a token: all four are running
    up.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while check_health(up.gateway, timeout=1.0):
        assert time.monotonic() < deadline, "the gateway stayed SERVING while draining"
        time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as info:  # new requests are refused meanwhile
        list(stub.Generate(_request(2), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finals = []
    for call in calls:
        responses = list(call)
        finals.append(responses[-1].final)
    assert [f.usage.completion_tokens for f in finals] == [80] * 4
    assert up.proc.wait(120) == 0
    out = "".join(up.lines)
    assert "draining" in out and "gramserve stopped" in out
