"""The lockstep control channel: small MAX all-reduces over a CPU (gloo) group.

Every rank calls the same sequence of `all_reduce_max` (one per step for admissions and
releases, one per checked step for sampled tokens); a dead or stuck peer makes the call raise
(gloo's timeout), which the engine treats as fatal for the rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ControlChannel:
    """MAX all-reduce of int64 vectors among the ranks of one TP group (`group` None = 1 rank)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int):
        self.group = group
        self.size = size

    def all_reduce_max(self, values: list[int]) -> list[int]:
        """Element-wise max over ranks. Raises RuntimeError when a peer is gone."""
        if self.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.tolist()


def diverged_rows(tokens: list[int], channel: ControlChannel) -> list[int]:
    """Indices of rows whose sampled token differs between ranks (I3's check).

    Reduces (t, -t) with MAX: max(t) == -max(-t) exactly when every rank has the same t.
    """
    reduced = channel.all_reduce_max([v for t in tokens for v in (t, -t)])
    return [i for i in range(len(tokens)) if reduced[2 * i] != -reduced[2 * i + 1]]
