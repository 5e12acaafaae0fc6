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

And what the engine's drafts (gpu_worker.guided.drafts, `--draft-tokens`) would give on the
same outputs, the model agreeing with every one of them but guessed tokens checked for real:
the instances stream through one DraftTables as a rank's commits would fill it (keyed by
schema; the first `--warm` instances fill it and are not counted), and each row follows the
engine's pipeline: where its guess after the committed tokens has two tokens or more and its
first is the pending token, the step feeds the rest and yields the samples up to the first
wrong guess plus one; the next step, launched before that is known, yields one more token if
every guess held and nothing otherwise; a row then drafts again from its next commit.
The `every step` column is the same tables and guesses with a draft at every step and no step
lost to the pipeline (each step's guess made from every token before it): what drafting at
every step could reach at most with these tables, the next forward's guess made before the
last one is checked.

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
from gpu_worker.guided.drafts import DraftTables  # noqa: E402

LAYOUTS = {"compact": (",", ":"), "spaced": (", ", ": ")}
STOP = (1 << 24) - 1  # the stop token in the drafts column: an id no tokenizer here uses


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


def _kept(guess: list[int], tokens: list[int], produced: int) -> int | None:
    """The samples after the first that count when a step feeds `guess` after the pending
    token `tokens[produced - 1]` (each guess before them held); None when the step drafts
    nothing (fewer than two guesses, or a wrong guess of the pending token)."""
    if len(guess) < 2 or guess[0] != tokens[produced - 1]:
        return None
    kept = 0
    while kept + 1 < len(guess) and produced + kept < len(tokens) \
            and guess[kept + 1] == tokens[produced + kept]:
        kept += 1
    return kept


def draft_steps(tables: DraftTables, key: str, tokens: list[int], draft_tokens: int) -> int:
    """Steps of one output under the engine's drafts (see the module docstring); the first
    token comes from the prefill step."""
    produced, steps = 1, 1
    while produced < len(tokens):
        steps += 1
        # committed: tokens[:produced - 1]; on the device: tokens[produced - 1]
        guess = tables.propose(key, tokens[:produced - 1], 1 + draft_tokens)
        kept = _kept(guess, tokens, produced)
        if kept is None:
            produced += 1
            continue
        produced += kept + 1
        if produced < len(tokens):
            steps += 1  # launched before the guesses are checked
            produced += kept + 1 == len(guess)
    return steps


def every_step(tables: DraftTables, key: str, tokens: list[int], draft_tokens: int) -> int:
    """Steps of one output with a draft at every step and no pipeline loss (the bound of the
    `every step` column); the first token comes from the prefill step."""
    produced, steps = 1, 1
    while produced < len(tokens):
        steps += 1
        guess = tables.propose(key, tokens[:produced - 1], 1 + draft_tokens)
        produced += (_kept(guess, tokens, produced) or 0) + 1
    return steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--families", default="long,short")
    parser.add_argument("--instances", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="GrammarOptions.strict")
    parser.add_argument("--fixed-order", action="store_true",
                        help="GrammarOptions.fixed_property_order")
    parser.add_argument("--draft-tokens", type=int, default=2,
                        help="the engine's --draft-tokens for the drafts column")
    parser.add_argument("--warm", type=int, default=50,
                        help="instances that fill the draft tables before counting")
    ns = parser.parse_args(argv)
    options = {k: True for k, on in (("strict", ns.strict),
                                     ("fixed_property_order", ns.fixed_order)) if on}
    from bench.grammars import model_dir
    from grammar_service.vocab import load_vocab

    judge = Judge(load_vocab(model_dir(ns.tokenizer)))
    print(f"vocabulary {judge.vocab.model_vocab_size} tokens, {ns.instances} instances per row; "
          f"options {options or 'default'}; steps per output token (the stop token counted)")
    print(f"{'family':8} {'layout':8} {'tokens':>7} {'with a draft':>13} {'draft bound':>12} "
          f"{'drafts':>8} {'every step':>11}")
    for family in ns.families.split(","):
        schemas = [json.loads(s) for s in load_schemas(family)]
        builds = [judge.build(s, "gramserve", **options) for s in schemas]
        if any(not b.ok or b.backend != "llguidance" for b in builds):
            raise SystemExit(f"{family}: a schema does not compile on llguidance")
        for layout, separators in LAYOUTS.items():
            rng = random.Random(ns.seed)
            total = drafted = draft = bound = 0
            tables, counted, engine = DraftTables(), 0, 0
            for n in range(ns.warm + ns.instances):
                i = rng.randrange(len(schemas))
                text = json.dumps(instance(schemas[i], rng), separators=separators)
                tokens = judge.vocab.encode(text, add_special_tokens=False)
                if n >= ns.warm:
                    draftable = walk(judge, builds[i], tokens)
                    total += len(draftable)
                    drafted += sum(1 for d in draftable if d)
                    draft += steps(draftable)
                    engine += draft_steps(tables, str(i), tokens + [STOP], ns.draft_tokens)
                    bound += every_step(tables, str(i), tokens + [STOP], ns.draft_tokens)
                    counted += len(tokens) + 1
                tables.observe(str(i), tokens + [STOP], 0)
            print(f"{family:8} {layout:8} {total:7d} {drafted / total:13.3f} "
                  f"{draft / total:12.3f} {engine / counted:8.3f} {bound / counted:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
