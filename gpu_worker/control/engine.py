"""The step loop of one rank: lockstep admission, scheduling, forward, masks, sampling.

One step, identical on every rank:
  1. control all-reduce → starts and releases take effect (I2);
  2. schedule: every decoding slot gets one token, prefill chunks fill the token budget;
  3. the guided rows' bitmasks are filled on a CPU thread while the CPU and the GPU do
     everything else: a row's fill starts as soon as its previous token is accepted (end of
     the previous step), or before the forward for a row that samples for the first time;
  4. padded vocabulary ids masked for every row; bitmask applied to the guided rows only
     (the kernel never touches an unguided row: I4);
  5. sample with counter-based per-request noise (same tokens whatever the batch: I3);
     steps 4-5 are one fused pass on CUDA where the rows allow it (`_sample_fused`);
  6. optional all-reduce of the sampled ids (divergence check), then each rank accepts the
     token into its own matcher (I1), dead ends fail one request (I6), finished slots are
     freed with every piece of their state dropped (I5).

Three shortcuts do less work for exactly the same tokens (each can be turned off):
- Forced tokens (`forced_tokens`): the step loop is overlapped (the forward launched while
  a row's token is found already had the token before it), so a lone forced token saves no
  step, nor does the first of a chain, and following a chain at once costs a fill round on
  the critical path per token (gpu_worker.guided.forced has the arithmetic). So a row samples
  the first forced token like any other, and the device notes that its masked logits had
  that one token left (the note travels with the token). After two forced tokens in a row
  the row's next job scans its fresh mask and takes the one allowed token, then follows the
  chain at once (fill again, accept) while the grammar allows one token and such a round
  pays (`forced_round_cost`: rows that took a token, times how often a taken token was
  followed by another, against the batch's rows). Taken tokens are emitted at once and fed
  to the row's next forward as one chunk. Rows without two forced tokens last pay for no
  scan. A row
  asking for unconstrained logprobs takes no forced tokens: they were never run through the
  model at their own positions, so it samples each one (the same token: the only one
  allowed).
- Accept-first (`accept_first`): sampling is argmax(logits / T + g) with per-request noise g,
  so when the argmax over the whole vocabulary is a token the grammar allows, it is also the
  argmax over the allowed tokens: the token mask-first sampling gives. Rows sampled greedily
  or with temperature only (no top-k/top-p/min-p, no logprobs, past min_tokens) sample
  unmasked and need no mask fill. Their token is checked when it is accepted, at the commit;
  a refused row is sampled again one sampling point later (not at the next), from the logits
  saved at its first try, masked (every word of its row written, I4), with the same noise
  (the same token index) and the same sampler path: the token mask-first sampling gives. Its
  fill runs in a job of its own during the forward between, so no other row waits for it, and
  every rank samples it at the same step (the rule does not depend on timing). The row's
  input of the forward already launched is rewritten at its next feed, and it sits out the
  forward between: it loses one step, the batch none. A row refused twice before an
  acceptance backs off: it samples mask-first for 3, 7, ... up to `accept_first_max_backoff`
  tokens, and an acceptance halves its backoff. The engine keeps a moving average of the
  refusal rate over all tries; while it is above one half (a model that does not follow the
  grammar), a new row starts fully backed off. So such a model costs about what mask-first
  costs, and one that follows the grammar keeps nearly every row accept-first. A row's mode
  is decided when its previous token is accepted (its mask fill starts then, or never).
  (Every rank sees the same acceptances in the same order, so every rank makes the same
  choices.)
- Drafts (`draft_tokens`, gpu_worker.guided.drafts): an accept-first row whose token is
  pending on the device feeds after it up to `draft_tokens` guessed tokens (the guess made at
  its last commit, whose first token is the guess of the pending one) and gets logits at
  every position (`Seq.draft`). Once the commit before the sampling point shows the pending
  token was the first guess, each position is sampled with its own noise index, unmasked,
  like any accept-first token; otherwise only the first, and the keys written after it are
  void. The commit keeps the samples while each equals the guess fed after it (a refused one
  is sampled again as above) and stops at the first that differs: that one is the row's next
  input. The row's next forward, launched before that commit, fed its last sample as if every
  guess held; where one did not, that forward's output for the row is dropped (the row lost
  that step, the batch nothing) and the row feeds its true last token next. Rows draft every
  other step at most: a guess is made only from committed tokens.

Drain (SIGTERM): `drain()` asks this rank's group to start nothing more and to end once its
running rows finish, within `drain_timeout_s`. The request travels in the control all-reduce
with the admissions (two more MAX fields: "some rank drains", "some rank's drain deadline
passed"), so every rank learns it at the same step, even one that got no signal, and every
rank ends at the same step: the first with nothing running and nothing in flight (the same
state everywhere, I2/I3), or the step where a deadline passed, which fails the rows still
running with UNAVAILABLE. No rank leaves a peer waiting in a collective. Admissions still
pending are dropped at the end; their gateways admit them elsewhere (they produced nothing).

The engine imports neither grpc nor protos: it hands each step's typed outputs (RowOutput,
Finish) to `publish`, and the server translates them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from gpu_worker.control.lockstep import ControlChannel, diverged_rows
from gpu_worker.control.slots import Entry, SlotTable
from gpu_worker.guided.drafts import DraftTables
from gpu_worker.guided.forced import ChainRounds, ForcedScan, RowJob, prepare, single_allowed
from gpu_worker.guided.masks import MaskFiller
from gpu_worker.runtime.model import ForwardBatch, feed_tokens
from gpu_worker.sampling.kernel import DEAD, NONFINITE, SINGLE, sample_rows
from gpu_worker.sampling.sampler import SamplingBatch, SamplingFlags, sample
from protos.rpc import public_message
from protos.sampling import CONSTRAINED, UNCONSTRAINED

log = logging.getLogger(__name__)

# Finish reasons, as plain strings (the server maps them to protos.FinishReason).
STOP, LENGTH, GRAMMAR_COMPLETED, CANCELLED = "stop", "length", "grammar_completed", "cancelled"
DEAD_END, DIVERGENCE, INTERNAL, UNAVAILABLE = "dead_end", "divergence", "internal", "unavailable"
# gRPC's UNAVAILABLE as a number (the engine imports no grpc): a rank of the group failed.
_UNAVAILABLE_CODE = 14


@dataclass
class Request:
    """A validated Admit, as the engine runs it. `session` and `tag` are set on rank 0 only:
    they say where the request's output goes."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False             # return each token's log-probability (TokenLogprob)
    top_logprobs: int = 0              # and this many most likely alternatives
    # Of which distribution: CONSTRAINED (as masked, as sampled) or UNCONSTRAINED (the
    # model's logits before the grammar's mask; such a row takes no forced chains).
    logprobs_mode: str = CONSTRAINED
    grammar: object | None = None      # a GrammarHandle pinned in the worker's grammar cache
    matcher: object | None = None      # this rank's own xgrammar.GrammarMatcher (I1)
    session: object | None = None
    tag: int = 0
    admitted_at: float = field(default_factory=time.monotonic)
    release_grammar: Callable[[object], None] | None = None

    @property
    def unconstrained_logprobs(self) -> bool:
        """Logprobs asked of the model's distribution before the grammar's mask."""
        return self.logprobs and self.logprobs_mode == UNCONSTRAINED

    def close(self) -> None:
        """Drop the matcher and unpin the grammar (idempotent)."""
        self.matcher = None
        handle, self.grammar = self.grammar, None
        if handle is not None and self.release_grammar is not None:
            self.release_grammar(handle)


@dataclass(frozen=True)
class Finish:
    """How a request ended. `code` is a gRPC status number for failures of the group (a rank
    failed, an admission expired), 0 otherwise."""

    reason: str
    message: str = ""
    completion_tokens: int = 0
    start_seconds: float = 0.0
    first_token_seconds: float = 0.0
    code: int = 0


