"""Forced tokens and the fill-thread job between accepting a token and sampling the next.

Where a row's grammar allows exactly one token (its bitmask row has one bit set), sampling has
nothing to decide: any sampler, greedy or not, top-p or not, picks that token. Such tokens are
accepted into the row's own matcher straight away (on every rank, each from its own matcher:
the chain is a function of the accepted tokens, so the ranks agree, I1/I3) and the engine
feeds the whole chain to the row's next forward as one chunk. Only single tokens of the
vocabulary are followed, never re-tokenised text, so the output is the one sampling would
have produced token for token.

`prepare` runs on the engine's mask-fill thread for the rows that sample mask-first next: it
fills each row's bitmask for the matcher's current state and, with a `ForcedScan`, counts
the bits of the row it just filled (about two microseconds); a single allowed token is
accepted. `follow`, the next job on that thread, fills those rows again and goes on until the
grammar allows more than one token. The engine waits for `prepare` before it samples, emits
the first forced token at once and feeds it to the next forward; it waits for `follow` only
where that row samples next, so the fill after a forced token runs beside the forward, as the
fill after a sampled token does. A chain ends before
a stop token (sampling takes those: the grammar may end there), at the row's token budget,
or where the grammar could be complete. Rows sampled accept-first get no job: their masks
are never filled, and the model predicts a forced token like any other (accept-first then
gives it exactly); checking them would cost the fill accept-first saves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RowJob:
    """One row's work: fill its mask and follow forced tokens (up to `budget` of them, never
    one of `stop_ids`). Results: `chain`, the forced token `prepare` accepted (none or one);
    then `more`, the forced tokens `follow` accepted after it, and `ends`, whether the grammar
    is then complete and allows nothing but a stop id (the output is done). Once the latest
    job is done, the slot's bitmask row holds the mask of the matcher's state after them."""

    matcher: object
    slot: int
    budget: int
    stop_ids: frozenset[int]
    chain: list[int] = field(default_factory=list)
    more: list[int] = field(default_factory=list)
    ends: bool = False


class ForcedScan:
    """Finds rows whose bitmask allows exactly one token below `vocab_size`."""

    def __init__(self, vocab_size: int, width: int):
        # Ids from vocab_size on are no tokens: whole words before `_full`, then the low
        # `_rest` bits of one more word.
        self._full, self._rest = divmod(min(vocab_size, 32 * width), 32)

    def single_allowed(self, host: torch.Tensor, slots: list[int]) -> list[int]:
        """Per slot: the one allowed token id of its bitmask row, or -1. (NumPy on the host
        rows: about two microseconds a row at 150k tokens, no thread pool.)"""
        words = host.numpy().view(np.uint32)
        out = []
        for slot in slots:
            row = words[slot]
            tail = int(row[self._full]) & ((1 << self._rest) - 1) if self._rest else 0
            count = np.count_nonzero(row[:self._full]) + (tail != 0)  # nonzero words
            if count != 1:
                out.append(-1)
                continue
            # the one nonzero word: the largest (argmax: one pass, no index array)
            word = self._full if tail else int(row[:self._full].argmax())
            value = tail or int(row[word])
            out.append(32 * word + value.bit_length() - 1 if value & (value - 1) == 0 else -1)
        return out

    def only_stops(self, host: torch.Tensor, slot: int, stop_ids: frozenset[int]) -> bool:
        """Whether slot's bitmask row allows no token below `vocab_size` but `stop_ids`."""
        row = host[slot].numpy().view(np.uint32).copy()
        for tok in stop_ids:
            if tok < 32 * self._full + self._rest:
                row[tok >> 5] &= ~np.uint32(1 << (tok & 31))
        tail = int(row[self._full]) & ((1 << self._rest) - 1) if self._rest else 0
        return tail == 0 and not row[:self._full].any()


def prepare(filler, scan: ForcedScan | None, jobs: list[RowJob]) -> tuple[float, int]:
    """The first round of `jobs` (see RowJob) with `filler` (a MaskFiller): fill every row,
    then accept the forced token of each row that has one (its chain's first; `follow` does
    the rest). `scan` None: fill only. Returns (seconds, bitmask rows filled)."""
    t0 = time.perf_counter()
    filler.fill([j.matcher for j in jobs], [j.slot for j in jobs])
    if scan is not None:
        _accept_forced(filler, scan, jobs)
    return time.perf_counter() - t0, len(jobs)


def follow(filler, scan: ForcedScan, jobs: list[RowJob]) -> tuple[float, int]:
    """The rest of the chains `prepare` started: each row with a forced token is filled
    again (its mask after the chain) and follows the next forced tokens (into `more`) until
    none is left; then `ends` is set where only a stop id is left. The engine waits for this
    job where the row samples next, so it runs while the forward that feeds the chain's
    first token runs. Returns (seconds, bitmask rows filled)."""
    t0 = time.perf_counter()
    fills = 0
    active = [j for j in jobs if j.chain]
    while active:
        filler.fill([j.matcher for j in active], [j.slot for j in active])
        fills += len(active)
        took = _accept_forced(filler, scan, active, into="more")
        went_on = {id(j) for j in took}
        for j in active:
            if id(j) not in went_on and j.matcher.is_completed():
                j.ends = scan.only_stops(filler.host, j.slot, j.stop_ids)
        active = took
    return time.perf_counter() - t0, fills


def _accept_forced(filler, scan: ForcedScan, jobs: list[RowJob],
                   into: str = "chain") -> list[RowJob]:
    """Accept the one allowed token of each just-filled row that has one (within its budget,
    never a stop id) into the job's list `into`; the jobs that took one."""
    check = [j for j in jobs if len(j.chain) + len(j.more) < j.budget]
    took = []
    for j, token in zip(check, scan.single_allowed(filler.host, [j.slot for j in check]),
                        strict=True):
        if token < 0 or token in j.stop_ids:
            continue
        if not j.matcher.accept_token(token):  # the mask allowed it: a backend bug
            raise RuntimeError(f"the grammar refused token {token}, the only one its mask "
                               "allows")
        getattr(j, into).append(token)
        took.append(j)
    return took
