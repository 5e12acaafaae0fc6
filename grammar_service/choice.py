"""Which backend compiles a spec, and why: exact enforcement first, then speed.

The rule for `backend: auto` (a client can force either backend with options.backend):

- json_schema: llguidance, compiled once, leniently. What it cannot enforce exactly (`not`,
  `uniqueItems`, `if`, `contains`, `dependentRequired`, an unknown `format`, ...) is ignored,
  a `oneOf` it cannot prove disjoint becomes `anyOf` (as on xgrammar), and each is reported
  from its warnings (grammar_service.unenforced.llguidance_unenforced); a `pattern` its regex
  engine cannot parse (look-around, back-references) and an integer lower bound at or below
  -2**63, which it refuses even then, are relaxed in the schema it compiles (a regex widened
  to what its engine parses, a bound left out) and reported the same way
  (grammar_service.unenforced.llguidance_relaxed). No warning: it enforces every
  keyword, including what xgrammar approximates (`allOf`, length bounds next to a `pattern`,
  large length bounds). Everything else stays exact, which is more than xgrammar enforces,
  and it compiles far faster. xgrammar compiles the schema when it enforces every keyword
  and llguidance does not (e.g. a `format` only it knows), or when llguidance cannot compile
  it at all (or a warning is not understood), its unenforced keywords reported
  (grammar_service.unenforced). With options.strict a schema with anything
  unenforced is refused.
  Properties come in any order on llguidance where grammar_service.property_order can say
  so exactly (options.fixed_order: the schema's order); xgrammar fixes the order.
- json_object: llguidance (both exact; llguidance is faster to build and to mask).
- regex, choice: xgrammar (both exact; xgrammar is faster for the small grammars these are).
- ebnf (xgrammar's dialect), structural_tag: xgrammar, whose formats they are.
- lark: llguidance, whose format it is.

Measured for the rule (default model, 4k-token byte-level BPE, one thread, medians;
xgrammar: compile, then deserialize + matcher on the rank; llguidance: building the matcher
from its grammar text, which is what a rank does):

    case                   xgr compile   xgr deser+matcher   llg build    mask p50/p99 xgr | llg
    regex (email)          0.07 ms       0.14 ms             0.85 ms      1.5/2.9 µs | 6.9/63 µs
    regex (200-way alt.)   1.5 ms        0.45 ms             0.99 ms
    choice (3)             0.03 ms       0.04 ms             0.57 ms
    choice (200)           3.6 ms        0.54 ms             1.45 ms      0.9/20 µs | 12/733 µs
    json_object            1.35 ms       1.42 ms             0.26 ms      12/878 µs | 10/51 µs
    schema (2 properties)  1.44 ms       0.78 ms             0.44 ms

What exactness costs at serving time, on the large vocabularies served models have: masks of
the JSON schemas of bench/schemas at a 151k-token byte-level BPE (rows stepped along random
valid outputs, one thread, 2-core x86): xgrammar p50 26-31 µs, mean 96-112 µs, p99
0.8-1.3 ms; llguidance p50 147-156 µs, mean 716-960 µs, p99 15-26 ms (inside length-bounded
strings nearly every token is allowed and llguidance walks them all). A client that prefers
mask speed on a schema xgrammar enforces (no keyword reported unenforced) forces xgrammar
with options.backend, as bench/serve.py does.

Pure and cheap; the compile pool's children call `compile_spec`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from grammar_service.backends import LLGUIDANCE, XGRAMMAR, BackendError
from grammar_service.specs import canonical_json
from grammar_service.unenforced import (
    ALWAYS_UNENFORCED,
    find_unenforced,
    llguidance_relaxed,
    llguidance_unenforced,
)

# Kinds whose auto choice does not depend on the spec, with the reason reported.
_STATIC = {
    "json_object": (LLGUIDANCE, "auto: json_object is exact on both; llguidance builds and "
                                "masks faster"),
    "regex": (XGRAMMAR, "auto: regex is exact on both; xgrammar compiles and masks faster"),
    "choice": (XGRAMMAR, "auto: choice is exact on both; xgrammar compiles and masks faster"),
    "ebnf": (XGRAMMAR, "auto: ebnf is xgrammar's dialect"),
    "structural_tag": (XGRAMMAR, "auto: structural tags are xgrammar's format"),
    "lark": (LLGUIDANCE, "auto: lark is llguidance's format"),
}
# Compiles that drop what llguidance refuses even when lenient (a regex it cannot parse, an
# int64 lower bound), each round one kind: past this, xgrammar compiles the schema.
_MAX_RELAX = 3
# Kinds a backend cannot compile at all (a forced choice of it is refused at validation).
UNSUPPORTED = {XGRAMMAR: frozenset({"lark"}), LLGUIDANCE: frozenset({"structural_tag"})}


class StrictRefused(ValueError):
    """options.strict and the only backend that compiles the schema does not enforce it all."""


@dataclass(frozen=True)
class Compiled:
    """A compiled spec: the backend that made it, why that one, the keywords it leaves
    unenforced (xgrammar only), and the serialised grammar."""

    backend: str
    reason: str
    unenforced: tuple[str, ...]
    payload: bytes


def compile_spec(spec, backends: dict) -> Compiled:
    """Compile a CanonicalSpec with the backend the rule above picks (or the forced one).

    `backends`: {name: backend} (grammar_service.backends). Raises StrictRefused, and what
    BackendError (naming the backend) when the chosen backend refuses the spec, and
    MemoryError. A JSON schema's reason also says which property order the grammar takes.
    """
    compiled = _choose(spec, backends)
    if spec.kind != "json_schema":
        return compiled
    if compiled.backend == LLGUIDANCE and _ANY_ORDER in compiled.payload[:120]:
        order = "properties in any order (where the rewrite applies: README, JSON Schema " \
                "semantics)"
    elif spec.options.fixed_order:
        order = "properties in the schema's order (options.fixed_property_order)"
    elif compiled.backend == XGRAMMAR:
        order = "properties in the schema's order (xgrammar fixes it)"
    else:
        order = "properties in the schema's order (no object the rewrite can reorder)"
    return replace(compiled, reason=f"{compiled.reason}; {order}")


# How an llguidance payload of the any-order rewrite begins (its Lark text's first line).
_ANY_ORDER = b'"grammar":"%llguidance {'


def _choose(spec, backends: dict) -> Compiled:
    forced = spec.options.backend
    if forced != "auto":
        return _with(backends[forced], spec, f"forced: options.backend is {forced}")
    if spec.kind != "json_schema":
        name, reason = _STATIC[spec.kind]
        return _with(backends[name], spec, reason)
    compiled, refusal = _llguidance(backends[LLGUIDANCE], spec)
    if compiled is not None and not compiled.unenforced:
        return compiled
    if compiled is not None and any(path.rsplit(".", 1)[-1] in ALWAYS_UNENFORCED
                                    for path in compiled.unenforced):
        return _approximated(compiled, spec)  # xgrammar ignores one of them too: no walk
    unenforced = tuple(find_unenforced(json.loads(spec.text)))
    if compiled is not None and unenforced:  # both approximate; llguidance enforces more
        return _approximated(compiled, spec)
    # xgrammar enforces it all (e.g. a format only it knows), or llguidance cannot compile it
    reason = f"auto: {_first_line(refusal)}; xgrammar compiles it"
    if unenforced:
        reason += f" without enforcing {', '.join(unenforced)}"
    return _with(backends[XGRAMMAR], spec, reason)


def _approximated(compiled: Compiled, spec) -> Compiled:
    """llguidance's lenient compile, when xgrammar would approximate the schema too; refused
    with options.strict."""
    if spec.options.strict:
        raise StrictRefused("schema uses keywords no backend enforces: "
                            f"{', '.join(compiled.unenforced)} (unset options.strict to "
                            "accept an approximation)")
    return compiled


def _llguidance(backend, spec) -> tuple[Compiled | None, str]:
    """The schema on llguidance, compiled once, leniently: what it cannot enforce is ignored
    (or, for oneOf, approximated) and reported from its warnings, and what it refuses even
    then is relaxed (`llguidance_relaxed`) and reported; no warning means every keyword is
    enforced, as a strict compile would. (None, why) when it still refuses, or says something
    we cannot turn into a report; else (the compiled spec, its first warning)."""
    start = time.perf_counter()
    schema, dropped = None, []  # parsed only where a refusal or a warning needs it
    for _ in range(_MAX_RELAX):
        try:
            compiled = backend.compile(spec, lenient=True)
            break
        except BackendError as exc:
            if schema is None:
                schema = json.loads(spec.text)
            relaxed = llguidance_relaxed(schema, str(exc))
            if relaxed is None:
                return None, str(exc)
            schema, paths = relaxed
            dropped += paths
            spec = replace(spec, text=canonical_json(schema))
    else:
        return None, "llguidance refuses it"
    seconds = time.perf_counter() - start
    if schema is None and compiled.warnings:
        schema = json.loads(spec.text)
    paths = llguidance_unenforced(schema, compiled.warnings)
    if paths is None:
        return None, "; ".join(compiled.warnings)
    paths = dropped + paths
    payload = backend.serialize(compiled, spec, seconds)
    if not paths:
        return Compiled(backend.name, "auto: llguidance enforces every keyword of this schema",
                        (), payload), ""
    notes = list(compiled.warnings)
    if dropped:
        notes.append(f"refused even leniently, relaxed: {', '.join(dropped)}")
    reason = ("auto: llguidance enforces every keyword of this schema but those it reports "
              f"({'; '.join(notes)})")
    return Compiled(backend.name, _first_line(reason), tuple(paths), payload), notes[0]


def _with(backend, spec, reason: str) -> Compiled:
    unenforced = ()
    if backend.name == XGRAMMAR and spec.kind == "json_schema":
        unenforced = tuple(find_unenforced(json.loads(spec.text)))
        if unenforced and spec.options.strict:
            raise StrictRefused(
                "schema uses keywords the compiled grammar does not enforce: "
                f"{', '.join(unenforced)} (llguidance refuses this schema too, or xgrammar "
                "was forced; unset options.strict to accept an approximation)")
    start = time.perf_counter()
    try:
        compiled = backend.compile(spec)
    except (MemoryError, BackendError):
        raise
    except Exception as exc:  # xgrammar raises RuntimeError and its own types
        raise BackendError(str(exc).strip(), backend.name) from None
    seconds = time.perf_counter() - start
    return Compiled(backend.name, reason, unenforced, backend.serialize(compiled, spec, seconds))


def _first_line(message: str) -> str:
    line = message.strip().splitlines()[0] if message.strip() else "llguidance refuses it"
    return line if len(line) <= 200 else line[:197] + "..."
