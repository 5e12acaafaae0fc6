"""Forced tokens and the per-row work between accepting a token and sampling the next.

Where a row's grammar allows exactly one token (its bitmask row has one bit set), sampling has
nothing to decide: any sampler, greedy or not, top-p or not, picks that token. Such tokens are
accepted into the row's own matcher straight away (on every rank, each from its own matcher:
the chain is a function of the accepted tokens, so the ranks agree, I1/I3) and the engine
feeds the whole chain to the row's next forward as one chunk. Only single tokens of the
vocabulary are followed, never re-tokenised text, so the output is the one sampling would
have produced token for token.

`prepare` runs on the engine's mask-fill thread for the rows that go on after a commit:
- a row that samples mask-first next needs its bitmask row filled for its current state;
- a row that samples accept-first next needs no mask.
A row is checked for a forced token (its filled row counted) only where the grammar may force
one. The cheap test (`may_force`, about a microsecond): the grammar's jump-forward string (the
text every continuation starts with) is empty, or two vocabulary tokens are prefixes of it
(both would be allowed), means at least two allowed tokens. The test only saves work; a token
is forced only when its filled row says so.
A chain ends before a stop token (sampling takes those: the grammar may end there), at the
row's token budget, or where the grammar could be complete.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from grammar_service.backends import LLGuidanceMatcher


@dataclass
class RowJob:
    """One row's work: fill its mask (`need_mask`) and/or follow forced tokens (up to
    `budget` of them, never one of `stop_ids`). `chain` and `mask_ok` are the results: the
    forced tokens accepted, and whether the slot's bitmask row holds the mask of the
    matcher's final state."""

    matcher: object
    slot: int
    need_mask: bool
    budget: int
    stop_ids: frozenset[int]
    chain: list[int] = field(default_factory=list)
    mask_ok: bool = False


class ForcedScan:
    """Finds rows whose bitmask allows exactly one token below `vocab_size`.

    `token_bytes`: the bytes of every ordinary (non-special) token, for `may_force`; None
    turns the jump-forward test off (every row is filled to be checked)."""

    def __init__(self, vocab_size: int, width: int, token_bytes: Iterable[bytes] | None = None):
        self.vocab_size = vocab_size
        self.width = width
        # Ids from vocab_size on are no tokens: whole words before `_full`, then the low
        # `_rest` bits of one more word.
        self._full, self._rest = divmod(min(vocab_size, 32 * width), 32)
        self._tokens = frozenset(t for t in token_bytes if t) if token_bytes is not None else None
        self._longest = max(map(len, self._tokens), default=0) if self._tokens else 0

    def single_allowed(self, host: torch.Tensor, slots: list[int]) -> list[int]:
        """Per slot: the one allowed token id of its bitmask row, or -1. (NumPy on the host
        rows: a few microseconds a row, no thread pool.)"""
        words = host.numpy().view(np.uint32)
        out = []
        for slot in slots:
            row = words[slot]
            tail = int(row[self._full]) & ((1 << self._rest) - 1) if self._rest else 0
            count = np.count_nonzero(row[:self._full]) + (tail != 0)  # nonzero words
            if count != 1:
                out.append(-1)
                continue
            word = self._full if tail else int(np.flatnonzero(row[:self._full])[0])
            value = tail or int(row[word])
            out.append(32 * word + value.bit_length() - 1 if value & (value - 1) == 0 else -1)
        return out

    def may_force(self, matcher) -> bool:
        """False when the grammar surely allows two or more tokens here (see the module)."""
        if self._tokens is None:
            return True
        if isinstance(matcher, LLGuidanceMatcher):
            ahead = bytes(matcher.llmatcher.compute_ff_bytes())
        else:
            ahead = matcher.find_jump_forward_string().encode("utf-8", "surrogatepass")
        if not ahead:
            return False
        prefixes = 0
        for n in range(1, min(len(ahead), self._longest) + 1):
            if ahead[:n] in self._tokens:
                prefixes += 1
                if prefixes == 2:
                    return False
        return True


def prepare(filler, scan: ForcedScan | None, jobs: list[RowJob]) -> tuple[float, int]:
    """Run `jobs` (see RowJob) with `filler` (a MaskFiller); `scan` None: fill only, follow
    no forced token. Returns (seconds, bitmask rows filled)."""
    t0 = time.perf_counter()
    fills = 0
    active = jobs
    while active:
        # Rows the grammar may force here (the cheap test), then the rows to fill: those and
        # the ones that sample mask-first next.
        maybe = ({id(j) for j in active if len(j.chain) < j.budget and scan.may_force(j.matcher)}
                 if scan is not None else set())
        to_fill = [j for j in active if j.need_mask or id(j) in maybe]
        if not to_fill:
            break
        filler.fill([j.matcher for j in to_fill], [j.slot for j in to_fill])
        fills += len(to_fill)
        for j in to_fill:
            j.mask_ok = True
        check = [j for j in to_fill if id(j) in maybe]
        active = []
        for j, token in zip(check, scan.single_allowed(filler.host, [j.slot for j in check])
                            if check else [], strict=True):
            if token < 0 or token in j.stop_ids:
                continue
            if not j.matcher.accept_token(token):  # the mask allowed it: a backend bug
                raise RuntimeError(f"the grammar refused token {token}, the only one its mask "
                                   "allows")
            j.chain.append(token)
            j.mask_ok = False
            if not j.matcher.is_completed():  # complete: the engine decides whether it ends
                active.append(j)
    stale = [j for j in jobs if j.need_mask and not j.mask_ok]
    if stale:
        filler.fill([j.matcher for j in stale], [j.slot for j in stale])
        fills += len(stale)
        for j in stale:
            j.mask_ok = True
    return time.perf_counter() - t0, fills
