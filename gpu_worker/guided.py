"""Bitmasks of the guided rows: filled on the CPU by each row's own matcher, applied on the
logits' device by our Triton kernel.

I4 is kept by construction: in a step, the rows passed to `apply` are exactly the rows `fill`
wrote in that step, and the kernel touches no other row. Unguided rows never meet a mask.
"""

from __future__ import annotations

import time

import torch
import xgrammar as xgr

from gpu_worker.mask_kernel import apply_token_bitmask_

# Below this many guided rows a plain loop beats handing the batch to xgrammar's threads.
_BATCH_FILL_MIN_ROWS = 8


class MaskFiller:
    """A (rows, ceil(vocab/32)) int32 bitmask buffer and the code that fills and applies it.

    `rows` is the most rows one step can sample (the slot count). On CUDA the host buffer is
    pinned and copied with one non-blocking copy per step.
    """

    def __init__(self, rows: int, vocab_size: int, device: torch.device, fill_threads: int | str = "auto"):
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.full((rows, self.width), -1, dtype=torch.int32, pin_memory=pin)
        self.dev = self.host if device.type == "cpu" else torch.empty_like(self.host, device=device)
        # Guided row indices, staged in pinned memory so their copy does not block the host.
        self.rows_host = torch.zeros(rows, dtype=torch.int32, pin_memory=pin)
        self.rows_dev = self.rows_host if device.type == "cpu" else \
            torch.empty_like(self.rows_host, device=device)
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads)

    def fill(self, matchers: list, positions: list[int]) -> float:
        """Write row positions[i] from matchers[i]; return the seconds it took."""
        t0 = time.perf_counter()
        if len(matchers) >= _BATCH_FILL_MIN_ROWS:
            self._batch.batch_fill_next_token_bitmask(matchers, self.host, positions)
        else:
            for matcher, pos in zip(matchers, positions, strict=True):
                matcher.fill_next_token_bitmask(self.host, pos)
        return time.perf_counter() - t0

    def apply(self, logits: torch.Tensor, positions: list[int]) -> None:
        """Mask logits rows `positions` (R, V) in place with the rows just filled."""
        n, k = max(positions) + 1, len(positions)
        # The previous step ended with a device sync (sampled ids to the host), so the staging
        # buffers are free to overwrite.
        self.rows_host[:k] = torch.tensor(positions, dtype=torch.int32)
        if self.dev is not self.host:
            self.dev[:n].copy_(self.host[:n], non_blocking=True)
            self.rows_dev[:k].copy_(self.rows_host[:k], non_blocking=True)
        apply_token_bitmask_(logits, self.dev, self.rows_dev[:k], vocab_size=self.vocab_size)
