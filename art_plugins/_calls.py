"""What the gateway's answer to a routed call says (a ``RoutedCall``), and when a streamed answer's body ends.

The gateway answers every completion with ``X-Request-Id``, ``X-Art-Adapter-Step``, ``X-Art-Prompt-Tokens`` and,
when it knows it before the body, ``X-Art-Completion-Tokens`` (``art_core.wire``). A live stream's headers
leave before any token is sampled, so its completion count is read from the gateway's record of the call once
its body has been read: the body's byte stream (httpx's or httpx2's, sync or async) is wrapped in place to say
when it has ended or was closed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from art_core.wire import ADAPTER_STEP_HEADER, COMPLETION_TOKENS_HEADER, PROMPT_TOKENS_HEADER, REQUEST_ID_HEADER

from ._tracing import RoutedCall

__all__ = ["on_body_end", "routed_call"]


def routed_call(response: Any, count_completion: Callable[[RoutedCall], None]) -> RoutedCall | None:
    """The gateway's facts about the call ``response`` answers (None: not a completion the gateway recorded).

    Args:
        response: the httpx (or httpx2) response to a routed call; its body may not have been read yet.
        count_completion: ``count_completion(call)`` has a streamed call's completion tokens read from the
            gateway's record of it, then calls ``call.complete(count)`` (at once, or later from a task of the
            loop when the record is fetched over HTTP); called once, when the body has ended.
    """
    headers = response.headers
    step = headers.get(ADAPTER_STEP_HEADER)
    if step is None:
        return None
    completion = headers.get(COMPLETION_TOKENS_HEADER)
    call = RoutedCall(request_id=headers.get(REQUEST_ID_HEADER), adapter_step=int(step),
                      prompt_tokens=int(headers.get(PROMPT_TOKENS_HEADER, 0)),
                      completion_tokens=None if completion is None else int(completion))
    if completion is None:
        def counted() -> None:
            count_completion(call)

        if not on_body_end(response, counted):
            counted()  # the body was read already: the gateway recorded the call before its last chunk
    return call


def on_body_end(response: Any, done: Callable[[], None]) -> bool:
    """Call ``done()`` once, when ``response``'s body has been read to its end or closed.

    Returns:
        False when the body was read already (nothing is left to wait for) or its stream is of no known kind.
    """
    if getattr(response, "is_stream_consumed", False) or getattr(response, "is_closed", False):
        return False
    inner = response.stream
    base = next((b for b in type(inner).__mro__ if b.__name__ in ("AsyncByteStream", "SyncByteStream")), None)
    if base is None:
        return False
    response.stream = _body_end_stream(base)(inner, done)
    return True


@functools.cache
def _body_end_stream(base: type) -> type:
    """A subclass of ``base`` (a sync or async byte stream) that passes ``inner`` through and calls ``done`` once
    at its end or close. A subclass, because the clients check ``isinstance(response.stream, ...)``."""
    def fire(self: Any) -> None:
        done, self._done = self._done, None
        if done is not None:
            done()

    def init(self: Any, inner: Any, done: Callable[[], None]) -> None:
        self._inner, self._done = inner, done

    if base.__name__ == "AsyncByteStream":
        async def aiter(self: Any) -> Any:
            async for chunk in self._inner:
                yield chunk
            fire(self)

        async def aclose(self: Any) -> None:
            try:
                await self._inner.aclose()
            finally:
                fire(self)
        return type("BodyEndStream", (base,), {"__init__": init, "__aiter__": aiter, "aclose": aclose})

    def sync_iter(self: Any) -> Any:
        yield from self._inner
        fire(self)

    def close(self: Any) -> None:
        try:
            self._inner.close()
        finally:
            fire(self)
    return type("BodyEndStream", (base,), {"__init__": init, "__iter__": sync_iter, "close": close})
