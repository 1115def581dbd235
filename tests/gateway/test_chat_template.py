"""ChatTemplate renders exactly what apply_chat_template renders, on SmolLM2's tool template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from art_core.gateway.chat_template import ChatTemplate
from art_core.messages import template_messages

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}]
CALL = {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": 1, "b": 2.5})}}

CONVERSATIONS: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = [
    ([{"role": "user", "content": "Hi!"}], None),
    ([{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello 🙂 <|im_end|>"}], None),
    ([{"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]}], None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], TOOLS),
    ([{"role": "user", "content": "1 + 2.5?"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "content": "3.5", "tool_call_id": "call_9"}, {"role": "assistant", "content": "3.5"},
      {"role": "user", "content": "  and  \n\n spaces\t"}], TOOLS),
    ([{"role": "assistant", "content": ""}, {"role": "user", "content": "empty before me", "name": "bob"}], None),
]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_renders_what_apply_chat_template_renders(tokenizer: Any, index: int):
    template = ChatTemplate(tokenizer)
    assert template.direct  # SmolLM2's template is rendered directly, so this compares the fast path
    messages, tools = CONVERSATIONS[index]
    converted = template_messages(messages)
    expected = tokenizer.apply_chat_template(converted, tools=tools, add_generation_prompt=True, tokenize=False)
    assert template.render(converted, tools) == expected


def test_a_refused_conversation_raises_as_apply_chat_template_does(tokenizer: Any):
    template = ChatTemplate(tokenizer)
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([], None)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    try:
        expected: Any = tokenizer.apply_chat_template(bad, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - whatever the template does, ours must do the same
        expected = type(exc)
    if isinstance(expected, str):
        assert template.render(bad, None) == expected
    else:
        with pytest.raises(expected):
            template.render(bad, None)


def test_a_template_that_differs_falls_back(tokenizer: Any, monkeypatch: pytest.MonkeyPatch):
    # Stands in for a transformers release whose apply_chat_template renders differently from the direct path
    # (a new rule, say), which cannot be installed here: the probes catch it and every call goes through it.
    real = ChatTemplate._direct
    monkeypatch.setattr(ChatTemplate, "_direct", lambda self, m, t: real(self, m, t) + "<extra>")
    template = ChatTemplate(tokenizer)
    assert not template.direct
    messages = template_messages([{"role": "user", "content": "Hi!"}])
    assert template.render(messages, None) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)
