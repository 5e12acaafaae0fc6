"""Chat messages rendered with the checkpoint's own chat template (jinja2, sandboxed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protos.rpc import InvalidArgument


def _raise_exception(message: str) -> None:
    # Templates call raise_exception("...") to refuse a conversation (e.g. bad role order).
    raise jinja2.TemplateError(message)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template with the special tokens it refers to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        # A frozen dataclass: bypass __setattr__ once, for the compiled template.
        object.__setattr__(self, "_template", env.from_string(self.source))

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        """Render (role, content) pairs with the generation prompt appended.

        Raises InvalidArgument(field="messages") when the template refuses the messages.
        """
        try:
            return self._template.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"the model's chat template refused them: {exc}",
                                  field="messages") from exc
