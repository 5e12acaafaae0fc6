"""What rank 0's session streams cost its engine thread through the GIL, in one process and
with the gRPC front in a process of its own.

    PYTHONPATH=$PWD python bench/session_gil.py [--rows 16] [--sessions 4] [--steps 400]

The engine thread releases the GIL and takes it back around every CUDA call. Side by side,
interleaved, an engine-like thread (the Python work of `--rows` x `--sessions` rows, with a
torch call, which releases the GIL, every 4 rows):
- alone;
- threads: one thread per gateway session in the same process, each building and
  serialising its session's update every step (the rank before its front process);
- front: the engine-like thread pickles every session's rows once per step and writes them
  to a socket; another process builds and serialises the updates (`FrontLink.publish` and
  `gpu_worker.control.front`).
The difference from alone is what the engine thread waits for.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpu_worker.control.front import step_update  # noqa: E402


def session_rows(sid: int, rows: int) -> list[tuple]:
    """One session's rows of a step, as the engine process sends them."""
    return [(sid, i, [5 + i, 6 + i], None, None) for i in range(rows)]


def _front(conn) -> None:
    """The front process: split each step's rows by session, build and serialise updates."""
    while (msg := conn.recv()) is not None:
        by_session: dict[int, list] = {}
        for row in msg[2]:
            by_session.setdefault(row[0], []).append(row)
        for rows in by_session.values():
            step_update(msg[1], rows).SerializeToString()
    conn.send("done")


def engine_ms(rows: int, sessions: int, steps: int, mode: str) -> float:
    """Mean ms of an engine-like step with the session streams served the `mode` way."""
    scratch = torch.zeros(8)
    data = [session_rows(s, rows) for s in range(sessions)]
    flat = [r for rs in data for r in rs]

    def work() -> int:
        x = 0
        for r in range(sessions * rows):
            for k in range(60):
                x += k * r
            if r % 4 == 0:
                scratch.add_(1)  # a torch call: the GIL is released and taken back
        return x

    queues = [queue.SimpleQueue() for _ in range(sessions)] if mode == "threads" else []

    def session(q: queue.SimpleQueue, rs: list) -> None:
        while (step := q.get()) is not None:
            step_update(step, rs).SerializeToString()

    threads = [threading.Thread(target=session, args=(q, rs)) for q, rs in zip(queues, data, strict=False)]
    for t in threads:
        t.start()
    proc = conn = None
    if mode == "front":
        conn, theirs = mp.Pipe()
        proc = mp.get_context("fork").Process(target=_front, args=(theirs,))
        proc.start()
    start = time.perf_counter()
    for step in range(steps):
        work()
        if conn is not None:
            conn.send(("step", step, flat))
        for q in queues:
            q.put(step)
    spent = (time.perf_counter() - start) / steps * 1e3
    for q in queues:
        q.put(None)
    for t in threads:
        t.join()
    if conn is not None:
        conn.send(None)
        conn.recv()
        proc.join()
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16, help="rows of one session's update")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=5)
    ns = p.parse_args()
    print(f"# {ns.rows} rows per session, {ns.sessions} sessions, {ns.steps} steps per run, "
          f"{ns.rounds} rounds interleaved (median)")
    modes = ("alone", "threads", "front")
    runs: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(ns.rounds):
        for m in modes:
            runs[m].append(engine_ms(ns.rows, ns.sessions, ns.steps, m))

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    alone = median(runs["alone"])
    print(f"engine-like step alone: {alone:.3f} ms")
    for m, what in (("threads", f"{ns.sessions} session threads in its process"),
                    ("front", "the front in a process of its own")):
        ms = median(runs[m])
        print(f"  with {what}: {ms:.3f} ms (+{ms - alone:.3f} ms)")


if __name__ == "__main__":
    main()
