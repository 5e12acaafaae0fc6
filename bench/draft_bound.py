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
engine's pipeline: a guess made at a commit from the committed tokens; where its first token
is the pending sample, the next step feeds the rest and yields the samples up to the first
wrong guess plus one; the step after, launched before that is known, yields one more token
if every guess held and nothing otherwise, and the row then feeds its last committed token
and drafts again after that. The `chained` column is drafting at every step through the
same pipeline (each guess continuing from the guesses the launched forward feeds; a row
feeding its last committed token again drafts after it too): built and measured on the
serving path at e369638 (fewer steps, no more tokens/s on a host-bound rank), not kept.
The `every step` column is the same tables with a draft at every step and no step lost to
the pipeline (each step's guess made from every token before the pending one): what drafting
at every step could reach at most with these tables.

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


def _held(fed: list[int], tokens: list[int], at: int) -> int:
    """How many of the guesses `fed` after the pending token match the output from `at` on:
    the samples after the first that count."""
    match = 0
    while match < len(fed) and at + match < len(tokens) and fed[match] == tokens[at + match]:
        match += 1
    return match


def draft_steps(tables: DraftTables, key: str, tokens: list[int], draft_tokens: int,
                chained: bool = False) -> int:
    """Steps of one output under the engine's drafts (see the module docstring), or with
    `chained` under drafts at every step; the first token comes from the prefill step."""
    n = len(tokens)
    steps, committed = 1, 0
    flight = kept = 1  # samples of the last sampling point on their way, of which the commit keeps
    draft = tables.propose(key, [], 1 + draft_tokens)  # made at the row's start
    while committed + kept < n:
        steps += 1
        # The plan: a row whose one sample is on its way (chained: any) feeds it and its
        # draft's guesses; chained, a row feeding its last committed token again (after a
        # void forward) feeds the guess after it whole and guesses on at once.
        if chained and not flight:
            guess = [tokens[committed - 1], *draft[:draft_tokens]]
        else:
            guess = draft if flight == 1 or chained else []
        fed = guess[1:] if len(guess) >= 2 else []
        if chained and not flight and fed:
            draft = tables.propose(key, tokens[:committed] + fed, 1 + draft_tokens)
        void = kept < flight  # the commit below cuts the row: this forward is void for it
        committed += kept
        if flight and (chained or not fed or void):
            # The commit guesses again: from the committed tokens, and chained from the
            # guesses fed now too unless it cut the row.
            draft = tables.propose(key, tokens[:committed] + (fed if chained and not void
                                                              else []), 1 + draft_tokens)
        elif flight:
            draft = []
        if void:  # the row samples nothing; its next forward feeds its last committed token
            flight = kept = 0
            continue
        if fed and guess[0] != tokens[committed - 1]:
            # The token it fed first was not the one guessed: only its first position is
            # sampled (the guesses after it are void); chained, it guesses again from there.
            if chained:
                draft = tables.propose(key, tokens[:committed], 1 + draft_tokens)
            fed = []
        flight, kept = 1 + len(fed), 1 + _held(fed, tokens, committed)
    return steps


def every_step(tables: DraftTables, key: str, tokens: list[int], draft_tokens: int) -> int:
    """Steps of one output with a draft at every step and no pipeline loss (the bound of the
    `every step` column); the first token comes from the prefill step."""
    produced, steps = 1, 1
    while produced < len(tokens):
        steps += 1
        # The pending token tokens[produced - 1] is fed, then guess[1:]; each sample counts
        # while the guesses before it held.
        fed = tables.propose(key, tokens[:produced - 1], 1 + draft_tokens)[1:]
        produced += _held(fed, tokens, produced) + 1
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
          f"{'drafts':>8} {'chained':>8} {'every step':>11}")
    for family in ns.families.split(","):
        schemas = [json.loads(s) for s in load_schemas(family)]
        builds = [judge.build(s, "gramserve", **options) for s in schemas]
        if any(not b.ok or b.backend != "llguidance" for b in builds):
            raise SystemExit(f"{family}: a schema does not compile on llguidance")
        for layout, separators in LAYOUTS.items():
            rng = random.Random(ns.seed)
            total = drafted = draft = bound = chained = 0
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
                    chained += draft_steps(tables, str(i), tokens + [STOP], ns.draft_tokens,
                                           chained=True)
                    bound += every_step(tables, str(i), tokens + [STOP], ns.draft_tokens)
                    counted += len(tokens) + 1
                tables.observe(str(i), tokens + [STOP], 0)
            print(f"{family:8} {layout:8} {total:7d} {drafted / total:13.3f} "
                  f"{draft / total:12.3f} {engine / counted:8.3f} {chained / counted:8.3f} "
                  f"{bound / counted:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
