"""Plain PyTorch reference for applying packed token bitmasks, and the argument checks.

The bitmask format is xgrammar's: an int32 tensor (rows, words) where bit j of word w says
whether token 32 * w + j is allowed. The Triton kernel in `mask_kernel` must agree with
`apply_token_bitmask_reference_` bit for bit; the tests compare the two on random masks.
"""

from __future__ import annotations

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ROW_INDEX_DTYPES = (torch.int32, torch.int64)


def check_mask_args(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                    vocab_size: int | None) -> int:
    """Validate the arguments of a bitmask apply and return the effective vocabulary size.

    The effective vocabulary size is `vocab_size`, or min(V, 32 * W) when it is None; columns at
    or past it are disallowed. Row index values are checked only when they are on the CPU: on a
    GPU that would cost a device sync, so there the kernel skips out-of-range indices instead.

    Raises ValueError naming the offending argument. Changes nothing.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits: expected a 2-D tensor (batch, vocab)")
    if logits.dtype not in LOGIT_DTYPES:
        raise ValueError(f"logits: dtype {logits.dtype} not supported; use float32, bfloat16 or float16")
    n_batch, n_cols = logits.shape
    if n_cols > 1 and logits.stride(1) != 1:
        raise ValueError("logits: the last dimension must be contiguous (stride 1)")
    if n_batch > 1 and n_cols > 0 and logits.stride(0) < n_cols:
        raise ValueError("logits: rows overlap in memory (row stride smaller than the row)")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dim() != 2:
        raise ValueError("bitmask: expected a 2-D tensor (rows, words)")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask: dtype must be int32, got {bitmask.dtype}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask: on {bitmask.device}, but logits are on {logits.device}")
    n_mask_rows, n_words = bitmask.shape
    if n_words > 1 and bitmask.stride(1) != 1:
        raise ValueError("bitmask: the last dimension must be contiguous (stride 1)")
    if rows is None:
        if n_mask_rows < n_batch:
            raise ValueError(f"bitmask: has {n_mask_rows} rows, logits have {n_batch}")
    else:
        _check_rows(rows, logits, min(n_batch, n_mask_rows))
    if vocab_size is None:
        return min(n_cols, 32 * n_words)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size: expected an int or None, got {type(vocab_size).__name__}")
    if not 0 <= vocab_size <= n_cols:
        raise ValueError(f"vocab_size: {vocab_size} outside [0, {n_cols}] (the logits' width)")
    return vocab_size


def _check_rows(rows: torch.Tensor, logits: torch.Tensor, n_valid: int) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1:
        raise ValueError("rows: expected a 1-D tensor of row indices or None")
    if rows.dtype not in ROW_INDEX_DTYPES:
        raise ValueError(f"rows: dtype must be int32 or int64, got {rows.dtype}")
    if rows.device != logits.device:
        raise ValueError(f"rows: on {rows.device}, but logits are on {logits.device}")
    if rows.device.type == "cpu" and rows.numel() > 0:
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= n_valid:
            raise ValueError(f"rows: indices must lie in [0, {n_valid}), got [{low}, {high}]")


def unpack_bitmask(bitmask: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Expand packed int32 words (R, W) into a bool tensor (R, n_cols); bits past 32 * W are False."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # (R, 32 * W)
    if allowed.shape[1] >= n_cols:
        return allowed[:, :n_cols]
    pad = torch.zeros(bitmask.shape[0], n_cols - allowed.shape[1], dtype=torch.bool,
                      device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor (R, V) into int32 words (R, ceil(V / 32)); the inverse of unpack_bitmask."""
    n_rows, n_cols = allowed.shape
    n_words = (n_cols + 31) // 32
    padded = torch.zeros(n_rows, 32 * n_words, dtype=torch.int64, device=allowed.device)
    padded[:, :n_cols] = allowed.to(torch.int64)
    shifts = torch.arange(32, device=allowed.device, dtype=torch.int64)
    words = (padded.view(n_rows, n_words, 32) << shifts).sum(-1)  # (R, W), values in [0, 2**32)
    # Reinterpret as signed 32-bit: bit 31 set means a negative int32.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def apply_token_bitmask_reference_(logits: torch.Tensor, bitmask: torch.Tensor,
                                   rows: torch.Tensor | None = None,
                                   vocab_size: int | None = None) -> None:
    """Set disallowed logits to -inf in place, row by row: the plain PyTorch reference.

    Same contract as `mask_kernel.apply_token_bitmask_`: `rows` (None = every row) picks both
    the logits row and the bitmask row; columns at or past `vocab_size` (default
    min(V, 32 * W)) or past the mask's last word are disallowed; rows not listed are untouched.
    Raises ValueError on bad arguments (see check_mask_args).
    """
    n_valid = check_mask_args(logits, bitmask, rows, vocab_size)
    n_batch, n_cols = logits.shape
    if rows is None:
        rows = torch.arange(n_batch, device=logits.device)
    if rows.numel() == 0 or n_cols == 0:
        return
    rows = rows.long()
    allowed = unpack_bitmask(bitmask[rows], n_cols)  # (n, V)
    allowed[:, n_valid:] = False
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
