"""The tokenizer's chat template, rendered with the work that is the same on every call done once.

``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True, tokenize=False)`` looks the
template up, rebuilds the special-token variables and copies every input into plain JSON types (callers may
pass rich objects) on each call: about a quarter of its time. The gateway's inputs are parsed JSON, plain
already, so ``ChatTemplate`` keeps the compiled template and the variables and renders directly. It uses
transformers' own compiler (same sandbox, filters and globals) and drops ``None`` fields as
``apply_chat_template`` does; at construction it renders probe conversations both ways, and renders through
``apply_chat_template`` itself whenever they differ or transformers lacks what it uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["ChatTemplate"]

logger = logging.getLogger(__name__)

_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}
_PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hello!"}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Weather?"}], None),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}], [_TOOL]),
]


class ChatTemplate:
    """``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)``.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str] | None = None
        try:
            from transformers.utils import chat_template_utils as utils

            self._compile = utils._compile_jinja_template
            self._alias = getattr(utils, "_alias_reasoning_fields", lambda chat: chat)
            self._variables = utils._plain_template_data(dict(tokenizer.special_tokens_map))
            self._render = self._direct
            if not all(self._direct(m, t) == self._reference(m, t) for m, t in _PROBES):
                logger.info("the chat template renders differently outside apply_chat_template: using it")
                self._render = None
        except Exception as exc:  # an older or newer transformers, or a template the probes trip: the safe path
            logger.debug("chat template: rendering through apply_chat_template (%s: %s)", type(exc).__name__, exc)
            self._render = None

    @property
    def direct(self) -> bool:
        """Whether the template is rendered directly (False: through ``apply_chat_template`` every time)."""
        return self._render is not None

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The prompt text, ending with the assistant's header.

        Args:
            messages: chat-template messages (``art_core.messages.template_messages``), plain JSON types.
            tools: JSON schemas of the tools, or None.

        Raises:
            Exception: whatever the template raises (jinja's ``TemplateError``, ``raise_exception()``...).
        """
        if self._render is None:
            return self._reference(messages, tools)
        return self._render(messages, tools)

    def _reference(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        text: str = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                       tokenize=False)
        return text

    def _direct(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        template = self._compile(self.tokenizer.get_chat_template(None, tools))  # cached by transformers
        chat = self._alias([{k: v for k, v in m.items() if v is not None} for m in messages])
        text: str = template.render(messages=chat, tools=tools, documents=None, add_generation_prompt=True,
                                    **self._variables)
        return text
