"""Soak: thousands of mixed requests through `gramserve up` at TP=2, with a rank killed and
its group restarted in the middle; every outcome accounted for.

The mix (seeded per request): JSON schemas, regexes, choice lists, unguided text, requests
the client cancels after their first delta and requests with deadlines too short to finish.
Every guided output that ends by its grammar is validated here, on the client (jsonschema,
re.fullmatch, choice membership). When half the requests are done, rank 1 of group0 is
killed with SIGKILL; `up` restarts the group. At the end the script prints requests by kind
and outcome, failures each with the reason that explains it (the injected fault, the
client's cancel, the client's deadline) or marked UNEXPLAINED, invalid outputs, slots still
in use on every rank after the run (leaks), RSS of every process over time, and p50/p99
latency of the completed requests.

    # CPU (the embedded default model; about 10 minutes on 2 cores)
    PYTHONPATH=$PWD python bench/soak.py --requests 5000 --out bench/results/soak_cpu.txt

Every wait has a timeout; the stack is stopped (SIGTERM, then SIGKILL) at the end and on any
error. Exit status 1 when a target is missed (an invalid output, a leaked slot, an
unexplained failure).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import jsonschema
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.loadgen import BUILTIN_SCHEMAS  # noqa: E402
from protos import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402
from protos.rpc import channel  # noqa: E402

REGEXES = (r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)!?")
CHOICES = (["red", "green", "blue"], ["alpha", "beta"], ["north", "south", "east", "west"])
KINDS = (("json_schema", 0.30), ("regex", 0.15), ("choice", 0.15), ("unguided", 0.25),
         ("cancel", 0.08), ("deadline", 0.07))
GRAMMAR_END = common_pb2.FINISH_REASON_GRAMMAR_COMPLETED


@dataclass
class Result:
    i: int
    kind: str
    started: float
    ended: float
    status: str  # gRPC status name, "OK", or "CANCELLED" for a client cancel
    detail: str = ""
    ttft: float = 0.0
    finish: str = ""
    valid: bool | None = None  # guided and ended by its grammar: did the output match?


def make(i: int, seed: int) -> tuple[str, gateway_pb2.GenerateRequest, float]:
    """Request i: (kind, request, client timeout in seconds)."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices([k for k, _ in KINDS], [w for _, w in KINDS])[0]
    sampling = common_pb2.SamplingParams(max_tokens=48, seed=rng.getrandbits(32),
                                         temperature=1.0)
    req = gateway_pb2.GenerateRequest(prompt=f"Request {i}:", sampling=sampling)
    timeout = 120.0
    if kind == "json_schema":
        req.constraint.json_schema = json.dumps(rng.choice(BUILTIN_SCHEMAS))
    elif kind == "regex":
        req.constraint.regex = rng.choice(REGEXES)
    elif kind == "choice":
        req.constraint.choice.choices.extend(rng.choice(CHOICES))
    elif kind in ("cancel", "deadline"):
        req.sampling.max_tokens = 64
        req.sampling.ignore_eos = True
        if kind == "deadline":
            timeout = rng.uniform(0.02, 0.4)
    else:
        req.sampling.max_tokens = rng.randint(4, 24)
    return kind, req, timeout


def valid(req: gateway_pb2.GenerateRequest, text: str) -> bool:
    c = req.constraint
    if c.json_schema:
        try:
            jsonschema.validate(json.loads(text), json.loads(c.json_schema))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if c.regex:
        return re.fullmatch(c.regex, text) is not None
    return text in list(c.choice.choices)


def run_one(stub, i: int, seed: int) -> Result:
    kind, req, timeout = make(i, seed)
    t0 = time.monotonic()
    res = Result(i, kind, t0, t0, "OK")
    try:
        call = stub.Generate(req, timeout=timeout)
        final = None
        for msg in call:
            if not res.ttft and msg.HasField("delta") and msg.delta.token_ids:
                res.ttft = time.monotonic() - t0
                if kind == "cancel":
                    call.cancel()
                    res.status = "CANCELLED"
                    break
            if msg.HasField("final"):
                final = msg.final
        if final is not None:
            res.finish = common_pb2.FinishReason.Name(final.finish_reason)
            if kind in ("json_schema", "regex", "choice") and final.finish_reason == GRAMMAR_END:
                res.valid = valid(req, final.text)
    except grpc.RpcError as exc:
        res.status, res.detail = exc.code().name, exc.details() or ""
    res.ended = time.monotonic()
    return res


