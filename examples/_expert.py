"""A scripted expert served as an OpenAI-compatible chat model on 127.0.0.1: the teacher of the examples' warm start.

A practitioner's teacher is a strong hosted model (``Teacher(model="openai/gpt-4.1")``). The examples must run
offline on a CPU, so a few lines of Python that know the task's answer stand in for that model: a *scripted expert*.
It is served over real HTTP (``POST /v1/chat/completions``, FastAPI on uvicorn in the caller's event loop, as the
gateway is), so demonstration mode talks to it exactly as it would to a hosted model, and the agent's code does not
change::

    async with ScriptedExpert(policy, name="calculator-expert") as expert:
        async with agent.demonstrations(expert.teacher) as demo:
            trajectory = await demo.rollout(task.input())

``policy(messages, tools)`` reads the conversation the agent sent (chat format) and returns the next assistant turn:
a ``ToolCall`` or a text answer. A conversation the expert cannot answer (its ``policy`` raises ``ValueError``) gets
an OpenAI-shaped 400 error quoting why, which demonstration mode reports as a ``TeacherError``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from art_core.gateway.listen import EmbeddedServer, bind, start_server
from art_plugins import Teacher

__all__ = ["Policy", "ScriptedExpert", "ToolCall", "message_text"]


@dataclass(frozen=True)
class ToolCall:
    """The expert's turn when it calls a tool: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


Policy = Callable[[list[dict[str, Any]], list[dict[str, Any]]], "ToolCall | str"]
"""``policy(messages, tools) -> ToolCall | str``: the next assistant turn for a chat-format conversation, given the
chat-format tool schemas offered (empty when none). Raises ``ValueError`` for a conversation it cannot answer."""


def message_text(message: dict[str, Any]) -> str:
    """A chat message's text, whether its ``content`` is a string or a list of content parts."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


class ScriptedExpert:
    """Serves ``policy`` as the chat model ``name`` on a free loopback port while the ``async with`` is open.

    Stands in for a strong hosted model (a scripted expert), so the examples' demonstrations need no network and
    no key.

    Args:
        policy: the next assistant turn for a conversation (see ``Policy``).
        name: the model name it answers as (and ``metadata["teacher"]`` of the demonstrations).
    """

    def __init__(self, policy: Policy, *, name: str) -> None:
        self.policy = policy
        self.name = name
        self.requests: list[dict[str, Any]] = []
        """Every request body it answered or refused, oldest first."""
        self._ids = itertools.count(1)
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._base_url: str | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` while serving."""
        if self._base_url is None:
            raise RuntimeError(f"the scripted expert {self.name!r} is not serving: use it inside `async with`")
        return self._base_url

    @property
    def teacher(self) -> Teacher:
        """The ``Teacher`` that demonstration mode asks: this server, by its model name."""
        return Teacher(model=self.name, base_url=self.base_url)

    async def __aenter__(self) -> ScriptedExpert:
        sock = bind("127.0.0.1", 0, fix="no loopback port is free")
        port = sock.getsockname()[1]
        self._server, self._task = await start_server(
            self._app(), sock, failed=lambda error: RuntimeError(f"the scripted expert did not start: {error}"))
        self._base_url = f"http://127.0.0.1:{port}/v1"
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        traceback: TracebackType | None) -> None:
        server, task, self._server, self._task, self._base_url = self._server, self._task, None, None, None
        if server is not None and task is not None:
            server.should_exit = True
            await task

    def _app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> JSONResponse:
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "the body is not JSON: send a chat completions request")
            self.requests.append(body)
            if not isinstance(body, dict):
                return _error(400, "the body must be a JSON object (a chat completions request)")
            messages, tools = body.get("messages"), body.get("tools") or []
            if not isinstance(messages, list) or not messages:
                return _error(400, "messages must be a non-empty list of chat messages")
            if body.get("stream"):
                return _error(400, "this scripted expert answers whole replies only: send stream=false")
            try:
                turn = self.policy(messages, tools)
            except ValueError as exc:
                return _error(400, f"the scripted expert {self.name!r} cannot answer this conversation: {exc}")
            return JSONResponse(self._completion(turn))

        return app

    def _completion(self, turn: ToolCall | str) -> dict[str, Any]:
        number = next(self._ids)
        if isinstance(turn, ToolCall):
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_expert_{number}", "type": "function",
                "function": {"name": turn.name, "arguments": json.dumps(turn.arguments)}}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": turn}, "stop"
        return {"id": f"chatcmpl-expert-{number}", "object": "chat.completion", "created": 0, "model": self.name,
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": None}}, status_code=status)
