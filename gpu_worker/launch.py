"""`python -m gpu_worker.launch` (= `gramserve worker-group`): start every rank of one TP group.

Rank r listens on --port + r and serves metrics on --metrics-port + r; all ranks meet at
--host-local rendezvous 127.0.0.1:--dist-port (or --dist-host). Any other flag is passed to
every rank unchanged. SIGTERM/SIGINT are passed to every rank, which drain the group together
(admissions refused, running requests finish for up to --drain-timeout seconds, then every
rank exits 0); ranks still there 15 s after that are killed. When one rank exits on its own,
the others are stopped and the launcher exits with that rank's status, so a supervisor
restarts the group.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time

from protos.rpc import env_default


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="gramserve worker-group", description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=env_default("tp", 1), help="ranks to start")
    p.add_argument("--host", default=env_default("host", "127.0.0.1"), help="gRPC bind address")
    p.add_argument("--port", type=int, default=env_default("port", 50060),
                   help="gRPC port of rank 0 (rank r: port + r)")
    p.add_argument("--dist-host", default=env_default("dist_host", "127.0.0.1"),
                   help="rendezvous host (rank 0's address as the ranks see it)")
    p.add_argument("--dist-port", type=int, default=env_default("dist_port", 29500),
                   help="rendezvous port")
    p.add_argument("--metrics-port", type=int, default=env_default("metrics_port", -1),
                   help="metrics port of rank 0 (rank r: port + r); -1 = off")
    p.add_argument("--drain-timeout", type=float, default=env_default("drain_timeout", 30.0),
                   help="passed to every rank: seconds running requests may finish after "
                        "SIGTERM (the launcher waits that long plus 15 s for the ranks)")
    args, rest = p.parse_known_args(argv)
    if args.tp < 1:
        p.error("--tp must be >= 1")
    if args.port <= 0:
        p.error("--port must be a fixed port (rank r listens on port + r)")
    return args, rest


def rank_command(args: argparse.Namespace, rest: list[str], rank: int) -> list[str]:
    metrics = args.metrics_port + rank if args.metrics_port >= 0 else -1
    return [sys.executable, "-m", "gpu_worker", "--rank", str(rank), "--tp", str(args.tp),
            "--dist-addr", f"{args.dist_host}:{args.dist_port}", "--host", args.host,
            "--port", str(args.port + rank), "--metrics-port", str(metrics),
            "--drain-timeout", str(args.drain_timeout), *rest]


def main(argv: list[str] | None = None) -> int:
    args, rest = parse(argv)
    procs = [subprocess.Popen(rank_command(args, rest, r)) for r in range(args.tp)]
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while not stopping:
        ended = [p for p in procs if p.poll() is not None]
        if ended:
            code = ended[0].returncode
            print(f"gramserve worker-group: rank {procs.index(ended[0])} exited with status "
                  f"{code}; stopping the group", file=sys.stderr)
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.terminate()  # a rank drains its whole group, within --drain-timeout
    deadline = time.monotonic() + (args.drain_timeout + 15 if stopping else 10)
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if stopping:  # a rank that did not drain cleanly (or was killed) fails the launcher
        code = next((p.returncode for p in procs if p.returncode), 0)
    return code if code else 0


if __name__ == "__main__":
    sys.exit(main())
