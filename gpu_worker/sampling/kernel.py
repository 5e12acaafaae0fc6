"""Fused Gumbel-max sampling in Triton: a sampling point's rows in one read of their logits.

The PyTorch path of `sampling.sample` builds the (B, V) noise with about twenty elementwise
passes over int64 tensors; at B=64 and V=152k that costs more than a CUDA-graph forward of a
0.5B model. This kernel computes the same per-token noise (the same integer hash, bit for bit,
and the same 23-bit uniform) inside one read of the logits, and reduces each block to its best
score and index; a tiny second kernel picks each row's winner. Rows are independent, so a
request's token does not depend on its batch. `-log(-log(u))` uses Triton's `log`, which can
differ from PyTorch's in the last bit: a rank never mixes the two paths, so every rank still
samples the same token (I3).

`sample_rows` is the engine's whole sampling point in the same pass (about thirty launches
of host time fewer a step, on a thread that bounds the guided step): each row reads its
logits row through an index (no gathered copy of the step's logits), columns at or past the
vocabulary are no tokens, a guided row's packed bitmask row is tested bit by bit (no masked
copy), and the second kernel writes, besides the token, the value the commit reads: -2 when
an allowed logit is NaN or +inf (the model failed), -1 when nothing is allowed (a dead end),
and optionally the token plus 2**32 when exactly one token was allowed (the forced-token
note). The score of every column is the one `gumbel_argmax` computes on logits masked in
place, with the same ties (the lowest token id), so both give the same token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.runtime.triton_launch import FastLaunch

_BLOCK = 4096
# Per (row, block) of the first kernel, 4 int32 fields: the best score (float32 bits), its
# column, how many allowed columns are above -inf, whether an allowed logit is NaN or +inf.
_FIELDS = tl.constexpr(4)
# Wire values (see sample_rows; the kernel spells them out): no allowed token, a broken
# logit, and what is added to the token when exactly one token was allowed.
DEAD, NONFINITE, SINGLE = -1, -2, 1 << 32


@triton.jit
def _mix32(x):
    # lowbias32 on values in [0, 2**32) held in int64; products wrap mod 2**64, whose low 32
    # bits are the mod-2**32 product, so masking gives the 32-bit result.
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["row0"])
def _rows_kernel(logits_ptr, row_stride, n_cols, vocab_size, row0, src_ptr, mask_row_ptr,
                 bitmask_ptr, mask_stride, temp_ptr, seed_ptr, step_ptr, work_ptr, n_blocks,
                 HAS_SRC: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    # Grid: (rows of this part, column blocks). Row `row0 + program 0` of the point reads
    # logits row src[row] (or its own index) and, where mask_row[row] >= 0, bitmask row
    # mask_row[row].
    row = row0 + tl.program_id(0)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    if HAS_SRC:
        src = tl.load(src_ptr + row)
    else:
        src = tl.program_id(0).to(tl.int64)
    logit = tl.load(logits_ptr + src * row_stride + cols, mask=inside, other=float("-inf"))
    allowed = cols < vocab_size
    if HAS_MASK:
        m = tl.load(mask_row_ptr + row)
        words = tl.load(bitmask_ptr + m * mask_stride + (cols >> 5),
                        mask=allowed & (tl.zeros_like(cols) + m >= 0), other=0)
        allowed = allowed & ((m < 0) | (((words >> (cols & 31)) & 1) != 0))
    logit_in = tl.where(allowed, logit, float("-inf"))
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
    scaled = logit_in / tl.maximum(temperature, 1e-6)
    score = tl.where(greedy, logit_in, scaled + gumbel)
    score = tl.where(inside, score, float("-inf"))
    best, where = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    count = tl.sum((logit_in > float("-inf")).to(tl.int32), axis=0)
    broken = tl.max((allowed & ~(logit < float("inf"))).to(tl.int32), axis=0)
    out = work_ptr + (row * _FIELDS) * n_blocks + block
    tl.store(out.to(tl.pointer_type(tl.float32), bitcast=True), best)
    tl.store(out + n_blocks, block * BLOCK + where.to(tl.int32))
    tl.store(out + 2 * n_blocks, count)
    tl.store(out + 3 * n_blocks, broken)


@triton.jit
def _pick_kernel(work_ptr, n_blocks, out_ptr, n_rows, FLAG_SINGLE: tl.constexpr,
                 BLOCKS: tl.constexpr):
    # Grid: (rows,). out[0, row] = the best column (the first on ties, as torch.argmax takes;
    # 0 for a dead or broken row), out[1, row] = what the commit reads (module docstring).
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    inside = b < n_blocks
    base = work_ptr + (row * _FIELDS) * n_blocks + b
    score = tl.load(base.to(tl.pointer_type(tl.float32), bitcast=True), mask=inside,
                    other=float("-inf"))
    best, where = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
    token = tl.load(work_ptr + (row * _FIELDS + 1) * n_blocks + where).to(tl.int64)
    count = tl.sum(tl.load(base + 2 * n_blocks, mask=inside, other=0), axis=0)
    broken = tl.max(tl.load(base + 3 * n_blocks, mask=inside, other=0), axis=0)
    wire = tl.where(broken != 0, -2, tl.where(count == 0, -1, token))
    if FLAG_SINGLE:
        wire = tl.where((count == 1) & (wire >= 0), wire + 4294967296, wire)
    tl.store(out_ptr + row, tl.where(wire < 0, 0, token))
    tl.store(out_ptr + n_rows + row, wire)


_rows = FastLaunch(_rows_kernel)
_pick = FastLaunch(_pick_kernel)


def sample_rows(parts: list[tuple[torch.Tensor, int]], temperature: torch.Tensor,
                seed: torch.Tensor, step: torch.Tensor, *, src: torch.Tensor | None = None,
                mask_rows: torch.Tensor | None = None, bitmask: torch.Tensor | None = None,
                vocab_size: int | None = None, flag_single: bool = False) -> torch.Tensor:
    """Sample R rows taken from one or more logits tensors in one pass each; returns a (2, R)
    int64 tensor: the token of each row (0 for a dead or broken row), and its wire value (the token, or -2 where an allowed
    logit is NaN or +inf, -1 where no token is allowed; plus 2**32 where exactly one was, if
    `flag_single`). No sync.

    parts: (logits (O, V) float32 with unit column stride, n): the next n rows of the point
    read that tensor, at row src[row] of it (src None: the rows in order, one part).
    temperature float32, seed and step int64: (R,) per row, as in `SamplingBatch`.
    mask_rows (R,) int64 with bitmask (K, W) int32: row r allows only the tokens whose bit is
    set in bitmask row mask_rows[r]; -1 (or mask_rows None) allows every token.
    vocab_size: columns at or past it are no tokens (default: every column).
    Raises ValueError naming the argument for a bad dtype or layout.
    """
    n_rows = temperature.shape[0]
    n_cols = parts[0][0].shape[1]
    for logits, _ in parts:
        if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
            raise ValueError("logits: expected (B, V) float32 with contiguous rows")
        if logits.shape[1] != n_cols:
            raise ValueError("parts: every logits tensor must have the same columns")
    if sum(n for _, n in parts) != n_rows:
        raise ValueError(f"parts: {sum(n for _, n in parts)} rows for {n_rows} rows of "
                         "parameters")
    if src is None and len(parts) > 1:
        raise ValueError("src: needed when the rows come from several logits tensors")
    if (mask_rows is None) != (bitmask is None):
        raise ValueError("bitmask: give it together with mask_rows")
    if bitmask is not None and bitmask.dtype != torch.int32:
        raise ValueError("bitmask: expected int32 words")
    device = temperature.device
    n_blocks = triton.cdiv(n_cols, _BLOCK)
    work = torch.empty((n_rows, _FIELDS.value, n_blocks), dtype=torch.int32, device=device)
    out = torch.empty((2, n_rows), dtype=torch.int64, device=device)
    if n_rows == 0:
        return out
    vocab = n_cols if vocab_size is None else min(vocab_size, n_cols)
    has_mask = mask_rows is not None
    if has_mask:  # columns past the mask's last word allow nothing
        vocab = min(vocab, 32 * bitmask.shape[1])
    row0 = 0
    for logits, n in parts:
        if n:
            args = (logits, logits.stride(0), n_cols, vocab, row0,
                    src if src is not None else work, mask_rows if has_mask else work,
                    bitmask if has_mask else work, bitmask.stride(0) if has_mask else 0,
                    temperature, seed, step, work, n_blocks)
            _rows((n, n_blocks, 1), args, (src is not None, has_mask, _BLOCK), 8, device)
        row0 += n
    _pick((n_rows, 1, 1), (work, n_blocks, out, n_rows),
          (flag_single, triton.next_power_of_2(n_blocks)), 1, device)
    return out


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor,
                  step: torch.Tensor) -> torch.Tensor:
    """(B,) int64: per row argmax(logits / T + Gumbel(hash(seed, step, token))), or
    argmax(logits) where T == 0. logits (B, V) float32 with unit column stride. Rows with no
    logit above -inf, or a NaN or +inf, return 0 (the caller flags them)."""
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.dtype != torch.float32:
        raise ValueError("logits: expected (B, V) float32 with contiguous rows")
    return sample_rows([(logits, logits.shape[0])], temperature.contiguous(), seed.contiguous(),
                       step.contiguous())[0]
