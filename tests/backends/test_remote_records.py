"""With ``RemoteBackend``, reading a rollout's records never blocks the event loop the rollouts run on.

The server holds its records route (``RouteGate``) until the test opens it: a blocking read would stop this
loop for as long as it is held (the watchdog could not tick, and the test could not open the gate: it would
hang). The loop must keep running while the records are held: the watchdog's ticks go on. Its largest pause is
printed, not asserted: on a loaded machine the scheduler alone can pause a loop for tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
from inprocess_server import InProcessServer, server_in_thread

from art_core import TrainableModel
from art_core.backends.remote import RemoteBackend
from art_plugins._rollout import RolloutScope


class LoopWatchdog:
    """Ticks on the loop every millisecond or so, and keeps the largest gap between two ticks."""

    def __init__(self) -> None:
        self.ticks = 0
        self.max_gap = 0.0
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.max_gap, last = max(self.max_gap, now - last), now
            self.ticks += 1

    def stop(self) -> None:
        self._task.cancel()


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def _held_read(server: InProcessServer, read: Callable[[], Awaitable[Any]]) -> tuple[Any, LoopWatchdog]:
    """``read()`` while the server holds its records route: the loop must tick on meanwhile. Returns its result."""
    server.records_gate.close()
    watchdog = LoopWatchdog()
    reading = asyncio.create_task(read())
    assert await asyncio.to_thread(server.records_gate.requested.wait, 300), "the read never reached the server"
    ticks = watchdog.ticks
    await _until(lambda: watchdog.ticks >= ticks + 20)  # the loop runs on while the records are held
    assert not reading.done()
    server.records_gate.open()
    result = await reading
    watchdog.stop()
    return result, watchdog


async def test_records_are_read_without_blocking_the_loop(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = TrainableModel(name="lag", base_model=tiny_model_dir)
    with server_in_thread(tmp_path) as server:
        async with RemoteBackend(server.url, show_progress=False) as backend:
            await model.register(backend)
            async with openai.AsyncOpenAI(base_url=model.rollout_base_url("r-1"), api_key="unused") as client:
                reply = await client.chat.completions.create(model="lag", messages=[{"role": "user", "content": "hi"}],
                                                             max_tokens=3)
            records, watchdog = await _held_read(server, lambda: model.fetch_rollout_records("r-1"))
            print(f"largest loop pause while a records read was held: {watchdog.max_gap * 1e3:.1f} ms")
            assert [r.request_id for r in records] == [reply.id]

            # What the adapters do after a run: settle, then build the trajectory from the records.
            scope = RolloutScope(model, framework="langgraph", rollout_id="r-1")

            async def settle_and_build() -> Any:
                await scope.settle()
                return await scope.fetch_trajectory()

            trajectory, watchdog = await _held_read(server, settle_and_build)
            print(f"largest loop pause while settle/fetch_trajectory were held: {watchdog.max_gap * 1e3:.1f} ms")
            assert len(trajectory.calls) == 1 and trajectory.calls[0].completion_token_ids
