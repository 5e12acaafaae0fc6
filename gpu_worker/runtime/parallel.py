"""Tensor parallelism: the process groups and the Megatron-style layers that use them.

Each layer owns its sharding (`load_` copies this rank's slice of the full checkpoint tensor,
read lazily through a safetensors slice so no rank reads another's shard) and its collective
(row-parallel linear and vocab embedding all-reduce; the LM head all-gathers the logits so
every rank holds the full row, which keeps sampling identical across ranks: invariant I3).
At size 1 every collective is the identity and torch.distributed is never touched.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

log = logging.getLogger(__name__)


class TensorSlice(Protocol):
    """What `safe_open(...).get_slice(name)` returns: a shape and lazy indexing."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index) -> Tensor: ...


@dataclass
class TPGroup:
    """This rank's view of its tensor-parallel group. `group` is None at size 1."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    device: torch.device

    def all_reduce_(self, x: Tensor) -> Tensor:
        """Sum `x` over the group in place and return it; the identity at size 1."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Concatenate every rank's `x` along the last dim, in rank order; the same tensor on
        every rank. Returns `x` itself at size 1."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def init_distributed(rank: int, world_size: int, dist_addr: str, device: torch.device,
                     timeout_s: float) -> tuple[TPGroup, dist.ProcessGroup]:
    """Join the group: returns (TP group, gloo control group for CPU tensors).

    world_size > 1: tcp:// rendezvous at `dist_addr` ("host:port", rank 0 listens there), NCCL
    on CUDA and gloo on CPU for the TP collectives, plus a separate gloo group for the
    engine's lockstep all-reduces. `timeout_s` bounds the rendezvous and every collective, so
    a dead or stuck peer makes a collective raise instead of hanging (on NCCL the watchdog
    aborts the process after the timeout).
    world_size 1: no rendezvous and no port; a size-1 gloo group in this process serves as the
    control group (calling again in the same process reuses it) and the TP group is `None`.
    Sets the current CUDA device when `device` is CUDA. Raises ValueError on bad arguments,
    RuntimeError/DistNetworkError when the rendezvous fails or times out.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of world_size {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timeout)
        elif dist.get_world_size() != 1:
            raise RuntimeError("torch.distributed is already initialised with world_size "
                               f"{dist.get_world_size()}")
        return TPGroup(0, 1, None, device), dist.new_group(backend="gloo", timeout=timeout)
    host, sep, port = dist_addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_addr must be host:port, got {dist_addr!r}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = _rendezvous_store(host, int(port), rank, world_size, timeout)
    if _is_loopback(host):
        # The group's own connections stay on loopback too (gloo and NCCL pick an interface
        # from the host name otherwise, which is reachable from the network).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback_interface())
    dist.init_process_group(backend, store=store, rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=timeout)
    log.info("rank %d/%d joined %s (%s)", rank, world_size, dist_addr, backend)
    return TPGroup(rank, world_size, dist.group.WORLD, device), control


_LISTEN_SOCKETS: list[socket.socket] = []


def _rendezvous_store(host: str, port: int, rank: int, world_size: int,
                      timeout: datetime.timedelta) -> dist.TCPStore:
    """The group's key-value store. Rank 0 serves it on a socket bound to `host` only
    (torch's own TCPStore server listens on every interface); the others connect."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"--dist-addr: cannot listen on {host}:{port}: {exc}") from None
    sock.listen(128)
    store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                          master_listen_fd=sock.fileno())
    _LISTEN_SOCKETS.append(sock)  # the store serves on its descriptor for the process's life
    return store


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _loopback_interface() -> str:
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo"):
            return name
    return "lo"


