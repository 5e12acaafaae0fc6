"""The lockstep control channel over a real 2-process gloo group: MAX reduction, and the
divergence check (I3) reporting exactly the rows whose sampled ids differ between ranks."""

import torch.distributed as dist
import torch.multiprocessing as mp
from procs import free_port

from gpu_worker.control.lockstep import ControlChannel, diverged_rows


def _rank(rank: int, port: int, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        channel = ControlChannel(dist.group.WORLD, 2)
        reduced = channel.all_reduce_max([rank, -rank, 7])
        same = diverged_rows([11, 12, 13], channel)
        tokens = [11, 12, 13] if rank == 0 else [11, 99, 13]
        differ = diverged_rows(tokens, channel)
        out.put((rank, reduced, same, differ))
    finally:
        dist.destroy_process_group()


def test_max_reduction_and_divergence_detection_on_both_ranks():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for _, reduced, same, differ in results:
        assert reduced == [1, 0, 7]
        assert same == []
        assert differ == [1]


def test_single_rank_channel_is_identity():
    channel = ControlChannel(None, 1)
    assert channel.all_reduce_max([3, -4]) == [3, -4]
    assert diverged_rows([5, 6], channel) == []
