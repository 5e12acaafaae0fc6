"""Process groups: a rank that loses its peer gets an error from the collective within the
timeout instead of hanging, and a group of one needs no rendezvous server."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import torch
from procs import free_port

TIMEOUT_S = 4.0
SLACK_S = 5.0


def _rank(rank: int, port: int, which: str, events, results) -> None:
    """Join a 2-rank gloo group, do one all-reduce, then (rank 0) wait until the peer has been
    killed or stopped and time the next all-reduce on the chosen group. Each rank has its own
    `results` queue: a process killed while it holds a shared queue's lock would block the
    other's reply."""
    torch.set_num_threads(1)
    from gpu_worker.runtime.parallel import init_distributed

    tp, control = init_distributed(rank, 2, f"127.0.0.1:{port}", torch.device("cpu"), TIMEOUT_S)
    x = torch.ones(4)
    tp.all_reduce_(x)
    if rank == 1:
        results.put(("ready", os.getpid()))
        time.sleep(60)
        return
    events.wait(30)
    t0 = time.monotonic()
    try:
        if which == "tp":
            tp.all_reduce_(torch.ones(4))
        else:
            torch.distributed.all_reduce(torch.ones(4), group=control)
        results.put(("no error", time.monotonic() - t0))
    except Exception as exc:  # the behaviour under test: the collective raises
        results.put((type(exc).__name__, time.monotonic() - t0))


def _collective_after_peer_loss(sig: int, which: str) -> tuple[str, float]:
    ctx = multiprocessing.get_context("spawn")
    events, results = ctx.Event(), [ctx.Queue(), ctx.Queue()]
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, which, events, results[r])) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        tag, pid = results[1].get(timeout=60)
        assert tag == "ready"
        os.kill(pid, sig)
        events.set()
        return results[0].get(timeout=TIMEOUT_S + SLACK_S + 10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def test_model_tp_all_reduce_raises_promptly_when_peer_is_killed():
    outcome, elapsed = _collective_after_peer_loss(signal.SIGKILL, "tp")
    assert outcome != "no error"
    assert elapsed < TIMEOUT_S + SLACK_S, f"all_reduce took {elapsed:.1f} s to fail"


def test_model_control_all_reduce_raises_within_timeout_when_peer_hangs():
    # A stopped peer keeps its sockets open: only the timeout can end the collective.
    outcome, elapsed = _collective_after_peer_loss(signal.SIGSTOP, "control")
    assert outcome != "no error"
    assert elapsed < TIMEOUT_S + SLACK_S, f"all_reduce took {elapsed:.1f} s to fail"


def _single_rank(results) -> None:
    from gpu_worker.runtime.parallel import init_distributed

    tp, control = init_distributed(0, 1, "unused:0", torch.device("cpu"), 5.0)
    flags = torch.tensor([1, 0, 1], dtype=torch.int32)
    torch.distributed.all_reduce(flags, group=control, op=torch.distributed.ReduceOp.MAX)
    x = torch.arange(3.0)
    again, _ = init_distributed(0, 1, "unused:0", torch.device("cpu"), 5.0)
    results.put((tp.size, tp.group is None, flags.tolist(), tp.all_reduce_(x).tolist(),
                 tp.all_gather_last(x).tolist(), again.size))


def test_model_single_rank_group_needs_no_rendezvous_and_control_group_works():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=_single_rank, args=(results,))
    p.start()
    try:
        assert results.get(timeout=60) == (1, True, [1, 0, 1], [0.0, 1.0, 2.0],
                                           [0.0, 1.0, 2.0], 1)
    finally:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