def _copy_into(param: Tensor, value: Tensor, name: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(f"{name}: shard has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


def _check_full_shape(src: TensorSlice, expected: tuple[int, ...], name: str) -> None:
    shape = tuple(src.get_shape())
    if shape != expected:
        raise ValueError(f"{name}: checkpoint tensor has shape {shape}, expected {expected}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W's output rows split across ranks; no collective.

    `output_sizes` fuses several projections that share an input (q/k/v, gate/up): each part
    is split across ranks on its own, and this rank's weight is the concatenation of its
    slice of every part, so the local output is [part0_shard | part1_shard | ...].
    """

    def __init__(self, in_features: int, output_sizes: list[int], tp: TPGroup, bias: bool,
                 dtype: torch.dtype):
        super().__init__()
        for size in output_sizes:
            if size % tp.size:
                raise ValueError(f"output size {size} is not divisible by tp size {tp.size}")
        self.tp = tp
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.local_sizes = [size // tp.size for size in output_sizes]
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype, device=tp.device),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(local_out, dtype=dtype, device=tp.device),
                                  requires_grad=False) if bias else None)

    def _rows(self, part: int) -> tuple[int, int, int]:
        """(offset in the local weight, start and end in the full part) for this rank."""
        local = self.local_sizes[part]
        offset = sum(self.local_sizes[:part])
        return offset, self.tp.rank * local, (self.tp.rank + 1) * local

    def load_(self, src: TensorSlice, part: int = 0, *, name: str = "weight") -> None:
        """Copy this rank's rows of part `part` of the full weight (out, in) from `src`."""
        _check_full_shape(src, (self.output_sizes[part], self.in_features), name)
        offset, start, end = self._rows(part)
        _copy_into(self.weight[offset:offset + end - start], src[start:end], name)

    def load_bias_(self, src: TensorSlice, part: int = 0, *, name: str = "bias") -> None:
        """Copy this rank's slice of part `part` of the full bias (out,) from `src`."""
        if self.bias is None:
            raise ValueError(f"{name}: layer has no bias")
        _check_full_shape(src, (self.output_sizes[part],), name)
        offset, start, end = self._rows(part)
        _copy_into(self.bias[offset:offset + end - start], src[start:end], name)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)  # (N, local_out)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks; the partial sums are all-reduced,
    so every rank returns the full output."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} is not divisible by tp size {tp.size}")
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.local_in = in_features // tp.size
        self.weight = nn.Parameter(
            torch.empty(out_features, self.local_in, dtype=dtype, device=tp.device),
            requires_grad=False)

    def load_(self, src: TensorSlice, *, name: str = "weight") -> None:
        """Copy this rank's columns of the full weight (out, in) from `src`."""
        _check_full_shape(src, (self.out_features, self.in_features), name)
        start = self.tp.rank * self.local_in
        _copy_into(self.weight, src[:, start:start + self.local_in], name)

    def forward(self, x: Tensor) -> Tensor:
        # x: (N, local_in) -> (N, out), summed over ranks
        return self.tp.all_reduce_(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. Each rank holds `ceil(V / tp)` rows (the last
    shard zero-padded when V does not divide), looks up the ids it owns, zeroes the rest and
    the all-reduce assembles the full embeddings."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.shard_size = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard_size
        self.end = min(self.start + self.shard_size, vocab_size)  # real rows held here
        self.weight = nn.Parameter(
            torch.zeros(self.shard_size, hidden_size, dtype=dtype, device=tp.device),
            requires_grad=False)

    def load_(self, src: TensorSlice, *, name: str = "weight") -> None:
        """Copy this rank's rows of the full (vocab, hidden) table from `src`; padding stays 0."""
        _check_full_shape(src, (self.vocab_size, self.hidden_size), name)
        if self.end > self.start:
            _copy_into(self.weight[:self.end - self.start], src[self.start:self.end], name)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)  # (N, hidden)
        local = ids - self.start
        owned = (local >= 0) & (local < self.end - self.start)  # (N,)
        out = F.embedding(torch.where(owned, local, 0), self.weight)
        out = out * owned.unsqueeze(-1).to(out.dtype)  # (N, hidden), zero where not owned
        return self.tp.all_reduce_(out)


class ParallelLMHead(nn.Module):
    """logits = h E^T over vocabulary shards, all-gathered so every rank returns the full
    (N, vocab_size) row in float32. Shares the embedding's shard when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype,
                 tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.tied = tied is not None
        self.embedding = tied if tied is not None else VocabParallelEmbedding(
            vocab_size, hidden_size, tp, dtype)

    def load_(self, src: TensorSlice, *, name: str = "lm_head.weight") -> None:
        """Copy this rank's vocabulary rows of the untied head (vocab, hidden) from `src`."""
        if self.tied:
            raise ValueError(f"{name}: the head is tied to the embedding")
        self.embedding.load_(src, name=name)

    def forward(self, h: Tensor) -> Tensor:
        # h: (S, hidden) -> local (S, shard) -> gathered (S, tp * shard) -> (S, vocab)
        logits = self.tp.all_gather_last(F.linear(h, self.embedding.weight)).float()
        return logits[:, :self.vocab_size] if logits.shape[-1] != self.vocab_size else logits
