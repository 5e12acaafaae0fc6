"""Counter-based sampling noise: u = hash(seed, step, token) in (0, 1), a pure function.

Shared by the PyTorch sampler (sampler.py) and the fused CUDA kernel (kernel.py), which
computes the same hash bit for bit, so a request gets the same noise on every path and rank.
On CPU tensors the same hash runs in NumPy uint32 (`noise_cpu`), elsewhere in int64 PyTorch
ops (`noise_int64`); tests/test_sampling.py holds the two to the same bits.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2**32 for x in [0, 2**32) and an odd 32-bit constant c, kept within int64
    # with no overflow: for c >= 2**31, x * c = x * (c - 2**31) + x * 2**31, and
    # x * 2**31 mod 2**32 is (x & 1) << 31. Every product stays below 2**63.
    if c >= 2**31:
        return ((x * (c - 2**31)) + ((x & 1) << 31)) & _MASK32
    return (x * c) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # A 32-bit bijective mixer with full avalanche (xorshift-multiply, constants from Chris
    # Wellons' "lowbias32"); input and output in [0, 2**32) held in int64.
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(B,) int64 in [0, 2**32): the per-row hash key of (seed, step) that the token hash mixes
    with each token id (shared with the fused CUDA kernel in sample_kernel.py)."""
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    return _mix32(_mix32(_mix32(seed_lo ^ 0x9E3779B9) ^ seed_hi) ^ (step & _MASK32))


def uniform_noise(seed: torch.Tensor, step: torch.Tensor, n_cols: int) -> torch.Tensor:
    """u = hash(seed, step, token) in (0, 1), float32 (B, n_cols); a pure function of its inputs.

    Uses 23 bits per value: u = (k + 0.5) / 2**23, so u is never 0 or 1 and -log(-log(u)) is
    finite (the Gumbel noise is truncated to about [-2.8, 16.6]). Steps are taken mod 2**32.
    """
    key = row_keys(seed, step)  # (B,)
    return noise_cpu(key, n_cols) if key.device.type == "cpu" else noise_int64(key, n_cols)


def noise_int64(key: torch.Tensor, n_cols: int) -> torch.Tensor:
    """`uniform_noise` from the row keys, in int64 PyTorch ops (on CUDA: ~20 elementwise
    passes over (B, V))."""
    token = torch.arange(n_cols, device=key.device, dtype=torch.int64)
    bits = _mix32(_mix32(key[:, None] ^ token[None, :]) ^ 0x5BD1E995)  # (B, V)
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 2**23)


def noise_cpu(key: torch.Tensor, n_cols: int) -> torch.Tensor:
    """`noise_int64` on the CPU, bit for bit: the same hash in NumPy uint32, whose products
    wrap mod 2**32 by themselves (no int64 masking), in place in one buffer and one scratch.
    The int64 ops allocate each of their ~20 passes: 5 against 0.8 ms for 40 rows of 4k
    tokens, 1.55 against 0.12 s for 64 rows of 151k (bench/cpu_worker.py)."""
    x = np.arange(n_cols, dtype=np.uint32)[None, :] ^ key.numpy().astype(np.uint32)[:, None]
    scratch = np.empty_like(x)
    _mix32_inplace(x, scratch)
    x ^= np.uint32(0x5BD1E995)
    _mix32_inplace(x, scratch)
    x >>= np.uint32(9)
    out = x.astype(np.float32)
    out += np.float32(0.5)
    out *= np.float32(1.0 / 2**23)
    return torch.from_numpy(out)


def _mix32_inplace(x: np.ndarray, scratch: np.ndarray) -> None:
    # _mix32 on uint32, in place.
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        np.right_shift(x, np.uint32(shift), out=scratch)
        x ^= scratch
        x *= np.uint32(multiplier)
    np.right_shift(x, np.uint32(16), out=scratch)
    x ^= scratch
