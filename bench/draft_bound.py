"""How few steps per output token exact grammar shortcuts could reach: an upper bound.

    PYTHONPATH=$PWD python bench/draft_bound.py --tokenizer .bench/tok150k.json \
        [--families long,short] [--instances 200] [--strict] [--fixed-order]

For valid instances of a family's schemas (as bench/train_json.py writes them: the answers of
a model that follows the schema), tokenized whole as the model emits them, the instance is
walked through the schema's matcher (gramserve's compile, auto backend); before each token,
llguidance's forced bytes (`compute_ff_bytes`: what the grammar allows and nothing else) are
compared with the instance's next tokens. A token is draftable where its bytes, with the
draftable tokens before it, are a prefix of the forced bytes. Printed per family and layout
(compact, or `json.dumps` spacing):
- the share of positions with at least one draftable token;
- the bound with speculative drafts of the forced bytes: one step verifies every draftable
  token at once and samples one more, the model accepting every draft (no real model does
  better), i.e. steps = positions reached by jumping `1 + draftable` tokens at a time.
The stop token counts as an output token.

By default the schemas compile as a client sends them with default options (JSON Schema
semantics: any property order, unlisted properties allowed, so no key is forced); `--strict`
and `--fixed-order` compile them as OpenAI's strict structured outputs generate (unlisted
properties forbidden, listed ones in the schema's order), where keys are forced bytes too.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.schema_verdicts import Judge  # noqa: E402
from bench.train_json import instance  # noqa: E402
from gateway.loadgen import load_schemas  # noqa: E402

LAYOUTS = {"compact": (",", ":"), "spaced": (", ", ": ")}


def walk(judge: Judge, build, tokens: list[int]) -> list[int]:
    """Per position of `tokens` + the stop token: the draftable tokens from there."""
    pieces = [judge.vocab.decode([t]).encode() for t in tokens]
    m = build.matcher
    m.reset()
    ll = m.llmatcher
    draftable = []
    for k, token in enumerate(tokens):
        forced = ll.compute_ff_bytes()
        covered, n = b"", 0
        for piece in pieces[k:]:
            if not forced.startswith(covered + piece):
                break
            covered += piece
            n += 1
        draftable.append(n)
        if not m.accept_token(token):
            raise SystemExit("a valid instance refused")
    return draftable + [0]


def steps(draftable: list[int]) -> int:
    at = n = 0
    while at < len(draftable):
        n += 1
        at += draftable[at] + 1
    return n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--families", default="long,short")
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="GrammarOptions.strict")
    parser.add_argument("--fixed-order", action="store_true",
                        help="GrammarOptions.fixed_property_order")
    ns = parser.parse_args(argv)
    options = {k: True for k, on in (("strict", ns.strict),
                                     ("fixed_property_order", ns.fixed_order)) if on}
    from bench.grammars import model_dir
    from grammar_service.vocab import load_vocab

    judge = Judge(load_vocab(model_dir(ns.tokenizer)))
    print(f"vocabulary {judge.vocab.model_vocab_size} tokens, {ns.instances} instances per row; "
          f"options {options or 'default'}; steps per output token (the stop token counted)")
    print(f"{'family':8} {'layout':8} {'tokens':>7} {'with a draft':>13} {'draft bound':>12}")
    for family in ns.families.split(","):
        schemas = [json.loads(s) for s in load_schemas(family)]
        builds = [judge.build(s, "gramserve", **options) for s in schemas]
        if any(not b.ok or b.backend != "llguidance" for b in builds):
            raise SystemExit(f"{family}: a schema does not compile on llguidance")
        for layout, separators in LAYOUTS.items():
            rng = random.Random(ns.seed)
            total = drafted = draft = 0
            for _ in range(ns.instances):
                i = rng.randrange(len(schemas))
                text = json.dumps(instance(schemas[i], rng), separators=separators)
                tokens = judge.vocab.encode(text, add_special_tokens=False)
                draftable = walk(judge, builds[i], tokens)
                total += len(draftable)
                drafted += sum(1 for d in draftable if d)
                draft += steps(draftable)
            print(f"{family:8} {layout:8} {total:7d} {drafted / total:13.3f} "
                  f"{draft / total:12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
