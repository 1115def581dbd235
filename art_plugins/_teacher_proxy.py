"""The recording proxy of demonstration mode: the gateway's two completion routes, answered by a teacher.

    proxy = TeacherProxy(Teacher(model="openai/gpt-4.1"))
    await proxy.start()                       # 127.0.0.1, a free port, in the running event loop
    url = proxy.rollout_base_url("run-1")     # the adapters route the trainable model's calls here
    ...
    proxy.exchanges("run-1")                  # what the teacher was asked and answered, oldest first
    await proxy.aclose()

Served like the gateway (``/rollouts/{rollout_id}/v1/chat/completions`` and ``.../v1/responses``, in the caller's
event loop like ``LocalBackend``'s gateway), so the adapters send calls here exactly as they send them there. Each
request is checked and translated as the gateway does (``gateway.parsing``, ``gateway.responses.as_chat_request``),
asked of the teacher as a chat completion (``_teacher_call``), recorded, then answered in the API and mode the
agent used (``_teacher_wire``). A bearer token made for each proxy keeps other local processes from spending the
teacher's key.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import secrets
import threading
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any, Literal, TypeVar

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from art_core.errors import ConfigError, LifecycleError
from art_core.gateway.errors import APIError, install_error_handlers
from art_core.gateway.listen import EmbeddedServer, bind, start_server
from art_core.gateway.parsing import json_body, new_request_id, validated
from art_core.gateway.responses import as_chat_request
from art_core.gateway.schemas import ChatCompletionRequest
from art_core.wire import CALLER_HEADER, ROLLOUT_ID_PATTERN, decode_caller

from ._routing import unrouted
from ._teacher_call import TeacherCallError, TeacherReply, ask_teacher
from ._teacher_wire import chat_chunks, chat_completion, response_events, response_object
from .demonstrations import Teacher, as_teacher

__all__ = ["TeacherExchange", "TeacherProxy", "demonstrating"]

logger = logging.getLogger(__name__)

# Fields of the agent's chat request the teacher is sent (the rest are the gateway's, or per-call: n, stream...).
_FORWARDED = ("tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p", "max_tokens",
              "max_completion_tokens", "stop", "seed", "response_format")


@dataclass(frozen=True)
class TeacherExchange:
    """One call the teacher answered: what the gateway would have recorded, minus the token ids."""

    request_id: str
    rollout_id: str
    endpoint: Literal["chat.completions", "responses"]
    messages: list[dict[str, Any]]
    """The conversation sent, in chat format (a Responses request's input translated as the gateway does)."""
    tools: list[dict[str, Any]]
    """Chat-format function-tool schemas offered (empty when none, or ``tool_choice="none"``)."""
    reply: dict[str, Any]
    """The assistant message the agent was answered with."""
    finish_reason: str
    caller: str | None = None
    """The part of the agent that made the call (``X-Art-Caller``: a graph node, an agent's name)."""
    usage: dict[str, int] = field(default_factory=dict)
    """The teacher's token counts (its own tokenizer's, not the student's)."""


class TeacherProxy:
    """Serves the agent's calls for the trainable model from ``teacher``, recording each exchange by rollout.

    Args:
        teacher: who answers.
    """

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher
        self.api_key = secrets.token_urlsafe(24)
        """The bearer token the proxy wants (the adapters' routes send it)."""
        self._lock = threading.Lock()  # exchanges are read from the rollouts' threads, written by the loop
        self._exchanges: dict[str, list[TeacherExchange]] = {}
        self._failures: dict[str, list[str]] = {}
        self._failed_last: dict[str, bool] = {}  # whether the rollout's latest answered-or-failed call failed
        self._server: EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self._url: str | None = None
        self._closed = False

    async def start(self) -> None:
        """Listen on 127.0.0.1 (a free port), served from the running event loop.

        Raises:
            LifecycleError: started twice, or after ``aclose``.
        """
        if self._server is not None or self._closed:
            raise LifecycleError("a TeacherProxy starts once: open a new demonstrations() scope instead")
        self._client = httpx.AsyncClient()
        sock = bind("127.0.0.1", 0, fix="no loopback port is free")
        port = sock.getsockname()[1]
        self._server, self._task = await start_server(
            self._app(), sock, failed=lambda error: LifecycleError(f"the teacher proxy did not start: {error}"))
        self._url = f"http://127.0.0.1:{port}"

    async def aclose(self) -> None:
        """Stop serving (calls in flight are answered first) and close the connection to the teacher."""
        self._closed = True
        server, task, self._server, self._task = self._server, self._task, None, None
        if server is not None and task is not None:
            server.should_exit = True
            await task
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    def rollout_base_url(self, rollout_id: str) -> str:
        """The base URL whose calls are answered by the teacher and recorded under ``rollout_id``.

        Raises:
            ConfigError: the rollout id is invalid.
            LifecycleError: the proxy is not serving.
        """
        if not ROLLOUT_ID_PATTERN.fullmatch(rollout_id) or rollout_id in (".", ".."):
            raise ConfigError(f"rollout id {rollout_id!r} is invalid: use 1-128 letters, digits, '.', '_' or '-'")
        if self._url is None:
            raise LifecycleError("the demonstrations() scope is not open: run demonstrations inside "
                                 "`async with agent.demonstrations(teacher) as demo:`")
        return f"{self._url}/rollouts/{rollout_id}/v1"

    def exchanges(self, rollout_id: str) -> list[TeacherExchange]:
        """The rollout's answered calls, oldest first."""
        with self._lock:
            return list(self._exchanges.get(rollout_id, ()))

    def failures(self, rollout_id: str) -> list[str]:
        """Why the teacher failed the rollout's calls it could not answer (one message per call)."""
        with self._lock:
            return list(self._failures.get(rollout_id, ()))

    def last_failure(self, rollout_id: str) -> str | None:
        """Why the teacher failed the rollout's latest call, or None when that call was answered (a failure the
        agent's client retried past is no cause of what the run raised later)."""
        with self._lock:
            return self._failures[rollout_id][-1] if self._failed_last.get(rollout_id) else None

    # --- the routes ---

    def _app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        install_error_handlers(app)

        @app.post("/rollouts/{rollout_id}/v1/chat/completions")
        async def chat_completions(rollout_id: str, request: Request) -> Response:
            raw = await self._checked_body(request)
            body = validated(ChatCompletionRequest, raw)
            reply, exchange = await self._answer(rollout_id, request, "chat.completions", body, raw.get("tools"))
            if body.stream:
                usage = bool(body.stream_options and body.stream_options.include_usage)
                return StreamingResponse(chat_chunks(exchange, body.model, reply, include_usage=usage),
                                         media_type="text/event-stream")
            return JSONResponse(chat_completion(exchange, body.model, reply))

        @app.post("/rollouts/{rollout_id}/v1/responses")
        async def responses(rollout_id: str, request: Request) -> Response:
            raw = await self._checked_body(request)
            body, chat, tools = as_chat_request(raw)
            reply, exchange = await self._answer(rollout_id, request, "responses", chat, tools)
            if body.stream:
                return StreamingResponse(response_events(body, raw, exchange, reply), media_type="text/event-stream")
            return JSONResponse(response_object(body, raw, exchange, reply))

        return app

    async def _checked_body(self, request: Request) -> dict[str, Any]:
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise APIError(401, "this teacher proxy answers only the rollouts of the demonstrations() scope that "
                           "started it (wrong or missing bearer token)", code="invalid_api_key")
        return await json_body(request)

    async def _answer(self, rollout_id: str, request: Request, endpoint: Literal["chat.completions", "responses"],
                      chat: ChatCompletionRequest, tools: list[dict[str, Any]] | None
                      ) -> tuple[TeacherReply, TeacherExchange]:
        """Ask the teacher ``chat``, record the exchange under ``rollout_id``; a failure is recorded, then answered
        as an error naming the teacher."""
        if (chat.n or 1) > 1:
            raise APIError(400, f"n is {chat.n}: demonstration mode records one reply per call; ask for n=1",
                           param="n", code="unsupported_value")
        offered = bool(chat.tools) and chat.tool_choice != "none"  # as the gateway records them
        messages = [m.model_dump(exclude_none=True) for m in chat.messages]
        dumped = chat.model_dump(mode="json", exclude_none=True, by_alias=True)
        sent = {"messages": messages, **{k: dumped[k] for k in _FORWARDED if k in dumped}}
        if tools:
            sent["tools"] = tools
        else:  # OpenAI refuses these without tools, and they mean nothing then
            sent = {k: v for k, v in sent.items() if k not in ("tools", "tool_choice", "parallel_tool_calls")}
        assert self._client is not None  # the routes run only while started
        try:
            with unrouted():  # the teacher's call is not the agent's: never redirect it, even to ourselves
                reply = await ask_teacher(self.teacher, sent, self._client)
        except TeacherCallError as exc:
            with self._lock:
                self._failures.setdefault(rollout_id, []).append(str(exc))
                self._failed_last[rollout_id] = True
            logger.warning("rollout %s: %s", rollout_id, exc)
            raise APIError(exc.status_code, str(exc), type="teacher_error", code="teacher_error") from exc
        caller = request.headers.get(CALLER_HEADER)
        exchange = TeacherExchange(
            request_id=new_request_id("chatcmpl-" if endpoint == "chat.completions" else "resp_"),
            rollout_id=rollout_id, endpoint=endpoint, messages=messages, tools=list(tools or []) if offered else [],
            reply=reply.message, finish_reason=reply.finish_reason, caller=decode_caller(caller) if caller else None,
            usage=reply.usage)
        with self._lock:  # recorded before the answer goes out: "answered" means "recorded", as at the gateway
            self._exchanges.setdefault(rollout_id, []).append(exchange)
            self._failed_last[rollout_id] = False
        return reply, exchange


A = TypeVar("A")


def demonstrating(adapter: A, teacher: Teacher | str) -> contextlib.AbstractAsyncContextManager[A]:
    """A copy of ``adapter`` (a ``TrainableGraph`` or ``TrainableRunner``) whose rollouts the teacher answers,
    through a proxy that serves while the ``async with`` is open (what both adapters' ``demonstrations`` return).

    Raises:
        ConfigError: ``teacher`` is not a ``Teacher`` or a model string (at once, not on entering).
    """
    return _demonstrating(adapter, as_teacher(teacher))


@contextlib.asynccontextmanager
async def _demonstrating(adapter: A, teacher: Teacher) -> AsyncIterator[A]:
    proxy = TeacherProxy(teacher)
    await proxy.start()
    try:
        demo = copy.copy(adapter)
        demo._teacher = proxy  # type: ignore[attr-defined]  # both adapters pass it to their scopes
        yield demo
    finally:
        await proxy.aclose()
