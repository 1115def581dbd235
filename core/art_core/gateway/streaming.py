"""Server-sent events as they happen, and noticing a client that went away.

``open_stream`` waits for a completion's first event (so a request the engine refuses still gets a plain
HTTP error), then answers with an ``EventStream``: each chunk is sent as soon as the route renders it from
the pipeline's events, while the client's channel is watched. When the client disconnects, the pipeline
is cancelled at once: its engine rows stop at the next step and its record says ``cancelled``.
``until_done`` does the same for a route that answers with one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from .errors import APIError, error_body

__all__ = ["ClientGone", "EventStream", "open_stream", "sse", "until_done"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E")


class ClientGone(Exception):
    """The client disconnected before its answer was ready (the work was cancelled)."""


def sse(data: dict[str, Any] | str, *, event: str | None = None) -> bytes:
    """One server-sent event: an optional ``event:`` line, then ``data:`` with ``data`` as compact JSON."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {text}\n\n".encode()


async def until_done(request: Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled as soon as the client disconnects.

    The work runs in the caller's task and only the watcher gets a task of its own: on the hot path of
    every non-streamed call, a second task and ``asyncio.wait`` cost about a tenth of the gateway's time.
    The watcher starts once the work first yields to the event loop: work that finishes without waiting
    (an answer ready at once, a refused request) had no moment at which a disconnect could cut it short,
    and creating, starting and cancelling a task for it cost about as much as the rest of the call's
    event-loop hops (benchmark part (c)).

    Raises:
        ClientGone: the client went away first (``work`` was cancelled and has finished cleaning up).
    """
    caller = asyncio.current_task()
    assert caller is not None  # a route always runs in a task
    left = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal left
        await _disconnected(request.receive)
        left = True
        caller.cancel()

    def start_watching() -> None:
        # Runs on the loop's next turn, i.e. only once the work has yielded to it.
        nonlocal watcher
        watcher = asyncio.ensure_future(watch())

    starting = asyncio.get_running_loop().call_soon(start_watching)
    try:
        result = await work
    except asyncio.CancelledError:
        # Ours only when the watcher cancelled and nobody else did too (the server shutting down, say).
        if left and caller.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        starting.cancel()
        if watcher is not None:
            watcher.cancel()
    if left:  # the client left as the work finished: take the cancellation back, the answer is ready
        caller.uncancel()
    return result


async def open_stream(request: Request, events: AsyncIterator[E],
                      render: Callable[[AsyncIterator[E]], AsyncIterator[bytes]],
                      headers: Callable[[], dict[str, str]] | None = None) -> EventStream:
    """An ``EventStream`` of ``render(events)``, once the first event has come.

    ``headers()`` is called then too: after admission, so what it reads (the adapter step) is what serves.

    Raises:
        ClientGone: the client went away before the first event.
        APIError: the pipeline refused the request before its first event (sent as a plain error response).
    """
    async def first_event() -> E:
        return await anext(events)

    first = await until_done(request, first_event())

    async def all_events() -> AsyncIterator[E]:
        yield first
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for event in events:
                yield event

    source = all_events()
    return EventStream(render(source), source=source, headers=headers() if headers else None)


class EventStream(StreamingResponse):
    """``text/event-stream`` whose chunks go out as they are made; a client disconnect cancels their maker.

    Starlette's ``StreamingResponse`` notices a disconnect only when a send fails; this one watches the
    channel, so a silent wait (a long tool-call block being held back) is cut as soon as the client leaves.
    An ``APIError`` raised mid-stream is sent as OpenAI's ``{"error": {...}}`` event, then the stream ends.
    """

    def __init__(self, chunks: AsyncIterator[bytes], *, source: AsyncIterator[Any] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        """``chunks``: the SSE body; ``source``: what it is rendered from, closed with it (a closed generator
        does not close the one it was reading, and the source's clean-up records a cut completion)."""
        super().__init__(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **(headers or {})})
        self.source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def pump() -> None:
            chunks = self.body_iterator
            try:
                async with contextlib.aclosing(chunks):  # type: ignore[type-var]
                    async for chunk in chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except APIError as exc:
                logger.warning("stream ended by an error: %s", exc.message)
                await send({"type": "http.response.body", "more_body": True, "body": sse(
                    error_body(exc.message, type=exc.type, param=exc.param, code=exc.code))})
            finally:
                if self.source is not None:
                    await self.source.aclose()  # type: ignore[attr-defined]
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = await _run_while_connected(receive, pump())
        if not task.cancelled() and task.exception() is not None:  # the client is gone, or the route failed
            logger.warning("stream stopped: %s: %s", type(task.exception()).__name__, task.exception())


async def _run_while_connected(receive: Receive, work: Awaitable[T]) -> asyncio.Future[T]:
    """Run ``work`` until it ends, or until the client disconnects (then it is cancelled and waited for).

    Returns:
        Its finished task: cancelled when the client left first.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return task


async def _disconnected(receive: Receive) -> None:
    # The request body has been read, so the next message on the channel is the client's disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
