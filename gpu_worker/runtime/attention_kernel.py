"""Triton kernel for slot attention: every new token of a step in one call, straight from the cache.

The contract is in `attention_reference` (the plain PyTorch spec). Each query row attends to
its own slot's keys [max(0, ctx - window), ctx), so decode rows and the rows of prefill chunks
are the same case and one launch per layer covers a mixed step. The grid depends only on the
number of rows N, the KV heads and a split count chosen from shapes, never from device values,
so a launch reads nothing back to the host and can be captured in a CUDA graph.

Why it is fast for decode: one program per (row, KV head, split) handles the G query heads of
that KV head together (padded to 16 rows for tl.dot), so each key and value is read once per
row, not once per query head, and only up to the row's context (not up to the cache length,
as the windowed gather + SDPA path does). Online softmax in float32 over key blocks. When rows
x KV heads would leave the GPU's multiprocessors idle (few rows, long contexts), the keys of a
row are split among a fixed number of programs (flash-decoding); a second small kernel merges
their partial results. Prefill rows re-read their slot's keys once per row (from L2): meant
for the short chunks of a mixed step, not for long prompts.

On the CPU the kernel runs under TRITON_INTERPRET=1, which must be set before triton is first
imported.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

from gpu_worker.runtime.attention_reference import check_attention_args


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: keys per block, programs per row and KV head, warps and pipeline stages."""

    block_n: int
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2