@dataclass
class RowOutput:
    """What one request produced in one step: new tokens and, on its last step, its Finish."""

    req: Request
    tokens: list[int] = field(default_factory=list)
    finish: Finish | None = None
    # With req.logprobs, one per token: (logprob, top token ids, top logprobs).
    logprobs: list[tuple[float, list[int], list[float]]] = field(default_factory=list)


@dataclass
class Run:
    """Engine state of one running slot. A new object per request, so nothing survives a
    release (I5)."""

    entry: Entry
    req: Request
    start_step: int
    started_at: float = field(default_factory=time.monotonic)
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)
    pending: int = 0  # 1 while a sampled token is still on the device (not in `generated`)
    fed: int = 0      # output tokens whose keys/values a launched forward writes
    emitted: int = 0
    first_token_at: float | None = None
    # The latest fill-thread job of this row (mask fill, forced tokens) and its RowJob,
    # whose results may be read once `job` is done: the row's mask is then filled for its
    # state after `prep.chain`.
    job: Future | None = None
    prep: RowJob | None = None
    # Forced tokens (the only one its mask allowed) that its output ends with: from one, its
    # next job takes a forced token; from two, it follows the chain (gpu_worker.guided.forced)
    forced_run: int = 0
    # Took forced tokens without a fill after them: its next fill joins the step's batch.
    chained: bool = False
    # Its accept-first token was refused: (the step's saved logits, its row there, the
    # sampler flags of that step), sampled again masked at the next sampling point.
    redo: tuple[torch.Tensor, int, SamplingFlags] | None = None
    stops: frozenset[int] = frozenset()  # ids that end the output (engine, request, grammar)
    af_backoff: int = 0            # accept-first: mask-first tokens after the next refusal
    af_skip: int = 0               # accept-first: mask-first tokens left before trying again
    af_next: bool | None = None    # the mode of the next sampling, once decided
    # Drafted tokens (gpu_worker.guided.drafts): the guess of the tokens from the one being
    # sampled after its last commit on, and how many of `generated` the tables have seen.
    draft: list[int] = field(default_factory=list)
    observed: int = 0

    @property
    def slot(self) -> int:
        return self.entry.slot

    @property
    def known(self) -> int:
        """Output tokens so far, a sampled one still on the device included."""
        return len(self.generated) + self.pending

    @property
    def kv_len(self) -> int:
        """Tokens in the slot's KV cache, or being written by a launched forward."""
        return self.prefilled + self.fed


@dataclass
class Seq:
    """One sequence of a step: its new tokens, whether it samples, whether it is prefill.
    A row verifying drafts feeds its pending token then `draft[1:]`, and gets logits at each
    of those `len(draft)` positions (`draft[0]` is the guess of the pending token); `out` is
    its first row in the step's logits."""

    run: Run
    tokens: list[int]
    samples: bool
    prefill: bool
    draft: list[int] = field(default_factory=list)
    out: int = 0

    @property
    def outputs(self) -> int:
        return max(1, len(self.draft))


@dataclass
class _InFlight:
    """A step whose tokens were sampled on the device and are on their way to the host."""

    rows: list[Run]
    tokens: torch.Tensor           # (R,) int64 on the device, dead rows as 0: the next inputs
    # (R,) int64 on the host (pinned): the token (a dead row DEAD or NONFINITE), plus SINGLE
    # where the row's mask allowed that token alone
    host: torch.Tensor
    done: torch.cuda.Event | None  # recorded after the copy (CUDA)
    step: int
    row_of: dict[int, int]         # slot -> row in `tokens`
    # Rows that asked for logprobs: (their indices in `rows`, (L, 1 + k) logprobs and
    # (L, k) token ids on the host, ready with `done`); None when no row asked.
    logprobs: tuple[list[int], torch.Tensor, torch.Tensor] | None = None
    # Accept-first rows (indices in `rows`); `saved` is the step's (R, V) logits as sampled
    # (theirs unmasked), kept for sampling a refused row again.
    accept_first: frozenset[int] = frozenset()
    saved: torch.Tensor | None = None
    # The sampling batch's flags: a refused row is sampled again on the same code path (bit
    # for bit, I3).
    flags: SamplingFlags | None = None
    # Per row of `rows`, for a row verifying drafts: the drafted token its sample must equal
    # for the row's next sample to count (None for a row's last or only sample).
    expect: list[int | None] | None = None
    # Per row of `rows`, its row in `saved` (None: the same index; the fused path saves the
    # step's logits as the forward wrote them, one row per `Seq.out`).
    saved_rows: list[int] | None = None
    # The CUDA-graph replays made before this sampling point (StepGraphs.calls): once `done`
    # has been waited for, their inputs have been copied on the device.
    graph_calls: int = 0


