"""`tool_choice: "auto"`: the model answers in text or calls tools in its chat template's own
tool-call format, and the calls are parsed back out of the text.

A format is recognised from the chat template (`tool_format`); the constraint is xgrammar's
built-in structural tag for that format (`auto_structural_tag`): free text until a trigger
(`<tool_call>`, `{"name": `), then a call whose name is one of the tools and whose arguments
follow that function's `parameters` schema, then free text again. `ToolCallParser` splits the
generated text into content and calls, incrementally, so a stream and a whole response give
the same calls. Plain Python but for building the tag with xgrammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    """One chat-template family's tool-call syntax.

    A call is `open`, optional whitespace, a JSON object {"name": ..., `args_key`: {...}},
    optional whitespace, `close`; it starts where `trigger` appears in the text.
    `xgrammar_name` is the key of xgrammar's built-in structural tag for the format.
    """

    name: str
    xgrammar_name: str
    trigger: str
    open: str
    close: str
    args_key: str
    # How the template shows it speaks this format (any of these substrings).
    markers: tuple[str, ...]


FORMATS = (
    # Qwen2.5, Qwen3, Hermes and the many templates that copied them.
    ToolFormat("hermes", "qwen_3", "<tool_call>", "<tool_call>", "</tool_call>", "arguments",
               ("<tool_call>",)),
    # Llama 3.1 / 3.2 / 3.3: a bare JSON object (the template asks for `"parameters"`).
    ToolFormat("llama3_json", "llama", '{"name": ', "", "", "parameters",
               ('{"name": function name, "parameters": dictionary of argument name',)),
)


def tool_format(chat_template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template speaks, None when it speaks none gramserve knows
    (or renders no tools at all)."""
    if not chat_template or "tools" not in chat_template:
        return None
    for fmt in FORMATS:
        if any(m in chat_template for m in fmt.markers):
            return fmt
    return None


def auto_structural_tag(fmt: ToolFormat, functions: dict[str, dict], *, parallel: bool,
                        max_whitespace: int | None, reasoning: bool) -> str:
    """The structural tag (JSON text) for `tool_choice: "auto"` in format `fmt`: free text or
    calls of `functions` (name → `parameters` schema, always enforced), at most one call
    unless `parallel`; with `reasoning`, an optional leading <think>…</think> block.
    `max_whitespace` bounds whitespace runs inside arguments (None: unbounded)."""
    import xgrammar as xgr

    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in functions.items()]
    tag = xgr.get_model_structural_tag(
        fmt.xgrammar_name, tools=tools, tool_choice="auto",
        reasoning="auto" if reasoning else "disabled", max_whitespace_cnt=max_whitespace,
        parallel_tool_calls=parallel)
    return tag.model_dump_json()


@dataclass(frozen=True)
class Call:
    """A parsed tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCallParser:
    """Splits generated text into content and tool calls, fed piece by piece.

    `feed` returns what is certain so far (content strings and Calls, in order); text that
    may be the start of a call is held back until it is known. `close` flushes the rest: an
    unfinished call (the output hit its token limit) comes back as content. Feeding a text
    in any pieces gives the same sequence as feeding it whole (adjacent content merged).
    """

    def __init__(self, fmt: ToolFormat, names: frozenset[str] | set[str]):
        self.fmt, self.names = fmt, frozenset(names)
        self._buf = ""
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[str | Call]:
        self._buf += text
        return self._drain(final=False)

    def close(self) -> list[str | Call]:
        out = self._drain(final=True)
        if self._buf:
            out.append(self._buf)
            self._buf = ""
        return out

    def _drain(self, final: bool) -> list[str | Call]:
        out: list[str | Call] = []
        while self._buf:
            at = self._buf.find(self.fmt.trigger)
            if at < 0:  # keep a tail that could grow into the trigger
                keep = 0 if final else _partial_suffix(self._buf, self.fmt.trigger)
                cut = len(self._buf) - keep
                if cut:
                    out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                break
            if at:
                out.append(self._buf[:at])
                self._buf = self._buf[at:]
            parsed = self._call()
            if parsed is None:  # not complete yet
                break
            call, used = parsed
            if call is None:  # the trigger did not start a call: it is text
                out.append(self._buf[:len(self.fmt.trigger)])
                self._buf = self._buf[len(self.fmt.trigger):]
            else:
                out.append(call)
                self._buf = self._buf[used:]
        return _merge(out)

    def _call(self) -> tuple[Call | None, int] | None:
        """(call or None if the buffer's start is no call, characters used), or None while
        the buffer may still become a call."""
        buf, fmt = self._buf, self.fmt
        if len(buf) < len(fmt.open):
            return None if fmt.open.startswith(buf) else (None, 0)
        if not buf.startswith(fmt.open):
            return None, 0
        pos = _skip_ws(buf, len(fmt.open))
        if pos == len(buf):
            return None
        if buf[pos] != "{":
            return None, 0
        try:
            obj, end = self._decoder.raw_decode(buf, pos)
        except ValueError:
            return None  # an unfinished object; close() turns it into content
        name = obj.get("name") if isinstance(obj, dict) else None
        args = obj.get(fmt.args_key) if isinstance(obj, dict) else None
        if name not in self.names or not isinstance(args, dict):
            return None, 0
        if fmt.close:
            end = _skip_ws(buf, end)
            rest = buf[end:end + len(fmt.close)]
            if rest != fmt.close:
                if fmt.close.startswith(rest):
                    return None  # the closing marker is still coming
                return None, 0
            end += len(fmt.close)
        return Call(name, json.dumps(args, ensure_ascii=False)), end


def parse(fmt: ToolFormat, names, text: str) -> tuple[str, list[Call]]:
    """(content, calls) of a whole output: the text outside the calls, and the calls."""
    parser = ToolCallParser(fmt, names)
    items = parser.feed(text) + parser.close()
    return ("".join(i for i in items if isinstance(i, str)),
            [i for i in items if isinstance(i, Call)])


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _merge(items: list[str | Call]) -> list[str | Call]:
    out: list[str | Call] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += item
                continue
        out.append(item)
    return out
