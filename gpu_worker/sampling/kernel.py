"""Fused Gumbel-max sampling in Triton: hash noise, temperature and argmax in one pass.

The PyTorch path of `sampling.sample` builds the (B, V) noise with about twenty elementwise
passes over int64 tensors; at B=64 and V=152k that costs more than a CUDA-graph forward of a
0.5B model. This kernel computes the same per-token noise (the same integer hash, bit for bit,
and the same 23-bit uniform) inside one read of the logits, and reduces each block to its best
score and index; a tiny second reduction picks each row's winner. Rows are independent, so a
request's token does not depend on its batch. `-log(-log(u))` uses Triton's `log`, which can
differ from PyTorch's in the last bit: a rank never mixes the two paths, so every rank still
samples the same token (I3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _mix32(x):
    # lowbias32 on values in [0, 2**32) held in int64; products wrap mod 2**64, whose low 32
    # bits are the mod-2**32 product, so masking gives the 32-bit result.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, row_stride, n_cols, seed_ptr, step_ptr, temp_ptr,
                          score_ptr, index_ptr, n_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    logit = tl.load(logits_ptr + row * row_stride + cols, mask=inside, other=float("-inf"))
    temperature = tl.load(temp_ptr + row)
    # noise.row_keys(seed, step), here rather than as ~50 tiny PyTorch launches per step.
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    key = _mix32(_mix32(_mix32((seed & 0xFFFFFFFF) ^ 0x9E3779B9) ^ ((seed >> 32) & 0xFFFFFFFF))
                 ^ (step & 0xFFFFFFFF))
    bits = _mix32(_mix32(key ^ cols.to(tl.int64)) ^ 0x5BD1E995)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    gumbel = -tl.log(-tl.log(u))
    greedy = temperature == 0.0
    scaled = logit / tl.maximum(temperature, 1e-6)
    score = tl.where(greedy, logit, scaled + gumbel)
    score = tl.where(inside, score, float("-inf"))
    best, where = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(score_ptr + row * n_blocks + block, best)
    tl.store(index_ptr + row * n_blocks + block, block * BLOCK + where.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                  step: torch.Tensor) -> torch.Tensor:
    """(B,) int64: per row argmax(logits / T + Gumbel(hash(seed, step, token))), or
    argmax(logits) where T == 0. logits (B, V) float32 with unit column stride. Rows with no
    finite logit return an arbitrary index (the caller masks them as dead)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError("logits: expected (B, V) float32 with contiguous rows")
    n_rows, n_cols = logits.shape
    n_blocks = triton.cdiv(n_cols, _BLOCK)
    score = torch.empty((n_rows, n_blocks), dtype=torch.float32, device=logits.device)
    index = torch.empty((n_rows, n_blocks), dtype=torch.int64, device=logits.device)
    if n_rows:
        _gumbel_argmax_kernel[(n_rows, n_blocks)](
            logits, logits.stride(0), n_cols, seed.contiguous(), step.contiguous(),
            temperature.contiguous(), score, index, n_blocks, BLOCK=_BLOCK, num_warps=8)
    # torch.argmax takes the first maximum, so ties keep the lowest token id.
    return index.gather(1, score.argmax(dim=1, keepdim=True)).squeeze(1)
