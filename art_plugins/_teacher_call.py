"""One chat completion from the teacher: over HTTP to an OpenAI-compatible server, or through litellm.

Both give a ``TeacherReply``: the assistant message normalised to the shape the gateway records (``role``,
``content``, ``tool_calls`` with ids), the finish reason and the token usage. Every failure becomes a
``TeacherError`` naming the teacher, with the status to answer the agent with and the teacher's own message.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from .demonstrations import Teacher, TeacherError

__all__ = ["TeacherCallError", "TeacherReply", "ask_teacher"]


class TeacherCallError(TeacherError):
    """A failed call, with the HTTP status the proxy answers the agent with (the teacher's, or 502)."""

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class TeacherReply:
    message: dict[str, Any]
    """``{"role": "assistant", "content": ..., "tool_calls": [...]}`` (``tool_calls`` only when it made any)."""
    finish_reason: str
    usage: dict[str, int] = field(default_factory=dict)
    """``prompt_tokens``, ``completion_tokens``, ``total_tokens`` as the teacher counted them (its tokenizer)."""


async def ask_teacher(teacher: Teacher, body: dict[str, Any], client: httpx.AsyncClient) -> TeacherReply:
    """The teacher's answer to ``body`` (a chat completions request without ``model``; not streamed).

    Raises:
        TeacherCallError: unreachable, timed out, an error status, or an answer that is not a chat completion.
    """
    request = {**_without_aliases_of(body, teacher.params), **teacher.params, "model": teacher.model}
    if teacher.base_url is None:
        return await _ask_litellm(teacher, request)
    url = teacher.base_url.rstrip("/") + "/chat/completions"
    headers = {"authorization": f"Bearer {teacher.api_key}"} if teacher.api_key else {}
    try:
        response = await client.post(url, json=request, headers=headers, timeout=teacher.timeout)
    except httpx.TimeoutException as exc:
        raise TeacherCallError(f"teacher {teacher.label} did not answer within Teacher(timeout={teacher.timeout:g}) "
                               f"seconds ({type(exc).__name__}): raise timeout= for a slow teacher or long answers",
                               504) from exc
    except httpx.HTTPError as exc:
        raise TeacherCallError(f"teacher {teacher.label} is unreachable: {type(exc).__name__}: {exc or 'no detail'}; "
                               "check base_url and that the server is up", 502) from exc
    if response.status_code >= 400:
        raise TeacherCallError(f"teacher {teacher.label} answered {response.status_code}: "
                               f"{_error_message(response)}", response.status_code)
    try:
        data = response.json()
        choice = data["choices"][0]
        return _reply(choice["message"], choice.get("finish_reason"), data.get("usage"))
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise TeacherCallError(f"teacher {teacher.label} answered with something that is not a chat completion "
                               f"({type(exc).__name__}: {exc}): {response.text[:300]!r}", 502) from exc


_ALIASES = ({"max_tokens", "max_completion_tokens"},)
"""Request fields that name one setting: the agent's client sends one (OpenAI's clients now send
``max_completion_tokens``), ``Teacher(params=...)`` may set the other."""


def _without_aliases_of(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``body`` without the fields that ``params`` overrides under another name, so that the teacher's setting is the
    one sent (a server reading ``max_completion_tokens`` first would otherwise keep the agent's)."""
    dropped = {name for names in _ALIASES if names & params.keys() for name in names - params.keys()}
    return {key: value for key, value in body.items() if key not in dropped}


async def _ask_litellm(teacher: Teacher, request: dict[str, Any]) -> TeacherReply:
    try:
        import litellm
    except ImportError as exc:
        raise TeacherCallError(f"teacher {teacher.label!r} is a litellm model string, and litellm is not installed: "
                               "pip install litellm, or give the teacher a base_url", 500) from exc
    try:
        response = await litellm.acompletion(**request, api_key=teacher.api_key, timeout=teacher.timeout)
    except Exception as exc:  # litellm maps every provider's errors to its own types; all end the same way
        status = getattr(exc, "status_code", None)
        status = status if isinstance(status, int) and 400 <= status < 600 else 502
        raise TeacherCallError(f"teacher {teacher.label} failed: {type(exc).__name__}: {exc}", status) from exc
    choice = response.choices[0]
    usage = getattr(response, "usage", None)
    return _reply(choice.message.model_dump(), choice.finish_reason,
                  usage.model_dump() if usage is not None else None)


def _reply(message: dict[str, Any], finish_reason: Any, usage: Any) -> TeacherReply:
    """The assistant message as the gateway records a reply: text (None only beside tool calls), calls with ids."""
    calls = [{"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": call["function"]["name"],
                           "arguments": _arguments(call["function"].get("arguments"))}}
             for call in message.get("tool_calls") or []]
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    reply: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        reply["tool_calls"] = calls
    if reply["content"] is None and not calls:
        reply["content"] = ""
    counts = {k: int(v) for k, v in (usage or {}).items()
              if k in ("prompt_tokens", "completion_tokens", "total_tokens") and isinstance(v, int)}
    return TeacherReply(reply, str(finish_reason or ("tool_calls" if calls else "stop")), counts)


def _arguments(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments or {})


def _error_message(response: httpx.Response) -> str:
    """The teacher's own error message (OpenAI's ``{"error": {"message"}}``), else the start of its body."""
    try:
        error = response.json().get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
    except (ValueError, AttributeError):
        pass
    return response.text[:500] or "(empty body)"