_BLOCK_N = 64
_MAX_SPLITS = 16
_MIN_KEYS_PER_SPLIT = 256  # below this a split's merge costs more than its parallelism gains
_PROGRAMS_PER_SM = 3  # split until rows x KV heads x splits reaches this many per multiprocessor
_LOG2E = math.log2(math.e)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(n_rows: int, kv_heads: int, max_len: int, device: torch.device) -> KernelConfig:
    """The launch config for `n_rows` query rows over a cache of `max_len` positions.

    Depends on shapes only (a CUDA graph replays one config for every context length). Off
    CUDA (the interpreter) the keys are never split.
    """
    if device.type != "cuda":
        return KernelConfig(_BLOCK_N, 1)
    programs = max(1, n_rows * kv_heads)
    wanted = _cdiv(_PROGRAMS_PER_SM * _multiprocessors(device.index or 0), programs)
    useful = max(1, max_len // _MIN_KEYS_PER_SPLIT)
    return KernelConfig(_BLOCK_N, max(1, min(wanted, useful, _MAX_SPLITS)))


@triton.jit(do_not_specialize=["num_slots", "max_len", "window"])
def _slot_attention_kernel(
        q_ptr, q_stride_n, q_stride_h,
        k_ptr, k_stride_s, k_stride_l, k_stride_h,
        v_ptr, v_stride_s, v_stride_l, v_stride_h,
        slots_ptr, ctx_ptr, out_ptr, out_stride_n, out_stride_h, part_ptr, stats_ptr,
        num_heads, num_slots, max_len, window, qk_scale,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr):
    # Grid: (rows, KV heads, splits). qk_scale = scale * log2(e): exp2 replaces exp.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    ctx = tl.load(ctx_ptr + row).to(tl.int32)
    # An out-of-range slot or context cannot be checked on the host without a sync: such a
    # row reads no keys and gets zeros instead of reading outside the cache.
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    ctx = tl.where(valid, tl.minimum(tl.maximum(ctx, 0), max_len), 0)
    lo = tl.maximum(ctx - window, 0)
    # Equal shares of this row's keys per split, in whole blocks; split 0 is never empty.
    share = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * share
    end = tl.minimum(start + share, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g  # (BG,) query heads sharing this KV head
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row * q_stride_n + heads[:, None] * q_stride_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (BG, BD)
    k_base = k_ptr + slot * k_stride_s + kv_head * k_stride_h
    v_base = v_ptr + slot * v_stride_s + kv_head * v_stride_h
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 domain
    total = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        keys = first + j  # (BN,)
        k_ok = keys < end
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + keys[:, None] * k_stride_l + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BG, BN)
        s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every block has a valid key
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + keys[:, None] * v_stride_l + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    store_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        result = acc / tl.where(total > 0, total, 1.0)[:, None]  # no keys (invalid row): zeros
        tl.store(out_ptr + row * out_stride_n + heads[:, None] * out_stride_h + d[None, :],
                 result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Partials (N, H, SPLITS, D) float32 and stats (2, N, H, SPLITS): max and sum.
        cell = (row * num_heads + heads) * NUM_SPLITS + split  # (BG,)
        tl.store(part_ptr + cell[:, None].to(tl.int64) * HEAD_DIM + d[None, :], acc,
                 mask=store_mask)
        n_cells = tl.num_programs(0) * num_heads * NUM_SPLITS
        tl.store(stats_ptr + cell, m, mask=g_ok)
        tl.store(stats_ptr + n_cells + cell, total, mask=g_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, stats_ptr, out_ptr, out_stride_n, out_stride_h, num_heads,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    # Grid: (rows, query heads). Rescales each split's partial sums to the common max.
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    cell = (row * num_heads + head) * NUM_SPLITS + s  # (BS,)
    n_cells = tl.num_programs(0) * num_heads * NUM_SPLITS
    m = tl.load(stats_ptr + cell, mask=s_ok, other=float("-inf"))
    totals = tl.load(stats_ptr + n_cells + cell, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a row without keys
    w = tl.exp2(m - m_max)  # (BS,), 0 for empty splits
    acc = tl.load(part_ptr + cell[:, None].to(tl.int64) * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # (BS, BD)
    total = tl.sum(w * totals, 0)
    result = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # (BD,)
    tl.store(out_ptr + row * out_stride_n + head * out_stride_h + d,
             result.to(out_ptr.dtype.element_ty), mask=d_ok)


def _is_interpreted() -> bool:
    return isinstance(_slot_attention_kernel, InterpretedFunction)


def _launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor,
            context_lens: Tensor, scale: float, window: int, out: Tensor, group: int,
            config: KernelConfig) -> None:
    n, heads, dim = q.shape
    num_slots, max_len, kv_heads, _ = k_cache.shape
    splits = config.num_splits
    if splits > 1:
        part = torch.empty((n, heads, splits, dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((2, n, heads, splits), dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # unused pointers
    block_d = triton.next_power_of_2(dim)
    _slot_attention_kernel[(n, kv_heads, splits)](
        q, q.stride(0), q.stride(1),
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        token_slots, context_lens, out, out.stride(0), out.stride(1), part, stats,
        heads, num_slots, max_len, window, scale * _LOG2E,
        GROUP=group, HEAD_DIM=dim, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=config.block_n, NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages)
    if splits > 1:
        _merge_splits_kernel[(n, heads)](
            part, stats, out, out.stride(0), out.stride(1), heads,
            HEAD_DIM=dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=4)


def slot_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, token_slots: Tensor,
                   context_lens: Tensor, *, scale: float, sliding_window: int | None = None,
                   out: Tensor | None = None) -> Tensor:
    """Attention of every query row over its own slot's cached keys, in one launch.

    q: (N, H, D) float32, bfloat16 or float16, last dim contiguous, any row and head stride
    (a slice of a fused qkv output works). k_cache, v_cache: (S, L, KV, D), q's dtype and
    device, last dim contiguous, any other strides (one layer of a bigger cache buffer).
    token_slots: (N,) int64, the slot of each row. context_lens: (N,) int32/int64 in [1, L]:
    row i attends to keys [max(0, ctx_i - sliding_window), ctx_i) of its slot (no window by
    default), with query head h reading KV head h // (H // KV). D: any multiple of 16.
    Softmax in float32; returns (N, H, D) in q's dtype, written into `out` when given (same
    shape, dtype and device, last dim contiguous), else a new tensor.

    Reads no device value on the host, so it can be captured in a CUDA graph. On the CPU,
    out-of-range slots or contexts raise ValueError; on a GPU such rows produce zeros.
    Raises ValueError naming the argument when a shape, dtype, layout or device is wrong.
    On the CPU the kernel needs TRITON_INTERPRET=1 set before triton was imported.
    """
    group = check_attention_args(q, k_cache, v_cache, token_slots, context_lens, scale,
                                 sliding_window, out)
    if q.device.type == "cpu" and not _is_interpreted():
        raise ValueError("q: on the CPU the Triton kernel needs TRITON_INTERPRET=1 set before "
                         "triton is imported (or use attention_reference)")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n, max_len, kv_heads = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    if n == 0:
        return out
    window = max_len if sliding_window is None else min(sliding_window, max_len)
    config = choose_config(n, kv_heads, max_len, q.device)
    _launch(q, k_cache, v_cache, token_slots, context_lens, float(scale), window, out, group,
            config)
    return out
