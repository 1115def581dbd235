"""How the Langfuse layer keeps Langfuse from holding up or failing training: bounded waits, counted failures.

Spans and scores leave in the SDK's background threads. What the layer itself waits for (a flush, the project
id for trace URLs, a dataset) runs in a daemon thread and is waited for at most a timeout (``bounded``); the
errors the SDK and the OpenTelemetry exporter log are counted (``FailureCounter``) and reported once per step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FAILURE_LOGGERS", "FailureCounter", "bounded", "failure_handlers", "plain"]

FAILURE_LOGGERS = ("langfuse", "opentelemetry.exporter", "opentelemetry.sdk.trace.export")
"""The loggers whose errors mean a span or a score was not delivered."""


async def bounded(fn: Callable[[], Any], timeout: float, *,
                  keep: Callable[[asyncio.Future[Any]], None] | None = None) -> tuple[bool, Any]:
    """``fn()`` in a daemon thread, waited for at most ``timeout`` s: ``(finished, result)``.

    A daemon thread, not the loop's executor: a call stuck on the network must not hold up the event loop,
    the step, or the interpreter's exit. Its exception, if it finished with one, is raised.

    Args:
        keep: given the future of the call, to see later whether a call given up on has finished.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (fn(), None)
        except BaseException as exc:
            outcome = (None, exc)
        try:
            loop.call_soon_threadsafe(_settle, future, *outcome)
        except RuntimeError:  # the loop closed meanwhile: nobody waits for this any more
            pass

    # Given up on, the call may still end with an error later: retrieve it, so asyncio does not log it as lost.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())
    thread = threading.Thread(target=run, name="art-langfuse", daemon=True)
    thread.start()
    if keep is not None:
        keep(future)
    try:
        async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it can swallow the caller's cancellation
            return True, await asyncio.shield(future)
    except TimeoutError:
        return False, None


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def plain(value: Any) -> Any:
    """JSON-friendly (tuples to lists, pydantic models dumped, the rest as text)."""
    try:
        return json.loads(json.dumps(value, default=lambda v: v.model_dump() if hasattr(v, "model_dump") else str(v)))
    except (TypeError, ValueError):
        return str(value)


class FailureCounter(logging.Handler):
    """Counts the errors the Langfuse SDK and the OpenTelemetry exporter log (failed exports, dropped scores),
    and the layer's own failures (``note``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        self.note(message)

    def note(self, message: str) -> None:
        self.count += 1
        self.last = message[:300]


class _Handlers:
    """Keeps failure counters on the SDK's loggers while their ``LangfuseTracing`` is open (logging is global)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()

    def acquire(self, handler: logging.Handler) -> None:
        with self._lock:
            for name in FAILURE_LOGGERS:
                logging.getLogger(name).addHandler(handler)

    def release(self, handler: logging.Handler) -> None:
        with self._lock:
            for name in FAILURE_LOGGERS:
                logging.getLogger(name).removeHandler(handler)


failure_handlers = _Handlers()
