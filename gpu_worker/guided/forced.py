"""Forced tokens and the fill-thread job between accepting a token and sampling the next.

Where a row's grammar allows exactly one token (its bitmask row has one bit set), sampling has
nothing to decide: any sampler, greedy or not, top-p or not, picks that token. Such tokens are
accepted into the row's own matcher straight away (on every rank, each from its own matcher:
the chain is a function of the accepted tokens, so the ranks agree, I1/I3) and the engine
feeds them to the row's next forward, several as one chunk. Only single tokens of the
vocabulary are followed, never re-tokenised text, so the output is the one sampling would
have produced token for token.

What pays in the overlapped step loop: the forward of a step is launched before the host
knows the token sampled at the step before, so a lone forced token saves nothing (the forward
that would take it is already running with it), and neither does the first of a chain. Taking
a chain's tokens in one step saves a step per token past the first taken, but finding each
means one more fill after the step's batch, on the critical path (a round for the few rows in
chains costs about what the whole batch costs, since rows fill in parallel): it pays only in
chains that go on. So, by a row's run of forced tokens so far (the device notes, with each
sampled token, whether its masked logits had one token left: `single_allowed`, three kernels,
no host scan):
- fewer than two forced tokens in a row (most rows): the job only fills; the second token
  of a chain is sampled like the first (taking it from the mask instead would save no step:
  its forward is already running);
- two or more: the job counts the bits of the fresh mask (`ForcedScan`, about two
  microseconds a row) and takes the one allowed token (accept) in place of sampling it; the
  row feeds it at its next forward. Taking one token so saves no step and costs no fill
  (the row's next fill joins the next step's batch). A further round (fill again at once,
  take the next forced token in the same step) saves a step for each row whose next token
  is forced too, and costs the whole batch one more fill on the critical path. `ChainRounds`
  runs it only where it pays on average: the rows that took a token, times the share of
  taken tokens that were followed by another forced one (a moving average over every such
  scan, rounds or not), must reach `round_cost` times the batch's rows (a round costs about
  `round_cost` of a step; a row's step is 1 / rows of it). So at small batches a chain is
  followed at once (fed as one chunk: a chain of n saves n - 3 steps); in a large batch only
  where many rows chain together or chains go on, and a model whose forced tokens come one
  or two at a time (random weights) pays for no rounds.
`prepare` runs on the engine's mask-fill thread for the rows that sample mask-first next: one
batch of fills for the step's rows, then rounds only for rows following a chain. A chain ends
before a stop token (sampling takes those: the grammar may end there), at the row's token
budget, or where the grammar allows more than one token. Rows sampled accept-first get no job:
their masks are never filled, and the model predicts a forced token like any other
(accept-first then gives it exactly). Everything `prepare` decides depends only on the rows'
matchers, in submission order (one fill thread), so every rank takes the same chains (I2/I3).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class RowJob:
    """One row's work: fill its mask and, up to `budget` tokens (0: none), take forced
    tokens (never one of `stop_ids`) into its matcher, filling again after each, while the
    grammar allows one token. Results: `chain`, the forced tokens accepted, and `filled`,
    whether the slot's bitmask row holds the mask after them."""

    matcher: object
    slot: int
    budget: int
    stop_ids: frozenset[int]
    # The row took a forced token at its previous job without a fill after it: whether this
    # job's scan finds another one is an observation for ChainRounds.
    after_forced: bool = False
    chain: list[int] = field(default_factory=list)
    filled: bool = False


class ChainRounds:
    """Whether one more fill round for the rows that just took a forced token pays (see the
    module docstring). Used on the fill thread only; its state changes only with the
    tokens scanned, so it is the same on every rank."""

    WEIGHT = 1 / 32  # of the moving average

    def __init__(self, round_cost: float):
        self.round_cost = round_cost
        self.goes_on = 1.0  # share of taken forced tokens followed by another one

    def observe(self, went_on: bool) -> None:
        self.goes_on += (float(went_on) - self.goes_on) * self.WEIGHT

    def worth(self, took: int, rows: int) -> bool:
        """A round for `took` rows of a batch of `rows`: expected steps saved >= its cost."""
        return took * self.goes_on >= self.round_cost * rows


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


def prepare(filler, scan: ForcedScan | None, jobs: list[RowJob],
            rounds: ChainRounds | None = None) -> tuple[float, int, int]:
    """Run `jobs` (see RowJob) with `filler` (a MaskFiller): one batch of fills, then one
    more round for the rows that took a forced token while `rounds` says it pays (None:
    until none takes one). `scan` None: fill only. Returns (seconds, bitmask rows filled,
    rounds after the batch)."""
    t0 = time.perf_counter()
    fills = extra = 0
    active = jobs
    while active:
        filler.fill([j.matcher for j in active], [j.slot for j in active])
        fills += len(active)
        for j in active:
            j.filled = True
        if scan is None:
            break
        took = _accept_forced(filler, scan, active, rounds)
        for j in took:
            j.filled = False
        if took and rounds is not None and not rounds.worth(len(took), len(jobs)):
            break  # taken without a fill after them: their fills join the next batch
        active = took
        extra += bool(took)
    return time.perf_counter() - t0, fills, extra


def single_allowed(logits: torch.Tensor) -> torch.Tensor:
    """(R,) bool: the rows of masked (R, V) logits with exactly one token left (one value
    above -inf). Three kernels, no sync. The same on every rank: every rank has the same
    logits (all-gathered) and the same masks. A model's own -inf can only make a row look
    single: the flag only asks the row's next job to scan its mask, which decides."""
    return (logits > float("-inf")).sum(dim=1) == 1


def _accept_forced(filler, scan: ForcedScan, jobs: list[RowJob],
                   rounds: ChainRounds | None = None) -> list[RowJob]:
    """Accept the one allowed token of each just-filled row that has one (within its budget,
    never a stop id); the jobs that took one. Rows just past a forced token tell `rounds`
    whether it went on."""
    check = [j for j in jobs if len(j.chain) < j.budget]
    took = []
    for j, token in zip(check, scan.single_allowed(filler.host, [j.slot for j in check]),
                        strict=True):
        go_on = token >= 0 and token not in j.stop_ids
        if rounds is not None and (j.chain or j.after_forced):
            rounds.observe(go_on)
        if not go_on:
            continue
        if not j.matcher.accept_token(token):  # the mask allowed it: a backend bug
            raise RuntimeError(f"the grammar refused token {token}, the only one its mask "
                               "allows")
        j.chain.append(token)
        took.append(j)
    return took
