"""``art-core serve``'s app on 127.0.0.1, in a thread of this process with its own event loop, for the tests that
must reach into the server while a client talks to it (hold a step, gate a route). The server is the real one
(``create_server_app`` over a ``LocalBackend``, uvicorn on its own socket); only its process is shared.

A module of its own (not conftest.py): tests import these helpers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from art_core import LocalBackend
from art_core.gateway.listen import bind, start_server
from art_core.server.app import create_server_app
from art_core.wire import gateway_path

T = TypeVar("T")


class RouteGate:
    """ASGI middleware that holds requests whose path ends with ``suffix`` until ``open()`` (thread-safe).

    ``requested`` is set when the first such request arrives, so a test knows it is being held. A held request
    goes on by itself after ``HOLD_AT_MOST`` seconds: a client that blocks its own loop while waiting (so that
    the test cannot open the gate) then fails its test instead of hanging it.
    """

    HOLD_AT_MOST = 60.0

    def __init__(self, app: Any, suffix: str) -> None:
        self.app, self.suffix = app, suffix
        self.requested = threading.Event()
        self._open = threading.Event()
        self._open.set()

    def close(self) -> None:
        self.requested.clear()
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith(self.suffix) and not self._open.is_set():
            self.requested.set()
            await asyncio.to_thread(self._open.wait, self.HOLD_AT_MOST)  # the server's loop serves on meanwhile
        await self.app(scope, receive, send)


@dataclass
class InProcessServer:
    url: str
    backend: LocalBackend
    """The server's backend (it lives on the server's loop: touch it only through ``call`` or thread-safe state)."""
    records_gate: RouteGate
    """Holds the gateways' ``.../records`` requests while closed (open by default)."""
    loop: asyncio.AbstractEventLoop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the server's loop and wait for it (from a thread that is not the server's)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


@contextmanager
def server_in_thread(path: Path, **backend_options: Any) -> Iterator[InProcessServer]:
    """Serve a fresh ``LocalBackend`` under ``path`` on a free loopback port; stop and close it afterwards.
    ``backend_options`` go to ``LocalBackend`` (as ``ServerSettings.backend_options`` do in ``art-core serve``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server-loop", daemon=True)
    thread.start()
    sock = bind("127.0.0.1", 0, fix="test")
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    backend = LocalBackend(path=path, show_progress=False, num_threads=None,
                           gateway_mount=lambda spec: url + gateway_path(spec.project, spec.name), **backend_options)
    app = create_server_app(backend, token=None, max_body_bytes=64 * 1024 * 1024)
    gate = RouteGate(app, "/records")

    async def start() -> Any:
        return await start_server(gate, sock, failed=lambda error: RuntimeError(f"test server: {error}"))

    server, task = asyncio.run_coroutine_threadsafe(start(), loop).result()
    running = InProcessServer(url, backend, gate, loop)
    try:
        yield running
    finally:
        gate.open()

        async def stop() -> None:
            server.should_exit = True
            await task
            await app.jobs.aclose()
            await backend.aclose()

        running.call(stop())
        sock.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(60)
        loop.close()