class Stack:
    """`gramserve up` as a child; its banner parsed, its output kept."""

    def __init__(self, groups: int, slots: int):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "GRAMSERVE_TORCH_THREADS": "1", "GRAMSERVE_COMPILE_WORKERS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "up", "--port", "0", "--http-port", "-1",
             "--tp", "2", "--groups", str(groups), "--slots", str(slots),
             "--max-model-len", "256"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=env, cwd=ROOT, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 600
        while not any("Ctrl-C" in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("gramserve up did not start:\n" + "".join(self.lines))
            time.sleep(0.2)
        text = "".join(self.lines)
        self.gateway = re.search(r"gramserve is up: gateway (\S+)", text).group(1)
        self.groups = {m.group(1): m.group(2).split(",")
                       for m in re.finditer(r"(group\d+) ranks: (\S+)", text)}
        self.metrics = {m.group(1): m.group(2)
                        for m in re.finditer(r"metrics (.+?): (http://\S+)", text)}
        self.grammar = self._grammar_address()

    def _grammar_address(self) -> str:
        """The grammar service's address, from our gateway's command line."""
        port = self.gateway.rsplit(":", 1)[1]
        for entry in Path("/proc").iterdir():
            try:
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if "gateway" in args and "--port" in args and args[args.index("--port") + 1] == port \
                    and "--grammar-service" in args:
                return args[args.index("--grammar-service") + 1]
        raise RuntimeError("the gateway process was not found")

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def processes(self) -> dict[str, list[int]]:
        """{role: pids} of every server process (roles survive restarts, pids do not). The
        grammar service's compile subprocesses share its command line; they are their own
        role."""
        ports = {a.rsplit(":", 1)[1]: f"{g} rank {r}"
                 for g, addrs in self.groups.items() for r, a in enumerate(addrs)}
        out: dict[str, list[int]] = {}
        grammar: dict[int, int] = {}  # pid -> parent pid
        # Other grammar services may run on this machine: ours is the one on our port.
        grammar_port = self.grammar.rsplit(":", 1)[1]
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if "-m" not in args or args.index("-m") + 1 >= len(args):
                continue
            module = args[args.index("-m") + 1]
            port = args[args.index("--port") + 1] if "--port" in args else ""
            if module == "gpu_worker" and port in ports:
                out.setdefault(ports[port], []).append(int(entry.name))
            elif module == "grammar_service" and port == grammar_port:
                grammar[int(entry.name)] = ppid
            elif module == "gateway" and port == self.gateway.rsplit(":", 1)[1]:
                out.setdefault("gateway", []).append(int(entry.name))
        for pid, ppid in grammar.items():
            out.setdefault("compile workers" if ppid in grammar else "grammar-service",
                           []).append(pid)
        return out

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()


def rss_mb(pids: list[int]) -> float:
    """Summed resident memory of `pids` in MB (NaN when none is alive)."""
    total, seen = 0.0, False
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
                    seen = True
        except OSError:
            pass
    return total if seen else float("nan")


def metric(url: str, name: str, label: str = "") -> float:
    """Sum of the samples named `name` (those whose labels contain `label`, when given)."""
    body = urllib.request.urlopen(url, timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name) and line[len(name)] in " {" and label in line)


