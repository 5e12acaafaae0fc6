"""Sampling of one token per row from (masked) logits, deterministic per request.

The same request (seed) gets the same tokens whatever else is in the batch, whichever row it
is in, and on every tensor-parallel rank (I3): there is no generator shared by the batch.
The noise of token j at step s of a request with seed k is a pure function
u = hash(k, s, j) in (0, 1), and a row samples by the exponential race (Gumbel-max):
argmax(logits / T - log(-log(u))), which draws from softmax(logits / T). Every operation is
row-wise, so rows cannot influence each other.

Filters run in the order temperature -> top-k -> top-p -> min-p, each as a -inf mask. The
sort behind top-k/top-p runs only when some row uses one of them; whether any row does is
known on the host (SamplingFlags), so sampling never waits on the device to decide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gpu_worker.sampling.noise import uniform_noise

_MIN_TEMPERATURE = 1e-6  # dividing by smaller values could overflow float32 logits to inf


@dataclass(frozen=True)
class SamplingFlags:
    """Host-side summary of a batch's parameters: which code paths sampling needs."""

    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @property
    def temperature_only(self) -> bool:
        """No row filters by top-k, top-p or min-p (the fused kernels' path)."""
        return not (self.any_top_k or self.any_top_p or self.any_min_p)

    @classmethod
    def of(cls, temperature, top_k, top_p, min_p) -> SamplingFlags:
        """The flags of a batch with these per-row values (sequences)."""
        return cls(all(t == 0 for t in temperature), any(k > 0 for k in top_k),
                   any(p < 1 for p in top_p), any(p > 0 for p in min_p))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling parameters, tensors of shape (B,) on the logits' device.

    temperature float32 (0 = greedy), top_k int32 (0 = off), top_p float32 (1 = off),
    min_p float32 (0 = off), seed int64 (per request), step int64 (index of the token being
    sampled within its request, 0 for the first). `flags` summarises them on the host; when
    None it is computed from the tensors at construction (one device sync on a GPU: prefer
    `from_lists`, which needs none). Raises ValueError naming the field for a bad shape,
    dtype, device or value.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    step: torch.Tensor
    flags: SamplingFlags | None = None

    def __post_init__(self):
        dtypes = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
                  "min_p": torch.float32, "seed": torch.int64, "step": torch.int64}
        n_rows, device = self.temperature.shape, self.temperature.device
        for name, dtype in dtypes.items():
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != dtype:
                raise ValueError(f"{name}: expected a 1-D {dtype} tensor")
            if value.shape != n_rows or value.device != device:
                raise ValueError(f"{name}: shape {tuple(value.shape)} on {value.device}, but "
                                 f"temperature is {tuple(n_rows)} on {device}")
        if self.flags is None:
            object.__setattr__(self, "flags", self._flags_from_tensors())

    def _flags_from_tensors(self) -> SamplingFlags:
        if self.temperature.numel() == 0:
            return SamplingFlags(True, False, False, False)
        summary = torch.stack([  # one transfer for every check
            (self.temperature < 0).any(), (self.top_k < 0).any(),
            ((self.top_p <= 0) | (self.top_p > 1)).any(),
            ((self.min_p < 0) | (self.min_p > 1)).any(),
            (self.temperature == 0).all(), (self.top_k > 0).any(), (self.top_p < 1).any(),
            (self.min_p > 0).any()]).tolist()
        for bad, name, rule in zip(summary[:4], ("temperature", "top_k", "top_p", "min_p"),
                                   (">= 0", ">= 0", "in (0, 1]", "in [0, 1]"), strict=True):
            if bad:
                raise ValueError(f"{name}: every value must be {rule}")
        return SamplingFlags(*summary[4:])

    @classmethod
    def from_lists(cls, temperature, top_k, top_p, min_p, seed, step,
                   device: torch.device | str = "cpu", stage=None) -> SamplingBatch:
        """Build a batch from per-row Python sequences, checking values on the host (no device
        sync). Raises ValueError naming the field. `stage(int_columns, float_columns)`, when
        given, turns equal-length columns into a (k, n) int64 and an (m, n) float32 tensor on
        `device` (the engine's staged pinned buffer: one copy, no pinned allocation per
        step)."""
        columns = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                   "seed": seed, "step": step}
        n_rows = len(temperature)
        for name, values in columns.items():
            if len(values) != n_rows:
                raise ValueError(f"{name}: {len(values)} values for {n_rows} rows")
        for name, ok, rule in (("temperature", lambda v: v >= 0, ">= 0"),
                               ("top_k", lambda v: v >= 0, ">= 0"),
                               ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
                               ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]")):
            if not all(ok(v) for v in columns[name]):
                raise ValueError(f"{name}: every value must be {rule}")
        flags = SamplingFlags.of(temperature, top_k, top_p, min_p)
        # Two packed tensors, so a step costs one or two non-blocking copies instead of six
        # pageable ones: staged, or made here (pinned for a GPU, from PyTorch's caching host
        # allocator).
        float_rows = [list(temperature), list(top_p), list(min_p)]
        int_rows = [list(top_k), list(seed), list(step)]
        if stage is not None:
            ints, floats = stage(int_rows, float_rows)
        else:
            floats = torch.tensor(float_rows, dtype=torch.float32)
            ints = torch.tensor(int_rows, dtype=torch.int64)
            if torch.device(device).type == "cuda":
                floats = floats.pin_memory().to(device, non_blocking=True)
                ints = ints.pin_memory().to(device, non_blocking=True)
        tensors = {"temperature": floats[0], "top_p": floats[1], "min_p": floats[2],
                   "top_k": ints[0].to(torch.int32), "seed": ints[1], "step": ints[2]}
        return cls(**tensors, flags=flags)

    def to(self, device: torch.device | str) -> SamplingBatch:
        """The same batch on `device` (flags kept, no sync)."""
        return replace(self, **{name: getattr(self, name).to(device, non_blocking=True)
                                for name in ("temperature", "top_k", "top_p", "min_p", "seed",
                                             "step")})


def _top_k_top_p_keep(scaled: torch.Tensor, params: SamplingBatch) -> torch.Tensor:
    # (B, V) bool: tokens that survive top-k then top-p. One stable sort, so ties keep the
    # lower token id first and the result is deterministic.
    n_cols = scaled.shape[1]
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)  # (B, V)
    position = torch.arange(n_cols, device=scaled.device)
    k = torch.where(params.top_k > 0, params.top_k.long().clamp(max=n_cols), n_cols)  # (B,)
    keep_sorted = position[None, :] < k[:, None]
    ordered = ordered.masked_fill(~keep_sorted, float("-inf"))
    probs = torch.softmax(ordered, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better-ranked tokens
    keep_sorted &= (mass_before < params.top_p[:, None]) | (params.top_p[:, None] >= 1)
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def sample(logits: torch.Tensor, params: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: (token ids (B,) int64, dead (B,) bool). Does not change `logits`.

    logits: (B, V) float32, -inf for masked tokens. Greedy rows (temperature 0) take the
    argmax (the first index on ties). dead[i] means row i had no finite logit (all masked, or
    NaN): its token is 0 and must be ignored; no NaN reaches any other row.
    Raises ValueError naming the argument for a bad shape, dtype or device.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError("logits: expected a 2-D tensor (batch, vocab)")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits: dtype must be float32, got {logits.dtype}")
    if logits.shape[0] != params.temperature.shape[0] or logits.shape[1] == 0:
        raise ValueError(f"logits: shape {tuple(logits.shape)} does not fit "
                         f"{params.temperature.shape[0]} rows of parameters")
    if logits.device != params.temperature.device:
        raise ValueError(f"params: on {params.temperature.device}, logits on {logits.device}")
    best, greedy = logits.max(dim=-1)  # (B,), first index of the maximum
    dead = ~(best > float("-inf"))  # also true for NaN
    if params.flags.all_greedy:
        return greedy.masked_fill(dead, 0), dead
    flags = params.flags
    if logits.is_cuda and flags.temperature_only:
        # One fused pass instead of ~20 elementwise passes over (B, V) int64 noise.
        from gpu_worker.sampling.kernel import gumbel_argmax

        tokens = gumbel_argmax(logits, params.temperature, params.seed, params.step)
        return tokens.masked_fill(dead, 0), dead
    # Dead rows are zeroed so that their softmax stays finite; their result is discarded.
    safe = logits.masked_fill(dead[:, None], 0.0)
    temperature = params.temperature.clamp(min=_MIN_TEMPERATURE)[:, None]  # (B, 1)
    scaled = safe / temperature  # (B, V)
    if params.flags.any_top_k or params.flags.any_top_p:
        scaled = scaled.masked_fill(~_top_k_top_p_keep(scaled, params), float("-inf"))
    if params.flags.any_min_p:
        # p / p_max >= min_p  <=>  scaled >= max(scaled) + log(min_p); log(0) = -inf keeps all.
        floor = scaled.amax(dim=-1, keepdim=True) + params.min_p.log()[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    # Exponential race: argmax(scaled - log(-log u)); in place on the fresh noise tensor.
    race = uniform_noise(params.seed, params.step, logits.shape[1]).log_().neg_().log_()
    sampled = torch.sub(scaled, race, out=race).argmax(dim=-1)
    tokens = torch.where(params.temperature == 0, greedy, sampled)
    return tokens.masked_fill(dead, 0), dead
