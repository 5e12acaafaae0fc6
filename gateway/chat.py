"""Chat messages to prompt ids through the checkpoint's own chat template.

Rendering is transformers' `apply_chat_template` (grammar_service.vocab.Vocab): its sandboxed
jinja environment with `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII
text, the template from tokenizer_config.json or chat_template.jinja, and tools passed to the
template. What stays here is the gateway's part: the request's fields in, a refusal out as
INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import jinja2

from grammar_service.vocab import Vocab
from protos import gateway_pb2
from protos.rpc import InvalidArgument

# What a template raises when the messages do not fit it (a role it does not know, content
# of the wrong type, tools without a user message): the request's fault, never the server's.
_REFUSALS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def parse_tools(tools_json: str) -> list[dict[str, Any]] | None:
    """The tool definitions of a GenerateRequest (None when empty). Raises InvalidArgument
    (field tools_json) unless it is a JSON array of objects."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"not valid JSON: {exc}", field="tools_json") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidArgument("must be a JSON array of objects", field="tools_json")
    return tools


def chat_prompt_ids(vocab: Vocab, messages: Sequence[gateway_pb2.ChatMessage],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt ids of `messages` (and `tools`) rendered by the model's chat template with the
    generation prompt appended, equal to transformers' `apply_chat_template`.

    Raises InvalidArgument(field="messages") when the model has no chat template or the
    template refuses the messages.
    """
    if vocab.chat_template is None:
        raise InvalidArgument("the model has no chat template; send `prompt` instead",
                              field="messages")
    try:
        return vocab.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages], tools)
    except _REFUSALS as exc:
        raise InvalidArgument(f"the model's chat template refused them: {exc}",
                              field="messages") from exc