def explain(r: Result, kill_at: float | None, back_at: float | None) -> str:
    """Why a request did not complete, or "UNEXPLAINED"."""
    if r.kind == "cancel" and r.status == "CANCELLED":
        return "cancelled by the client"
    if r.kind == "deadline" and r.status == "DEADLINE_EXCEEDED":
        return "client deadline shorter than the request"
    if kill_at is not None and r.status == "UNAVAILABLE" and r.started <= kill_at + 1.0 \
            and r.ended >= kill_at and "not retried" in r.detail:
        return "streaming on the killed rank's group (tokens already sent)"
    if kill_at is not None and r.status in ("UNAVAILABLE", "DEADLINE_EXCEEDED") \
            and r.ended >= kill_at and (back_at is None or r.started <= back_at):
        return "during the group's restart"
    return "UNEXPLAINED"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--groups", type=int, default=2, help="TP=2 groups")
    p.add_argument("--slots", type=int, default=8, help="slots per group")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-every", type=float, default=15.0, help="seconds between RSS samples")
    p.add_argument("--out", default="", help="also write the report to this file")
    ns = p.parse_args(argv)

    t_start = time.monotonic()
    stack = Stack(ns.groups, ns.slots)
    report: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        report.append(line)

    results: list[Result] = []
    rss: list[tuple[float, dict[str, float]]] = []
    kill: dict[str, float] = {}
    done = threading.Event()
    try:
        say(f"gramserve soak: {ns.requests} requests, concurrency {ns.concurrency}, TP=2, "
            f"{ns.groups} groups x {ns.slots} slots, CPU, embedded default model "
            f"(start-up {time.monotonic() - t_start:.0f} s)")
        t0 = time.monotonic()

        def sample_rss() -> None:
            while not done.wait(ns.rss_every):
                rss.append((time.monotonic() - t0,
                            {role: rss_mb(pids) for role, pids in stack.processes().items()}))

        threading.Thread(target=sample_rss, daemon=True).start()
        rss.append((0.0, {role: rss_mb(pids) for role, pids in stack.processes().items()}))
        stub = gateway_pb2_grpc.GatewayStub(channel(stack.gateway))

        def killer() -> None:
            while len(results) < ns.requests // 2 and not done.is_set():
                time.sleep(0.05)
            if done.is_set():
                return
            (victim,) = stack.processes()["group0 rank 1"]
            mark = len(stack.lines)
            kill["at"] = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            while not done.is_set():
                if any("group0 is serving again" in line for line in stack.lines[mark:]):
                    kill["back"] = time.monotonic()
                    return
                time.sleep(0.1)

        threading.Thread(target=killer, daemon=True).start()
        with ThreadPoolExecutor(ns.concurrency) as pool:
            futures = [pool.submit(run_one, stub, i, ns.seed) for i in range(ns.requests)]
            for n, f in enumerate(futures, 1):
                results.append(f.result())
                if n % 500 == 0:
                    print(f"  {n} done, {time.monotonic() - t0:.0f} s", flush=True)
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 180  # the restarted group must be back to be read
        while "at" in kill and "back" not in kill and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3.0)  # let releases land
        leaks = {role: metric(url, "gramserve_worker_slots_in_use")
                 for role, url in stack.metrics.items() if "rank" in role}
        gateway_in_flight = metric(stack.metrics["gateway"], "gramserve_gateway_in_flight")
        retries = {why: metric(stack.metrics["gateway"], "gramserve_gateway_retries_total",
                               f'reason="{why}"')
                   for why in ("group_failed", "group_full", "slot_race")}
        rss.append((time.monotonic() - t0,
                    {role: rss_mb(pids) for role, pids in stack.processes().items()}))
    finally:
        done.set()
        status = stack.stop()

    kill_at, back_at = kill.get("at"), kill.get("back")
    say(f"wall {wall:.0f} s, {len(results) / wall:.1f} requests/s; up exited {status}")
    if kill_at is not None:
        say(f"fault: SIGKILL of group0 rank 1 at t={kill_at - t0:.1f} s; group0 serving again "
            + (f"{back_at - kill_at:.1f} s later" if back_at else "NEVER"))
    say("gateway retries (admitted again before a first token): "
        + ", ".join(f"{why} {n:.0f}" for why, n in retries.items())
        + " (group_full: rank 0 still held a released slot that this gateway counted free)")
    say()
    say("requests by kind and outcome")
    kinds = [k for k, _ in KINDS]
    outcomes = sorted({r.status for r in results})
    say(f"  {'kind':<12}{'total':>7}" + "".join(f"{o:>20}" for o in outcomes))
    for k in kinds:
        rows = [r for r in results if r.kind == k]
        say(f"  {k:<12}{len(rows):>7}"
            + "".join(f"{sum(r.status == o for r in rows):>20}" for o in outcomes))
    say()
    say("failures and why")
    reasons: dict[str, int] = {}
    for r in results:
        if r.status != "OK":
            why = explain(r, kill_at, back_at)
            reasons[f"{r.status}: {why}"] = reasons.get(f"{r.status}: {why}", 0) + 1
    for why, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        say(f"  {n:>6}  {why}")
    unexplained = [r for r in results if r.status != "OK"
                   and explain(r, kill_at, back_at) == "UNEXPLAINED"]
    for r in unexplained[:10]:
        say(f"    e.g. #{r.i} {r.kind} {r.status} at t={r.started - t0:.1f}-{r.ended - t0:.1f}: "
            f"{r.detail[:160]}")
    say()
    checked = [r for r in results if r.valid is not None]
    invalid = [r for r in checked if not r.valid]
    guided_ok = [r for r in results if r.status == "OK"
                 and r.kind in ("json_schema", "regex", "choice")]
    cut = sum(r.finish == "FINISH_REASON_LENGTH" for r in guided_ok)
    say(f"guided outputs validated on the client: {len(checked)} of {len(guided_ok)} completed "
        f"guided requests ({cut} ended on max_tokens, unchecked); invalid: {len(invalid)}")
    say("slots in use after the run: " + ", ".join(f"{k} {v:.0f}" for k, v in leaks.items())
        + f"; gateway in flight {gateway_in_flight:.0f}")
    say()
    ok = [r for r in results if r.status == "OK" and r.kind != "cancel"]
    lat = np.array([r.ended - r.started for r in ok])
    ttft = np.array([r.ttft for r in ok if r.ttft])
    say(f"latency of completed requests ({len(ok)}): p50 {np.percentile(lat, 50):.3f} s, "
        f"p99 {np.percentile(lat, 99):.3f} s; time to first token p50 "
        f"{np.percentile(ttft, 50):.3f} s, p99 {np.percentile(ttft, 99):.3f} s")
    say()
    say("RSS (MB) per process over time (a restarted process is a new pid under the same role; "
        "compile workers: the grammar service's compile subprocesses together, recycled "
        "by its pool)")
    roles = sorted({role for _, sample in rss for role in sample})
    say(f"  {'t (s)':>7}" + "".join(f"{r:>17} " for r in roles))
    for t, sample in rss:
        say(f"  {t:>7.0f}" + "".join(f"{sample.get(r, float('nan')):>18.0f}" for r in roles))
    missed = bool(invalid) or any(leaks.values()) or gateway_in_flight or bool(unexplained)
    say()
    say("targets: 0 invalid outputs, 0 leaked slots, every failure explained: "
        + ("MISSED" if missed else "met"))
    if ns.out:
        Path(ns.out).write_text("\n".join(report) + "\n")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
