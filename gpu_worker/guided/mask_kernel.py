"""Triton kernel that applies packed token bitmasks to logits in place, for given rows only.

Why it is fast: a grammar usually allows ~1 % of the vocabulary, so the kernel reads the
logits of a 32-token word only when the word has a bit set (predicated-off loads issue no
memory traffic; at 1 % allowed ~28 % of words are read) and writes every column with wide
stores. The traffic is about one write of each guided row plus the packed mask, against a
read and a write for a load-select-store kernel. Each program reads its slice of the packed
mask once. (Reading only the allowed logits, one predicated scalar load each, measured the
same on the H200 at 1 % allowed and is slower when most tokens are allowed.) Row indices live on the device, so a launch needs no sync
and can be captured in a CUDA graph.

On CUDA the launcher (gpu_worker.runtime.triton_launch) keeps the compiled kernel of each
specialisation and calls it directly, skipping Triton's per-call argument binding (most of
its host cost). On the CPU the same kernel runs under TRITON_INTERPRET=1, which must be set
before triton is first imported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from gpu_worker.guided.mask_reference import check_mask_args
from gpu_worker.runtime.triton_launch import FastLaunch


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: 32-bit mask words per program (32 columns each) and warps per program."""

    block_words: int
    num_warps: int


# Chosen ahead from the H200 sweep in bench/mask_kernel.py (results in bench/results/), never
# at call time. Key: logits element size in bytes.
_CONFIGS = {4: KernelConfig(128, 4), 2: KernelConfig(128, 4)}
# Small launches use narrower blocks so that every multiprocessor gets work.
_SMALL_CONFIG = KernelConfig(32, 4)
_MIN_PROGRAMS = 264  # two per multiprocessor on an H200 (132 SMs)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # triton.cdiv costs ~1.5 us of host time per call


@triton.jit(do_not_specialize=["n_logit_rows", "n_mask_rows"])
def _apply_bitmask_kernel(logits_ptr, logits_row_stride, bitmask_ptr, bitmask_row_stride, rows_ptr,
                          n_logit_rows, n_mask_rows, n_cols, vocab_size, n_words,
                          HAS_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr):
    # Grid: (guided rows, column blocks of 32 * BLOCK_WORDS).
    if HAS_ROWS:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    else:
        row = tl.program_id(0).to(tl.int64)
    # Out-of-range row indices are skipped: checking them on the host would cost a device sync.
    if (row >= 0) & (row < n_logit_rows) & (row < n_mask_rows):
        word = tl.program_id(1) * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)  # (BW,)
        bits = tl.load(bitmask_ptr + row * bitmask_row_stride + word, mask=word < n_words,
                       other=0)  # (BW,) int32; words past the mask allow nothing
        lane = tl.arange(0, 32)
        col = word[:, None] * 32 + lane[None, :]  # (BW, 32)
        allowed = (((bits[:, None] >> lane[None, :]) & 1) != 0) & (col < vocab_size)
        ptrs = logits_ptr + row * logits_row_stride + col
        # Read a word's 32 logits with wide loads only when any of its bits is set (~28 % of
        # words at 1 % allowed); the select then masks within the word.
        any_bit = (bits != 0)[:, None] & (col < n_cols)  # (BW, 32), constant along a word
        values = tl.load(ptrs, mask=any_bit, other=float("-inf"))
        values = tl.where(allowed, values, float("-inf"))
        tl.store(ptrs, values, mask=col < n_cols)


def _is_interpreted() -> bool:
    return isinstance(_apply_bitmask_kernel, InterpretedFunction)


def choose_config(element_size: int, n_rows: int, n_cols: int) -> KernelConfig:
    """The launch config used for `n_rows` rows of `n_cols` logits of `element_size` bytes."""
    config = _CONFIGS[element_size]
    programs = n_rows * _cdiv(n_cols, 32 * config.block_words)
    return config if programs >= _MIN_PROGRAMS else _SMALL_CONFIG


# Compiled kernels by specialisation, launched directly (`launcher.fast = False` routes every
# CUDA launch through Triton's own launch path: the bench compares both).
launcher = FastLaunch(_apply_bitmask_kernel)


def _launch(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
            n_valid: int, config: KernelConfig) -> None:
    n_batch, n_cols = logits.shape
    n_rows = n_batch if rows is None else rows.numel()
    if n_rows == 0 or n_cols == 0:
        return
    n_words = min(bitmask.shape[1], _cdiv(n_valid, 32))
    has_rows = rows is not None
    args = (logits, logits.stride(0), bitmask, bitmask.stride(0),
            rows if has_rows else bitmask,  # a dummy pointer when every row is guided
            n_batch, bitmask.shape[0], n_cols, n_valid, n_words)
    grid = (n_rows, _cdiv(n_cols, 32 * config.block_words), 1)
    launcher(grid, args, (has_rows, config.block_words), config.num_warps, logits.device)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | None = None, vocab_size: int | None = None) -> None:
    """Set every disallowed logit to -inf, in place, in the given rows only.

    logits: (B, V) float32, bfloat16 or float16, last dimension contiguous, any row stride.
    bitmask: (R, W) int32 on the same device; bit j of word w allows token 32 * w + j.
    rows: 1-D int32/int64 tensor on the logits' device; index i picks logits row i AND bitmask
    row i. None (default) means every row, and then R >= B. Rows not listed are left bit-
    identical. On the CPU indices outside [0, min(B, R)) raise ValueError; on a GPU they are
    skipped (checking would cost a device sync).
    vocab_size: columns >= vocab_size are disallowed (padded model vocab); default
    min(V, 32 * W). Columns past the mask's last word are always disallowed.

    Raises ValueError naming the argument when a shape, dtype, layout or device is wrong.
    On the CPU the kernel needs TRITON_INTERPRET=1 set before triton was imported.
    """
    n_valid = check_mask_args(logits, bitmask, rows, vocab_size)
    if logits.device.type == "cpu" and not _is_interpreted():
        raise ValueError("logits: on the CPU the Triton kernel needs TRITON_INTERPRET=1 set "
                         "before triton is imported (or use mask_reference)")
    n_rows = logits.shape[0] if rows is None else rows.numel()
    config = choose_config(logits.element_size(), n_rows, logits.shape[1])
    _launch(logits, bitmask, rows, n_valid, config)
