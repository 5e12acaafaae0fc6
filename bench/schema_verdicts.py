"""One JSON schema through gramserve's compile path, and instances through its matchers.

Shared by the conformance suite (bench/conformance.py, tests/test_conformance.py) and the
real-schema benchmark (bench/grammars.py). Three modes, each the path a request takes:

    gramserve    options.backend auto: gramserve's choice (grammar_service.choice)
    xgrammar     options.backend forced to xgrammar (gramserve's rewrites and report apply)
    llguidance   options.backend forced to llguidance

and one reference that is no path of gramserve's (bench/grammars.py's last column):

    llguidance-raw  llguidance alone, as a library user runs it: its own JSON front end on
                    the schema with its default options (property order fixed, whitespace
                    flexible, what it cannot enforce refused), one build in one process;
                    nothing validated, rewritten or reported by gramserve

A schema is validated (grammar_service.specs.parse_spec), compiled and serialised as the
grammar service does (choice.compile_spec), read back as a rank does (deserialize +
new_matcher); an instance is its JSON text, tokenized by the model's tokenizer and fed token
by token, then a stop token. Nothing is mocked.

Verdicts for one (instance, mode), the columns of every table:

    pass              valid accepted, or invalid refused
    valid_rejected    a valid instance refused by the matcher
    invalid_reported  an invalid instance accepted, and the compile reported keywords it
                      does not enforce (CompileGrammar's unenforced_keywords)
    invalid_silent    an invalid instance accepted with nothing reported: the failure that
                      must not happen
    refused           the schema was refused at validation or compile, with an error
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from grammar_service.backends import (
    LLGUIDANCE,
    STEP_MAX_ITEMS,
    XGRAMMAR,
    LLGuidanceMatcher,
    VocabView,
    backend_for,
)
from grammar_service.choice import compile_spec
from grammar_service.specs import parse_spec
from protos import common_pb2

MODES = ("gramserve", XGRAMMAR, LLGUIDANCE)
RAW_LLGUIDANCE = "llguidance-raw"
VERDICTS = ("pass", "valid_rejected", "invalid_reported", "invalid_silent", "refused")
_FORCED = {"gramserve": common_pb2.GRAMMAR_BACKEND_AUTO,
           XGRAMMAR: common_pb2.GRAMMAR_BACKEND_XGRAMMAR,
           LLGUIDANCE: common_pb2.GRAMMAR_BACKEND_LLGUIDANCE}


@dataclass
class Build:
    """A schema compiled in one mode: a matcher template on the rank side, or the error.

    compile_s: validation + compile + serialise (the grammar service); build_s: deserialise +
    first matcher (the rank)."""

    mode: str
    backend: str = ""
    unenforced: tuple[str, ...] = ()
    error: str = ""
    compile_s: float = 0.0
    build_s: float = 0.0
    matcher: object = field(default=None, repr=False)
    grammar: object = field(default=None, repr=False)  # the rank's compiled grammar

    @property
    def ok(self) -> bool:
        return self.matcher is not None


def instance_text(instance) -> str:
    """The JSON text a model would write for `instance`: json.dumps' default separators and
    non-ASCII kept (escaped only where the text cannot be UTF-8, e.g. a lone surrogate)."""
    text = json.dumps(instance, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(instance)
    return text


class Judge:
    """Compiles schemas and runs instances on one vocabulary (a grammar_service.vocab.Vocab).

    Not thread-safe; build one per thread."""

    def __init__(self, vocab, threads: int = 1):
        self.vocab = vocab
        self.service = VocabView.of(vocab).backends(threads)
        self.ranks = {name: backend_for(vocab, name) for name in (XGRAMMAR, LLGUIDANCE)}
        self.eos = vocab.eos_token_ids[0]
        self.words = (vocab.model_vocab_size + 31) // 32

    def build(self, schema, mode: str, **options) -> Build:
        """Compile `schema` (parsed JSON) in `mode`; `options`: GrammarOptions fields
        (e.g. strict=True). Never raises for what a user can send: the error is recorded."""
        if mode == RAW_LLGUIDANCE:
            return self._build_raw(schema)
        out = Build(mode)
        text = json.dumps(schema)  # what a client sends: its encoding is not the service's
        start = time.perf_counter()
        try:
            opts = common_pb2.GrammarOptions(backend=_FORCED[mode], **options)
            spec = parse_spec(common_pb2.GrammarSpec(json_schema=text, options=opts))
            compiled = compile_spec(spec, self.service)
        except Exception as exc:  # InvalidArgument, BackendError, StrictRefused, RuntimeError
            out.error = f"{type(exc).__name__}: {_first_line(str(exc))}"
            out.compile_s = time.perf_counter() - start
            return out
        out.compile_s = time.perf_counter() - start
        out.backend, out.unenforced = compiled.backend, compiled.unenforced
        start = time.perf_counter()
        rank = self.ranks[compiled.backend]
        out.grammar = rank.deserialize(compiled.payload)
        out.matcher = rank.new_matcher(out.grammar)
        out.build_s = time.perf_counter() - start
        return out

    def _build_raw(self, schema) -> Build:
        """llguidance alone (RAW_LLGUIDANCE): its grammar of the schema and one matcher, with
        the rank's tokenizer and parser limits; all of it counted as compile_s."""
        import llguidance

        out = Build(RAW_LLGUIDANCE, backend=LLGUIDANCE)
        rank = self.ranks[LLGUIDANCE]
        start = time.perf_counter()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            template = llguidance.LLMatcher(
                rank.tokenizer, grammar, log_level=0,
                limits=llguidance.LLParserLimits(step_max_items=STEP_MAX_ITEMS))
            if template.is_error():
                raise ValueError(template.get_error())
        except ValueError as exc:
            out.error = f"llguidance: {_first_line(str(exc))}"
        else:
            out.matcher = LLGuidanceMatcher(template, frozenset(self.vocab.eos_token_ids),
                                            self.words)
        out.compile_s = time.perf_counter() - start
        return out

    def accepts(self, build: Build, text: str, mask_times: list[float] | None = None) -> bool:
        """Whether `build`'s matcher takes `text` token by token and then a stop token.

        With `mask_times`, every mask before a token (and before the stop token) is filled
        into a one-row bitmask and its seconds appended, as a rank fills it."""
        import torch

        m = build.matcher
        m.reset()
        bitmask = torch.zeros((1, self.words), dtype=torch.int32) if mask_times is not None \
            else None
        for token in [*self.vocab.encode(text, add_special_tokens=False), self.eos]:
            if bitmask is not None:
                start = time.perf_counter()
                m.fill_next_token_bitmask(bitmask, 0)
                mask_times.append(time.perf_counter() - start)
            if not m.accept_token(token):
                return False
        return m.is_terminated()

    def verdict(self, build: Build, instance, valid: bool,
                mask_times: list[float] | None = None) -> str:
        """The verdict (see VERDICTS) of `instance`, whose validity is `valid`, on `build`."""
        if not build.ok:
            return "refused"
        accepted = self.accepts(build, instance_text(instance), mask_times)
        if accepted == valid:
            return "pass"
        if valid:
            return "valid_rejected"
        return "invalid_reported" if build.unenforced else "invalid_silent"


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    return line if len(line) <= 160 else line[:157] + "..."
