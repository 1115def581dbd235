"""OpenAI chat messages -> what a chat template takes: the one conversion every renderer uses.

The gateway renders prompts with it, the trainer re-renders histories recorded without token ids with
it (``training/samples.py``), and ``TrainableModel.sample`` renders its prompt with it, so a conversation
gives the same prompt whichever path renders it. The rules:

- ``developer`` becomes ``system``: OpenAI's newer name for the same turn; templates know only the old one.
- Content that is a list of text parts (``{"type": "text", "text": ...}``) becomes one string, the form
  text templates expect; a list with any other part (an image) is passed on, for the template to take or
  refuse. A string, or ``None`` (an assistant turn that only calls tools), is kept as it is.
- Tool-call arguments arrive as JSON text and become dicts, the form templates render with ``tojson``;
  text that is not a JSON object is passed on verbatim.
- ``tool_call_id`` and ``name`` are kept when set; other fields (``refusal``, ``annotations``...) are dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["template_message", "template_messages"]


def template_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each message through ``template_message``.

    Args:
        messages: OpenAI chat-format messages, as dicts (``Message.model_dump()`` gives one).

    Returns:
        The messages as chat templates expect them.
    """
    return [template_message(m) for m in messages]


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One OpenAI chat message as chat templates expect it (see the module docstring for the rules).

    Args:
        message: a chat-format message with at least ``role``.

    Returns:
        A new dict; ``message`` is not changed.
    """
    role = "system" if message["role"] == "developer" else message["role"]
    out: dict[str, Any] = {"role": role, "content": _content(message.get("content"))}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            function = dict(call["function"])
            function["arguments"] = _arguments(function.get("arguments"))
            calls.append({"id": call.get("id"), "type": "function", "function": function})
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def _content(content: Any) -> Any:
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text") or "") for p in content)
    return content


def _arguments(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments
