"""`SamplingParams` checked once, with its defaults applied: the typed form every service uses.

The gateway checks a client's request with `Sampling.from_proto` and the worker checks the
Admit it receives with the same function, so the rules (and the field names in the errors)
live here only. Plain Python: importing it needs neither torch nor a server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos import common_pb2
from protos.rpc import InvalidArgument

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20
# Logprobs modes (common.proto LogprobsMode), by the names the HTTP API and the client use.
CONSTRAINED, UNCONSTRAINED = "constrained", "unconstrained"
LOGPROBS_MODES = {common_pb2.LOGPROBS_MODE_CONSTRAINED: CONSTRAINED,
                  common_pb2.LOGPROBS_MODE_UNCONSTRAINED: UNCONSTRAINED}


@dataclass(frozen=True)
class Sampling:
    """Sampling of one request; see protos/common.proto `SamplingParams` for each field.

    `seed` is the uint64 the client gave (None: not given); `seed_int64` is the same 64 bits
    as a signed value, which is what the sampler's noise hash reads.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    logprobs_mode: str = CONSTRAINED  # a value of LOGPROBS_MODES

    @property
    def seed_int64(self) -> int:
        seed = self.seed or 0
        return seed - (1 << 64) if seed >= 1 << 63 else seed

    @classmethod
    def from_proto(cls, s, *, vocab_size: int) -> Sampling:
        """Check `s` (a common_pb2.SamplingParams); raise InvalidArgument naming the first bad
        `sampling.*` field. `vocab_size` bounds stop_token_ids."""
        def bad(name: str, why: str):
            raise InvalidArgument(why, field=f"sampling.{name}")

        max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        temperature = s.temperature if s.HasField("temperature") else 1.0
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if max_tokens < 1:
            bad("max_tokens", f"must be >= 1, got {max_tokens}")
        if not (math.isfinite(temperature) and temperature >= 0):
            bad("temperature", f"must be finite and >= 0, got {temperature}")
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            bad("top_p", f"must be in (0, 1], got {top_p}")
        if s.top_k < 0:
            bad("top_k", f"must be >= 0, got {s.top_k}")
        if not (math.isfinite(s.min_p) and 0 <= s.min_p <= 1):
            bad("min_p", f"must be in [0, 1], got {s.min_p}")
        if s.min_tokens < 0:
            bad("min_tokens", f"must be >= 0, got {s.min_tokens}")
        if s.min_tokens > max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({max_tokens}), got {s.min_tokens}")
        if len(s.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
        for i, stop in enumerate(s.stop):
            if not stop or len(stop) > MAX_STOP_CHARS:
                bad(f"stop[{i}]", f"must be 1 to {MAX_STOP_CHARS} characters")
        for i, tok in enumerate(s.stop_token_ids):
            if tok >= vocab_size:
                bad(f"stop_token_ids[{i}]",
                    f"token id {tok} is outside the vocabulary (size {vocab_size})")
        if not 0 <= s.top_logprobs <= MAX_TOP_LOGPROBS:
            bad("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {s.top_logprobs}")
        if s.top_logprobs and not s.logprobs:
            bad("top_logprobs", "needs sampling.logprobs")
        mode = LOGPROBS_MODES.get(s.logprobs_mode)
        if mode is None:  # proto3 enums are open: an unknown number parses
            bad("logprobs_mode", f"unknown mode {s.logprobs_mode}")
        if mode != CONSTRAINED and not s.logprobs:
            bad("logprobs_mode", "needs sampling.logprobs")
        return cls(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=s.top_k,
                   min_p=s.min_p, seed=s.seed if s.HasField("seed") else None,
                   stop=tuple(s.stop), stop_token_ids=frozenset(s.stop_token_ids),
                   ignore_eos=s.ignore_eos, min_tokens=s.min_tokens,
                   include_stop_str_in_output=s.include_stop_str_in_output,
                   logprobs=s.logprobs, top_logprobs=s.top_logprobs, logprobs_mode=mode)
