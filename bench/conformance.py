"""The official JSON Schema Test Suite through gramserve's matchers, per keyword and per mode.

    PYTHONPATH=$PWD python bench/conformance.py [--model DIR] [--out FILE] [--cases]

Every test case of tests/data/json_schema_test_suite (draft 2020-12 and draft 7; see its
README for the commit and what is included) is run in three modes, gramserve's choice,
xgrammar forced and llguidance forced (bench/schema_verdicts.py): the schema through the
compile path, the instance token by token through a rank's matcher. Prints one row per
keyword file with, per mode, `pass/total` and the failures by kind: valid rejected (vr),
invalid accepted but reported unenforced (rep), invalid accepted silently (SIL), schema
refused with an error (ref). `--cases` also lists every case that is not a pass.
tests/test_conformance.py asserts on the same run: no silent acceptance under gramserve's
choice, and the choice passes at least as many cases as either backend alone.

The model: the embedded default model (4k-token byte-level BPE) unless --model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.schema_verdicts import MODES, VERDICTS, Judge  # noqa: E402

SUITE = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schema_test_suite"
DRAFTS = ("draft2020-12", "draft7")
# The `$schema` of each folder's dialect, given to its schemas that do not name one (the
# suite leaves it out; a schema without one is read as 2020-12).
DIALECTS = {"draft2020-12": "https://json-schema.org/draft/2020-12/schema",
            "draft7": "http://json-schema.org/draft-07/schema#"}
_SHORT = {"pass": "pass", "valid_rejected": "vr", "invalid_reported": "rep",
          "invalid_silent": "SIL", "refused": "ref"}


@dataclass(frozen=True)
class Case:
    """One test of the suite: where it is, its schema, the instance and its validity."""

    draft: str
    keyword: str  # the file's name: a keyword, or "format-<name>"
    group: str
    description: str
    schema: object
    data: object
    valid: bool

    @property
    def name(self) -> str:
        return f"{self.draft}/{self.keyword}: {self.group} / {self.description}"


@dataclass(frozen=True)
class Outcome:
    """A case's verdict in one mode, with the backend used and what was reported/refused."""

    case: Case
    mode: str
    verdict: str
    backend: str
    detail: str


def load_cases(suite: Path = SUITE) -> list[Case]:
    """Every case of the included files, in file order."""
    cases = []
    for draft in DRAFTS:
        for path in sorted((suite / draft).glob("*.json")):
            for group in json.loads(path.read_text()):
                schema = group["schema"]
                if isinstance(schema, dict) and "$schema" not in schema:
                    # The draft's folder is the schema's dialect: said as a client says it.
                    schema = {"$schema": DIALECTS[draft], **schema}
                for test in group["tests"]:
                    cases.append(Case(draft, path.stem, group["description"],
                                      test["description"], schema, test["data"],
                                      test["valid"]))
    return cases


def run(judge: Judge, cases: list[Case]) -> list[Outcome]:
    """Every case in every mode; each schema is compiled once per mode."""
    out = []
    builds: dict[tuple[str, str], object] = {}
    for case in cases:
        key = json.dumps(case.schema, sort_keys=True) + case.draft
        for mode in MODES:
            build = builds.get((key, mode))
            if build is None:
                build = builds[(key, mode)] = judge.build(case.schema, mode)
            verdict = judge.verdict(build, case.data, case.valid)
            detail = build.error if not build.ok else ", ".join(build.unenforced)
            out.append(Outcome(case, mode, verdict, build.backend, detail))
    return out


def tally(outcomes: list[Outcome]) -> dict[tuple[str, str], Counter]:
    """{(keyword, mode): Counter of verdicts}; keyword "all" sums every file, both drafts."""
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for o in outcomes:
        counts[(o.case.keyword, o.mode)][o.verdict] += 1
        counts[("all", o.mode)][o.verdict] += 1
    return counts


def table(outcomes: list[Outcome]) -> str:
    """The per-keyword, per-mode table (both drafts summed per keyword file)."""
    counts = tally(outcomes)
    keywords = sorted({k for k, _ in counts if k != "all"}) + ["all"]
    head = f"{'keyword':<22}" + "".join(f"| {m:<33}" for m in MODES)
    sub = " " * 22 + "".join("| pass/total   vr  rep  SIL  ref   " for _ in MODES)
    lines = [head, sub, "-" * len(sub)]
    for kw in keywords:
        row = f"{kw:<22}"
        for mode in MODES:
            c = counts[(kw, mode)]
            total = sum(c.values())
            row += (f"| {c['pass']:>4}/{total:<6} {c['valid_rejected']:>4} "
                    f"{c['invalid_reported']:>4} {c['invalid_silent']:>4} {c['refused']:>4}   ")
        lines.append(row.rstrip())
    return "\n".join(lines)


def failures(outcomes: list[Outcome]) -> str:
    """One line per (case, mode) that is not a pass."""
    return "\n".join(f"{_SHORT[o.verdict]:<4} {o.mode:<10} {o.backend or '-':<10} "
                     f"{o.case.name} [{'valid' if o.case.valid else 'invalid'}] {o.detail}"
                     for o in outcomes if o.verdict != "pass")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: embedded)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--cases", action="store_true", help="list every case not passing")
    ns = parser.parse_args(argv)
    from grammar_service.default_model import resolve_model
    from grammar_service.vocab import load_vocab

    judge = Judge(load_vocab(resolve_model(ns.model)))
    cases = load_cases()
    start = time.perf_counter()
    outcomes = run(judge, cases)
    seconds = time.perf_counter() - start
    report = (f"JSON Schema Test Suite: {len(cases)} cases x {len(MODES)} modes in "
              f"{seconds:.1f} s; verdicts: {', '.join(VERDICTS)}\n" + table(outcomes))
    if ns.cases:
        report += "\n\n" + failures(outcomes)
    print(report)
    if ns.out:
        ns.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
