"""Bitmasks of the guided rows: filled on the CPU by each slot's own matcher, applied on the
logits' device by our Triton kernel (on the CPU, by xgrammar's C++ kernel: see
`apply_token_bitmask_cpu_`).

The host buffer has one row per slot. I4 is kept by construction: the engine waits, before
`apply`, for the fill of every guided row's matcher in its current state; `apply` gathers
those slots' rows into the positions of their logits rows and the kernel touches no other
row. Unguided rows never meet a mask.

Matchers come from either backend (grammar_service.backends); both write the same packed
layout. A step's rows are filled in parallel, GIL released, by each backend's own batch
filler: xgrammar's `BatchGrammarMatcher` and llguidance's `LLExecutor`. That matters: at a
150k vocabulary one row costs 30 µs to several ms (llguidance inside length-bounded strings:
0.5-2.6 ms), so 64 rows filled one after the other took 10 ms per step on the H200's host,
three forwards' worth.
"""

from __future__ import annotations

import time

import llguidance
import torch
import xgrammar as xgr

from gpu_worker.guided.mask_kernel import apply_token_bitmask_
from gpu_worker.guided.mask_reference import check_mask_args
from grammar_service.backends import LLGuidanceMatcher, default_fill_threads

# Below this many rows of one backend a plain loop beats handing them to a thread pool.
_BATCH_FILL_MIN_ROWS = 4


class MaskFiller:
    """A (rows, ceil(vocab/32)) int32 bitmask buffer and the code that fills and applies it.

    `rows` is the slot count. On CUDA the host buffer is pinned and copied with one
    non-blocking copy per step. `triton`: apply masks with our Triton kernel (None: on CUDA;
    on the CPU it runs only under TRITON_INTERPRET=1, for tests of the kernel in the engine),
    else with `apply_token_bitmask_cpu_`.
    """

    def __init__(self, rows: int, vocab_size: int, device: torch.device,
                 fill_threads: int | str = "auto", triton: bool | None = None):
        if triton is None:
            triton = device.type == "cuda"
        if not triton and device.type != "cpu":
            raise ValueError(f"triton: masks on {device} are applied by the Triton kernel")
        self._apply = apply_token_bitmask_ if triton else apply_token_bitmask_cpu_
        self.vocab_size = vocab_size
        self.width = (vocab_size + 31) // 32
        self.device = device
        pin = device.type == "cuda"
        self.host = torch.full((rows, self.width), -1, dtype=torch.int32, pin_memory=pin)
        self._stage = _Stage(self.host, rows, device)
        self._batch = xgr.BatchGrammarMatcher(max_threads=fill_threads)
        # "auto": llguidance's own default, the count its grammars' lanes are sized for
        self._llg = llguidance.LLExecutor(default_fill_threads() if fill_threads == "auto"
                                          else int(fill_threads))

    def fill(self, matchers: list, slots: list[int]) -> float:
        """Write slot row slots[i] from matchers[i]; return the seconds it took."""
        t0 = time.perf_counter()
        xgr_rows, llg_rows, other = [], [], []
        for m, s in zip(matchers, slots, strict=True):
            if isinstance(m, xgr.GrammarMatcher):
                xgr_rows.append((m, s))
            elif isinstance(m, LLGuidanceMatcher):
                llg_rows.append((m, s))
            else:
                other.append((m, s))
        if len(xgr_rows) >= _BATCH_FILL_MIN_ROWS:
            self._batch.batch_fill_next_token_bitmask([m for m, _ in xgr_rows], self.host,
                                                      [s for _, s in xgr_rows])
        else:
            other += xgr_rows
        if len(llg_rows) >= _BATCH_FILL_MIN_ROWS:
            # Writes row s (all `width` words) of the contiguous host buffer for each pair.
            self._llg.unsafe_compute_mask_ptr([(m.llmatcher, s) for m, s in llg_rows],
                                              self.host.data_ptr(), self.width * 4,
                                              self.host.shape[0])
        else:
            other += llg_rows
        for matcher, slot in other:
            matcher.fill_next_token_bitmask(self.host, slot)
        return time.perf_counter() - t0

    def stage_rows(self, slots: list[int]) -> torch.Tensor:
        """Slot rows `slots` of the bitmask as one (k, width) int32 tensor on the device, copied
        without blocking (on the CPU, a gathered copy). Valid until the next `stage_rows` or
        `apply`: the staging buffers are free again once the device work queued after their
        previous use has run (the engine syncs on each step's sampled ids)."""
        st, k = self._stage, len(slots)
        st.words[1, :k] = slots
        if st.dev is self.host:
            return self.host.index_select(0, st.rows_host[1, :k])
        torch.index_select(self.host, 0, st.rows_host[1, :k], out=st.stage[:k])
        return st.dev[:k].copy_(st.stage[:k], non_blocking=True)  # (k, words)

    def apply(self, logits: torch.Tensor, positions: list[int], slots: list[int]) -> None:
        """Mask logits rows `positions` (of (R, V)) in place with slot rows `slots`."""
        k = len(positions)
        guided = self.stage_rows(slots)
        st = self._stage
        st.words[0, :k] = positions
        if st.dev is self.host:
            rows = st.rows_host[0, :k]
        else:
            rows = st.rows_dev[0, :k].copy_(st.rows_host[0, :k], non_blocking=True)
        # Bitmask row i must sit at logits row positions[i]: scatter the guided rows there.
        mask = guided.new_empty((logits.shape[0], self.width))
        mask.index_copy_(0, rows, guided)
        self._apply(logits, mask, rows, vocab_size=self.vocab_size)


def apply_token_bitmask_cpu_(logits: torch.Tensor, bitmask: torch.Tensor,
                             rows: torch.Tensor | None = None,
                             vocab_size: int | None = None) -> None:
    """`mask_kernel.apply_token_bitmask_` on CPU tensors, the same contract and errors, with
    xgrammar's C++ kernel. On the CPU our Triton kernel runs only in Triton's interpreter:
    0.23 s a step for 38 rows of the default model's 4k tokens, against 0.3 ms here
    (bench/cpu_worker.py), which made guided requests on a CPU worker a fifteenth as fast as
    free text. Columns at or past the effective vocabulary (xgrammar leaves them as they
    are) are set to -inf afterwards, as the kernel sets them."""
    n_valid = check_mask_args(logits, bitmask, rows, vocab_size)
    if logits.device.type != "cpu":
        raise ValueError(f"logits: on {logits.device}; this kernel runs on the CPU")
    n_batch, n_cols = logits.shape
    index = list(range(n_batch)) if rows is None else rows.tolist()
    if not index or n_cols == 0:
        return
    # Bits past the mask's last word allow nothing: xgrammar must not read past it.
    n_valid = min(n_valid, 32 * bitmask.shape[1])
    if n_valid:
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=n_valid, indices=index,
                                        backend="cpu")
    if n_valid < n_cols:
        logits[torch.tensor(index), n_valid:] = float("-inf")


class _Stage:
    """Pinned host staging and device buffers for `apply`: the gathered guided rows and
    their (logits row, slot) indices. On CPU the host buffer serves directly."""

    def __init__(self, host: torch.Tensor, rows: int, device: torch.device):
        cpu = device.type == "cpu"
        self.stage = host if cpu else torch.empty_like(host, pin_memory=True)
        self.dev = host if cpu else torch.empty_like(host, device=device)
        self.rows_host = torch.zeros((2, rows), dtype=torch.int64, pin_memory=not cpu)
        self.rows_dev = self.rows_host if cpu else torch.empty_like(self.rows_host, device=device)
        self.words = self.rows_host.numpy()  # written in place (no tensor per step)
