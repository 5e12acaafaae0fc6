"""What rank 0's session threads cost its engine thread through the GIL.

    PYTHONPATH=$PWD python bench/session_gil.py [--rows 16] [--sessions 4] [--steps 400]

Rank 0 hands each step's outputs to one thread per gateway session, which builds that
session's StepUpdate. Those threads share the GIL with the engine thread, which releases and
takes it back around every CUDA call. Side by side in one run:
- the update's build time: `step_update` (rows added in place) against building each
  RowUpdate apart and copying the list in (the code before);
- an engine-like thread (the Python work of `--rows` x 4 rows, with a torch call, which
  releases the GIL, every 4 rows) alone, and with `--sessions` threads each building a
  `--rows`-row update per step with either builder, and with one thread building every
  session's update in turn (in place). The difference is what the engine thread waits for.
"""

from __future__ import annotations

import argparse
import queue
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from gpu_worker.control import engine as eng  # noqa: E402
from gpu_worker.control.server import finished_proto, step_update  # noqa: E402
from protos import worker_pb2  # noqa: E402


def step_update_copied(step: int, outputs: list[eng.RowOutput]) -> worker_pb2.SessionEvent:
    """The builder before: each RowUpdate made apart, then the list copied into the update."""
    rows = []
    for out in outputs:
        row = worker_pb2.RowUpdate(tag=out.req.tag, token_ids=out.tokens)
        for (token, (logprob, top_ids, top_lps)) in zip(out.tokens, out.logprobs, strict=False):
            row.logprobs.add(token_id=token, logprob=logprob, top_token_ids=top_ids,
                             top_logprobs=top_lps)
        if out.finish is not None:
            row.finished.CopyFrom(finished_proto(out.finish, len(out.req.prompt)))
        rows.append(row)
    return worker_pb2.SessionEvent(step=worker_pb2.StepUpdate(step=step, rows=rows))


def outputs(rows: int) -> list[eng.RowOutput]:
    out = []
    for i in range(rows):
        req = eng.Request(request_id=str(i), prompt=[1] * 50, max_tokens=10)
        req.tag = i
        out.append(eng.RowOutput(req, tokens=[5 + i, 6 + i]))
    return out


def every_session(sessions: int):
    """A builder that makes `sessions` updates in place, for one thread serving them all."""
    class _All:
        def __init__(self, step, rows):
            self.step, self.rows = step, rows

        def SerializeToString(self) -> bytes:  # noqa: N802 (the protobuf name)
            return b"".join(step_update(self.step, self.rows).SerializeToString()
                            for _ in range(sessions))
    return _All


def build_us(build, rows: list[eng.RowOutput], n: int = 5000) -> float:
    start = time.perf_counter()
    for _ in range(n):
        build(7, rows).SerializeToString()
    return (time.perf_counter() - start) / n * 1e6


def engine_ms(rows: int, steps: int, sessions: int = 0, build=None,
              data: list[eng.RowOutput] | None = None) -> float:
    """Mean ms of an engine-like step, with `sessions` threads building an update per step."""
    scratch = torch.zeros(8)

    def step() -> int:
        x = 0
        for r in range(4 * rows):
            for k in range(60):
                x += k * r
            if r % 4 == 0:
                scratch.add_(1)  # a torch call: the GIL is released and taken back
        return x

    queues = [queue.SimpleQueue() for _ in range(sessions)]

    def session(q: queue.SimpleQueue) -> None:
        while q.get() is not None:
            build(1, data).SerializeToString()

    threads = [threading.Thread(target=session, args=(q,)) for q in queues]
    for t in threads:
        t.start()
    start = time.perf_counter()
    for _ in range(steps):
        step()
        for q in queues:
            q.put(1)
    spent = (time.perf_counter() - start) / steps * 1e3
    for q in queues:
        q.put(None)
    for t in threads:
        t.join()
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16, help="rows of one session's update")
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    ns = p.parse_args()
    data = outputs(ns.rows)
    assert step_update(7, data).SerializeToString() == \
        step_update_copied(7, data).SerializeToString()
    print(f"# {ns.rows} rows per update, {ns.sessions} sessions, {ns.steps} steps per run, "
          f"{ns.rounds} rounds interleaved (median)")
    names = ("alone", "in place", "copied", "one thread")
    runs: dict[str, list[float]] = {n: [] for n in names}
    builds: dict[str, list[float]] = {"in place": [], "copied": []}
    for _ in range(ns.rounds):
        builds["in place"].append(build_us(step_update, data))
        builds["copied"].append(build_us(step_update_copied, data))
        runs["alone"].append(engine_ms(ns.rows, ns.steps))
        runs["in place"].append(engine_ms(ns.rows, ns.steps, ns.sessions, step_update, data))
        runs["copied"].append(engine_ms(ns.rows, ns.steps, ns.sessions, step_update_copied,
                                        data))
        runs["one thread"].append(engine_ms(ns.rows, ns.steps, 1, every_session(ns.sessions),
                                            data))

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    b_new, b_old = median(builds["in place"]), median(builds["copied"])
    print(f"update build + serialise: in place {b_new:.1f} us, copied {b_old:.1f} us "
          f"(in place / copied {b_new / b_old:.2f})")
    alone = median(runs["alone"])
    print(f"engine-like step alone: {alone:.3f} ms")
    for name in ("in place", "copied"):
        ms = median(runs[name])
        print(f"  with {ns.sessions} session threads, {name}: {ms:.3f} ms (+{ms - alone:.3f} ms, "
              f"their own build {ns.sessions * median(builds[name]) / 1e3:.3f} ms)")
    ms = median(runs["one thread"])
    print(f"  with one thread building all {ns.sessions} updates in place: {ms:.3f} ms "
          f"(+{ms - alone:.3f} ms)")


if __name__ == "__main__":
    main()
