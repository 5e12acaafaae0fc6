"""Incremental, UTF-8-safe detokenisation and stop-string matching.

Byte-level BPE tokens can end in the middle of a UTF-8 character, so text is decoded from
the raw token bytes with an incremental decoder that holds an incomplete character back
until the bytes that finish it arrive. Stop strings can span tokens, so the last
`len(longest stop) - 1` characters are held back until they can no longer begin a stop.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable


class IncrementalDetokenizer:
    """Turns token ids into text pieces that never split a UTF-8 character.

    `token_bytes(id)` gives a token's raw bytes (b"" for special tokens). Bytes that are not
    valid UTF-8 become U+FFFD, as in `bytes.decode(errors="replace")`.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Iterable[int]) -> str:
        """Decode more tokens; return the text they complete (possibly "")."""
        data = b"".join(self._token_bytes(int(t)) for t in token_ids)
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        """The end of the stream: return what an incomplete trailing character decodes to."""
        return self._decoder.decode(b"", final=True)


class StopStringFilter:
    """Finds the first stop string in a growing text and decides what may be emitted.

    State: the whole text seen and how much of it was emitted. After a match, `stopped`
    is True and further input is ignored.
    """

    def __init__(self, stops: Iterable[str], include_stop: bool = False):
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._include = include_stop
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        """Add decoded text; return the part that is now safe to emit."""
        if self.stopped or not piece:
            return ""
        start = max(0, len(self._text) - self._hold)
        self._text += piece
        end = self._first_stop_end(start)
        if end is not None:
            self.stopped = True
        else:
            end = max(self._emitted, len(self._text) - self._hold)
        out = self._text[self._emitted:end]
        self._emitted = end
        return out

    def flush(self) -> str:
        """The end of the stream: return the held-back text (nothing after a stop)."""
        if self.stopped:
            return ""
        out = self._text[self._emitted:]
        self._emitted = len(self._text)
        return out

    def _first_stop_end(self, start: int) -> int | None:
        """End of the emitted text for the earliest stop found at or after `start`."""
        best: tuple[int, int] | None = None
        for stop in self._stops:
            i = self._text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, i + len(stop))
        if best is None:
            return None
        return best[1] if self._include else best[0]
