"""The engine's health as the gateway last heard it, refreshed in the background.

    monitor = EngineHealth(engine)        # Gateway does this; create_app takes it
    await monitor.start()                 # first report in hand (or the first check timed out)
    report, age = monitor.report()        # GET /health and /metrics: no call to the engine
    await monitor.aclose()

Monitoring and load balancers poll ``/health`` exactly when the server is saturated. Asking the engine on each
poll makes the route as slow as the engine's own check: a vLLM server busy decoding a full batch answers its
``/health`` late, and the gateway's route with it (seen: past a client's 5 s timeout). So one background task
asks the engine every ``interval`` seconds, each time with its own ``timeout``, and the routes answer at once
from the last report and its age. While the engine's check hangs, the age grows: that is the liveness figure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from ..engines.base import Engine

__all__ = ["EngineHealth"]

logger = logging.getLogger(__name__)


class EngineHealth:
    """Polls ``engine.health()`` in a task of its own and keeps the last report.

    Args:
        engine: the engine to watch.
        interval: seconds between checks. Default: 1.0 (a report is at most about this old while the engine
            answers).
        timeout: seconds one check may take before it counts as failed. Default: 10.0 (above the vLLM
            engine's own 5 s probe, so its answer is the one reported).
    """

    def __init__(self, engine: Engine, *, interval: float = 1.0, timeout: float = 10.0) -> None:
        self._engine = engine
        self.interval, self.timeout = interval, timeout
        self._report: dict[str, Any] | None = None
        self._at = 0.0  # time.monotonic() of the last check that answered
        self._error: str | None = None  # why the last check failed (None: it answered)
        self._first = asyncio.Event()  # set once the first check has ended, answered or not
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    def report(self) -> tuple[dict[str, Any], float | None]:
        """The last report and its age in seconds (None before any check answered).

        When the last check failed or timed out, the report is the last one that answered (or empty), plus
        ``health_error`` saying why. Starts the background task if it is not running (a gateway served by a
        host application has no ``start`` of its own).
        """
        self.ensure_running()
        report = dict(self._report) if self._report is not None else {}
        if self._error is not None:
            report["health_error"] = self._error
        return report, (time.monotonic() - self._at) if self._report is not None else None

    async def first_report(self) -> tuple[dict[str, Any], float | None]:
        """``report()``, after waiting for the first check to end (answered, failed or timed out) if it has not.

        Only the first requests to a gateway that never ran ``start()`` wait here (at most ``timeout``); every
        later one answers at once.
        """
        self.ensure_running()
        await self._first.wait()  # the check itself is bounded by ``timeout``; aclose() sets it too
        return self.report()

    async def start(self) -> None:
        """Start the background checks and wait for the first one to end (at most ``timeout``)."""
        await self.first_report()

    def ensure_running(self) -> None:
        if self._closed or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="art-gateway-health")

    async def aclose(self) -> None:
        """Stop the checks (closing twice is allowed)."""
        self._closed = True
        self._first.set()  # nobody waits for a first check that will not come
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _poll(self) -> None:
        while not self._closed:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11, wait_for swallows a cancellation that arrives as
                # the check finishes, and aclose() then waited forever for a task that went on polling.
                async with asyncio.timeout(self.timeout):
                    report = await self._engine.health()
                self._report = dict(report)
                self._at, self._error = time.monotonic(), None
            except asyncio.TimeoutError:
                self._error = f"engine.health() did not answer within {self.timeout:g} s"
            except Exception as exc:  # reported at /health, and logged: the next check may succeed
                self._error = f"engine.health() failed: {exc!r}"
                logger.warning("the gateway's engine health check failed: %r", exc)
            self._first.set()
            await asyncio.sleep(self.interval)
