"""The training handshake: hold requests while a GRPO step runs, then check the new adapter is served.

    await control.pause_for_training()       # new requests wait (they do not fail); in-flight ones finish
    ... train, write checkpoint 0007 ...
    await control.resume_after_training(7, adapter_path=ckpt)   # load (optional), check, let requests go

If, after resuming, the engine serves another step than the one just trained, ``resume_after_training``
raises ``CheckpointError`` naming both steps and the gateway **stays paused**: held requests keep waiting
rather than being sampled by the wrong adapter (their records would be off-policy for the step the trainer
expects). Load the right adapter and call ``resume_after_training`` again to release them. A gateway that
closes while requests are held answers them with 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Literal

from ..engines.base import Engine
from ..errors import CheckpointError, LifecycleError
from ..wire import RolloutStatus
from .errors import APIError

__all__ = ["GatewayControl"]


class GatewayControl:
    """Admits requests to the engine, and pauses and resumes them around a training step.

    Args:
        engine: the engine the gateway serves.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._open = asyncio.Event()  # set: requests go to the engine; clear: they wait
        self._open.set()
        self._idle = asyncio.Event()  # set when no request is inside the engine
        self._idle.set()
        self._in_flight = 0
        self._unanswered: Counter[str] = Counter()  # rollout id -> its requests received and not yet answered
        self._state: Literal["serving", "paused", "closed"] = "serving"

    @property
    def state(self) -> Literal["serving", "paused", "closed"]:
        return self._state

    @property
    def in_flight(self) -> int:
        """Requests being generated now."""
        return self._in_flight

    def rollout_status(self, rollout_id: str) -> RolloutStatus:
        """The rollout's requests received and not answered yet (held while paused, sampled, or being recorded),
        and the gateway's state."""
        return RolloutStatus(unanswered=self._unanswered[rollout_id], gateway=self._state)

    @contextmanager
    def answering(self, rollout_id: str | None) -> Iterator[None]:
        """Count a request of ``rollout_id`` as unanswered while inside (from its parsed body to its records)."""
        if rollout_id is None:
            yield
            return
        self._unanswered[rollout_id] += 1
        try:
            yield
        finally:
            self._unanswered[rollout_id] -= 1
            if not self._unanswered[rollout_id]:
                del self._unanswered[rollout_id]

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[float]:
        """Hold the caller while paused, then count it in flight. Yields the seconds it waited.

        Raises:
            APIError: 503 when the gateway closed.
        """
        start = time.perf_counter()
        # Re-check after every wake-up: pause_for_training may have cleared the event again in between.
        while not self._open.is_set():
            await self._open.wait()
        if self._state == "closed":
            raise APIError(503, "the gateway is shutting down: retry against the new gateway", code="gateway_closed")
        self._in_flight += 1
        self._idle.clear()
        try:
            yield time.perf_counter() - start
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def pause_for_training(self) -> None:
        """Stop admitting requests, wait for in-flight ones to finish, then pause the engine.

        Raises:
            LifecycleError: already paused, or closed.
        """
        if self._state != "serving":
            raise LifecycleError(
                f"pause_for_training() called while the gateway is {self._state}: pause once, then "
                "call resume_after_training(step)"
            )
        self._state = "paused"
        self._open.clear()
        while self._in_flight:
            await self._idle.wait()
        await self._engine.pause()

    async def resume_after_training(self, expected_step: int, *, adapter_path: Path | None = None) -> None:
        """Resume the engine, optionally load an adapter, check its step, then release held requests.

        Args:
            expected_step: the checkpoint step the engine must serve from now on.
            adapter_path: a PEFT adapter folder to load as ``expected_step`` first; None when the engine
                already has it (e.g. the transformers engine shares the trainer's model). Default: None.

        Raises:
            LifecycleError: the gateway is not paused.
            CheckpointError: the engine serves another step; requests stay held (see the module docstring).
        """
        if self._state != "paused":
            raise LifecycleError(
                f"resume_after_training() called while the gateway is {self._state}: call pause_for_training() first"
            )
        await self._engine.resume()
        if adapter_path is not None:
            await self._engine.load_adapter(Path(adapter_path), expected_step)
        served = self._engine.adapter_step
        if served != expected_step:
            raise CheckpointError(
                f"engine serves adapter {served}, expected {expected_step}: checkpoint {expected_step:04d} was not "
                "loaded; requests stay held until resume_after_training() sees the right step"
            )
        self._state = "serving"
        self._open.set()

    def close(self) -> None:
        """Refuse new requests and wake held ones so they are answered 503."""
        self._state = "closed"
        self._open.set()
