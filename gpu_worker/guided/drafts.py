"""Drafted tokens: guesses of a guided row's next tokens that the model checks in one step.

A guided row sampled with temperature only (the accept-first rows) feeds, besides its newest
token, a guess of the tokens after it, and gets logits at every position. Each position is
sampled as the row would sample it one step at a time (its own noise index, unmasked, the
token then checked by the row's matcher like any accept-first token), and the samples are kept
while each equals the guess fed after it: sample j saw exactly the context a step-by-step
decode would have given it, so the output is the same tokens with fewer steps. A wrong guess
costs positions of the forward and, the row's next forward being launched before the guess is
checked, that one forward for the row (gpu_worker.control.engine has the pipeline).

The guesses come from what the rank's earlier outputs of the same grammar did next after the
same last few tokens (an n-gram table per grammar): structured outputs of one schema repeat
their keys, punctuation and enum values, which is most of what a fine-tuned model writes
the same way each time. The tables are filled from committed tokens only, in commit order,
so every rank of a group holds the same tables and plans the same steps (I2/I3).
"""

from __future__ import annotations

from collections import OrderedDict

# Contexts are keyed by their tokens packed into one int (a token id below 2**_BITS; each
# order has its own dict): a tuple per context cost twice the time on the engine's thread.
_BITS = 24
# A token before every output, so that its first tokens are guessed too (`{"`, a first key).
START = (1 << _BITS) - 2


class DraftTables:
    """Per grammar key, the token that last followed each context of 1..`order` tokens.

    `max_grammars` tables at most (the least recently used is dropped); a table past
    `max_entries` contexts of one length starts again empty. Both rules depend only on the
    calls, so ranks that make the same calls hold the same tables. Every output is read as
    if it began with START: the first tokens are guessed from the output's start."""

    def __init__(self, order: int = 4, max_grammars: int = 256, max_entries: int = 1 << 16):
        if not 1 <= order <= 4:
            raise ValueError("order must be in [1, 4]")
        self.order = order
        self.max_grammars = max_grammars
        self.max_entries = max_entries
        # key -> one dict per context length (1..order): packed context -> next token
        self._tables: OrderedDict[str, list[dict[int, int]]] = OrderedDict()

    def _table(self, key: str) -> list[dict[int, int]]:
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = [{} for _ in range(self.order)]
            if len(self._tables) > self.max_grammars:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
            if len(table[-1]) > self.max_entries:  # the longest contexts are the most
                for by_length in table:
                    by_length.clear()
        return table

    def observe(self, key: str, tokens: list[int], start: int) -> None:
        """Learn from `tokens[start:]`, each after the tokens before it in `tokens` (token ids
        in [0, 2**24)). Written out per context length: the engine's thread runs this for
        every committed token."""
        if start >= len(tokens):
            return
        table = self._table(key)
        if start < self.order:  # the first tokens follow the start too
            tokens, start = [START, *tokens], start + 1
        one = table[0]
        two = table[1] if self.order > 1 else None
        three = table[2] if self.order > 2 else None
        four = table[3] if self.order > 3 else None
        for j in range(max(start, 1), len(tokens)):
            token = tokens[j]
            context = tokens[j - 1]
            one[context] = token
            if two is None or j < 2:
                continue
            context |= tokens[j - 2] << _BITS
            two[context] = token
            if three is None or j < 3:
                continue
            context |= tokens[j - 3] << 2 * _BITS
            three[context] = token
            if four is not None and j >= 4:
                four[context | tokens[j - 4] << 3 * _BITS] = token

    def propose(self, key: str, tokens: list[int], n: int) -> list[int]:
        """Up to `n` guessed tokens to follow `tokens`: each the one that last followed the
        longest context seen (of up to `order` tokens), the guesses so far included. Empty
        when the grammar has no table or no context matches. Written out per context length,
        as `observe` is (a loop over lengths cost twice the time on the engine's thread)."""
        table = self._tables.get(key)
        if not table:
            return []
        one, two, three, four = (*table, None, None, None)[:4]
        # The context, newest token last: d, then c, b, a before it (None: none that far back,
        # or past the order).
        context = tokens[-4:] if len(tokens) >= 4 else [START, *tokens]
        a, b, c, d = [None] * (4 - len(context)) + context
        out: list[int] = []
        while len(out) < n:
            found = one.get(d)
            if found is None:
                break
            if two is not None and c is not None:
                packed = d | c << _BITS
                token = two.get(packed)
                if token is not None:
                    found = token
                    if three is not None and b is not None:
                        packed |= b << 2 * _BITS
                        token = three.get(packed)
                        if token is not None:
                            found = token
                            if four is not None and a is not None:
                                token = four.get(packed | a << 3 * _BITS)
                                if token is not None:
                                    found = token
            out.append(found)
            a, b, c, d = b, c, d, found
        return out