def _index(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D tensor (an int64 index by default) on `device`, copied from pinned memory
    without blocking: a copy from pageable memory would wait for the forward queued before
    it."""
    out = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        out = out.pin_memory().to(device, non_blocking=True)
    return out


class _IndexStage:
    """The small host-made tensors of one sampling point (rows to sample, rows sampled again,
    logprob rows, the sampling parameters), from one pinned host buffer written in place and
    copied without blocking: a pinned tensor made per use (`_index`) cost ~0.1 ms of host time
    each on an H100 host, a fifth of a guided step's extra host work over an unguided one.
    `blocks` stages a sampling point's int64 and float32 columns with one copy: each copy
    releases the GIL, and on a rank whose other threads want it, taking it back costs more
    than the copy.

    `start()` at each sampling point, which may then take up to `capacity` int64 and
    `capacity` float32 entries (more go through fresh tensors). The buffer is free again by
    then: the commit before a sampling point syncs on the previous one's sampled ids, which
    the device computed after every copy from the buffer (one stream)."""

    def __init__(self, capacity: int, device: torch.device):
        cuda = device.type == "cuda"
        self.device = device
        self._host = torch.empty(12 * capacity, dtype=torch.uint8, pin_memory=cuda)
        self._dev = torch.empty_like(self._host, device=device) if cuda else None
        self._bytes = self._host.numpy()
        self._at = 0

    def start(self) -> None:
        self._at = 0

    def __call__(self, values: list[int]) -> torch.Tensor:
        """`values` as an int64 index on the device (valid until the next `start()`)."""
        return self.blocks([values], [])[0][0]

    def blocks(self, ints: list[list], floats: list[list]) -> tuple:
        """Equal-length int64 columns `ints` and float32 columns `floats` as (k, n) int64 and
        (m, n) float32 tensors on the device (None for an empty list), in one copy, valid
        until the next `start()`."""
        n = len((ints or floats)[0])
        a = self._at
        mid = a + 8 * n * len(ints)
        end = mid + 4 * n * len(floats)
        if end > len(self._bytes):
            return (_index([v for c in ints for v in c], self.device).view(len(ints), n)
                    if ints else None,
                    _index([v for c in floats for v in c], self.device, torch.float32)
                    .view(len(floats), n) if floats else None)
        self._at = (end + 7) & ~7  # the next block starts 8-byte aligned
        words = self._bytes[a:mid].view(np.int64)
        for k, column in enumerate(ints):
            words[k * n:(k + 1) * n] = column
        reals = self._bytes[mid:end].view(np.float32)
        for k, column in enumerate(floats):
            reals[k * n:(k + 1) * n] = column
        if self._dev is None:
            staged = self._host
        else:
            staged = self._dev
            staged[a:end].copy_(self._host[a:end], non_blocking=True)
        return (staged[a:mid].view(torch.int64).view(len(ints), n) if ints else None,
                staged[mid:end].view(torch.float32).view(len(floats), n) if floats else None)


class _HostCopies:
    """Where each step's sampled ids land on the host: two pinned buffers and two CUDA events
    used in turn, so a step allocates neither. A buffer is written again two sampling points
    later, long after its commit read it (each commit comes before the next sampling point).
    `capacity` is the engine's `max_outputs`: a point samples each running row at most once
    per logits row it has (a row sampled again is not among the step's rows)."""

    def __init__(self, capacity: int, device: torch.device):
        cuda = device.type == "cuda"
        self._buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=cuda)
                         for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._turn = 0

    def put(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the copy of (R,) int64 `values` to the host; (the host tensor, the event
        recorded after the copy on CUDA, else None)."""
        self._turn ^= 1
        host = self._buffers[self._turn][:values.shape[0]]
        host.copy_(values, non_blocking=True)
        if self._events is None:
            return host, None
        done = self._events[self._turn]
        done.record()
        return host, done


def _flags(rows: list[Run]) -> SamplingFlags:
    """The sampling flags of a batch of `rows` (what SamplingBatch.from_lists computes)."""
    reqs = [r.req for r in rows]
    return SamplingFlags.of([q.temperature for q in reqs], [q.top_k for q in reqs],
                            [q.top_p for q in reqs], [q.min_p for q in reqs])


def _logprob_rows(inflight: _InFlight) -> dict[int, tuple[float, list[int], list[float]]]:
    """Row index -> (logprob, top ids, top logprobs) of a committed step; top entries that
    the mask left impossible (fewer allowed tokens than asked) are dropped."""
    if inflight.logprobs is None:
        return {}
    asked, values, ids = inflight.logprobs
    values, ids = values.tolist(), ids.tolist()
    out = {}
    for n, j in enumerate(asked):
        k = inflight.rows[j].req.top_logprobs
        top = [(t, v) for t, v in zip(ids[n][:k], values[n][1:k + 1], strict=True)
               if v > float("-inf")]
        out[j] = (values[n][0], [t for t, _ in top], [v for _, v in top])
    return out


@dataclass(frozen=True)
class EngineConfig:
    num_slots: int
    max_model_len: int
    step_tokens: int = 512           # per-step token budget (decode tokens + prefill chunks)
    divergence_check_every: int = 1  # 0 disables the check
    # An idle engine waits this long for its table to change before the next lockstep step,
    # twice as long after each idle step without a change, up to idle_poll_max_s: an idle
    # TP group's control all-reduce (gloo) kept a core a fifth busy per rank at 5 ms. Any
    # Admit, release or drain wakes the rank at once, and a slot starts once every rank holds
    # its Admit, which wakes each rank as it arrives: the backoff adds no start latency.
    idle_poll_s: float = 0.005
    idle_poll_max_s: float = 0.05
    # CUDA only: replay steps of up to this many new tokens (decode rows and prefill chunks
    # alike) from captured graphs (0 = eager). The model's KV cache needs one slot more than
    # num_slots (the scratch slot).
    cuda_graph_max_tokens: int = 0
    mask_fill_threads: int = 0       # xgrammar's batch fill threads (0 = one per core)
    # Apply masks with the Triton kernel (None: on CUDA; on the CPU xgrammar's C++ kernel,
    # gpu_worker.guided.masks.apply_token_bitmask_cpu_, unless this is True: the kernel under
    # TRITON_INTERPRET=1, for tests of it in the engine).
    triton_masks: bool | None = None
    forced_tokens: bool = True       # follow single-allowed tokens without sampling
    # A chain round (fill at once to follow a chain in the same step) costs about this share
    # of a step; rounds run only where they save more (gpu_worker.guided.forced.ChainRounds).
    forced_round_cost: float = 1 / 16
    accept_first: bool = True        # sample temperature-only guided rows unmasked first
    accept_first_max_backoff: int = 64
    # Sample a point's rows in one fused pass (gpu_worker.sampling.kernel.sample_rows) when
    # they allow it (`Engine._fusable`); None: on CUDA. The same tokens either way.
    fused_sampling: bool | None = None
    # Accept-first rows feed up to this many guessed tokens after their newest one and keep
    # the samples that agree (gpu_worker.guided.drafts); 0 turns drafts off.
    draft_tokens: int = 0
    drain_timeout_s: float = 30.0    # after drain(): running rows finish within this


class Engine:
    """Runs the step loop of one rank on its own thread.

    `publish(outputs)` (rank 0) receives, once per step, every request's RowOutput of that
    step; it runs on the engine thread and must only hand the list on. `stats` counts what
    the shortcuts did (also exported as metrics). `on_drain()` runs (engine thread) at the
    step the group starts draining, `on_drained()` once the loop ended after a drain.
    """

    def __init__(self, cfg: EngineConfig, model, table: SlotTable, control: ControlChannel, *,
                 vocab_size: int, model_vocab_size: int, eos_token_ids: tuple[int, ...],
                 device: torch.device, metrics=None,
                 on_fatal: Callable[[BaseException], None] | None = None,
                 publish: Callable[[list[RowOutput]], None] | None = None):
        self.cfg = cfg
        self.model = model
        self.table = table
        self.control = control
        self.vocab_size = vocab_size
        self.model_vocab_size = model_vocab_size
        self.eos = frozenset(eos_token_ids)
        self.device = device
        self.metrics = metrics
        # The labelled child, looked up once: a label lookup per token was 6 % of the step.
        # Counted once a step (`_flush`), not per token: each inc takes the counter's lock.
        self._generated = metrics.tokens.labels(kind="generated") if metrics is not None else None
        self._generated_now = 0  # tokens taken this step, not yet counted
        self.on_fatal = on_fatal
        self.publish = publish
        self.runs: dict[int, Run] = {}
        self.step_index = 0
        self._outputs: dict[int, RowOutput] = {}  # id(request) -> this step's output
        self._inflight: _InFlight | None = None  # the sampled step whose tokens are on the way
        self.masks = MaskFiller(cfg.num_slots, model_vocab_size, device,
                                fill_threads=cfg.mask_fill_threads or "auto",
                                triton=cfg.triton_masks)
        self.scan = ForcedScan(vocab_size, self.masks.width) if cfg.forced_tokens else None
        self.chain_rounds = ChainRounds(cfg.forced_round_cost)
        self.stats: Counter[str] = Counter()
        # Refused accept-first rows: those of the last commit (`_redo_next`) are sampled again
        # one sampling point later (`_redo`), when their fill has had a forward's time to run.
        self._redo: list[Run] = []
        self._redo_next: list[Run] = []
        self._refusal_rate = 0.0  # moving average over accept-first tries (1 = refused)
        self.drafts = DraftTables() if cfg.accept_first and cfg.draft_tokens > 0 else None
        # One bitmask row on the host for the "can the grammar only end here?" check.
        self._end_row = torch.empty((1, self.masks.width), dtype=torch.int32)
        # Logit rows of a step: one per sequence, more for rows verifying drafts.
        self.max_outputs = cfg.num_slots * (1 + (cfg.draft_tokens if self.drafts else 0))
        # A sampling point sends at most five indices and two sampling batches (three int64
        # and three float32 columns each) of at most that many rows.
        self._index = _IndexStage(8 * self.max_outputs, device)
        self._wire = _HostCopies(self.max_outputs, device)
        self._fused_sampling = (device.type == "cuda" if cfg.fused_sampling is None
                                else cfg.fused_sampling)
        self.graphs = None
        # On CUDA every token attends through slot attention, so mixed steps replay graphs too.
        self.slot_attention = device.type == "cuda"
        if device.type == "cuda" and cfg.cuda_graph_max_tokens > 0:
            from gpu_worker.runtime.cuda_graphs import StepGraphs

            self.graphs = StepGraphs(model, cfg.cuda_graph_max_tokens, self.max_outputs,
                                     scratch_slot=cfg.num_slots)
            with torch.inference_mode():
                self.graphs.capture_all()
        self._fill_pool = ThreadPoolExecutor(1, thread_name_prefix="mask-fill")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failed: BaseException | None = None
        self.last_step_timings: dict[str, float] = {}
        self.on_drain: Callable[[], None] | None = None
        self.on_drained: Callable[[], None] | None = None
        self.drain_requested = False  # drain() was called on this rank
        self.draining = False  # the group drains (some rank's drain reached the lockstep)
        self.drained = threading.Event()  # the group drained; the loop has ended
        self._idle_wait = cfg.idle_poll_s
        self._drain_deadline: float | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def drain(self) -> None:
        """Ask the group to drain (any thread; idempotent): from the next step no request
        starts on any rank, running rows go on for up to `drain_timeout_s` seconds, then the
        loop ends on every rank at the same step (`drained`, `on_drained`). Admissions must
        be refused from now on (the caller's part: `draining or drain_requested`)."""
        self.drain_requested = True
        self.table.poke()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.step()
            if self.drained.is_set() and self.on_drained is not None:
                self.on_drained()
        except BaseException as exc:  # a lost peer, or a bug: this rank cannot go on
            self.failed = exc
            log.error("engine stopped: %s", exc, exc_info=not isinstance(exc, RuntimeError))
            self.table.abort_step()
            self._inflight, self._redo, self._redo_next = None, [], []
            # Library errors (gloo's lost peer) name their C++ source files: not for clients.
            self._fail_all(UNAVAILABLE, public_message(f"worker rank failed: {exc}"))
            self._flush()
            if self.on_fatal is not None:
                self.on_fatal(exc)

    # ---- one step: lockstep, plan, execute, commit, publish ---------------------------------

    def step(self) -> None:
        """Run one lockstep step (blocks briefly when idle).

        Overlapped: the forward of step k is launched before the tokens of step k-1 reach the
        host (a decode row reads its newest token on the device), so the host's work on step
        k-1 (accept, finish, publish, the masks of step k) runs while the GPU computes.
        """
        if not self.runs and self._inflight is None:
            if self.table.wait_for_change(self._idle_wait) or self.table.in_use():
                self._idle_wait = self.cfg.idle_poll_s
            else:
                self._idle_wait = min(2 * self._idle_wait, self.cfg.idle_poll_max_s)
        if self._lockstep():
            return self._end_drain(timed_out=True)
        with torch.inference_mode():
            t0, cpu0 = time.perf_counter(), time.thread_time()
            seqs = self._plan() if self.runs else []
            logits = self._execute(seqs) if seqs else None
            t = {"forward": time.perf_counter() - t0}
            ahead = []
            if self._inflight is not None:
                inflight, self._inflight = self._inflight, None
                ahead = self._commit(inflight, t)
            # The next fills, one job while the forward runs: rows that go on after the
            # commit, rows that took forced tokens at the last sampling point. Then, in a job
            # of their own, the rows the commit refused: the thread runs jobs in order, and
            # they are needed only at the next sampling point.
            self._submit([r for r in ahead if r.redo is None]
                         + [r for r in self.runs.values() if r.chained])
            self._submit([r for r in ahead if r.redo is not None])
            if seqs or self._redo or self._redo_next:
                self._inflight = self._sample(seqs, logits, t)
            if seqs:
                t["cpu"] = time.thread_time() - cpu0
                self._record(seqs, t, time.perf_counter() - t0)
        self._flush()
        if (self.draining and not self.runs and self._inflight is None and not self._redo
                and not self._redo_next):
            self._end_drain(timed_out=False)

    def _lockstep(self) -> bool:
        """The control all-reduce: starts and releases take effect here on every rank (I2),
        and so does a drain. True when a drain deadline passed on some rank (the group ends
        now)."""
        now = time.monotonic()
        if self.drain_requested and self._drain_deadline is None:
            self._drain_deadline = now + self.cfg.drain_timeout_s
        overdue = self._drain_deadline is not None and now >= self._drain_deadline
        try:
            reduced = self.control.all_reduce_max(
                self.table.local_vector() + [int(self.drain_requested), int(overdue)])
        except BaseException:
            self.table.abort_step()
            raise
        *reduced, drain, overdue = reduced
        if drain and not self.draining:
            # Learned here by every rank at once; the deadline runs from now on those that
            # got no drain() themselves.
            self.draining = True
            if self._drain_deadline is None:
                self._drain_deadline = now + self.cfg.drain_timeout_s
            log.info("draining: no new requests start; %d running (up to %g s)",
                     len(self.runs), self.cfg.drain_timeout_s)
            if self.on_drain is not None:
                self.on_drain()
        decision = self.table.apply(reduced, admit=not self.draining)
        for entry in decision.releases:
            self._finish(self.runs[entry.slot], CANCELLED, "released", table_done=True)
        for entry in decision.starts:
            req = entry.payload
            stops = self.eos | req.stop_token_ids
            if req.matcher is not None:
                stops |= (req.grammar.stop_ids(req.matcher) if req.grammar is not None
                          else frozenset(req.matcher.stop_token_ids))
            start = self.cfg.accept_first_max_backoff if self._refusal_rate > 0.5 else 0
            r = self.runs[entry.slot] = Run(entry, req, self.step_index, stops=stops,
                                            af_backoff=start, af_skip=start)
            if self.drafts is not None and req.grammar is not None and not start:
                # The first token and those after it, as earlier outputs began.
                r.draft = self.drafts.propose(req.grammar.key, [], 1 + self.cfg.draft_tokens)
        self.step_index += 1
        self._update_gauges()
        return bool(overdue)

    def _end_drain(self, timed_out: bool) -> None:
        """End the loop of a drained group (the same step on every rank): rows still running
        fail with UNAVAILABLE (the deadline passed), pending admissions are dropped (their
        gateways admit them elsewhere)."""
        if timed_out:
            log.warning("drain timeout: failing %d running requests", len(self.runs))
            self._inflight, self._redo, self._redo_next = None, [], []
        self._fail_all(UNAVAILABLE, f"the worker group shut down: its drain timeout "
                                    f"({self.cfg.drain_timeout_s:g} s) passed before this "
                                    "request finished")
        self._flush()
        self._update_gauges()
        self.drained.set()
        self._stop.set()

    def _plan(self) -> list[Seq]:
        """The sequences of this step; the same result on every rank. A decode row feeds its
        output tokens not yet in its cache: the newest sampled one (on the device while
        pending), or a chain of forced tokens. A row whose token in flight ends it by length
        is not scheduled again."""
        decode = [r for r in self.runs.values() if r.prefilled == len(r.req.prompt)
                  and r.known > r.fed and not (r.pending and self._ends_by_length(r))]
        prefill = sorted((r for r in self.runs.values() if r.prefilled < len(r.req.prompt)),
                         key=lambda r: (r.start_step, r.slot))
        seqs = [self._drafted(r) if r.pending == 1 and r.draft
                else Seq(r, [0] if r.pending else r.generated[r.fed:], True, False)
                for r in sorted(decode, key=lambda r: r.slot)]
        # A long prompt is chunked so decoding slots keep their pace; some prefill always runs.
        budget = max(self.cfg.step_tokens - sum(len(s.tokens) for s in seqs),
                     32 if prefill else 0)
        for r in prefill:
            if budget <= 0:
                break
            n = min(len(r.req.prompt) - r.prefilled, budget)
            chunk = r.req.prompt[r.prefilled:r.prefilled + n]
            seqs.append(Seq(r, chunk, r.prefilled + n == len(r.req.prompt), True))
            budget -= n
        return seqs

    def _drafted(self, r: Run) -> Seq:
        """The sequence of a decode row whose token is pending on the device: that token, and
        after it the row's draft where it may verify one (an accept-first row with room for
        the samples before max_tokens and the model's length)."""
        room = min(1 + self.cfg.draft_tokens, r.req.max_tokens - r.known,
                   self.cfg.max_model_len - r.prefilled - r.known)
        draft, r.draft = r.draft[:room], []
        if len(draft) < 2 or r.redo is not None or r.chained or not self._accept_first(r):
            return Seq(r, [0], True, False)
        return Seq(r, [0, *draft[1:]], True, False, draft)

    def _ends_by_length(self, r: Run) -> bool:
        return r.known >= r.req.max_tokens or r.prefilled + r.known >= self.cfg.max_model_len

    def _accept_first(self, r: Run) -> bool:
        """Whether r's next token is sampled unmasked first (see the module docstring),
        decided once per token."""
        if r.af_next is None:
            q = r.req
            r.af_next = (self.cfg.accept_first and q.matcher is not None and r.af_skip == 0
                         and q.top_k == 0 and q.top_p >= 1.0 and q.min_p == 0.0
                         and not q.logprobs and r.known >= q.min_tokens)
        return r.af_next

    def _accept_first_result(self, r: Run, refused: bool) -> None:
        """Back r (and the engine's average) off after a refusal, forward after an
        acceptance."""
        self._refusal_rate += (float(refused) - self._refusal_rate) / 32
        if refused:
            # A lone refusal costs the row one step and the batch nothing (`_refused`): the
            # row stays accept-first. Refused again before an acceptance: mask-first for 3,
            # 7, ... tokens.
            r.af_backoff = min(2 * r.af_backoff + 1, self.cfg.accept_first_max_backoff)
            r.af_skip = r.af_backoff if r.af_backoff > 1 else 0
        else:
            r.af_backoff //= 2

    def _execute(self, seqs: list[Seq]) -> torch.Tensor:
        """The forward of the step: (O, V) fp32 logits, one row per sequence (`Seq.out`), more
        for a row verifying drafts. Rows that sample for the first time get their fill-thread
        job submitted first, so it runs meanwhile. A row whose newest token is still on the
        device gets it there (no host round trip)."""
        fresh = [s.run for s in seqs if s.samples and s.run.req.matcher is not None
                 and s.run.prep is None and not s.run.pending and not s.run.chained
                 and not self._accept_first(s.run)]
        if fresh:
            self._submit(fresh)
        slots, starts = [s.run.slot for s in seqs], [s.run.kv_len for s in seqs]
        tokens = [s.tokens for s in seqs]
        feed = None
        if self._inflight is not None:
            rows = self._inflight.row_of
            dst, src, at = [], [], 0
            for s in seqs:
                if s.run.pending:  # one token, still on the device
                    dst.append(at)
                    src.append(rows[s.run.slot])
                at += len(s.tokens)
            if dst:
                feed = (self._inflight.tokens, dst, src)
        outputs, at = None, 0
        for s in seqs:
            s.out, at = at, at + s.outputs
        if at > len(seqs):
            outputs = [s.outputs for s in seqs]
        if self.graphs is not None and self.graphs.fits(sum(map(len, tokens)), at):
            logits = self.graphs.run(slots, starts, tokens, feed, outputs)  # (O, V) fp32
        else:
            batch = ForwardBatch.build(slots, starts, tokens, self.device,
                                       slot_attention=self.slot_attention, outputs=outputs)
            if feed is not None:
                feed_tokens(batch.input_ids, *feed)
            logits = self.model(batch)                                  # (O, V) fp32
        for s in seqs:
            if s.prefill:
                s.run.prefilled += len(s.tokens)
            else:
                s.run.fed += len(s.tokens)
        self.stats["row_forwards"] += sum(1 for s in seqs if not s.prefill)
        return logits

    def _sample(self, seqs: list[Seq], logits: torch.Tensor | None,
                t: dict[str, float]) -> _InFlight | None:
        """Mask and sample the step's sampling rows on the device; start the copy of their
        tokens to the host. First the rows' fill-thread jobs are waited for and their forced
        chains taken: a row with a chain does not sample now. Rows that ended while the
        forward ran are left out. Rows whose accept-first token the commit before last refused
        are sampled too, from their saved logits (`Run.redo`), after the step's own rows; those
        the last commit refused wait for the next sampling point (their fills run meanwhile,
        off the critical path), whatever the timing, so every rank samples them at the same
        step (I2/I3). A row that fed drafts samples at each of their positions when its pending
        token (committed since) was the draft's first guess, else only at the first."""
        live = [s.run for s in seqs if s.samples and self.runs.get(s.run.slot) is s.run
                and s.run.redo is None]
        redo = [r for r in self._redo if self.runs.get(r.slot) is r]
        self._redo, self._redo_next = self._redo_next, []
        t_wait = time.perf_counter()
        t["mask_fill"] = self._wait_jobs([r.job for r in live + redo])
        t_mask = time.perf_counter()
        t["mask_fill_exposed"] = t_mask - t_wait
        for r in {id(r): r for r in live + redo}.values():
            r.job = None  # done; `prep` keeps its results until the row samples
            if r.prep is not None and r.prep.chain:
                self._take_chain(r)
        keep, rows, ahead, expect = self._sampled_rows(seqs)
        redo = [r for r in redo if r.redo is not None and self.runs.get(r.slot) is r
                and r.fed == r.known]
        rows += redo
        if not rows:
            return None
        ahead += [0] * len(redo)
        if expect is not None:
            expect += [None] * len(redo)
        self._index.start()
        masked, af = [], []
        for j, r in enumerate(rows):
            if r.req.matcher is None:
                continue
            if self._accept_first(r):
                af.append(j)
            else:
                masked.append(j)
                r.af_skip = max(0, r.af_skip - 1)
        stale = [rows[j] for j in masked if rows[j].prep is None]
        if stale:  # not filled for its current state (its mode changed since its commit)
            self._submit(stale, forced=False)
            t["mask_fill"] += self._wait_jobs([r.job for r in stale])
        for r in rows:
            r.job = r.prep = None
            r.af_next = None
        if af:
            self.stats["accept_first"] += len(af)
            if self.metrics is not None:
                self.metrics.accept_first_sampled.inc(len(af))
        n = len(rows) - len(redo)
        self.stats["sampling_points"] += 1
        fused = self._fusable(rows, redo)
        if self.metrics is not None:
            self.metrics.sampling_path["fused" if fused else "op_by_op"].inc()
        if fused:
            self.stats["fused_points"] += 1
            wire, tokens, saved, flags, lp = self._sample_fused(logits, keep, rows, n, ahead,
                                                                masked, af, t)
            saved_rows = keep
        else:
            wire, tokens, saved, flags, lp = self._sample_unfused(logits, keep, rows, n, ahead,
                                                                  masked, af, t)
            saved_rows = None
        for r in rows[n:]:
            r.redo = None
        t_copy = time.perf_counter()
        # One device-to-host copy per step, started now and waited for at the commit.
        host, done = self._wire.put(wire)
        for r in rows:  # a row verifying drafts has a sample at each of its positions
            r.pending = 0
        for r in rows:
            r.pending += 1
        t["sample"] += time.perf_counter() - t_copy
        # A row's next forward reads its last sample (row_of): with drafts, the guess that
        # every draft holds, checked at the commit.
        return _InFlight(rows, tokens, host, done, self.step_index,
                         {r.slot: j for j, r in enumerate(rows)}, lp, frozenset(af), saved,
                         flags, expect, saved_rows,
                         self.graphs.calls if self.graphs is not None else 0)

    def _fusable(self, rows: list[Run], redo: list[Run]) -> bool:
        """Whether this sampling point runs as one fused pass (`_sample_fused`): on the device
        that allows it, when every row samples with temperature only (greedy included), none
        asks for logprobs or is under min_tokens, and the rows sampled again took the fused
        kernel's path at their first try (their flags say temperature only). Decided from the
        requests alone, so every rank decides alike (I3)."""
        if not self._fused_sampling:
            return False
        for r in rows:
            q = r.req
            if (q.top_k or q.top_p < 1.0 or q.min_p > 0.0 or q.logprobs
                    or r.known < q.min_tokens):
                return False
        return not redo or redo[0].redo[2].temperature_only

    def _sample_fused(self, logits, keep, rows, n, ahead, masked, af, t):
        """The sampling point as two kernels (gpu_worker.sampling.kernel.sample_rows): each row
        reads its logits row in place (the step's, or the saved ones of a row sampled again),
        the padded ids and a masked row's bitmask applied as it reads, Gumbel-max with the
        row's noise, and the commit's value (dead, non-finite, the forced-token note) written
        beside the token. The same tokens as `_sample_unfused` on this device: the score of
        every column is the one the unfused kernel computes from logits masked in place."""
        t0 = time.perf_counter()
        redo = rows[n:]
        mask_rows = [-1] * len(rows)
        bitmask = None
        if masked:
            bitmask = self.masks.stage_rows([rows[j].slot for j in masked])
            for i, j in enumerate(masked):
                mask_rows[j] = i
        t_sample = time.perf_counter()
        t["mask_apply"] = t_sample - t0
        reqs = [r.req for r in rows]
        ints, reals = self._index.blocks([keep + [r.redo[1] for r in redo], mask_rows,
                                          [q.seed for q in reqs],
                                          [r.known + a for r, a in zip(rows, ahead, strict=True)]],
                                         [[q.temperature for q in reqs]])
        temperature = reals[0]
        parts = [(logits, n)] if n else []
        if redo:  # all refused at one commit: one saved tensor
            parts.append((redo[0].redo[0], len(redo)))
        out = sample_rows(parts, temperature, ints[2], ints[3], src=ints[0],
                          mask_rows=ints[1] if masked else None, bitmask=bitmask,
                          vocab_size=self.vocab_size,
                          flag_single=bool(masked) and self.scan is not None)
        # The step's logits as the forward wrote them, kept for a refused row (`saved_rows`:
        # its row there is its `keep` entry). A graph's output buffer is overwritten by the
        # next replay, so this is a copy.
        saved = logits.clone() if af else None
        flags = _flags(rows[:n])
        t["sample"] = time.perf_counter() - t_sample
        return out[1], out[0], saved, flags, None

    def _sample_unfused(self, logits, keep, rows, n, ahead, masked, af, t):
        """The sampling point op by op: gather the sampled rows' logits (the step's, then the
        saved ones of rows sampled again), mask padded ids and the masked rows, sample, and
        derive the commit's value (dead, non-finite, the forced-token note) and logprobs."""
        redo = rows[n:]
        parts = []
        if keep:
            if len(keep) < logits.shape[0]:
                logits = logits.index_select(0, self._index(keep))
            parts.append(logits)
        if redo:  # all refused at one commit: one saved tensor
            saved = redo[0].redo[0]
            parts.append(saved.index_select(0, self._index([r.redo[1] for r in redo])))
        logits = (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()   # (R, V)
        if self.vocab_size < logits.shape[1]:
            logits[:, self.vocab_size:] = float("-inf")  # padded ids are no tokens
        t_mask = time.perf_counter()
        raw = self._unmasked(logits, rows)
        if masked:
            self.masks.apply(logits, masked, [rows[j].slot for j in masked])
        self._suppress_early_stop(logits, rows)
        saved = logits.clone() if af else None  # every row: one device copy, no index to send
        t_sample = time.perf_counter()
        t["mask_apply"] = t_sample - t_mask
        flags = None
        picked = []
        if n and redo and _flags(rows[:n]) == redo[0].redo[2]:
            # The step's rows take the path the refused rows took at their first try: one
            # call (redo rows are temperature-only, so the flags of all rows are these too).
            batch = self._sampling_batch(rows, ahead)
            flags = batch.flags
            picked.append(sample(logits, batch))
        else:
            if n:
                batch = self._sampling_batch(rows[:n], ahead[:n])
                flags = batch.flags
                picked.append(sample(logits[:n], batch))
            if redo:
                # The sampler path of their first try (the fused and the PyTorch path may
                # differ in the last bit of the noise).
                picked.append(sample(logits[n:], replace(self._sampling_batch(redo),
                                                         flags=redo[0].redo[2])))
        tokens, dead = picked[0] if len(picked) == 1 else map(torch.cat, zip(*picked, strict=True))
        # A NaN or +inf logit among the tokens a row may take is the model's failure, not
        # the grammar's: such a row is -2, a row with nothing allowed (a dead end) -1.
        broken = ~(logits < float("inf")).all(dim=-1)                    # (R,) NaN or +inf
        picked = torch.where(broken, NONFINITE, torch.where(dead, DEAD, tokens))
        lp = self._logprobs(logits, tokens, rows, raw)
        wire = picked
        if masked and self.scan is not None:  # rows whose token was the only one allowed
            wire = torch.where(single_allowed(logits) & (picked >= 0), picked + SINGLE, picked)
        t["sample"] = time.perf_counter() - t_sample
        return wire, picked.clamp(min=0), saved, flags, lp

    def _sampled_rows(self, seqs: list[Seq]):
        """The step's logit rows that sample (`keep`), the row of each, its position after
        the row's pending token (`ahead`: its noise index is the row's `known` plus that, as
        one step at a time would give it), and for each the drafted token it must equal for
        the row's next sample to count (None where no row verifies drafts).

        A row that took forced tokens samples nothing now (they feed its next forward). A row
        that fed drafts samples at every position when the token it fed first (committed
        since) is the draft's first guess; otherwise the keys and values written after that
        token are void and it samples once."""
        keep, rows, ahead, expect = [], [], [], []
        verifying = False
        for s in seqs:
            r = s.run
            if not s.samples or self.runs.get(r.slot) is not r or r.redo is not None:
                continue
            n = len(s.draft)
            if n > 1 and r.fed == r.known + n - 1:
                if r.generated[-1] == s.draft[0]:
                    keep.extend(range(s.out, s.out + n))
                    rows.extend([r] * n)
                    ahead.extend(range(n))
                    expect.extend([*s.draft[1:], None])
                    verifying = True
                    self.stats["drafted"] += n - 1
                    if self.metrics is not None:
                        self.metrics.drafted_tokens.inc(n - 1)
                    continue
                r.fed -= n - 1
            if r.fed == r.known:
                keep.append(s.out)
                rows.append(r)
                ahead.append(0)
                expect.append(None)
        return keep, rows, ahead, expect if verifying else None

    def _wait_jobs(self, jobs) -> float:
        """Wait for fill-thread jobs (None entries skipped); their fill seconds, summed. The
        thread runs jobs in order, so a row's newest job finishes last."""
        seconds = 0.0
        for job in dict.fromkeys(j for j in jobs if j is not None):
            spent, fills, rounds = job.result()
            seconds += spent
            self.stats["mask_fills"] += fills
            self.stats["chain_rounds"] += rounds
            if self.metrics is not None and fills:
                self.metrics.mask_fills.inc(fills)
                if rounds:
                    self.metrics.forced_chain_rounds.inc(rounds)
        return seconds

    def _unmasked(self, logits: torch.Tensor, rows: list[Run]) -> torch.Tensor | None:
        """A copy of the rows asking for unconstrained logprobs, in row order, taken before
        the grammar's mask (and the min_tokens suppression) is applied: (U, V), padded ids
        -inf. None when no row asks, and on a follower rank (it sends no logprobs)."""
        if self.publish is None:
            return None
        unc = [j for j, r in enumerate(rows) if r.req.unconstrained_logprobs]
        if not unc:
            return None
        return logits.index_select(0, self._index(unc))                # (U, V), a copy

    def _logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, rows: list[Run],
                  raw: torch.Tensor | None = None):
        """Log-probabilities of the rows that asked, the sampled token's and the top-k, at
        temperature 1, copied to the host with the tokens: of `logits` as masked, or, for
        the rows asking for unconstrained logprobs, of their unmasked copy `raw`
        (`_unmasked`). The token was sampled from `logits` either way."""
        if self.publish is None:  # a follower rank sends no tokens, so no logprobs either
            return None
        asked = [j for j, r in enumerate(rows) if r.req.logprobs]
        if not asked:
            return None
        k = max(rows[j].req.top_logprobs for j in asked)
        idx = self._index(asked)
        sub = logits.index_select(0, idx)                               # (L, V) masked
        if raw is not None:  # the unconstrained rows' own logits replace their masked ones
            at = [n for n, j in enumerate(asked) if rows[j].req.unconstrained_logprobs]
            sub.index_copy_(0, self._index(at), raw)                    # (L, V)
        lse = torch.logsumexp(sub, dim=-1, keepdim=True)                # (L, 1)
        values = sub.gather(1, tokens.index_select(0, idx)[:, None])    # (L, 1)
        ids = torch.empty((len(asked), 0), dtype=torch.int64, device=logits.device)
        if k:
            top_v, ids = sub.topk(k, dim=-1)                            # (L, k), sorted
            values = torch.cat([values, top_v], dim=1)
        values = values - lse                                           # (L, 1 + k)
        pin = logits.is_cuda
        values_host = torch.empty(values.shape, dtype=values.dtype, pin_memory=pin)
        ids_host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pin)
        values_host.copy_(values, non_blocking=True)
        ids_host.copy_(ids, non_blocking=True)
        return asked, values_host, ids_host

    def _commit(self, inflight: _InFlight, t: dict[str, float]) -> list[Run]:
        """The host side of a sampled step: check divergence, accept each token into the
        rank's own matcher (a refused accept-first token is sampled again at the next
        sampling point), finish rows. Returns the rows that go on mask-first (their fills
        are the step's next job)."""
        t0 = time.perf_counter()
        if inflight.done is not None:
            inflight.done.synchronize()
            t["device_wait"] = time.perf_counter() - t0
            if self.graphs is not None:
                self.graphs.done_through(inflight.graph_calls)
        picked = inflight.host.tolist()
        single = [False] * len(picked)
        if self.scan is not None:  # only then does `_sample` add the forced-token flag
            single = [v >= SINGLE for v in picked]
            picked = [v - SINGLE if one else v for v, one in zip(picked, single, strict=True)]
        rows = inflight.rows
        for r in rows:
            r.pending = 0
        diverged: set[int] = set()
        every = self.cfg.divergence_check_every
        if every and self.control.size > 1 and inflight.step % every == 0:
            # A dead row is sent as -1, so a dead row on one rank never matches a real
            # token 0 on another.
            diverged = set(diverged_rows(picked, self.control))
            if diverged and self.metrics is not None:
                self.metrics.tp_divergence.inc()
        lp = _logprob_rows(inflight)
        expect = inflight.expect
        forced = kept = 0
        cut: set[int] = set()  # rows whose later samples do not count
        for j, r in enumerate(rows):
            # Released while its token was in flight, or its earlier sample ended it.
            if self.runs.get(r.slot) is not r or id(r) in cut:
                continue
            if not self._advance(r, picked[j], j in diverged, lp.get(j),
                                 j in inflight.accept_first):
                self._refused(r, inflight, j)
                cut.add(id(r))
            elif single[j]:
                r.forced_run += 1
                forced += 1
            else:
                r.forced_run = 0
            if expect is not None and expect[j] is not None and id(r) not in cut:
                if picked[j] == expect[j]:
                    kept += 1
                else:
                    # The draft after this sample was wrong: the samples after it and the
                    # forward launched since (it fed the last) are void; the row feeds this
                    # sample next.
                    cut.add(id(r))
                    if self.runs.get(r.slot) is r:
                        r.fed = len(r.generated) - 1
        if self.drafts is not None:
            self._learn(rows, inflight)
        if kept:
            self.stats["draft_accepted"] += kept
            if self.metrics is not None:
                self.metrics.draft_accepted.inc(kept)
        if forced:
            self.stats["forced_tokens"] += forced
            if self.metrics is not None:
                self.metrics.forced_tokens.inc(forced)
        t["commit"] = time.perf_counter() - t0
        return [r for r in {id(r): r for r in rows}.values() if r.req.matcher is not None
                and self.runs.get(r.slot) is r and not self._accept_first(r)]

    def _refused(self, r: Run, inflight: _InFlight, j: int) -> None:
        """Row j's accept-first token was refused by its grammar: back off, and sample it
        again one sampling point later (its fill is submitted now, in a job of its own),
        masked, from the logits saved at its try, with the same noise (same seed and token
        index) and sampler path: the token mask-first sampling gives. Its input in the
        forward already launched is rewritten at its next feed; it sits out the forward
        between (it has no new token), so the row loses one step and the batch none."""
        self.stats["resamples"] += 1
        if self.metrics is not None:
            self.metrics.resamples.inc()
        self._accept_first_result(r, refused=True)
        r.fed = min(r.fed, len(r.generated))
        at = j if inflight.saved_rows is None else inflight.saved_rows[j]
        r.redo = (inflight.saved, at, inflight.flags)
        r.af_next = False  # the token is sampled again masked, whatever the backoff says
        self._redo_next.append(r)

    def _learn(self, rows: list[Run], inflight: _InFlight) -> None:
        """After a commit: the draft tables learn the committed tokens of the guided rows, and
        each row still running guesses its next tokens (`Run.draft`), unless it is verifying
        drafts in the forward launched since (its next sample is then not the one after
        this commit's tokens), or backed off to mask-first (it would not draft: a model that
        does not follow the grammar pays for the tables' filling alone)."""
        seen = set()
        for r in rows:
            if id(r) in seen or r.req.grammar is None:
                continue
            seen.add(id(r))
            key = r.req.grammar.key
            self.drafts.observe(key, r.generated, r.observed)
            r.observed = len(r.generated)
            if self.runs.get(r.slot) is r and r.fed <= len(r.generated) and r.af_skip == 0:
                r.draft = self.drafts.propose(key, r.generated, 1 + self.cfg.draft_tokens)

    def _submit(self, runs: list[Run], forced: bool = True) -> None:
        """Start the fill-thread job of `runs` (gpu_worker.guided.forced.prepare): fill their
        bitmask rows, and follow the chain of forced tokens of the rows whose output ends
        with two or more (`Run.forced_run`; unless `forced` is False or the engine takes
        none). A row asking for unconstrained logprobs takes none (a budget of 0): it samples
        every token, so each has the model's logits at its own position.

        A released slot's pending job may still write its row; its next tenant's job is
        submitted later and so runs later, and is waited for before that row is used."""
        if not runs:
            return
        jobs = []
        for r in runs:
            budget = 0
            if forced and r.forced_run > 1 and not r.req.unconstrained_logprobs:
                budget = max(0, min(r.req.max_tokens - r.known,
                                    self.cfg.max_model_len - r.prefilled - r.known))
            jobs.append(RowJob(r.req.matcher, r.slot, budget, r.stops, after_forced=r.chained))
        scan = self.scan if forced and any(j.budget for j in jobs) else None
        future = self._fill_pool.submit(prepare, self.masks, scan, jobs, self.chain_rounds)
        for r, job in zip(runs, jobs, strict=True):
            r.job, r.prep, r.chained = future, job, False

    def _advance(self, r: Run, token: int, diverged: bool, logprob=None,
                 accept_first: bool = False) -> bool:
        """Take row r's sampled token (-1: the row had no allowed token) and, when the
        request asked, its (logprob, top ids, top logprobs). False only for an accept-first
        token the grammar refused (the row is then resampled)."""
        req = r.req
        if diverged:
            log.error("TP divergence on slot %d (request %s)", r.slot, req.request_id)
            self._finish(r, DIVERGENCE, "ranks sampled different tokens")
            return True
        if token == NONFINITE:
            if self.metrics is not None:
                self.metrics.nonfinite_logits.inc()
            self._finish(r, INTERNAL, "the model produced NaN or infinite logits for this "
                                      "request")
            return True
        if token < 0:
            if self.metrics is not None:
                self.metrics.grammar_dead_ends.inc()
            self._finish(r, DEAD_END, "the grammar allows no token here and is not complete")
            return True
        if req.matcher is not None and not req.matcher.accept_token(token):
            if accept_first:
                return False
            self._finish(r, INTERNAL, f"the grammar rejected sampled token {token}")
            return True
        if accept_first:
            self._accept_first_result(r, refused=False)
        self._take(r, token, logprob)
        return True

    def _take_chain(self, r: Run) -> None:
        """Emit the forced tokens r's job accepted into its matcher (log-probability 0: the
        only token the masked distribution allows), in place of sampling; the next plan feeds
        them. Where the job did not fill r's mask after them, r's next fill joins the next
        batch (`chained`). A row to be sampled again (`redo`) takes its chain instead: the
        chain's first token is that token. Never a row asking for unconstrained logprobs: its
        jobs take no forced tokens (`_submit`)."""
        job = r.prep
        chain, job.chain = job.chain, []
        r.redo = None
        r.forced_run += len(chain)
        self.stats["forced_tokens"] += len(chain)
        self.stats["chain_tokens"] += len(chain)  # taken without sampling
        self.stats["chains"] += 1
        if self.metrics is not None:
            self.metrics.forced_tokens.inc(len(chain))
            self.metrics.forced_chains.inc()
        top = r.req.top_logprobs > 0
        for n, token in enumerate(chain, 1):
            if self.runs.get(r.slot) is not r:
                return
            # The matcher is past the whole chain (no job runs on it now): only the last
            # token is checked against it (a chain stops where the grammar could be complete).
            self._take(r, token, (0.0, [token] if top else [], [0.0] if top else [])
                       if r.req.logprobs else None, grammar_ends=n == len(chain))
        if self.runs.get(r.slot) is r and not job.filled:
            r.prep, r.chained = None, True

    def _take(self, r: Run, token: int, logprob=None, grammar_ends: bool = True) -> None:
        """Append an accepted token to r's output; finish r where it ends (by its grammar
        too, unless `grammar_ends` is False)."""
        req = r.req
        r.generated.append(token)
        r.draft = []  # a guess of what follows the output before this token
        if r.first_token_at is None:
            r.first_token_at = time.monotonic()
        self._generated_now += 1
        ends = token in req.stop_token_ids or (
            token in self.eos and (req.matcher is not None or not req.ignore_eos))
        if not ends:
            r.emitted += 1
            out = self._output(req)
            out.tokens.append(token)
            if logprob is not None:
                out.logprobs.append(logprob)
        # A matcher terminates only by accepting a stop token (xgrammar's default; our
        # llguidance matcher records it the same way).
        if req.matcher is not None and grammar_ends and (
                (token in r.stops and req.matcher.is_terminated()) or self._can_only_end(r)):
            return self._finish(r, GRAMMAR_COMPLETED)
        if ends:  # a guided row only samples a stop id where its grammar allows one
            return self._finish(r, STOP)
        if self._ends_by_length(r):
            return self._finish(r, LENGTH)

    def _can_only_end(self, r: Run) -> bool:
        """The grammar is complete and allows no token but a stop token: the output is done,
        and sampling once more could only pick the end. Checked only once complete."""
        req = r.req
        if not req.matcher.is_completed():
            return False
        # llguidance knows when only EOS may follow (each matcher's stop ids are its EOS ids,
        # all in r.stops): no mask to fill at the end of nearly every output.
        stopped = getattr(req.matcher, "is_stopped", None)
        if stopped is not None and stopped():
            return True
        row = self._end_row
        req.matcher.fill_next_token_bitmask(row, 0)
        words = row[0].numpy().view(np.uint32)  # a view of the scratch row: no list
        for tok in r.stops:
            if tok < self.vocab_size:
                words[tok >> 5] &= np.uint32(~(1 << (tok & 31)) & 0xFFFFFFFF)
        full, rest = divmod(self.vocab_size, 32)
        if rest and int(words[full]) & ((1 << rest) - 1):
            return False
        return not words[:full].any()

    def _output(self, req: Request) -> RowOutput:
        out = self._outputs.get(id(req))
        if out is None:
            out = self._outputs[id(req)] = RowOutput(req)
        return out

    def _finish(self, r: Run, reason: str, message: str = "", table_done: bool = False,
                code: int = 0) -> None:
        del self.runs[r.slot]
        if not table_done:
            self.table.finish(r.entry)
        r.req.close()
        if self.metrics is not None:
            self.metrics.releases.labels(reason=reason).inc()
        self._output(r.req).finish = Finish(
            reason, message, r.emitted, r.started_at - r.req.admitted_at,
            (r.first_token_at - r.req.admitted_at) if r.first_token_at else 0.0, code)

    def _flush(self) -> None:
        """Count this step's tokens; hand its outputs to `publish` (rank 0) in one call."""
        if self._generated_now:
            if self._generated is not None:
                self._generated.inc(self._generated_now)
            self._generated_now = 0
        if not self._outputs:
            return
        outputs, self._outputs = list(self._outputs.values()), {}
        if self.publish is not None:
            self.publish(outputs)

    def _fail_all(self, reason: str, message: str) -> None:
        for r in list(self.runs.values()):
            self._finish(r, reason, message, table_done=True, code=_UNAVAILABLE_CODE)
        for entry in self.table.drain():
            entry.payload.close()

    # ---- helpers ---------------------------------------------------------------------------

    def _sampling_batch(self, rows: list[Run], ahead: list[int] | None = None) -> SamplingBatch:
        """The sampling parameters of `rows`; each samples its token number `known` (plus
        `ahead[j]` for a position after a drafted token)."""
        reqs = [r.req for r in rows]
        steps = [r.known for r in rows] if ahead is None else [
            r.known + a for r, a in zip(rows, ahead, strict=True)]
        return SamplingBatch.from_lists(
            [q.temperature for q in reqs], [q.top_k for q in reqs], [q.top_p for q in reqs],
            [q.min_p for q in reqs], [q.seed for q in reqs], steps, device=self.device,
            stage=self._index.blocks)

    def _suppress_early_stop(self, logits: torch.Tensor, rows: list[Run]) -> None:
        """EOS and stop ids are not sampled before min_tokens, unless the grammar allows
        nothing else (then suppressing them would make a dead end of a complete output)."""
        for j, r in enumerate(rows):
            if r.known >= r.req.min_tokens:
                continue
            ids = sorted(i for i in (self.eos | r.req.stop_token_ids) if i < logits.shape[1])
            if not ids:
                continue
            idx = torch.tensor(ids, device=logits.device)
            saved = logits[j, idx].clone()
            logits[j, idx] = float("-inf")
            if r.req.matcher is not None and not torch.isfinite(logits[j]).any():
                logits[j, idx] = saved

    def _update_gauges(self) -> None:
        if self.metrics is None:
            return
        self.metrics.slots_in_use.set(self.table.in_use())
        self.metrics.guided_slots.set(sum(1 for r in self.runs.values() if r.req.matcher is not None))

    def _record(self, seqs: list[Seq], t: dict[str, float], total: float) -> None:
        t["total"] = total
        self.last_step_timings = t
        if self.metrics is None:
            return
        kinds = {s.prefill for s in seqs}
        phase = "mixed" if len(kinds) == 2 else ("prefill" if True in kinds else "decode")
        m = self.metrics
        m.step_seconds.labels(phase=phase).observe(total)
        m.batch_size.observe(len(seqs))
        prompt_tokens = sum(len(s.tokens) for s in seqs if s.prefill)
        if prompt_tokens:
            m.tokens.labels(kind="prompt").inc(prompt_tokens)
        m.row_forwards.inc(sum(1 for s in seqs if not s.prefill))
        if t.get("mask_fill"):
            m.mask_fill_seconds.observe(t["mask_fill"])
            m.mask_fill_exposed_seconds.observe(t["mask_fill_exposed"])
        if "mask_apply" in t:
            m.mask_apply_seconds.observe(t["mask_apply"])
        if "device_wait" in t:
            m.device_wait_seconds.observe(t["device_wait"])
        m.step_cpu_seconds.observe(t["cpu"])
