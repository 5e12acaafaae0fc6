"""Where the mask tail comes from: one schema feature at a time, xgrammar vs llguidance.

    PYTHONPATH=$PWD python bench/mask_tail.py [--tokenizer .bench/tok150k.json] [--reps N]

For each variant, the grammar is compiled as gramserve compiles it (xgrammar forced, with
gramserve's rewrites and bounded whitespace, or llguidance), then one instance is walked
token by token and the mask before every token is filled into a one-row bitmask, N times;
printed: the mask time p50 / p99 / max in microseconds, and the position of the slowest mask
in the instance text. Variants differ from the baseline in one thing only, so the table says
which feature makes the tail: a length-bounded string (rewritten into a bounded repetition
for xgrammar), its bound, the whitespace policy, a long free string, a string restricted by a
`pattern` or a `format`. llguidance runs twice: with gramserve's slices
(grammar_service.backends.WORD_SLICES before llguidance's general ones) and with llguidance's
general slices alone (or, with `--versus 'REGEX;REGEX'`, those before the general ones).

    PYTHONPATH=$PWD python bench/mask_tail.py --corpus .bench/schemastore-138.json ...

walks every instance of a bench/grammars.py corpus under gramserve's choice instead, both
slice sets interleaved schema by schema (the faster of two walks per mask), and prints the
mask p50 / p90 / p99 / max of each, the masks over 300 us, and how many instances each
accepts (the same: slices change no mask). `--worst N` adds the N schemas with the most
masks over 300 us, each with its slowest mask and the text before it (where the tail is).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.schema_verdicts import Judge, instance_text  # noqa: E402
from protos import common_pb2  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, again and again. " * 3


def _obj(string_schema: dict) -> dict:
    return {"type": "object", "properties": {"id": {"type": "integer"},
                                             "text": string_schema},
            "required": ["id", "text"]}


VARIANTS = {
    "free string": (_obj({"type": "string"}), {}),
    "maxLength 256": (_obj({"type": "string", "maxLength": 256}), {}),
    "maxLength 64": (_obj({"type": "string", "maxLength": 64}), {}),
    "maxLength 1000 (not rewritten)": (_obj({"type": "string", "maxLength": 1000}), {}),
    "pattern": (_obj({"type": "string", "pattern": "^[A-Za-z ,.]+$"}), {}),
    "pattern identifier": (_obj({"type": "string", "pattern": "^[a-zA-Z0-9_]+$"}), {},
                           "build_step_" * 6 + "42"),
    "pattern lower-case": (_obj({"type": "string", "pattern": "^[a-z]+$"}), {},
                           "abcdefghijklmnopqrstuvwxyz" * 2),
    "pattern URL, maxLength 2000": (_obj({"type": "string", "maxLength": 2000,
                                          "pattern": "^([Hh][Tt][Tt][Pp][Ss]?)://.+$"}), {},
                                    "https://github.com/microsoft/terminal/blob/main/LICENSE"),
    "pattern URL, no bound": (_obj({"type": "string",
                                    "pattern": "^([Hh][Tt][Tt][Pp][Ss]?)://.+$"}), {},
                              "https://github.com/microsoft/terminal/blob/main/LICENSE"),
    "format uri": (_obj({"type": "string", "format": "uri"}), {},
                   "https://example.com/docs/schemas/config.json?version=2&lang=en"),
    "format date-time": (_obj({"type": "string", "format": "date-time"}), {},
                         "2024-05-06T07:08:09.123Z"),
    "free string, whitespace any": (_obj({"type": "string"}),
                                    {"whitespace": common_pb2.WHITESPACE_ANY}),
    "free string, compact": (_obj({"type": "string"}),
                             {"whitespace": common_pb2.WHITESPACE_COMPACT}),
}


def time_masks(judge: Judge, build, text: str, reps: int) -> tuple[list[float], int, int]:
    """(mask seconds of every position, all reps; position of the slowest; tokens)."""
    tokens = judge.vocab.encode(text, add_special_tokens=False)
    bitmask = torch.zeros((1, judge.words), dtype=torch.int32)
    times, worst, worst_at = [], 0.0, 0
    for _ in range(reps):
        m = build.matcher
        m.reset()
        for i, token in enumerate(tokens):
            start = time.perf_counter()
            m.fill_next_token_bitmask(bitmask, 0)
            t = time.perf_counter() - start
            times.append(t)
            if t > worst:
                worst, worst_at = t, i
            assert m.accept_token(token)
    return times, worst_at, len(tokens)


def _other_slices(vocab, before: list[str]):
    """`vocab` with `before` and then llguidance's general slices in its cached llguidance
    tokenizer (the same vocabulary; only the bench swaps it)."""
    import llguidance

    general = llguidance.LLTokenizer.general_slices()
    tok = vocab.llguidance_tokenizer().with_slices(general[:1] + before + general[1:])
    vocab._cache["llguidance_tokenizer"] = tok
    return vocab


def corpus(judge: Judge, general: Judge, path: Path, worst: int = 0,
           other: str = "general slices") -> int:
    """Every mask of every instance of the corpus at `path`, gramserve's choice, with both
    slice sets (interleaved per instance; per mask the faster of two walks). `worst`: also
    the schemas with the most masks over 300 us (gramserve's slices), each with the text
    before its slowest mask."""
    data = json.loads(path.read_text())
    slow: dict[str, list[tuple[float, str]]] = {}
    times = {"gramserve slices": [], other: []}
    accepted = dict.fromkeys(times, 0)
    bitmask = torch.zeros((1, judge.words), dtype=torch.int32)
    for entry in data["schemas"]:
        builds = {"gramserve slices": (judge, judge.build(entry["schema"], "gramserve")),
                  other: (general, general.build(entry["schema"], "gramserve"))}
        if not all(b.ok for _, b in builds.values()):
            continue
        for instance, _ in entry["instances"]:
            tokens = [*judge.vocab.encode(instance_text(instance), add_special_tokens=False),
                      judge.eos]
            best = {}
            for rep in range(2):
                for name, (_, build) in builds.items():
                    m, walk, ok = build.matcher, [], True
                    m.reset()
                    for token in tokens:
                        start = time.perf_counter()
                        m.fill_next_token_bitmask(bitmask, 0)
                        walk.append(time.perf_counter() - start)
                        if not m.accept_token(token):
                            ok = False
                            break
                    if rep == 0:
                        accepted[name] += ok and m.is_terminated()
                    best[name] = [min(a, b) for a, b in zip(best.get(name, walk), walk, strict=True)]
            for name in times:
                times[name] += best[name]
            for i, t in enumerate(best["gramserve slices"]):
                if t > 3e-4:
                    text = judge.vocab.decode(tokens[:i])[-60:]
                    slow.setdefault(entry["name"], []).append((t, text))
    print(f"{path.name}: {data.get('source', '')} {data.get('commit', '')}, vocabulary "
          f"{judge.vocab.model_vocab_size} tokens, one thread; mask p50 / p90 / p99 / max us")
    for name, values in times.items():
        values.sort()
        n = len(values)
        q = " / ".join(f"{1e6 * values[min(n - 1, int(f * n))]:.1f}" for f in (.5, .9, .99, 1))
        print(f"{name:<18} {q}   masks {n}, over 300 us {sum(v > 3e-4 for v in values)}, "
              f"instances accepted {accepted[name]}")
    if worst:
        print("\nschemas with the most masks over 300 us (gramserve slices), the slowest "
              "mask's us and the text before it:")
        for name, masks in sorted(slow.items(), key=lambda kv: -len(kv[1]))[:worst]:
            t, text = max(masks)
            print(f"{len(masks):5d}  {name:<36} {1e6 * t:7.0f}  ...{text!r}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--corpus", type=Path, default=None,
                        help="a bench/grammars.py --export-corpus file: all its masks instead")
    parser.add_argument("--worst", type=int, default=0,
                        help="with --corpus: the N schemas with the most masks over 300 us")
    parser.add_argument("--versus", type=lambda text: [r for r in text.split(";") if r],
                        default=[], metavar="REGEX;REGEX",
                        help="the other column's slices before llguidance's general ones "
                             "(default none: the general ones alone)")
    ns = parser.parse_args(argv)
    from bench.grammars import model_dir
    from grammar_service.vocab import load_vocab

    model = model_dir(ns.tokenizer)
    judge = Judge(load_vocab(model))
    general = Judge(_other_slices(load_vocab(model), ns.versus))
    if ns.corpus is not None:
        return corpus(judge, general, ns.corpus, ns.worst,
                      "versus slices" if ns.versus else "general slices")
    print(f"vocabulary {judge.vocab.model_vocab_size} tokens, one thread, {ns.reps} walks; "
          "mask p50 / p99 / max us (slowest at token i of n); llguidance with gramserve's "
          "slices, then with its general slices alone")
    for name, (schema, options, *value) in VARIANTS.items():
        row = f"{name:<34}"
        for mode, j in (("xgrammar", judge), ("llguidance", judge), ("general", general)):
            build = j.build(schema, "llguidance" if mode == "general" else mode, **options)
            if not build.ok:
                row += f"| {mode}: {build.error[:40]:<40}"
                continue
            instance = {"id": 7, "text": value[0] if value else
                        TEXT[:60] if "64" in name else TEXT}
            text = (json.dumps(instance, separators=(",", ":")) if "compact" in name
                    else instance_text(instance))
            times, at, n = time_masks(judge, build, text, ns.reps)
            times.sort()
            p = [times[len(times) // 2], times[int(0.99 * len(times))], times[-1]]
            row += (f"| {mode} {' / '.join(f'{1e6 * v:.0f}' for v in p)} "
                    f"(at {at} of {n}) ")
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
