"""The grammar backends, xgrammar and llguidance, behind one interface.

A backend turns a canonical spec into a compiled grammar, writes it to bytes for the cache
and the ranks, reads those bytes back against the rank's vocabulary, and makes matchers.
Every matcher has the methods the engine and `gpu_worker.guided.masks` call:

    fill_next_token_bitmask(bitmask, index=0)  write row `index` of an int32 (rows, words)
                                               bitmask; bit i of word i // 32 allows token i
    accept_token(token_id) -> bool             advance; False (state unchanged) if refused
    is_terminated() -> bool                    a stop token was accepted
    is_completed() -> bool                     the text so far is complete: a stop token
                                               may come next (xgrammar's name)
    rollback(n), reset()

xgrammar's own `GrammarMatcher` already has them (and stays unwrapped, so
`xgrammar.BatchGrammarMatcher` can fill many rows at once); `LLGuidanceMatcher` gives
llguidance's `LLMatcher` the same shape. Both write the same packed layout, so the mask
kernel does not know which backend filled a row.

Serialised forms. xgrammar: `CompiledGrammar.serialize_json()`, deserialised against the
rank's TokenizerInfo. llguidance compiles in about a millisecond (lexer and parser are built
lazily, per matcher state), so its serialised form is its normalised grammar (the JSON
grammar `LLMatcher.grammar_from_*` returns, which embeds the schema, regex or Lark text and
the options) in a small JSON envelope; each rank builds the matcher itself, once per
grammar, and every slot gets a `deep_copy` of it (about 1 µs). Measured (default model, 4k
vocabulary, one thread, medians; service: compile + serialise; rank: deserialise + matcher +
first mask):

    schema             xgrammar service / rank / bytes     llguidance service / rank / bytes
    2 properties       3.0 ms / 1.3 ms / 66 kB             0.30 ms / 0.56 ms / 0.4 kB
    20 properties      309 ms / 124 ms / 5.9 MB            0.74 ms / 1.06 ms / 1.5 kB

So for llguidance, building on the rank from the small text is cheaper than fetching any
compiled form could be. Building both backends for a vocabulary: ~15 ms at 4k tokens.

A compiled object only pairs with the backend that made it: `new_matcher` refuses another
backend's object, and a payload names its format so one backend never reads the other's.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import threading
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import xgrammar as xgr

from grammar_service.property_order import (
    any_order_grammar,
    embedded_schemas,
    whitespace_regex,
)
from grammar_service.schema_fixes import (
    fix_schema,
    fix_schema_llguidance,
    forbid_unlisted_properties,
    llguidance_fix_applies,
    without_ignored,
)

XGRAMMAR = "xgrammar"
LLGUIDANCE = "llguidance"
BACKENDS = (XGRAMMAR, LLGUIDANCE)

VERSIONS = {XGRAMMAR: importlib.metadata.version("xgrammar"),
            LLGUIDANCE: importlib.metadata.version("llguidance")}

_LLG_FORMAT = "gramserve-llguidance/1"
_XGR_SPEC_FORMAT = "gramserve-xgrammar-spec/1"
# What a rank pays per byte of xgrammar's serialised form to fetch and deserialise it, and
# how much faster than compiling that must be for the serialised form to travel (else the
# spec does and each rank compiles it; see XGrammarBackend.serialize). Measured with
# bench/grammar_cache.py on this project's 2-core machine, one thread: deserialize_json
# 21-35 ns per byte at 4k and 150k vocabularies, serialize_json about twice that.
RANK_SECONDS_PER_BYTE = 40e-9
CACHE_SPEEDUP = 4.0
# xgrammar's max_whitespace_cnt as an llguidance whitespace lexeme (JSON's four characters).
_JSON_WS = r"[\x20\x0A\x0D\x09]"
# llguidance's parser limit on Earley items per mask step (its default: 50,000); see
# LLGuidanceBackend._ready.
STEP_MAX_ITEMS = 200_000


class BackendError(ValueError):
    """The backend refuses the spec (syntax, an unsupported feature), or a pairing is wrong.

    `backend` names the backend ("" when not known)."""

    def __init__(self, message: str, backend: str = ""):
        super().__init__(message)
        self.backend = backend


class Matcher(Protocol):
    """What the engine and the mask filler call on a matcher (see the module docstring)."""

    @property
    def stop_token_ids(self) -> list[int]: ...

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> bool: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...
    def is_completed(self) -> bool: ...
    def rollback(self, num_tokens: int = 1) -> None: ...
    def reset(self) -> None: ...


class Backend(Protocol):
    """compile (grammar service) -> serialize -> bytes -> deserialize (rank) -> new_matcher."""

    name: str
    version: str

    def compile(self, spec) -> object: ...
    def serialize(self, compiled, spec=None, compile_seconds: float | None = None) -> bytes: ...
    def deserialize(self, payload: bytes) -> object: ...
    def new_matcher(self, compiled, **options) -> Matcher: ...


# ---------------------------------------------------------------------------- xgrammar


class XGrammarBackend:
    """xgrammar over one TokenizerInfo. `threads`: compile threads. The compiler is built on
    the first compile (ranks only deserialize), or now with `eager`."""

    name = XGRAMMAR
    version = VERSIONS[XGRAMMAR]

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, threads: int = 1, eager: bool = False):
        self.tokenizer_info = tokenizer_info
        self._threads = threads
        self._compiler = None
        if eager:
            self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=threads,
                                                 cache_enabled=False)

    def compile(self, spec) -> xgr.CompiledGrammar:
        """Compile a CanonicalSpec (every kind but lark). Raises what xgrammar raises
        (RuntimeError and its own types) when it refuses the spec; BackendError for lark."""
        if self._compiler is None:
            self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=self._threads,
                                                 cache_enabled=False)
        return _xgr_compile(self._compiler, spec)

    def serialize(self, compiled: xgr.CompiledGrammar, spec=None,
                  compile_seconds: float | None = None) -> bytes:
        """The payload a rank reads back with `deserialize`.

        xgrammar's serialised form when fetching and deserialising it is at least
        CACHE_SPEEDUP times faster than compiling (estimated at RANK_SECONDS_PER_BYTE);
        otherwise, when `spec` (the CanonicalSpec compiled) and `compile_seconds` (what the
        compile took) are given, the spec itself in a small envelope, which the rank
        compiles. The serialised form grows much faster than the grammar (measured at a 4k
        vocabulary: 0.7 MB for a 42 ms compile, 18 MB for 0.2 s, 95 MB and 6.8 s to write for
        0.3 s) and is never smaller than the grammar in memory, so that lower bound is
        checked before anything is written. The service has already compiled the spec
        within its deadline and memory cap on the same vocabulary, so a rank's compile is
        bounded too. Without `spec` or `compile_seconds`: always the serialised form.
        """
        def slow(nbytes: int) -> bool:
            return nbytes * RANK_SECONDS_PER_BYTE * CACHE_SPEEDUP > compile_seconds

        spec_payload = None
        if spec is not None and compile_seconds is not None:
            spec_payload = json.dumps({"format": _XGR_SPEC_FORMAT, "spec": spec.to_dict()},
                                      separators=(",", ":"), ensure_ascii=False).encode()
            if slow(compiled.memory_size_bytes):
                return spec_payload
        text = compiled.serialize_json().encode()
        return spec_payload if spec_payload is not None and slow(len(text)) else text

    def deserialize(self, payload: bytes) -> xgr.CompiledGrammar:
        """The compiled grammar of a `serialize` payload: read back, or compiled here from
        the spec it carries. Raises BackendError when `payload` is neither for this
        vocabulary, or xgrammar refuses the spec."""
        if payload.startswith(b'{"format":"' + _LLG_FORMAT.encode()):
            raise BackendError("the payload is an llguidance grammar, not xgrammar's", XGRAMMAR)
        if payload.startswith(b'{"format":"' + _XGR_SPEC_FORMAT.encode()):
            from grammar_service.specs import CanonicalSpec

            try:
                return self.compile(CanonicalSpec.from_dict(json.loads(payload)["spec"]))
            except Exception as exc:  # xgrammar raises its own error types and RuntimeError
                raise BackendError(f"{type(exc).__name__}: {exc}", XGRAMMAR) from None
        try:
            return xgr.CompiledGrammar.deserialize_json(payload.decode(), self.tokenizer_info)
        except Exception as exc:  # xgrammar raises its own error types and RuntimeError
            raise BackendError(f"{type(exc).__name__}: {exc}", XGRAMMAR) from None

    def new_matcher(self, compiled, **options) -> xgr.GrammarMatcher:
        """A fresh `xgrammar.GrammarMatcher`; `options` go to it (override_stop_tokens=None,
        terminate_without_stop_token=False, max_rollback_tokens=-1)."""
        if not isinstance(compiled, xgr.CompiledGrammar):
            raise BackendError(f"xgrammar cannot make a matcher from {type(compiled).__name__}",
                               XGRAMMAR)
        return xgr.GrammarMatcher(compiled, **options)


def _xgr_compile(compiler: xgr.GrammarCompiler, spec) -> xgr.CompiledGrammar:
    opts = spec.options
    if spec.kind in ("json_schema", "json_object"):
        schema = (json.dumps(fix_schema(json.loads(spec.text)))
                  if spec.kind == "json_schema" else '{"type":"object"}')
        compact = opts.whitespace == "compact"
        return compiler.compile_json_schema(
            schema,
            any_whitespace=not compact,
            separators=(",", ":") if compact else None,
            max_whitespace_cnt=opts.max_whitespace if opts.whitespace == "bounded" else None,
            # strict_mode forbids properties the schema does not list (options.strict).
            strict_mode=opts.strict,
        )
    if spec.kind == "regex":
        return compiler.compile_regex(spec.text)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.text)
    if spec.kind == "choice":
        # JSON string literals are valid xgrammar EBNF string literals (same escapes).
        choices = json.loads(spec.text)
        return compiler.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.text)
    raise BackendError(f"xgrammar does not compile {spec.kind}", XGRAMMAR)


# ---------------------------------------------------------------------------- llguidance


@dataclass
class LLGuidanceGrammar:
    """An llguidance grammar checked against this vocabulary: its text, and a matcher at the
    start which `new_matcher` copies (the template itself is never advanced), built by the
    first `new_matcher` or `deserialize`: the grammar service, which only checks and sends
    the text (of an any-order rewrite it checks the embedded schemas, `_llg_grammar`),
    never builds one.

    Lanes: an LLMatcher's `deep_copy` shares the original's lexer, behind one lock, so the
    masks of all copies of one template are computed one at a time, whatever the fill
    threads. `lanes` holds the templates matchers are copied from (`template` first), each
    with its number of live copies; where every lane has one, `LLGuidanceBackend.new_matcher`
    builds another template from the text (a compile, once per lane), up to the backend's
    lane count, so the rows of one grammar fill in parallel."""

    grammar: str
    # llguidance's warnings: what a lenient compile ignored or approximated
    warnings: tuple[str, ...] = ()
    template: object | None = None  # llguidance.LLMatcher
    build_s: float = 0.0  # seconds the template took to build
    lanes: list = field(default_factory=list, repr=False, compare=False)  # [[template, live]]
    # Reentrant: a matcher's finalizer (`_leave`) may run inside a garbage collection that
    # starts while this thread holds the lock in `new_matcher`.
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)


class LLGuidanceBackend:
    """llguidance over one `llguidance.LLTokenizer` (see `llguidance_tokenizer`)."""

    name = LLGUIDANCE
    version = VERSIONS[LLGUIDANCE]

    def __init__(self, tokenizer, eos_token_ids: Iterable[int], lanes: int | None = None):
        """`lanes`: templates per grammar at most (see LLGuidanceGrammar); None:
        `LANES_PER_THREAD` per thread of llguidance's default fill pool."""
        self.tokenizer = tokenizer
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.lanes = LANES_PER_THREAD * default_fill_threads() if lanes is None else lanes
        if self.lanes < 1:
            raise ValueError(f"lanes: must be >= 1, got {self.lanes}")
        # A grammar whose template took longer than this to build keeps one lane: another
        # would cost a request that long (the middle of SchemaStore builds in about 2 ms).
        self.lane_build_max_s = LANE_BUILD_MAX_S

    def compile(self, spec, lenient: bool = False) -> LLGuidanceGrammar:
        """Build the grammar of a CanonicalSpec and check it against the vocabulary.

        Raises BackendError with llguidance's message when it refuses the spec, which it does
        for what it cannot enforce exactly (e.g. `not`, overlapping `oneOf` branches,
        `uniqueItems`, unknown `format`s) as well as for syntax errors. With `lenient`
        (json_schema), what it cannot enforce is ignored instead (an unknown keyword or
        format) or approximated (`oneOf` as `anyOf`), and said in the result's `warnings`,
        which the caller must report (grammar_service.unenforced.llguidance_unenforced).
        """
        from llguidance import LLMatcher

        grammar, ignored, check = _llg_grammar(spec, lenient)
        failed, messages = LLMatcher.validate_grammar_with_warnings(check or grammar,
                                                                    self.tokenizer)
        if failed and check is not None:
            # The any-order rewrite failed where the schema as it is may not (an embedded
            # node llguidance refuses on its own, e.g. unsatisfiable where its compile of the
            # whole schema drops it): the schema's own grammar, order fixed.
            grammar, ignored, _ = _llg_grammar(spec, lenient, any_order=False)
            failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise BackendError(messages[0] if messages else "llguidance refuses the grammar",
                               LLGUIDANCE)
        if ignored:  # left out of the rewrite's schema: said as llguidance says it
            messages = [*messages, f"Unimplemented keys: {json.dumps(list(ignored))}"]
        return LLGuidanceGrammar(grammar, tuple(messages))

    def serialize(self, compiled: LLGuidanceGrammar, spec=None,
                  compile_seconds: float | None = None) -> bytes:
        """Our envelope around the grammar text (`spec` is not needed: the text is small)."""
        return json.dumps({"format": _LLG_FORMAT, "grammar": compiled.grammar},
                          separators=(",", ":"), ensure_ascii=False).encode()

    def deserialize(self, payload: bytes) -> LLGuidanceGrammar:
        """Raises BackendError when `payload` is not an llguidance grammar in our envelope, or
        llguidance refuses it on this vocabulary."""
        try:
            data = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("format") != _LLG_FORMAT:
            raise BackendError(f"the payload is not an llguidance grammar ({_LLG_FORMAT})",
                               LLGUIDANCE)
        return self._ready(data["grammar"])

    def new_matcher(self, compiled, **options) -> LLGuidanceMatcher:
        """A fresh matcher at the grammar's start. `options`: none are supported (xgrammar's
        matcher options have no llguidance counterpart here); passing one is TypeError."""
        if options:
            raise TypeError(f"llguidance matchers take no options, got {sorted(options)}")
        if not isinstance(compiled, LLGuidanceGrammar):
            raise BackendError(f"llguidance cannot make a matcher from {type(compiled).__name__}",
                               LLGUIDANCE)
        with compiled.lock:
            if compiled.template is None:
                ready = self._ready(compiled.grammar)
                compiled.template, compiled.build_s = ready.template, ready.build_s
            if not compiled.lanes:
                compiled.lanes.append([compiled.template, 0])
            lane = min(compiled.lanes, key=lambda entry: entry[1])
            if lane[1] and len(compiled.lanes) < self.lanes \
                    and compiled.build_s <= self.lane_build_max_s:
                # Every lane has a live copy: one more lexer, so one more row of this
                # grammar can fill at once (a compile on this thread, once per lane).
                lane = [self._ready(compiled.grammar).template, 0]
                compiled.lanes.append(lane)
            lane[1] += 1
        matcher = LLGuidanceMatcher(lane[0], self.eos, (self.tokenizer.vocab_size + 31) // 32)
        weakref.finalize(matcher, _leave, compiled.lock, lane)
        return matcher

    def _ready(self, grammar: str) -> LLGuidanceGrammar:
        import llguidance

        # Earley items per mask step: llguidance's default (50k) is hit mid-output by some
        # real schemas at a 151k vocabulary (SchemaStore's tox: 4 ms masks inside a string
        # of a wide anyOf), which leaves the matcher in an error state: a dead end for a
        # valid output. 200k (about 10 ms of parsing at most) lets them through.
        limits = llguidance.LLParserLimits(step_max_items=STEP_MAX_ITEMS)
        start = time.perf_counter()
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if template.is_error():
            raise BackendError(template.get_error(), LLGUIDANCE)
        return LLGuidanceGrammar(grammar, tuple(template.get_grammar_warnings()), template,
                                 build_s=time.perf_counter() - start)


# Measured on 64 rows of one schema at a 151k vocabulary, 2 fill threads (60 batches):
# batch fill 10.0 ms with one template, 9.4 with 2 lanes, 7.5 with 8, 6.3 with 16. With as
# many lanes as threads, two threads often want the same lane at once: a batch's rows are
# spread over the threads by index, not by lane.
LANES_PER_THREAD = 8
LANE_BUILD_MAX_S = 0.02


def _leave(lock: threading.RLock, lane: list) -> None:
    """A matcher copied from `lane` is gone (weakref.finalize)."""
    with lock:
        lane[1] -= 1


def default_fill_threads() -> int:
    """llguidance's own default for `LLExecutor` threads: 80 % of the cores, 1 to 32."""
    return max(1, min(32, (os.cpu_count() or 1) * 80 // 100))


def _llg_grammar(spec, lenient: bool = False,
                 any_order: bool = True) -> tuple[str, tuple[str, ...], str | None]:
    """(llguidance's grammar text for `spec`, the keywords the grammar ignores that its own
    compile will not name: those `without_ignored` left out of a lenient any-order rewrite's
    schema, what the service checks of the any-order rewrite's grammar: None for another).

    What the service checks of the any-order rewrite's Lark (property_order) is the JSON
    schemas the Lark embeds, as one grammar list. Everything of the user's in that Lark is
    in those embeds (names are literals the rewrite escapes itself), and the rest is the
    rewrite's own text, whose every form the tests build; so the embeds build exactly when
    the Lark does, with the same warnings (the Lark's are its embeds'). That check costs
    what llguidance's JSON front end does (0.1 ms at SchemaStore's median) instead of a
    second compile of the Lark (3-4 ms; a rank builds it anyway). A Lark that embeds
    nothing is checked whole."""
    from llguidance import LLMatcher

    opts = spec.options
    if spec.kind in ("json_schema", "json_object"):
        # The spec's own text unless a rewrite applies (no parse, no second dump).
        text = spec.text if spec.kind == "json_schema" else '{"type":"object"}'
        fix = spec.kind == "json_schema" and llguidance_fix_applies(text)
        any_order = any_order and spec.kind == "json_schema" and not opts.fixed_order
        schema = None
        if fix or any_order or (spec.kind == "json_schema" and opts.strict):
            schema = json.loads(text)
            if fix:
                schema = fix_schema_llguidance(schema)
            if opts.strict:
                # options.strict means the same on both backends: xgrammar's strict_mode.
                schema = forbid_unlisted_properties(schema)
            if fix or opts.strict:  # else the spec's text is the schema's already
                text = json.dumps(schema)
        if opts.whitespace == "compact":
            ws = {"whitespace_flexible": False}
        elif opts.whitespace == "bounded":
            ws = {"whitespace_flexible": True,
                  "whitespace_pattern": f"{_JSON_WS}{{0,{opts.max_whitespace}}}"}
        else:
            ws = {"whitespace_flexible": True}
        # Our options override any "x-guidance" the schema carries.
        if lenient:
            ws["lenient"] = True
        if any_order:
            # What a lenient compile ignores does not stop an object's rewrite.
            readable, ignored = without_ignored(schema, text) if lenient else (schema, ())
            lark = any_order_grammar(readable, ws, whitespace_regex(opts.whitespace,
                                                                    opts.max_whitespace),
                                     None if ignored else text)
            if lark is not None:
                embeds = embedded_schemas(lark)
                check = '{"grammars":[' + ",".join(
                    '{"json_schema":' + e + "}" for e in embeds) + "]}" if embeds else lark
                return lark, ignored, check
        try:
            return LLMatcher.grammar_from_json_schema(text, overrides=ws), (), None
        except ValueError as exc:
            raise BackendError(str(exc), LLGUIDANCE) from None
    return _llg_other_grammar(spec), (), None


def _llg_other_grammar(spec) -> str:
    """llguidance's grammar text for a spec that is not a JSON schema or json_object."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        choices = json.loads(spec.text)
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    if spec.kind == "lark":
        return LLMatcher.grammar_from_lark(spec.text)
    if spec.kind == "ebnf":
        try:
            return LLMatcher.grammar_from_lark(any_to_lark(spec.text))
        except Exception as exc:  # the converter raises whatever its parser hits
            raise BackendError(f"cannot convert the EBNF to Lark: {exc}", LLGUIDANCE) from None
    raise BackendError(f"llguidance does not compile {spec.kind} here", LLGUIDANCE)


class LLGuidanceMatcher:
    """An llguidance `LLMatcher` with xgrammar's matcher interface (see the module docstring).

    Differences it hides: a refused token puts an LLMatcher into a permanent error state, so
    `accept_token` uses `try_consume_tokens`, which refuses without changing state; and
    LLMatcher has no "terminated" state, so accepting a stop token is recorded here. Not
    thread-safe; one per (rank, slot, request) (I1).
    """

    __slots__ = ("_m", "_template", "_eos", "_words", "_terminated", "__weakref__")

    def __init__(self, template, eos: frozenset[int], words: int):
        self._template = template  # the grammar's LLMatcher at its start, never advanced
        self._m = template.deep_copy()
        self._eos = eos
        self._words = words
        self._terminated = False

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids that end the output (as xgrammar's matcher reports its own)."""
        return sorted(self._eos)

    @property
    def llmatcher(self):
        """The wrapped `llguidance.LLMatcher`, for batch mask fills (`LLExecutor`)."""
        return self._m

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> bool:
        """Write every word of row `index` of `bitmask` (CPU int32, (rows, words), rows
        contiguous, words == ceil(vocab / 32)). Returns True (xgrammar returns whether the row
        needs applying; this one always does). Raises ValueError for a bitmask of another
        shape or kind."""
        if bitmask.dtype != _torch().int32 or bitmask.device.type != "cpu" \
                or bitmask.dim() != 2 or bitmask.shape[1] != self._words:
            raise ValueError(f"bitmask: expected a CPU int32 (rows, {self._words}) tensor, got "
                             f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        row = bitmask[index]
        if not row.is_contiguous():
            raise ValueError("bitmask: rows must be contiguous")
        # Drops the GIL while llguidance writes all `words` int32 words of the row.
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)
        return True

    def accept_token(self, token_id: int) -> bool:
        """Advance by `token_id`; False, with the state unchanged, when the grammar refuses it
        (or a stop token was already accepted)."""
        token_id = int(token_id)
        if self._terminated:
            return False
        if token_id in self._eos:
            # A stopped LLMatcher (nothing but EOS can follow) refuses EOS in
            # try_consume_tokens while its mask allows it; consume_token takes it.
            if self._m.is_error() or not self._m.is_accepting() \
                    or not self._m.consume_token(token_id):
                return False
            self._terminated = True
            return True
        return self._m.try_consume_tokens([token_id]) == 1

    def is_terminated(self) -> bool:
        """True once a stop token was accepted (as xgrammar's default matcher)."""
        return self._terminated

    def is_completed(self) -> bool:
        """The text so far is a complete instance: a stop token may come next."""
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        """The grammar has ended: it allows nothing but a stop token (its mask would be the
        EOS ids alone), known without computing a mask. False does not say more tokens may
        follow (llguidance may find out only at the next mask)."""
        return self._m.is_stopped() and not self._m.is_error()

    def error(self) -> str:
        """llguidance's error message ('' when none): a parser limit hit mid-generation
        leaves the matcher allowing nothing, which the engine reports as a dead end (I6)."""
        return self._m.get_error()

    def rollback(self, num_tokens: int = 1) -> None:
        """Undo the last `num_tokens` accepted tokens (a stop token counts as one)."""
        if num_tokens <= 0:
            return
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")
        self._terminated = False

    def reset(self) -> None:
        """Back to the grammar's start, from an error state too (an LLMatcher's own reset
        keeps its error: a parser limit hit, or a refused token consumed directly)."""
        if self._m.is_error():
            self._m = self._template.deep_copy()
        else:
            self._m.reset()
        self._terminated = False


def _torch():
    import torch

    return torch


def llguidance_tokenizer(tokenizer_json: str, n_vocab: int, eos_token_ids: Iterable[int]):
    """An `llguidance.LLTokenizer` over a `tokenizers` JSON (Tokenizer.to_str()).

    `n_vocab` is the model's (padded) vocabulary, as xgrammar's TokenizerInfo uses: ids past
    the tokenizer's are padding that no grammar allows, and mask rows have ceil(n_vocab / 32)
    words on both backends.

    Slices (llguidance's mask shortcut: a slice whose tokens the lexer all allows is added
    whole, its trie not walked): llguidance's general ones for free JSON strings, after
    `WORD_SLICES` (identifiers, and words after a space), which also hold whole inside
    strings with a `pattern`, a `format` or a length bound that allows such characters. They
    change no mask, only its cost.
    """
    import llguidance

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab,
                                 eos_token=[int(t) for t in eos_token_ids])
    general = llguidance.LLTokenizer.general_slices()
    return tok.with_slices(general[:1] + list(WORD_SLICES) + general[1:])


# Measured on 128 SchemaStore schemas at a 151k-token BPE (`bench/mask_tail.py --corpus`:
# every mask of every instance, the schema's auto backend), the masks themselves unchanged:
# the first two (identifiers up to 10 characters) took mask p99 1.25 -> 1.05 ms (inside a
# `^[a-zA-Z0-9_]+$` string, ~89k of 151k tokens allowed, 1.41 -> 0.85 ms); the longer
# identifiers (18k tokens of 11-30 characters) and the words after a space (35k tokens):
# masks over 300 us 1,404 -> 1,208 of 62,710, p99 1.04 -> 1.02 ms
# (`bench/results/mask_tail_corpus_cpu_word_slices_c31d649.txt`; on the corpus walk of the
# code before, where fewer instances ran to their end, p99 0.83 -> 0.47 ms), build unchanged.
WORD_SLICES = ("[a-z]{1,10}", "[a-zA-Z0-9_]{1,10}", "[a-zA-Z0-9_]{1,30}",
               " [a-zA-Z0-9_]{1,10}")


# ---------------------------------------------------------------------------- both


def backend_for(vocab, name: str, fill_threads: int | None = None) -> Backend:
    """A new backend `name` over a grammar_service.vocab.Vocab (its tokenizer views are
    cached on the Vocab). `fill_threads`: the threads that fill this rank's masks at once
    (llguidance keeps `LANES_PER_THREAD` lanes per thread for a grammar; None: llguidance's
    default pool). Raises KeyError for an unknown name."""
    if name == XGRAMMAR:
        return XGrammarBackend(vocab.tokenizer_info())
    if name == LLGUIDANCE:
        return LLGuidanceBackend(vocab.llguidance_tokenizer(), vocab.eos_token_ids,
                                 lanes=fill_threads and LANES_PER_THREAD * fill_threads)
    raise KeyError(name)


@dataclass(frozen=True)
class VocabView:
    """What a process needs to build both backends for one vocabulary; picklable, so the
    compile pool can send it to its children."""

    tokenizer_info_json: str
    tokenizer_json: str
    model_vocab_size: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def of(cls, vocab) -> VocabView:
        """The view of a grammar_service.vocab.Vocab."""
        return cls(vocab.tokenizer_info().serialize_json(), vocab.tokenizer_json(),
                   vocab.model_vocab_size, tuple(vocab.eos_token_ids))

    def backends(self, threads: int = 1) -> dict[str, Backend]:
        """Both backends, ready to compile ({name: backend})."""
        info = xgr.TokenizerInfo.deserialize_json(self.tokenizer_info_json)
        tok = llguidance_tokenizer(self.tokenizer_json, self.model_vocab_size,
                                   self.eos_token_ids)
        return {XGRAMMAR: XGrammarBackend(info, threads, eager=True),
                LLGUIDANCE: LLGuidanceBackend(tok, self.eos_token_ids)}
