"""Bitmasks of the guided rows: filled on the CPU by each slot's own matcher, applied on the
logits' device by our Triton kernel.

The host buffer has one row per slot. I4 is kept by construction: the engine waits, before
`apply`, for the fill of every guided row's matcher in its current state; `apply` gathers
those slots' rows into the positions of their logits rows and the kernel touches no other
row. Unguided rows never meet a mask.

Matchers come from either backend (grammar_service.backends); both write the same packed
layout. xgrammar matchers of a large batch go through xgrammar's batch matcher; any other
matcher fills its own row.
"""

from __future__ import annotations

import time

import torch
import xgrammar as xgr

from gpu_worker.guided.mask_kernel import apply_token_bitmask_

# Below this many guided rows a plain loop beats handing the batch to xgrammar's threads.
_BATCH_FILL_MIN_ROWS = 8


class MaskFiller:
    """A (rows, ceil(vocab/32)) int32 bitmask buffer and the code that fills and applies it.

    `rows` is the slot count. On CUDA the host buffer is pinned and copied with one
    non-blocking copy per step.
    """

    def __init__(self, rows: int, vocab_size: int, device: torch.device, fill_threads: int | str = "auto"):
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.full((rows, self.width), -1, dtype=torch.int32, pin_memory=pin)
        self.dev = self.host if device.type == "cpu" else torch.empty_like(self.host, device=device)
        # Guided (logits row, slot) indices, staged in pinned memory so that their copy does
        # not block the host.
        self.rows_host = torch.zeros((2, rows), dtype=torch.int64, pin_memory=pin)
        self.rows_dev = self.rows_host if device.type == "cpu" else \
            torch.empty_like(self.rows_host, device=device)
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads)

    def fill(self, matchers: list, slots: list[int]) -> float:
        """Write slot row slots[i] from matchers[i]; return the seconds it took."""
        t0 = time.perf_counter()
        xgr_rows = [(m, s) for m, s in zip(matchers, slots, strict=True)
                    if isinstance(m, xgr.GrammarMatcher)]
        batched = len(xgr_rows) >= _BATCH_FILL_MIN_ROWS
        if batched:
            self._batch.batch_fill_next_token_bitmask([m for m, _ in xgr_rows], self.host,
                                                      [s for _, s in xgr_rows])
        for matcher, slot in zip(matchers, slots, strict=True):
            if not (batched and isinstance(matcher, xgr.GrammarMatcher)):
                matcher.fill_next_token_bitmask(self.host, slot)
        return time.perf_counter() - t0

    def apply(self, logits: torch.Tensor, positions: list[int], slots: list[int]) -> None:
        """Mask logits rows `positions` (of (R, V)) in place with slot rows `slots`."""
        k = len(positions)
        # The previous step ended with a device sync (sampled ids to the host), so the staging
        # buffers are free to overwrite.
        self.rows_host[:, :k] = torch.tensor([positions, slots], dtype=torch.int64)
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self.rows_dev[:, :k].copy_(self.rows_host[:, :k], non_blocking=True)
        rows, slot_rows = self.rows_dev[0, :k], self.rows_dev[1, :k]
        # Bitmask row i must sit at logits row positions[i]: scatter the slots' rows there.
        mask = self.dev.new_empty((logits.shape[0], self.width))
        mask.index_copy_(0, rows, self.dev.index_select(0, slot_rows))
        apply_token_bitmask_(logits, mask, rows, vocab_size=self.vocab_size)
